"""(3) Per-job mode: jobs/s of `fleetless drain --concurrency 2` per tier on `print(1)` handlers,
against the same jobs run with no sandbox (`python3 handler.py payload.json`, two at a time); and
with no tier flag at all (`--sandbox auto`, what a user who types the README's command gets)."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psycopg

from fleetless import Queue
from fleetless.sandbox import SandboxUnavailable, choose_tier, get_backend

from . import VENV_PY, Context, Section, fmt, median, run_process, scratch_db, spread


def _bare(folder: str, n: int) -> float:
    payload = Path(folder, "payload.json")
    payload.write_text(json.dumps({"i": 1}))
    t = time.perf_counter()
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda _: subprocess.run(["/usr/bin/python3", f"{folder}/one.py", str(payload)], check=True,
                                               capture_output=True), range(n)))
    return n / (time.perf_counter() - t)


def run(ctx: Context) -> Section:
    sizes = {"process": 200, "bwrap": 200, "forkserver": 200, "microvm": 6}
    if ctx.quick:
        sizes = {"process": 20, "bwrap": 20, "forkserver": 20, "microvm": 2}
    tiers = []
    for tier in sizes:
        try:
            get_backend(tier).check()
            tiers.append(tier)
        except SandboxUnavailable:
            pass
    cases: dict[str, list[float]] = {"no sandbox (python3 handler.py)": []}  # /usr/bin/python3, as the tiers
    cases.update({f"{t} tier": [] for t in tiers})
    auto, _ = choose_tier("auto")  # the tier the drain with no flag picks here
    cases[f"no tier flag (auto: {auto})"] = []
    with scratch_db() as dsn, tempfile.TemporaryDirectory() as folder:
        Path(folder, "one.py").write_text("print(1)\n")
        os.chmod(folder, 0o755)
        q = Queue(dsn)
        q.init()
        for _ in range(ctx.reps):
            for label in cases:
                if label.startswith("no sandbox"):
                    cases[label].append(_bare(folder, sizes["process"]))
                    continue
                tier = auto if label.startswith("no tier flag") else label.split()[0]
                flag = [] if label.startswith("no tier flag") else ["--sandbox", tier]
                with psycopg.connect(dsn, autocommit=True) as c:
                    c.execute("TRUNCATE fleetless.jobs, fleetless.job_attempts CASCADE")
                q.enqueue_many(("one", {"i": i}) for i in range(sizes[tier]))
                wall, _, _ = run_process([VENV_PY, "-m", "fleetless.cli", "drain", "--handlers", folder, *flag,
                                          "--concurrency", "2"], env={"DATABASE_URL": dsn, "FLEETLESS_SANDBOX": ""})
                cases[label].append(sizes[tier] / wall)
        q.close()
    s = Section("perjob", "(3) Per-job mode: one sandbox per job, --concurrency 2", "bench/run.py --only perjob",
                ctx, ["tier", "jobs/s", "/ no sandbox"], raw=cases)
    bare = median(cases["no sandbox (python3 handler.py)"])
    for label, values in cases.items():
        s.rows.append([label, f"{fmt(median(values))} [{spread(values)}]", f"{median(values) / bare:.2f}"])
        s.add_bar(label, values)
    s.notes.append("Jobs per repetition: " + ", ".join(f"{t} {sizes[t]}" for t in tiers)
                   + " (the drain is a whole process: its start is included).")
    return s
