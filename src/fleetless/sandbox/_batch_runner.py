"""The in-sandbox batch runner: many jobs of one kind in one sandbox, one result line each.

The drainer writes this file and ``batch.json`` into a sandbox's workspace and runs
``python _fleetless_batch.py batch.json`` there, on every tier alike. In watch mode a spare
sandbox's runner starts ahead with a named pipe instead and reads the batch from it when jobs
come (see ``read_batch``). It uses the standard
library only (it must not import ``fleetless``: the sandbox's python may not have it)::

    {"handler": "/handlers/kind.py", "module": true, "argv": ["/usr/bin/python3", "/handlers/kind.py"],
     "budget": 880.0, "grace": 2.0, "stdout_bytes": 65536, "stderr_bytes": 2000, "kind": "kind",
     "jobs": [{"id": 7, "attempt": 1, "timeout": 10.0, "not_after": 5123.4, "payload": {...}}, ...]}

``not_after`` (optional): the last moment the job may start, on the host's ``time.monotonic()``
clock (its lease end less its timeout). A job reached at or after it is not started (its lease
may pass to another drainer while it runs, this one being stopped): the runner writes
``{"i": N, "late": true}`` and exits.

The process's own environment is what every job of the batch shares; each job adds what is its
own: FLEETLESS_JOB_ID, FLEETLESS_ATTEMPT and FLEETLESS_KIND (the batch's kind).

``module``: the handler defines ``handle(payload)``. It is imported once and called once per
job in this process, so a tiny job costs a function call; ``handle``'s return value is the job's
result (JSON). A per-job timer (SIGALRM) raises in ``handle`` at the job's timeout; a job stuck
where no signal reaches it (a long C call) is stopped by faulthandler's watchdog, which exits
this process a little later. Otherwise the handler is a script or executable: each job runs as
its own process (own process group, killed with its leftovers after the job) with the payload
in ``payload.json``, as in per-job mode.

Results go to stdout, one JSON line per job, in order, written as soon as the job ends::

    {"i": 0, "ok": true, "result": ...}                                 (module; the result last)
    {"i": 1, "ok": false, "error": "ValueError: ...", "duration": ...}  (module)
    {"i": 2, "exit": 0, "stdout": "...", "stderr": "...", "killed": null, "duration": ...}

A job that takes this process down (os._exit, a segfault, the memory limit, the watchdog) leaves
no line: the host charges the first job without one and runs the rest in a fresh sandbox. The
runner starts no job that could not finish within ``budget`` seconds of its own start (the
sandbox's TTL): it exits 0 and the host runs the rest elsewhere, charging nobody.
"""

from __future__ import annotations

import faulthandler
import importlib.util
import json
import os
import signal
import stat
import sys
import time
from typing import Any

# subprocess and traceback are imported where they are used (scripts, a failed job): a batch of
# handle() jobs that all return does not pay for them at each sandbox's start.

#: The error text kept for a failed job (as the queue's MAX_ERROR_CHARS).
ERROR_CHARS = 2000
#: Largest JSON result of handle(), in bytes (as the queue's MAX_RESULT_CHARS).
RESULT_BYTES = 64 * 1024


class JobTimeout(BaseException):
    """Raised in handle() at the job's timeout (BaseException: ``except Exception`` in a handler
    does not swallow it)."""


def _on_alarm(signum: int, frame: object) -> None:
    raise JobTimeout()


def describe_exception(exc: BaseException) -> str:
    """The exception's own line first, then the tail of the traceback, within ERROR_CHARS."""
    import traceback

    head = "".join(traceback.format_exception_only(type(exc), exc)).strip().splitlines()
    first = (head[-1] if head else type(exc).__name__)[:500]
    tail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()
    room = ERROR_CHARS - len(first) - 1
    return f"{first}\n{tail[-room:]}" if room > 0 else first


def _fmt(seconds: float) -> str:
    return f"{seconds:g}"


