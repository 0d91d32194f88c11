"""Supervisor of one process-tier job. Runs as its own small program (``python -I -S``).

It is the job's parent and a child subreaper, so every descendant of the job, even one that
called setsid() and double-forked, is re-parented to it and can be found and killed. It dies
with the drainer (parent-death signal), and then kills the job's whole tree and removes the
workspace on its way out. It reports the job's wait status on a pipe (STATUS_FD) as one line,
``status N``; the drainer treats anything else there as the job's own failure (a job running as
the drainer's uid can write into that pipe through /proc). It also kills the job DEADLINE seconds
after its start by itself, so a job never outlives its lease even when the drainer is stopped
(SIGSTOP, a frozen VM) and cannot kill it at its timeout.

Where the kernel lets it (root, or unprivileged user namespaces), the job runs *contained*: in a
pid namespace of its own (with a user namespace mapping only the supervisor's uid, for a non-root
drainer) whose init is a small fork of the supervisor, the job's parent. That init dies with the
supervisor (parent-death SIGKILL) and then the kernel kills every process of the namespace, so a
job's daemon cannot outlive its supervisor even where no cgroup can be made; the job cannot name
its supervisor or the drainer (they are outside its pid namespace), and init ignores every signal
from inside. The init also gives the job a mount namespace with a fresh /proc (of its pid
namespace: no host process is visible), a private tmpfs on /tmp, /var/tmp, /dev/shm and /run/lock,
an IPC namespace, a cgroup namespace (its /proc/self/cgroup reads "/") and (unless
``limits.network``) a network namespace with only loopback, up: the job's 127.0.0.1 is its own, so
it cannot reach the host's database or any other host service.
Before it detaches every other workspace mount (:func:`_hide_other_workspaces`: the job's mount
table names no other job's workspace). Every job gets TMPDIR in its workspace, no_new_privs, a fresh
session keyring and, right before exec, the seccomp filter of bwrap and the fork server (the drainer
passes it on SECCOMP_FD: ``bwrap/_seccomp.py``, which this program does not import). A job run as
another uid (CREDS) has a *sweeper*, forked before the job: at the job's end (or the supervisor's)
it becomes that uid and kills every process of it and clears its keyrings; the supervisor exits 3
when that did not complete (0 otherwise). The supervisor and the init make themselves non-
dumpable, so that what they hold (the status pipe) is not reachable through /proc even by the same
uid.

Usage (start-up imports almost nothing): ``python -I -S _supervisor.py CONFIG_FD``, where CONFIG_FD
is an inherited descriptor (a pipe the drainer filled and closed) holding the arguments below, each
ended by a NUL byte:
    STATUS_FD WORKSPACE RLIMITS CREDS WAIT DEADLINE CONTAIN SECCOMP_FD -- ARGV...
Never on the command line: the job's namespace's init is a fork of this process, and every job reads
its ``/proc/1/cmdline`` (issue 25: it showed the workspace's and the work directory's paths, the
rlimits, the job's uid and deadline, the handlers' path); the configuration is read and its
descriptor closed before the job exists. RLIMITS is "RLIMIT_AS=n,RLIMIT_CPU=n,..." (or "-";
RLIMIT_NPROC: see :func:`_nproc`; NICE=n: the job's nice value, never below the supervisor's), CREDS
is "UID:GID" for the job to run as (or "-": the supervisor's own), WAIT is "wait" when the supervisor
must first read one byte on its stdin (the drainer puts it into the job's cgroups meanwhile) or
"-", DEADLINE a number of seconds, and CONTAIN "-" (run the job uncontained) or newline-separated
lines: TMP_BYTES (each private directory's size), then "I N" for each one's most files (its
``nr_inodes``: each costs kernel memory no memory cgroup may hold), "W PATH" for the work directory (its mounts
but WORKSPACE are detached), "K PATH" for each host path under those the
job needs (the work directory, the handlers, the interpreter),
"T DIR" for each directory the job's uid cannot search that holds its interpreter (a root
drainer's /root), "V PATH<tab>DIR" for each path under such a DIR to bind back for it, and "N" when
the job keeps the host's network (``limits.network``; else a network namespace with only loopback).
SECCOMP_FD is a descriptor to read the job's seccomp filter from (a ``struct sock_filter`` array;
"-": none, which the drainer says). The job gets this process's environment and working
directory, and /dev/null as its stdin.
"""

