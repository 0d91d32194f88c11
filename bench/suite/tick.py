"""(6) Cron tick cost: `fleetless drain` on an empty queue as a whole process (wall time, peak
RSS), and `python -X importtime` of the CLI (the slowest imports)."""

from __future__ import annotations

import re
import subprocess

from fleetless import Queue

from . import VENV_PY, Context, Section, fmt, median, run_process, scratch_db, spread


def run(ctx: Context) -> Section:
    walls: list[float] = []
    rss: list[float] = []
    import tempfile

    with scratch_db() as dsn, tempfile.TemporaryDirectory() as handlers:
        Queue(dsn).init()
        for _ in range(ctx.reps * 2):
            wall, peak, _ = run_process([VENV_PY, "-m", "fleetless.cli", "drain", "--handlers", handlers],
                                        env={"DATABASE_URL": dsn})
            walls.append(wall)
            rss.append(peak / 1024)
    imp = subprocess.run([VENV_PY, "-X", "importtime", "-c", "import fleetless.cli"], capture_output=True,
                         text=True).stderr
    rows = []
    for line in imp.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)", line)
        if m:
            rows.append((int(m.group(2)), m.group(4)))
    top = sorted((r for r in rows if "." not in r[1] or r[1].startswith("fleetless")), reverse=True)[:8]
    s = Section("tick", "(6) Cron tick: `fleetless drain` on an empty queue", "bench/run.py --only tick", ctx,
                ["what", "median [spread]", "target"], raw={"wall_s": walls, "rss_mib": rss, "importtime": rows})
    s.rows.append(["whole-process wall time", f"{median(walls):.3f} s [{spread(walls)}]", "<= 0.2 s"])
    s.rows.append(["peak RSS", f"{median(rss):.1f} MiB [{spread(rss)}]", "<= 60 MB"])
    s.unit = "seconds"
    s.notes.append("Slowest top-level imports of the CLI (`-X importtime`, cumulative µs): "
                   + ", ".join(f"{name} {fmt(us)}" for us, name in top))
    return s
