"""cgroup v2: a single ``cgroup2`` hierarchy.

The drainer first moves itself into a leaf ``fleetless-drainer-<pid>`` below its own cgroup
(a cgroup with processes cannot enable controllers for its children), enables ``memory pids cpu``
in the ``cgroup.subtree_control`` of its own cgroup, and puts each job into one sibling group
that serves every controller and the kill.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

from ._common import CFS_PERIOD_US, PREFIX, CgroupCaps, JobDirs, Layout, probe_dir, read, write

#: The file whose ``oom_kill`` line counts the kernel's OOM kills in a group.
OOM_EVENTS = "memory.events"
_WANTED = {"memory", "pids", "cpu"}


def _prepare(base: Path) -> tuple[set[str], str]:
    """Move ourselves into a leaf and enable the controllers for our children."""
    available_here = set(read(base / "cgroup.controllers").split())
    enabled = set(read(base / "cgroup.subtree_control").split())
    want = (_WANTED & available_here) - enabled
    if want:
        leaf = base / f"{PREFIX}drainer-{os.getpid()}"
        try:
            leaf.mkdir(exist_ok=True)
            write(leaf / "cgroup.procs", "0")
        except OSError as exc:
            return enabled & _WANTED, f"cannot move the drainer into a leaf cgroup: {exc}"
        for c in sorted(want):
            try:
                write(base / "cgroup.subtree_control", f"+{c}")
                enabled.add(c)
            except OSError as exc:
                return enabled & _WANTED, f"cannot enable {c} in {base}/cgroup.subtree_control: {exc}"
    return enabled & _WANTED, ""


def probe(layout: Layout) -> CgroupCaps:
    """Which controllers this drainer's children can use (enabling them if it may), and how a
    whole group is killed."""
    base = layout.unified
    if base is None or not probe_dir(base, ("cgroup.procs",)):
        return CgroupCaps(layout, reason=f"{base} is not writable")
    enabled, reason = _prepare(base)
    kill = "signal"
    if probe_dir(base, ("cgroup.kill",)):
        kill = "cgroup.kill"
    elif probe_dir(base, ("cgroup.freeze",)):
        kill = "freezer"
    return CgroupCaps(layout, memory="memory" in enabled, pids="pids" in enabled, cpu="cpu" in enabled,
                      kill=kill, reason=reason)


def create(caps: CgroupCaps, kill_via: str | None, mk: Callable[[Path], Path]) -> JobDirs:
    """One group for every controller and the kill (``mk`` makes it and records it for removal)."""
    if caps.layout.unified is None or not (caps.any or kill_via):
        return JobDirs()
    d = mk(caps.layout.unified)
    if caps.memory:
        with contextlib.suppress(OSError):
            write(d / "memory.swap.max", "0")
        with contextlib.suppress(OSError):  # OOM kills the whole job, not one process of it
            write(d / "memory.oom.group", "1")
    return JobDirs(memory=d if caps.memory else None, pids=d if caps.pids else None, cpu=d if caps.cpu else None,
                   kill=d, kill_via=kill_via if kill_via in ("cgroup.kill", "freezer") else "signal")


def set_memory(d: Path, memory_bytes: int | None, memsw: bool) -> None:
    """Cap memory (swap is off for the group from its creation)."""
    write(f"{d}/memory.max", "max" if memory_bytes is None else str(memory_bytes))


def set_cpu(d: Path, quota: int) -> None:
    """A CFS quota per period (``-1``: unlimited)."""
    write(f"{d}/cpu.max", f"{'max' if quota < 0 else quota} {CFS_PERIOD_US}")
