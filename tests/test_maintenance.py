"""Housekeeping units, each through its ``run_once`` against a real table, and a drain running
them at its start and on its maintenance timer."""

from __future__ import annotations

import logging
import os
import subprocess
import threading
from pathlib import Path

import pytest

from fleetless import Queue, Status
from fleetless.drainer import DrainConfig, Drainer
from fleetless.maintenance import Maintainer, Settings, pruner, reaper, retention, sweeper
from fleetless.periodic import Schedule
from fleetless.sandbox import get_backend

from proctools import wait_for

pytestmark = pytest.mark.usefixtures("private_workdir")


def finished(queue: Queue, sql, status: str, n: int, days_ago: float) -> list[int]:
    ids = queue.enqueue_many([("k", {})] * n)
    sql("UPDATE fleetless.jobs SET status = %s, finished_at = now() - make_interval(days => %s)"
        " WHERE id = ANY(%s)", status, days_ago, ids)
    return ids


def test_reaper_returns_expired_leases_and_counts_them(queue: Queue, sql) -> None:
    queue.enqueue("a", {}, max_attempts=1)
    queue.enqueue("b", {})
    queue.enqueue("c", {})
    queue.claim(3)
    sql("UPDATE fleetless.jobs SET lease_expires_at = now() - interval '1 second' WHERE kind IN ('a', 'b')")
    result = reaper.run_once(queue)
    assert (result.pending, result.dead) == (1, 1)
    assert sql("SELECT kind, status FROM fleetless.jobs ORDER BY id") == [
        ("a", "dead"), ("b", "pending"), ("c", "running")]
    assert reaper.run_once(queue).reaped == {}
    assert reaper.run_once(queue, reaper.Settings(older_than=0.001)).reaped == {3: Status.PENDING}


def test_reaper_settings_refuse_a_non_positive_age() -> None:
    with pytest.raises(ValueError, match="positive"):
        reaper.Settings(older_than=0)


