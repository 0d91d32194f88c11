"""The sandbox protocol: one fresh, isolated environment per job, always destroyed afterwards.

The shape is the seed's::

    with backend.create(template, ttl_seconds=900) as sbx:
        sbx.write("payload.json", payload)
        r = sbx.exec([sbx.python, f"{sbx.handlers_path}/{kind}.py", f"{sbx.workspace_path}/payload.json"],
                     timeout_seconds=600)
    # sbx.kill() has run: no process, file or cgroup of the job is left.

Backends register themselves by name (``process``, ``bwrap``, ``microvm``) and are looked up
with :func:`get_backend`. A backend module is imported only when it is asked for.
"""

from __future__ import annotations

import importlib
import logging
import os
import shutil
import sys
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar

__all__ = [
    "AUTO",
    "OWN_DEADLINE_SLACK",
    "ExecResult",
    "Limits",
    "Sandbox",
    "SandboxUnavailable",
    "Template",
    "available_backends",
    "choose_tier",
    "get_backend",
]

MiB = 1024 * 1024
#: Every tier also enforces an exec's timeout by itself, outside the drainer (the process tier's
#: supervisor, bwrap's per-drainer watchdog, the microVM's guest), at most this much later than
#: the drainer would: a drainer that is stopped (SIGSTOP, a frozen VM) cannot make a job outlive
#: its lease, whose grace keeps more than this for the teardown.
OWN_DEADLINE_SLACK = 0.5


class SandboxUnavailable(RuntimeError):
    """The backend cannot run on this host (missing binary, no permission, no image)."""


@dataclass(frozen=True)
class Limits:
    """Resource caps for one job. ``None`` means "not capped by fleetless"."""

    memory_bytes: int | None = 512 * MiB  # address space (process) / cgroup memory / guest RAM
    cpus: float | None = 1.0  # CPU quota in cores (cgroup cfs / guest vCPUs)
    pids: int | None = 128  # processes and threads the job may have at once
    cpu_seconds: int | None = None  # RLIMIT_CPU; None = derived from the timeout
    file_size_bytes: int | None = 1024 * MiB  # RLIMIT_FSIZE: largest file the job can write
    open_files: int | None = 256  # RLIMIT_NOFILE
    tmp_bytes: int = 64 * MiB  # size of the private /tmp where the backend gives one
    # the workspace's tmpfs where the drainer can mount one (a root drainer: process, bwrap):
    disk_bytes: int | None = 512 * MiB  # its size (RAM, as the job writes it)
    inodes: int | None = 16384  # how many files and directories it may hold
    network: bool = False  # False: no interface but loopback (where the tier can enforce it)
    stdout_bytes: int = 64 * 1024  # stdout kept (the job's result); the rest is read and dropped
    stderr_bytes: int = 64 * 1024  # stderr kept (its tail)


@dataclass(frozen=True)
class Template:
    """What every sandbox of a drain run is created from."""

    handlers_dir: Path  # bound read-only; appears inside as ``Sandbox.handlers_path``
    limits: Limits = field(default_factory=Limits)
    env: Mapping[str, str] = field(default_factory=dict)  # the complete environment of the job
    python: str | None = None  # interpreter for ``*.py`` handlers; None = backend default


@dataclass(frozen=True)
class ExecResult:
    """What one ``exec`` produced.

    ``exit_code`` is the process's exit status, or ``-signal`` when it died by a signal.
    ``killed`` is set when the sandbox itself killed the job, in words for an operator:
    ``"timeout after 10 s"``, ``"ttl of 900 s expired"``, ``"memory limit 256 MiB exceeded"``.
    ``stdout_cut`` is True when the job wrote more than ``limits.stdout_bytes`` to stdout (only
    the head is in ``stdout``).
    """

    exit_code: int
    stdout: str
    stderr: str
    duration: float
    killed: str | None = None
    stdout_cut: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.killed is None


