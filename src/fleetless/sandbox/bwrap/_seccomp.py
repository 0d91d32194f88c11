"""The seccomp filter of bwrap jobs: the system calls a job never needs fail with EPERM.

bwrap already leaves a job without capabilities, in its own user, pid, mount, network, IPC and UTS
namespaces and with user namespaces disabled; most calls below would fail anyway. The filter is the
second wall, as in Docker's default profile: it shrinks the kernel surface a job can reach (the
calls with a history of privilege escalations: keyrings, ``bpf``, ``perf_event_open``,
``userfaultfd``, ``io_uring``, ``open_by_handle_at``) and makes the rest fail even if a kernel bug
or a future bwrap change left a capability behind. :data:`DENIED` is the list, with why for each
group; ``docs/isolation.md`` shows it.

A denied call returns ``EPERM`` (the job sees an ordinary error, nothing is killed), except
``clone3``, which returns ``ENOSYS``: its flags sit in a struct a filter cannot read, and ENOSYS is
what makes the C library fall back to ``clone``, whose flags the filter does check (new namespaces
are refused, threads and fork work).

On x86_64 the filter covers the three ABIs a process can call the kernel with: x86_64, i386
(``int 0x80``) and x32 (numbers with bit 30 set), each with the same list; any other architecture
gets EPERM for everything. The BPF is built with libseccomp through ``pyseccomp`` (ctypes, the API
of libseccomp's own Python bindings), once per host or per drainer process (:func:`seccomp_file`),
and handed to ``bwrap --seccomp FD``.
"""

from __future__ import annotations

import errno
import functools
import os
import tempfile
from pathlib import Path

from .. import SandboxUnavailable, _workspace

__all__ = ["DENIED", "NAMESPACE_FLAGS", "bpf", "seccomp_file"]

#: Denied system calls, by reason. Names unknown on an ABI (``vm86`` on x86_64) are skipped there.
DENIED: dict[str, tuple[str, ...]] = {
    "kernel keyrings are not namespaced: a job could read or fill keys of the host's users":
        ("add_key", "request_key", "keyctl"),
    "mounts are bwrap's business; a job never mounts, unmounts or changes its root":
        ("mount", "umount", "umount2", "pivot_root", "fsopen", "fsconfig", "fsmount", "fspick",
         "move_mount", "open_tree", "mount_setattr"),
    "no new namespaces, no joining others (clone with CLONE_NEW* flags is refused too)":
        ("unshare", "setns"),
    "kernel code, tracing and memory tricks with a history of privilege escalations":
        ("bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter",
         "io_uring_register", "lookup_dcookie"),
    "secret memory is in no RSS and no memfd the drainer's memory watch counts (where no memory cgroup "
    "holds a job, up to RLIMIT_MEMLOCK per process went uncounted: red team, issue 25)":
        ("memfd_secret",),
    "kernel modules and kexec":
        ("init_module", "finit_module", "delete_module", "create_module", "query_module",
         "get_kernel_syms", "kexec_load", "kexec_file_load"),
    "tracing or reading other processes (ptrace is denied outright: see docs/isolation.md)":
        ("ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd"),
    "host-wide state: accounting, swap, reboot, clocks, quotas, kernel log, terminals":
        ("acct", "swapon", "swapoff", "reboot", "settimeofday", "stime", "clock_settime",
         "clock_adjtime", "quotactl", "quotactl_fd", "syslog", "vhangup", "nfsservctl", "_sysctl"),
    "file handles bypass path permissions (the 'shocker' container escape)":
        ("open_by_handle_at", "name_to_handle_at"),
    "raw I/O ports and legacy modes":
        ("iopl", "ioperm", "vm86", "vm86old", "uselib", "ustat", "sysfs"),
}

#: clone(2) flags that make namespaces; a clone with any of them fails with EPERM.
NAMESPACE_FLAGS = (
    0x00020000  # CLONE_NEWNS
    | 0x02000000  # CLONE_NEWCGROUP
    | 0x04000000  # CLONE_NEWUTS
    | 0x08000000  # CLONE_NEWIPC
    | 0x10000000  # CLONE_NEWUSER
    | 0x20000000  # CLONE_NEWPID
    | 0x40000000  # CLONE_NEWNET
    | 0x00000080  # CLONE_NEWTIME
)


