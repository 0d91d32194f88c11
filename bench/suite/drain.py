"""(2) Drain of many no-op jobs, each drain timed as a whole process (interpreter start and imports
included for all): fleetless batch mode at several --per-sandbox sizes against the raw-SQL
ceiling (claim N=100 + one UPDATE per batch), PgQueuer (asyncpg, batch 200, drain mode) and
Procrastinate's one-shot worker. Every fleetless job runs in a sandbox and has its own fenced
outcome stored. fleetless runs on the process tier, and on the forkserver tier where it can (a
root drainer): its sandboxes are forked from a pre-warmed server instead of started."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import psycopg

from fleetless import Queue

from . import ROOT, VENV_PY, Context, Section, fmt, median, run_process, scratch_db, spread

PEERS = ROOT / "bench" / "peers"
PEERS_PY = os.path.join(os.environ.get("PEERS_VENV", os.path.expanduser("~/.cache/fleetless-peers")), "bin", "python")
SIZES = (100, 500, 2000)


def _tiers() -> list[str]:
    from fleetless.sandbox import SandboxUnavailable, get_backend

    try:
        get_backend("forkserver").check()
    except SandboxUnavailable:
        return ["process"]
    return ["process", "forkserver"]


def _url(dsn: str) -> str:
    """asyncpg takes URLs only."""
    i = psycopg.conninfo.conninfo_to_dict(dsn)
    return f"postgresql://{i.get('user', '')}@{i.get('host', '127.0.0.1')}:{i.get('port', 5432)}/{i['dbname']}"


def _fill_fleetless(dsn: str, n: int) -> None:
    q = Queue(dsn)
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("TRUNCATE fleetless.jobs, fleetless.job_attempts CASCADE")
    q.enqueue_many(("noop", {"i": i}) for i in range(n))
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("VACUUM ANALYZE fleetless.jobs")
    q.close()


def _fill_raw(dsn: str, n: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("DROP TABLE IF EXISTS raw_jobs")
        c.execute("CREATE TABLE raw_jobs (id bigserial PRIMARY KEY, kind text NOT NULL, payload jsonb NOT NULL,"
                  " status text NOT NULL DEFAULT 'pending', attempts int NOT NULL DEFAULT 0,"
                  " max_attempts int NOT NULL DEFAULT 3, run_after timestamptz NOT NULL DEFAULT now(),"
                  " locked_at timestamptz, last_error text, created_at timestamptz NOT NULL DEFAULT now())")
        c.execute("CREATE INDEX ON raw_jobs (run_after) WHERE status = 'pending'")
        with c.cursor() as cur, cur.copy("COPY raw_jobs (kind, payload) FROM STDIN") as cp:
            for i in range(n):
                cp.write_row(("noop", f'{{"i": {i}}}'))
        c.execute("VACUUM ANALYZE raw_jobs")


def run(ctx: Context) -> Section:
    n = ctx.size(30000, 3000)
    peers = os.access(PEERS_PY, os.X_OK)
    cases: dict[str, list[float]] = {"raw SQL ceiling (N = 100)": []}
    cases.update({f"fleetless --per-sandbox {k} ({tier} tier)": [] for tier in _tiers() for k in SIZES})
    if peers:
        cases["PgQueuer (asyncpg, batch 200, drain)"] = []
        cases["Procrastinate one-shot worker (concurrency 10)"] = []
    with scratch_db() as dsn, tempfile.TemporaryDirectory() as folder:
        Path(folder, "noop.py").write_text("def handle(payload):\n    return None\n")
        os.chmod(folder, 0o755)
        Queue(dsn).init()
        for _ in range(ctx.reps):
            for label in cases:
                if label.startswith("raw"):
                    _fill_raw(dsn, n)
                    argv = [VENV_PY, str(PEERS / "raw_drain.py"), dsn, "100"]
                elif label.startswith("fleetless"):
                    _fill_fleetless(dsn, n)
                    size, tier = label.split()[2], label.split()[3].strip("(")
                    argv = [VENV_PY, "-m", "fleetless.cli", "drain", "--handlers", folder, "--sandbox", tier,
                            "--per-sandbox", size, "--concurrency", "2", "--lease-grace", "60"]
                elif label.startswith("PgQueuer"):
                    run_process([PEERS_PY, str(PEERS / "pgqueuer_drain.py"), "fill", _url(dsn), str(n)])
                    argv = [PEERS_PY, str(PEERS / "pgqueuer_drain.py"), "drain", _url(dsn), "200"]
                else:  # about 1,000 jobs/s at best: a tenth of the jobs keeps the run short
                    run_process([PEERS_PY, str(PEERS / "procrastinate_drain.py"), "fill", dsn, str(n // 10)])
                    argv = [PEERS_PY, str(PEERS / "procrastinate_drain.py"), "drain", dsn, "10"]
                wall, _, _ = run_process(argv, env={"DATABASE_URL": dsn})
                if label.startswith("fleetless"):
                    with psycopg.connect(dsn) as c:
                        done = c.execute("SELECT count(*) FROM fleetless.jobs WHERE status = 'done'").fetchone()
                    assert done == (n,), f"{label}: {done} of {n} done"
                cases[label].append((n // 10 if label.startswith("Procrastinate") else n) / wall)
    s = Section("drain", f"(2) Drain of {n:,} no-op jobs, whole processes", "bench/run.py --only drain", ctx,
                ["drainer", "jobs/s", "/ raw ceiling", "/ PgQueuer"], raw=cases)
    raw = median(cases["raw SQL ceiling (N = 100)"])
    pgq = median(cases["PgQueuer (asyncpg, batch 200, drain)"]) if peers else None
    for label, values in cases.items():
        m = median(values)
        s.rows.append([label, f"{fmt(m)} [{spread(values)}]", f"{m / raw:.2f}", f"{m / pgq:.2f}" if pgq else "-"])
        s.add_bar(label, values)
    best = max((k for k in cases if k.startswith("fleetless")), key=lambda k: median(cases[k]))
    s.notes.append(f"Targets: fleetless at its best N ({' '.join(best.split()[2:])}) >= 1.5x PgQueuer and >= 0.5x "
                   "the raw ceiling. fleetless runs `drain --sandbox TIER --per-sandbox N --concurrency 2` with a "
                   "`handle(payload)` module; every job's outcome is written by the batched completer.")
    if peers:
        s.notes.append(f"Procrastinate drains {n // 10:,} jobs per repetition (its rate is about 1,000/s).")
    if not peers:
        s.notes.append(f"Peers not measured: no venv at {PEERS_PY} (bash bench/peers/setup.sh).")
    return s
