"""Periodic jobs: schedules in the table, occurrences enqueued exactly once by racing drainers,
bounded catch-up, DST as cronsim defines it, and the CLI."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import threading
from zoneinfo import ZoneInfo

import psycopg
import pytest

from fleetless import Queue
from fleetless.drainer import DrainConfig, Drainer, DrainError
from fleetless.maintenance import scheduler
from fleetless.periodic import Schedule, occurrences

from proctools import wait_for

UTC = dt.UTC
PARIS = ZoneInfo("Europe/Paris")


pytestmark = pytest.mark.usefixtures("private_workdir")


@pytest.fixture(autouse=True)
def no_schedules(queue: Queue, sql) -> None:
    sql("DELETE FROM fleetless.schedules")


def add(q: Queue, run_sql, created: dt.datetime, /, **fields: object) -> Schedule:
    fields.setdefault("name", "every-5")
    fields.setdefault("cron", "*/5 * * * *")
    fields.setdefault("kind", "tick")
    fields.setdefault("payload", {"n": 1})
    sched = Schedule(**fields)  # type: ignore[arg-type]
    q.add_schedule(sched)
    run_sql("UPDATE fleetless.schedules SET created_at = %s WHERE name = %s", created, sched.name)
    return sched


def local(*args: int, fold: int = 0) -> dt.datetime:
    return dt.datetime(*args, tzinfo=PARIS, fold=fold)  # type: ignore[misc]


def test_a_time_skipped_by_spring_forward_runs_at_the_end_of_the_gap() -> None:
    s = Schedule(name="n", cron="30 2 * * *", kind="k", payload={}, timezone="Europe/Paris")
    ticks, skipped = occurrences(s, local(2026, 3, 27, 12, 0), local(2026, 3, 31, 12, 0), 10)
    assert [t.astimezone(PARIS).isoformat() for t in ticks] == [
        "2026-03-28T02:30:00+01:00", "2026-03-29T03:00:00+02:00", "2026-03-30T02:30:00+02:00",
        "2026-03-31T02:30:00+02:00"]
    assert skipped == 0


def test_a_daily_time_repeated_by_fall_back_runs_once_and_a_half_hourly_one_runs_in_both_passes() -> None:
    daily = Schedule(name="n", cron="30 2 * * *", kind="k", payload={}, timezone="Europe/Paris")
    ticks, _ = occurrences(daily, local(2026, 10, 24, 12, 0), local(2026, 10, 26, 12, 0), 10)
    assert [t.astimezone(PARIS).isoformat() for t in ticks] == [
        "2026-10-25T02:30:00+02:00", "2026-10-26T02:30:00+01:00"]
    half = Schedule(name="n", cron="*/30 * * * *", kind="k", payload={}, timezone="Europe/Paris")
    ticks, _ = occurrences(half, local(2026, 10, 25, 1, 0), local(2026, 10, 25, 3, 30), 20)
    assert [t.astimezone(PARIS).isoformat() for t in ticks] == [
        "2026-10-25T01:30:00+02:00", "2026-10-25T02:00:00+02:00", "2026-10-25T02:30:00+02:00",
        "2026-10-25T02:00:00+01:00", "2026-10-25T02:30:00+01:00", "2026-10-25T03:00:00+01:00",
        "2026-10-25T03:30:00+01:00"]


def test_due_occurrences_are_enqueued_once_each_due_at_their_tick(queue: Queue, sql) -> None:
    created = dt.datetime(2026, 6, 1, 10, 0, 30, tzinfo=UTC)
    add(queue, sql, created, payload={"report": "daily"}, queue="reports", priority=3)
    now = created + dt.timedelta(hours=1)
    assert scheduler.run_once(queue, now=now) == scheduler.Result(enqueued=10, skipped=2)
    assert scheduler.run_once(queue, now=now) == scheduler.Result()
    assert scheduler.run_once(queue, now=now + dt.timedelta(minutes=5)).enqueued == 1
    rows = sql("SELECT kind, payload, queue, priority, run_after FROM fleetless.jobs ORDER BY run_after")
    assert [r[4] for r in rows] == [dt.datetime(2026, 6, 1, 10, m, tzinfo=UTC) for m in (15, 20, 25, 30, 35, 40,
                                                                                       45, 50, 55)] + [
        dt.datetime(2026, 6, 1, 11, m, tzinfo=UTC) for m in (0, 5)]
    assert all(r[:4] == ("tick", {"report": "daily"}, "reports", 3) for r in rows)


def test_catch_up_is_bounded_by_count_and_window(queue: Queue, sql) -> None:
    created = dt.datetime(2026, 6, 1, 0, 0, tzinfo=UTC)
    add(queue, sql, created, cron="0 * * * *")
    now = created + dt.timedelta(days=3, minutes=1)  # 72 hourly occurrences missed
    result = scheduler.run_once(queue, scheduler.Settings(max_catch_up=5, window=24 * 3600.0), now=now)
    assert result == scheduler.Result(enqueued=5, skipped=19)  # 24 in the window, the latest 5 run
    assert sql("SELECT max(run_after), min(run_after) FROM fleetless.jobs") == [
        (dt.datetime(2026, 6, 4, 0, 0, tzinfo=UTC), dt.datetime(2026, 6, 3, 20, 0, tzinfo=UTC))]


def test_racing_drainers_enqueue_each_occurrence_exactly_once(dsn: str, queue: Queue, sql) -> None:
    created = dt.datetime(2026, 6, 1, 0, 0, tzinfo=UTC)
    add(queue, sql, created, name="a", cron="* * * * *")
    add(queue, sql, created, name="b", cron="*/2 * * * *", timezone="Europe/Paris")
    n = 6
    barrier = threading.Barrier(n)
    results: list[scheduler.Result] = []

    def drainer(offset: int) -> None:
        q = Queue(dsn)
        try:
            barrier.wait()
            for minute in [*range(0, 60, 3), 60]:
                now = created + dt.timedelta(minutes=min(minute + offset % 2, 60))
                results.append(scheduler.run_once(q, scheduler.Settings(max_catch_up=100), now=now))
        finally:
            q.close()

    threads = [threading.Thread(target=drainer, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected = 60 + 30  # (created, created + 60 min]: every minute for "a", even minutes for "b"
    assert sum(r.enqueued for r in results) == expected
    assert sql("SELECT count(*), count(DISTINCT run_after) FROM fleetless.jobs") == [(expected, 60)]
    assert sql("SELECT count(*) FROM fleetless.schedule_ticks") == [(expected,)]


def test_spring_forward_through_the_table(queue: Queue, sql) -> None:
    add(queue, sql, local(2026, 3, 27, 12, 0).astimezone(UTC), cron="30 2 * * *", timezone="Europe/Paris")
    result = scheduler.run_once(queue, scheduler.Settings(window=10 * 86400.0),
                                now=local(2026, 3, 30, 12, 0).astimezone(UTC))
    assert result.enqueued == 3
    assert [r[0].astimezone(PARIS).isoformat() for r in sql("SELECT run_after FROM fleetless.jobs ORDER BY 1")] == [
        "2026-03-28T02:30:00+01:00", "2026-03-29T03:00:00+02:00", "2026-03-30T02:30:00+02:00"]


def test_a_drain_enqueues_due_occurrences_and_runs_them(queue: Queue, sql, handlers) -> None:
    h = handlers(**{"tick.py": "print('tick')"})
    add(queue, sql, dt.datetime.now(UTC) - dt.timedelta(minutes=3, seconds=30), cron="* * * * *")
    summary = Drainer(queue, DrainConfig(handlers_dir=h, concurrency=2)).run()
    assert summary.scheduled == summary.done in (3, 4)  # 3.5 minutes hold 3 or 4 minute ticks
    assert sql("SELECT status, count(*) FROM fleetless.jobs GROUP BY status") == [("done", summary.done)]


def test_bad_schedules_are_one_line_errors() -> None:
    with pytest.raises(ValueError, match="invalid cron expression '61 \\* \\* \\* \\*': Bad minute"):
        Schedule(name="x", cron="61 * * * *", kind="k", payload={})
    with pytest.raises(ValueError, match="unknown time zone 'Mars/Olympus'"):
        Schedule(name="x", cron="* * * * *", kind="k", payload={}, timezone="Mars/Olympus")
    with pytest.raises(ValueError, match="invalid schedule name"):
        Schedule(name="bad name", cron="* * * * *", kind="k", payload={})


def test_cli_schedule_add_list_remove(dsn: str, queue: Queue, fleetless, sql) -> None:
    r = fleetless("schedule", "add", "nightly", "render-report", '{"r": 1}', "--cron", "0 3 * * *",
                  "--timezone", "Europe/Paris", "--queue", "reports", dsn=dsn)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("schedule nightly added; next: ") and r.stdout.rstrip().endswith(":00+00:00")
    listed = json.loads(fleetless("schedule", "list", "--json", dsn=dsn).stdout)
    assert [(s["name"], s["cron"], s["timezone"], s["kind"], s["queue"], s["payload"], s["last"])
            for s in listed] == [("nightly", "0 3 * * *", "Europe/Paris", "render-report", "reports", {"r": 1}, None)]
    assert dt.datetime.fromisoformat(listed[0]["next"]).astimezone(PARIS).hour == 3
    text = fleetless("schedule", "list", dsn=dsn).stdout.splitlines()
    assert text[0].split()[:3] == ["name", "cron", "timezone"] and text[1].startswith("nightly")
    bad = fleetless("schedule", "add", "x", "k", "--cron", "* * *", dsn=dsn)
    assert bad.returncode == 1 and bad.stderr.startswith("fleetless: error: invalid cron expression")
    assert fleetless("schedule", "remove", "nightly", dsn=dsn).stdout.strip() == "schedule nightly removed"
    gone = fleetless("schedule", "remove", "nightly", dsn=dsn)
    assert gone.returncode == 1 and gone.stderr.strip() == "fleetless: error: no schedule named 'nightly'"


def test_schedules_declared_in_the_settings_file_are_stored_by_a_drain(queue: Queue, handlers) -> None:
    h = handlers(**{"tick.py": "print('tick')"})
    (h / "fleetless.toml").write_text(
        "[schedules.nightly]\ncron = '0 3 * * *'\nkind = 'tick'\ntimezone = 'Europe/Paris'\n"
        "payload = { scope = 'all' }\nqueue = 'reports'\n")
    Drainer(queue, DrainConfig(handlers_dir=h)).run()
    ((sched, _, last),), _ = queue.schedules()
    assert (sched.name, sched.cron, sched.kind, sched.timezone, sched.payload, sched.queue, last) == (
        "nightly", "0 3 * * *", "tick", "Europe/Paris", {"scope": "all"}, "reports", None)
    (h / "fleetless.toml").write_text("[schedules.nightly]\ncron = '0 3 * * *'\n")
    with pytest.raises(DrainError, match=r"\[schedules.nightly\]: needs kind"):
        Drainer(queue, DrainConfig(handlers_dir=h)).run()
    (h / "fleetless.toml").write_text("[schedules.x]\ncron = '99 * * * *'\nkind = 'tick'\n")
    with pytest.raises(DrainError, match=r"\[schedules.x\]: invalid cron expression"):
        Drainer(queue, DrainConfig(handlers_dir=h)).run()
    assert [s.name for s, _, _ in queue.schedules()[0]] == ["nightly"]


def test_a_schedule_removed_while_a_pass_runs_is_skipped_and_the_others_are_enqueued(
        dsn: str, queue: Queue, sql) -> None:
    """The race of issue 26.3, forced: a pass reads the schedules, then another session removes one
    of them (its DELETE not yet committed) and the pass's insert of that schedule's ticks must wait
    for it. On 61e842d the pass then died of a foreign-key violation on schedule_ticks and enqueued
    nothing (a drain: exit 3). Now the removed schedule is left out and the other one's ticks are
    enqueued."""
    created = dt.datetime.now(UTC) - dt.timedelta(minutes=3, seconds=30)
    add(queue, sql, created, name="gone", cron="* * * * *", kind="gone")
    add(queue, sql, created, name="kept", cron="* * * * *", kind="kept")
    remover = psycopg.connect(dsn)
    results: list[scheduler.Result] = []
    errors: list[BaseException] = []

    def one_pass() -> None:
        q = Queue(dsn)
        try:
            results.append(scheduler.run_once(q))
        except BaseException as exc:  # the test reports it
            errors.append(exc)
        finally:
            q.close()

    try:
        remover.execute("SELECT pg_advisory_lock(4711)")
        # The pass is held after its read of the schedules: the first of its enqueued jobs ...
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute("CREATE OR REPLACE FUNCTION fleetless.test_hold() RETURNS trigger LANGUAGE plpgsql AS"
                      " $$BEGIN PERFORM pg_advisory_lock(4711); PERFORM pg_advisory_unlock(4711);"
                      " RETURN NEW; END$$")
            c.execute("CREATE TRIGGER test_hold BEFORE INSERT ON fleetless.schedule_ticks"
                      " FOR EACH STATEMENT EXECUTE FUNCTION fleetless.test_hold()")
        thread = threading.Thread(target=one_pass)
        thread.start()
        wait_for(lambda: sql("SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)"
                             " WHERE a.datname = current_database() AND l.locktype = 'advisory'"
                             " AND l.objid = 4711 AND NOT l.granted") == [(1,)], what="the pass to reach its insert")
        remover.execute("DELETE FROM fleetless.schedules WHERE name = 'gone'")  # not committed yet
        remover.execute("SELECT pg_advisory_unlock(4711)")
        wait_for(lambda: sql("SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)"
                             " WHERE a.datname = current_database() AND l.locktype = 'transactionid'"
                             " AND NOT l.granted") == [(1,)] or not thread.is_alive(),
                 what="the pass to wait for the removal")
        remover.commit()
        thread.join(timeout=60)
    finally:
        remover.close()
        sql("DROP TRIGGER IF EXISTS test_hold ON fleetless.schedule_ticks")
        sql("DROP FUNCTION IF EXISTS fleetless.test_hold()")
    assert errors == []
    kept = sql("SELECT count(*) FROM fleetless.jobs WHERE kind = 'kept'")[0][0]
    assert kept in (3, 4) and results[0].enqueued == kept  # 3.5 minutes hold 3 or 4 minute ticks
    assert sql("SELECT count(*) FROM fleetless.jobs WHERE kind = 'gone'") == [(0,)]
    assert sql("SELECT DISTINCT schedule FROM fleetless.schedule_ticks") == [("kept",)]


def test_a_watcher_enqueues_a_schedules_occurrence_at_its_tick(dsn: str, queue: Queue, sql, handlers) -> None:
    # Issue 26 item 7: a watcher ran the scheduler only at its maintenance passes (every 60 s by
    # default, here never again after the first), so `* * * * *` fired up to a minute late. It now
    # sleeps at most until the next occurrence, and enqueues it then.
    h = handlers(**{"tick.py": "print('tick')"})
    queue.add_schedule(Schedule(name="every-minute", cron="* * * * *", kind="tick", payload={}))
    w = subprocess.Popen([sys.executable, "-m", "fleetless.cli", "drain", "--handlers", str(h), "--sandbox", "process",
                          "--watch", "--maintenance-interval", "1h"], env={**os.environ, "DATABASE_URL": dsn},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: sql("SELECT count(*) FROM fleetless.jobs WHERE kind = 'tick' AND status = 'done'") == [(1,)],
                 130, "the next minute's occurrence to run")
        ((late,),) = sql("SELECT extract(epoch FROM started_at - run_after)::float8 FROM fleetless.jobs"
                         " WHERE kind = 'tick'")
        assert late < 10, f"started {late:.1f} s after its tick"  # a few seconds at most, not a minute
    finally:
        w.terminate()
        w.communicate(timeout=60)


def _watching(dsn: str, h: object) -> subprocess.Popen[str]:
    """A watcher whose maintenance passes (the scheduler's among them) never come round again:
    only a schedule's next occurrence, or a change it hears, runs the scheduler."""
    return subprocess.Popen([sys.executable, "-m", "fleetless.cli", "drain", "--handlers", str(h), "--sandbox",
                             "process", "--watch", "--maintenance-interval", "1h"],
                            env={**os.environ, "DATABASE_URL": dsn}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _in_its_loop(queue: Queue, sql) -> None:
    """The watcher has made its first scheduler pass and sleeps in its loop: it ran a job."""
    job = queue.enqueue("tick", {"warm": True})
    wait_for(lambda: sql("SELECT status FROM fleetless.jobs WHERE id = %s", job) == [("done",)], 60,
             "the watcher to run a job")


def test_a_schedule_added_while_a_watcher_sleeps_is_enqueued_at_its_first_tick(
        dsn: str, queue: Queue, sql, handlers, fleetless) -> None:
    """Issue 26 item 7 remnant: a watcher computed its next wake from the schedules it knew at its
    last scheduler pass, so a schedule added meanwhile was enqueued only at its next maintenance
    pass (a minute or more late; here never). `schedule add` now NOTIFYs every watcher, which runs
    a scheduler pass and sleeps until the new first occurrence (the next minute: the cron's finest)."""
    h = handlers(**{"tick.py": "print('tick')"})
    w = _watching(dsn, h)
    try:
        _in_its_loop(queue, sql)
        r = fleetless("schedule", "add", "soon", "tick", "--cron", "* * * * *", dsn=dsn)
        assert r.returncode == 0, r.stderr
        ((tick, left),) = sql("SELECT date_trunc('minute', now()) + interval '1 minute',"
                              " extract(epoch FROM date_trunc('minute', now()) + interval '1 minute' - now())::float8")
        wait_for(lambda: sql("SELECT count(*) FROM fleetless.jobs WHERE kind = 'tick' AND run_after = %s", tick)
                 == [(1,)], left + 10, "the first occurrence to be enqueued")
        ((late,),) = sql("SELECT extract(epoch FROM created_at - run_after)::float8 FROM fleetless.jobs"
                         " WHERE run_after = %s AND kind = 'tick'", tick)
        assert late < 5, f"enqueued {late:.1f} s after its tick"
    finally:
        w.terminate()
        w.communicate(timeout=60)


def test_a_schedule_changed_while_a_watcher_sleeps_is_caught_up_at_once(
        dsn: str, queue: Queue, sql, handlers) -> None:
    """The same through the Python API, for a change: a yearly schedule made two minutes ago is
    changed to every minute while the watcher sleeps (until next year, as far as it knew). Hearing
    the change, it runs a pass at once, which enqueues the minutes since the schedule was made."""
    h = handlers(**{"tick.py": "print('tick')"})
    created = sql("SELECT now() - interval '2 minutes'")[0][0]
    add(queue, sql, created, name="rare", cron="0 0 1 1 *", kind="tick", payload={})
    w = _watching(dsn, h)
    try:
        _in_its_loop(queue, sql)
        assert queue.add_schedule(Schedule(name="rare", cron="0 0 1 1 *", kind="tick", payload={})) is False
        queue.add_schedule(Schedule(name="rare", cron="* * * * *", kind="tick", payload={}))
        wait_for(lambda: sql("SELECT count(*) FROM fleetless.schedule_ticks WHERE schedule = 'rare'")[0][0] >= 1, 10,
                 "the watcher to enqueue the changed schedule's missed minutes")
        queue.remove_schedule("rare")  # wakes it too; the pass finds no schedule
        assert w.poll() is None
    finally:
        w.terminate()
        _, err = w.communicate(timeout=60)
    assert "Traceback" not in err, err
