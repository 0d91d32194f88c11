"""One drain run: maintenance, then claim -> sandbox -> finish until nothing is claimable.

A drainer never waits for new work. It exits when a claim returns nothing and no job of its own
is still running, when its runtime budget is spent (it stops claiming and finishes what it
holds), or when asked to stop (SIGTERM: stop claiming, give running jobs a grace period, then
destroy their sandboxes and give their claims back without charging an attempt).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType
from typing import Literal, TypeVar

import psycopg

from . import handlers, kinds, maintenance
from .events import FinishedAs, JobFinished, NullReporter, Reporter
from .insights import error_head, summarize_failure
from .job import Job, Run, Status
from .queue import Queue
from .retry import MAX_ERROR_CHARS, RetryPolicy
from .sandbox import ExecResult, Limits, Sandbox, SandboxUnavailable, Template, choose_tier, get_backend

__all__ = ["DrainConfig", "DrainError", "Drainer", "Summary", "base_env", "describe_failure", "job_env"]

log = logging.getLogger("fleetless.drainer")
T = TypeVar("T")

#: How often a drain holding jobs asks the table which of them an operator cancelled.
CANCEL_POLL_SECONDS = 1.0
#: How long the drainer keeps trying to reach a database that went away before giving up.
DB_RETRY_SECONDS = 30.0
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"


class DrainError(RuntimeError):
    """The drain cannot go on (database lost, sandbox broken); the message says why."""


@dataclass(frozen=True)
class DrainConfig:
    handlers_dir: Path
    queues: tuple[str, ...] | None = None
    batch: int = 20
    concurrency: int = field(default_factory=lambda: os.cpu_count() or 1)
    max_runtime: float | None = None
    timeout: float = 600
    ttl: float = 900
    lease_grace: float = 60
    shutdown_grace: float = 30
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    sandbox: str = "process"
    limits: Limits = field(default_factory=Limits)
    pass_env: tuple[str, ...] = ()
    python: str | None = None
    maintenance: maintenance.Settings = field(default_factory=maintenance.Settings)

    def __post_init__(self) -> None:
        for name in ("batch", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be at least 1")
        for name in ("timeout", "ttl"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name} must be positive")
        if self.max_runtime is not None and self.max_runtime <= 0:
            raise ValueError("--max-runtime must be positive")


@dataclass
class Summary:
    claimed: int = 0
    done: int = 0
    retried: int = 0
    dead: int = 0
    released: int = 0  # claims given back without charging an attempt
    cancelled: int = 0  # running jobs an operator cancelled (fleetless cancel)
    fenced_out: int = 0  # outcomes discarded: the claim had been reaped and taken over
    reaped: int = 0
    pruned: int = 0  # finished jobs deleted by retention
    scheduled: int = 0  # periodic jobs enqueued
    seconds: float = 0.0

    def line(self) -> str:
        extra = "".join(
            f", {n} {what}"
            for n, what in ((self.released, "released"), (self.cancelled, "cancelled"),
                            (self.fenced_out, "fenced out"), (self.reaped, "reaped"), (self.pruned, "pruned"),
                            (self.scheduled, "scheduled"))
            if n
        )
        return (
            f"drained: claimed {self.claimed}, done {self.done}, retried {self.retried}, "
            f"dead {self.dead}{extra} in {self.seconds:.1f} s"
        )


@dataclass(frozen=True)
class _Outcome:
    what: Literal["ran", "no_handler", "sandbox_error", "cancelled"]
    result: ExecResult | None = None
    error: str = ""


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


def parse_pass_env(items: tuple[str, ...], environ: dict[str, str] | None = None) -> dict[str, str]:
    """``NAME`` copies the drainer's value (if set); ``NAME=VALUE`` sets it."""
    environ = dict(os.environ) if environ is None else environ
    out: dict[str, str] = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not name or not (name[0].isalpha() or name[0] == "_") or not name.replace("_", "").isalnum():
            raise ValueError(f"invalid --pass-env {item!r}: NAME or NAME=VALUE")
        if eq:
            out[name] = value
        elif name in environ:
            out[name] = environ[name]
    return out


def base_env(passed: dict[str, str]) -> dict[str, str]:
    """What every job of a drain gets: PATH, LANG and what the operator passed. Nothing else of
    the drainer's environment reaches a job."""
    return {"PATH": DEFAULT_PATH, "LANG": "C.UTF-8", **passed}


