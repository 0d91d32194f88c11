"""Per-job workspaces on the host: created private, always removed, leftovers swept.

A workspace directory is named ``ws-<drainer pid>-<random>`` under :func:`root`, a directory
of the drainer's user that no one else can write or swap (checked at every use). Beside them live
per-drainer copies of host files that sandboxes run from or bind (:func:`cached_copy`:
``hs-…`` handlers snapshots, ``etc-…`` and ``bpf-…`` (its seccomp filter) for bwrap). A drainer
that was SIGKILLed cannot remove its own; :func:`sweep` (run at the start of every drain) removes
those whose drainer process is gone. A copy every drainer can share (the jobs' ``/etc``) is made
once for all of them instead (:func:`shared_copy`: ``<prefix>-shared-<digest of what it holds>``),
and swept once it is stale (:func:`sweep_shared`).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import logging
import os
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Hashable
from pathlib import Path

log = logging.getLogger("fleetless.sandbox")

#: Prefixes of what :func:`sweep` removes once its drainer process is gone.
_SWEPT = ("ws", "hs", "etc", "bpf")
#: Longest :func:`remove` works on one tree before it moves it aside.
REMOVE_SECONDS = 60.0
#: Subdirectory of :func:`root` for what could not be removed (never swept).
QUARANTINE = "quarantine"


#: The environment variable naming the work directory (else a private one under the tmp dir).
ENV = "FLEETLESS_WORKDIR"


class UnsafeDirectory(OSError):
    """A work (or lease) directory that others could swap or write: refused, never used."""

    def __str__(self) -> str:
        return str(self.args[0])


_default: dict[tuple[str, int], Path] = {}  # (prefix, euid) -> the private directory found or made


def root() -> Path:
    """Where workspaces live: ``$FLEETLESS_WORKDIR`` (made 0711 if missing), else this user's
    private ``<tmp>/fleetless-<uid>-<random>`` (:func:`private_dir`). Checked at every call
    (:func:`check`): a real directory of this user that no one else may write, reached through
    directories only root or this user may change; :class:`UnsafeDirectory` otherwise."""
    given = os.environ.get(ENV)
    if not given:
        return private_dir(f"fleetless-{os.geteuid()}-")
    path = Path(os.path.abspath(given))
    if _volume_for_all(path):  # a volume mounted 0777 (a Kubernetes emptyDir): a private directory in it
        return private_dir(f"fleetless-{os.geteuid()}-", path)
    if not os.path.lexists(path):
        existing = path.parent
        while not os.path.lexists(existing):
            existing = existing.parent
        check(existing, f"the work directory {ENV}={given}", above=True)  # what it is made in
        path.mkdir(mode=0o711, parents=True, exist_ok=True)
    check(path, f"the work directory {ENV}={given}")
    return path


def _volume_for_all(path: Path) -> bool:
    """A mount point (a volume mounted for the drainer, as Kubernetes mounts an ``emptyDir``, 0777)
    of root's or this user's that others may write: what is made in it is this user's own."""
    try:
        st, up = os.lstat(path), os.lstat(path.parent)
    except OSError:
        return False
    return (stat.S_ISDIR(st.st_mode) and st.st_dev != up.st_dev and st.st_uid in (0, os.geteuid())
            and bool(st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)))


def private_dir(prefix: str, base: Path | None = None) -> Path:
    """This user's directory ``<tmp>/<prefix><random>`` (0711): the name is not predictable, so no
    other user can make it first. Every drainer of the user finds the same one again: the
    first (by name) in the tmp dir that passes :func:`check` (a directory another user made with
    the prefix fails it and is ignored); the first drainer makes it."""
    key = (f"{base}/{prefix}", os.geteuid())
    known = _default.get(key)
    if known is not None:
        try:
            check(known, "the work directory")
            return known
        except OSError:  # removed (a tmp cleaner) or changed: find or make another
            del _default[key]
    tmp = Path(os.path.realpath(tempfile.gettempdir())) if base is None else base
    found = _find_own(tmp, prefix)
    if found is None:
        made = Path(tempfile.mkdtemp(prefix=prefix, dir=tmp))
        os.chmod(made, 0o711)
        found = _find_own(tmp, prefix)  # two drainers that started together use the same one
        if found != made:
            with contextlib.suppress(OSError):
                made.rmdir()
        if found is None:
            raise UnsafeDirectory(f"the directory {made} it just made fails its own check")
    _default[key] = found
    return found


