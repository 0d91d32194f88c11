"""What the queue gate (paused and concurrency-limited queues, queue_settings) costs the plain claim.

    python bench/bench_queue_gate.py [--reps 5] [--rounds 300] [--pending 100000]

Same run, same database, same connection, cases alternating within each repetition: the claim
statement as it runs today (with the gate: one InitPlan over queue_settings), and the same text
with the gate's lines taken out (the claim before queue_settings), each run in a transaction
that is rolled back, so the pending set never changes (and VACUUMed before each case's rounds,
so neither reads the other's dead row versions). Run with queue_settings empty (no queue
paused or limited), then with one other queue paused (the gate then has one name to leave out).
Prints statements/s, medians, spreads and each case's ratio to the claim without the gate, for
claims of 1 and of 20 jobs, over all queues and over one named queue.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, scratch_db, spread

from fleetless import Queue

GATE = re.compile(r"AND \(CASE WHEN [a-z.]+ = ANY\(ARRAY\(SELECT queue FROM [^)]*queue_settings.*?END\) IS NOT NULL",
                  re.S)


def _rate(conn: psycopg.Connection[Any], text: str, params: dict[str, Any], rounds: int) -> float:
    t = time.perf_counter()
    for _ in range(rounds):
        with conn.transaction(force_rollback=True):
            conn.execute(text, params).fetchall()
    return rounds / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--pending", type=int, default=100_000)
    a = ap.parse_args()
    with scratch_db() as dsn:
        q = Queue(dsn)
        q.init()
        gated = q.bind("claim", {})[0]
        cases = {"without the gate": GATE.sub("", gated), "with the gate": gated}
        assert "queue_settings" not in cases["without the gate"]
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute("INSERT INTO fleetless.jobs (kind, payload, queue)"
                      " SELECT 'k' || (i %% 5), '{}', CASE WHEN i %% 2 = 0 THEN 'a' ELSE 'b' END"
                      " FROM generate_series(1, %s) i", (a.pending,))
            c.execute("VACUUM ANALYZE fleetless.jobs")
        with psycopg.connect(dsn, autocommit=True) as conn:
            for settings in ("no queue paused or limited", "queue 'other' paused"):
                if settings != "no queue paused or limited":
                    q.pause_queue("other")
                for queues in (None, ["a"]):
                    for n in (1, 20):
                        params = {"n": n, "queues": queues, "skip_kinds": None, "token": uuid.uuid4(),
                                  "default_timeout": 600.0, "ttl": 900.0, "grace": 60.0, "claimed_by": "bench:1",
                                  "tier": "process", "kinds": None}
                        results: dict[str, list[float]] = {name: [] for name in cases}
                        for _ in range(a.reps):
                            for name, text in cases.items():
                                conn.execute("VACUUM fleetless.jobs")  # the rolled-back rows' dead versions
                                results[name].append(_rate(conn, text, params, a.rounds))
                        base = median(results["without the gate"])
                        for name, values in results.items():
                            print(f"{settings:27} queues={queues!s:6} N={n:2}  {name:17} {median(values):7.0f}/s"
                                  f"  (spread {spread(values)})  ratio {median(values) / base:.2f}")
        q.close()


if __name__ == "__main__":
    main()
