"""Job uids for a non-root drainer: a leased uid of the drainer user's subordinate range.

A non-root drainer cannot switch uid, so without help every job would be its own uid on the host
(able to read its ``~/.pgpass``, its sibling jobs' workspaces). The standard delegation fixes that:
a line ``USER:FIRST:COUNT`` in ``/etc/subuid`` and ``/etc/subgid`` (Debian's ``useradd`` adds
one) plus the setuid helpers ``newuidmap``/``newgidmap`` (Debian package ``uidmap``) let the user
make a user namespace in which ns-uid 0 is the user itself and ns-uids 1..COUNT are the host uids
FIRST..FIRST+COUNT-1, which own nothing on the host.

Each drainer process starts one *holder* (:class:`Holder`): ``unshare --map-user=0 --map-group=0
--map-users=FIRST,1,COUNT --map-groups=...`` running this module, ns-root in that namespace with
every capability over the mapped ids (and none outside it). The job's launcher (bwrap's shell, the
process tier's supervisor) enters it with ``nsenter --user=/proc/HOLDER/ns/user`` (allowed: the
drainer owns the namespace) and drops to ns-uid K >= 1 right before bwrap or the job, exactly as a
root drainer's launcher drops to its leased host uid: the job's host uid is FIRST + K - 1. Leases
are :mod:`._hostuid`'s ``flock`` files, per host uid, in a directory every drainer of the user
shares (:func:`lock_dir`), so concurrent jobs of that user never share a uid.

The drainer cannot remove or chown files of those uids itself; the holder does it on request
(one JSON line on its stdin, one back): removing a workspace with :func:`._workspace.remove`'s
symlink-safe routine, chowning a job's workspace to its uid, writing a file into it, and capping
it: the holder has a mount namespace of its own too (owned by its user namespace, so ns-root may
mount there), where each workspace gets a tmpfs of its own, ``size=Limits.disk_bytes`` and
``nr_inodes=Limits.inodes`` (:meth:`Holder.cap`, issue 25's disk cap for a non-root drainer).
Launchers enter that mount namespace with the user namespace, so the job's bwrap or supervisor
finds its workspace on that tmpfs; the drainer reaches it only through the holder (writes,
removal). On the host the workspace stays an empty directory of the work directory's disk, and
the tmpfs goes with the holder's namespace, also when the drainer dies. The drainer,
owner of the namespace, has every capability in it for the kernel, so it can still signal the
job's processes. Without a range or ``newuidmap`` the jobs stay the drainer's uid, and the drain's
one line says what to add (:func:`missing`).

    python -m fleetless.sandbox._subuid     # the holder's side (ns-root, reads requests)
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from . import SandboxUnavailable, _hostuid, _workspace

__all__ = ["Delegation", "Holder", "delegation", "holder", "lease", "missing"]

#: ``FLEETLESS_SUBUID=off`` keeps a non-root drainer's jobs at its own uid (for comparison only).
ENV = "FLEETLESS_SUBUID"


@dataclass(frozen=True)
class Delegation:
    """The drainer user's subordinate ids: host uids ``uid_first``.. and gids ``gid_first``..,
    ``count`` of each (the smaller of the two ranges), ns-ids 1..count in the holder."""

    uid_first: int
    gid_first: int
    count: int

    def host_uid(self, ns_id: int) -> int:
        return self.uid_first + ns_id - 1

    def host_gid(self, ns_id: int) -> int:
        return self.gid_first + ns_id - 1

    def __str__(self) -> str:
        return f"{self.uid_first}-{self.uid_first + self.count - 1}"


def _ranges(path: str, names: set[str]) -> list[tuple[int, int]]:
    out = []
    try:
        with open(path) as f:
            for line in f:
                parts = line.strip().split(":")
                ok = len(parts) == 3 and parts[0] in names and parts[1].isdigit() and parts[2].isdigit()
                if ok and int(parts[2]) > 0:
                    out.append((int(parts[1]), int(parts[2])))
    except OSError:
        pass
    return out


def _names() -> set[str]:
    uid = os.getuid()
    names = {str(uid)}
    try:
        names.add(pwd.getpwuid(uid).pw_name)
    except KeyError:
        pass
    return names


_cache: tuple[Delegation | None, str] | None = None
_cache_lock = threading.Lock()


def _probe() -> tuple[Delegation | None, str]:
    """(the delegation, "") where a non-root drainer can use one, else (None, what is missing)."""
    if os.geteuid() == 0:
        return None, "a root drainer leases uids of its own range (see _hostuid)"
    if os.environ.get(ENV) == "off":
        return None, f"{ENV}=off"
    user = max(_names(), key=lambda n: not n.isdigit())  # the name, else the number
    uids, gids = _ranges("/etc/subuid", _names()), _ranges("/etc/subgid", _names())
    need = []
    if not uids:
        need.append(f"a line {user}:FIRST:65536 in /etc/subuid")
    if not gids:
        need.append(f"a line {user}:FIRST:65536 in /etc/subgid")
    tools = [t for t in ("newuidmap", "newgidmap") if shutil.which(t, path="/usr/bin:/bin:/usr/sbin:/sbin") is None]
    if tools:
        need.append("newuidmap and newgidmap (apt-get install uidmap)")
    if need:
        return None, "add " + " and ".join(need)
    (ufirst, ucount), (gfirst, gcount) = uids[0], gids[0]
    d = Delegation(ufirst, gfirst, min(ucount, gcount))
    if os.getuid() in range(ufirst, ufirst + d.count) or os.getgid() in range(gfirst, gfirst + d.count):
        return None, f"the subordinate range {d} contains the drainer's own uid or gid: use another"
    try:  # the kernel or newuidmap may still refuse (a container): then nothing changes
        r = subprocess.run([*_unshare(d), "true"], capture_output=True, timeout=30, stdin=subprocess.DEVNULL,
                           env={"PATH": "/usr/bin:/bin:/usr/sbin:/sbin"}, cwd="/")
        err = "" if r.returncode == 0 else (r.stderr.decode(errors="replace").strip() or f"exit {r.returncode}")
    except (OSError, subprocess.SubprocessError) as exc:
        err = str(exc)
    if err:
        return None, f"make user namespaces with the subordinate range {d} work here (unshare: {err})"
    return d, ""


def _unshare(d: Delegation) -> list[str]:
    """argv prefix of a program run as ns-root of a new user namespace mapping ``d``, in a mount
    namespace of its own (private: nothing it mounts reaches the host)."""
    return ["unshare", "--map-user=0", "--map-group=0", f"--map-users={d.uid_first},1,{d.count}",
            f"--map-groups={d.gid_first},1,{d.count}", "--mount", "--propagation", "private", "--"]


def delegation() -> Delegation | None:
    """This (non-root) drainer's usable delegation, or None (:func:`missing` says why)."""
    global _cache
    with _cache_lock:
        if _cache is None:
            _cache = _probe()
        return _cache[0]


