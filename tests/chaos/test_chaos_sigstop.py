"""A batch drainer SIGSTOPped past its jobs' leases: its batch runner (not stopped: a process of its
own) must start no job it cannot finish inside the lease its drainer last knew, because the reaper
hands those jobs to another drainer meanwhile (issue 26, item 2: the same job ran twice at once and
a kind's concurrency = 4 peaked at 5)."""

from __future__ import annotations

import itertools
import os
import signal
from pathlib import Path
from typing import Any

from fleetless import Queue

from proctools import wait_for

JOBS, LIMIT = 4, 4
#: Each job sleeps SLEEP s of its TIMEOUT; a lease is TIMEOUT + GRACE: a batch of four outlives it twice.
SLEEP, TIMEOUT, GRACE = 4, 5, 3


def test_a_sigstopped_batch_drainer_starts_no_job_past_its_lease_and_no_job_runs_twice_at_once(
        dsn: str, queue: Queue, sql: Any, handlers: Any, tmp_path: Path, start_drain: Any) -> None:
    log = tmp_path / "runs.log"
    log.touch()
    log.chmod(0o666)
    h = handlers(**{"slow.py": f"""
        import os, time

        def _note(what):
            with open({str(log)!r}, "a") as f:
                env = os.environ
                f.write(f"{{what}} {{env['FLEETLESS_JOB_ID']}} {{env['FLEETLESS_ATTEMPT']}} {{time.time()!r}}\\n")

        def handle(payload):
            _note("start")
            time.sleep({SLEEP})
            _note("end")
    """, "fleetless.toml": f"[kinds.slow]\nconcurrency = {LIMIT}\n"})
    ids = [queue.enqueue("slow", {"n": n}, max_attempts=5) for n in range(JOBS)]
    common = ("--sandbox", "process", "--timeout", str(TIMEOUT), "--lease-grace", str(GRACE))
    a = start_drain(dsn, h, *common, "--per-sandbox", str(JOBS), "--concurrency", "1")
    wait_for(lambda: "start" in log.read_text(), timeout=120, what="the batch's first job to start")
    os.kill(a.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: sql("SELECT bool_and(lease_expires_at < now()) FROM fleetless.jobs"
                             " WHERE status = 'running'") == [(True,)], timeout=60,
                 what="the stopped drainer's leases to pass")
        # another drainer reaps them and runs them all at once (as the kind's limit allows)
        b = start_drain(dsn, h, *common, "--per-sandbox", "1", "--concurrency", str(JOBS))
        assert b.wait(timeout=120) == 0, b.stderr
    finally:
        os.kill(a.pid, signal.SIGCONT)
    assert a.wait(timeout=120) == 0, a.stderr

    # The table: every job done once, by the second drainer; one history row per attempt.
    assert sql("SELECT status, count(*) FROM fleetless.jobs GROUP BY status") == [("done", JOBS)]
    assert sql("SELECT job_id, attempt FROM fleetless.job_attempts GROUP BY job_id, attempt"
               " HAVING count(*) > 1") == []
    for job in ids:
        ((attempts,),) = sql("SELECT attempts FROM fleetless.jobs WHERE id = %s", job)
        rows = sql("SELECT attempt, outcome FROM fleetless.job_attempts WHERE job_id = %s ORDER BY attempt", job)
        assert rows[-1] == (attempts, "done") and [r[0] for r in rows] == list(range(1, attempts + 1)), rows

    # The runs, from the handler's own log: no job twice at once, never more than the limit at once.
    starts: dict[tuple[int, int], float] = {}
    runs: list[tuple[int, float, float]] = []
    for line in log.read_text().splitlines():
        what, job_id, attempt, at = line.split()
        if what == "start":
            starts[int(job_id), int(attempt)] = float(at)
        else:
            runs.append((int(job_id), starts.pop((int(job_id), int(attempt))), float(at)))
    assert not starts, f"runs that never ended: {starts}"
    for (j1, s1, e1), (j2, s2, e2) in itertools.combinations(runs, 2):
        assert not (j1 == j2 and s1 < e2 and s2 < e1), f"job {j1} ran twice at once: {runs}"
    most = max(sum(1 for _, s, e in runs if s <= t < e) for _, t, _ in runs)
    assert most <= LIMIT, f"{most} jobs of a kind limited to {LIMIT} ran at once: {runs}"
