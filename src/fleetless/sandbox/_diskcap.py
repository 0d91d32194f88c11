"""A job's workspace on a tmpfs of its own, capped in bytes and inodes (issue 25, item 8).

On the work directory's disk a job could create 150,000 files or fill the disk: nothing but
``RLIMIT_FSIZE`` (one file's size) held it. Where the drainer may mount (root, in the host's mount
namespace), each workspace is a fresh tmpfs mounted on its directory (``size=Limits.disk_bytes``,
``nr_inodes=Limits.inodes``, owned by the job's uid, ``nosuid,nodev``): a job that goes past either
gets ``ENOSPC``, nothing of it reaches the disk, and its pages are charged to the memory cgroup of
the job that writes them. :func:`release` detaches it (the files go with it, however many) before
the directory is removed; :func:`._workspace.remove` does the same for what a dead drainer left.

A non-root drainer cannot mount in the host's mount namespace. One with a subordinate uid range
mounts the same tmpfs in its holder's mount namespace (:meth:`._subuid.Holder.cap`), where its jobs'
launchers are; without a range its workspaces stay on the work directory's disk, not capped, and
:func:`._caps.workspaces_uncapped_why` says so (``fleetless doctor``, the drain's caps).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

__all__ = ["cap", "mount", "release"]

MS_NOSUID, MS_NODEV = 2, 4
MNT_DETACH = 2
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def cap(path: Path, size: int | None, inodes: int | None, uid: int, gid: int) -> bool:
    """Mount a fresh tmpfs on ``path`` (an empty directory the drainer just made), owned by
    ``uid``:``gid``, mode 0700; True if mounted (False where this drainer cannot in the host's mount
    namespace: not root). OSError when the kernel refuses a root drainer."""
    if os.geteuid() != 0:
        return False
    mount(path, size, inodes, uid, gid)
    return True


def mount(path: Path, size: int | None, inodes: int | None, uid: int, gid: int) -> None:
    """The tmpfs of :func:`cap`, mounted in this process's mount namespace (OSError if refused)."""
    options = [f"mode=0700,uid={uid},gid={gid}"]
    if size is not None:
        options.append(f"size={max(size, 4096)}")
    if inodes is not None:
        options.append(f"nr_inodes={max(inodes, 2)}")
    if _libc.mount(b"fleetless-workspace", str(path).encode(), b"tmpfs", MS_NOSUID | MS_NODEV,
                   ",".join(options).encode()) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"cannot mount a tmpfs on the workspace {path}: {os.strerror(errno)}")


def release(path: Path) -> None:
    """Detach the tmpfs on ``path`` (lazily: a process still inside keeps its own view)."""
    if _libc.umount2(str(path).encode(), MNT_DETACH) != 0:
        errno = ctypes.get_errno()
        if errno not in (22, 2):  # EINVAL: not a mount point (any more); ENOENT: gone
            raise OSError(errno, f"cannot unmount the workspace {path}: {os.strerror(errno)}")