def missing() -> str:
    """What to add so that jobs get uids of their own ("" when they do)."""
    delegation()
    assert _cache is not None
    return _cache[1]


def lock_dir() -> Path:
    """The lease files of every drainer of this user: ``$FLEETLESS_RUN_DIR/job-uids``, else
    ``$XDG_RUNTIME_DIR/fleetless/job-uids``, else ``job-uids`` in this user's private
    ``<tmp>/fleetless-run-<uid>-<random>`` (:func:`._workspace.private_dir`: no other user can make
    it first); each made 0700 and refused unless it passes :func:`._workspace.check` (a real
    directory of this user's that no one else may write or swap)."""
    base = os.environ.get(_hostuid.RUN_DIR_ENV)
    if not base:
        runtime = os.environ.get("XDG_RUNTIME_DIR")
        base = (os.path.join(runtime, "fleetless") if runtime
                else str(_workspace.private_dir(f"fleetless-run-{os.geteuid()}-")))
    path = Path(os.path.abspath(base)) / "job-uids"
    for d in (path.parent, path):
        d.mkdir(mode=0o700, parents=d is path.parent, exist_ok=True)
        try:
            _workspace.check(d, f"the job uid lease directory (set {_hostuid.RUN_DIR_ENV})")
        except OSError as exc:
            raise SandboxUnavailable(str(exc)) from None
    return path


