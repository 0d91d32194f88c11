"""The read-only snapshot of the handlers directory that the host's tiers run jobs from (a cached
copy made with :mod:`._workspace`)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from . import _workspace


def handlers_snapshot(folder: Path) -> Path:
    """A read-only copy of the handlers directory (directories 0555, files 0444, or 0555 where the
    original is executable) that jobs run from, made again when the original changes. Jobs
    therefore cannot change the handlers other jobs run, short of a deliberate chmod (or being
    root, which the process tier does not defend against: use bwrap or microvm for that)."""
    folder = folder.resolve()
    files = sorted(os.path.join(d, f) for d, _, names in os.walk(folder) for f in names)

    def build(copy: Path) -> None:
        shutil.copytree(folder, copy, dirs_exist_ok=True)
        for dirpath, _, filenames in os.walk(copy, topdown=False):
            for name in filenames:
                target = os.path.join(dirpath, name)
                os.chmod(target, 0o555 if os.stat(target).st_mode & 0o111 else 0o444)
            os.chmod(dirpath, 0o555)

    return _workspace.cached_copy("hs", folder, _workspace.signature(files), build)
