"""The ``process`` tier: a supervised process tree with a scrubbed environment and rlimits.

What it isolates: the environment (only what the template passes), the working directory (a fresh
private workspace, removed afterwards), resources by rlimit (address space, CPU seconds, file size,
open files), pids and memory by a per-job pids and memory cgroup where the drainer can write one
(memory otherwise by RLIMIT_AS and the drainer's watch, :mod:`.._tree`), and the process tree (a
supervisor in a session of its own, so signals meant for the drainer's process group never reach
it; it is a subreaper that kills every descendant at exit, timeout, TTL and when the drainer dies,
even by SIGKILL; the cgroup kills what outlives the supervisor). Where the kernel allows, the job
runs in a pid namespace of its own whose init dies with the supervisor (so nothing of the job
outlives it, cgroup or not), with a fresh /proc, private tmpfs /tmp, /var/tmp, /dev/shm and
/run/lock, an IPC namespace, no_new_privs and a session keyring of its own (see
``_supervisor.py``), and a mount table that names no other job's workspace (but those the kernel
locked into it: docs/isolation.md); every job (contained or
not) runs under the seccomp filter of bwrap and the fork server (:mod:`..bwrap._seccomp`: no new
namespaces, no keyrings, ``bpf``, ``io_uring``...; where it cannot be built, :func:`unfiltered`
says why, in ``doctor`` and the drain's caps line); its TMPDIR is in its workspace; the drainer and
supervisor are non-dumpable. Under a root drainer the job runs as a leased unprivileged uid
(:mod:`.._hostuid`; a non-root drainer with a subordinate range: one of it, :mod:`.._subuid`), so
it cannot reach its supervisor, the drainer or other jobs, and when it ends every process and key
of that uid is swept before the lease is released. Where it gives the job those namespaces it also
gives it a network namespace with only loopback (unless ``limits.network``): its 127.0.0.1 is its
own, not the host's database; where the kernel refuses them, the job has the host's network
(:func:`network_words`, said by ``doctor`` and ``auto``). What it does not: the rest of the
filesystem is the job uid's (the drainer's own uid under a non-root drainer without a range:
:func:`isolation_gap`, and ``auto`` does not fall back to this tier then). Use ``bwrap`` or
``microvm`` for untrusted code.
"""

from __future__ import annotations

import dataclasses
import logging
import os
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
from .._caps import JOB_NICE, nproc_counts_per_namespace, tier_caps
from .._handlers import handlers_snapshot
from .._hardening import harden_drainer, untraversable
from .._limits import rlimit_kill_reason, rlimits_for
from .._wording import describe_signal, memory_size

__all__ = ["CONTAIN_ENV", "ProcessSandbox", "isolation_gap", "jobs_own_network", "network_words", "unfiltered"]

log = logging.getLogger(__name__)
_SUPERVISOR = str(Path(__file__).with_name("_supervisor.py"))
MiB = 1024 * 1024


def tree_cgroup_caps() -> cgroups.CgroupCaps | None:
    """What a process-tier job's cgroup is made with: a pids group (capped at ``Limits.pids``), a
    memory group where one is writable too (capped at ``Limits.memory_bytes``: it is charged what
    no process maps, memfds and tmpfs files, issue 25) and the tree kill that goes with them, where
    this drainer can write one (root can; a non-root drainer only where a cgroup is delegated to
    it). None where it cannot."""
    caps = cgroups.available()
    if not caps.pids:
        return None
    return dataclasses.replace(caps, cpu=False)


