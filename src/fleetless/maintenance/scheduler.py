"""The scheduler: enqueues the occurrences of periodic jobs that came due.

What it does: for every schedule (``fleetless schedule add``), the occurrences of its cron
expression (in its time zone) after the latest one already enqueued (or after the schedule was
created) and up to now, on the database's clock. Each occurrence becomes exactly one job, due at
its tick, however many drainers run this at once: a (schedule, tick) row decides, no leader.

Catch-up is bounded: when drains were rarer than the schedule (or stopped), at most
``max_catch_up`` of the missed occurrences are enqueued per schedule (the latest ones), and none
older than ``window`` seconds; older ones are skipped and counted.

When it can go wrong: occurrences are enqueued only when a drain runs, so a job is enqueued up to
one drain interval late (its ``run_after`` is still its tick). A schedule changed (``schedule
add`` again) keeps its history. A drain whose clock is wrong does not matter: the database's
``now()`` is used.

Reports: how many jobs it enqueued, how many occurrences it skipped, and how long until the
next occurrence of any schedule (``next_in``): a watching drain runs the scheduler again then,
instead of at its next maintenance pass (issue 26 item 7).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

from ..periodic import occurrences
from ..queue import Queue

__all__ = ["Result", "Settings", "run_once"]


@dataclass(frozen=True)
class Settings:
    #: The most missed occurrences one schedule enqueues in one pass (the latest ones).
    max_catch_up: int = 10
    #: Occurrences older than this many seconds are never enqueued (and forgotten).
    window: float = 24 * 3600.0

    def __post_init__(self) -> None:
        if self.max_catch_up < 1:
            raise ValueError("scheduler max_catch_up must be at least 1")
        if not self.window > 0:
            raise ValueError("scheduler window must be positive")


@dataclass(frozen=True)
class Result:
    enqueued: int = 0
    skipped: int = 0  # occurrences in the window over the catch-up bound (older ones are not counted)
    # seconds from the pass's now to the next occurrence of any schedule (a timing, not a count)
    next_in: float | None = field(default=None, compare=False)


def run_once(queue: Queue, settings: Settings = Settings(), now: dt.datetime | None = None) -> Result:
    """One pass. ``now`` (tests): the moment to catch up to instead of the database's clock."""
    schedules, db_now = queue.schedules()
    if not schedules:
        return Result()
    now = now or db_now
    earliest = now - dt.timedelta(seconds=settings.window)
    due: list[tuple[str, dt.datetime]] = []
    skipped = 0
    upcoming: list[dt.datetime] = []
    for schedule, created_at, last_tick in schedules:
        start = max(last_tick or created_at, earliest)
        ticks, over = occurrences(schedule, start, now, settings.max_catch_up)
        skipped += over
        due += [(schedule.name, t) for t in ticks]
        upcoming.append(schedule.next_after(max(now, start)))
    next_in = (min(upcoming) - now).total_seconds()
    if not due:
        return Result(skipped=skipped, next_in=next_in)
    return Result(queue.enqueue_ticks(due, forget_before=earliest), skipped, next_in)

