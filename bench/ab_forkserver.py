"""Same-run A/B of per-job drains from several source trees and tiers, interleaved, each drain in
its own process (only the drain timed), with the CPU each drain's process tree used per job.

    .venv/bin/python bench/ab_forkserver.py --jobs 1000 --reps 3 \\
        --case new=src:forkserver --case before=/tmp/base-head/src:forkserver \\
        --case bwrap0=/tmp/base-b1ae44d/src:bwrap

A case is ``NAME=SOURCE_TREE:TIER``: a worktree's ``src`` (``git worktree add /tmp/base-head HEAD``)
and the tier its drain uses, concurrency 2 (``--concurrency``), the json handler of
``bench_forkserver.py``. The CPU is the drain process's and its descendants' (the fork server and
every job tree), not PostgreSQL's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import psycopg
from _common import scratch_db
from bench_forkserver import BASELINE_DRAIN, json_handlers

from fleetless import Queue
from fleetless.sandbox import default_python


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--case", action="append", required=True, help="NAME=SOURCE_TREE:TIER")
    a = ap.parse_args()
    cases: list[tuple[str, str, str]] = []
    for case in a.case:
        name, _, spec = case.partition("=")
        tree, _, tier = spec.rpartition(":")
        if not (name and tree and tier) or not Path(tree, "fleetless").is_dir():
            raise SystemExit(f"--case {case!r}: not NAME=SOURCE_TREE:TIER with a fleetless package in the tree")
        cases.append((name, str(Path(tree).resolve()), tier))
    rates: dict[str, list[float]] = {}
    cpus: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="fleetless-bench-") as tmp, scratch_db() as dsn:
        hdir = json_handlers(Path(tmp))
        q = Queue(dsn)
        q.init()
        for rep in range(a.reps):
            for name, tree, tier in cases:
                with psycopg.connect(dsn, autocommit=True) as c:
                    c.execute("TRUNCATE fleetless.jobs, fleetless.job_attempts CASCADE")
                q.enqueue_many(("job", {"n": 1}) for _ in range(a.jobs))
                before = os.times()
                out = subprocess.run(
                    [sys.executable, "-c", BASELINE_DRAIN, dsn, str(hdir), tier, str(a.concurrency),
                     default_python(), str(a.jobs)],
                    env={**os.environ, "PYTHONPATH": tree}, capture_output=True, text=True)
                after = os.times()
                if out.returncode:
                    raise SystemExit(f"{name}: the drain failed:\n{out.stderr[-2000:]}")
                rate = a.jobs / float(out.stdout.split()[-1])
                cpu = (after.children_user + after.children_system - before.children_user
                       - before.children_system) / a.jobs * 1000
                rates.setdefault(name, []).append(rate)
                cpus.setdefault(name, []).append(cpu)
                print(f"rep {rep + 1}/{a.reps} {name}: {rate:.1f} jobs/s, {cpu:.2f} ms CPU per job",
                      file=sys.stderr, flush=True)
        q.close()
    first = statistics.median(rates[cases[0][0]])
    print(f"\nper-job drain of {a.jobs} json jobs, concurrency {a.concurrency}, {a.reps} rep(s), interleaved:")
    for name, values in rates.items():
        rate = statistics.median(values)
        print(f"  {name:12s} {rate:7.1f} jobs/s  {cases[0][0]} x{first / rate:5.2f} of it"
              f"  CPU {statistics.median(cpus[name]):5.2f} ms/job  [{', '.join(f'{v:.1f}' for v in values)}]")


if __name__ == "__main__":
    main()
