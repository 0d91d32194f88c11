"""(6) Cron tick cost: `fleetless drain` on an empty queue as a whole process (wall time, peak
RSS), and `python -X importtime` of the CLI (the slowest imports)."""

from __future__ import annotations

import re
import subprocess

from fleetless import Queue

from . import VENV_PY, Context, Section, fmt, median, run_process, scratch_db, spread

#: GNU time (Debian's ``time`` package): it measures the tick's peak RSS from outside.
TIME = "/usr/bin/time"


def run(ctx: Context) -> Section:
    walls: list[float] = []
    rss: list[float] = []
    import tempfile

    with scratch_db() as dsn, tempfile.TemporaryDirectory() as handlers:
        Queue(dsn).init()
        for _ in range(ctx.reps * 2):
            with tempfile.NamedTemporaryFile("r") as peak_file:
                # The peak RSS as GNU time reports it for its own child: a process forked by this
                # one (matplotlib and all loaded) would carry this one's peak in its own
                # ru_maxrss, which the kernel keeps across exec; time's is a small process.
                wall, _, _ = run_process([TIME, "-f", "%M", "-o", peak_file.name, VENV_PY, "-m", "fleetless.cli",
                                          "drain", "--handlers", handlers], env={"DATABASE_URL": dsn})
                walls.append(wall)
                rss.append(int(peak_file.read().split()[-1]) / 1024)
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
    bare: list[float] = []
    driver: list[float] = []
    for _ in range(ctx.reps * 2):
        bare.append(run_process([VENV_PY, "-c", "pass"])[0])
        driver.append(run_process([VENV_PY, "-c", "import psycopg"])[0])
    s.rows.append(["bare `python -c pass` (same interpreter, same run)", f"{median(bare):.3f} s [{spread(bare)}]", ""])
    s.rows.append(["`python -c 'import psycopg'` (the driver alone, same run)",
                   f"{median(driver):.3f} s [{spread(driver)}]", ""])
    s.notes.append(f"The tick is {median(walls) / median(bare):.1f}x a bare interpreter start and "
                   f"{median(walls) / median(driver):.2f}x an interpreter that only imports psycopg, in the same run; "
                   "wall time includes the interpreter, the imports, one connection and the maintenance "
                   "round. Peak RSS by GNU time (`/usr/bin/time -f %M`).")
    s.notes.append("Slowest top-level imports of the CLI (`-X importtime`, cumulative µs): "
                   + ", ".join(f"{name} {fmt(us)}" for us, name in top))
    return s