def lease(d: Delegation) -> _hostuid.Lease:
    """A lease on one host uid of ``d`` (``Lease.uid``); its ns-uid is ``Lease.uid - d.uid_first + 1``."""
    return _hostuid.lease(_hostuid.UidRange(d.uid_first, d.uid_first + d.count - 1), folder=lock_dir())


def ns_id(d: Delegation, job: _hostuid.Lease) -> int:
    return job.uid - d.uid_first + 1


#: A mount holder's namespaces: a user namespace mapping only the drainer's uid (as ns-root) and a
#: mount namespace of its own (:func:`mount_holder`).
_UNSHARE_OWN = ["unshare", "--map-root-user", "--mount", "--propagation", "private", "--"]


class Holder:
    """A process of this module, ns-root in a user namespace mapping the delegation (see above);
    without one (``d`` None: :func:`mount_holder`), mapping only the drainer's own uid, as ns-root,
    for its mount namespace alone."""

    def __init__(self, d: Delegation | None) -> None:
        self.delegation = d
        self._lock = threading.Lock()
        argv = [*(_unshare(d) if d is not None else _UNSHARE_OWN), sys.executable, "-I", "-S", "-c", _HOLDER_MAIN,
                json.dumps([p for p in sys.path if p])]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={},
                                     start_new_session=True, cwd="/")
        try:
            self.call("ping")
        except SandboxUnavailable:
            self.close()
            raise

    @property
    def root(self) -> Path:
        """The holder's view of the filesystem (its mount namespace's), for the drainer's own use:
        ``root / "tmp/x"`` is ``/tmp/x`` as the holder and the launchers it holds see it."""
        return Path(f"/proc/{self.proc.pid}/root")

    @property
    def userns(self) -> str:
        """The namespace to enter (``nsenter --user=``)."""
        return f"/proc/{self.proc.pid}/ns/user"

    def enter(self) -> list[str]:
        """argv prefix that runs a program as ns-root in the holder's user and mount namespaces
        (where the workspaces' tmpfs are: :meth:`cap`)."""
        keep = [] if self.delegation is not None else ["--preserve-credentials"]  # (setgroups is denied there)
        return ["nsenter", f"--user={self.userns}", f"--mount=/proc/{self.proc.pid}/ns/mnt", *keep, "--"]

    def call(self, op: str, **args: object) -> object:
        with self._lock:
            stdin, stdout = self.proc.stdin, self.proc.stdout
            assert stdin is not None and stdout is not None
            try:
                stdin.write(json.dumps({"op": op, **args}).encode() + b"\n")
                stdin.flush()
                line = stdout.readline()
            except OSError as exc:
                raise SandboxUnavailable(f"job uid holder: {exc}") from None
        if not line:
            what = f"unshare with {self.delegation}" if self.delegation is not None else "unshare --map-root-user"
            raise SandboxUnavailable(f"job uid holder ({what}) exited: {_died(self.proc)}")
        reply = json.loads(line)
        if "error" in reply:  # a ValueError (a path outside the workspace) stays one
            raise (ValueError if reply.get("kind") == "ValueError" else OSError)(reply["error"])
        return reply.get("ok")

    def remove(self, path: Path) -> bool:
        """:func:`._workspace.remove` as ns-root (True if gone; else it quarantined ``path``)."""
        return bool(self.call("remove", path=str(path)))

    def chown(self, path: Path, uid: int, gid: int) -> None:
        """``lchown`` with ns-ids (-1: unchanged)."""
        self.call("chown", path=str(path), uid=uid, gid=gid)

    def cap(self, path: Path, size: int | None, inodes: int | None, ns: int, dirs: tuple[str, ...] = ()) -> bool:
        """Mount a tmpfs of its own on the workspace ``path`` in the holder's mount namespace
        (:func:`._diskcap.cap`: ``size`` bytes, ``inodes`` files, owned by ns-id ``ns``, 0700) and
        make ``dirs`` in it, the job's too. False when both caps are None (nothing mounted)."""
        return bool(self.call("cap", path=str(path), size=size, inodes=inodes, uid=ns, dirs=list(dirs)))

    def pipes(self, top: Path, names: Sequence[str], ns: int) -> list[int]:
        """Named pipes ``names`` in the workspace ``top`` (in the holder's mount namespace), owned by
        ns-root, the drainer's uid, and group ``ns``, the job's, mode 0660: the job's batch runner
        opens them by path (and unlinks them); the drainer gets this side of each, read-write,
        through the holder's own descriptors (``/proc/HOLDER/fd/N``: it may not search the job's
        0700 workspace), which the holder then closes."""
        held = [int(fd) for fd in cast(list[int], self.call("pipes", top=str(top), names=list(names), gid=ns))]
        mine: list[int] = []
        try:
            for fd in held:
                mine.append(os.open(f"/proc/{self.proc.pid}/fd/{fd}", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC))
        except OSError:
            for fd in mine:
                os.close(fd)
            raise
        finally:
            self.call("close", fds=held)
        return mine

    def write(self, path: Path, data: bytes, top: Path, ns: int) -> None:
        """Write ``data`` at ``path`` under ``top`` (made dirs and the file owned by ns-id ``ns``)."""
        self.call("write", path=str(path), top=str(top), data=data.hex(), uid=ns)

    def memfd_bytes(self, pids: list[int]) -> int:
        """:func:`._tree.memfd_bytes` of ``pids`` as ns-root over the job uids (the drainer may not
        read their ``/proc/<pid>/fd``), for the drainer's memory watch."""
        return int(cast(int, self.call("memfds", pids=pids)))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def remove(path: Path, helper: Holder | None) -> bool:
    """Remove a job's workspace: straight through ``helper`` (its files are the job uid's, which
    the drainer could not delete), else (or if the holder is gone) :func:`._workspace.remove`."""
    from . import _workspace

    if helper is not None:
        try:
            return helper.remove(path)
        except (OSError, SandboxUnavailable):
            pass
    return _workspace.remove(path)


