"""The pruner: deletes finished jobs (and their attempt history) by age, in batches.

What it does: deletes ``done``, ``cancelled`` and ``dead`` jobs that finished longer ago than the
age given for their status (a status without an age is kept), oldest first, ``batch_size`` rows per
statement, until none is left or ``max_batches`` statements ran. Workflow graphs go as a whole,
looked at ``batch_size`` graphs a statement from where the last one left off
(``Queue.prune_pass``), so a run goes on while graphs are left that it has not looked at. Small batches keep each
transaction short, so a big backlog never holds locks or bloats WAL in one go; rows another
pruner is deleting are skipped, not waited on.

When it can go wrong: it cannot delete anything not finished. An age shorter than you need to
inspect failures loses the evidence: dead jobs have their own, longer age for that reason.

Reports: how many jobs it deleted, and whether more were due when it stopped.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..queue import Queue

__all__ = ["FINISHED", "Result", "Settings", "run_once"]

FINISHED = ("done", "cancelled", "dead")


@dataclass(frozen=True)
class Settings:
    #: Seconds after finishing that a job of each status may be deleted; a status not named is kept.
    ages: tuple[tuple[str, float], ...] = (("done", 7 * 86400.0), ("cancelled", 7 * 86400.0))
    #: Rows deleted per statement.
    batch_size: int = 1000
    #: Statements per run; None: until nothing is due.
    max_batches: int | None = None
    #: False: a batch finding a metrics fold or another pruner at work deletes nothing (and the
    #: run stops) instead of waiting for it; retention's way.
    wait: bool = True

    def __post_init__(self) -> None:
        for status, age in self.ages:
            if status not in FINISHED:
                raise ValueError(f"cannot prune status {status!r}: only {', '.join(FINISHED)}")
            if not age >= 0:
                raise ValueError(f"prune age for {status} must be a non-negative number of seconds")
        if not 1 <= self.batch_size <= 100_000:
            raise ValueError("prune batch size must be from 1 to 100000")
        if self.max_batches is not None and self.max_batches < 1:
            raise ValueError("prune max_batches must be at least 1")


@dataclass(frozen=True)
class Result:
    deleted: int = 0
    more: bool = False  # stopped at max_batches with a full last batch, or graphs not looked at yet


def run_once(queue: Queue, settings: Settings = Settings()) -> Result:
    ages = dict(settings.ages)
    deleted = batches = 0
    while settings.max_batches is None or batches < settings.max_batches:
        n, graphs_left = queue.prune_pass(ages, limit=settings.batch_size, wait=settings.wait)
        deleted += n
        batches += 1
        if n < settings.batch_size and not graphs_left:
            return Result(deleted, more=False)
    return Result(deleted, more=True)
