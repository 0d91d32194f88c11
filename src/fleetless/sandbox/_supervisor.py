"""Supervisor of one process-tier job. Runs as its own small program (``python -I -S``).

It is the job's parent and a child subreaper, so every descendant of the job, even one that
called setsid() and double-forked, is re-parented to it and can be found and killed. It dies
with the drainer (parent-death signal), and then kills the job's whole tree and removes the
workspace on its way out. It reports the job's wait status on a pipe (STATUS_FD) as one line,
``status N``; the drainer treats anything else there as the job's own failure (a job running as
the drainer's uid can write into that pipe through /proc). It also kills the job DEADLINE seconds
after its start by itself, so a job never outlives its lease even when the drainer is stopped
(SIGSTOP, a frozen VM) and cannot kill it at its timeout.

Usage (kept to argv and the inherited environment and cwd, so start-up imports almost nothing):
    python -I -S _supervisor.py STATUS_FD WORKSPACE RLIMITS CREDS WAIT DEADLINE -- ARGV...
where RLIMITS is "RLIMIT_AS=n,RLIMIT_CPU=n,..." (or "-"), CREDS is "UID:GID" for the job to run as
(or "-": the supervisor's own), WAIT is "wait" when the supervisor must first read one byte on
its stdin (the drainer puts it into the job's cgroups meanwhile) or "-", and DEADLINE a number of
seconds. The job gets this process's environment and working directory, and /dev/null as its stdin.
"""

import ctypes
import os
import resource
import signal
import sys

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
_libc = ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, value: int) -> None:
    if _libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl failed")


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


def _kill_tree() -> None:
    """SIGKILL and reap every descendant until none is left (forks racing the kill included)."""
    for _ in range(100):
        pids = _descendants()
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
    """The drainer's own symlink-safe, recursion-free removal (loaded from beside this file only
    when needed, so the supervisor's start-up stays small)."""
    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location(
        "_fleetless_workspace", os.path.join(os.path.dirname(os.path.abspath(__file__)), "_workspace.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.remove(pathlib.Path(workspace))


def main() -> None:
    status_fd, workspace, rlimits_arg, creds, wait, deadline, sep, *argv = sys.argv[1:]
    assert sep == "--" and argv, "usage: STATUS_FD WORKSPACE RLIMITS CREDS WAIT DEADLINE -- ARGV..."
    rlimits = [item.split("=") for item in rlimits_arg.split(",")] if rlimits_arg != "-" else []
    uid, gid = (int(x) for x in creds.split(":")) if creds != "-" else (-1, -1)

    def die(signum: int, frame: object) -> None:
        # Once only: a multi-threaded drainer's death can deliver the parent-death signal twice
        # (the child is re-parented to a sibling thread first), and a second run of this handler
        # inside the first one broke its lazy import, leaving the workspace behind.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        _kill_tree()
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

    fd = int(status_fd)
    pid = os.fork()
    if pid == 0:
        try:
            os.close(fd)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.close(null)
            os.setsid()
            if uid >= 0:
                os.setgroups([])
                os.setresgid(gid, gid, gid)
                os.setresuid(uid, uid, uid)
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after setresuid, which clears it
            for name, value in rlimits:
                limit = int(value)
                # CPU: the soft limit sends SIGXCPU (nameable); the hard one, a second later, SIGKILL.
                hard = limit + 1 if name == "RLIMIT_CPU" else limit
                resource.setrlimit(getattr(resource, name), (limit, hard))
            # Python ignores SIGPIPE and SIGXFSZ, and exec keeps ignored signals: restore them.
            for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE, signal.SIGXFSZ):
                signal.signal(signum, signal.SIG_DFL)
            os.execvp(argv[0], argv)
        except BaseException as exc:  # report an exec failure the shell's way
            os.write(2, f"fleetless: cannot run {argv[0]}: {exc}\n".encode())
            os._exit(127)

    def overdue(signum: int, frame: object) -> None:  # the wait below then reports the kill
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGALRM, overdue)
    signal.setitimer(signal.ITIMER_REAL, max(float(deadline), 0.001))
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    _kill_tree()  # whatever the job left behind dies with it
    os.set_blocking(fd, False)  # a pipe the job filled through /proc must not hang us
    try:
        os.write(fd, f"status {status}\n".encode())
    except OSError:
        pass  # the drainer reads the job's failure from what is there
    os.close(fd)


if __name__ == "__main__":
    main()