class ProcessSandbox(Sandbox):
    name: ClassVar[str] = "process"
    runs_host_programs: ClassVar[bool] = True

    def __init__(self, template: Template, ttl_seconds: float) -> None:
        self._template = template
        self._ttl = ttl_seconds
        self._born = time.monotonic()
        self._proc: subprocess.Popen[bytes] | None = None
        self._cgroup: cgroups.JobCgroup | None = None
        self._stopped = False  # the drainer (not the job) stopped the supervisor
        self._unswept = False  # a supervisor did not report its job uid swept (exit status 0)
        # kill() may come from another thread (the drainer's stop) while exec starts the
        # supervisor: then the job must not go on, or it would outlive its sandbox unseen.
        self._lock = threading.Lock()
        self._lease: _hostuid.Lease | None = None
        self._creds = "-"  # the supervisor's UID:GID argument: what the job runs as
        self._holder: _subuid.Holder | None = None  # a non-root drainer's, with a subordinate range
        self.handlers_path = str(handlers_snapshot(template.handlers_dir))  # may fail: nothing made yet
        self._killed = False
        self._workspace = _workspace.create()
        self.workspace_path = str(self._workspace)
        self.python = self.handler_python(template)
        self._tmpdir = str(self._workspace / ".tmp")  # the job's TMPDIR: its own, removed with it
        self._capped = False  # the workspace is a tmpfs of its own (issue 25, item 8)
        try:
            if _hostuid.needed():  # a root drainer's job runs as a uid of its own, never as root
                self._lease = _hostuid.lease()
                self._capped = _diskcap.cap(self._workspace, template.limits.disk_bytes, template.limits.inodes,
                                            self._lease.uid, self._lease.gid)
            os.mkdir(self._tmpdir, 0o700)
            if self._lease is not None:
                os.chown(self._workspace, self._lease.uid, self._lease.gid)
                os.chown(self._tmpdir, self._lease.uid, self._lease.gid)
                self._creds = f"{self._lease.uid}:{self._lease.gid}"
            elif (d := _subuid.delegation()) is not None:
                # a non-root drainer's: a subordinate uid, its supervisor ns-root in the holder
                self._holder = _subuid.holder()
                self._lease = _subuid.lease(d)
                ns = _subuid.ns_id(d, self._lease)
                assert self._holder is not None
                # its tmpfs (and TMPDIR in it) in the holder's mount namespace, which the supervisor
                # enters; the .tmp made above stays under it on the disk, the drainer's, removed after
                # (the directory under it the job's too, as before: the drainer makes no pipe there)
                limits = template.limits
                self._holder.chown(self._workspace, ns, ns)
                self._holder.cap(self._workspace, limits.disk_bytes, limits.inodes, ns, (".tmp",))
                self._holder.chown(Path(self._tmpdir), ns, ns)
                self._holder.chown(self._workspace, ns, ns)
                self._creds = f"{ns}:{ns}"
            caps = tree_cgroup_caps()
            if caps is not None:  # the supervisor, its uid sweeper and the job's init count too
                pids = None if template.limits.pids is None else template.limits.pids + 3
                self._cgroup = cgroups.JobCgroup(memory_bytes=template.limits.memory_bytes, pids=pids, caps=caps)
        except BaseException:
            self.kill()
            raise

    @classmethod
    def handler_python(cls, template: Template) -> str:
        """``template.python``, else fleetless's own interpreter, also under a root drainer where it
        lives under a directory the job uids cannot search (``/root``): the job's mount namespace
        binds it back, where the kernel gives the job one; else the system's (said once)."""
        if template.python:
            return template.python
        if _hostuid.needed() and os.environ.get(CONTAIN_ENV) != "0" and _namespaces_work():
            own = default_python(binds_blocked=True)
            from ..bwrap._filesystem import _require_job_paths

            try:
                _require_job_paths(own)
                return own
            except (SandboxUnavailable, OSError):
                pass
        return default_python()

    @classmethod
    def has_program(cls, template: Template, path: str) -> bool:
        """On the host, and (under a root drainer) reachable by the job's unprivileged uid, or one
        of the default interpreter's paths, which the job's mount namespace binds back."""
        if not super().has_program(template, path):
            return False
        if jobs_cannot_reach(path) is None:
            return True
        if template.python is None and _hostuid.needed():
            from ..bwrap._filesystem import _covered, interpreter_paths

            try:
                bound = interpreter_paths(cls.handler_python(template))
            except SandboxUnavailable:
                return False
            return _covered(path, bound) and _covered(os.path.realpath(path), bound)
        return False

    @classmethod
    def check_template(cls, template: Template) -> None:
        """The handlers' interpreter is the host's: one that is not there would fail every ``.py``
        job and spend its attempts. Under a root drainer, jobs run as leased uids: the uid range
        must be usable here, and the work directory reachable by other users."""
        d = None if _hostuid.needed() else _subuid.delegation()
        if _hostuid.needed() or d is not None:
            (_hostuid.lease() if d is None else _subuid.lease(d)).release()
            try:
                work = _workspace.root()
            except OSError as exc:
                raise SandboxUnavailable(f"cannot use the sandbox work directory: {exc}") from None
            blocked = untraversable(work)
            if blocked is not None:
                raise SandboxUnavailable(
                    f"the process tier runs a root drainer's jobs as unprivileged uids, which cannot "
                    f"reach the work directory {work}: {blocked} is not searchable by "
                    "others (chmod o+x, or set FLEETLESS_WORKDIR elsewhere)")
        python = template.python
        if python is None:
            cls.handler_python(template)
            return
        path = template.env.get("PATH", os.defpath)
        if shutil.which(python, path=path) is None and not ("/" in python and _has_exec_bit(python)):
            # (one that someone may execute but the job's uid cannot: its kinds are not claimed, said
            # per kind; a file no one may execute, /etc/passwd, is no interpreter at all)
            raise SandboxUnavailable(
                f"cannot use {python} as the handler interpreter: no executable file by that name"
                + ("" if "/" in python else f" on PATH {path}"))

    @classmethod
    def describe(cls) -> str:
        """Which uid jobs run as, which network they have and their seccomp filter (for ``fleetless
        doctor``)."""
        why = unfiltered()
        words = ("jobs run under bwrap's seccomp deny-list (no new namespaces, no keyrings, ...) with no_new_privs"
                 if why is None else f"jobs run with NO seccomp filter: {why}")
        return f"{cls._describe_uid()}; {words}; {network_words()}"

    @classmethod
    def unfiltered(cls) -> str | None:
        return unfiltered()

    @classmethod
    def _describe_uid(cls) -> str:
        if _hostuid.needed():
            try:
                return f"jobs run as host uids {_hostuid.configured_range()}, one each"
            except SandboxUnavailable as exc:
                return str(exc)
        d = _subuid.delegation()
        if d is not None:
            return f"jobs run as host uids {d} (the drainer user's subordinate range), one each"
        return (f"jobs run as the drainer's own uid {os.getuid()} on the host, all of them (reading what it may); "
                f"a uid of their own needs a root drainer or a subordinate uid range; here: {_subuid.missing()}")

    @classmethod
    def caps(cls, limits: Limits | None = None) -> dict[str, str]:
        """pids: a pids cgroup where the drainer can write one, else RLIMIT_NPROC where it counts the
        job alone (a uid of its own, or the user namespace its supervisor makes); memory: a memory
        cgroup with the pids one where writable, else RLIMIT_AS per process and the tree's sum by
        the drainer's watch (:mod:`.._tree`: what it counts and what not); cpu: not in
        cores (RLIMIT_CPU and the job's nice are said); disk: see :mod:`.._diskcap`. The words:
        :func:`.._caps.tier_caps`, shared with bwrap."""
        limits = limits or Limits()
        how = []
        own_uid = _hostuid.needed() or _subuid.delegation() is not None
        tree = tree_cgroup_caps()
        if tree is not None:
            how.append("a pids cgroup (pids.max)")
        elif own_uid:
            how.append("RLIMIT_NPROC (each job a uid of its own)")
        elif os.environ.get(CONTAIN_ENV) != "0" and nproc_counts_per_namespace() and _own_userns_works():
            how.append("RLIMIT_NPROC in the job's own user namespace (it counts that job's processes alone)")
        return tier_caps(limits, pids=how, no_pids=(f"no pids cgroup is writable and every job runs as the drainer's "
                                                    f"uid {os.getuid()} in no user namespace of its own"),
                         memory_cgroup=("v2" if tree.layout.mode == "v2" else "v1") if tree and tree.memory else None,
                         cpu_cgroup=None, memfds_seen=_watch_reads_fds())

    @classmethod
    def sweep(cls) -> int:
        """Per-job cgroups and workspaces of drainers that died."""
        try:
            removed = cgroups.sweep()
        except OSError as exc:
            log.warning("cgroup sweep failed: %s", exc)
            removed = 0
        return removed + _workspace.sweep()

    @classmethod
    def create(cls, template: Template, ttl_seconds: float = 900) -> ProcessSandbox:
        if not template.handlers_dir.is_dir():
            raise SandboxUnavailable(f"handlers directory {template.handlers_dir} does not exist")
        try:
            return cls(template, ttl_seconds)
        except OSError as exc:
            raise SandboxUnavailable(f"cannot prepare a process sandbox: {exc}") from None

    @property
    def host_workspace(self) -> Path | None:
        return self._workspace

    def write(self, path: str, data: bytes | str) -> None:
        if self._killed:
            raise RuntimeError("sandbox already destroyed")
        if self._holder is not None:  # the job's uid owns the workspace
            ns = int(self._creds.split(":")[0])
            self._holder.write(self._workspace / path, data.encode() if isinstance(data, str) else data,
                               self._workspace, ns)
            return
        target = (self._workspace / path).resolve()
        if not target.is_relative_to(self._workspace):
            raise ValueError(f"path {path!r} is outside the workspace")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data.encode() if isinstance(data, str) else data)

    @property
    def host_pid(self) -> int | None:
        proc = self._proc
        return None if proc is None or proc.returncode is not None else proc.pid

    def open_pipes(self, names: Sequence[str]) -> list[int] | None:
        """A subordinate-range drainer's: made by its holder (:meth:`.._subuid.Holder.pipes`)."""
        if self._holder is None:
            return None
        return self._holder.pipes(self._workspace, names, int(self._creds.split(":")[1]))

    def exec(self, argv: Sequence[str], timeout_seconds: float) -> ExecResult:
        started = time.monotonic()
        ttl_left = self._ttl - (started - self._born)
        budget = min(timeout_seconds, ttl_left)
        reason = (
            f"killed: timeout after {timeout_seconds:g} s"
            if timeout_seconds <= ttl_left
            else f"killed: ttl of {self._ttl:g} s expired"
        )
        if self._killed:
            return ExecResult(-signal.SIGKILL, "", "", 0.0, "killed: sandbox destroyed")
        rlimits = rlimits_for(self._template, timeout_seconds)
        rlimits.update(NICE=JOB_NICE, RLIMIT_NICE=0)  # NICE first: RLIMIT_NICE 0 then keeps it (_caps)
        cgroup = self._cgroup
        pids = self._template.limits.pids
        if pids is not None and cgroup is None and (self._lease is not None or nproc_counts_per_namespace()):
            rlimits["RLIMIT_NPROC"] = pids  # the supervisor applies it only where it counts the job alone
        harden_drainer()
        seccomp = _filter_fd()
        status_r, status_w = os.pipe()
        limits_arg = ",".join(f"{k}={v}" for k, v in rlimits.items()) or "-"
        config = -1
        try:
            config = self._config_pipe(
                [str(status_w), self.workspace_path, limits_arg, self._creds, "wait" if cgroup is not None else "-",
                 f"{max(budget, 0) + OWN_DEADLINE_SLACK:.3f}", self._contain(),
                 "-" if seccomp is None else str(seccomp), "--", *argv])
            # Its own session: signals aimed at the drainer's process group (Ctrl-C, kill -- -PGID,
            # systemd's KillMode=control-group aside) do not reach the job's supervisor.
            # A non-root drainer's subordinate uid: the supervisor starts as ns-root of the holder
            # (nsenter also enters the workspace, which the drainer itself may no longer search).
            enter = [] if self._holder is None else [*self._holder.enter()[:-1], f"--wdns={self.workspace_path}", "--"]
            proc = subprocess.Popen(
                [*enter, sys.executable, "-I", "-S", _SUPERVISOR, str(config)],
                stdin=subprocess.PIPE if cgroup is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(status_w, config) if seccomp is None else (status_w, config, seccomp),
                cwd=self.workspace_path if self._holder is None else "/",
                env={"HOME": self.workspace_path, "TMPDIR": self._tmpdir, **self._template.env},
                start_new_session=True,
            )
        finally:
            os.close(status_w)
            if config >= 0:
                os.close(config)
            if seccomp is not None:
                os.close(seccomp)
        with self._lock:
            self._proc = proc
            destroyed = self._killed
        if destroyed:  # killed while the supervisor started: it stops the job at once
            self._stop_supervisor()
        assert proc.stdout is not None and proc.stderr is not None
        try:
            if cgroup is not None:  # in the job's cgroup before the job exists
                assert proc.stdin is not None
                cgroup.mark()
                cgroup.attach(proc.pid)
                proc.stdin.write(b"g")
                proc.stdin.close()
            pidfd = os.pidfd_open(proc.pid)
        except BaseException:
            os.close(status_r)
            self.kill()
            raise
        limits = self._template.limits
        captured = _capture.Captured(limits.stdout_bytes, limits.stderr_bytes, self.stdout_seen)
        deadline = started + max(budget, 0)
        memory = self._template.limits.memory_bytes  # the tree's sum: RLIMIT_AS caps each process only
        counter = _tree.memfd_bytes if self._holder is None else self._holder.memfd_bytes
        watched = None if memory is None or (cgroup is not None and cgroup.memory_bytes is not None) else (
            _tree.watch(proc.pid, memory, self._stop_supervisor, counter))
        try:
            hit = _capture.pump(proc.stdout, proc.stderr, captured, deadline, self._stop_supervisor,
                                exited=(pidfd, self._kill_leftovers))
            try:  # a job that closed its stdout and stderr is still held to its deadline
                proc.wait(timeout=max(deadline - time.monotonic(), 0))
            except subprocess.TimeoutExpired:
                hit = True
                self._stop()
            self._kill_leftovers()
            if proc.returncode != 0:  # (0: it swept the job's uid of processes and keys)
                self._unswept = True
            os.set_blocking(status_r, False)  # whatever holds its write end, never wait on it
            try:
                raw = os.read(status_r, 4096)
            except BlockingIOError:
                raw = b""
        finally:
            if watched is not None:
                watched.cancel()
            os.close(status_r)
            os.close(pidfd)
            proc.stdout.close()
            proc.stderr.close()
        killed: str | None = reason if hit else None
        status = _capture.parse_status(raw)
        if status is not None:
            exit_code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        else:
            exit_code = -signal.SIGKILL
            if killed is None and raw:  # only the job can have written anything else there
                killed = "killed: the job wrote into its supervisor's status pipe"
            elif killed is None and not self._stopped:
                # the job killed its supervisor: its tree is killed all the same, and it is charged
                killed = f"killed: its supervisor died ({_died_of(proc.returncode)})"
            killed = killed or "killed: sandbox destroyed"
        cg = self._cgroup
        if cg is not None and cg.pids_max is not None and exit_code != 0 and cg.pids_limit_hit():
            killed = f"killed: pids limit {self._template.limits.pids} reached" + (
                f" ({reason.removeprefix('killed: ')})" if hit else "")
        if watched is not None and watched.hit and memory is not None:
            killed = f"killed: memory limit {memory_size(memory)} exceeded"
        elif cg is not None and cg.memory_bytes is not None and exit_code != 0 and cg.oom_killed():
            killed = f"killed: memory limit {memory_size(cg.memory_bytes)} exceeded"  # the supervisor's death too
        if killed is None:
            killed = rlimit_kill_reason(exit_code, rlimits)
        return ExecResult(exit_code, captured.stdout, captured.stderr, time.monotonic() - started, killed,
                          stdout_cut=captured.stdout_cut)

    @staticmethod
    def _config_pipe(args: list[str]) -> int:
        """The read end of a pipe holding the supervisor's arguments (each ended by a NUL), written
        whole and closed: its command line says nothing of them, as a job reads it as its
        ``/proc/1/cmdline`` (issue 25). The pipe grows to fit (a long job argv)."""
        data = b"".join(os.fsencode(arg) + b"\0" for arg in args)
        r, w = os.pipe()
        try:
            if len(data) > 65536:
                import fcntl

                fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, len(data))  # (OSError past pipe-max-size)
            os.write(w, data)  # (whole: the pipe holds it all, and no one reads it yet)
        except BaseException:
            os.close(r)
            raise
        finally:
            os.close(w)
        return r

    def _contain(self) -> str:
        """The supervisor's CONTAIN argument: the size of each of the job's private temporary
        directories (``/tmp``, ``/var/tmp``, ``/dev/shm``, ``/run/lock``), then the host paths under
        them the job needs (the work directory, the handlers, the interpreter's), bound back."""
        if os.environ.get(CONTAIN_ENV) == "0":
            return "-"
        keep = [str(_workspace.root().resolve()), os.path.realpath(self.handlers_path)]
        python = os.path.realpath(self.python)
        if _under_private_dirs(python) or _under_private_dirs(os.path.abspath(self.python)):
            from ..bwrap._filesystem import interpreter_paths

            keep += [os.path.realpath(p) for p in interpreter_paths(self.python)]
        keep = [p for p in keep if _under_private_dirs(p) and "\n" not in p]
        work = str(_workspace.root())
        inodes = self._template.limits.inodes
        lines = [str(self._template.limits.tmp_bytes), *([f"I {max(inodes, 2)}"] if inodes is not None else []),
                 *([f"W {work}"] if "\n" not in work else []), *(f"K {p}" for p in keep)]
        if self._lease is not None:  # a root drainer's interpreter under /root: bound back for the job
            from ..bwrap._filesystem import blocked_paths, interpreter_paths

            view = [(p, top) for p, top in blocked_paths(interpreter_paths(self.python))
                    if not any(c in p + top for c in "\n\t")]
            lines += [f"T {top}" for top in sorted({top for _, top in view})]
            lines += [f"V {p}\t{top}" for p, top in view]
        if self._template.limits.network:  # the host's network, as the kind asks; else loopback only
            lines.append("N")
        return "\n".join(lines)

    def _kill_leftovers(self) -> None:
        """Whatever of the job's tree outlived its supervisor (one that the job killed): killed, and
        waited for until its group lists no process (exec returns only when the tree is gone)."""
        if self._cgroup is not None and not self._cgroup.wait_empty():
            log.warning("job processes still in cgroup %s after its supervisor exited", self._cgroup.name)

    def _stop_supervisor(self) -> None:
        """Ask the supervisor to kill the job's tree and exit (it does at once)."""
        self._stopped = True
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)

    def _stop(self) -> None:
        """Stop the supervisor and wait for it; SIGKILL it (and the cgroup) if it does not go."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            self._stop_supervisor()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                self._kill_leftovers()

    def _destroy(self) -> None:
        with self._lock:
            self._killed = True
        self._stop()
        if self._cgroup is not None:
            self._cgroup.remove()
        if self._capped:  # its files, however many, go with the tmpfs
            try:
                _diskcap.release(self._workspace)
            except OSError as exc:
                log.warning("%s", exc)
            self._capped = False
        _subuid.remove(self._workspace, self._holder)
        if self._lease is not None:
            # every process of the job is dead by now; of its uid too, unless a supervisor could not
            # say so: then the uid is leased again only once /proc shows none of it
            self._lease.release(clean=not self._unswept and self._proc is not None)


def jobs_own_network() -> bool:
    """Whether this drainer's process-tier jobs get a network namespace of their own (only loopback,
    unless ``limits.network``): wherever they get their pid, mount and IPC namespaces, the ones the
    kernel may refuse (then a job has the host's network, as it has the host's everything else)."""
    if os.environ.get(CONTAIN_ENV) == "0":
        return False
    return _namespaces_work() if _hostuid.needed() else _own_userns_works()


def network_words() -> str:
    """What network this drainer's process-tier jobs have, in words (``doctor``, ``auto``)."""
    if jobs_own_network():
        return ("each job has a network namespace of its own with only loopback (its 127.0.0.1 is not the "
                "host's), the host's network only for kinds with network = true")
    why = (f"{CONTAIN_ENV}=0" if os.environ.get(CONTAIN_ENV) == "0"
           else "the kernel refuses its supervisors new namespaces here")
    return f"jobs share the host's network, its 127.0.0.1 (the database) too: {why}"


