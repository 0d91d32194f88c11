"""A measured sketch for docs/scaling.md: keeping the hot jobs table small at high volume.

    python bench/bench_partition.py [--rows 1000000] [--batch 5000]

On a scratch database (same server, same run), with ``--rows`` finished jobs:
  1. retention as fleetless does it: DELETE of finished rows in batches of ``--batch``;
  2. the sketch: finished rows moved in batches (one DELETE … RETURNING feeding an INSERT) into a
     history table partitioned by day, then a day dropped at once (DROP TABLE of a partition);
  3. claim cost against the size of the hot table: claim 100 + finish_many, 20,000 jobs, with the
     pending jobs alone in the table, then beside ``--rows`` finished rows (vacuumed), then beside
     the same rows' dead versions right after a DELETE (before vacuum).
Prints rows/s and jobs/s; only the ratios within one run mean anything on a shared machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import scratch_db

from fleetless import Queue
from fleetless.job import Outcome

FILL = """
INSERT INTO fleetless.jobs (kind, payload, status, attempts, run_after, created_at, finished_at, result)
SELECT 'noop', '{}', 'done', 1, ts, ts, ts + interval '1 second', 'ok'
FROM (SELECT now() - interval '3 days' + (g * interval '1 second') * (2 * 86400.0 / %(n)s) AS ts
      FROM generate_series(1, %(n)s) g) s
"""
HISTORY = """
CREATE TABLE fleetless.job_history (LIKE fleetless.jobs) PARTITION BY RANGE (finished_at);
"""


def fill(conn: psycopg.Connection[object], n: int) -> None:
    conn.execute(FILL, {"n": n})
    conn.execute("VACUUM ANALYZE fleetless.jobs")


def delete_batches(conn: psycopg.Connection[object], batch: int) -> tuple[int, float]:
    t, total = time.perf_counter(), 0
    while True:
        cur = conn.execute(  # with the jobs' attempt history, as prune_batch does
            "WITH gone AS (DELETE FROM fleetless.jobs WHERE id IN (SELECT id FROM fleetless.jobs WHERE status = 'done'"
            " AND finished_at < now() LIMIT %s) RETURNING id), history AS (DELETE FROM fleetless.job_attempts a"
            " USING gone g WHERE a.job_id = g.id) SELECT id FROM gone", (batch,))
        total += cur.rowcount
        if cur.rowcount < batch:
            return total, time.perf_counter() - t


def move_batches(conn: psycopg.Connection[object], batch: int) -> tuple[int, float]:
    t, total = time.perf_counter(), 0
    while True:
        cur = conn.execute(
            "WITH moved AS (DELETE FROM fleetless.jobs WHERE id IN (SELECT id FROM fleetless.jobs"
            " WHERE status = 'done' AND finished_at < now() LIMIT %s) RETURNING *)"
            " INSERT INTO fleetless.job_history SELECT * FROM moved", (batch,))
        total += cur.rowcount
        if cur.rowcount < batch:
            return total, time.perf_counter() - t


def claim_rate(dsn: str, jobs: int = 20_000) -> float:
    q = Queue(dsn)
    q.enqueue_many(("noop", {}) for _ in range(jobs))
    done = Outcome("done")
    t, n = time.perf_counter(), 0
    while True:
        batch = q.claim(100)
        if not batch:
            break
        q.finish_many([(j, done) for j in batch])
        n += len(batch)
    rate = n / (time.perf_counter() - t)
    q.close()
    with psycopg.connect(dsn, autocommit=True) as c:  # drop the measured jobs, keep the rest
        c.execute("DELETE FROM fleetless.job_attempts WHERE job_id IN (SELECT id FROM fleetless.jobs"
                  " WHERE status = 'done' AND finished_at > now() - interval '1 hour')")
        c.execute("DELETE FROM fleetless.jobs WHERE status = 'done' AND finished_at > now() - interval '1 hour'")
    return rate


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=5000)
    args = ap.parse_args()
    with scratch_db() as dsn:
        q = Queue(dsn)
        q.init()
        q.close()
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute("TRUNCATE fleetless.jobs, fleetless.job_attempts CASCADE")
            empty = claim_rate(dsn)
            fill(c, args.rows)
            beside = claim_rate(dsn)
            n, s = delete_batches(c, args.batch)
            print(f"1. retention: DELETE in batches of {args.batch}: {n:,} rows in {s:.1f} s = {n / s:,.0f} rows/s")
            dead = claim_rate(dsn)
            c.execute("VACUUM fleetless.jobs")
            fill(c, args.rows)
            c.execute(HISTORY)
            for day in range(-4, 2):
                c.execute(f"CREATE TABLE fleetless.job_history_d{day + 4} PARTITION OF fleetless.job_history"
                          f" FOR VALUES FROM (date_trunc('day', now()) + interval '{day} days')"
                          f" TO (date_trunc('day', now()) + interval '{day + 1} days')")
            n, s = move_batches(c, args.batch)
            print(f"2. sketch: move to the day-partitioned history in batches of {args.batch}: {n:,} rows in "
                  f"{s:.1f} s = {n / s:,.0f} rows/s")
            sizes = c.execute("SELECT relname, n_live_tup FROM pg_stat_user_tables WHERE relname LIKE"
                              " 'job_history_d%%' ORDER BY n_live_tup DESC LIMIT 1").fetchone()
            assert sizes is not None
            c.execute("ANALYZE fleetless.job_history")
            count = c.execute(f"SELECT count(*) FROM fleetless.{sizes[0]}").fetchone()
            t = time.perf_counter()
            c.execute(f"DROP TABLE fleetless.{sizes[0]}")
            drop = time.perf_counter() - t
            rows = count[0] if count else 0
            print(f"   retention of one day then: DROP TABLE of a partition of {rows:,} rows: {drop * 1000:.0f} ms")
        print(f"3. claim 100 + finish_many: {empty:,.0f} jobs/s with nothing else in the table; "
              f"{beside:,.0f} beside {args.rows:,} finished rows ({beside / empty:.2f}); "
              f"{dead:,.0f} right after deleting them, before vacuum ({dead / empty:.2f})")


if __name__ == "__main__":
    main()
