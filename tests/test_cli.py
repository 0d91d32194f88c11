"""The command line as an operator uses it: every command, --json, and one-line errors."""

from __future__ import annotations

import json
import os

import pytest

from fleetless import Queue


def one_line_error(result, fragment: str) -> None:  # type: ignore[no-untyped-def]
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("fleetless: error: ") and fragment in lines[0], lines[0]


def test_commands_without_a_database_say_they_need_one(fleetless) -> None:
    one_line_error(fleetless("status"), "no database given: set DATABASE_URL or pass --database-url")


def test_unreachable_database_is_one_line(fleetless) -> None:
    r = fleetless("status", "--json", dsn="postgresql://postgres@127.0.0.1:1/nope?connect_timeout=2")
    one_line_error(r, "cannot connect to the database")


@pytest.mark.parametrize("dsn", [
    "postgresql//app:hunter2-secret@127.0.0.1/app",  # a URL missing its colon: libpq quotes it back
    "host=127.0.0.1 password=hunter2-secret dbname=app bogus=1",
    "postgresql://app:hunter2-secret@127.0.0.1:5432:x/app",
])
def test_a_mistyped_database_url_is_never_printed_with_its_password(fleetless, dsn: str) -> None:
    r = fleetless("status", dsn=dsn)
    assert r.returncode != 0 and "hunter2" not in r.stderr + r.stdout, r.stderr
    assert r.stderr.startswith("fleetless: error: "), r.stderr


def test_init_enqueue_show_status_jobs(dsn: str, queue: Queue, fleetless, sql) -> None:
    assert "up to date" in fleetless("init", dsn=dsn).stdout
    r = fleetless("enqueue", "report", '{"month": "2026-11"}', "--max-attempts", "5", "--delay", "5m",
                  "--queue", "reports", "--priority", "3", "--timeout", "90s", dsn=dsn)
    assert r.returncode == 0, r.stderr
    job_id = int(r.stdout)
    row = sql("SELECT kind, payload, max_attempts, queue, priority, timeout_seconds,"
              " round(extract(epoch FROM run_after - created_at)) FROM fleetless.jobs WHERE id = %s", job_id)
    assert row == [("report", {"month": "2026-11"}, 5, "reports", 3, 90, 300)]
    from_stdin = fleetless("enqueue", "greet", "-", input='{"name": "stdin"}', dsn=dsn)
    assert sql("SELECT payload FROM fleetless.jobs WHERE id = %s", int(from_stdin.stdout)) == [({"name": "stdin"},)]
    shown = json.loads(fleetless("show", str(job_id), "--json", dsn=dsn).stdout)
    assert shown["kind"] == "report" and shown["status"] == "pending" and shown["payload"] == {"month": "2026-11"}
    assert "last_error" in shown and "result" in shown and "claim_token" in shown
    status = json.loads(fleetless("status", "--json", dsn=dsn).stdout)
    assert status["by_status"]["pending"] == 2 and status["by_kind"]["report"] == {"pending": 1}
    listed = json.loads(fleetless("jobs", "--kind", "greet", "--json", dsn=dsn).stdout)
    assert [j["kind"] for j in listed] == ["greet"]
    text = fleetless("jobs", "--status", "pending", dsn=dsn).stdout
    assert "report" in text and "greet" in text
    assert "pending 2" in fleetless("status", dsn=dsn).stdout