def isolation_gap() -> str | None:
    """Why this drainer's process-tier jobs would not be kept apart (issue 25, item 4: a uid of
    their own, swept of processes and keys when its lease ends; private temporary directories and
    IPC; no_new_privs), or None where they are. ``auto`` does not fall back to the tier then."""
    if os.environ.get(CONTAIN_ENV) == "0":
        return f"{CONTAIN_ENV}=0 gives its jobs no namespaces of their own"
    if _hostuid.needed():
        if not _namespaces_work():
            return "the kernel refuses this root drainer new pid, mount, IPC and network namespaces"
        return None
    if _subuid.delegation() is None:
        return (f"its jobs would run as the drainer's own uid {os.getuid()}, which cannot be swept when "
                f"they end; {_subuid.missing()}")
    return None


_unfiltered: list[str | None] = []


def unfiltered() -> str | None:
    """Why this drainer's process-tier jobs would run without the seccomp filter (pyseccomp or
    libseccomp missing, a kernel without seccomp filters), or None where each job gets it. Asked
    once per process (the drain's caps line and ``doctor`` say it)."""
    if not _unfiltered:
        from ..bwrap._seccomp import seccomp_file

        why = None
        try:
            with open("/proc/self/status", "rb") as f:
                if not any(line.startswith(b"Seccomp_filters:") or line.startswith(b"Seccomp:") for line in f):
                    why = "this kernel has no seccomp (no Seccomp field in /proc/self/status)"
            if why is None:
                seccomp_file()
        except (SandboxUnavailable, OSError) as exc:
            why = str(exc)
        _unfiltered.append(why)
    return _unfiltered[0]


