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

Needs a root drainer (the job uids: :mod:`.._hostuid`'s range), or a non-root drainer whose user has
a subordinate uid range (:mod:`.._subuid`): its server then starts as ns-root of the drainer's
holder's user namespace (every capability over the subordinate uids, none outside), where it makes
the same namespaces and mounts, and each job drops to a leased ns-uid of the range. What a root
drainer's cgroups do is done there as bwrap's non-root path does it: ``RLIMIT_NPROC`` of the job's
own (leased, unshared) uid caps its processes, ``RLIMIT_AS`` each process's memory and the
drainer's watch (:mod:`.._tree`) the tree's; init chowns the workspace and the job's pipes to the
job (the drainer cannot). Another drainer gets ``SandboxUnavailable`` saying what to add.
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
    _subuid,
    _tree,
    cgroups,
)
from .._caps import JOB_NICE
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
    # never None here: check() refuses the tier where the filter cannot be built
    return client.RootSpec(tuple(binds), tuple(links), str(seccomp_file()), scripts=HANDLERS)


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
        self._ids = (0, 0)  # the job's uid and gid as its server sees them (host ids, or ns-ids)
        self._own = not _hostuid.needed()  # a non-root drainer's: init gives the job its workspace
        self._holder: _subuid.Holder | None = None
        self._watched: _tree.Watched | None = None
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
            self._lease = self._job_lease()
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
            if not self._own:
                os.fchown(self._workspace, self._lease.uid, self._lease.gid)  # the job's own
        except BaseException:
            self.kill()
            raise

    def _job_lease(self) -> _hostuid.Lease:
        """A uid of the job's own: a root drainer's from its range; else one of the drainer user's
        subordinate range, as its ns-uid in the holder's namespace, where the server runs."""
        if not self._own:
            lease = _hostuid.lease()
            self._ids = (lease.uid, lease.gid)
            return lease
        d = _subuid.delegation()
        if d is None:
            raise SandboxUnavailable(unavailable_why())
        self._holder = _subuid.holder()
        lease = _subuid.lease(d)
        self._ids = (_subuid.ns_id(d, lease), _subuid.ns_id(d, lease))
        return lease

    @classmethod
    def check(cls) -> None:
        why = unavailable_why()
        if why:
            raise SandboxUnavailable(why)
        if not hasattr(os, "pidfd_open"):
            raise SandboxUnavailable("the fork server needs pidfd_open (Linux 5.3+, Python 3.9+)")
        from ..bwrap._seccomp import seccomp_file

        try:  # its jobs get bwrap's filter or the tier does not run (it ran them unfiltered, silently)
            seccomp_file()
        except SandboxUnavailable as exc:
            raise SandboxUnavailable(f"the fork server loads bwrap's seccomp filter into every job: {exc}") from None

    @classmethod
    def warm(cls, template: Template) -> None:
        from .. import bwrap

        bwrap.BwrapSandbox.warm(template)  # its interpreter's paths: the server's root binds them

    @classmethod
    def check_template(cls, template: Template) -> None:
        cls.check()
        if _hostuid.needed():
            _hostuid.configured_range()

    @classmethod
    def sweep(cls) -> int:
        """Per-job cgroups, workspaces and server roots of drainers that died."""
        from .. import bwrap

        return bwrap.sweep() + client.sweep()

    @classmethod
    def describe(cls) -> str:
        caps = cgroups.available().describe()
        if _hostuid.needed():
            uids = "jobs run as leased host uids, one each"
        else:
            uids = (f"jobs run as host uids {_subuid.delegation()} (the drainer user's subordinate range), one "
                    "each; the server is ns-root of the drainer's user namespace")
            caps = ["RLIMIT_NPROC of the job's own uid", "the drainer's watch on the tree's memory"]
        return ("enforces: " + "; ".join([*caps, "rlimits"]) + "; fresh pid/mount/net/IPC/UTS namespaces; "
                f"seccomp deny-list; .py handlers forked from a pre-warmed server; {uids}")

    @classmethod
    def caps(cls, limits: Limits | None = None) -> dict[str, str]:
        """As bwrap's (the same cgroups), but the workspace: a tmpfs of the job's memory size."""
        from .._caps import NOT, Cap
        from ..bwrap import tier_caps

        limits = limits or Limits()
        out = tier_caps(limits, nice=_niced())
        if limits.pids is not None and not cgroups.available().pids and not _hostuid.needed():
            out["pids"] = Cap(f"capped by RLIMIT_NPROC of the job's own subordinate uid (leased to it alone) at "
                              f"{limits.pids}",
                              f"capped by RLIMIT_NPROC of the job's own subordinate uid at {limits.pids}")
        caps = ([] if limits.memory_bytes is None else [f"{limits.memory_bytes // (1024 * 1024)} MiB"]) + (
            [] if limits.inodes is None else [f"{limits.inodes} files"])
        if caps:
            out["disk"] = Cap(f"capped by tmpfs: the workspace, /tmp and /dev/shm live in the job's memory "
                              f"(workspace {' and '.join(caps)})",
                              f"capped by tmpfs in the job's memory (workspace {' and '.join(caps)})")
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
                    if not self._own:  # (else init gives it to the job before it runs)
                        os.chown(part, uid, gid, dir_fd=folder, follow_symlinks=False)
                except FileExistsError:
                    pass
                inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder)
                os.close(folder)
                folder = inner
            fd = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                         dir_fd=folder)
            try:
                if not self._own:
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
        pids = self._template.limits.pids
        if self._own and pids is not None and (self._cgroup is None or self._cgroup.pids_max is None):
            # the job's uid is leased to it alone and init is ns-root: the count is the job's own
            rl["RLIMIT_NPROC"] = pids
        if _niced():
            rl["RLIMIT_NICE"] = 0  # with its nice (``_exec``): it cannot lower it again
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
            "uid": self._ids[0], "gid": self._ids[1], "own": self._own, "rlimits": rlimits,
            "deadline": max(budget, 0) + OWN_DEADLINE_SLACK, "network": limits.network,
            "nice": JOB_NICE if _niced() else None,
            "tmp_bytes": limits.tmp_bytes, "workspace_bytes": limits.memory_bytes,
            "workspace_inodes": limits.inodes,
        }
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        status_r, status_w = os.pipe()
        try:
            for fd in (out_w, err_w) if not self._own else ():  # the job's own, as a shell's pipe
                os.fchown(fd, lease.uid, lease.gid)  # would be: /dev/stderr opens (else init does it)
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
        watched = None  # no memory cgroup: the tree's sum is watched (RLIMIT_AS caps each process only)
        if limits.memory_bytes is not None and (self._cgroup is None or self._cgroup.memory_bytes is None):
            holder = self._holder
            watched = _tree.watch(init.pid, limits.memory_bytes, lambda: self._terminate(init),
                                  _tree.memfd_bytes if holder is None else holder.memfd_bytes)
        self._watched = watched
        try:
            with open(out_r, "rb", buffering=0) as out, open(err_r, "rb", buffering=0) as err:
                hit = _capture.pump(out, err, captured, deadline, lambda: self._terminate(init),
                                    exited=(pidfd, lambda: None))
            if not select.select([pidfd], [], [], max(deadline - time.monotonic(), 0))[0]:
                hit = True
                self._terminate(init)
        finally:
            if watched is not None:
                watched.cancel()
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
        if watched is not None and watched.hit and limits.memory_bytes is not None:
            killed = f"killed: memory limit {memory_size(limits.memory_bytes)} exceeded"
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

    def _destroy(self) -> None:
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


