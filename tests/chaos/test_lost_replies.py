"""Replies lost at the worst moment: the statement committed, the connection dropped before the
drainer read the answer. A TCP proxy on loopback (``tests/pgproxy.py``) does it for real. The
drainer retries (it cannot tell a lost reply from a statement that never ran), and the retry must
find what the lost attempt did instead of doing it again or calling it someone else's."""

from __future__ import annotations

import logging
import uuid

import pytest
from pgproxy import pg_proxy

from fleetless import Queue, Status
from fleetless.completer import Completer
from fleetless.db import DatabaseUnavailable
from fleetless.drainer import DrainConfig, Drainer
from fleetless.job import Outcome
from fleetless.retry import RetryPolicy

CLAIM = b"attempts = j.attempts + 1"  # in the claim statement only
COMPLETE = b"SET status = 'done'"
FAIL = b"max_attempts AND NOT"
RELEASE = b"times in a row; charged"
FINISH = b"e->>5 AS error"
#: The per-job finish with a claim once prepared (its first use sends a PREPARE with FINISH's text)
EXECUTED_FINISH = b"EXECUTE fleetless_finish_many("


def test_a_claim_whose_reply_is_lost_runs_every_job_it_claimed(dsn: str, queue: Queue, handlers, sql) -> None:
    h = handlers(**{"ok.py": "print('ran')"})
    queue.enqueue_many({"kind": "ok", "payload": {"i": i}, "max_attempts": 1} for i in range(5))
    with pg_proxy(dsn) as proxy:
        proxy.drop_reply_to(CLAIM)
        through = Queue(proxy.dsn)
        summary = Drainer(through, DrainConfig(handlers_dir=h, concurrency=2, batch=5)).run()
        through.close()
    assert proxy.dropped == [CLAIM]
    # Nothing stranded running until its lease ends, nothing charged an attempt it did not run.
    assert sql("SELECT status, attempts, result, count(*) FROM fleetless.jobs GROUP BY 1, 2, 3") == [
        ("done", 1, "ran\n", 5)]
    assert (summary.claimed, summary.done, summary.fenced_out) == (5, 5, 0)


@pytest.mark.parametrize("per_sandbox", [1, 3], ids=["per-job", "batch"])
@pytest.mark.parametrize(("source", "status", "counted"), [
    ("print('ok')", "done", "done"),
    ("import sys; sys.exit(1)", "pending", "failed"),
], ids=["done", "failed"])
def test_a_finish_whose_reply_is_lost_is_recognised_as_the_drainers_own(
        dsn: str, queue: Queue, handlers, sql, source: str, status: str, counted: str, per_sandbox: int) -> None:
    h = handlers(**{"job.py": source})
    queue.enqueue_many([("job", {})] * 3)
    with pg_proxy(dsn) as proxy:
        proxy.drop_reply_to(FINISH)
        through = Queue(proxy.dsn)
        summary = Drainer(through, DrainConfig(handlers_dir=h, concurrency=1, per_sandbox=per_sandbox)).run()
        through.close()
    assert proxy.dropped == [FINISH]
    assert sql("SELECT status, attempts, count(*) FROM fleetless.jobs GROUP BY 1, 2") == [(status, 1, 3)]
    assert getattr(summary, counted) == 3 and summary.fenced_out == 0, summary


def test_a_batched_finish_retried_after_a_lost_reply_reports_every_row_as_its_own(
        dsn: str, queue: Queue, sql) -> None:
    queue.enqueue_many([("k", {})] * 3)
    with pg_proxy(dsn) as proxy:
        through = Queue(proxy.dsn)
        done, failed, released = jobs = through.claim(3)
        items = [(done, Outcome("done", result="r")), (failed, Outcome("fail", error="boom")),
                 (released, Outcome("release", error="stopping"))]
        proxy.drop_reply_to(FINISH)
        with pytest.raises(DatabaseUnavailable):
            through.finish_many(items)
        assert through.finish_many(items) == {  # the retry: every write is ours
            done.id: Status.DONE, failed.id: Status.PENDING, released.id: Status.PENDING}
        through.close()
    assert sql("SELECT id, status, attempts FROM fleetless.jobs ORDER BY id") == [
        (jobs[0].id, "done", 1), (jobs[1].id, "pending", 1), (jobs[2].id, "pending", 0)]
    # Once another claim holds a job, the old token changes nothing; asked again, the old claim's
    # outcome is still the one it wrote (found by its token in the attempt history), not fenced out.
    assert len(queue.claim(2)) == 2
    assert queue.finish_many(items[1:]) == {failed.id: Status.PENDING, released.id: Status.PENDING}
    assert sql("SELECT id, status, attempts FROM fleetless.jobs ORDER BY id") == [
        (jobs[0].id, "done", 1), (jobs[1].id, "running", 2), (jobs[2].id, "running", 1)]


