"""The in-sandbox batch runner: many jobs of one kind in one sandbox, each in a process of its own.

The drainer writes this file into a sandbox's workspace and runs ``python _fleetless_batch.py IN
[OUT]`` there, on every tier alike. It uses the standard library only (it must not import
``fleetless``: the sandbox's python may not have it). It speaks in JSON lines:

- IN carries a header, then one job per line::

    {"handler": "/handlers/kind.py", "module": true, "argv": ["/usr/bin/python3", "/handlers/kind.py"],
     "budget": 880.0, "grace": 2.0, "stdout_bytes": 65536, "stderr_bytes": 2000, "kind": "kind"}
    {"id": 7, "attempt": 1, "timeout": 10.0, "not_after": 5123.4, "tag": "9f1c...", "payload": {...}}

  ``not_after`` (optional): the last moment the job may start, on the host's ``time.monotonic()``
  clock (its lease end less its timeout); in a microVM's guest, whose clock is its own,
  ``start_within``: seconds from the runner's start instead. A job reached at or after it is not started (its lease
  may pass to another drainer while it runs, this one being stopped): the runner answers
  ``{"tag": TAG, "late": true}`` and exits.

- each job's result goes back as one line, tagged with the job's own random tag::

    {"tag": "9f1c...", "ok": true, "result": ...}                      (module; the result last)
    {"tag": "...", "ok": false, "error": "ValueError: ...", "stdout": "...", "stderr": "..."}
    {"tag": "...", "ok": false, "decided": {"decided": "snooze", "seconds": 30, "reason": "..."}, ...}
                                   (module: it raised fleetless.outcomes' Discard, Snooze or Retry)
    {"tag": "...", "ok": false, "too_large": 70001, "stdout": "...", "stderr": "..."}
                                   (module: its result was 70001 bytes of JSON, past RESULT_BYTES)
    {"tag": "...", "ok": false, "not_json": "set: Object of type set is not JSON serializable", ...}
                                   (module: it returned a value JSON cannot hold)
    {"tag": "...", "exit": 0, "stdout": "...", "stderr": "...", "killed": null, "duration": ...}

**Channel mode** (IN and OUT are named pipes, process and bwrap tiers): the drainer holds both
pipes open before the runner starts; the runner opens them, unlinks them, and makes itself
non-dumpable, so no job can open them again (by path, or through ``/proc/<runner>/fd``). The
drainer sends a job only when the one before it has ended and its leftovers are dead, so no job
ever sees another's payload; a line ``{"cancel": TAG}`` kills the job running with that tag.
**File mode** (IN is a file, tiers whose workspace is a copy: microvm, forkserver): every job is
in IN, which the runner unlinks before the first job starts; results go to stdout. SIGUSR1 (from
the drainer: a job after the one running was cancelled) makes the runner start no other job once
the one running has ended: it exits 0 and the host runs the rest, the cancelled one left out, in a
fresh sandbox.

Each job runs in a fork of the runner's *template* (``handle(payload)`` modules: the module is
imported once, before the template is forked; scripts: the fork execs the handler with
``payload.json``). The template is forked right after the import, when the runner has read nothing
but the header, and never reads a job's line, payload or result: on the runner's request (a
message on a ``SOCK_SEQPACKET`` socket carrying the job's pipes) it forks the job's process, sends
back its pid (and a pidfd), waits for it, kills what it left (it is a child subreaper too) and
sends its wait status. The job's process reads its own line from a pipe the runner writes, and
nothing else of the batch: no job starts from memory that held another job's payload or result,
which the runner's own memory does (``tests/test_batch_isolation.py``). A job that kills the
template ends the batch after itself (the runner, its subreaper, reaps and kills what is left; the
rest run elsewhere, uncharged). Each job runs in its own process group, in a directory of its own
(its cwd and TMPDIR), its stdout and stderr pipes that
only its own processes hold (the runner reads them as the job runs: no file per job to write, read
and remove). The runner enforces the timeout from outside (SIGKILL of the job's
group); the template then kills every process the job left (it is a child subreaper: setsid
daemons included) and checks none is left before the runner writes the result. A job that dies
(os._exit, a segfault) is
charged alone; the runner goes on. The runner starts no job that could not finish within
``budget`` seconds of its own start (the sandbox's TTL): it exits 0 and the host runs the rest
elsewhere, charging nobody.

**Shared mode** (the header's ``"shared": true``: a kind's ``batch_isolation = "shared"``, for
trusted code, handle() modules only): no template and no fork. Each job runs in this runner's own
process, one after another, as a call of ``handle(payload)``, in a directory of its own (its cwd,
HOME and TMPDIR), its ``print()`` output (sys.stdout and sys.stderr, not fd 1 and 2) kept as its
own. A timer (SIGALRM) raises :class:`JobTimeout` in handle() at its timeout: the job is reported
``killed: timeout`` and the runner starts no other job (the rest go on in a fresh sandbox: what a
stopped job left, a thread, a lock held, stays in this process). A job that switches the timer off
is stopped from outside by the drainer, which destroys the sandbox past the job's timeout. The
processes a job left are killed after it (the runner is a subreaper); its threads, its changes to
modules and to this process's memory are not undone: they reach the later jobs of its batch
(docs/isolation.md, "Shared batches").

A handle() imports ``fleetless.outcomes`` wherever it runs: when the sandbox's python has no such
module, this runner serves the copy of it that fleetless.batch put in ``OUTCOMES_SOURCE``.
"""

from __future__ import annotations

