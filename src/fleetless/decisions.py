"""A handler's own decision about its job's outcome, as the :class:`~fleetless.job.Outcome` the
completer writes: a ``handle()`` that raised :mod:`fleetless.outcomes`' ``Discard``, ``Snooze`` or
``Retry`` (the batch runner's record), or a script that exited with one of the reserved codes
(``EXIT_DISCARD`` 90, ``EXIT_SNOOZE`` 91, ``EXIT_RETRY`` 92; the last non-empty line of its stderr
is the discard's reason, or ``SECONDS [REASON]``).

Every value comes from inside the sandbox and is checked here: a delay that is not a number from 0
to ``MAX_SECONDS`` fails the attempt as any error does (charged, the retry policy's backoff), with
a one-line error naming what was wrong; the job is never lost.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .failure import exception_line
from .job import Outcome, Run
from .outcomes import EXIT_DISCARD, EXIT_RETRY, EXIT_SNOOZE, MAX_SECONDS
from .retry import MAX_ERROR_CHARS

__all__ = ["EXIT_CODES", "from_exit", "from_handle"]

#: The reserved exit codes, and what each decides.
EXIT_CODES = {EXIT_DISCARD: "discard", EXIT_SNOOZE: "snooze", EXIT_RETRY: "retry"}
#: How a snooze's note begins (the job's last_error, its history row's error_head): front ends tell
#: it from an error by it (a snooze is not a failure; issue 28). Snoozes past the cap say otherwise.
SNOOZE_NOTE = "snoozed for "
_REASON_CHARS = 500


class _Bad(ValueError):
    pass


def _seconds(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _Bad(f"not a number of seconds: {str(value)[:60]!r}")
    try:
        seconds = float(value)
    except OverflowError:  # an int past any float
        seconds = math.inf
    if not (math.isfinite(seconds) and 0 <= seconds <= MAX_SECONDS):
        raise _Bad(f"{str(value)[:40]} s is out of range (0 to {MAX_SECONDS:.0f} s, 365 days)")
    return seconds


def _with_tail(head: str, stderr: str) -> str:
    tail = stderr.rstrip()
    if not tail:
        return head
    head = head[:MAX_ERROR_CHARS // 2]
    return f"{head}\n{tail[-(MAX_ERROR_CHARS - len(head) - 1):]}"


def _outcome(decided: str, seconds: float | None, reason: str, how: str, run: Run, stderr: str,
             result: str | None, result_cut: bool) -> Outcome:
    """``how``: " (exit code 91)" for a script, "" for handle()."""
    said = f": {reason}" if reason else ""
    if decided == "discard":
        return Outcome("fail", error=_with_tail(f"discarded{how}{said}", stderr), permanent=True, decided="discard",
                       result=result, result_cut=result_cut, run=run)
    if decided == "snooze":
        assert seconds is not None
        return Outcome("snooze", error=_with_tail(f"{SNOOZE_NOTE}{seconds:g} s{how}{said}", stderr), delay=seconds,
                       decided="snooze", result=result, result_cut=result_cut, run=run)
    if seconds is None:  # Retry(after=None): the retry policy's backoff, as any failure
        return Outcome("fail", error=_with_tail(f"retry requested{how}{said}", stderr), decided="retry",
                       result=result, result_cut=result_cut, run=run)
    return Outcome("fail", error=_with_tail(f"retry requested in {seconds:g} s{how}{said}", stderr), delay=seconds,
                   decided="retry", own_delay=True, result=result, result_cut=result_cut, run=run)


def _bad(head: str, stderr: str, run: Run, result: str | None, result_cut: bool) -> Outcome:
    """A decision with a value that cannot stand: a failed attempt, as any error."""
    return Outcome("fail", error=_with_tail(head, stderr), result=result, result_cut=result_cut, run=run)


def from_handle(rec: Mapping[str, Any], run: Run, stdout: str | None, stderr: str, cut: bool = False) -> Outcome:
    """The batch runner's record of a handle() that raised Discard, Snooze or Retry:
    ``{"decided": "snooze", "seconds": 30, "reason": "..."}``; ``cut``: it printed past the cap."""
    if not isinstance(rec, Mapping):
        return _bad("handle() raised an outcome the runner could not describe", stderr, run, stdout, cut)
    decided = rec.get("decided")
    # text PostgreSQL can store: a lone surrogate (a "\udXXX" the handler put in its reason) would
    # make the whole outcome unstorable, and the completer would then fail the job permanently
    reason = str(rec.get("reason") or "")[:_REASON_CHARS].encode("utf-8", "replace").decode("utf-8")
    name = str(decided).capitalize()
    if decided not in ("discard", "snooze", "retry"):
        return _bad(f"handle() raised an unknown outcome {str(decided)[:40]!r}", stderr, run, stdout, cut)
    seconds = None
    raw = rec.get("seconds")
    if decided == "snooze" or (decided == "retry" and raw is not None):
        try:
            seconds = _seconds(raw)
        except _Bad as exc:
            return _bad(f"handle() raised {name} with a bad delay: {exc}", stderr, run, stdout, cut)
    return _outcome(decided, seconds, reason, "", run, stderr, stdout, cut)


def from_exit(exit_code: int, stderr: str, run: Run, result: str | None, result_cut: bool) -> Outcome | None:
    """A script's reserved exit code as its decision; None for any other exit code."""
    decided = EXIT_CODES.get(exit_code)
    if decided is None:
        return None
    how = f" (exit code {exit_code})"
    if decided == "discard":
        return _outcome(decided, None, exception_line(stderr) or "", how, run, stderr, result, result_cut)
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    first, _, reason = last.partition(" ")
    try:
        seconds = _seconds(float(first))
    except (ValueError, OverflowError) as exc:
        problem = str(exc) if isinstance(exc, _Bad) else f"not a number of seconds: {first[:60]!r}"
        return _bad(f"exit code {exit_code} ({decided}) needs 'SECONDS [REASON]' as the last line of stderr: "
                    f"{problem}", stderr, run, result, result_cut)
    before = stderr.rstrip()[:-len(last)] if last else stderr  # what it said before its decision's line
    return _outcome(decided, seconds, reason.strip()[:_REASON_CHARS], how, run, before, result, result_cut)
