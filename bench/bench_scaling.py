"""Claims per second one PostgreSQL sustains with 1 to 16 drainers, directly and through PgBouncer.

    python bench/bench_scaling.py [--drainers 1,2,4,8,16] [--seconds 5] [--reps 2] [--pool-size 4]

Each drainer is a process of its own with one ``Queue`` (one connection, as ``fleetless drain``
holds), looping over no-op jobs with no sandbox, through the Python API, in two modes:
  per-job: ``claim(1)`` then ``complete(job)``: two statements (two commits) per job, what a
           per-job drain's slot does;
  batch:   ``claim(100)`` then one ``finish_many`` for the batch, what batch mode does;
  per-job-prepared: per-job on a connection with psycopg's default server-side prepares (what
           fleetless turned off for poolers), to show what turning them off costs.
All drainers start together and run for ``--seconds``; the figure is the jobs finished in that
window over its length. The table holds far more pending jobs than get claimed, refilled between
runs. "direct" is the server at ``FLEETLESS_BENCH_PG``; "pgbouncer" is a private PgBouncer in
transaction pooling with ``--pool-size`` server connections in front of it (``tests/pooler.py``).
Connections are sampled from ``pg_stat_activity`` during each run: server connections per
drainer. Prints a Markdown table of medians over ``--reps`` (reps are the outer loop).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from _common import ADMIN_DSN, median, scratch_db, spread

from fleetless import Queue
from fleetless.job import Outcome

import pooler

HERE = Path(__file__).resolve().parent

DONE = Outcome("done")
APP = "fleetless-bench-drainer"


def worker(dsn: str, mode: str, seconds: float) -> None:
    """One drainer: connect, say so, wait for the go, then claim and finish until time is up."""
    if mode.endswith("-prepared"):  # psycopg's default: server-side prepare on the fifth run
        mode = mode.removesuffix("-prepared")
        queue = Queue(psycopg.connect(dsn, autocommit=True, prepare_threshold=5))
    else:
        queue = Queue(dsn)  # as fleetless connects: never prepared
    queue.stats()  # connected before the clock starts
    print("ready", flush=True)
    sys.stdin.readline()
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        if mode == "per-job":
            jobs = queue.claim(1)
            for job in jobs:
                queue.complete(job)
        else:
            jobs = queue.claim(100)
            queue.finish_many([(job, DONE) for job in jobs])
        if not jobs:
            raise SystemExit("ran out of jobs: raise --refill")
        n += len(jobs)
    print(json.dumps({"jobs": n}), flush=True)
    queue.close()


def refill(dsn: str, n: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("TRUNCATE fleetless.jobs, fleetless.job_attempts CASCADE")  # and its attempt history
    q = Queue(dsn)
    q.enqueue_many(("noop", {}) for _ in range(n))
    q.close()
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("VACUUM ANALYZE fleetless.jobs")


def server_connections(dbname: str, stats_dsn: str, admin_dsn: str | None) -> int:
    """Server connections the drainers hold now: backends named by the bench directly, or the
    pooler's own server connections to the database (its admin console's SHOW POOLS)."""
    if admin_dsn is None:
        with psycopg.connect(stats_dsn, autocommit=True) as c:
            row = c.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND application_name = %s",
                            (dbname, APP)).fetchone()
            return int(row[0]) if row else 0
    with psycopg.connect(admin_dsn, autocommit=True, cursor_factory=psycopg.ClientCursor) as a:
        cur = a.execute("SHOW POOLS")
        names = [d.name for d in cur.description or []]
        pools = [dict(zip(names, r, strict=True)) for r in cur.fetchall()]
    return sum(p[k] for p in pools if p["database"] == dbname
               for k in ("sv_active", "sv_idle", "sv_used", "sv_tested", "sv_login"))


def run_once(dsn: str, stats_dsn: str, admin_dsn: str | None, dbname: str, drainers: int, mode: str,
             seconds: float) -> tuple[float, int]:
    """(jobs/s, peak server connections held for the drainers)."""
    # Named, so the count finds them; the pooler's server connections keep the name of their last
    # client, hence another name through it (its idle connections are not the direct drainers').
    dsn = psycopg.conninfo.make_conninfo(dsn, application_name=APP if admin_dsn is None else f"{APP}-pooled")
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", dsn, mode, str(seconds)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(drainers)]
    for p in procs:  # every drainer connected...
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    for p in procs:  # ...then all start together
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    peak = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.wait(0.2):
            peak = max(peak, server_connections(dbname, stats_dsn, admin_dsn))

    sampler = threading.Thread(target=sample)
    sampler.start()
    total = 0
    try:
        for p in procs:
            out, _ = p.communicate(timeout=seconds + 120)  # the last line: its count
            if p.returncode != 0:
                raise SystemExit(f"a drainer failed ({p.returncode})")
            total += json.loads(out.strip().splitlines()[-1])["jobs"]
    finally:
        stop.set()
        sampler.join()
    return total / seconds, peak


def drain_connections(dsn: str, dbname: str, concurrency: int = 4) -> int:
    """Peak server connections of one real ``fleetless drain`` (process tier, 1 s jobs)."""
    with tempfile.TemporaryDirectory() as handlers:
        (Path(handlers) / "nap.py").write_text("import time; time.sleep(1)\n")
        Path(handlers).chmod(0o755)
        q = Queue(dsn)
        q.enqueue_many(("nap", {}) for _ in range(3 * concurrency))
        q.close()
        env = {**os.environ, "DATABASE_URL": dsn, "PGAPPNAME": APP}
        proc = subprocess.Popen([sys.executable, "-m", "fleetless.cli", "drain", "--handlers", handlers,
                                 "--sandbox", "process", "--concurrency", str(concurrency)], env=env,
                                stdout=subprocess.DEVNULL)
        peak = 0
        while proc.poll() is None:
            peak = max(peak, server_connections(dbname, dsn, None))
            time.sleep(0.1)
        return peak


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drainers", default="1,2,4,8,16")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--pool-size", type=int, default=4)
    ap.add_argument("--modes", default="per-job,batch")
    ap.add_argument("--refill", type=int, default=60_000)
    ap.add_argument("--routes", default="direct,pgbouncer",
                    help="per-job-prepared fails through PgBouncer 1.18: run it with --routes direct")
    args = ap.parse_args()
    counts = [int(x) for x in args.drainers.split(",")]
    modes = args.modes.split(",")
    info = psycopg.conninfo.conninfo_to_dict(ADMIN_DSN)
    results: dict[tuple[str, str, int], list[tuple[float, float]]] = {}
    with scratch_db() as dsn:
        dbname = str(psycopg.conninfo.conninfo_to_dict(dsn)["dbname"])
        q = Queue(dsn)
        q.init()
        q.close()
        refill(dsn, 0)
        held = drain_connections(dsn, dbname)
        print(f"one `fleetless drain --concurrency 4` held at most {held} server connection(s)",
              file=sys.stderr, flush=True)
        bouncer = pooler.PgBouncer(upstream_host=str(info.get("host", "127.0.0.1")),
                                   upstream_port=int(info.get("port", 5432)), pool_size=args.pool_size,
                                   pool_mode="transaction").start()
        try:
            routes = {"direct": (dsn, None), "pgbouncer": (bouncer.dsn(dbname), bouncer.dsn("pgbouncer"))}
            routes = {k: v for k, v in routes.items() if k in args.routes.split(",")}
            for rep in range(args.reps):
                for mode in modes:
                    for via, (route, admin) in routes.items():
                        for k in counts:
                            refill(dsn, args.refill if mode.startswith("batch") else args.refill // 10)
                            r = run_once(route, dsn, admin, dbname, k, mode, args.seconds)
                            results.setdefault((mode, via, k), []).append(r)
                            print(f"rep {rep + 1} {mode:8} {via:9} {k:2} drainers: {r[0]:8.0f} jobs/s, "
                                  f"{r[1]} server connections", file=sys.stderr, flush=True)
        finally:
            bouncer.stop()
    print(f"\nOne `fleetless drain --concurrency 4` (process tier) held at most {held} server connection(s).")
    print(f"\n{args.seconds:g} s per run, median of {args.reps}; PgBouncer 1.18, pool_mode=transaction, "
          f"default_pool_size={args.pool_size}\n")
    print("| mode | drainers | direct jobs/s | spread | server conns | pgbouncer jobs/s | spread | server conns "
          "| pgbouncer/direct |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|")
    for mode in modes:
        for k in counts:
            d = results[(mode, "direct", k)]
            b = results.get((mode, "pgbouncer", k), [(float("nan"), 0)])
            dr, br = median([x[0] for x in d]), median([x[0] for x in b])
            print(f"| {mode} | {k} | {dr:.0f} | {spread([x[0] for x in d])} | {max(x[1] for x in d)} "
                  f"| {br:.0f} | {spread([x[0] for x in b])} | {max(x[1] for x in b)} "
                  f"| {br / dr if dr else float('nan'):.2f} |")

if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up (pooler, database) on kill too
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], float(sys.argv[4]))
    else:
        main()
