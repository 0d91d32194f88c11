"""Shared bits of the benchmarks: a throw-away database, repetition, medians, ratios."""

from __future__ import annotations

import os
import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import psycopg

ADMIN_DSN = os.environ.get("FLEETLESS_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/postgres")


@contextmanager
def scratch_db() -> Iterator[str]:
    """A database of our own for one benchmark run, dropped afterwards."""
    name = f"fleetless_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(ADMIN_DSN, autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{name}"')
    info = psycopg.conninfo.conninfo_to_dict(ADMIN_DSN)
    info["dbname"] = name
    try:
        yield psycopg.conninfo.make_conninfo(**info)  # type: ignore[arg-type]
    finally:
        with psycopg.connect(ADMIN_DSN, autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def median(values: list[float]) -> float:
    return statistics.median(values)


def spread(values: list[float]) -> str:
    m = statistics.median(values)
    return f"{100 * (max(values) - min(values)) / m:.0f}%" if m else "-"
