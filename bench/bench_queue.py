"""Queue throughput against the raw-SQL ceiling, measured in the same run.

    python bench/bench_queue.py [--jobs 10000] [--reps 3]

Per repetition (reps are the outer loop, so machine noise spreads over all cases):
  enqueue: Queue.enqueue one job per transaction vs a raw INSERT per transaction;
           Queue.enqueue_many (COPY) vs a raw COPY of the seed's columns.
  claim:   Queue.claim(N) + Queue.complete per job (what a drainer does) vs the raw claim of the
           seed + one `UPDATE ... status='done' WHERE id = ANY(ids)` per batch, N in 1, 20, 100.
Prints medians (jobs/s) and fleetless/raw ratios. Timings are only meaningful as these ratios.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, scratch_db, spread, timed

from fleetless import Queue

RAW_DDL = """
DROP TABLE IF EXISTS raw_jobs;
CREATE TABLE raw_jobs (
  id bigserial PRIMARY KEY, kind text NOT NULL, payload jsonb NOT NULL,
  status text NOT NULL DEFAULT 'pending', attempts int NOT NULL DEFAULT 0,
  max_attempts int NOT NULL DEFAULT 3, run_after timestamptz NOT NULL DEFAULT now(),
  locked_at timestamptz, last_error text, created_at timestamptz NOT NULL DEFAULT now());
CREATE INDEX raw_jobs_claim_idx ON raw_jobs (run_after) WHERE status = 'pending';
"""
RAW_CLAIM = """
UPDATE raw_jobs SET status = 'running', locked_at = now(), attempts = attempts + 1
WHERE id IN (SELECT id FROM raw_jobs WHERE status = 'pending' AND run_after <= now()
             ORDER BY run_after FOR UPDATE SKIP LOCKED LIMIT %s)
RETURNING id, kind, payload, attempts, max_attempts"""


def reset(dsn: str, raw: bool) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        if raw:
            c.execute(RAW_DDL)
        else:
            c.execute("TRUNCATE fleetless.jobs, fleetless.job_attempts CASCADE")


def raw_insert_one(dsn: str, n: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        for i in range(n):
            c.execute("INSERT INTO raw_jobs (kind, payload) VALUES (%s, %s)", ("noop", f'{{"i": {i}}}'))


def raw_copy(dsn: str, n: int) -> None:
    with psycopg.connect(dsn) as c, c.cursor() as cur, cur.copy("COPY raw_jobs (kind, payload) FROM STDIN") as cp:
        for i in range(n):
            cp.write_row(("noop", f'{{"i": {i}}}'))


def raw_drain(dsn: str, batch: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        while True:
            with c.transaction():
                ids = [r[0] for r in c.execute(RAW_CLAIM, (batch,)).fetchall()]
            if not ids:
                return
            with c.transaction():
                c.execute("UPDATE raw_jobs SET status = 'done' WHERE id = ANY(%s)", (ids,))


def fl_drain(q: Queue, batch: int) -> None:
    while jobs := q.claim(batch):
        for job in jobs:
            q.complete(job, "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=10_000)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    n = a.jobs
    results: dict[str, list[float]] = {}

    def record(name: str, seconds: float) -> None:
        results.setdefault(name, []).append(n / seconds)

    with scratch_db() as dsn:
        q = Queue(dsn)
        q.init()
        for rep in range(a.reps):
            reset(dsn, raw=True)
            record("raw INSERT, one per txn", timed(lambda: raw_insert_one(dsn, n)))
            reset(dsn, raw=False)
            record("Queue.enqueue, one per txn", timed(lambda: [q.enqueue("noop", {"i": i}) for i in range(n)]))
            reset(dsn, raw=True)
            record("raw COPY", timed(lambda: raw_copy(dsn, n)))
            reset(dsn, raw=False)
            record("Queue.enqueue_many (COPY)",
                   timed(lambda: q.enqueue_many(("noop", {"i": i}) for i in range(n))))
            for batch in (1, 20, 100):
                reset(dsn, raw=True)
                raw_copy(dsn, n)
                record(f"raw claim+complete N={batch}", timed(lambda b=batch: raw_drain(dsn, b)))
                reset(dsn, raw=False)
                q.enqueue_many(("noop", {"i": i}) for i in range(n))
                with psycopg.connect(dsn, autocommit=True) as c:
                    c.execute("ANALYZE fleetless.jobs")
                record(f"Queue claim+complete N={batch}", timed(lambda b=batch: fl_drain(q, b)))
            print(f"rep {rep + 1}/{a.reps} done", file=sys.stderr, flush=True)
        q.close()

    print(f"\n{n} no-op jobs, {a.reps} reps, median jobs/s [spread]")
    for name, values in results.items():
        print(f"  {name:34s} {median(values):>10,.0f}  [{spread(values)}]")
    pairs = [("Queue.enqueue, one per txn", "raw INSERT, one per txn"),
             ("Queue.enqueue_many (COPY)", "raw COPY")] + [
        (f"Queue claim+complete N={b}", f"raw claim+complete N={b}") for b in (1, 20, 100)]
    print("\nfleetless / raw ceiling (same run):")
    for ours, raw in pairs:
        print(f"  {ours:34s} {median(results[ours]) / median(results[raw]):.2f}")


if __name__ == "__main__":
    main()
