"""(7) Reads and claims at scale (issue 26): 1M pending jobs in one queue beside 5M finished ones
and their 5M attempt rows, and a queue with nothing due. Times the reads of ``fleetless metrics``
(over the history not folded yet, and folded) and ``status`` (also as a SELECT-only role), a
claim and ``next_due`` for the idle queue, a claim and ``next_due`` that skip every kind of the
backlog (a drain whose kinds are all rate- or concurrency-limited), a retention pass (alone, and
four drains' passes at once), against the goals; and what keeping the counts exact (migration
016's triggers) and the queue and kind indexes (018, 020) cost an enqueue, as a same-run ratio with
them removed."""

from __future__ import annotations

import threading
import time

import psycopg

from fleetless import Queue
from fleetless.attempt_totals import DURATION_BUCKETS, bucket_params
from fleetless.insights import Insights
from fleetless.maintenance import retention

from . import Context, Section, median, scratch_db, spread

PENDING = """
INSERT INTO fleetless.jobs (kind, payload, queue, run_after)
SELECT 'k' || (i %% 20), '{}', 'backlog', now() - make_interval(secs => (i %% 3600)::float8)
FROM generate_series(1, %(n)s) i"""
IDLE = """
INSERT INTO fleetless.jobs (kind, payload, queue, run_after)
SELECT 'k1', '{}', 'idle', now() + interval '1 hour' FROM generate_series(1, 10)"""
# Finished over the last ten days: done (80%), dead, cancelled; some done ones past retention's 7 days.
FINISHED = """
INSERT INTO fleetless.jobs (kind, payload, queue, status, attempts, started_at, finished_at)
SELECT 'k' || (i %% 20), '{}', 'backlog',
       CASE WHEN i %% 20 < 16 THEN 'done' WHEN i %% 20 < 19 THEN 'dead' ELSE 'cancelled' END, 1,
       now() - make_interval(secs => i * 864000.0 / %(n)s) - interval '1 second',
       now() - make_interval(secs => i * 864000.0 / %(n)s)
FROM generate_series(1, %(n)s) i"""
ATTEMPTS = """
INSERT INTO fleetless.job_attempts (job_id, attempt, outcome, started_at, finished_at, duration_seconds)
SELECT id, 1, CASE status WHEN 'cancelled' THEN 'cancelled' ELSE status END, started_at, finished_at,
       (id % 100) / 10.0
FROM fleetless.jobs WHERE status <> 'pending'"""


def _timed(fn: object) -> float:
    t = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - t


def _server_ms(dsn: str, q: Queue, name: str, params: dict[str, object]) -> float:
    """The server's planning plus execution time of one statement (EXPLAIN ANALYZE, rolled back) in
    a warm session: what the goal is about, without this loaded machine's client noise."""
    with psycopg.connect(dsn) as c:
        for _ in range(2):  # the second, in a session past its first statement's catalog loads
            rows = [r[0] for r in c.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + q._q[name], params)]
            c.rollback()
    top = rows[0][0]
    return float(top["Planning Time"] + top["Execution Time"]) / 1000


CLAIM = {"token": "00000000-0000-0000-0000-000000000001", "claimed_by": "bench:1", "tier": "process",
         "kinds": None, "default_timeout": 600.0, "ttl": 900.0, "grace": 60.0, "skip_kinds": None, "n": 10,
         "queues": ["idle"]}


SKIP = [f"k{i}" for i in range(20)]  # every kind of the backlog

