"""The drainer's watch on a job's memory where no memory cgroup holds it (the process tier, and bwrap
for a drainer that cannot write one): RLIMIT_AS caps each process, not the tree, so a job that forks
could hold the cap many times over. One daemon thread per drainer sums, every :data:`INTERVAL`
seconds, the resident anonymous and shared memory (``RssAnon`` + ``RssShmem``) of each watched
tree, found from its root through ``/proc/<pid>/task/<tid>/children`` (readable by any user, so a
job under another uid is seen too), plus the pages held by the memfds its processes have open
(:func:`memfd_bytes`: memory no process maps, issue 25) and the System V shared memory of its IPC
namespaces (:mod:`._sysvshm`: segments no process has attached are in no RSS), and calls the tree's ``over`` once when
the sum passes its cap; the sandbox then kills the tree and says ``memory limit N exceeded``
(tests/security/test_caps.py). Pages that forked processes still share are counted in each, and a
memfd both open and mapped counts twice. Not counted (:data:`NOT_COUNTED`): files in tmpfs (the
job's /tmp and /dev/shm and its workspace have size caps of their own), a memfd no process of the
job has open (in flight over a socket), System V shared memory in the host's IPC namespace (a job
without one of its own), and kernel memory
(pipe and socket buffers). ``/proc/<pid>/fd`` of a job under a subordinate uid is not the
drainer's to read: its holder (ns-root over that uid, :meth:`._subuid.Holder.memfd_bytes`) counts
them. A non-dumpable process's ``/proc/<pid>/fd`` is unreadable even to its own uid without
CAP_SYS_PTRACE: its fds are copied with pidfd_getfd(2) instead, which the drainer (or holder) may
do over a job in a user namespace it owns (:func:`_copied_memfds`); where nothing can have a
process's fds its memfds are unseen, and the tiers say so.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable

from . import _sysvshm

__all__ = ["INTERVAL", "NOT_COUNTED", "Watched", "descendants", "memfd_bytes", "resident_bytes", "watch"]

INTERVAL = 0.1
#: What the watch does not count, in the caps line's words.
NOT_COUNTED = ("tmpfs files (/tmp, /dev/shm and the workspace have size caps of their own), memfds no process of "
               "the job has open, kernel memory such as pipe and socket buffers")


def descendants(root: int) -> list[int]:
    """Every live process below ``root`` (not ``root`` itself)."""
    found: list[int] = []
    stack = [root]
    while stack:
        pid = stack.pop()
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                    kids = [int(k) for k in f.read().split()]
            except (OSError, ValueError):
                continue
            found += kids
            stack += kids
    return found


def resident_bytes(pids: list[int]) -> int:
    """The resident anonymous and shared-memory pages of ``pids`` (``RssAnon`` + ``RssShmem``, so a
    mapped memfd or /dev/shm file counts too), summed; a process gone meanwhile counts 0."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status", "rb") as f:
                for line in f:
                    if line.startswith((b"RssAnon:", b"RssShmem:")):
                        total += int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            continue
    return total


#: pidfd_getfd(2)'s number, the same on every architecture (Linux 5.6 and later).
_SYS_PIDFD_GETFD = 438


def _fd_table_size(pid: int) -> int:
    """``FDSize`` of ``/proc/<pid>/status`` (readable without ptrace): every fd of ``pid`` is below it."""
    with open(f"/proc/{pid}/status", "rb") as f:
        for line in f:
            if line.startswith(b"FDSize:"):
                return int(line.split()[1])
    raise OSError(f"no FDSize for {pid}")


