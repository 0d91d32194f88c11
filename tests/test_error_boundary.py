"""Driver errors become fleetless's own at one boundary (``db.errors_translated``): no other module
catches psycopg's, so every front end (CLI, dashboard, drainer, watcher) sees the same few errors."""

from __future__ import annotations

import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "fleetless"
#: db.py is the boundary; queue.py closes its own broken connection inside it, then re-raises.
#: async_queue.py is the asyncio twin of db.connect's boundary (its own connections, both drivers).
BOUNDARY = {"db.py", "queue.py", "async_queue.py"}


def test_only_the_boundary_catches_the_drivers_errors() -> None:
    catching = re.compile(r"except\s*\(?[^:\n]*\bpsycopg\b")
    found = [f"{path.relative_to(SRC)}:{n}" for path in sorted(SRC.rglob("*.py")) if path.name not in BOUNDARY
             for n, line in enumerate(path.read_text().splitlines(), 1) if catching.search(line)]
    assert found == []


def test_the_dashboard_never_imports_the_driver() -> None:
    for path in sorted((SRC / "web").glob("*.py")):
        assert "psycopg" not in path.read_text(), path.name