class Sandbox(ABC):
    """One isolated environment. Create it, write files into its workspace, exec, kill."""

    name: ClassVar[str]
    _kill_lock: threading.RLock
    #: Seconds a sandbox may take beyond its job's timeout before the timeout even starts (a VM's
    #: boot). The drainer adds it to every lease, so a live drainer's lease never expires under a
    #: running job; the teardown after a kill (a second or two) is what --lease-grace covers.
    overhead_seconds: ClassVar[float] = 0.0
    #: Called with each chunk of the job's stdout as it arrives (on the exec's thread), when set,
    #: also after the exec started (a watch-mode spare): the batch runner's one record per job, from
    #: which the drainer kills a batch's job that outlives its deadline (``batch._Pacer``). The
    #: microVM tier's guest streams it only when it is set as the exec starts (not a spare's).
    on_stdout: Callable[[bytes], None] | None = None
    #: The job's processes read the host's ``time.monotonic()`` clock (not a VM's own).
    host_clock: ClassVar[bool] = True
    #: Every process running as the job's uid in this sandbox is its own (or its batch's): a
    #: machine of its own (a microVM guest), so a batch runner that cannot be a child subreaper
    #: finds a job's leftovers by uid (``_batch_runner.end_leftovers``).
    own_machine: ClassVar[bool] = False
    #: Paths as the job sees them.
    workspace_path: str
    handlers_path: str
    python: str

    @classmethod
    @abstractmethod
    def create(cls, template: Template, ttl_seconds: float = 900) -> Sandbox:
        """Make a fresh sandbox; its TTL clock starts now."""

    @classmethod
    def check(cls) -> None:
        """Raise :class:`SandboxUnavailable` with the reason if this backend cannot run here."""
        return None

    @classmethod
    def check_template(cls, template: Template) -> None:
        """Raise :class:`SandboxUnavailable` if sandboxes cannot be made from ``template`` (checked
        before a drain claims anything, so an operator's mistake spends no job's attempts)."""
        return None

    @classmethod
    def warm(cls, template: Template) -> None:
        """Start in the background what :meth:`check_template` would wait for (a tier's probe of
        the interpreter in a subprocess), so that it overlaps the drain's other start-up work; the
        check then waits for it and says what it found. A no-op where there is nothing to start."""
        return None

    #: Whether jobs run the host's own files (process, bwrap), whose permissions then apply to them.
    runs_host_programs: ClassVar[bool] = False
    #: How to add a program this tier lacks, said when a kind is not claimed for want of one.
    missing_program_hint: ClassVar[str] = ""

    @classmethod
    def handler_python(cls, template: Template) -> str:
        """The interpreter ``*.py`` handlers run with in this tier."""
        return template.python or default_python()

    @classmethod
    def has_program(cls, template: Template, path: str) -> bool:
        """Whether an executable file is at the absolute ``path`` where this tier's jobs run (the
        drain's check, before claiming, that a handler's interpreter is there)."""
        return os.path.isfile(path) and os.access(path, os.X_OK)

    @classmethod
    def describe(cls) -> str:
        """One line for ``fleetless doctor``: what this backend enforces here."""
        return ""

    @classmethod
    def unfiltered(cls) -> str | None:
        """Why this tier's jobs run here without the seccomp filter it loads into them where it can
        (the drain's caps line says it), or None: they get it, or the tier loads none anyway."""
        return None

    @classmethod
    def caps(cls, limits: Limits | None = None) -> dict[str, str]:
        """For each of ``pids``, ``memory``, ``cpu`` and ``disk``: how this tier holds a job of
        ``limits`` (the defaults when None) to it on this host, ``"capped by ..."``, or
        ``"NOT capped: ..."`` saying what there is instead (:mod:`._caps`)."""
        from ._caps import CAPS, NOT

        return {name: f"{NOT}: the {cls.name} tier does not say" for name in CAPS}

    @classmethod
    def sweep(cls) -> int:
        """Remove what sandboxes of drainers that died left behind; returns how many.

        Every backend's workspaces are swept; backends with more state (cgroups) add theirs."""
        from . import _workspace

        return _workspace.sweep()

    @abstractmethod
    def write(self, path: str, data: bytes | str) -> None:
        """Write a file into the workspace (``path`` is relative to it)."""

    @property
    def host_workspace(self) -> Path | None:
        """The workspace as a directory on the host, shared live with the job (process, bwrap);
        None where it is not (a microVM's copy, the forkserver's tmpfs of its mount namespace)."""
        return None

    @property
    def host_pid(self) -> int | None:
        """The host pid at the top of the running exec's process tree (its supervisor, bwrap, the
        fork server's init), whose descendants the drainer may look at and signal; None where
        there is none on this host (a microVM's guest) or nothing runs."""
        return None

    def stop_batch_runner(self) -> bool:
        """Where the drainer cannot signal a batch runner itself (``host_pid`` is None: a
        microVM's guest), ask it through the tier to start no other job once the one running has
        ended (file mode's SIGUSR1). True if asked; False where the tier has no way."""
        return False

    def open_pipes(self, names: Sequence[str]) -> list[int] | None:
        """Named pipes ``names`` made in the workspace for the job's uid to open, and this side of
        each opened read-write (a batch's channel), where the drainer cannot make them itself (its
        jobs' workspaces are subordinate uids'): None where it can, or not at all."""
        return None

    @abstractmethod
    def exec(self, argv: Sequence[str], timeout_seconds: float) -> ExecResult:
        """Run ``argv`` with the workspace as cwd; never raises for the job's own failures.

        The job is killed at ``timeout_seconds`` (or the TTL) even if the calling thread or the
        whole drainer is stopped: the tier enforces it by itself, at most ``OWN_DEADLINE_SLACK``
        later."""

    def stdout_seen(self, chunk: bytes) -> None:
        """The exec's observer of stdout: passes ``chunk`` to :attr:`on_stdout` if one is set."""
        seen = self.on_stdout
        if seen is not None:
            seen(chunk)

    def __new__(cls, *args: Any, **kwargs: Any) -> Sandbox:
        self = super().__new__(cls)
        self._kill_lock = threading.RLock()
        return self

    def kill(self) -> None:
        """Destroy everything: processes, workspace, cgroups. Idempotent, never raises, and safe
        from several threads at once: every call returns only once the sandbox is destroyed (a
        drainer's cancel kills a batch's sandbox from its poll while the batch's end kills it too;
        two kills at once once closed one descriptor twice and ended the drain, CI)."""
        with self._kill_lock:
            self._destroy()

    @abstractmethod
    def _destroy(self) -> None:
        """:meth:`kill`'s work, one call at a time; idempotent."""

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.kill()


