"""``fleetless demo``: a burst of example jobs, drained once, with a readable outcome."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import stat
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from importlib import resources
from pathlib import Path

import click
import psycopg

from .drainer import DrainConfig, Drainer
from .queue import Queue
from .retry import RetryPolicy
from .sandbox import AUTO

DEMO_SCHEMA = "fleetless_demo"


def burst(n_jobs: int) -> list[dict[str, object]]:
    """Mostly well-behaved jobs of several kinds, plus one that fails, one that hangs and one
    with no handler."""
    texts = ["the queue is a table", "no worker fleet\nbetween bursts nothing runs", "one job one sandbox"]
    jobs: list[dict[str, object]] = [
        {"kind": "flaky", "payload": {"url": "https://billing.internal/api"}, "max_attempts": 3},
        {"kind": "slow", "payload": {}, "max_attempts": 1, "timeout": 2},
        {"kind": "resize-image", "payload": {"path": "cat.png"}},
    ]
    makers: list[Callable[[int], dict[str, object]]] = [
        lambda i: {"kind": "greet", "payload": {"name": f"user {i}"}},
        lambda i: {"kind": "word-count", "payload": {"text": texts[i % len(texts)]}},
        lambda i: {"kind": "checksum", "payload": {"invoice": 1000 + i}},
        lambda i: {"kind": "fib", "payload": {"n": 18 + i % 5}, "priority": 1},
    ]
    for i in range(max(n_jobs - len(jobs), 0)):
        jobs.append(makers[i % len(makers)](i))
    return jobs


def handlers_copy(into: Path) -> Path:
    """The shipped example handlers, copied somewhere every sandbox can read, executable bits set."""
    target = into / "handlers"
    target.mkdir()
    source = resources.files("fleetless.examples").joinpath("handlers")
    for entry in source.iterdir():
        if entry.name.startswith(("_", ".")) or not entry.is_file():
            continue
        path = target / entry.name
        path.write_bytes(entry.read_bytes())
        mode = 0o755 if not entry.name.endswith(".py") else 0o644
        path.chmod(mode)
    target.chmod(stat.S_IRWXU | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
    into.chmod(0o755)
    return target


def outcome_line(status: str, text: str | None, width: int = 100) -> str:
    """The table's outcome cell: the first line whole (never cut mid-word or mid-path); for a
    failure, the last line of stderr after it while the two fit in ``width``."""
    lines = (text or "").strip().splitlines()
    if not lines:
        return ""
    outcome = lines[0]
    if status != "done" and len(lines) > 1 and len(outcome) + 3 + len(lines[-1]) <= width:
        outcome += f"  | {lines[-1]}"
    return outcome


def run(dsn: str | None, *, sandbox: str = AUTO, n_jobs: int = 12, as_json: bool = False) -> None:
    """The demo; ``as_json``: its lines go to stderr and stdout is one JSON object (the tier, the
    drain's summary as ``drain --json`` gives it, each job's row, where the handlers are)."""
    say = functools.partial(click.echo, err=as_json)
    with ExitStack() as stack:
        embedded = not dsn
        logging.getLogger("fleetless.drainer").setLevel(logging.ERROR)  # the table says it all
        if not dsn:
            from .embedded import EmbeddedPostgres, writable_data_dir

            data_dir, notice = writable_data_dir()
            if notice:
                say(notice)
            say("No DATABASE_URL given: starting an embedded PostgreSQL for the demo ...")
            dsn = stack.enter_context(EmbeddedPostgres(data_dir))
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {DEMO_SCHEMA} CASCADE")
        queue = Queue(dsn, schema=DEMO_SCHEMA)
        stack.callback(queue.close)
        queue.init()
        # Kept afterwards (not removed): the user reads the handlers that just ran, and can drain
        # with them.
        handlers = handlers_copy(Path(tempfile.mkdtemp(prefix="fleetless-demo-")))
        ids = queue.enqueue_many(burst(n_jobs))
        config = DrainConfig(
            handlers_dir=handlers, sandbox=sandbox, timeout=30, ttl=60, lease_grace=10,
            concurrency=max(os.cpu_count() or 1, 2),
            # Retries due at once so the demo shows a job walking to dead in one drain.
            retry=RetryPolicy(base_seconds=0, max_jitter_seconds=0),
            # The demo's kind with no handler is given back for 60 s, as by any drain (a drainer of
            # the next release may have it): the demo teaches what a real drain does.
        )
        drainer = Drainer(queue, config)
        if drainer.tier_note:
            say(drainer.tier_note)
        say(f"Enqueued {len(ids)} jobs into {DEMO_SCHEMA}.jobs; draining with the "
            f"'{drainer.config.sandbox}' sandbox (one sandbox per job) ...")
        started = time.monotonic()
        summary = drainer.run()
        say(summary.line())
        rows = sorted(queue.list(limit=len(ids)), key=lambda r: r["id"])
        say("")
        say(f"{'id':>4}  {'kind':<13} {'status':<9} {'tries':<6} outcome")
        report = []
        for r in rows:
            job = queue.get(r["id"])
            text = job["result"] if job["status"] == "done" else job["last_error"]
            outcome = outcome_line(job["status"], text)
            report.append({k: job[k] for k in ("id", "kind", "status", "attempts", "max_attempts")}
                          | {"outcome": outcome})
            say(f"{job['id']:>4}  {job['kind']:<13} {job['status']:<9} "
                f"{job['attempts']}/{job['max_attempts']:<4} {outcome}")
        say("")
        given_back = f", {summary.released} given back" if summary.released else ""
        say(f"{summary.done} done, {summary.dead} dead{given_back} in {time.monotonic() - started:.1f} s.")
        for job in report:
            if job["status"] == "pending" and str(job["outcome"]).startswith("no handler for kind"):
                say(f"Job {job['id']} ({job['kind']}) has no handler here: a drain gives such a job back, "
                    f"uncharged, due again in {drainer.config.no_handler_delay or 0:g} s, for a drainer that has "
                    "its handler (a rolling deploy); five give-backs in a row count as one failed attempt. "
                    "--no-handler-delay 0 makes it dead at once.")
        kinds = ", ".join(sorted(p.name for p in handlers.iterdir()))
        say(f"The handlers that ran are in {handlers} ({kinds}): read them, or run them on "
            f"your own jobs with: fleetless drain --handlers {handlers}")
        if embedded:
            say("The embedded server stops now. Against your own database: DATABASE_URL=... fleetless demo,"
                " then fleetless --schema fleetless_demo show ID")
        else:
            say("Inspect with: fleetless --schema fleetless_demo status | jobs | show ID")
        if as_json:
            click.echo(json.dumps({"tier": drainer.config.sandbox, "summary": dataclasses.asdict(summary),
                                   "handlers": str(handlers), "jobs": report}))
