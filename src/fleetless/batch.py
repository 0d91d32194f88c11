"""Running claimed jobs in sandboxes: one job per sandbox, or a batch of one kind per sandbox.

:meth:`Runner.run` takes jobs of one kind and returns each job's :class:`~fleetless.job.Outcome`;
the completer writes them. How a batch runs:

- A script or executable handler with one job: the seed's shape, ``exec`` of the handler itself.
- Otherwise the in-sandbox batch runner (``sandbox/_batch_runner.py``) is written into the
  workspace and runs the jobs in order, each in a fork of its own (a ``handle(payload)`` module
  is imported once, before the first fork; a script is exec'd by the fork). Where the workspace
  is a host directory (process, bwrap) the drainer talks to it over two named pipes that only
  the two of them hold (:class:`_Channel`): a job is sent only when the one before it has ended
  and its processes are dead, a result comes back with that job's random tag, and a cancelled
  job that has not started is never sent. Elsewhere (microvm, forkserver) every job is in a file
  the runner reads and removes before the first job starts.
- Each job keeps its own outcome and its own output. A job that takes the sandbox down (the
  memory limit, the TTL) is charged alone: the jobs before it keep their results, and the ones
  after it run on in a fresh sandbox, charged nothing.
- When the drainer stops (:meth:`Slot.abort`), the sandbox is destroyed and every job without a
  result is released: back to pending with its attempt given back.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import re
import secrets
import select
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from . import decisions, handlers
from .failure import result_not_json, result_too_large, summarize_failure
from .job import Job, Outcome, Run, done_with_json
from .kinds import KindSettings
from .retry import MAX_ERROR_CHARS
from .sandbox import ExecResult, Sandbox, SandboxUnavailable, Template

__all__ = ["RUNNER_NAME", "Runner", "Slot", "Teardown", "describe_failure", "describe_run", "job_env"]

log = logging.getLogger("fleetless.batch")
RUNNER = Path(__file__).parent / "sandbox" / "_batch_runner.py"
RUNNER_NAME = "_fleetless_batch.py"
#: The runner as written into a sandbox: with fleetless/outcomes.py's text in it, which it serves
#: as ``fleetless.outcomes`` where the sandbox's python has no fleetless (one copy of the module).
_RUNNER_BYTES = RUNNER.read_bytes().replace(
    b'\nOUTCOMES_SOURCE = ""\n',
    b"\nOUTCOMES_SOURCE = " + repr((Path(__file__).parent / "outcomes.py").read_text()).encode() + b"\n", 1)
_RUNNER_COMM = b"fleetless-batch"  # the name the runner gives itself (_batch_runner.NAME)
#: The named pipes of the channel to a batch runner: jobs in, results out (unlinked once open).
CHANNEL_IN, CHANNEL_OUT = "batch.in", "batch.out"
#: Seconds a batch waits for a spare sandbox that is being started.
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
#: A shared batch's jobs sent to its runner ahead of the one running (``_converse_shared``).
SHARED_AHEAD = 64
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
CANCELLED_WAITING = "cancelled: an operator cancelled the job before its turn in its batch"
DESTROYED = "killed: sandbox destroyed"
RELEASED_FOR_CANCEL = ("released: its batch's sandbox was destroyed for a cancel of a job after it (the"
                       " drainer cannot reach this tier's batch runner)")


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
    return {"FLEETLESS_JOB_ID": str(job.id), "FLEETLESS_ATTEMPT": str(job.attempts),
            "FLEETLESS_SNOOZES": str(job.snoozes), "FLEETLESS_KIND": job.kind}


class Slot:
    """The sandbox a running batch uses right now, so that the drainer can destroy it on stop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sandbox: Sandbox | None = None
        self._on_cancel: Callable[[], None] | None = None
        self.aborted = False

    def attach(self, sbx: Sandbox, on_cancel: Callable[[], None] | None = None) -> bool:
        """Use ``sbx``; False (and nothing attached) when the slot was aborted already. With
        ``on_cancel``, a cancel calls it instead of destroying the sandbox (a batch's channel
        stops the cancelled job alone)."""
        with self._lock:
            if self.aborted:
                return False
            self._sandbox, self._on_cancel = sbx, on_cancel
            return True

    def detach(self) -> None:
        with self._lock:
            self._sandbox = self._on_cancel = None

    def kill_current(self) -> None:
        """A job of this slot was cancelled: stop it. Through a batch's channel only the job
        running is stopped, and only if it is the one cancelled (one that has not started is
        never sent); otherwise the sandbox in use is destroyed, the rest go on in a fresh one."""
        with self._lock:
            sbx, hook = self._sandbox, self._on_cancel
        if hook is not None:
            hook()
        elif sbx is not None:
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
        self.ready: list[tuple[Sandbox, _Channel, float]] = []  # oldest first, with its start
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
    #: Start spares only after a full batch (of ``spare_jobs``) is taken: a one-shot drain's, whose
    #: next batch is likely only while its claims come back full (watch mode: always).
    spare_after_full: bool = False
    #: Per-job mode: a job's sandbox is destroyed by this, beside the slot's next claim (None: inline).
    teardown: Teardown | None = None
    #: When the job's lease ends (``time.monotonic()``; None: unknown). A job starts only if its
    #: timeout ends inside it: else the reaper may give it to another drainer while it still runs
    #: here (issue 26, item 2). Checked just before a job's exec, and by the batch runner before
    #: each job (in a microVM's guest on its own clock, the boot allowance taken off), so a runner
    #: whose drainer is stopped or cut off starts nothing it cannot finish inside the lease the
    #: drainer last knew.
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
            error = f"no handler for kind {kind!r}: {handlers.missing(self.template.handlers_dir, kind)}"
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
        size = self._kind(kind).batch_size or len(jobs)  # a kind's batch_size = 1 refuses batching
        while left:
            if slot.aborted:
                done += [(j, self._stopped(None)) for j in left]
                break
            gone = [j for j in left if self.cancelled(j)]
            if gone:  # cancelled before their turn (a runner told to stop before them): never started
                done += [(j, self._cancelled_waiting()) for j in gone]
                left = [j for j in left if not self.cancelled(j)]
                continue
            if self._lease_over(left[0], batch=True):
                done.append((left[0], self._late()))
                left = left[1:]
                continue
            try:
                if not handler.module and (len(left) == 1 or size == 1):
                    got = [self._single(left[0], handler, slot)]
                    r = None
                else:
                    got, r = self._batch(left[:size], handler, slot)
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
            elif r.killed == DESTROYED and any(self.cancelled(j) for j in left[1:]):
                # destroyed for a cancel of a job after it (a runner the drainer cannot reach: a
                # microVM's): not its fault, given back uncharged
                done.append((left[0], Outcome("release", error=RELEASED_FOR_CANCEL,
                                              run=describe_run(self.backend.name, r, "cancel of another job"))))
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
        spare, sbx, chan = self._spare, None, None
        try:
            sbx = self.backend.create(self._spare_template(), self.ttl)
            host = sbx.host_workspace
            if host is None:  # the job's workspace is a copy (a microVM's): no pipe reaches it
                with spare.lock:
                    spare.closed = True
                return
            sbx.write(RUNNER_NAME, _RUNNER_BYTES)
            chan = _channel(host, sbx)
            if chan is None:  # no pipe can be made there: no spares (file mode starts its own)
                with spare.lock:
                    spare.closed = True
                return
            ws = sbx.workspace_path
            chan.start(sbx, [sbx.python, f"{ws}/{RUNNER_NAME}", f"{ws}/{CHANNEL_IN}", f"{ws}/{CHANNEL_OUT}"], self.ttl)
            with spare.lock:
                if not spare.closed:
                    spare.ready.append((sbx, chan, time.monotonic()))
                    sbx = chan = None
        except Exception as exc:  # no spare this time: the next batch starts its own sandbox
            log.debug("could not start a spare sandbox: %s", exc)
        finally:
            if sbx is not None:
                sbx.kill()
            if chan is not None:
                chan.close()
            with spare.lock:
                spare.starting -= 1
                spare.lock.notify_all()

    def _take_spare(self, jobs: Sequence[Job]) -> tuple[Sandbox, _Channel] | None:
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
                sbx, chan, born = spare.ready.pop(0)
                if chan.result.done() or time.monotonic() - born + need > self.ttl:
                    spare.lock.release()  # gone, or too little TTL left: replaced below
                    try:
                        sbx.kill()
                        chan.close()
                    finally:
                        spare.lock.acquire()
                else:
                    taken = sbx, chan
        if not self.spare_after_full or len(jobs) >= self.spare_jobs:
            self.prewarm()  # for the batches after this one
        return taken

    def close(self) -> None:
        """Destroy the spare sandboxes, start no other (the drain ends)."""
        spare = self._spare
        with spare.lock:
            spare.closed = True
            spare.lock.wait_for(lambda: not spare.starting, timeout=60)  # each kills what it made
            ready, spare.ready = spare.ready, []
        for sbx, chan, _ in ready:
            sbx.kill()
            chan.close()

    # -- one sandbox ---------------------------------------------------------------------------

    def _sandbox(self, template: Template, slot: Slot, kind: str,
                 on_cancel: Callable[[], None] | None = None) -> Sandbox:
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
        if not slot.attach(sbx, on_cancel):
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
        # batch_isolation = "shared": its handle() jobs one after another in the runner's own process
        shared = handler.module and self._kind(kind).shared

        def header(sbx: Sandbox) -> str:
            return json.dumps({
                "handler": f"{sbx.handlers_path}/{handler.filename}", "module": handler.module,
                "argv": handler.argv(sbx.handlers_path, sbx.python, "")[:-1],
                "budget": self.ttl_of(kind), "grace": HARD_GRACE, "kind": kind,
                "stdout_bytes": limits.stdout_bytes, "stderr_bytes": MAX_ERROR_CHARS, "shared": shared,
                "own_machine": sbx.own_machine})

        timeouts = [self.timeout_of(j) for j in jobs]
        spare = self._take_spare(jobs)
        if spare is not None:
            try:
                return self._converse(jobs, spare[0], spare[1], header(spare[0]), slot, shared)
            finally:
                spare[0].kill()
                spare[1].close()
                slot.detach()
        per_job = limits.stdout_bytes + RECORD_OVERHEAD
        template = replace(base, limits=replace(limits, stdout_bytes=per_job * len(jobs) + 65536))
        # file mode's answer to a cancel (a channel's conversation attaches its own): until the
        # exec starts, a cancel is left to the checks before it (the conversation's before each
        # job, file mode's just before the exec), so the sandbox is never destroyed while it is made
        made: list[Sandbox] = []
        paced: list[_Pacer | None] = [None]
        live = threading.Event()
        try:
            sbx = self._sandbox(template, slot, kind, self._file_cancel(made, jobs, paced, live))
        except _Aborted:
            return [(j, self._stopped(None)) for j in jobs], None
        made.append(sbx)
        chan: _Channel | None = None
        pacer = None
        # The whole run is held to the sum of its jobs' deadlines by the tier itself (also while the
        # drainer is stopped); each job to its own by the runner (a SIGKILL from outside the job's
        # process) and, from the drainer's side, by the channel's wait or the pacer.
        bound = min(self.ttl_of(kind), timeouts[0] + HARD_GRACE if len(timeouts) == 1
                    else sum(timeouts) + HOST_GRACE * len(timeouts))
        try:
            sbx.write(RUNNER_NAME, _RUNNER_BYTES)
            ws, host = sbx.workspace_path, sbx.host_workspace
            if host is not None:
                chan = _channel(host, sbx)
            if chan is not None:
                chan.start(sbx, [sbx.python, f"{ws}/{RUNNER_NAME}", f"{ws}/{CHANNEL_IN}", f"{ws}/{CHANNEL_OUT}"],
                           bound)
                return self._converse(jobs, sbx, chan, header(sbx), slot, shared)
            # a copied workspace (microvm, forkserver): every job in a file the runner removes first
            # (or a drainer that cannot make pipes in its jobs' workspaces: a non-root one's subordinate uids)
            tags = [secrets.token_hex(16) for _ in jobs]
            lines = [self._job_line(j, t).encode() for j, t in zip(jobs, tags, strict=True)]
            head = header(sbx)[:-1] + f',"sizes":{json.dumps([len(x) for x in lines])}}}'
            body = b"\n".join([head.encode(), *lines])
            sbx.write("batch.json", body + b"\n")
            if len(jobs) > 1:
                pacer = paced[0] = _Pacer(sbx, timeouts)
            live.set()
            if any(self.cancelled(j) for j in jobs):  # cancelled while its sandbox was made: the
                return [], None                       # batch runs again, without it, in a fresh one
            r = sbx.exec([sbx.python, f"{ws}/{RUNNER_NAME}", f"{ws}/batch.json"], bound)
            got = self._parse(jobs, tags, r.stdout)
            return got, _timed_out(r, got, timeouts, pacer, bound)
        except Exception as exc:
            if slot.aborted:  # destroyed under it by the drainer's stop: not a broken sandbox
                return [(j, self._stopped(None)) for j in jobs], None
            raise SandboxBroken(str(exc)) from None
        finally:
            if pacer is not None:
                pacer.stop()
            sbx.kill()
            if chan is not None:
                chan.close()
            slot.detach()

    def _file_cancel(self, made: list[Sandbox], jobs: Sequence[Job], paced: list[_Pacer | None],
                     live: threading.Event) -> Callable[[], None]:
        """File mode's answer to a cancel of a job of this batch (the drainer's cancel poll). The
        job running is the first without a record (:class:`_Pacer`; without one, the first): when
        it is the one cancelled, the sandbox is destroyed (the jobs after it run on in a fresh one).
        When a job after it was, the runner is told to start no other job (SIGUSR1,
        :func:`_stop_runner`): the job running finishes, and the rest go to a fresh sandbox without
        the cancelled ones. A microVM's guest runner passes it on (``Sandbox.stop_batch_runner``),
        and its guest streams the runner's records as they come (a pacer), as every tier does.
        Where the runner cannot be reached at all, the sandbox is destroyed as before, and the job
        running is released, not charged (Runner.run). A cancel of a job that has ended (its record
        is in) changes nothing: the job running goes on, and the ended one keeps its outcome."""

        def cancel() -> None:
            if not live.is_set():  # not started: the check before the exec runs none of them
                return
            sbx, pacer = made[0], paced[0]
            at = pacer.records() if pacer is not None else 0
            if not any(self.cancelled(j) for j in jobs[at:]):
                return  # the cancelled jobs have written their records: ended already
            if self.cancelled(jobs[at]):
                sbx.kill()
            elif not _stop_runner(sbx):
                log.warning("cannot reach the batch runner of a %s sandbox: destroying it for a cancel", sbx.name)
                sbx.kill()

        return cancel

    def _job_line(self, job: Job, tag: str) -> str:
        # the payload as the table gave it (jsonb's own output, valid JSON): never decoded here.
        # not_after: the last moment the job may start (its lease end less its timeout) on the
        # host's monotonic clock, which the runner reads too. A microVM's guest has a clock of its
        # own: start_within, seconds from the runner's start, which comes at most the tier's
        # overhead (its boot) after now, so the job never starts past that moment either (audit:
        # a SIGSTOPped drainer's guest started jobs after their leases ended and another drainer
        # had reaped them)
        end = self._start_by(job)
        if end is None:
            late = ""
        elif self.backend.host_clock:
            late = f'"not_after":{end!r},'
        else:
            late = f'"start_within":{end - time.monotonic() - self.backend.overhead_seconds!r},'
        return (f'{{"id":{job.id},"attempt":{job.attempts},"snoozes":{job.snoozes},'
                f'"timeout":{self.timeout_of(job)!r},{late}'
                f'"tag":"{tag}","payload":{job.payload_json}}}')

    def _converse(self, jobs: Sequence[Job], sbx: Sandbox, chan: _Channel, header: str,
                  slot: Slot, shared: bool = False) -> tuple[list[tuple[Job, Outcome]], ExecResult | None]:
        """Run ``jobs`` one at a time through a runner's channel: each job is sent when the one
        before it has ended (so no job sees another's payload), one cancelled before its turn is
        never sent, and a cancel of the job running stops it alone. ``shared``: a shared batch's
        runner, sent jobs ahead (:meth:`_converse_shared`)."""
        if shared:
            return self._converse_shared(jobs, sbx, chan, header, slot)
        running: list[tuple[Job, str]] = []

        def cancel() -> None:
            now = running[-1] if running else None
            if now is not None and self.cancelled(now[0]):
                chan.send(json.dumps({"cancel": now[1]}))

        if not slot.attach(sbx, cancel):
            return [(j, self._stopped(None)) for j in jobs], None
        out: list[tuple[Job, Outcome]] = []
        overdue: float | None = None
        late = ""
        if chan.send(header):
            for job in jobs:
                if self.cancelled(job):  # cancelled while it waited: it never starts
                    out.append((job, self._cancelled_waiting()))
                    continue
                if slot.aborted:
                    break
                tag = secrets.token_hex(16)
                running.append((job, tag))
                if not chan.send(self._job_line(job, tag)):
                    break
                outcome, said_late, past = self._answer(chan, sbx, job, tag, time.monotonic())
                if outcome is None:
                    late, overdue = said_late, past
                    break
                out.append((job, outcome))
        return self._ended(out, chan, slot, overdue, late)

    def _answer(self, chan: _Channel, sbx: Sandbox, job: Job, tag: str,
                since: float) -> tuple[Outcome | None, str, float | None]:
        """The runner's line for ``job`` (due ``HOST_GRACE`` past its timeout from ``since``): its
        outcome, or why the batch ends here: the runner's "too late for its lease" line (not
        started); no line in time (its timeout, the sandbox destroyed if the runner still runs);
        a malformed line (the sandbox destroyed)."""
        line = chan.recv(since + self.timeout_of(job) + HOST_GRACE)
        if line is not None and _said_late(line):  # not started: too late for its lease
            return None, line, None
        if line is None:
            if chan.result.done():
                return None, "", None
            sbx.kill()  # past its deadline without a result: stopped from here
            return None, "", self.timeout_of(job)
        outcome = self._record(job, tag, line)
        if outcome is None:
            log.warning("job %d: the batch runner sent a malformed result; its sandbox is destroyed", job.id)
            sbx.kill()
        return outcome, "", None

    def _ended(self, out: list[tuple[Job, Outcome]], chan: _Channel, slot: Slot, overdue: float | None,
               late: str) -> tuple[list[tuple[Job, Outcome]], ExecResult | None]:
        """A conversation's end: the runner told no more jobs come, and its run's result."""
        chan.finish()
        try:
            r = chan.result.result()
        except Exception as exc:
            if slot.aborted:
                return out, None
            raise SandboxBroken(str(exc)) from None
        if overdue is not None and not r.ok:
            r = replace(r, killed=f"killed: timeout after {overdue:g} s")
        if late:  # the caller reads it where file mode's runner writes it
            r = replace(r, stdout=late)
        return out, r

    def _converse_shared(self, jobs: Sequence[Job], sbx: Sandbox, chan: _Channel, header: str,
                         slot: Slot) -> tuple[list[tuple[Job, Outcome]], ExecResult | None]:
        """A shared batch (``batch_isolation = "shared"``) through the runner's channel: up to
        SHARED_AHEAD jobs are sent ahead of the one running, so the runner never waits for the
        drainer between jobs (their lines are in the runner's process before their turn: what a job
        of a shared batch can reach anyway). Each record is still taken in order, by its job's tag,
        each job held to its own deadline from its predecessor's record. A job cancelled before it
        is sent is never sent; one cancelled once sent gets a cancel line, which the runner honours
        when it reads it before the job's turn (``{"tag": T, "cancelled": true}``); the job running,
        cancelled, takes the sandbox down (the runner reads no line while ``handle()`` runs), the
        jobs after it run on in a fresh one. The runner starts no job after one stopped at its
        timeout: those run on in a fresh sandbox too."""
        flight: collections.deque[tuple[Job, str | None]] = collections.deque()  # in order; None: never sent
        lock = threading.Lock()

        def cancel() -> None:
            with lock:
                sent = [(j, t) for j, t in flight if t is not None]
            if sent and self.cancelled(sent[0][0]):  # the job running: the first sent without a record
                sbx.kill()
                return
            for j, t in sent[1:]:
                if self.cancelled(j):
                    chan.send(json.dumps({"cancel": t}))

        if not slot.attach(sbx, cancel):
            return [(j, self._stopped(None)) for j in jobs], None
        out: list[tuple[Job, Outcome]] = []
        overdue: float | None = None
        late = ""
        ahead = 0  # jobs[:ahead] are in flight or have their outcome
        broken = not chan.send(header)
        since = time.monotonic()  # when the job at the front started (about: its predecessor's record)
        while not broken:
            while ahead < len(jobs) and len(flight) < SHARED_AHEAD and not slot.aborted:
                job = jobs[ahead]
                ahead += 1
                tag = None if self.cancelled(job) else secrets.token_hex(16)
                with lock:
                    flight.append((job, tag))
                if tag is not None and not chan.send(self._job_line(job, tag), drain=True):
                    broken = True
                    break
            while flight and flight[0][1] is None:  # cancelled while it waited: it never starts
                with lock:
                    out.append((flight.popleft()[0], self._cancelled_waiting()))
            if broken or not flight or slot.aborted:
                break
            job, tag = flight[0]
            assert tag is not None
            outcome, said_late, past = self._answer(chan, sbx, job, tag, since)
            since = time.monotonic()
            if outcome is None:
                late, overdue = said_late, past
                break
            with lock:
                flight.popleft()
            out.append((job, outcome))
            if _timed_out_in_place(outcome):
                break  # a shared runner starts no job after a timeout: the rest in a fresh sandbox
        return self._ended(out, chan, slot, overdue, late)

    def _record(self, job: Job, tag: str, line: str) -> Outcome | None:
        """One job's result line, which must carry its tag (None when it is not well formed).

        A handle() result line, ``{"tag":T,"ok":true,"result":TEXT}``, is taken without decoding:
        TEXT goes to the completer as it is, when it is ASCII (the runner's json.dumps escapes
        the rest) with no escape jsonb refuses (``\u0000``, a surrogate: those lines take the full
        decode, which replaces them). TEXT is passed as one value, never spliced into a
        statement, and the server's jsonb cast is its check (TEXT that is not JSON fails that
        job alone, in the completer's one-by-one write)."""
        head = f'{{"tag":"{tag}","ok":true,"result":'
        if (line.startswith(head) and line.endswith("}") and line.isascii()
                and len(line) <= _FAST_RESULT_CHARS and _REFUSED_ESCAPE.search(line) is None):
            return done_with_json(line[len(head):-1], _done_run(self.backend.name))
        try:
            rec = json.loads(line)
            if rec["tag"] != tag:
                return None
            if rec.get("cancelled") is True:  # a shared runner's: cancelled before its turn, never started
                return self._cancelled_waiting() if self.cancelled(job) and set(rec) == {"tag", "cancelled"} else None
            outcome = _outcome(self.backend.name, rec)
        except (ValueError, KeyError, TypeError):
            return None
        if self.cancelled(job) and outcome.action != "done":
            return Outcome("fail", error=CANCELLED, permanent=True,
                           run=replace(outcome.run or Run(tier=self.backend.name), kill_reason="cancelled"))
        return outcome

    def _lease_over(self, job: Job, *, batch: bool = False) -> bool:
        """Whether ``job`` can no longer start inside its lease. ``batch``: in a batch's sandbox not
        started yet, whose runner may come the tier's whole start allowance later and, in a
        microVM's guest, counts each job's start-by time from its own start with that allowance
        taken off (:meth:`_job_line`): the host asks the same, or it would boot VM after VM whose
        runner says at once that the job is too late."""
        start_by = self._start_by(job)
        if start_by is None:
            return False
        allowance = self.backend.overhead_seconds if batch and not self.backend.host_clock else 0.0
        return time.monotonic() >= start_by - allowance

    def _start_by(self, job: Job) -> float | None:
        """The last moment ``job`` may start: its timeout must end inside its lease."""
        end = self.not_after(job)
        return None if end is None else end - self.timeout_of(job)

    def _cancelled_waiting(self) -> Outcome:
        return Outcome("fail", error=CANCELLED_WAITING, permanent=True,
                       run=Run(tier=self.backend.name, kill_reason="cancelled"))

    def _late(self) -> Outcome:
        return Outcome("release", error=LEASE_ENDED, run=describe_run(self.backend.name, None, "lease ended"))

    def _stopped(self, r: ExecResult | None) -> Outcome:
        return Outcome("release", error=RELEASED_STOPPING, run=describe_run(self.backend.name, r, "drainer stopped"))

    def _parse(self, jobs: Sequence[Job], tags: Sequence[str], stdout: str) -> list[tuple[Job, Outcome]]:
        """File mode's records, in order, up to the first that is missing or not well formed."""
        out: list[tuple[Job, Outcome]] = []
        for line in stdout.splitlines():
            i = len(out)
            if i == len(jobs):
                break
            outcome = self._record(jobs[i], tags[i], line)
            if outcome is None:
                break
            out.append((jobs[i], outcome))
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
    batch), never the run's bound. The first job is also given the sandbox's own start
    (``overhead_seconds``: a microVM's boot), which the exec's start does not wait for."""

    def __init__(self, sbx: Sandbox, timeouts: Sequence[float]) -> None:
        self._sbx = sbx
        self._timeouts = timeouts
        self._cond = threading.Condition()
        self._records = 0
        self._since = time.monotonic() + sbx.overhead_seconds
        self._stopped = False
        self.overdue: int | None = None  # the job killed at its deadline
        self._thread = threading.Thread(target=self._watch, name="pacer", daemon=True)
        self._thread.start()
        sbx.on_stdout = self._seen

    def records(self) -> int:
        """How many jobs have written their record: the index of the job running."""
        with self._cond:
            return self._records

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


def _timed_out_in_place(outcome: Outcome) -> bool:
    """A shared batch's job stopped at its timeout by the runner's own timer (its record says so)."""
    return outcome.action == "fail" and (outcome.error or "").startswith("killed: timeout")


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


class _Channel:
    """The drainer's ends of a batch runner's two named pipes, and the exec that runs the runner.

    Both pipes are made in the workspace and opened here (read-write: neither open waits for
    the runner) before the runner starts; the runner opens and unlinks them before it reads a
    job, and is non-dumpable, so no job can reach either. Writes wait for room, reads for a
    line, each until the runner's exec has returned (a pipe this side holds read-write never
    reports the other side's end)."""

    def __init__(self, host: Path, made: list[int] | None = None) -> None:
        self._fds: list[int] = []
        if made is not None:  # made by the sandbox: a subordinate-range drainer's holder (open_pipes)
            self._fds += made
        else:
            owner = host.stat()  # the job's uid owns its workspace, and so its pipes
            for path in [host / CHANNEL_IN, host / CHANNEL_OUT]:
                os.mkfifo(path, 0o600)
                os.chown(path, owner.st_uid, owner.st_gid)
                self._fds.append(os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC))
        self._to, self._from = self._fds
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._fds += [self._wake_r, self._wake_w]
        self._buf = b""
        self._lock = threading.Lock()
        self._closed = False
        self.result: Future[ExecResult] = Future()

    def start(self, sbx: Sandbox, argv: list[str], ttl: float) -> None:
        def run() -> None:
            try:
                self.result.set_result(sbx.exec(argv, ttl))
            except BaseException as exc:
                self.result.set_exception(exc)
            finally:
                with self._lock:
                    if not self._closed:
                        os.write(self._wake_w, b"x")

        threading.Thread(target=run, name="batch-exec", daemon=True).start()

    def send(self, line: str, drain: bool = False) -> bool:
        """Write one line; False when the runner ended before it could take it. ``drain`` (the
        thread that calls :meth:`recv` alone): what the runner writes meanwhile is read into the
        buffer, so a runner blocked on a full result pipe never leaves this write waiting for ever."""
        view = memoryview((line + "\n").encode())
        with self._lock:
            if self._closed or self._to < 0:
                return False
            while view:
                try:
                    view = view[os.write(self._to, view):]
                    continue
                except BlockingIOError:
                    pass
                ready = select.select([self._wake_r, *([self._from] if drain else [])], [self._to], [])[0]
                if self._from in ready:
                    with contextlib.suppress(BlockingIOError):
                        self._buf += os.read(self._from, 1 << 16)
                if self._wake_r in ready:
                    return False
        return True

    def recv(self, deadline: float) -> str | None:
        """The runner's next line; None when it ended without one, or at ``deadline``."""
        while b"\n" not in self._buf:
            try:
                data = os.read(self._from, 1 << 16)
                self._buf += data
                continue
            except BlockingIOError:
                pass
            left = deadline - time.monotonic()
            if self.result.done() or left <= 0:  # it has ended, and the pipe is read to the end
                return None
            select.select([self._from, self._wake_r], [], [], left)
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode("utf-8", "replace")

    def finish(self) -> None:
        """No more jobs: the runner reads the end of its input and exits."""
        with self._lock:
            if self._to >= 0 and not self._closed:
                os.close(self._to)
                self._fds.remove(self._to)
                self._to = -1

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for fd in self._fds:
                os.close(fd)
            self._fds = []


