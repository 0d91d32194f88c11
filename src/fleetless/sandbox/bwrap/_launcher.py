"""The bwrap tier's launchers: a small shell spawned (and put into the job's cgroups) before the
job is known, kept ready by a pool, that reads one line and becomes bwrap (:func:`_launch`)."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import resource
import subprocess
import threading
from collections.abc import Sequence

from .. import SandboxUnavailable, _hostuid, _subuid, cgroups

log = logging.getLogger(__name__)


#: The launcher: a shell that reads one line, a shell command that becomes bwrap (see
#: :func:`_launch`), and runs it. It is spawned and put into the job's cgroups *before* the
#: command is known: moving a process between cgroups waits for an RCU grace period (about 9 ms on
#: these VMs, longer than bwrap itself), so a background thread keeps one launcher ready in fresh
#: groups (see :class:`_Pool`) and a job only pays for the limits it writes. A Python
#: ``preexec_fn`` is no alternative: it forces a full fork() of the drainer (3-7 ms here). If the
#: drainer dies before sending the line, ``read`` hits EOF and nothing runs. The shell exports a
#: ``PWD`` (the drainer's working directory) of its own accord: unset, so that bwrap, whose
#: environment the job can read as /proc/1/environ, starts with an empty one.
_SHIM_SCRIPT = 'nl=\'\n\'\nunset PWD\nread -r line || exit 125\neval "$line"\n'
_SHIM = ["/bin/sh", "-c", _SHIM_SCRIPT, "fleetless-bwrap"]


def _shim() -> list[str]:
    """The launcher's argv; for a non-root drainer with a subordinate range, as ns-root of its holder
    (:mod:`.._subuid`), where ``setpriv`` drops it to the job's ns-uid; without a range, in its
    mount holder (:func:`.._subuid.mount_holder`), whose mount namespace has the workspaces' tmpfs."""
    helper = None
    if not _hostuid.needed():
        helper = _subuid.holder() or _subuid.mount_holder()
    return _SHIM if helper is None else [*helper.enter(), *_SHIM]


#: The launcher hands bwrap its options on this fd (the rest of its stdin, ``--args``) and the
#: seccomp filter on the next (``--seccomp``).
_FD_ARGS, _FD_SECCOMP = 3, 4


def _quote(arg: str) -> str:
    """``arg`` as one single-quoted shell word (newlines through the shim's ``$nl``)."""
    if "\0" in arg:
        raise ValueError(f"argument contains a NUL byte: {arg!r}")
    return "'" + arg.replace("'", "'\\''").replace("\n", "'\"$nl\"'") + "'"


#: ``ulimit`` flag and unit (bytes per unit) of each rlimit the tier sets.
_ULIMIT = {"RLIMIT_CPU": ("t", 1), "RLIMIT_FSIZE": ("f", 512), "RLIMIT_NOFILE": ("n", 1), "RLIMIT_CORE": ("c", 512),
           "RLIMIT_AS": ("v", 1024)}


