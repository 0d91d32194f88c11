"""(1) Enqueue: ``Queue.enqueue`` one per transaction and ``Queue.enqueue_many`` against a raw
single INSERT and a raw COPY into an identical table (``LIKE fleetless.jobs INCLUDING ALL``: same
columns, defaults, constraints and indexes), all in one process, interleaved."""

from __future__ import annotations

import time

import psycopg

from fleetless import Queue

from . import Context, Section, fmt, median, scratch_db, spread

RAW_TABLE = "DROP TABLE IF EXISTS raw_jobs; CREATE TABLE raw_jobs (LIKE fleetless.jobs INCLUDING ALL)"


RAW_INSERT = "INSERT INTO raw_jobs (kind, payload) VALUES (%s, %s) RETURNING id"
#: Single enqueues alternate between raw and fleetless in chunks this size, so that the machine's
#: noise (other work starting and stopping) falls on both alike.
CHUNK = 50


def _singles(dsn: str, q: Queue, n: int) -> tuple[float, float]:
    """Jobs/s of a raw one-row INSERT (psycopg's defaults: prepared from its fifth run) and of
    ``Queue.enqueue``, each one per transaction, interleaved in chunks."""
    spent = [0.0, 0.0]
    with psycopg.connect(dsn, autocommit=True) as c:
        done = 0
        while done < n:
            t = time.perf_counter()
            for i in range(done, done + CHUNK):
                c.execute(RAW_INSERT, ("noop", f'{{"i": {i}}}'))
            spent[0] += time.perf_counter() - t
            t = time.perf_counter()
            for i in range(done, done + CHUNK):
                q.enqueue("noop", {"i": i})
            spent[1] += time.perf_counter() - t
            done += CHUNK
    return done / spent[0], done / spent[1]


def _raw_copy(dsn: str, n: int) -> None:
    with psycopg.connect(dsn) as c, c.cursor() as cur, cur.copy("COPY raw_jobs (kind, payload) FROM STDIN") as cp:
        for i in range(n):
            cp.write_row(("noop", f'{{"i": {i}}}'))


def run(ctx: Context) -> Section:
    n_one, n_many = ctx.size(3000, 300), ctx.size(30000, 3000)
    cases = {"raw INSERT, one per transaction": [], "Queue.enqueue, one per transaction": [],
             "raw COPY": [], "Queue.enqueue_many (COPY)": []}
    with scratch_db() as dsn:
        q = Queue(dsn)
        q.init()
        for _ in range(ctx.reps):
            for label in cases:
                if label.startswith("Queue.enqueue,"):
                    continue  # measured with the raw INSERT, interleaved
                with psycopg.connect(dsn, autocommit=True) as c:
                    c.execute("TRUNCATE fleetless.jobs, fleetless.job_attempts CASCADE")
                    c.execute(RAW_TABLE)
                    c.execute("VACUUM ANALYZE")
                if label.startswith("raw INSERT"):
                    raw, ours = _singles(dsn, q, n_one)
                    cases[label].append(raw)
                    cases["Queue.enqueue, one per transaction"].append(ours)
                    continue
                t = time.perf_counter()
                if label == "raw COPY":
                    _raw_copy(dsn, n_many)
                else:
                    q.enqueue_many(("noop", {"i": i}) for i in range(n_many))
                cases[label].append(n_many / (time.perf_counter() - t))
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
    s.notes.append(f"{n_one:,} single enqueues and {n_many:,} batched ones per repetition; the single ones "
                   f"alternate between raw and fleetless every {CHUNK} jobs. Both single INSERTs are prepared "
                   "(psycopg's default for the raw one; fleetless prepares its enqueue on its own connection when "
                   "no pooler is in between). fleetless's single enqueue validates the job and NOTIFYs watchers in "
                   "the same statement; the raw INSERT does neither. enqueue_many validates each job, reserves "
                   "ids, COPYs 4 columns per default job (9 for one with options of its own) and NOTIFYs once.")
    return s
