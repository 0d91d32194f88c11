"""Issue 25 item 7: no advisory locks. Every lock fleetless waits for is a row or a table of its own
schema, which only roles with rights on it can take, and every wait is bounded. A role that can
only connect (the attacker here) can no longer stall a drain, a watcher or `init`. Every
assertion reads the tables."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from fleetless import Queue
from fleetless.drainer import DrainConfig, Drainer

from proctools import wait_for

pytestmark = pytest.mark.usefixtures("private_workdir")

#: Generous bounds on waits for an outcome (never a measured timing).
BOUND = 60


@pytest.fixture
def outsider(dsn: str) -> Iterator[str]:
    """The DSN of a new role with LOGIN and nothing else: the database's default CONNECT (PUBLIC)."""
    role = f"fleetless_t_outsider_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(f'CREATE ROLE "{role}" LOGIN')
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    info["user"] = role
    try:
        yield psycopg.conninfo.make_conninfo(**info)  # type: ignore[arg-type]
    finally:
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,))
            admin.execute(f'DROP ROLE IF EXISTS "{role}"')


def settings(folder: Path, text: str) -> Path:
    (folder / "fleetless.toml").write_text(text)
    return folder


def drain_cli(dsn: str, h: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`fleetless drain` as cron runs it, bounded: a drain that hangs on a lock fails the test."""
    return subprocess.run([sys.executable, "-m", "fleetless.cli", "drain", "--handlers", str(h),
                           "--sandbox", "process", *args],
                          env={**os.environ, "DATABASE_URL": dsn},
                          capture_output=True, text=True, timeout=BOUND)


@pytest.mark.parametrize("statement", [
    "SELECT kind FROM fleetless.kind_limits FOR UPDATE",
    "LOCK TABLE fleetless.kind_limits IN ACCESS EXCLUSIVE MODE",
    "LOCK TABLE fleetless.migrations IN ACCESS EXCLUSIVE MODE",
    "SELECT 1 FROM fleetless.jobs FOR UPDATE",
    "SELECT 1 FROM fleetless.watchers FOR UPDATE",
    "SELECT 1 FROM fleetless.graph_joins FOR UPDATE",
    "LOCK TABLE fleetless.watchers IN ACCESS EXCLUSIVE MODE",
    "INSERT INTO fleetless.watchers VALUES ('*', 'x', now() + interval '1 year', 1e9)",
])
def test_a_connect_only_role_cannot_lock_fleetless_tables(queue: Queue, outsider: str, statement: str) -> None:
    with psycopg.connect(outsider) as c, pytest.raises(psycopg.errors.InsufficientPrivilege):
        c.execute(statement)


def test_the_old_advisory_kind_limit_key_no_longer_stalls_a_limited_claim(
        dsn: str, queue: Queue, outsider: str, sql, handlers) -> None:
    # On 61e842d the claim waited for pg_advisory_xact_lock(hashtext(scope), hashtext(kind)): an
    # outsider holding that key hung the drain (SIGTERM ignored) until it let go.
    h = settings(handlers(**{"limited.py": "print('ok')"}), "[kinds.limited]\nconcurrency = 1\n")
    queue.enqueue("limited", {})
    with psycopg.connect(outsider, autocommit=True) as attacker:
        attacker.execute("SELECT pg_advisory_lock(hashtext('fleetless.kind_limit.fleetless'), hashtext('limited'))")
        out = drain_cli(dsn, h)
        assert out.returncode == 0, out.stderr
    assert sql("SELECT kind, status FROM fleetless.jobs") == [("limited", "done")]


def test_a_held_kind_row_skips_that_kind_for_the_pass_instead_of_hanging(
        dsn: str, queue: Queue, sql, handlers, caplog: pytest.LogCaptureFixture) -> None:
    # Whoever holds a kind's row (only a role with rights on kind_limits can): a limited claim waits
    # for it at most KIND_LOCK_TIMEOUT, then leaves that kind for the next pass; other kinds run.
    h = settings(handlers(**{"limited.py": "print('ok')", "free.py": "print('ok')"}),
                 "[kinds.limited]\nconcurrency = 1\n")
    limited, free = queue.enqueue("limited", {}), queue.enqueue("free", {})
    sql("INSERT INTO fleetless.kind_limits (kind) VALUES ('limited') ON CONFLICT DO NOTHING")
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with psycopg.connect(dsn) as c:
            c.execute("SELECT kind FROM fleetless.kind_limits WHERE kind = 'limited' FOR UPDATE")
            holding.set()
            release.wait(BOUND)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert holding.wait(BOUND)
        summary = Drainer(queue, DrainConfig(handlers_dir=h, sandbox="process")).run()
    finally:
        release.set()
        holder.join(BOUND)
    assert summary.done == 1
    assert sql("SELECT id, status FROM fleetless.jobs ORDER BY id") == [(limited, "pending"), (free, "done")]
    assert "skipping it this pass" in caplog.text
    # the row is free again: the next pass claims the kind
    assert Drainer(queue, DrainConfig(handlers_dir=h, sandbox="process")).run().done == 1
    assert sql("SELECT status FROM fleetless.jobs WHERE id = %s", limited) == [("done",)]



def watcher(dsn: str, h: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "fleetless.cli", "drain", "--handlers", str(h), "--sandbox",
                             "process", "--watch", *args], env={**os.environ, "DATABASE_URL": dsn},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def stop(proc: subprocess.Popen[str]) -> tuple[str, str]:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
    return proc.communicate(timeout=BOUND)


def test_the_old_advisory_watcher_key_no_longer_makes_cron_ticks_exit(
        dsn: str, queue: Queue, outsider: str, sql, handlers) -> None:
    # On 61e842d an outsider holding the watcher's advisory key made every tick exit 0 with "a
    # watcher is already draining these queues" and no job ever ran.
    h = handlers(**{"k.py": "print('ok')"})
    job = queue.enqueue("k", {})
    with psycopg.connect(outsider, autocommit=True) as attacker:
        attacker.execute("SELECT pg_advisory_lock(hashtext('fleetless:fleetless:*'))")
        out = drain_cli(dsn, h, "--watch", "--idle-exit", "1s")
    assert out.returncode == 0, out.stderr
    assert "already draining" not in out.stdout + out.stderr
    assert sql("SELECT status FROM fleetless.jobs WHERE id = %s", job) == [("done",)]


def test_a_stopped_watcher_is_taken_over_by_a_cron_tick_after_its_lease(dsn: str, queue: Queue, sql,
                                                                         handlers) -> None:
    # Issue 26 item 6: a SIGSTOPped watcher held its session lock forever and every tick exited.
    # Now its heartbeat ages; once older than its lease the next tick drains, and the stopped
    # watcher, resumed, finds the row taken over and exits without claiming.
    h = handlers(**{"k.py": "print('ok')"})
    w = watcher(dsn, h, "--watch-lease", "3s")
    try:
        holder = f"{socket.gethostname()}:{w.pid}:"
        wait_for(lambda: sql("SELECT count(*) FROM fleetless.watchers WHERE holder LIKE %s", holder + "%") == [(1,)],
                 BOUND, "the watcher's row")
        first = queue.enqueue("k", {})
        wait_for(lambda: sql("SELECT status FROM fleetless.jobs WHERE id = %s", first) == [("done",)], BOUND,
                 "the live watcher to run the first job")
        tick = drain_cli(dsn, h, "--watch", "--idle-exit", "1s")
        assert "a watcher is already draining these queues" in tick.stdout + tick.stderr  # it is alive
        os.kill(w.pid, signal.SIGSTOP)
        second = queue.enqueue("k", {})
        wait_for(lambda: sql("SELECT heartbeat_at < now() - make_interval(secs => lease_seconds)"
                             " FROM fleetless.watchers") == [(True,)], BOUND, "the stopped watcher's lease to run out")
        tick = drain_cli(dsn, h, "--watch", "--idle-exit", "1s")
        assert tick.returncode == 0, tick.stderr
        assert "already draining" not in tick.stdout + tick.stderr
        assert sql("SELECT status, attempts FROM fleetless.jobs WHERE id = %s", second) == [("done", 1)]
        (by,) = sql("SELECT claimed_by FROM fleetless.jobs WHERE id = %s", second)[0]
        assert not str(by).endswith(f":{w.pid}")  # the tick ran it, not the stopped watcher
        os.kill(w.pid, signal.SIGCONT)  # resumed: its next heartbeat finds the row taken over
        assert w.wait(BOUND) == 0
        _, err = w.communicate(timeout=BOUND)
        assert "another watcher took over" in err
    finally:
        stop(w)
    assert sql("SELECT status, count(*) FROM fleetless.jobs GROUP BY 1") == [("done", 2)]


def test_the_old_advisory_migration_key_no_longer_stalls_init(dsn: str, queue: Queue, outsider: str, sql) -> None:
    # On 61e842d `init` first took pg_advisory_xact_lock(0x666C656574): an outsider holding that
    # key made every deploy's `fleetless init` hang.
    with psycopg.connect(outsider, autocommit=True) as attacker:
        attacker.execute("SELECT pg_advisory_lock(x'666C656574'::bigint)")
        out = subprocess.run([sys.executable, "-m", "fleetless.cli", "init"], env={**os.environ, "DATABASE_URL": dsn},
                             capture_output=True, text=True, timeout=BOUND)
    assert out.returncode == 0, out.stderr
    assert sql("SELECT count(*) > 0 FROM fleetless.migrations") == [(True,)]


def test_init_waits_a_bounded_time_for_another_inits_lock(dsn: str, queue: Queue, monkeypatch) -> None:
    # Only a role with rights on the migrations table can hold its lock (a long migration): init
    # waits for it at most MIGRATION_LOCK_TIMEOUT (300 s; shortened here), then says so in a line.
    from fleetless import db

    monkeypatch.setattr(db, "MIGRATION_LOCK_TIMEOUT", 0.5)
    with psycopg.connect(dsn) as holder:
        holder.execute("LOCK TABLE fleetless.migrations IN ACCESS EXCLUSIVE MODE")
        with pytest.raises(db.LockTimeout, match=r"^lock wait timed out: canceling statement due to lock timeout$"):
            Queue(dsn).init()
    assert Queue(dsn).init() == []  # the lock is free: init goes on (nothing left to apply)


def test_the_old_advisory_fold_key_no_longer_stalls_delete_or_retention(dsn: str, queue: Queue, outsider: str,
                                                                         sql) -> None:
    # On 61e842d a delete waited for pg_advisory_xact_lock(0x666C6D6574) (the /metrics fold's) and
    # retention skipped while it was held: an outsider holding it hung `fleetless delete` and
    # stopped every prune. The fold's lock is now the row of attempt_totals_mark.
    from fleetless.maintenance import retention

    gone, old = queue.enqueue("k", {}), queue.enqueue("k", {})
    sql("UPDATE fleetless.jobs SET status = 'done', finished_at = now() - interval '30 days'")
    with psycopg.connect(outsider, autocommit=True) as attacker:
        attacker.execute("SELECT pg_advisory_lock(x'666C6D6574'::bigint)")
        out = subprocess.run([sys.executable, "-m", "fleetless.cli", "delete", str(gone)],
                             env={**os.environ, "DATABASE_URL": dsn}, capture_output=True, text=True, timeout=BOUND)
        assert out.returncode == 0, out.stderr
        assert retention.run_once(queue, retention.Settings(every=None)).deleted == 1
    assert sql("SELECT count(*) FROM fleetless.jobs WHERE id IN (%s, %s)", gone, old) == [(0,)]


def test_the_old_advisory_counts_key_no_longer_stops_compaction_or_recount(dsn: str, queue: Queue, outsider: str,
                                                                            sql) -> None:
    # job_counts' fold and `init --recount` took turns on pg_advisory_xact_lock(hashtext(
    # 'fleetless.job_counts')): an outsider holding it stopped every fold (job_counts grew a row
    # per job-changing statement for ever) and hung the recount. Their lock is now the table's.
    for _ in range(5):
        queue.enqueue("k", {})
    with psycopg.connect(outsider, autocommit=True) as attacker:
        attacker.execute("SELECT pg_advisory_lock(hashtext('fleetless.job_counts'))")
        queue.compact_counts()
        assert sql("SELECT kind, status, n FROM fleetless.job_counts") == [("k", "pending", 5)]
        out = subprocess.run([sys.executable, "-m", "fleetless.cli", "init", "--recount"],
                             env={**os.environ, "DATABASE_URL": dsn}, capture_output=True, text=True, timeout=BOUND)
        assert out.returncode == 0, out.stderr


def test_a_fold_of_the_counts_skips_while_another_holds_their_lock(dsn: str, queue: Queue, sql) -> None:
    for _ in range(3):
        queue.enqueue("k", {})
    with psycopg.connect(dsn) as other:
        other.execute("LOCK TABLE fleetless.job_counts IN SHARE UPDATE EXCLUSIVE MODE")  # another fold
        queue.compact_counts()  # folds nothing, at once, and the queue's connection stays usable
        assert sql("SELECT count(*) FROM fleetless.job_counts") == [(3,)]
        queue.enqueue("k", {})  # job writes go on under the fold's lock
    queue.compact_counts()
    assert sql("SELECT kind, status, n FROM fleetless.job_counts") == [("k", "pending", 4)]


def test_no_advisory_lock_is_left_in_the_code() -> None:
    # Every lock fleetless takes is a row or a table of its schema (comments may name the old ones).
    import re

    import fleetless

    root = Path(fleetless.__file__).parent
    found = []
    for path in [*root.rglob("*.py"), *root.rglob("*.sql")]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("--")[0] if path.suffix == ".sql" else line.split("#")[0]
            if re.search(r"pg_(try_)?advisory", code):
                found.append(f"{path.relative_to(root)}:{n}")
    assert found == []