def _died(proc: subprocess.Popen[bytes]) -> str:
    try:
        proc.wait(timeout=2)
    except subprocess.TimeoutExpired:
        return "no reply"
    return f"exit status {proc.returncode}"


_holder: tuple[int, Holder] | None = None
_holder_lock = threading.Lock()


def holder() -> Holder | None:
    """This process's holder (started once, again after a fork or if it died), None without a
    delegation. SandboxUnavailable when it cannot start (newuidmap refused)."""
    global _holder
    d = delegation()
    if d is None:
        return None
    with _holder_lock:
        if _holder is not None and _holder[0] == os.getpid() and _holder[1].alive():
            return _holder[1]
        h = Holder(d)
        _holder = (os.getpid(), h)
        return h


_mounts: tuple[int, Holder | None, str] | None = None


def mount_holder() -> Holder | None:
    """A non-root drainer's holder *without* a subordinate range (its jobs are its own uid): ns-root
    of a user namespace mapping only that uid, in a mount namespace of its own, where the bwrap
    tier's workspaces get their capped tmpfs (:meth:`Holder.cap`); started once per process (again
    after a fork, or if it died). None for a root drainer, one with a range (:func:`holder` does
    it), or where the kernel refuses the namespaces (:func:`mount_holder_missing` says why)."""
    global _mounts
    if os.geteuid() == 0 or delegation() is not None:
        return None
    with _holder_lock:
        if _mounts is not None and _mounts[0] == os.getpid() and (_mounts[1] is None or _mounts[1].alive()):
            return _mounts[1]
        try:
            h: Holder | None = Holder(None)
            why = ""
        except (OSError, SandboxUnavailable) as exc:
            h, why = None, str(exc)
        _mounts = (os.getpid(), h, why)
        return h


