"""One drain run: maintenance, then claim -> sandbox -> finish, in one loop with a wait strategy.

Without ``watch`` the drainer never waits for new work: it exits when a claim returns nothing and
no job of its own is still running. With ``watch`` it then sleeps until an enqueue's NOTIFY, the
next pending job's due time or ``idle_exit`` (see :mod:`fleetless.watch`). Either way it stops
claiming when its runtime budget is spent (finishing what it holds), or when asked to stop
(SIGTERM: stop claiming, give running jobs a grace period, then destroy their sandboxes and give
their claims back without charging an attempt).

A unit of work is one claim's jobs of one kind in one sandbox (``per_sandbox`` > 1, batch mode)
or one job (per-job mode); :mod:`fleetless.batch` runs it, :mod:`fleetless.completer` writes its
outcomes: inline in per-job mode (written before the slot claims again), batched in batch mode,
where the drainer also renews the leases of every job it holds with one fenced statement.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeVar

from . import db, handlers, kinds, maintenance
from .batch import CANCELLED, RELEASED_STOPPING, Runner, Slot, Teardown, describe_failure, describe_run, job_env
from .completer import Completer
from .events import JobFinished, NullReporter, Reporter, finished_as, spent_words
from .failure import error_head
from .job import Claim, Job, Outcome, Run, Status, claim_of
from .queue import Queue
from .retry import RetryPolicy
from .sandbox import Limits, Sandbox, SandboxUnavailable, Template, choose_tier, get_backend

__all__ = ["DrainConfig", "DrainError", "Drainer", "Summary", "base_env", "describe_failure", "describe_run",
           "job_env"]

if TYPE_CHECKING:
    from .watch import Watcher

log = logging.getLogger("fleetless.drainer")
_NO_SETTINGS = kinds.KindSettings()  # a kind fleetless.toml does not name (frozen: shared, built once)
T = TypeVar("T")

#: How long the drainer keeps trying to reach a database that went away before giving up.
DB_RETRY_SECONDS = 30.0
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
#: How often a drain holding jobs asks the table which of them an operator cancelled.
CANCEL_POLL_SECONDS = 1.0
#: Watch mode: how soon a drain looks again at due jobs it could not claim while a kind with a
#: concurrency or rate limit is set (they wait for room, which another host's drain may free).
LIMIT_POLL_SECONDS = 1.0
#: Watch mode: a job that is due but that the claim just now could not take (another transaction
#: holds its row: a claim in flight, an operator's open transaction) is looked at again after this
#: long, doubling up to UNCLAIMABLE_MAX_SECONDS, instead of at once (a loop of claims and commits).
UNCLAIMABLE_FIRST_SECONDS = 0.05
UNCLAIMABLE_MAX_SECONDS = 1.0
#: The least --lease-grace: the grace pays for creating the sandbox and for tearing it down and
#: writing the outcome, so that a lease does not expire under a live drainer.
MIN_LEASE_GRACE = 3.0
#: Upper bound of every duration option: far beyond any real use, and inside what PostgreSQL's
#: timestamps can hold when added to now().
MAX_SECONDS = 10 * 365 * 86400.0
MAX_BATCH = 10_000
#: The shortest --watch-lease: the watcher renews its heartbeat every third of it.
MIN_WATCH_LEASE = 3.0
MAX_CONCURRENCY = 4096


def sleep_for(next_due: float | None, idle_left: float | None, cap: float = 60.0) -> float:
    """How long the drain loop may sleep: until the next job is due, the idle exit, or ``cap``."""
    candidates = [cap]
    if next_due is not None:
        candidates.append(max(next_due, 0.0))
    if idle_left is not None:
        candidates.append(max(idle_left, 0.0))
    return min(candidates)


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
    per_sandbox: int = 1  # batch mode above 1: up to this many claimed jobs of one kind per sandbox
    watch: bool = False  # wait for work (NOTIFY, next due time) instead of exiting when idle
    idle_exit: float | None = None  # watch mode: exit after this long with nothing to do (None: never)
    #: a job of a kind with no handler here: given back, due again after this long (None: dead at once)
    no_handler_delay: float | None = 60.0
    watch_lease: float | None = None  # watch mode: a cron tick takes over a watcher silent this long
    flush_size: int = 500  # batch mode: a write starts once this many outcomes wait
    flush_interval: float = 0.05  # batch mode: an outcome waits at most this long to be written

    def __post_init__(self) -> None:
        if not 1 <= self.per_sandbox <= 100_000:
            raise ValueError("--per-sandbox must be from 1 to 100000")
        if self.idle_exit is not None and self.idle_exit <= 0:
            raise ValueError("--idle-exit must be positive")
        if self.idle_exit is not None and not self.watch:
            raise ValueError("--idle-exit needs --watch")
        if self.watch_lease is not None and not self.watch:
            raise ValueError("--watch-lease needs --watch")
        if self.watch_lease is not None and not MIN_WATCH_LEASE <= self.watch_lease <= MAX_SECONDS:
            raise ValueError(f"--watch-lease must be from {MIN_WATCH_LEASE:g} s to {MAX_SECONDS / 86400:.0f} days")
        # Every value is checked here, before anything is claimed: a value PostgreSQL cannot add
        # to now() would otherwise surface as an error in the middle of a drain.
        for name, most in (("batch", MAX_BATCH), ("concurrency", MAX_CONCURRENCY)):
            if not 1 <= getattr(self, name) <= most:
                raise ValueError(f"--{name} must be from 1 to {most}")
        for name in ("timeout", "ttl", "max_runtime", "lease_grace", "shutdown_grace"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_SECONDS:
                raise ValueError(f"--{name.replace('_', '-')} must be from 0 to {MAX_SECONDS / 86400:.0f} days")
        for name in ("timeout", "ttl", "max_runtime"):
            if getattr(self, name) == 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        if self.lease_grace < MIN_LEASE_GRACE:
            raise ValueError(f"--lease-grace must be at least {MIN_LEASE_GRACE:g} s: it pays for creating"
                             " and tearing down each sandbox inside the lease")


@dataclass
class Summary:
    claimed: int = 0
    done: int = 0
    failed: int = 0  # attempts that failed with attempts left (pending again after the backoff)
    retried: int = 0  # attempts whose handler raised Retry with attempts left (fleetless.outcomes, exit 92)
    dead: int = 0
    discarded: int = 0  # of the dead: their handler raised Discard (the history says ``discarded``)
    released: int = 0  # claims given back without charging an attempt
    snoozed: int = 0  # jobs whose handler asked to come back later (fleetless.outcomes.Snooze, exit 91)
    cancelled: int = 0  # running jobs an operator cancelled (fleetless cancel)
    fenced_out: int = 0  # outcomes discarded: the claim had been reaped and taken over
    reaped: int = 0
    pruned: int = 0  # finished jobs deleted by retention
    scheduled: int = 0  # periodic jobs enqueued
    seconds: float = 0.0
    watching_elsewhere: bool = False  # watch mode: another watcher holds these queues' lock

    def line(self) -> str:
        if self.watching_elsewhere:
            return "a watcher is already draining these queues; nothing to do"
        extra = "".join(
            f", {n} {what}"
            for n, what in ((self.retried, "retried"), (self.released, "released"), (self.snoozed, "snoozed"),
                            (self.cancelled, "cancelled"), (self.fenced_out, "fenced out"), (self.reaped, "reaped"),
                            (self.pruned, "pruned"),
                            (self.scheduled, "scheduled"))
            if n
        )
        discarded = f" ({self.discarded} discarded)" if self.discarded else ""
        return (
            f"drained: claimed {self.claimed}, done {self.done}, failed {self.failed}, "
            f"dead {self.dead}{discarded}{extra} in {self.seconds:.1f} s"
        )


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


_Unit = tuple[list[Job], Slot]  # one claim's jobs of one kind, and the sandbox slot they run in
_Claim = Claim  # (job id, claim token): one run of a job, as every fenced write names it
_Result = tuple[list[tuple[Job, Outcome]], str | None]


class Drainer:
    def __init__(self, queue: Queue, config: DrainConfig, reporter: Reporter | None = None) -> None:
        self.queue = queue
        queue.connect_ahead()  # while the tier is chosen and probed
        self._env = base_env(parse_pass_env(config.pass_env))
        self._template = Template(handlers_dir=config.handlers_dir, limits=config.limits, env=self._env,
                                  python=config.python)
        from .sandbox import _workspace

        try:  # before any tier is probed: one that is not the drainer's own is refused, never used
            _workspace.root()
        except OSError as exc:
            raise DrainError(f"cannot use the sandbox work directory: {exc}") from None
        # "auto": one line says which, and why; the tier's slow checks of the template start now
        tier, self.tier_note = choose_tier(config.sandbox, self._template)
        self.config = config = replace(config, sandbox=tier)
        self.reporter: Reporter = reporter or NullReporter()
        # Keyed by claim, not job id: this drain may claim a job id again (reaped under it) while
        # it still tears down the first run, and the two runs must not share anything.
        self._claimed_at: dict[_Claim, float] = {}  # claim -> monotonic time it was claimed
        # claim -> when its lease ends (monotonic, a little early: counted from before the statement
        # that set it was sent); no job starts after it (Runner.not_after)
        self._lease_ends: dict[_Claim, float] = {}
        self._claimed_by = f"{socket.gethostname()}:{os.getpid()}"
        self.summary = Summary()
        self._backend: type[Sandbox] = get_backend(config.sandbox)
        self._stop_at: float | None = None  # monotonic time after which running jobs are aborted
        self.signalled: int | None = None  # the first SIGTERM/SIGINT that stopped this drain
        self._fatal: str | None = None
        self._reached_db = False  # "cannot connect" until a call succeeded, "lost" after
        self._unrunnable: dict[str, str] = {}  # kind -> why its handler cannot start here
        self._handlers_dir = config.handlers_dir
        self._maintainer = maintenance.Maintainer(queue, self._backend, config.maintenance, guard=self._db,
                                                  fatal=(DrainError,))
        self._batched = config.per_sandbox > 1
        self._wake = threading.Event()  # set by a finished unit, a NOTIFY, the completer's failure, or stop()
        self._completer = self._new_completer()
        self._backends: dict[str, type[Sandbox]] = {config.sandbox: self._backend}  # tier -> backend
        self._runners: dict[str, Runner] = {}  # tier -> the runner of its kinds
        self._watcher: Watcher | None = None
        self._kinds: dict[str, kinds.KindSettings] = {}  # fleetless.toml, read when the drain starts
        self._cancelled: set[_Claim] = set()  # claims an operator cancelled while this drain held them
        self._had_handler: frozenset[str] = frozenset()  # kinds with a handler when the drain started
        self._next_cancel_poll = 0.0
        self._unclaimable = 0.0  # watch mode: the current wait for a due job the claim could not take
        self._ahead: list[Job] = []  # batch mode: the next batch, claimed while every slot runs
        self._written_at_claim = 0  # batch mode: the completer's written count when the last claim was sent
        self._teardown = Teardown(config.concurrency)  # a job's sandbox dies beside its slot's next claim

    def _new_completer(self) -> Completer:
        """Batch mode: the completer writes on a connection of its own, beside the loop's claims."""
        c = self.config
        return Completer(Queue(self.queue.conninfo, schema=self.queue.schema) if self._batched else self.queue,
                         c.retry, flush_size=c.flush_size, flush_interval=c.flush_interval,
                         on_written=self._written, retry_of=self._retry_of, on_failure=self._wake.set)

    @property
    def _limited(self) -> bool:
        """A kind has a global limit (concurrency or rate) in fleetless.toml, or one of the drain's
        queues a concurrency (``fleetless queue set``, as the last claim read them)."""
        return any(ks.limited for ks in self._kinds.values()) or bool(
            self.queue.limited_queues(self.config.queues, read=False))

    def _tier_of(self, kind: str) -> str:
        return self._kinds.get(kind, _NO_SETTINGS).tier or self.config.sandbox

    def _load_kind_tiers(self) -> None:
        """fleetless.toml's per-kind tiers: each one checked (with the kinds' interpreters) before
        anything is claimed; and a kind's batch_size puts the drain in batch mode."""
        for kind, ks in sorted(self._kinds.items()):
            tier = self._tier_of(kind)
            try:
                if tier not in self._backends:
                    backend = get_backend(tier)
                    backend.check()
                    backend.check_template(self._template)
                    self._backends[tier] = backend
            except SandboxUnavailable as exc:
                raise SandboxUnavailable(f"{kinds.FILENAME} [kinds.{kind}] tier: {exc}") from None
            if ks.interpreter is not None:
                try:
                    self._backends[tier].check_template(replace(self._template, python=ks.interpreter))
                except SandboxUnavailable as exc:
                    raise SandboxUnavailable(f"{kinds.FILENAME} [kinds.{kind}] interpreter: {exc}") from None
        interpreters = {kind: ks.interpreter for kind, ks in self._kinds.items() if ks.interpreter is not None}
        self._unrunnable = {}
        for tier, backend in self._backends.items():
            found = handlers.unrunnable(self._handlers_dir, backend, self._template, interpreters)
            self._unrunnable.update({k: why for k, why in found.items() if self._tier_of(k) == tier})
        self._maintainer.sweep_also(tuple(self._backends.values()))
        shared = sorted(kind for kind, ks in self._kinds.items() if ks.shared)
        if shared:  # said once, at the drain's start: these kinds' jobs can reach each other
            log.warning("kinds %s: batch_isolation = \"shared\" (%s): in batch mode their handle() jobs run one"
                        " after another in one process per sandbox, and a job can reach the later jobs of its"
                        " batch (docs/isolation.md)", ", ".join(shared), kinds.FILENAME)
        if not self._batched and any((ks.batch_size or 1) > 1 for ks in self._kinds.values()):
            self._batched = True
            self._completer = self._new_completer()

    # -- control -----------------------------------------------------------------------------

    def stop(self, grace: float | None = None) -> None:
        """Stop claiming; abort running jobs after ``grace`` seconds (default: the config's)."""
        grace = self.config.shutdown_grace if grace is None else grace
        deadline = time.monotonic() + grace
        if self._stop_at is None or deadline < self._stop_at:
            self._stop_at = deadline
        self._wake.set()

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT: stop claiming and wind down; a second one aborts at once."""

        def handler(signum: int, frame: FrameType | None) -> None:
            self.signalled = self.signalled or signum
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
        """One drain. In watch mode, when another watcher serves these queues already, it returns
        at once with ``watching_elsewhere`` set (the cron tick that finds one costs one query).

        Any error it has no rule for (from a claim, a handler's lookup, a finish, the completer)
        gives back every claim the drain still holds (fenced, uncharged) and becomes a one-line
        DrainError naming it and how many claims were given back (the CLI: exit 3)."""
        try:
            return self._run()
        except (DrainError, KeyboardInterrupt, SystemExit):
            raise
        except db.SchemaNotInitialised as exc:
            raise DrainError(str(exc)) from exc
        except Exception as exc:
            log.debug("unexpected error", exc_info=True)
            raise DrainError(f"unexpected error: {_what(exc)}") from exc
        finally:
            self.reporter.close()

    def _run(self) -> Summary:
        started = time.monotonic()
        c = self.config
        try:
            self._handlers_dir = handlers.check_dir(c.handlers_dir)
            self._template = replace(self._template, handlers_dir=self._handlers_dir)
            self._backend.check()
            self._backend.check_template(self._template)
            self._kinds = kinds.load(self._handlers_dir)
            declared = kinds.load_schedules(self._handlers_dir)
            self._load_kind_tiers()
            self._had_handler = handlers.kinds(self._handlers_dir)
            for kind in sorted(set(self._kinds) - self._had_handler):
                hint = handlers.did_you_mean(kind, self._had_handler)
                log.warning("fleetless.toml: [kinds.%s] names no handler in %s (misspelt?%s): its settings"
                            " apply to nothing", kind, self._handlers_dir, f" {hint}" if hint else "")
        except (handlers.HandlersDirError, SandboxUnavailable, kinds.SettingsError, OSError) as exc:
            raise DrainError(str(exc)) from None
        self._db(self.queue.check_schema)  # an old schema: "run 'fleetless init'" before anything is claimed
        if declared:  # periodic jobs declared in fleetless.toml: stored (or updated) in the table
            self._db(lambda: [self.queue.add_schedule(s) for s in declared])
        for kind, reason in sorted(self._unrunnable.items()):
            log.warning("not claiming kind %r: %s", kind, reason)
        if c.watch:
            from .watch import Watcher  # only watch mode pays for it (the cron tick's import time)

            self._watcher = Watcher(self.queue.conninfo, schema=self.queue.schema, channel=self.queue.channel,
                                    queues=c.queues, wake=self._wake, lease=c.watch_lease,
                                    on_schedules=self._maintainer.schedules_changed)
            if not self._db(self._watcher.acquire):
                self._watcher = None
                self.summary.watching_elsewhere = True
                return self.summary
        runner = Runner(self._backend, self._template, ttl=c.ttl, default_timeout=c.timeout, kinds=self._kinds,
                        cancelled=lambda job: _claim_of(job) in self._cancelled, had_handler=self._had_handler,
                        no_handler_delay=c.no_handler_delay,
                        teardown=self._teardown, not_after=lambda job: self._lease_ends.get(_claim_of(job)))
        self._runners = {tier: replace(runner, backend=backend) for tier, backend in self._backends.items()}
        if c.watch:  # a sandbox of the drain's own tier started ahead: a job that comes skips its start
            # as many as the slots can take at once, plus one for a job that comes while they are replaced
            self._runners[c.sandbox] = replace(self._runners[c.sandbox], spare_jobs=c.per_sandbox,
                                               spares=c.concurrency + 1)
            self._runners[c.sandbox].prewarm()
        elif self._batched:  # a one-shot batch drain: while a full batch runs, the next one's sandbox
            # starts (one per slot), so a slot goes from one batch to the next without waiting for it
            self._runners[c.sandbox] = replace(self._runners[c.sandbox], spare_jobs=c.per_sandbox,
                                               spares=c.concurrency, spare_after_full=True)
        running: dict[Future[_Result], _Unit] = {}
        if self._batched:
            self._completer.start()
        try:
            self._maintenance()
            with ThreadPoolExecutor(max_workers=c.concurrency, thread_name_prefix="job") as pool:
                try:
                    self._loop(pool, runner, running, started)
                except BaseException:
                    self._abort(running.values())  # every sandbox destroyed: its jobs are released
                    raise
            # the drain's own connection, idle now, writes half of the last outcomes beside it
            self._completer.close(flush=lambda f: self._db(f),
                                  beside=self.queue if self._completer.queue is not self.queue else None)
        except BaseException as exc:
            try:
                released = self._give_back(running, exc)
            finally:
                self._close(started)
            if isinstance(exc, DrainError | KeyboardInterrupt | SystemExit):
                if released and isinstance(exc, DrainError):
                    raise DrainError(f"{exc}; {released} held claim(s) released") from exc
                raise
            if isinstance(exc, db.SchemaNotInitialised):
                raise
            log.debug("unexpected error", exc_info=True)
            raise DrainError(f"unexpected error: {_what(exc)}; {released} held claim(s) released") from exc
        self._close(started)
        if self._fatal:
            raise DrainError(self._fatal)
        return self.summary

    def _loop(self, pool: ThreadPoolExecutor, runner: Runner, running: dict[Future[_Result], _Unit],
              started: float) -> None:
        c = self.config
        budget_end = started + c.max_runtime if c.max_runtime else None
        idle_since: float | None = None
        next_beat = float("inf")  # the next lease renewal: set by the claims themselves
        while True:
            self._maintenance()  # a no-op until the maintenance interval has passed
            may_claim = (
                not self.stopping
                and self._fatal is None
                and (budget_end is None or time.monotonic() < budget_end)
            )
            # a watcher claims only while its queues' row is surely its own: one that lost it (or
            # whose heartbeat is past its lease) finishes what it runs and claims nothing more
            claiming = may_claim and (self._watcher is None or self._watcher.holds())
            short = False
            if not self._batched and not (claiming and len(running) < c.concurrency):
                self._db(self._completer.flush)  # no claim to write them with: on their own
            if not claiming and self._ahead:
                self._release_ahead(RELEASED_STOPPING)
            if claiming:
                while len(running) < c.concurrency:
                    if self._ahead:  # claimed while the slots ran: it starts without waiting for a claim
                        units, want = [self._take_ahead()], 0
                        got = 0  # counted when it was claimed
                    elif self._batched:
                        units, want = self._claim_batch()
                        got = len(units[0])
                    else:
                        want = min(c.batch, c.concurrency - len(running))
                        # the outcomes of the jobs that ended go in the same transaction
                        units = [[job] for job in self._claimed(self._claim(want, with_outcomes=True))]
                        got = len(units)
                    for jobs in units:
                        if jobs:
                            slot = Slot()
                            fut = pool.submit(self._run_unit, runner, jobs, slot)
                            # Leases run from the claim, the timeout from the exec: renew within a
                            # third of a lease, so a slow sandbox start or teardown never lets a
                            # lease expire under a live drainer (batch mode: jobs also wait in line).
                            next_beat = min(next_beat, time.monotonic() + self._lease_beat(jobs))
                            fut.add_done_callback(lambda _: self._wake.set())
                            running[fut] = (jobs, slot)
                    if got < want:
                        short = True
                        break
                if (not short and self._batched and not self._ahead and not self._limited
                        and len(running) == c.concurrency):
                    # Every slot busy, more may be due: claim the next batch now, while they run,
                    # so the slot that frees first starts it at once (a claim of thousands of rows
                    # takes a while; the slot would otherwise stand idle for it).
                    units, want = self._claim_batch()
                    self._ahead = units[0]
                    if self._ahead:
                        next_beat = min(next_beat, time.monotonic() + self._lease_beat(self._ahead))
                    short = len(self._ahead) < want
            watching = self._watcher is not None and not self._watcher.lost and may_claim
            if self._watcher is not None:
                self._watcher.alive()  # the loop turns: the heartbeat goes on (a hung loop stops it)
            now = time.monotonic()
            if running or not short:
                idle_since = None
            elif idle_since is None:
                idle_since = now
            if not running:
                if short and self._batched and (self._completer.unwritten
                                                or self._completer.written != self._written_at_claim):
                    # outcomes count against a kind's or queue's limit until written (also while the
                    # background flush writes them: flush waits for it), and a finish may release
                    # waiting children (workflows), also one the background thread committed while
                    # the short claim ran: write them, then claim once more
                    self._db(self._completer.flush)
                    continue
                if not watching:
                    break
                # (idle_since is None only when it did not claim: not sure it holds its row)
                idle_left = None if c.idle_exit is None or idle_since is None else idle_since + c.idle_exit - now
                if idle_left is not None and idle_left <= 0:
                    break
                if claiming:
                    pause = sleep_for(self._next_wake(short), idle_left, cap=self._watch_cap())
                else:  # its heartbeat is past its lease: no claim until the next one says (about a second)
                    pause = sleep_for(None, idle_left, cap=min(1.0, self._watch_cap()))
                if budget_end is not None:
                    pause = min(pause, max(budget_end - now, 0.0))
            else:
                pause = 0.25
                if watching and claiming and len(running) < c.concurrency:
                    pause = sleep_for(self._db(partial(self._next_due, short)), None, cap=0.25)
            if self._stop_at is not None and now >= self._stop_at:
                self._abort(running.values())
            if running:
                self._poll_cancels(running.values())
                pause = min(pause, CANCEL_POLL_SECONDS)
            if running:
                if now >= next_beat:
                    self._extend_leases(running)
                    next_beat = now + self._lease_beat([j for jobs, _ in running.values() for j in jobs])
                pause = min(pause, max(next_beat - now, 0.0))
            if self._stop_at is not None:
                pause = min(pause, max(self._stop_at - now, 0.0) + 0.01)
            self._wake.wait(pause)
            self._wake.clear()
            if self._completer.failure is not None:  # batch mode: a write it has no rule for
                raise self._completer.failure
            for fut in [f for f in running if f.done()]:
                result = fut.result()  # a unit that raised stays in running: its claims are given back
                running.pop(fut)
                self._record(result)  # per-job mode: written with the next claim, at the loop's top

    def _claim_batch(self) -> tuple[list[list[Job]], int]:
        """Batch mode: one claim of up to a batch of one kind, as one unit, and how many it wanted
        (the drain's --per-sandbox, or the claimed kind's batch_size)."""
        self._written_at_claim = self._completer.written  # before the claim: see the loop's end
        jobs = self._claimed(self._claim(self.config.per_sandbox, one_kind=True))
        want = self.config.per_sandbox
        if jobs:
            want = self._kinds.get(jobs[0].kind, _NO_SETTINGS).batch_size or want
        return [jobs], want

    def _claimed(self, jobs: list[Job]) -> list[Job]:
        if type(self.reporter) is not NullReporter:  # nobody listens: nothing to time (once per job)
            now = time.monotonic()
            for job in jobs:
                self._claimed_at[_claim_of(job)] = now
                self.reporter.claimed(job)
        self.summary.claimed += len(jobs)
        return jobs

    def _take_ahead(self) -> list[Job]:
        """The batch claimed ahead, less its jobs an operator cancelled meanwhile (they end
        cancelled without running)."""
        jobs, self._ahead = self._ahead, []
        if not self._cancelled:
            return jobs
        kept = []
        for job in jobs:
            if _claim_of(job) in self._cancelled:
                run = Run(tier=self._tier_of(job.kind), kill_reason="cancelled")
                self._completer.add(job, Outcome("fail", error=CANCELLED, permanent=True, run=run))
            else:
                kept.append(job)
        return kept

    def _release_ahead(self, reason: str) -> None:
        """The batch claimed ahead will not run here: its claims are given back, uncharged."""
        jobs, self._ahead = self._ahead, []
        for job in jobs:
            self._completer.add(job, Outcome("release", error=reason, run=Run(tier=self._tier_of(job.kind))))

    def _give_back(self, running: dict[Future[_Result], _Unit], exc: BaseException) -> int:
        """After an error: what ran still counts, and every other claim the drain holds is given
        back (fenced, uncharged), each with one try. Returns how many claims were given back; a
        job whose outcome or give-back cannot be written runs again once its lease has passed."""
        before = self._completer.counts.released
        self._completer.stop()
        reason = f"released: the drain stopped on an error ({_what(exc)})"
        for fut, (jobs, _) in running.items():  # every unit has ended: its sandbox was destroyed
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._record(fut.result())
            else:  # it raised: its jobs have no outcome
                for job in jobs:
                    self._completer.add(job, Outcome("release", error=reason, run=Run(tier=self._tier_of(job.kind))))
        running.clear()
        self._release_ahead(reason)
        self._completer.settle(reason)
        if self._completer.buffered:
            log.warning("could not write %d outcome(s) (the database is away); those jobs run again after"
                        " their leases", self._completer.buffered)
        return self._completer.counts.released - before

    def _close(self, started: float) -> None:
        try:
            self._teardown.close()  # every sandbox of this drain is gone before it returns
        finally:
            for each in self._runners.values():  # spare sandboxes (watch mode)
                each.close()
            if self._watcher is not None:
                self._watcher.close()
            if self._completer.queue is not self.queue:
                self._completer.queue.close()
            self._take_counts()
            self.summary.seconds = time.monotonic() - started
        if self._teardown.failure is not None and self._fatal is None:  # the last sandbox's, say
            self._fatal = f"sandbox error: {self._teardown.failure}"

    def _lease_bounds(self) -> tuple[float, float]:
        """The timeout and TTL a lease is computed from: a kind's own may be longer than the drain's."""
        c = self.config
        timeout = max([c.timeout, *(k.timeout for k in self._kinds.values() if k.timeout)])
        ttl = max([c.ttl, *(k.ttl for k in self._kinds.values() if k.ttl)])
        return timeout, ttl

    def _watch_cap(self) -> float:
        """The longest sleep of a watching loop: it turns at least once per heartbeat."""
        return self._watcher.beat_every if self._watcher is not None else 60.0

    def _next_wake(self, short: bool) -> float | None:
        """Seconds until the loop has something to do: the next pending job is due, or a schedule's
        next occurrence is to be enqueued (a watcher wakes for it, not at its next maintenance pass)."""
        due, tick = self._db(partial(self._next_due, short)), self._maintainer.next_schedule_in()
        return min((s for s in (due, tick) if s is not None), default=None)

    def _next_due(self, short: bool) -> float | None:
        """Seconds until the next job is due. ``short``: the claim just now took fewer jobs than it
        asked for, so a job due now is one it could not take: waited for, longer each time."""
        due = self.queue.next_due(self.config.queues, sorted(self._unrunnable))
        if due is not None and due <= 0 and self._limited:
            return LIMIT_POLL_SECONDS  # due but not claimed: a limited kind or queue waits for room
        if due is not None and due <= 0 and short:
            self._unclaimable = min(max(self._unclaimable * 2, UNCLAIMABLE_FIRST_SECONDS), UNCLAIMABLE_MAX_SECONDS)
            return self._unclaimable
        self._unclaimable = 0.0
        return due

    def _claim(self, n: int, *, one_kind: bool = False, with_outcomes: bool = False) -> list[Job]:
        """One claim statement, with a token of its own: if its reply is lost after it committed,
        the retry first takes back what it claimed instead of stranding it until the lease ends.

        ``with_outcomes`` (per-job mode): the outcomes waiting in the completer are written in the
        claim's own transaction (one round trip, one commit), so each is durable no later than the
        slot's next job is claimed; a retry that finds the claim committed writes them again,
        which recognises them as its own (the same transaction wrote both)."""
        c = self.config
        timeout, ttl = self._lease_bounds()
        token = uuid.uuid4()
        tries = 0
        args: dict[str, Any] = dict(
            queues=c.queues, default_timeout=timeout, ttl=ttl, lease_grace=self._grace, one_kind=one_kind,
            claimed_by=self._claimed_by, tier=c.sandbox, skip_kinds=sorted(self._unrunnable), token=token,
            kinds=self._kinds)

        sent = 0.0

        def claim() -> list[Job]:
            nonlocal tries, sent
            tries += 1
            sent = time.monotonic()
            if tries > 1:
                held = self.queue.claimed_with(token)
                if held:
                    log.warning("took back %d job(s) from a claim whose reply was lost", len(held))
                    if with_outcomes:  # written by the lost statement: the retry finds them its own
                        self._completer.flush()
                    return held
            if with_outcomes:
                got = self._completer.flush_then_claim(lambda items: self.queue.finish_then_claim(items, n, **args))
                if got is not None:
                    return got
            return self.queue.claim(n, **args)

        jobs = self._db(claim)
        for job in jobs:
            if job.lease_seconds is not None:
                self._lease_ends[_claim_of(job)] = sent + job.lease_seconds
        return jobs

    def _retry_of(self, job: Job) -> RetryPolicy:
        return self._kinds.get(job.kind, _NO_SETTINGS).retry(self.config.retry)

    def _poll_cancels(self, units: Iterable[_Unit]) -> None:
        """About once a second while jobs run: kill the sandbox of a job an operator cancelled (in
        batch mode the rest of its batch goes on in a fresh sandbox)."""
        now = time.monotonic()
        if now < self._next_cancel_poll:
            return
        self._next_cancel_poll = now + CANCEL_POLL_SECONDS
        units = list(units)
        held = [j for jobs, _ in units for j in jobs if _claim_of(j) not in self._cancelled]
        held += [j for j in self._ahead if _claim_of(j) not in self._cancelled]  # ends cancelled when taken
        cancelled = self._db(lambda: self.queue.cancel_requested(held)) if held else set()
        for job_id, _ in cancelled:
            log.warning("job %d: cancelled by request; killing its sandbox", job_id)
        self._cancelled |= cancelled
        if cancelled:
            for jobs, slot in units:
                if any(_claim_of(j) in cancelled for j in jobs):
                    slot.kill_current()

    def _run_unit(self, runner: Runner, jobs: list[Job], slot: Slot) -> _Result:
        """In a worker thread: one unit's jobs in their sandbox(es)."""
        if type(self.reporter) is not NullReporter:
            for job in jobs:
                self.reporter.started(job)
        return self._runners.get(self._tier_of(jobs[0].kind), runner).run(jobs, slot)

    def _written(self, job: Job, outcome: Outcome, status: Status | None) -> None:
        """The completer wrote (or was fenced out of) one outcome: tell the reporter."""
        self._lease_ends.pop(_claim_of(job), None)
        if type(self.reporter) is NullReporter:  # nobody listens: no event built (once per job)
            if self._cancelled:
                self._cancelled.discard(_claim_of(job))
            return
        what = finished_as(job, outcome, status)
        started = self._claimed_at.pop(_claim_of(job), None)
        self._cancelled.discard(_claim_of(job))
        error = outcome.error
        if what == "cancelled" and error is not None and not error.startswith("cancelled:"):
            error = f"{CANCELLED}; its attempt ended: {error}"  # as the table's last_error says (queries.sql)
        elif what in ("failed", "dead") and (spent := spent_words(job, outcome)) is not None:
            error = spent + (error or "")  # likewise (a snooze or a release past its cap: charged)
        elif what == "dead" and outcome.decided == "retry" and not outcome.permanent:
            error = f"no attempts left ({job.attempts}/{job.max_attempts}); {error or ''}"  # likewise (finish_many)
        self.reporter.finished(JobFinished(
            id=job.id, kind=job.kind, queue=job.queue, attempt=job.attempts, outcome=what,
            duration=time.monotonic() - started if started is not None else 0.0,
            tier=self._tier_of(job.kind), error_head=error_head(error),
            retry_in=outcome.delay if what in ("failed", "retried") else None,
            snooze=job.snoozes + 1 if what == "snoozed" else None))

    @property
    def _grace(self) -> float:
        return self.config.lease_grace + max(b.overhead_seconds for b in self._backends.values())

    def _record(self, result: _Result) -> None:
        """A unit's outcomes go to the completer. In per-job mode the loop writes them before its
        slot claims again: with that claim, in its transaction, or alone when it claims nothing."""
        outcomes, fatal = result
        for job, outcome in outcomes:
            self._completer.add(job, outcome)
        if fatal is not None:
            log.error("%s", fatal)
            self._fatal = fatal

    def _lease_beat(self, jobs: Iterable[Job]) -> float:
        """How often to renew leases: a third of the shortest lease of ``jobs``, and at most half
        the grace (a job starts only while its timeout fits in the lease the drainer last renewed:
        Runner.not_after), at least 0.2 s."""
        c = self.config
        shortest = min((min(float(j.timeout_seconds or c.timeout), c.ttl) for j in jobs),
                       default=min(c.timeout, c.ttl))
        return max(min((shortest + self._grace) / 3, self._grace / 2), 0.2)

    def _extend_leases(self, running: dict[Future[_Result], _Unit]) -> None:
        """Renew every lease this drainer holds, in one fenced statement: a sandbox may be slow to
        start or tear down, and in batch mode jobs wait behind each other in one sandbox and
        finished ones for the completer's flush. A renewed lease still ends after the job's own
        deadline (exec start + timeout), which every sandbox enforces without the drainer."""
        held = [j for jobs, _ in running.values() for j in jobs] + self._ahead + self._completer.holding()
        if held:
            timeout, ttl = self._lease_bounds()
            sent = 0.0

            def renew() -> dict[int, float]:
                nonlocal sent
                sent = time.monotonic()
                return self.queue.extend_leases(held, default_timeout=timeout, ttl=ttl, lease_grace=self._grace)

            left = self._db(renew)
            for job in held:
                seconds = left.get(job.id)
                if seconds is not None and _claim_of(job) in self._lease_ends:
                    self._lease_ends[_claim_of(job)] = sent + seconds

    def _take_counts(self) -> None:
        counts, s = self._completer.counts, self.summary
        s.done, s.failed, s.retried, s.dead = counts.done, counts.failed, counts.retried, counts.dead
        s.released, s.fenced_out, s.cancelled = counts.released, counts.fenced_out, counts.cancelled
        s.snoozed, s.discarded = counts.snoozed, counts.discarded

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

    def _abort(self, units: Iterable[_Unit]) -> None:
        for _, slot in list(units):
            slot.abort()

    def _db(self, call: Callable[[], T]) -> T:
        """Run a queue call, riding out a database restart for up to DB_RETRY_SECONDS."""
        deadline = time.monotonic() + DB_RETRY_SECONDS
        delay = 0.2
        while True:
            try:
                out = call()
                self._reached_db = True
                return out
            except ConnectionError as exc:  # db.DatabaseUnavailable, and connect's own
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                first = first.removeprefix("cannot connect to the database: ").removeprefix("database unavailable: ")
                if time.monotonic() + delay > deadline:
                    what = "lost the database connection" if self._reached_db else "cannot connect to the database"
                    self._fatal = f"{what}: {first}"
                    raise DrainError(self._fatal) from None
                log.warning("database unavailable (%s); retrying", first)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)


_claim_of = claim_of


def _what(exc: BaseException) -> str:
    """An error in one line: fleetless's own say what they are; others are named by their type."""
    first = (str(exc).strip().splitlines() or [""])[0]
    if isinstance(exc, db.DatabaseError | DrainError):
        return first or type(exc).__name__
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__
