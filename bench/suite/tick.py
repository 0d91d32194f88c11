"""(6) Cron tick cost: `fleetless drain` on an empty queue as a whole process (wall time, peak
RSS), and `python -X importtime` of the CLI (the slowest imports)."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import tempfile
from pathlib import Path

from fleetless import Queue

from . import VENV_PY, Context, Section, compile_tree, fmt, median, run_process, scratch_db, spread

#: GNU time (Debian's ``time`` package): it measures the tick's peak RSS from outside.
TIME = "/usr/bin/time"


def _commit(tree: Path | None) -> str:
    """The commit a worktree is at (its short hash), else the tree's path."""
    if tree is None:
        return ""
    r = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() or str(tree)


def _source_tree(tree: Path) -> Path:
    """The folder holding the ``fleetless`` package of ``tree`` (a checkout: its ``src``), checked
    to be what a process with it on PYTHONPATH imports, not this checkout's editable install."""
    tree = tree.resolve()
    if (tree / "src" / "fleetless").is_dir():
        tree = tree / "src"
    found = subprocess.run([VENV_PY, "-c", "import fleetless; print(fleetless.__file__)"], capture_output=True,
                           text=True, env={**os.environ, "PYTHONPATH": str(tree)}).stdout.strip()
    if not found.startswith(f"{tree}/"):
        raise SystemExit(f"--baseline-tree {tree}: a process with it on PYTHONPATH imports {found or 'nothing'}")
    return tree


def _tick(dsn: str, handlers: str, pythonpath: Path | None, *options: str) -> tuple[float, float]:
    """One ``fleetless drain`` on an empty queue as a whole process: wall seconds, peak RSS MiB."""
    env = {"DATABASE_URL": dsn}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    with tempfile.NamedTemporaryFile("r") as peak_file:
        # The peak RSS as GNU time reports it for its own child: a process forked by this one
        # (matplotlib and all loaded) would carry this one's peak in its own ru_maxrss, which the
        # kernel keeps across exec; time's is a small process.
        wall, _, _ = run_process([TIME, "-f", "%M", "-o", peak_file.name, VENV_PY, "-m", "fleetless.cli",
                                  "drain", "--handlers", handlers, *options], env=env)
        return wall, int(peak_file.read().split()[-1]) / 1024


def run(ctx: Context) -> Section:
    walls: list[float] = []
    rss: list[float] = []
    base_walls: list[float] = []
    base_rss: list[float] = []
    process_walls: list[float] = []  # today's tick without the auto tier's bwrap probe, as the baseline's default
    baseline = _source_tree(ctx.baseline) if ctx.baseline is not None else None
    with contextlib.ExitStack() as stack:
        dsn = stack.enter_context(scratch_db())
        handlers = stack.enter_context(tempfile.TemporaryDirectory())
        Queue(dsn).init()
        base_dsn = ""
        if baseline is not None:  # its own database, made by its own code (its schema is older)
            compile_tree(baseline)
            base_dsn = stack.enter_context(scratch_db())
            run_process([VENV_PY, "-m", "fleetless.cli", "init"],
                        env={"DATABASE_URL": base_dsn, "PYTHONPATH": str(baseline)})
        for _ in range(ctx.reps * 2):  # interleaved: a load swing reaches both alike
            wall, peak = _tick(dsn, handlers, None)
            walls.append(wall)
            rss.append(peak)
            process_walls.append(_tick(dsn, handlers, None, "--sandbox", "process")[0])
            if baseline is not None:
                wall, peak = _tick(base_dsn, handlers, baseline)
                base_walls.append(wall)
                base_rss.append(peak)
    imp = subprocess.run([VENV_PY, "-X", "importtime", "-c", "import fleetless.cli"], capture_output=True,
                         text=True).stderr
    rows = []
    for line in imp.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)", line)
        if m:
            rows.append((int(m.group(2)), m.group(4)))
    top = sorted((r for r in rows if "." not in r[1] or r[1].startswith("fleetless")), reverse=True)[:8]
    s = Section("tick", "(6) Cron tick: `fleetless drain` on an empty queue", "bench/run.py --only tick", ctx,
                ["what", "median [spread]", "target"],
                raw={"wall_s": walls, "rss_mib": rss, "importtime": rows, "baseline": str(baseline or ""),
                     "baseline_wall_s": base_walls, "baseline_rss_mib": base_rss,
                     "process_tier_wall_s": process_walls})
    s.rows.append(["whole-process wall time", f"{median(walls):.3f} s [{spread(walls)}]", "<= 0.2 s"])
    s.rows.append(["peak RSS", f"{median(rss):.1f} MiB [{spread(rss)}]", "<= 60 MB"])
    if base_walls:
        s.rows.append([f"the same tick at the baseline tree ({_commit(baseline)}), wall time",
                       f"{median(base_walls):.3f} s [{spread(base_walls)}]", ""])
        s.rows.append(["the same tick at the baseline tree, peak RSS",
                       f"{median(base_rss):.1f} MiB [{spread(base_rss)}]", ""])
        s.rows.append(["today / baseline: wall time, peak RSS",
                       f"**{median(walls) / median(base_walls):.2f}**, **{median(rss) / median(base_rss):.2f}**",
                       "<= 1 (keep it there)"])
    s.rows.append(["today's tick with `--sandbox process` (no bwrap probe), wall time",
                   f"{median(process_walls):.3f} s [{spread(process_walls)}]", ""])
    if base_walls:
        s.rows.append(["today with `--sandbox process` / baseline (whose default tier was process)",
                       f"{median(process_walls) / median(base_walls):.2f}", ""])
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