def test_run_after_needs_a_zone(dsn: str, queue: Queue, fleetless, sql) -> None:
    r = fleetless("enqueue", "a", "{}", "--run-after", "2030-01-01T00:00:00Z", dsn=dsn)
    assert r.returncode == 0, r.stderr
    one_line_error(fleetless("enqueue", "a", "{}", "--run-after", "2030-01-01T00:00:00", dsn=dsn),
                   "give a time zone")
    one_line_error(fleetless("enqueue", "a", "{}", "--run-after", "tomorrow", dsn=dsn), "invalid --run-after")


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["enqueue", "../etc/passwd", "{}"], "invalid job kind '../etc/passwd'"),
        (["enqueue", "A B", "{}"], "invalid job kind 'A B'"),
        (["enqueue", "", "{}"], "invalid job kind ''"),
        (["enqueue", "a", '{"x": }'], "invalid JSON payload: Expecting value at line 1 column 7"),
        (["enqueue", "a", '{"x": 1'], "invalid JSON payload: Expecting ',' delimiter"),
        (["enqueue", "a", "{}", "--max-attempts", "0"], "max_attempts must be an integer from 1 to 1000"),
        (["enqueue", "a", "{}", "--delay", "soon"], "invalid duration 'soon'"),
        (["enqueue", "a", "{}", "--priority", "x"], "'x' is not a valid integer"),
        (["enqueue", "a", "{}", "--queue", "a b"], "invalid queue name"),
        (["show", "999"], "no job with id 999"),
        (["show", "abc"], "'abc' is not a valid integer"),
        (["show", "1; DROP TABLE fleetless.jobs"], "is not a valid integer"),
        (["retry"], "give a JOB_ID or --all-dead"),
        (["cancel", "999"], "no job with id 999"),
        (["jobs", "--status", "weird"], "unknown status 'weird'"),
        (["drain", "--handlers", "/nonexistent"], "handlers directory /nonexistent does not exist"),
        (["drain", "--handlers", "/tmp", "--concurrency", "0"], "--concurrency must be from 1 to 4096"),
        # Out of range for PostgreSQL's timestamps: refused before anything is claimed (issue 14).
        (["drain", "--handlers", "/tmp", "--max-jitter", "1000000000d"], "jitter must be from 0 to 365 days"),
        (["drain", "--handlers", "/tmp", "--backoff-base", "1000000000d"], "backoff base must be from 0"),
        (["drain", "--handlers", "/tmp", "--ttl", "1000000000d"], "--ttl must be from 0 to 3650 days"),
        (["drain", "--handlers", "/tmp", "--lease-grace", "0"], "--lease-grace must be at least 3 s"),
        (["drain", "--handlers", "/tmp", "--batch", "100000"], "--batch must be from 1 to 10000"),
        (["drain", "--handlers", "/tmp", "--sandbox", "docker"], "'docker' is not one of"),
        (["drain", "--handlers", "/tmp", "--memory", "lots"], "invalid size 'lots'"),
        (["drain", "--handlers", "/tmp", "--pass-env", "1BAD"], "invalid --pass-env '1BAD'"),
        (["--schema", "x; drop", "status"], "invalid schema name"),
        # 45 characters: its waiters' channel fleetless_<schema>_finished would pass 63 bytes (issue 26)
        (["--schema", "s" * 45, "init"], "invalid schema name 'sssss"),
        (["--schema", "s" * 45, "status"], "(at most 44, so that its NOTIFY channels fit"),
        (["--schema", "s" * 45, "drain", "--handlers", "/tmp"], "invalid schema name"),
        (["nonsense"], "No such command 'nonsense'"),
    ],
)
def test_bad_input_gets_a_one_line_error_and_writes_nothing(dsn: str, queue: Queue, fleetless, sql,
                                                            args: list[str], fragment: str) -> None:
    one_line_error(fleetless(*args, dsn=dsn), fragment)
    assert sql("SELECT count(*) FROM fleetless.jobs") == [(0,)]


def test_an_uninitialised_schema_is_named(dsn: str, queue: Queue, fleetless) -> None:
    one_line_error(fleetless("--schema", "never_made", "status", dsn=dsn),
                   "schema never_made is not initialised: run 'fleetless init'")


def test_a_drain_exits_1_for_a_bad_value_and_3_when_it_cannot_start(dsn: str, queue: Queue, fleetless,
                                                                     handlers) -> None:
    """The exit codes deploy/kubernetes-cronjob.yaml's podFailurePolicy reads (docs/deploy.md): a
    bad flag value is 1 (the Job fails at once); an uninitialised schema or a missing handlers
    directory, found at run time, is 3 (the pod is replaced)."""
    h = handlers(**{"a.py": "print(1)"})
    bad = fleetless("drain", "--handlers", str(h), "--timeout", "0", dsn=dsn)
    assert bad.returncode == 1, bad.stderr
    never = fleetless("--schema", "never_made", "drain", "--handlers", str(h), dsn=dsn)
    assert never.returncode == 3 and "schema never_made is not initialised" in never.stderr, never.stderr
    missing = fleetless("drain", "--handlers", str(h / "nope"), dsn=dsn)
    assert missing.returncode == 3 and "does not exist" in missing.stderr, missing.stderr