def _filter_fd() -> int | None:
    """A descriptor of the seccomp filter's file for the supervisor (SECCOMP_FD), None where
    :func:`unfiltered` says why not."""
    if unfiltered() is not None:
        return None
    from ..bwrap._seccomp import seccomp_file

    try:
        return os.open(seccomp_file(), os.O_RDONLY | os.O_CLOEXEC)
    except (SandboxUnavailable, OSError) as exc:  # was there a moment ago: the job must not run unfiltered
        raise SandboxUnavailable(f"cannot open the seccomp filter for the job: {exc}") from exc


def _watch_reads_fds() -> bool:
    """Whether the drainer's memory watch can read its jobs' ``/proc/<pid>/fd`` (their memfds): a
    root drainer's, and a job in a user namespace the drainer's uid owns (a subordinate range's
    holder, or the supervisor's own), even one that made itself non-dumpable. A job run as the
    drainer's own uid in no namespace of its own can hide them (``prctl(PR_SET_DUMPABLE, 0)``)."""
    return (os.geteuid() == 0 or _subuid.delegation() is not None
            or (os.environ.get(CONTAIN_ENV) != "0" and _own_userns_works()))


#: The directories a process-tier job gets a private tmpfs on (the supervisor's PRIVATE_DIRS).
PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")


