"""What commands print: -v lines per finished job, JSON logs, --json reports, error heads, the live view."""

from __future__ import annotations

import io
import json
import sys
from typing import Any

from rich.console import Console

from fleetless import Queue
from fleetless.events import JobFinished
from fleetless.job import Job
from fleetless.terminal import LiveReporter

HANDLERS = {
    "ok.py": "print('fine')",
    "bad.py": "def main():\n    raise ValueError('invoice 42 has no lines')\nmain()",
}
HEAD = "exit code 1: ValueError: invoice 42 has no lines"


def test_verbose_drain_logs_one_line_per_finished_job(dsn: str, queue: Queue, fleetless: Any, handlers: Any) -> None:
    h = handlers(**HANDLERS)
    ok, bad = queue.enqueue("ok", {}), queue.enqueue("bad", {}, max_attempts=1)
    quiet = fleetless("drain", "--handlers", str(h), dsn=dsn)
    assert quiet.returncode == 0 and "fleetless: job " not in quiet.stderr, quiet.stderr  # quiet without -v
    ok2, bad2 = queue.enqueue("ok", {}), queue.enqueue("bad", {}, max_attempts=1)
    r = fleetless("-v", "drain", "--handlers", str(h), dsn=dsn)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("fleetless: job ")]
    assert len(lines) == 2, r.stderr
    done = next(ln for ln in lines if f"job {ok2} " in ln)
    dead = next(ln for ln in lines if f"job {bad2} " in ln)
    assert done.startswith(f"fleetless: job {ok2} (ok) attempt 1: done in ") and done.endswith(" s on process")
    assert dead.startswith(f"fleetless: job {bad2} (bad) attempt 1: dead in ") and dead.endswith(f"on process: {HEAD}")
    assert ok and bad


def test_json_logs_are_one_object_per_event(dsn: str, queue: Queue, fleetless: Any, handlers: Any) -> None:
    h = handlers(**HANDLERS)
    bad = queue.enqueue("bad", {}, max_attempts=2)
    r = fleetless("-v", "--log-format", "json", "drain", "--handlers", str(h), "--json", dsn=dsn)
    assert r.returncode == 0, r.stderr
    events = [json.loads(ln) for ln in r.stderr.splitlines()]
    finished = [e for e in events if e.get("event") == "job_finished"]
    assert len(finished) == 1, events
    e = finished[0]
    assert (e["id"], e["kind"], e["attempt"], e["outcome"], e["tier"], e["error_head"], e["queue"]) == \
        (bad, "bad", 1, "failed", "process", HEAD, "default")  # the history's word (it said 'retried')
    assert 60 <= e["retry_in"] <= 150  # the default policy's first backoff: 2 min (+ jitter)
    assert e["duration"] > 0 and e["level"] == "info"
    import datetime as dt  # the time is UTC and says so: a shipper elsewhere reads it unambiguously
    logged = dt.datetime.fromisoformat(e["time"].replace("Z", "+00:00"))
    assert e["time"].endswith("Z") and abs((dt.datetime.now(dt.UTC) - logged).total_seconds()) < 600
    summary = json.loads(r.stdout)
    assert (summary["claimed"], summary["failed"], summary["retried"], summary["done"], summary["dead"]) == \
        (1, 1, 0, 0, 0)
    assert set(summary) >= {"released", "fenced_out", "reaped", "seconds"}


def test_v_and_log_format_after_the_command_work_as_before_it(dsn: str, queue: Queue, fleetless: Any,
                                                              handlers: Any, sql: Any) -> None:
    """`fleetless drain -v --handlers DIR`, as a new user types it, logs each job (it was 'No such
    option: -v': the flag was the group's only)."""
    h = handlers(**HANDLERS)
    ok = queue.enqueue("ok", {})
    r = fleetless("drain", "-v", "--handlers", str(h), dsn=dsn)
    assert r.returncode == 0, r.stderr
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("fleetless: job ")]
    assert line.startswith(f"fleetless: job {ok} (ok) attempt 1: done in "), r.stderr
    bad = queue.enqueue("bad", {}, max_attempts=1)
    r = fleetless("drain", "--handlers", str(h), "--log-format", "json", "--verbose", dsn=dsn)
    assert r.returncode == 0, r.stderr
    events = [json.loads(ln) for ln in r.stderr.splitlines()]  # (with -v also the drain's caps line)
    (e,) = [e for e in events if e.get("event") == "job_finished"]
    assert (e["event"], e["id"], e["outcome"], e["error_head"]) == ("job_finished", bad, "dead", HEAD)
    job_id = queue.enqueue("report", {})
    queue.claim(1)
    sql("UPDATE fleetless.jobs SET lease_expires_at = now() - interval '1 second'")
    r = fleetless("reap", "--log-format", "json", dsn=dsn)
    assert r.returncode == 0, r.stderr
    (event,) = [json.loads(line) for line in r.stderr.splitlines()]
    assert event["message"] == f"reaped job {job_id}: claim expired, now pending"