def test_retry_cancel_reap_prune(dsn: str, queue: Queue, fleetless, sql) -> None:
    a = queue.enqueue("a", {}, max_attempts=1)
    b = queue.enqueue("b", {})
    (job,) = queue.claim(1)
    queue.fail(job, "boom", delay=0)
    assert fleetless("retry", str(a), dsn=dsn).stdout.strip() == "retried 1 job(s): 1"
    assert json.loads(fleetless("cancel", str(b), "--json", dsn=dsn).stdout) == {"cancelled": b}
    one_line_error(fleetless("cancel", str(b), dsn=dsn), f"job {b} is cancelled; only pending or running jobs")
    (job,) = queue.claim(1)
    sql("UPDATE fleetless.jobs SET locked_at = now() - interval '2 hours' WHERE id = %s", a)
    assert "reaped 0" in fleetless("reap", dsn=dsn).stdout
    assert "reaped 1" in fleetless("reap", "--older-than", "30m", dsn=dsn).stdout
    assert sql("SELECT status FROM fleetless.jobs WHERE id = %s", a) == [("dead",)]  # it had 2 of 2
    assert json.loads(fleetless("retry", "--all-dead", "--json", dsn=dsn).stdout) == {"retried": [a]}
    sql("UPDATE fleetless.jobs SET finished_at = now() - interval '30 days' WHERE id = %s", b)
    assert "pruned 1" in fleetless("prune", "--older-than", "7d", dsn=dsn).stdout


def test_drain_prints_a_one_line_summary(dsn: str, queue: Queue, fleetless, handlers) -> None:
    h = handlers(**{"ok.py": "print('fine')", "bad.py": "raise SystemExit(2)"})
    queue.enqueue("ok", {})
    queue.enqueue("bad", {}, max_attempts=1)
    r = fleetless("drain", "--handlers", str(h), dsn=dsn)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith("drained: claimed 2, done 1, failed 0, dead 1 in ")


def test_drain_defaults_to_auto_and_says_which_tier_it_chose_and_why(dsn: str, queue: Queue, fleetless,
                                                                       handlers) -> None:
    """No --sandbox: the strongest tier that works here without set-up, named in one line on stderr;
    --help shows the same default."""
    from fleetless.sandbox import choose_tier

    h = handlers(**{"ok.py": "print('fine')"})
    queue.enqueue("ok", {})
    r = fleetless("drain", "--handlers", str(h), dsn=dsn, env={"FLEETLESS_SANDBOX": ""})
    assert r.returncode == 0, r.stderr
    tier, note = choose_tier("auto")
    from fleetless.sandbox import _subuid

    fork = os.geteuid() == 0 or _subuid.delegation() is not None  # (and its probe: test_subuid_jobs.py)
    assert tier == (("forkserver" if fork else "bwrap") if _bwrap_works() else "process")
    # The usual choice is news only with -v; a fall-back to the process tier is always a warning.
    if tier in ("bwrap", "forkserver"):
        assert note not in r.stderr, r.stderr
        queue.enqueue("ok", {})
        r = fleetless("-v", "drain", "--handlers", str(h), dsn=dsn, env={"FLEETLESS_SANDBOX": ""})
    assert r.stderr.splitlines()[0] == f"fleetless: {note}"
    assert r.stdout.strip().startswith("drained: claimed 1, done 1,")
    explicit = fleetless("drain", "--handlers", str(h), "--sandbox", "process", dsn=dsn)
    assert explicit.returncode == 0 and "auto" not in explicit.stderr, explicit.stderr
    helptext = " ".join(fleetless("drain", "--help", env={"FLEETLESS_SANDBOX": ""}).stdout.split())
    assert "[auto|bwrap|forkserver|microvm|process]" in helptext and "[default: auto]" in helptext
    assert ("auto: the fork server for a root drainer or one with a subordinate uid range, else bwrap where it "
            "works on this host, else process") in helptext


def _bwrap_works() -> bool:
    from fleetless.sandbox import SandboxUnavailable, get_backend

    try:
        get_backend("bwrap").check()
    except SandboxUnavailable:
        return False
    return True


def test_auto_falls_back_to_process_and_says_why_bwrap_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    from fleetless.sandbox import bwrap, choose_tier

    monkeypatch.setattr(bwrap, "_probe_result", (None, "bwrap cannot create namespaces here: EPERM"))
    tier, note = choose_tier("auto")
    assert tier == "process"
    assert note.startswith("sandbox: process (auto: bwrap cannot run here: bwrap cannot create namespaces "
                           "here: EPERM);"), note
    assert choose_tier("microvm") == ("microvm", "")


