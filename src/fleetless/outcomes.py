"""What a ``handle(payload)`` handler raises to decide its job's outcome itself.

::

    from fleetless.outcomes import Discard, Retry, Snooze

    def handle(payload):
        if payload.get("version") != 2:
            raise Discard("payload version 1 is no longer supported")  # dead at once, no retries
        if not upstream_ready():
            raise Snooze(30)                  # pending again in 30 s; no attempt is charged
        if rate_limited():
            raise Retry(after=120, reason="429 from upstream")  # a failed attempt, retried in 120 s

- ``Discard(reason)``: the job is dead at once, whatever attempts are left; its history row says
  ``discarded`` and its ``last_error`` is ``discarded: <reason>``.
- ``Snooze(seconds)``: the job is pending again after ``seconds``, its attempt given back (not
  charged against ``max_attempts``); its history row says ``snoozed``. Bounded: a job may snooze
  ``MAX_SNOOZES`` times; a snooze beyond that is charged as a failed attempt (said in its error).
- ``Retry(after=seconds, reason=...)``: a failed attempt (``max_attempts`` still applies), retried
  after the handler's own delay instead of the retry policy's backoff (``after=None``: the policy's);
  its history row says ``retried`` (a plain failure's says ``failed``).

``seconds``/``after`` are an ``int``, a ``float`` or a ``datetime.timedelta`` from 0 to
``MAX_SECONDS`` (365 days); anything else raises ``ValueError`` where the exception is made, so the
job fails with that one-line error as from any other exception.

This module uses the standard library only and is importable in every sandbox tier: where the
sandbox's interpreter has no ``fleetless`` package (a microVM guest, a system python), the batch
runner that calls ``handle()`` serves this very file as ``fleetless.outcomes``
(``sandbox/_batch_runner.py``). The runner recognises the three by their class names in this
module (subclasses too), so the copy and the installed package are interchangeable.
"""

from __future__ import annotations

import datetime
import math

__all__ = ["EXIT_DISCARD", "EXIT_RETRY", "EXIT_SNOOZE", "MAX_SECONDS", "MAX_SNOOZES", "Decision", "Discard", "Retry",
           "Snooze"]

#: The longest delay a Snooze or a Retry may ask for (365 days, as the retry policy's options).
MAX_SECONDS = 365 * 86400.0
#: How many snoozes a job may take; the next one is charged as a failed attempt.
MAX_SNOOZES = 100
#: A script (any executable) decides the same by its exit code; the last non-empty line of its
#: stderr is the discard's reason, or ``SECONDS [REASON]`` for a snooze or a retry.
EXIT_DISCARD, EXIT_SNOOZE, EXIT_RETRY = 90, 91, 92


def _seconds(what: str, value: object) -> float:
    if isinstance(value, datetime.timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must be a number of seconds or a timedelta, not {type(value).__name__}")
    try:
        seconds = float(value)
    except OverflowError:  # an int past any float
        seconds = math.inf
    if not (math.isfinite(seconds) and 0 <= seconds <= MAX_SECONDS):
        raise ValueError(f"{what} must be from 0 to {MAX_SECONDS:.0f} s (365 days), not {str(value)[:40]}")
    return seconds


class Decision(Exception):  # not an error: a decision
    """The base of the three: a handler's own decision about its job's outcome."""

    reason: str = ""


class Discard(Decision):
    """Give up now: the job is dead at once with ``reason``, without its remaining attempts."""

    def __init__(self, reason: str = "") -> None:
        self.reason = str(reason)
        super().__init__(self.reason)


class Snooze(Decision):
    """Pending again after ``seconds``, without charging an attempt (at most MAX_SNOOZES times)."""

    def __init__(self, seconds: float | datetime.timedelta, reason: str = "") -> None:
        self.seconds = _seconds("Snooze seconds", seconds)
        self.reason = str(reason)
        super().__init__(self.seconds, self.reason)


class Retry(Decision):
    """A failed attempt, retried after ``after`` seconds (None: the retry policy's backoff)."""

    def __init__(self, after: float | datetime.timedelta | None = None, reason: str = "") -> None:
        self.after = None if after is None else _seconds("Retry after", after)
        self.reason = str(reason)
        super().__init__(self.after, self.reason)