def test_under_json_logs_errors_and_warnings_are_json_objects_too(dsn: str, queue: Queue, fleetless: Any,
                                                                   handlers: Any) -> None:
    """--log-format json keeps stderr all JSON: a drain's one-line error and enqueue's warning
    were plain text among the JSON records."""
    h = handlers(**HANDLERS)
    r = fleetless("--log-format", "json", "drain", "--handlers", str(h / "nope"), dsn=dsn)
    assert r.returncode == 3, r.stderr
    events = [json.loads(line) for line in r.stderr.splitlines()]
    assert events[-1]["level"] == "error" and events[-1]["event"] == "error" and events[-1]["exit_code"] == 3
    assert events[-1]["message"].startswith("handlers directory ") and "does not exist" in events[-1]["message"]
    r = fleetless("--log-format", "json", "enqueue", "nothing-here", "{}", "--handlers", str(h), dsn=dsn)
    assert r.returncode == 0, r.stderr
    (warning,) = [json.loads(line) for line in r.stderr.splitlines()]
    assert warning["level"] == "warning" and "no handler for kind 'nothing-here'" in warning["message"]
    r = fleetless("--log-format", "json", "drain", "--handlers", str(h), "--timeout", "0", dsn=dsn)
    (error,) = [json.loads(line) for line in r.stderr.splitlines()]
    assert (r.returncode, error["exit_code"], error["level"]) == (1, 1, "error"), r.stderr
    text = fleetless("drain", "--handlers", str(h / "nope"), dsn=dsn)  # text stays as it was
    assert text.stderr.splitlines()[-1].startswith("fleetless: error: handlers directory "), text.stderr


def test_jobs_shows_the_first_line_of_each_error(dsn: str, queue: Queue, fleetless: Any, handlers: Any,
                                                 sql: Any) -> None:
    h = handlers(**HANDLERS)
    queue.enqueue("bad", {}, max_attempts=1)
    assert fleetless("drain", "--handlers", str(h), dsn=dsn).returncode == 0
    text = fleetless("jobs", dsn=dsn).stdout
    assert "error_head" in text and HEAD in text and "Traceback" not in text
    (row,) = json.loads(fleetless("jobs", "--json", dsn=dsn).stdout)
    assert row["error_head"] == HEAD
    shown = fleetless("show", str(row["id"]), dsn=dsn).stdout
    assert f"last_error:\n  {HEAD}\n  Traceback (most recent call last):" in shown


def test_reporting_commands_answer_json_with_the_apis_field_names(dsn: str, queue: Queue, fleetless: Any,
                                                                   sql: Any) -> None:
    init = json.loads(fleetless("init", "--json", dsn=dsn).stdout)
    assert init == {"schema": "fleetless", "applied": []}
    job_id = json.loads(fleetless("enqueue", "report", "{}", "--json", dsn=dsn).stdout)["id"]
    assert sql("SELECT kind FROM fleetless.jobs WHERE id = %s", job_id) == [("report",)]
    queue.claim(1)
    sql("UPDATE fleetless.jobs SET lease_expires_at = now() - interval '1 second'")
    assert json.loads(fleetless("reap", "--json", dsn=dsn).stdout) == {"reaped": {str(job_id): "pending"}}
    queue.cancel(job_id)
    sql("UPDATE fleetless.jobs SET finished_at = now() - interval '30 days'")
    assert json.loads(fleetless("prune", "--json", dsn=dsn).stdout) == {"pruned": 1}


