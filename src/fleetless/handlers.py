"""Kind -> handler resolution. The seed's contract: ``DIR/<kind>.py`` runs as
``python3 DIR/<kind>.py <workspace>/payload.json``; any executable ``DIR/<kind>`` (with a shebang)
runs the same way, so handlers can be written in any language.

A ``DIR/<kind>.py`` with a top-level ``def handle(`` is a handler *module*: it is imported once
per sandbox and ``handle(payload)`` is called once per job, its return value (JSON) being the
job's result. The file is read, never imported, by the drainer itself."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from .job import validate_kind

__all__ = ["Handler", "HandlersDirError", "resolve", "check_dir"]


class HandlersDirError(RuntimeError):
    pass


_HANDLE_RE = re.compile(rb"^def\s+handle\s*\(", re.MULTILINE)
_module_cache: dict[tuple[str, int, int, int], bool] = {}


def defines_handle(path: Path) -> bool:
    """Whether a Python handler defines a top-level ``handle`` (cached per file version)."""
    try:
        st = path.stat()
        key = (str(path), st.st_ino, st.st_size, st.st_mtime_ns)
        if key not in _module_cache:
            _module_cache[key] = bool(_HANDLE_RE.search(path.read_bytes()))
        return _module_cache[key]
    except OSError:
        return False


@dataclass(frozen=True)
class Handler:
    kind: str
    filename: str  # relative to the handlers directory
    python: bool  # True: run with the sandbox's python; False: exec directly
    module: bool = False  # defines handle(payload): imported once per sandbox, called per job

    def argv(self, handlers_path: str, python: str, payload_path: str) -> list[str]:
        script = f"{handlers_path}/{self.filename}"
        return [python, script, payload_path] if self.python else [script, payload_path]


def check_dir(handlers_dir: Path) -> Path:
    """The directory, resolved, or a one-line error when it is not usable."""
    if not handlers_dir.exists():
        raise HandlersDirError(f"handlers directory {handlers_dir} does not exist")
    if not handlers_dir.is_dir():
        raise HandlersDirError(f"handlers directory {handlers_dir} is not a directory")
    if not os.access(handlers_dir, os.R_OK | os.X_OK):
        raise HandlersDirError(f"handlers directory {handlers_dir} is not readable")
    return handlers_dir.resolve()


def resolve(handlers_dir: Path, kind: str) -> Handler | None:
    """The handler for ``kind``, or None when there is none."""
    validate_kind(kind)
    script = handlers_dir / f"{kind}.py"
    if script.is_file():
        return Handler(kind, script.name, python=True, module=defines_handle(script))
    program = handlers_dir / kind
    if program.is_file() and os.access(program, os.X_OK):
        return Handler(kind, program.name, python=False)
    return None
