"""Kill and signal wording the tiers share (what a result's ``killed`` and log lines say)."""

from __future__ import annotations

import signal


def describe_signal(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def memory_size(n: int) -> str:
    """A memory limit as a kill reason names it: ``256 MiB``, or ``1000 bytes`` when not whole MiB."""
    mib = 1024 * 1024
    return f"{n // mib} MiB" if n % mib == 0 else f"{n} bytes"
