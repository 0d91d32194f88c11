"""The waiters' leftovers: ``job_waiters`` rows no waiter will remove.

What it does: deletes up to ``batch_size`` rows of ``job_waiters`` (``Queue.wait``'s registrations)
whose job has finished or is gone. A job's finish removes its waiters' rows itself (migration 019's
trigger) and a returning waiter its own; what is left comes from a waiter killed while a finish it
raced could not see its row (the finish's trigger ran first), or whose job was then deleted. Such a
row wakes no one, but while any row exists every UPDATE of the jobs table pays the trigger's join,
so none may accumulate. One bounded statement per run (every drain runs it once at its start, and
again on the maintenance timer).

When it can go wrong: it cannot; a live waiter of a finished job reads the job as finished anyway,
and the rows of unfinished jobs are never touched.

Reports: how many rows it deleted.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..queue import Queue

__all__ = ["Result", "Settings", "run_once"]


@dataclass(frozen=True)
class Settings:
    #: Most rows one run deletes (one statement).
    batch_size: int = 1000

    def __post_init__(self) -> None:
        if not self.batch_size >= 1:
            raise ValueError(f"waiters batch_size must be at least 1, not {self.batch_size!r}")


@dataclass(frozen=True)
class Result:
    deleted: int = 0


def run_once(queue: Queue, settings: Settings = Settings()) -> Result:
    return Result(queue.forget_waiters(settings.batch_size))
