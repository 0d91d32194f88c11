"""Importing psycopg without its version lookups (a cron tick's start-up, BENCHMARKS.md (6)).

``psycopg`` and ``psycopg_binary`` each set ``__version__`` in a ``version`` submodule with
``importlib.metadata.version()``, which imports ``email``, ``zipfile``, ``csv``... and searches
every ``sys.path`` entry for the distribution: ~15 ms of an empty drain's ~200 ms here, about as
much as fleetless's own imports. When psycopg is not imported yet, :func:`prepare` registers those
two submodules with the version read from the installed ``*.dist-info`` directory's name next to
the package (what the lookup finds), so psycopg's own import skips the lookup. Anything unexpected
(no single ``dist-info``, a psycopg whose import then fails) leaves psycopg to import as it always
does. Importing this module does all that (``fleetless/__init__.py`` imports it first).
"""

from __future__ import annotations

import os
import sys
import types
from importlib.machinery import PathFinder

_PACKAGES = (("psycopg", "psycopg"), ("psycopg_binary", "psycopg_binary"))


def _installed_version(package: str, dist: str) -> str | None:
    spec = PathFinder.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    site = os.path.dirname(next(iter(spec.submodule_search_locations)))
    prefix = f"{dist}-"
    try:
        found = [n for n in os.listdir(site) if n.startswith(prefix) and n.endswith(".dist-info")]
    except OSError:
        return None
    if len(found) != 1:
        return None
    version = found[0][len(prefix):-len(".dist-info")]
    return version if version and version[0].isdigit() else None


def prepare() -> None:
    """Register psycopg's version submodules before psycopg is imported (see the module)."""
    if any(name in sys.modules for name, _ in _PACKAGES):
        return
    for package, dist in _PACKAGES:
        version = _installed_version(package, dist)
        if version is None:
            continue
        module = types.ModuleType(f"{package}.version", f"{package} distribution version (from its dist-info)")
        module.__version__ = version  # type: ignore[attr-defined]
        sys.modules[module.__name__] = module


def undo() -> None:
    """Forget what :func:`prepare` registered and whatever of psycopg it then half-imported."""
    for name in [n for n in sys.modules if n.split(".")[0] in {p for p, _ in _PACKAGES}]:
        del sys.modules[name]


def _import() -> None:
    prepare()
    try:
        import psycopg  # noqa: F401
    except ImportError:
        undo()  # a psycopg unlike the ones this knows: it imports as it always does, or says why not


_import()