def job_env(job: Job, base: dict[str, str]) -> dict[str, str]:
    """One job's whole environment: the drain's, plus who it is."""
    return {**base, "FLEETLESS_JOB_ID": str(job.id), "FLEETLESS_ATTEMPT": str(job.attempts),
            "FLEETLESS_KIND": job.kind}


class Drainer:
    def __init__(self, queue: Queue, config: DrainConfig, reporter: Reporter | None = None) -> None:
        self.queue = queue
        tier, self.tier_note = choose_tier(config.sandbox)  # "auto": one line says which, and why
        self.config = config = replace(config, sandbox=tier)
        self.reporter: Reporter = reporter or NullReporter()
        self._claimed_at: dict[int, float] = {}  # job id -> monotonic time of its claim
        self._claimed_by = f"{socket.gethostname()}:{os.getpid()}"
        self.summary = Summary()
        self._backend: type[Sandbox] = get_backend(config.sandbox)
        self._env = base_env(parse_pass_env(config.pass_env))
        self._stop_at: float | None = None  # monotonic time after which running jobs are aborted
        self._fatal: str | None = None
        self._reached_db = False  # "cannot connect" until a call succeeded, "lost" after
        self._lock = threading.Lock()
        self._sandboxes: dict[int, Sandbox] = {}
        self._aborted: set[int] = set()
        self._kinds: dict[str, kinds.KindSettings] = {}  # fleetless.toml, read when the drain starts
        self._cancelled: set[int] = set()  # jobs an operator cancelled while this drain held them
        self._next_cancel_poll = 0.0
        self._handlers_dir = config.handlers_dir
        self._template = Template(handlers_dir=config.handlers_dir, limits=config.limits, env=self._env,
                                  python=config.python)
        self._maintainer = maintenance.Maintainer(queue, self._backend, config.maintenance, guard=self._db)

    # -- control -----------------------------------------------------------------------------

    def stop(self, grace: float | None = None) -> None:
        """Stop claiming; abort running jobs after ``grace`` seconds (default: the config's)."""
        grace = self.config.shutdown_grace if grace is None else grace
        deadline = time.monotonic() + grace
        if self._stop_at is None or deadline < self._stop_at:
            self._stop_at = deadline

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT: stop claiming and wind down; a second one aborts at once."""

        def handler(signum: int, frame: FrameType | None) -> None:
            if self._stop_at is None:
                log.warning("%s: stopping; running jobs get %g s", signal.Signals(signum).name,
                            self.config.shutdown_grace)
                self.stop()
            else:
                self.stop(grace=0)

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    @property
    def stopping(self) -> bool:
        return self._stop_at is not None

    # -- the run -----------------------------------------------------------------------------

    def run(self) -> Summary:
        try:
            return self._run()
        finally:
            self.reporter.close()

    def _run(self) -> Summary:
        started = time.monotonic()
        try:
            self._handlers_dir = handlers.check_dir(self.config.handlers_dir)
            self._template = replace(self._template, handlers_dir=self._handlers_dir)
            self._kinds = kinds.load(self._handlers_dir)
            self._backend.check()
            self._backend.check_template(self._template)
            for kind, ks in sorted(self._kinds.items()):
                if ks.interpreter is not None:
                    try:
                        self._backend.check_template(replace(self._template, python=ks.interpreter))
                    except SandboxUnavailable as exc:
                        raise SandboxUnavailable(f"{kinds.FILENAME} [kinds.{kind}] interpreter: {exc}") from None
        except (handlers.HandlersDirError, SandboxUnavailable, kinds.SettingsError) as exc:
            raise DrainError(str(exc)) from None
        self._maintenance()
        budget_end = started + self.config.max_runtime if self.config.max_runtime else None
        running: dict[Future[_Outcome], Job] = {}
        with ThreadPoolExecutor(max_workers=self.config.concurrency, thread_name_prefix="job") as pool:
            try:
                while True:
                    self._maintenance()  # a no-op until the maintenance interval has passed
                    claiming = (
                        not self.stopping
                        and self._fatal is None
                        and (budget_end is None or time.monotonic() < budget_end)
                    )
                    if claiming:
                        while len(running) < self.config.concurrency:
                            want = min(self.config.batch, self.config.concurrency - len(running))
                            jobs = self._claim(want)
                            self.summary.claimed += len(jobs)
                            for job in jobs:
                                self._claimed_at[job.id] = time.monotonic()
                                self.reporter.claimed(job)
                                running[pool.submit(self._execute, job)] = job
                            if len(jobs) < want:
                                break
                    if not running:
                        break
                    if self._stop_at is not None and time.monotonic() >= self._stop_at:
                        self._abort(running.values())
                    finished, _ = wait(running, timeout=0.25, return_when=FIRST_COMPLETED)
                    self._poll_cancels(running.values())
                    for fut in finished:
                        self._finish(running.pop(fut), fut.result())
            except BaseException:
                self._abort(running.values())
                raise
        self.summary.seconds = time.monotonic() - started
        if self._fatal:
            raise DrainError(self._fatal)
        return self.summary

    def _claim(self, n: int) -> list[Job]:
        c = self.config
        grace = c.lease_grace + self._backend.overhead_seconds
        # A kind's own timeout or TTL may be longer than the drain's: the lease covers the longest.
        timeout = max([c.timeout, *(k.timeout for k in self._kinds.values() if k.timeout)])
        ttl = max([c.ttl, *(k.ttl for k in self._kinds.values() if k.ttl)])
        return self._db(lambda: self.queue.claim(
            n, queues=c.queues, default_timeout=timeout, ttl=ttl, lease_grace=grace,
            claimed_by=self._claimed_by, tier=c.sandbox))

    def _maintenance(self) -> None:
        """The housekeeping units: at the start of the drain, then every maintenance interval."""
        try:
            report = self._maintainer.run_due()
        except OSError as exc:
            raise DrainError(f"cannot use the sandbox work directory: {exc}") from None
        if report is not None:
            self.summary.reaped += len(report.reaped.reaped)
            self.summary.pruned += report.pruned.deleted
            self.summary.scheduled += report.scheduled.enqueued

    def _poll_cancels(self, jobs: Iterable[Job]) -> None:
        """About once a second while jobs run: kill the sandboxes of jobs an operator cancelled."""
        now = time.monotonic()
        if now < self._next_cancel_poll:
            return
        self._next_cancel_poll = now + CANCEL_POLL_SECONDS
        held = [j.id for j in jobs if j.id not in self._cancelled]
        cancelled = self._db(lambda: self.queue.cancel_requested(held)) if held else set()
        with self._lock:
            for job_id in cancelled:
                log.warning("job %d: cancelled by request; killing its sandbox", job_id)
                self._cancelled.add(job_id)
                sbx = self._sandboxes.get(job_id)
                if sbx is not None:
                    sbx.kill()

    def _abort(self, jobs: Iterable[Job]) -> None:
        with self._lock:
            for job in list(jobs):
                sbx = self._sandboxes.get(job.id)
                self._aborted.add(job.id)
                if sbx is not None:
                    sbx.kill()

    def _db(self, call: Callable[[], T]) -> T:
        """Run a queue call, riding out a database restart for up to DB_RETRY_SECONDS."""
        deadline = time.monotonic() + DB_RETRY_SECONDS
        delay = 0.2
        while True:
            try:
                out = call()
                self._reached_db = True
                return out
            except (psycopg.OperationalError, ConnectionError) as exc:
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                first = first.removeprefix("cannot connect to the database: ")
                if time.monotonic() + delay > deadline:
                    what = "lost the database connection" if self._reached_db else "cannot connect to the database"
                    self._fatal = f"{what}: {first}"
                    raise DrainError(self._fatal) from None
                log.warning("database unavailable (%s); retrying", first)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)

    # -- one job -----------------------------------------------------------------------------

    def _execute(self, job: Job) -> _Outcome:
        """Runs in a worker thread: one job, one sandbox, always destroyed."""
        handler = handlers.resolve(self._handlers_dir, job.kind)
        if handler is None:
            return _Outcome(
                "no_handler",
                error=f"no handler for kind {job.kind!r}: neither {job.kind}.py nor an executable "
                f"{job.kind} in {self._handlers_dir}",
            )
        ks = self._kinds.get(job.kind, kinds.KindSettings())
        template = replace(self._template, env=job_env(job, self._env), limits=ks.limits(self._template.limits),
                           python=ks.interpreter or self._template.python)
        ttl = ks.ttl or self.config.ttl
        timeout = min(float(job.timeout_seconds or ks.timeout or self.config.timeout), ttl)
        sbx: Sandbox | None = None
        try:
            sbx = self._backend.create(template, ttl)
            with self._lock:
                if job.id in self._cancelled:
                    return _Outcome("cancelled")
                if job.id in self._aborted:
                    raise SandboxUnavailable("drainer is stopping")
                self._sandboxes[job.id] = sbx
            sbx.write("payload.json", json.dumps(job.payload))
            self.reporter.started(job)
            argv = handler.argv(sbx.handlers_path, sbx.python, f"{sbx.workspace_path}/payload.json")
            return _Outcome("ran", result=sbx.exec(argv, timeout))
        except Exception as exc:  # the sandbox broke: not the job's fault
            return _Outcome("sandbox_error", error=f"sandbox error ({self.config.sandbox}): {exc}")
        finally:
            if sbx is not None:
                sbx.kill()
            with self._lock:
                self._sandboxes.pop(job.id, None)

    def _finish(self, job: Job, outcome: _Outcome) -> None:
        what, error = self._record(job, outcome)
        started = self._claimed_at.pop(job.id, None)
        self.reporter.finished(JobFinished(
            id=job.id, kind=job.kind, queue=job.queue, attempt=job.attempts, outcome=what,
            duration=time.monotonic() - started if started is not None else 0.0,
            tier=self.config.sandbox, error_head=error_head(error)))

    def _record(self, job: Job, outcome: _Outcome) -> tuple[FinishedAs, str | None]:
        """Write the outcome (fenced) and count it; return what became of the claim and the error."""
        s = self.summary
        tier = self.config.sandbox
        ended_on_its_own = outcome.what == "ran" and outcome.result is not None and outcome.result.killed is None
        if job.id in self._cancelled and not (outcome.result is not None and outcome.result.ok):
            # The cancel mark turns this failed attempt into cancelled, with no further attempt.
            run = replace(describe_run(tier, outcome.result), kill_reason="cancelled")
            status = self._db(lambda: self.queue.fail(
                job, "cancelled: an operator cancelled the job while it ran", delay=0, permanent=True, run=run))
            if status is None:
                s.fenced_out += 1
                return "fenced_out", None
            s.cancelled += 1
            return "cancelled", "cancelled while it ran"
        if job.id in self._aborted and not ended_on_its_own:  # one that ended keeps its outcome
            reason = "released: the drainer stopped before the job finished"
            run = describe_run(tier, outcome.result, "drainer stopped")
            if self._db(lambda: self.queue.release(job, reason, run=run)):
                s.released += 1
                return "released", reason
            s.fenced_out += 1
            return "fenced_out", None
        if outcome.what == "sandbox_error":
            log.error("job %d: %s", job.id, outcome.error)
            self._fatal = outcome.error
            if self._db(lambda: self.queue.release(job, outcome.error, run=describe_run(tier, None, "sandbox error"))):
                s.released += 1
                return "released", outcome.error
            return "fenced_out", outcome.error
        result = outcome.result
        run = describe_run(tier, result)
        if result is not None and result.ok:
            ok = self._db(lambda: self.queue.complete(job, result.stdout, run=run, result_cut=result.stdout_cut))
            if ok:
                s.done += 1
                return "done", None
            s.fenced_out += 1
            log.warning("job %d: finished, but its claim had expired and was taken over", job.id)
            return "fenced_out", None
        if result is not None:
            error, permanent, stdout = describe_failure(result), False, result.stdout
        else:
            error, permanent, stdout = outcome.error, True, None
        delay = self._kinds.get(job.kind, kinds.KindSettings()).retry(self.config.retry).delay(job.attempts)
        cut = result is not None and result.stdout_cut
        status = self._db(lambda: self.queue.fail(job, error, delay=delay, permanent=permanent, result=stdout,
                                                  run=run, result_cut=cut))
        if status is None:
            s.fenced_out += 1
            return "fenced_out", error
        if status is Status.DEAD:
            s.dead += 1
            return "dead", error
        s.retried += 1
        return "retried", error
