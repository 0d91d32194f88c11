"""Enqueueing and waiting from asyncio apps, on psycopg's ``AsyncConnection`` or on asyncpg.

:class:`AsyncQueue` is :class:`fleetless.Queue`'s enqueue side for ``async`` code: the same
checks, the same SQL (``sql/queries.sql``) and the same guarantees. Given ``conn=``, a write joins
that connection's open transaction and exists only if the app commits it. Drains stay synchronous
command-line processes; nothing here claims or runs jobs.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import os
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager
from typing import Any, Literal

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from . import db
from .graphs import Labels
from .job import MAX_PAYLOAD_BYTES
from .queue import (
    FINAL_STATUSES,
    ITEM_OPTIONS,
    WAIT_RECHECK,
    DuplicateJob,
    Enqueued,
    Finished,
    JobNotFound,
    OnDuplicate,
    OnParentFailure,
    Queue,
    WaitTimeout,
    _parent_ids,
    finished_channel,
    keyed_answer,
    no_job_with_ids,
    not_to_wait_for,
    notify_payloads,
    with_defaults,
)

__all__ = ["AsyncQueue"]

#: A connection the app passes: psycopg's AsyncConnection or an asyncpg Connection.
AnyConnection = Any


class _StartOver(Exception):
    """Rolls a savepoint back to take its locks again (AsyncQueue._read_labels)."""


def _is_asyncpg(conn: object) -> bool:
    return type(conn).__module__.startswith("asyncpg")


class AsyncQueue:
    """The jobs table of one schema, for asyncio code.

    ``db_`` is a DSN (each call opens a connection of its own with ``driver``, psycopg or
    asyncpg) or an open connection of either driver used as it is. Every method takes ``conn=``:
    the call then runs on that connection, inside its transaction if one is open. As with
    :class:`Queue`, ``db_`` defaults to ``$DATABASE_URL`` and ``schema`` to ``$FLEETLESS_SCHEMA``.
    """

    def __init__(self, db_: str | AnyConnection | None = None, *, schema: str | None = None,
                 driver: Literal["psycopg", "asyncpg"] = "psycopg",
                 max_payload_bytes: int = MAX_PAYLOAD_BYTES) -> None:
        if db_ is None:
            db_ = os.environ.get("DATABASE_URL") or None
            if db_ is None:
                raise ValueError("no database given: pass a DSN or connection to AsyncQueue() or set DATABASE_URL")
        if driver not in ("psycopg", "asyncpg"):
            raise ValueError(f"driver must be psycopg or asyncpg, not {driver!r}")
        self._dsn = db_ if isinstance(db_, str) else None
        self._conn = None if isinstance(db_, str) else db_
        self._driver = driver
        # The synchronous queue checks arguments and holds the statements; it never connects here.
        self._shape = Queue(self._dsn or "postgresql://", schema=schema, max_payload_bytes=max_payload_bytes)
        self.schema = self._shape.schema
        self.channel = self._shape.channel

    # -- connections -------------------------------------------------------------------------

    @asynccontextmanager
    async def _connection(self, conn: AnyConnection | None = None) -> AsyncIterator[AnyConnection]:
        if conn is not None or self._conn is not None:
            yield conn if conn is not None else self._conn
            return
        assert self._dsn is not None
        if self._driver == "asyncpg":
            import asyncpg

            try:
                own = await asyncpg.connect(asyncpg_dsn(self._dsn))
            except (OSError, asyncpg.PostgresError) as exc:
                raise db.DatabaseUnavailable(f"cannot connect to the database: {db.redacted(str(exc))}") from None
            try:
                yield own
            finally:
                await own.close()
            return
        try:
            aconn = await psycopg.AsyncConnection.connect(self._dsn, autocommit=True)
        except psycopg.OperationalError as exc:
            raise db.DatabaseUnavailable(f"cannot connect to the database: {db.redacted(str(exc))}") from None
        async with aconn:
            yield aconn

    async def _execute(self, conn: AnyConnection, name: str, params: Mapping[str, Any]) -> list[dict[str, Any]]:
        """One named statement on either driver: named placeholders become asyncpg's $n."""
        if _is_asyncpg(conn):
            import asyncpg

            query, values = self._shape.bind(name, params, positional=True)
            try:
                rows = await conn.fetch(query, *values)
            except asyncpg.UniqueViolationError as exc:
                raise db.DuplicateValue(f"database refused a duplicate: {exc}") from exc
            except asyncpg.UndefinedTableError as exc:
                raise db.SchemaNotInitialised(
                    f"schema {self.schema} is not initialised: run 'fleetless init'") from exc
            except (asyncpg.DataError, asyncpg.IntegrityConstraintViolationError) as exc:
                raise db.ValueNotStorable(f"database refused a value: {exc}") from exc
            except asyncpg.TransactionRollbackError as exc:  # a deadlock, a serialization failure
                raise db.TransactionConflict(f"{db._first_line(exc)}: retry the transaction") from exc
            except asyncpg.PostgresError as exc:
                raise db.DatabaseError(f"database: {db._first_line(exc)}") from exc
            return [dict(r) for r in rows]
        with db.errors_translated(self.schema):
            async with conn.cursor(row_factory=dict_row) as cur:
                await cur.execute(*self._shape.bind(name, params))
                return await cur.fetchall() if cur.description else []

    @asynccontextmanager
    async def _atomic(self, conn: AnyConnection) -> AsyncIterator[None]:
        """All or none, inside the caller's transaction when one is open (a savepoint), as
        :func:`fleetless.db.atomic` for the synchronous queue."""
        if _is_asyncpg(conn):
            async with conn.transaction():
                yield
            return
        if not conn.autocommit and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
            await conn.execute(db._raw_queries()["open_transaction"])
        async with conn.transaction():
            yield

    # -- enqueue -----------------------------------------------------------------------------

    async def enqueue(
        self, kind: str, payload: Any, *, max_attempts: int | None = None, run_after: dt.datetime | None = None,
        delay: float | dt.timedelta | None = None, queue: str = "default", priority: int = 0,
        timeout: float | dt.timedelta | None = None, key: str | None = None, on_duplicate: OnDuplicate = "existing",
        after: Iterable[int] | None = None, on_parent_failure: OnParentFailure = "cancel",
        conn: AnyConnection | None = None,
    ) -> Enqueued:
        """As :meth:`Queue.enqueue`: one job, its id (an :class:`Enqueued`); ``after``: a workflow's
        child (docs/workflows.md)."""
        params = self._shape.job_params(
            kind, payload, max_attempts=max_attempts, run_after=run_after, delay=delay, queue=queue,
            priority=priority, timeout=timeout, key=key, on_duplicate=on_duplicate,
            on_parent_failure=on_parent_failure)
        parents = _parent_ids(after) if after is not None else []
        async with self._connection(conn) as c:
            if parents:
                async with self._atomic(c):
                    labels = Labels()
                    if key is not None:
                        return await self._enqueue_keyed_after(c, {**params, "parents": parents}, labels)
                    child = await self._enqueue_waiting(c, {**params, "parents": parents})
                    labels.child(child, parents)
                    await self._settle(c, labels, [child])
                    return Enqueued(child)
            return await self._enqueue_params(c, params)

    async def _settle(self, conn: AnyConnection, labels: Labels, children: list[int]) -> None:
        """As :meth:`Queue._settle`: the children's graphs labelled, then the children settled."""
        found: dict[int, int] = {}
        ids = labels.unread()
        if ids:
            found = await self._read_labels(conn, labels, ids)
        relabel, assign = labels.step(found, children)
        while relabel["old"] and (await self._execute(conn, "graph_relabel", relabel))[0]["n"]:
            pass  # again, with a new snapshot: a child another enqueue added meanwhile
        await self._execute(conn, "graph_label_set", assign)
        await self._execute(conn, "settle_children", {"ids": children, "channel": self.channel})

    async def _read_labels(self, conn: AnyConnection, labels: Labels, ids: list[int]) -> dict[int, int]:
        """As :meth:`Queue._read_labels`: a join locks its graphs' slots first, in order, and
        starts over (a savepoint rolled back) should one have joined another meanwhile."""
        slots: list[int] = []
        if labels.may_join(ids):
            peek = await self._execute(conn, "graph_labels_peek", {"ids": ids})
            slots = labels.join_slots({r["id"]: r["graph_id"] for r in peek})
        while slots:
            try:
                async with conn.transaction():
                    await self._execute(conn, "graph_join_lock", {"slots": slots})
                    found = await self._locked_labels(conn, ids)
                    more = set(labels.join_slots(found)) - set(slots)
                    if not more:
                        return found
                    slots = sorted({*slots, *more})
                    raise _StartOver  # this savepoint's locks go back
            except _StartOver:
                pass
        return await self._locked_labels(conn, ids)  # one graph: it stays one (graphs only ever merge)

    async def _locked_labels(self, conn: AnyConnection, ids: list[int]) -> dict[int, int]:
        await self._execute(conn, "graph_label_fresh", {"ids": ids})
        return {r["id"]: r["graph_id"] for r in await self._execute(conn, "graph_labels", {"ids": ids})
                if r["graph_id"] is not None}

    async def _enqueue_keyed_after(self, conn: AnyConnection, params: dict[str, Any], labels: Labels) -> Enqueued:
        """As :meth:`Queue._enqueue_keyed_after`: a keyed child, or the job holding its key."""
        parents = params["parents"]
        missing = [r["id"] for r in await self._execute(conn, "lock_parents_missing", {"ids": parents})]
        if missing:
            raise ValueError(f"after: {no_job_with_ids(missing)}")
        for _ in range(5):  # a duplicate committed after the statement's snapshot: look again
            rows = await self._execute(conn, "enqueue_keyed_waiting",
                                       {**params, "after": sorted(parents), "channel": self.channel})
            if rows:
                if rows[0]["inserted"]:
                    labels.child(rows[0]["id"], parents)
                    await self._settle(conn, labels, [rows[0]["id"]])
                return keyed_answer(params, rows[0], parents)
        raise RuntimeError(f"key {params['key']!r}: the job holding it kept changing; try again")

    async def _enqueue_waiting(self, conn: AnyConnection, params: dict[str, Any]) -> int:
        """A workflow's child, written waiting with its edges (settle_children decides its status)."""
        rows = await self._execute(conn, "enqueue_waiting", {**params, "after": params["parents"]})
        if not rows:
            missing = [r["id"] for r in await self._execute(conn, "missing_jobs", {"ids": params["parents"]})]
            raise ValueError(f"after: {no_job_with_ids(missing)}")
        return int(rows[0]["id"])

    async def _enqueue_params(self, conn: AnyConnection, params: dict[str, Any]) -> Enqueued:
        params = {**params, "channel": self.channel}
        if params["key"] is None:
            (row,) = await self._execute(conn, "enqueue", params)
            return Enqueued(row["id"])
        for _ in range(5):  # a duplicate committed after the statement's snapshot: look again
            rows = await self._execute(conn, "enqueue_keyed", params)
            if rows:
                return keyed_answer(params, rows[0])
        raise RuntimeError(f"key {params['key']!r}: the job holding it kept changing; try again")

    async def enqueue_many(self, jobs: Iterable[tuple[str, Any] | Mapping[str, Any]], *,
                           conn: AnyConnection | None = None, **defaults: Any) -> list[int]:
        """As :meth:`Queue.enqueue_many`: all or none, ids in order; the call's options are every
        item's defaults. Unkeyed jobs go in one statement, keyed ones one statement each."""
        unknown = set(defaults) - set(ITEM_OPTIONS)
        if unknown:
            raise ValueError(f"enqueue_many: unknown default option(s) {', '.join(sorted(unknown))}")
        items = list(with_defaults(jobs, defaults))
        if any(isinstance(item, Mapping) and ("after" in item or "name" in item) for item in items):
            return await self._enqueue_graph(items, conn)
        rows = [self._shape.item_params(i, item) for i, item in enumerate(items)]
        if not rows:
            return []
        ids: list[int] = [0] * len(rows)
        plain = [i for i, r in enumerate(rows) if r["key"] is None]
        async with self._connection(conn) as c, self._atomic(c):
            if plain:
                got = await self._execute(c, "enqueue_rows", {
                    "kinds": [rows[i]["kind"] for i in plain], "payloads": [rows[i]["payload"] for i in plain],
                    "max_attempts": [rows[i]["max_attempts"] for i in plain],
                    "run_afters": [rows[i]["run_after"] for i in plain],
                    "delays": [rows[i]["delay"] for i in plain], "queues": [rows[i]["queue"] for i in plain],
                    "priorities": [rows[i]["priority"] for i in plain],
                    "timeouts": [rows[i]["timeout"] for i in plain],
                    "defaults": [rows[i]["max_attempts_default"] for i in plain],
                })
                for i, job_id in zip(plain, sorted(r["id"] for r in got), strict=True):
                    ids[i] = job_id
            for i, r in enumerate(rows):
                if r["key"] is not None:
                    ids[i] = int(await self._enqueue_params(c, r))
            await self._execute(c, "notify", {"channel": self.channel,
                                              "payloads": notify_payloads(r["queue"] for r in rows)})
        return ids

    async def _enqueue_graph(self, items: list[Mapping[str, Any]], conn: AnyConnection | None) -> list[int]:
        """enqueue_many of a workflow (items with ``name`` or ``after``): one statement per item, in
        order (each item's parents are known by then), then the children settled in one statement;
        all in one transaction."""
        names: dict[str, int] = {}
        ids: list[int] = []
        children: list[int] = []
        labels = Labels()
        async with self._connection(conn) as c, self._atomic(c):
            for i, item in enumerate(items):
                r = self._shape.item_params(i, item, names)
                if r["parents"]:
                    try:
                        if r["key"] is not None:  # settled by its own statements, or an existing job
                            job_id = int(await self._enqueue_keyed_after(c, r, labels))
                        else:
                            job_id = await self._enqueue_waiting(c, r)
                            labels.child(job_id, r["parents"])
                            children.append(job_id)
                    except DuplicateJob:
                        raise
                    except ValueError as exc:
                        raise ValueError(f"job #{i}: {exc}") from None
                else:
                    written = await self._enqueue_params(c, r)
                    job_id = int(written)
                    if r["name"] is not None and not written.existing:
                        labels.wrote(job_id)
                if r["name"] is not None:
                    names[r["name"]] = job_id
                ids.append(job_id)
            if children:
                await self._settle(c, labels, children)
        return ids

    # -- reads -------------------------------------------------------------------------------

    async def get(self, job_id: int, *, conn: AnyConnection | None = None) -> dict[str, Any]:
        """The job's row, as :meth:`Queue.get`; :class:`JobNotFound` when there is none."""
        async with self._connection(conn) as c:
            rows = await self._execute(c, "get", {"id": int(job_id)})
        if not rows:
            raise JobNotFound(f"no job with id {job_id}")
        return _decoded(rows[0])

    async def attempts(self, job_id: int, *, conn: AnyConnection | None = None) -> list[dict[str, Any]]:
        """The job's attempt history, oldest first, as :meth:`Queue.attempts` (outcome in the
        history's words: failed, retried, snoozed with its ``snooze`` count, discarded, ...);
        :class:`JobNotFound` when there is no such job."""
        async with self._connection(conn) as c:
            rows = await self._execute(c, "attempts", {"id": int(job_id)})
            if not rows and not await self._execute(c, "status_of", {"id": int(job_id)}):
                raise JobNotFound(f"no job with id {job_id}")
        return [_decoded(r) for r in rows]

    async def wait(self, job_id: int, timeout: float | dt.timedelta | None = None) -> Finished:
        """As :meth:`Queue.wait`: until the job is done, dead or cancelled, woken by its finish's
        NOTIFY; :class:`WaitTimeout` after ``timeout`` seconds. Listens on a connection of its own
        when the queue has a DSN, else on the queue's connection (outside any transaction)."""
        job_id = int(job_id)
        limit = timeout.total_seconds() if isinstance(timeout, dt.timedelta) else timeout
        if limit is not None and limit < 0:
            raise ValueError(f"timeout must be at least 0 seconds, not {limit!r}")
        deadline = None if limit is None else time.monotonic() + limit
        channel = finished_channel(self.schema)
        async with self._connection() as c, self._listening(c, channel) as woken:
            if not await self._execute(c, "wait_mark", {"id": job_id}):
                raise JobNotFound(not_to_wait_for(job_id))
            try:
                found = await self._wait_read(c, job_id)
                while found and found[0]["status"] not in FINAL_STATUSES:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise WaitTimeout(job_id, found[0]["status"], limit or 0.0)
                    await woken(WAIT_RECHECK if left is None else min(WAIT_RECHECK, left))
                    found = await self._wait_read(c, job_id)
            finally:
                with contextlib.suppress(db.DatabaseError):
                    await self._execute(c, "wait_done", {"id": job_id})
        if not found:
            raise JobNotFound(f"job {job_id} was deleted while waited for")
        return Finished.of(_decoded(found[0]))

    async def _wait_read(self, conn: AnyConnection, job_id: int) -> list[dict[str, Any]]:
        """As :meth:`Queue._wait_read`: an unfinished row a transaction has touched is read again
        once that transaction has ended (a finish that could not see this waiter NOTIFYs no one)."""
        found = await self._execute(conn, "wait_read", {"id": job_id})
        if found and found[0]["status"] not in FINAL_STATUSES and found[0]["touched"]:
            found = await self._execute(conn, "wait_read_settled", {"id": job_id})
        return found

    @asynccontextmanager
    async def _listening(self, conn: AnyConnection, channel: str) -> AsyncIterator[Any]:
        """LISTEN on ``channel`` for the block; yields ``woken(timeout)``, which returns at the
        next notification or after ``timeout`` seconds."""
        if _is_asyncpg(conn):
            event = asyncio.Event()

            def heard(*_: object) -> None:
                event.set()

            await conn.add_listener(channel, heard)

            async def woken_asyncpg(seconds: float) -> None:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(event.wait(), seconds)
                event.clear()

            try:
                yield woken_asyncpg
            finally:
                await conn.remove_listener(channel, heard)
            return
        if not conn.autocommit:
            raise ValueError("wait() needs a connection in autocommit (or a DSN): "
                             "a LISTEN inside a transaction hears nothing until it commits")
        name = sql.Identifier(channel).as_string(conn)
        await conn.execute(f"LISTEN {name}".encode())

        async def woken_psycopg(seconds: float) -> None:
            async for _ in conn.notifies(timeout=seconds, stop_after=1):
                pass

        try:
            yield woken_psycopg
        finally:
            with contextlib.suppress(psycopg.Error):
                await conn.execute(f"UNLISTEN {name}".encode())


def asyncpg_dsn(dsn: str) -> str:
    """``dsn`` as asyncpg takes it: a URL as it is; libpq's ``key=value`` form as a URL."""
    if "://" in dsn:
        return dsn
    from urllib.parse import quote, urlencode

    params = psycopg.conninfo.conninfo_to_dict(dsn)
    user = quote(str(params.pop("user", "")), safe="")
    password = params.pop("password", None)
    auth = f"{user}:{quote(str(password), safe='')}@" if password is not None else (f"{user}@" if user else "")
    host, port = params.pop("host", ""), params.pop("port", None)
    netloc = f"{auth}{host}" + (f":{port}" if port else "")
    dbname = quote(str(params.pop("dbname", "")), safe="")
    rest = f"?{urlencode({k: str(v) for k, v in params.items()})}" if params else ""
    return f"postgresql://{netloc}/{dbname}{rest}"


def _decoded(row: dict[str, Any]) -> dict[str, Any]:
    """asyncpg returns json/jsonb columns as text: decode them as psycopg does."""
    for column in ("payload", "result_json"):
        if isinstance(row.get(column), str):
            row[column] = json.loads(row[column])
    return row