# The same reads as fleetless ran them before issue 26's last fixes (390c217), for same-run ratios:
# the claim's choice of rows with skip_kinds (the claim index's order filtered by kind) and the
# attempt totals over a history not folded yet (the whole tail, its kinds by a join).
OLD_CLAIM_SKIPPING = """
SELECT id FROM fleetless.jobs
WHERE status = 'pending' AND run_after <= now()
  AND (%(queues)s::text[] IS NULL OR queue = ANY(%(queues)s::text[]))
  AND (%(skip_kinds)s::text[] IS NULL OR kind <> ALL(%(skip_kinds)s::text[]))
ORDER BY priority DESC, run_after
FOR UPDATE SKIP LOCKED
LIMIT %(n)s"""
OLD_TAIL = """
SELECT kind, outcome, bound, sum(n)::bigint AS n, sum(seconds)::float8 AS seconds
FROM (
  SELECT kind, outcome, bound, n, seconds FROM fleetless.attempt_totals
  UNION ALL
  SELECT COALESCE(j.kind, '(pruned)'), a.outcome,
         CASE WHEN a.duration_seconds IS NULL THEN -1
              ELSE COALESCE((%(bounds)s::float8[])[cardinality(%(bounds)s::float8[]) + 1
                            - width_bucket(-a.duration_seconds, %(negated)s::float8[])], 'Infinity') END,
         1, COALESCE(a.duration_seconds, 0)
  FROM fleetless.job_attempts a
  LEFT JOIN fleetless.jobs j ON j.id = a.job_id
  WHERE a.id > %(after)s
) AS t
GROUP BY kind, outcome, bound"""


def _server_ms_sql(dsn: str, text: str, params: dict[str, object]) -> float:
    """As _server_ms, for a statement given as text."""
    with psycopg.connect(dsn) as c:
        for _ in range(2):
            rows = [r[0] for r in c.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + text, params)]
            c.rollback()
    top = rows[0][0]
    return float(top["Planning Time"] + top["Execution Time"]) / 1000


def _reader(dsn: str) -> str:
    """The DSN of a role granted only USAGE on the schema and SELECT on its tables."""
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("DROP ROLE IF EXISTS fleetless_bench_reader")
        c.execute("CREATE ROLE fleetless_bench_reader LOGIN")
        c.execute("GRANT USAGE ON SCHEMA fleetless TO fleetless_bench_reader")
        c.execute("GRANT SELECT ON ALL TABLES IN SCHEMA fleetless TO fleetless_bench_reader")
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    info["user"] = "fleetless_bench_reader"
    return psycopg.conninfo.make_conninfo(**info)  # type: ignore[arg-type]