@functools.cache
def bpf() -> bytes:
    """The compiled filter (a ``struct sock_filter`` array), built on first use and kept."""
    try:
        import pyseccomp as sc  # type: ignore[import-untyped]  # ctypes module without stubs
    except (ImportError, OSError) as exc:  # OSError: the package is there but libseccomp is not
        raise SandboxUnavailable(f"cannot build the seccomp filter (pyseccomp, libseccomp2): {exc}") from exc
    eperm = sc.ERRNO(errno.EPERM)
    flt = sc.SyscallFilter(sc.ALLOW)
    flt.set_attr(sc.Attr.ACT_BADARCH, eperm)
    native = sc.system_arch()
    compat = {sc.Arch.X86_64: (sc.Arch.X86, sc.Arch.X32), sc.Arch.AARCH64: (sc.Arch.ARM,)}
    for arch in compat.get(native, ()):
        flt.add_arch(arch)
    for names in DENIED.values():
        for name in names:
            if sc.resolve_syscall(sc.Arch.NATIVE, name) == -1:  # unknown to this libseccomp
                continue
            flt.add_rule(eperm, name)
    for bit in range(32):
        if NAMESPACE_FLAGS >> bit & 1:  # clone's flags are its argument 0 on x86 and arm
            flt.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, 1 << bit, 1 << bit))
    flt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    with tempfile.TemporaryFile() as f:
        flt.export_bpf(f)
        f.seek(0)
        data = f.read()
    if not data or len(data) % 8:
        raise SandboxUnavailable(f"libseccomp produced an invalid filter ({len(data)} bytes)")
    return data


def write_to(path: str | os.PathLike[str]) -> None:
    """Write :func:`bpf` to ``path`` (a new file, read-only for everyone)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o444)
    try:
        os.write(fd, bpf())
    finally:
        os.close(fd)


#: Where libseccomp may be (its file is part of the shared filter's key: another libseccomp may
#: know other system calls).
_LIB_DIRS = ("/usr/lib", "/lib", "/usr/lib64", "/lib64", f"/usr/lib/{os.uname().machine}-linux-gnu",
             f"/lib/{os.uname().machine}-linux-gnu")


@functools.cache
def _source() -> tuple[tuple[object, ...], _workspace.Signature]:
    """What the filter is made from, known without libseccomp: the list, the machine and the format
    of this module (the key), and the libseccomp files (their signature). Looked at once per
    process, as the filter was built once per process before."""
    libs = []
    for folder in _LIB_DIRS:
        try:
            libs += [os.path.join(folder, n) for n in sorted(os.listdir(folder)) if n.startswith("libseccomp.so")]
        except OSError:
            continue
    key = ("filter-1", tuple(sorted(DENIED.items())), NAMESPACE_FLAGS, os.uname().machine)
    return key, _workspace.signature(libs)


def seccomp_file() -> Path:
    """The seccomp filter as a file the launcher (a job uid under a root drainer) opens for
    ``bwrap --seccomp``, readable by all (it is no secret, and not writable by anyone). Where jobs
    run as leased uids, one file serves every drainer of the host (``bpf-shared-*``, keyed by
    :func:`_source`): building it costs ``pyseccomp``'s import (two ``ldconfig`` runs) and
    libseccomp, ~9 ms of every cron tick's tier probe. Otherwise written once per drainer
    process, ``bpf-<pid>-*/filter``, swept like ``etc-*``."""
    from ._filesystem import _leased

    def build(folder: Path) -> None:
        write_to(folder / "filter")
        folder.chmod(0o711)

    if _leased():
        return _workspace.shared_copy("bpf", *_source(), build) / "filter"
    return _workspace.cached_copy("bpf", "seccomp", (), build) / "filter"


def shared_name() -> str:
    """The name the host's shared filter has now (what :func:`seccomp_file` would use)."""
    return _workspace.shared_name("bpf", *_source())
