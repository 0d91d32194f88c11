"""The ``forkserver`` tier: each job in fresh namespaces, forked from a pre-warmed Python.

A per-drainer fork server (:mod:`._server`, started by :mod:`.client`) has imported the standard
library and lives in a minimal root of its own (read-only ``/usr``, ``/etc`` and handlers). Per job
it forks an *init* that is pid 1 of a fresh pid namespace; init joins the job's cgroups, unshares
fresh mount, IPC, UTS and network namespaces and mounts its own ``/proc`` and workspace (a tmpfs the
drainer writes the payload into through ``/proc/<init>/root``; inits are made ahead by
:data:`.client.pool`), then, given the job, its ``/tmp`` and ``/dev/shm``, and forks the job, which
drops to the leased uid (no capability left), sets rlimits, ``no_new_privs`` and bwrap's seccomp
filter, and runs the ``.py`` handler with ``runpy`` as ``__main__`` (no new interpreter to start:
that is the saving) or execs anything else. Killing init (its pidfd) kills the whole pid namespace,
``setsid()`` daemons included.

Handler behaviour is ``python3 -s handler.py payload.json``'s, with these differences (see
``docs/isolation.md``): modules the server pre-imported (:data:`.client.PREWARM`) are already in
``sys.modules``; every job of one server shares its address-space layout and its ``str`` hash seed;
``/proc/self/environ`` shows the server's (empty) start-up environment while ``os.environ`` is the
job's; stdout and stderr are UTF-8 whatever the job's locale variables say.

Needs a root drainer (namespaces and the job uids); a non-root drainer gets ``SandboxUnavailable``.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
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
    _hostuid,
    cgroups,
)
from .._wording import memory_size
from . import client

__all__ = ["ForkServerSandbox"]

WORKSPACE = "/workspace"
HANDLERS = "/handlers"
_SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


def _root_spec(python: str, handlers: Path, network: bool) -> client.RootSpec:
    # the same /etc copy, interpreter paths and seccomp filter as bwrap
    from ..bwrap._filesystem import etc_dir, interpreter_paths
    from ..bwrap._seccomp import seccomp_file

    binds: list[tuple[str, str]] = []
    links: list[tuple[str, str]] = []
    for path in _SYSTEM_PATHS:
        if os.path.islink(path):
            links.append((os.readlink(path), path))
        elif os.path.isdir(path):
            binds.append((path, path))
    binds.append((str(etc_dir(network)), "/etc"))
    binds += [(p, p) for p in interpreter_paths(python)]
    binds.append((str(handlers), HANDLERS))
    try:
        seccomp: str | None = str(seccomp_file())
    except SandboxUnavailable:
        seccomp = None
    return client.RootSpec(tuple(binds), tuple(links), seccomp, scripts=HANDLERS)


class ForkServerSandbox(Sandbox):
    name: ClassVar[str] = "forkserver"
    workspace_path = WORKSPACE
    handlers_path = HANDLERS

    _pythons: ClassVar[dict[str | None, str]] = {}

    @classmethod
    def handler_python(cls, template: Template) -> str:
        """bwrap's: the template's interpreter, else fleetless's own, also under a root-only
        directory (the server binds its paths into its root, the way there searchable), else the
        system's (looked up once per drainer process)."""
        from .. import bwrap

        python = cls._pythons.get(template.python)
        if python is None:
            python = cls._pythons[template.python] = bwrap.BwrapSandbox.handler_python(template)
        return python

    def __init__(self, template: Template, ttl_seconds: float) -> None:
        from .._handlers import handlers_snapshot

        self._template = template
        self._ttl = ttl_seconds
        self._born = time.monotonic()
        self._lease: _hostuid.Lease | None = None
        self._cgroup: cgroups.JobCgroup | None = None
        self._init: client.Init | None = None
        self._started = False
        self._lock = threading.Lock()  # kill() may come from another thread during exec()
        self._running = False  # exec() uses the init: kill() kills it, exec() lets it go after
        self._workspace: int | None = None  # the init's /workspace (a tmpfs of its mount namespace)
        self.python = self.handler_python(template)
        try:
            handlers = handlers_snapshot(template.handlers_dir)
            self._key = client.ServerKey(self.python, str(handlers), template.limits.network)
            self._lease = _hostuid.lease()
            key = self._key

            def root() -> client.RootSpec:
                return _root_spec(key.python, Path(key.handlers), key.network)

            self._init = client.pool.take(key, root)
            self._cgroup = self._init.cgroup
            if self._cgroup is not None:  # init counts against pids.max too: the job gets ``pids``
                limits = template.limits
                pids = None if limits.pids is None else limits.pids + 1
                self._cgroup.set_limits(limits.memory_bytes, pids, limits.cpus)
            # Opened through the init's root, then checked that the init still runs: the pid was
            # not reused, this is its workspace. Nothing of the job has run yet.
            self._workspace = os.open(f"/proc/{self._init.pid}/root/workspace",
                                      os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            if not self._init.alive():
                raise SandboxUnavailable("the fork server's job init died before its job")
            os.fchown(self._workspace, self._lease.uid, self._lease.gid)  # the job's own
        except BaseException:
            self.kill()
            raise

    @classmethod
    def check(cls) -> None:
        if not _hostuid.needed():
            raise SandboxUnavailable("the fork server needs a root drainer (it makes namespaces and runs "
                                     "each job as a leased uid); use bwrap or process")
        if not hasattr(os, "pidfd_open"):
            raise SandboxUnavailable("the fork server needs pidfd_open (Linux 5.3+, Python 3.9+)")

    @classmethod
    def warm(cls, template: Template) -> None:
        from .. import bwrap

        bwrap.BwrapSandbox.warm(template)  # its interpreter's paths: the server's root binds them

    @classmethod
    def check_template(cls, template: Template) -> None:
        cls.check()
        _hostuid.configured_range()

    @classmethod
    def sweep(cls) -> int:
        """Per-job cgroups, workspaces and server roots of drainers that died."""
        from .. import bwrap

        return bwrap.sweep() + client.sweep()

    @classmethod
    def describe(cls) -> str:
        caps = cgroups.available().describe()
        return ("enforces: " + "; ".join([*caps, "rlimits"]) + "; fresh pid/mount/net/IPC/UTS namespaces; "
                "seccomp deny-list; .py handlers forked from a pre-warmed server")

    @classmethod
    def caps(cls, limits: Limits | None = None) -> dict[str, str]:
        """As bwrap's (the same cgroups), but the workspace: a tmpfs of the job's memory size."""
        from .._caps import NOT
        from ..bwrap import tier_caps

        limits = limits or Limits()
        out = tier_caps(limits, nice=False)
        caps = ([] if limits.memory_bytes is None else [f"{limits.memory_bytes // (1024 * 1024)} MiB"]) + (
            [] if limits.inodes is None else [f"{limits.inodes} files"])
        if caps:
            out["disk"] = (f"capped by tmpfs: the workspace, /tmp and /dev/shm live in the job's memory "
                           f"(workspace {' and '.join(caps)})")
        else:
            out["disk"] = f"{NOT}: the workspace is a tmpfs of no size (--memory and Limits.inodes not set)"
        return out

    missing_program_hint: ClassVar[str] = (
        "a job sees the host's /usr, /bin, /sbin and /lib only, plus the handler interpreter's prefix")

    @classmethod
    def has_program(cls, template: Template, path: str) -> bool:
        from .. import bwrap

        return bwrap.BwrapSandbox.has_program(template, path)

    @classmethod
    def create(cls, template: Template, ttl_seconds: float = 900) -> ForkServerSandbox:
        cls.check()
        if not template.handlers_dir.is_dir():
            raise SandboxUnavailable(f"handlers directory {template.handlers_dir} does not exist")
        try:
            return cls(template, ttl_seconds)
        except OSError as exc:
            raise SandboxUnavailable(f"cannot prepare a fork-server sandbox: {exc}") from None

    @property
    def cgroup(self) -> cgroups.JobCgroup | None:
        return self._cgroup

    def write(self, path: str, data: bytes | str) -> None:
        """Write a file into the job's workspace (before its job runs), owned by the job's uid;
        ``path`` is relative to it, and every step is opened below it without following links."""
        if self._workspace is None or self._lease is None or self._started:
            raise RuntimeError("sandbox already destroyed" if not self._started else "the job already ran")
        parts = path.split("/")
        if path.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"path {path!r} is outside the workspace")
        uid, gid = self._lease.uid, self._lease.gid
        folder = os.dup(self._workspace)
        try:
            for part in parts[:-1]:
                try:
                    os.mkdir(part, 0o755, dir_fd=folder)
                    os.chown(part, uid, gid, dir_fd=folder, follow_symlinks=False)
                except FileExistsError:
                    pass
                inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder)
                os.close(folder)
                folder = inner
            fd = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                         dir_fd=folder)
            try:
                os.fchown(fd, uid, gid)
                view = memoryview(data.encode() if isinstance(data, str) else data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
        finally:
            os.close(folder)

    def _rlimits(self, timeout_seconds: float) -> dict[str, list[int]]:
        from .._limits import rlimits_for

        rl = rlimits_for(self._template, timeout_seconds)
        if self._cgroup is not None and self._cgroup.memory_bytes is not None:
            rl.pop("RLIMIT_AS", None)  # the cgroup caps real memory; AS breaks some runtimes
        return {name: [v, v + 1 if name == "RLIMIT_CPU" else v] for name, v in rl.items()}


    @property
    def host_pid(self) -> int | None:
        init = self._init
        return None if init is None else init.pid

    def exec(self, argv: Sequence[str], timeout_seconds: float) -> ExecResult:
        started = time.monotonic()
        ttl_left = self._ttl - (started - self._born)
        budget = min(timeout_seconds, ttl_left)
        reason = (f"killed: timeout after {timeout_seconds:g} s" if timeout_seconds <= ttl_left
                  else f"killed: ttl of {self._ttl:g} s expired")
        with self._lock:
            init, lease = self._init, self._lease
            if self._workspace is None or lease is None or init is None:
                return ExecResult(-signal.SIGKILL, "", "", 0.0, "killed: sandbox destroyed")
            if budget <= 0:
                return ExecResult(-signal.SIGKILL, "", "", 0.0, reason)
            if self._started:
                raise SandboxUnavailable("the forkserver tier runs one exec per sandbox")
            self._started = self._running = True
        try:
            return self._exec(init, lease, argv, timeout_seconds, started, budget, reason)
        finally:
            with self._lock:
                self._running = False
                killed_meanwhile = self._init is None
            if killed_meanwhile:  # kill() killed it and left the rest to us
                _release(init)

    def _exec(self, init: client.Init, lease: _hostuid.Lease, argv: Sequence[str], timeout_seconds: float,
              started: float, budget: float, reason: str) -> ExecResult:
        from .._limits import rlimit_kill_reason

        limits = self._template.limits
        rlimits = self._rlimits(timeout_seconds)
        runpy = len(argv) >= 2 and argv[0] == self.python and argv[1].endswith(".py")
        spec = {
            "argv": list(argv), "runpy": runpy, "env": {"HOME": WORKSPACE, **self._template.env},
            "uid": lease.uid, "gid": lease.gid, "rlimits": rlimits,
            "deadline": max(budget, 0) + OWN_DEADLINE_SLACK, "network": limits.network,
            "tmp_bytes": limits.tmp_bytes, "workspace_bytes": limits.memory_bytes,
            "workspace_inodes": limits.inodes,
        }
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        status_r, status_w = os.pipe()
        try:
            for fd in (out_w, err_w):  # the job's own, as a shell's pipe would be: /dev/stderr opens
                os.fchown(fd, lease.uid, lease.gid)
            if self._cgroup is not None:
                self._cgroup.mark()
            socket.send_fds(init.sock, [json.dumps(spec).encode()], [out_w, err_w, status_w])
            client.pool.refill()
        except BaseException:
            for fd in (out_r, err_r, status_r):
                os.close(fd)
            self.kill()
            raise
        finally:
            for fd in (out_w, err_w, status_w):
                os.close(fd)
        captured = _capture.Captured(limits.stdout_bytes, limits.stderr_bytes, self.stdout_seen)
        deadline = started + max(budget, 0)
        pidfd = init.pidfd
        with open(out_r, "rb", buffering=0) as out, open(err_r, "rb", buffering=0) as err:
            hit = _capture.pump(out, err, captured, deadline, lambda: self._terminate(init),
                                exited=(pidfd, lambda: None))
        if not select.select([pidfd], [], [], max(deadline - time.monotonic(), 0))[0]:
            hit = True
            self._terminate(init)
        os.set_blocking(status_r, False)
        try:
            raw = os.read(status_r, 4096)
        except BlockingIOError:
            raw = b""
        finally:
            os.close(status_r)
        if raw.startswith(b"error "):
            self.kill()
            raise SandboxUnavailable(f"the fork server's job init failed: {raw[6:].decode(errors='replace').strip()}")
        status = _capture.parse_status(raw)
        killed: str | None = reason if hit else None
        if status is not None:
            exit_code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        else:
            exit_code = -signal.SIGKILL
            killed = killed or "killed: sandbox destroyed"
        cg = self._cgroup
        if cg is not None and exit_code != 0:
            if cg.memory_bytes is not None and cg.oom_killed():
                killed = f"killed: memory limit {memory_size(cg.memory_bytes)} exceeded"
            elif cg.pids_max is not None and cg.pids_limit_hit():
                killed = f"killed: pids limit {limits.pids} reached" + (
                    f" ({reason.removeprefix('killed: ')})" if hit else "")
        if killed is None:
            killed = rlimit_kill_reason(exit_code, {k: v[0] for k, v in rlimits.items()})
        return ExecResult(exit_code, captured.stdout, captured.stderr, time.monotonic() - started, killed,
                          stdout_cut=captured.stdout_cut)

    def _terminate(self, init: client.Init) -> None:
        """Kill the job's init: its pid namespace, the whole job, dies with it."""
        with contextlib.suppress(ProcessLookupError, OSError):
            signal.pidfd_send_signal(init.pidfd, signal.SIGKILL)
        cgroup = self._cgroup
        if cgroup is not None:
            cgroup.kill()

    def kill(self) -> None:
        dead = True
        try:
            with self._lock:
                init, self._init = self._init, None
                running = self._running
                # a running exec() releases the init (closes its pidfd) as soon as it sees it
                # killed, maybe while this waits for it to die: wait on a pidfd of this call's own
                watch = os.dup(init.pidfd) if init is not None else -1
            if init is not None:
                try:
                    with contextlib.suppress(ProcessLookupError, OSError):
                        signal.pidfd_send_signal(watch, signal.SIGKILL)
                    dead = bool(select.select([watch], [], [], 5)[0])
                finally:
                    os.close(watch)
                if not running:  # else exec() still reads its pidfd: it lets the init go itself
                    _release(init)
            if self._workspace is not None:  # the last reference to the workspace's tmpfs
                os.close(self._workspace)
                self._workspace = None
            if self._cgroup is not None:
                self._cgroup.remove()
                self._cgroup = None
        finally:
            if self._lease is not None:  # last: nothing of the job runs as it any more
                self._lease.release(clean=dead)
                self._lease = None


def _release(init: client.Init) -> None:
    """Close what the drainer holds of a dead init, and count it out of its server."""
    init.sock.close()
    os.close(init.pidfd)
    init.server.done()