def _drop_reader(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("DROP OWNED BY fleetless_bench_reader")
        c.execute("DROP ROLE IF EXISTS fleetless_bench_reader")


def _passes_at_once(dsn: str, n: int) -> float:
    """n drains' retention passes started together, each on its own connection: the slowest."""
    queues = [Queue(dsn) for _ in range(n)]
    for q in queues:
        q.query("attempt_totals_mark")  # connected
    times: list[float] = []
    start = threading.Barrier(n)

    def one(q: Queue) -> None:
        start.wait()
        times.append(_timed(lambda: retention.run_once(q)))

    threads = [threading.Thread(target=one, args=(q,)) for q in queues]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for q in queues:
        q.close()
    return max(times)


def _enqueue_costs(dsn: str, reps: int, single: int, many: int) -> dict[str, list[float]]:
    """Seconds for ``single`` enqueues and one enqueue_many of ``many``, with the counts' triggers
    and the queue indexes (as shipped) and without them, interleaved."""
    q = Queue(dsn)
    out: dict[str, list[float]] = {k: [] for k in ("enqueue, as shipped", "enqueue, without",
                                                   "enqueue_many, as shipped", "enqueue_many, without")}
    with psycopg.connect(dsn, autocommit=True) as c:
        for _ in range(reps):
            for shipped in (True, False):
                label = "as shipped" if shipped else "without"
                if shipped:
                    c.execute("ALTER TABLE fleetless.jobs ENABLE TRIGGER USER")
                    c.execute("CREATE INDEX IF NOT EXISTS jobs_queue_claim_idx ON fleetless.jobs"
                              " (queue, priority DESC, run_after) WHERE status = 'pending'")
                    c.execute("CREATE INDEX IF NOT EXISTS jobs_queue_due_idx ON fleetless.jobs"
                              " (queue, run_after) WHERE status = 'pending'")
                    c.execute("CREATE INDEX IF NOT EXISTS jobs_kind_claim_idx ON fleetless.jobs"
                              " (kind, queue, priority DESC, run_after) WHERE status = 'pending'")
                else:
                    c.execute("ALTER TABLE fleetless.jobs DISABLE TRIGGER USER")
                    c.execute("DROP INDEX IF EXISTS fleetless.jobs_queue_claim_idx")
                    c.execute("DROP INDEX IF EXISTS fleetless.jobs_queue_due_idx")
                    c.execute("DROP INDEX IF EXISTS fleetless.jobs_kind_claim_idx")
                c.execute("TRUNCATE fleetless.jobs CASCADE")
                q.close()
                q.enqueue("warm", {})
                out[f"enqueue, {label}"].append(_timed(lambda: [q.enqueue("k", {"i": i}) for i in range(single)]))
                out[f"enqueue_many, {label}"].append(_timed(lambda: q.enqueue_many([("k", {"i": i})
                                                                                     for i in range(many)])))
        c.execute("ALTER TABLE fleetless.jobs ENABLE TRIGGER USER")
        c.execute("TRUNCATE fleetless.jobs CASCADE")
    q.close()
    return out


def run(ctx: Context) -> Section:
    pending, finished = ctx.size(1_000_000, 10_000), ctx.size(5_000_000, 50_000)
    reps = ctx.reps
    section = Section(
        name="scale", title="(7) Reads and claims at scale (issue 26)",
        command=f"bench/run.py --only scale  # {pending:,} pending + {finished:,} finished + {finished:,} attempts",
        context=ctx, columns=["read", "median [spread]", "goal", "met"], unit="ms")
    cases: dict[str, list[float]] = {}
    with scratch_db() as empty_dsn:
        e = Queue(empty_dsn)
        e.init()
        e.stats()  # its session's first statements past, as for the big table's
        empty_status = [_timed(e.stats) for _ in range(reps)]
        e.close()
    with scratch_db() as dsn:
        q = Queue(dsn)
        q.init()
        t0 = time.perf_counter()
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute(PENDING, {"n": pending})
            c.execute(IDLE)
            c.execute(FINISHED, {"n": finished})
            c.execute(ATTEMPTS)
            c.execute("VACUUM ANALYZE fleetless.jobs")
            c.execute("VACUUM ANALYZE fleetless.job_attempts")
        build = time.perf_counter() - t0
        # The first scrapes of a history not folded yet (an upgrade whose init did not fold it):
        # each folds a bounded step and counts a bounded tail.
        Insights(q).metrics()
        for _ in range(reps):
            cases.setdefault("fleetless metrics, history not folded yet", []).append(
                _timed(lambda: Insights(q).metrics()))
        with psycopg.connect(dsn) as c:  # once: it reads the whole unfolded history
            mark = c.execute("SELECT last_id FROM fleetless.attempt_totals_mark").fetchone()[0]  # type: ignore[index]
            t0 = time.perf_counter()
            c.execute(OLD_TAIL, {"after": mark, **bucket_params([float(b) for b in DURATION_BUCKETS])}).fetchall()
            old_tail = time.perf_counter() - t0
        t0 = time.perf_counter()
        Insights(q).fold_history()  # what `fleetless init` does on an upgraded database
        fold = time.perf_counter() - t0
        q.compact_counts()
        reader = Queue(_reader(dsn))
        reader.stats()
        for _ in range(reps):
            for name, fn in (
                ("fleetless metrics (one scrape)", lambda: Insights(q).metrics()),
                ("fleetless status", q.stats),
                ("claim 10 from the idle queue", lambda: q.claim(10, queues=["idle"])),
                ("next_due of the idle queue", lambda: q.next_due(["idle"])),
                ("fleetless status as a SELECT-only role", reader.stats),
                ("claim 10 skipping every backlog kind", lambda: q.claim(10, skip_kinds=SKIP)),
                ("next_due skipping every backlog kind", lambda: q.next_due(None, SKIP)),
                ("claim 10 from the idle queue, server time", lambda: _server_ms(dsn, q, "claim", CLAIM)),
                ("next_due of the idle queue, server time",
                 lambda: _server_ms(dsn, q, "next_due", {"queues": ["idle"], "skip_kinds": None})),
                ("claim 10 skipping every backlog kind, server time",
                 lambda: _server_ms(dsn, q, "claim", {**CLAIM, "queues": None, "skip_kinds": SKIP})),
                ("next_due skipping every backlog kind, server time",
                 lambda: _server_ms(dsn, q, "next_due", {"queues": None, "skip_kinds": SKIP})),
                ("the same claim's rows as chosen before (390c217), server time",
                 lambda: _server_ms_sql(dsn, OLD_CLAIM_SKIPPING, {"queues": None, "skip_kinds": SKIP, "n": 10})),
                ("retention pass (deletes its batch of 500)",
                 lambda: retention.run_once(q, retention.Settings(every=None))),
            ):
                if name.endswith("server time"):
                    cases.setdefault(name, []).append(fn())  # type: ignore[operator]
                else:
                    cases.setdefault(name, []).append(_timed(fn))
            with psycopg.connect(dsn, autocommit=True) as c:
                c.execute("DELETE FROM fleetless.maintenance_runs")
            cases.setdefault("4 drains' retention passes at once, slowest", []).append(_passes_at_once(dsn, 4))
        q.close()
        reader.close()
        _drop_reader(dsn)
        costs = _enqueue_costs(dsn, reps, single=300 if ctx.quick else 2000, many=5000 if ctx.quick else 50_000)
    goals = {
        "fleetless metrics (one scrape)": (0.25, "<= 250 ms"),
        "fleetless metrics, history not folded yet": (0.25, "<= 250 ms"),
        "fleetless status as a SELECT-only role": (0.1, "works; <= 100 ms"),
        "claim 10 skipping every backlog kind": (0.005, "<= 5 ms"),
        "next_due skipping every backlog kind": (0.005, "<= 5 ms"),
        "claim 10 skipping every backlog kind, server time": (0.005, "<= 5 ms"),
        "next_due skipping every backlog kind, server time": (0.005, "<= 5 ms"),
        "claim 10 from the idle queue": (0.005, "<= 5 ms"),
        "next_due of the idle queue": (0.005, "<= 5 ms"),
        "claim 10 from the idle queue, server time": (0.005, "<= 5 ms"),
        "next_due of the idle queue, server time": (0.005, "<= 5 ms"),
        "retention pass (deletes its batch of 500)": (None, "bounded"),
        "4 drains' retention passes at once, slowest": (None, "no global lock"),
    }
    goals["the same claim's rows as chosen before (390c217), server time"] = (None, "")
    status_over = [s - median(empty_status) for s in cases["fleetless status"]]
    for name, values in cases.items():
        ms = f"{1000 * median(values):.1f} ms [{spread(values)}]"
        if name == "fleetless status":
            over = median(status_over)
            section.rows.append([name, f"{ms}; {1000 * over:+.1f} ms over an empty database's "
                                 f"({1000 * median(empty_status):.1f} ms)", "<= +100 ms",
                                 "yes" if over <= 0.1 else "NO"])
        else:
            limit, goal = goals[name]
            section.rows.append([name, ms, goal, "" if limit is None else ("yes" if median(values) <= limit else "NO")])
    now_claim = median(cases["claim 10 skipping every backlog kind, server time"])
    before_claim = median(cases["the same claim's rows as chosen before (390c217), server time"])
    section.rows.append(["claim skipping every backlog kind, before / now (server time)",
                         f"**{before_claim / now_claim:.0f}x**", "", ""])
    unfolded = median(cases["fleetless metrics, history not folded yet"])
    section.rows.append(["the attempt totals over the unfolded history as read before (390c217), once",
                         f"{1000 * old_tail:.0f} ms; **{old_tail / unfolded:.0f}x** a whole scrape now", "", ""])
    for what in ("enqueue", "enqueue_many"):
        ratio = median(costs[f"{what}, as shipped"]) / median(costs[f"{what}, without"])
        section.rows.append([f"{what} wall time, with the counts' triggers and queue and kind indexes / without",
                             f"**{ratio:.2f}x**", "", ""])
    section.notes += [
        f"Building the table took {build:.0f} s; folding the {finished:,} attempts once (`fleetless init`)"
        f" {fold:.1f} s.",
        "Retention at most once a minute per database: in the 4-at-once row, one drain runs the pass and "
        "three skip it after one statement.",
        "Enqueue ratios are whole-call wall time (client and server) on a small table, same run, interleaved.",
    ]
    section.raw = {"cases": cases, "empty_status": empty_status, "costs": costs, "build_s": build, "fold_s": fold,
                   "sizes": {"pending": pending, "finished": finished}}
    return section
