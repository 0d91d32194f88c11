"""Kill and signal wording the tiers share (what a result's ``killed`` and log lines say)."""

from __future__ import annotations

import signal


def describe_signal(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
