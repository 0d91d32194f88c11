"""Per-job workspaces on the host: created private, always removed, leftovers swept.

A workspace directory is named ``ws-<drainer pid>-<random>`` under :func:`root`. Beside them live
per-drainer copies of host files that sandboxes run from or bind (:func:`cached_copy`:
``hs-…`` handlers snapshots, ``etc-…`` for bwrap). A drainer that was SIGKILLed cannot remove its
own; :func:`sweep` (run at the start of every drain) removes those whose drainer process is gone.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Hashable
from pathlib import Path

#: Prefixes of what :func:`sweep` removes once its drainer process is gone.
_SWEPT = ("ws", "hs", "etc")


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
        if len(parts) < 3 or parts[0] not in _SWEPT or not parts[1].isdigit():
            continue
        if not pid_alive(int(parts[1])):
            remove(entry)
            removed += 1
    return removed


Signature = tuple[tuple[str, int, int, int], ...]
_copies_lock = threading.Lock()
_copies: dict[tuple[str, Hashable], tuple[Signature, Path]] = {}
_old_copies: list[Path] = []


def signature(paths: list[str]) -> Signature:
    """What these files are now (size, mode, mtime), to notice that one changed."""
    out = []
    for p in paths:
        try:
            st = os.stat(p)
        except OSError:
            continue
        out.append((p, st.st_size, st.st_mode, st.st_mtime_ns))
    return tuple(out)


def cached_copy(prefix: str, key: Hashable, sig: Signature, build: Callable[[Path], None]) -> Path:
    """A directory ``<prefix>-<pid>-*`` under :func:`root` that ``build`` fills, made once per drainer
    process and again whenever ``sig`` changes. A replaced copy may still be in use by a running
    job, so it is removed at exit (or by the next :func:`sweep`), not at once. A ``build`` that
    fails leaves nothing behind."""
    with _copies_lock:
        current = _copies.get((prefix, key))
        if current is not None and current[0] == sig and current[1].is_dir():
            return current[1]
        folder = Path(tempfile.mkdtemp(prefix=f"{prefix}-{os.getpid()}-", dir=root()))
        try:
            build(folder)
        except BaseException:
            remove(folder)
            raise
        if current is not None:
            _old_copies.append(current[1])
        _copies[(prefix, key)] = (sig, folder)
        return folder


@atexit.register
def _remove_copies() -> None:
    for folder in [*_old_copies, *(v[1] for v in _copies.values())]:
        remove(folder)
