"""Which resource caps hold for a tier's jobs on this host, and how (``Sandbox.caps``), in words for
``fleetless doctor`` and the drain's first log line. Every cap is said as held (``capped by ...``)
or not (``NOT capped: ...``): never a cap that the host cannot give.

Pids are held by a pids cgroup where the drainer can write one, and by ``RLIMIT_NPROC`` where the
kernel counts it for the job alone: since Linux 5.14 the count is per user namespace and uid, so a
job in a user namespace of its own (bwrap's, the process tier's supervisor's) or under a uid of its
own (a leased or subordinate uid) counts only its own processes and threads, whoever else runs as
the same host uid (tests/security/test_caps.py).
"""

from __future__ import annotations

import os
import re

__all__ = ["CAPS", "NOT", "caps_line", "held", "nproc_counts_per_namespace"]

#: The caps every tier reports, in this order.
CAPS = ("pids", "memory", "cpu", "disk")
#: How a cap that does not hold starts.
NOT = "NOT capped"


def nproc_counts_per_namespace() -> bool:
    """Whether this kernel counts ``RLIMIT_NPROC`` per user namespace and uid (Linux 5.14 and later)
    rather than per host uid across every namespace."""
    found = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return found is not None and (int(found[1]), int(found[2])) >= (5, 14)


def held(caps: dict[str, str]) -> dict[str, bool]:
    """Per cap: whether it holds."""
    return {name: not text.startswith(NOT) for name, text in caps.items()}


def caps_line(tier: str, caps: dict[str, str]) -> str:
    """One line: ``caps (bwrap): pids capped by ...; memory NOT capped: ...; ...``."""
    return f"caps ({tier}): " + "; ".join(f"{name} {caps[name]}" for name in CAPS if name in caps)
