"""cgroup v1: one hierarchy per controller.

A job gets a group in each of the ``memory``, ``pids`` and ``cpu`` hierarchies, created *under the
drainer's own cgroup* in that hierarchy (in a container that is often nested, e.g.
``memory:/process_api/<id>``), plus one in the controller-less ``unified`` v2 hierarchy (for
``cgroup.kill``) when the host mounts one beside them, or failing that in ``freezer``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

from ._common import CFS_PERIOD_US, CgroupCaps, JobDirs, Layout, probe_dir, write

#: What ``memory.limit_in_bytes`` reads when unlimited (the largest page-aligned value).
UNLIMITED = 9223372036854771712
#: The file whose ``oom_kill`` line counts the kernel's OOM kills in a memory group.
OOM_EVENTS = "memory.oom_control"


def probe(layout: Layout) -> CgroupCaps:
    """Which controllers this drainer can make groups in, and how it can kill a whole group."""
    mem = "memory" in layout.v1 and probe_dir(layout.v1["memory"], ("memory.limit_in_bytes",))
    memsw = mem and (layout.v1["memory"] / "memory.memsw.limit_in_bytes").exists()
    pids = "pids" in layout.v1 and probe_dir(layout.v1["pids"], ("pids.max",))
    cpu = "cpu" in layout.v1 and probe_dir(layout.v1["cpu"], ("cpu.cfs_quota_us",))
    kill: str | None = None
    if layout.unified is not None and probe_dir(layout.unified, ("cgroup.kill",)):
        kill = "cgroup.kill"
    elif "freezer" in layout.v1 and probe_dir(layout.v1["freezer"], ("freezer.state",)):
        kill = "freezer"
    elif mem or pids or cpu:
        kill = "signal"
    reason = "" if (mem or pids or cpu) else "no writable v1 memory/pids/cpu cgroup"
    return CgroupCaps(layout, mem, pids, cpu, kill, memsw, reason)


def create(caps: CgroupCaps, kill_via: str | None, mk: Callable[[Path], Path]) -> JobDirs:
    """A group in each usable hierarchy (``mk`` makes one and records it for removal)."""
    layout = caps.layout
    dirs = JobDirs()
    if caps.memory:
        dirs.memory = mk(layout.v1["memory"])
    if caps.pids:
        dirs.pids = mk(layout.v1["pids"])
    if caps.cpu:
        dirs.cpu = mk(layout.v1["cpu"])
    if kill_via == "cgroup.kill" and layout.unified is not None:
        dirs.kill, dirs.kill_via = mk(layout.unified), "cgroup.kill"
    elif kill_via == "freezer" and "freezer" in layout.v1:
        dirs.kill, dirs.kill_via = mk(layout.v1["freezer"]), "freezer"
    return dirs


def set_memory(d: Path, memory_bytes: int | None, memsw: bool) -> None:
    """Cap memory, and memory plus swap at the same value where the host accounts swap.
    memsw must stay >= memory: lower memory first, raise memsw first."""
    value = str(UNLIMITED if memory_bytes is None else memory_bytes)
    order = ["memory.limit_in_bytes", "memsw"] if memory_bytes is not None else ["memsw", "memory.limit_in_bytes"]
    for name in order:
        if name != "memsw":
            write(f"{d}/{name}", value)
        elif memsw:
            with contextlib.suppress(OSError):  # no swapping around the limit
                write(f"{d}/memory.memsw.limit_in_bytes", value)


def set_cpu(d: Path, quota: int) -> None:
    """A CFS quota per period (``-1``: unlimited)."""
    write(f"{d}/cpu.cfs_period_us", str(CFS_PERIOD_US))
    write(f"{d}/cpu.cfs_quota_us", str(quota))
