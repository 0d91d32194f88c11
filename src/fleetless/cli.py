"""The command line: thin; parses, calls the modules, prints. Every error is one line."""

from __future__ import annotations

import datetime as dt
import functools
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, Literal, NoReturn, TypeVar

import click

from . import db, maintenance
from ._units import format_duration, format_size, parse_duration, parse_size
from .drainer import DrainConfig, Drainer, DrainError
from .events import NullReporter, Reporter
from .insights import Insights, age, attempt_label, payload_lines, printable
from .job import MAX_PAYLOAD_BYTES, parse_payload_json, validate_kind
from .queue import MAX_ATTEMPTS_CEILING, JobNotFound, Queue, result_was_cut
from .retry import RetryPolicy
from .sandbox import AUTO, Limits, SandboxUnavailable, available_backends
from .sandbox import _hostuid as hostuid

F = TypeVar("F", bound=Callable[..., Any])


class Fail(click.ClickException):
    """A one-line error; exit 1 (2 for usage errors, as click)."""


def _fail(message: str) -> NoReturn:
    raise Fail(message)


def _say(level: int, message: str, **fields: Any) -> None:
    """``fleetless: error: …`` / ``fleetless: warning: …`` on stderr; under ``--log-format json``
    a JSON log record instead (``level``, ``message`` and ``fields``), so stderr stays all JSON."""
    from .terminal import JsonFormatter

    if any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers):
        logging.getLogger("fleetless.cli").log(level, "%s", message, extra={"fields": fields})
    else:
        click.echo(f"fleetless: {logging.getLevelName(level).lower()}: {message}", err=True)


def _queue(ctx: click.Context, max_payload_bytes: int = MAX_PAYLOAD_BYTES) -> Queue:
    obj = ctx.obj
    if not obj["dsn"]:
        _fail("no database given: set DATABASE_URL or pass --database-url")
    return Queue(obj["dsn"], schema=obj["schema"], max_payload_bytes=max_payload_bytes)


def _insights(ctx: click.Context) -> Insights:
    return Insights(_queue(ctx))


def _json_value(value: Any) -> Any:
    """Timestamps as ISO 8601 (``2026-12-04T05:01:02.5+00:00``, what every JSON reader parses);
    anything else JSON has no type for as its text."""
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    return str(value)


def _echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=_json_value))


