"""The one read service under every front end: the CLI's ``status``/``jobs``/``show``, the web
dashboard and ``/metrics`` all read the queue through :class:`Insights`, never with SQL of their own.

Everything here reads the table, not a drainer's memory: drainers are short-lived and many, so
the table is the only place that knows what happened. The presentation helpers live here once:
making a job's own output safe for a terminal (:func:`printable`) or a page (:func:`html_text`),
ages (:func:`age`) and sizes (:func:`size`); the one-line summary of an error (:func:`error_head`)
is :mod:`fleetless.failure`'s, which the drain writes with each attempt.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from . import db
from .attempt_totals import DURATION_BUCKETS, bucket_params
from .decisions import SNOOZE_NOTE
from .failure import HEAD_CHARS, error_head, exception_line, summarize_failure
from .job import Status
from .queue import JobNotFound, Queue

if TYPE_CHECKING:
    from .kinds import KindSettings

__all__ = [
    "DURATION_BUCKETS",
    "Insights",
    "MetricsSnapshot",
    "Overview",
    "Page",
    "age",
    "attempt_label",
    "error_head",
    "exception_line",
    "html_text",
    "is_snooze_note",
    "page_of",
    "printable",
    "size",
    "summarize_failure",
]

# -- presentation --------------------------------------------------------------------------------

# C0 and C1 controls but tab and newline; and the invisible format characters that reorder or
# hide text (bidi embeddings, overrides and isolates, zero-width and soft-hyphen characters, tag
# characters) or break lines where a terminal does not (U+2028, U+2029, U+0085).
_CONTROL = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\u00ad\u061c\u115f\u1160\u180e\u200b-\u200f\u2028-\u202e"
    "\u2060-\u206f\u3164\ufeff\ufff9-\ufffb\U000e0000-\U000e007f]"
)


def printable(text: str) -> str:
    """A job's own output (result, last_error) made safe for the operator's terminal: control
    characters other than tab and newline are shown as \\xNN, and invisible format characters
    (bidi overrides such as U+202E and U+2066, zero-width characters, U+2028) as \\uNNNN, so job
    output cannot retitle, clear or recolour the terminal, write its clipboard, hide text behind a
    carriage return, or show text in another order than it is stored."""
    return _CONTROL.sub(_escaped, text)


#: ``fleetless show`` prints each parent's result in a child's payload up to this many characters.
SHOWN_PARENT_RESULT_CHARS = 500


def payload_lines(payload: Any) -> list[str]:
    """A job's payload for ``fleetless show``, made printable: one line, except for a workflow's
    child whose payload carries its parents' results (``_parents``, up to 256 KiB on one line):
    the rest of the payload on its line, then one indented line per parent, ``id: result`` as
    JSON, each cut at SHOWN_PARENT_RESULT_CHARS characters (``--json`` has them whole)."""
    parents = payload.get("_parents") if isinstance(payload, dict) else None
    if not isinstance(parents, dict):
        return [f"payload: {printable(json.dumps(payload))}"]
    rest = {k: v for k, v in payload.items() if k not in ("_parents", "_parents_cut")}
    cut = "; past 256 KiB in all, null" if payload.get("_parents_cut") else ""
    lines = [f"payload: {printable(json.dumps(rest))}",
             f"payload _parents (the results of {len(parents)} parents, by id{cut}):"]
    for parent, result in parents.items():
        text = json.dumps(result)
        if len(text) > SHOWN_PARENT_RESULT_CHARS:
            text = f"{text[:SHOWN_PARENT_RESULT_CHARS]}... ({len(text)} characters; --json has it whole)"
        lines.append(f"  {printable(parent)}: {printable(text)}")
    return lines


def _escaped(match: re.Match[str]) -> str:
    code = ord(match.group())
    if code <= 0xFF:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def html_text(text: object) -> str:
    """Any value made safe to put between tags or in a quoted attribute: control characters shown
    as in :func:`printable`, then ``& < > " '`` escaped, so job output cannot inject markup."""
    from html import escape  # here: html.entities is 1 ms of every cron tick's imports otherwise

    return escape(printable("" if text is None else str(text)), quote=True)