_BACKENDS: dict[str, str] = {
    "process": "fleetless.sandbox.process:ProcessSandbox",
    "bwrap": "fleetless.sandbox.bwrap:BwrapSandbox",
    "forkserver": "fleetless.sandbox.forkserver:ForkServerSandbox",
    "microvm": "fleetless.sandbox.microvm:MicroVMSandbox",
}


#: The tier name that picks one: the strongest that works on this host without extra set-up.
AUTO = "auto"


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def choose_tier(name: str, template: Template | None = None) -> tuple[str, str]:
    """The tier a drain runs with for ``name``, and one line saying which and why when ``name``
    is ``auto`` (else ""). ``auto`` is the cheapest tier that keeps bwrap's promises: the fork
    server for a root drainer, or one whose user has a subordinate uid range, where bwrap's namespaces
    work (the same namespaces, uids, seccomp filter and caps, without an interpreter start per job:
    issue 27), else bwrap where it can
    create its namespaces here, else process; never microvm, which needs its guest image built
    first. With the drain's ``template``, the chosen tier's own checks of it are started
    (:meth:`Sandbox.warm`)."""
    if name != AUTO:
        backend = get_backend(name)  # an unknown name: one line
        if template is not None:
            backend.warm(template)
        return name, ""
    try:
        if template is not None:
            get_backend("bwrap").warm(template)  # beside its probe below
        get_backend("bwrap").check()
    except SandboxUnavailable as exc:
        from .process import isolation_gap, network_words

        gap = isolation_gap()
        if gap is not None:  # issue 25, item 4: never a silent fall back to a tier that cannot hold
            raise SandboxUnavailable(
                f"auto: bwrap cannot run here ({exc}), and the process tier cannot keep this drainer's "
                f"jobs apart ({gap}); pass --sandbox process to run them so anyway (see "
                "docs/isolation.md)") from None
        return "process", (f"sandbox: process (auto: bwrap cannot run here: {exc}); jobs share the "
                           f"drainer's filesystem; {network_words()}: see docs/isolation.md")
    try:
        get_backend("forkserver").check()
    except SandboxUnavailable:
        return "bwrap", "sandbox: bwrap (auto: it can create namespaces here; --sandbox chooses another)"
    who = "a root drainer" if os.geteuid() == 0 else "a drainer with a subordinate uid range"
    return "forkserver", (f"sandbox: forkserver (auto: {who} forks each job from a pre-started server into "
                          "bwrap's namespaces; --sandbox chooses another)")


