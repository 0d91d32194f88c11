"""What the drainer does to itself and checks of the host before its jobs run as other uids: made
non-dumpable, and which directories other users cannot search."""

from __future__ import annotations

import os
from pathlib import Path

_hardened = False


def harden_drainer() -> None:
    """Make the drainer non-dumpable (once): its ``/proc/<pid>`` files (fd, environ, mem) then
    belong to root, so a job running as the drainer's own uid (a non-root drainer's) cannot write
    the operator's terminal through ``/proc/<drainer>/fd/2``, read its environment or memory, nor
    ptrace it. Children that exec a program are dumpable again (the kernel resets it)."""
    global _hardened
    if not _hardened:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0
        _hardened = True


def untraversable(path: Path) -> Path | None:
    """The first directory on the way to ``path`` (itself included) that others cannot search."""
    current = Path("/")
    for part in path.resolve().parts[1:]:
        current = current / part
        try:
            if not os.stat(current).st_mode & 0o001:
                return current
        except OSError:
            return current
    return None