def _niced() -> bool:
    """Whether jobs run at :data:`.._caps.JOB_NICE` as bwrap's do where no cpu cgroup holds them
    (a non-root drainer's): a busy job then yields the CPU to the drainer and PostgreSQL."""
    return not _hostuid.needed() and not cgroups.available().cpu


_probed: dict[int, str] = {}  # drainer pid -> why the holder cannot make a job's namespaces ("" if it can)


def unavailable_why() -> str:
    """Why this drainer cannot run the fork server ("" where it can): one line."""
    if not hasattr(os, "pidfd_open"):
        return "the fork server needs pidfd_open (Linux 5.3+, Python 3.9+)"
    if _hostuid.needed():
        return ""
    if _subuid.delegation() is None:
        return (f"the fork server needs a root drainer or a subordinate uid range for the drainer's user (its "
                f"server is ns-root over those uids, each job one of them); here: {_subuid.missing()}")
    if os.getpid() not in _probed:
        _probed[os.getpid()] = _probe_userns()
    return _probed[os.getpid()]


def _probe_userns() -> str:
    """Whether the drainer's holder can make what each job's init makes: a pid namespace with its
    own ``/proc``, network, IPC and UTS namespaces (once per drainer process, ~10 ms)."""
    import subprocess

    try:
        holder = _subuid.holder()
        assert holder is not None
        r = subprocess.run([*holder.enter(), "unshare", "--pid", "--fork", "--mount-proc", "--net", "--ipc", "--uts",
                            "--", "true"], capture_output=True, timeout=30, env={}, cwd="/", stdin=subprocess.DEVNULL)
    except (OSError, SandboxUnavailable, subprocess.SubprocessError) as exc:
        return f"the fork server cannot start in the drainer's user namespace: {exc}"
    if r.returncode != 0:
        err = r.stderr.decode(errors="replace").strip() or f"exit status {r.returncode}"
        return f"the fork server cannot make a job's namespaces in the drainer's user namespace: {err}"
    return ""


def _release(init: client.Init) -> None:
    """Close what the drainer holds of a dead init, and count it out of its server."""
    init.sock.close()
    os.close(init.pidfd)
    init.server.done()



