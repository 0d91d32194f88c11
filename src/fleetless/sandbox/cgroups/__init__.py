"""Per-job cgroups: memory, pids and CPU caps, and killing a whole process tree at once.

Both layouts are detected at run time from ``/proc/self/cgroup`` and ``/proc/self/mountinfo``
(:func:`detect`); what differs between them lives in :mod:`.v1` (one hierarchy per controller)
and :mod:`.v2` (a single ``cgroup2`` hierarchy), each behind the same four functions (``probe``,
``create``, ``set_memory``, ``set_cpu``), as nsjail keeps ``cgroup.cc`` and ``cgroup2.cc``.

Groups are named ``fleetless-<drainer pid>-<random>``; :func:`sweep` removes those whose drainer
is gone (killing anything left inside first). Nothing here needs the job to cooperate: a process
is put into its groups by writing its pid to ``cgroup.procs`` (see :meth:`JobCgroup.procs_files`,
meant for a ``preexec_fn``), and its descendants inherit them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from pathlib import Path
from types import ModuleType

from .. import _workspace
from . import v1, v2
from ._common import CFS_PERIOD_US, PREFIX, CgroupCaps, JobDirs, Layout, detect, pids_of, read, rmdir, write

__all__ = [
    "PREFIX",
    "CgroupCaps",
    "JobCgroup",
    "Layout",
    "available",
    "detect",
    "enforced_caps",
    "kill_paths",
    "sweep",
]

log = logging.getLogger(__name__)

_CAPS: CgroupCaps | None = None


def _version(layout: Layout) -> ModuleType | None:
    return {"v1": v1, "v2": v2}.get(layout.mode)


def available(refresh: bool = False) -> CgroupCaps:
    """Probe (once, cached) which per-job cgroup features this drainer can use."""
    global _CAPS
    if _CAPS is not None and not refresh:
        return _CAPS
    layout = detect()
    version = _version(layout)
    caps: CgroupCaps = version.probe(layout) if version is not None else CgroupCaps(
        layout, reason="no cgroup filesystem found")
    _CAPS = caps
    return caps


def enforced_caps() -> list[str]:
    """Human-readable list of what per-job cgroups enforce here, e.g. ``["memory (cgroup v1)"]``."""
    return available().describe()


class JobCgroup:
    """The cgroups of one job: create, limit, attach, read events, kill, remove.

    A group is made in every hierarchy whose controller is usable (see :func:`available`), even
    for a limit that is ``None`` (then it only accounts and kills); :meth:`set_limits` may be
    called again later, e.g. on a group prepared in advance before the job's limits are known.
    """

    def __init__(
        self,
        memory_bytes: int | None = None,
        pids: int | None = None,
        cpus: float | None = None,
        caps: CgroupCaps | None = None,
        kill_via: str | None = None,
    ) -> None:
        self.caps = caps if caps is not None else available()
        self.name = f"{PREFIX}{os.getpid()}-{os.urandom(4).hex()}"
        self.memory_bytes: int | None = None
        self.pids_max: int | None = None
        self.cpus: float | None = None
        self.kill_via = kill_via or self.caps.kill
        self.dirs: list[Path] = []  # every group we created (to attach to and remove)
        self._version = _version(self.caps.layout)
        self._groups = JobDirs()
        try:
            if self._version is not None:
                self._groups = self._version.create(self.caps, self.kill_via, self._mk)
                self.kill_via = self._groups.kill_via
            if (memory_bytes, pids, cpus) != (None, None, None):  # a new group has no cap yet
                self.set_limits(memory_bytes, pids, cpus)
        except BaseException:
            self.remove()
            raise
        self._oom_before = 0  # a new group's counters
        self._pids_before = 0

    def _mk(self, base: Path) -> Path:
        path = base / self.name
        path.mkdir()
        self.dirs.append(path)
        return path

    def set_limits(self, memory_bytes: int | None, pids: int | None, cpus: float | None) -> None:
        """Cap memory (bytes, no swap), pids (processes and threads) and CPU (cores).
        ``None`` lifts a cap. Caps whose controller is not available here are ignored."""
        g = self._groups
        if g.memory is not None and self._version is not None:
            self._version.set_memory(g.memory, memory_bytes, self.caps.memsw)
            self.memory_bytes = memory_bytes
        if g.pids is not None:
            write(f"{g.pids}/pids.max", "max" if pids is None else str(pids))
            self.pids_max = pids
        if g.cpu is not None and self._version is not None:
            self._version.set_cpu(g.cpu, -1 if cpus is None else max(1000, int(cpus * CFS_PERIOD_US)))
            self.cpus = cpus

    # -- attaching --------------------------------------------------------------------------
    def procs_files(self) -> list[str]:
        """The ``cgroup.procs`` files a process writes its pid to in order to join (for a
        ``preexec_fn``: ``os.write(fd, b"0")`` to each; its children inherit the groups)."""
        return [f"{d}/cgroup.procs" for d in self.dirs]

    def attach(self, pid: int) -> None:
        for f in self.procs_files():
            write(Path(f), str(pid))

    # -- reading ----------------------------------------------------------------------------
    def pids(self) -> set[int]:
        return pids_of(self.dirs)

    def oom_kills(self) -> int:
        d = self._groups.memory
        if d is None or self._version is None:
            return 0
        return _counter(read(f"{d}/{self._version.OOM_EVENTS}"), "oom_kill")

    def pids_max_events(self) -> int:
        d = self._groups.pids
        return 0 if d is None else _counter(read(f"{d}/pids.events"), "max")

    def mark(self) -> None:
        """Start counting OOM kills and refused forks from now (e.g. before each exec)."""
        self._oom_before = self.oom_kills()
        self._pids_before = self.pids_max_events()

    def oom_killed(self) -> bool:
        """Did the kernel OOM-kill a process of this job since the group was made?"""
        return self.oom_kills() > self._oom_before

    def pids_limit_hit(self) -> bool:
        """Was a fork refused because of ``pids.max`` since the group was made?"""
        return self.pids_max_events() > self._pids_before

    # -- killing and removing ---------------------------------------------------------------
    def kill(self) -> None:
        """SIGKILL every process of the job (forks racing the kill included). Never raises."""
        try:
            _kill_groups(self.dirs, self._groups.kill, self.kill_via)
        except OSError as exc:
            log.debug("killing cgroup %s: %s", self.name, exc)

    def wait_empty(self, wait_seconds: float = 5.0) -> bool:
        """Kill what is left and wait until no process of the job is listed any more (a process
        killed with its pid namespace stays in ``cgroup.procs`` until it has exited). True when
        empty. Never raises."""
        deadline = time.monotonic() + wait_seconds
        while True:
            try:
                if not self.pids():
                    return True
            except OSError:
                return True  # the groups are gone
            if time.monotonic() >= deadline:
                return False
            self.kill()
            time.sleep(0.001)

    def remove(self, wait_seconds: float = 2.0) -> bool:
        """Kill whatever is left and remove every group. True if all are gone. Never raises."""
        if not self.dirs:
            return True
        # Every process of the job is in every group: when the first group is empty and goes, so
        # do the others (nothing to kill, nothing to list).
        if rmdir(self.dirs[0]):
            self.dirs = [d for d in self.dirs[1:] if not rmdir(d)]
            if not self.dirs:
                return True
        if self.pids():
            self.kill()
        deadline = time.monotonic() + wait_seconds
        remaining = list(self.dirs)
        while True:
            remaining = [d for d in remaining if not rmdir(d)]
            if not remaining or time.monotonic() >= deadline:
                break
            time.sleep(0.001)
        self.dirs = remaining
        if remaining:
            log.warning("could not remove cgroups %s (left for sweep)", ", ".join(map(str, remaining)))
        return not remaining


def _counter(text: str, key: str) -> int:
    """The value of ``key`` in a flat-keyed events file (``oom_kill 2``)."""
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return 0


def kill_paths(dirs: list[Path]) -> None:
    """SIGKILL every process in these groups, from a process other than the one that made them
    (bwrap's watchdog at a job's deadline). Never raises."""
    try:
        for d in dirs:
            if (d / "cgroup.kill").exists():
                write(d / "cgroup.kill", "1")
        _kill_groups(dirs, None, None)  # what is left (v1 hierarchies, no cgroup.kill)
    except OSError as exc:
        log.debug("killing cgroups %s: %s", dirs, exc)
def _kill_groups(dirs: list[Path], kill_dir: Path | None, how: str | None) -> None:
    if kill_dir is not None and how == "cgroup.kill":
        write(kill_dir / "cgroup.kill", "1")
        return
    frozen = False
    if kill_dir is not None and how == "freezer":
        state = "freezer.state" if (kill_dir / "freezer.state").exists() else "cgroup.freeze"
        try:
            write(kill_dir / state, "FROZEN" if state == "freezer.state" else "1")
            frozen = True
        except OSError:
            pass
        try:
            for _ in range(100):
                pids = pids_of([kill_dir, *dirs])
                if not pids:
                    break
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                if frozen:
                    break  # a frozen group cannot fork; SIGKILL takes effect when thawed
                time.sleep(0.001)
        finally:
            if frozen:
                write(kill_dir / state, "THAWED" if state == "freezer.state" else "0")
        return
    for _ in range(100):  # no atomic kill: repeat until no process is left to fork
        pids = pids_of(dirs)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.001)


def _owner_pid(name: str) -> int | None:
    """``fleetless-<pid>-<rand>``, ``fleetless-probe-<pid>-<rand>`` or ``fleetless-drainer-<pid>``."""
    if not name.startswith(PREFIX):
        return None
    parts = name[len(PREFIX) :].split("-")
    if parts and parts[0] in ("probe", "drainer"):
        parts = parts[1:]
    if not parts or not parts[0].isdigit():
        return None
    return int(parts[0])


def sweep() -> int:
    """Remove per-job groups left by drainers that no longer run (killing what is inside first).
    Returns how many groups were removed. Never raises."""
    layout = detect()
    bases: list[Path] = list(layout.v1.values())
    if layout.unified is not None:
        bases.append(layout.unified)
    stale: list[Path] = []
    for base in bases:
        try:
            entries = list(base.iterdir())
        except OSError:
            continue
        for entry in entries:
            pid = _owner_pid(entry.name)
            if pid is None or not entry.is_dir() or _workspace.pid_alive(pid):
                continue
            if entry.name.startswith(PREFIX + "drainer-") and pids_of([entry]):
                continue  # a drainer leaf still holding processes (e.g. its children): leave it
            stale.append(entry)
    if not stale:
        return 0
    # kill first, in every hierarchy (the processes of one job are in several groups)
    kill_dirs = [p for p in stale if (p / "cgroup.kill").exists()]
    for p in kill_dirs:
        with contextlib.suppress(OSError):
            write(p / "cgroup.kill", "1")
    with contextlib.suppress(OSError):
        _kill_groups(stale, None, "signal")
    removed = 0
    deadline = time.monotonic() + 2.0
    pending = stale
    while pending:
        still = []
        for p in pending:
            if rmdir(p):
                removed += 1
            else:
                still.append(p)
        pending = still
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(0.01)
    for p in pending:
        log.warning("sweep: could not remove %s", p)
    return removed
