"""Drainers SIGKILLed at random moments while three of them race over a burst of short jobs: every
job ends done, nothing is stuck in running, and every re-run is an attempt the table counted."""

from __future__ import annotations

import collections
import os
import random
import time
from pathlib import Path
from typing import Any

import psycopg

from fleetless import Queue

from .conftest import SOAK, Drain, executions, processes_mentioning
from proctools import leftovers, wait_for

# The issue asks for 20 kills over 2,000 jobs (FLEETLESS_SOAK=1); by default the 20 kills come over
# 1,000 jobs, to fit the suite in its time on a 2-core machine. FLEETLESS_CHAOS_JOBS and
# FLEETLESS_CHAOS_KILLS set any other size.
JOBS = int(os.environ.get("FLEETLESS_CHAOS_JOBS", 2_000 if SOAK else 1_000))
KILLS = int(os.environ.get("FLEETLESS_CHAOS_KILLS", 20))
DRAINERS, CONCURRENCY = 3, 2
DRAIN_ARGS = ("--concurrency", str(CONCURRENCY), "--batch", str(CONCURRENCY), "--timeout", "5",
              "--lease-grace", "3", "--backoff-base", "0", "--max-jitter", "0")


def test_drainers_sigkilled_at_random_lose_no_job_and_every_rerun_is_a_counted_attempt(
        dsn: str, queue: Queue, sql: Any, handlers: Any, tmp_path: Path, workdir: Path, start_drain: Any,
        record_property: Any) -> None:
    log = tmp_path / "executions.log"
    h = handlers(work=f"""
        #!/bin/sh
        echo "$FLEETLESS_JOB_ID $FLEETLESS_ATTEMPT" >> {log}
        echo "$FLEETLESS_JOB_ID $FLEETLESS_ATTEMPT"
    """)
    queue.enqueue_many({"kind": "work", "payload": {"i": i}, "max_attempts": 50} for i in range(JOBS))
    seed = int(os.environ.get("FLEETLESS_CHAOS_SEED", random.randrange(2**32)))
    rng = random.Random(seed)
    print(f"\nchaos seed {seed} (FLEETLESS_CHAOS_SEED={seed} repeats the kill schedule)")
    # The k-th kill comes when the done count first passes its threshold, after a random pause.
    thresholds = sorted(rng.sample(range(JOBS * 3 // 100, JOBS * 95 // 100), KILLS))
    started = time.monotonic()
    deadline = started + max(170, JOBS / 5)  # ~40 jobs/s here alone, half that under load

    def done_count() -> int:
        return int(sql("SELECT count(*) FROM fleetless.jobs WHERE status = 'done'")[0][0])

    slots: list[Drain] = [start_drain(dsn, h, *DRAIN_ARGS) for _ in range(DRAINERS)]
    everyone: list[Drain] = list(slots)
    kills = 0
    while (done := done_count()) < JOBS:
        assert time.monotonic() < deadline, f"only {done} of {JOBS} done after {time.monotonic() - started:.0f} s"
        for i, d in enumerate(slots):
            if d.poll() is not None:  # ran out of claimable work (leases of killed ones not yet expired)
                assert d.poll() == 0, d.stderr
                time.sleep(0.2)
                slots[i] = start_drain(dsn, h, *DRAIN_ARGS)
                everyone.append(slots[i])
        if kills < KILLS and done >= thresholds[kills]:
            time.sleep(rng.uniform(0, 0.3))
            victim = rng.randrange(DRAINERS)
            slots[victim].kill()
            kills += 1
            slots[victim] = start_drain(dsn, h, *DRAIN_ARGS)
            everyone.append(slots[victim])
        time.sleep(0.02)
    for d in slots:
        assert d.wait() == 0, d.stderr
    elapsed = time.monotonic() - started

    # The table: all done, nothing held, and the stored result is the last attempt's own output.
    assert kills == KILLS
    assert sql("SELECT status, count(*) FROM fleetless.jobs GROUP BY status") == [("done", JOBS)]
    assert sql("SELECT count(*) FROM fleetless.jobs WHERE claim_token IS NULL OR lease_expires_at IS NOT NULL"
               " OR locked_at IS NOT NULL OR result <> id || ' ' || attempts || E'\\n'") == [(0,)]
    attempts = dict(sql("SELECT id, attempts FROM fleetless.jobs"))

    # The log: no attempt ran twice, the last attempt ran, and no run happened outside an attempt.
    runs = executions(log)
    assert set(runs) == set(attempts)
    for job_id, ran in runs.items():
        assert len(ran) == len(set(ran)), (job_id, ran)  # one execution per attempt number
        assert max(ran) == attempts[job_id], (job_id, ran, attempts[job_id])
    extra_attempts = sum(attempts.values()) - JOBS  # type: ignore[arg-type]
    extra_runs = sum(len(r) for r in runs.values()) - JOBS
    # A drainer holds at most CONCURRENCY claims, so a kill can cost at most that many attempts.
    assert extra_attempts <= KILLS * CONCURRENCY, extra_attempts
    assert extra_runs <= extra_attempts
    histogram = collections.Counter(attempts.values())
    report = (f"{JOBS} jobs, {DRAINERS} drainers x {CONCURRENCY}, {kills} SIGKILLs, {len(everyone)} drain runs "
              f"in {elapsed:.1f} s: {extra_attempts} extra attempts charged, {extra_runs} handler re-runs "
              f"({extra_attempts - extra_runs} claims died before their handler started); "
              f"attempts histogram {dict(sorted(histogram.items()))}")
    print(report)
    record_property("chaos_kills", report)

    # Nothing of the killed drainers survives them: no supervisor or job process, no workspace.
    assert processes_mentioning(str(workdir)) == []
    wait_for(lambda: not leftovers(workdir), timeout=10, what="workspaces to be removed")
    with psycopg.connect(dsn) as c:
        assert c.execute("SELECT count(*) FROM fleetless.jobs WHERE status = 'running'").fetchone() == (0,)