def test_sweeper_removes_leftovers_of_dead_drainers_only(private_workdir: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    private_workdir.mkdir(mode=0o711)
    private_workdir.chmod(0o711)  # whatever the umask: a work directory others may write is refused
    (private_workdir / f"ws-{dead.pid}-gone").mkdir()
    (private_workdir / f"hs-{dead.pid}-gone").mkdir()
    mine = private_workdir / f"ws-{os.getpid()}-live"
    mine.mkdir()
    assert sweeper.run_once(sweeper.Settings(get_backend("process"))).removed == 2
    assert [p.name for p in private_workdir.iterdir()] == [mine.name]


def test_pruner_deletes_by_age_per_status_in_batches(queue: Queue, sql) -> None:
    old_done = finished(queue, sql, "done", 25, days_ago=8)
    finished(queue, sql, "done", 3, days_ago=1)
    finished(queue, sql, "dead", 4, days_ago=8)
    queue.enqueue("still-pending", {})
    settings = pruner.Settings(ages=(("done", 7 * 86400.0),), batch_size=10, max_batches=2)
    first = pruner.run_once(queue, settings)
    assert (first.deleted, first.more) == (20, True)
    rest = pruner.run_once(queue, pruner.Settings(ages=(("done", 7 * 86400.0),), batch_size=10))
    assert (rest.deleted, rest.more) == (5, False)
    assert sql("SELECT count(*) FROM fleetless.jobs WHERE id = ANY(%s)", old_done) == [(0,)]
    assert sql("SELECT status, count(*) FROM fleetless.jobs GROUP BY status ORDER BY status") == [
        ("dead", 4), ("done", 3), ("pending", 1)]


def test_pruner_never_touches_pending_or_running_jobs(queue: Queue, sql) -> None:
    queue.enqueue_many([("k", {})] * 3)
    queue.claim(1)
    sql("UPDATE fleetless.jobs SET finished_at = now() - interval '90 days'")  # nonsense, but still
    assert pruner.run_once(queue, pruner.Settings(ages=tuple((s, 0.0) for s in pruner.FINISHED))).deleted == 0


def test_pruner_settings_refuse_unfinished_statuses() -> None:
    with pytest.raises(ValueError, match="cannot prune status 'running'"):
        pruner.Settings(ages=(("running", 1.0),))


def test_retention_keeps_dead_jobs_longer_than_done_ones_by_default(queue: Queue, sql) -> None:
    finished(queue, sql, "done", 2, days_ago=8)
    finished(queue, sql, "cancelled", 1, days_ago=8)
    finished(queue, sql, "dead", 2, days_ago=8)
    finished(queue, sql, "dead", 1, days_ago=31)
    assert retention.run_once(queue).deleted == 4
    assert sql("SELECT status, count(*) FROM fleetless.jobs GROUP BY status") == [("dead", 2)]


def test_retention_deletes_at_most_its_batches_per_pass(queue: Queue, sql) -> None:
    """Bounded: at most ``batches`` statements of ``batch_size`` rows a pass (20 x 500 by default:
    with one batch a pass, once a minute, a database finishing more than 8 jobs a second grew
    without bound: audit, issue 26)."""
    finished(queue, sql, "done", 30, days_ago=8)
    result = retention.run_once(queue, retention.Settings(batch_size=12, batches=2, every=None))
    assert (result.deleted, result.more) == (24, True)
    assert retention.run_once(queue, retention.Settings(done=None, cancelled=None, dead=None)).deleted == 0
    assert sql("SELECT count(*) FROM fleetless.jobs") == [(6,)]
    assert retention.Settings().batches * retention.Settings().batch_size == 10_000
    result = retention.run_once(queue, retention.Settings(batch_size=4, every=None))  # stops at a short batch
    assert (result.deleted, result.more) == (6, False)


def test_a_drain_reaps_sweeps_and_applies_retention_before_it_claims(queue: Queue, sql, handlers) -> None:
    h = handlers(**{"ok.py": "print('ok')"})
    finished(queue, sql, "done", 7, days_ago=8)
    queue.enqueue("ok", {})
    queue.claim(1)
    sql("UPDATE fleetless.jobs SET lease_expires_at = now() - interval '1 second' WHERE status = 'running'")
    config = DrainConfig(handlers_dir=h, concurrency=1,
                         maintenance=Settings(retention=retention.Settings(batch_size=5)))
    summary = Drainer(queue, config).run()
    assert (summary.reaped, summary.pruned, summary.done) == (1, 7, 1)  # two batches of 5
    assert sql("SELECT status, count(*) FROM fleetless.jobs GROUP BY status") == [("done", 1)]


def test_a_long_drain_repeats_maintenance_on_its_timer(queue: Queue, sql, handlers, tmp_path: Path) -> None:
    go = tmp_path / "go"
    h = handlers(**{"wait.py": f"""
        import os, time
        while not os.path.exists({str(go)!r}):
            time.sleep(0.02)
    """})
    queue.enqueue("wait", {})
    queue.enqueue("other", {}, delay=3600)
    config = DrainConfig(handlers_dir=h, concurrency=1, maintenance=Settings(interval=0.2))
    drainer = Drainer(queue, config)
    thread = threading.Thread(target=drainer.run)
    thread.start()
    try:
        wait_for(lambda: sql("SELECT status FROM fleetless.jobs WHERE kind = 'wait'") == [("running",)],
                 what="the waiting job to run")
        # Another drainer's claim expires while this drain is busy: the timer's pass returns it.
        sql("UPDATE fleetless.jobs SET status = 'running', attempts = 1, claim_token = gen_random_uuid(),"
            " locked_at = now(), lease_expires_at = now() - interval '1 second' WHERE kind = 'other'")
        wait_for(lambda: sql("SELECT status FROM fleetless.jobs WHERE kind = 'other'") == [("pending",)],
                 what="the expired claim to be reaped mid-drain")
    finally:
        go.touch()
        thread.join(timeout=60)
    assert drainer.summary.reaped == 1 and drainer.summary.done == 1


def test_the_maintainer_runs_again_only_after_its_interval(queue: Queue) -> None:
    m = Maintainer(queue, get_backend("process"), Settings(interval=3600))
    assert m.run_due() is not None
    assert m.run_due() is None
    assert m.run_all() is not None


def test_cli_prune_by_status_and_reap_use_the_units(dsn: str, queue: Queue, fleetless, sql) -> None:
    finished(queue, sql, "done", 3, days_ago=8)
    finished(queue, sql, "dead", 2, days_ago=8)
    r = fleetless("prune", "--older-than", "7d", "--status", "dead", "--batch-size", "1", dsn=dsn)
    assert r.stdout.strip() == "pruned 2 job(s)", r.stderr
    assert sql("SELECT status, count(*) FROM fleetless.jobs GROUP BY status") == [("done", 3)]
    r = fleetless("prune", "--status", "running", dsn=dsn)
    assert r.returncode == 1 and r.stderr.strip().startswith("fleetless: error: cannot prune status 'running'")


def test_a_failing_maintenance_unit_is_logged_and_the_drain_and_its_jobs_go_on(
        queue: Queue, sql, handlers, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 26.3: on 61e842d an error in one unit (here the database refuses every scheduler
    insert) ended the drain with exit 3 and released the jobs it was running. Now each unit's
    error is a warning, the other units and the running job go on, and the drain ends normally."""
    go = tmp_path / "go"
    h = handlers(**{"wait.py": f"""
        import os, time
        while not os.path.exists({str(go)!r}):
            time.sleep(0.02)
    """})
    sql("CREATE OR REPLACE FUNCTION fleetless.test_refuse() RETURNS trigger LANGUAGE plpgsql AS"
        " $$BEGIN RAISE EXCEPTION 'refused by the test'; END$$")
    sql("CREATE TRIGGER test_refuse BEFORE INSERT ON fleetless.schedule_ticks"
        " FOR EACH STATEMENT EXECUTE FUNCTION fleetless.test_refuse()")
    try:
        queue.add_schedule(Schedule(name="every-minute", cron="* * * * *", kind="tick", payload={}))
        sql("UPDATE fleetless.schedules SET created_at = now() - interval '3 minutes'")
        queue.enqueue("wait", {})
        config = DrainConfig(handlers_dir=h, concurrency=1, maintenance=Settings(interval=0.2))
        drainer = Drainer(queue, config)
        outcome: list[object] = []
        thread = threading.Thread(target=lambda: outcome.append(drainer.run()))
        with caplog.at_level(logging.WARNING, logger="fleetless.maintenance"):
            thread.start()
            try:
                wait_for(lambda: sql("SELECT status FROM fleetless.jobs WHERE kind = 'wait'") == [("running",)],
                         what="the waiting job to run")
                # a pass on the timer while the job runs: the scheduler fails again, the reaper still works
                sql("INSERT INTO fleetless.jobs (kind, payload, status, attempts, claim_token, locked_at,"
                    " lease_expires_at) VALUES ('other', '{}', 'running', 1, gen_random_uuid(), now(),"
                    " now() - interval '1 second')")
                wait_for(lambda: sql("SELECT status FROM fleetless.jobs WHERE kind = 'other'") == [("pending",)],
                         what="the expired claim to be reaped mid-drain")
            finally:
                go.touch()
                thread.join(timeout=60)
    finally:
        sql("DROP TRIGGER IF EXISTS test_refuse ON fleetless.schedule_ticks")
        sql("DROP FUNCTION IF EXISTS fleetless.test_refuse()")
        sql("DELETE FROM fleetless.schedules")
    assert outcome == [drainer.summary] and drainer.summary.done == 1
    assert sql("SELECT status FROM fleetless.jobs WHERE kind = 'wait'") == [("done",)]
    assert sql("SELECT count(*) FROM fleetless.jobs WHERE kind = 'tick'") == [(0,)]
    failures = [r.getMessage() for r in caplog.records if "the scheduler failed" in r.getMessage()]
    assert len(failures) >= 2 and "refused by the test" in failures[0]


def test_retention_runs_at_most_once_a_minute_per_database(queue: Queue, sql, dsn: str) -> None:
    finished(queue, sql, "done", 30, days_ago=8)
    other = Queue(dsn)  # another drain, on another connection
    try:
        assert retention.run_once(queue, retention.Settings(batch_size=10, batches=1)).deleted == 10
        assert retention.run_once(other, retention.Settings(batch_size=10, batches=1)).deleted == 0  # not its turn
        assert retention.run_once(other, retention.Settings(batch_size=10, batches=1, every=None)).deleted == 10
        sql("UPDATE fleetless.maintenance_runs SET last_at = now() - interval '61 seconds'")
        assert retention.run_once(other, retention.Settings(batch_size=10, batches=1)).deleted == 10
    finally:
        other.close()


def test_retention_skips_rather_than_waits_for_a_metrics_fold(queue: Queue, sql, dsn: str) -> None:
    import psycopg

    finished(queue, sql, "done", 3, days_ago=8)
    with psycopg.connect(dsn) as holder:
        holder.execute("SELECT last_id FROM fleetless.attempt_totals_mark FOR UPDATE")  # a fold in progress
        done: list[int] = []
        thread = threading.Thread(target=lambda: done.append(retention.run_once(queue).deleted))
        thread.start()
        thread.join(30)
        assert done == [0]
    assert retention.run_once(queue, retention.Settings(every=None)).deleted == 3


def test_the_reaper_ends_a_streak_of_give_backs(queue: Queue, sql) -> None:
    """Issue 26.10: an expired claim is charged an attempt, so the count of give-backs in a row
    (releases, the max_releases rule) starts again; on 61e842d the reaper left it as it was."""
    job = queue.enqueue("k", {}, max_attempts=5)
    sql("UPDATE fleetless.jobs SET status = 'running', attempts = 1, releases = 4, claim_token = gen_random_uuid(),"
        " locked_at = now(), lease_expires_at = now() - interval '1 second' WHERE id = %s", job)
    assert reaper.run_once(queue).pending == 1
    assert sql("SELECT status, attempts, releases FROM fleetless.jobs WHERE id = %s", job) == [("pending", 1, 0)]