def test_every_fenced_write_retried_after_a_lost_reply_reports_its_own_outcome(dsn: str, queue: Queue,
                                                                                sql) -> None:
    for _ in range(3):
        queue.enqueue("k", {})
    with pg_proxy(dsn) as proxy:
        through = Queue(proxy.dsn)
        done, failed, released = through.claim(3)
        for marker, write, expected in (
            (COMPLETE, lambda: through.complete(done, "r"), True),
            (FAIL, lambda: through.fail(failed, "boom", delay=0), Status.PENDING),
            (RELEASE, lambda: through.release(released, "stopping"), Status.PENDING),
        ):
            proxy.drop_reply_to(marker)
            with pytest.raises(DatabaseUnavailable):
                write()
            assert write() == expected  # the retry: the write is ours, not someone else's
        through.close()
    assert sql("SELECT status, attempts FROM fleetless.jobs ORDER BY id") == [
        ("done", 1), ("pending", 1), ("pending", 0)]
    # Once another claim holds the job, the old token changes nothing; the answer is still what
    # the old claim's own write set (it was written), not someone else's.
    assert len(queue.claim(2)) == 2
    assert queue.fail(released, "stale", delay=0) is Status.PENDING
    assert queue.release(failed, "stale") is Status.PENDING
    assert sql("SELECT status, attempts FROM fleetless.jobs ORDER BY id") == [
        ("done", 1), ("running", 2), ("running", 1)]


def test_a_per_job_outcome_written_with_a_claim_whose_reply_is_lost_is_recognised_and_nothing_strands(
        dsn: str, queue: Queue, handlers, sql) -> None:
    """Per-job mode writes a slot's outcome in its next claim's transaction. The last job's comes
    with a claim that finds nothing: that reply lost, the retry finds no claim it made and writes
    the outcome again, which recognises its own write."""
    h = handlers(**{"job.py": "print('ok')"})
    queue.enqueue("job", {})
    with pg_proxy(dsn) as proxy:
        proxy.drop_reply_to(FINISH)
        through = Queue(proxy.dsn)
        summary = Drainer(through, DrainConfig(handlers_dir=h, concurrency=1)).run()
        through.close()
    assert proxy.dropped == [FINISH]
    assert sql("SELECT status, attempts, result FROM fleetless.jobs") == [("done", 1, "ok\n")]
    assert sql("SELECT outcome, count(*) FROM fleetless.job_attempts GROUP BY 1") == [("done", 1)]
    assert (summary.done, summary.fenced_out) == (1, 0), summary


