"""The running totals of ended attempts that ``/metrics`` reads: the duration histogram's bounds
and the lock under which attempts are folded into the totals. The fold (:mod:`fleetless.insights`)
and the deletes that add what they delete to the totals (:mod:`fleetless.queue`) both use them, so
they live here, below both (``tests/test_layout.py`` keeps the modules free of import cycles)."""

from __future__ import annotations

__all__ = ["DURATION_BUCKETS", "FOLD_LOCK", "bucket_params"]

#: Upper bounds (seconds) of the job-duration histogram, from a sub-second job to a long one.
DURATION_BUCKETS: tuple[float, ...] = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)

#: The advisory lock a fold tries and a delete that adds to the totals itself waits for.
FOLD_LOCK = 0x666C6D6574


def bucket_params(bounds: list[float]) -> dict[str, list[float]]:
    """The histogram's bounds as the totals' queries take them (ascending, and negated descending)."""
    return {"bounds": bounds, "negated": [-b for b in reversed(bounds)]}
