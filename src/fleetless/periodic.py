"""Periodic jobs: a schedule (cron expression, time zone, the job to enqueue) and its occurrences.

The cron arithmetic is the ``cronsim`` library's, including what happens at DST changes: a time
that does not exist (spring forward, e.g. 02:30 in Paris on the last Sunday of March) runs at the
end of the gap (03:00); a daily time that occurs twice (fall back) runs once, at its first
occurrence; sub-hourly expressions run in both passes of the repeated hour.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterator
from dataclasses import dataclass
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from .job import validate_kind, validate_queue_name

__all__ = ["Schedule", "occurrences", "validate_cron", "zone"]

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,99}")


def validate_name(name: object) -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ValueError(f"invalid schedule name {name!r}: use 1-100 of A-Z a-z 0-9 _ . : - starting with a"
                         " letter or digit")
    return name


def zone(name: str) -> ZoneInfo:
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"unknown time zone {name!r} (an IANA name such as Europe/Paris or UTC)") from None


def validate_cron(expr: str) -> str:
    try:
        CronSim(expr, dt.datetime.now(dt.UTC))
    except CronSimError as exc:
        raise ValueError(f"invalid cron expression {expr!r}: {exc}") from None
    return expr


@dataclass(frozen=True)
class Schedule:
    name: str
    cron: str
    kind: str
    payload: object
    timezone: str = "UTC"
    queue: str = "default"
    max_attempts: int | None = None  # None: the kind's (fleetless.toml), applied by the claiming drain, else 3
    priority: int = 0
    timeout_seconds: int | None = None

    def __post_init__(self) -> None:
        validate_name(self.name)
        validate_cron(self.cron)
        zone(self.timezone)
        validate_kind(self.kind)
        validate_queue_name(self.queue)

    def after(self, moment: dt.datetime) -> Iterator[dt.datetime]:
        """Occurrences strictly after ``moment``, in UTC, for ever."""
        for tick in CronSim(self.cron, moment.astimezone(zone(self.timezone))):
            yield tick.astimezone(dt.UTC)

    def next_after(self, moment: dt.datetime) -> dt.datetime:
        return next(self.after(moment))


def occurrences(
    schedule: Schedule, after: dt.datetime, until: dt.datetime, limit: int
) -> tuple[list[dt.datetime], int]:
    """Occurrences in ``(after, until]``: the latest ``limit`` of them, and how many older ones
    were skipped for being over the limit."""
    found: list[dt.datetime] = []
    skipped = 0
    for tick in schedule.after(after):
        if tick > until:
            break
        found.append(tick)
        if len(found) > limit:
            found.pop(0)
            skipped += 1
    return found, skipped
