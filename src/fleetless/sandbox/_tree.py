"""The drainer's watch on a job's memory where no memory cgroup holds it (the process tier, and bwrap
for a drainer that cannot write one): RLIMIT_AS caps each process, not the tree, so a job that forks
could hold the cap many times over. One daemon thread per drainer sums, every :data:`INTERVAL`
seconds, the resident anonymous and shared memory (``RssAnon`` + ``RssShmem``) of each watched
tree, found from its root through ``/proc/<pid>/task/<tid>/children`` (readable by any user, so a
job under another uid is seen too), and calls the tree's ``over`` once when the sum passes its cap;
the sandbox then kills the tree and says ``memory limit N exceeded``
(tests/security/test_caps.py). Pages that forked processes still share are counted in each; pages
no process maps (a memfd only written to) are not seen.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

__all__ = ["INTERVAL", "Watched", "descendants", "resident_bytes", "watch"]

INTERVAL = 0.1


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


class Watched:
    """One tree under watch; :meth:`cancel` when its job has ended."""

    def __init__(self, root: int, cap: int, over: Callable[[], None]) -> None:
        self.root, self.cap, self.over = root, cap, over
        self.hit = False  # the tree passed its cap (``over`` was called)

    def cancel(self) -> None:
        with _lock:
            _trees.discard(self)


_lock = threading.Lock()
_wake = threading.Condition(_lock)
_trees: set[Watched] = set()
_thread: threading.Thread | None = None


def watch(root: int, cap: int, over: Callable[[], None]) -> Watched:
    """Watch the processes below ``root``; ``over()`` (once, from the watch's thread) when their
    resident memory passes ``cap`` bytes."""
    global _thread
    w = Watched(root, cap, over)
    with _lock:
        _trees.add(w)
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_run, name="fleetless-memory-watch", daemon=True)
            _thread.start()
        _wake.notify()
    return w


def _run() -> None:
    while True:
        with _lock:
            while not _trees:
                _wake.wait()
            trees = list(_trees)
        for w in trees:
            if resident_bytes(descendants(w.root)) > w.cap:
                w.hit = True
                w.cancel()
                try:
                    w.over()
                except Exception:  # the sandbox's kill never raises; nothing may end this thread
                    pass
        with _lock:
            _wake.wait(INTERVAL)
