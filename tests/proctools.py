"""Process helpers the tests share: is a pid alive, which processes carry a marker, waiting, and
what drains left in a work directory."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fleetless.sandbox._tree import descendants as tree_descendants


def alive(pid: int) -> bool:
    """Whether ``pid`` still runs; a zombie (dead, not yet reaped) does not."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2 :][:1] not in (b"Z", b"X")


def pids_with(marker: str) -> list[int]:
    """Live host pids (other than this one) whose command line contains ``marker``."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(name))
        except OSError:
            continue
    return [pid for pid in found if alive(pid)]


def descendants(pid: int) -> list[int]:
    """The pids of ``pid``'s children, their children and so on (from each task's ``children``
    file): a test that looks for what its own drain started looks only there, never at every
    process on the host (another drain running there must not change its answer). The drainer's
    own memory watch walks the tree the same way: one walk serves both."""
    return tree_descendants(pid)


def wait_for(predicate: Callable[[], Any], timeout: float = 30.0, what: str = "condition",
             interval: float = 0.05) -> Any:
    """Poll until ``predicate()`` is truthy and return it; AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    value = predicate()
    if value:
        return value
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def leftovers(work: Path) -> list[str]:
    """What drains left in their work directory (workspaces, per-drainer copies), leaving out the
    quarantine and the copies every drainer shares by design (``etc-shared-*``, kept after them)."""
    return sorted(p.name for p in work.iterdir() if p.name != "quarantine" and "-shared-" not in p.name)
