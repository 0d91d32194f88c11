"""The fork server: a pre-warmed Python that forks one fresh, isolated job per request.

Run as its own program by the drainer (``fleetless.sandbox.forkserver.client``), by exec, with an
empty environment, ``/`` as cwd, ``/dev/null`` as stdin, stdout and stderr, and one inherited fd:
its control socket (``SOCK_SEQPACKET``). It imports only the standard library, never a module of
fleetless, holds no database connection and no secret, and is single-threaded. Usage::

    python -s _server.py CONFIG_JSON

At start (as root) it imports the modules it pre-warms, makes a mount namespace of its own and
``pivot_root``-s into a minimal root built on a tmpfs: read-only binds of ``/usr`` (plus the
``/lib``, ``/bin``... symlinks), the sandbox ``/etc``, the handlers snapshot at ``/handlers``
and the interpreter's prefix when it is not under ``/usr``; a small ``/dev``; empty ``/proc``,
``/tmp``, ``/workspace``. Nothing of the host's work directory is in it. Then it closes every other fd
(``close_range``), says ``ready`` and serves requests one at a time:

``fork`` with fds ``[job socket, cgroup.procs fds...]``: ``unshare(CLONE_NEWPID)``, ``fork()``
(the child is pid 1 of a fresh pid namespace), ``setns`` back, and answer ``ok PID`` with a pidfd
of the child. The server reads nothing else: the job's spec, its pipes and its output travel between
the drainer and the child on the job socket, never through the server.

The child (the job's *init*) writes itself into its cgroups, unshares mount, IPC, UTS and (unless
the server's jobs have network) network namespaces, brings loopback up, mounts ``/proc`` and a tmpfs
``/workspace`` and says ``ready`` on the job socket (the drainer then writes the payload through
``/proc/<init>/root/workspace``); then it reads its spec and pipe fds from the job socket, caps the
workspace, mounts a size-capped ``/tmp`` and ``/dev/shm``, and forks the job (pid 2): a new session,
the pipes as stdout and stderr, ``/dev/null`` as stdin, every other fd closed, rlimits, the leased
uid and gid with no groups (so no capability is left), ``no_new_privs``, the seccomp filter, the
exact environment, default signal dispositions; then either ``runpy`` of the handler script as
``__main__`` (a ``.py`` handler run by this server's interpreter) or ``execve`` (anything else).
Init waits for the job, kills it at its deadline by itself, writes ``status N`` (the wait status) on
the status pipe and exits, which kills every process left in its pid namespace (``setsid`` daemons
included). Init dies with the server (parent-death signal), and the server kills its children and
exits when its control socket closes (the drainer died, or retired it).

A non-root drainer's server (``config["userns"]``) runs as ns-root of the drainer's user namespace
(its subordinate uids mapped) and pid 1 of a pid namespace of that user namespace, which it may
``setns`` back into after each job's: the same steps, but its binds keep the mount flags the kernel
locked, its root holds the host's ``/proc`` for each init to detach once its own is mounted (a user
namespace may mount ``proc`` only where one is fully visible), and each init chowns the workspace
and the job's pipes to the job's ns-uid (``spec["own"]``) and nices it (``spec["nice"]``).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import platform
import signal
import socket
import stat
import struct
import sys
from types import CodeType

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
CLONE_NEWCGROUP = 0x02000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_MOVE = 8192
MS_PRIVATE = 1 << 18
MS_RELATIME = 1 << 21
MS_STRICTATIME = 1 << 24
MNT_DETACH = 2
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_SECCOMP = 22
PR_SET_NO_NEW_PRIVS = 38
SECCOMP_MODE_FILTER = 2
_SYSCALLS = {"x86_64": {"pivot_root": 155, "close_range": 436},
             "aarch64": {"pivot_root": 41, "close_range": 436}}
_NR = _SYSCALLS.get(platform.machine(), _SYSCALLS["x86_64"])
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.syscall.restype = ctypes.c_long
_DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
_MAX_MSG = 1 << 20


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _b(text: str | None) -> bytes | None:
    return None if text is None else os.fsencode(text)


def _mount(src: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(_libc.mount(_b(src), _b(target), _b(fstype), flags, _b(data)), f"mount {src} on {target}")


def _prctl(option: int, value: int, arg3: int = 0) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(value), ctypes.c_ulong(arg3), ctypes.c_ulong(0), ctypes.c_ulong(0)),
           f"prctl {option}")


def _unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare")


def _close_from(first: int) -> None:
    """Close every fd from ``first`` up (``close_range``; one by one where the kernel lacks it)."""
    if _libc.syscall(_NR["close_range"], first, 0xFFFFFFFF, 0) != 0:
        os.closerange(first, 65536)


def _kept_flags(path: str) -> int:
    """The mount flags ``path``'s mount has now (``statvfs``'s, as ``MS_*``): a remount of a bind in
    a user namespace must keep the flags the kernel locked on it (noexec, nodev, atime...), as bwrap's."""
    got = os.statvfs(path).f_flag
    flags = got & (MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC | 1024 | 2048)  # + NOATIME, NODIRATIME
    if got & 4096:  # ST_RELATIME
        flags |= MS_RELATIME
    elif not got & 1024:
        flags |= MS_STRICTATIME
    return flags


