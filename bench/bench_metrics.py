"""What a /metrics scrape and a dashboard overview cost on a big table.

    python bench/bench_metrics.py [--rows 1000000] [--reps 5]

Fills a scratch database with ``--rows`` jobs (finished over the last 30 days, 20 kinds, 4
queues; 0.1 % pending or running, 2 % dead) and one attempt-history row per finished job,
analyses it, times the first scrapes (which fold the history into the running totals,
``FOLD_BATCH`` attempts each) until the totals have caught up, then times, per repetition:
  metrics:  fleetless.metrics.render (every gauge, counter and the duration histogram)
  overview: Insights.overview (the dashboard's first page)
  jobs:     Insights.jobs(status="dead") and its 20th page (keyset paging)
  count:    a bare `SELECT count(*)` of the table, the floor any full count stands on
Prints medians in milliseconds and each as a ratio to the bare count, measured in the same run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, scratch_db, spread, timed

from fleetless import Queue
from fleetless.insights import Insights
from fleetless.metrics import render

FILL = """
INSERT INTO fleetless.jobs (kind, payload, status, attempts, max_attempts, run_after, created_at, queue,
                            started_at, finished_at, last_error)
SELECT 'kind-' || (i %% 20), '{"n": 1}',
       CASE WHEN i %% 1000 = 0 THEN 'pending' WHEN i %% 1000 = 1 THEN 'running'
            WHEN i %% 50 = 2 THEN 'dead' ELSE 'done' END,
       1, 3, t, t, 'q' || (i %% 4),
       CASE WHEN i %% 1000 = 0 THEN NULL ELSE t END,
       CASE WHEN i %% 1000 IN (0, 1) THEN NULL ELSE t + make_interval(secs => (i %% 600) / 10.0) END,
       CASE WHEN i %% 50 = 2 THEN 'exit code 1: ValueError: bad input' END
FROM (SELECT i, now() - make_interval(secs => (i::float8 / %(rows)s) * 30 * 86400) AS t
      FROM generate_series(1, %(rows)s) AS i) AS g
"""

# One attempt per finished job, as the drainers' finish statements write them.
ATTEMPTS = """
INSERT INTO fleetless.job_attempts (job_id, attempt, outcome, host, pid, tier, started_at, finished_at,
                                    exit_code, duration_seconds)
SELECT id, 1, CASE status WHEN 'done' THEN 'done' ELSE 'dead' END, 'host', 1, 'process', started_at,
       finished_at, CASE status WHEN 'done' THEN 0 ELSE 1 END, extract(epoch FROM finished_at - started_at)
FROM fleetless.jobs WHERE status IN ('done', 'dead') ORDER BY finished_at
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    with scratch_db() as dsn:
        queue = Queue(dsn)
        queue.init()
        t = time.perf_counter()
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute(FILL, {"rows": args.rows})
            c.execute(ATTEMPTS)
            c.execute("VACUUM ANALYZE fleetless.jobs")
            size = c.execute("SELECT pg_size_pretty(pg_total_relation_size('fleetless.jobs'))").fetchone()
        print(f"filled {args.rows:,} rows in {time.perf_counter() - t:.1f} s; "
              f"table with indexes: {size[0] if size else '?'}")
        insights = Insights(queue)
        raw = psycopg.connect(dsn, autocommit=True)
        page20 = insights.jobs(status="dead", limit=50)
        for _ in range(19):
            page20 = insights.jobs(status="dead", limit=50, before=page20[-1]["id"])
        before = page20[0]["id"] + 1
        cases = {
            "metrics": lambda: render(insights),
            "overview": lambda: insights.overview(),
            "jobs dead p1": lambda: insights.jobs(status="dead", limit=50),
            "jobs dead p20": lambda: insights.jobs(status="dead", limit=50, before=before),
            "count(*)": lambda: raw.execute("SELECT count(*) FROM fleetless.jobs").fetchone(),
        }
        # The first scrapes fold the history into the running totals, FOLD_BATCH attempts each.
        catch_up: list[float] = []
        while True:
            mark = queue.query("attempt_totals_mark")[0]["last_id"]
            catch_up.append(timed(lambda: render(insights)))
            if queue.query("attempt_totals_mark")[0]["last_id"] == mark:
                break
        print(f"catching up on the history: {len(catch_up)} scrapes, "
              + ", ".join(f"{x * 1000:.0f}" for x in catch_up) + " ms")
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.reps):
            for name, fn in cases.items():
                times[name].append(timed(fn))
        floor = median(times["count(*)"])
        print(f"{'case':<14}{'median ms':>10}{'spread':>8}{'x count(*)':>12}")
        for name, values in times.items():
            print(f"{name:<14}{median(values) * 1000:>10.0f}{spread(values):>8}{median(values) / floor:>12.2f}")
        raw.close()
        queue.close()


if __name__ == "__main__":
    main()
