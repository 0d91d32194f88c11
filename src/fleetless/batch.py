"""Running claimed jobs in sandboxes: one job per sandbox, or a batch of one kind per sandbox.

:meth:`Runner.run` takes jobs of one kind and returns each job's :class:`~fleetless.job.Outcome`;
the completer writes them. How a batch runs:

- A script or executable handler with one job: the seed's shape, ``exec`` of the handler itself.
- Otherwise the in-sandbox batch runner (``sandbox/_batch_runner.py``) is written into the
  workspace with the jobs and runs them in order, one result line each: a ``handle(payload)``
  module is imported once and called per job; a script runs as one process per job.
- Each job keeps its own outcome. A job that takes the sandbox down (os._exit, a segfault, the
  memory limit, a timeout the interpreter could not stop, the TTL) is charged alone: the jobs
  before it keep their results, and the ones after it run on in a fresh sandbox, charged nothing.
- When the drainer stops (:meth:`Slot.abort`), the sandbox is destroyed and every job without a
  result is released: back to pending with its attempt given back.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from . import handlers
from .failure import summarize_failure
from .job import Job, Outcome, Run, done_with_json
from .kinds import KindSettings
from .retry import MAX_ERROR_CHARS
from .sandbox import ExecResult, Sandbox, Template

__all__ = ["RUNNER_NAME", "Runner", "Slot", "Teardown", "describe_failure", "describe_run", "job_env"]

log = logging.getLogger("fleetless.batch")
RUNNER = Path(__file__).parent / "sandbox" / "_batch_runner.py"
RUNNER_NAME = "_fleetless_batch.py"
#: The named pipe a spare sandbox's runner reads its batch from (watch mode).
FIFO_NAME = "batch.fifo"
#: Seconds a spare's runner may take to open its pipe once a batch is handed to it.
FEED_SECONDS = 10.0
#: Seconds the batch runner's watchdog allows past a job's timeout before it stops the sandbox.
HARD_GRACE = 2.0
#: Seconds past a batch job's timeout after which the drainer kills its sandbox from outside
#: (:class:`_Pacer`): the runner's own timer and watchdog are inside the job's process, and a
#: handle() can switch both off. Later than the runner's watchdog (timeout + HARD_GRACE + 1 s at
#: most), which names a stuck C call. A module job alone in its sandbox is given its timeout plus
#: HARD_GRACE as the exec's own deadline instead, which every tier enforces by itself (also while
#: the drainer is stopped, inside the lease's grace).
HOST_GRACE = HARD_GRACE + 3.0
#: Room for one job's record on the runner's stdout, beyond the job's own stdout.
RECORD_OVERHEAD = 8 * 1024
_NUL_ESCAPE = re.compile(r"(?<!\\)((?:\\\\)*)\\u0000")
#: A \u escape a result may not keep as it is: NUL, or any surrogate (a lone one is refused by
#: jsonb; a line with a pair takes the full decode as well). Conservative: a match, even one that
#: is really an escaped backslash followed by "u0000", only sends the line to the full decode.
_REFUSED_ESCAPE = re.compile(r"\\u(?:0000|[dD][89a-fA-F])")
#: Longest result line taken without decoding (the runner caps a result at 64 KiB of JSON).
_FAST_RESULT_CHARS = 64 * 1024 + 64
RELEASED_STOPPING = "released: the drainer stopped before the job finished"
CANCELLED = "cancelled: an operator cancelled the job while it ran"
LEASE_ENDED = "released: its lease ended before it started (its drainer was stopped or cut off)"


def _signal_name(exit_code: int) -> str:
    """SIGSEGV for an exit status of -11."""
    try:
        return signal.Signals(-exit_code).name
    except ValueError:
        return f"signal {-exit_code}"


def describe_failure(r: ExecResult) -> str:
    """last_error for a failed run: what happened in one line, then the tail of stderr."""
    if r.killed:
        head = r.killed
    elif r.exit_code < 0:
        head = f"killed by {_signal_name(r.exit_code)}"
    else:
        head = summarize_failure(f"exit code {r.exit_code}", r.stderr)
    tail = r.stderr.rstrip()
    if not tail:
        return head
    room = MAX_ERROR_CHARS - len(head) - 1
    return f"{head}\n{tail[-room:]}"


def describe_run(tier: str, r: ExecResult | None, kill_reason: str | None = None) -> Run:
    """The attempt-history view of a run: exit status, or the signal and the kill reason."""
    if r is None:
        return Run(tier=tier, kill_reason=kill_reason)
    if r.killed:
        kill_reason = r.killed.removeprefix("killed: ")
    if r.exit_code < 0:
        return Run(tier=tier, signal=_signal_name(r.exit_code), kill_reason=kill_reason)
    return Run(tier=tier, exit_code=r.exit_code, kill_reason=kill_reason)


def job_env(job: Job, base: dict[str, str]) -> dict[str, str]:
    """One job's whole environment: the drain's, plus who it is."""
    return {**base, **_own_env(job)}


def _own_env(job: Job) -> dict[str, str]:
    return {"FLEETLESS_JOB_ID": str(job.id), "FLEETLESS_ATTEMPT": str(job.attempts), "FLEETLESS_KIND": job.kind}


class Slot:
    """The sandbox a running batch uses right now, so that the drainer can destroy it on stop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sandbox: Sandbox | None = None
        self.aborted = False

    def attach(self, sbx: Sandbox) -> bool:
        """Use ``sbx``; False (and nothing attached) when the slot was aborted already."""
        with self._lock:
            if self.aborted:
                return False
            self._sandbox = sbx
            return True

    def detach(self) -> None:
        with self._lock:
            self._sandbox = None

    def kill_current(self) -> None:
        """Destroy the sandbox in use (its job was cancelled); the rest go on in a fresh one."""
        with self._lock:
            sbx = self._sandbox
        if sbx is not None:
            sbx.kill()

    def abort(self) -> None:
        """Stop: destroy the sandbox in use (its job is released), start no other."""
        with self._lock:
            self.aborted = True
            sbx = self._sandbox
        if sbx is not None:
            sbx.kill()