def _bind(src: str, dst: str, readonly: bool, device: bool = False) -> None:
    _mount(src, dst, None, MS_BIND | MS_REC)
    flags = MS_REMOUNT | MS_BIND | MS_NOSUID | (0 if device else MS_NODEV) | (MS_RDONLY if readonly else 0)
    if _USERNS:
        flags |= _kept_flags(dst)
    _mount(None, dst, None, flags)


def _make_point(root: str, path: str, is_dir: bool) -> str:
    target = root + path
    if is_dir:
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if not os.path.exists(target):
            os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
    return target


#: Binds (where the server's root keeps it, path inside, is a directory) under /tmp or /dev/shm: an
#: interpreter installed there (a venv under /tmp, issue 25, item 1). Each job gets a tmpfs of its
#: own on both, so :func:`_mount_job` binds these again on top of it.
_KEPT: list[tuple[str, str, bool]] = []
#: A server started as ns-root of a non-root drainer's user namespace (:mod:`..._subuid`'s holder,
#: ``config["userns"]``): its binds keep the flags the kernel locked, and its root holds the host's
#: ``/proc`` until each job's init has mounted its own (:func:`_prepare`), as the kernel lets a user
#: namespace mount a ``proc`` only where one is fully visible already.
_USERNS = False


def _under_job_tmpfs(path: str) -> bool:
    return any(path == top or path.startswith(top + "/") for top in ("/tmp", "/dev/shm"))


