"""The rlimits a job of the host's tiers (process, bwrap, forkserver) runs under, and the words for a
death one of them caused (the microVM's guest sets the same limits and reports them the same way)."""

from __future__ import annotations

import math
import signal

from . import Template


def rlimits_for(template: Template, timeout_seconds: float) -> dict[str, int]:
    limits = template.limits
    out: dict[str, int] = {}
    if limits.memory_bytes is not None:
        out["RLIMIT_AS"] = limits.memory_bytes
    cpu = limits.cpu_seconds if limits.cpu_seconds is not None else math.ceil(timeout_seconds) + 1
    out["RLIMIT_CPU"] = cpu
    if limits.file_size_bytes is not None:
        out["RLIMIT_FSIZE"] = limits.file_size_bytes
    if limits.open_files is not None:
        out["RLIMIT_NOFILE"] = limits.open_files
    out["RLIMIT_CORE"] = 0
    return out


def rlimit_kill_reason(exit_code: int, rlimits: dict[str, int]) -> str | None:
    """Words for a death that an rlimit caused (the kernel signals the job itself)."""
    if exit_code == -signal.SIGXCPU and "RLIMIT_CPU" in rlimits:
        return f"killed: cpu time limit {rlimits['RLIMIT_CPU']} s exceeded"
    if exit_code == -signal.SIGXFSZ and "RLIMIT_FSIZE" in rlimits:
        return f"killed: file size limit {rlimits['RLIMIT_FSIZE'] // (1024 * 1024)} MiB exceeded"
    return None
