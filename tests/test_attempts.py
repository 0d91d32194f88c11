"""Attempt history: one row per ended attempt, written by the job's own finish statement, shown by
``fleetless show`` and ``Queue.attempts``, pruned with its job."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from fleetless import JobNotFound, Queue
from fleetless.drainer import DrainConfig, Drainer
from fleetless.job import Run
from fleetless.retry import RetryPolicy

pytestmark = pytest.mark.usefixtures("private_workdir")


def drain(queue: Queue, handlers_dir: Path, **options: object) -> None:
    options.setdefault("concurrency", 2)
    options.setdefault("retry", RetryPolicy(base_seconds=0, max_jitter_seconds=0))
    Drainer(queue, DrainConfig(handlers_dir=handlers_dir, **options)).run()  # type: ignore[arg-type]


def test_every_attempt_of_a_drained_job_is_recorded_with_how_it_ended(queue: Queue, handlers) -> None:
    h = handlers(**{"third-time.py": """
        import os, sys
        attempt = int(os.environ["FLEETLESS_ATTEMPT"])
        if attempt == 1:
            sys.exit("first failure")
        if attempt == 2:
            os.kill(os.getpid(), 11)
        print("ok")
    """})
    job_id = queue.enqueue("third-time", {})
    for _ in range(3):
        drain(queue, h)
    rows = queue.attempts(job_id)
    assert [(a["attempt"], a["outcome"], a["exit_code"], a["signal"]) for a in rows] == [
        (1, "failed", 1, None), (2, "failed", None, "SIGSEGV"), (3, "done", 0, None)]
    assert {(a["host"], a["pid"], a["tier"]) for a in rows} == {(socket.gethostname(), os.getpid(), "process")}
    assert rows[0]["error_head"].startswith("exit code 1")
    assert rows[2]["error_head"] is None
    for a in rows:
        assert a["started_at"] <= a["finished_at"]
        assert a["duration_seconds"] == pytest.approx((a["finished_at"] - a["started_at"]).total_seconds(),
                                                      abs=0.01)


def test_a_killed_attempt_records_the_kill_reason_and_the_dead_outcome(queue: Queue, handlers) -> None:
    h = handlers(**{"slow.py": "import time; time.sleep(60)"})
    job_id = queue.enqueue("slow", {}, max_attempts=1, timeout=1)
    drain(queue, h)
    (a,) = queue.attempts(job_id)
    assert (a["outcome"], a["kill_reason"]) == ("dead", "timeout after 1 s")


def test_a_job_with_no_handler_records_an_attempt_that_never_ran(queue: Queue, handlers) -> None:
    job_id = queue.enqueue("nobody", {})
    drain(queue, handlers(), no_handler_delay=None)
    (a,) = queue.attempts(job_id)
    assert (a["outcome"], a["exit_code"], a["signal"]) == ("dead", None, None)
    assert a["error_head"].startswith("no handler for kind 'nobody'")


def test_a_fenced_out_finish_writes_no_history(queue: Queue, sql) -> None:
    queue.enqueue("a", {})
    (old,) = queue.claim(1)
    sql("UPDATE fleetless.jobs SET lease_expires_at = now() - interval '1 second'")
    queue.reap()
    (new,) = queue.claim(1)
    assert not queue.complete(old, "stale", run=Run(tier="process", exit_code=0))
    assert queue.complete(new, "fresh", run=Run(tier="bwrap", exit_code=0))
    assert [(a["attempt"], a["outcome"], a["tier"], a["host"], a["kill_reason"])
            for a in queue.attempts(new.id)] == [
        (1, "expired", None, None, "claim expired"), (2, "done", "bwrap", socket.gethostname(), None)]


def test_a_released_attempt_is_recorded_under_the_number_the_next_claim_uses_again(queue: Queue) -> None:
    queue.enqueue("a", {})
    (job,) = queue.claim(1)
    assert queue.release(job, "drainer stopping", run=Run(tier="process", kill_reason="drainer stopped"))
    (again,) = queue.claim(1)
    queue.fail(again, "boom", delay=0, run=Run(tier="process", exit_code=3))
    assert [(a["attempt"], a["outcome"], a["kill_reason"], a["exit_code"]) for a in queue.attempts(job.id)] == [
        (1, "released", "drainer stopped", None), (1, "failed", None, 3)]


def test_history_is_pruned_with_its_job(queue: Queue, sql) -> None:
    queue.enqueue("a", {})
    (job,) = queue.claim(1)
    queue.complete(job)
    sql("UPDATE fleetless.jobs SET finished_at = now() - interval '30 days'")
    assert sql("SELECT count(*) FROM fleetless.job_attempts") == [(1,)]
    assert queue.prune(86400) == 1
    assert sql("SELECT count(*) FROM fleetless.job_attempts") == [(0,)]


def test_attempts_of_an_unknown_job_is_job_not_found(queue: Queue) -> None:
    queue.enqueue("a", {})
    assert queue.attempts(1) == []
    with pytest.raises(JobNotFound):
        queue.attempts(99)


def test_show_lists_the_attempts(dsn: str, queue: Queue, fleetless) -> None:
    queue.enqueue("a", {})
    (job,) = queue.claim(1)
    queue.fail(job, "exit code 2\nTraceback ...", delay=0, run=Run(tier="bwrap", exit_code=2))
    out = fleetless("show", str(job.id), dsn=dsn)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    at = lines.index("attempts (1):")
    assert lines[at + 1].split()[:4] == ["attempt", "outcome", "drainer", "tier"]
    assert lines[at + 2].split()[:4] == ["1", "failed", f"{socket.gethostname()}:{os.getpid()}", "bwrap"]
    data = json.loads(fleetless("show", str(job.id), "--json", dsn=dsn).stdout)
    assert [(a["attempt"], a["outcome"], a["exit_code"]) for a in data["attempts"]] == [(1, "failed", 2)]


def test_a_batched_finish_writes_each_rows_history_in_the_same_statement(queue: Queue) -> None:
    from fleetless.job import Outcome

    queue.enqueue_many([("a", {})] * 3)
    a, b, c = queue.claim(3)
    sql_written = queue.finish_many([
        (a, Outcome("done", result="ok", run=Run(tier="process", exit_code=0))),
        (b, Outcome("fail", error="exit code 4", delay=0, run=Run(tier="process", exit_code=4))),
        (c, Outcome("release", error="stopping", run=Run(tier="process", kill_reason="drainer stopped"))),
    ])
    assert len(sql_written) == 3
    assert [(x["attempt"], x["outcome"], x["exit_code"], x["kill_reason"], x["started_at"] is not None)
            for j in (a, b, c) for x in queue.attempts(j.id)] == [
        (1, "done", 0, None, True), (1, "failed", 4, None, True), (1, "released", None, "drainer stopped", True)]
    # The same claim's finish again (a retry after a lost reply): its own earlier write, no second row.
    assert queue.finish_many([(a, Outcome("done"))]) == {a.id: "done"}
    assert len(queue.attempts(a.id)) == 1


def test_a_flush_of_done_outcomes_alone_writes_the_rows_and_history_a_mixed_flush_writes(queue: Queue, sql) -> None:
    """A flush whose outcomes are all done takes a leaner statement (finish_done): every column it
    leaves on the job and its attempt row are what the general one (finish_many) writes for the
    same outcome, a requested cancel still losing to done, and it is fenced on the claim alike."""
    from fleetless.job import Outcome

    queue.enqueue_many([("a", {})] * 4)
    lean, lean_cancelled, general, general_cancelled = queue.claim(4, claimed_by="h:1", tier="microvm")
    sql("UPDATE fleetless.jobs SET cancel_requested_at = now() WHERE id = ANY(%s)",
        [lean_cancelled.id, general_cancelled.id])
    done = [Outcome("done", result_json='{"n": 1}', run=Run(tier="bwrap", exit_code=0)),
            Outcome("done", result="out\n")]
    assert queue.finish_many(list(zip((lean, lean_cancelled), done, strict=True))) == {
        lean.id: "done", lean_cancelled.id: "done"}
    release = Outcome("release", error="stopping")  # makes the flush a mixed one
    extra = queue.enqueue("a", {})
    (held,) = queue.claim(1)
    assert held.id == extra
    assert queue.finish_many([*zip((general, general_cancelled), done, strict=True), (held, release)]) == {
        general.id: "done", general_cancelled.id: "done", held.id: "pending"}

    def row(job_id: int) -> tuple[object, ...]:
        (r,) = sql("SELECT status, attempts, releases, result, result_json, last_error, started_at IS NOT NULL,"
                   " finished_at IS NOT NULL, locked_at, lease_expires_at, tier FROM fleetless.jobs WHERE id = %s",
                   job_id)
        (a,) = [(x["attempt"], x["outcome"], x["tier"], x["exit_code"], x["host"], x["started_at"] is not None,
                 x["duration_seconds"] is not None, x["error_head"]) for x in queue.attempts(job_id)]
        return r, a

    assert row(lean.id) == row(general.id)
    assert row(lean_cancelled.id) == row(general_cancelled.id)
    assert row(lean.id)[0][:5] == ("done", 1, 0, None, {"n": 1})
    assert row(lean.id)[1][:3] == (1, "done", "bwrap")
    assert row(lean_cancelled.id)[1][:3] == (1, "done", "microvm")  # the claim's tier when the outcome has none
    # The same claim's done again (a retry after a lost reply): its own write, no second history row;
    # once a new claim holds the job, the old claim's write changes nothing and is answered with
    # what that claim's own outcome set (its history row carries its token).
    assert queue.finish_many([(lean, Outcome("done"))]) == {lean.id: "done"}
    assert len(queue.attempts(lean.id)) == 1
    (again,) = queue.claim(1)  # the released job, under a new claim
    assert again.id == held.id
    assert queue.finish_many([(held, Outcome("done"))]) == {held.id: "pending"}
    assert sql("SELECT status FROM fleetless.jobs WHERE id = %s", held.id) == [("running",)]
    assert len(queue.attempts(held.id)) == 1


def test_an_expired_attempt_names_the_drainer_that_held_it(queue: Queue, sql) -> None:
    job_id = queue.enqueue("a", {})
    queue.claim(1, claimed_by="worker-7.example:4242", tier="bwrap")
    sql("UPDATE fleetless.jobs SET lease_expires_at = now() - interval '1 second'")
    queue.reap()
    (a,) = queue.attempts(job_id)
    assert (a["outcome"], a["host"], a["pid"], a["tier"]) == ("expired", "worker-7.example", 4242, "bwrap")


def test_an_outcome_that_does_not_name_its_tier_records_the_claims(queue: Queue) -> None:
    from fleetless.job import Outcome

    queue.enqueue_many([("a", {})] * 2)
    batched, single = queue.claim(2, claimed_by="h:1", tier="microvm")
    queue.finish_many([(batched, Outcome("done", result="ok"))])
    queue.complete(single, "ok")
    assert [a["tier"] for j in (batched, single) for a in queue.attempts(j.id)] == ["microvm", "microvm"]
