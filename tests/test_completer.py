"""The completer writes outcomes fenced per row: inline (per-job mode) or batched by size and
timer, one statement per flush, never losing an outcome when a flush fails."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from fleetless import Queue, RetryPolicy
from fleetless.completer import Completer
from fleetless.db import DatabaseError, DatabaseUnavailable
from fleetless.job import Job, Outcome

from proctools import wait_for


def claim_all(queue: Queue, n: int) -> list[Job]:
    return queue.claim(n, default_timeout=60, ttl=60, lease_grace=60)


def statement_sizes(queue: Queue, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many outcomes each of ``queue``'s finish statements writes, in order (filled as they run)."""
    sizes: list[int] = []
    real = queue.finish_claims

    def counting(items: Any) -> Any:
        sizes.append(len(items))
        return real(items)

    monkeypatch.setattr(queue, "finish_claims", counting)
    return sizes


def test_one_flush_writes_mixed_outcomes_in_one_statement(queue: Queue, sql: Callable[..., list[Any]],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    ids = queue.enqueue_many([("k", {"n": i}) for i in range(5)])
    queue.enqueue("k", {"n": 5}, max_attempts=1)
    jobs = claim_all(queue, 6)
    statements: list[str] = []
    real, real_tuples = queue._run, queue._tuples

    def counting(name: str, params: Any, conn: Any = None) -> Any:
        statements.append(name)
        return real(name, params, conn)

    def counting_tuples(name: str, params: Any) -> Any:
        statements.append(name)
        return real_tuples(name, params)

    monkeypatch.setattr(queue, "_run", counting)
    monkeypatch.setattr(queue, "_tuples", counting_tuples)
    c = Completer(queue, flush_size=100)
    c.add(jobs[0], Outcome("done", result="text out"))
    c.add(jobs[1], Outcome("done", result_json='{"a": [1, 2]}'))
    c.add(jobs[2], Outcome("fail", error="ValueError: x\ntraceback"))
    c.add(jobs[3], Outcome("fail", error="no handler", permanent=True))
    c.add(jobs[4], Outcome("release", error="released: stopping"))
    c.add(jobs[5], Outcome("fail", error="last try"))
    assert sql("SELECT count(*) FROM fleetless.jobs WHERE status = 'running'") == [(6,)]  # nothing yet
    c.flush()
    assert statements == ["finish_many"]
    rows = {r[0]: r[1:] for r in sql(
        "SELECT id, status, attempts, result, result_json, last_error, run_after > now() + interval '30 s',"
        " finished_at IS NOT NULL, claim_token IS NULL FROM fleetless.jobs")}
    assert rows[ids[0]] == ("done", 1, "text out", None, None, False, True, False)
    assert rows[ids[1]] == ("done", 1, None, {"a": [1, 2]}, None, False, True, False)
    assert rows[ids[2]] == ("pending", 1, None, None, "ValueError: x\ntraceback", True, False, False)  # backoff
    assert rows[ids[3]] == ("dead", 1, None, None, "no handler", False, True, False)
    assert rows[ids[4]] == ("pending", 0, None, None, "released: stopping", False, False, False)  # token kept
    assert rows[6] == ("dead", 1, None, None, "last try", False, True, False)
    counts = c.counts
    assert (counts.done, counts.failed, counts.dead, counts.released, counts.fenced_out) == (2, 1, 2, 1, 0)


def test_a_reaped_claims_late_outcome_is_fenced_out(queue: Queue, sql: Callable[..., list[Any]]) -> None:
    job_id = queue.enqueue("k", {})
    old = claim_all(queue, 1)[0]
    sql("UPDATE fleetless.jobs SET lease_expires_at = now() - interval '1 s'")
    queue.reap()
    new = claim_all(queue, 1)[0]
    c = Completer(queue)
    c.add(old, Outcome("done", result="late"))
    c.flush()
    assert c.counts.fenced_out == 1
    assert sql("SELECT status, result, claim_token FROM fleetless.jobs WHERE id = %s", job_id) == [
        ("running", None, new.claim_token)]
    c.add(new, Outcome("done", result="mine"))
    c.flush()
    assert sql("SELECT status, result FROM fleetless.jobs") == [("done", "mine")]


def test_batched_mode_flushes_on_size_and_on_the_timer(queue: Queue, sql: Callable[..., list[Any]]) -> None:
    queue.enqueue_many([("k", {}) for _ in range(5)])
    jobs = claim_all(queue, 5)
    c = Completer(queue, flush_size=3, flush_interval=3600)
    c.start()
    for job in jobs[:3]:
        c.add(job, Outcome("done"))
    wait_for(lambda: sql("SELECT count(*) FROM fleetless.jobs WHERE status = 'done'") == [(3,)],
             what="a flush on size")
    c.close()
    timed = Completer(queue, flush_size=100, flush_interval=0.05)
    timed.start()
    timed.add(jobs[3], Outcome("done"))
    wait_for(lambda: sql("SELECT count(*) FROM fleetless.jobs WHERE status = 'done'") == [(4,)],
             what="a flush on the timer")
    timed.add(jobs[4], Outcome("done"))
    timed.close()  # writes what is left
    assert sql("SELECT count(*) FROM fleetless.jobs WHERE status = 'done'") == [(5,)]


def test_a_failed_flush_keeps_its_outcomes_and_retries(queue: Queue, sql: Callable[..., list[Any]],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    queue.enqueue_many([("k", {}) for _ in range(3)])
    jobs = claim_all(queue, 3)
    real = queue.finish_claims
    failures = [2]
    lock = threading.Lock()

    def flaky(items: Any) -> Any:
        with lock:
            if failures[0]:
                failures[0] -= 1
                raise DatabaseUnavailable("database unavailable: server closed the connection unexpectedly")
        return real(items)

    monkeypatch.setattr(queue, "finish_claims", flaky)
    c = Completer(queue, flush_size=1, flush_interval=0.01)
    with pytest.raises(DatabaseUnavailable):
        c.add(jobs[0], Outcome("done"))
        c.flush()
    assert c.holding() == [jobs[0]]  # kept
    c.start()
    c.add(jobs[1], Outcome("done"))
    c.add(jobs[2], Outcome("fail", error="x"))
    wait_for(lambda: c.buffered == 0, what="the retried flush")
    c.close()
    assert sorted(r[0] for r in sql("SELECT status FROM fleetless.jobs")) == ["done", "done", "pending"]
    assert (c.counts.done, c.counts.failed, c.counts.fenced_out) == (2, 1, 0)  # each acknowledged once


def test_one_outcome_the_database_refuses_fails_that_job_alone_and_the_flush_writes_the_rest(
        queue: Queue, sql: Callable[..., list[Any]]) -> None:
    ids = queue.enqueue_many([("k", {}) for _ in range(4)])
    jobs = claim_all(queue, 4)

    class Never(RetryPolicy):  # a retry delay PostgreSQL cannot add to now()
        def delay(self, attempt: int) -> float:
            return 1e300

    c = Completer(queue, flush_size=100, retry_of=lambda job: Never() if job is jobs[1] else RetryPolicy())
    c.add(jobs[0], Outcome("done", result="fine"))
    c.add(jobs[1], Outcome("fail", error="boom"))
    c.add(jobs[2], Outcome("fail", error="try again"))
    c.add(jobs[3], Outcome("release", error="stopping"))
    c.flush()
    rows = {r[0]: r[1:] for r in sql("SELECT id, status, attempts, last_error FROM fleetless.jobs")}
    assert rows == {
        ids[0]: ("done", 1, None),
        ids[1]: ("dead", 1, "its outcome cannot be stored: database refused a value: timestamp out of range"),
        ids[2]: ("pending", 1, "try again"),
        ids[3]: ("pending", 0, "stopping")}
    counts = c.counts
    assert (counts.done, counts.dead, counts.failed, counts.released, c.buffered) == (1, 1, 1, 1, 0)


def test_a_row_refused_for_no_known_reason_stops_the_flush_there_and_keeps_the_rest(
        queue: Queue, sql: Callable[..., list[Any]]) -> None:
    sql("""CREATE OR REPLACE FUNCTION refuse_done() RETURNS trigger LANGUAGE plpgsql AS $$
           BEGIN
             IF NEW.status = 'done' AND NEW.payload ? 'refuse' THEN RAISE EXCEPTION 'audit log is full'; END IF;
             RETURN NEW;
           END $$""")
    sql("CREATE TRIGGER refuse_done BEFORE UPDATE ON fleetless.jobs FOR EACH ROW EXECUTE FUNCTION refuse_done()")
    try:
        first = queue.enqueue("k", {}, priority=3)
        refused = queue.enqueue("k", {"refuse": True}, priority=2)
        last = queue.enqueue("k", {}, priority=1)
        jobs = claim_all(queue, 3)
        c = Completer(queue, flush_size=100)
        for job in jobs:
            c.add(job, Outcome("done"))
        with pytest.raises(DatabaseError, match="audit log is full"):
            c.flush()
        # What came before it is written; it and what follows stay buffered for the drainer to
        # decide (it gives them back: settle).
        assert [j.id for j in c.holding()] == [refused, last]
        assert c.settle("released: the drain stopped") == (1, 1)
        assert sql("SELECT id, status, attempts FROM fleetless.jobs ORDER BY id") == [
            (first, "done", 1), (refused, "pending", 0), (last, "done", 1)]
    finally:
        sql("DROP TRIGGER refuse_done ON fleetless.jobs")


def test_outcomes_written_with_the_next_claim_share_its_transaction(queue: Queue,
                                                                    sql: Callable[..., list[Any]]) -> None:
    """Per-job mode: a slot's outcome and its next job go in one transaction (one commit, one round
    trip): the finished row and the claimed one carry the same transaction id and time."""
    first, second = queue.enqueue_many([("k", {"n": 0}), ("k", {"n": 1})])
    (job,) = claim_all(queue, 1)
    completer = Completer(queue)
    completer.add(job, Outcome("done", result="r"))
    claimed = completer.flush_then_claim(lambda items: queue.finish_then_claim(items, 5, ttl=60))
    assert [j.id for j in claimed or []] == [second]
    assert completer.counts.done == 1 and completer.buffered == 0
    rows = dict((r[0], r[1:]) for r in sql(
        "SELECT id, status, xmin::text, finished_at, started_at FROM fleetless.jobs"))
    assert rows[first][0] == "done" and rows[second][0] == "running"
    assert rows[first][1] == rows[second][1]  # the same transaction wrote both rows
    assert rows[first][2] == rows[second][3]  # now(): its one start time
    assert sql("SELECT job_id, outcome FROM fleetless.job_attempts") == [(first, "done")]


def test_an_outcome_refused_with_the_next_claim_claims_nothing_and_is_written_alone(
        queue: Queue, sql: Callable[..., list[Any]]) -> None:
    """All or nothing: the database refusing an outcome rolls the claim back with it; the
    completer then writes the outcomes one by one (the refused one fails its job alone) and says
    nothing was claimed, so the caller claims on its own."""
    ids = queue.enqueue_many([("k", {"n": i}) for i in range(3)])
    good, bad = claim_all(queue, 2)
    completer = Completer(queue)
    completer.add(good, Outcome("done", result="r"))
    completer.add(bad, Outcome("done", result_json="{not json"))
    assert completer.flush_then_claim(lambda items: queue.finish_then_claim(items, 5, ttl=60)) is None
    assert sql("SELECT id, status, left(last_error, 30) FROM fleetless.jobs ORDER BY id") == [
        (ids[0], "done", None), (ids[1], "dead", "its outcome cannot be stored: "), (ids[2], "pending", None)]
    assert (completer.counts.done, completer.counts.dead, completer.buffered) == (1, 1, 0)


def test_the_background_writer_keeps_each_statement_within_its_row_cap(
        queue: Queue, sql: Callable[..., list[Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    """A backlog (the outcomes of several batches at once) is written as several statements of at
    most STATEMENT_ROWS rows, oldest first, not as one statement that runs long on one core."""
    import fleetless.completer as completer

    monkeypatch.setattr(completer, "STATEMENT_ROWS", 4)
    queue.enqueue_many([("k", {}) for _ in range(10)])
    jobs = claim_all(queue, 10)
    sizes = statement_sizes(queue, monkeypatch)
    c = Completer(queue, flush_size=2, flush_interval=3600)
    with c._cond:  # the whole backlog arrives before the writer looks
        for job in jobs:
            c._buffer.append((job, Outcome("done")))
        c._first_at = 0.0
    c.start()
    wait_for(lambda: c.buffered == 0, what="the backlog written")
    c.close()
    assert sizes == [4, 4, 2]
    assert sql("SELECT count(*) FROM fleetless.jobs WHERE status = 'done'") == [(10,)]
    assert c.counts.done == 10


def test_close_writes_half_of_what_is_left_on_a_second_connection_each_outcome_once(
        dsn: str, queue: Queue, sql: Callable[..., list[Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    """The drain's tail: close() writes what is left on the completer's connection and on a second
    one (the drain's own) at once; every outcome is written and counted once, and a half the second
    connection cannot write is put back and written by the closing flush."""
    queue.enqueue_many([("k", {"n": i}) for i in range(40)])
    jobs = claim_all(queue, 40)
    beside = Queue(dsn)
    written_beside = statement_sizes(beside, monkeypatch)
    seen: list[int] = []
    c = Completer(queue, flush_size=5, flush_interval=3600, on_written=lambda job, o, s: seen.append(job.id))
    for job in jobs[:20]:
        c.add(job, Outcome("done"))
    c.close(beside=beside)
    assert written_beside == [10]
    assert sorted(seen) == sorted(j.id for j in jobs[:20]) and c.counts.done == 20

    def lost(items: Any) -> Any:
        raise DatabaseUnavailable("database unavailable: server closed the connection unexpectedly")

    monkeypatch.setattr(beside, "finish_claims", lost)
    again = Completer(queue, flush_size=5, flush_interval=3600)
    for job in jobs[20:]:
        again.add(job, Outcome("fail", error="x"))
    again.close(beside=beside)
    assert (again.counts.failed, again.buffered) == (20, 0)
    beside.close()
    assert sql("SELECT status, count(*) FROM fleetless.jobs GROUP BY 1 ORDER BY 1") == [("done", 20), ("pending", 20)]
    assert sql("SELECT count(*) FROM fleetless.job_attempts") == [(40,)]  # one history row each


def test_close_raises_what_failed_beside_its_write_rather_than_hide_it(
        dsn: str, queue: Queue, sql: Callable[..., list[Any]]) -> None:
    """The second connection's outcomes written, their reporting failing (a reporter whose pipe
    closed): close() raises that error as a single writer's flush would, and writes everything."""
    queue.enqueue_many([("k", {"n": i}) for i in range(12)])
    jobs = claim_all(queue, 12)
    first = jobs[0].id  # in the half taken for the second connection (the oldest)

    def reporter(job: Job, outcome: Outcome, status: Any) -> None:
        if job.id == first:
            raise BrokenPipeError("the reporter's pipe closed")

    c = Completer(queue, flush_size=2, flush_interval=3600, on_written=reporter)
    for job in jobs:
        c.add(job, Outcome("done"))
    beside = Queue(dsn)
    with pytest.raises(BrokenPipeError):
        c.close(beside=beside)
    beside.close()
    assert sql("SELECT status, count(*) FROM fleetless.jobs GROUP BY 1") == [("done", 12)]


def _prepared(queue: Queue) -> set[str]:
    """The statements fleetless prepared on ``queue``'s own session (that session's view only)."""
    assert queue._conn is not None
    return {r[0] for r in queue._conn.execute(
        "SELECT name FROM pg_prepared_statements WHERE name LIKE 'fleetless%'").fetchall()}


def test_a_queue_on_its_own_session_finishes_and_claims_with_statements_prepared_once(
        queue: Queue, sql: Callable[..., list[Any]]) -> None:
    """On a server session of its own, the per-job finish and claim travel as EXECUTEs of
    statements prepared once per session (the server skips parsing them again), with the same rows
    written; a new session (after a reconnect) prepares them again."""
    ids = queue.enqueue_many([("k", {"n": i}) for i in range(5)])
    (job,) = claim_all(queue, 1)
    _, (job,) = queue.finish_then_claim([(job, Outcome("done", result="r0"))], 1, ttl=60)
    assert _prepared(queue) == {"fleetless_finish_done", "fleetless_claim"}
    _, (job,) = queue.finish_then_claim([(job, Outcome("fail", error="boom", delay=3600))], 1, ttl=60)
    assert _prepared(queue) == {"fleetless_finish_done", "fleetless_finish_many", "fleetless_claim"}
    assert queue._conn is not None
    queue._conn.close()  # the next call opens a new session: nothing is prepared there yet
    before = job
    written, (job,) = queue.finish_then_claim([(job, Outcome("done", result="r2"))], 1, ttl=60)
    assert written == {(ids[2], before.claim_token): "done"} and job.id == ids[3]  # by claim
    assert _prepared(queue) == {"fleetless_finish_done", "fleetless_claim"}
    assert sql("SELECT id, status, attempts, result, last_error FROM fleetless.jobs ORDER BY id") == [
        (ids[0], "done", 1, "r0", None), (ids[1], "pending", 1, None, "boom"), (ids[2], "done", 1, "r2", None),
        (ids[3], "running", 1, None, None), (ids[4], "pending", 0, None, None)]
    assert sql("SELECT job_id, outcome FROM fleetless.job_attempts ORDER BY id") == [
        (ids[0], "done"), (ids[1], "failed"), (ids[2], "done")]


def test_a_prepared_claim_keeps_a_fractional_timeout_in_the_lease(queue: Queue) -> None:
    """The prepared claim's parameters have the types the literal one had: a 0.5 s default timeout
    makes a lease of grace + 0.5 s, not a rounded one."""
    queue.enqueue_many([("k", {}), ("k", {}), ("k", {})])
    (job,) = claim_all(queue, 1)
    for _ in range(2):  # the first run prepares it, the second runs the prepared statement again
        _, claimed = queue.finish_then_claim([(job, Outcome("done"))], 1, default_timeout=0.5, ttl=900,
                                             lease_grace=60)
        (job,) = claimed
        assert job.lease_seconds is not None and abs(job.lease_seconds - 60.5) < 0.2
    assert "fleetless_claim" in _prepared(queue)
