"""The running totals of ended attempts that ``/metrics`` reads: the duration histogram's bounds.
The fold (:mod:`fleetless.insights`) and the deletes that add what they delete to the totals
(:mod:`fleetless.queue`) both use them, so they live here, below both (``tests/test_layout.py``
keeps the modules free of import cycles). Their lock is the row of attempt_totals_mark
(``fold_lock`` in queries.sql)."""

from __future__ import annotations

__all__ = ["DURATION_BUCKETS", "bucket_params"]

#: Upper bounds (seconds) of the job-duration histogram, from a sub-second job to a long one.
DURATION_BUCKETS: tuple[float, ...] = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)


def bucket_params(bounds: list[float]) -> dict[str, list[float]]:
    """The histogram's bounds as the totals' queries take them (ascending, and negated descending)."""
    return {"bounds": bounds, "negated": [-b for b in reversed(bounds)]}