def build_root(config: dict) -> None:  # type: ignore[type-arg]
    """A private mount namespace whose root is a minimal tree (see the module's docstring)."""
    _unshare(CLONE_NEWNS)
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    root = config["mountpoint"]
    _mount("fleetless", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=4m")
    for target, link in config["symlinks"]:
        os.symlink(target, root + link)
    for i, (src, dst) in enumerate(config["binds"]):
        if _under_job_tmpfs(dst):  # each job's own /tmp or /dev/shm would hide it: bound again after
            keep = f"/.fleetless-keep/{i}"
            _bind(src, _make_point(root, keep, os.path.isdir(src)), readonly=True)
            _KEPT.append((keep, dst, os.path.isdir(src)))
            continue
        _bind(src, _make_point(root, dst, os.path.isdir(src)), readonly=True)
    for d in ("/proc", "/tmp", "/workspace", "/dev"):
        os.makedirs(root + d, exist_ok=True)
    if _USERNS:  # (not remounted: its flags are the host's, locked; each init moves it away)
        _mount("/proc", root + "/proc", None, MS_BIND | MS_REC)
    _mount("fleetless-dev", root + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k")
    for name in _DEVICES:
        if os.path.exists(f"/dev/{name}"):
            _bind(f"/dev/{name}", _make_point(root, f"/dev/{name}", False), readonly=False, device=True)
    os.mkdir(root + "/dev/shm")
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{root}/dev/{name}")
    _mount(None, root + "/dev", None, MS_REMOUNT | MS_NOSUID | MS_NOEXEC | MS_RDONLY, "mode=0755,size=64k")
    os.chdir(root)
    os.mkdir(".old-root")
    _check(_libc.syscall(_NR["pivot_root"], b".", b".old-root"), "pivot_root")
    os.chdir("/")
    _check(_libc.umount2(b"/.old-root", MNT_DETACH), "umount old root")
    os.rmdir("/.old-root")
    _mount(None, "/", None, MS_REMOUNT | MS_NOSUID | MS_NODEV | MS_RDONLY, "mode=0755,size=4m")


# -- the job's init (pid 1 of its namespace) and the job ----------------------------------------
def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        import fcntl

        flags = 0x1 | 0x8 | 0x40  # IFF_UP | IFF_LOOPBACK | IFF_RUNNING
        fcntl.ioctl(s, 0x8914, struct.pack("16sH22x", b"lo", flags))  # SIOCSIFFLAGS


def _prepare(network: bool) -> None:
    """What every job of this server gets, done before its job is known: fresh mount, IPC, UTS,
    cgroup and (without network) network namespaces, the hostname, loopback, a fresh ``/proc``."""
    flags = CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS
    if not network:
        flags |= CLONE_NEWNET
    _unshare(flags)
    # its cgroups (joined before this) as the job's whole view: /proc/self/cgroup reads "/", not
    # the host's fleetless-<drainer pid>-… (only a kernel without cgroup namespaces goes without)
    if _libc.unshare(CLONE_NEWCGROUP) != 0 and ctypes.get_errno() != errno.EINVAL:
        _check(-1, "unshare the cgroup namespace")
    _check(_libc.sethostname(b"fleetless", 9), "sethostname")
    if not network:
        _loopback_up()
    if _USERNS:  # its own /proc mounted beside the host's, which then goes (the job never sees it)
        _mount("proc", "/tmp", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        _check(_libc.umount2(b"/proc", MNT_DETACH), "umount the host's /proc")
        _mount("/tmp", "/proc", None, MS_MOVE)
    else:
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    # The workspace: a tmpfs of this mount namespace (RAM charged to the job's memory cgroup, gone
    # with the namespace); the drainer writes the payload into it through /proc/<init>/root.
    _mount("workspace", "/workspace", "tmpfs", MS_NOSUID | MS_NODEV, "mode=0700")


def _mount_job(spec: dict) -> None:  # type: ignore[type-arg]
    """The job's own size caps: its workspace's, ``/tmp`` and ``/dev/shm``."""
    caps = ([f"size={int(spec['workspace_bytes'])}"] if spec["workspace_bytes"] else []) + (
        [f"nr_inodes={int(spec['workspace_inodes'])}"] if spec.get("workspace_inodes") else [])
    if caps:  # its size and how many files it may hold (issue 25, item 8)
        _mount(None, "/workspace", None, MS_REMOUNT | MS_NOSUID | MS_NODEV, ",".join(caps))
    tmp = f"mode=1777,size={int(spec['tmp_bytes'])}"
    if spec.get("workspace_inodes"):  # each file is kernel memory (issue 25, second round)
        tmp += f",nr_inodes={int(spec['workspace_inodes'])}"
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, tmp)
    _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, tmp)
    for keep, dst, is_dir in _KEPT:
        _bind(keep, _make_point("", dst, is_dir), readonly=True)


def _give(uid: int, gid: int, fds: tuple[int, ...]) -> None:
    """The workspace (what the drainer wrote into it) and the job's pipes to the job's uid, before
    the job exists: its own, as a root drainer makes them (no link is followed)."""
    for fd in fds:
        os.fchown(fd, uid, gid)
    for top, dirs, files in os.walk("/workspace"):
        os.chown(top, uid, gid, follow_symlinks=False)
        for name in files + [d for d in dirs if os.path.islink(os.path.join(top, d))]:
            os.chown(os.path.join(top, name), uid, gid, follow_symlinks=False)


def _run_job(spec: dict, out_fd: int, err_fd: int, seccomp: bytes | None) -> None:  # type: ignore[type-arg]
    """In the forked job: drop everything, then become the handler. Never returns."""
    import resource

    try:
        os.setsid()
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        _close_from(3)
        os.chdir("/workspace")
        if spec.get("nice") is not None:  # before RLIMIT_NICE 0, as bwrap's jobs are
            os.setpriority(os.PRIO_PROCESS, 0, max(int(spec["nice"]), os.getpriority(os.PRIO_PROCESS, 0)))
        for name, (soft, hard) in spec["rlimits"].items():
            resource.setrlimit(getattr(resource, name), (soft, hard))
        uid, gid = spec["uid"], spec["gid"]
        if uid is not None:
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)  # from root to a uid: every capability is gone
            # What an exec would do: the job owns its /proc/self (fd, mem, /dev/stdout). Its uid is
            # its own; ptrace is denied by seccomp anyway.
            _prctl(PR_SET_DUMPABLE, 1)
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        if seccomp:
            buf = ctypes.create_string_buffer(seccomp, len(seccomp))
            prog = _SockFprog(len(seccomp) // 8, ctypes.cast(buf, ctypes.c_void_p))
            _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0), "seccomp")
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGALRM, signal.SIGQUIT):
            signal.signal(signum, signal.SIG_DFL)
        env: dict[str, str] = spec["env"]
        argv: list[str] = spec["argv"]
        if not spec["runpy"]:
            for signum in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT):  # exec keeps ignored ones
                signal.signal(signum, signal.SIG_DFL)
            os.execvpe(argv[0], argv, env)
    except BaseException as exc:
        os.write(2, f"fleetless: cannot run {spec['argv'][0]}: {exc}\n".encode())
        os._exit(127)
    _run_python(argv[1:], env)