def _stop_runner(sbx: Sandbox) -> bool:
    """Send SIGUSR1 to the batch runner running in ``sbx`` (file mode: start no other job); False
    when it cannot be found for certain or signalled. The runner is the one process of the
    sandbox's tree named as the runner names itself whose parent is not so named (a handle() job is
    a fork of it, with its name; an orphan comes back to it, a subreaper): a job that mimics it
    elsewhere makes two, and none is signalled."""
    from .sandbox import _tree

    top = sbx.host_pid
    if top is None:  # nothing of it on this host (a microVM's guest): through the tier, if it can
        return sbx.stop_batch_runner()
    marked: dict[int, int] = {}  # pid -> parent, of the processes that look like the runner
    for pid in [top, *_tree.descendants(top)]:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
            parent = int(stat[stat.rindex(b")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if stat[stat.index(b"(") + 1:stat.rindex(b")")] == _RUNNER_COMM:
            marked[pid] = parent
    tops = [pid for pid, parent in marked.items() if parent not in marked]
    if len(tops) != 1:
        return False
    try:
        pidfd = os.pidfd_open(tops[0])
    except OSError as exc:
        log.debug("cannot reach the batch runner %d: %s", tops[0], exc)
        return False
    # The runner names itself first thing, and catches SIGUSR1 only once it has read its header
    # and imported the handler: a SIGUSR1 before that would kill it (its first job charged with
    # 'killed by SIGUSR1'). Sent once it catches the signal, by a thread that waits for that.
    threading.Thread(target=_usr1_when_caught, args=(tops[0], pidfd), name="stop-runner", daemon=True).start()
    return True


#: Bit of SIGUSR1 in /proc/<pid>/status's SigCgt (the signals a process catches).
_USR1_BIT = 1 << (signal.SIGUSR1 - 1)


def _usr1_when_caught(pid: int, pidfd: int) -> None:
    """SIGUSR1 to the runner (through its pidfd: never another process) once it catches it;
    nothing if it ends first."""
    try:
        while True:
            try:
                with open(f"/proc/{pid}/status") as f:
                    caught = next((int(line.split()[1], 16) & _USR1_BIT for line in f
                                   if line.startswith("SigCgt:")), 0)
            except (OSError, ValueError, IndexError):
                caught = 0
            if caught:
                signal.pidfd_send_signal(pidfd, signal.SIGUSR1)
                return
            if select.select([pidfd], [], [], 0.02)[0]:  # it ended
                return
    except OSError as exc:
        log.debug("cannot signal the batch runner %d: %s", pid, exc)
    finally:
        os.close(pidfd)


def _said_late(stdout: str) -> bool:
    """Whether the runner's last record says it did not start a job, too late for its lease: a
    record of exactly a tag and ``late`` (a job's result could end like one: not taken as one)."""
    last = stdout.rstrip("\n").rpartition("\n")[2]
    if not (last.endswith('"late":true}') and last.startswith('{"tag":')):
        return False
    try:
        rec = json.loads(last)
    except ValueError:
        return False
    return isinstance(rec, dict) and set(rec) == {"tag", "late"} and rec["late"] is True


def _channel(host: Path, sbx: Sandbox) -> _Channel | None:
    """A channel in ``host`` (its pipes made by the sandbox where the drainer may not: a non-root
    drainer's holder, whose jobs' workspaces are its subordinate uids'), or None where none can be
    made: the batch then runs in file mode."""
    try:
        return _Channel(host, sbx.open_pipes((CHANNEL_IN, CHANNEL_OUT)))
    except (OSError, SandboxUnavailable) as exc:
        for name in (CHANNEL_IN, CHANNEL_OUT):
            with contextlib.suppress(OSError):
                (host / name).unlink()
        log.debug("no batch channel in %s (%s): every job in a file", host, exc)
        return None


def _text(value: object) -> str:
    """Text PostgreSQL accepts: a lone surrogate (from a \\udXXX escape) becomes "?"."""
    return str(value).encode("utf-8", "replace").decode("utf-8")


def _script_outcome(tier: str, r: ExecResult) -> Outcome:
    run = describe_run(tier, r)
    if r.ok:
        return Outcome("done", result=r.stdout, result_cut=r.stdout_cut, run=run)
    if r.killed is None and r.exit_code in decisions.EXIT_CODES:  # the script decided: 90 discard, 91 snooze, 92 retry
        decided = decisions.from_exit(r.exit_code, r.stderr, run, r.stdout, r.stdout_cut)
        if decided is not None:
            return decided
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
        stdout = _text(rec.get("stdout") or "") or None  # what this job printed, its own alone
        cut = rec.get("stdout_cut") is True  # printed past the cap: its stored output says so, as a script's
        if rec["ok"]:
            if rec["result"] is None and stdout is not None:  # returned nothing, printed: as a script
                return Outcome("done", result=stdout, result_cut=cut, run=_done_run(tier))
            text = _RESULT_JSON.encode(rec["result"])
            # what it printed stays its own too: result beside result_json (it was dropped)
            return Outcome("done", result=stdout, result_cut=cut,
                           result_json=_NUL_ESCAPE.sub(r"\1\\ufffd", _text(text)), run=_done_run(tier))
        if "too_large" in rec:  # its result is past the cap: as deterministic as its payload, never retried
            return Outcome("fail", error=result_too_large(int(rec["too_large"])), permanent=True, result=stdout,
                           result_cut=cut, run=Run(tier=tier, exit_code=0))
        if "not_json" in rec:  # it returned a set, NaN, an object: the same again on every try
            return Outcome("fail", error=result_not_json(_text(str(rec["not_json"]))), permanent=True,
                           result=stdout, result_cut=cut, run=Run(tier=tier, exit_code=0))
        if "decided" in rec:  # it raised fleetless.outcomes' Discard, Snooze or Retry
            return decisions.from_handle(rec["decided"], Run(tier=tier), stdout, _text(rec.get("stderr") or ""),
                                         cut)
        error = _text(rec["error"])
        timed_out = error.startswith("killed: ")
        stderr = _text(rec.get("stderr") or "").rstrip()
        if stderr:  # its own stderr's tail after the error's head
            error = error[:MAX_ERROR_CHARS // 2].rstrip() + "\n" + stderr[-(MAX_ERROR_CHARS // 2 - 1):]
        return Outcome("fail", error=error, result=stdout, result_cut=cut,
                       run=Run(tier=tier, kill_reason=error.split("\n", 1)[0].removeprefix("killed: ")
                               if timed_out else None))
    r = ExecResult(int(rec["exit"]), _text(rec["stdout"]), _text(rec["stderr"]), float(rec["duration"]),
                   _text(rec["killed"]) if isinstance(rec["killed"], str) else None,
                   stdout_cut=rec.get("stdout_cut") is True)
    return _script_outcome(tier, r)