def test_a_lost_finish_whose_job_the_same_statement_claimed_again_is_counted_as_written(
        dsn: str, queue: Queue, sql) -> None:
    """Issue 26.9, the drainer's steps (Drainer._claim) one by one: a per-job slot writes its failed
    job's outcome (a retry due at once) with its next claim, that claim takes the same job again,
    and the reply is lost. The retry takes the claim back (the job, under the new token) and
    flushes the outcome again, whose old token matches nothing now. On 61e842d it was counted and
    logged as fenced out; it is the drainer's own write, counted as a retry (the attempt history
    row it wrote carries the old claim's token)."""
    queue.enqueue("k", {}, max_attempts=3)
    token = uuid.uuid4()
    with pg_proxy(dsn) as proxy:
        through = Queue(proxy.dsn)
        (job,) = through.claim(1)
        seen: list[Status | None] = []
        completer = Completer(through, RetryPolicy(base_seconds=0, max_jitter_seconds=0),
                              on_written=lambda _j, _o, status: seen.append(status))
        completer.add(job, Outcome("fail", error="boom"))
        proxy.drop_reply_to(EXECUTED_FINISH)
        with pytest.raises(DatabaseUnavailable):
            completer.flush_then_claim(lambda items: through.finish_then_claim(items, 1, token=token))
        held = through.claimed_with(token)  # the retry, as the drainer's
        assert [(j.id, j.attempts) for j in held] == [(job.id, 2)]
        completer.flush()  # the old claim's write, found by its token in the attempt history
        through.close()
    assert proxy.dropped == [EXECUTED_FINISH]
    assert (completer.counts.failed, completer.counts.fenced_out) == (1, 0)
    assert seen == [Status.PENDING] and completer.buffered == 0
    assert sql("SELECT status, attempts, claim_token FROM fleetless.jobs") == [("running", 2, token)]
    assert sql("SELECT attempt, outcome FROM fleetless.job_attempts") == [(1, "failed")]


def test_a_drain_counts_its_lost_finish_as_written_when_its_claim_took_the_job_again(
        dsn: str, queue: Queue, handlers, sql, tmp_path) -> None:
    """Issue 26.9 in a real per-job drain: the failed first attempt's outcome (a retry due at once)
    goes out with the slot's next claim, which takes the same job again; that reply is lost. On
    61e842d the drain counted a fenced-out outcome and no retry."""
    marker = tmp_path / "failed-once"
    h = handlers(**{"job.py": f"""
        import os, sys
        if not os.path.exists({str(marker)!r}):
            open({str(marker)!r}, "w").close()
            sys.exit(1)
        print("ok")
    """})
    queue.enqueue("job", {}, max_attempts=2)
    with pg_proxy(dsn) as proxy:
        proxy.drop_reply_to(EXECUTED_FINISH)
        through = Queue(proxy.dsn)
        config = DrainConfig(handlers_dir=h, concurrency=1, retry=RetryPolicy(base_seconds=0, max_jitter_seconds=0))
        summary = Drainer(through, config).run()
        through.close()
    assert proxy.dropped == [EXECUTED_FINISH]
    assert sql("SELECT status, attempts, result FROM fleetless.jobs") == [("done", 2, "ok\n")]
    assert sql("SELECT attempt, outcome FROM fleetless.job_attempts ORDER BY id") == [(1, "failed"), (2, "done")]
    assert (summary.failed, summary.done, summary.fenced_out) == (1, 1, 0), summary


#: A handle() module for the batch drain below: "s" decides Snooze(0) or Retry(after=0) on its first
#: run (a marker file outside the sandbox tells runs apart), then succeeds; "x" sleeps a second.
BATCH_DECIDER = """
    import os, time
    from fleetless.outcomes import Retry, Snooze

    def handle(payload):
        if payload["x"]:
            time.sleep(1)
            return "slept"
        if not os.path.exists(payload["marker"]):
            open(payload["marker"], "w").close()
            raise Snooze(0) if payload["decide"] == "snooze" else Retry(after=0)
        return "ok"
"""