def _duration(_: click.Context | None, param: click.Parameter | None, value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _status(_: click.Context | None, param: click.Parameter | None, value: str | None) -> str | None:
    """A job status, or a usage error (exit 2) naming the one it may be a misspelling of."""
    import difflib

    from .job import Status

    if value is None:
        return None
    known = [st.value for st in Status]
    for one in value.split(",") if param is not None and param.name == "statuses" else [value]:
        if one.strip() and one.strip() not in known:
            close = difflib.get_close_matches(one.strip(), known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise click.BadParameter(f"unknown status {one.strip()!r}{hint}; one of {', '.join(known)}")
    return value


def _size(_: click.Context | None, param: click.Parameter | None, value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _uid_range(_: click.Context | None, param: click.Parameter | None, value: str | None) -> str | None:
    if value is None:
        return None
    try:
        return str(hostuid.parse_range(value))
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON.")


def _relog(ctx: click.Context, param: click.Parameter, value: Any) -> None:
    """``-v`` or ``--log-format`` given after the command (``fleetless drain -v``) as before it."""
    from .terminal import configure_logging

    if value is None or value is False:
        return
    ctx.obj["verbose" if param.name == "verbose" else "log_format"] = value
    configure_logging(verbose=ctx.obj["verbose"], log_format=ctx.obj["log_format"])


def logging_options(f: F) -> F:
    """The group's -v and --log-format, also accepted after the commands that log."""
    f = click.option("--log-format", type=click.Choice(["text", "json"]), default=None, expose_value=False,
                     callback=_relog, help="As before the command: log lines, or one JSON object per event.")(f)
    return click.option("-v", "--verbose", is_flag=True, expose_value=False, callback=_relog,
                        help="As before the command: log each finished job.")(f)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--database-url", envvar="DATABASE_URL", metavar="DSN",
              help="PostgreSQL URL or conninfo [env DATABASE_URL].")
@click.option("--schema", envvar="FLEETLESS_SCHEMA", default=db.DEFAULT_SCHEMA, show_default=True,
              help="PostgreSQL schema holding the jobs table [env FLEETLESS_SCHEMA].")
@click.option("-v", "--verbose", is_flag=True,
              help="Log each finished job (id, kind, attempt, outcome, duration, error) off a terminal.")
@click.option("--log-format", type=click.Choice(["text", "json"]), default="text", show_default=True,
              envvar="FLEETLESS_LOG_FORMAT", help="Log lines, or one JSON object per event [env FLEETLESS_LOG_FORMAT].")
@click.version_option(package_name="fleetless")
@click.pass_context
def cli(ctx: click.Context, database_url: str | None, schema: str, verbose: bool, log_format: str) -> None:
    """fleetless: a PostgreSQL job queue with no worker fleet."""
    from .terminal import configure_logging

    try:
        db.validate_schema_name(schema)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--schema") from None
    configure_logging(verbose=verbose, log_format=log_format)
    ctx.obj = {"dsn": database_url, "schema": schema, "verbose": verbose, "log_format": log_format}


@cli.command()
@click.option("--recount", is_flag=True,
              help="Also rebuild the job counts that status and /metrics read from the jobs table "
                   "(holds off job writes while it counts).")
@json_option
@click.pass_context
def init(ctx: click.Context, recount: bool, as_json: bool) -> None:
    """Create or upgrade the schema (idempotent)."""
    from .insights import Insights

    q = _queue(ctx)
    applied = q.init()
    wrong = q.recount() if recount else None
    Insights(q).fold_history()  # an existing attempt history folded here, not by the first scrapes
    if as_json:
        _echo_json({"schema": q.schema, "applied": applied}
                   | ({} if wrong is None else {"recounted": True, "wrong": wrong}))
        return
    click.echo(f"schema {q.schema}: " + (f"applied migrations {applied}" if applied else "up to date"))
    if wrong is not None:
        click.echo(f"job counts rebuilt: {wrong} of them were wrong")


@cli.command()
@click.argument("kind")
@click.argument("payload_json", default="{}", metavar="PAYLOAD_JSON")
@click.option("--max-attempts", type=int, default=None,
              help="[default: the kind's max_attempts in the drain's fleetless.toml, applied when a drain "
                   "claims the job; else 3]")
@click.option("--delay", callback=_duration, help="Run no sooner than this from now (e.g. 90s, 5m).")
@click.option("--run-after", type=str, help="ISO 8601 time with zone, e.g. 2026-12-01T02:00:00Z.")
@click.option("--queue", "queue_name", default="default", show_default=True)
@click.option("--priority", type=int, default=0, show_default=True, help="Higher runs first.")
@click.option("--timeout", callback=_duration, help="Overrides the drainer's --timeout for this job.")
@click.option("--key", help="At most one pending, running or waiting job has this key (also with --after).")
@click.option("--handlers", "handlers_dir", type=click.Path(path_type=Path), envvar="FLEETLESS_HANDLERS",
              help="The drainers' handlers directory: warn if KIND has no handler there, and use its "
                   "fleetless.toml [env FLEETLESS_HANDLERS].")
@click.option("--on-duplicate", type=click.Choice(["existing", "replace", "raise"]), default="existing",
              show_default=True,
              help="A job with --key is already pending, running or waiting: print its id, give a pending one "
                   "(or, with the same --after, a waiting one) this payload, or fail.")
@click.option("--max-payload-bytes", "max_payload", callback=_size, default="1M", show_default=True,
              envvar="FLEETLESS_MAX_PAYLOAD_BYTES",
              help="Refuse a payload larger than this once encoded [env FLEETLESS_MAX_PAYLOAD_BYTES].")
@click.option("--after", "after", type=int, multiple=True, metavar="ID",
              help="Run only after job ID is done (repeatable: after all of them); a workflow, see docs/workflows.md.")
@click.option("--on-parent-failure", type=click.Choice(["cancel", "run"]), default="cancel", show_default=True,
              help="With --after: a parent that ends dead or cancelled cancels this job, or counts as ended.")
@json_option
@click.pass_context
def enqueue(ctx: click.Context, kind: str, payload_json: str, max_attempts: int | None, delay: float | None,
            run_after: str | None, queue_name: str, priority: int, timeout: float | None,
            key: str | None, on_duplicate: Literal["existing", "replace", "raise"], handlers_dir: Path | None,
            max_payload: int, after: tuple[int, ...], on_parent_failure: Literal["cancel", "run"],
            as_json: bool) -> None:
    """Add a job; PAYLOAD_JSON '-' reads standard input. Prints the new id."""
    text = sys.stdin.read() if payload_json == "-" else payload_json
    payload = parse_payload_json(text)
    when = None
    if run_after is not None:
        try:
            when = dt.datetime.fromisoformat(run_after)
        except ValueError:
            _fail(f"invalid --run-after {run_after!r}: use ISO 8601, e.g. 2026-12-01T02:00:00Z")
        if when.tzinfo is None:
            _fail(f"invalid --run-after {run_after!r}: give a time zone (Z or +hh:mm)")
    if max_payload < 1:
        raise click.BadParameter("must be at least 1 byte", param_hint="--max-payload-bytes")
    if handlers_dir is not None:
        _check_kind(handlers_dir, kind)
    q = _queue(ctx, max_payload_bytes=max_payload)
    try:
        job_id = q.enqueue(kind, payload, max_attempts=max_attempts,
                           run_after=when, delay=delay,
                           queue=queue_name, priority=priority, timeout=timeout, key=key,
                           on_duplicate=on_duplicate, after=list(after) if after else None,
                           on_parent_failure=on_parent_failure)
    except ValueError as exc:
        if "over the limit" in str(exc):
            _fail(f"{exc} (raise it with --max-payload-bytes or FLEETLESS_MAX_PAYLOAD_BYTES)")
        raise
    if as_json:
        _echo_json({"id": int(job_id), "existing": job_id.existing, "replaced": job_id.replaced})
    else:
        click.echo(int(job_id))
    if job_id.existing:  # on stderr: stdout stays the bare id scripts read
        what = ("gave it this payload and options" if job_id.replaced
                else "nothing new was enqueued (--on-duplicate replace updates a pending one)")
        _say(logging.INFO,
             f"job {int(job_id)} with key {key!r} is already pending, running or waiting: {what}",
             event="existing", id=int(job_id), replaced=job_id.replaced)


def _check_kind(handlers_dir: Path, kind: str) -> None:
    """Warn when KIND has no handler in the drainers' directory (whose fleetless.toml must read)."""
    from . import handlers, kinds

    try:
        folder = handlers.check_dir(handlers_dir)
    except handlers.HandlersDirError as exc:
        _say(logging.WARNING, str(exc))
        return
    kinds.load(folder)
    validate_kind(kind)
    if handlers.resolve(folder, kind) is None:  # warned, not refused: a deploy may be adding it
        hint = handlers.did_you_mean(kind, handlers.kinds(folder))
        _say(logging.WARNING, f"no handler for kind {kind!r}{f' ({hint})' if hint else ''}: "
             f"{handlers.missing(folder, kind)}; a drain gives the job back until a drainer has one")


def drain_options(f: F) -> F:
    options = [
        click.option("--handlers", "handlers_dir", type=click.Path(path_type=Path), required=True,
                     help="Directory of handlers: <kind>.py or an executable <kind>."),
        click.option("--queue", "queues", multiple=True, help="Only these queues (repeatable)."),
        click.option("--batch", type=int, default=20, show_default=True, help="Most jobs per claim."),
        click.option("--per-sandbox", type=int, default=1, show_default=True,
                     help="Batch mode: run up to N claimed jobs of one kind in one sandbox."),
        click.option("--watch", is_flag=True,
                     help="After draining, wait for new jobs (NOTIFY) and due times instead of exiting."),
        click.option("--idle-exit", callback=_duration, default=None,
                     help="With --watch: exit after this long with nothing to do (e.g. 60s)."),
        click.option("--watch-lease", callback=_duration, default=None,
                     help="With --watch: a cron tick takes these queues over from a watcher whose heartbeat"
                          " is older than this (stopped or hung) [default: 30s]."),
        click.option("--concurrency", type=int, default=None, help="Jobs at once [default: CPU count]."),
        click.option("--max-runtime", callback=_duration, help="Stop claiming after this long."),
        click.option("--timeout", callback=_duration, default="600", show_default=True,
                     help="Per-job timeout unless the job sets its own."),
        click.option("--ttl", callback=_duration, default="900", show_default=True,
                     help="Sandbox lifetime; hard upper bound on a job."),
        click.option("--no-handler-delay", callback=_duration, default="60", show_default=True,
                     help="A job whose kind has no handler here is given back (not charged) and due again "
                          "after this long, for a drainer that has it (a rolling deploy); 0: dead at once."),
        click.option("--lease-grace", callback=_duration, default="60", show_default=True,
                     help="Lease = timeout + this (at least 3 s); past it the reaper returns the claim."),
        click.option("--shutdown-grace", callback=_duration, default="30", show_default=True,
                     help="On SIGTERM, running jobs get this long before their claims are returned."),
        click.option("--backoff-base", callback=_duration, default="60", show_default=True,
                     help="Retry delay = 2^attempts x this + jitter."),
        click.option("--max-jitter", callback=_duration, default="30", show_default=True),
        click.option("--sandbox", type=click.Choice([AUTO, *available_backends()]), default=AUTO,
                     show_default=True, envvar="FLEETLESS_SANDBOX",
                     help="Isolation tier. auto: the fork server for a root drainer or one with a subordinate uid "
                          "range, else bwrap where it works on this host, else process (says which, and why, on "
                          "stderr) [env FLEETLESS_SANDBOX]."),
        click.option("--memory", callback=_size, default="512M", show_default=True,
                     help="Memory cap per job."),
        click.option("--cpus", type=float, default=1.0, show_default=True, help="CPU quota per job."),
        click.option("--pids", type=int, default=128, show_default=True, help="Process cap per job."),
        click.option("--network", type=click.Choice(["off", "on"]), default="off", show_default=True),
        click.option("--pass-env", multiple=True, metavar="NAME[=VALUE]",
                     help="Pass this variable to jobs (repeatable). Nothing else is passed."),
        click.option("--python", "python", default=None, help="Interpreter for .py handlers."),
        click.option("--keep-done", callback=_keep, default="7d", show_default=True,
                     help="Retention: delete done jobs this long after they finished ('forever': keep)."),
        click.option("--keep-cancelled", callback=_keep, default="7d", show_default=True,
                     help="Retention for cancelled jobs ('forever': keep)."),
        click.option("--keep-dead", callback=_keep, default="30d", show_default=True,
                     help="Retention for dead jobs ('forever': keep)."),
        click.option("--retention-batch", type=int, default=500, show_default=True,
                     help="Most finished jobs one retention statement deletes (a pass: up to 20 of them)."),
        click.option("--maintenance-interval", callback=_duration, default="60", show_default=True,
                     help="A drain running longer repeats reap, sweep and retention this often."),
        click.option("--job-uids", callback=_uid_range, envvar=hostuid.ENV, metavar="FIRST-LAST",
                     help=f"Root drainers: host uids jobs run as, one per job [default: {hostuid.DEFAULT_RANGE}; "
                          f"env {hostuid.ENV}]."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _keep(ctx: click.Context | None, param: click.Parameter | None, value: str | None) -> float | None:
    if value is None or value.strip().lower() == "forever":
        return None
    return _duration(ctx, param, value)


def _drain_config(kw: dict[str, Any]) -> DrainConfig:
    limits = Limits(memory_bytes=kw["memory"], cpus=kw["cpus"], pids=kw["pids"],
                    network=kw["network"] == "on")
    return DrainConfig(
        handlers_dir=kw["handlers_dir"], queues=tuple(kw["queues"]) or None, batch=kw["batch"],
        concurrency=kw["concurrency"] if kw["concurrency"] is not None else os.cpu_count() or 1,
        max_runtime=kw["max_runtime"],
        timeout=kw["timeout"], ttl=kw["ttl"], lease_grace=kw["lease_grace"],
        shutdown_grace=kw["shutdown_grace"],
        retry=RetryPolicy(base_seconds=kw["backoff_base"], max_jitter_seconds=kw["max_jitter"]),
        sandbox=kw["sandbox"], limits=limits, pass_env=tuple(kw["pass_env"]), python=kw["python"],
        per_sandbox=kw["per_sandbox"], watch=kw["watch"], idle_exit=kw["idle_exit"],
        no_handler_delay=kw["no_handler_delay"] or None,
        watch_lease=kw["watch_lease"],
        maintenance=maintenance.Settings(
            retention=maintenance.retention.Settings(
                done=kw["keep_done"], cancelled=kw["keep_cancelled"], dead=kw["keep_dead"],
                batch_size=kw["retention_batch"]),
            interval=kw["maintenance_interval"]),
    )


def _reporter(ctx: click.Context, tier: str) -> Reporter:
    """Live progress on a terminal; one log record per finished job with -v; nothing otherwise.
    ``terminal`` (and rich) is imported only when it reports: a cron tick does not pay for it."""
    if ctx.obj["log_format"] == "text" and sys.stderr.isatty():
        from .terminal import LiveReporter

        return LiveReporter(tier=tier)
    if ctx.obj["verbose"]:
        from .terminal import LogReporter

        return LogReporter()
    return NullReporter()


def _log_caps(tier: str, limits: Limits) -> None:
    """The drain's first lines (after the tier's, for ``auto``): which caps hold for its jobs and how
    (``Sandbox.caps``), a short line each (doctor says them in full), and that its jobs run without
    their seccomp filter where they do (``Sandbox.unfiltered``). Shown (warnings) for a non-root
    drainer, whose jobs no cgroup may hold, wherever pids or memory is not capped and wherever the
    filter is missing; else at -v. One log record a line: --log-format json keeps one object each."""
    from .sandbox import get_backend
    from .sandbox._caps import caps_lines, held

    backend = get_backend(tier)
    caps = backend.caps(limits)
    why = backend.unfiltered()
    loud = os.geteuid() != 0 or why is not None or not all(held(caps)[name] for name in ("pids", "memory"))
    for line in caps_lines(tier, caps, why):
        logging.getLogger("fleetless.cli").log(logging.WARNING if loud else logging.INFO, "%s", line)


@cli.command()
@drain_options
@logging_options
@json_option
@click.pass_context
def drain(ctx: click.Context, /, as_json: bool, **kw: Any) -> None:
    """Reap, claim and run due jobs, one sandbox each (or --per-sandbox N of one kind); exit when
    nothing is claimable, or with --watch wait for more."""
    import dataclasses

    config = _drain_config(kw)
    # This process is the drain: what was imported lives as long as it, and a batch claim makes
    # thousands of objects at once (Jobs, their outcomes), each allocation burst setting off
    # collections that walk everything alive. Frozen imports and a larger first threshold: same
    # run, 15,000 no-op jobs, the drainer's CPU per job about 10% lower (BENCHMARKS.md, issue 8).
    import gc

    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    if kw["job_uids"]:  # read by the sandboxes (and their probes) of this process
        os.environ[hostuid.ENV] = kw["job_uids"]
    drainer = Drainer(_queue(ctx), config)
    if drainer.tier_note:  # a log record, so --log-format json keeps stderr all JSON
        # Which tier auto chose is news only when it is not the one the docs lead with.
        level = logging.WARNING if drainer.config.sandbox == "process" else logging.INFO
        logging.getLogger("fleetless.cli").log(level, "%s", drainer.tier_note)
    _log_caps(drainer.config.sandbox, config.limits)
    drainer.install_signal_handlers()
    drainer.reporter = _reporter(ctx, drainer.config.sandbox)
    summary = drainer.run()
    if as_json:
        _echo_json(dataclasses.asdict(summary))
    else:
        click.echo(summary.line())
        if (summary.claimed == 0 and not summary.watching_elsewhere and not drainer.signalled
                and (ctx.obj["verbose"] or sys.stderr.isatty())):
            # "claimed 0" with due jobs held back looks like a broken queue: say what holds them
            # (one more query, for a person watching: not on a cron tick's empty drain)
            from . import kinds

            held = [h for h in drainer.queue.held_back(kinds.load(config.handlers_dir))
                    if h["what"] == "kind" or config.queues is None or h["name"] in config.queues]
            if held:
                logging.getLogger("fleetless.cli").warning("nothing claimed; held back: %s", _held_text(held))
    if drainer.signalled == signal.SIGINT:
        sys.exit(130)  # the shell's convention for Ctrl-C, after the jobs were wound down


def _held_text(held: Sequence[dict[str, Any]]) -> str:
    """What :meth:`Queue.held_back` found, in words: ``queue media paused, kind thumb (concurrency 1 reached)``."""
    return ", ".join(f"{h['what']} {h['name']} paused" if h["why"] == "paused" else
                     f"{h['what']} {h['name']} ({h['why']} {h['limit']} reached)" for h in held)


@cli.command()
@click.option("--older-than", callback=_duration,
              help="Also return claims locked longer ago than this (e.g. 30m), lease or not.")
@json_option
@logging_options
@click.pass_context
def reap(ctx: click.Context, older_than: float | None, as_json: bool) -> None:
    """Return expired claims to pending (or dead when no attempt is left)."""
    result = maintenance.reaper.run_once(_queue(ctx), maintenance.reaper.Settings(older_than))
    if as_json:
        _echo_json({"reaped": {str(k): v for k, v in sorted(result.reaped.items())}})
        return
    for job_id, status in sorted(result.reaped.items()):
        click.echo(f"job {job_id}: {status}")
    click.echo(f"reaped {len(result.reaped)}")


@cli.command()
@click.option("--handlers", "handlers_dir", type=click.Path(path_type=Path), envvar="FLEETLESS_HANDLERS",
              help="The handlers directory: its fleetless.toml's kind limits are checked too"
                   " [env FLEETLESS_HANDLERS].")
@json_option
@click.pass_context
def status(ctx: click.Context, handlers_dir: Path | None, as_json: bool) -> None:
    """Counts by status and kind, oldest due job's wait, next due, what a pause or limit holds back;
    with --handlers, the kinds with pending jobs and no handler there."""
    from . import handlers, kinds

    folder = None
    if handlers_dir is not None:
        try:
            folder = handlers.check_dir(handlers_dir)
        except handlers.HandlersDirError as exc:
            _fail(str(exc))
    s = _insights(ctx).stats(kinds.load(folder) if folder is not None else None)
    if folder is not None:
        s["no_handler"] = _without_handler(folder, {k: c.get("pending", 0) for k, c in s["by_kind"].items()})
    if as_json:
        _echo_json(s)
        return
    click.echo("  ".join(f"{k} {v}" for k, v in s["by_status"].items()) + f"  (total {s['total']})")
    click.echo(f"oldest due job waiting: {age(s['oldest_due_age_seconds'])}   "
               f"next due in: {age(s['next_due_in_seconds'])}")
    if s["held_back"]:
        click.echo("held back: " + _held_text(s["held_back"]))
    if s["by_kind"]:
        statuses = list(s["by_status"])
        width = max(len(k) for k in s["by_kind"]) + 2
        click.echo("kind".ljust(width) + "".join(st.rjust(10) for st in statuses))
        for kind, counts in sorted(s["by_kind"].items()):
            click.echo(kind.ljust(width) + "".join(str(counts.get(st, 0)).rjust(10) for st in statuses))
    _echo_without_handler(s.get("no_handler", []), folder)


def _without_handler(folder: Path, pending: dict[str, int]) -> list[dict[str, Any]]:
    """The kinds with pending jobs and no handler in ``folder`` (a misspelt enqueue, or a handler
    not deployed yet: a drain gives their jobs back until it is dead), each with the handlers' kinds
    it may be a misspelling of."""
    from . import handlers

    have = handlers.kinds(folder)
    return [{"kind": kind, "pending": n, "did_you_mean": handlers.close_kinds(kind, have)}
            for kind, n in sorted(pending.items()) if n and kind not in have]


def _echo_without_handler(rows: list[dict[str, Any]], folder: Path | None) -> None:
    for r in rows:
        hint = f"; did you mean {' or '.join(r['did_you_mean'])}?" if r["did_you_mean"] else ""
        click.echo(f"no handler in {folder} for kind {printable(r['kind'])} ({r['pending']} pending{hint})")


def _table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    cells = [[printable(("" if r[c] is None else str(r[c])).replace("\n", " ").replace("\t", " "))[:60]
              for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    click.echo("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip())
    for row in cells:
        click.echo("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())


@cli.command()
@click.option("--status", "status_", callback=_status, help="pending, running, done, dead, cancelled or waiting.")
@click.option("--kind")
@click.option("--queue", "queue_name")
@click.option("--limit", type=int, default=50, show_default=True)
@click.option("--before", type=int, help="Only jobs with a smaller id (the next page: the last id shown).")
@json_option
@click.pass_context
def jobs(ctx: click.Context, status_: str | None, kind: str | None, queue_name: str | None, limit: int,
         before: int | None, as_json: bool) -> None:
    """List jobs, newest first, with the first line of each error."""
    rows = _insights(ctx).jobs(status=status_, kind=kind, queue=queue_name, limit=limit, before=before)
    if as_json:
        _echo_json(rows)
    else:
        _table(rows, ["id", "kind", "queue", "status", "attempts", "max_attempts", "run_after", "error_head"])


#: `fleetless wait`'s exit status by how the job ended (124 for a timeout, as timeout(1) uses).
WAIT_EXIT = {"done": 0, "dead": 4, "cancelled": 5}


@cli.command()
@click.argument("job_id", type=int)
@click.option("--timeout", callback=_duration, help="Give up after this long (exit 124) [default: forever].")
@json_option
@click.pass_context
def wait(ctx: click.Context, job_id: int, timeout: float | None, as_json: bool) -> None:
    """Wait until job JOB_ID finishes (woken by its finish, not by polling); print its result.
    Exit 0 done, 4 dead, 5 cancelled, 124 on --timeout."""
    from .queue import WaitTimeout

    try:
        finished = _queue(ctx).wait(job_id, timeout=timeout)
    except WaitTimeout as exc:
        _say(logging.ERROR, str(exc), event="timeout", id=job_id, status=exc.status)
        sys.exit(124)
    if as_json:
        _echo_json({"id": finished.id, "status": finished.status, "attempts": finished.attempts,
                    "result": finished.result, "error": finished.error, "finished_at": finished.finished_at})
    elif finished.status == "done":
        if finished.result is not None:
            text = finished.result if isinstance(finished.result, str) else json.dumps(finished.result)
            click.echo(printable(text.rstrip("\n")))
    else:
        # "job 7 is cancelled: an operator cancelled the job …", not "is cancelled: cancelled: …"
        head = [line.removeprefix(f"{finished.status}: ") for line in (finished.error or "").strip().splitlines()[:1]]
        _say(logging.ERROR, f"job {job_id} is {finished.status}" + (f": {printable(head[0])}" if head else ""),
             event="finished", id=job_id, status=finished.status)
    sys.exit(WAIT_EXIT[finished.status])


@cli.command()
@click.argument("job_id", type=int)
@json_option
@click.pass_context
def show(ctx: click.Context, job_id: int, as_json: bool) -> None:
    """Every column of one job, then its attempt history (and its workflow's parents and children)."""
    insights = _insights(ctx)
    row = insights.job(job_id)
    attempts = insights.attempts(job_id)
    graph = insights.graph(job_id)
    if as_json:
        _echo_json({**row, "attempts": attempts, **graph})
        return
    row.pop("error_head", None)
    row.pop("snoozed", None)  # derived: last_error (shown) says a snooze's note; "snoozes" counts them
    for key, value in row.items():
        if key == "result" and result_was_cut(value):
            # a handle() that returned a value (result_json) and printed: its prints are its output
            click.echo(f"{'output' if row.get('result_json') is not None else 'result'} (cut: only the first 64 KiB"
                       " of stdout were kept):")
            click.echo("  " + printable(str(value).rstrip()).replace("\n", "\n  "))
        elif key in ("last_error", "result") and value:
            # a handle() that returned a value (result_json) and printed: its prints are its output
            click.echo(f"{'output' if key == 'result' and row.get('result_json') is not None else key}:")
            click.echo("  " + printable(str(value).rstrip()).replace("\n", "\n  "))
        elif key == "payload":
            click.echo("\n".join(payload_lines(value)))
        elif key == "result_json" and value is not None:
            click.echo(f"{key}: {printable(json.dumps(value))}")
        else:
            click.echo(f"{key}: {'' if value is None else printable(str(value))}")
    click.echo(f"attempts ({len(attempts)}):")
    if attempts:
        for a in attempts:
            a["ended"] = a["exit_code"] if a["signal"] is None else a["signal"]
            a["seconds"] = None if a["duration_seconds"] is None else f"{a['duration_seconds']:.1f}"
            a["drainer"] = None if a["host"] is None else f"{a['host']}:{a['pid']}"
            a["attempt"] = attempt_label(a)
        _table(attempts, ["attempt", "outcome", "drainer", "tier", "started_at", "seconds", "ended",
                          "kill_reason", "error_head"])
    for what in ("parents", "children"):
        if graph[f"n_{what}"]:
            shown = graph[what]
            more = graph[f"n_{what}"] - len(shown)
            click.echo(f"{what} ({graph[f'n_{what}']}" + (f", the first {len(shown)} shown" if more else "") + "):")
            _table(shown, ["id", "kind", "status", "finished_at"])
    if graph["n_children"]:
        by_status = sorted(graph["children_by_status"].items())
        click.echo("children by status: " + ", ".join(f"{k} {v}" for k, v in by_status))


@cli.command()
@click.argument("job_id", type=int, required=False)
@click.option("--all-dead", is_flag=True, help="Retry every dead job.")
@click.option("--children", is_flag=True,
              help="Also the workflow children its failure cancelled: they wait for it again.")
@json_option
@click.pass_context
def retry(ctx: click.Context, job_id: int | None, all_dead: bool, children: bool, as_json: bool) -> None:
    """Make a dead or cancelled job pending again, due now."""
    if (job_id is None) == (not all_dead):
        raise click.UsageError("give a JOB_ID or --all-dead")
    if children and all_dead:
        raise click.UsageError("--children goes with a JOB_ID, not --all-dead")
    q = _queue(ctx)
    if all_dead:
        ids = q.retry_all_dead()
        for stuck in q.dead_at_the_ceiling():
            click.echo(f"fleetless: job {stuck} not retried: it already used the most attempts a job can"
                       f" have ({MAX_ATTEMPTS_CEILING}); enqueue it again instead", err=True)
    else:
        assert job_id is not None
        ids = [job_id, *q.retry(job_id, children=children)]
    if as_json:
        _echo_json({"retried": ids})
    else:
        click.echo(f"retried {len(ids)} job(s)" + (f": {', '.join(map(str, ids[:20]))}" if ids else ""))


@cli.command()
@click.argument("job_id", type=int)
@json_option
@click.pass_context
def cancel(ctx: click.Context, job_id: int, as_json: bool) -> None:
    """Cancel a pending job, or ask the drainer running it to kill it (it ends cancelled)."""
    status = _queue(ctx).cancel(job_id)
    if as_json:
        _echo_json({"cancel_requested" if status == "running" else "cancelled": job_id})
    elif status == "running":
        click.echo(f"job {job_id} is running: cancel requested; its drainer kills it within seconds")
    else:
        click.echo(f"cancelled job {job_id}")


@cli.command("run-now")
@click.argument("job_id", type=int)
@json_option
@click.pass_context
def run_now(ctx: click.Context, job_id: int, as_json: bool) -> None:
    """Make a pending job due now (skip its delay or retry backoff)."""
    _queue(ctx).run_now(job_id)
    if as_json:
        _echo_json({"run_now": job_id})
    else:
        click.echo(f"job {job_id} is due now")


@cli.command()
@click.argument("job_id", type=int)
@json_option
@click.pass_context
def delete(ctx: click.Context, job_id: int, as_json: bool) -> None:
    """Delete a finished job (done, dead or cancelled) and its attempt history."""
    _queue(ctx).delete(job_id)
    if as_json:
        _echo_json({"deleted": job_id})
    else:
        click.echo(f"deleted job {job_id}")


@cli.command()
@click.option("--older-than", callback=_duration, default="7d", show_default=True)
@click.option("--status", "statuses", default="done,cancelled", show_default=True, callback=_status,
              help="Comma-separated: which finished statuses to delete (done, cancelled, dead).")
@click.option("--include-dead", is_flag=True, help="Delete dead jobs too (same as adding dead to --status).")
@click.option("--batch-size", type=int, default=1000, show_default=True,
              help="Rows per DELETE statement; batches run until nothing is due.")
@json_option
@click.pass_context
def prune(ctx: click.Context, older_than: float, statuses: str, include_dead: bool, batch_size: int,
          as_json: bool) -> None:
    """Delete finished jobs (and their attempt history) finished longer ago than --older-than."""
    chosen = {s.strip() for s in statuses.split(",") if s.strip()} | ({"dead"} if include_dead else set())
    settings = maintenance.pruner.Settings(ages=tuple((s, older_than) for s in sorted(chosen)),
                                           batch_size=batch_size)
    result = maintenance.pruner.run_once(_queue(ctx), settings)
    if as_json:
        _echo_json({"pruned": result.deleted})
    else:
        click.echo(f"pruned {result.deleted} job(s)")


@cli.command("kinds")
@click.option("--handlers", "handlers_dir", type=click.Path(path_type=Path), envvar="FLEETLESS_HANDLERS",
              required=True, help="The handlers directory [env FLEETLESS_HANDLERS].")
@click.option("--sandbox", type=click.Choice([AUTO, *available_backends()]), default=AUTO, show_default=True,
              envvar="FLEETLESS_SANDBOX", help="The drain's tier, for kinds without their own [env FLEETLESS_SANDBOX].")
@click.option("--python", "python", default=None, help="The drain's interpreter for .py handlers.")
@json_option
@click.pass_context
def kinds_command(ctx: click.Context, handlers_dir: Path, sandbox: str, python: str | None, as_json: bool) -> None:
    """The kinds with a handler (and those only in fleetless.toml), with their effective settings
    under the drain's default flags (--sandbox and --python as a drain would get them); given a
    database, also the kinds with pending jobs and no handler."""
    from . import handlers, kinds
    from .sandbox import Template, choose_tier, get_backend

    try:
        folder = handlers.check_dir(handlers_dir)
    except handlers.HandlersDirError as exc:
        _fail(str(exc))
    settings = kinds.load(folder)
    have = set(kinds.found(folder))
    unhandled = []
    if ctx.obj["dsn"]:  # a database to read: which pending kinds no handler here runs
        by_kind = _insights(ctx).stats()["by_kind"]
        unhandled = _without_handler(folder, {k: c.get("pending", 0) for k, c in by_kind.items()})
    defaults = kinds.KindSettings(timeout=600.0, ttl=900.0, backoff_base=60.0, backoff_cap=7 * 86400.0, jitter=30.0,
                                  memory=512 * 1024**2, cpus=1.0, pids=128, network=False, max_attempts=3,
                                  batch_isolation="process")
    drain_tier = choose_tier(sandbox)[0]
    rows = []
    for kind in sorted(have | set(settings) | {u["kind"] for u in unhandled}):
        own = settings.get(kind, kinds.KindSettings())
        tier = own.tier or drain_tier
        effective = {"batch_size": None, "concurrency": None, "rate": None, **defaults.describe(),
                     **own.describe(), "tier": tier}
        handler = handlers.resolve(folder, kind) if kind in have else None
        effective["interpreter"] = None if handler is None else handlers.interpreter_of(
            folder, handler, own.interpreter or python,
            functools.partial(get_backend(tier).handler_python, Template(handlers_dir=folder)))
        rows.append({"kind": kind, "handler": kind in have, "set_in_file": sorted(own.describe()), **effective})
        for u in unhandled:  # pending jobs and no handler: how many, and what it may be a misspelling of
            if u["kind"] == kind:
                rows[-1] |= {"pending": u["pending"], "did_you_mean": u["did_you_mean"]}
    if as_json:
        _echo_json(rows)
        return
    # Two tables of ~100 columns (one was ~240): how each kind runs, then its limits; a value its
    # [kinds.X] table sets is marked *. The names are fleetless.toml's keys; durations as written there.
    shown: dict[str, Callable[[Any], str]] = {
        "timeout": format_duration, "ttl": format_duration, "backoff_base": format_duration,
        "backoff_cap": format_duration, "jitter": format_duration, "memory": lambda v: format_size(int(v)),
        "cpus": lambda v: f"{v:g}", "network": lambda v: "on" if v else "off"}
    cells = []
    for r in rows:
        cell = {k: ("-" if v is None else shown.get(k, str)(v)) + ("*" if k in r["set_in_file"] else "")
                for k, v in r.items() if k not in ("kind", "handler", "set_in_file")}
        cells.append(cell | {"kind": r["kind"], "handler": "yes" if r["handler"] else "MISSING"})
    _table(cells, ["kind", "handler", "tier", "interpreter", "batch_size", "batch_isolation", "concurrency", "rate"])
    click.echo("")
    _table(cells, ["kind", "timeout", "ttl", "max_attempts", "backoff_base", "backoff_cap", "jitter", "memory",
                   "cpus", "pids", "network"])
    if any(r["set_in_file"] for r in rows):
        click.echo(f"* set in {folder / 'fleetless.toml'}")
    _echo_without_handler(unhandled, folder)


@cli.group()
def schedule() -> None:
    """Periodic jobs: a cron expression in a time zone, and the job each occurrence enqueues."""


@schedule.command("add")
@click.argument("name")
@click.argument("kind")
@click.argument("payload_json", default="{}", metavar="PAYLOAD_JSON")
@click.option("--cron", required=True, help="Five fields, e.g. '*/5 * * * *' (cronsim syntax).")
@click.option("--timezone", default="UTC", show_default=True, help="IANA zone the expression is read in.")
@click.option("--queue", "queue_name", default="default", show_default=True)
@click.option("--max-attempts", type=int, default=None,
              help="[default: the kind's max_attempts in the drain's fleetless.toml, else 3]")
@click.option("--priority", type=int, default=0, show_default=True)
@click.option("--timeout", callback=_duration, help="The jobs' own timeout.")
@json_option
@click.pass_context
def schedule_add(ctx: click.Context, name: str, kind: str, payload_json: str, cron: str, timezone: str,
                 queue_name: str, max_attempts: int | None, priority: int, timeout: float | None,
                 as_json: bool) -> None:
    """Add (or change) schedule NAME: each occurrence of --cron enqueues KIND with PAYLOAD_JSON."""
    from .periodic import Schedule

    sched = Schedule(name=name, cron=cron, kind=kind, payload=parse_payload_json(payload_json),
                     timezone=timezone, queue=queue_name, max_attempts=max_attempts, priority=priority,
                     timeout_seconds=None if timeout is None else max(1, round(timeout)))
    q = _queue(ctx)
    created = q.add_schedule(sched)
    _, now = q.schedules()
    next_due = sched.next_after(now).isoformat()
    if as_json:
        _echo_json({"name": name, "created": created, "next": next_due})
    else:
        click.echo(f"schedule {name} {'added' if created else 'changed'}; next: {next_due}")


@schedule.command("list")
@json_option
@click.pass_context
def schedule_list(ctx: click.Context, as_json: bool) -> None:
    """Every schedule, its latest enqueued occurrence and the next one due."""
    rows = _insights(ctx).schedules()
    if as_json:
        _echo_json(rows)
    else:
        _table(rows, ["name", "cron", "timezone", "kind", "queue", "last", "next"])


@schedule.command("remove")
@click.argument("name")
@json_option
@click.pass_context
def schedule_remove(ctx: click.Context, name: str, as_json: bool) -> None:
    """Remove schedule NAME (jobs it already enqueued stay)."""
    _queue(ctx).remove_schedule(name)
    if as_json:
        _echo_json({"removed": name})
    else:
        click.echo(f"schedule {name} removed")


@cli.group("queue")
def queue_group() -> None:
    """Operate queues: pause and resume them, cap how many of their jobs run at once."""


def _concurrency(_: click.Context | None, param: click.Parameter | None, value: str | None) -> int | None:
    """--concurrency: a positive integer, or "none" for no limit."""
    if value is None or value.strip().lower() == "none":
        return None
    try:
        n = int(value)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a positive integer or 'none'") from None
    if n < 1:
        raise click.BadParameter(f"{value!r} is not a positive integer or 'none'")
    return n


def _echo_setting(setting: Any, as_json: bool, said: str) -> None:
    if as_json:
        _echo_json({"queue": setting.queue, "paused": setting.paused, "concurrency": setting.concurrency})
    else:
        click.echo(f"queue {setting.queue} {said}")


def _warn_unknown_queue(ctx: click.Context, name: str) -> None:
    """A queue no job has used and no setting names yet is often a typo: set anyway (a queue may be
    paused before its first job), but say so on stderr, with the names it may have meant."""
    import difflib

    from .job import validate_queue_name

    try:
        validate_queue_name(name)
    except ValueError:
        return  # the command itself says what is wrong with it
    known = [r["queue"] for r in _insights(ctx).queues()]
    if name in known:
        return
    close = difflib.get_close_matches(name, known, n=3)
    hint = (f" (did you mean {' or '.join(close)}?)" if close
            else f" (known: {', '.join(known[:10])})" if known else "")
    _say(logging.WARNING, f"queue {name} has no jobs yet{hint}; set anyway: "
                          f"'fleetless queue remove {name}' forgets it", queue=name)


@queue_group.command("remove")
@click.argument("name")
@json_option
@click.pass_context
def queue_remove(ctx: click.Context, name: str, as_json: bool) -> None:
    """Forget queue NAME's pause and concurrency (a misspelt one's): its jobs run as any queue's."""
    removed = _queue(ctx).remove_queue_settings(name)
    if as_json:
        _echo_json({"queue": name, "removed": removed})
    elif removed:
        click.echo(f"queue {name}: settings removed")
    else:
        _fail(f"queue {name} has no settings to remove")


@queue_group.command("list")
@json_option
@click.pass_context
def queue_list(ctx: click.Context, as_json: bool) -> None:
    """Every queue with jobs or settings: paused or running, its concurrency, its job counts."""
    rows = _insights(ctx).queues()
    if as_json:
        _echo_json(rows)
        return
    for r in rows:
        r["state"] = "paused" if r["paused"] else "running"
        r["concurrency"] = "-" if r["concurrency"] is None else r["concurrency"]
    _table(rows, ["queue", "state", "concurrency", "pending", "running", "done", "dead", "cancelled", "waiting"])


@queue_group.command("pause")
@click.argument("name")
@json_option
@click.pass_context
def queue_pause(ctx: click.Context, name: str, as_json: bool) -> None:
    """Pause queue NAME: no drain claims its jobs until it is resumed (running ones finish)."""
    _warn_unknown_queue(ctx, name)
    _echo_setting(_queue(ctx).pause_queue(name), as_json, "paused")


@queue_group.command("resume")
@click.argument("name")
@json_option
@click.pass_context
def queue_resume(ctx: click.Context, name: str, as_json: bool) -> None:
    """Resume queue NAME: its due jobs are claimed again at once."""
    _echo_setting(_queue(ctx).resume_queue(name), as_json, "resumed")


@queue_group.command("set")
@click.argument("name")
@click.option("--concurrency", callback=_concurrency, required=True, metavar="N|none",
              help="At most N of the queue's jobs running at once, across every drainer on every host"
                   " ('none': no limit).")
@json_option
@click.pass_context
def queue_set(ctx: click.Context, name: str, concurrency: int | None, as_json: bool) -> None:
    """Change queue NAME's settings."""
    _warn_unknown_queue(ctx, name)
    setting = _queue(ctx).set_queue_concurrency(name, concurrency)
    _echo_setting(setting, as_json, f"concurrency {'none' if concurrency is None else concurrency}")


@cli.command()
@click.pass_context
def metrics(ctx: click.Context) -> None:
    """Print the Prometheus metrics once (for a node-exporter textfile collector)."""
    from .metrics import render

    click.echo(render(_insights(ctx)).decode(), nl=False)


@cli.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=int, default=8484, show_default=True)
@click.option("--root-path", default="", help="URL prefix when served under a reverse proxy's sub-path.")
@logging_options
@click.pass_context
def serve(ctx: click.Context, host: str, port: int, root_path: str) -> None:
    """The web dashboard and /metrics. Actions need FLEETLESS_DASHBOARD_TOKEN; read-only without."""
    import os

    try:
        import uvicorn

        from .web import create_app
    except ImportError as exc:
        _fail(f"the dashboard needs the web extra: pip install 'fleetless[web]' ({exc.name} is missing)")
    token = os.environ.get("FLEETLESS_DASHBOARD_TOKEN") or None
    app = create_app(_queue(ctx), token=token)
    url = f"http://{host}:{port}{root_path}/"
    said = f"fleetless dashboard on {url} ({'actions need the token' if token else 'read-only'})"
    if ctx.obj["log_format"] == "json":  # a log record, so --log-format json keeps stderr all JSON
        logging.getLogger("fleetless.web").warning(
            "%s", said, extra={"fields": {"event": "serve_started", "url": url, "read_only": token is None}})
    else:
        click.echo(said, err=True)
    # log_config=None: uvicorn's own records go through fleetless's handler (text or JSON) too.
    config = uvicorn.Config(app, host=host, port=port, root_path=root_path, log_level="warning",
                            proxy_headers=True, log_config=None)
    server = uvicorn.Server(config)
    stopped_by: list[int] = []
    handle_exit = server.handle_exit

    def on_signal(sig: int, frame: FrameType | None) -> None:
        stopped_by.append(sig)
        handle_exit(sig, frame)

    server.handle_exit = on_signal  # type: ignore[method-assign]
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn raises the signal it caught again once it has shut down
        stopped_by.append(signal.SIGINT)
    if signal.SIGINT in stopped_by:
        sys.exit(130)  # Ctrl-C: the shell's convention, as drain and wait exit


@cli.command()
@click.option("--sandbox", type=click.Choice([AUTO, *available_backends()]), default=AUTO, show_default=True,
              envvar="FLEETLESS_SANDBOX",
              help="Isolation tier. auto: the fork server for a root drainer or one with a subordinate uid range, "
                   "else bwrap where it works on this host, else process [env FLEETLESS_SANDBOX].")
@click.option("--jobs", "n_jobs", type=int, default=12, show_default=True, help="Size of the burst.")
@json_option
@click.pass_context
def demo(ctx: click.Context, sandbox: str, n_jobs: int, as_json: bool) -> None:
    """Enqueue a burst of example jobs (one fails, one times out), drain them, show the outcome."""
    from . import demo as demo_mod
    from .embedded import EmbeddedPostgresError

    try:
        demo_mod.run(ctx.obj["dsn"], sandbox=sandbox, n_jobs=n_jobs, as_json=as_json)
    except EmbeddedPostgresError as exc:
        _fail(str(exc).strip().splitlines()[0])


@cli.command()
@click.option("--handlers", "handlers_dir", type=click.Path(path_type=Path, file_okay=False, exists=True),
              default=None, help="Also say, per tier, which kinds of this handlers directory a drain "
              "would run and which it would not claim (and why).")
@json_option
@click.pass_context
def doctor(ctx: click.Context, handlers_dir: Path | None, as_json: bool) -> None:
    """Which sandbox tiers work on this host, why not where they do not, and their start-up."""
    from . import doctor as doctor_mod

    if as_json:
        _echo_json(doctor_mod.check(handlers_dir))
    else:
        doctor_mod.run(handlers_dir)


@cli.group()
def microvm() -> None:
    """The microVM tier's guest image."""


@microvm.command("build-image")
@click.option("--force", is_flag=True, help="Rebuild even if cached.")
@click.option("--apt", "apt", multiple=True, metavar="PACKAGE",
              help="Add a Debian package (or a .deb file) to the guest, e.g. bash (repeatable).")
@click.option("--pip", "pip", multiple=True, metavar="REQUIREMENT",
              help="Add a Python requirement to the guest's python (repeatable).")
@click.option("--snapshot-memory", "snapshot_memory", multiple=True, type=int, metavar="MIB",
              default=(512,), show_default=True,
              help="Guest RAM of a snapshot to build with the image (repeatable; jobs with that "
                   "memory limit restore it instead of booting).")
@click.option("--snapshot-cpus", type=int, default=1, show_default=True,
              help="vCPUs of the snapshots.")
@click.option("--no-snapshot", is_flag=True, help="Build no snapshot (every job cold-boots).")
@json_option
def build_image(force: bool, apt: tuple[str, ...], pip: tuple[str, ...],
                snapshot_memory: tuple[int, ...], snapshot_cpus: int, no_snapshot: bool, as_json: bool) -> None:
    """Build and cache the guest kernel + initramfs, and a snapshot of the booted guest that
    each job restores. With --apt/--pip: an image of its own, beside the default one."""
    from .sandbox.microvm import image as microvm_image

    extras = microvm_image.Extras(apt=apt, pip=pip)
    path = microvm_image.build_image(force=force, extras=extras)
    if not as_json:
        click.echo(f"microvm image ready: {path}")
    snaps = []
    if not no_snapshot:
        for snap in microvm_image.build_snapshots(path, [(m, snapshot_cpus) for m in snapshot_memory]):
            snaps.append(str(snap))
            if not as_json:
                click.echo(f"microvm snapshot ready: {snap}")
    env = {"FLEETLESS_CACHE": str(path)} if extras else {}
    if as_json:
        _echo_json({"image": str(path), "snapshots": snaps, "drain_env": env})
    elif extras:
        click.echo(f"drain with it: FLEETLESS_CACHE={path} fleetless drain --sandbox microvm ...")


#: The group's options that take a value, accepted after the command too (``fleetless status
#: --database-url …``) unless that command has an option of the same name.
_GLOBAL_WITH_VALUE = ("--database-url", "--schema", "--log-format")
#: And its flags (``fleetless status -v``).
_GLOBAL_FLAGS = ("-v", "--verbose")


def _global_options_first(args: list[str]) -> list[str]:
    """``args`` with the group's ``--database-url``/``--schema``/``--log-format``/``-v`` moved in
    front of the command when given after it, as users of git, psql and kubectl type them. Nothing
    after ``--`` moves."""
    i = 0
    while i < len(args) and args[i].startswith("-"):  # the group's own options before the command
        i += 2 if args[i] in _GLOBAL_WITH_VALUE else 1
    if i >= len(args) or args[i] not in cli.commands:
        return args
    command = cli.commands[args[i]]
    own = {o for p in command.params for o in getattr(p, "opts", [])}
    front, rest, j = args[:i], [args[i]], i + 1
    while j < len(args):
        a = args[j]
        if a == "--":
            rest.extend(args[j:])
            break
        name = a.partition("=")[0]
        if a in _GLOBAL_FLAGS and a not in own:
            front.append(a)
        elif name in _GLOBAL_WITH_VALUE and name not in own:
            if "=" in a:
                front.append(a)
            else:
                front.extend(args[j:j + 2])
                j += 1
        else:
            rest.append(a)
        j += 1
    return front + rest


def main(argv: list[str] | None = None) -> None:
    """Entry point: click's parsing, but every error is a single line on stderr."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:  # bare `fleetless`: the help, as `fleetless --help` (git and psql answer so too), exit 0
        with click.Context(cli, info_name="fleetless") as ctx:
            click.echo(cli.get_help(ctx))
        sys.exit(0)
    try:
        cli.main(args=_global_options_first(args), prog_name="fleetless", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.Abort:
        click.echo("fleetless: aborted", err=True)
        sys.exit(130)
    except click.UsageError as exc:
        hint = f" (see 'fleetless {exc.ctx.command_path.partition(' ')[2]} --help')".replace("  ", " ") \
            if exc.ctx else ""
        _say(logging.ERROR, f"{exc.format_message()}{hint}", event="error", exit_code=2)
        sys.exit(2)
    except click.ClickException as exc:
        _say(logging.ERROR, exc.format_message(), event="error", exit_code=1)
        sys.exit(1)
    except (ValueError, JobNotFound, ConnectionError, DrainError, SandboxUnavailable, db.DatabaseError) as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if isinstance(exc, JobNotFound):
            message = str(exc.args[0])
        code = 3 if isinstance(exc, DrainError) else 1
        _say(logging.ERROR, message, event="error", exit_code=code)
        sys.exit(code)


if __name__ == "__main__":
    main()
