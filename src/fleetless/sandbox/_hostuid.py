"""Host uids for the jobs of a root drainer: one unprivileged uid per running job, from a dedicated range.

A root drainer must never run a job as root, nor as itself. Each job therefore *leases* one uid
(and the gid of the same number) from a range that owns nothing on the host, for the job's whole
life, and runs as it (:meth:`Lease.popen_kwargs`, or bwrap started as it). No two running jobs share
a uid, also across drainer processes on the same host, so one job cannot signal, trace or read
another.

The range is ``$FLEETLESS_JOB_UIDS`` (``FIRST-LAST``; ``fleetless drain --job-uids``), by default
:data:`DEFAULT_RANGE`: 2000000000-2000065535, inside the block systemd documents as unused
(1879048192-2147352575: above container ranges, below the "negative" 32-bit uids), so no user,
file or ``/etc/subuid`` delegation of a normal host has it. Reserve it explicitly with a line
``fleetless-jobs:2000000000:65536`` in ``/etc/subuid`` and ``/etc/subgid`` (``useradd`` then never
hands it out) and in a container make sure it is inside the container's uid map. A line there that
overlaps the range and names a user (or, in ``/etc/subgid``, a group) of this host refuses the range
(:func:`delegated`): that user may run processes as the job uids (``newuidmap``), which a job's uid
sweep would kill and which could signal or trace root's jobs (red team).

Leases are ``flock``-ed files ``<uid>`` under ``$FLEETLESS_RUN_DIR/job-uids`` (default
``/run/fleetless/job-uids``), one directory for every drainer of the host. The kernel drops a lock
when its holder dies, even by SIGKILL; the job of such a holder may still be running for a moment
(its drainer's watchdog is killing it). So a lease writes its pid into the file and :meth:`Lease.release`
(called once the job is dead) blanks it (both write one fixed-width line over the last: no
truncate): a uid whose file holds a pid is handed out again only after ``/proc`` shows no process
running as it. Each lease is also claimed host-wide (an
abstract Unix socket name per uid, :func:`_claim`), so drainers whose lease files are elsewhere (a
non-root drainer's directory follows its environment) or whose ranges overlap never share a uid,
as long as they share a network namespace (the name's scope) or the run directory.

    with _hostuid.lease() as job:          # SandboxUnavailable if the range is exhausted
        subprocess.Popen(argv, **job.popen_kwargs())
        ...                                # wait until every process of the job is dead
"""

from __future__ import annotations

import errno
import fcntl
import grp
import itertools
import os
import pwd
import socket
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from . import SandboxUnavailable

__all__ = [
    "DEFAULT_RANGE", "ENV", "Lease", "UidRange", "configured_range", "delegated", "lease", "needed", "parse_range",
]

#: Environment variable holding the range (``FIRST-LAST``); the drain flag ``--job-uids`` sets it.
ENV = "FLEETLESS_JOB_UIDS"
#: Environment variable naming the host-wide run directory (lock files live in its ``job-uids``).
RUN_DIR_ENV = "FLEETLESS_RUN_DIR"
_MAX_ID = 2**32 - 2  # 2^32-1 is (uid_t) -1


@dataclass(frozen=True)
class UidRange:
    """Host uids ``first`` to ``last`` inclusive (the gids of the same numbers go with them)."""

    first: int
    last: int

    def __post_init__(self) -> None:
        if not 0 < self.first <= self.last <= _MAX_ID:
            raise ValueError(f"job uid range {self.first}-{self.last} must be within 1-{_MAX_ID}, first <= last")
        if self.first <= 65535 and self.last >= 65534:
            raise ValueError(f"job uid range {self} contains 65534 (nobody) or 65535 ((uint16) -1)")

    def __str__(self) -> str:
        return f"{self.first}-{self.last}"

    def __len__(self) -> int:
        return self.last - self.first + 1

    def __contains__(self, uid: object) -> bool:
        return isinstance(uid, int) and self.first <= uid <= self.last