def test_run_now_delete_and_schedule_changes_answer_json_too(dsn: str, queue: Queue, fleetless: Any,
                                                              sql: Any) -> None:
    """Every command that reports takes --json (issue 10), also those that change one job or schedule."""
    job_id = queue.enqueue("report", {}, delay=3600)
    r = fleetless("run-now", str(job_id), "--json", dsn=dsn)
    assert r.returncode == 0 and json.loads(r.stdout) == {"run_now": job_id}, r.stderr
    queue.cancel(job_id)
    r = fleetless("delete", str(job_id), "--json", dsn=dsn)
    assert r.returncode == 0 and json.loads(r.stdout) == {"deleted": job_id}, r.stderr
    assert sql("SELECT count(*) FROM fleetless.jobs WHERE id = %s", job_id) == [(0,)]
    r = fleetless("schedule", "add", "nightly", "report", "{}", "--cron", "0 3 * * *", "--json", dsn=dsn)
    assert r.returncode == 0, r.stderr
    added = json.loads(r.stdout)
    assert added["name"] == "nightly" and added["created"] is True and added["next"].endswith("T03:00:00+00:00")
    r = fleetless("schedule", "remove", "nightly", "--json", dsn=dsn)
    assert r.returncode == 0 and json.loads(r.stdout) == {"removed": "nightly"}, r.stderr
    assert sql("SELECT count(*) FROM fleetless.schedules") == [(0,)]


def test_the_live_view_shows_counts_and_each_running_jobs_kind() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100, color_system=None)
    live = LiveReporter(console, tier="bwrap")
    job = Job(id=7, kind="render-invoice", payload_json="{}", attempts=1, max_attempts=3, claim_token=None)  # type: ignore[arg-type]
    live.claimed(job)
    live.claimed(Job(id=8, kind="thumbnail", payload_json="{}", attempts=1, max_attempts=3, claim_token=None))  # type: ignore[arg-type]
    live.finished(JobFinished(id=8, kind="thumbnail", queue="default", attempt=1, outcome="dead",
                              duration=0.5, tier="bwrap", error_head="exit code 1: \x1b[2Jboom"))
    snapshot = io.StringIO()
    Console(file=snapshot, width=100, color_system=None).print(live)
    live.close()
    text = snapshot.getvalue()
    assert "claimed 2" in text and "running 1" in text and "dead 1" in text and "on bwrap" in text
    assert "render-invoice" in text and "thumbnail" not in text.split("\n", 1)[1]
    assert "job 8 (thumbnail) attempt 1: dead in 0.5 s on bwrap: exit code 1: \\x1b[2Jboom" in out.getvalue()
    assert "\x1b[2J" not in out.getvalue()


def test_a_log_record_during_the_live_view_stays_above_it_and_logging_is_restored_after() -> None:
    """A Ctrl-C's "stopping; running jobs get 30 s" was written straight to stderr, where the
    view's next redraw erased it: the first Ctrl-C looked ignored for up to the shutdown grace."""
    import logging

    from fleetless.terminal import configure_logging

    out, after = io.StringIO(), io.StringIO()
    configure_logging(verbose=False, log_format="text", stream=sys.stderr)
    console = Console(file=out, force_terminal=True, width=100, color_system=None)
    live = LiveReporter(console, tier="process")
    logging.getLogger("fleetless.drainer").warning("SIGINT: stopping; running jobs get 30 s")
    live.close()
    assert "fleetless: SIGINT: stopping; running jobs get 30 s" in out.getvalue()
    handler = logging.getLogger().handlers[0]
    assert isinstance(handler, logging.StreamHandler) and handler.stream is sys.stderr
    handler.setStream(after)
    logging.getLogger("fleetless.drainer").warning("after")
    assert after.getvalue() == "fleetless: after\n"


