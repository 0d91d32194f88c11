"""Shared parts of the suite: the run's context, a section (table, plot, markdown), statistics,
a scratch database, and whole-process timing."""

from __future__ import annotations

import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import ADMIN_DSN, scratch_db  # bench/ is on sys.path (bench/run.py puts it there)

ROOT = Path(__file__).resolve().parents[2]
VENV_PY = str(ROOT / ".venv" / "bin" / "python")


@dataclass
class Context:
    reps: int
    quick: bool
    machine: str
    note: str = ""
    scale: float = 1.0  # job counts and table sizes times this
    baseline: Path | None = None  # another source tree (a worktree of an older commit), where a section compares

    def size(self, full: int, quick: int) -> int:
        return quick if self.quick else max(1, int(full * self.scale))


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def spread(values: Sequence[float]) -> str:
    m = statistics.median(values)
    return f"{100 * (max(values) - min(values)) / m:.0f}%" if m else "-"


def fmt(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


@dataclass
class Section:
    name: str
    title: str
    command: str
    context: Context
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)
    #: bars for the plot: label -> (median, min, max), and the axis label
    bars: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    unit: str = "jobs/s"

    def add_bar(self, label: str, values: Sequence[float]) -> None:
        self.bars[label] = (median(values), min(values), max(values))

    def markdown(self) -> str:
        lines = [f"### {self.title}", "", f"    {self.command}", "",
                 f"Run: {self.context.machine}; {self.context.reps} repetitions, medians [spread]"
                 + (f"; sizes scaled by {self.context.scale:g}." if self.context.scale != 1 else ".")]
        if self.context.note:
            lines.append(f"*{self.context.note}*")
        lines += ["", "| " + " | ".join(self.columns) + " |", "|" + "---|" * len(self.columns)]
        lines += ["| " + " | ".join(r) + " |" for r in self.rows]
        if self.bars:
            lines += ["", f"![{self.title}](bench/plots/{self.name}.png)"]
        if self.notes:
            lines += [""] + [f"- {n}" for n in self.notes]
        return "\n".join(lines)

    def plot(self, path: Path) -> None:
        if not self.bars:
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        labels = list(self.bars)
        med = [self.bars[k][0] for k in labels]
        low = [m - self.bars[k][1] for k, m in zip(labels, med, strict=True)]
        high = [self.bars[k][2] - m for k, m in zip(labels, med, strict=True)]
        fig, ax = plt.subplots(figsize=(8, 0.45 * len(labels) + 1.5))
        ax.barh(labels, med, xerr=[low, high], color="#4878a8", capsize=3)
        ax.invert_yaxis()
        ax.set_xlabel(f"{self.unit} (median; bars: min-max over {self.context.reps} reps)")
        ax.set_title(self.title, fontsize=10)
        fig.tight_layout()
        fig.savefig(path, dpi=90)
        plt.close(fig)


def compile_tree(src: Path = ROOT / "src") -> None:
    """Byte-compile the fleetless sources under ``src`` (default: this checkout's), as ``pip
    install`` does for an installed package. The checkout is installed editable, and where
    PYTHONDONTWRITEBYTECODE is set (as on these machines) Python never writes a ``.pyc`` for it:
    every process would compile each module it imports from source again (~0.1 s of a drain's
    start here), which no deployed drainer does. Python still reads the files this writes, and
    recompiles in memory any that a later edit made stale."""
    import compileall

    compileall.compile_dir(str(src), quiet=1)


def run_process(argv: Sequence[str], env: dict[str, str] | None = None) -> tuple[float, int, str]:
    """Run a whole process; its wall time, peak RSS (KiB, from wait4) and stdout."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t = time.perf_counter()
        proc = subprocess.Popen(list(argv), stdout=out, stderr=err, env={**os.environ, **(env or {})})
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t
        proc.returncode = code = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if code != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({code}): {err.read().strip()[-2000:]}")
        return wall, int(usage.ru_maxrss), out.read()


__all__ = ["ADMIN_DSN", "VENV_PY", "Context", "Section", "compile_tree", "fmt", "median", "run_process",
           "scratch_db", "spread"]