DEFAULT_RANGE = UidRange(2_000_000_000, 2_000_065_535)


def parse_range(text: str) -> UidRange:
    """``FIRST-LAST`` as a :class:`UidRange`; ValueError with one line naming what is wrong."""
    first, sep, last = text.strip().partition("-")
    if not sep or not first.strip().isdigit() or not last.strip().isdigit():
        raise ValueError(f"job uid range {text!r} is not FIRST-LAST (e.g. {DEFAULT_RANGE})")
    return UidRange(int(first), int(last))


def configured_range() -> UidRange:
    """``$FLEETLESS_JOB_UIDS`` if set, else :data:`DEFAULT_RANGE`; :class:`SandboxUnavailable` when
    it is not uids, or when a user of this host may run processes as some of them (:func:`delegated`)."""
    text = os.environ.get(ENV)
    try:
        ids = parse_range(text) if text else DEFAULT_RANGE
    except ValueError as exc:
        raise SandboxUnavailable(f"{ENV}: {exc}") from None
    why = delegated(ids)
    if why is not None:
        raise SandboxUnavailable(why)
    return ids


#: The subordinate id files a user's ``newuidmap``/``newgidmap`` honour (tests point them elsewhere).
SUBUID = "/etc/subuid"
SUBGID = "/etc/subgid"
#: Files whose change may change who a line's name is (they key :func:`delegated`'s cache only:
#: the names themselves are looked up through ``pwd``/``grp``, so NSS users count too).
ACCOUNTS = ("/etc/passwd", "/etc/group")
#: :func:`delegated`'s last answer and what it depended on: every lease asks, a stat per file.
_delegated_last: list[tuple[object, str | None]] = []