def _under_private_dirs(path: str) -> bool:
    return any(path.startswith(d + "/") for d in PRIVATE_DIRS)


def _has_exec_bit(path: str) -> bool:
    """A file someone may execute (its owner at least)."""
    try:
        return os.path.isfile(path) and bool(os.stat(path).st_mode & 0o111)
    except OSError:
        return False


_namespaces_ok: bool | None = None


def _namespaces_work() -> bool:
    """Whether this (root) drainer's supervisors can give jobs pid and mount namespaces here (a
    container may forbid it): tried once with ``unshare``."""
    global _namespaces_ok
    if _namespaces_ok is None:
        try:
            _namespaces_ok = subprocess.run(["unshare", "--pid", "--mount", "--ipc", "--net", "--fork", "true"],
                                            capture_output=True, timeout=30,
                                            stdin=subprocess.DEVNULL).returncode == 0
        except (OSError, subprocess.SubprocessError):
            _namespaces_ok = False
    return _namespaces_ok


_own_userns_ok: bool | None = None


def _own_userns_works() -> bool:
    """Whether a non-root supervisor can make the job a user and pid namespace of its own here (as
    ``_supervisor.py`` does): tried once with ``unshare``."""
    global _own_userns_ok
    if os.geteuid() == 0:
        return _namespaces_work()
    if _own_userns_ok is None:
        try:
            _own_userns_ok = subprocess.run(["unshare", "--user", "--pid", "--fork", "true"], capture_output=True,
                                            timeout=30, stdin=subprocess.DEVNULL).returncode == 0
        except (OSError, subprocess.SubprocessError):
            _own_userns_ok = False
    return _own_userns_ok


#: ``FLEETLESS_PROCESS_CONTAIN=0`` runs process-tier jobs without their own pid and mount namespaces
#: (as before them; for comparison only: the tree then dies with its supervisor only by cgroup).
CONTAIN_ENV = "FLEETLESS_PROCESS_CONTAIN"
def _died_of(returncode: int | None) -> str:
    if returncode is None or returncode >= 0:
        return f"exit code {returncode}"
    return f"killed by {describe_signal(-returncode)}"
