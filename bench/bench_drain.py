"""End-to-end drain throughput: enqueue N no-op jobs, run one `Drainer` to empty, per sandbox tier.

    python bench/bench_drain.py [--jobs 500] [--reps 3] [--tiers process,bwrap] [--concurrency 2]

Each job is a real handler (`print(1)` in Python) in its own fresh sandbox, so this measures what
the seed calls the honest trade: per-job isolation costs a process (or VM) start per job. Also
measured in the same run: the queue alone (claim + complete, no sandbox, same batch size) as the
ceiling the sandboxes are compared with. Prints jobs/s medians and ratios.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, scratch_db, spread

from fleetless import Queue
from fleetless.drainer import DrainConfig, Drainer
from fleetless.sandbox import Limits, get_backend


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=500)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tiers", default="process,bwrap")
    ap.add_argument("--concurrency", type=int, default=2)
    a = ap.parse_args()
    tiers = [t for t in a.tiers.split(",") if t]
    for tier in tiers:
        get_backend(tier).check()
    results: dict[str, list[float]] = {}
    with scratch_db() as dsn, tempfile.TemporaryDirectory(prefix="fleetless-bench-") as tmp:
        hdir = Path(tmp) / "handlers"
        hdir.mkdir(parents=True)
        Path(tmp).chmod(0o755)
        hdir.chmod(0o755)
        (hdir / "noop.py").write_text("print(1)\n")
        (hdir / "noop.py").chmod(0o644)
        q = Queue(dsn)
        q.init()

        def fill() -> None:
            with psycopg.connect(dsn, autocommit=True) as c:
                c.execute("TRUNCATE fleetless.jobs, fleetless.job_attempts CASCADE")
            q.enqueue_many(("noop", {"i": i}) for i in range(a.jobs))

        for rep in range(a.reps):
            fill()
            t = time.perf_counter()
            while jobs := q.claim(a.concurrency):
                for job in jobs:
                    q.complete(job, "1\n")
            results.setdefault("queue only (no sandbox)", []).append(a.jobs / (time.perf_counter() - t))
            for tier in tiers:
                fill()
                config = DrainConfig(handlers_dir=hdir, sandbox=tier, concurrency=a.concurrency,
                                     limits=Limits(memory_bytes=256 * 1024 * 1024))
                t = time.perf_counter()
                summary = Drainer(q, config).run()
                elapsed = time.perf_counter() - t
                if summary.done != a.jobs:
                    raise SystemExit(f"{tier}: only {summary.done}/{a.jobs} done: {summary.line()}")
                results.setdefault(f"drain --sandbox {tier}", []).append(a.jobs / elapsed)
            print(f"rep {rep + 1}/{a.reps} done", file=sys.stderr, flush=True)
        q.close()
    base = median(results["queue only (no sandbox)"])
    print(f"\n{a.jobs} no-op jobs, concurrency {a.concurrency}, {a.reps} reps: median jobs/s [spread]")
    for name, values in results.items():
        print(f"  {name:28s} {median(values):>9,.1f}  x{median(values) / base:.3f} of queue only  [{spread(values)}]")


if __name__ == "__main__":
    main()
