"""How a command shows what it does: log lines (text or JSON) and a drain's live view.

Reporters for :class:`fleetless.events.Reporter`: :class:`LogReporter` writes one log record per
finished job (a line, or a JSON object with ``--log-format json``); :class:`LiveReporter` draws a
live table with ``rich`` when the drain is attached to a terminal. Job output reaching the terminal
goes through :func:`fleetless.insights.printable` first.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from typing import IO, TYPE_CHECKING, Any

from .events import JobFinished, NullReporter
from .insights import age, printable
from .job import Job

if TYPE_CHECKING:  # rich is imported by the live view itself: a drain off a terminal never loads it
    from rich.console import Console, RenderableType

__all__ = ["JsonFormatter", "LiveReporter", "LogReporter", "PrintableFormatter", "configure_logging", "job_line"]

log = logging.getLogger("fleetless.jobs")


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601 with ``Z``), level, logger, message, and
    the event's own fields."""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        # UTC, so that a log shipper on another host reads the time unambiguously
        return time.strftime(datefmt or "%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            data.update(fields)
        if record.exc_info:
            data["exception"] = self.formatException(record.exc_info)
        return json.dumps(data, default=str)


class PrintableFormatter(logging.Formatter):
    """Text log lines, escaped with :func:`printable`: they can quote what a job controls (a file
    name in its workspace, a sandbox error), which must not reach the terminal as escape sequences."""

    def format(self, record: logging.LogRecord) -> str:
        return printable(super().format(record))


def configure_logging(*, verbose: bool, log_format: str, stream: IO[str] | None = None) -> None:
    """Logging for every command: INFO with ``-v`` else WARNING; text or JSON lines on stderr."""
    handler = logging.StreamHandler(stream or sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(PrintableFormatter("fleetless: %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.INFO if verbose else logging.WARNING)


def job_line(e: JobFinished) -> str:
    """``job 12 (render-invoice) attempt 1: dead in 0.8 s on bwrap: exit code 1: ValueError: …``;
    an attempt that failed with attempts left says when it is due again:
    ``job 12 (render-invoice) attempt 1: failed in 0.8 s on bwrap, retry in 2.1m: exit code 1: …``
    (``retried``, in the history's words, only when its handler raised Retry); a snooze is labelled
    as its history row is, ``attempt 1 (snooze 2): snoozed in …`` (it gives its attempt back)."""
    label = f"{e.attempt}" if e.snooze is None else f"{e.attempt} (snooze {e.snooze})"
    line = f"job {e.id} ({e.kind}) attempt {label}: {e.outcome.replace('_', ' ')} in {e.duration:.1f} s on {e.tier}"
    if e.retry_in is not None:
        line += f", retry in {age(e.retry_in)}"
    if e.error_head:
        line += f": {e.error_head}"
    return printable(line)


class LogReporter(NullReporter):
    """One INFO record per finished job (shown with ``-v``), with the event's fields for JSON."""

    def finished(self, event: JobFinished) -> None:
        log.info("%s", job_line(event), extra={"fields": {"event": "job_finished", **event.as_dict()}})


class _AboveLive:
    """A log handler's stream while a live view is drawn: each record is printed above the view."""

    def __init__(self, live: LiveReporter) -> None:
        self.live = live

    def write(self, text: str) -> int:
        if text.strip():
            self.live.print_above(text.rstrip("\n"))
        return len(text)

    def flush(self) -> None:
        pass


class LiveReporter:
    """A live view of a drain on a terminal: counts, the rate, and each running job with its kind
    and elapsed time. Failed and dead jobs are also printed above it as they finish."""

    def __init__(self, console: Console | None = None, *, tier: str = "") -> None:
        from rich.console import Console
        from rich.live import Live

        self.console = console or Console(stderr=True)
        self.tier = tier
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._running: dict[int, tuple[str, float]] = {}  # id -> (kind, monotonic start)
        self._counts = {"claimed": 0, "done": 0, "failed": 0, "retried": 0, "dead": 0, "discarded": 0, "released": 0,
                        "fenced_out": 0, "cancelled": 0, "snoozed": 0}
        self._live = Live(self, console=self.console, refresh_per_second=4, transient=True)
        stderr = sys.stderr  # before the view starts: it redirects sys.stderr through itself
        self._live.start()
        # Log records (a Ctrl-C's "stopping; running jobs get 30 s", a refused kind) go above the
        # view: written straight to stderr, the view's next redraw would erase them.
        self._restore: list[tuple[logging.StreamHandler[Any], IO[str]]] = []
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream in (stderr, sys.__stderr__):
                old = handler.setStream(_AboveLive(self))
                if old is not None:
                    self._restore.append((handler, old))

    def claimed(self, job: Job) -> None:
        with self._lock:
            self._counts["claimed"] += 1
            self._running[job.id] = (job.kind, time.monotonic())

    def started(self, job: Job) -> None:
        pass

    def finished(self, event: JobFinished) -> None:
        with self._lock:
            self._running.pop(event.id, None)
            self._counts[event.outcome] += 1
        if event.outcome != "done":
            from rich.text import Text

            self._live.console.print(Text(job_line(event)), highlight=False)

    def close(self) -> None:
        self._live.stop()
        for handler, stream in self._restore:
            handler.setStream(stream)
        self._restore = []

    def print_above(self, line: str) -> None:
        """One line printed above the live view, which stays below it."""
        from rich.text import Text

        self._live.console.print(Text(line), highlight=False)

    def __rich__(self) -> RenderableType:
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        with self._lock:
            counts = dict(self._counts)
            running = sorted(self._running.items(), key=lambda item: item[1][1])
        now = time.monotonic()
        elapsed = max(now - self._started, 1e-9)
        dead = counts["dead"] + counts["discarded"]
        finished = counts["done"] + counts["failed"] + counts["retried"] + dead
        retried = f"retried {counts['retried']}  " if counts["retried"] else ""
        discarded = f" ({counts['discarded']} discarded)" if counts["discarded"] else ""
        head = Text(
            f"claimed {counts['claimed']}  running {len(running)}  done {counts['done']}  "
            f"failed {counts['failed']}  {retried}dead {dead}{discarded}  "
            f"{finished / elapsed * 60:.1f} jobs/min  ({age(elapsed)}{' on ' + self.tier if self.tier else ''})"
        )
        table = Table(box=None, show_header=bool(running), pad_edge=False)
        table.add_column("id", justify="right")
        table.add_column("kind")
        table.add_column("elapsed", justify="right")
        for job_id, (kind, since) in running[:20]:
            table.add_row(str(job_id), kind, age(now - since))
        if len(running) > 20:
            table.add_row("", f"… and {len(running) - 20} more", "")
        return Group(head, table)