def age(seconds: float | None) -> str:
    """``42.0s``, ``3.5m``, ``2.0h``, ``1.5d``; ``-`` for none."""
    if seconds is None:
        return "-"
    seconds = max(seconds, 0)
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= span:
            return f"{seconds / span:.1f}{unit}"
    return f"{seconds:.1f}s"


def attempt_label(row: Mapping[str, Any]) -> str:
    """An attempt history row's number as a front end shows it: ``2``, or ``1 (snooze 3)`` for the
    job's third snooze, which gave attempt 1 back (a snooze is not an attempt: the run after it
    has the same number). A snooze row from before migration 024 has no count: ``1 (snooze)``."""
    if row.get("outcome") != "snoozed":
        return str(row["attempt"])
    nth = row.get("snooze")
    return f'{row["attempt"]} (snooze{"" if nth is None else f" {nth}"})'


def is_snooze_note(text: str | None) -> bool:
    """Whether a job's ``last_error`` (or ``error_head``) is the note a snooze left, not an error:
    a snooze gives its attempt back and is not a failure, so front ends show it apart (issue 28)."""
    return text is not None and text.startswith(SNOOZE_NOTE)


def size(n: int | None) -> str:
    """``512 B``, ``1.5 KiB``, ``64.0 MiB``; ``-`` for none."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


# -- paging --------------------------------------------------------------------------------------

T = TypeVar("T")

#: Rows per page of every list a front end shows (jobs, running, kinds, queues, schedules, attempts).
PAGE_SIZE = 50


@dataclass(frozen=True)
class Page(Generic[T]):
    """One page of a list that can be long: its rows, its number (from 1), the page size, and
    whether a next page exists (read as one row more than the page holds)."""

    rows: list[T]
    number: int = 1
    size: int = PAGE_SIZE
    more: bool = False

    @property
    def offset(self) -> int:
        return (self.number - 1) * self.size


def _check_page(number: int, size: int) -> None:
    if number < 1 or number > 1_000_000:
        raise ValueError(f"page {number}: pages are numbered from 1")
    if not 1 <= size <= 1000:
        raise ValueError(f"page size {size}: give 1 to 1000")


def page_of(items: Sequence[T], number: int = 1, size: int = PAGE_SIZE) -> Page[T]:
    """Page ``number`` of ``items`` (already read whole, as the counts by kind are)."""
    _check_page(number, size)
    start = (number - 1) * size
    return Page(list(items[start:start + size]), number, size, len(items) > start + size)


def _paged(rows: list[T], number: int, size: int) -> Page[T]:
    """A page from a query that read ``size + 1`` rows at ``(number - 1) * size``."""
    return Page(rows[:size], number, size, len(rows) > size)


def _timestamp(text: str | None) -> dt.datetime | None:
    """A timestamptz that came back inside jsonb (ISO 8601 text)."""
    return None if text is None else dt.datetime.fromisoformat(text)


# -- reading -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Overview:
    """What the dashboard's first page shows."""

    total: int
    by_status: dict[str, int]
    by_kind: Page[tuple[str, dict[str, int]]]  # (kind, counts by status), by name
    by_queue: Page[tuple[str, dict[str, int]]]  # every status, by name
    oldest_due_age_seconds: float | None
    next_due_in_seconds: float | None
    running: Page[dict[str, Any]]
    per_minute: list[dict[str, Any]]  # {"minute": datetime, "done": n, "failed": n}: attempts


@dataclass(frozen=True)
class MetricsSnapshot:
    """Everything ``/metrics`` exposes, read in a few aggregate queries."""

    jobs: list[tuple[str, str, str, int]]  # (queue, kind, status, n) of pending and running jobs
    kept: list[tuple[str, str, int]]  # (kind, status, n) of finished jobs still in the table
    oldest_due_age: dict[str, float]  # queue -> seconds
    finished: list[tuple[str, str, int]]  # (kind, outcome, n): every ended attempt, ever
    durations: dict[tuple[str, str], tuple[list[int], float, int]] = field(default_factory=dict)
    # (kind, outcome) -> (cumulative count per DURATION_BUCKETS bound, sum of seconds, count)


