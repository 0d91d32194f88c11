"""Migration files: each number used once (two helpers once both landed a 007; the second could
never be applied, since the migrations table is keyed on the number)."""

from __future__ import annotations

from collections import Counter

from fleetless import db


def test_every_migration_number_is_used_once() -> None:
    numbers = Counter(version for version, _, _ in db._migrations())
    assert [n for n, count in numbers.items() if count > 1] == []
    assert sorted(numbers) == list(range(1, len(numbers) + 1))
