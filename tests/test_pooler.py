"""Everything fleetless does, through a real PgBouncer in transaction and in session pooling.

PgBouncer (Debian's 1.18 here, which has no ``max_prepared_statements``: protocol-level prepared
statements arrived in 1.21) runs on a port of its own in front of the test database. Outcomes are
read from the table directly, not through the pooler."""

from __future__ import annotations

import itertools
import json
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from fleetless import Queue, db
from fleetless.watch import Watcher

import pooler
from conftest import ADMIN_DSN

MODES = ("transaction", "session")


@pytest.fixture(scope="module", params=MODES)
def bouncer(request: pytest.FixtureRequest) -> Iterator[pooler.PgBouncer]:
    pooler.skip_unless_possible(pooler.unavailable())
    info = psycopg.conninfo.conninfo_to_dict(ADMIN_DSN)
    with pooler.PgBouncer(upstream_host=str(info.get("host", "127.0.0.1")),
                          upstream_port=int(info.get("port", 5432)), pool_mode=request.param) as b:
        yield b


@pytest.fixture
def pooled(bouncer: pooler.PgBouncer, dsn: str, queue: Queue) -> str:
    """The test database's DSN through the pooler (the ``queue`` fixture has emptied the table)."""
    return bouncer.dsn(psycopg.conninfo.conninfo_to_dict(dsn)["dbname"])  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def private_workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    work = tmp_path / "work"
    monkeypatch.setenv("FLEETLESS_WORKDIR", str(work))
    return work


def test_the_same_queries_from_several_clients_never_trip_over_prepared_statements(pooled: str, sql) -> None:
    # psycopg prepares a query on its fifth run by default; behind a transaction pooler the next
    # run lands on a server connection that lacks it or where another client made the same name
    # ("prepared statement "_pg3_0" already exists"). fleetless's own connections never prepare.
    queues = [Queue(pooled) for _ in range(3)]
    try:
        for i in range(12):
            for q in queues:
                q.enqueue("k", {"i": i})
                (job,) = q.claim(1)
                assert q.complete(job, "ok")
                q.stats()
    finally:
        for q in queues:
            q.close()
    assert sql("SELECT status, count(*) FROM fleetless.jobs GROUP BY status") == [("done", 36)]


def test_every_command_works_through_the_pooler(pooled: str, fleetless, handlers, sql) -> None:
    h = handlers(**{"ok.py": "import os; print('ran', os.environ['FLEETLESS_JOB_ID'])",
                    "bad.py": "raise SystemExit(3)"})
    assert fleetless("init", dsn=pooled).returncode == 0
    ok = [int(fleetless("enqueue", "ok", "{}", dsn=pooled).stdout)]
    bad = int(fleetless("enqueue", "bad", "{}", "--max-attempts", "1", dsn=pooled).stdout)
    later = int(fleetless("enqueue", "ok", "{}", "--delay", "1h", dsn=pooled).stdout)
    q = Queue(pooled)
    try:
        many = q.enqueue_many(("ok", {"n": n}) for n in range(5))  # one COPY inside a transaction
        with psycopg.connect(pooled) as own:  # enqueue joins the caller's transaction...
            kept = q.enqueue("ok", {}, conn=own)
        with psycopg.connect(pooled) as own:  # ...and a rolled-back one leaves nothing
            q.enqueue("ok", {"gone": True}, conn=own)
            q.enqueue("bad", {"gone": True}, conn=own)
            own.rollback()
    finally:
        q.close()
    r = fleetless("drain", "--handlers", str(h), "--sandbox", "process", "--concurrency", "2", "--batch", "3",
                  dsn=pooled)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("drained: claimed 8, done 7, failed 0, dead 1 in "), r.stdout
    done = sql("SELECT id, result FROM fleetless.jobs WHERE status = 'done' ORDER BY id")
    assert [i for i, _ in done] == sorted([*ok, *many, kept])
    assert all(result == f"ran {i}\n" for i, result in done)
    assert sql("SELECT count(*) FROM fleetless.jobs WHERE payload ? 'gone'") == [(0,)]
    status = json.loads(fleetless("status", "--json", dsn=pooled).stdout)
    assert status["by_status"] == {"pending": 1, "running": 0, "done": 7, "dead": 1, "cancelled": 0, "waiting": 0}
    assert [j["id"] for j in json.loads(fleetless("jobs", "--status", "dead", "--json", dsn=pooled).stdout)] == [bad]
    assert json.loads(fleetless("show", str(bad), "--json", dsn=pooled).stdout)["last_error"] == "exit code 3"
    assert fleetless("retry", str(bad), dsn=pooled).stdout.strip() == f"retried 1 job(s): {bad}"
    assert json.loads(fleetless("cancel", str(later), "--json", dsn=pooled).stdout) == {"cancelled": later}
    assert "reaped 0" in fleetless("reap", dsn=pooled).stdout
    assert fleetless("schedule", "add", "nightly", "ok", "{}", "--cron", "0 3 * * *", dsn=pooled).returncode == 0
    assert "nightly" in fleetless("schedule", "list", dsn=pooled).stdout
    assert fleetless("schedule", "remove", "nightly", dsn=pooled).returncode == 0
    sql("UPDATE fleetless.jobs SET finished_at = now() - interval '30 days' WHERE id = %s", later)
    assert "pruned 1" in fleetless("prune", "--older-than", "7d", dsn=pooled).stdout
    assert sql("SELECT status, count(*) FROM fleetless.jobs GROUP BY status ORDER BY status") == [
        ("done", 7), ("pending", 1)]
    # run-now, and delete (a transaction: the fold's lock, then the delete that keeps its counts)
    assert json.loads(fleetless("run-now", str(bad), "--json", dsn=pooled).stdout) == {"run_now": bad}
    assert json.loads(fleetless("delete", str(kept), "--json", dsn=pooled).stdout) == {"deleted": kept}
    assert "fleetless_attempts_finished_total" in fleetless("metrics", dsn=pooled).stdout
    assert sql("SELECT status, count(*) FROM fleetless.jobs GROUP BY status ORDER BY status") == [
        ("done", 6), ("pending", 1)]