def test_a_drain_on_a_terminal_shows_live_progress(dsn: str, queue: Queue, handlers: Any) -> None:
    import os
    import pty
    import subprocess
    import sys
    import threading

    h = handlers(**HANDLERS)
    queue.enqueue("ok", {})
    queue.enqueue("bad", {}, max_attempts=1)
    primary, secondary = pty.openpty()
    env = {**os.environ, "DATABASE_URL": dsn, "COLUMNS": "120", "TERM": "xterm"}
    proc = subprocess.Popen([sys.executable, "-m", "fleetless.cli", "drain", "--handlers", str(h)],
                            stdout=subprocess.PIPE, stderr=secondary, env=env)
    os.close(secondary)
    chunks: list[bytes] = []

    def read_terminal() -> None:  # concurrently, so the drain never blocks on a full terminal
        while True:
            try:
                chunk = os.read(primary, 65536)
            except OSError:  # EIO: the drain closed the terminal's last writer
                return
            if not chunk:
                return
            chunks.append(chunk)

    reader = threading.Thread(target=read_terminal)
    reader.start()
    out, _ = proc.communicate(timeout=240)
    reader.join(timeout=60)
    os.close(primary)
    assert proc.returncode == 0
    text = b"".join(chunks).decode(errors="replace")
    assert "claimed" in text and "running" in text and "jobs/min" in text, text  # the live view
    assert "(bad) attempt 1: dead in" in text and HEAD in text  # failed jobs printed above it
    assert out.decode().startswith("drained: claimed 2, done 1, failed 0, dead 1")


def test_jobs_and_show_cannot_let_job_output_drive_the_terminal(dsn: str, queue: Queue, fleetless: Any) -> None:
    evil = "\x1b]0;pwned\x07\x1b[2J\rexit code 1: ValueError: \x1b[31mred\x1b[0m"
    queue.enqueue("bad", {"note": "\x1b[5mblink"}, max_attempts=1)
    (job,) = queue.claim(1)
    queue.fail(job, evil + "\nTraceback …", delay=0, result="partial \x1b]52;c;cHduZWQ=\x07 output")
    listed = fleetless("jobs", dsn=dsn).stdout
    shown = fleetless("show", str(job.id), dsn=dsn).stdout
    for text in (listed, shown):
        assert "\x1b" not in text and "\x07" not in text and "\r" not in text, repr(text)
    assert "\\x1b]0;pwned\\x07\\x1b[2J\\x0dexit code 1: ValueError:" in listed
    assert "partial \\x1b]52;c;cHduZWQ=\\x07 output" in shown and "\\u001b[5mblink" in shown


def test_the_reaper_logs_json_objects_too(dsn: str, queue: Queue, fleetless: Any, sql: Any) -> None:
    job_id = queue.enqueue("report", {})
    queue.claim(1)
    sql("UPDATE fleetless.jobs SET lease_expires_at = now() - interval '1 second'")
    r = fleetless("--log-format", "json", "reap", dsn=dsn)
    assert r.returncode == 0, r.stderr
    (event,) = [json.loads(line) for line in r.stderr.splitlines()]
    assert event["level"] == "warning" and event["message"] == f"reaped job {job_id}: claim expired, now pending"


def test_doctor_answers_json(fleetless: Any) -> None:
    import sys
    import tempfile
    from pathlib import Path

    from fleetless.sandbox import Template, available_backends, get_backend

    r = fleetless("doctor", "--json", timeout=600)  # probes every tier, the microVM under TCG too
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["python"] and report["python_startup_ms"] > 0
    assert [t["name"] for t in report["tiers"]] == list(available_backends())
    assert all(isinstance(t["ok"], bool) and isinstance(t["detail"], str) for t in report["tiers"])
    assert any(t["ok"] for t in report["tiers"] if t["name"] == "process")
    # It names the interpreter each tier's drain runs .py handlers with, the drain's own choice: a
    # root drainer whose venv is under /root still runs it where the tier binds it back (doctor
    # said /usr/bin/python3 and warned that the jobs cannot reach the venv while drains used it).
    with tempfile.TemporaryDirectory() as tmp:
        expected = {name: get_backend(name).handler_python(Template(handlers_dir=Path(tmp)))
                    for name in ("process", "bwrap") if name in available_backends()}
    tiers = {t["name"]: t for t in report["tiers"]}
    assert report["python"] == expected["process"], (report["python"], expected)
    for name, python in expected.items():
        assert not tiers[name]["ok"] or tiers[name]["python"] == python, (tiers[name], python)
    if report["python"] == sys.executable:
        assert "cannot reach it" not in r.stderr, r.stderr
