"""Kind -> handler resolution. The seed's contract: ``DIR/<kind>.py`` runs as
``python3 DIR/<kind>.py <workspace>/payload.json``; any executable ``DIR/<kind>`` (with a shebang)
runs the same way, so handlers can be written in any language."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .job import validate_kind

__all__ = ["Handler", "HandlersDirError", "resolve", "check_dir"]


class HandlersDirError(RuntimeError):
    pass


@dataclass(frozen=True)
class Handler:
    kind: str
    filename: str  # relative to the handlers directory
    python: bool  # True: run with the sandbox's python; False: exec directly

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
        return Handler(kind, script.name, python=True)
    program = handlers_dir / kind
    if program.is_file() and os.access(program, os.X_OK):
        return Handler(kind, program.name, python=False)
    return None
