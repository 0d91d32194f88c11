"""``Queue``: every operation on the jobs table. The SQL itself lives in ``sql/queries.sql``."""

from __future__ import annotations

import collections
import contextlib
import datetime as dt
import itertools
import json
import logging
import os
import random
import re
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

import psycopg
from psycopg import sql
from psycopg.rows import dict_row, tuple_row

from . import db
from .attempt_totals import DURATION_BUCKETS, bucket_params
from .graphs import Labels
from .job import (
    MAX_PAYLOAD_BYTES,
    MAX_RELEASES,
    Claim,
    Job,
    Outcome,
    Run,
    Status,
    claim_of,
    encode_payload,
    validate_kind,
    validate_queue_name,
)
from .outcomes import MAX_SNOOZES
from .periodic import Schedule
from .retry import MAX_ERROR_CHARS

log = logging.getLogger("fleetless.queue")

if TYPE_CHECKING:
    from psycopg_pool import ConnectionPool  # imported by the app that passes one, not here

    from .kinds import KindSettings

__all__ = ["DuplicateJob", "Enqueued", "Finished", "JobNotFound", "Queue", "QueueSettings", "WaitTimeout"]

#: ``result`` keeps at most this much of the handler's stdout.
MAX_RESULT_CHARS = 64 * 1024
#: enqueue_many reads, checks and copies this many jobs at a time.
ENQUEUE_CHUNK = 5000
#: Ends a ``result`` of which only the head was kept, so no reader takes it for the whole output.
RESULT_CUT_MARKER = "\n[fleetless: output cut here; only the first 64 KiB of stdout are kept]\n"
#: The most attempts a job can have (the table's CHECK); an operator retry cannot go past it.
MAX_ATTEMPTS_CEILING = 1000
#: A job enqueued without max_attempts: its kind's (fleetless.toml, applied by the claiming drain), else this.
DEFAULT_MAX_ATTEMPTS = 3
#: retry_all_dead runs its statement again when a keyed enqueue committed under it took a key:
#: this many times at most (each run skips the keys held by then).
RETRY_ALL_DEAD_TRIES = 10
#: How long a limited kind's claim waits for its kind_limits row before skipping the kind this pass.
KIND_LOCK_TIMEOUT = 2.0
#: A claim reads which queues have a concurrency (to claim them apart) at most this often; the
#: plain claim leaves a limited queue out by itself, so a limit set meanwhile is never exceeded.
QUEUE_LIMITS_TTL = 1.0
_PG_INT = 2**31 - 1


class JobNotFound(LookupError):
    pass


class DuplicateJob(ValueError):
    """``on_duplicate="raise"``: a pending, running or waiting job already has this key."""

    def __init__(self, key: str, existing_id: int) -> None:
        super().__init__(f"job {existing_id} with key {key!r} is already pending, running or waiting")
        self.key = key
        self.existing_id = existing_id


#: A job in one of these has finished: wait() returns.
FINAL_STATUSES = frozenset({"done", "dead", "cancelled"})
#: wait() reads the job again at least this often even without a NOTIFY naming it.
WAIT_RECHECK = 5.0


def finished_channel(schema: str) -> str:
    """The channel on which a finish NOTIFYs the ids of waited jobs (migration 019's trigger)."""
    return f"fleetless_{schema}_finished"


class WaitTimeout(TimeoutError):
    """wait() gave up: the job had not finished within the timeout."""

    def __init__(self, job_id: int, status: str, timeout: float) -> None:
        super().__init__(f"job {job_id} did not finish within {timeout:g} s (it is {status})")
        self.job_id = job_id
        self.status = status


@dataclass(frozen=True)
class Finished:
    """How a waited-for job ended: ``status`` (done, dead or cancelled), ``result`` (a script's
    stdout, or handle()'s return value decoded from JSON), ``error`` (last_error), ``attempts``."""

    id: int
    kind: str
    queue: str
    status: str
    attempts: int
    result: Any
    error: str | None
    finished_at: dt.datetime | None

    @classmethod
    def of(cls, row: Mapping[str, Any]) -> Finished:
        result = row["result_json"] if row["result_json"] is not None else row["result"]
        return cls(id=row["id"], kind=row["kind"], queue=row["queue"], status=row["status"],
                   attempts=row["attempts"], result=result, error=row["last_error"],
                   finished_at=row["finished_at"])


@dataclass(frozen=True)
class QueueSettings:
    """One queue's run-time settings (``fleetless queue pause|resume|set``): ``paused`` (no drain
    claims its jobs) and ``concurrency`` (at most this many of its jobs running at once across every
    drainer; None: no limit)."""

    queue: str
    paused: bool
    concurrency: int | None


class Enqueued(int):
    """The id :meth:`Queue.enqueue` returns: an ``int``, plus, for a keyed enqueue, ``existing``
    (a pending, running or waiting job already had the key: its id, nothing new was enqueued) and
    ``replaced`` (that job was pending and took this enqueue's payload and options)."""

    existing: bool
    replaced: bool

    def __new__(cls, job_id: int, *, existing: bool = False, replaced: bool = False) -> Enqueued:
        self = super().__new__(cls, job_id)
        self.existing = existing
        self.replaced = replaced
        return self


OnDuplicate = Literal["existing", "replace", "raise"]
_ON_DUPLICATE = ("existing", "replace", "raise")
OnParentFailure = Literal["cancel", "run"]
_ON_PARENT_FAILURE = ("cancel", "run")
#: The most parents one job may wait for.
MAX_PARENTS = 100_000


def no_job_with_ids(missing: Sequence[int]) -> str:
    """An enqueue's parents that name no job, the first 20 and how many in all (one line, whatever
    the count: 60,000 ids were 400 KB of error)."""
    listed = ", ".join(map(str, missing[:20])) or "?"
    return f"no job with id {listed}" + (f" and {len(missing) - 20} more" if len(missing) > 20 else "")


def not_to_wait_for(job_id: int) -> str:
    """wait's one line for an id with no job: most often one whose enqueue has not committed yet
    (the waiter sees only committed rows), so the line says so."""
    return f"no job with id {job_id} (not committed yet? wait sees a job once its enqueue commits)"


def keyed_answer(params: Mapping[str, Any], row: Mapping[str, Any], parents: Sequence[int] = ()) -> Enqueued:
    """What a keyed enqueue returns, from its statement's row (enqueue_keyed or
    enqueue_keyed_waiting): the new job, or the one holding the key; :class:`DuplicateJob` for
    ``on_duplicate="raise"``, and a one-line ValueError for a ``replace`` the holder's place in a
    workflow refused (other parents, or another on_parent_failure: a replace never rewires a graph)."""
    job_id = int(row["id"])
    if row["inserted"]:
        return Enqueued(job_id)
    if params["raise"]:
        raise DuplicateJob(params["key"], job_id)
    if params["replace"] and not row["same_shape"]:
        wanted = f"after {sorted(parents)} (on_parent_failure {params['on_parent_failure']})" if parents \
            else "no parents"
        raise ValueError(f"job {job_id} with key {params['key']!r} has other parents or another on_parent_failure"
                         f" than this enqueue's ({wanted:.80}); replace never rewires a workflow: cancel it and"
                         " enqueue again")
    return Enqueued(job_id, existing=True, replaced=bool(row["replaced"]))


def _count(row: tuple[Any, ...] | None) -> int:
    """A ``SELECT count(*)`` statement's answer."""
    return int(row[0]) if row else 0


def _parent_ids(after: Iterable[int]) -> list[int]:
    """enqueue's ``after``: job ids, each once, in order."""
    if isinstance(after, (str, bytes, int)):
        raise ValueError(f"after must be a list of job ids, not {after!r:.60}")
    ids = list(dict.fromkeys(int(_job_id(p)) for p in after))
    if len(ids) > MAX_PARENTS:
        raise ValueError(f"after names {len(ids)} jobs; at most {MAX_PARENTS}")
    return ids


_NO_RUN = Run()
_STATUS = {s.value: s for s in Status}
#: The finish rows' encoder, built once (json.dumps with options builds one per call). ASCII: a
#: lone surrogate reaches the server as an escape it refuses (a refused value, that row alone).
_ROWS_JSON = json.JSONEncoder(allow_nan=False, separators=(",", ":"))


def clean_text(text: str | None, limit: int, *, keep: str = "head") -> str | None:
    """Text PostgreSQL will store: no NUL bytes, at most ``limit`` characters (head or tail)."""
    if text is None:
        return None
    text = text.replace("\x00", "\ufffd")
    if len(text) > limit:
        text = text[:limit] if keep == "head" else text[-limit:]
    return text


def result_text(text: str | None, *, cut: bool = False) -> str | None:
    """The handler's stdout as ``result`` stores it: the first 64 KiB, followed by
    :data:`RESULT_CUT_MARKER` when anything was dropped (``cut``, or the text is longer)."""
    text = clean_text(text, MAX_RESULT_CHARS + 1)
    if text is None:
        return None
    if cut or len(text) > MAX_RESULT_CHARS:
        text = text[:MAX_RESULT_CHARS] + RESULT_CUT_MARKER
    return text


def result_was_cut(result: str | None) -> bool:
    return bool(result) and str(result).endswith(RESULT_CUT_MARKER)


def _as_float(value: float | dt.timedelta | None, what: str) -> float | None:
    if value is None:
        return None
    try:
        seconds = value.total_seconds() if isinstance(value, dt.timedelta) else float(value)
    except (OverflowError, TypeError, ValueError):  # 10**400, "soon", [1]
        raise ValueError(f"{what} must be a finite number of seconds, not {value!r:.40}") from None
    if seconds != seconds or seconds in (float("inf"), float("-inf")):
        raise ValueError(f"{what} must be a finite number of seconds")
    return seconds