import gc
import importlib.util
import io
import json
import os
import select
import signal
import socket
import stat
import sys
import time
from typing import Any

#: The error text kept for a failed job (as the queue's MAX_ERROR_CHARS).
ERROR_CHARS = 2000
#: Largest JSON result of handle(), in bytes (as the queue's MAX_RESULT_CHARS).
RESULT_BYTES = 64 * 1024
PR_SET_PDEATHSIG, PR_SET_NAME, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER = 1, 15, 4, 36
#: The runner's name (its /proc/<pid>/comm), by which the drainer finds it to signal it: on the fork
#: server's tier it runs without an exec of its own, under the server's command line.
NAME = b"fleetless-batch"
#: fleetless/outcomes.py's text, put here by fleetless.batch when it writes this file into a
#: sandbox: served as ``fleetless.outcomes`` where the sandbox's python has no such module.
OUTCOMES_SOURCE = ""
#: Shared mode's directory in the workspace: every job's cwd, HOME and TMPDIR, emptied between jobs.
SHARED_HOME = "job-shared"
#: The exceptions of fleetless.outcomes a handle() raises to decide its job's outcome, by name.
DECISIONS = ("Discard", "Snooze", "Retry")


class _OutcomesShim:
    """A finder (last on ``sys.meta_path``) for ``fleetless.outcomes`` where no ``fleetless``
    package has one: a python without fleetless (a microVM guest, the system's) or an older
    fleetless. The installed package, when it has the module, is found first and used."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        import importlib.machinery

        loader: Any = self
        if name == "fleetless":
            return importlib.machinery.ModuleSpec(name, loader, is_package=True)
        if name == "fleetless.outcomes":
            return importlib.machinery.ModuleSpec(name, loader, origin="fleetless-batch-runner")
        return None

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: Any) -> None:
        if module.__name__ == "fleetless":
            module.__path__ = []
        else:
            exec(compile(OUTCOMES_SOURCE, "fleetless/outcomes.py", "exec"), module.__dict__)


def _number(value: Any) -> Any:
    """A decision's seconds as JSON can carry them: a finite number, None, or a short text the
    drainer refuses (with a one-line error) for anything else."""
    if hasattr(value, "total_seconds"):
        value = value.total_seconds()
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            value = float(value)
        except OverflowError:  # an int past any float
            return "an integer too large"
        if value == value and value not in (float("inf"), float("-inf")):
            return value
    try:
        return repr(value)[:80]
    except Exception:
        return type(value).__name__


def decision(exc: BaseException) -> dict[str, Any] | None:
    """What a handle() decided by raising fleetless.outcomes' Discard, Snooze or Retry (or a
    subclass), recognised by name (the installed module and the shim alike); None: an error."""
    for cls in type(exc).__mro__:
        if cls.__module__ == "fleetless.outcomes" and cls.__name__ in DECISIONS:
            what = cls.__name__.lower()
            seconds = getattr(exc, "seconds", None) if what == "snooze" else getattr(exc, "after", None)
            return {"decided": what, "seconds": _number(seconds), "reason": str(getattr(exc, "reason", ""))[:500]}
    return None


def describe_exception(exc: BaseException) -> str:
    """The exception's own line first, then the tail of the traceback, within ERROR_CHARS."""
    import traceback

    head = "".join(traceback.format_exception_only(type(exc), exc)).strip().splitlines()
    first = (head[-1] if head else type(exc).__name__)[:500]
    # The runner's own frames are cut (as runpy's are): Python would print their lines from this
    # file in the batch's workspace, which an earlier job of the batch may have rewritten (red team)
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == describe_exception.__code__.co_filename:
        tb = tb.tb_next
    tail = "".join(traceback.format_exception(type(exc), exc, tb)).rstrip()
    room = ERROR_CHARS - len(first) - 1
    return f"{first}\n{tail[-room:]}" if room > 0 else first


def _fmt(seconds: float) -> str:
    return f"{seconds:g}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


def _prctl(option: int, value: int | bytes) -> bool:
    try:
        import ctypes

        return bool(ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0)
    except Exception:  # a guest without ctypes
        return False


def _children(me: int) -> list[int]:
    """This runner's children, from ``/proc`` (orphans of the jobs come to it: it is a subreaper)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                st = f.read()
            if int(st[st.rindex(b")") + 2:].split()[1]) == me:
                out.append(int(name))
        except (OSError, ValueError, IndexError):
            continue
    return out


def _reap() -> bool:
    """Reap every child that has exited; False when this runner has no child at all."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        return False
    return True