def _stamp(path: str) -> tuple[str, int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return path, st.st_mtime_ns, st.st_size, st.st_ino


def delegated(ids: UidRange) -> str | None:
    """Why ``ids`` is not the root drainer's alone, in one line, or None: a line of :data:`SUBUID`
    or :data:`SUBGID` overlapping it whose owner (a name or a numeric id) is a user of this host
    (or, in :data:`SUBGID`, a group). Such a user may map those ids into a user namespace of its
    own and run processes as them: a job's uid sweep would SIGKILL them and they could signal or
    inspect the jobs. A line whose name is no user (the reservation ``fleetless-jobs``) is fine.
    Cached until one of the files changes (its mtime, size or inode)."""
    key = (ids, tuple(_stamp(p) for p in (SUBUID, SUBGID, *ACCOUNTS)))
    if _delegated_last and _delegated_last[0][0] == key:
        return _delegated_last[0][1]
    why = None
    for path, kind in ((SUBUID, "uids"), (SUBGID, "gids")):
        why = why or _overlapping_owner(path, kind, ids)
    _delegated_last[:] = [(key, why)]
    return why


def _overlapping_owner(path: str, kind: str, ids: UidRange) -> str | None:
    """The first line of ``path`` that overlaps ``ids`` and names an account here, as a refusal."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return None  # no such file: no user has subordinate ids here
    for line in lines:
        owner, first, count = [*line.strip().split(":"), "", ""][:3]
        if not (owner and first.isdigit() and count.isdigit()) or line.lstrip().startswith("#"):
            continue
        if int(count) == 0 or int(first) > ids.last or int(first) + int(count) - 1 < ids.first:
            continue
        who = _account(owner, groups=kind == "gids")
        if who is not None:
            return (f'job uid range {ids} overlaps {path}\'s line "{line.strip()}": {who} can run processes as '
                    f"those {kind}; choose another --job-uids or reserve the range under a name no user has "
                    "(fleetless-jobs)")
    return None


def _account(owner: str, groups: bool) -> str | None:
    """``owner`` of a subordinate id line as "user NAME" ("user ID (NAME)", "group NAME") if it is
    an account here, else None."""
    try:
        if owner.isdigit():
            return f"user {owner} ({pwd.getpwuid(int(owner)).pw_name})"
        return f"user {pwd.getpwnam(owner).pw_name}"
    except (KeyError, OverflowError):
        pass
    if groups:
        try:
            if owner.isdigit():
                return f"group {owner} ({grp.getgrgid(int(owner)).gr_name})"
            return f"group {grp.getgrnam(owner).gr_name}"
        except (KeyError, OverflowError):
            pass
    return None


def needed() -> bool:
    """Whether jobs need a leased uid: the drainer is root (a non-root drainer cannot switch uid, and
    its jobs are not root anyway)."""
    return os.geteuid() == 0


def lock_dir() -> Path:
    """``$FLEETLESS_RUN_DIR/job-uids`` (default ``/run/fleetless/job-uids``), created root-only."""
    path = os.path.join(os.environ.get(RUN_DIR_ENV) or "/run/fleetless", "job-uids")
    try:
        os.mkdir(path, 0o700)  # once per job: the usual answer, "exists", in one system call
    except FileExistsError:
        pass
    except FileNotFoundError:
        Path(path).mkdir(mode=0o700, parents=True, exist_ok=True)
    return Path(path)


#: ``_mapped``'s answers: a user namespace's id maps are written once, before anything runs in it.
_maps: dict[tuple[str, UidRange], bool] = {}


def _mapped(path: str, ids: UidRange) -> bool:
    """Whether every id of ``ids`` exists in this process's user namespace (``/proc/self/uid_map``)."""
    known = _maps.get((path, ids))
    if known is not None:
        return known
    try:
        with open(path) as f:
            rows = [tuple(int(n) for n in line.split()) for line in f if line.strip()]
    except OSError:
        return True
    known = _maps[(path, ids)] = any(inside <= ids.first and ids.last < inside + count for inside, _, count in rows)
    return known


def _in_use(uid: int) -> bool:
    """Whether any process runs with ``uid`` as its real, effective, saved or filesystem uid."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"Uid:"):
                        if uid in (int(n) for n in line.split()[1:]):
                            return True
                        break
        except OSError:
            continue
    return False


class Lease:
    """One uid (and gid) of the range, held until :meth:`release`. Release it only once every process
    that ran as it is dead; releasing twice is harmless."""

    def __init__(self, uid: int, fd: int, claim: socket.socket | None = None) -> None:
        self.uid = uid
        self.gid = uid
        self._fd: int | None = fd
        self._claim = claim

    def popen_kwargs(self) -> dict[str, object]:
        """``subprocess.Popen`` arguments that start the child as this uid and gid, no other groups."""
        return {"user": self.uid, "group": self.gid, "extra_groups": []}

    def release(self, clean: bool = True) -> None:
        """Give the uid back. ``clean=False`` when a process of the job may still be running: the
        next holder then takes the uid only once ``/proc`` shows none."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if clean:
                _overwrite(fd, "")  # blank: the next holder need not look for stragglers
        finally:
            os.close(fd)  # drops the flock
            if self._claim is not None:
                self._claim.close()  # and the host-wide name
                self._claim = None

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"<Lease uid={self.uid}{'' if self._fd is not None else ' released'}>"


#: The width of a lease file's one line (a uid or a pid, padded with blanks, and its newline).
_LINE = 12


def _overwrite(fd: int, text: str) -> None:
    """Replace a lease file's one line by ``text`` (at most a uid's ten digits), padded to :data:`_LINE`
    bytes: written over the old line in place, never truncated (an ``ftruncate`` that frees a block
    cost 1.5-2.8 ms on an ext4 mounted ``discard``, three times a job; this write costs 5 us)."""
    data = text.ljust(_LINE - 1).encode() + b"\n"
    os.pwrite(fd, data, 0)
    if os.fstat(fd).st_size > len(data):  # a longer line of an older fleetless's
        os.ftruncate(fd, len(data))


def _cursor(folder: Path, ids: UidRange) -> tuple[int, int]:
    """(the uid to start looking at, the fd of the locked ``next`` file holding it): leases go round
    the range, so a uid just given back (and whatever its job might have left that outlived the
    sweep) is the last one handed out again, not the next."""
    fd = os.open(f"{folder}/next", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        text = os.pread(fd, 32, 0).strip()
    except BaseException:
        os.close(fd)
        raise
    start = int(text) if text.isdigit() else ids.first
    return (start if start in ids else ids.first), fd


def lease(uids: UidRange | None = None, folder: Path | None = None) -> Lease:
    """Lease the next free uid of ``uids`` (default :func:`configured_range`) after the one leased
    last (round the range), with its lock file in ``folder`` (default :func:`lock_dir`; a non-root
    drainer's subordinate uids: :mod:`._subuid`).

    Raises :class:`SandboxUnavailable` when the range is not usable here (not root, not mapped in
    this user namespace, contains the drainer's uid) or every uid of it is leased."""
    ids = uids if uids is not None else configured_range()
    if os.geteuid() != 0 and folder is None:
        raise SandboxUnavailable("only a root drainer can run jobs as other uids")
    if os.getuid() in ids or os.getgid() in ids:
        raise SandboxUnavailable(f"job uid range {ids} contains the drainer's own uid or gid")
    if not (_mapped("/proc/self/uid_map", ids) and _mapped("/proc/self/gid_map", ids)):
        raise SandboxUnavailable(
            f"job uid range {ids} is not mapped in this user namespace (set {ENV} or --job-uids "
            "to uids that exist here)"
        )
    folder = folder if folder is not None else lock_dir()
    start, cursor = _cursor(folder, ids)
    try:
        job = _lease_from(ids, folder, start)
        if job is not None:
            _overwrite(cursor, str(job.uid + 1 if job.uid < ids.last else ids.first))
            return job
    finally:
        os.close(cursor)  # (drops its lock)
    raise SandboxUnavailable(f"all {len(ids)} job uids of {ids} are in use (widen {ENV} or --job-uids)")


def _claim(uid: int) -> socket.socket | None:
    """The host-wide claim on ``uid``: a Unix socket bound to the abstract name
    ``fleetless-job-uid-<uid>`` (one namespace per network namespace, whatever a drainer's
    environment, ``/tmp`` or lease directory; dropped by the kernel when its holder dies). None when
    another process holds it: a drainer whose lease files are elsewhere (a non-root drainer's
    directory follows ``$XDG_RUNTIME_DIR`` and ``$TMPDIR``; a user's subordinate range may overlap
    root's) leases that uid now, and sharing it would let one job's uid sweep kill the other (red
    team, 4th pass). Anyone may bind such a name first: that makes leasing skip the uid (a denial
    of service, said in docs/isolation.md), never share it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        sock.bind(f"\0fleetless-job-uid-{uid}")
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            return None
        raise
    return sock


def _lease_from(ids: UidRange, folder: Path, start: int) -> Lease | None:
    """The first free uid of ``ids`` from ``start`` on, round the range; None if every one is held."""
    for uid in itertools.chain(range(start, ids.last + 1), range(ids.first, start)):  # (lazily: 65,536 uids)
        fd = os.open(f"{folder}/{uid}", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                continue
            raise
        claim = None
        try:
            stale = os.pread(fd, 32, 0).strip()  # a holder's pid, or blank (or empty) when clean
            if stale and _in_use(uid):  # its last holder died holding it and the job still runs
                os.close(fd)
                continue
            claim = _claim(uid)
            if claim is None:  # leased by a drainer whose lease files are elsewhere
                os.close(fd)
                continue
            _overwrite(fd, str(os.getpid()))
        except BaseException:
            os.close(fd)
            if claim is not None:
                claim.close()
            raise
        return Lease(uid, fd, claim)
    return None
