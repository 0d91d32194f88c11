"""Retention passes beside old jobs of workflow graphs still held (issue 29 audit).

Data (built by the caller, the audit's shape, ``bench/retention_graphs_setup.sql``): 1M pending
jobs; 4M finished in no graph over the last 10 days; 1M done in 100 graphs of 10,000, each held
by one job still waiting, older than every other finished row. Times, with the fleetless on
``PYTHONPATH`` (run it once with the old tree, then ``fleetless init`` and once with the new):
three single retention passes (``prune_batch``, 500 rows, the drain's default ages; committed)
and one retention run (the pruner's 20 passes of 500). Usage:
``python bench/bench_retention_graphs.py DSN LABEL``."""

from __future__ import annotations

import sys
import time

from fleetless import Queue
from fleetless.maintenance import pruner, retention


def main() -> None:
    dsn, label = sys.argv[1], sys.argv[2]
    q = Queue(dsn)
    ages = {"done": 7 * 86400.0, "cancelled": 7 * 86400.0, "dead": 30 * 86400.0}
    for _ in range(3):
        t = time.monotonic()
        n = q.prune_batch(ages, limit=500)
        print(f"{label}: pass deleted {n} in {(time.monotonic() - t) * 1000:.1f} ms", flush=True)
    t, c = time.monotonic(), time.process_time()
    result = pruner.run_once(q, retention.Settings(every=None).pruner_settings())
    print(f"{label}: run of 20 x 500 deleted {result.deleted} (more {result.more}) in"
          f" {time.monotonic() - t:.2f} s", flush=True)
    q.close()


if __name__ == "__main__":
    main()
