"""Waiting for a job's outcome: Queue.wait, and `fleetless wait`, woken by the finish's NOTIFY
(migration 019's trigger), never by polling."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from typing import Any

import psycopg
import pytest

import fleetless.queue as queue_module
from fleetless import Finished, Queue, WaitTimeout
from fleetless.queue import JobNotFound

from proctools import wait_for


def _finish_later(queue: Queue, dsn: str, how: str, started: threading.Event) -> threading.Thread:
    def run() -> None:
        other = Queue(dsn)
        started.wait(30)
        (job,) = other.claim(1)
        if how == "done":
            other.complete(job, '{"pages": 3}')
        else:
            other.fail(job, "exit code 1: ValueError: no lines", delay=0, permanent=True)
        other.close()

    t = threading.Thread(target=run)
    t.start()
    return t


@pytest.mark.parametrize("how", ["done", "dead"])
def test_wait_returns_the_outcome_as_soon_as_a_finish_notifies(queue: Queue, dsn: str, how: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # With the re-read an hour apart, only the finish's NOTIFY can wake the waiter in time.
    monkeypatch.setattr(queue_module, "WAIT_RECHECK", 3600.0)
    job_id = queue.enqueue("render", {})
    started = threading.Event()
    finisher = _finish_later(queue, dsn, how, started)
    started.set()
    finished = queue.wait(job_id, timeout=60)
    finisher.join()
    assert isinstance(finished, Finished) and finished.id == job_id and finished.status == how
    if how == "done":
        assert finished.result == '{"pages": 3}' and finished.error is None
    else:
        assert finished.error is not None and "ValueError: no lines" in finished.error


def test_wait_on_a_finished_job_returns_at_once_and_a_timeout_names_the_status(queue: Queue) -> None:
    job_id = queue.enqueue("render", {})
    with pytest.raises(WaitTimeout, match=rf"job {job_id} did not finish within 0.2 s \(it is pending\)"):
        queue.wait(job_id, timeout=0.2)
    queue.cancel(job_id)
    assert queue.wait(job_id, timeout=0).status == "cancelled"
    with pytest.raises(JobNotFound):
        queue.wait(999_999, timeout=1)


@pytest.mark.parametrize("driver", ["psycopg", "asyncpg"])
def test_wait_on_an_id_with_no_job_says_it_may_not_be_committed_yet(queue: Queue, dsn: str, fleetless: Any,
                                                                     driver: str) -> None:
    """The usual cause: the enqueue's transaction has not committed. One line, saying so (it was a
    bare "no job with id 1"), from Queue.wait, AsyncQueue.wait and `fleetless wait`."""
    import asyncio

    from fleetless import AsyncQueue

    said = "no job with id 999999 (not committed yet? wait sees a job once its enqueue commits)"
    with pytest.raises(JobNotFound) as err:
        queue.wait(999_999, timeout=1)
    assert str(err.value) == said

    async def main() -> None:
        with pytest.raises(JobNotFound) as err:
            await AsyncQueue(dsn, driver=driver).wait(999_999, timeout=1)
        assert str(err.value) == said

    asyncio.run(main())
    r = fleetless("wait", "999999", dsn=dsn)
    assert (r.returncode, r.stdout, r.stderr) == (1, "", f"fleetless: error: {said}\n"), r


def test_a_rolled_back_finish_wakes_no_one_and_only_waited_jobs_are_notified(queue: Queue, dsn: str,
                                                                             sql: Any) -> None:
    import psycopg

    waited, other = queue.enqueue("a", {}), queue.enqueue("b", {})
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute('LISTEN "fleetless_fleetless_finished"')
        sql("INSERT INTO fleetless.job_waiters (job_id) VALUES (%s)", waited)
        with psycopg.connect(dsn) as c:  # finished, then rolled back
            c.execute("UPDATE fleetless.jobs SET status = 'cancelled' WHERE id = %s", (waited,))
            c.rollback()
        sql("UPDATE fleetless.jobs SET status = 'cancelled' WHERE id = %s", other)
        assert list(listener.notifies(timeout=0.5)) == []
        sql("UPDATE fleetless.jobs SET status = 'cancelled' WHERE id = %s", waited)
        notes = list(listener.notifies(timeout=5, stop_after=1))
        assert [n.payload for n in notes] == [str(waited)]
    assert sql("SELECT count(*) FROM fleetless.job_waiters") == [(0,)]  # a finished job's waiters go


def test_a_waiter_does_not_hide_the_job_from_a_claim(queue: Queue, dsn: str, sql: Any) -> None:
    # The waiter's row is its own: the job row is never locked by waiting, so a claim racing a
    # wait() always sees the job.
    job_id = queue.enqueue("a", {})
    sql("INSERT INTO fleetless.job_waiters (job_id) VALUES (%s)", job_id)
    import psycopg

    with psycopg.connect(dsn) as c:  # a waiter registering, not yet committed
        c.execute("INSERT INTO fleetless.job_waiters (job_id) VALUES (%s)", (job_id,))
        assert [j.id for j in queue.claim(1)] == [job_id]
        c.rollback()


def test_cli_wait_prints_the_result_and_exits_by_outcome(dsn: str, queue: Queue, fleetless: Any) -> None:
    done = queue.enqueue("a", {})
    (job,) = queue.claim(1)
    queue.complete(job, "rendered 3 pages\n")
    r = fleetless("wait", str(done), dsn=dsn)
    assert (r.returncode, r.stdout) == (0, "rendered 3 pages\n"), r.stderr
    dead = queue.enqueue("a", {}, max_attempts=1)
    (job,) = queue.claim(1)
    queue.fail(job, "exit code 1: boom", delay=0)
    r = fleetless("wait", str(dead), "--json", dsn=dsn)
    assert r.returncode == 4 and json.loads(r.stdout)["status"] == "dead"
    cancelled = queue.enqueue("a", {})
    queue.cancel(cancelled)
    assert fleetless("wait", str(cancelled), dsn=dsn).returncode == 5
    pending = queue.enqueue("a", {})
    r = fleetless("wait", str(pending), "--timeout", "0.5", dsn=dsn)
    assert r.returncode == 124 and r.stderr.strip() == (
        f"fleetless: error: job {pending} did not finish within 0.5 s (it is pending)")


def test_cli_wait_is_woken_by_a_drain_in_another_process(dsn: str, queue: Queue, handlers: Any) -> None:
    h = handlers(**{"hello.py": "def handle(payload):\n    return {'hello': payload['name']}\n"})
    job_id = queue.enqueue("hello", {"name": "ada"})
    waiter = subprocess.Popen([sys.executable, "-m", "fleetless.cli", "wait", str(job_id), "--json",
                               "--timeout", "120"], env={**os.environ, "DATABASE_URL": dsn},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    drain = subprocess.run([sys.executable, "-m", "fleetless.cli", "drain", "--handlers", str(h)],
                           env={**os.environ, "DATABASE_URL": dsn}, capture_output=True, text=True, timeout=120)
    assert drain.returncode == 0, drain.stderr
    out, err = waiter.communicate(timeout=120)
    assert waiter.returncode == 0, err
    assert json.loads(out)["result"] == {"hello": "ada"}


def test_a_finish_in_flight_while_the_waiter_registers_still_wakes_it_at_once(
        queue: Queue, dsn: str, sql: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 26: a finish whose trigger ran before the waiter's row was visible NOTIFYs no one; if
    it commits after the waiter read the job, the waiter used to wait for WAIT_RECHECK. Forced: the
    finish's UPDATE runs first and commits only once the waiter has read the job (it then listens)
    or waits on the finish's row lock. With the re-read an hour apart, the wait must return on a read
    or a NOTIFY, never by running out its 20 s bound."""
    import psycopg

    monkeypatch.setattr(queue_module, "WAIT_RECHECK", 3600.0)
    job_id = queue.enqueue("a", {})
    listening = threading.Event()
    original = psycopg.Connection.notifies

    heard: list[int] = []  # per wait for a NOTIFY: how many it heard (0: it ran out of time)

    def notifies(self: psycopg.Connection[Any], *args: Any, **kwargs: Any) -> Any:
        listening.set()  # the waiter read the job unfinished: it waits for a NOTIFY now
        notes = list(original(self, *args, **kwargs))
        heard.append(len(notes))
        return iter(notes)

    monkeypatch.setattr(psycopg.Connection, "notifies", notifies)
    got: dict[str, Any] = {}

    def wait() -> None:
        try:
            got["finished"] = queue.wait(job_id, timeout=20)
        except Exception as exc:
            got["error"] = exc

    with psycopg.connect(dsn) as finisher:
        finisher.execute("UPDATE fleetless.jobs SET status = 'cancelled', finished_at = now() WHERE id = %s",
                         (job_id,))
        waiter = threading.Thread(target=wait)
        waiter.start()

        def blocked() -> bool:
            return sql("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                       "AND wait_event_type = 'Lock'") != [(0,)]

        wait_for(lambda: listening.is_set() or blocked(), timeout=30, what="the waiter to read the job")
        finisher.commit()
    waiter.join(timeout=60)
    assert "error" not in got, got
    assert got["finished"].status == "cancelled"
    assert 0 not in heard, "the waiter was woken by its timeout, not by the finish"
    assert sql("SELECT count(*) FROM fleetless.job_waiters") == [(0,)]


WAITER = """
import sys
from fleetless import Queue
Queue(sys.argv[1]).wait(int(sys.argv[2]))
"""


def test_no_waiter_row_outlives_its_job_after_waits_timeouts_and_killed_waiters(queue: Queue, dsn: str,
                                                                                 sql: Any) -> None:
    """Issue 26: job_waiters rows must not accumulate (while any exists, every UPDATE of the jobs
    table pays the finish trigger's join). Waits that return or time out leave none; a killed
    waiter's row goes with its job's finish; what a killed waiter leaves in a race with a finish
    that could not see its row, or for a job deleted by hand, goes with the waiters unit's pass,
    which keeps the row of a waiter whose job has not finished."""
    import psycopg

    from fleetless.maintenance import waiters

    def rows(job_id: int | None = None) -> int:
        if job_id is None:
            return int(sql("SELECT count(*) FROM fleetless.job_waiters")[0][0])
        return int(sql("SELECT count(*) FROM fleetless.job_waiters WHERE job_id = %s", job_id)[0][0])

    def killed_waiter(job_id: int, before_kill: Any = None) -> None:
        proc = subprocess.Popen([sys.executable, "-c", WAITER, dsn, str(job_id)], env={**os.environ})
        try:
            wait_for(lambda: rows(job_id) == 1, timeout=60, what="the waiter's row")
            if before_kill is not None:
                wait_for(before_kill, timeout=60, what="the waiter to read the job")
        finally:
            proc.kill()
            proc.wait()

    a = queue.enqueue("a", {})
    with pytest.raises(WaitTimeout):
        queue.wait(a, timeout=0.1)
    queue.cancel(a)
    assert queue.wait(a, timeout=5).status == "cancelled"
    assert rows() == 0
    b = queue.enqueue("b", {})  # a killed waiter of an unfinished job: its row goes with the finish
    killed_waiter(b)
    queue.cancel(b)
    assert rows() == 0
    c = queue.enqueue("c", {})  # killed while a finish that ran before its row existed was in flight
    with psycopg.connect(dsn) as finisher:
        finisher.execute("UPDATE fleetless.jobs SET status = 'cancelled', finished_at = now() WHERE id = %s", (c,))
        killed_waiter(c, lambda: sql("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                                     "AND wait_event_type = 'Lock'") != [(0,)])
        finisher.commit()
    d = queue.enqueue("d", {})  # a killed waiter's job deleted by hand
    killed_waiter(d)
    sql("DELETE FROM fleetless.jobs WHERE id = %s", d)
    live = queue.enqueue("e", {})  # a killed waiter's pending job: its row stays for its finish
    killed_waiter(live)
    assert (rows(c), rows(d), rows(live)) == (1, 1, 1)
    assert waiters.run_once(queue, waiters.Settings(batch_size=1)).deleted == 1  # bounded
    assert waiters.run_once(queue).deleted == 1
    assert rows() == 1 == rows(live)
    queue.cancel(live)
    assert rows() == 0


@pytest.mark.parametrize("schema", ["fleetless", "w" * 44])
def test_wait_and_its_notify_work_up_to_the_longest_schema_name(dsn: str, schema: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # 44 characters: fleetless_<schema>_finished is 63 bytes, PostgreSQL's longest name. (A longer
    # name is refused by every command: tests/test_cli.py; before, 45 to 63 made each finish of a
    # waited job fail in its NOTIFY, and the waiter LISTENed on a truncated channel.)
    monkeypatch.setattr(queue_module, "WAIT_RECHECK", 3600.0)
    q = Queue(dsn, schema=schema)
    q.init()
    job_id = q.enqueue("render", {})
    started = threading.Event()

    def finish() -> None:
        other = Queue(dsn, schema=schema)
        started.wait(30)
        wait_for(lambda: other.query("wait_read", {"id": job_id}) and bool(
            psycopg_rows(dsn, f"SELECT 1 FROM {schema}.job_waiters WHERE job_id = %s", job_id)), timeout=30)
        (job,) = other.claim(1)
        other.complete(job, '{"ok": 1}')
        other.close()

    t = threading.Thread(target=finish)
    t.start()
    started.set()
    finished = q.wait(job_id, timeout=60)
    t.join()
    q.close()
    assert finished.status == "done" and finished.result == '{"ok": 1}'


def psycopg_rows(dsn: str, query: str, *params: object) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as c:
        return c.execute(query, params).fetchall()