def test_concurrent_inits_serialise_on_the_migrations_table_lock(pooled: str, sql) -> None:
    # The migration lock is LOCK TABLE migrations (no advisory lock): it lives exactly as long as
    # the transaction, which is all a transaction pooler keeps a server connection for. A session
    # lock would be taken on one server connection and leak to whichever client gets it next.
    schema = f"pool_{uuid.uuid4().hex[:8]}"
    applied: list[list[int]] = []
    errors: list[BaseException] = []

    def init() -> None:
        try:
            applied.append(Queue(pooled, schema=schema).init())
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=init) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert sorted(map(len, applied))[-1] >= 1 and sum(map(len, applied)) == len(db._migrations())
    assert sql(f"SELECT count(*) FROM {schema}.migrations") == [(len(db._migrations()),)]
    assert sql("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
               " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())") == [(0,)]
    sql(f"DROP SCHEMA {schema} CASCADE")


def test_listen_needs_a_session_and_a_transaction_pooler_is_named(bouncer: pooler.PgBouncer, pooled: str,
                                                                   dsn: str) -> None:
    db.require_session(dsn)  # direct: fine
    watcher = Watcher(pooled, schema="fleetless", channel="fleetless_fleetless", queues=None, wake=threading.Event())
    if bouncer.pool_mode == "session":
        db.require_session(pooled)  # session pooling keeps one server connection per client: fine
        assert watcher.acquire()
        watcher.close()
        return
    assert db.shares_server_sessions(pooled)
    with pytest.raises(db.PoolerError, match=r"^watch mode \(LISTEN and the watcher lock\) needs a session of"):
        watcher.acquire()
    with pytest.raises(db.PoolerError) as caught:
        db.require_session(pooled, why="drain --watch (LISTEN)")
    assert str(caught.value) == (
        "drain --watch (LISTEN) needs a session of its own, but this database URL goes through a transaction "
        "pooler (several clients share one server connection): use a direct connection or session pooling")


def test_a_kinds_concurrency_limit_holds_through_the_pooler(pooled: str, fleetless, handlers, sql) -> None:
    # The limited claim is one transaction (lock_timeout, the kind's row lock, the claim): a
    # transaction pooler keeps it on one server connection, and the row lock ends with it.
    h = handlers(**{"one.py": "import time; time.sleep(0.2)", "free.py": "print('ok')"})
    (h / "fleetless.toml").write_text("[kinds.one]\nconcurrency = 1\nrate = '100/s'\n")
    for kind in ("one", "one", "one", "free", "free"):
        assert fleetless("enqueue", kind, "{}", dsn=pooled).returncode == 0
    r = fleetless("drain", "--handlers", str(h), "--sandbox", "process", "--concurrency", "3", dsn=pooled)
    assert r.returncode == 0, r.stderr
    assert sql("SELECT kind, status, count(*) FROM fleetless.jobs GROUP BY 1, 2 ORDER BY 1") == [
        ("free", "done", 2), ("one", "done", 3)]
    spans = sql("SELECT a.started_at, a.finished_at FROM fleetless.job_attempts a JOIN fleetless.jobs j"
                " ON j.id = a.job_id WHERE j.kind = 'one' ORDER BY 1")
    assert all(later[0] >= earlier[1] for earlier, later in itertools.pairwise(spans)), spans
