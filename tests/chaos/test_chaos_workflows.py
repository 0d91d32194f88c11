"""Workflows under SIGKILLs (issue 29): a diamond (A -> B, C -> D) and a chain drain while drainers
are killed at random moments. Every job ends done, each attempt ran at most once, and no attempt
of a child started before its parents had finished, compared on the table's own clocks.

CI size: a 200-job chain and 5 kills; ``FLEETLESS_SOAK=1`` (marked slow): the issue's 1,000-job
chain and 20 kills."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any

import pytest

from fleetless import Queue

from .conftest import SOAK, Drain, executions, processes_mentioning
from proctools import leftovers, wait_for

CHAIN = int(os.environ.get("FLEETLESS_CHAOS_CHAIN", 1_000 if SOAK else 200))
KILLS = int(os.environ.get("FLEETLESS_CHAOS_KILLS", 20 if SOAK else 5))
DRAINERS, CONCURRENCY = 3, 2
DRAIN_ARGS = ("--concurrency", str(CONCURRENCY), "--batch", str(CONCURRENCY), "--timeout", "5",
              "--lease-grace", "3", "--backoff-base", "0", "--max-jitter", "0")


@pytest.mark.parametrize("size", [pytest.param(CHAIN, marks=[pytest.mark.slow] if SOAK else [])])
def test_a_diamond_and_a_chain_drain_in_order_under_sigkills(
        dsn: str, queue: Queue, sql: Any, handlers: Any, tmp_path: Path, workdir: Path, start_drain: Any,
        size: int) -> None:
    log = tmp_path / "executions.log"
    h = handlers(work=f"""
        #!/bin/sh
        echo "$FLEETLESS_JOB_ID $FLEETLESS_ATTEMPT" >> {log}
        echo "$FLEETLESS_JOB_ID $FLEETLESS_ATTEMPT"
    """)
    options = {"kind": "work", "max_attempts": 50}
    queue.enqueue_many(
        [{**options, "payload": {"n": "a"}, "name": "a"},
         {**options, "payload": {"n": "b"}, "name": "b", "after": ["a"]},
         {**options, "payload": {"n": "c"}, "name": "c", "after": ["a"]},
         {**options, "payload": {"n": "d"}, "after": ["b", "c"]}]
        + [{**options, "payload": {"n": i}, "name": f"link{i}", **({"after": [f"link{i - 1}"]} if i else {})}
           for i in range(size)])
    total = size + 4
    seed = int(os.environ.get("FLEETLESS_CHAOS_SEED", random.randrange(2**32)))
    rng = random.Random(seed)
    print(f"\nchaos seed {seed} (FLEETLESS_CHAOS_SEED={seed} repeats the kill schedule)")
    thresholds = sorted(rng.sample(range(total * 3 // 100, total * 95 // 100), KILLS))
    started = time.monotonic()
    deadline = started + max(240, total / 2 + KILLS * 10)  # a chain runs one job at a time

    def done_count() -> int:
        return int(sql("SELECT count(*) FROM fleetless.jobs WHERE status = 'done'")[0][0])

    slots: list[Drain] = [start_drain(dsn, h, *DRAIN_ARGS) for _ in range(DRAINERS)]
    kills = 0
    while (done := done_count()) < total:
        assert time.monotonic() < deadline, f"only {done} of {total} done after {time.monotonic() - started:.0f} s"
        for i, d in enumerate(slots):
            if d.poll() is not None:  # nothing claimable (a chain's next link waits on a killed claim)
                assert d.poll() == 0, d.stderr
                time.sleep(0.2)
                slots[i] = start_drain(dsn, h, *DRAIN_ARGS)
        if kills < KILLS and done >= thresholds[kills]:
            time.sleep(rng.uniform(0, 0.3))
            victim = rng.randrange(DRAINERS)
            slots[victim].kill()
            kills += 1
            slots[victim] = start_drain(dsn, h, *DRAIN_ARGS)
        time.sleep(0.02)
    for d in slots:
        assert d.wait() == 0, d.stderr

    assert kills == KILLS
    assert sql("SELECT status, count(*) FROM fleetless.jobs GROUP BY status") == [("done", total)]
    # children never before their parents: every attempt of a child started after each parent's finish
    assert sql("""SELECT d.child_id, d.parent_id, a.attempt FROM fleetless.job_dependencies d
                  JOIN fleetless.job_attempts a ON a.job_id = d.child_id
                  JOIN fleetless.jobs p ON p.id = d.parent_id
                  WHERE a.started_at < p.finished_at""") == []
    # every job ran once per attempt, and its last attempt ran
    attempts = dict(sql("SELECT id, attempts FROM fleetless.jobs"))
    runs = executions(log)
    assert set(runs) == set(attempts)
    for job_id, ran in runs.items():
        assert len(ran) == len(set(ran)), (job_id, ran)
        assert max(ran) == attempts[job_id], (job_id, ran, attempts[job_id])
    assert processes_mentioning(str(workdir)) == []
    wait_for(lambda: not leftovers(workdir), timeout=10, what="workspaces to be removed")
