"""The retry policy, in one place. The seed's numbers are the defaults."""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["MAX_ERROR_CHARS", "RetryPolicy"]

#: last_error keeps at most this many characters (the tail, where the traceback's cause is).
MAX_ERROR_CHARS = 2000
#: The largest backoff base, jitter or maximum delay accepted, in seconds (a year).
MAX_DELAY_OPTION = 365 * 86400.0


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff plus jitter: ``2**attempt * base + uniform(0, j)`` seconds, where
    ``j = min(max_jitter, backoff / 4)``: the jitter scales with the backoff, so a short base
    (``1s``) retries in about 2 s, not up to 30 s later.

    With the defaults a job failing its 1st attempt waits 2 min (+0-30 s), its 2nd 4 min, ...;
    jitter keeps a batch failing on the same dependency from retrying in lockstep.
    """

    base_seconds: float = 60.0
    max_jitter_seconds: float = 30.0
    max_delay_seconds: float = 7 * 24 * 3600.0

    def __post_init__(self) -> None:
        # Bounded so that now() + the delay is always a timestamp PostgreSQL can hold: a value out
        # of range is refused here, before a drain claims anything, not in the middle of one.
        for what, value in (("backoff base", self.base_seconds), ("jitter", self.max_jitter_seconds),
                            ("maximum delay", self.max_delay_seconds)):
            if not 0 <= value <= MAX_DELAY_OPTION:
                raise ValueError(f"{what} must be from 0 to {MAX_DELAY_OPTION / 86400:.0f} days, not {value:g} s")

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
        exp = min(attempt, 60)  # 2**60 minutes is already forever; avoid float overflow
        backoff = min((2.0**exp) * self.base_seconds, self.max_delay_seconds)
        return backoff + random.uniform(0, min(self.max_jitter_seconds, backoff / 4))
