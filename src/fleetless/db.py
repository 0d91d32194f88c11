"""Connecting to PostgreSQL, loading the named queries and running the schema migrations."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from importlib import resources
from typing import Any

import psycopg
from psycopg import sql
from psycopg.pq import TransactionStatus

__all__ = ["DEFAULT_SCHEMA", "atomic", "connect", "migrate", "queries", "validate_schema_name"]

DEFAULT_SCHEMA = "fleetless"
_SCHEMA_RE = re.compile(r"[a-z_][a-z0-9_]{0,62}")  # fullmatch: "$" matches before a final "\n"
_NAME_RE = re.compile(r"^-- name: (\S+)\s*$", re.MULTILINE)
# Any number; fixed so that concurrent `init`s serialise instead of racing on CREATE.
_MIGRATION_LOCK = 0x666C656574


def validate_schema_name(schema: str) -> str:
    if not _SCHEMA_RE.fullmatch(schema):
        raise ValueError(
            f"invalid schema name {schema!r}: use lower-case letters, digits and _ (max 63)"
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


@cache
def _raw_queries() -> dict[str, str]:
    return _parse(resources.files("fleetless.sql").joinpath("queries.sql").read_text())


@cache
def queries(schema: str = DEFAULT_SCHEMA) -> dict[str, str]:
    """Every named query of ``sql/queries.sql``, for this schema."""
    quoted = _quoted(schema)
    return {name: q.replace("{schema}", quoted) for name, q in _raw_queries().items()}


def _migrations() -> list[tuple[int, str, str]]:
    folder = resources.files("fleetless.sql").joinpath("schema")
    found = []
    for entry in folder.iterdir():
        m = re.match(r"^(\d+)_(.+)\.sql$", entry.name)
        if m:
            found.append((int(m.group(1)), m.group(2), entry.read_text()))
    return sorted(found)


def connect(dsn: str, **kwargs: Any) -> psycopg.Connection[Any]:
    """A connection, with the error said in one line when the server cannot be reached."""
    try:
        return psycopg.connect(dsn, **kwargs)
    except psycopg.OperationalError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConnectionError(f"cannot connect to the database: {first}") from None


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


def migrate(conn: psycopg.Connection[Any], schema: str = DEFAULT_SCHEMA) -> list[int]:
    """Create or upgrade the schema. Idempotent, safe to run concurrently; commits.

    Returns the versions applied by this call."""
    quoted = _quoted(schema)
    applied: list[int] = []
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
        conn.execute(f"CREATE SCHEMA IF NOT EXISTS {quoted}")
        conn.execute(
            f"CREATE TABLE IF NOT EXISTS {quoted}.migrations ("
            " version int PRIMARY KEY, name text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now())"
        )
        done = {r[0] for r in conn.execute(f"SELECT version FROM {quoted}.migrations")}
        for version, name, text in _migrations():
            if version in done:
                continue
            conn.execute(text.replace("{schema}", quoted).encode())
            conn.execute(
                f"INSERT INTO {quoted}.migrations (version, name) VALUES (%s, %s)", (version, name)
            )
            applied.append(version)
    return applied
