"""What both cgroup versions share: where this process's groups are, what a drainer can use, and
the few file operations on a cgroup filesystem."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

#: Every group fleetless makes is named with this prefix (``fleetless-<drainer pid>-<random>``).
PREFIX = "fleetless-"
#: The v1 hierarchies whose controllers cap a job (``freezer`` only kills).
V1_LIMIT_CONTROLLERS = ("memory", "pids", "cpu")
#: The CPU quota's period, in microseconds, on both versions.
CFS_PERIOD_US = 100_000


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
    if any(c in v1 for c in V1_LIMIT_CONTROLLERS):
        return Layout("v1", v1, unified)
    if unified is not None:
        return Layout("v2", {}, unified)
    return Layout("none")


def probe_dir(base: Path, files: tuple[str, ...]) -> bool:
    """Can we create a child group in ``base`` that has ``files``? (mkdir + rmdir)"""
    if not os.access(base, os.W_OK):
        return False
    probe = base / f"{PREFIX}probe-{os.getpid()}-{os.urandom(3).hex()}"
    try:
        probe.mkdir()
    except OSError:
        return False
    try:
        return all((probe / f).exists() for f in files)
    finally:
        rmdir(probe)


def rmdir(path: Path) -> bool:
    """Remove an (empty) group; True if it is gone."""
    try:
        os.rmdir(path)
        return True
    except FileNotFoundError:
        return True
    except OSError:
        return False


# A per-job drain reads and writes about twenty control files per job: plain fd calls, not text
# file objects (which cost several times the system calls' own time).
def read(path: str | Path) -> str:
    """A control file's text, or "" when it cannot be read (the group is gone)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks).decode()
    except OSError:
        return ""
    finally:
        os.close(fd)


def write(path: str | Path, value: str) -> None:
    """Write a control file (one ``write``: the kernel parses each write on its own)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)  # open(path, "w")'s
    try:
        data = value.encode()
        if os.write(fd, data) != len(data):
            raise OSError(f"short write of {value!r} to {path}")
    finally:
        os.close(fd)


def pids_of(dirs: list[Path]) -> set[int]:
    """Every pid listed in these groups' ``cgroup.procs``."""
    out: set[int] = set()
    for d in dirs:
        for line in read(f"{d}/cgroup.procs").split():
            out.add(int(line))
    return out


@dataclass
class JobDirs:
    """The groups made for one job, and which one serves each purpose (``None``: not capped here).
    On v2 one directory serves them all; on v1 each controller has its own hierarchy."""

    memory: Path | None = None
    pids: Path | None = None
    cpu: Path | None = None
    kill: Path | None = None
    kill_via: str = "signal"