def mount_holder_missing() -> str:
    """Why :func:`mount_holder` is None here ("" when there is one)."""
    mount_holder()
    return "" if _mounts is None else _mounts[2]


#: The holder's side, run with ``-I -S`` (so nothing of the environment steers it) and the
#: drainer's own ``sys.path`` (JSON) as argv[1].
_HOLDER_MAIN = ("import sys, json; sys.path[:] = json.loads(sys.argv[1]); "
                "from fleetless.sandbox._subuid import serve; serve()")


def serve() -> None:
    """Answer the drainer's requests until EOF (the drainer is gone)."""
    from . import _workspace

    for raw in sys.stdin.buffer:
        try:
            req = json.loads(raw)
            op = req["op"]
            if op == "ping":
                reply: dict[str, object] = {"ok": os.getuid() == 0}
            elif op == "remove":
                reply = {"ok": _workspace.remove(Path(req["path"]))}
            elif op == "chown":
                os.chown(req["path"], req["uid"], req["gid"], follow_symlinks=False)
                reply = {"ok": True}
            elif op == "cap":
                reply = {"ok": _cap(Path(req["path"]), req["size"], req["inodes"], int(req["uid"]), req["dirs"])}
            elif op == "pipes":
                reply = {"ok": _pipes(Path(req["top"]), req["names"], int(req["gid"]))}
            elif op == "memfds":
                from . import _tree

                reply = {"ok": _tree.memfd_bytes([int(p) for p in req["pids"]])}
            elif op == "close":
                for fd in req["fds"]:
                    os.close(int(fd))
                reply = {"ok": True}
            elif op == "write":
                _write(Path(req["path"]), Path(req["top"]), bytes.fromhex(req["data"]), int(req["uid"]))
                reply = {"ok": True}
            else:
                reply = {"error": f"unknown request {op!r}"}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            reply = {"error": str(exc), "kind": type(exc).__name__}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


def _write(path: Path, top: Path, data: bytes, ns: int) -> None:
    target = path.resolve()
    if not target.is_relative_to(top):
        raise ValueError(f"path {path} is outside the workspace")
    made = [p for p in target.parents if p.is_relative_to(top) and not p.exists()]
    target.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fchown(fd, ns, ns)
    finally:
        os.close(fd)
    for p in made:
        os.chown(p, ns, ns, follow_symlinks=False)


def _pipes(top: Path, names: list[str], gid: int) -> list[int]:
    """The holder's side of :meth:`Holder.pipes`: its descriptors, open until ``close``."""
    fds = []
    for name in names:
        if "/" in name or name in ("", ".", ".."):
            raise ValueError(f"not a pipe name: {name!r}")
        path = top / name
        os.mkfifo(path, 0o600)
        os.chown(path, 0, gid, follow_symlinks=False)
        os.chmod(path, 0o660)
        fds.append(os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW))
    return fds


def _cap(path: Path, size: int | None, inodes: int | None, ns: int, dirs: list[str]) -> bool:
    """The holder's side of :meth:`Holder.cap`."""
    from . import _diskcap

    if size is None and inodes is None:
        return False
    _diskcap.mount(path, size, inodes, ns, ns)
    for name in dirs:
        if "/" in name or name in ("", ".", ".."):
            raise ValueError(f"not a directory name: {name!r}")
        os.mkdir(path / name, 0o700)
        os.chown(path / name, ns, ns, follow_symlinks=False)
    return True