#: Longest handler script the server compiles ahead (bigger ones are compiled by their job).
_MAX_SCRIPT = 256 * 1024
#: Handler scripts compiled once at the server's start, by path: a job runs the code object instead
#: of compiling its script again (a job's compile copies the compiler's memory pages from the
#: server: ~90 page faults and 0.4 ms for a two-line handler, more for a longer one). The
#: handlers are the server's read-only snapshot, and the server is replaced when they change.
_compiled: dict[str, CodeType] = {}


def compile_scripts(folder: str) -> None:
    """Compile the top-level ``.py`` files of ``folder`` as ``python3 FILE`` would (no inherited
    ``__future__`` flags). One that cannot be read or compiled, or whose compiling warns (a warning
    ``python3`` would print on every run, to the job's stderr), is left to its job, which then
    compiles it as ``python3`` would; nothing of one script keeps the server from starting."""
    import warnings

    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return
    for name in names:
        path = f"{folder}/{name}"
        if not name.endswith(".py"):
            continue
        try:
            st = os.stat(path)
            if not (stat.S_ISREG(st.st_mode) and st.st_size <= _MAX_SCRIPT):
                continue
            with open(path, "rb") as f, warnings.catch_warnings():
                warnings.simplefilter("error")
                _compiled[path] = compile(f.read(), path, "exec", dont_inherit=True)
        except Exception:  # SyntaxError, a warning, RecursionError, MemoryError: left to its job
            continue


