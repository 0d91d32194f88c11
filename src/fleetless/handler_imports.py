"""Which of a ``.py`` handler's imports an interpreter lacks (issue 28).

Where a tier passes fleetless's own interpreter (the app's virtual environment) over for the
system's, because the job's uid cannot reach it (:func:`.sandbox.default_python`), a handler that
imports one of the app's packages would fail every attempt with ``ModuleNotFoundError``, each
charged. A drain asks this before it claims: the absolute imports at the handler's top level (read
with :mod:`ast`, never run) that the drainer's own interpreter finds and the one jobs get does not,
asked of that interpreter once per drain (one subprocess, isolated: no user site, no environment).
A module beside the handler (the handlers directory is on the job's ``sys.path``) is not asked, nor
``fleetless`` (the batch runner serves ``fleetless.outcomes`` where the job's python has none).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
from pathlib import Path

__all__ = ["missing"]

_ASK = ("import importlib.util, json, sys\n"
        "print(json.dumps([n for n in sys.argv[1:] if importlib.util.find_spec(n) is None]))\n")

_cache: dict[tuple[str, tuple[str, ...]], list[str]] = {}


def top_level_imports(path: Path) -> list[str]:
    """The top-level package names ``path`` imports absolutely, anywhere in the module (sorted)."""
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (OSError, SyntaxError, ValueError):
        return []
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return sorted(names)


def _own_finds(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def missing(path: Path, python: str) -> list[str]:
    """The packages the handler at ``path`` imports that this (the drainer's) interpreter has and
    ``python`` has not; [] when ``python`` cannot be asked (its own check says why)."""
    handlers_dir = path.parent
    names = tuple(n for n in top_level_imports(path) if n != "fleetless" and not (handlers_dir / f"{n}.py").exists()
                  and not (handlers_dir / n).is_dir() and _own_finds(n))
    if not names:
        return []
    key = (python, names)
    if key not in _cache:
        try:
            out = subprocess.run([python, "-I", "-c", _ASK, *names], capture_output=True, env={}, timeout=30,
                                 check=True, stdin=subprocess.DEVNULL, cwd="/").stdout
            _cache[key] = [str(n) for n in json.loads(out)]
        except (OSError, subprocess.SubprocessError, ValueError):
            _cache[key] = []
    return _cache[key]