import ctypes
import os
import resource
import signal
import sys
import time

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID = 0x00020000, 0x08000000, 0x10000000, 0x20000000
CLONE_NEWNET, CLONE_NEWCGROUP = 0x40000000, 0x02000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18
MNT_DETACH = 2
MS_RDONLY = 1
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.syscall.restype = ctypes.c_long
#: The directories every user may write on a host, each covered by a fresh tmpfs of the job's own.
PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
#: Each private tmpfs's most files (CONTAIN's "I N"; 0: the kernel's default, half the RAM's pages)
_tmp_inodes = 0
#: keyctl(2)'s system call number by machine; its operations and special keyring ids.
_SYS_KEYCTL = {"x86_64": 250, "aarch64": 219, "riscv64": 219, "i686": 288, "armv7l": 311, "ppc64le": 311,
               "s390x": 280}
KEYCTL_JOIN_SESSION_KEYRING, KEYCTL_CLEAR, KEYCTL_GET_PERSISTENT = 1, 7, 22
KEY_SPEC_SESSION_KEYRING, KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING = -3, -4, -5
SWEEP_SECONDS = 10.0
#: The tmpfs source name of a capped workspace (``sandbox/_diskcap.py``'s).
WORKSPACE_SOURCE = b"fleetless-workspace"


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _load_filter(bpf: bytes) -> None:
    """Load ``bpf`` as this process's seccomp filter (no_new_privs must be set: it is)."""
    buf = ctypes.create_string_buffer(bpf, len(bpf))
    prog = _SockFprog(len(bpf) // 8, ctypes.cast(buf, ctypes.c_void_p))
    if _libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"cannot load the seccomp filter: {os.strerror(errno)}")


def _prctl(option: int, value: int) -> None:
    if _libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl failed")


def _unshare(flags: int) -> None:
    if _libc.unshare(flags) != 0:
        raise OSError(ctypes.get_errno(), "unshare failed")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    def b(x: str | None) -> bytes | None:
        return None if x is None else x.encode()

    if _libc.mount(b(source), b(target), b(fstype), flags, b(data)) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {target}: {os.strerror(errno)}")


def _keyctl(*args: int) -> int:
    """keyctl(2); the kernel's answer (OSError on failure)."""
    number = _SYS_KEYCTL.get(os.uname().machine)
    if number is None:
        raise OSError(38, "keyctl: unknown system call number on this machine")  # ENOSYS
    r = _libc.syscall(ctypes.c_long(number), *(ctypes.c_long(a) for a in args))
    if r < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"keyctl: {os.strerror(errno)}")
    return int(r)


def _fresh_session_keyring() -> None:
    """Join a new anonymous session keyring: what it holds dies with the job's last process, and
    the drainer's session keyring (which its children would otherwise possess) is out of reach.
    Where keyrings are not there at all (ENOSYS, or a seccomp profile's EPERM) nothing can leak."""
    try:
        _keyctl(KEYCTL_JOIN_SESSION_KEYRING, 0)
    except OSError as exc:
        if exc.errno not in (1, 38):  # EPERM, ENOSYS
            raise


def _sweep_now(uid: int, gid: int) -> bool:
    """Nothing of ``uid`` left (run in a process of its own, which this makes ``uid``): SIGKILL
    every process it may signal (``kill(-1)``: every process of that uid but this one) until none
    is left, then clear its user, user-session and persistent keyrings. True once done (bounded by
    SWEEP_SECONDS)."""
    code = False
    try:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        _prctl(PR_SET_DUMPABLE, 0)
        _fresh_session_keyring()  # (never the supervisor's own, which it must not touch)
        give_up = time.monotonic() + SWEEP_SECONDS
        while time.monotonic() < give_up:
            try:
                os.kill(-1, signal.SIGKILL)  # (says nothing of what it reached: /proc does)
            except ProcessLookupError:
                pass
            if not _running_as(uid):
                code = True
                break
            time.sleep(0.002)
        for keyring in (KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING):
            try:
                _keyctl(KEYCTL_CLEAR, keyring)
            except OSError as exc:
                if exc.errno not in (1, 38):
                    code = False
        try:
            _keyctl(KEYCTL_CLEAR, _keyctl(KEYCTL_GET_PERSISTENT, -1, KEY_SPEC_SESSION_KEYRING))
        except OSError:
            pass  # (a kernel without persistent keyrings)
    except BaseException:
        code = False
    return code