def _run_script(script: str) -> None:
    """``runpy.run_path(script, run_name="__main__")``, from the server's code object if it has one
    (runpy's own steps for a file: a fresh ``__main__`` module, ``sys.argv[0]``, its globals)."""
    import runpy

    code = _compiled.get(script)
    run_code = getattr(runpy, "_run_module_code", None)
    if code is None or run_code is None:
        runpy.run_path(script, run_name="__main__")
    else:
        run_code(code, None, "__main__", pkg_name="", script_name=script)


def _run_python(argv: list[str], env: dict[str, str]) -> None:
    """``python3 SCRIPT ARGS...`` in this already started interpreter: ``__main__``, ``sys.argv``,
    ``sys.path[0]``, the environment, exit codes, atexit, SIGINT's KeyboardInterrupt."""
    import atexit

    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as a fresh interpreter sets them
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = list(argv)
    script = argv[0]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    atexit._clear()
    code = 0
    try:
        _run_script(script)
    except SystemExit as exc:
        code = _exit_code(exc)
    except KeyboardInterrupt:
        _finish()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 130
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    code = _finish() or code
    os._exit(code)


def _exit_code(exc: SystemExit) -> int:
    value = exc.code
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    try:
        sys.stderr.write(f"{value}\n")
    except Exception:
        pass
    return 1


def _finish() -> int:
    """What the interpreter does at exit: join non-daemon threads, run atexit, flush. Returns 120
    where flushing stdout failed (as Python does)."""
    import atexit

    threading = sys.modules.get("threading")
    if threading is not None:
        try:
            threading._shutdown()
        except BaseException:
            pass
    atexit._run_exitfuncs()
    code = 0
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:
            code = 120 if stream is sys.stdout else code
    return code


def job_init(sock: socket.socket, network: bool, seccomp: bytes | None) -> None:
    """The job's init: set up, read the spec, fork the job, wait, report. Never returns."""
    try:
        _prepare(network)
    except BaseException as exc:
        failed: BaseException | None = exc
    else:
        failed = None
    try:
        sock.send(b"ready" if failed is None else f"error {type(failed).__name__}: {failed}".encode())
    except OSError:
        os._exit(0)
    msg, fds, _, _ = socket.recv_fds(sock, _MAX_MSG, 3)
    if not msg or len(fds) != 3:
        os._exit(0)  # the drainer gave this sandbox up before its job (or died)
    out_fd, err_fd, status_fd = fds
    try:
        if failed is not None:
            raise failed
        spec = json.loads(msg)
        if spec["network"] != network:
            raise ValueError("a job with another network setting than its server's")
        _mount_job(spec)
        if spec.get("own"):  # a non-root drainer cannot chown to the job's uid: ns-root here can
            _give(spec["uid"], spec["gid"], (out_fd, err_fd))
        pid = os.fork()
    except BaseException as exc:
        os.write(status_fd, f"error {type(exc).__name__}: {exc}\n".encode())
        os._exit(1)
    if pid == 0:
        try:
            sock.close()
            os.close(status_fd)
            _run_job(spec, out_fd, err_fd, seccomp)
        finally:
            os._exit(127)
    os.close(out_fd)
    os.close(err_fd)

    def overdue(signum: int, frame: object) -> None:  # the wait below then reports the kill
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGALRM, overdue)
    signal.setitimer(signal.ITIMER_REAL, max(float(spec["deadline"]), 0.001))
    while True:  # as pid 1, every orphan of the job is ours to reap too
        try:
            got, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(1)
        if got == pid:
            break
    os.set_blocking(status_fd, False)
    try:
        os.write(status_fd, f"status {status}\n".encode())
    except OSError:
        pass
    os._exit(0)  # and the kernel kills whatever is left in the pid namespace


