"""Per-job workspaces on the host: created private, always removed, leftovers swept.

A workspace directory is named ``ws-<drainer pid>-<random>`` under :func:`root`. A drainer that was
SIGKILLed cannot remove its own; :func:`sweep` (run at the start of every drain) removes those
whose drainer process is gone.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def root() -> Path:
    """Where workspaces live: ``$FLEETLESS_WORKDIR`` or ``<tmp>/fleetless-<uid>``."""
    base = os.environ.get("FLEETLESS_WORKDIR") or os.path.join(
        tempfile.gettempdir(), f"fleetless-{os.getuid()}"
    )
    path = Path(base)
    path.mkdir(mode=0o711, parents=True, exist_ok=True)
    return path


def create() -> Path:
    """A fresh, empty, private directory for one job."""
    return Path(tempfile.mkdtemp(prefix=f"ws-{os.getpid()}-", dir=root()))


def remove(path: Path) -> None:
    """Remove a workspace whatever the job did to its permissions."""
    if not path.exists():
        return
    for dirpath, dirnames, _ in os.walk(path):
        for name in dirnames:
            try:
                os.chmod(os.path.join(dirpath, name), 0o700)
            except OSError:
                pass
    shutil.rmtree(path, ignore_errors=True)


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] != b"Z"


def sweep() -> int:
    """Remove workspaces left by drainers that no longer run; returns how many."""
    removed = 0
    for entry in root().iterdir():
        parts = entry.name.split("-")
        # ws-: a job's workspace; hs-: a process-tier handlers snapshot
        if len(parts) < 3 or parts[0] not in ("ws", "hs") or not parts[1].isdigit():
            continue
        if not pid_alive(int(parts[1])):
            remove(entry)
            removed += 1
    return removed
