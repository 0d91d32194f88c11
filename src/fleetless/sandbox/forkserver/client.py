"""The drainer's side of the fork server: start one per (interpreter, handlers, network), ask it for
a fresh job init, retire it after ``FLEETLESS_FORKSERVER_JOBS`` jobs or ``FLEETLESS_FORKSERVER_SECONDS``
seconds or when the handlers change.

A server is started by exec with an empty environment and only its control socket; the drainer
passes it nothing but paths (what to bind) and, per job, a socket and the job's ``cgroup.procs``
fds. It answers with a pidfd of the job's init, to which the drainer then sends the job's spec and
pipes directly (:mod:`._server`). A retired server takes no more jobs; its socket is closed once
its last job is dead, and it exits.

:data:`pool` keeps two :class:`Init` ready per server key (forked, in fresh limit-less cgroups, its
namespaces and workspace made): a thread refills it once a job runs, so a job's sandbox is a
lease, a workspace chown and the cgroup limits.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .. import SandboxUnavailable, _subuid, _workspace, cgroups

log = logging.getLogger("fleetless.sandbox")

SERVER = str(Path(__file__).with_name("_server.py"))
#: What the server's interpreter reads on stdin: the server module, then its main on the control
#: socket (fd ``ctl``), which then brings the configuration.
BOOT = "import runpy\nrunpy.run_path({server!r}, run_name='_fleetless_forkserver')['main']({ctl})\n"
JOBS_ENV = "FLEETLESS_FORKSERVER_JOBS"
SECONDS_ENV = "FLEETLESS_FORKSERVER_SECONDS"
DEFAULT_JOBS = 1000
DEFAULT_SECONDS = 600.0
#: Standard-library modules the server imports before it forks (a job finds them in sys.modules).
#: Nothing that draws randomness at import (``random``, ``tempfile``, ``uuid``): every job would
#: share it.
PREWARM = ("json", "pathlib", "runpy", "pkgutil", "traceback", "datetime", "base64", "collections", "functools",
           "re", "io", "struct", "fcntl", "resource", "atexit", "threading", "typing", "enum")
START_TIMEOUT = 30.0
#: Prefix of the servers' (empty) root directories in the work directory; :func:`sweep` removes
#: those of drainers that are gone.
PREFIX = "srv"


def _env_number(name: str, default: float) -> float:
    text = os.environ.get(name)
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise SandboxUnavailable(f"{name}={text!r} is not a number") from None
    if value <= 0:
        raise SandboxUnavailable(f"{name}={text!r} must be above 0")
    return value


@dataclass(frozen=True)
class ServerKey:
    python: str
    handlers: str  # the snapshot's path: a new one when the handlers change
    network: bool


@dataclass(frozen=True)
class RootSpec:
    """What the server's root holds: read-only binds (host path, path inside) and symlinks."""

    binds: tuple[tuple[str, str], ...]
    symlinks: tuple[tuple[str, str], ...]
    seccomp: str | None
    #: A folder inside the root whose top-level ``.py`` scripts the server compiles once at start.
    scripts: str | None = None


def _enter() -> list[str]:
    """argv prefix that starts the server: none for a root drainer; for a non-root one, ``nsenter``
    into its holder's user and mount namespaces (:mod:`.._subuid`), where the server is ns-root with
    every capability over the drainer's subordinate uids (its jobs' leased ns-uids) and none outside."""
    if os.geteuid() == 0:
        return []
    helper = _subuid.holder()
    if helper is None:
        raise SandboxUnavailable(f"the fork server needs a root drainer or a subordinate uid range: "
                                 f"{_subuid.missing()}")
    # and pid 1 of a pid namespace of that user namespace's: one it may setns back into after
    # each job's (the host's it may not); all of it dies with the server (its parent unshare's
    # --kill-child: with unshare too)
    return [*helper.enter(), "unshare", "--pid", "--fork", "--kill-child", "--"]


