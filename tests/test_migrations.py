"""Migration files: each number used once (two helpers once both landed a 007; the second could
never be applied, since the migrations table is keyed on the number)."""

from __future__ import annotations

import re
from collections import Counter

import psycopg
import pytest

from fleetless import Queue, db


def test_every_migration_number_is_used_once() -> None:
    numbers = Counter(version for version, _, _ in db._migrations())
    assert [n for n, count in numbers.items() if count > 1] == []
    assert sorted(numbers) == list(range(1, len(numbers) + 1))


def _old_schema(dsn: str, schema: str, upto: int) -> None:
    """A schema as an older fleetless left it: migrations 1 to ``upto`` only."""
    quoted = f'"{schema}"'
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(f"CREATE SCHEMA {quoted}")
        c.execute(f"CREATE TABLE {quoted}.migrations (version int PRIMARY KEY, name text NOT NULL,"
                  " applied_at timestamptz NOT NULL DEFAULT now())")
        for version, name, text in db._migrations():
            if version <= upto:
                c.execute(text.replace("{schema}", quoted).encode())
                c.execute(f"INSERT INTO {quoted}.migrations (version, name) VALUES (%s, %s)", (version, name))


def test_a_drain_on_an_older_schema_says_run_fleetless_init_in_one_line(dsn: str, fleetless, handlers) -> None:
    """Issue 26.10: on 61e842d a drain on a schema an older fleetless made failed with the
    database's `column ... does not exist` (exit 3, mid-way). Now the drain compares the schema's
    newest migration with its own before it claims anything, and says what to do; a query that
    still meets a missing column says the same."""
    _old_schema(dsn, "old_one", 9)
    h = handlers(**{"a.py": "print(1)"})
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("INSERT INTO old_one.jobs (kind, payload) VALUES ('a', '{}')")
    drained = fleetless("--schema", "old_one", "drain", "--handlers", str(h), dsn=dsn)
    assert drained.returncode == 3
    lines = drained.stderr.strip().splitlines()
    assert len(lines) == 1 and re.fullmatch(
        r"fleetless: error: schema old_one is at migration 9, this fleetless needs \d+: run 'fleetless init'",
        lines[0]), drained.stderr
    with psycopg.connect(dsn, autocommit=True) as c:
        assert c.execute("SELECT status, attempts FROM old_one.jobs").fetchall() == [("pending", 0)]
    q = Queue(dsn, schema="old_one")
    try:
        with pytest.raises(db.SchemaNotInitialised, match=r"older than this fleetless .*run 'fleetless init'"):
            q.reap()  # its statement names releases, a column migration 10 added
        assert q.init() == list(range(10, db.latest_migration() + 1))
        q.check_schema()
    finally:
        q.close()


def test_indexes_built_concurrently_before_init_are_kept_by_its_migrations(dsn: str) -> None:
    """docs/operations.md (Upgrading): an operator who builds 018's and 020's indexes CONCURRENTLY
    (writes go on) before `fleetless init` keeps them: init finds them and builds none again."""
    _old_schema(dsn, "prebuilt", 17)
    names = ["jobs_queue_claim_idx", "jobs_queue_due_idx", "jobs_finished_status_idx", "jobs_kind_claim_idx"]
    with psycopg.connect(dsn, autocommit=True) as c:
        for version, _, text in db._migrations():
            for statement in re.findall(r"CREATE INDEX IF NOT EXISTS .*?;", text, re.S):
                if version in (18, 20):
                    c.execute(statement.replace("CREATE INDEX", "CREATE INDEX CONCURRENTLY")
                              .replace("{schema}", "prebuilt").encode())
        before = dict(c.execute("SELECT relname, oid FROM pg_class WHERE relname = ANY(%s)"
                                " AND relnamespace = 'prebuilt'::regnamespace", (names,)).fetchall())
    assert sorted(before) == sorted(names)
    q = Queue(dsn, schema="prebuilt")
    try:
        assert q.init() == list(range(18, db.latest_migration() + 1))
    finally:
        q.close()
    with psycopg.connect(dsn, autocommit=True) as c:
        after = dict(c.execute("SELECT c.relname, c.oid FROM pg_class c JOIN pg_index i ON i.indexrelid = c.oid"
                               " WHERE c.relname = ANY(%s) AND c.relnamespace = 'prebuilt'::regnamespace"
                               " AND i.indisvalid", (names,)).fetchall())
    del before["jobs_finished_status_idx"]  # migration 030 replaces it (jobs_finished_free_idx)
    assert after == before


def test_migration_28_labels_the_workflow_graphs_written_before_it(dsn: str) -> None:
    """Each job with an edge takes its graph's smallest id as graph_id (retention prunes a graph
    as a whole by it); a job without edges none. A chain given out of order, a fan-in, a pair."""
    _old_schema(dsn, "fleetless", 27)
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("INSERT INTO fleetless.jobs (id, kind, payload) SELECT i, 'k', '{}' FROM generate_series(1, 12) i")
        c.execute("INSERT INTO fleetless.job_dependencies (parent_id, child_id)"
                  " VALUES (5, 6), (1, 2), (3, 4), (2, 3), (4, 5), (7, 9), (8, 9), (11, 12)")
    q = Queue(dsn)
    assert q.init() == list(range(28, db.latest_migration() + 1))
    q.close()
    with psycopg.connect(dsn) as c:
        labels = c.execute("SELECT id, graph_id FROM fleetless.jobs ORDER BY id").fetchall()
    assert labels == [*((i, 1) for i in range(1, 7)), (7, 7), (8, 7), (9, 7), (10, None), (11, 11), (12, 11)]
