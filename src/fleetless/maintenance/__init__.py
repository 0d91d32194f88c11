"""Housekeeping as small units, one per task (reaper, sweeper, pruner, retention, waiters, scheduler).

Each unit module has a ``Settings`` (every field commented, validated on creation, defaults in
one place), a ``Result`` of counts, and ``run_once(...)`` that does one pass and returns it: tests
call ``run_once`` directly, without any loop or timer. The CLI commands (``reap``, ``prune``) call
the same units. :class:`Maintainer` is what a drain uses: every unit once at the start, then again
whenever ``interval`` has passed, for drains that run long; the scheduler alone also when the next
occurrence of a schedule has come (a watcher sleeps until then: ``next_schedule_in``), and when
a schedule was added, changed or removed (a watcher hears it: ``schedules_changed``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from .. import db
from ..queue import Queue
from ..sandbox import Sandbox
from . import pruner, reaper, retention, scheduler, sweeper, waiters

__all__ = ["Maintainer", "Report", "Settings", "pruner", "reaper", "retention", "scheduler", "sweeper", "waiters"]

T = TypeVar("T")
#: How long after a schedule's occurrence the scheduler runs for it (the database's clock must
#: have passed the tick for the pass to enqueue it).
SCHEDULE_MARGIN = 0.05
log = logging.getLogger("fleetless.maintenance")


@dataclass(frozen=True)
class Settings:
    #: The reaper's settings (default: leases that expired).
    reaper: reaper.Settings = field(default_factory=reaper.Settings)
    #: How long finished jobs are kept, and how many one pass deletes.
    retention: retention.Settings = field(default_factory=retention.Settings)
    #: Periodic jobs: how far back a pass catches up on missed occurrences.
    scheduler: scheduler.Settings = field(default_factory=scheduler.Settings)
    #: Seconds between passes in a drain that runs longer than that.
    interval: float = 60.0

    def __post_init__(self) -> None:
        if not self.interval > 0:
            raise ValueError("maintenance interval must be positive")


@dataclass
class Report:
    """What one pass did, unit by unit."""

    reaped: reaper.Result = field(default_factory=reaper.Result)
    swept: sweeper.Result = field(default_factory=sweeper.Result)
    pruned: pruner.Result = field(default_factory=pruner.Result)
    forgotten: waiters.Result = field(default_factory=waiters.Result)  # waiter rows no one removes
    scheduled: scheduler.Result = field(default_factory=scheduler.Result)
    failed: list[str] = field(default_factory=list)  # the units that failed (each logged), in order


def _direct(call: Callable[[], Any]) -> Any:
    return call()


class Maintainer:
    """Runs the units for one drain. ``guard`` wraps each database call (the drainer's rides out
    a database restart); the default calls it as it is."""

    def __init__(self, queue: Queue, backend: type[Sandbox], settings: Settings = Settings(),
                 guard: Callable[[Callable[[], Any]], Any] = _direct,
                 fatal: tuple[type[BaseException], ...] = ()) -> None:
        """``fatal``: the errors ``guard`` raises when it gives up, which end the drain."""
        self.queue = queue
        self._fatal: tuple[type[BaseException], ...] = (*fatal, ConnectionError, db.SchemaNotInitialised, OSError)
        self.settings = settings
        self._sweeper = sweeper.Settings(backend)
        self._guard = guard
        self._last: float | None = None
        self._next_schedule: float | None = None  # monotonic time of the next schedule occurrence
        self._schedules_changed = False  # set by schedules_changed (a watcher's thread), taken by run_due

    def sweep_also(self, backends: tuple[type[Sandbox], ...]) -> None:
        """Also sweep these tiers' leftovers (kinds that run in a tier of their own)."""
        self._sweeper = replace(self._sweeper, also=backends)

    def run_all(self) -> Report:
        """One pass of every unit. OSError from the sweeper (unusable work directory) propagates."""
        s = self.settings
        self._last = time.monotonic()
        report = Report()
        report.reaped = self._unit(report, "reaper", lambda: self._guard(lambda: reaper.run_once(self.queue, s.reaper)),
                                   reaper.Result())
        report.swept = self._unit(report, "sweeper", lambda: sweeper.run_once(self._sweeper), sweeper.Result())
        report.pruned = self._unit(report, "retention",
                                   lambda: self._guard(lambda: retention.run_once(self.queue, s.retention)),
                                   pruner.Result())
        report.forgotten = self._unit(report, "waiters", lambda: self._guard(lambda: waiters.run_once(self.queue)),
                                    waiters.Result())
        report.scheduled = self._schedule(report)
        return report

    def _schedule(self, report: Report) -> scheduler.Result:
        self._next_schedule = None  # a failed pass leaves the timing to the interval
        self._schedules_changed = False  # this pass reads them (a change heard during it: another pass)
        result = self._unit(report, "scheduler",
                            lambda: self._guard(lambda: scheduler.run_once(self.queue, self.settings.scheduler)),
                            scheduler.Result())
        if result.next_in is not None:
            # a little after the tick, so that the database's now() has passed it
            self._next_schedule = time.monotonic() + max(result.next_in, 0.0) + SCHEDULE_MARGIN
        return result

    def schedules_changed(self) -> None:
        """A schedule was added, changed or removed (a watcher heard it): the next :meth:`run_due`
        runs a scheduler pass, whose next occurrence replaces the one computed before."""
        self._schedules_changed = True

    def next_schedule_in(self) -> float | None:
        """Seconds until a schedule's next occurrence is due to be enqueued (None: no schedule)."""
        return None if self._next_schedule is None else max(self._next_schedule - time.monotonic(), 0.0)

    def _unit(self, report: Report, name: str, call: Callable[[], T], nothing: T) -> T:
        """One unit's pass; on an error that need not end the drain, a warning and ``nothing``."""
        try:
            return call()
        except self._fatal:
            raise
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [""])[0]
            log.warning("maintenance: the %s failed (%s: %s); the drain goes on", name, type(exc).__name__, first)
            log.debug("maintenance unit %s failed", name, exc_info=True)
            report.failed.append(name)
            return nothing

    def run_due(self) -> Report | None:
        """A pass if ``interval`` has passed since the last one (or none ran yet), else None."""
        now = time.monotonic()
        if self._last is not None and now - self._last < self.settings.interval:
            if self._schedules_changed or (self._next_schedule is not None and now >= self._next_schedule):
                report = Report()
                report.scheduled = self._schedule(report)
                return report
            return None
        return self.run_all()
