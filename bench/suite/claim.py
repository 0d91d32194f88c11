"""(5) Claim cost as the table grows: claim N=100 (and complete the batch, so the pending set
stays the same size) with 10k pending, with 1M pending, and with 5M finished rows beside 10k
pending. The same Queue.claim a drainer uses."""

from __future__ import annotations

import time

import psycopg

from fleetless import Queue
from fleetless.completer import Completer
from fleetless.job import Outcome

from . import Context, Section, fmt, median, scratch_db, spread

FILL = """
INSERT INTO fleetless.jobs (kind, payload, status, finished_at)
SELECT 'noop', '{}'::jsonb, %s, CASE WHEN %s = 'done' THEN now() END FROM generate_series(1, %s)"""


def _rate(q: Queue, rounds: int) -> float:
    completer = Completer(q, flush_size=100_000)
    t = time.perf_counter()
    for _ in range(rounds):
        jobs = q.claim(100, default_timeout=60, ttl=60, lease_grace=60)
        for job in jobs:
            completer.add(job, Outcome("release"))  # back to pending: the table keeps its shape
        completer.flush()
    return rounds * 100 / (time.perf_counter() - t)


def run(ctx: Context) -> Section:
    small, big, finished = 10_000, ctx.size(1_000_000, 100_000), ctx.size(5_000_000, 500_000)
    rounds = 20 if ctx.quick else 100
    setups = {f"{small:,} pending": (small, 0), f"{big:,} pending": (big, 0),
              f"{small:,} pending + {finished:,} done": (small, finished)}
    cases: dict[str, list[float]] = {k: [] for k in setups}
    with scratch_db() as dsn:
        q = Queue(dsn)
        q.init()
        for label, (pending, done) in setups.items():  # the fill is slow: reps inside each setup
            with psycopg.connect(dsn, autocommit=True) as c:
                c.execute("TRUNCATE fleetless.jobs, fleetless.job_attempts CASCADE")
                c.execute(FILL, ("pending", "pending", pending))
                if done:
                    c.execute(FILL, ("done", "done", done))
                c.execute("VACUUM ANALYZE fleetless.jobs")
            for _ in range(ctx.reps):
                cases[label].append(_rate(q, rounds))
        q.close()
    s = Section("claim", "(5) Claim cost as the table grows", "bench/run.py --only claim", ctx,
                ["table", "claims of 100 (+ release) jobs/s", "ratio to 10k pending", "target"], raw=cases)
    base = median(cases[next(iter(cases))])
    for i, (label, values) in enumerate(cases.items()):
        ratio = base / median(values)
        s.rows.append([label, f"{fmt(median(values))} [{spread(values)}]", f"**{ratio:.2f}**" if i else "1.00",
                       "<= 1.3" if i else ""])
        s.add_bar(label, values)
    s.notes.append(f"{rounds} claims of N = 100 per repetition; each batch is written back with one finish_many "
                   "(release), so the pending set keeps its size. Ratio = time per claim against 10k pending.")
    return s
