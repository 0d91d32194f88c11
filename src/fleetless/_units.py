"""Parsing of durations ("30m") and sizes ("512M") given on the command line, and writing them back."""

from __future__ import annotations

import re

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}


def parse_duration(text: str) -> float:
    """Seconds from ``90``, ``90s``, ``30m``, ``2h``, ``7d``, ``500ms``."""
    m = _DURATION.match(text)
    if not m:
        raise ValueError(f"invalid duration {text!r}: a number with an optional unit ms, s, m, h or d")
    return float(m.group(1)) * _DURATION_UNITS[m.group(2)]


def parse_size(text: str) -> int:
    """Bytes from ``512M``, ``1G``, ``256MiB``, ``4096``."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"invalid size {text!r}: a number with an optional unit K, M, G or T")
    unit = (m.group(2) or "B")[0].upper()
    factor = {"B": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}[unit]
    return int(float(m.group(1)) * factor)


def format_size(n: int) -> str:
    for unit, factor in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= factor and n % factor == 0:
            return f"{n // factor} {unit}"
    return f"{n} B"


def format_duration(seconds: float) -> str:
    """``10m``, ``30s``, ``7d``, ``90s``, ``1.5s``, ``500ms``: the largest unit that holds it whole,
    as a user would write it in fleetless.toml (parse_duration reads it back)."""
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= span and float(seconds / span).is_integer():
            return f"{int(seconds / span)}{unit}"
    if 0 < seconds < 1 and float(seconds * 1000).is_integer():
        return f"{int(seconds * 1000)}ms"
    return f"{seconds:g}s"