def _running_as(uid: int) -> bool:
    """Whether any process but this one runs with ``uid`` as a real, effective, saved or filesystem
    uid (zombies aside: they hold nothing but their pid, until their parents reap them)."""
    me = str(os.getpid())
    for name in os.listdir("/proc"):
        if not name.isdigit() or name == me:
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                text = f.read()
        except OSError:
            continue
        fields = dict(line.split(b":", 1) for line in text.splitlines() if b":" in line)
        if fields.get(b"State", b"").strip().startswith(b"Z"):
            continue
        if uid in (int(n) for n in fields.get(b"Uid", b"").split()):
            return True
    return False


def _start_sweeper(uid: int, gid: int) -> tuple[int, int]:
    """A child that sweeps ``uid`` (:func:`_sweep_now`) when told (a byte on the returned fd) or
    when this process dies (EOF), forked before the job's pid namespace (whose children it could
    not have once the namespace is gone); (its pid, the fd)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(w)
        for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(signum, signal.SIG_IGN)
        while True:
            try:
                os.read(r, 1)
                break
            except InterruptedError:
                continue
        os._exit(0 if _sweep_now(uid, gid) else 1)
    os.close(r)
    return pid, w


def _sweep(sweeper: tuple[int, int] | None) -> bool:
    """Have the sweeper do its work and wait for it; True once nothing of the uid is left."""
    if sweeper is None:
        return True
    pid, w = sweeper
    try:
        os.write(w, b"s")
    except OSError:
        pass
    os.close(w)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            return status == 0
        except InterruptedError:
            continue
        except ChildProcessError:
            return False


def _enter_pid_namespace() -> bool:
    """Make this process's next child the init of a new pid namespace (a non-root supervisor: in a
    new user namespace mapping only its own uid and gid). False where the kernel refuses."""
    uid, gid = os.geteuid(), os.getegid()
    try:
        if uid == 0:
            _unshare(CLONE_NEWPID)
            return True
        _unshare(CLONE_NEWUSER | CLONE_NEWPID)
    except OSError:
        return False
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1\n"), ("gid_map", f"{gid} {gid} 1\n")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    return True


def _bind_back(tops: list[str], paths: list[tuple[str, str]]) -> None:
    """Cover each directory of ``tops`` (one the job's uid may not search, such as /root) with a
    small tmpfs holding only ``paths`` (real path, its top), each bound back from the original
    through a descriptor of its top opened before: a root drainer's interpreter under /root."""
    held = {top: os.open(top, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC) for top in tops}
    for top in tops:
        _mount("fleetless-view", top, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    for path, top in paths:
        source = f"/proc/self/fd/{held[top]}/{os.path.relpath(path, top)}"
        if os.path.isdir(source):
            os.makedirs(path, mode=0o755, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
            open(path, "wb").close()
        _mount(source, path, None, MS_BIND | MS_REC)
    for fd in held.values():
        os.close(fd)


def _private_dir(target: str, size: int, keep: list[str]) -> None:
    """Cover ``target`` with a fresh tmpfs (no setuid, no devices) the size of ``size``, the paths
    of ``keep`` under it bound back from the host (opened before it is covered)."""
    if not os.path.isdir(target) or os.path.islink(target) or target in keep:
        return
    held = [(p, os.open(p, os.O_PATH | os.O_CLOEXEC)) for p in keep
            if p.startswith(target + "/") and os.path.exists(p)]
    try:
        _mount(f"fleetless{target.replace('/', '-')}", target, "tmpfs", MS_NOSUID | MS_NODEV,
               f"mode=1777,size={size}" + (f",nr_inodes={_tmp_inodes}" if _tmp_inodes else ""))
        try:
            for path, fd in held:
                if os.path.isdir(f"/proc/self/fd/{fd}"):
                    os.makedirs(path, mode=0o755, exist_ok=True)
                else:
                    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
                    open(path, "wb").close()
                _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        except OSError:
            _libc.umount2(target.encode(), MNT_DETACH)
            raise
    finally:
        for _, fd in held:
            os.close(fd)


def _loopback_up() -> None:
    """Bring up ``lo`` of this (new) network namespace: the fork server's way (SIOCSIFFLAGS), with
    ``_socket`` rather than ``socket`` (whose import, enum and all, would be most of the cost)."""
    import _socket
    import fcntl

    flags = 0x1 | 0x8 | 0x40  # IFF_UP | IFF_LOOPBACK | IFF_RUNNING
    ifreq = b"lo".ljust(16, b"\0") + flags.to_bytes(2, sys.byteorder) + bytes(22)  # struct ifreq
    s = _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM)
    try:
        fcntl.ioctl(s.fileno(), 0x8914, ifreq)  # SIOCSIFFLAGS
    finally:
        s.close()


def _unescape(field: bytes) -> bytes:
    """A path of /proc/self/mountinfo as it is (the kernel writes space, tab, newline and backslash
    as octal escapes)."""
    head, *rest = field.split(b"\\")
    return head + b"".join(bytes([int(part[:3], 8)]) + part[3:] for part in rest)


def _hide_other_workspaces(base: str, own: str) -> None:
    """Detach, in this (new, private) mount namespace, every mount under the work directory ``base``
    and every capped workspace (a tmpfs named WORKSPACE_SOURCE, another drainer's too) but the job's
    own workspace ``own``: the job's /proc/self/mountinfo then names no other job's workspace. A
    mount the kernel locked into this namespace (one that came from a more privileged one: the
    host's mounts, for a supervisor in a user namespace) cannot be detached and stays listed
    (docs/isolation.md says which)."""
    under = base.encode() + b"/" if base else None
    mine = own.encode()
    for _ in range(8):  # stacked mounts come off one per round
        found = []
        with open("/proc/self/mountinfo", "rb") as f:
            for line in f:
                fields = line.split()
                point = _unescape(fields[4])
                source = fields[fields.index(b"-") + 2] if b"-" in fields else b""
                if mine and (point == mine or point.startswith(mine + b"/")):
                    continue
                if source == WORKSPACE_SOURCE or (under is not None and point.startswith(under)):
                    found.append(point)
        detached = sum(_libc.umount2(point, MNT_DETACH) == 0 for point in reversed(found))
        if not detached:
            return


def _own_cgroup_namespace() -> None:
    """A cgroup namespace rooted where this process is (the job's cgroups, which the drainer put the
    supervisor in before the init was forked): the job's ``/proc/self/cgroup`` then reads ``/`` for
    every hierarchy, not the host's paths (``fleetless-<drainer pid>-…``, a container's own). Only a
    kernel without cgroup namespaces (EINVAL) goes without."""
    try:
        _unshare(CLONE_NEWCGROUP)
    except OSError as exc:
        if exc.errno != 22:  # EINVAL
            raise


def _private_mounts(size: int, keep: list[str], tops: list[str], view: list[tuple[str, str]], net: bool,
                    base: str, own: str) -> None:
    """In a new mount, IPC and cgroup namespace (the init's, inherited by the job) and, unless ``net``
    (the kind's ``limits.network``), a new network namespace with only loopback, up: a fresh /proc of the
    job's pid namespace (and /sys of its network namespace, read-only) and a private tmpfs on each
    of PRIVATE_DIRS (the host paths of ``keep`` under them bound back), and the ``view`` of
    :func:`_bind_back`. A job therefore leaves nothing in the host's shared temporary directories (a
    setuid copy of an interpreter for the next job of its uid), and no System V IPC object, and
    reaches nothing on the host's network (its 127.0.0.1 is its own: not the host's database) nor
    the host's Unix sockets under /run (its /run is a tmpfs of its own then: PostgreSQL's socket).
    First, :func:`_hide_other_workspaces` (``base``: the work directory; ``own``: the job's
    workspace), so that none is bound back with the work directory. The mounts and the namespaces
    are required; only a /proc or /sys the kernel will not mount here (a
    container that masks parts of its own) stays the host's."""
    _unshare(CLONE_NEWNS | CLONE_NEWIPC | (0 if net else CLONE_NEWNET))
    _own_cgroup_namespace()
    if not net:
        _loopback_up()
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing of this reaches the host's mounts
    _hide_other_workspaces(base, own)
    if view:
        _bind_back(tops, view)
    if not net:
        # The host's Unix sockets that any user may connect to live under /run (PostgreSQL's
        # /run/postgresql, 0777, trust or peer auth for local connections): a network namespace
        # does not hide a socket file, so a job without the network gets a /run of its own.
        _private_dir("/run", size, keep)
        os.makedirs("/run/lock", mode=0o1777, exist_ok=True)
    for target in PRIVATE_DIRS:
        _private_dir(target, size, keep)
    try:
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError:
        pass
    if not net:  # the host's /sys/class/net would still name the host's interfaces
        try:
            _mount("sysfs", "/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY)
        except OSError:
            pass


def _descendants() -> list[int]:
    """Every live process below this one (one /proc scan)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(name))
    found: list[int] = []
    stack = [os.getpid()]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _kill_tree(spare: int = 0) -> None:
    """SIGKILL and reap every descendant (but ``spare``) until none is left (forks racing the kill
    included)."""
    for _ in range(100):
        pids = [p for p in _descendants() if p != spare]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _reap_all()
    _reap_all()


def _reap_all() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _remove_workspace(workspace: str) -> None:
    """The drainer's own symlink-safe, recursion-free removal (``sandbox/_workspace.py``, loaded from the
    package above this one only when needed, so the supervisor's start-up stays small)."""
    import importlib.util
    import pathlib

    sandbox = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("_fleetless_workspace", os.path.join(sandbox, "_workspace.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.remove(pathlib.Path(workspace))


def _nproc(rlimits: list[list[str]], uid: int, contained: bool) -> list[list[str]]:
    """RLIMIT_NPROC only where the kernel counts it for this job alone (since Linux 5.14, per user
    namespace and uid): a uid of the job's own (``uid``), or the drainer's uid in the user namespace
    this supervisor made (``contained``), where this process and the init count too. Elsewhere it
    would count every process of the drainer's uid: left out (``Sandbox.caps`` says so)."""
    out = []
    for name, value in rlimits:
        if name == "RLIMIT_NPROC":
            if uid < 0 and not contained:
                continue
            value = str(int(value) + (2 if uid < 0 else 0))
        out.append([name, value])
    return out


def _exec_job(argv: list[str], uid: int, gid: int, rlimits: list[list[str]], bpf: bytes) -> None:
    """In the forked child: become the job (never returns); its seccomp filter ``bpf`` (if any) is
    the last thing before exec (after keyctl, which it denies), and a filter that will not load
    fails the job (it never runs unfiltered)."""
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.setsid()
        if uid >= 0:
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after setresuid, which clears it
        _prctl(PR_SET_NO_NEW_PRIVS, 1)  # a setuid file (a copy a job of its uid left) gives it nothing
        _fresh_session_keyring()
        for name, value in rlimits:
            limit = int(value)
            if name == "NICE":  # lower priority than the drainer's (never higher: it may be niced itself)
                os.setpriority(os.PRIO_PROCESS, 0, max(limit, os.getpriority(os.PRIO_PROCESS, 0)))
                continue
            # CPU: the soft limit sends SIGXCPU (nameable); the hard one, a second later, SIGKILL.
            hard = limit + 1 if name == "RLIMIT_CPU" else limit
            resource.setrlimit(getattr(resource, name), (limit, hard))
        # Python ignores SIGPIPE and SIGXFSZ, and exec keeps ignored signals: restore them.
        for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(signum, signal.SIG_DFL)
        if bpf:
            _load_filter(bpf)
        os.execvp(argv[0], argv)
    except BaseException as exc:  # report an exec failure the shell's way
        os.write(2, f"fleetless: cannot run {argv[0]}: {exc}\n".encode())
    os._exit(127)


def _init(alive: int, report: int, contain: list[str], argv: list[str], uid: int, gid: int,
          rlimits: list[list[str]], bpf: bytes, workspace: str) -> None:
    """The job's pid namespace's init (pid 1 there; never returns): private mounts, then the job;
    its wait status goes to the supervisor on ``report``. When it exits, or dies with the
    supervisor, the kernel kills whatever is left in the namespace."""
    try:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        _prctl(PR_SET_DUMPABLE, 0)
        import select

        if select.select([alive], [], [], 0)[0]:  # EOF: the supervisor died before we could ask
            os._exit(125)
        os.close(alive)
        keep = [line[2:] for line in contain[1:] if line.startswith("K ")]
        tops = [line[2:] for line in contain[1:] if line.startswith("T ")]
        view = [(path, top) for path, _, top in (line[2:].partition("\t") for line in contain[1:]
                                                  if line.startswith("V "))]
        base = next((line[2:] for line in contain[1:] if line.startswith("W ")), "")
        global _tmp_inodes
        _tmp_inodes = next((int(line[2:]) for line in contain[1:] if line.startswith("I ")), 0)
        _private_mounts(int(contain[0]), keep, tops, view, "N" in contain[1:], base, workspace)
        for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):  # as init: the job's are ignored
            signal.signal(signum, signal.SIG_DFL)
        job = os.fork()
        if job == 0:
            os.close(report)
            _exec_job(argv, uid, gid, rlimits, bpf)
        while True:  # reap everything re-parented to us; stop at the job's end
            pid, status = os.waitpid(-1, 0)
            if pid == job:
                break
        os.write(report, f"{status}".encode())
    except BaseException as exc:
        os.write(2, f"fleetless: cannot contain the job: {exc}\n".encode())
        os._exit(126)
    os._exit(0)


def _config(fd: int) -> list[str]:
    """The arguments on ``fd`` (NUL-ended, read to its end; the descriptor closed: the job does not
    inherit it)."""
    with open(fd, "rb") as f:
        data = f.read()
    return [os.fsdecode(arg) for arg in data.split(b"\0")[:-1]]


def main() -> None:
    [config_fd] = sys.argv[1:]
    args = _config(int(config_fd))
    status_fd, workspace, rlimits_arg, creds, wait, deadline, contain_arg, seccomp_fd, sep, *argv = args
    assert sep == "--" and argv, "usage: STATUS_FD WORKSPACE RLIMITS CREDS WAIT DEADLINE CONTAIN SECCOMP_FD -- ARGV..."
    bpf = b""
    if seccomp_fd != "-":
        with open(int(seccomp_fd), "rb") as f:  # (closed: the job does not inherit it)
            bpf = f.read()
        if not bpf or len(bpf) % 8:
            sys.exit(f"fleetless: the seccomp filter on fd {seccomp_fd} is not one ({len(bpf)} bytes)")
    rlimits = [item.split("=") for item in rlimits_arg.split(",")] if rlimits_arg != "-" else []
    uid, gid = (int(x) for x in creds.split(":")) if creds != "-" else (-1, -1)
    contain = contain_arg.split("\n") if contain_arg != "-" else []

    sweeper: tuple[int, int] | None = None

    def die(signum: int, frame: object) -> None:
        # Once only: a multi-threaded drainer's death can deliver the parent-death signal twice
        # (the child is re-parented to a sibling thread first), and a second run of this handler
        # inside the first one broke its lazy import, leaving the workspace behind.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        _kill_tree(sweeper[0] if sweeper else 0)
        _sweep(sweeper)  # (the drainer then leases the uid again only once /proc shows none of it)
        if workspace:
            try:
                _remove_workspace(workspace)
            except Exception:
                pass  # the next drain's sweep removes it
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, die)
    signal.signal(signal.SIGHUP, die)
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() == 1:  # the drainer died before we could ask to be told
        die(signal.SIGTERM, None)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    if wait == "wait" and not os.read(0, 1):
        os._exit(125)  # the drainer gave up on this sandbox before the job started
    if uid >= 0:
        sweeper = _start_sweeper(uid, gid)

    fd = int(status_fd)
    report_r = report_w = -1
    contained = bool(contain) and _enter_pid_namespace()  # (it writes /proc/self: dumpable until then)
    rlimits = _nproc(rlimits, uid, contained)
    _prctl(PR_SET_DUMPABLE, 0)  # its status pipe out of the job's reach through /proc, same uid or not
    if contained:
        _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)  # (again: in case the new credentials cleared it)
        alive_r, alive_w = os.pipe()
        report_r, report_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(fd)
            os.close(alive_w)
            os.close(report_r)
            _init(alive_r, report_w, contain, argv, uid, gid, rlimits, bpf, workspace)
        os.close(alive_r)  # alive_w stays open, unused, until this process dies
        os.close(report_w)
    else:
        pid = os.fork()
        if pid == 0:
            os.close(fd)
            _exec_job(argv, uid, gid, rlimits, bpf)

    def overdue(signum: int, frame: object) -> None:  # the wait below then reports the kill
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGALRM, overdue)
    signal.setitimer(signal.ITIMER_REAL, max(float(deadline), 0.001))
    status = 0
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    signal.setitimer(signal.ITIMER_REAL, 0)  # (its pid may be another's soon)
    if report_r >= 0:  # contained: the job's status is what its init reported, if it did
        reported = os.read(report_r, 32)
        os.close(report_r)
        if reported:
            status = int(reported)
        elif os.WIFEXITED(status) and os.WEXITSTATUS(status) in (125, 126):
            status = 127 << 8  # the job never started: as an exec failure
    _kill_tree(sweeper[0] if sweeper else 0)  # whatever the job left behind dies with it
    # and whatever runs as its uid elsewhere (a process that ran a setuid copy the job left), and
    # its keys: exit status 3 tells the drainer that this did not complete
    swept = _sweep(sweeper)
    sweeper = None
    os.set_blocking(fd, False)  # a pipe the job filled through /proc must not hang us
    try:
        os.write(fd, f"status {status}\n".encode())
    except OSError:
        pass  # the drainer reads the job's failure from what is there
    os.close(fd)
    if not swept:
        sys.exit(3)


if __name__ == "__main__":
    main()