@pytest.mark.parametrize(("decide", "history", "counted"), [
    ("snooze", [(1, "snoozed"), (1, "done")], "snoozed"),
    ("retry", [(1, "retried"), (2, "done")], "retried"),
])
def test_a_batch_drain_counts_its_lost_finish_as_written_when_it_claimed_the_job_again_before_the_retry(
        dsn: str, queue: Queue, handlers, sql, tmp_path, caplog: pytest.LogCaptureFixture,
        decide: str, history: list[tuple[int, str]], counted: str) -> None:
    """Issue 26.9, batch mode: a job that snoozed (or asked for a retry) with no delay has its
    outcome's reply lost; the statement committed, so the job is pending again and the drain's
    next claim (ahead, while the slot runs) takes it under a new token before the completer tries
    the write again. That retry matches nothing: before the fix the drain counted and logged the
    job as fenced out although the write was its own. Outcomes are told apart by their claim."""
    h = handlers(**{"k.py": BATCH_DECIDER})
    marker = tmp_path / "decided-once"
    s = queue.enqueue("k", {"x": False, "marker": str(marker), "decide": decide}, max_attempts=3)
    queue.enqueue_many([("k", {"x": True})] * 3)
    with pg_proxy(dsn) as proxy:
        proxy.drop_reply_to(FINISH)
        through = Queue(proxy.dsn)
        # The completer's first flush waits a second, its retry after a lost reply two more: the
        # second job of the first batch ends meanwhile, and the claim ahead takes the decided job.
        config = DrainConfig(handlers_dir=h, concurrency=1, per_sandbox=2, flush_interval=1.0, timeout=60)
        with caplog.at_level(logging.INFO, logger="fleetless"):
            summary = Drainer(through, config).run()
        through.close()
    assert proxy.dropped == [FINISH]
    assert sql("SELECT status, result_json FROM fleetless.jobs WHERE id = %s", s) == [("done", "ok")]
    assert sql("SELECT attempt, outcome FROM fleetless.job_attempts WHERE job_id = %s ORDER BY id", s) == history
    assert sql("SELECT count(*) FROM fleetless.jobs WHERE status = 'done'") == [(4,)]
    assert summary.claimed == 5 and summary.done == 4 and summary.fenced_out == 0, summary
    assert getattr(summary, counted) == 1, summary
    assert "taken over" not in caplog.text and "fenced out" not in summary.line()


def test_one_flush_with_two_claims_of_one_job_answers_each_claim_with_its_own_outcome(
        dsn: str, queue: Queue, sql) -> None:
    """A snooze due at once, its reply lost, the job claimed again and finished: the completer may
    write both claims' outcomes in one statement. Each is answered by its claim (job id and
    token), not both with the status the statement left on the job."""
    job_id = queue.enqueue("k", {})
    with pg_proxy(dsn) as proxy:
        through = Queue(proxy.dsn)
        (first,) = through.claim(1)
        snooze = (first, Outcome("snooze", error="later", delay=0))
        proxy.drop_reply_to(FINISH)
        with pytest.raises(DatabaseUnavailable):
            through.finish_claims([snooze])
        (second,) = through.claim(1)
        assert second.id == first.id and second.claim_token != first.claim_token
        assert through.finish_claims([snooze, (second, Outcome("done", result="r"))]) == {
            (job_id, first.claim_token): Status.PENDING, (job_id, second.claim_token): Status.DONE}
        through.close()
    assert sql("SELECT status, attempts, snoozes FROM fleetless.jobs") == [("done", 1, 1)]
    assert sql("SELECT attempt, outcome FROM fleetless.job_attempts ORDER BY id") == [(1, "snoozed"), (1, "done")]


#: The simple-query message psycopg sends to end a transaction it opened: exactly COMMIT.
COMMIT_MESSAGE = b"Q\x00\x00\x00\x0bCOMMIT\x00"


def test_a_keyed_child_enqueued_again_after_its_commits_reply_was_lost_is_written_once(
        dsn: str, queue: Queue, sql) -> None:
    """enqueue(after=..., key=...): the transaction committed, its reply never came; the app
    enqueues again with the same key and gets the child that was written, not a second one."""
    parent = queue.enqueue("a", {})
    with pg_proxy(dsn) as proxy:
        through = Queue(proxy.dsn)
        proxy.drop_reply_to(COMMIT_MESSAGE)
        with pytest.raises(DatabaseUnavailable):
            through.enqueue("b", {"v": 1}, after=[parent], key="child-1")
        assert proxy.dropped == [COMMIT_MESSAGE]
        child = through.enqueue("b", {"v": 1}, after=[parent], key="child-1")
        through.close()
    assert child.existing
    assert sql("SELECT id, status, key FROM fleetless.jobs WHERE kind = 'b'") == [(child, "waiting", "child-1")]
    assert sql("SELECT parent_id, child_id FROM fleetless.job_dependencies") == [(parent, child)]
