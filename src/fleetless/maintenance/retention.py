"""Retention: every drain's bounded share of pruning, so the jobs table stays small by itself.

What it does: up to ``batches`` pruner batches per run (each at most ``batch_size`` rows, its own
short statement; 20 x 500 by default, 10,000 rows a run) with the retention ages:
``done`` and ``cancelled`` jobs 7 days after they finished, ``dead`` ones after 30 (they are the
evidence of what went wrong, so they are kept longer). A drain that finds more due leaves the rest
to the next run; a long-running drain runs it again on its maintenance timer. Workflow graphs go
as a whole, ``batch_size`` graphs looked at a batch from where the last batch left off (a cursor
in the database), so old jobs of graphs still held cost a batch one probe a graph, not one a
job; a run goes on while graphs are left that it has not looked at. At most one run per
database every ``every`` seconds (60), by whichever drain comes first: the others skip it at the
cost of one short statement, and a run that finds a metrics fold or another pruner at work skips
too, rather than wait (drains used to queue behind one another here). Each run also folds the job
counts (``Queue.compact_counts``), so they stay a few rows between reads, and moves the attempt
totals of ``/metrics`` on by at most ``fold_batch`` attempts (``Insights.fold_step``), so they keep
up with the history even when only a role that may not write scrapes the metrics.

When it can go wrong: set an age to None to keep that status forever (then prune by hand with
``fleetless prune``). A run at most once a minute per database deletes at most ``batches`` x
``batch_size`` rows: 10,000 a minute (about 160 finished jobs a second) by default; with one batch
a run, as before, a database finishing more than 8 jobs a second grew without bound (audit, issue
26). Past that, raise them, or run ``fleetless prune`` from a timer.

Reports: the pruner's counts.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..insights import Insights
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
    #: Most rows one statement deletes (one short transaction each).
    batch_size: int = 500
    #: Most statements one run makes (it stops at the first that is not full).
    batches: int = 20
    #: Seconds between two runs in one database, whichever drains run them; None: every call.
    every: float | None = 60.0
    #: Most attempts one run folds into /metrics' running totals (a bounded step).
    fold_batch: int = 50_000

    def pruner_settings(self) -> pruner.Settings:
        ages = tuple((status, age) for status, age in
                     (("done", self.done), ("cancelled", self.cancelled), ("dead", self.dead))
                     if age is not None)
        return pruner.Settings(ages=ages, batch_size=self.batch_size, max_batches=self.batches, wait=False)

    def __post_init__(self) -> None:
        self.pruner_settings()  # validates
        if self.every is not None and not self.every >= 0:
            raise ValueError("retention interval must be a non-negative number of seconds")


def run_once(queue: Queue, settings: Settings = Settings()) -> pruner.Result:
    if settings.done is None and settings.cancelled is None and settings.dead is None:
        return pruner.Result()
    if settings.every is not None and not queue.maintenance_turn("retention", settings.every):
        return pruner.Result()
    queue.compact_counts()
    Insights(queue).fold_step(batch=settings.fold_batch)
    return pruner.run_once(queue, settings.pruner_settings())
