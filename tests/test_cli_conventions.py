"""What a user of git, psql or any other Unix tool expects of fleetless's command line: help on a
bare command, options in any order, Ctrl-C's exit status, ISO timestamps, quiet success."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fleetless import Queue, RetryPolicy

from proctools import wait_for


def test_bare_fleetless_prints_its_help_not_an_error(fleetless: Any) -> None:
    r = fleetless()
    assert r.returncode == 0, r  # as `fleetless --help`: asking for nothing is not a mistake (it was 2)
    assert "Usage: fleetless" in r.stdout and "drain" in r.stdout and "fleetless: error" not in r.stderr + r.stdout


def test_the_database_and_schema_options_work_after_the_command(dsn: str, queue: Queue, fleetless: Any) -> None:
    queue.enqueue("report", {})
    for args in (["status", "--json", "--database-url", dsn], ["status", f"--database-url={dsn}", "--json"],
                 ["status", "--json", "--database-url", dsn, "--schema", "fleetless"]):
        r = fleetless(*args)
        assert r.returncode == 0, (args, r.stderr)
        assert json.loads(r.stdout)["by_status"]["pending"] == 1
    wrong = fleetless("status", "--schema", "nosuch", "--database-url", dsn)
    assert wrong.returncode == 1 and "schema nosuch is not initialised" in wrong.stderr


def test_v_and_log_format_work_after_every_command(dsn: str, queue: Queue, fleetless: Any) -> None:
    """As --database-url does: `status -v`, `jobs --log-format json` and `wait ID --log-format json`
    were "No such option" (newcomer review)."""
    job_id = queue.enqueue("report", {})
    for args in (["status", "-v", "--json"], ["jobs", "--log-format", "json"], ["status", "--log-format=json"],
                 ["queue", "list", "--verbose"], ["show", str(job_id), "-v"],
                 ["wait", str(job_id), "--timeout", "0.1", "--log-format", "json"]):
        r = fleetless(*args, dsn=dsn)
        assert "No such option" not in r.stderr and r.returncode in (0, 124), (args, r.stderr)


def test_json_timestamps_are_iso_8601_with_a_t(dsn: str, queue: Queue, fleetless: Any) -> None:
    job_id = queue.enqueue("report", {})
    shown = json.loads(fleetless("show", str(job_id), "--json", dsn=dsn).stdout)
    assert "T" in shown["created_at"] and " " not in shown["created_at"], shown["created_at"]


def test_every_json_report_writes_its_timestamps_with_a_t(dsn: str, queue: Queue, fleetless: Any) -> None:
    """Every --json report (a finished job's attempts, a list's rows, a schedule's next occurrence,
    a queue's settings, wait's answer), not only show's created_at."""
    job_id = queue.enqueue("report", {})
    (job,) = queue.claim(1)
    queue.fail(job, "boom", delay=0)
    (job,) = queue.claim(1)
    queue.complete(job, "ok")
    assert fleetless("queue", "pause", "default", dsn=dsn).returncode == 0
    assert fleetless("schedule", "add", "nightly", "report", "{}", "--cron", "0 2 * * *", dsn=dsn).returncode == 0
    stamps: list[str] = []

    def collect(value: Any) -> None:
        if isinstance(value, dict):
            for v in value.values():
                collect(v)
        elif isinstance(value, list):
            for v in value:
                collect(v)
        elif isinstance(value, str) and re.match(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d", value):
            stamps.append(value)

    for args in (["show", str(job_id)], ["jobs"], ["status"], ["queue", "list"], ["schedule", "list"],
                 ["wait", str(job_id)]):
        r = fleetless(*args, "--json", dsn=dsn)
        assert r.returncode == 0, (args, r.stderr)
        before = len(stamps)
        collect(json.loads(r.stdout))
        assert len(stamps) > before or args[0] in ("status", "queue"), (args, r.stdout)
    assert all("T" in s and " " not in s for s in stamps), [s for s in stamps if " " in s]


def test_lease_graces_help_states_its_floor(fleetless: Any) -> None:
    assert "at least 3 s" in " ".join(fleetless("drain", "--help").stdout.split())


def test_a_misspelt_status_is_a_usage_error_naming_the_one_it_may_mean(dsn: str, queue: Queue, fleetless: Any) -> None:
    """`jobs --status ded` exited 1 with the list alone; a bad option value is a usage error (exit 2,
    as click's own), and it names the close status (prune's --status list too)."""
    known = "one of pending, running, done, dead, cancelled, waiting"
    for args in (["jobs", "--status", "ded"], ["prune", "--status", "done,ded"]):
        r = fleetless(*args, dsn=dsn)
        assert (r.returncode, r.stdout) == (2, ""), r
        assert r.stderr == (f"fleetless: error: Invalid value for '--status': unknown status 'ded' (did you mean "
                            f"dead?); {known} (see 'fleetless {args[0]} --help')\n"), r.stderr
    r = fleetless("jobs", "--status", "zzz", dsn=dsn)
    assert r.returncode == 2 and "unknown status 'zzz'; one of" in r.stderr, r.stderr
    assert fleetless("jobs", "--status", "dead", dsn=dsn).returncode == 0
    r = fleetless("prune", "--status", "pending", dsn=dsn)  # a status, but not one prune deletes: as before
    assert (r.returncode, r.stderr) == (
        1, "fleetless: error: cannot prune status 'pending': only done, cancelled, dead\n"), r


def test_ctrl_c_winds_the_drain_down_and_exits_130(dsn: str, queue: Queue, handlers: Any, sql: Any,
                                                 tmp_path: Path) -> None:
    started = tmp_path / "started"
    h = handlers(**{"long.py": f"""
        import time
        open({str(started)!r}, "w").close()
        time.sleep(600)
    """})
    job_id = queue.enqueue("long", {})
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleetless.cli", "drain", "--handlers", str(h), "--shutdown-grace", "1"],
        env={**os.environ, "DATABASE_URL": dsn}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(started.exists, timeout=30, what="the job to start")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "1 released" in out
    assert sql("SELECT status, attempts FROM fleetless.jobs WHERE id = %s", job_id) == [("pending", 0)]


def test_ctrl_c_stops_serve_with_exit_130_as_drain_and_wait(dsn: str, queue: Queue) -> None:
    """It exited 0: a script running `fleetless serve` could not tell Ctrl-C from a clean end."""
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "fleetless.cli", "serve", "--port", str(port)],
                            env={**os.environ, "DATABASE_URL": dsn}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        def answers() -> bool:
            assert proc.poll() is None, proc.communicate()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    return bool(r.status == 200)
            except OSError:
                return False

        wait_for(answers, timeout=60, what="fleetless serve to answer")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err