def _processes_of(uid: int, spared: set[int]) -> list[int]:
    """The live processes (not zombies) running as ``uid``, from ``/proc``, but ``spared``."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in spared:
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                fields = dict(line.split(b":", 1) for line in f.read().splitlines() if b":" in line)
            if fields[b"State"].split()[0] != b"Z" and uid in (int(n) for n in fields[b"Uid"].split()):
                out.append(int(name))
        except (OSError, ValueError, KeyError, IndexError):
            continue
    return out


def end_leftovers(me: int, group: int | None, subreaper: bool, within: float = 10.0,
                  own_machine: bool = False) -> bool:
    """Kill the job's process group (None: a shared job's, which is this runner's own), then every
    process left as this runner's child (a daemon that called setsid() and double-forked comes back
    to it), until it has no child at all. True when none is left (always so for a subreaper that
    returns).

    Where this process cannot be a child subreaper (a guest's python without ctypes), a daemon's
    orphans go elsewhere and cannot be told by their parent: on a machine of the batch's own
    (``own_machine``: every process of this uid is the batch's) every process of this uid but this
    one and its parent is killed until none is left; anywhere else the answer is False (unknown),
    and the runner starts no other job (red team, 5th pass: on the microVM tier a job's setsid
    daemon outlived it and rewrote the next job's payload)."""
    if group is not None:
        try:
            os.killpg(group, signal.SIGKILL)
        except OSError:
            pass
    give_up = time.monotonic() + within
    if not subreaper and own_machine:
        spared = {os.getpid(), os.getppid()}
        while True:
            _reap()
            left = _processes_of(os.getuid(), spared)
            if not left:
                return True
            if time.monotonic() >= give_up:
                return False
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.001)
    while True:
        if not _reap():
            return subreaper
        for pid in _children(me):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if not subreaper:  # leftovers that were not its children cannot be seen
            _reap()
            return False
        if time.monotonic() >= give_up:
            return False
        time.sleep(0.001)


class JobTimeout(BaseException):
    """Raised in a shared job's handle() at its timeout (BaseException: ``except Exception`` in a
    handler does not swallow it)."""


def _on_alarm(signum: int, frame: object) -> None:
    raise JobTimeout()


class _Capture(io.TextIOBase):
    """A shared job's sys.stdout (its first ``head`` characters, and whether there was more) or
    sys.stderr (its last ``tail``): what it print()s, kept as its own."""

    def __init__(self, head: int = 0, tail: int = 0) -> None:
        super().__init__()
        self.head, self.tail = head, tail
        self.parts: list[str] = []
        self.size = 0
        self.cut = False

    encoding = "utf-8"  # (TextIOBase says None: some code reads sys.stdout.encoding)

    def write(self, text: str) -> int:
        text = str(text)
        if self.tail:
            self.parts.append(text)
            self.size += len(text)
            if self.size > 2 * self.tail:
                kept = "".join(self.parts)[-self.tail:]
                self.parts, self.size = [kept], len(kept)
        elif self.size < self.head:
            room = self.head - self.size
            if len(text) > room:
                self.cut, text = True, text[:room]
            self.parts.append(text)
            self.size += len(text)
        elif text:
            self.cut = True
        return len(text)

    def writable(self) -> bool:
        return True

    def text(self) -> str:
        out = "".join(self.parts)
        return out[-self.tail:] if self.tail else out


class _Output:
    """A job's stdout (its first ``head`` bytes, and whether there was more) or stderr (its last
    ``tail`` bytes), read from the pipe the job writes to as it runs, so that it never blocks on a
    full pipe; what is past the limit is read and dropped."""

    def __init__(self, fd: int, head: int = 0, tail: int = 0) -> None:
        self.fd, self.head, self.tail = fd, head, tail
        self.data = b""
        self.cut = False
        os.set_blocking(fd, False)

    def pull(self) -> bool:
        """Read what is there; False at the pipe's end (every writer gone)."""
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except BlockingIOError:
                return True
            if not chunk:
                return False
            if self.tail:
                self.data = (self.data + chunk)[-self.tail:]
            elif len(self.data) <= self.head:
                self.data += chunk
                if len(self.data) > self.head:
                    self.cut, self.data = True, self.data[:self.head]
            else:
                self.cut = True

    def text(self) -> str:
        return self.data.decode("utf-8", "replace")


def _entries(folder: str) -> dict[str, tuple[int, int]]:
    """``folder``'s entries by name: (inode, device), what tells a kept entry from a replaced one."""
    out: dict[str, tuple[int, int]] = {}
    try:
        with os.scandir(folder) as found:
            for entry in found:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                out[entry.name] = (st.st_ino, st.st_dev)
    except OSError:
        pass
    return out


def _purge(path: str) -> None:
    """Remove ``path`` and all below it, whatever modes a job gave them (no recursion: a job may
    nest thousands of directories); what cannot be removed stays."""
    stack = [(path, False)]
    while stack:
        p, emptied = stack.pop()
        try:
            st = os.lstat(p)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode):
            try:
                os.unlink(p)
            except OSError:
                pass
            continue
        if emptied:
            try:
                os.rmdir(p)
            except OSError:
                pass
            continue
        try:
            os.chmod(p, 0o700)
            names = os.listdir(p)
        except OSError:
            names = []
        stack.append((p, True))
        stack.extend((os.path.join(p, n), False) for n in names)


def _remove(path: str) -> None:
    """A job's directory: one rmdir when the job left it empty, else :func:`_purge`."""
    try:
        os.rmdir(path)
    except OSError:
        _purge(path)


class Runner:
    def __init__(self, inp: int, out: int, channel: bool) -> None:
        self.inp, self.out, self.channel = inp, out, channel
        self.buf = b""
        self.offset = 0
        self.sizes: list[int] | None = None  # file mode: each job's line's size, from the header
        self.me = os.getpid()
        self.cwd = os.getcwd()
        #: what the workspace held when the runner started (its own file): each job finds only that
        self.kept = _entries(self.cwd)
        self.handle: Any = None
        self.import_error: str | None = None
        self.desc: dict[str, Any] = {}
        self.subreaper = _prctl(PR_SET_CHILD_SUBREAPER, 1)
        self.stop = False  # SIGUSR1 came (file mode), or a job's leftovers outlived it: start no other job
        self.forked = 0  # jobs whose process the template forked
        self.jobs_usr1: Any = signal.SIG_DFL  # SIGUSR1 as the jobs get it (what the module set, if it did)
        self.header = True  # the next line read is the header
        self.template: socket.socket | None = None  # the runner's end of the template's socket
        self.template_pid = 0
        self.shared = False  # the header's "shared": every job in this process (handle() modules only)
        self.ahead: list[bytes] = []  # shared, channel mode: jobs' lines read before their turn
        self.cancels: set[str] = set()  # shared, channel mode: tags cancelled before their turn

    def _stop(self, signum: int, frame: object) -> None:
        self.stop = True

    # -- the channel -----------------------------------------------------------------------
    def read_line(self, block: bool = True) -> bytes | None:
        """The next line from IN; b"" at its end; None when not ``block`` and none is there. In
        file mode exactly one line is read (the header byte by byte, then each job by the size
        the header gives): a later job's payload is never in this process's memory before its turn.
        The header is read byte by byte in both modes: nothing of the first job is read before the
        template is forked (:meth:`start_template`)."""
        if self.header:
            self.header = False
            line = b""
            while not line.endswith(b"\n"):
                byte = os.read(self.inp, 1) if self.channel else os.pread(self.inp, 1, self.offset)
                if not byte:
                    break
                line += byte
                self.offset += 1
            return line.rstrip(b"\n")
        if not self.channel:
            if not self.sizes:
                return b""
            size = self.sizes.pop(0)
            line = os.pread(self.inp, size, self.offset)
            self.offset += size + 1
            return line
        while b"\n" not in self.buf:
            if not block and not select.select([self.inp], [], [], 0)[0]:
                return None
            data = os.read(self.inp, 65536)
            if not data:
                line, self.buf = self.buf, b""
                return line
            self.buf += data
        line, _, self.buf = self.buf.partition(b"\n")
        return line

    def next_shared(self) -> bytes:
        """Shared mode over the channel: the next job's line. The drainer sends jobs ahead of their
        turn; every line that has come is read first, so that a cancel sent for a job ahead is seen
        before its turn (noted in ``cancels``)."""
        while True:
            line = self.read_line(block=not self.ahead)
            if line is None:
                return self.ahead.pop(0)
            if line.startswith(b'{"cancel"'):
                try:
                    self.cancels.add(str(json.loads(line)["cancel"]))
                except (ValueError, KeyError, TypeError):
                    pass
                continue
            self.ahead.append(line)
            if not line:  # the end: the jobs read before it first
                return self.ahead.pop(0)

    def send(self, text: str) -> None:
        _write_all(self.out, text.encode("utf-8", "replace") + b"\n")

    # -- the jobs ---------------------------------------------------------------------------
    @property
    def own_machine(self) -> bool:
        """Every process of this uid is the batch's (a microVM guest): see :func:`end_leftovers`."""
        return self.desc.get("own_machine") is True

    def load(self, desc: dict[str, Any]) -> None:
        self.desc = desc
        if not self.channel:
            self.sizes = list(desc.get("sizes", []))
        os.environ["FLEETLESS_KIND"] = desc["kind"]
        if not desc["module"]:
            return
        self.shared = desc.get("shared") is True
        handler = desc["handler"]
        sys.path[0] = os.path.dirname(handler)  # as when the file runs as a script
        if OUTCOMES_SOURCE:
            sys.meta_path.append(_OutcomesShim())
        try:
            spec = importlib.util.spec_from_file_location("fleetless_handler", handler)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules["fleetless_handler"] = module
            spec.loader.exec_module(module)
            handle = getattr(module, "handle", None)
            if not callable(handle):
                raise TypeError(f"{handler} has no callable handle(payload)")
            self.handle = handle
        except BaseException as exc:  # the import fails for every job alike: each job's failure
            self.import_error = "cannot import the handler: " + describe_exception(exc)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()

    def run(self, started: float) -> None:
        if not self.channel:  # after the template's fork: the jobs get what the module set
            signal.signal(signal.SIGUSR1, self._stop)
            self.stop = self.stop or bool(_EARLY_STOP)
        desc = self.desc
        budget = float(desc.get("budget", 1e9))
        grace = float(desc.get("grace", 2.0))
        first = True
        while True:
            line = self.next_shared() if self.shared and self.channel else self.read_line()
            if not line:
                return
            job = json.loads(line)
            if "cancel" in job:  # for a job that has ended already
                continue
            if job.get("tag") in self.cancels:  # shared: cancelled after it was sent, before its turn
                self.send(json.dumps({"tag": job["tag"], "cancelled": True}, separators=(",", ":")))
                continue
            timeout = float(job["timeout"])
            if not first and (self.stop or time.monotonic() - started + timeout + grace > budget):
                return
            if self.import_error is None and self.template is None and not self.shared:
                return  # a job killed the template: the rest elsewhere
            first = False
            tag = str(job["tag"])
            end = job.get("not_after")
            if end is None and job.get("start_within") is not None:  # a guest's: on its own clock
                end = started + float(job["start_within"])
            if end is not None and time.monotonic() >= end:
                # too late to start: it could run on past its lease, when another drainer may run
                # it (this one being stopped). Reported as not started; the runner stops.
                self.send(json.dumps({"tag": tag, "late": True}, separators=(",", ":")))
                return
            if self.import_error is not None:
                self.send(json.dumps({"tag": tag, "ok": False, "error": self.import_error, "duration": 0.0}))
                continue
            if self.shared:
                text, timed_out = self.shared_one(job, tag, timeout)
                self.send(text)
                if timed_out:  # what it left (a thread, a lock held) stays here: the rest elsewhere
                    return
                continue
            result = self.one(job, line, tag, timeout)
            if result is None:  # the template is gone before the job started: it runs elsewhere
                return
            self.send(result)

    def home(self, job: dict[str, Any]) -> str:
        """The job's own directory (its cwd, HOME and TMPDIR)."""
        return os.path.join(self.cwd, f"job-{job['id']}-{str(job['tag'])[:12]}")

    # -- the template ------------------------------------------------------------------------
    def start_template(self) -> None:
        """Fork the template: a process that never reads a job's line, a payload or a result, and
        forks each job on the runner's request. It is forked right after the import (the header is
        all this process has read), so every job starts from memory that held no other job's
        payload or result; only the job's own process reads its line (from a pipe the runner
        writes). The template is the job's parent and a child subreaper: it waits for the job,
        kills what the job left, then says the job's wait status. It dies with the runner."""
        before = signal.getsignal(signal.SIGUSR1)  # what the module set, if it did: the jobs' own
        self.jobs_usr1 = signal.SIG_DFL if before is None or before is _early_stop else before
        if self.import_error is not None:  # no job runs: each gets the import's error
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:  # the template: it never returns
            try:
                ours.close()
                self.serve_template(theirs)
            except BaseException:
                pass
            os._exit(0)
        theirs.close()
        self.template, self.template_pid = ours, pid

    def serve_template(self, sock: socket.socket) -> None:
        _prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
        if os.getppid() != self.me:  # the runner is gone already
            return
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # the jobs get theirs back (child)
        for fd in (self.inp, self.out):  # never the channel: neither the template nor its jobs
            os.close(fd)
        subreaper = _prctl(PR_SET_CHILD_SUBREAPER, 1)
        me = os.getpid()
        while True:
            msg, fds, _, _ = socket.recv_fds(sock, 16, 4)
            if not msg or len(fds) != 4:  # the runner closed its end
                return
            try:
                pid = os.fork()
            except OSError as exc:
                for fd in fds:
                    os.close(fd)
                sock.send(b"e" + str(exc).encode("utf-8", "replace"))
                continue
            if pid == 0:  # the job's own process: it never returns
                sock.close()
                self.job_process(*fds)
            for fd in fds:
                os.close(fd)
            try:
                os.setpgid(pid, pid)  # also here: the group exists before the runner hears of it
            except OSError:
                pass
            ended: list[int] = []
            try:  # the runner watches the job's end through it (no pid reuse: this holds it)
                ended.append(os.pidfd_open(pid))
            except (AttributeError, OSError):
                pass
            socket.send_fds(sock, [b"p%d" % pid], ended)
            for fd in ended:
                os.close(fd)
            try:
                _, status = os.waitpid(pid, 0)
            except ChildProcessError:
                status = 0
            clean = end_leftovers(me, pid, subreaper, own_machine=self.own_machine)
            sock.send(b"s%d,%d" % (status, clean))

    def job_process(self, job_r: int, w: int, out_w: int, err_w: int) -> None:
        """The job's process, a fork of the template: it reads its own line, then runs it. It is
        dumpable again (the runner and the template stay not), as a script's process is after its
        exec: the drainer's memory watch reads its /proc/<pid>/fd for the memfds it holds (issue 25),
        and the runner's fds are still not its to open."""
        _prctl(PR_SET_DUMPABLE, 1)
        try:
            signal.signal(signal.SIGUSR1, self.jobs_usr1)  # the runner's own, not the job's
            os.setpgid(0, 0)
            chunks = []
            while True:
                chunk = os.read(job_r, 1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
            os.close(job_r)
            job = json.loads(b"".join(chunks))
            home = self.home(job)
            argv = [] if self.desc["module"] else [*self.desc["argv"], os.path.join(home, "payload.json")]
        except BaseException:
            os._exit(1)
        self.child(job, home, argv, w, out_w, err_w)

    def _template_gone(self, pid: int) -> tuple[int, bool]:
        """The template died (a job killed it): the job's wait status and whether its leftovers
        are dead, found by the runner itself (the job and what it left are its children now)."""
        if self.template is not None:
            self.template.close()
            self.template = None
        try:
            os.waitpid(self.template_pid, 0)  # once it is reaped, its children are this runner's
        except ChildProcessError:
            pass
        status = 0
        if pid:
            try:
                _, status = os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        return status, end_leftovers(self.me, pid, self.subreaper, own_machine=self.own_machine) if pid else True

    def close_template(self) -> None:
        if self.template is None:
            return
        self.template.close()
        self.template = None
        try:
            os.kill(self.template_pid, signal.SIGKILL)
            os.waitpid(self.template_pid, 0)
        except OSError:
            pass

    def scrub(self) -> None:
        """The workspace as the runner found it, before each job: a job of a batch made its parent
        read-only (the next job's directory could not be made: that job was charged), filled its
        inodes, or left files for later jobs to read (red team, issue 25)."""
        try:
            os.chmod(self.cwd, 0o700)
        except OSError:
            pass
        for name, key in _entries(self.cwd).items():
            if self.kept.get(name) != key:
                _purge(os.path.join(self.cwd, name))

    def one(self, job: dict[str, Any], line: bytes, tag: str, timeout: float) -> str | None:
        desc = self.desc
        module = bool(desc["module"])
        home = self.home(job)
        self.scrub()
        os.mkdir(home, 0o700)
        payload_path = os.path.join(home, "payload.json")
        if not module:
            with open(payload_path, "w") as f:
                json.dump(job["payload"], f)
        job_r, job_w = os.pipe()  # its line: read by its own process alone
        r, w = os.pipe()
        out_r, out_w = os.pipe()  # its stdout and stderr: pipes only this job's processes hold
        err_r, err_w = os.pipe()
        theirs = (job_r, w, out_w, err_w)
        t0 = time.monotonic()
        assert self.template is not None
        try:
            socket.send_fds(self.template, [b"f"], list(theirs))
            msg, fds, _, _ = socket.recv_fds(self.template, 4096, 1)
        except OSError:
            msg, fds = b"", []
        for fd in theirs:
            os.close(fd)
        if not msg.startswith(b"p"):  # no job process: the template is gone, or its fork failed
            for fd in (*fds, job_w, r, out_r, err_r):
                os.close(fd)
            if not module:
                try:
                    os.unlink(payload_path)
                except OSError:
                    pass
            _remove(home)
            if not msg:
                self._template_gone(0)
                return None
            if self.forked:  # e.g. EAGAIN: an earlier job's leftovers hold the pids cap. Not this
                return None  # job's doing: it and the rest run in a fresh sandbox, uncharged
            return json.dumps({"tag": tag, "ok": False, "duration": 0.0,
                               "error": "cannot start the job: " + msg[1:].decode("utf-8", "replace")})
        pid = int(msg[1:])
        self.forked += 1
        try:
            _write_all(job_w, line)
        except OSError:  # it died before it read it
            pass
        os.close(job_w)
        outs = (_Output(out_r, head=int(desc.get("stdout_bytes", RESULT_BYTES))),
                _Output(err_r, tail=int(desc.get("stderr_bytes", ERROR_CHARS))))
        killed, data = self.wait(pid, fds[0] if fds else None, r, t0 + timeout, tag, timeout, outs)
        os.close(r)
        try:
            reply = self.template.recv(64)
        except OSError:
            reply = b""
        if reply.startswith(b"s"):
            status_text, _, clean_text = reply[1:].partition(b",")
            status, clean = int(status_text), clean_text == b"1"
        else:
            status, clean = self._template_gone(pid)
        duration = time.monotonic() - t0
        for each in outs:  # every writer is dead (when clean): the rest of what it wrote, to its end
            each.pull()
            os.close(each.fd)
        stdout, cut, stderr = outs[0].text(), outs[0].cut, outs[1].text()
        if not module:  # what the runner made: then one rmdir does
            try:
                os.unlink(payload_path)
            except OSError:
                pass
        _remove(home)
        if not clean:  # they may be at work on the next job's directory: this sandbox runs no other
            stderr += "\n(fleetless: processes of this job could not all be killed)"
            self.stop = True
        code = os.waitstatus_to_exitcode(status)
        if not module:
            if killed is None and data.startswith(b"E"):
                code = int(data[1:4])
                stderr = data[4:].decode("utf-8", "replace")
            return json.dumps({"tag": tag, "exit": code, "stdout": stdout, "stdout_cut": cut, "stderr": stderr,
                               "killed": killed, "duration": duration}, ensure_ascii=False)
        return _module_line(tag, killed, data, code, stdout, stderr, duration, cut=cut)

    def shared_home(self) -> str:
        """Shared mode's one directory, every job's cwd, HOME and TMPDIR, left empty for each job:
        what a job left there is removed before the next starts (one ``mkdir`` and ``rmdir`` per job
        cost more than the rest of a no-op job). Made again when a job removed, replaced or locked it."""
        self.scrub()  # the workspace as the runner found it (this directory kept, if it is the same)
        home = os.path.join(self.cwd, SHARED_HOME)
        try:
            with os.scandir(home) as found:
                names = [entry.name for entry in found]
        except OSError:  # not there yet, or made unreadable
            _purge(home)
            os.mkdir(home, 0o700)
            st = os.lstat(home)
            self.kept[SHARED_HOME] = (st.st_ino, st.st_dev)
            names = []
        for name in names:
            _purge(os.path.join(home, name))
        return home

    def shared_one(self, job: dict[str, Any], tag: str, timeout: float) -> tuple[str, bool]:
        """A shared job: handle(payload) called in this process, in an empty directory, with its own
        print() output and FLEETLESS_* variables, stopped by SIGALRM at its timeout; the processes it
        left are killed after it. Its result line, and whether it was stopped at its timeout."""
        desc = self.desc
        home = self.shared_home()
        env = os.environ
        env["FLEETLESS_JOB_ID"] = str(job["id"])
        for name, value in (("FLEETLESS_ATTEMPT", str(job["attempt"])),
                            ("FLEETLESS_SNOOZES", str(job.get("snoozes", 0))), ("TMPDIR", home), ("HOME", home)):
            if env.get(name) != value:  # most jobs of a batch share them: no putenv for those
                env[name] = value
        out = _Capture(head=int(desc.get("stdout_bytes", RESULT_BYTES)))
        err = _Capture(tail=int(desc.get("stderr_bytes", ERROR_CHARS)))
        killed = None
        data = b""
        t0 = time.monotonic()
        try:
            os.chdir(home)
            sys.stdout, sys.stderr = out, err
            try:
                signal.signal(signal.SIGALRM, _on_alarm)  # again: the module or an earlier job may have set its own
                signal.setitimer(signal.ITIMER_REAL, timeout)
                try:
                    data = _call(self.handle, job["payload"])
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
            except JobTimeout:  # (also when it came just as handle() returned)
                killed = f"killed: timeout after {_fmt(timeout)} s"
        finally:
            sys.stdout = sys.stderr = sys.__stderr__  # fd 2: never the channel
            os.chdir(self.cwd)
        duration = time.monotonic() - t0
        if os.getpid() != self.me:  # a fork the job made came back here: it never reports
            os._exit(0)
        stderr = err.text()
        if not end_leftovers(self.me, None, self.subreaper, own_machine=self.own_machine):
            stderr += "\n(fleetless: processes of this job could not all be killed)"
            self.stop = True
        # the report is the runner's own (json.dumps'): no check that it is one JSON value
        return (_module_line(tag, killed, data, 0, out.text(), stderr, duration, checked=True, cut=out.cut),
                killed is not None)

    def wait(self, pid: int, ended: int | None, r: int, deadline: float, tag: str, timeout: float,
             outs: tuple[_Output, ...]) -> tuple[str | None, bytes]:
        """The job's report, read until its process has exited (not until its pipe closes: a
        process the job left may hold it), or why it was killed: its timeout, or a cancel. Its
        stdout and stderr are read meanwhile (``outs``). ``ended``: the job's pidfd, from the
        template (None on an old kernel: the pipe's end stands for the job's)."""
        data = b""
        os.set_blocking(r, False)
        watch = [r] if ended is None else [r, ended]
        if self.channel:
            watch.append(self.inp)
        streams = {each.fd: each for each in outs}
        watch += streams
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    _kill_job(pid, ended)
                    return f"killed: timeout after {_fmt(timeout)} s", b""
                ready = select.select(watch, [], [], left)[0]
                for fd in ready:
                    if fd in streams and not streams[fd].pull():
                        watch.remove(fd)  # its end: every process that held it is gone
                if r in watch and (r in ready or (ended is not None and ended in ready)):
                    while True:
                        try:
                            chunk = os.read(r, 65536)
                        except BlockingIOError:
                            break
                        if not chunk:  # closed (a script's exec closes it): wait for the process
                            if ended is None:
                                return None, data
                            watch.remove(r)
                            break
                        data += chunk
                if ended is not None and ended in ready:
                    return None, data
                if self.channel and self.inp in ready:
                    line = self.read_line(block=False)
                    if line == b"":  # the drainer is gone: so is the job
                        _kill_job(pid, ended)
                        return "killed: sandbox destroyed", b""
                    if line and json.loads(line).get("cancel") == tag:
                        _kill_job(pid, ended)
                        return "cancelled", b""
        finally:
            if ended is not None:
                os.close(ended)

    def child(self, job: dict[str, Any], home: str, argv: list[str], w: int, out_w: int, err_w: int) -> None:
        try:
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            for fd in (out_w, err_w):  # the template closed the channel
                os.close(fd)
            os.chdir(home)
            sys.stdout = sys.__stdout__  # fd 1 again: this job's own stdout
            env = os.environ
            env["FLEETLESS_JOB_ID"] = str(job["id"])
            env["FLEETLESS_ATTEMPT"] = str(job["attempt"])
            env["FLEETLESS_SNOOZES"] = str(job.get("snoozes", 0))  # (a line from an older drainer has none)
            env["TMPDIR"] = env["HOME"] = home
            if argv:
                os.set_inheritable(w, False)
                try:
                    os.execve(argv[0], argv, env)
                except OSError as exc:
                    code = 127 if isinstance(exc, FileNotFoundError) else 126
                    _write_all(w, f"E{code}cannot execute {argv[0]}: {exc.strerror or exc}".encode())
                    os._exit(code)
            self.module_job(job, w)
        except BaseException:
            pass
        os._exit(1)

    def module_job(self, job: dict[str, Any], w: int) -> None:
        report = _call(self.handle, job["payload"])
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        _write_all(w, report)
        os._exit(0)


def _module_line(tag: str, killed: str | None, data: bytes, code: int, stdout: str, stderr: str,
                 duration: float, checked: bool = False, cut: bool = False) -> str:
    """A handle() job's result line, from its report (:func:`_call`) or why it was killed.
    ``checked``: the report was made by this process's json.dumps, not read from a job's pipe.
    ``cut``: it printed past the stdout cap (the host marks its stored output so, as a script's)."""
    if killed is None and not checked and data.startswith(b"R") and not _one_json_value(data[1:]):
        # the report pipe is the job's: what it wrote there is spliced into this line only when
        # it is one JSON value (a job wrote 'R1,"late":true' to pass as never started)
        killed, data = None, b"X" + b"the job's report of its result is not one JSON value"
    if killed is None and data.startswith(b"R"):  # returned: the result last, as it is
        extra = ""
        if stdout or stderr:
            extra = f',"stdout":{json.dumps(stdout)},"stderr":{json.dumps(stderr)}'
        if cut:
            extra += ',"stdout_cut":true'
        return f'{{"tag":"{tag}","ok":true{extra},"result":{data[1:].decode()}}}'
    line = _module_failure(tag, killed, data, code, stdout, stderr, duration)
    return line[:-1] + ',"stdout_cut":true}' if cut else line


def _module_failure(tag: str, killed: str | None, data: bytes, code: int, stdout: str, stderr: str,
                    duration: float) -> str:
    """:func:`_module_line` of a handle() that did not return a result JSON can hold."""
    decided = None
    if killed is None and data.startswith(b"D"):  # it raised Discard, Snooze or Retry
        try:
            decided = json.loads(data[1:])
        except ValueError:
            decided = None
    if killed is None and data.startswith(b"N"):
        return json.dumps({"tag": tag, "ok": False, "not_json": data[1:501].decode("utf-8", "replace"),
                           "stdout": stdout, "stderr": stderr, "duration": duration}, ensure_ascii=False)
    if killed is None and data.startswith(b"B") and data[1:].isdigit() and len(data) < 24:
        return json.dumps({"tag": tag, "ok": False, "too_large": int(data[1:]), "stdout": stdout,
                           "stderr": stderr, "duration": duration}, ensure_ascii=False)
    if decided is not None:
        return json.dumps({"tag": tag, "ok": False, "decided": decided, "error": "", "stdout": stdout,
                           "stderr": stderr, "duration": duration}, ensure_ascii=False)
    if killed is not None:
        error = killed
    elif data.startswith(b"X"):
        error = data[1:].decode("utf-8", "replace")
    elif code < 0:
        error = f"killed by {_signal_name(-code)}"
    else:
        error = f"exit code {code} (handle() did not return)"
    return json.dumps({"tag": tag, "ok": False, "error": error, "stdout": stdout, "stderr": stderr,
                       "duration": duration}, ensure_ascii=False)


def _call(handle: Any, payload: Any) -> bytes:
    """handle(payload)'s report: R and its result's JSON, N (not JSON), B (too large), D (a
    decision) or X (an exception). :class:`JobTimeout` is let through (a shared job's timeout)."""
    try:
        value = handle(payload)
        try:
            text = "null" if value is None else json.dumps(value, allow_nan=False, separators=(",", ":"))
        except (TypeError, ValueError, RecursionError) as exc:
            # a value JSON cannot hold (a set, NaN, an object) comes back on every try: decided
            # once, as a result too large is, never retried
            return b"N" + _not_json(value, exc).encode("utf-8", "replace")
        # ASCII: json.dumps escapes the rest. Too large is decided once (the host fails the
        # job for good: the same payload would return as much again), not an error retried
        return b"B%d" % len(text) if len(text) > RESULT_BYTES else b"R" + text.encode()
    except JobTimeout:
        raise
    except BaseException as exc:  # SystemExit and KeyboardInterrupt too: the job's own doing
        decided = decision(exc)
        if decided is not None:
            return b"D" + json.dumps(decided).encode()
        return b"X" + describe_exception(exc).encode("utf-8", "replace")


def _kill_job(pid: int, ended: int | None) -> None:
    """SIGKILL the job's process group and its process (through its pidfd where there is one: no pid
    reuse). A job may have left its group (setpgid into a child's), so the group may be gone while
    the job runs on (red team: ProcessLookupError ended the runner's wait at a timeout); what it
    left is the template's to kill once the job has ended (:func:`end_leftovers`)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    try:
        if ended is not None:
            signal.pidfd_send_signal(ended, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def _not_json(value: Any, exc: BaseException) -> str:
    """What in a handle()'s returned value JSON cannot hold, on one line: the value's type and
    json's own complaint (``Object of type set is not JSON serializable``, ``Out of range float
    values are not JSON compliant``)."""
    why = " ".join(str(exc).split())[:200] or type(exc).__name__
    return f"{type(value).__name__}: {why}"


def _one_json_value(text: bytes) -> bool:
    """Whether ``text`` is exactly one JSON value on one line (what module_job writes: json.dumps)."""
    if b"\n" in text or b"\r" in text:
        return False
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _open_channel(args: list[str]) -> tuple[int, int, bool]:
    """(IN, OUT, channel mode): the pipes, opened and then unlinked, or the file and stdout."""
    if len(args) > 1 and stat.S_ISFIFO(os.stat(args[0]).st_mode):
        # The drainer holds both open, but it may have closed its end of IN already (every job of
        # the batch cancelled before the runner got here): a blocking open would then wait for a
        # writer for ever, and the runner outlive its drain. Opened without waiting, IN reads its
        # end at once then (no job), and OUT fails (ENXIO) if nobody reads it any more.
        inp = os.open(args[0], os.O_RDONLY | os.O_NONBLOCK)
        try:
            out = os.open(args[1], os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            sys.exit(0)
        os.set_blocking(inp, True)
        os.set_blocking(out, True)
        for path in args[:2]:
            os.unlink(path)
        return inp, out, True
    inp = os.open(args[0], os.O_RDONLY)
    os.unlink(args[0])
    return inp, os.dup(1), False


#: SIGUSR1 came before the runner's own handler was set (file mode: stop after the first job)
_EARLY_STOP: list[bool] = []


def _early_stop(signum: int, frame: object) -> None:
    _EARLY_STOP.append(True)


def main() -> None:
    started = time.monotonic()  # a spare's waiting counts against its budget (the sandbox's TTL)
    _prctl(PR_SET_NAME, NAME)
    # caught from the start (the drainer signals once /proc shows it caught): a stop during a slow
    # import is kept, not lost to a drainer that waited for the import and signalled after the
    # runner had started every job (CI, under load: the cancelled 4th job ran and ended done)
    signal.signal(signal.SIGUSR1, _early_stop)
    inp, out, channel = _open_channel(sys.argv[1:])
    _prctl(PR_SET_DUMPABLE, 0)  # /proc/<this>/fd is then out of the jobs' reach, even as its uid
    os.dup2(2, 1)  # the runner's own prints cannot reach the channel
    sys.stdout = sys.stderr
    for fd in (inp, out):
        os.set_inheritable(fd, False)
    runner = Runner(inp, out, channel)
    line = runner.read_line()
    if not line:
        return
    runner.load(json.loads(line))
    gc.freeze()  # what the runner holds now: no job's collection walks (and so copies) its pages
    if not runner.shared:  # shared mode: every job in this process, no template
        runner.start_template()
    try:
        runner.run(started)
    finally:
        runner.close_template()


if __name__ == "__main__":
    main()
