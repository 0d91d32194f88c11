"""What a drain tells whoever watches it: the ``Reporter`` interface and the events it receives.

The drainer calls a reporter at three points of a job's life (claimed, started in a sandbox,
finished) and once at the end of the drain. It never formats anything itself: logging a line per
job, a JSON object per job, or a live terminal view are reporters the command line picks
(``fleetless.terminal``). A reporter is called from the drainer's threads and must not raise; the
table stays the truth, a reporter only shows it happening.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol

from .job import Job

__all__ = ["FinishedAs", "JobFinished", "NullReporter", "Reporter"]

#: What became of one claim, in the attempt history's words: ``done``, ``failed`` (an error, attempts
#: left), ``retried`` (its handler raised Retry, attempts left), ``dead``, ``released`` (given back
#: without charging an attempt), ``snoozed`` (its handler asked to come back later, uncharged),
#: ``cancelled``, or ``fenced_out`` (the claim had been taken over). Before issue 28 a plain failure
#: was reported ``retried`` too.
FinishedAs = Literal["done", "failed", "retried", "dead", "discarded", "released", "snoozed", "fenced_out", "cancelled"]


@dataclass(frozen=True)
class JobFinished:
    """One finished claim, with the field names of the Python API (``Job``, ``Summary``)."""

    id: int
    kind: str
    queue: str
    attempt: int
    outcome: FinishedAs
    duration: float  # seconds from claim to the outcome written
    tier: str
    error_head: str | None = None  # the first line of last_error, when the attempt failed
    retry_in: float | None = None  # failed or retried: seconds until the job is due again

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Reporter(Protocol):
    def claimed(self, job: Job) -> None:
        """The drain holds this job (its row is ``running``)."""

    def started(self, job: Job) -> None:
        """Its sandbox exists and the handler is about to run."""

    def finished(self, event: JobFinished) -> None:
        """Its outcome is in the table."""

    def close(self) -> None:
        """The drain is over."""


class NullReporter:
    """Reports nothing: the default, and what the Python API gets."""

    def claimed(self, job: Job) -> None:
        pass

    def started(self, job: Job) -> None:
        pass

    def finished(self, event: JobFinished) -> None:
        pass

    def close(self) -> None:
        pass