def test_a_drain_on_the_usual_tier_says_nothing_about_it_but_a_misspelt_kind_is_warned_of(
        dsn: str, queue: Queue, handlers: Any, fleetless: Any) -> None:
    h = handlers(**{"report.py": "print('ok')",
                    "fleetless.toml": "[kinds.reprot]\ntimeout = \"5s\"\n"})
    queue.enqueue("report", {})
    r = fleetless("drain", "--handlers", str(h), dsn=dsn, env={"FLEETLESS_SANDBOX": ""})
    assert r.returncode == 0, r.stderr
    assert "(auto: it can create namespaces" not in r.stderr
    assert "[kinds.reprot] names no handler" in r.stderr and "(misspelt? did you mean report?)" in r.stderr


@pytest.mark.parametrize(("base", "most"), [(1.0, 2.5), (60.0, 150.0), (0.0, 0.0)])
def test_retry_jitter_scales_with_a_short_backoff(base: float, most: float) -> None:
    policy = RetryPolicy(base_seconds=base, max_jitter_seconds=30)
    delays = [policy.delay(1) for _ in range(500)]
    assert all(2 * base <= d <= most for d in delays), (min(delays), max(delays))


def test_an_older_schema_is_not_called_uninitialised_alone(dsn: str, queue: Queue, fleetless: Any, sql: Any) -> None:
    """A schema missing a later migration's table said only "not initialised" (re-audit of issue
    26): the line also names what is missing, so an operator sees an upgrade is due."""
    sql("DROP TABLE fleetless.queue_settings CASCADE")
    sql("DELETE FROM fleetless.migrations WHERE version >= 23")  # as a schema from before 023
    r = fleetless("queue", "list", dsn=dsn)
    assert r.returncode != 0
    assert "run 'fleetless init'" in r.stderr and ("queue_settings" in r.stderr or "migration" in r.stderr), r.stderr
    assert fleetless("init", dsn=dsn).returncode == 0
    assert fleetless("queue", "list", dsn=dsn).returncode == 0