def _host_pid(pidfd: int) -> int:
    """The pid, in the drainer's pid namespace, of the process ``pidfd`` refers to (the server says
    its own namespace's: another one where it runs in a pid namespace of its own)."""
    with open(f"/proc/self/fdinfo/{pidfd}", "rb") as f:
        for line in f:
            if line.startswith(b"Pid:"):
                pid = int(line.split()[1])
                if pid > 0:
                    return pid
    raise SandboxUnavailable("the fork server's job init is gone")


class Server:
    """One running fork server (its process, control socket and counters)."""

    def __init__(self, key: ServerKey, root: RootSpec, max_jobs: int, max_seconds: float) -> None:
        self.key = key
        self.max_jobs = max_jobs
        self.deadline = time.monotonic() + max_seconds
        self.jobs = 0
        self.live = 0
        self.retired = False
        self._lock = threading.Lock()
        # the server's tmpfs root (mounted in its own namespace only: an empty directory here)
        self._mountpoint = Path(tempfile.mkdtemp(prefix=f"{PREFIX}-{os.getpid()}-", dir=_workspace.root()))
        try:
            enter = _enter()
        except BaseException:
            _workspace.remove(self._mountpoint)
            raise
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        config = {
            "ctl": theirs.fileno(), "mountpoint": str(self._mountpoint), "userns": bool(enter),
            "binds": [list(b) for b in root.binds], "symlinks": [list(s) for s in root.symlinks],
            "seccomp": root.seccomp, "prewarm": list(PREWARM), "network": key.network, "scripts": root.scripts,
        }
        debug = os.environ.get("FLEETLESS_FORKSERVER_STDERR")  # a file for the server's tracebacks
        try:
            err = open(debug, "ab") if debug else None
            # "python -s -": its command line (every job's /proc/1/cmdline) says nothing of its
            # configuration; the code comes on stdin, the configuration on its socket
            self.proc = subprocess.Popen(
                [*enter, key.python, "-s", "-"], env={}, cwd="/", pass_fds=(theirs.fileno(),),
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                stderr=err or subprocess.DEVNULL, start_new_session=True)
            if err is not None:
                err.close()
            assert self.proc.stdin is not None
            with self.proc.stdin as code:
                code.write(BOOT.format(server=SERVER, ctl=theirs.fileno()).encode())
            ours.sendall(json.dumps(config).encode())
        except OSError as exc:
            ours.close()
            if getattr(self, "proc", None) is not None:
                self.proc.kill()
                self.proc.wait()
            _workspace.remove(self._mountpoint)
            raise SandboxUnavailable(f"cannot start the fork server: {exc}") from None
        finally:
            theirs.close()
        self._sock: socket.socket | None = ours
        ours.settimeout(START_TIMEOUT)
        try:
            answer = ours.recv(4096)
        except OSError as exc:
            answer = f"error {exc}".encode()
        ours.settimeout(None)
        if answer != b"ready":
            self.close()
            said = answer.decode(errors="replace").removeprefix("error ") or "it exited"
            raise SandboxUnavailable(f"the fork server did not start: {said}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def fork(self, job_sock: socket.socket, cgroup_procs: list[str]) -> tuple[int, int]:
        """A fresh job init, in the cgroups of ``cgroup_procs`` before anything runs: its pid and
        a pidfd of it."""
        fds = [job_sock.fileno()]
        try:
            for path in cgroup_procs:
                fds.append(os.open(path, os.O_WRONLY | os.O_CLOEXEC))
            with self._lock:
                if self._sock is None or self.retired or self.expired():  # another thread took its last fork
                    raise SandboxUnavailable("the fork server was retired")
                self.jobs += 1
                self.live += 1
                try:
                    socket.send_fds(self._sock, [b"fork"], fds)
                    msg, got, _, _ = socket.recv_fds(self._sock, 4096, 1)
                except OSError as exc:
                    self.live -= 1
                    raise SandboxUnavailable(f"the fork server is gone: {exc}") from None
                word, _, pid = msg.partition(b" ")
                if word != b"ok" or len(got) != 1 or not pid.isdigit():
                    for fd in got:
                        os.close(fd)
                    self.live -= 1
                    said = msg.decode(errors="replace").removeprefix("error ") or "it exited"
                    raise SandboxUnavailable(f"the fork server cannot fork: {said}")
                if self.jobs >= self.max_jobs or time.monotonic() >= self.deadline:
                    self.retired = True
                return _host_pid(got[0]), got[0]
        finally:
            for fd in fds[1:]:
                os.close(fd)

    def done(self) -> None:
        """One of its jobs is dead; a retired server with none left is closed."""
        with self._lock:
            self.live -= 1
            last = self.retired and self.live <= 0
        if last:
            self.close()

    def retire(self) -> None:
        with self._lock:
            self.retired = True
            last = self.live <= 0
        if last:
            self.close()

    def usable(self) -> bool:
        return not self.retired and self.proc.poll() is None and not self.expired()

    def expired(self) -> bool:
        """Past its lifetime: it forks no more, and inits it forked before are not used."""
        return time.monotonic() >= self.deadline

    def close(self) -> None:
        """Close its socket (it kills what is left of its jobs and exits) and wait for it."""
        with self._lock:
            self.retired = True
            sock, self._sock = getattr(self, "_sock", None), None
        if sock is not None:
            sock.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        _workspace.remove(self._mountpoint)


_servers_lock = threading.Lock()
_servers: dict[ServerKey, Server] = {}
_all: list[Server] = []
_HISTORY = 100


def server_for(key: ServerKey, root: Callable[[], RootSpec]) -> Server:
    """The current server for ``key``: started on first use and after its predecessor retired.
    A server for other handlers of the same interpreter and network (they changed) is retired."""
    max_jobs = int(_env_number(JOBS_ENV, DEFAULT_JOBS))
    max_seconds = _env_number(SECONDS_ENV, DEFAULT_SECONDS)
    with _servers_lock:
        current = _servers.get(key)
        if current is not None and current.usable():
            return current
        for other_key, other in list(_servers.items()):
            if other is current or (other_key.python == key.python and other_key.network == key.network):
                del _servers[other_key]
                other.retire()
        server = Server(key, root(), max_jobs, max_seconds)
        _servers[key] = server
        _all.append(server)
        del _all[:-_HISTORY]
        return server


class Init:
    """A job's init, forked and waiting for its job's spec on ``sock``, already in its cgroups
    (limit-less until taken) and its namespaces."""

    def __init__(self, key: ServerKey, root: Callable[[], RootSpec]) -> None:
        self.key = key
        caps = cgroups.available()
        self.cgroup = cgroups.JobCgroup(caps=caps) if caps.any or caps.kill else None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock = ours
        procs = [] if self.cgroup is None else self.cgroup.procs_files()
        try:
            for attempt in range(2):  # a server retired meanwhile, or gone: once more with the next
                self.server = server_for(key, root)
                try:
                    self.pid, self.pidfd = self.server.fork(theirs, procs)
                    break
                except SandboxUnavailable:
                    self.server.retire()
                    if attempt:
                        raise
        except BaseException:
            ours.close()
            if self.cgroup is not None:
                self.cgroup.remove()
            raise
        finally:
            theirs.close()
        try:
            ours.settimeout(START_TIMEOUT)
            said = ours.recv(4096)  # its namespaces and workspace are made
            ours.settimeout(None)
        except OSError as exc:
            said = f"error {exc}".encode()
        if said != b"ready":
            self.discard()
            reason = said.decode(errors="replace").removeprefix("error ") or "it exited"
            raise SandboxUnavailable(f"the fork server's job init failed: {reason}")

    def alive(self) -> bool:
        return not select.select([self.pidfd], [], [], 0)[0]

    def discard(self) -> None:
        """Let it exit unused (EOF on its socket), then drop its cgroups."""
        self.sock.close()
        if not select.select([self.pidfd], [], [], 2)[0]:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            select.select([self.pidfd], [], [], 2)
        os.close(self.pidfd)
        self.server.done()
        if self.cgroup is not None:
            self.cgroup.remove()


class Pool:
    """Keeps ``size`` inits ready per key in use, made by a daemon thread while jobs run, so a job
    does not wait for the fork, the cgroup moves and the namespaces of its init."""

    def __init__(self, size: int = 2) -> None:
        self.size = size
        self._cond = threading.Condition()
        self._ready: dict[ServerKey, list[Init]] = {}
        self._roots: dict[ServerKey, Callable[[], RootSpec]] = {}
        self._thread: threading.Thread | None = None
        self._closed = False
        self._generation = 0  # one per close: a filling thread of an earlier one stops

    def take(self, key: ServerKey, root: Callable[[], RootSpec]) -> Init:
        stale: list[Init] = []
        with self._cond:
            for other in list(self._roots):  # the handlers changed: their inits are of no use
                if other != key and other.python == key.python and other.network == key.network:
                    del self._roots[other]
                    stale += self._ready.pop(other, [])
            self._roots[key] = root
            ready = self._ready.get(key, [])
            init = ready.pop(0) if ready else None
        for old in stale:
            old.discard()
        while init is not None and (not init.alive() or init.server.expired()):
            init.discard()
            with self._cond:
                ready = self._ready.get(key, [])
                init = ready.pop(0) if ready else None
        return init if init is not None else Init(key, root)

    def refill(self) -> None:
        """Make inits for the ones taken, now (called once a job runs: the drainer's thread then
        waits for it, and the filling does not compete with its sandbox's set-up)."""
        with self._cond:
            if self._thread is None and not self._closed and self.size > 0:
                self._thread = threading.Thread(target=self._fill, args=(self._generation,),
                                                name="fleetless-forkserver-pool", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _want(self) -> tuple[ServerKey, Callable[[], RootSpec]] | None:
        for key, root in self._roots.items():
            if len(self._ready.get(key, [])) < self.size:
                return key, root
        return None

    def _gone(self, generation: int) -> bool:
        return self._generation != generation  # every close bumps it

    def _fill(self, generation: int) -> None:
        while True:
            with self._cond:
                while not self._gone(generation) and (want := self._want()) is None:
                    self._cond.wait()  # until a job runs and :meth:`refill` says so
                if self._gone(generation) or want is None:
                    return
            key, root = want
            try:
                init = Init(key, root)
            except (OSError, SandboxUnavailable) as exc:
                with self._cond:
                    if self._gone(generation):  # closed meanwhile (the drain ended): its server went too
                        return
                log.warning("fork server pool: %s", exc)
                with self._cond:
                    self._cond.wait(timeout=5)
                continue
            with self._cond:
                if self._gone(generation) or key not in self._roots:
                    init_to_drop: Init | None = init
                else:
                    self._ready.setdefault(key, []).append(init)
                    init_to_drop = None
            if init_to_drop is not None:
                init_to_drop.discard()

    def ready_groups(self) -> set[str]:
        """The cgroups of the inits waiting for a job (limit-less, no job in them yet)."""
        with self._cond:
            return {i.cgroup.name for inits in self._ready.values() for i in inits if i.cgroup is not None}

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._generation += 1
            ready = [i for inits in self._ready.values() for i in inits]
            self._ready.clear()
            self._roots.clear()
            self._cond.notify_all()
        for init in ready:
            init.discard()

    def reopen(self) -> None:
        """After :meth:`close` (tests): take and fill again."""
        with self._cond:
            self._closed = False
            self._thread = None


pool = Pool(size=2)


def started() -> list[Server]:
    """The servers this drainer process started (the last hundred), running or not."""
    with _servers_lock:
        return list(_all)


def running() -> list[Server]:
    """The servers of this drainer process that still run."""
    return [s for s in started() if s.proc.poll() is None]


def sweep() -> int:
    """Remove the server directories of drainers that no longer run; returns how many."""
    removed = 0
    for entry in _workspace.root().iterdir():
        parts = entry.name.split("-")
        if len(parts) >= 3 and parts[0] == PREFIX and parts[1].isdigit() and not _workspace.pid_alive(int(parts[1])):
            removed += _workspace.remove(entry)
    return removed


@atexit.register
def close_all() -> None:
    """Drop the ready inits and stop every server (at exit; tests call it between cases)."""
    pool.close()
    pool.reopen()
    with _servers_lock:
        servers, _all[:] = [s for s in _all if s.proc.poll() is None], []
        _servers.clear()
    for server in servers:
        server.close()
