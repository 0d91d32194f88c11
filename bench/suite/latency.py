"""(4) Pickup latency in watch mode: enqueue to handler start, p50 and p99 over many jobs enqueued
one at a time at random intervals; and for delayed jobs, due time to handler start."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg

from fleetless import Queue

from . import VENV_PY, Context, Section, scratch_db

#: Mean gap between enqueues (exponential): slower than the drain serves them, so what is measured
#: is pickup, not a queue building up.
GAP = 0.2
TIERS = ("process", "bwrap")


def _pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def _wait_done(dsn: str, n: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    with psycopg.connect(dsn, autocommit=True) as c:
        while time.monotonic() < deadline:
            if c.execute("SELECT count(*) FROM fleetless.jobs WHERE status = 'done'").fetchone() == (n,):
                return
            time.sleep(0.2)
    raise RuntimeError("the watcher did not finish the jobs")


def _tiers() -> list[str]:
    from fleetless.sandbox import SandboxUnavailable, get_backend

    out = []
    for tier in TIERS:
        try:
            get_backend(tier).check()
            out.append(tier)
        except SandboxUnavailable:
            pass
    return out


def _one(dsn: str, folder: str, q: Queue, tier: str, n: int, delayed: int) -> tuple[list[float], list[float]]:
    """One watcher of ``tier``: (enqueue -> handler start, due time -> handler start), in ms."""
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("TRUNCATE fleetless.jobs, fleetless.job_attempts CASCADE")
    watcher = subprocess.Popen([VENV_PY, "-m", "fleetless.cli", "drain", "--handlers", folder, "--sandbox", tier,
                                "--watch", "--idle-exit", "600", "--concurrency", "2", "--per-sandbox", "50"],
                               env={**os.environ, "DATABASE_URL": dsn}, stderr=subprocess.DEVNULL)
    try:
        time.sleep(3)  # let it start and go idle: we measure pickup, not its start
        sent: dict[int, float] = {}
        for i in range(n):
            time.sleep(random.expovariate(1 / GAP))
            t = time.time()
            sent[q.enqueue("stamp", {"i": i})] = t
        due: dict[int, float] = {}
        for i in range(delayed):
            job_id = q.enqueue("stamp", {"d": i}, delay=1.0 + random.random())
            with psycopg.connect(dsn) as c:
                row = c.execute("SELECT extract(epoch FROM run_after) FROM fleetless.jobs WHERE id = %s",
                                (job_id,)).fetchone()
            assert row is not None
            due[job_id] = float(row[0])
            time.sleep(random.random() * 0.2)
        _wait_done(dsn, n + delayed)
    finally:
        watcher.send_signal(signal.SIGTERM)
        watcher.wait(60)
    with psycopg.connect(dsn) as c:
        got = dict(c.execute("SELECT id, (result_json #>> '{}')::float8 FROM fleetless.jobs").fetchall())
    return [1000 * (got[i] - t) for i, t in sent.items()], [1000 * (got[i] - t) for i, t in due.items()]


def run(ctx: Context) -> Section:
    n, delayed = ctx.size(1000, 50), ctx.size(20, 5)
    tiers = _tiers()
    immediate: dict[str, list[float]] = {t: [] for t in tiers}
    late: dict[str, list[float]] = {t: [] for t in tiers}
    per_rep: dict[str, list[float]] = {f"{t} {what}": [] for t in tiers for what in ("p50 ms", "p99 ms")}
    with scratch_db() as dsn, tempfile.TemporaryDirectory() as folder:
        Path(folder, "stamp.py").write_text("import time\n\ndef handle(payload):\n    return time.time()\n")
        os.chmod(folder, 0o755)
        q = Queue(dsn)
        q.init()
        for _ in range(max(1, ctx.reps // 2)):
            for tier in tiers:
                rep_imm, rep_late = _one(dsn, folder, q, tier, n, delayed)
                immediate[tier] += rep_imm
                late[tier] += rep_late
                per_rep[f"{tier} p50 ms"].append(_pct(rep_imm, 50))
                per_rep[f"{tier} p99 ms"].append(_pct(rep_imm, 99))
        q.close()
    s = Section("latency", "(4) Pickup latency in watch mode (handle() module)",
                "bench/run.py --only latency", ctx, ["tier", "what", "ms", "target"],
                raw={"immediate_ms": immediate, "delayed_ms": late})
    for tier in tiers:
        s.rows.append([tier, "enqueue -> handler start, p50", f"{_pct(immediate[tier], 50):.1f}", "<= 20"])
        s.rows.append([tier, "enqueue -> handler start, p99", f"{_pct(immediate[tier], 99):.1f}", "<= 100"])
        s.rows.append([tier, "due time -> handler start, p50 (delayed jobs)", f"{_pct(late[tier], 50):.1f}",
                       "<= 50"])
        s.rows.append([tier, "due time -> handler start, max (delayed jobs)", f"{max(late[tier]):.1f}", ""])
    for label, values in per_rep.items():
        s.add_bar(label, values)
    s.unit = "ms"
    s.notes.append(f"{n} jobs enqueued one at a time (exponential gaps, mean {GAP * 1000:.0f} ms) and {delayed} "
                   "delayed by 1-2 s, per repetition and tier, to one `drain --watch --per-sandbox 50 --concurrency "
                   "2`. The watcher keeps three sandboxes started ahead (--concurrency + 1; their batch runners "
                   "waiting on a pipe), so a job's pickup is the NOTIFY, one claim and a write to that pipe; a job "
                   "arriving while all three are being replaced waits for one (the p99).")
    return s
