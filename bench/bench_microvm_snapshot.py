"""MicroVM per job: restoring the guest's snapshot against a cold boot, in the same run.

    python bench/bench_microvm_snapshot.py [--runs 10] [--jobs 12] [--memory 512]

1. Per job, restore and cold boot interleaved: claim a job, create the sandbox, write the
   payload, exec the json handler (imports json and pathlib, reads its payload), kill, store the
   result (``Queue.complete``): p50 from before ``create`` to the result stored, and the ratio.
2. A drain of ``--jobs`` such jobs at concurrency 2, restore then cold boot: jobs/s, ratio.

The snapshot for ``--memory`` MiB / 1 vCPU is built first if missing (``build-image`` builds the
512 MiB one). Cold boots are forced with ``FLEETLESS_MICROVM_SNAPSHOT=off``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, scratch_db, spread

from fleetless import Queue
from fleetless.drainer import DrainConfig, Drainer
from fleetless.sandbox import Limits, Template
from fleetless.sandbox.microvm import MicroVMSandbox
from fleetless.sandbox.microvm.image import load_image
from fleetless.sandbox.microvm.snapshot import build_snapshot

HANDLER = """import json, pathlib, sys
d = json.loads(pathlib.Path(sys.argv[1]).read_text())
print(json.dumps({"i": d["i"]}))
"""
MiB = 1024 * 1024


def set_mode(mode: str) -> None:
    if mode == "cold":
        os.environ["FLEETLESS_MICROVM_SNAPSHOT"] = "off"
    else:
        os.environ.pop("FLEETLESS_MICROVM_SNAPSHOT", None)


def p50(values: list[float]) -> float:
    return median(values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10, help="per-job samples of each mode")
    ap.add_argument("--jobs", type=int, default=12, help="jobs per drain")
    ap.add_argument("--memory", type=int, default=512, help="guest RAM, MiB")
    a = ap.parse_args()
    MicroVMSandbox.check()
    t = time.perf_counter()
    snap = build_snapshot(load_image(), a.memory, 1)
    print(f"snapshot {snap} ready in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    limits = Limits(memory_bytes=a.memory * MiB)
    per_job: dict[str, list[float]] = {"restore": [], "cold": []}
    drains: dict[str, float] = {}
    with scratch_db() as dsn, tempfile.TemporaryDirectory(prefix="fleetless-bench-") as tmp:
        hdir = Path(tmp) / "handlers"
        hdir.mkdir(parents=True)
        (hdir / "json_handler.py").write_text(HANDLER)
        q = Queue(dsn)
        q.init()
        for run in range(a.runs):
            for mode in ("restore", "cold") if run % 2 == 0 else ("cold", "restore"):
                set_mode(mode)
                q.enqueue("json_handler", {"i": run})
                job = q.claim(1)[0]
                t = time.perf_counter()
                sbx = MicroVMSandbox.create(Template(hdir, limits), ttl_seconds=300)
                with sbx:
                    sbx.write("payload.json", f'{{"i": {run}}}')
                    res = sbx.exec([sbx.python, f"{sbx.handlers_path}/json_handler.py",
                                    f"{sbx.workspace_path}/payload.json"], 120)
                if res.exit_code != 0 or sbx.last_boot is None \
                        or sbx.last_boot.restored != (mode == "restore"):
                    raise SystemExit(f"{mode}: {res}")
                q.complete(job, res.stdout)
                per_job[mode].append(time.perf_counter() - t)
            print(f"run {run + 1}/{a.runs}", file=sys.stderr, flush=True)
        for mode in ("restore", "cold"):
            set_mode(mode)
            with psycopg.connect(dsn, autocommit=True) as c:
                c.execute("TRUNCATE fleetless.jobs, fleetless.job_attempts CASCADE")
            q.enqueue_many(("json_handler", {"i": i}) for i in range(a.jobs))
            t = time.perf_counter()
            summary = Drainer(q, DrainConfig(handlers_dir=hdir, sandbox="microvm", concurrency=2,
                                             limits=limits, timeout=120)).run()
            elapsed = time.perf_counter() - t
            if summary.done != a.jobs:
                raise SystemExit(f"{mode}: only {summary.done}/{a.jobs} done: {summary.line()}")
            drains[mode] = a.jobs / elapsed
        q.close()
    set_mode("restore")
    r, c = p50(per_job["restore"]), p50(per_job["cold"])
    print(f"\nmicrovm ({a.memory} MiB guest), json handler, per job from create to result stored "
          f"(p50 of {a.runs} each, interleaved):")
    print(f"  restore   {r * 1000:7.0f} ms  [{spread(per_job['restore'])}]")
    print(f"  cold boot {c * 1000:7.0f} ms  [{spread(per_job['cold'])}]")
    print(f"  restore / cold boot: x{r / c:.3f}")
    print(f"drain of {a.jobs} jobs at concurrency 2:")
    print(f"  restore   {drains['restore']:6.2f} jobs/s")
    print(f"  cold boot {drains['cold']:6.2f} jobs/s")
    print(f"  restore / cold boot: x{drains['restore'] / drains['cold']:.2f}")


if __name__ == "__main__":
    main()
