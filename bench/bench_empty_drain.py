"""What the maintenance units cost a drain that finds nothing to do (issue 9's goal: an empty-queue
drain stays about as cheap as before them).

    python bench/bench_empty_drain.py [--reps 30] [--schedules 3]

Same run, same database, alternating: a `Drainer.run()` on an empty queue with every unit
(reaper, sweeper, retention, scheduler) against one whose maintenance pass is skipped. With
``--finished`` rows already past retention that the first drains delete in bounded batches, and
``--schedules`` periodic schedules that are not due. Prints medians in milliseconds and the ratio.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, scratch_db, spread

from fleetless import Queue
from fleetless.drainer import DrainConfig, Drainer
from fleetless.periodic import Schedule


class _NoMaintenance(Drainer):
    def _maintenance(self) -> None:
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--schedules", type=int, default=3)
    a = ap.parse_args()
    with scratch_db() as dsn, tempfile.TemporaryDirectory(prefix="fleetless-bench-") as tmp:
        q = Queue(dsn)
        q.init()
        for i in range(a.schedules):
            q.add_schedule(Schedule(name=f"yearly-{i}", cron="0 0 1 1 *", kind="k", payload={}))
        with psycopg.connect(dsn, autocommit=True) as c:  # a finished backlog retention walks past
            c.execute("INSERT INTO fleetless.jobs (kind, payload, status, finished_at)"
                      " SELECT 'k', '{}', 'done', now() - interval '1 day' FROM generate_series(1, 10000)")
        handlers = Path(tmp) / "handlers"
        handlers.mkdir()
        config = DrainConfig(handlers_dir=handlers, concurrency=2, sandbox="process")
        results: dict[str, list[float]] = {"with units": [], "without": []}
        for _ in range(a.reps):
            for name, cls in (("with units", Drainer), ("without", _NoMaintenance)):
                t = time.perf_counter()
                cls(q, config).run()
                results[name].append(time.perf_counter() - t)
        for name, values in results.items():
            print(f"{name:12} median {1000 * median(values):7.2f} ms  (spread {spread(values)})")
        print(f"ratio with/without: {median(results['with units']) / median(results['without']):.2f}")
        q.close()


if __name__ == "__main__":
    main()
