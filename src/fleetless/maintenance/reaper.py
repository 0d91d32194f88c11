"""The reaper: claims whose drainer died sit in ``running`` forever unless something returns them.

What it does: every claim whose lease expired (or, with ``older_than``, every claim locked longer
ago than that, lease or not: the seed's variant) goes back to ``pending``, or to ``dead`` when that
was its last attempt, with ``last_error = 'claim expired: ...'``. Clearing the claim token fences
out the old holder in case it was only slow.

When it can go wrong: ``older_than`` shorter than a real job returns live claims (the live holder
is then fenced out and the job runs again). Without ``older_than`` it cannot: a live drainer
always finishes before its lease ends.

Reports: how many claims went back to pending and how many became dead, and their ids.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..job import Status
from ..queue import Queue

__all__ = ["Result", "Settings", "run_once"]

log = logging.getLogger("fleetless.maintenance.reaper")


@dataclass(frozen=True)
class Settings:
    #: None (default): reap claims whose lease expired. Seconds: also claims locked longer ago.
    older_than: float | None = None

    def __post_init__(self) -> None:
        if self.older_than is not None and not self.older_than > 0:
            raise ValueError(f"reaper older_than must be a positive number of seconds, not {self.older_than!r}")


@dataclass(frozen=True)
class Result:
    reaped: dict[int, Status] = field(default_factory=dict)

    @property
    def pending(self) -> int:
        return sum(1 for s in self.reaped.values() if s is Status.PENDING)

    @property
    def dead(self) -> int:
        return sum(1 for s in self.reaped.values() if s is Status.DEAD)


def run_once(queue: Queue, settings: Settings = Settings()) -> Result:
    reaped = queue.reap(settings.older_than)
    for job_id, status in sorted(reaped.items()):
        log.warning("reaped job %d: claim expired, now %s", job_id, status)
    return Result(reaped)