def _ulimits(rlimits: dict[str, int]) -> list[str]:
    """Shell commands setting ``rlimits`` on the launcher, which bwrap and the job inherit (soft =
    hard, but CPU: SIGXCPU at the soft limit, reported as such, SIGKILL a second later). Lowering
    one's own limits needs no privilege, whatever uid the launcher is by then; raising one above the
    drainer's own hard limit would fail, so a limit is never set above it."""
    out = []
    for name, value in rlimits.items():
        flag, unit = _ULIMIT[name]
        ceiling = resource.getrlimit(getattr(resource, name))[1]  # the launcher's: the drainer's
        soft, hard = value, value + 1 if name == "RLIMIT_CPU" else value
        if ceiling != resource.RLIM_INFINITY:
            soft, hard = min(soft, ceiling), min(hard, ceiling)
        soft, hard = -(-soft // unit), -(-hard // unit)
        out += [f"ulimit -S -{flag} {soft}", f"ulimit -H -{flag} {hard}"]
    return out


def _launch(
    binary: str, uid: int | None, options: Sequence[str], seccomp: str, argv: Sequence[str], rlimits: dict[str, int],
    view: str = "",
) -> bytes:
    """What the launcher reads on its stdin: one shell line that becomes bwrap, then bwrap's
    ``options`` NUL-separated, which bwrap reads through ``--args`` until EOF.

    Nothing of the host shows on bwrap's command line, which the job can read as ``/proc/1/cmdline``:
    it is ``./bwrap --args 3 -- <argv>`` (the line ``cd``-s to bwrap's directory first and unsets
    the ``PWD`` that sets), and sets ``rlimits`` (:func:`_ulimits`). With ``uid`` (a root drainer),
    ``setpriv`` makes the launcher that uid, the gid of the same number and no supplementary groups
    right before bwrap: bwrap then makes an ordinary unprivileged user namespace whose one uid, the
    job's 65534, is that host uid. (Spawning the pooled launcher as the uid instead costs a full
    ``fork()`` of the drainer, about three times the CPU of the extra ``exec``.) The seccomp filter
    is opened before the drop. bwrap's job gets ``/dev/null`` as stdin.

    With a ``view`` (:func:`._filesystem._view`: a root drainer's interpreter under ``/root``), the
    launcher first becomes ``unshare --mount`` and a shell that runs the view, still root: its mount
    namespace is made here, at the job's exec, so it holds what the host's has by then, the
    workspace's own capped tmpfs (:mod:`.._diskcap`) included. (Made when the pooled launcher
    started, before the workspace, it did not: issue 25's disk cap did not hold there.)"""
    for option in options:
        if "\0" in option:
            raise ValueError(f"argument contains a NUL byte: {option!r}")
    folder, name = os.path.split(binary)
    drop = "" if uid is None else f"setpriv --reuid={uid} --regid={uid} --clear-groups -- "
    become = " ".join([f"exec {drop}{_quote('./' + name)}", f"--args {_FD_ARGS} --", *(_quote(a) for a in argv)])
    if view:  # (the inner shell has no $nl of its own: a newline in an argument needs one)
        inner = f"nl='\n'\n{view}cd {_quote(folder)} && unset PWD OLDPWD && {become}\n"
        head = ["cd /", "unset PWD OLDPWD", *_ulimits(rlimits),
                f"exec unshare --mount --propagation private -- /bin/sh -c {_quote(inner)} fleetless-bwrap"]
    else:
        head = [f"cd {_quote(folder)}", "unset PWD OLDPWD", *_ulimits(rlimits), become]
    words = [" && ".join(head), f"{_FD_ARGS}<&0 0</dev/null {_FD_SECCOMP}<{_quote(seccomp)}"]
    data = [*options, "--seccomp", str(_FD_SECCOMP)]
    return (" ".join(words) + "\n").encode() + "".join(o + "\0" for o in data).encode()


class _Launcher:
    """A waiting launcher process and the (limit-less until taken) cgroups it is already in."""

    def __init__(self, cgroup: cgroups.JobCgroup | None) -> None:
        self.cgroup = cgroup
        self.proc = subprocess.Popen(
            _shim(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={},  # bwrap's own environment is readable in the sandbox (/proc/1/environ)
            start_new_session=True,
            cwd="/",
        )
        try:
            if cgroup is not None:
                cgroup.attach(self.proc.pid)
        except OSError:
            self.discard()
            raise

    def discard(self) -> None:
        """Let the launcher exit unused (EOF on its stdin) and remove its cgroups."""
        proc = self.proc
        for f in (proc.stdin, proc.stdout, proc.stderr):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if self.cgroup is not None:
            self.cgroup.remove()

    @classmethod
    def fresh(cls, caps: cgroups.CgroupCaps) -> _Launcher:
        """A launcher in new cgroups (where ``caps`` has any)."""
        return cls(cgroups.JobCgroup(caps=caps) if caps.any or caps.kill else None)


class _Pool:
    """Keeps ``size`` launchers ready, made by a daemon thread while jobs run."""

    def __init__(self, size: int = 1) -> None:
        self.size = size
        self._cond = threading.Condition()
        self._ready: list[_Launcher] = []
        self._thread: threading.Thread | None = None
        self._closed = False

    def take(self, caps: cgroups.CgroupCaps) -> _Launcher:
        with self._cond:
            launcher = self._ready.pop() if self._ready else None
            if self._thread is None and not self._closed and self.size > 0:
                self._thread = threading.Thread(target=self._fill, name="fleetless-bwrap-pool", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        if launcher is not None and launcher.proc.poll() is None:
            return launcher
        if launcher is not None:
            launcher.discard()
        return _Launcher.fresh(caps)

    def _fill(self) -> None:
        while True:
            with self._cond:
                while not self._closed and len(self._ready) >= self.size:
                    self._cond.wait()
                if self._closed:
                    return
            try:
                launcher = _Launcher.fresh(cgroups.available())
            except (OSError, SandboxUnavailable) as exc:
                log.warning("bwrap launcher pool: %s", exc)
                with self._cond:
                    self._cond.wait(timeout=5)
                continue
            with self._cond:
                if self._closed:
                    launcher.discard()
                    return
                self._ready.append(launcher)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            ready, self._ready = self._ready, []
            self._cond.notify_all()
        for launcher in ready:
            launcher.discard()


_pool = _Pool(size=2)
atexit.register(_pool.close)

