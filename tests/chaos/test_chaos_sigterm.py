"""SIGTERM with many jobs in flight: jobs that finish in the grace period are recorded, the rest are
given back without charging an attempt, nothing is left claimed, exit 0; the next drain finishes."""

from __future__ import annotations

import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

from fleetless import Queue, batch
from fleetless.drainer import DrainConfig, Drainer

from .conftest import executions, processes_mentioning
from proctools import wait_for


def test_sigterm_to_three_busy_drainers_finishes_or_returns_every_job_and_exits_0(
        dsn: str, queue: Queue, sql: Any, handlers: Any, tmp_path: Path, workdir: Path, start_drain: Any,
        fleetless: Any) -> None:
    starts, ends = tmp_path / "starts.log", tmp_path / "ends.log"
    h = handlers(**{"work.py": f"""
        import json, os, sys, time
        line = f"{{os.environ['FLEETLESS_JOB_ID']}} {{os.environ['FLEETLESS_ATTEMPT']}}\\n"
        with open({str(starts)!r}, "a") as f:
            f.write(line)
        time.sleep(json.load(open(sys.argv[1]))["seconds"])
        with open({str(ends)!r}, "a") as f:
            f.write(line)
        print("ok")
    """})
    rng = random.Random()
    n = 60
    # Nine long jobs first (priority): more than the grace period is left of them at the SIGTERM.
    queue.enqueue_many([{"kind": "work", "payload": {"seconds": 3}, "priority": 1}] * 9
                       + [{"kind": "work", "payload": {"seconds": round(rng.uniform(0.1, 1.0), 2)}}
                          for _ in range(n - 9)])
    drains = [start_drain(dsn, h, "--concurrency", "3", "--shutdown-grace", "1", "--lease-grace", "3")
              for _ in range(3)]
    wait_for(lambda: sum(len(r) for r in executions(starts).values()) >= 9, what="jobs to be running")
    assert sql("SELECT count(*) FROM fleetless.jobs WHERE status = 'running'")[0][0] >= 6
    for d in drains:
        d.proc.send_signal(signal.SIGTERM)
    for d in drains:
        assert d.wait(timeout=30) == 0, d.stderr
        # (a root drainer whose own interpreter its job uids cannot reach says once which one it uses)
        said = [ln for ln in d.stderr.strip().splitlines() if not ln.startswith("fleetless: handlers run under")]
        assert said == ["fleetless: SIGTERM: stopping; running jobs get 1 s"], d.stderr
    # Nothing held (a released row keeps its last token: a retried release recognises its own write).
    assert sql("SELECT count(*) FROM fleetless.jobs WHERE status = 'running' OR locked_at IS NOT NULL"
               " OR lease_expires_at IS NOT NULL") == [(0,)]
    rows = dict((r[0], r[1:]) for r in sql("SELECT id, status, attempts FROM fleetless.jobs"))
    assert {s for s, _ in rows.values()} <= {"done", "pending"}
    assert all(a == (1 if s == "done" else 0) for s, a in rows.values()), rows  # released: attempt given back
    released = sum(int(d.stdout.split(" released")[0].rsplit(", ", 1)[1]) if "released" in d.stdout else 0
                   for d in drains)
    started, ended = executions(starts), executions(ends)
    assert released == len(set(started) - set(ended)) > 0  # cut short: given back, one by one
    assert {job for job in ended if rows[job][0] != "done"} == set()  # a job that ended is never given back
    assert processes_mentioning(str(workdir)) == []

    again = fleetless("drain", "--handlers", str(h), "--concurrency", "8", dsn=dsn)
    assert again.returncode == 0, again.stderr
    assert sql("SELECT status, attempts, count(*) FROM fleetless.jobs GROUP BY 1, 2") == [("done", 1, n)]


def test_a_job_that_ended_on_its_own_as_the_grace_ran_out_keeps_its_outcome(queue: Queue, sql: Any, handlers: Any,
                                                                             monkeypatch: Any) -> None:
    # The job exits 0; as its sandbox is handed over to be taken down (its unit not yet returned),
    # the shutdown grace runs out and the drainer aborts what it holds. The job's outcome is known:
    # it must be recorded, not thrown away with the claim given back (which would run the job, and
    # its side effects, again).
    h = handlers(quick="""
        #!/bin/sh
        echo "quick"
    """)
    job_id = queue.enqueue("quick", {})
    drainer = Drainer(queue, DrainConfig(handlers_dir=h, concurrency=1))
    original = batch.Teardown.hand_over
    first = threading.Event()

    def slow_hand_over(self: batch.Teardown, sbx: Any) -> None:
        original(self, sbx)
        if not first.is_set():
            first.set()
            drainer.stop(grace=0)
            time.sleep(1)  # the main loop sees the grace over and aborts meanwhile

    monkeypatch.setattr(batch.Teardown, "hand_over", slow_hand_over)
    summary = drainer.run()
    assert (summary.done, summary.released) == (1, 0)
    assert sql("SELECT id, status, attempts, result FROM fleetless.jobs") == [(job_id, "done", 1, "quick\n")]
