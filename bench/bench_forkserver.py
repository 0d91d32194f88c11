"""The fork server (issue 11): per-job sandbox cost and per-job drain rate, as same-run ratios.

    python bench/bench_forkserver.py [--runs 100] [--jobs 1000] [--reps 1] [--tiers process,bwrap]

Part 1, per job: create + write the payload + exec + kill of the json handler (imports json and
pathlib, reads its payload) on the ``forkserver`` tier and on each of --tiers, interleaved with a
bare ``python3 handler.py payload.json`` run by subprocess; medians and ratios to the bare start.
Target: forkserver <= 0.7x bare.

Part 2, per-job drain: --jobs such jobs, one sandbox each (no batch mode), concurrency 2, one
``Drainer`` to empty, forkserver against each of --tiers in the same run; jobs/s medians and
ratios. Target: forkserver >= 4x each of today's tiers. The issue's baseline is the tiers as they
were when it was filed: ``--baseline-tree DIR`` (a source tree, for example a worktree of the
commit before the fork server, ``git worktree add /tmp/base d1bbc85^``, then ``/tmp/base/src``)
also drains each of --tiers with that tree's code (its own process, the drain alone timed), in
the same repetitions. Each repetition also runs the case ``forkserver sandboxes only``: the same
number of create + write + exec + kill of the json handler on --concurrency threads, with no
database and no drainer, which is the ceiling a forkserver drain cannot pass on this host.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, scratch_db, spread

from fleetless import Queue
from fleetless.drainer import DrainConfig, Drainer
from fleetless.sandbox import Limits, Template, default_python, get_backend

HANDLER = "import json, pathlib, sys\nprint(json.loads(pathlib.Path(sys.argv[1]).read_text())['n'])\n"
LIMITS = Limits(memory_bytes=256 * 1024 * 1024)


def one_job(template: Template, tier: str) -> None:
    """Create a sandbox of ``tier``, write the payload, run the json handler, kill it; a failed job
    ends the run (``SystemExit``)."""
    with get_backend(tier).create(template, 120) as sbx:
        sbx.write("payload.json", '{"n": 1}')
        r = sbx.exec([sbx.python, f"{sbx.handlers_path}/job.py", f"{sbx.workspace_path}/payload.json"], 120)
    if not r.ok or r.stdout.strip() != "1":
        raise SystemExit(f"{tier}: job failed: {r}")


def per_job(hdir: Path, payload: Path, tiers: list[str], runs: int) -> None:
    python = default_python()
    template = Template(handlers_dir=hdir, limits=LIMITS, python=python)  # every tier: the bare one's

    def bare() -> None:
        subprocess.run([python, str(hdir / "job.py"), str(payload)], check=True, capture_output=True)

    names = ["forkserver", *tiers]
    one_job(template, "forkserver")  # the server's start is once per drainer, not per job
    results: dict[str, list[float]] = {"bare python": [], **{t: [] for t in names}}
    for _ in range(runs):  # interleaved, so noise spreads over all of them
        t = time.perf_counter()
        bare()
        results["bare python"].append(time.perf_counter() - t)
        for tier in names:
            t = time.perf_counter()
            one_job(template, tier)
            results[tier].append(time.perf_counter() - t)
    base = median(results["bare python"])
    print(f"\nper job: create + write + exec + kill of the json handler, median of {runs} (python: {python})")
    for name, values in results.items():
        print(f"  {name:12s} {median(values) * 1000:8.1f} ms  x{median(values) / base:5.2f} of bare python"
              f"  [spread {spread(values)}]")


def json_handlers(tmp: Path) -> Path:
    """``tmp/handlers`` holding the json handler as ``job.py``, reachable by the job uids."""
    tmp.chmod(0o755)
    hdir = tmp / "handlers"
    hdir.mkdir()
    hdir.chmod(0o755)
    (hdir / "job.py").write_text(HANDLER)
    (hdir / "job.py").chmod(0o644)
    return hdir


#: A drain with another source tree's code (the baseline), timed inside its own process.
BASELINE_DRAIN = """
import sys, time
from pathlib import Path
from fleetless import Queue
from fleetless.drainer import DrainConfig, Drainer
from fleetless.sandbox import Limits
dsn, hdir, tier, concurrency, python, jobs = sys.argv[1:]
q = Queue(dsn)
config = DrainConfig(handlers_dir=Path(hdir), sandbox=tier, concurrency=int(concurrency),
                     limits=Limits(memory_bytes=256 * 1024 * 1024), python=python)
