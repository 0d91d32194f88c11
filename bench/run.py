"""The benchmark suite of issue 8: one command, one PostgreSQL, same-run ratios.

    .venv/bin/python bench/run.py [--reps 5] [--only enqueue,drain,perjob,latency,claim,tick,scale] [--quick]
    .venv/bin/python bench/run.py --current   # only rebuild the current table at BENCHMARKS.md's top

Each measurement (``bench/suite/<name>.py``) runs its cases interleaved over ``--reps`` repetitions
(so machine noise spreads over all of them), reports medians with the spread (max - min over
median), writes its section of BENCHMARKS.md (between ``<!-- suite:<name> -->`` markers, replaced
on every run), rebuilds the one current table at the top of BENCHMARKS.md from all the sections,
and a PNG plot in ``bench/plots/``. Only ratios measured in the same run mean
anything on shared machines. Raw results go to ``bench/results/<name>.json``.

Needs the ``bench`` extra (``pip install -e '.[bench]'``: matplotlib) and, for the peers (PgQueuer,
Procrastinate), their own venv: ``bash bench/peers/setup.sh`` (see bench/peers/README.md).
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from suite import Context, Section, compile_tree  # noqa: E402

ALL = ("enqueue", "drain", "perjob", "latency", "claim", "tick", "scale")
DOC = HERE.parent / "BENCHMARKS.md"


def write_section(section: Section) -> None:
    start, end = f"<!-- suite:{section.name} -->", f"<!-- /suite:{section.name} -->"
    text = DOC.read_text() if DOC.exists() else "# Benchmarks\n"
    body = f"{start}\n{section.markdown()}\n{end}"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = head + body + rest.split(end, 1)[1]
    elif "<!-- /suite:" in text:  # a new section: after the others, above the history
        cut = text.rindex("<!-- /suite:")
        cut = text.index("-->", cut) + 3
        text = text[:cut] + "\n\n" + body + text[cut:]
    else:
        if "## The issue-8 suite" not in text:
            text = text.rstrip() + "\n\n## The issue-8 suite (`bench/run.py`)\n\n" + (
                "Every section below is written by `bench/run.py` itself; see its header for how.\n")
        text = text.rstrip() + "\n\n" + body + "\n"
    DOC.write_text(text)


CURRENT = ("<!-- current -->", "<!-- /current -->")


def current_table(text: str) -> str:
    """One table of every suite section's latest figures, read from the sections in ``text`` (each
    as bench/run.py last wrote it): section, case, figures, when it ran."""
    lines = ["## Current figures", "",
             "Written by `bench/run.py` from the latest run of each of its sections (full tables, with",
             "the command and machine of each run, are in the sections below; everything after them is",
             "the dated history of earlier sessions). Medians [spread]; ratios are same-run.", "",
             "| section | case | figures | run |", "|---|---|---|---|"]
    for block in text.split("<!-- suite:")[1:]:
        body = block.split("-->", 1)[1].split("<!-- /suite:", 1)[0]
        title = next((ln[4:] for ln in body.splitlines() if ln.startswith("### ")), "?")
        run = next((ln[5:21] for ln in body.splitlines() if ln.startswith("Run: ")), "?")
        rows = [ln for ln in body.splitlines() if ln.startswith("| ")][1:]  # past the header
        for row in rows:
            cells = [c.strip() for c in row.strip().strip("|").split("|")]
            figures = " · ".join(c for c in cells[1:] if c)
            lines.append(f"| {title} | {cells[0]} | {figures} | {run} |")
    return "\n".join(lines)


def write_current() -> None:
    """The current table at the top of BENCHMARKS.md (replaced on every run)."""
    text = DOC.read_text()
    table = f"{CURRENT[0]}\n{current_table(text)}\n{CURRENT[1]}"
    if CURRENT[0] in text and CURRENT[1] in text:
        head, rest = text.split(CURRENT[0], 1)
        text = head + table + rest.split(CURRENT[1], 1)[1]
    else:
        title, rest = text.split("\n", 1)
        text = f"{title}\n\n{table}\n\n## History\n{rest}"
    DOC.write_text(text)


def machine() -> str:
    load = Path("/proc/loadavg").read_text().split()[:3]
    pg = subprocess.run(["psql", "--version"], capture_output=True, text=True).stdout.strip() or "psql ?"
    return (f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.machine()}, "
            f"{len(__import__('os').sched_getaffinity(0))} cores, load {' '.join(load)} at the start, "
            f"Python {platform.python_version()}, {pg}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--only", default=",".join(ALL))
    ap.add_argument("--quick", action="store_true", help="small sizes: checks the suite runs, numbers are noise")
    ap.add_argument("--scale", type=float, default=1.0,
                    help="job counts and table sizes times this (the issue's sizes at 1.0)")
    ap.add_argument("--baseline-tree", type=Path,
                    help="a checkout (a worktree of the commit before issue 8, say) or its src/: the tick compares")
    ap.add_argument("--note", default="", help="a line added under each section (e.g. other work was running)")
    ap.add_argument("--current", action="store_true",
                    help="only rebuild the current table at the top of BENCHMARKS.md from its sections")
    args = ap.parse_args()
    if args.current:
        write_current()
        return
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = set(names) - set(ALL)
    if unknown:
        ap.error(f"unknown measurement(s) {', '.join(sorted(unknown))} (from {', '.join(ALL)})")
    ctx = Context(reps=args.reps, quick=args.quick, machine=machine(), note=args.note, scale=args.scale,
                  baseline=args.baseline_tree)
    compile_tree()  # every fleetless process below starts as an installed one does
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "plots").mkdir(exist_ok=True)
    for name in names:
        print(f"== {name}", flush=True)
        module = importlib.import_module(f"suite.{name}")
        section: Section = module.run(ctx)
        section.plot(HERE / "plots" / f"{name}.png")
        (HERE / "results" / f"{name}.json").write_text(json.dumps(section.raw, indent=1))
        if not args.quick:
            write_section(section)
            write_current()
        print(section.markdown(), flush=True)


if __name__ == "__main__":
    main()