def _copied_memfds(pid: int, seen: set[tuple[int, int]]) -> int:
    """The memfd pages of a process whose ``/proc/<pid>/fd`` is unreadable (it is non-dumpable: a
    batch's runner, or a job that called ``prctl(PR_SET_DUMPABLE, 0)``, issue 25): each of its fds
    is copied with pidfd_getfd(2), which asks ptrace's access (the drainer has it over a job in a
    user namespace it owns: bwrap's, the process tier's contained one; a holder, as ns-root),
    looked at and closed at once. Where that is refused too the process counts 0 (the tiers say
    memfds are unseen there)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    size = _fd_table_size(pid)
    pidfd = os.pidfd_open(pid)
    total = 0
    try:
        for target in range(size):
            got = int(libc.syscall(_SYS_PIDFD_GETFD, pidfd, target, 0))
            if got < 0:
                if ctypes.get_errno() in (errno.EPERM, errno.ESRCH, errno.ENOSYS):
                    break  # not ours to copy, gone, or an older kernel
                continue  # EBADF: no such fd
            try:
                if not os.readlink(f"/proc/self/fd/{got}").startswith("/memfd:"):
                    continue
                st = os.fstat(got)
            finally:
                os.close(got)
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    finally:
        os.close(pidfd)
    return total


def memfd_bytes(pids: list[int]) -> int:
    """The pages held by the memfds that ``pids`` have open (``/proc/<pid>/fd/<n>`` links to
    ``/memfd:...``; its ``st_blocks``), each file counted once however many hold it. A process whose
    ``/proc/<pid>/fd`` is unreadable (non-dumpable) has its fds copied instead
    (:func:`_copied_memfds`); one whose fds cannot be had either way counts 0."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for pid in pids:
        base = f"/proc/{pid}/fd/"
        try:
            fds = os.listdir(base)
        except OSError:
            try:
                total += _copied_memfds(pid, seen)
            except (OSError, ValueError):
                pass
            continue
        for fd in fds:
            try:
                if not os.readlink(base + fd).startswith("/memfd:"):
                    continue
                st = os.stat(base + fd)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


class Watched:
    """One tree under watch; :meth:`cancel` when its job has ended."""

    def __init__(self, root: int, cap: int, over: Callable[[], None], memfds: Callable[[list[int]], int]) -> None:
        self.root, self.cap, self.over, self.memfds = root, cap, over, memfds
        self.hit = False  # the tree passed its cap (``over`` was called)
        self.shm: dict[int, _sysvshm.Counter] = {}  # a helper per IPC namespace of the tree

    def cancel(self) -> None:
        with _lock:
            _trees.discard(self)
            counters = list(self.shm.values())
            self.shm = {}
        for counter in counters:
            counter.close()


_lock = threading.Lock()
_wake = threading.Condition(_lock)
_trees: set[Watched] = set()
_thread: threading.Thread | None = None
_idle = False  # the thread waits for a tree to watch (only then does :func:`watch` wake it)


def watch(root: int, cap: int, over: Callable[[], None],
          memfds: Callable[[list[int]], int] = memfd_bytes) -> Watched:
    """Watch the processes below ``root``; ``over()`` (once, from the watch's thread) when their
    resident memory and open memfds (counted by ``memfds``) pass ``cap`` bytes. The first look is
    the watch's next round, at most :data:`INTERVAL` from now, not at once: the tree's job has only
    just started, so a look now would see nothing that round will not (a round asks each IPC
    namespace's System V segments of a Python helper started for it: issue 27, a job shorter than a
    round starts none; before, every new tree's look at once started one for most short jobs)."""
    global _thread
    w = Watched(root, cap, over, memfds)
    with _lock:
        _trees.add(w)
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_run, name="fleetless-memory-watch", daemon=True)
            _thread.start()
        elif _idle:
            _wake.notify()  # it waits for a tree: it waits a round more, then looks
    return w


def _held(w: Watched) -> int:
    pids = descendants(w.root)
    held = resident_bytes(pids)
    if held <= w.cap:
        try:
            held += w.memfds(pids)
        except Exception:  # a holder gone (its drainer stopping): what it would count is unseen
            pass
    if held <= w.cap:
        counters = w.shm
        held += _sysvshm.count(pids, counters)
        if counters is not w.shm:  # cancelled meanwhile: a helper started since is this one's to end
            for counter in counters.values():
                counter.close()
    return held


def _run() -> None:
    global _idle
    with _lock:
        _wake.wait(INTERVAL)  # (a round after the tree that started it)
    while True:
        with _lock:
            while not _trees:
                _idle = True
                _wake.wait()
                _idle = False
                if _trees:  # a tree came: its job has only just started
                    _wake.wait(INTERVAL)
            trees = list(_trees)
        for w in trees:
            if _held(w) > w.cap:
                w.hit = True
                w.cancel()
                try:
                    w.over()
                except Exception:  # the sandbox's kill never raises; nothing may end this thread
                    pass
        with _lock:
            _wake.wait(INTERVAL)
