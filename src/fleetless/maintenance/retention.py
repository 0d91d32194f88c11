"""Retention: every drain's bounded share of pruning, so the jobs table stays small by itself.

What it does: one pruner batch per run (at most ``batch_size`` rows) with the retention ages:
``done`` and ``cancelled`` jobs 7 days after they finished, ``dead`` ones after 30 (they are the
evidence of what went wrong, so they are kept longer). A drain that finds more due leaves the rest
to the next run; a long-running drain runs it again on its maintenance timer.

When it can go wrong: set an age to None to keep that status forever (then prune by hand with
``fleetless prune``). With drains rarer than jobs finish, a backlog shrinks only ``batch_size``
rows per drain: raise it, or run ``fleetless prune`` once.

Reports: the pruner's counts.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..queue import Queue
from . import pruner

__all__ = ["Settings", "run_once"]

DAY = 86400.0


@dataclass(frozen=True)
class Settings:
    #: Seconds a done job is kept after it finished; None: forever.
    done: float | None = 7 * DAY
    #: Seconds a cancelled job is kept; None: forever.
    cancelled: float | None = 7 * DAY
    #: Seconds a dead job is kept; None: forever. Longer: dead jobs are evidence.
    dead: float | None = 30 * DAY
    #: Most rows one run deletes (one statement).
    batch_size: int = 500

    def pruner_settings(self) -> pruner.Settings:
        ages = tuple((status, age) for status, age in
                     (("done", self.done), ("cancelled", self.cancelled), ("dead", self.dead))
                     if age is not None)
        return pruner.Settings(ages=ages, batch_size=self.batch_size, max_batches=1)

    def __post_init__(self) -> None:
        self.pruner_settings()  # validates


def run_once(queue: Queue, settings: Settings = Settings()) -> pruner.Result:
    if settings.done is None and settings.cancelled is None and settings.dead is None:
        return pruner.Result()
    return pruner.run_once(queue, settings.pruner_settings())