class Queue:
    """The jobs table of one schema.

    ``db`` is a DSN (the queue keeps one connection of its own, in autocommit), a
    ``psycopg_pool.ConnectionPool``, or an open ``psycopg.Connection`` used as it is.
    Every method that writes also takes ``conn=``: the write then joins the caller's open
    transaction and exists only if the caller commits.

    As the command line does, ``db`` defaults to ``$DATABASE_URL`` and ``schema`` to
    ``$FLEETLESS_SCHEMA`` (else ``fleetless``); arguments given explicitly win.
    """

    def __init__(
        self,
        db_: str | ConnectionPool | psycopg.Connection[Any] | None = None,
        *,
        schema: str | None = None,
        max_payload_bytes: int = MAX_PAYLOAD_BYTES,
    ) -> None:
        if db_ is None:
            db_ = os.environ.get("DATABASE_URL") or None
            if db_ is None:
                raise ValueError("no database given: pass a DSN to Queue() or set DATABASE_URL")
        if schema is None:
            schema = os.environ.get("FLEETLESS_SCHEMA") or db.DEFAULT_SCHEMA
        self.schema = db.validate_schema_name(schema)
        self._q = db.queries(schema)
        self._dsn = db_ if isinstance(db_, str) else None
        pools = sys.modules.get("psycopg_pool")  # not imported by the app: db_ is no pool of it
        self._pool = db_ if pools is not None and isinstance(db_, pools.ConnectionPool) else None
        self._conn: psycopg.Connection[Any] | None = (
            db_ if isinstance(db_, psycopg.Connection) else None
        )
        self._owns_conn = self._dsn is not None
        self._checked: psycopg.Connection[Any] | None = None  # the own connection _preparable looked at
        self._may_prepare = False
        #: ``EXECUTE`` texts of the statements prepared by name on ``_checked``'s session (:meth:`_executes`).
        self._execute_texts: dict[str, str] = {}
        self._lock = threading.RLock()
        self.max_payload_bytes = max_payload_bytes
        #: The NOTIFY channel of this schema: every enqueue notifies it in its own transaction.
        self.channel = f"fleetless_{self.schema}"
        self._queue_limits: dict[str, int] = {}  # queue -> concurrency, as read at _limits_read_at
        self._limits_read_at = -float("inf")  # never

    # -- connections -------------------------------------------------------------------------

    @contextmanager
    def _connection(self, conn: psycopg.Connection[Any] | None = None) -> Iterator[psycopg.Connection[Any]]:
        if conn is not None:
            yield conn
            return
        if self._pool is not None:
            with self._pool.connection() as pooled:
                yield pooled
            return
        with self._lock:
            if self._conn is None or (self._owns_conn and self._conn.closed):
                assert self._dsn is not None
                self._conn = db.connect(self._dsn, autocommit=True)
            try:
                yield self._conn
            except psycopg.OperationalError as exc:  # errors_translated, around this, names it
                # a broken connection: the next call reconnects (a lock wait that ran out is no sign of one)
                if self._owns_conn and not isinstance(exc, psycopg.errors.LockNotAvailable):
                    self._conn.close()
                raise

    def connect_ahead(self) -> None:
        """Open the queue's own connection in a background thread (a drain's start: beside its
        sandbox tier's probes, ~3 ms of a cron tick). A connection that cannot be made is left to
        the first call, which says why as it always does."""
        if self._pool is not None or self._dsn is None or self._conn is not None:
            return

        def connect() -> None:
            with contextlib.suppress(Exception), self._connection():
                pass

        threading.Thread(target=connect, name="fleetless-connect", daemon=True).start()

    def _preparable(self, conn: psycopg.Connection[Any]) -> bool:
        """Whether a hot statement may be prepared on ``conn``: only on the queue's own connection,
        once it is known to be a server session of its own (never a caller's connection or a
        pool's, which may go through a transaction pooler)."""
        if conn is not self._conn or not self._owns_conn:
            return False
        if self._checked is not conn:  # another session: nothing of the last one is prepared on it
            self._may_prepare = db.prepare_on_request(conn)
            self._checked, self._execute_texts = conn, {}
        return self._may_prepare

    def _executes(self, conn: psycopg.Connection[Any], name: str) -> str:
        """The query ``name`` for a simple-query message on ``conn``: ``EXECUTE fleetless_<name>(...)``
        of a statement prepared with SQL's ``PREPARE`` once per server session, where
        :meth:`_preparable`; else the query itself. The server then neither parses, analyses nor
        rewrites it again (with the finish's planning, nearly half a per-job drain's database CPU),
        and it still goes out with others in one message and one transaction. Its parameters get
        the types their context gives them (the queries cast where the context is not enough); the
        values still travel as literals."""
        query = self._q[name]
        if not self._preparable(conn):
            return query
        text = self._execute_texts.get(name)
        if text is None:
            positional, params = _positional(query)
            conn.execute(f"PREPARE fleetless_{name} AS {positional}")  # errors: the caller's boundary
            text = self._execute_texts[name] = f"EXECUTE fleetless_{name}({', '.join(f'%({p})s' for p in params)})"
        return text

    def bind(self, name: str, params: Mapping[str, Any], *, positional: bool = False) -> tuple[str, Any]:
        """The named statement of ``sql/queries.sql`` for this schema, with its parameters as a
        driver takes them: psycopg's ``%(name)s`` and the mapping; ``positional`` (asyncpg): ``$1``,
        ``$2``... and the values in that order. Queue's own calls and AsyncQueue's go through here."""
        if not positional:
            return self._q[name], params
        text, names = _positional(self._q[name])
        return text, tuple(params[n] for n in names)

    def _run(
        self, name: str, params: Mapping[str, Any], conn: psycopg.Connection[Any] | None = None,
        *, prepare: bool | None = None,
    ) -> list[dict[str, Any]]:
        with (db.errors_translated(self.schema), self._connection(conn) as c,
              c.cursor(row_factory=dict_row) as cur):
            cur.execute(*self.bind(name, params), prepare=prepare)
            return cur.fetchall() if cur.description else []

    def _tuples(self, name: str, params: Mapping[str, Any]) -> list[tuple[Any, ...]]:
        """As :meth:`_run`, with rows as tuples: the batch path's statements return thousands of
        rows, and a dict per row was a visible share of a drain of small jobs."""
        with db.errors_translated(self.schema), self._connection() as c, c.cursor(row_factory=tuple_row) as cur:
            cur.execute(*self.bind(name, params))
            return cur.fetchall() if cur.description else []

    def query(
        self, name: str, params: Mapping[str, Any] | None = None, *, prepare: bool | None = None
    ) -> list[dict[str, Any]]:
        """Run one named query of ``sql/queries.sql``: the read service's (``insights``) way in.
        ``prepare=False``: plan it with these values every time (never a generic plan)."""
        return self._run(name, params or {}, prepare=prepare)

    def close(self) -> None:
        with self._lock:
            if self._owns_conn and self._conn is not None:
                self._conn.close()
                self._conn = None

    def check_schema(self) -> None:
        """SchemaNotInitialised (``run 'fleetless init'``, one line) unless the schema has every
        migration this fleetless's queries expect; a drain asks once, before it claims."""
        rows = self._run("schema_version", {})
        have, need = int(rows[0]["version"]), db.latest_migration()
        if have < need:
            raise db.SchemaOutdated(f"schema {self.schema} is at migration {have}, this fleetless needs {need}:"
                                    " run 'fleetless init'")

    def init(self) -> list[int]:
        """Create or upgrade the schema (idempotent). Returns the migrations applied."""
        if self._pool is not None:
            with self._pool.connection() as c:
                return db.migrate(c, self.schema)
        assert self._dsn is not None or self._conn is not None
        if self._dsn is not None:
            with db.connect(self._dsn) as c:
                return db.migrate(c, self.schema)
        assert self._conn is not None
        return db.migrate(self._conn, self.schema)

    # -- enqueue -----------------------------------------------------------------------------

    def job_params(
        self,
        kind: str,
        payload: Any,
        *,
        max_attempts: int | None = None,
        run_after: dt.datetime | None = None,
        delay: float | dt.timedelta | None = None,
        queue: str = "default",
        priority: int = 0,
        timeout: float | dt.timedelta | None = None,
        key: str | None = None,
        on_duplicate: OnDuplicate = "existing",
        on_parent_failure: OnParentFailure = "cancel",
    ) -> dict[str, Any]:
        """One job's enqueue parameters (the statements' names), checked: a bad option is a one-line
        ValueError. :meth:`enqueue` and :class:`~fleetless.async_queue.AsyncQueue` both build theirs
        here, and run them with :meth:`bind`."""
        validate_kind(kind)
        if on_parent_failure not in _ON_PARENT_FAILURE:
            raise ValueError(f"on_parent_failure must be cancel or run, not {on_parent_failure!r:.40}")
        if key is not None and (not isinstance(key, str) or not 1 <= len(key) <= 255 or "\x00" in key):
            raise ValueError(f"key must be a string of 1 to 255 characters without NUL, not {key!r:.60}")
        if on_duplicate not in _ON_DUPLICATE:
            raise ValueError(f"on_duplicate must be one of {', '.join(_ON_DUPLICATE)}, not {on_duplicate!r}")
        validate_queue_name(queue)
        kinds_default = max_attempts is None  # the claiming drain applies the kind's (fleetless.toml)
        if max_attempts is None:
            max_attempts = DEFAULT_MAX_ATTEMPTS
        if (isinstance(max_attempts, bool) or not isinstance(max_attempts, int)
                or not 1 <= max_attempts <= MAX_ATTEMPTS_CEILING):
            raise ValueError(f"max_attempts must be an integer from 1 to {MAX_ATTEMPTS_CEILING}, not {max_attempts!r}")
        if isinstance(priority, bool) or not isinstance(priority, int) or not -_PG_INT <= priority <= _PG_INT:
            raise ValueError(f"priority must be an integer from {-_PG_INT} to {_PG_INT}, not {priority!r}")
        if run_after is not None and delay is not None:
            raise ValueError("give run_after or delay, not both")
        if run_after is not None and (not isinstance(run_after, dt.datetime) or run_after.tzinfo is None):
            raise ValueError("run_after must be a timezone-aware datetime")
        if run_after is not None:
            try:  # PostgreSQL would store it, but it could not be read back into a datetime
                run_after.astimezone(dt.UTC)
            except OverflowError:
                raise ValueError(f"run_after {run_after.isoformat()} is outside years 1-9999 in UTC") from None
        delay_s = _as_float(delay, "delay") or 0.0
        if not 0 <= delay_s <= 100 * 365 * 86400:
            raise ValueError(f"delay must be from 0 to 100 years in seconds, not {delay_s!r}")
        timeout_s = _as_float(timeout, "timeout")
        if timeout_s is not None:
            if not 1 <= timeout_s <= _PG_INT:
                raise ValueError(f"timeout must be at least 1 second, not {timeout_s!r}")
            timeout_s = round(timeout_s)
        return {
            "kind": kind,
            "payload": encode_payload(payload, self.max_payload_bytes),
            "max_attempts": max_attempts,
            "max_attempts_default": kinds_default,
            "run_after": run_after,
            "delay": delay_s,
            "queue": queue,
            "priority": priority,
            "timeout": timeout_s,
            "key": key,
            "replace": on_duplicate == "replace",
            "raise": on_duplicate == "raise",
            "keep_due": run_after is None and delay is None,
            "on_parent_failure": on_parent_failure,
        }

    def enqueue(
        self,
        kind: str,
        payload: Any,
        *,
        max_attempts: int | None = None,
        run_after: dt.datetime | None = None,
        delay: float | dt.timedelta | None = None,
        queue: str = "default",
        priority: int = 0,
        timeout: float | dt.timedelta | None = None,
        key: str | None = None,
        on_duplicate: OnDuplicate = "existing",
        after: Iterable[int] | None = None,
        on_parent_failure: OnParentFailure = "cancel",
        conn: psycopg.Connection[Any] | None = None,
    ) -> Enqueued:
        """Add one job and return its id (an :class:`Enqueued`, an ``int`` that also tells whether a
        keyed enqueue found or replaced an existing job). Bad input raises ValueError and writes
        nothing.

        ``max_attempts``: when not given, the job takes its kind's ``max_attempts`` from the
        claiming drain's ``fleetless.toml`` at each claim, else 3 (stored until then).

        ``key``: at most one pending, running or waiting job has it. A duplicate enqueue returns
        the existing job's id and writes nothing (``on_duplicate="existing"``, the default), gives a
        still pending job the new payload and options and returns its id (``"replace"``; its due
        time stays unless ``delay`` or ``run_after`` is given), or raises
        :class:`DuplicateJob` (``"raise"``); inside your transaction, none of these aborts it.
        With ``after``: the key's job is returned as it is whatever its parents; a ``replace``
        takes only on a pending or waiting job with the same parents and ``on_parent_failure``,
        and is refused (ValueError, nothing written) for one with others: it never rewires a graph.

        ``after`` (job ids): a workflow's child. It is ``waiting``, never claimed, until every
        parent is done; then pending, with ``payload["_parents"]`` (an object payload) mapping each
        parent's id to its result. A parent ending dead or cancelled cancels it (and its own
        waiting descendants), or, with ``on_parent_failure="run"``, counts as ended. A parent that
        does not exist: ValueError, nothing written. See docs/workflows.md."""
        params = self.job_params(
            kind, payload, max_attempts=max_attempts, run_after=run_after, delay=delay,
            queue=queue, priority=priority, timeout=timeout, key=key, on_duplicate=on_duplicate,
            on_parent_failure=on_parent_failure,
        )
        if after is not None:
            parents = _parent_ids(after)
            if parents:
                with db.errors_translated(self.schema), self._connection(conn) as c, db.atomic(c):
                    if key is not None:
                        return self._enqueue_keyed_after(c, params, parents, Labels())
                    return self._enqueue_after(c, params, parents)
        if key is None:  # the hot path: one statement, one tuple row (a dict row cost ~10% of an enqueue)
            name, params = ("enqueue_default", {"kind": params["kind"], "payload": params["payload"]}) \
                if _all_default(params) else ("enqueue", params)
            params["channel"] = self.channel
            with (db.errors_translated(self.schema), self._connection(conn) as c,
                  c.cursor(row_factory=tuple_row) as cur):  # whatever the caller's connection's rows are
                row = cur.execute(self._q[name], params, prepare=True if self._preparable(c) else None).fetchone()
                assert row is not None
                return Enqueued(row[0])
        with self._connection(conn) as c:
            return self._enqueue_keyed(c, params)

    def _enqueue_after(self, conn: psycopg.Connection[Any], params: dict[str, Any], parents: list[int]) -> Enqueued:
        """One job after ``parents``: written waiting with its edges, then settled (the caller's
        transaction, or one of its own)."""
        with conn.cursor(row_factory=tuple_row) as cur:
            row = cur.execute(self._q["enqueue_waiting"], {**params, "after": parents}).fetchone()
            if row is None:
                missing = [r[0] for r in cur.execute(self._q["missing_jobs"], {"ids": parents}).fetchall()]
                raise ValueError(f"after: {no_job_with_ids(missing)}")
        labels = Labels()
        labels.child(row[0], parents)
        self._settle(conn, labels, [row[0]])
        return Enqueued(row[0])

    def _settle(self, conn: psycopg.Connection[Any], labels: Labels, children: list[int]) -> None:
        """Children just written (waiting, with their edges): their graphs labelled (fleetless.graphs:
        the parents new to a graph first, then the parents' labels read under a share lock, the
        graphs a child joined relabelled until no job is left behind, the children's labels set),
        then settled, all in the caller's transaction."""
        with conn.cursor(row_factory=tuple_row) as cur:
            found: dict[int, int] = {}
            ids = labels.unread()
            if ids:
                found = self._read_labels(conn, cur, labels, ids)
            relabel, assign = labels.step(found, children)
            while relabel["old"] and _count(cur.execute(self._q["graph_relabel"], relabel).fetchone()):
                pass  # again, with a new snapshot: a child another enqueue added meanwhile
            cur.execute(self._q["graph_label_set"], assign)
            cur.execute(self._q["settle_children"], {"ids": children, "channel": self.channel})

    def _read_labels(self, conn: psycopg.Connection[Any], cur: psycopg.Cursor[Any], labels: Labels,
                     ids: list[int]) -> dict[int, int]:
        """The parents' labels, read under a share lock (graph_labels) after those in no graph
        are given their own (graph_label_fresh). A call that joins graphs first locks their slots
        (graph_join_lock, fleetless.graphs); should a graph have joined another meanwhile (its
        label moved to one whose slot is not held), the locks go back (a savepoint) and it starts
        over with that slot too, so slots are always taken in order."""
        slots: list[int] = []
        if labels.may_join(ids):
            slots = labels.join_slots(dict(cur.execute(self._q["graph_labels_peek"], {"ids": ids}).fetchall()))
        while slots:
            with conn.transaction():
                cur.execute(self._q["graph_join_lock"], {"slots": slots})
                found = self._locked_labels(cur, ids)
                more = set(labels.join_slots(found)) - set(slots)
                if not more:
                    return found
                slots = sorted({*slots, *more})
                raise psycopg.Rollback()  # this savepoint's locks go back
        return self._locked_labels(cur, ids)  # one graph: it stays one (graphs only ever merge)

    def _locked_labels(self, cur: psycopg.Cursor[Any], ids: list[int]) -> dict[int, int]:
        cur.execute(self._q["graph_label_fresh"], {"ids": ids})
        return {i: g for i, g in cur.execute(self._q["graph_labels"], {"ids": ids}).fetchall() if g is not None}

    def _enqueue_keyed(self, conn: psycopg.Connection[Any], params: dict[str, Any]) -> Enqueued:
        for _ in range(5):  # a duplicate committed after the statement's snapshot: look again
            rows = self._run("enqueue_keyed", {**params, "channel": self.channel}, conn)
            if rows:
                return keyed_answer(params, rows[0])
        raise RuntimeError(f"key {params['key']!r}: the job holding it kept changing; try again")

    def _enqueue_keyed_after(self, conn: psycopg.Connection[Any], params: dict[str, Any],
                             parents: list[int], labels: Labels) -> Enqueued:
        """A workflow's child with a key (in the caller's transaction, or one of its own): its
        parents locked and checked, then written waiting and settled, or the job already holding
        the key returned (enqueue_keyed_waiting says how a replace is decided)."""
        with conn.cursor(row_factory=tuple_row) as cur:
            missing = [row[0] for row in cur.execute(self._q["lock_parents_missing"], {"ids": parents}).fetchall()]
            if missing:
                raise ValueError(f"after: {no_job_with_ids(missing)}")
        for _ in range(5):  # as _enqueue_keyed
            rows = self._run("enqueue_keyed_waiting", {**params, "after": sorted(parents), "channel": self.channel},
                             conn)
            if rows:
                if rows[0]["inserted"]:
                    labels.child(rows[0]["id"], parents)
                    self._settle(conn, labels, [rows[0]["id"]])
                return keyed_answer(params, rows[0], parents)
        raise RuntimeError(f"key {params['key']!r}: the job holding it kept changing; try again")

    def item_params(self, index: int, item: tuple[str, Any] | Mapping[str, Any],
                     names: dict[str, int] | None = None) -> dict[str, Any]:
        """An enqueue_many item's parameters (as :meth:`job_params`, for Queue and AsyncQueue);
        ``names`` (the call's items so far by name, to their ids) resolves its ``after``, given as
        ``parents``."""
        try:
            if isinstance(item, Mapping):
                options = dict(item)
                unknown = set(options) - {"kind", "payload", *ITEM_OPTIONS, *GRAPH_OPTIONS}
                if unknown:
                    raise ValueError(f"unknown option(s) {', '.join(sorted(unknown))}")
                if "kind" not in options or "payload" not in options:
                    raise ValueError("needs 'kind' and 'payload'")
                name, after = options.pop("name", None), options.pop("after", None)
                params = self.job_params(options.pop("kind"), options.pop("payload"), **options)
                params["name"] = name
                if name is not None and (not isinstance(name, str) or not name):
                    raise ValueError(f"name must be a non-empty string, not {name!r:.40}")
                if name is not None and names is not None and name in names:
                    raise ValueError(f"name {name!r:.60} is already an earlier item's")
                params["parents"] = None if after is None else self._resolve_after(after, names or {})
                return params
            kind, payload = item
            params = self.job_params(kind, payload)
            params["name"] = params["parents"] = None
            return params
        except (ValueError, TypeError) as exc:
            raise ValueError(f"job #{index}: {exc}") from None

    @staticmethod
    def _resolve_after(after: Any, names: Mapping[str, int]) -> list[int]:
        if isinstance(after, (str, bytes, int)) or not isinstance(after, Iterable):
            after = [after]
        ids: list[int] = []
        for ref in after:
            if isinstance(ref, str):
                if ref not in names:
                    raise ValueError(f"after: no earlier item is named {ref!r:.60}")
                ids.append(names[ref])
            else:
                ids.append(int(_job_id(ref)))
        return _parent_ids(ids)

    def enqueue_many(
        self,
        jobs: Iterable[tuple[str, Any] | Mapping[str, Any]],
        *,
        conn: psycopg.Connection[Any] | None = None,
        **defaults: Any,
    ) -> list[int]:
        """Add many jobs with COPY, all or none. Items are ``(kind, payload)`` or dicts with
        ``kind``, ``payload`` and any option of :meth:`enqueue`. Returns the ids in order.
        Options given to the call itself (``queue="mail", priority=5``, any option of
        :meth:`enqueue`) are every item's defaults; an item's own options win.

        ``jobs`` may be any iterable, a generator included: it is read, checked and copied
        ``ENQUEUE_CHUNK`` jobs at a time, so memory stays flat however many there are. A bad item
        raises ValueError naming its index, and nothing of the call is written.

        Workflows: an item may have a ``name`` (unique in the call) and ``after``, a list of its
        parents: ids of existing jobs, or names of earlier items of this call (so a whole graph is
        one call and one transaction; an item can only follow items before it, so no cycle can
        be written). Keyed items may have parents and be parents: a later item naming a keyed
        item follows the job its key resolved to (the existing one, for a duplicate). See
        :meth:`enqueue` and docs/workflows.md."""
        items = enumerate(jobs)
        if defaults:
            unknown = set(defaults) - set(ITEM_OPTIONS) - {"kind", "payload"} | (set(defaults) & {"kind", "payload"})
            if unknown:
                raise ValueError(f"enqueue_many: unknown default option(s) {', '.join(sorted(unknown))}")
            items = enumerate(with_defaults(jobs, defaults))
        first = next(items, None)
        if first is None:
            return []
        ids: list[int] = []
        queues: set[str] = set()
        names: dict[str, int] = {}
        labels = Labels()  # the call's workflow graphs
        with (db.errors_translated(self.schema), self._connection(conn) as c, db.atomic(c),
              c.cursor(row_factory=tuple_row) as cur):
            pending: Iterator[tuple[int, Any]] = itertools.chain([first], items)
            while chunk := list(itertools.islice(pending, ENQUEUE_CHUNK)):
                # ids for the whole chunk (a keyed job's goes unused: it gets its own), so that each
                # job is checked and copied in one pass while the server takes in the rows before it
                cur.execute(self._q["reserve_ids"], {"table": f"{self.schema}.jobs", "n": len(chunk)})
                found = cur.fetchone()
                assert found is not None
                now, reserved = cast(dt.datetime, found[0]), cast(list[int], found[1])
                rows: list[dict[str, Any]] = []
                later = set(reserved)  # this chunk's ids not yet an earlier item's: no item may follow one
                todo = list(zip(chunk, reserved, strict=True))
                nxt = 0
                while nxt < len(todo):
                    # a run of unkeyed items, streamed: COPYed while checked, those with parents
                    # or options of their own after it; it stops before a keyed item, which goes
                    # by its own statement once everything before it is written (a later item
                    # may name it as a parent, and its key may give it an existing job's id)
                    others: list[dict[str, Any]] = []  # options of their own: the nine-column COPY
                    children: list[dict[str, Any]] = []  # with parents: written waiting, then settled
                    keyed: tuple[int, dict[str, Any]] | None = None
                    with contextlib.ExitStack() as stack:
                        copy: psycopg.Copy | None = None  # opened by the run's first plain job
                        while nxt < len(todo) and keyed is None:
                            (i, item), job_id = todo[nxt]
                            nxt += 1
                            r = self.item_params(i, item, names)
                            rows.append(r)
                            if r["parents"] and (ahead := [p for p in r["parents"] if p in later]):
                                whose = "its own" if ahead[0] == job_id else "a later item's"
                                raise ValueError(f"job #{i}: after names job id {ahead[0]}, {whose} in this call;"
                                                 " an item can only follow earlier items or existing jobs")
                            later.discard(job_id)
                            if r["key"] is not None:  # its reserved id goes unused: it gets its own
                                keyed = (i, r)
                                continue
                            r["id"] = job_id
                            if r["name"] is not None:
                                names[r["name"]] = job_id
                                if not r["parents"]:
                                    labels.wrote(job_id)
                            if r["parents"]:
                                children.append(r)
                            elif _all_default(r):
                                if copy is None:
                                    copy = stack.enter_context(cur.copy(self._q["copy_default_jobs"]))
                                copy.write_row((job_id, r["kind"], r["payload"], True))
                            else:
                                others.append(r)
                    if others:
                        with cur.copy(self._q["copy_jobs"]) as copy:
                            for r in others:
                                run_after = r["run_after"] or now + dt.timedelta(seconds=r["delay"])
                                copy.write_row(
                                    (r["id"], r["kind"], r["payload"], r["max_attempts"], run_after,
                                     r["queue"], r["priority"], r["timeout"], r["max_attempts_default"])
                                )
                    if children:
                        self._copy_children(c, cur, children, now, labels)
                    if keyed is not None:
                        i, r = keyed
                        try:
                            r["id"] = (self._enqueue_keyed_after(c, r, r["parents"], labels) if r["parents"]
                                       else self._enqueue_keyed(c, r))
                        except DuplicateJob:
                            raise
                        except ValueError as exc:
                            raise ValueError(f"job #{i}: {exc}") from None
                        if r["name"] is not None:
                            names[r["name"]] = r["id"]
                            if not r["parents"] and not r["id"].existing:
                                labels.wrote(r["id"])
                ids.extend(r["id"] for r in rows)
                queues.update(r["queue"] for r in rows)
            cur.execute(self._q["notify"], {"channel": self.channel, "payloads": notify_payloads(queues)})
        return ids

    def _copy_children(self, conn: psycopg.Connection[Any], cur: psycopg.Cursor[Any], children: list[dict[str, Any]],
                       now: dt.datetime, labels: Labels) -> None:
        """enqueue_many's items with parents: COPYed waiting with their edges, then labelled and
        settled (:meth:`_settle`), in the call's transaction."""
        with cur.copy(self._q["copy_waiting_jobs"]) as copy:
            for r in children:
                run_after = r["run_after"] or now + dt.timedelta(seconds=r["delay"])
                copy.write_row((r["id"], r["kind"], r["payload"], r["max_attempts"], run_after, r["queue"],
                                r["priority"], r["timeout"], r["max_attempts_default"], "waiting",
                                r["on_parent_failure"]))
        with cur.copy(self._q["copy_dependencies"]) as copy:
            for r in children:
                for parent in r["parents"]:
                    copy.write_row((parent, r["id"]))
        parents = list({p for r in children for p in r["parents"]})
        missing = [row[0] for row in cur.execute(self._q["lock_parents_missing"], {"ids": parents}).fetchall()]
        if missing:
            raise ValueError(f"after: {no_job_with_ids(missing)}")
        for r in children:
            labels.child(r["id"], r["parents"])
        self._settle(conn, labels, [r["id"] for r in children])

    # -- the drainer's side ------------------------------------------------------------------

    def claim(
        self,
        n: int,
        *,
        queues: Sequence[str] | None = None,
        default_timeout: float = 600,
        ttl: float = 900,
        lease_grace: float = 60,
        one_kind: bool = False,
        claimed_by: str | None = None,
        tier: str | None = None,
        skip_kinds: Sequence[str] = (),
        token: uuid.UUID | None = None,
        kinds: Mapping[str, KindSettings] | None = None,
    ) -> list[Job]:
        """Claim up to ``n`` due jobs (priority first, then due time) and mark them running.

        ``one_kind``: all of the kind of the first due job (batch mode: one sandbox per batch).
        ``claimed_by`` (the drainer's ``host:pid``) and ``tier`` are recorded on the rows so an
        operator can see where each running job is.
        ``skip_kinds``: never these (a drain that cannot run them leaves them to one that can).
        ``token`` (default: a new one) becomes every claimed job's claim token: a caller that lost
        the reply finds what the claim took with :meth:`claimed_with` and the same token.
        ``kinds`` (fleetless.toml): each kind's tier is recorded on its rows, its max_attempts
        applied to jobs enqueued without one, its batch_size used instead of ``n`` in one_kind
        mode. Without a kind that sets ``concurrency`` or ``rate`` this is one statement. Kinds
        that do are claimed first, each in a short transaction of its own under the kind's
        kind_limits row lock (a bounded wait), within their limits counted in the table (every
        drainer's running rows and recent starts); then the other kinds with one statement, as without limits."""
        if n <= 0:
            return []
        kinds = kinds or {}
        limited = sorted(k for k, ks in kinds.items() if ks.limited and k not in skip_kinds)
        params = _claim_params(n, queues=queues, default_timeout=default_timeout, ttl=ttl, lease_grace=lease_grace,
                               claimed_by=claimed_by, tier=tier, skip_kinds=[*skip_kinds, *limited], token=token,
                               kinds=kinds)
        got: list[Job] = []
        limited_queues = self.limited_queues(queues)
        if limited_queues:
            due = [r["queue"] for r in self._run("limited_queues_due", {"queues": limited_queues})]
            random.shuffle(due)  # no limited queue always goes first
            for queue in due:
                size = n if one_kind else n - len(got)
                jobs = self._claim_queue_limited(queue, limited, kinds, {**params, "n": size}, one_kind=one_kind)
                if one_kind and jobs:
                    return jobs
                got += jobs
                if len(got) >= n:
                    return got
        if limited:
            due = [r["kind"] for r in self._run("limited_kinds_due", {"limited": limited, "queues": params["queues"],
                                                                      "held_queue": None})]
            random.shuffle(due)  # no limited kind always goes first
            for kind in due:
                size = (kinds[kind].batch_size or n) if one_kind else n - len(got)
                jobs = self._claim_limited(kind, kinds[kind], {**params, "n": size})
                if one_kind and jobs:
                    return jobs
                got += jobs
                if len(got) >= n:
                    return got
        if one_kind:  # in run order already; a tuple per row, in Job's field order
            return [Job.from_row(row) for row in self._tuples("claim_kind", params)]
        return got + _jobs(self._run("claim", {**params, "n": n - len(got)}))

    def _claim_limited(self, kind: str, ks: KindSettings, params: dict[str, Any]) -> list[Job]:
        """One limited kind's claim: its row lock, then its jobs within its limits, one transaction.
        The lock wait is bounded (KIND_LOCK_TIMEOUT): when it runs out the kind is skipped this
        pass (nothing claimed), so a claim never hangs behind whoever holds the row."""
        try:
            with self._limit_lock() as cur:
                return self._claim_kind_within(cur, kind, ks, params, held_queue=None, queue_concurrency=None)
        except db.LockTimeout:
            log.warning("kind %r: its limit row stayed locked for %g s; skipping it this pass", kind,
                        KIND_LOCK_TIMEOUT)
            return []

    def _claim_kind_within(self, cur: psycopg.Cursor[dict[str, Any]], kind: str, ks: KindSettings,
                           params: dict[str, Any], *, held_queue: str | None,
                           queue_concurrency: int | None) -> list[Job]:
        """A limited kind's row lock and claim, in the transaction of ``cur`` (``held_queue``: the
        limited queue whose row that transaction holds, its concurrency counted too)."""
        cur.execute(self._q["kind_limit_lock"], {"kind": kind})
        cur.execute(self._q["claim_limited"], {
            **params, "kind": kind, "concurrency": ks.concurrency,
            "rate": ks.rate.count if ks.rate else None, "window": ks.rate.seconds if ks.rate else None,
            "held_queue": held_queue, "queue_concurrency": queue_concurrency})
        return _jobs(cur.fetchall())

    @contextmanager
    def _limit_lock(self) -> Iterator[psycopg.Cursor[dict[str, Any]]]:
        """A transaction of its own (a savepoint in a caller's) whose row-lock waits are bounded by
        KIND_LOCK_TIMEOUT (db.LockTimeout when one runs out), for a limited kind's or queue's claim."""
        with db.errors_translated(self.schema), self._connection() as c:
            own = c.autocommit  # the block is a transaction of its own, not part of the caller's
            with db.atomic(c), c.cursor(row_factory=dict_row) as cur:
                cur.execute(self._q["kind_limit_wait"], {"timeout": f"{KIND_LOCK_TIMEOUT * 1000:.0f}ms"})
                before = cur.fetchone()
                yield cur
                if not own:  # the caller's transaction goes on: its lock_timeout as it was
                    cur.execute(self._q["kind_limit_unwait"], {"old": before["old"] if before else "0"})

    def _claim_queue_limited(self, queue: str, limited: Sequence[str], kinds: Mapping[str, KindSettings],
                             params: dict[str, Any], *, one_kind: bool) -> list[Job]:
        """One concurrency-limited queue's claim, one transaction: its queue_settings row lock, then
        its jobs within its concurrency (counted from the table: every drainer's running rows); then
        its jobs of limited kinds, each under its kind's row too (always queue first, then kind).
        A lock wait that runs out skips the queue this pass; a queue paused meanwhile gives none."""
        n = params["n"]
        try:
            with self._limit_lock() as cur:
                cur.execute(self._q["queue_limit_lock"], {"queue": queue})
                row = cur.fetchone()
                if row is None or row["paused"]:
                    return []
                concurrency = row["concurrency"]
                cur.execute(self._q["claim_queue_limited"],
                            {**params, "queue": queue, "concurrency": concurrency, "one_kind": one_kind})
                jobs = _jobs(cur.fetchall())
                if not limited or (one_kind and jobs) or len(jobs) >= n:
                    return jobs
                cur.execute(self._q["limited_kinds_due"], {"limited": list(limited), "queues": [queue],
                                                           "held_queue": queue})
                due = [r["kind"] for r in cur.fetchall()]
                random.shuffle(due)
                for kind in due:
                    size = (kinds[kind].batch_size or n) if one_kind else n - len(jobs)
                    got = self._claim_kind_within(cur, kind, kinds[kind], {**params, "queues": [queue], "n": size},
                                                  held_queue=queue, queue_concurrency=concurrency)
                    if one_kind and got:
                        return got
                    jobs += got
                    if len(jobs) >= n:
                        break
                return jobs
        except db.LockTimeout:
            log.warning("queue %r: its settings row stayed locked for %g s; skipping it this pass", queue,
                        KIND_LOCK_TIMEOUT)
            return []

    def limited_queues(self, queues: Sequence[str] | None = None, *, read: bool = True) -> list[str]:
        """The queues (of ``queues``; None: all) with a concurrency, as read at most
        QUEUE_LIMITS_TTL ago: a claim takes their jobs apart, each under its queue's row lock.
        ``read=False``: as the last claim read them (no query)."""
        now = time.monotonic()
        if read and now - self._limits_read_at >= QUEUE_LIMITS_TTL:
            self._queue_limits = {r["queue"]: int(r["concurrency"]) for r in self._run("queue_limits", {})}
            self._limits_read_at = now
        return sorted(q for q in self._queue_limits if queues is None or q in queues)

    def claimed_with(self, token: uuid.UUID) -> list[Job]:
        """The jobs a claim with this token took and still holds."""
        return _jobs(self._run("claimed_with", {"token": token}))

    def _own_outcome(self, job: Job) -> Status | None:
        """After a fenced write matched nothing: the status this claim's own earlier write left,
        when that is what happened (its reply was lost and the call retried); else None."""
        return self._own_outcomes([job]).get(claim_of(job))

    def _own_outcomes(self, jobs: Sequence[Job]) -> dict[Claim, Status]:
        """Of these claims, those whose outcome a finish of theirs wrote (by the attempt history
        row it wrote with them), and the status each write set."""
        rows = self._run("outcomes_of", {"ids": [j.id for j in jobs], "tokens": [j.claim_token for j in jobs]})
        return {(r["id"], r["token"]): Status(r["status"]) for r in rows}

    @staticmethod
    def _run_params(job: Job, run: Run | None) -> dict[str, Any]:
        """The fence and the attempt-history columns every finish statement writes."""
        run = run or Run()
        return {"id": job.id, "token": job.claim_token, "host": socket.gethostname(), "pid": os.getpid(),
                "tier": run.tier, "exit_code": run.exit_code, "signal": run.signal,
                "kill_reason": clean_text(run.kill_reason, 500)}

    def complete(self, job: Job, result: str | None = None, *, run: Run | None = None,
                 result_cut: bool = False) -> bool:
        """Mark done, and record the attempt (``run``: how it ran). False if this claim no longer
        holds the job (fenced out): then nothing is written. ``result_cut``: the sandbox dropped
        the rest of stdout (the stored result then says so). A retry whose first reply was lost
        recognises its own earlier write (True)."""
        rows = self._run("complete", {**self._run_params(job, run), "result": result_text(result, cut=result_cut)})
        return bool(rows) or self._own_outcome(job) is Status.DONE

    def fail(
        self, job: Job, error: str, *, delay: float, permanent: bool = False, result: str | None = None,
        run: Run | None = None, result_cut: bool = False,
    ) -> Status | None:
        """Record a failed attempt: back to pending after ``delay`` seconds if attempts are left
        (and not ``permanent``), else dead. Returns the new status, or None if fenced out."""
        rows = self._run(
            "fail",
            {**self._run_params(job, run), "delay": delay, "permanent": permanent,
             "error": clean_text(error, MAX_ERROR_CHARS, keep="tail"),
             "result": result_text(result, cut=result_cut)},
        )
        return Status(rows[0]["status"]) if rows else self._own_outcome(job)

    def release(self, job: Job, reason: str, *, run: Run | None = None, delay: float = 0) -> Status | None:
        """Give the claim back without charging an attempt (shutdown, broken sandbox).

        Bounded: the ``MAX_RELEASES``-th release in a row is charged as a failed attempt instead
        (pending again after ``delay`` seconds, or dead when no attempt is left), so a job that
        breaks its sandbox every time cannot block its queue forever. Returns the new status, or
        None if fenced out."""
        rows = self._run(
            "release",
            {**self._run_params(job, run), "max_releases": MAX_RELEASES, "delay": delay,
             "error": clean_text(reason, MAX_ERROR_CHARS, keep="tail")},
        )
        return Status(rows[0]["status"]) if rows else self._own_outcome(job)

    def next_due(self, queues: Sequence[str] | None = None, skip_kinds: Sequence[str] = ()) -> float | None:
        """Seconds until the next pending job of ``queues`` (not of ``skip_kinds``) is due (<= 0: due
        now); None: none."""
        rows = self._run("next_due", {"queues": list(queues) if queues else None,
                                      "skip_kinds": list(skip_kinds) or None})
        seconds = rows[0]["seconds"] if rows else None
        return None if seconds is None else float(seconds)

    @property
    def conninfo(self) -> str:
        """How to open another connection to this queue's database (watch mode listens on one)."""
        if self._dsn is not None:
            return self._dsn
        if self._pool is not None and isinstance(self._pool.conninfo, str):
            return self._pool.conninfo
        assert self._conn is not None, "a pool whose conninfo is a callable cannot be watched"
        return self._conn.info.dsn

    def finish_many(self, outcomes: Sequence[tuple[Job, Outcome]]) -> dict[int, Status]:
        """Write many outcomes in one statement, each fenced on its claim. Returns the new status
        of every job written; a job missing from it was fenced out (its claim was taken over). A
        retry whose first reply was lost recognises its own earlier writes (their status is in it).
        By job id: for outcomes of one claim per job (:meth:`finish_claims` tells claims apart)."""
        return {job_id: status for (job_id, _), status in self.finish_claims(outcomes).items()}

    def finish_claims(self, outcomes: Sequence[tuple[Job, Outcome]]) -> dict[Claim, Status]:
        """:meth:`finish_many`, its answer by claim (job id, claim token): outcomes of two claims of
        one job (the first one's reply lost, the job claimed again meanwhile) are told apart."""
        if not outcomes:
            return {}
        rows = self._tuples(_finish_query(outcomes), _finish_params(outcomes))
        return self._written(outcomes, rows)

    def _written(self, outcomes: Sequence[tuple[Job, Outcome]], rows: list[tuple[Any, ...]]) -> dict[Claim, Status]:
        """finish_many's answer, by claim: each written claim's new status, and the claims it did
        not match told apart (fenced out, or written by this call's own earlier try whose reply
        was lost). A job with two claims among ``outcomes`` is asked about by claim as well (the
        statement matched one of them, and its answer names the job only)."""
        by_id = {job_id: _STATUS[status] for job_id, status in rows}
        ids = [job.id for job, _ in outcomes]
        twice = set() if len(set(ids)) == len(ids) else {i for i, n in collections.Counter(ids).items() if n > 1}
        written: dict[Claim, Status] = {}
        ask: list[Job] = []
        for job, _ in outcomes:
            status = by_id.get(job.id)
            if status is None or job.id in twice:
                ask.append(job)
            else:
                written[claim_of(job)] = status
        if ask:
            written.update(self._own_outcomes(ask))
        return written

    def finish_then_claim(
        self, outcomes: Sequence[tuple[Job, Outcome]], n: int, **claim: Any
    ) -> tuple[dict[Claim, Status], list[Job]]:
        """:meth:`finish_claims` of ``outcomes``, then :meth:`claim` of up to ``n`` (``claim``: its
        keyword arguments), both in one transaction sent as one message: a per-job drain's slot
        writes its job's outcome and takes its next job with one round trip and one commit (two
        commits per job were most of its drainer's time), and the outcome is durable no later than
        the claim. All or nothing: a database error writes neither and propagates. A claim that is
        more than its one statement (a kind with a concurrency or rate limit, a queue with a
        concurrency), ``one_kind``, or
        ``n`` < 1: the two calls, one after the other."""
        kinds: Mapping[str, KindSettings] = claim.get("kinds") or {}
        if (n < 1 or claim.get("one_kind") or any(ks.limited for ks in kinds.values()) or not outcomes
                or self.limited_queues(claim.get("queues"))):
            return self.finish_claims(outcomes), self.claim(n, **claim)
        claim.pop("one_kind", None)
        params = {**_finish_params(outcomes), **_claim_params(n, **claim)}
        # Client-side binding is what lets two statements travel in one simple query, which the
        # server runs as one implicit transaction; psycopg quotes every value as a literal.
        with (db.errors_translated(self.schema), self._connection() as c, psycopg.ClientCursor(c) as cur):
            # A claim of named queues goes as its text, planned with its values each time: a prepared
            # statement's generic plan cannot use the queue as an index condition ("queues IS NULL
            # OR queue = ANY(queues)") and read every pending row of the other queues (issue 26).
            claim_sql = self._executes(c, "claim") if params["queues"] is None else self._q["claim"]
            cur.execute(self._executes(c, _finish_query(outcomes)) + ";\n" + claim_sql, params)
            finished = cur.fetchall()
            cur.nextset()
            names = [col.name for col in cur.description or ()]
            claimed = [dict(zip(names, row, strict=True)) for row in cur.fetchall()]
        return self._written(outcomes, finished), _jobs(claimed)

    def extend_leases(
        self, jobs: Iterable[Job], *, default_timeout: float = 600, ttl: float = 900, lease_grace: float = 60
    ) -> dict[int, float]:
        """Renew the leases of jobs this drainer still holds (fenced per row); returns the seconds
        left of each one renewed, by job id."""
        jobs = list(jobs)
        if not jobs:
            return {}
        rows = self._tuples("extend_leases", {
            **_held(jobs), "default_timeout": default_timeout, "ttl": ttl, "grace": lease_grace})
        return {int(r[0]): float(r[1]) for r in rows}

    def reap(self, older_than: float | dt.timedelta | None = None) -> dict[int, Status]:
        """Return expired claims to pending (or dead when no attempt is left).

        Without ``older_than``: claims whose lease expired. With it: claims older than that."""
        rows = self._run("reap", {"older_than": _as_float(older_than, "older_than")})
        return {r["id"]: Status(r["status"]) for r in rows}

    # -- operators ---------------------------------------------------------------------------

    def _status_of(self, job_id: int) -> dict[str, Any]:
        rows = self._run("status_of", {"id": job_id})
        if not rows:
            raise JobNotFound(f"no job with id {job_id}")
        return rows[0]

    def retry(self, job_id: int, *, children: bool = False) -> list[int]:
        """Make a dead or cancelled job pending and due now, with at least one attempt left (a
        workflow's child: waiting again for its parents that have not ended yet).

        ``children``: also its descendants that its failure cancelled wait again, for it (and their
        other parents not ended yet); returns their ids (without it, they stay cancelled)."""
        try:
            with db.errors_translated(self.schema), self._connection() as c, db.atomic(c), \
                    c.cursor(row_factory=dict_row) as cur:
                cur.execute(self._q["retry_lock_parents"], {"id": _job_id(job_id), "children": children})
                retried = cur.execute(self._q["retry"], {"id": _job_id(job_id), "channel": self.channel}).fetchall()
                revived = [r["id"] for r in cur.execute(self._q["retry_children"], {"id": job_id}).fetchall()] \
                    if retried and children else []
        except db.DuplicateValue:
            raise ValueError(f"job {job_id} has a key that a pending, running or waiting job holds now") from None
        if not retried:
            row = self._status_of(job_id)
            if row["status"] in (Status.DEAD, Status.CANCELLED):
                raise ValueError(f"job {job_id} already used {row['attempts']} attempts, the most a job"
                                 f" can have ({MAX_ATTEMPTS_CEILING}); enqueue it again instead")
            raise ValueError(f"job {job_id} is {row['status']}; only dead or cancelled jobs can be retried")
        return revived

    def retry_all_dead(self) -> list[int]:
        """Retry every dead job that can have one more attempt (see :meth:`dead_at_the_ceiling`).
        A dead job whose key another job took meanwhile is skipped, also when that job's enqueue
        commits while this runs (the statement then fails on the key and runs again)."""
        for _ in range(RETRY_ALL_DEAD_TRIES - 1):
            try:
                return [r["id"] for r in self._run("retry_all_dead", {"channel": self.channel})]
            except db.DuplicateValue:
                continue
        return [r["id"] for r in self._run("retry_all_dead", {"channel": self.channel})]

    def dead_at_the_ceiling(self) -> list[int]:
        """Dead jobs that already used the most attempts a job can have: no retry can help them."""
        return [r["id"] for r in self._run("dead_at_the_ceiling", {})]

    def cancel(self, job_id: int) -> Status:
        """Cancel a job. A pending or waiting one is cancelled at once (returns CANCELLED; a
        workflow's waiting descendants follow the failure rules). A running one is
        marked (returns RUNNING): the drainer holding it kills its sandbox within about a second
        and the job ends cancelled, with no further attempt; if it finishes first, it is done."""
        rows = self._run("cancel", {"id": _job_id(job_id)})
        if not rows:
            status = self._status_of(job_id)["status"]
            raise ValueError(f"job {job_id} is {status}; only pending or running jobs can be cancelled")
        return Status(rows[0]["status"])

    def cancel_requested(self, jobs: Iterable[Job]) -> set[tuple[int, uuid.UUID]]:
        """Which of these claims (job id, claim token) an operator asked to cancel (the drainer's
        poll). A request reaches only the claim holding the job now."""
        jobs = list(jobs)
        if not jobs:
            return set()
        return set(self._tuples("cancel_requested", _held(jobs)))

    def delete(self, job_id: int) -> None:
        """Delete a finished (done, dead or cancelled) job and its attempt history (the attempt
        counters of ``/metrics`` keep counting its attempts)."""
        if not self._delete_folding("delete", {"id": _job_id(job_id)}):
            status = self._status_of(job_id)["status"]
            raise ValueError(f"job {job_id} is {status}; only done, dead or cancelled jobs can be deleted"
                             " (cancel it first)")

    def _delete_folding(self, name: str, params: dict[str, Any], *, wait: bool = True) -> list[dict[str, Any]]:
        """Run ``delete``, which adds the deleted jobs' not yet folded attempts
        to /metrics' running totals, after the fold's lock in the same transaction (see
        ``fold_lock``): deleting jobs never lowers the attempt counters. ``wait=False``: delete
        nothing (an empty list) when a fold or another such delete holds the lock."""
        params = {**params, **bucket_params([float(b) for b in DURATION_BUCKETS])}
        with (db.errors_translated(self.schema), self._connection() as c, db.atomic(c),
              c.cursor(row_factory=dict_row) as cur):
            if not self._fold_locked(cur, wait):
                return []
            cur.execute(self._q[name], params, prepare=False)
            return cur.fetchall()

    def _fold_locked(self, cur: psycopg.Cursor[dict[str, Any]], wait: bool) -> bool:
        """The fold's lock (``fold_lock``) for this transaction; ``wait=False``: False at once
        when a fold or another such delete holds it."""
        if wait:
            cur.execute(self._q["fold_lock"])
            return True
        cur.execute(self._q["fold_try_lock"])
        got = cur.fetchone()
        return bool(got and got["got"])

    def maintenance_turn(self, name: str, every: float) -> bool:
        """Whether this caller runs the periodic task ``name`` now: True for the one caller, of any
        number of drains on any hosts, that finds it last ran ``every`` seconds ago or more (the
        run is recorded at once); the others do not wait."""
        return bool(self._run("maintenance_turn", {"name": name, "every": float(every)}))

    def run_now(self, job_id: int) -> None:
        """Make a pending job due now (it keeps its attempts)."""
        if not self._run("run_now", {"id": _job_id(job_id), "channel": self.channel}):
            status = self._status_of(job_id)["status"]
            if status == Status.WAITING:
                raise ValueError(f"job {job_id} is waiting for its parents (a workflow); it runs once they are done")
            raise ValueError(f"job {job_id} is {status}; only pending jobs can be run now")

    # -- queue settings ----------------------------------------------------------------------

    def pause_queue(self, name: str) -> QueueSettings:
        """Pause queue ``name``: from the next claim on, no drain takes its jobs (they stay pending;
        jobs already running finish). Works for a queue with no jobs yet."""
        return self._set_queue(name, paused=True)

    def resume_queue(self, name: str) -> QueueSettings:
        """Resume queue ``name``: its due jobs are claimed again (watchers are woken at once)."""
        return self._set_queue(name, paused=False)

    def set_queue_concurrency(self, name: str, concurrency: int | None) -> QueueSettings:
        """At most ``concurrency`` jobs of queue ``name`` running at once across every drainer on
        every host (None: no limit)."""
        if concurrency is not None and (isinstance(concurrency, bool) or not isinstance(concurrency, int)
                                        or not 1 <= concurrency <= _PG_INT):
            raise ValueError(f"invalid concurrency {concurrency!r}: a positive integer (or None for no limit)")
        return self._set_queue(name, concurrency=concurrency, set_concurrency=True)

    def _set_queue(self, name: str, *, paused: bool | None = None, concurrency: int | None = None,
                   set_concurrency: bool = False) -> QueueSettings:
        rows = self._run("queue_settings_set", {
            "queue": validate_queue_name(name), "paused": paused, "concurrency": concurrency,
            "set_concurrency": set_concurrency, "channel": self.channel})
        self._limits_read_at = -float("inf")  # this process sees its own change at once
        r = rows[0]
        return QueueSettings(queue=r["queue"], paused=r["paused"], concurrency=r["concurrency"])

    def remove_queue_settings(self, name: str) -> bool:
        """Forget queue ``name``'s pause and concurrency (a misspelt name's, say): True if it had any."""
        rows = self._run("queue_settings_remove", {"queue": validate_queue_name(name), "channel": self.channel})
        self._limits_read_at = -float("inf")
        return bool(rows)

    def queues(self) -> list[dict[str, Any]]:
        """Every queue with jobs or settings, by name: ``queue``, ``paused``, ``concurrency`` and
        its job counts (``pending``, ``running``, ``done``, ``dead``, ``cancelled``, ``waiting``: a
        workflow's children waiting for their parents)."""
        self.compact_counts()
        return [{**r, **{s: int(r[s]) for s in ("pending", "running", "done", "dead", "cancelled", "waiting")}}
                for r in self._run("queue_list", {})]

    # -- periodic jobs -----------------------------------------------------------------------

    def add_schedule(self, schedule: Schedule) -> bool:
        """Store a schedule (replacing one of the same name). True if it is new."""
        if schedule.max_attempts is not None and (
                isinstance(schedule.max_attempts, bool) or not 1 <= schedule.max_attempts <= 1000):
            raise ValueError("max_attempts must be an integer from 1 to 1000")
        rows = self._run("schedule_add", {
            "name": schedule.name, "cron": schedule.cron, "timezone": schedule.timezone, "kind": schedule.kind,
            "payload": encode_payload(schedule.payload, self.max_payload_bytes), "queue": schedule.queue,
            "max_attempts": schedule.max_attempts, "priority": schedule.priority,
            "timeout": schedule.timeout_seconds, "channel": self.channel, "schedules_changed": SCHEDULES_CHANGED})
        return bool(rows and rows[0]["created"])  # no row: stored already as it is

    def remove_schedule(self, name: str) -> None:
        if not self._run("schedule_remove", {"name": name, "channel": self.channel,
                                             "schedules_changed": SCHEDULES_CHANGED}):
            raise JobNotFound(f"no schedule named {name!r}")

    def schedules(self) -> tuple[list[tuple[Schedule, dt.datetime, dt.datetime | None]], dt.datetime]:
        """Every schedule with its creation time and latest enqueued occurrence, and the
        database's clock now."""
        rows = self._run("schedules", {})
        out = [(Schedule(name=r["name"], cron=r["cron"], kind=r["kind"], payload=r["payload"],
                         timezone=r["timezone"], queue=r["queue"], max_attempts=r["max_attempts"],
                         priority=r["priority"], timeout_seconds=r["timeout_seconds"]),
                r["created_at"], r["last_tick"]) for r in rows]
        now = rows[0]["now"] if rows else dt.datetime.now(dt.UTC)
        return out, now

    def enqueue_ticks(self, due: Sequence[tuple[str, dt.datetime]], *, forget_before: dt.datetime) -> int:
        """Enqueue each (schedule, occurrence) not enqueued before, exactly once across all
        drainers; forget recorded occurrences before ``forget_before``. Returns how many."""
        rows = self._run("enqueue_ticks", {
            "names": [n for n, _ in due], "ticks": [t for _, t in due], "channel": self.channel,
            "forget_before": forget_before})
        return int(rows[0]["n"])

    def get(self, job_id: int) -> dict[str, Any]:
        rows = self._run("get", {"id": _job_id(job_id)})
        if not rows:
            raise JobNotFound(f"no job with id {job_id}")
        return rows[0]

    def wait(self, job_id: int, timeout: float | dt.timedelta | None = None) -> Finished:
        """Block until job ``job_id`` is done, dead or cancelled and return how it ended, woken
        by the NOTIFY its finish sends (migration 019), not by polling. ``timeout`` (seconds;
        None: forever): :class:`WaitTimeout`, a ``TimeoutError`` naming the job's status then.
        Listens on a connection of its own (a pool's, or one opened from the DSN); with only a
        caller's connection, that one, which must then be in autocommit."""
        job_id = _job_id(job_id)
        limit = _as_float(timeout, "timeout")
        if limit is not None and limit < 0:
            raise ValueError(f"timeout must be at least 0 seconds, not {limit!r}")
        deadline = None if limit is None else time.monotonic() + limit
        with db.errors_translated(self.schema), self._listener() as conn:
            channel = sql.Identifier(finished_channel(self.schema)).as_string(conn)
            conn.execute(f"LISTEN {channel}".encode())
            try:
                with conn.cursor(row_factory=dict_row) as cur:
                    if cur.execute(self._q["wait_mark"], {"id": job_id}).fetchone() is None:
                        raise JobNotFound(not_to_wait_for(job_id))
                    row = self._wait_read(cur, job_id)
                    while row is not None and row["status"] not in FINAL_STATUSES:
                        left = None if deadline is None else deadline - time.monotonic()
                        if left is not None and left <= 0:
                            raise WaitTimeout(job_id, row["status"], limit or 0.0)
                        # woken by a NOTIFY naming it; read again at least every WAIT_RECHECK
                        # seconds all the same (a job deleted under it, a lost connection's gap)
                        # (any note: reading the row again costs less than parsing every id)
                        list(conn.notifies(timeout=WAIT_RECHECK if left is None else min(WAIT_RECHECK, left),
                                           stop_after=1))
                        row = self._wait_read(cur, job_id)
                if row is None:
                    raise JobNotFound(f"job {job_id} was deleted while waited for")
                return Finished.of(row)
            finally:
                with contextlib.suppress(psycopg.Error):
                    conn.execute(self._q["wait_done"], {"id": job_id})
                    conn.execute(f"UNLISTEN {channel}".encode())

    def _wait_read(self, cur: psycopg.Cursor[dict[str, Any]], job_id: int) -> dict[str, Any] | None:
        """The waited job's row (None: deleted). An unfinished row that a transaction has touched
        is read again once that transaction has ended: it may be a finish whose trigger ran before
        this waiter's row was visible, which NOTIFYs no one (wait_read's comment)."""
        row = cur.execute(self._q["wait_read"], {"id": job_id}).fetchone()
        if row is not None and row["status"] not in FINAL_STATUSES and row["touched"]:
            row = cur.execute(self._q["wait_read_settled"], {"id": job_id}).fetchone()
        return row

    @contextmanager
    def _listener(self) -> Iterator[psycopg.Connection[Any]]:
        """A connection that may LISTEN: never the queue's shared one (its notifications would
        mix with other calls'), but a pool's, a new one from the DSN, or the caller's."""
        if self._pool is not None:
            with self._pool.connection() as pooled:
                pooled.autocommit = True
                yield pooled
            return
        if self._dsn is not None:
            with db.connect(self._dsn, autocommit=True) as own:
                yield own
            return
        assert self._conn is not None
        if not self._conn.autocommit:
            raise ValueError("wait() needs a connection in autocommit (or a DSN or pool): "
                             "a LISTEN inside a transaction hears nothing until it commits")
        yield self._conn

    def graph(self, job_id: int, limit: int = 100) -> dict[str, Any]:
        """A job's place in a workflow: ``parents`` and ``children`` (up to ``limit`` each, by id:
        id, kind, status, finished_at), how many of each it has (``n_parents``, ``n_children``),
        and its children by status (``children_by_status``). JobNotFound if there is no such job."""
        job_id = _job_id(job_id)
        counts = self._run("job_graph_counts", {"id": job_id})[0]
        if not counts["parents"] and not counts["children"]:
            self._status_of(job_id)
        return {"parents": self._run("job_parents", {"id": job_id, "limit": limit}) if counts["parents"] else [],
                "children": self._run("job_children", {"id": job_id, "limit": limit}) if counts["children"] else [],
                "n_parents": counts["parents"], "n_children": counts["children"],
                "children_by_status": counts["children_by_status"]}

    def attempts(self, job_id: int) -> list[dict[str, Any]]:
        """The job's attempt history, oldest first: attempt, outcome (done; failed: failed with
        attempts left; retried: its handler raised Retry; dead; discarded; snoozed; released;
        expired; cancelled), snooze (a snoozed row's count: the job's Nth snooze), host, pid, tier,
        started_at, finished_at, exit_code, signal, kill_reason, duration_seconds, error_head.
        JobNotFound if there is no such job."""
        rows = self._run("attempts", {"id": _job_id(job_id)})
        if not rows:
            self._status_of(job_id)
        return rows

    def list(
        self, *, status: str | None = None, kind: str | None = None, queue: str | None = None, limit: int = 50,
        before: int | None = None,
    ) -> list[dict[str, Any]]:
        """Jobs newest first, ``limit`` at a time; ``before`` (an id) gives the next page."""
        if status is not None and status not in {s.value for s in Status}:
            raise ValueError(f"unknown status {status!r} (one of {', '.join(s.value for s in Status)})")
        if kind is not None:
            validate_kind(kind)
        if queue is not None:
            validate_queue_name(queue)
        if not 1 <= limit <= 100_000:
            raise ValueError("limit must be from 1 to 100000")
        if before is not None:
            _job_id(before)
        return self._run("list", {"status": status, "kind": kind, "queue": queue, "limit": limit, "before": before})

    def forget_waiters(self, limit: int = 1000) -> int:
        """Delete up to ``limit`` waiter rows (:meth:`wait`'s) whose job has finished or is gone
        (``forget_waiters`` in queries.sql); returns how many."""
        with db.errors_translated(self.schema), self._connection() as c, db.atomic(c), c.cursor() as cur:
            cur.execute(self._q["forget_waiters"], {"limit": int(limit)})
            return cur.rowcount

    def compact_counts(self) -> None:
        """Fold job_counts' rows into one per (queue, kind, status) (``compact_counts`` in
        queries.sql); the reads of the counts call it first, so they sum a few rows. When another
        fold holds the table's lock (``counts_lock``) this one folds nothing; so too, quietly, on
        a connection that may not write (a role granted only SELECT, a standby): the reads then
        sum the rows as they are, the same counts."""
        try:
            with db.errors_translated(self.schema), self._connection() as c, db.atomic(c), c.cursor() as cur:
                cur.execute(self._q["counts_lock"] + " NOWAIT")
                cur.execute(self._q["compact_counts"])
        except (db.LockTimeout, db.CannotWrite):
            pass

    def recount(self) -> int:
        """Make job_counts again from the jobs table, holding off job writes meanwhile (``fleetless
        init --recount``). Returns how many (queue, kind, status) counts were wrong."""
        with db.errors_translated(self.schema), self._connection() as c, c.transaction(), c.cursor() as cur:
            cur.execute(self._q["counts_lock"])
            cur.execute(self._q["lock_jobs_share"])
            cur.execute(self._q["recount"])
            row = cur.fetchone()
        return int(row[0]) if row else 0

    def held_back(self, kinds: Mapping[str, KindSettings] | None = None) -> Sequence[dict[str, Any]]:
        """What a pause or a limit holds back now: each paused queue (``why`` "paused"), each queue
        and each kind of ``kinds`` (fleetless.toml) with a due job whose concurrency or rate is
        reached (``why`` "concurrency" or "rate", ``limit`` its text). ``what``: "queue" or "kind"."""
        limited = sorted((k, ks) for k, ks in (kinds or {}).items() if ks.limited)
        rows = self._run("held_back", {
            "kinds": [k for k, _ in limited], "concurrency": [ks.concurrency for _, ks in limited],
            "rate": [ks.rate.count if ks.rate else None for _, ks in limited],
            "seconds": [ks.rate.seconds if ks.rate else None for _, ks in limited]})
        held: list[dict[str, Any]] = []
        for r in rows:
            base = {"what": r["what"], "name": r["name"]}
            if r["paused"]:
                held.append({**base, "why": "paused", "limit": None})
            elif r["due"] and r["concurrency"] is not None and r["running"] >= r["concurrency"]:
                held.append({**base, "why": "concurrency", "limit": str(r["concurrency"])})
            elif r["due"] and r["rate"] is not None and r["started"] >= r["rate"]:
                held.append({**base, "why": "rate", "limit": f"{r['rate']}/{r['window']:g}s"})
        return held

    def stats(self, kinds: Mapping[str, KindSettings] | None = None) -> dict[str, Any]:
        """Counts by status and by kind, the oldest due job's wait, when the next is due, and what
        is held back (:meth:`held_back`; kinds' limits from ``kinds``, fleetless.toml)."""
        self.compact_counts()
        counts = self._run("counts", {})
        by_status = {s.value: 0 for s in Status}
        by_kind: dict[str, dict[str, int]] = {}
        for r in counts:
            by_status[r["status"]] += r["n"]
            by_kind.setdefault(r["kind"], {})[r["status"]] = r["n"]
        times = self._run("pending_times", {})[0]
        return {
            "total": sum(by_status.values()),
            "by_status": by_status,
            "by_kind": by_kind,
            "oldest_due_age_seconds": times["oldest_due_age_seconds"],
            "next_due_in_seconds": times["next_due_in_seconds"],
            "held_back": self.held_back(kinds),
        }

    def prune_batch(self, ages: Mapping[str, float], *, limit: int | None = None, wait: bool = True) -> int:
        """Delete up to ``limit`` (None: all) finished jobs older than the age in seconds given
        for their status (``done``, ``cancelled``, ``dead``; a status not given is kept), oldest
        first, with their attempt history. Returns how many. ``wait=False``: none while a metrics
        fold or another pruner holds the fold's lock, instead of waiting for it."""
        unknown = set(ages) - {"done", "cancelled", "dead"}
        if unknown:
            raise ValueError(f"cannot prune status {', '.join(sorted(unknown))}: only done, cancelled, dead")
        return self.prune_pass(ages, limit=limit, wait=wait)[0]

    def prune_pass(self, ages: Mapping[str, float], *, limit: int | None = None,
                   wait: bool = True) -> tuple[int, bool]:
        """``prune_batch``, and whether workflow graphs are left that this pass did not look at.

        Jobs in no graph are read oldest first. Graphs are looked at a bounded number a pass
        (``limit``, as many as the rows), from where the last pass left off (a cursor kept in the
        database, across runs and drains), round and round; each graph is checked once (a few
        index probes) and, once all of it has finished and is past its ages, deleted as a whole,
        first in the batch. So a pass costs about the same however many old jobs of graphs still
        held there are. ``limit=None``: every graph, from the first."""
        unknown = set(ages) - {"done", "cancelled", "dead"}
        if unknown:
            raise ValueError(f"cannot prune status {', '.join(sorted(unknown))}: only done, cancelled, dead")
        params: dict[str, Any] = {s: _as_float(ages.get(s), f"{s} age") for s in ("done", "cancelled", "dead")}
        params["limit"] = limit
        params.update(bucket_params([float(b) for b in DURATION_BUCKETS]))
        with (db.errors_translated(self.schema), self._connection() as c, db.atomic(c),
              c.cursor(row_factory=dict_row) as cur):
            if not self._fold_locked(cur, wait):
                return 0, False
            after = 0
            if limit is not None:
                cur.execute(self._q["prune_graphs_at"])
                at = cur.fetchone()
                after = (at and at["position"]) or 0
            cur.execute(self._q["prune_graphs_next"], {"after": after, "graphs": limit})
            looked = [row["id"] for row in cur.fetchall()]
            cur.execute(self._q["prune_batch"], {**params, "graphs": looked}, prepare=False)
            gone = cur.fetchall()
            if limit is None:
                return len(gone), False
            in_graphs = [row["graph_id"] for row in gone if row["graph_id"] is not None]
            if len(in_graphs) >= limit:  # the last graph deleted from may have more: again next pass
                position, left = max(in_graphs) - 1, True
            elif len(looked) < limit:  # the last graph: round again from the first
                position, left = 0, False
            else:
                position, left = looked[-1], True
            cur.execute(self._q["prune_graphs_mark"], {"position": position})
            return len(gone), left

    def prune(self, older_than: float | dt.timedelta, *, include_dead: bool = False) -> int:
        """Delete done and cancelled (and, if asked, dead) jobs finished longer ago than that."""
        seconds = _as_float(older_than, "older_than")
        assert seconds is not None
        statuses = ["done", "cancelled"] + (["dead"] if include_dead else [])
        return self.prune_batch(dict.fromkeys(statuses, seconds))


