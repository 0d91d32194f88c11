"""Workflows (issue 29): pg-boss's dependency workloads against the same jobs without dependencies.

    python bench/bench_workflows.py [--reps 3] [--jobs 10000] [--chain 10000] [--sandbox process]
                                    [--per-sandbox 1000] [--pending 1000000] [--rounds 50]

Part 1, drains: 10,000 no-op jobs (a handle() module returning None), drained by one in-process
batch drain (``--per-sandbox 1000 --concurrency 2``), as

- none: 10,000 jobs without dependencies (the baseline);
- fan-out: 1 job, then 9,999 after it;
- fan-in: 9,999 jobs, then 1 after all of them;
- layers: 20 layers of 500, each job after 3 jobs (chosen at random, seeded) of the layer before;
- chain: each job after the one before (``--chain``; 10,000 by default).

Each graph is enqueued with one enqueue_many (items naming earlier items), then drained; the
wall time of the drain alone gives jobs/s. The cases alternate inside each repetition on the same
database (tables emptied between), so each ratio to "none" is same-run.

Part 2, the claim of jobs without parents beside ``--pending`` pending jobs: ``claim(1000)`` then
one finish_many giving them back (the pending set keeps its size), ``--rounds`` times, with no
workflow in the database, and with 100,000 waiting children of one parent beside them (their
rows are outside the claim's indexes; the finish's trigger then probes for children). Alternating.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, scratch_db, spread

from fleetless import Queue
from fleetless.completer import Completer
from fleetless.drainer import DrainConfig, Drainer
from fleetless.job import Outcome


def none(n: int) -> list[dict[str, Any]]:
    return [{"kind": "noop", "payload": {}} for _ in range(n)]


def fan_out(n: int) -> list[dict[str, Any]]:
    return [{"kind": "noop", "payload": {}, "name": "root"}] + [
        {"kind": "noop", "payload": {}, "after": ["root"]} for _ in range(n - 1)]


def fan_in(n: int) -> list[dict[str, Any]]:
    return [{"kind": "noop", "payload": {}, "name": str(i)} for i in range(n - 1)] + [
        {"kind": "noop", "payload": {}, "after": [str(i) for i in range(n - 1)]}]


def layers(n: int, depth: int = 20, fan: int = 3) -> list[dict[str, Any]]:
    rng = random.Random(29)
    width = n // depth
    items: list[dict[str, Any]] = []
    for layer in range(depth):
        for i in range(width):
            item: dict[str, Any] = {"kind": "noop", "payload": {}, "name": f"{layer}.{i}"}
            if layer:
                item["after"] = [f"{layer - 1}.{p}" for p in rng.sample(range(width), fan)]
            items.append(item)
    return items


def chain(n: int) -> list[dict[str, Any]]:
    return [{"kind": "noop", "payload": {}, "name": str(i), **({"after": [str(i - 1)]} if i else {})}
            for i in range(n)]


def _empty(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("TRUNCATE fleetless.jobs, fleetless.job_attempts, fleetless.job_dependencies,"
                  " fleetless.job_counts")
        c.execute("VACUUM ANALYZE fleetless.jobs")


def _drain_rate(q: Queue, dsn: str, items: list[dict[str, Any]], config: DrainConfig) -> tuple[float, float]:
    """(enqueue seconds, drained jobs/s) of one graph."""
    _empty(dsn)
    t = time.perf_counter()
    q.enqueue_many(items)
    enqueued = time.perf_counter() - t
    t = time.perf_counter()
    summary = Drainer(q, config).run()
    took = time.perf_counter() - t
    with psycopg.connect(dsn) as c:
        row = c.execute("SELECT count(*) FILTER (WHERE status = 'done'), count(*) FROM fleetless.jobs").fetchone()
    assert row is not None and row[0] == row[1] == len(items), (row, summary)
    return enqueued, len(items) / took


def _claim_rate(q: Queue, rounds: int) -> float:
    completer = Completer(q, flush_size=100_000)
    claimed = 0
    t = time.perf_counter()
    for _ in range(rounds):
        jobs = q.claim(1000, default_timeout=60, ttl=60, lease_grace=60)
        claimed += len(jobs)
        for job in jobs:
            completer.add(job, Outcome("release"))
        completer.flush()
    return claimed / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=10_000)
    ap.add_argument("--chain", type=int, default=10_000)
    ap.add_argument("--sandbox", default="process")
    ap.add_argument("--per-sandbox", type=int, default=1000)
    ap.add_argument("--pending", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--skip-drains", action="store_true")
    ap.add_argument("--skip-claims", action="store_true")
    a = ap.parse_args()
    cases: dict[str, Callable[[], list[dict[str, Any]]]] = {
        "none": lambda: none(a.jobs), "fan-out": lambda: fan_out(a.jobs), "fan-in": lambda: fan_in(a.jobs),
        "layers": lambda: layers(a.jobs), f"chain of {a.chain:,}": lambda: chain(a.chain)}
    with scratch_db() as dsn, tempfile.TemporaryDirectory() as tmp:
        q = Queue(dsn)
        q.init()
        handlers = Path(tmp) / "handlers"
        handlers.mkdir()
        (handlers / "noop.py").write_text("def handle(payload):\n    return None\n")
        config = DrainConfig(handlers_dir=handlers, sandbox=a.sandbox, per_sandbox=a.per_sandbox, concurrency=2,
                             timeout=600)
        if not a.skip_drains:
            rates: dict[str, list[float]] = {name: [] for name in cases}
            enqueues: dict[str, list[float]] = {name: [] for name in cases}
            for rep in range(a.reps):
                for name, make in cases.items():
                    seconds, rate = _drain_rate(q, dsn, make(), config)
                    rates[name].append(rate)
                    enqueues[name].append(seconds)
                    print(f"  rep {rep + 1} {name:18} {rate:8.0f} jobs/s (enqueue {seconds:.2f} s)", flush=True)
            base = median(rates["none"])
            print(f"\ndrain, --per-sandbox {a.per_sandbox} --concurrency 2, {a.sandbox} tier, {a.reps} reps")
            for name, values in rates.items():
                print(f"{name:18} {median(values):8.0f} jobs/s [spread {spread(values)}]  ratio"
                      f" {median(values) / base:.2f}  (enqueue_many {median(enqueues[name]):.2f} s)")
        if not a.skip_claims:
            _empty(dsn)
            with psycopg.connect(dsn, autocommit=True) as c:
                c.execute("INSERT INTO fleetless.jobs (kind, payload) SELECT 'noop', '{}' FROM generate_series(1, %s)",
                          (a.pending,))
                c.execute("VACUUM ANALYZE fleetless.jobs")
            claims: dict[str, list[float]] = {"no workflow": [], "beside 100,000 waiting": []}
            for _ in range(a.reps):
                with psycopg.connect(dsn, autocommit=True) as c:
                    c.execute("DELETE FROM fleetless.jobs WHERE status <> 'pending' OR kind <> 'noop'")
                    c.execute("TRUNCATE fleetless.job_dependencies")
                claims["no workflow"].append(_claim_rate(q, a.rounds))
                root = q.enqueue("root", {}, delay=86400)
                q.enqueue_many({"kind": "child", "payload": {}, "after": [root]} for _ in range(100_000))
                with psycopg.connect(dsn, autocommit=True) as c:
                    c.execute("ANALYZE fleetless.jobs")
                claims["beside 100,000 waiting"].append(_claim_rate(q, a.rounds))
            base = median(claims["no workflow"])
            print(f"\nclaim(1000) + give back, {a.pending:,} pending, {a.rounds} rounds, {a.reps} reps")
            for name, values in claims.items():
                print(f"{name:24} {median(values):8.0f} jobs/s [spread {spread(values)}]  ratio"
                      f" {median(values) / base:.2f}")
        q.close()


if __name__ == "__main__":
    main()