# -- the server ---------------------------------------------------------------------------------
def _fork_job(ctl: socket.socket, own_pidns: int, fds: list[int], network: bool,
              seccomp: bytes | None) -> int | None:
    job_fd, cgroup_fds = fds[0], fds[1:]
    try:
        _unshare(CLONE_NEWPID)
        try:
            pid = os.fork()
        except OSError:
            pid = -1
            raise
        finally:  # (the server may be pid 1 of a namespace of its own: it tells itself by pid)
            if pid != 0 and _libc.setns(own_pidns, CLONE_NEWPID) != 0:
                os._exit(70)  # later children must not land in this job's namespace
    except OSError as exc:
        for fd in fds:
            os.close(fd)
        ctl.send(f"error cannot fork: {exc}".encode())
        return None
    if pid == 0:
        try:
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            ctl.close()
            os.close(own_pidns)
            for fd in cgroup_fds:  # into the job's cgroups before anything of it runs
                os.write(fd, b"0")
                os.close(fd)
            sock = socket.socket(fileno=job_fd)
        except BaseException as exc:
            os.write(2, f"fleetless fork server: job init: {exc}\n".encode())
            os._exit(1)
        try:
            job_init(sock, network, seccomp)
        finally:  # job_init never returns; an exception must not go on as a second server
            import traceback

            traceback.print_exc()
            os._exit(1)
    for fd in fds:
        os.close(fd)
    pidfd = os.pidfd_open(pid)
    try:
        socket.send_fds(ctl, [f"ok {pid}".encode()], [pidfd])
    finally:
        os.close(pidfd)
    return pid


def _reap(children: set[int], block: bool = False) -> None:
    while children:
        try:
            pid, _ = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            children.clear()
            return
        if pid == 0:
            return
        children.discard(pid)


def serve(config: dict) -> None:  # type: ignore[type-arg]
    global _USERNS
    ctl = socket.socket(fileno=int(config["ctl"]))
    _USERNS = bool(config.get("userns"))
    seccomp: bytes | None = None
    try:
        for name in config["prewarm"]:
            try:
                __import__(name)
            except ImportError:
                pass
        if config["seccomp"]:
            with open(config["seccomp"], "rb") as f:
                seccomp = f.read()
        own_pidns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)  # before /proc goes
        build_root(config)
        if config.get("scripts"):
            compile_scripts(config["scripts"])
    except BaseException as exc:
        ctl.send(f"error {type(exc).__name__}: {exc}".encode())
        os._exit(1)
    keep = sorted({ctl.fileno(), own_pidns})  # and 0-2: /dev/null (or a debug file for stderr)
    for low, high in zip([3, *(k + 1 for k in keep)], [*keep, 1 << 20]):  # noqa: B905 (3.9 has no strict)
        if high > low:
            os.closerange(low, high)
    import gc

    gc.collect()
    gc.freeze()  # never traversed again: a job's collections copy none of the server's pages
    ctl.send(b"ready")
    children: set[int] = set()
    while True:
        msg, fds, _, _ = socket.recv_fds(ctl, 64, 16)
        _reap(children)
        if not msg:
            for fd in fds:
                os.close(fd)
            break
        if msg == b"fork" and fds:
            pid = _fork_job(ctl, own_pidns, fds, bool(config["network"]), seccomp)
            if pid is not None:
                children.add(pid)
            continue
        for fd in fds:
            os.close(fd)
        ctl.send(b"error unknown request")
    # The drainer closed the socket: retired (no job left) or dead (kill what is left)
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _reap(children, block=True)
    os._exit(0)


def main(ctl: int) -> None:
    """Started as ``python -s -`` (nothing of its configuration on its command line, which every
    job sees as ``/proc/1/cmdline``): the configuration is the first message on ``ctl``."""
    del sys.path[0]  # "" (the code came on stdin): a handler gets its own directory instead
    null = os.open(os.devnull, os.O_RDONLY)  # stdin was the code's pipe: /dev/null, as before
    os.dup2(null, 0)
    os.close(null)
    sock = socket.socket(fileno=ctl)
    try:
        config = json.loads(sock.recv(1 << 22))
    finally:
        sock.detach()
    config["ctl"] = ctl
    serve(config)