#: What an enqueue_many item (and the call's defaults) may set besides kind and payload.
ITEM_OPTIONS = ("max_attempts", "run_after", "delay", "queue", "priority", "timeout", "key", "on_duplicate",
                "on_parent_failure")
#: What only an enqueue_many item may set: its client-side name, and its parents (job ids, or
#: names of earlier items of the same call).
GRAPH_OPTIONS = ("name", "after")


def with_defaults(jobs: Iterable[tuple[str, Any] | Mapping[str, Any]],
                  defaults: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """enqueue_many's items as dicts with the call's defaults under each item's own options."""
    for item in jobs:
        if isinstance(item, Mapping):
            yield {**defaults, **item}
        else:
            kind, payload = item
            yield {**defaults, "kind": kind, "payload": payload}


_PLACEHOLDER = re.compile(r"%\((\w+)\)s")


def _positional(query: str) -> tuple[str, tuple[str, ...]]:
    """``query`` with its named placeholders (``%(name)s``) as ``$1``, ``$2``... in the order
    each first appears, and their names in that order (``PREPARE`` takes positional ones)."""
    names: list[str] = []

    def number(m: re.Match[str]) -> str:
        if m.group(1) not in names:
            names.append(m.group(1))
        return f"${names.index(m.group(1)) + 1}"

    return _PLACEHOLDER.sub(number, query).replace("%%", "%"), tuple(names)


#: A NOTIFY payload must be shorter than 8,000 bytes (PostgreSQL's limit).
NOTIFY_PAYLOAD_BYTES = 7999
#: The payload a schedule's change (add, change, remove) NOTIFYs on the channel enqueues use: it
#: wakes every watcher, whatever its queues (each runs the scheduler for every schedule), to run a
#: scheduler pass at once. A queue name begins with a letter or digit, so none is this.
SCHEDULES_CHANGED = ":schedules"


def notify_payloads(queues: Iterable[str], limit: int = NOTIFY_PAYLOAD_BYTES) -> list[str]:
    """The queues as comma-separated payloads of at most ``limit`` bytes each, in name order
    (queue names are ASCII and at most 64 characters: each fits in one payload)."""
    payloads: list[str] = []
    for name in sorted(set(queues)):
        if payloads and len(payloads[-1]) + 1 + len(name) <= limit:
            payloads[-1] += "," + name
        else:
            payloads.append(name)
    return payloads


def _claim_params(
    n: int, *, queues: Sequence[str] | None = None, default_timeout: float = 600, ttl: float = 900,
    lease_grace: float = 60, claimed_by: str | None = None, tier: str | None = None, skip_kinds: Sequence[str] = (),
    token: uuid.UUID | None = None, kinds: Mapping[str, KindSettings] | None = None,
) -> dict[str, Any]:
    """The claim statements' parameters (``skip_kinds``: with the limited kinds, claimed apart)."""
    return {"n": n, "queues": list(queues) if queues else None, "skip_kinds": list(skip_kinds) or None,
            "token": token or uuid.uuid4(), "default_timeout": default_timeout, "ttl": ttl, "grace": lease_grace,
            "claimed_by": claimed_by, "tier": tier, "kinds": _claim_settings(kinds or {})}


def _all_default(params: Mapping[str, Any]) -> bool:
    """Whether a job's :meth:`Queue.job_params` are every option's default (but a key): the job the
    lean statements (enqueue_default, copy_default_jobs) write from the columns' defaults."""
    return bool(params["max_attempts_default"] and params["run_after"] is None and not params["delay"]
                and params["queue"] == "default" and params["priority"] == 0 and params["timeout"] is None)


def _finish_query(outcomes: Sequence[tuple[Job, Outcome]]) -> str:
    """finish_done when every outcome is done (it needs less of the server), else finish_many."""
    return "finish_done" if all(o.action == "done" for _, o in outcomes) else "finish_many"


def _finish_params(outcomes: Sequence[tuple[Job, Outcome]]) -> dict[str, Any]:
    """finish_many's parameters: the outcomes as one JSON array of rows (see the statement)."""
    tokens: dict[uuid.UUID, str] = {}  # a claim's jobs share its token: one str() per claim
    rows = []
    # in id order, as the statement then reads them: its row locks are taken in the order other
    # writers of several rows take theirs (a workflow enqueue locks its parents by id)
    for job, o in sorted(outcomes, key=lambda item: item[0].id):
        run = o.run or _NO_RUN
        token = tokens.get(job.claim_token)
        if token is None:
            token = tokens[job.claim_token] = str(job.claim_token)
        rows.append((job.id, token, o.action, o.permanent, float(o.delay),
                     None if o.error is None else clean_text(o.error, MAX_ERROR_CHARS, keep="tail"),
                     None if o.result is None else result_text(o.result, cut=o.result_cut),
                     o.result_json, run.tier, run.exit_code, run.signal,
                     None if run.kill_reason is None else clean_text(run.kill_reason, 500), o.decided))
    return {"rows": _ROWS_JSON.encode(rows), "host": socket.gethostname(), "pid": os.getpid(),
            "max_releases": MAX_RELEASES, "max_snoozes": MAX_SNOOZES}


def _claim_settings(kinds: Mapping[str, KindSettings]) -> str | None:
    """What the claim statements apply per kind, as JSON (None: nothing set)."""
    out = {}
    for kind, ks in kinds.items():
        own = {key: value for key, value in (("tier", ks.tier), ("max_attempts", ks.max_attempts),
                                             ("batch_size", ks.batch_size)) if value is not None}
        if own:
            out[kind] = own
    return json.dumps(out) if out else None


def _held(jobs: Sequence[Job]) -> dict[str, Any]:
    """Claims a drainer holds, as the statements that renew or poll them take them: the ids as one
    array literal (psycopg dumps a list element by element, in Python; a drain holds thousands),
    and the few distinct claim tokens (one per claim statement)."""
    return {"ids": "{" + ",".join([str(j.id) for j in jobs]) + "}",
            "tokens": list({j.claim_token for j in jobs})}


def _jobs(rows: list[dict[str, Any]]) -> list[Job]:
    jobs = [
        Job(id=r["id"], kind=r["kind"], payload_json=r["payload_json"], attempts=r["attempts"],
            max_attempts=r["max_attempts"], claim_token=r["claim_token"],
            timeout_seconds=r["timeout_seconds"], queue=r["queue"], priority=r["priority"],
            lease_seconds=r["lease_seconds"], snoozes=r["snoozes"], releases=r["releases"])
        for r in rows
    ]
    jobs.sort(key=lambda j: (-j.priority, j.id))
    return jobs


def _job_id(job_id: object) -> int:
    if isinstance(job_id, bool) or not isinstance(job_id, int) or not 1 <= job_id < 2**63:
        raise ValueError(f"invalid job id {job_id!r}: a positive integer")
    return job_id