def test_doctor_and_auto_say_which_network_process_tier_jobs_have(monkeypatch: pytest.MonkeyPatch) -> None:
    """Their own network namespace with only loopback where the kernel gives their supervisors
    namespaces (issue 25: not the host's 127.0.0.1, where its database listens); the host's network,
    said with why, where it refuses them or FLEETLESS_PROCESS_CONTAIN=0."""
    from fleetless.sandbox import bwrap, choose_tier, process

    own = ("each job has a network namespace of its own with only loopback (its 127.0.0.1 is not the host's), "
           "the host's network only for kinds with network = true")
    assert process.ProcessSandbox.describe().endswith(f"; {own}")
    monkeypatch.setattr(bwrap, "_probe_result", (None, "bwrap cannot create namespaces here: EPERM"))
    if process.isolation_gap() is None:  # (auto runs the process tier only where it keeps jobs apart)
        assert f"; {own}: see docs/isolation.md" in choose_tier("auto")[1]
    monkeypatch.setattr(process, "_namespaces_ok", False)
    monkeypatch.setattr(process, "_own_userns_ok", False)
    shared = "jobs share the host's network, its 127.0.0.1 (the database) too"
    assert process.ProcessSandbox.describe().endswith(
        f"; {shared}: the kernel refuses its supervisors new namespaces here")
    monkeypatch.setenv(process.CONTAIN_ENV, "0")
    assert process.ProcessSandbox.describe().endswith(f"; {shared}: {process.CONTAIN_ENV}=0")


def test_show_prints_a_handle_result_as_json(dsn: str, queue: Queue, fleetless) -> None:
    from fleetless.completer import Completer
    from fleetless.job import Outcome

    queue.enqueue("k", {})
    job = queue.claim(1)[0]
    completer = Completer(queue)
    completer.add(job, Outcome("done", result_json='{"total": 3, "names": ["a"]}'))
    completer.flush()
    out = fleetless("show", str(job.id), dsn=dsn).stdout
    assert 'result_json: {"names": ["a"], "total": 3}' in out
    shown = json.loads(fleetless("show", str(job.id), "--json", dsn=dsn).stdout)
    assert shown["result_json"] == {"names": ["a"], "total": 3} and shown["result"] is None


def test_retry_of_a_job_at_the_attempts_ceiling_is_refused_alone(dsn: str, queue: Queue, fleetless, sql) -> None:
    """GREATEST(max_attempts, attempts + 1) would break the table's CHECK (at most 1000) and make
    `retry --all-dead` retry nothing; the job at the ceiling is named instead, the others proceed."""
    stuck = queue.enqueue("a", {}, max_attempts=1000)
    other = queue.enqueue("a", {}, max_attempts=1)
    sql("UPDATE fleetless.jobs SET status = 'dead', attempts = max_attempts")
    r = fleetless("retry", str(stuck), dsn=dsn)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        f"fleetless: error: job {stuck} already used 1000 attempts, the most a job can have (1000);"
        " enqueue it again instead"]
    r = fleetless("retry", "--all-dead", dsn=dsn)
    assert r.returncode == 0 and r.stdout.strip() == f"retried 1 job(s): {other}", r
    assert f"job {stuck} not retried" in r.stderr
    assert sql("SELECT id, status FROM fleetless.jobs ORDER BY id") == [(stuck, "dead"), (other, "pending")]


def test_jobs_pages_with_a_cursor(dsn: str, queue: Queue, fleetless) -> None:
    ids = queue.enqueue_many([("a", {"i": i}) for i in range(7)])
    seen = []
    before: list[str] = []
    while True:
        page = json.loads(fleetless("jobs", "--limit", "3", "--json", *before, dsn=dsn).stdout)
        if not page:
            break
        seen += [row["id"] for row in page]
        before = ["--before", str(page[-1]["id"])]
    assert seen == ids[::-1]


def test_auto_does_not_fall_back_to_a_process_tier_that_cannot_keep_jobs_apart(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 25, item 4: where bwrap cannot run and the process tier could not give jobs a uid of
    their own swept at its end (a non-root drainer without a subordinate range), ``auto`` refuses
    in one line naming the explicit choice; ``--sandbox process`` still runs."""
    from fleetless.sandbox import SandboxUnavailable, _hostuid, _subuid, bwrap, choose_tier

    monkeypatch.setattr(bwrap, "_probe_result", (None, "bwrap cannot create namespaces here: EPERM"))
    monkeypatch.setattr(_hostuid, "needed", lambda: False)
    monkeypatch.setattr(_subuid, "_cache", (None, "add a line me:FIRST:65536 in /etc/subuid"))
    with pytest.raises(SandboxUnavailable) as caught:
        choose_tier("auto")
    line = str(caught.value)
    assert "\n" not in line and "pass --sandbox process" in line and "/etc/subuid" in line, line
    assert choose_tier("process") == ("process", "")