t = time.perf_counter()
summary = Drainer(q, config).run()
elapsed = time.perf_counter() - t
assert summary.done == int(jobs), summary.line()
print(elapsed)
"""


def sandboxes_only(hdir: Path, jobs: int, concurrency: int) -> float:
    """jobs/s of ``jobs`` forkserver sandboxes (create, write, exec, kill) on ``concurrency``
    threads: a drain's sandbox work without its claims, finishes and bookkeeping."""
    template = Template(handlers_dir=hdir, limits=LIMITS, python=default_python())
    left = [jobs]
    lock = threading.Lock()
    failed: list[str] = []

    def worker() -> None:
        while not failed:
            with lock:
                if left[0] <= 0:
                    return
                left[0] -= 1
            try:
                one_job(template, "forkserver")
            except BaseException as exc:  # a thread's exception (SystemExit too) would only shorten the run
                failed.append(f"{type(exc).__name__}: {exc}")
                return

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    t = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - t
    if failed:
        raise SystemExit(f"forkserver sandboxes only: {failed[0]}")
    return jobs / elapsed


def drains(hdir: Path, tiers: list[str], jobs: int, reps: int, concurrency: int, baseline: str | None) -> None:
    results: dict[str, list[float]] = {}
    cases = ["forkserver", *tiers] + [f"{t} (baseline)" for t in tiers if baseline] + ["forkserver sandboxes only"]
    with scratch_db() as dsn:
        q = Queue(dsn)
        q.init()
        for rep in range(reps):
            for case in cases:
                tier = case.split()[0]
                if case.endswith("sandboxes only"):
                    results.setdefault(case, []).append(sandboxes_only(hdir, jobs, concurrency))
                    continue
                with psycopg.connect(dsn, autocommit=True) as c:
                    c.execute("TRUNCATE fleetless.jobs, fleetless.job_attempts CASCADE")
                q.enqueue_many(("job", {"n": 1}) for _ in range(jobs))
                if case.endswith("(baseline)"):
                    assert baseline is not None
                    out = subprocess.run(
                        [sys.executable, "-c", BASELINE_DRAIN, dsn, str(hdir), tier, str(concurrency),
                         default_python(), str(jobs)],
                        env={**os.environ, "PYTHONPATH": baseline}, capture_output=True, text=True, check=True)
                    results.setdefault(case, []).append(jobs / float(out.stdout.split()[-1]))
                    continue
                config = DrainConfig(handlers_dir=hdir, sandbox=tier, concurrency=concurrency, limits=LIMITS,
                                     python=default_python())
                t = time.perf_counter()
                summary = Drainer(q, config).run()
                elapsed = time.perf_counter() - t
                if summary.done != jobs:
                    raise SystemExit(f"{tier}: only {summary.done}/{jobs} done: {summary.line()}")
                results.setdefault(case, []).append(jobs / elapsed)
            print(f"rep {rep + 1}/{reps} done", file=sys.stderr, flush=True)
        q.close()
    fork = median(results["forkserver"])
    print(f"\nper-job drain of {jobs} json jobs, concurrency {concurrency}, {reps} rep(s): median jobs/s")
    for name, values in results.items():
        print(f"  {name:26s} {median(values):8.1f} jobs/s  forkserver x{fork / median(values):5.2f} of it"
              f"  [spread {spread(values)}]")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--tiers", default="process,bwrap")
    ap.add_argument("--skip-drain", action="store_true")
    ap.add_argument("--skip-per-job", action="store_true")
    ap.add_argument("--baseline-tree", help="a source tree whose tiers are the drain's baseline (see above)")
    a = ap.parse_args()
    tiers = [t for t in a.tiers.split(",") if t]
    for tier in ["forkserver", *tiers]:
        get_backend(tier).check()
    with tempfile.TemporaryDirectory(prefix="fleetless-bench-") as tmp:
        hdir = json_handlers(Path(tmp))
        payload = Path(tmp) / "payload.json"
        payload.write_text('{"n": 1}')
        payload.chmod(0o644)
        if not a.skip_per_job:
            per_job(hdir, payload, tiers, a.runs)
        if not a.skip_drain:
            drains(hdir, tiers, a.jobs, a.reps, a.concurrency, a.baseline_tree)


if __name__ == "__main__":
    main()