def get_backend(name: str) -> type[Sandbox]:
    """The backend class registered as ``name``; a one-line error for an unknown name."""
    try:
        target = _BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown sandbox backend {name!r} (choose from {', '.join(available_backends())})"
        ) from None
    module_name, _, attr = target.partition(":")
    cls: type[Sandbox] = getattr(importlib.import_module(module_name), attr)
    return cls


def jobs_cannot_reach(path: str) -> str | None:
    """Under a root drainer, whose jobs run as unprivileged uids: the first directory on the way to
    ``path`` (or to what it links to) that other users cannot search; None when they can, and
    for a non-root drainer whose jobs are its own uid (one without a subordinate range, _subuid)."""
    if os.geteuid() != 0:
        from . import _subuid

        if _subuid.delegation() is None:
            return None
    from ._hardening import untraversable

    for p in (os.path.dirname(os.path.abspath(path)), os.path.dirname(os.path.realpath(path))):
        blocked = untraversable(Path(p))
        if blocked is not None:
            return str(blocked)
    return None


_passed_over: dict[str, str] = {}  # fleetless's own interpreter -> the directory in the job uids' way


def passed_over(own: str) -> str | None:
    """The directory the job uids cannot search that made :func:`default_python` pass ``own`` over
    for the system's python3 (said once in a log line), else None."""
    return _passed_over.get(own)


def default_python(binds_blocked: bool = False) -> str:
    """The interpreter ``.py`` handlers run with by default on the host's tiers: the one fleetless
    itself runs under (``sys.executable``: the app's virtual environment, so a handler imports
    what the app imports), else the system's python3. Under a root drainer, an own interpreter
    the unprivileged job uids cannot reach (a virtual environment under /root) is passed over,
    said once in a log line, unless the tier makes it reachable (``binds_blocked``: bwrap and the
    fork server bind it into each job's view however deep under /root it is, or under a 0700
    directory of a non-root drainer whose jobs are subordinate uids)."""
    own = sys.executable
    blocked = jobs_cannot_reach(own) if own and not binds_blocked else None
    if own and blocked is not None and own not in _passed_over:
        _passed_over[own] = blocked
        logging.getLogger("fleetless.sandbox").warning(
            "handlers run under /usr/bin/python3, not %s (fleetless's own): the unprivileged job uids "
            "cannot reach it, %s is not searchable by others (move the environment, chmod o+x, or "
            "pass --python)", own, blocked)
    for candidate in (own if blocked is None else "", "/usr/bin/python3", shutil.which("python3", path=os.defpath)):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise SandboxUnavailable("no python3 found for handlers (set --python)")