_NO_SETTINGS = KindSettings()
# json.dumps with options builds an encoder per call: one, built once, for every handle() result
_RESULT_JSON = json.JSONEncoder(allow_nan=False, ensure_ascii=False, separators=(",", ":"))


class _Spare:
    """Watch mode's sandboxes started ahead of their batches: each one's batch runner has started and
    waits on a named pipe in the workspace, so a job that arrives skips the sandbox's and
    interpreter's start. The runner's ``spares`` of them (the drain's concurrency plus one), so that
    a job that comes while as many as the slots took are being replaced still finds one ready."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.ready: list[tuple[Sandbox, Future[ExecResult], float]] = []  # oldest first, with its start
        self.starting = 0
        self.closed = False


#: Most tries to make one job's sandbox while sandboxes handed over are being destroyed.
_CREATE_TRIES = 5


class SandboxBroken(Exception):
    """The sandbox failed, not the job: the drain cannot go on with this tier."""


class Teardown:
    """Per-job mode's sandboxes destroyed beside the slot's next claim instead of before it.

    A slot hands its sandbox over once the job has ended (every tier's ``exec`` returns when the
    job's tree is dead) and its output is read, and goes on to its outcome and next claim while a
    teardown thread (up to ``limit`` of them, kept until :meth:`close`) removes what is left
    (cgroups, workspace, the uid lease). Up to ``limit``
    (the drain's concurrency) are destroyed at once; a slot that finds ``limit`` still going blocks,
    as if it killed its own. A slot whose next sandbox cannot be made tries again while sandboxes
    handed over keep being destroyed (:meth:`freed_since`: a job uid may be held by one). :meth:`close`
    returns when every sandbox handed over is gone (the drain calls it before it returns); after
    it, or when no thread can start, a sandbox handed over is destroyed inline. A kill that raised
    is kept in ``failure``: a later job is refused a sandbox with it, and the drain ends with it."""

    def __init__(self, limit: int) -> None:
        self._limit = max(limit, 1)
        self._room = threading.BoundedSemaphore(self._limit)
        lock = threading.Lock()
        self._cond = threading.Condition(lock)  # a sandbox destroyed
        self._work = threading.Condition(lock)  # a sandbox handed over, or closed
        self._queue: list[Sandbox] = []  # handed over, not taken by a thread yet
        self._threads = 0  # started, not exited: up to limit, each destroying one sandbox at a time
        self._pending = 0  # handed over, not destroyed yet
        self._finished = 0  # destroyed so far, by the threads
        self._closed = False
        self.failure: str | None = None

    def hand_over(self, sbx: Sandbox) -> None:
        self._room.acquire()
        with self._cond:
            if not self._closed and self._has_thread():
                self._pending += 1
                self._queue.append(sbx)
                self._work.notify()
                return
        self._room.release()  # no thread could start: inline
        self._destroy(sbx)

    def _has_thread(self) -> bool:
        """(Holding the lock.) Start one more thread while fewer than ``limit`` run: a sandbox handed
        over holds a permit until destroyed, so ``limit`` threads always have one free. The threads
        stay (a thread started per sandbox cost its slot about a millisecond a job: the start waits
        for the new thread to run). False when none runs and none can start."""
        if self._threads < self._limit:
            worker = threading.Thread(target=self._serve, name="teardown", daemon=True)
            try:
                worker.start()
                self._threads += 1
            except RuntimeError as exc:
                log.debug("teardown thread: %s", exc)
        return self._threads > 0

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    if self._closed:
                        self._threads -= 1
                        return
                    self._work.wait()
                sbx = self._queue.pop(0)
            self._destroy_counted(sbx)

    def _destroy(self, sbx: Sandbox) -> None:
        try:
            sbx.kill()
        except Exception as exc:
            log.warning("could not destroy a sandbox of the %s tier: %s", sbx.name, exc)
            self.failure = self.failure or f"cannot destroy a sandbox of the {sbx.name} tier: {exc}"

    def _destroy_counted(self, sbx: Sandbox) -> None:
        try:
            self._destroy(sbx)
        finally:
            with self._cond:
                self._pending -= 1
                self._finished += 1
                self._cond.notify_all()
            self._room.release()

    @property
    def finished(self) -> int:
        with self._cond:
            return self._finished

    def freed_since(self, finished: int) -> bool:
        """Wait until no sandbox handed over is still being destroyed; whether any was destroyed
        since :attr:`finished` read ``finished`` (then what it held is free for another try)."""
        with self._cond:
            self._cond.wait_for(lambda: self._pending == 0)
            return self._finished > finished

    def close(self) -> None:
        """Return when every sandbox handed over is destroyed; destroy later ones inline."""
        with self._cond:
            self._closed = True
            self._work.notify_all()  # the threads exit once nothing is left to take
            self._cond.wait_for(lambda: self._pending == 0)


@dataclass(frozen=True)
class Runner:
    backend: type[Sandbox]
    template: Template  # handlers_dir resolved; env = the drain's base environment
    ttl: float = 900
    default_timeout: float = 600
    kinds: Mapping[str, KindSettings] = field(default_factory=dict)  # fleetless.toml
    cancelled: Callable[[Job], bool] = lambda job: False  # an operator cancelled this claim while it ran
    #: kinds that had a handler when the drain started: one missing now was taken away by a
    #: deploy mid-drain, and its jobs are retried (not dead) so the new release can run them
    had_handler: frozenset[str] = frozenset()
    #: A job of a kind with no handler here is given back (not charged) to come back after this
    #: long: during a rolling deploy, the drainers of the release that has it run it. None: it
    #: fails at once, permanently (dead), as an unknown kind does nowhere else.
    no_handler_delay: float | None = 60.0
    #: Watch mode: keep sandboxes started ahead for batches of up to this many jobs (0: never)...
    spare_jobs: int = 0
    #: ... this many of them.
    spares: int = 2
    #: Per-job mode: a job's sandbox is destroyed by this, beside the slot's next claim (None: inline).
    teardown: Teardown | None = None
    #: When the job's lease ends (``time.monotonic()``; None: unknown). A job starts only if its
    #: timeout ends inside it: else the reaper may give it to another drainer while it still runs
    #: here (issue 26, item 2). Checked just before a job's exec, and by the batch runner before
    #: each job (on the tiers that share the host's monotonic clock), so a runner whose drainer is
    #: stopped or cut off starts nothing it cannot finish inside the lease the drainer last knew.
    not_after: Callable[[Job], float | None] = lambda job: None
    _spare: _Spare = field(default_factory=_Spare, init=False, compare=False, repr=False)  # each copy its own

    def _kind(self, kind: str) -> KindSettings:
        return self.kinds.get(kind, _NO_SETTINGS)  # one shared default: this runs for every job of a batch

    def ttl_of(self, kind: str) -> float:
        return self._kind(kind).ttl or self.ttl

    def timeout_of(self, job: Job) -> float:
        ks = self._kind(job.kind)
        return min(float(job.timeout_seconds or ks.timeout or self.default_timeout), ks.ttl or self.ttl)

    def template_of(self, kind: str) -> Template:
        ks = self._kind(kind)
        return replace(self.template, limits=ks.limits(self.template.limits),
                       python=ks.interpreter or self.template.python)

    def run(self, jobs: Sequence[Job], slot: Slot) -> tuple[list[tuple[Job, Outcome]], str | None]:
        """Run ``jobs`` (all of one kind) and return each one's outcome, in order, plus the reason
        the drain must stop when a sandbox broke (every job not run is then released)."""
        if not jobs:
            return [], None
        kind = jobs[0].kind
        assert all(j.kind == kind for j in jobs), "a batch is of one kind"
        handler = handlers.resolve(self.template.handlers_dir, kind)
        if handler is None:
            error = (f"no handler for kind {kind!r}: neither {kind}.py nor an executable {kind} in "
                     f"{self.template.handlers_dir}")
            vanished = kind in self.had_handler
            never = Run(tier=self.backend.name)
            if self.no_handler_delay is not None:
                # not the job's fault: another drainer (the next release's) may have the handler
                error += (f"; given back uncharged, due again in {self.no_handler_delay:g} s (a drainer that"
                          " has it can run it; five give-backs in a row are charged as one attempt)")
                return [(j, Outcome("release", error=error, delay=self.no_handler_delay, run=never))
                        for j in jobs], None
            if vanished:
                error += " (it had one when the drain started: retried, for the release that replaced it)"
            return [(j, Outcome("fail", error=error, permanent=not vanished, run=never)) for j in jobs], None
        done: list[tuple[Job, Outcome]] = []
        left = list(jobs)
        while left:
            if slot.aborted:
                done += [(j, self._stopped(None)) for j in left]
                break
            if self._lease_over(left[0]):
                done.append((left[0], self._late()))
                left = left[1:]
                continue
            try:
                if len(left) == 1 and not handler.module:
                    got = [self._single(left[0], handler, slot)]
                    r = None
                else:
                    got, r = self._batch(left, handler, slot)
            except SandboxBroken as exc:
                error = f"sandbox error ({self.backend.name}): {exc}"
                broke = describe_run(self.backend.name, None, "sandbox error")
                done += [(j, Outcome("release", error=error, run=broke)) for j in left]
                return done, error
            done += got
            left = left[len(got):]
            if not left or r is None:
                continue
            if slot.aborted:  # destroyed by the drainer's stop: nobody is charged
                continue
            if r.ok and (got or _said_late(r.stdout)):
                # the runner stopped before its TTL, or at a job too late for the lease it was given:
                # the rest go to a fresh sandbox (with the lease as renewed since; the loop's top
                # releases a job too late by that too)
                continue
            if self.cancelled(left[0]):
                run = replace(describe_run(self.backend.name, r), kill_reason="cancelled")
                done.append((left[0], Outcome("fail", error=CANCELLED, permanent=True, run=run)))
            else:
                done.append((left[0], Outcome("fail", error=self._death(left[0], handler, r),
                                              run=describe_run(self.backend.name, r))))
            left = left[1:]
        return done, None

    # -- the spare sandbox (watch mode) --------------------------------------------------------

    def _spare_template(self) -> Template:
        limits = self.template.limits
        per_job = limits.stdout_bytes + RECORD_OVERHEAD
        return replace(self.template, limits=replace(limits, stdout_bytes=per_job * self.spare_jobs + 65536))

    def prewarm(self) -> None:
        """Start spare sandboxes in the background until ``spares`` are ready or starting."""
        spare = self._spare
        with spare.lock:
            if not self.spare_jobs or spare.closed:
                return
            more = self.spares - len(spare.ready) - spare.starting
            spare.starting += max(more, 0)
        for _ in range(more):
            threading.Thread(target=self._start_spare, name="spare", daemon=True).start()

    def _start_spare(self) -> None:
        spare, sbx = self._spare, None
        try:
            sbx = self.backend.create(self._spare_template(), self.ttl)
            host = sbx.host_workspace
            if host is None:  # the job's workspace is a copy (a microVM's): no pipe reaches it
                with spare.lock:
                    spare.closed = True
                return
            sbx.write(RUNNER_NAME, RUNNER.read_bytes())
            fifo = host / FIFO_NAME
            os.mkfifo(fifo, 0o600)
            owner = host.stat()  # the job's uid owns its workspace, and so its pipe
            os.chown(fifo, owner.st_uid, owner.st_gid)
            ws, started = sbx.workspace_path, sbx
            result: Future[ExecResult] = Future()

            def run() -> None:
                try:
                    result.set_result(started.exec([started.python, f"{ws}/{RUNNER_NAME}", f"{ws}/{FIFO_NAME}"],
                                                   self.ttl))
                except BaseException as exc:
                    result.set_exception(exc)

            threading.Thread(target=run, name="spare-exec", daemon=True).start()
            with spare.lock:
                if not spare.closed:
                    spare.ready.append((started, result, time.monotonic()))
                    sbx = None
        except Exception as exc:  # no spare this time: the next batch starts its own sandbox
            log.debug("could not start a spare sandbox: %s", exc)
        finally:
            if sbx is not None:
                sbx.kill()
            with spare.lock:
                spare.starting -= 1
                spare.lock.notify_all()

    def _take_spare(self, jobs: Sequence[Job]) -> tuple[Sandbox, Future[ExecResult]] | None:
        """The spare sandbox for ``jobs``, if it fits them and its runner still waits (a kind with
        settings of its own, in fleetless.toml, always starts its own sandbox)."""
        kind = jobs[0].kind
        if not self.spare_jobs or len(jobs) > self.spare_jobs:
            return None
        if self.template_of(kind) != self.template or self.ttl_of(kind) != self.ttl:
            return None
        # its TTL runs from its start: the first job must still fit in what is left of it
        need = self.timeout_of(jobs[0]) + HARD_GRACE
        spare = self._spare
        taken = None
        with spare.lock:
            # one on its way started before this batch came: it is ready sooner than a new sandbox
            spare.lock.wait_for(lambda: spare.ready or not spare.starting, timeout=FEED_SECONDS)
            while spare.ready and taken is None:
                sbx, result, born = spare.ready.pop(0)
                if result.done() or time.monotonic() - born + need > self.ttl:
                    spare.lock.release()  # gone, or too little TTL left: replaced below
                    try:
                        sbx.kill()
                    finally:
                        spare.lock.acquire()
                else:
                    taken = sbx, result
        self.prewarm()  # for the batches after this one
        return taken

    def close(self) -> None:
        """Destroy the spare sandboxes, start no other (the drain ends)."""
        spare = self._spare
        with spare.lock:
            spare.closed = True
            spare.lock.wait_for(lambda: not spare.starting, timeout=60)  # each kills what it made
            ready, spare.ready = spare.ready, []
        for sbx, _, _ in ready:
            sbx.kill()

    # -- one sandbox ---------------------------------------------------------------------------

    def _sandbox(self, template: Template, slot: Slot, kind: str) -> Sandbox:
        teardown = self.teardown
        tries = 0
        while True:
            tries += 1
            finished = teardown.finished if teardown is not None else 0
            try:
                sbx = self.backend.create(template, self.ttl_of(kind))
                break
            except Exception as exc:
                # Per-job mode: what it lacked (a job uid, say) may be held by sandboxes still being
                # destroyed; once more while they go, unless the drain is stopping
                if (teardown is None or slot.aborted or tries >= _CREATE_TRIES
                        or not teardown.freed_since(finished)):
                    raise SandboxBroken(str(exc)) from None
                log.debug("no sandbox (%s): once more, as sandboxes being destroyed are gone", exc)
        if not slot.attach(sbx):
            sbx.kill()
            raise _Aborted()
        return sbx

    def _single(self, job: Job, handler: handlers.Handler, slot: Slot) -> tuple[Job, Outcome]:
        template = replace(self.template_of(job.kind), env=job_env(job, dict(self.template.env)))
        teardown = self.teardown
        if teardown is not None and teardown.failure is not None:
            raise SandboxBroken(teardown.failure)
        try:
            sbx = self._sandbox(template, slot, job.kind)
        except _Aborted:
            return job, self._stopped(None)
        if self.cancelled(job):  # cancelled while its sandbox was made: the kill found none, so never exec
            sbx.kill()
            slot.detach()
            return job, Outcome("fail", error=CANCELLED, permanent=True,
                                run=describe_run(self.backend.name, None, "cancelled"))
        try:
            sbx.write("payload.json", job.payload_json)
            argv = handler.argv(sbx.handlers_path, sbx.python, f"{sbx.workspace_path}/payload.json")
            if self._lease_over(job):  # its sandbox took the rest of its lease (a stopped drainer)
                sbx.kill()
                slot.detach()
                return job, self._late()
            r = sbx.exec(argv, self.timeout_of(job))
        except BaseException as exc:
            sbx.kill()
            slot.detach()
            if not isinstance(exc, Exception):
                raise
            if slot.aborted:  # destroyed under it by the drainer's stop: not a broken sandbox
                return job, self._stopped(None)
            raise SandboxBroken(str(exc)) from None
        slot.detach()
        if teardown is None:
            sbx.kill()
        else:  # the job has ended and its output is read: the rest of its tree dies beside the next claim
            teardown.hand_over(sbx)
        if self.cancelled(job) and not r.ok:
            return job, Outcome("fail", error=CANCELLED, permanent=True,
                                run=replace(describe_run(self.backend.name, r), kill_reason="cancelled"))
        if slot.aborted and r.killed is not None:  # one that ended on its own keeps its outcome
            return job, self._stopped(r)
        return job, _script_outcome(self.backend.name, r)

    def _batch(self, jobs: Sequence[Job], handler: handlers.Handler,
               slot: Slot) -> tuple[list[tuple[Job, Outcome]], ExecResult | None]:
        kind = jobs[0].kind
        base = self.template_of(kind)
        limits = base.limits

        # Every job's line of the batch, written once for this run (a fresh sandbox for the jobs
        # left reuses them): each payload as the table gave it (jsonb's own output, valid JSON),
        # so the host neither decodes nor re-encodes a payload.
        # not_after: the last moment the job may start (its lease end less its timeout) on the
        # host's monotonic clock, which the runner reads too (not a microVM's guest: its jobs are
        # checked before the VM starts only)
        host_clock = self.backend.host_clock

        def line(j: Job) -> str:
            end = self._start_by(j) if host_clock else None
            late = "" if end is None else f'"not_after":{end!r},'
            head = f'{{"id":{j.id},"attempt":{j.attempts},"timeout":{self.timeout_of(j)!r},'
            return f'{head}{late}"payload":{j.payload_json}}}'

        lines = [line(j) for j in jobs]

        def describe(sbx: Sandbox) -> bytes:
            head = json.dumps({
                "handler": f"{sbx.handlers_path}/{handler.filename}", "module": handler.module,
                "argv": handler.argv(sbx.handlers_path, sbx.python, "")[:-1],
                "budget": self.ttl_of(kind), "grace": HARD_GRACE, "kind": kind,
                "stdout_bytes": limits.stdout_bytes, "stderr_bytes": MAX_ERROR_CHARS})
            return f'{head[:-1]},"jobs":[{",".join(lines)}]}}'.encode()

        timeouts = [self.timeout_of(j) for j in jobs]
        spare = self._take_spare(jobs)
        if spare is not None:
            sbx, result = spare
            if not slot.attach(sbx):
                sbx.kill()
                return [(j, self._stopped(None)) for j in jobs], None
            pacer = None
            try:
                host = sbx.host_workspace
                assert host is not None
                pacer = _Pacer(sbx, timeouts)
                if _feed(host / FIFO_NAME, describe(sbx) + b"\n", result):
                    r = result.result()
                    got = self._parse(jobs, r.stdout)
                    return got, _timed_out(r, got, timeouts, pacer)
            except Exception as exc:
                raise SandboxBroken(str(exc)) from None
            finally:
                if pacer is not None:
                    pacer.stop()
                sbx.kill()
                slot.detach()
            # its runner was gone before it took the batch: nothing ran, start a sandbox of its own
        per_job = limits.stdout_bytes + RECORD_OVERHEAD
        template = replace(base, limits=replace(limits, stdout_bytes=per_job * len(jobs) + 65536))
        try:
            sbx = self._sandbox(template, slot, kind)
        except _Aborted:
            return [(j, self._stopped(None)) for j in jobs], None
        pacer = None
        try:
            desc = describe(sbx)
            sbx.write(RUNNER_NAME, RUNNER.read_bytes())
            sbx.write("batch.json", desc)
            ws = sbx.workspace_path
            # The whole run is held to the sum of its jobs' deadlines by the tier itself (one job:
            # its own, also while the drainer is stopped); each job to its own by the pacer.
            bound = min(self.ttl_of(kind), timeouts[0] + HARD_GRACE if len(timeouts) == 1
                        else sum(timeouts) + HOST_GRACE * len(timeouts))
            if len(jobs) > 1 and sbx.streams_stdout:
                pacer = _Pacer(sbx, timeouts)
            r = sbx.exec([sbx.python, f"{ws}/{RUNNER_NAME}", f"{ws}/batch.json"], bound)
        except Exception as exc:
            if slot.aborted:  # destroyed under it by the drainer's stop: not a broken sandbox
                return [(j, self._stopped(None)) for j in jobs], None
            raise SandboxBroken(str(exc)) from None
        finally:
            if pacer is not None:
                pacer.stop()
            sbx.kill()
            slot.detach()
        got = self._parse(jobs, r.stdout)
        return got, _timed_out(r, got, timeouts, pacer, bound)

    def _lease_over(self, job: Job) -> bool:
        start_by = self._start_by(job)
        return start_by is not None and time.monotonic() >= start_by

    def _start_by(self, job: Job) -> float | None:
        """The last moment ``job`` may start: its timeout must end inside its lease."""
        end = self.not_after(job)
        return None if end is None else end - self.timeout_of(job)

    def _late(self) -> Outcome:
        return Outcome("release", error=LEASE_ENDED, run=describe_run(self.backend.name, None, "lease ended"))

    def _stopped(self, r: ExecResult | None) -> Outcome:
        return Outcome("release", error=RELEASED_STOPPING, run=describe_run(self.backend.name, r, "drainer stopped"))

    def _parse(self, jobs: Sequence[Job], stdout: str) -> list[tuple[Job, Outcome]]:
        """The records, in order, up to the first that is missing or not well formed.

        A handle() result line, ``{"i":N,"ok":true,"result":TEXT}``, is taken without decoding:
        TEXT goes to the completer as it is, when it is ASCII (the runner's json.dumps escapes
        the rest) with no escape jsonb refuses (``\u0000``, a surrogate: those lines take the full
        decode, which replaces them). The sandbox is not trusted for it: a line is read only at
        the place of the job expected next (``i``), TEXT is passed as one value, never spliced into
        a statement, and the server's jsonb cast is its check (TEXT that is not JSON fails that
        job alone, in the completer's one-by-one write)."""
        out: list[tuple[Job, Outcome]] = []
        n = len(jobs)
        done_run = _done_run(self.backend.name)
        for line in stdout.splitlines():
            i = len(out)
            if i == n:
                break
            head = f'{{"i":{i},"ok":true,"result":'
            if (line.startswith(head) and line.endswith("}") and line.isascii()
                    and len(line) <= _FAST_RESULT_CHARS and _REFUSED_ESCAPE.search(line) is None):
                out.append((jobs[i], done_with_json(line[len(head):-1], done_run)))
                continue
            try:
                rec = json.loads(line)
                if rec["i"] != i:
                    break
                if rec.get("late") is True:  # not started, too late by the lease the runner was given
                    break
                out.append((jobs[i], _outcome(self.backend.name, rec)))
            except (ValueError, KeyError, TypeError):
                break
        return out

    def _death(self, job: Job, handler: handlers.Handler, r: ExecResult) -> str:
        """The charged job's last_error when it took the sandbox down."""
        if handler.module and r.killed is None and r.exit_code == 1 and "Timeout (" in r.stderr:
            return f"killed: timeout after {self.timeout_of(job):g} s (stopped by the watchdog)"
        if r.ok:
            return "the batch runner ended without running this job"
        return describe_failure(r)


class _Aborted(Exception):
    pass


class _Pacer:
    """Keeps each job of a batch to its own deadline from the drainer's side: the runner writes one
    record per job as it ends, so the job running is the one after the last record, started no
    earlier than that record came. When it is still without a record ``HOST_GRACE`` seconds past
    its timeout (its handle() switched off the runner's timer and watchdog, say), the sandbox is
    destroyed; the run's result then names the timeout (:func:`_timed_out`) and the jobs after it
    go on in a fresh sandbox, uncharged. A record's newline is all it counts: a job that writes
    newlines on the channel gains at most its batch's later jobs' time (the blast radius of a
    batch), never the run's bound."""

    def __init__(self, sbx: Sandbox, timeouts: Sequence[float]) -> None:
        self._sbx = sbx
        self._timeouts = timeouts
        self._cond = threading.Condition()
        self._records = 0
        self._since = time.monotonic()
        self._stopped = False
        self.overdue: int | None = None  # the job killed at its deadline
        self._thread = threading.Thread(target=self._watch, name="pacer", daemon=True)
        self._thread.start()
        sbx.on_stdout = self._seen

    def _seen(self, chunk: bytes) -> None:
        n = chunk.count(b"\n")
        if n:
            with self._cond:
                self._records += n
                self._since = time.monotonic()
                self._cond.notify()

    def _watch(self) -> None:
        with self._cond:
            while not self._stopped and self._records < len(self._timeouts):
                left = self._since + self._timeouts[self._records] + HOST_GRACE - time.monotonic()
                if left <= 0:
                    self.overdue = self._records
                    break
                self._cond.wait(left)
        if self.overdue is not None:
            log.warning("a batch job outlived its timeout by %g s: destroying its sandbox", HOST_GRACE)
            self._sbx.kill()

    def stop(self) -> None:
        self._sbx.on_stdout = None
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join()


def _timed_out(r: ExecResult, got: Sequence[object], timeouts: Sequence[float], pacer: _Pacer | None,
               bound: float | None = None) -> ExecResult:
    """The run's result, naming the timeout of the first job without a record when the drainer
    (the pacer) or the tier (at the run's bound) killed it there, as the job's own timeout."""
    i = len(got)
    if i >= len(timeouts) or r.ok:
        return r
    if (pacer is not None and pacer.overdue == i) or (
            bound is not None and r.killed is not None and r.killed.startswith("killed: timeout")):
        return replace(r, killed=f"killed: timeout after {timeouts[i]:g} s")
    return r


def _said_late(stdout: str) -> bool:
    """Whether the runner's last record says it did not start a job, too late for its lease."""
    last = stdout.rstrip("\n").rpartition("\n")[2]
    return last.endswith('"late":true}') and last.startswith('{"i":')


def _feed(fifo: Path, data: bytes, result: Future[ExecResult]) -> bool:
    """Hand a batch to a spare's runner through its pipe. False when the runner is not there to
    read it (it ended, or never opened the pipe within FEED_SECONDS): it then ran nothing."""
    deadline = time.monotonic() + FEED_SECONDS
    while True:
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError as exc:
            if exc.errno != errno.ENXIO:  # ENXIO: the runner has not opened it yet
                return False
        if result.done() or time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    try:
        os.set_blocking(fd, True)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except OSError:  # the runner went away while reading: it cannot have started a job
        return False
    finally:
        os.close(fd)
    return True


def _text(value: object) -> str:
    """Text PostgreSQL accepts: a lone surrogate (from a \\udXXX escape) becomes "?"."""
    return str(value).encode("utf-8", "replace").decode("utf-8")


def _script_outcome(tier: str, r: ExecResult) -> Outcome:
    run = describe_run(tier, r)
    if r.ok:
        return Outcome("done", result=r.stdout, result_cut=r.stdout_cut, run=run)
    return Outcome("fail", error=describe_failure(r), result=r.stdout, result_cut=r.stdout_cut, run=run)


_DONE_RUNS: dict[str, Run] = {}


def _done_run(tier: str) -> Run:
    """The attempt-history view of a handle() that returned: one shared (frozen) Run per tier."""
    run = _DONE_RUNS.get(tier)
    if run is None:
        run = _DONE_RUNS[tier] = Run(tier=tier, exit_code=0)
    return run


def _outcome(tier: str, rec: dict[str, Any]) -> Outcome:
    if "ok" in rec:  # handle(): it returned (exit code 0 in the history) or raised (no exit code)
        if rec["ok"]:
            text = _RESULT_JSON.encode(rec["result"])
            return Outcome("done", result_json=_NUL_ESCAPE.sub(r"\1\\ufffd", _text(text)), run=_done_run(tier))
        error = _text(rec["error"])
        timed_out = error.startswith("killed: ")
        return Outcome("fail", error=error,
                       run=Run(tier=tier, kill_reason=error.removeprefix("killed: ") if timed_out else None))
    r = ExecResult(int(rec["exit"]), _text(rec["stdout"]), _text(rec["stderr"]), float(rec["duration"]),
                   _text(rec["killed"]) if isinstance(rec["killed"], str) else None,
                   stdout_cut=rec.get("stdout_cut") is True)
    return _script_outcome(tier, r)
