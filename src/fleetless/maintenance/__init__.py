"""Housekeeping as small units, one per task (reaper, sweeper, pruner, retention, scheduler).

Each unit module has a ``Settings`` (every field commented, validated on creation, defaults in
one place), a ``Result`` of counts, and ``run_once(...)`` that does one pass and returns it: tests
call ``run_once`` directly, without any loop or timer. The CLI commands (``reap``, ``prune``) call
the same units. :class:`Maintainer` is what a drain uses: every unit once at the start, then again
whenever ``interval`` has passed, for drains that run long.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from ..queue import Queue
from ..sandbox import Sandbox
from . import pruner, reaper, retention, scheduler, sweeper

__all__ = ["Maintainer", "Report", "Settings", "pruner", "reaper", "retention", "scheduler", "sweeper"]

T = TypeVar("T")


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
    scheduled: scheduler.Result = field(default_factory=scheduler.Result)


def _direct(call: Callable[[], Any]) -> Any:
    return call()


class Maintainer:
    """Runs the units for one drain. ``guard`` wraps each database call (the drainer's rides out
    a database restart); the default calls it as it is."""

    def __init__(self, queue: Queue, backend: type[Sandbox], settings: Settings = Settings(),
                 guard: Callable[[Callable[[], Any]], Any] = _direct) -> None:
        self.queue = queue
        self.settings = settings
        self._sweeper = sweeper.Settings(backend)
        self._guard = guard
        self._last: float | None = None

    def sweep_also(self, backends: tuple[type[Sandbox], ...]) -> None:
        """Also sweep these tiers' leftovers (kinds that run in a tier of their own)."""
        self._sweeper = replace(self._sweeper, also=backends)

    def run_all(self) -> Report:
        """One pass of every unit. OSError from the sweeper (unusable work directory) propagates."""
        s = self.settings
        self._last = time.monotonic()
        report = Report()
        report.reaped = self._guard(lambda: reaper.run_once(self.queue, s.reaper))
        report.swept = sweeper.run_once(self._sweeper)
        report.pruned = self._guard(lambda: retention.run_once(self.queue, s.retention))
        report.scheduled = self._guard(lambda: scheduler.run_once(self.queue, s.scheduler))
        return report

    def run_due(self) -> Report | None:
        """A pass if ``interval`` has passed since the last one (or none ran yet), else None."""
        if self._last is not None and time.monotonic() - self._last < self.settings.interval:
            return None
        return self.run_all()
