"""System V shared memory in a job's IPC namespaces, for the drainer's memory watch (:mod:`._tree`).

A job can ``shmget`` a segment, fill it through a mapping and ``shmdt`` it: its pages then sit in
no process's RSS and behind no open fd, past ``--memory`` where no memory cgroup holds (issue 25,
second round). Every sandbox has an IPC namespace of its own (bwrap's ``--unshare-all``, the
process tier's supervisor), and ``/proc/sysvipc/shm`` lists the segments of the *reader's* IPC
namespace only, so the count is read from inside: one small helper process per IPC namespace of
the tree (:class:`Counter`), which joins the user namespace owning it and then the IPC namespace
(``setns``: the drainer has ``CAP_SYS_ADMIN`` over a user namespace its uid owns, bwrap's and the
process tier's, and over those below a subordinate range's holder, which its uid owns too), and
answers each question with the ``rss`` + ``swap`` bytes of every segment there. It joins no mount
or pid namespace: the job cannot name it. The host's own IPC namespace is never counted. An
attached segment's touched pages count in its attacher's ``RssShmem`` too (counted twice, as a
memfd both open and mapped).
"""

from __future__ import annotations

import os
import subprocess
import sys

__all__ = ["Counter", "ipc_namespace"]

#: The helper: joins the user namespace that owns the IPC namespace of the pid in argv[1] (unless
#: it is its own already: not the job's own, which may be nested below it, as bwrap's
#: ``--disable-userns`` makes it), then that IPC namespace; then, for each line read, prints the
#: bytes of the segments it sees.
_HELPER = r"""
import ctypes, fcntl, os, sys
libc = ctypes.CDLL(None, use_errno=True)
ipc = os.open(f"/proc/{sys.argv[1]}/ns/ipc", os.O_RDONLY)
owner = fcntl.ioctl(ipc, 0xB701)  # NS_GET_USERNS: the user namespace owning it (bwrap's outer one)
if os.fstat(owner).st_ino != os.stat("/proc/self/ns/user").st_ino and libc.setns(owner, 0) != 0:
    sys.exit(3)
if libc.setns(ipc, 0) != 0:
    sys.exit(4)
os.close(ipc)
os.close(owner)
for _ in sys.stdin.buffer:
    total = 0
    with open("/proc/sysvipc/shm", "rb") as f:
        f.readline()
        for line in f:
            cols = line.split()
            total += int(cols[14]) + int(cols[15])
    sys.stdout.buffer.write(b"%d\n" % total)
    sys.stdout.buffer.flush()
"""


def ipc_namespace(pid: int) -> int | None:
    """The inode of ``pid``'s IPC namespace; None where it cannot be seen (gone, not ours to look at)."""
    try:
        return os.stat(f"/proc/{pid}/ns/ipc").st_ino
    except OSError:
        return None


HOST = ipc_namespace(os.getpid())


class Counter:
    """A helper inside one IPC namespace (that of ``pid``); :meth:`bytes` asks it, :meth:`close`
    ends it. A helper that could not join, or died, answers None."""

    def __init__(self, pid: int) -> None:
        self.proc: subprocess.Popen[bytes] | None = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _HELPER, str(pid)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True, cwd="/")

    def bytes(self) -> int | None:
        proc = self.proc
        if proc is None or proc.stdin is None or proc.stdout is None:
            return None
        try:
            proc.stdin.write(b"?\n")
            proc.stdin.flush()
            return int(proc.stdout.readline())
        except (OSError, ValueError):
            self.close()
            return None

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for stream in (proc.stdin, proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        try:
            proc.wait(timeout=5)  # stdin closed: it ends at once
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def count(pids: list[int], counters: dict[int, Counter]) -> int:
    """The System V shared memory of the IPC namespaces of ``pids`` other than the host's, each
    namespace once, its helper started on first sight and kept in ``counters`` (by namespace)."""
    total = 0
    seen: set[int] = set()
    for pid in pids:
        ns = ipc_namespace(pid)
        if ns is None or ns == HOST or ns in seen:
            continue
        seen.add(ns)
        if ns not in counters:
            counters[ns] = Counter(pid)
        total += counters[ns].bytes() or 0
    return total
