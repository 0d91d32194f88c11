"""What a kind's global limits (fleetless.toml's concurrency and rate) cost a claim.

    python bench/bench_kind_limits.py [--reps 5] [--rounds 100] [--pending 10000]

Same run, same database, cases alternating within each repetition: `Queue.claim(N)` of one kind
(then every claimed job released with one finish_many, so the pending set keeps its size) with
no per-kind settings; with settings that are not limits (tier, max_attempts: the claim is still
one statement); with a concurrency limit that is never reached; with a rate limit that is never
reached (each claim logs its starts in kind_starts and counts the window). Prints claimed jobs/s,
medians and spreads, and each case's ratio to the first.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, scratch_db, spread

from fleetless import Queue
from fleetless.completer import Completer
from fleetless.job import Outcome
from fleetless.kinds import KindSettings, Rate

CASES: dict[str, dict[str, KindSettings] | None] = {
    "no settings": None,
    "tier + max_attempts": {"noop": KindSettings(tier="process", max_attempts=5)},
    "concurrency = 1000000": {"noop": KindSettings(concurrency=1_000_000)},
    "rate = 1000000/min": {"noop": KindSettings(rate=Rate(1_000_000, 60.0))},
}


def _rate(q: Queue, n: int, rounds: int, kinds: dict[str, KindSettings] | None) -> float:
    completer = Completer(q, flush_size=100_000)
    claimed = 0
    t = time.perf_counter()
    for _ in range(rounds):
        jobs = q.claim(n, default_timeout=60, ttl=60, lease_grace=60, kinds=kinds)
        claimed += len(jobs)
        for job in jobs:
            completer.add(job, Outcome("release"))
        completer.flush()
    return claimed / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--pending", type=int, default=10_000)
    a = ap.parse_args()
    with scratch_db() as dsn:
        q = Queue(dsn)
        q.init()
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute("INSERT INTO fleetless.jobs (kind, payload) SELECT 'noop', '{}' FROM generate_series(1, %s)",
                      (a.pending,))
            c.execute("VACUUM ANALYZE fleetless.jobs")
        for n in (1, 20):
            results: dict[str, list[float]] = {name: [] for name in CASES}
            for _ in range(a.reps):
                for name, kinds in CASES.items():
                    results[name].append(_rate(q, n, a.rounds, kinds))
            base = median(results["no settings"])
            for name, values in results.items():
                print(f"N = {n:2}  {name:24} {median(values):8.0f} jobs/s  (spread {spread(values)})"
                      f"  ratio {median(values) / base:.2f}")
        q.close()


if __name__ == "__main__":
    main()
