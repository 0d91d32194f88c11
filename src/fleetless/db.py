"""Connecting to PostgreSQL, loading the named queries and running the schema migrations."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.pq import TransactionStatus

__all__ = [
    "DEFAULT_SCHEMA",
    "DatabaseError",
    "DatabaseUnavailable",
    "DuplicateValue",
    "CannotWrite",
    "LockTimeout",
    "PoolerError",
    "SchemaNotInitialised",
    "TransactionConflict",
    "ValueNotStorable",
    "atomic",
    "connect",
    "errors_translated",
    "migrate",
    "queries",
    "require_session",
    "shares_server_sessions",
    "validate_schema_name",
]

DEFAULT_SCHEMA = "fleetless"
#: The longest schema name: its waiters' NOTIFY channel, ``fleetless_<schema>_finished`` (LISTENed
#: by Queue.wait, notified by migration 019's trigger), must fit PostgreSQL's 63-byte names; a
#: longer one made every finish of a waited job fail (pg_notify: channel name too long).
MAX_SCHEMA_CHARS = 63 - len("fleetless__finished")
_SCHEMA_RE = re.compile(rf"[a-z_][a-z0-9_]{{0,{MAX_SCHEMA_CHARS - 1}}}")  # fullmatch: "$" matches before a final "\n"
_NAME_RE = re.compile(r"^-- name: (\S+)\s*$", re.MULTILINE)
#: How long `init` waits for another's LOCK TABLE migrations (a long migration) before giving up.
MIGRATION_LOCK_TIMEOUT = 300.0


#: The only server encoding fleetless runs on: payloads, results and errors are any Unicode text.
SUPPORTED_ENCODING = "UTF8"


class DatabaseError(RuntimeError):
    """A database error, said in one line. Driver errors become these here and nowhere else."""


class DatabaseUnavailable(DatabaseError, ConnectionError):
    """The connection is lost, refused or was terminated: the same call may work after a retry."""


class TransactionConflict(DatabaseUnavailable):
    """PostgreSQL aborted the transaction to break a deadlock or a serialization conflict with
    another session (SQLSTATE class 40): the connection is fine, the transaction is lost; run it
    again from its start. Said as ``deadlock detected: retry the transaction``. A
    DatabaseUnavailable, so that what retries those (the drain's own writes, an app's retry loop)
    retries this as before; its name and line no longer call it an outage."""


class SchemaNotInitialised(DatabaseError):
    """The schema or its table does not exist."""


class SchemaOutdated(SchemaNotInitialised):
    """The schema exists but lacks migrations this fleetless needs (``fleetless init`` adds them)."""


class ValueNotStorable(DatabaseError, ValueError):
    """The database refused a value (out of range, not encodable, a constraint)."""


class DuplicateValue(ValueNotStorable):
    """A unique index refused the row (a job key already held, ...)."""


class LockTimeout(DatabaseError):
    """A lock wait bounded by ``lock_timeout`` ran out: another session holds the row or table."""


class CannotWrite(DatabaseError):
    """The role may not write this (granted only SELECT, say) or the server takes no writes (a
    standby, a read-only transaction): the reads' own upkeep (compacting the counts, folding the
    attempt totals) is skipped on it."""


_URL_PASSWORD = re.compile(r"([\w.%+-]+):([^@\s\"'/]+)@")
_CONNINFO_PASSWORD = re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|[^\s\"]+)", re.IGNORECASE)


def redacted(text: str) -> str:
    """``text`` with any password a DSN in it carries (``user:secret@host`` in a URL, mistyped or
    not, and ``password=secret`` in conninfo) shown as ``***``: the driver's errors quote the
    connection string they could not parse, and those lines reach terminals and logs."""
    return _CONNINFO_PASSWORD.sub(r"\1***", _URL_PASSWORD.sub(r"\1:***@", text))


def _first_line(exc: BaseException) -> str:
    return redacted((str(exc).strip().splitlines() or [type(exc).__name__])[0])


@contextmanager
def errors_translated(schema: str = DEFAULT_SCHEMA) -> Iterator[None]:
    """The one boundary where psycopg's errors become fleetless's (as Procrastinate's
    ``wrap_exceptions``): callers above ``db`` and ``queue`` never see the driver."""
    try:
        yield
    except psycopg.errors.LockNotAvailable as exc:  # an OperationalError, but not an outage
        raise LockTimeout(f"lock wait timed out: {_first_line(exc)}") from exc
    except (psycopg.errors.InsufficientPrivilege, psycopg.errors.ReadOnlySqlTransaction) as exc:
        raise CannotWrite(f"database: {_first_line(exc)}") from exc
    except psycopg.OperationalError as exc:  # includes terminated backends and admin shutdown
        if (exc.sqlstate or "").startswith("40"):  # a deadlock (40P01), a serialization failure (40001)
            raise TransactionConflict(f"{_first_line(exc)}: retry the transaction") from exc
        raise DatabaseUnavailable(f"database unavailable: {_first_line(exc)}") from exc
    except psycopg.errors.UndefinedTable as exc:
        if f'"{schema}.jobs"' in str(exc):
            raise SchemaNotInitialised(f"schema {schema} is not initialised: run 'fleetless init'") from exc
        # a later migration's table (queue_settings, ...): an older schema, or none at all
        raise SchemaNotInitialised(f"schema {schema} is not initialised: run 'fleetless init' (or it is older"
                                   f" than this fleetless: {_first_line(exc)})") from exc
    except psycopg.errors.InvalidSchemaName as exc:
        raise SchemaNotInitialised(f"schema {schema} is not initialised: run 'fleetless init'") from exc
    except psycopg.errors.UndefinedColumn as exc:  # a query of this version on an older schema
        raise SchemaOutdated(f"schema {schema} is older than this fleetless ({_first_line(exc)}):"
                             " run 'fleetless init'") from exc
    except psycopg.errors.UniqueViolation as exc:
        raise DuplicateValue(f"database refused a duplicate: {_first_line(exc)}") from exc
    except (psycopg.DataError, psycopg.IntegrityError) as exc:
        raise ValueNotStorable(f"database refused a value: {_first_line(exc)}") from exc
    except psycopg.Error as exc:
        raise DatabaseError(f"database: {_first_line(exc)}") from exc


def validate_schema_name(schema: str) -> str:
    if not _SCHEMA_RE.fullmatch(schema):
        raise ValueError(
            f"invalid schema name {schema!r}: use lower-case letters, digits and _ (at most {MAX_SCHEMA_CHARS},"
            " so that its NOTIFY channels fit PostgreSQL's 63-byte names)"
        )
    return schema


def _quoted(schema: str) -> str:
    return sql.Identifier(validate_schema_name(schema)).as_string(None)


def _parse(text: str) -> dict[str, str]:
    parts = _NAME_RE.split(text)
    out: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        lines = [ln for ln in body.strip().splitlines() if not ln.lstrip().startswith("--")]
        out[name] = "\n".join(lines).strip().rstrip(";")
    return out


#: The package's SQL: read as files beside this module (importlib.resources' readers cost ~2 ms of
#: every cron tick's start; fleetless is never imported from a zip: its sandboxes run files of it).
SQL_DIR = Path(__file__).resolve().parent / "sql"


@cache
def _raw_queries() -> dict[str, str]:
    return _parse((SQL_DIR / "queries.sql").read_text())


@cache
def queries(schema: str = DEFAULT_SCHEMA) -> dict[str, str]:
    """Every named query of ``sql/queries.sql``, for this schema."""
    quoted = _quoted(schema)
    return {name: q.replace("{schema}", quoted) for name, q in _raw_queries().items()}


def latest_migration() -> int:
    """The newest schema migration this fleetless has (what its queries expect)."""
    return _migrations()[-1][0]


def _migrations() -> list[tuple[int, str, str]]:
    folder = SQL_DIR / "schema"
    found = []
    for entry in folder.iterdir():
        m = re.match(r"^(\d+)_(.+)\.sql$", entry.name)
        if m:
            found.append((int(m.group(1)), m.group(2), entry.read_text()))
    return sorted(found)


def connect(dsn: str, **kwargs: Any) -> psycopg.Connection[Any]:
    """A connection, with the error said in one line when the server cannot be reached.

    No server-side prepared statements (``prepare_threshold=None``): psycopg would otherwise
    prepare a query on its fifth run, and behind a transaction pooler (PgBouncer before 1.21, or
    with ``max_prepared_statements = 0``) the next run lands on another server connection that
    lacks it, or that another client already prepared the same name on. Measured here, preparing
    gains nothing a claim can see (``bench/bench_hosts.py``)."""
    kwargs.setdefault("prepare_threshold", None)
    try:
        return psycopg.connect(dsn, **kwargs)
    except psycopg.OperationalError as exc:
        raise DatabaseUnavailable(f"cannot connect to the database: {_first_line(exc)}") from None


#: ``prepare_threshold`` of a connection known to be a session of its own: nothing is prepared
#: unless a call asks for it (``prepare=True``), as the enqueue does.
PREPARE_ON_REQUEST = 2**31


def prepare_on_request(conn: psycopg.Connection[Any]) -> bool:
    """Let statements that ask for it be prepared on ``conn`` when it is its server's session
    of its own (no pooler in between: the protocol's backend pid is the server's
    ``pg_backend_pid()``). One round trip; False, and nothing changed, behind a pooler, where a
    prepared statement may be missing on the next server connection. Preparing halves the
    server's work for a one-row statement: a single enqueue, 0.61 -> 0.82 of a raw prepared
    INSERT (bench/run.py --only enqueue)."""
    row = conn.execute("SELECT pg_backend_pid()").fetchone()
    if row is None or row[0] != conn.info.backend_pid:
        return False
    conn.prepare_threshold = PREPARE_ON_REQUEST
    return True


@contextmanager
def atomic(conn: psycopg.Connection[Any]) -> Iterator[None]:
    """A block that is all or none and belongs to the caller's transaction when there is one.

    psycopg's ``conn.transaction()`` on a connection that is not in autocommit and has not run
    anything yet opens *and commits* a transaction of its own. So the caller's implicit
    transaction is opened first, and the block becomes a savepoint inside it: it commits or rolls
    back with the caller's work, and a failure inside it leaves the caller's transaction usable.
    In autocommit the block is a transaction of its own."""
    if not conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE:
        conn.execute(_raw_queries()["open_transaction"])
    with conn.transaction():
        yield


class PoolerError(ValueError):
    """The DSN reaches PostgreSQL through a pooler that cannot give what is asked (a session).
    A configuration mistake, not an outage: nothing retries it."""


def shares_server_sessions(dsn: str, tries: int = 3) -> bool:
    """Whether ``dsn`` hands one server session to several clients in turn: a transaction (or
    statement) pooler such as PgBouncer with ``pool_mode = transaction``.

    A direct connection's protocol-level backend pid is its server's ``pg_backend_pid()``; a
    pooler makes up its own. Behind a pooler, a second client that runs while the first sits
    idle gets the first one's server session in transaction pooling (PgBouncer reuses the most
    recently used one), never in session pooling, where the first keeps it. Never a false
    positive; under heavy concurrent load a transaction pooler may go undetected."""
    with connect(dsn, autocommit=True) as first:
        own = first.execute("SELECT pg_backend_pid()").fetchone()
        if own is None or own[0] == first.info.backend_pid:
            return False  # no pooler in between
        for _ in range(tries):
            server = first.execute("SELECT pg_backend_pid()").fetchone()
            with connect(dsn, autocommit=True) as second:
                other = second.execute("SELECT pg_backend_pid()").fetchone()
            if server is not None and other is not None and server[0] == other[0]:
                return True
    return False


def require_session(dsn: str, why: str = "LISTEN") -> None:
    """Raise PoolerError, in one line, when ``dsn`` is a transaction pooler: what needs a
    session of its own (``LISTEN``, session advisory locks) would silently not work there."""
    if shares_server_sessions(dsn):
        raise PoolerError(
            f"{why} needs a session of its own, but this database URL goes through a transaction pooler "
            "(several clients share one server connection): use a direct connection or session pooling"
        )


def migrate(conn: psycopg.Connection[Any], schema: str = DEFAULT_SCHEMA) -> list[int]:
    """Create or upgrade the schema. Idempotent, safe to run concurrently; commits.

    Concurrent runs take turns on ``LOCK TABLE migrations`` (a table of the schema: only roles
    with rights on it can hold it, where any role that can connect could hold an advisory key,
    issue 25 item 7), waiting at most MIGRATION_LOCK_TIMEOUT seconds (LockTimeout after that).

    Returns the versions applied by this call."""
    quoted = _quoted(schema)
    applied: list[int] = []
    with errors_translated(schema):
        _create_migrations_table(conn, quoted)
        with conn.transaction():
            row = conn.execute(_raw_queries()["migration_lock_wait"],
                               {"timeout": f"{MIGRATION_LOCK_TIMEOUT * 1000:.0f}ms"}).fetchone()
            conn.execute(f"LOCK TABLE {quoted}.migrations IN SHARE ROW EXCLUSIVE MODE")
            done = {r[0] for r in conn.execute(f"SELECT version FROM {quoted}.migrations")}
            for version, name, text in _migrations():
                if version in done:
                    continue
                conn.execute(text.replace("{schema}", quoted).encode())
                conn.execute(
                    f"INSERT INTO {quoted}.migrations (version, name) VALUES (%s, %s)", (version, name)
                )
                applied.append(version)
            conn.execute(_raw_queries()["migration_lock_unwait"], {"old": row[0] if row else "0"})
    return applied


def _create_migrations_table(conn: psycopg.Connection[Any], quoted: str, tries: int = 5) -> None:
    """The schema and its migrations table, in a transaction of their own (the table must exist
    before it can be locked). Two first inits at once: the second's CREATE ... IF NOT EXISTS waits
    for the first to commit, then fails on the catalog's unique index; it looks again."""
    for attempt in range(tries):
        try:
            with conn.transaction():
                encoding = conn.execute(_raw_queries()["server_encoding"]).fetchone()
                found = encoding[0] if encoding else "unknown"
                if isinstance(found, bytes):  # SQL_ASCII: text arrives as bytes
                    found = found.decode("ascii", "replace")
                if found != SUPPORTED_ENCODING:
                    raise DatabaseError(
                        f"database encoding is {found}; fleetless needs {SUPPORTED_ENCODING}"
                        " (CREATE DATABASE ... ENCODING 'UTF8' TEMPLATE template0)"
                    )
                conn.execute(f"CREATE SCHEMA IF NOT EXISTS {quoted}")
                conn.execute(
                    f"CREATE TABLE IF NOT EXISTS {quoted}.migrations ("
                    " version int PRIMARY KEY, name text NOT NULL,"
                    " applied_at timestamptz NOT NULL DEFAULT now())"
                )
            return
        except psycopg.errors.UniqueViolation:
            if attempt == tries - 1:
                raise