#: Attempts that ended at least this long ago are folded into the running totals; see
#: ``fold_attempt_totals`` in queries.sql for why this margin makes the fold exact.
FOLD_MARGIN_SECONDS = 600
#: Most attempts one fold adds to the totals: ``fleetless init`` folds a history in such steps.
FOLD_BATCH = 200_000
#: Most attempts a scrape folds (and a drain's retention run, once a minute per database): a
#: bounded step, so a long unfolded history costs each scrape no more than this (issue 26: 4-15 s
#: a scrape at 5M attempts), and the totals catch up over the scrapes that follow.
STEP_FOLD_BATCH = 5_000
#: Most attempts past the totals a scrape counts itself (the unfolded tail, by id): until the
#: folds catch up, the counters show the totals plus this much of the tail, and rise to the exact
#: figures as the folds move on, never down (every attempt at or below an id is counted once the
#: tail's end passes it, and that end never moves back).
TAIL_MAX = 10_000


class Insights:
    """Reads for operators. Bad filters raise ValueError; a missing job raises JobNotFound."""

    def __init__(self, queue: Queue) -> None:
        self.queue = queue

    # -- the CLI's reports -----------------------------------------------------------------

    def stats(self, kinds: Mapping[str, KindSettings] | None = None) -> dict[str, Any]:
        """Counts by status and kind, the oldest due job's wait, next due, and what a pause or a
        limit holds back (kinds' limits from ``kinds``, fleetless.toml) (``fleetless status``)."""
        return self.queue.stats(kinds)

    def queues(self) -> list[dict[str, Any]]:
        """Every queue with jobs or settings (``fleetless queue list``, the dashboard): ``queue``,
        ``paused``, ``concurrency`` and its counts by status."""
        return self.queue.queues()

    def jobs(
        self,
        *,
        status: str | None = None,
        kind: str | None = None,
        queue: str | None = None,
        limit: int = 50,
        before: int | None = None,
    ) -> list[dict[str, Any]]:
        """Jobs newest first, ``limit`` at a time; ``before`` (an id) pages on. Each row has
        ``error_head``, the first line of its ``last_error``, and ``snoozed``: whether that is a
        snooze's note rather than an error."""
        rows = self.queue.list(status=status, kind=kind, queue=queue, limit=limit, before=before)
        for row in rows:
            row["snoozed"] = is_snooze_note(row["last_error"])
            row["error_head"] = error_head(row.pop("last_error"))
        return rows

    def job(self, job_id: int) -> dict[str, Any]:
        """Every column of one job, plus ``error_head`` and ``snoozed`` (as in :meth:`jobs`)."""
        row = self.queue.get(job_id)
        row["error_head"] = error_head(row.get("last_error"))
        row["snoozed"] = is_snooze_note(row.get("last_error"))
        return row

    def graph(self, job_id: int, limit: int = 100) -> dict[str, Any]:
        """A job's workflow: its parents and children (up to ``limit`` each) and their counts
        (:meth:`Queue.graph`)."""
        return self.queue.graph(job_id, limit)

    def attempts(self, job_id: int) -> list[dict[str, Any]]:
        """One job's attempt history, oldest first, each ``error_head`` cut to its first line."""
        rows = self.queue.attempts(job_id)
        for row in rows:
            row["error_head"] = error_head(row.get("error_head"))
        return rows

    def attempts_page(self, job_id: int, number: int = 1, size: int = PAGE_SIZE) -> Page[dict[str, Any]]:
        """Page ``number`` of one job's attempt history, oldest first (a job may have thousands)."""
        rows = self._attempt_rows("insight_attempts", job_id, number, size)
        return _paged(rows, number, size)

    def _attempt_rows(self, query: str, job_id: int, number: int, size: int) -> list[dict[str, Any]]:
        """One page's rows of ``query`` (``size`` and one more, to tell a next page), each row's
        ``error_head`` its first line; JobNotFound when there is no such job."""
        _check_page(number, size)
        rows = self.queue.query(query, {"id": job_id, "limit": size + 1, "offset": (number - 1) * size})
        if not rows:
            self.queue.get(job_id)  # JobNotFound when there is no such job
        for row in rows:
            row["error_head"] = error_head(row.get("error_head"))
        return rows

    def attempt_runs_page(self, job_id: int, number: int = 1, size: int = PAGE_SIZE) -> Page[dict[str, Any]]:
        """Page ``number`` of one job's attempt history, oldest first, as :meth:`attempts_page` but
        with each run of consecutive snoozes one row: its first row's columns plus ``n`` (rows in
        the run, 1 for any other row), ``run_started``, ``run_finished`` and ``run`` (None, or the
        run's rows: ``snooze``, ``finished_at``, ``error_head``). A page holds ``size`` such rows."""
        rows = self._attempt_rows("insight_attempt_runs", job_id, number, size)
        for row in rows:
            for one in row["run"] or ():
                one["finished_at"] = _timestamp(one["finished_at"])
                one["error_head"] = error_head(one["error_head"])
        return _paged(rows, number, size)

    def schedules(self) -> list[dict[str, Any]]:
        """Every schedule: name, cron, timezone, kind, queue, payload, its latest enqueued
        occurrence (``last``) and the next one due (``next``)."""
        found, now = self.queue.schedules()
        return [{"name": s.name, "cron": s.cron, "timezone": s.timezone, "kind": s.kind, "queue": s.queue,
                 "payload": s.payload, "last": last, "next": s.next_after(max(now, last or now))}
                for s, _, last in found]

    def schedules_page(self, number: int = 1, size: int = PAGE_SIZE) -> Page[dict[str, Any]]:
        """Page ``number`` of :meth:`schedules`, by name (schedules are read whole: the scheduler
        needs them all at every drain anyway)."""
        return page_of(self.schedules(), number, size)

    # -- the dashboard ---------------------------------------------------------------------

    def running(self, number: int = 1, size: int = PAGE_SIZE) -> Page[dict[str, Any]]:
        """Page ``number`` of the running jobs, longest-running first, with ``elapsed_seconds``."""
        _check_page(number, size)
        rows = self.queue.query("insight_running", {"limit": size + 1, "offset": (number - 1) * size})
        return _paged(rows, number, size)

    def per_minute(self, hours: float = 3) -> list[dict[str, Any]]:
        """Attempts that ended per minute, oldest first, every minute of the window present:
        ``done``, and ``failed`` (retried, dead or expired: a job tried three times that failed
        each time counts three). From the attempt history, so each retry is seen."""
        return self.queue.query("insight_per_minute", {"minutes": max(1, round(hours * 60))})

    def overview(self, hours: float = 3, *, running_page: int = 1, kinds_page: int = 1, queues_page: int = 1,
                 size: int = PAGE_SIZE) -> Overview:
        """The first page's figures; the tables of kinds, queues and running jobs are paged."""
        for number in (running_page, kinds_page, queues_page):
            _check_page(number, size)
        self.queue.compact_counts()
        counts = self.queue.query("insight_counts", {})
        by_status = {s.value: 0 for s in Status}
        by_kind: dict[str, dict[str, int]] = {}
        by_queue: dict[str, dict[str, int]] = {}
        for r in counts:
            by_status[r["status"]] += r["n"]
            kind = by_kind.setdefault(r["kind"], {})
            kind[r["status"]] = kind.get(r["status"], 0) + r["n"]
        for r in self.queue.query("insight_counts_by_queue", {}):
            by_queue.setdefault(r["queue"], {})[r["status"]] = int(r["n"])
        stats = self.queue.query("pending_times", {})[0]
        return Overview(
            total=sum(by_status.values()),
            by_status=by_status,
            by_kind=page_of(sorted(by_kind.items()), kinds_page, size),
            by_queue=page_of(sorted(by_queue.items()), queues_page, size),
            oldest_due_age_seconds=stats["oldest_due_age_seconds"],
            next_due_in_seconds=stats["next_due_in_seconds"],
            running=self.running(running_page, size),
            per_minute=self.per_minute(hours),
        )

    # -- metrics ---------------------------------------------------------------------------

    def metrics(self) -> MetricsSnapshot:
        """Jobs by queue, kind and status; the oldest due job per queue; every ended attempt by
        kind and outcome with its duration histogram, from the attempt history's running totals."""
        bounds = [float(b) for b in DURATION_BUCKETS]
        self.fold_step(bounds)
        self.queue.compact_counts()
        counts = self.queue.query("insight_counts", {})
        oldest = self.queue.query("insight_oldest_due_by_queue", {})
        finished: dict[tuple[str, str], int] = {}
        per_bound: dict[tuple[str, str], dict[float, int]] = {}
        sums: dict[tuple[str, str], float] = {}
        for r in self._attempt_totals(bounds):
            key = (r["kind"], r["outcome"])
            finished[key] = finished.get(key, 0) + int(r["n"])
            if r["bound"] >= 0:
                by = per_bound.setdefault(key, {})
                by[r["bound"]] = by.get(r["bound"], 0) + int(r["n"])
                sums[key] = sums.get(key, 0.0) + float(r["seconds"])
        durations: dict[tuple[str, str], tuple[list[int], float, int]] = {}
        for key, by in per_bound.items():
            cumulative = [sum(n for bound, n in by.items() if bound <= le) for le in bounds]
            durations[key] = (cumulative, sums[key], sum(by.values()))
        return MetricsSnapshot(
            jobs=[(r["queue"], r["kind"], r["status"], int(r["n"])) for r in counts if r["queue"] is not None],
            kept=[(r["kind"], r["status"], int(r["n"])) for r in counts if r["queue"] is None],
            oldest_due_age={r["queue"]: float(r["age_seconds"]) for r in oldest},
            finished=[(kind, outcome, n) for (kind, outcome), n in sorted(finished.items())],
            durations=durations,
        )

    def fold_history(self) -> None:
        """Fold every attempt that ended FOLD_MARGIN_SECONDS ago or more into the running totals, a
        batch at a time, until none is left (``fleetless init``): an upgraded database's long
        history is folded once there, instead of over its first scrapes (issue 26: 9-13 s each for
        ~25 scrapes at 5M attempts). Stops early when a concurrent fold holds the lock."""
        bounds = [float(b) for b in DURATION_BUCKETS]
        while True:
            before = self.queue.query("attempt_totals_mark")[0]["last_id"]
            self.fold_step(bounds, FOLD_BATCH)
            if self.queue.query("attempt_totals_mark")[0]["last_id"] == before:
                return

    def fold_step(self, bounds: list[float] | None = None, batch: int | None = None) -> None:
        """Move the running totals on by at most ``batch`` (STEP_FOLD_BATCH) attempts, toward those
        that ended FOLD_MARGIN_SECONDS ago. Nothing, quietly, on a connection that may not write (a
        role granted only SELECT: its scrapes count the bounded tail; writers' folds move it on)."""
        bounds = bounds or [float(b) for b in DURATION_BUCKETS]
        batch = STEP_FOLD_BATCH if batch is None else batch
        after = self.queue.query("attempt_totals_mark")[0]["last_id"]
        try:
            for row in self.queue.query("attempt_fold_upto", {"after": after, "margin": FOLD_MARGIN_SECONDS,
                                                              "batch": batch}, prepare=False):
                self.queue.query("fold_attempt_totals", {"after": after, "upto": row["upto"],
                                                         **bucket_params(bounds)}, prepare=False)
        except db.CannotWrite:
            pass

    def _attempt_totals(self, bounds: list[float]) -> list[dict[str, Any]]:
        """The totals plus the unfolded tail, read again if a concurrent fold moved the mark."""
        while True:
            after = self.queue.query("attempt_totals_mark", {})[0]["last_id"]
            rows = self.queue.query("attempt_totals", {"after": after, "tail": TAIL_MAX, **bucket_params(bounds)},
                                    prepare=False)
            if not rows or rows[0]["mark"] == after:
                return rows


__all__ += ["HEAD_CHARS", "PAGE_SIZE", "JobNotFound", "bucket_params"]
