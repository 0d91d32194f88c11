"""Per-job cgroups: memory, pids and CPU caps, and killing a whole process tree at once.

Both layouts are detected at run time from ``/proc/self/cgroup`` and ``/proc/self/mountinfo``:

* **cgroup v1** (one hierarchy per controller, often with a v2 ``unified`` hierarchy next to it
  that has no controllers but offers ``cgroup.kill``): a job gets a group in each of the
  ``memory``, ``pids`` and ``cpu`` hierarchies, created *under the drainer's own cgroup* in that
  hierarchy (in a container that is often nested, e.g. ``memory:/process_api/<id>``), plus one in
  ``unified`` (for ``cgroup.kill``) or, failing that, in ``freezer``.
* **cgroup v2** (a single ``cgroup2`` mount): the drainer first moves itself into a leaf
  ``fleetless-drainer-<pid>`` below its own cgroup, enables ``memory pids cpu`` in the
  ``cgroup.subtree_control`` of its own cgroup, and puts each job into a sibling group.

Groups are named ``fleetless-<drainer pid>-<random>``; :func:`sweep` removes those whose drainer
is gone (killing anything left inside first). Nothing here needs the job to cooperate: a process
is put into its groups by writing its pid to ``cgroup.procs`` (see :meth:`JobCgroup.procs_files`,
meant for a ``preexec_fn``), and its descendants inherit them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import _workspace

__all__ = [
    "CgroupCaps",
    "JobCgroup",
    "Layout",
    "available",
    "detect",
    "enforced_caps",
    "sweep",
]

log = logging.getLogger(__name__)

PREFIX = "fleetless-"
_V1_LIMIT_CONTROLLERS = ("memory", "pids", "cpu")
_CFS_PERIOD_US = 100_000
_UNLIMITED_V1 = 9223372036854771712


@dataclass(frozen=True)
class Layout:
    """Where this process's cgroups are, per hierarchy.

    ``v1`` maps a controller name to the directory of *our own* cgroup in its hierarchy;
    ``unified`` is our own directory in the cgroup2 hierarchy (hybrid or pure v2).
    ``mode`` is ``"v1"`` (controllers on v1 hierarchies, maybe a controller-less unified one),
    ``"v2"`` (pure cgroup2) or ``"none"``.
    """

    mode: str
    v1: dict[str, Path] = field(default_factory=dict)
    unified: Path | None = None


def _parse_mountinfo(text: str) -> tuple[dict[str, tuple[str, str]], tuple[str, str] | None]:
    """(controller -> (mount root, mount point)) for cgroup v1, and the cgroup2 mount."""
    v1: dict[str, tuple[str, str]] = {}
    v2: tuple[str, str] | None = None
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields = left.split()
        rfields = right.split()
        if len(fields) < 5 or len(rfields) < 3:
            continue
        root, mountpoint = _unescape(fields[3]), _unescape(fields[4])
        fstype = rfields[0]
        if fstype == "cgroup2":
            if v2 is None:
                v2 = (root, mountpoint)
        elif fstype == "cgroup":
            for opt in rfields[2].split(","):
                if opt in ("memory", "pids", "cpu", "freezer") and opt not in v1:
                    v1[opt] = (root, mountpoint)
    return v1, v2


def _unescape(path: str) -> str:
    return path.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def _join(mount: tuple[str, str], own: str) -> Path:
    root, mountpoint = mount
    rel = own
    if root != "/" and (own == root or own.startswith(root.rstrip("/") + "/")):
        rel = own[len(root) :]
    return Path(mountpoint) / rel.lstrip("/")


def detect(proc_cgroup: str | None = None, mountinfo: str | None = None) -> Layout:
    """The cgroup layout of this process (texts can be passed in for testing)."""
    try:
        if proc_cgroup is None:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
        if mountinfo is None:
            mountinfo = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return Layout("none")
    mounts_v1, mount_v2 = _parse_mountinfo(mountinfo)
    own_v1: dict[str, str] = {}
    own_v2: str | None = None
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            own_v2 = path
        for c in controllers.split(","):
            own_v1[c] = path
    v1 = {c: _join(mounts_v1[c], own_v1[c]) for c in mounts_v1 if c in own_v1}
    unified = _join(mount_v2, own_v2) if mount_v2 is not None and own_v2 is not None else None
    if unified is not None and unified.name.startswith(PREFIX + "drainer-"):
        unified = unified.parent  # we (or our parent) already moved into our leaf
    if any(c in v1 for c in _V1_LIMIT_CONTROLLERS):
        return Layout("v1", v1, unified)
    if unified is not None:
        return Layout("v2", {}, unified)
    return Layout("none")


@dataclass(frozen=True)
class CgroupCaps:
    """What per-job cgroups can do on this host for this drainer (probed once)."""

    layout: Layout
    memory: bool = False
    pids: bool = False
    cpu: bool = False
    kill: str | None = None  # "cgroup.kill", "freezer" or "signal" (kill every pid listed)
    memsw: bool = False
    reason: str = ""

    @property
    def any(self) -> bool:
        return self.memory or self.pids or self.cpu

    def describe(self) -> list[str]:
        ver = "cgroup v2" if self.layout.mode == "v2" else "cgroup v1"
        out = [f"{name} ({ver})" for name in ("memory", "pids", "cpu") if getattr(self, name)]
        if self.kill is not None:
            out.append(f"tree kill ({self.kill})")
        return out


_CAPS: CgroupCaps | None = None


def _probe_dir(base: Path, files: tuple[str, ...]) -> bool:
    """Can we create a child group in ``base`` that has ``files``? (mkdir + rmdir)"""
    if not os.access(base, os.W_OK):
        return False
    probe = base / f"{PREFIX}probe-{os.getpid()}-{secrets.token_hex(3)}"
    try:
        probe.mkdir()
    except OSError:
        return False
    try:
        return all((probe / f).exists() for f in files)
    finally:
        _rmdir(probe)


def _rmdir(path: Path) -> bool:
    try:
        path.rmdir()
        return True
    except FileNotFoundError:
        return True
    except OSError:
        return False


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _v2_prepare(base: Path) -> tuple[set[str], str]:
    """Pure v2: move ourselves into a leaf and enable controllers for our children."""
    wanted = {"memory", "pids", "cpu"}
    available_here = set(_read(base / "cgroup.controllers").split())
    enabled = set(_read(base / "cgroup.subtree_control").split())
    want = (wanted & available_here) - enabled
    if want:
        leaf = base / f"{PREFIX}drainer-{os.getpid()}"
        try:
            leaf.mkdir(exist_ok=True)
            _write(leaf / "cgroup.procs", "0")
        except OSError as exc:
            return enabled & wanted, f"cannot move the drainer into a leaf cgroup: {exc}"
        for c in sorted(want):
            try:
                _write(base / "cgroup.subtree_control", f"+{c}")
                enabled.add(c)
            except OSError as exc:
                return enabled & wanted, f"cannot enable {c} in {base}/cgroup.subtree_control: {exc}"
    return enabled & wanted, ""


def available(refresh: bool = False) -> CgroupCaps:
    """Probe (once, cached) which per-job cgroup features this drainer can use."""
    global _CAPS
    if _CAPS is not None and not refresh:
        return _CAPS
    layout = detect()
    if layout.mode == "v1":
        mem = "memory" in layout.v1 and _probe_dir(layout.v1["memory"], ("memory.limit_in_bytes",))
        memsw = mem and (layout.v1["memory"] / "memory.memsw.limit_in_bytes").exists()
        pids = "pids" in layout.v1 and _probe_dir(layout.v1["pids"], ("pids.max",))
        cpu = "cpu" in layout.v1 and _probe_dir(layout.v1["cpu"], ("cpu.cfs_quota_us",))
        kill: str | None = None
        if layout.unified is not None and _probe_dir(layout.unified, ("cgroup.kill",)):
            kill = "cgroup.kill"
        elif "freezer" in layout.v1 and _probe_dir(layout.v1["freezer"], ("freezer.state",)):
            kill = "freezer"
        elif mem or pids or cpu:
            kill = "signal"
        reason = "" if (mem or pids or cpu) else "no writable v1 memory/pids/cpu cgroup"
        _CAPS = CgroupCaps(layout, mem, pids, cpu, kill, memsw, reason)
    elif layout.mode == "v2" and layout.unified is not None:
        base = layout.unified
        if not _probe_dir(base, ("cgroup.procs",)):
            _CAPS = CgroupCaps(layout, reason=f"{base} is not writable")
        else:
            enabled, reason = _v2_prepare(base)
            kill = "signal"
            if _probe_dir(base, ("cgroup.kill",)):
                kill = "cgroup.kill"
            elif _probe_dir(base, ("cgroup.freeze",)):
                kill = "freezer"
            _CAPS = CgroupCaps(
                layout,
                memory="memory" in enabled,
                pids="pids" in enabled,
                cpu="cpu" in enabled,
                kill=kill,
                reason=reason,
            )
    else:
        _CAPS = CgroupCaps(layout, reason="no cgroup filesystem found")
    return _CAPS


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
        self.name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        self.memory_bytes: int | None = None
        self.pids_max: int | None = None
        self.cpus: float | None = None
        self.kill_via = kill_via or self.caps.kill
        self.dirs: list[Path] = []  # every group we created (to attach to and remove)
        self._memory_dir: Path | None = None
        self._pids_dir: Path | None = None
        self._cpu_dir: Path | None = None
        self._kill_dir: Path | None = None
        try:
            self._create()
            self.set_limits(memory_bytes, pids, cpus)
        except BaseException:
            self.remove()
            raise
        self._oom_before = self.oom_kills()
        self._pids_before = self.pids_max_events()

    # -- creation ---------------------------------------------------------------------------
    def _mk(self, base: Path) -> Path:
        path = base / self.name
        path.mkdir()
        self.dirs.append(path)
        return path

    def _create(self) -> None:
        caps = self.caps
        layout = caps.layout
        if layout.mode == "v1":
            if caps.memory:
                self._memory_dir = self._mk(layout.v1["memory"])
            if caps.pids:
                self._pids_dir = self._mk(layout.v1["pids"])
            if caps.cpu:
                self._cpu_dir = self._mk(layout.v1["cpu"])
            if self.kill_via == "cgroup.kill" and layout.unified is not None:
                self._kill_dir = self._mk(layout.unified)
            elif self.kill_via == "freezer" and "freezer" in layout.v1:
                self._kill_dir = self._mk(layout.v1["freezer"])
            else:
                self.kill_via = "signal"
        elif layout.mode == "v2" and layout.unified is not None:
            if not (caps.any or self.kill_via):
                return
            d = self._mk(layout.unified)
            self._memory_dir = d if caps.memory else None
            self._pids_dir = d if caps.pids else None
            self._cpu_dir = d if caps.cpu else None
            self._kill_dir = d
            if caps.memory:
                with contextlib.suppress(OSError):
                    _write(d / "memory.swap.max", "0")
                with contextlib.suppress(OSError):  # OOM kills the whole job, not one process of it
                    _write(d / "memory.oom.group", "1")
            if self.kill_via not in ("cgroup.kill", "freezer"):
                self.kill_via = "signal"

    def set_limits(self, memory_bytes: int | None, pids: int | None, cpus: float | None) -> None:
        """Cap memory (bytes, no swap), pids (processes and threads) and CPU (cores).
        ``None`` lifts a cap. Caps whose controller is not available here are ignored."""
        v2 = self.caps.layout.mode == "v2"
        if self._memory_dir is not None:
            d = self._memory_dir
            if v2:
                _write(d / "memory.max", "max" if memory_bytes is None else str(memory_bytes))
            else:
                value = str(_UNLIMITED_V1 if memory_bytes is None else memory_bytes)
                memsw = d / "memory.memsw.limit_in_bytes"
                lowering = memory_bytes is not None
                # memsw must stay >= memory: lower memory first, raise memsw first
                order = ["memory.limit_in_bytes", "memsw"] if lowering else ["memsw", "memory.limit_in_bytes"]
                for name in order:
                    if name == "memsw":
                        if self.caps.memsw:
                            with contextlib.suppress(OSError):  # no swapping around the limit
                                _write(memsw, value)
                    else:
                        _write(d / name, value)
            self.memory_bytes = memory_bytes
        if self._pids_dir is not None:
            _write(self._pids_dir / "pids.max", "max" if pids is None else str(pids))
            self.pids_max = pids
        if self._cpu_dir is not None:
            quota = -1 if cpus is None else max(1000, int(cpus * _CFS_PERIOD_US))
            if v2:
                _write(self._cpu_dir / "cpu.max", f"{'max' if quota < 0 else quota} {_CFS_PERIOD_US}")
            else:
                _write(self._cpu_dir / "cpu.cfs_period_us", str(_CFS_PERIOD_US))
                _write(self._cpu_dir / "cpu.cfs_quota_us", str(quota))
            self.cpus = cpus

    # -- attaching --------------------------------------------------------------------------
    def procs_files(self) -> list[str]:
        """The ``cgroup.procs`` files a process writes its pid to in order to join (for a
        ``preexec_fn``: ``os.write(fd, b"0")`` to each; its children inherit the groups)."""
        return [str(d / "cgroup.procs") for d in self.dirs]

    def attach(self, pid: int) -> None:
        for f in self.procs_files():
            _write(Path(f), str(pid))

    # -- reading ----------------------------------------------------------------------------
    def pids(self) -> set[int]:
        out: set[int] = set()
        for d in self.dirs:
            for line in _read(d / "cgroup.procs").split():
                out.add(int(line))
        return out

    def oom_kills(self) -> int:
        d = self._memory_dir
        if d is None:
            return 0
        text = _read(d / ("memory.events" if self.caps.layout.mode == "v2" else "memory.oom_control"))
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def pids_max_events(self) -> int:
        d = self._pids_dir
        if d is None:
            return 0
        for line in _read(d / "pids.events").splitlines():
            key, _, value = line.partition(" ")
            if key == "max":
                return int(value)
        return 0

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
            _kill_groups(self.dirs, self._kill_dir, self.kill_via)
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
        if self.pids():
            self.kill()
        deadline = time.monotonic() + wait_seconds
        remaining = list(self.dirs)
        while True:
            remaining = [d for d in remaining if not _rmdir(d)]
            if not remaining or time.monotonic() >= deadline:
                break
            time.sleep(0.001)
        self.dirs = remaining
        if remaining:
            log.warning("could not remove cgroups %s (left for sweep)", ", ".join(map(str, remaining)))
        return not remaining


def _pids_of(dirs: list[Path]) -> set[int]:
    out: set[int] = set()
    for d in dirs:
        for line in _read(d / "cgroup.procs").split():
            out.add(int(line))
    return out


def kill_paths(dirs: list[Path]) -> None:
    """SIGKILL every process in these groups, from a process other than the one that made them
    (bwrap's watchdog at a job's deadline). Never raises."""
    try:
        for d in dirs:
            if (d / "cgroup.kill").exists():
                _write(d / "cgroup.kill", "1")
        _kill_groups(dirs, None, None)  # what is left (v1 hierarchies, no cgroup.kill)
    except OSError as exc:
        log.debug("killing cgroups %s: %s", dirs, exc)


def _kill_groups(dirs: list[Path], kill_dir: Path | None, how: str | None) -> None:
    if kill_dir is not None and how == "cgroup.kill":
        _write(kill_dir / "cgroup.kill", "1")
        return
    frozen = False
    if kill_dir is not None and how == "freezer":
        state = "freezer.state" if (kill_dir / "freezer.state").exists() else "cgroup.freeze"
        try:
            _write(kill_dir / state, "FROZEN" if state == "freezer.state" else "1")
            frozen = True
        except OSError:
            pass
        try:
            for _ in range(100):
                pids = _pids_of([kill_dir, *dirs])
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
                _write(kill_dir / state, "THAWED" if state == "freezer.state" else "0")
        return
    for _ in range(100):  # no atomic kill: repeat until no process is left to fork
        pids = _pids_of(dirs)
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
            if entry.name.startswith(PREFIX + "drainer-") and _pids_of([entry]):
                continue  # a drainer leaf still holding processes (e.g. its children): leave it
            stale.append(entry)
    if not stale:
        return 0
    # kill first, in every hierarchy (the processes of one job are in several groups)
    kill_dirs = [p for p in stale if (p / "cgroup.kill").exists()]
    for p in kill_dirs:
        with contextlib.suppress(OSError):
            _write(p / "cgroup.kill", "1")
    with contextlib.suppress(OSError):
        _kill_groups(stale, None, "signal")
    removed = 0
    deadline = time.monotonic() + 2.0
    pending = stale
    while pending:
        still = []
        for p in pending:
            if _rmdir(p):
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