class Output:
    """The result channel: the process's real stdout, kept on a private fd. fd 1 and 2 both become
    the runner's stderr, so a handler's print() cannot corrupt the records."""

    def __init__(self) -> None:
        self.fd = os.dup(1)
        os.dup2(2, 1)
        sys.stdout = sys.stderr

    def send(self, record: dict[str, Any]) -> None:
        self.write(json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n")

    def write(self, line: str) -> None:
        data = line.encode("utf-8", "replace")
        while data:
            n = os.write(self.fd, data)
            data = data[n:]


def _arm_watchdog(seconds: float) -> None:
    """``faulthandler.dump_traceback_later``, which starts a thread: retried for up to 10 s while
    the uid's process limit leaves no room for one (a fork bomb's last copies, each exiting as
    its fork fails, still hold it just after its job). Raising here would take the runner down
    and charge the next job, which did nothing wrong."""
    give_up = time.monotonic() + 10.0
    while True:
        try:
            faulthandler.dump_traceback_later(seconds, exit=True)
            return
        except RuntimeError:
            if time.monotonic() >= give_up:
                raise
            time.sleep(0.02)


def _become_subreaper() -> bool:
    """Orphans of the jobs' processes come to this runner (not to the sandbox's init), so that
    :func:`_end_leftovers` finds them. False where prctl cannot be reached (a guest without
    ctypes): leftovers are then also found by their process group."""
    try:
        import ctypes

        return bool(ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0)  # PR_SET_CHILD_SUBREAPER
    except Exception:  # a guest without ctypes
        return False


def _stat(pid: str) -> tuple[int, int]:
    """(parent pid, process group) of a process, from ``/proc/<pid>/stat``."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    fields = stat[stat.rindex(b")") + 2:].split()
    return int(fields[1]), int(fields[2])


def _self_and_ancestors(me: int) -> frozenset[int]:
    """This runner and the processes above it, which may share its process group (a shell, the
    guest's agent) and are never a job's leftovers; they do not change during a batch."""
    keep = {me}
    pid = me
    while pid > 1:
        try:
            pid = _stat(str(pid))[0]
        except (OSError, ValueError, IndexError):
            break
        keep.add(pid)
    return frozenset(keep)


def _end_leftovers(me: int, subreaper: bool, keep: frozenset[int], within: float = 5.0) -> None:
    """Kill every process a module job left behind (its forks, a fork bomb's copies, their
    children) before the next job starts: a job's processes die with the job, and must not take
    the sandbox down (or hold its pids limit) while a neighbour runs. As a subreaper with no child
    at all this is one ``waitpid``; otherwise ``/proc`` is scanned for this runner's children
    (orphans come to it) and, without a subreaper, for the other members of its process group
    that are not its ancestors, until none is left, at most ``within`` seconds."""
    if subreaper:
        try:
            os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return  # no child, so no descendant: the common case
    group = os.getpgrp()
    give_up = time.monotonic() + within
    while True:
        found = False
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) in keep:
                continue
            try:
                parent, pgrp = _stat(name)
                if parent == me or (not subreaper and pgrp == group):
                    found = True
                    os.kill(int(name), signal.SIGKILL)
            except (OSError, ValueError, IndexError):
                continue  # gone already
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            if subreaper:
                return
        if not found or time.monotonic() >= give_up:
            return
        time.sleep(0.001)


def _late(job: dict[str, Any], out: Output, i: int) -> bool:
    """Whether it is too late to start the job (``not_after``, the host's monotonic clock): it
    could run on past its lease, when another drainer may run it. Reported as not started; the
    runner stops."""
    end = job.get("not_after")
    if end is None or time.monotonic() < end:
        return False
    out.send({"i": i, "late": True})
    return True


def run_modules(desc: dict[str, Any], out: Output, started: float) -> None:
    handler = desc["handler"]
    jobs = desc["jobs"]
    grace = float(desc.get("grace", 2.0))
    budget = float(desc.get("budget", 1e9))
    longest = max(float(j["timeout"]) for j in jobs)
    handle = None
    import_error = None
    sys.path[0] = os.path.dirname(handler)  # as when the file runs as a script
    try:
        spec = importlib.util.spec_from_file_location("fleetless_handler", handler)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["fleetless_handler"] = module
        spec.loader.exec_module(module)
        handle = getattr(module, "handle", None)
        if not callable(handle):
            raise TypeError(f"{handler} has no callable handle(payload)")
    except BaseException as exc:  # the import fails for every job alike: each job's failure
        import_error = "cannot import the handler: " + describe_exception(exc)
    me = os.getpid()
    subreaper = _become_subreaper()
    keep = _self_and_ancestors(me)
    encode = json.JSONEncoder(allow_nan=False, separators=(",", ":")).encode  # built once, not per job
    environ = os.environ
    environ["FLEETLESS_KIND"] = desc["kind"]
    signal.signal(signal.SIGALRM, _on_alarm)
    armed_at = -10.0
    attempt_was: str | None = None
    for i, job in enumerate(jobs):
        timeout = float(job["timeout"])
        now = time.monotonic()
        if i and now - started + timeout + grace > budget:
            return
        if import_error is not None:
            out.send({"i": i, "ok": False, "error": import_error, "duration": 0.0})
            continue
        if now - armed_at > 1.0:
            # The hard stop, re-armed at most once a second (each arm starts a thread): it fires
            # no earlier than timeout + grace after any job's start, and at most 1 s later.
            _arm_watchdog(longest + grace + 1.0)
            armed_at = now
        if i:
            _end_leftovers(me, subreaper, keep)  # what the previous job forked dies before this one starts
        if _late(job, out, i):
            return
        environ["FLEETLESS_JOB_ID"] = str(job["id"])
        attempt = str(job["attempt"])
        if attempt != attempt_was:  # most jobs of a batch are at the same attempt: one putenv less
            environ["FLEETLESS_ATTEMPT"] = attempt_was = attempt
        t0 = time.monotonic()
        try:
            signal.setitimer(signal.ITIMER_REAL, timeout)
            try:
                value = handle(job["payload"])  # type: ignore[misc]
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            if os.getpid() != me:  # a fork of this runner made by the job: never report twice
                os._exit(0)
            text = "null" if value is None else encode(value)  # most jobs return nothing
            if len(text) > RESULT_BYTES:  # ASCII: json.dumps escapes the rest
                raise ValueError(f"handle() returned {len(text)} characters of JSON; results are capped "
                                 f"at {RESULT_BYTES} bytes")
            # the result last, as json.dumps wrote it: the host takes it without decoding the line
            out.write(f'{{"i":{i},"ok":true,"result":{text}}}\n')
            continue
        except JobTimeout:
            if os.getpid() != me:
                os._exit(0)
            error = f"killed: timeout after {_fmt(timeout)} s"
        except BaseException as exc:  # SystemExit and KeyboardInterrupt too: the job's own doing
            if os.getpid() != me:
                os._exit(0)
            error = describe_exception(exc)
        out.send({"i": i, "ok": False, "error": error, "duration": time.monotonic() - t0})
    faulthandler.cancel_dump_traceback_later()


def _own_env(desc: dict[str, Any], job: dict[str, Any]) -> dict[str, str]:
    return {"FLEETLESS_JOB_ID": str(job["id"]), "FLEETLESS_ATTEMPT": str(job["attempt"]),
            "FLEETLESS_KIND": desc["kind"]}


def _head(path: str, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", "replace")


def _tail(path: str, limit: int) -> str:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - limit))
        return f.read().decode("utf-8", "replace")


def run_scripts(desc: dict[str, Any], out: Output, started: float) -> None:
    import subprocess

    argv0 = list(desc["argv"])
    budget = float(desc.get("budget", 1e9))
    grace = float(desc.get("grace", 2.0))
    stdout_bytes = int(desc.get("stdout_bytes", RESULT_BYTES))
    stderr_bytes = int(desc.get("stderr_bytes", ERROR_CHARS))
    cwd = os.getcwd()
    payload_path = os.path.join(cwd, "payload.json")
    out_path, err_path = os.path.join(cwd, ".job-stdout"), os.path.join(cwd, ".job-stderr")
    for i, job in enumerate(desc["jobs"]):
        timeout = float(job["timeout"])
        if i and time.monotonic() - started + timeout + grace > budget:
            return
        with open(payload_path, "w") as f:
            json.dump(job["payload"], f)
        if _late(job, out, i):
            return
        t0 = time.monotonic()
        killed = None
        with open(out_path, "wb") as fo, open(err_path, "wb") as fe:
            try:
                proc = subprocess.Popen([*argv0, payload_path], stdin=subprocess.DEVNULL, stdout=fo, stderr=fe,
                                        env={**os.environ, **_own_env(desc, job)}, start_new_session=True,
                                        cwd=cwd)
            except OSError as exc:
                out.send({"i": i, "exit": 127 if isinstance(exc, FileNotFoundError) else 126, "stdout": "",
                          "stderr": f"cannot execute {argv0[0]}: {exc.strerror or exc}", "killed": None,
                          "duration": 0.0})
                continue
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                killed = f"killed: timeout after {_fmt(timeout)} s"
                code = None
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the job's leftovers go with it
            except OSError:
                pass
            if code is None:
                code = proc.wait()
        out.send({"i": i, "exit": code, "stdout": _head(out_path, stdout_bytes),
                  "stdout_cut": os.path.getsize(out_path) > stdout_bytes,
                  "stderr": _tail(err_path, stderr_bytes), "killed": killed, "duration": time.monotonic() - t0})
        for path in (out_path, err_path, payload_path):
            try:
                os.unlink(path)
            except OSError:
                pass


def read_batch(path: str) -> Any:
    """The batch: a file, or in a spare sandbox (watch mode) a named pipe on which the drainer
    writes it as one line when jobs come. The pipe is opened read-write, which never blocks and
    shows (as an open fd) that the runner is waiting."""
    if not stat.S_ISFIFO(os.stat(path).st_mode):
        with open(path) as f:
            return json.load(f)
    with os.fdopen(os.open(path, os.O_RDWR), "rb") as pipe:
        return json.loads(pipe.readline())


def main() -> None:
    started = time.monotonic()  # a spare's waiting counts against its budget (the sandbox's TTL)
    desc = read_batch(sys.argv[1])
    os.unlink(sys.argv[1])
    out = Output()
    if desc["module"]:
        run_modules(desc, out, started)
    else:
        run_scripts(desc, out, started)


if __name__ == "__main__":
    main()