def _find_own(tmp: Path, prefix: str) -> Path | None:
    with os.scandir(tmp) as it:
        names = sorted(e.name for e in it if e.name.startswith(prefix))
    for name in names:
        try:
            check(tmp / name, name)
            return tmp / name
        except OSError:
            continue
    return None


def check(path: Path, what: str, above: bool = False) -> None:
    """Refuse (:class:`UnsafeDirectory`, one line) unless every step of ``path`` (absolute) is a
    real directory, no symlink (each opened with ``O_NOFOLLOW`` relative to the one before), the
    steps above it owned by root or this user and writable by no one else unless sticky (as /tmp
    is), and ``path`` itself owned by this user and writable by no one else. Then no other user
    can swap or write anything in it. ``above``: ``path`` is only checked as a step above one
    (to make a directory in)."""
    me = os.geteuid()
    parts = [p for p in str(path).split("/") if p]
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    prev_dev = -1
    try:
        for i, part in enumerate(["", *parts]):
            if part:
                try:
                    nxt = os.open(part, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
                except OSError as exc:
                    step = "/" + "/".join(parts[:i])
                    why = exc.strerror or str(exc)
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                        link = os.path.islink(step)
                        why = "a symlink (name the directory itself)" if link else "not a directory"
                    raise UnsafeDirectory(f"refusing {what}: {step} is {why}") from None
                os.close(fd)
                fd = nxt
            st = os.fstat(fd)
            up_dev, prev_dev = prev_dev, st.st_dev
            step = "/" + "/".join(parts[:i])
            if i == len(parts) and not above:
                if st.st_uid != me:
                    raise UnsafeDirectory(f"refusing {what}: {step} is owned by uid {st.st_uid}, not {me}")
                if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                    raise UnsafeDirectory(f"refusing {what}: {step} is writable by others "
                                          f"(mode {stat.S_IMODE(st.st_mode):o}; chmod go-w)")
            elif st.st_uid not in (0, me) or (
                    st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX
                    and st.st_dev == up_dev):  # (a volume mounted 0777 for the drainer: see root())
                raise UnsafeDirectory(f"refusing {what}: {step} (above it) could be changed by "
                                      f"another user (owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})")
    finally:
        os.close(fd)


def create() -> Path:
    """A fresh, empty, private directory for one job."""
    return Path(tempfile.mkdtemp(prefix=f"ws-{os.getpid()}-", dir=root()))


def remove(path: Path, seconds: float = REMOVE_SECONDS) -> bool:
    """Remove a workspace (or a cached copy) whatever its job left in it; True if it is gone.

    Safe for any tree a job can make: symlinks are removed, never followed (every step is relative
    to a directory file descriptor opened with ``O_NOFOLLOW``); any depth, without recursion (each
    subdirectory's subdirectories are first moved up to the top, so nothing is ever deeper than
    two levels); any modes (directories are made 0700 through their own descriptor before they are
    read); at most ``seconds``. What still cannot be removed (a file the drainer may not delete, a
    job that keeps writing) is moved into :func:`quarantine_dir` and reported once: it never stops a
    later drain and is not swept again."""
    try:
        _detach_mounts(path)
        _remove_tree(path, time.monotonic() + seconds)
        return True
    except (OSError, _OutOfTime) as exc:
        if not os.path.lexists(path):  # another sweep (a dead drainer's watchdog) removed it
            return True
        why: BaseException = exc
        if isinstance(exc, PermissionError) and os.geteuid() != 0:
            # a non-root drainer's job ran as a subordinate uid: its files are removed by the
            # holder, ns-root over those uids (same routine, same quarantine), see _subuid
            from . import SandboxUnavailable, _subuid

            try:
                helper = _subuid.holder()
                if helper is not None:
                    return helper.remove(path)
            except (OSError, SandboxUnavailable) as exc2:
                why = exc2
        _quarantine(path, why)
        return False


class _OutOfTime(Exception):
    def __str__(self) -> str:
        return "removal took too long"


def _remove_tree(path: Path, deadline: float) -> None:
    parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            st = os.stat(path.name, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            return
        # Two removers may work on one tree at once (a dead drainer's watchdog and the next
        # drain's sweep): whatever vanishes under one was removed by the other.
        if stat.S_ISDIR(st.st_mode):
            try:
                top = _open_dir(parent, path.name)
            except FileNotFoundError:
                return
            try:
                while True:
                    _empty(top, deadline)
                    try:
                        os.rmdir(path.name, dir_fd=parent)
                        break
                    except FileNotFoundError:
                        break
                    except OSError as exc:
                        # the other remover hoisted a subdirectory into the top meanwhile: again
                        if exc.errno != errno.ENOTEMPTY or time.monotonic() > deadline:
                            raise
            finally:
                os.close(top)
        else:
            _unlink(path.name, parent)
    finally:
        os.close(parent)


def _open_dir(parent: int, name: str) -> int:
    """A readable descriptor of the directory ``name`` in ``parent``, made 0700 first; never of
    what a symlink points to (``O_NOFOLLOW``), and the chmod goes through the descriptor's own
    ``/proc/self/fd`` link, so it is this directory's even if the name is swapped meanwhile."""
    handle = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=parent)
    try:
        own = f"/proc/self/fd/{handle}"
        try:
            os.chmod(own, 0o700)
        except PermissionError:
            pass  # not ours (a non-root drainer): it may still be readable
        return os.open(own, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    finally:
        os.close(handle)


def _empty(top: int, deadline: float) -> None:
    """Delete everything in the directory ``top``: files and symlinks are unlinked; each directory
    is opened, its files unlinked, its own subdirectories moved up into ``top`` under fresh names,
    and then removed. The loop ends when ``top`` is empty: one pass over ``top``'s entries per
    level of depth, with no recursion and two descriptors open at most."""
    hoist = f".fleetless-rm-{os.urandom(4).hex()}-"
    hoisted = 0
    while True:
        with os.scandir(top) as it:
            entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
        if not entries:
            return
        for name, is_dir in entries:
            if time.monotonic() > deadline:
                raise _OutOfTime()
            if not is_dir:
                _unlink(name, top)
                continue
            try:
                sub = _open_dir(top, name)
            except FileNotFoundError:
                continue
            try:
                with os.scandir(sub) as it:
                    inner = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
                for child, child_is_dir in inner:
                    if not child_is_dir:
                        _unlink(child, sub)
                        continue
                    for _ in range(100):  # a name the job made can be in the way: take the next
                        hoisted += 1
                        try:
                            os.rename(child, f"{hoist}{hoisted}", src_dir_fd=sub, dst_dir_fd=top)
                            break
                        except (FileExistsError, IsADirectoryError, NotADirectoryError):
                            continue
                        except FileNotFoundError:
                            break  # hoisted or removed by a concurrent remover
                        except OSError as exc:
                            if exc.errno != errno.ENOTEMPTY:
                                raise
                    if time.monotonic() > deadline:
                        raise _OutOfTime()
            finally:
                os.close(sub)
            try:
                os.rmdir(name, dir_fd=top)
            except FileNotFoundError:
                pass
            except OSError as exc:
                if exc.errno != errno.ENOTEMPTY:  # written meanwhile: the next pass sees it
                    raise


def _unlink(name: str, folder: int) -> None:
    try:
        os.unlink(name, dir_fd=folder)
    except FileNotFoundError:
        pass


def quarantine_dir() -> Path:
    """Where workspaces that could not be removed are moved (inside :func:`root`)."""
    return root() / QUARANTINE


def _quarantine(path: Path, why: BaseException) -> None:
    """Move ``path`` into :func:`quarantine_dir` and say so once (it is never swept again)."""
    try:
        target = path.parent / QUARANTINE
        target.mkdir(mode=0o700, exist_ok=True)
        os.rename(path, target / path.name)
    except FileNotFoundError:
        return
    except OSError as exc:
        log.warning("cannot remove %s (%s) nor move it aside (%s)", path, why, exc)
        return
    log.warning("cannot remove %s (%s); moved it to %s, for an operator to delete", path, why,
                target / path.name)


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] != b"Z"


def _detach_mounts(path: Path) -> None:
    """Detach every mount at or below ``path`` (a job's workspace tmpfs, :mod:`._diskcap`: only a
    root drainer mounts one), deepest first, so that removing ``path`` neither walks the tmpfs's
    files nor stops at a busy mount point. Self-contained: the process tier's supervisor loads this
    file alone."""
    if os.geteuid() != 0:
        return
    top = os.path.realpath(path).rstrip("/")
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            points = {line.split()[4] for line in f}
    except OSError:
        return
    mine = top.encode()
    below = [p for p in points if p == mine or p.startswith(mine + b"/")]
    if not below:
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for point in sorted(below, key=len, reverse=True):
        libc.umount2(point, 2)  # MNT_DETACH (a refusal leaves it to the removal's quarantine)


def start_time(pid: int) -> int:
    """When ``pid`` started, in clock ticks since boot (``/proc/PID/stat`` field 22): with the pid,
    a name for one process that a reused pid does not match. OSError when there is none."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return int(stat[stat.rindex(b")") + 2:].split()[19])


def sweep() -> int:
    """Remove workspaces left by drainers that no longer run; returns how many. One that cannot be
    removed is moved into :func:`quarantine_dir` (and reported once), so it never stops a drain."""
    removed = 0
    for entry in root().iterdir():
        parts = entry.name.split("-")
        if len(parts) < 3 or parts[0] not in _SWEPT or not parts[1].isdigit():
            continue
        if not pid_alive(int(parts[1])) and remove(entry):
            removed += 1
    return removed


#: A path signed: (path, size, mode, mtime in ns)
Signed = tuple[str, int, int, int]
Signature = tuple[Signed, ...]
_copies_lock = threading.RLock()  # shared_copy falls back to cached_copy under it
_copies: dict[tuple[str, Hashable], tuple[Signature, Path]] = {}
_old_copies: list[Path] = []
_shared: dict[tuple[str, Hashable], tuple[Signature, Path]] = {}


#: How long what lies below a signed directory is taken as unchanged (scanning /etc/alternatives and
#: /etc/ssl/certs costs ~0.5 ms, too much for every bwrap job; once per drainer start is not enough
#: for a drainer that runs for hours)
BELOW_TTL = 10.0
_below: dict[str, tuple[float, Signature]] = {}


def signature(paths: list[str]) -> Signature:
    """What these files are now (size, mode, mtime), to notice that one changed. A directory's
    own mtime changes when an entry is added, removed or renamed over, not when a file inside is
    edited in place: for a directory, the directories and regular files below it are signed too
    (symlinks not followed: a copy keeps them as links), looked at again after ``BELOW_TTL``."""
    out: list[Signed] = []
    now = time.monotonic()
    for p in paths:
        try:
            st = os.stat(p)
        except OSError:
            continue
        out.append((p, st.st_size, st.st_mode, st.st_mtime_ns))
        if stat.S_ISDIR(st.st_mode):
            seen = _below.get(p)
            if seen is None or now - seen[0] >= BELOW_TTL:
                below: list[Signed] = []
                _sign_below(p, below)
                seen = _below[p] = (now, tuple(below))
            out += seen[1]
    return tuple(out)


def _sign_below(folder: str, out: list[Signed]) -> None:
    try:
        with os.scandir(folder) as it:
            entries = sorted((e for e in it if not e.is_symlink()), key=lambda e: e.name)
    except OSError:
        return
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode):
            out.append((entry.path, st.st_size, st.st_mode, st.st_mtime_ns))
        if stat.S_ISDIR(st.st_mode):
            _sign_below(entry.path, out)


def cached_copy(prefix: str, key: Hashable, sig: Signature, build: Callable[[Path], None]) -> Path:
    """A directory ``<prefix>-<pid>-*`` under :func:`root` that ``build`` fills, made once per drainer
    process and again whenever ``sig`` changes. A replaced copy may still be in use by a running
    job, so it is removed at exit (or by the next :func:`sweep`), not at once. A ``build`` that
    fails leaves nothing behind."""
    with _copies_lock:
        current = _copies.get((prefix, key))
        if current is not None and current[0] == sig and current[1].is_dir():
            return current[1]
        folder = Path(tempfile.mkdtemp(prefix=f"{prefix}-{os.getpid()}-", dir=root()))
        try:
            build(folder)
        except BaseException:
            remove(folder)
            raise
        if current is not None:
            _old_copies.append(current[1])
        _copies[(prefix, key)] = (sig, folder)
        return folder


#: A shared copy that was replaced may still be bound by a job that started before: it is swept
#: only once its replacement was made this long ago.
SHARED_GRACE_SECONDS = 24 * 3600.0
SHARED = "shared"


def shared_name(prefix: str, key: Hashable, sig: Signature) -> str:
    """``<prefix>-shared-<digest>``: the same name in every drainer for the same contents."""
    import hashlib  # here: 1 ms of every cron tick's imports otherwise

    return f"{prefix}-{SHARED}-{hashlib.sha256(repr((key, sig)).encode()).hexdigest()[:20]}"


def shared_copy(prefix: str, key: Hashable, sig: Signature, build: Callable[[Path], None]) -> Path:
    """:func:`cached_copy`'s directory, but one for every drainer on the host and kept after they
    exit: the first drainer that needs it builds it (in a ``<prefix>-<pid>-*`` directory, swept if it
    dies meanwhile) and renames it into place, so a copy under its name is always whole. ``key`` and
    ``sig`` must name everything ``build`` puts in it (a change makes another copy). Only for what
    no job can write: :func:`root` is the drainer's own, and bwrap binds the copy read-only."""
    with _copies_lock:
        known = _shared.get((prefix, key))  # (every sandbox asks: the same files, no digest again)
        if known is not None and known[0] == sig and known[1].is_dir():
            return known[1]
        work = root()
        if not _own_dir(work, private=True):  # someone else's work directory: nothing of it is shared
            log.warning("%s is not a directory of this user's that only it may write: not sharing %s "
                        "copies there", work, prefix)
            return cached_copy(prefix, key, sig, build)
        final = work / shared_name(prefix, key, sig)
        ours = _own_dir(final)
        if not ours and os.path.lexists(final):  # not ours: never used, never replaced
            log.warning("%s is not a directory of this user's: not using it", final)
            return cached_copy(prefix, key, sig, build)
        if not ours:
            folder = Path(tempfile.mkdtemp(prefix=f"{prefix}-{os.getpid()}-", dir=work))
            try:
                build(folder)
                os.rename(folder, final)
            except OSError as exc:
                remove(folder)
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not _own_dir(final):
                    raise  # not "another drainer made it first"
            except BaseException:
                remove(folder)
                raise
        _shared[(prefix, key)] = (sig, final)  # (never removed at exit: other drainers use it too)
        return final


def _own_dir(path: Path, private: bool = False) -> bool:
    """A real directory (no symlink) of this process's user; ``private``: that no one else may
    write either."""
    try:
        st = path.lstat()
    except OSError:
        return False
    return (stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
            and not (private and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)))


def sweep_shared(prefix: str, current: set[str], grace: float = SHARED_GRACE_SECONDS) -> int:
    """Remove the ``<prefix>-shared-*`` copies not named in ``current`` (what the host's files
    make now) that were made before the newest current one, once that one is ``grace`` seconds
    old: a job that started on a replaced copy has had that long. Returns how many."""
    entries = [e for e in root().iterdir() if e.name.startswith(f"{prefix}-{SHARED}-")]
    made = {}
    for entry in entries:
        with contextlib.suppress(FileNotFoundError):
            made[entry.name] = entry.lstat().st_mtime
    replaced_at = max((made[n] for n in current if n in made), default=None)
    if replaced_at is None or time.time() - replaced_at <= grace:
        return 0
    removed = 0
    for entry in entries:
        if entry.name not in current and made.get(entry.name, replaced_at) < replaced_at and remove(entry):
            removed += 1
    return removed


@atexit.register
def _remove_copies() -> None:
    for folder in [*_old_copies, *(v[1] for v in _copies.values())]:
        remove(folder)
