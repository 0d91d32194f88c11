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

from .job import MAX_RELEASES, Job, Outcome, Status
from .outcomes import MAX_SNOOZES

__all__ = ["RELEASES_SPENT", "SNOOZES_SPENT", "FinishedAs", "JobFinished", "NullReporter", "Reporter", "finished_as",
           "spent_words"]

#: What became of one claim, in the attempt history's words: ``done``, ``failed`` (an error, attempts
#: left), ``retried`` (its handler raised Retry, attempts left), ``dead``, ``released`` (given back
#: without charging an attempt), ``snoozed`` (its handler asked to come back later, uncharged),
#: ``cancelled``, or ``fenced_out`` (the claim had been taken over). Before issue 28 a plain failure
#: was reported ``retried`` too.
FinishedAs = Literal["done", "failed", "retried", "dead", "discarded", "released", "snoozed", "fenced_out", "cancelled"]
#: How last_error begins for a snooze past the cap, charged as a failed attempt (finish_many in
#: queries.sql writes the same words): ``.format(n=...)``, the job's snoozes before it.
SNOOZES_SPENT = "snoozed {n} times already, the most a job may; charged as a failed attempt: "


#: The same for a release, the MAX_RELEASES-th in a row: ``.format(n=...)``, counting it.
RELEASES_SPENT = "released {n} times in a row; charged as an attempt: "


def spent_words(job: Job, outcome: Outcome) -> str | None:
    """How last_error begins when the table charges ``outcome`` as a failed attempt although it
    gives its attempt back (a snooze past MAX_SNOOZES, the MAX_RELEASES-th release in a row), else
    None. From the job's counts at the claim: only its claim's holder changes them meanwhile."""
    if outcome.action == "snooze" and job.snoozes >= MAX_SNOOZES:
        return SNOOZES_SPENT.format(n=job.snoozes)
    if outcome.action == "release" and job.releases + 1 >= MAX_RELEASES:
        return RELEASES_SPENT.format(n=job.releases + 1)
    return None


def finished_as(job: Job, outcome: Outcome, status: Status | None) -> FinishedAs:
    """What the table made of ``outcome`` (``status``: the job's new status, None when fenced out),
    in the words of the history row the same statement wrote (finish_many): the drain's lines, JSON
    events and summary say what ``fleetless show`` says."""
    if status is None:
        return "fenced_out"
    if status is Status.CANCELLED:
        return "cancelled"
    spent = spent_words(job, outcome) is not None
    if outcome.action == "release" and not spent:
        return "released"
    if outcome.action == "snooze" and status is Status.PENDING and not spent:
        return "snoozed"
    if status is Status.DONE:
        return "done"
    if status is Status.DEAD:  # the history's word for a handler's Discard
        return "discarded" if outcome.decided == "discard" else "dead"
    # pending again, charged: a handler's Retry, or a plain failure (a snooze or release past its cap too)
    return "retried" if outcome.decided == "retry" else "failed"


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
    #: snoozed: the job's snooze count after this one (1 for its first), as its history row's
    #: ``snooze``; a snooze gives its attempt back, so ``attempt`` alone repeats (issue 28)
    snooze: int | None = None

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
