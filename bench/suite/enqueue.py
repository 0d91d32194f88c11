"""(1) Enqueue: ``Queue.enqueue`` one per transaction and ``Queue.enqueue_many`` against a raw
single INSERT and a raw COPY into an identical table (``LIKE fleetless.jobs INCLUDING ALL``: same
columns, defaults, constraints and indexes), all in one process, interleaved."""

from __future__ import annotations

import psycopg

from fleetless import Queue

from . import Context, Section, fmt, median, scratch_db, spread

RAW_TABLE = "DROP TABLE IF EXISTS raw_jobs; CREATE TABLE raw_jobs (LIKE fleetless.jobs INCLUDING ALL)"


def _raw_insert(dsn: str, n: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        for i in range(n):
            c.execute("INSERT INTO raw_jobs (kind, payload) VALUES (%s, %s) RETURNING id", ("noop", f'{{"i": {i}}}'))


def _raw_copy(dsn: str, n: int) -> None:
    with psycopg.connect(dsn) as c, c.cursor() as cur, cur.copy("COPY raw_jobs (kind, payload) FROM STDIN") as cp:
        for i in range(n):
            cp.write_row(("noop", f'{{"i": {i}}}'))


def run(ctx: Context) -> Section:
    import time

    n_one, n_many = ctx.size(3000, 300), ctx.size(30000, 3000)
    cases = {"raw INSERT, one per transaction": [], "Queue.enqueue, one per transaction": [],
             "raw COPY": [], "Queue.enqueue_many (COPY)": []}
    with scratch_db() as dsn:
        q = Queue(dsn)
        q.init()
        for _ in range(ctx.reps):
            for label in cases:
                with psycopg.connect(dsn, autocommit=True) as c:
                    c.execute("TRUNCATE fleetless.jobs CASCADE")
                    c.execute(RAW_TABLE)
                    c.execute("VACUUM ANALYZE")
                many = "COPY" in label
                n = n_many if many else n_one
                t = time.perf_counter()
                if label.startswith("raw INSERT"):
                    _raw_insert(dsn, n)
                elif label == "raw COPY":
                    _raw_copy(dsn, n)
                elif many:
                    q.enqueue_many(("noop", {"i": i}) for i in range(n))
                else:
                    for i in range(n):
                        q.enqueue("noop", {"i": i})
                cases[label].append(n / (time.perf_counter() - t))
        q.close()
    s = Section("enqueue", "(1) Enqueue against raw INSERT and raw COPY", "bench/run.py --only enqueue", ctx,
                ["what", "jobs/s", "fleetless / raw", "target"], raw=cases)
    one = median(cases["Queue.enqueue, one per transaction"]) / median(cases["raw INSERT, one per transaction"])
    many = median(cases["Queue.enqueue_many (COPY)"]) / median(cases["raw COPY"])
    for label, values in cases.items():
        ratio = target = ""
        if label.startswith("Queue.enqueue,"):
            ratio, target = f"**{one:.2f}**", ">= 0.8"
        elif label.startswith("Queue.enqueue_many"):
            ratio, target = f"**{many:.2f}**", ">= 0.5"
        s.rows.append([label, f"{fmt(median(values))} [{spread(values)}]", ratio, target])
        s.add_bar(label, values)
    s.notes.append(f"{n_one:,} single enqueues and {n_many:,} batched ones per repetition. fleetless's single "
                   "enqueue validates the job and NOTIFYs watchers in the same statement; the raw INSERT does "
                   "neither. enqueue_many reserves ids, COPYs 8 columns and NOTIFYs once.")
    return s
