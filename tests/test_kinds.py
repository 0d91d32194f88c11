"""Per-kind settings in fleetless.toml next to the handlers: read and checked before anything is
claimed, applied by real drains (job options win over the kind, the kind over the drain's flags),
listed by `fleetless kinds`, and used by `fleetless enqueue --handlers`."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from fleetless import Queue
from fleetless.drainer import DrainConfig, Drainer, DrainError
from fleetless.kinds import KindSettings, Rate, SettingsError, load
from fleetless.retry import RetryPolicy
from fleetless.sandbox import Template, choose_tier
from fleetless.sandbox.process import ProcessSandbox

pytestmark = pytest.mark.usefixtures("private_workdir")

#: Not the drain's default (/usr/bin/python3) and usable by the unprivileged uid a root drainer's
#: jobs run as (a venv under a private home may not be).
INTERPRETER = os.path.realpath("/usr/bin/python3")


def settings_file(folder: Path, text: str) -> Path:
    (folder / "fleetless.toml").write_text(textwrap.dedent(text).lstrip())
    return folder


def test_the_settings_file_is_read_with_units(handlers, tmp_path: Path) -> None:
    h = settings_file(handlers(), """
        [kinds.render-invoice]
        timeout = "2m"
        ttl = 1800
        backoff_base = "30s"
        backoff_cap = "1h"
        jitter = 0
        memory = "1G"
        cpus = 2
        pids = 256
        network = true
        interpreter = "/usr/bin/python3"
        max_attempts = 5
        tier = "bwrap"
        batch_size = 50
        batch_isolation = "shared"
        concurrency = 5
        rate = "100/min"
        [kinds.b]
        rate = "20/10s"
        [kinds.c]
        rate = "5/s"
    """)
    assert load(h) == {"render-invoice": KindSettings(
        timeout=120.0, ttl=1800.0, backoff_base=30.0, backoff_cap=3600.0, jitter=0.0, memory=1024**3, cpus=2.0,
        pids=256, network=True, interpreter="/usr/bin/python3", max_attempts=5, tier="bwrap", batch_size=50,
        batch_isolation="shared", concurrency=5, rate=Rate(100, 60.0)),
        "b": KindSettings(rate=Rate(20, 10.0)), "c": KindSettings(rate=Rate(5, 1.0))}
    assert load(tmp_path) == {}  # no file: no settings


@pytest.mark.parametrize(("text", "error"), [
    ("[kinds.a]\ntimout = 5\n", "[kinds.a] timout: unknown key, did you mean timeout? (known: backoff_base, "),
    ("[kinds.a]\nzzz = 5\n", "[kinds.a] zzz: unknown key (known: backoff_base, "),  # nothing close: no guess
    ("[kinds.a]\ntimeout = \"soon\"\n", "[kinds.a] timeout: invalid duration 'soon'"),
    ("[kinds.a]\ntimeout = -1\n", "[kinds.a] timeout: must be positive, not -1"),
    ("[kinds.a]\nnetwork = \"yes\"\n", "[kinds.a] network: true or false, not 'yes'"),
    ("[kinds.a]\nmax_attempts = 0\n", "[kinds.a] max_attempts: an integer from 1 to 1000, not 0"),
    ("[kinds.a]\nconcurrency = 0\n", "[kinds.a] concurrency: an integer from 1 to 100000, not 0"),
    ("[kinds.a]\nrate = \"fast\"\n", "[kinds.a] rate: a rate such as \"100/min\", \"5/s\" or \"20/10s\", not 'fast'"),
    ("[kinds.a]\nrate = \"10/fortnight\"\n", "[kinds.a] rate: a rate such as"),
    ("[kinds.a]\nrate = \"0/min\"\n", "[kinds.a] rate: from 1 to 1000000 jobs per window"),
    ("[kinds.a]\ntier = \"docker\"\n", "[kinds.a] tier: one of bwrap, "),
    ("[kinds.a]\nbatch_size = 1.5\n", "[kinds.a] batch_size: an integer from 1 to 100000, not 1.5"),
    ("[kinds.a]\nbatch_isolation = \"none\"\n", "[kinds.a] batch_isolation: \"process\" (each job a process"
     " of its own) or \"shared\" (the batch's jobs in one process: trusted code only), not 'none'"),
    ("[kinds.a]\nbatch_isolation = true\n", "[kinds.a] batch_isolation: \"process\" "),
    ("[kinds.A]\ntimeout = 1\n", "[kinds.A]: invalid job kind 'A'"),
    ("[drain]\nbatch = 5\n", "unknown table or key 'drain'"),
    ("[kinds.a\n", "not valid TOML"),
])
def test_bad_settings_are_one_line_errors_naming_file_kind_and_key(handlers, text: str, error: str) -> None:
    h = settings_file(handlers(), text)
    with pytest.raises(SettingsError) as err:
        load(h)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{h}/fleetless.toml: ") and error in message, message


def test_a_misspelt_schedule_key_is_named_with_the_one_it_may_mean(handlers) -> None:
    from fleetless.kinds import load_schedules

    h = settings_file(handlers(), "[schedules.s]\ncron = '* * * * *'\nkind = 'a'\ntimezon = 'UTC'\n")
    with pytest.raises(SettingsError) as err:
        load_schedules(h)
    assert "[schedules.s] timezon: unknown key, did you mean timezone? (known: cron, " in str(err.value), err


def test_a_bad_settings_file_stops_the_drain_before_it_claims(queue: Queue, sql, handlers) -> None:
    h = settings_file(handlers(**{"a.py": "print(1)"}), "[kinds.a]\ntimeout = 'never'\n")
    queue.enqueue("a", {})
    with pytest.raises(DrainError, match=r"fleetless.toml: \[kinds.a\] timeout: invalid duration"):
        Drainer(queue, DrainConfig(handlers_dir=h)).run()
    bad_python = settings_file(h, "[kinds.a]\ninterpreter = '/nonexistent/python3'\n")
    with pytest.raises(DrainError, match=r"\[kinds.a\] interpreter"):
        Drainer(queue, DrainConfig(handlers_dir=bad_python)).run()
    assert sql("SELECT status, attempts FROM fleetless.jobs") == [("pending", 0)]


def test_a_kinds_timeout_beats_the_drains_and_a_jobs_own_beats_the_kinds(queue: Queue, sql, handlers) -> None:
    h = settings_file(handlers(**{"slow.py": "import time; time.sleep(3); print('slept')"}),
                      "[kinds.slow]\ntimeout = 1\n")
    killed = queue.enqueue("slow", {}, max_attempts=1)
    allowed = queue.enqueue("slow", {}, max_attempts=1, timeout=60)
    Drainer(queue, DrainConfig(handlers_dir=h, concurrency=2, timeout=600)).run()
    assert sql("SELECT id, status, left(last_error, 30) FROM fleetless.jobs ORDER BY id") == [
        (killed, "dead", "killed: timeout after 1 s"), (allowed, "done", None)]


def test_a_kinds_backoff_beats_the_drains(queue: Queue, sql, handlers) -> None:
    h = settings_file(handlers(**{"flaky.py": "raise SystemExit(1)", "other.py": "raise SystemExit(1)"}),
                      "[kinds.flaky]\nbackoff_base = 0\njitter = 0\n")
    queue.enqueue("flaky", {})
    queue.enqueue("other", {})
    Drainer(queue, DrainConfig(handlers_dir=h, retry=RetryPolicy(base_seconds=3600, max_jitter_seconds=0))).run()
    waits = dict(sql("SELECT kind, extract(epoch FROM run_after - now())::int FROM fleetless.jobs"))
    assert waits["flaky"] <= 0 and waits["other"] > 7000  # 2^1 x 3600 s for the drain's policy


def test_a_kinds_one_second_backoff_is_not_stretched_by_the_default_jitter(handlers) -> None:
    """Issue 28 papercut: ``backoff_base = "1s"`` in fleetless.toml waited up to 30 s (the default
    jitter); the jitter scales with the backoff, so a first retry is due in 2 to 2.5 s."""
    h = settings_file(handlers(**{"flaky.py": "raise SystemExit(1)"}), '[kinds.flaky]\nbackoff_base = "1s"\n')
    policy = load(h)["flaky"].retry(RetryPolicy())
    delays = [policy.delay(1) for _ in range(1000)]
    assert min(delays) >= 2 and max(delays) <= 2.5, (min(delays), max(delays))


def test_a_kinds_interpreter_and_longer_timeout_are_used_and_its_lease_covers_it(queue: Queue, sql,
                                                                              handlers) -> None:
    h = settings_file(handlers(**{"which.py": "import sys; print(sys.executable)"}),
                      f"[kinds.which]\ninterpreter = {json.dumps(INTERPRETER)}\ntimeout = '2h'\nttl = '3h'\n")
    queue.enqueue("which", {})
    Drainer(queue, DrainConfig(handlers_dir=h)).run()
    assert sql("SELECT status, result FROM fleetless.jobs") == [("done", INTERPRETER + "\n")]
    queue.enqueue("which", {})
    drainer = Drainer(queue, DrainConfig(handlers_dir=h, timeout=60))
    drainer._kinds = load(h)
    (claimed,) = drainer._claim(1)
    assert sql("SELECT extract(epoch FROM lease_expires_at - now()) > 7200 FROM fleetless.jobs WHERE id = %s",
               claimed.id) == [(True,)]


def test_cli_kinds_lists_handlers_with_effective_settings(fleetless, handlers) -> None:
    h = settings_file(handlers(**{"a.py": "", "b": "#!/bin/sh\n"}),
                      "[kinds.a]\ntimeout = '2m'\n[kinds.ghost]\npids = 9\nconcurrency = 3\nrate = '10/min'\n"
                      "tier = 'process'\nbatch_size = 20\nbatch_isolation = 'shared'\n")
    r = fleetless("kinds", "--handlers", str(h), "--json")
    assert r.returncode == 0, r.stderr
    rows = {row["kind"]: row for row in json.loads(r.stdout)}
    assert sorted(rows) == ["a", "b", "ghost"]
    assert (rows["a"]["handler"], rows["a"]["timeout"], rows["a"]["ttl"], rows["a"]["set_in_file"]) == (
        True, 120.0, 900, ["timeout"])
    assert (rows["b"]["timeout"], rows["b"]["set_in_file"]) == (600, [])
    assert all(type(r[k]) is float for r in rows.values() for k in ("timeout", "ttl", "jitter")), rows  # not 600, 120.0
    assert (rows["ghost"]["handler"], rows["ghost"]["pids"]) == (False, 9)
    assert [rows["ghost"][k] for k in ("concurrency", "rate", "tier", "batch_size")] == [3, "10/60s", "process", 20]
    assert [rows["a"][k] for k in ("concurrency", "rate", "batch_size")] == [None] * 3  # the drain's
    assert (rows["ghost"]["batch_isolation"], rows["a"]["batch_isolation"]) == ("shared", "process")
    assert rows["a"]["tier"] == choose_tier(os.environ["FLEETLESS_SANDBOX"])[0]  # the drain's, resolved as it does
    # the text: two tables under 120 columns (one was ~240), durations as fleetless.toml writes them
    # (a timeout read 600 beside 120.0), a value the file sets marked *
    text = fleetless("kinds", "--handlers", str(h), env={"FLEETLESS_SANDBOX": "process"}).stdout.splitlines()
    runs, limits = {line.split()[0]: line.split() for line in text[:4]}, {line.split()[0]: line.split()
                                                                           for line in text[5:9]}
    assert runs["kind"] == ["kind", "handler", "tier", "interpreter", "batch_size", "batch_isolation",
                            "concurrency", "rate"], text
    assert runs["ghost"] == ["ghost", "MISSING", "process*", "-", "20*", "shared*", "3*", "10/60s*"], text
    assert runs["a"][1:3] == ["yes", "process"] and runs["a"][4:] == ["-", "process", "-", "-"], text
    assert limits["kind"] == ["kind", "timeout", "ttl", "max_attempts", "backoff_base", "backoff_cap", "jitter",
                              "memory", "cpus", "pids", "network"], text
    assert limits["a"][1:] == ["2m*", "15m", "3", "1m", "7d", "30s", "512", "MiB", "1", "128", "off"], text
    assert limits["b"][1:3] == ["10m", "15m"] and limits["ghost"][-2:] == ["9*", "off"], text
    assert text[9:] == [f"* set in {h / 'fleetless.toml'}"], text
    assert max(len(line) for line in text[:9]) <= 120, text


def test_cli_kinds_shows_the_tier_and_interpreter_a_drain_would_use_for_each_kind(fleetless, handlers) -> None:
    """Not blanks where fleetless.toml is silent: the drain's --sandbox (and a kind's own tier), a .py
    handler's interpreter (the kind's, the drain's --python, else the tier's default), a script's #!."""
    h = settings_file(handlers(**{"plain.py": "", "own.py": "", "sh": "#!/bin/sh -e\n", "odd": "echo hi\n"}),
                      "[kinds.own]\ninterpreter = '/usr/bin/python3.11'\ntier = 'bwrap'\n")
    os.chmod(h / "odd", 0o755)
    r = fleetless("kinds", "--handlers", str(h), "--sandbox", "process", "--json")
    assert r.returncode == 0, r.stderr
    rows = {row["kind"]: row for row in json.loads(r.stdout)}
    tier_default = ProcessSandbox.handler_python(Template(handlers_dir=h))
    assert {k: (rows[k]["tier"], rows[k]["interpreter"]) for k in rows} == {
        "plain": ("process", tier_default), "own": ("bwrap", "/usr/bin/python3.11"),
        "sh": ("process", "/bin/sh -e"), "odd": ("process", "(no #! line)")}
    r = fleetless("kinds", "--handlers", str(h), "--sandbox", "process", "--python", "/usr/bin/python3", "--json")
    rows = {row["kind"]: row for row in json.loads(r.stdout)}
    assert (rows["plain"]["interpreter"], rows["own"]["interpreter"]) == ("/usr/bin/python3", "/usr/bin/python3.11")


def test_status_and_kinds_name_pending_kinds_with_no_handler_and_what_they_may_mean(
        dsn: str, queue: Queue, fleetless, handlers) -> None:
    """A misspelt kind was invisible (issue 28 review): `fleetless enqueue sendemail` exits 0 and the
    job is given back for ~15 minutes before it is dead. `status` and `kinds` given the handlers list
    each kind with pending jobs and no handler there, with the handlers it may be a misspelling of."""
    h = handlers(**{"send-email.py": "", "report.py": ""})
    queue.enqueue_many([("sendemail", {}), ("sendemail", {}), ("send-email", {}), ("zzz", {})])
    gone = queue.enqueue("gone", {})
    queue.cancel(gone)  # not pending: not listed
    line = f"no handler in {h} for kind sendemail (2 pending; did you mean send-email?)"
    r = fleetless("status", "--handlers", str(h), dsn=dsn)
    assert r.returncode == 0, r.stderr
    assert line in r.stdout.splitlines() and f"no handler in {h} for kind zzz (1 pending)" in r.stdout, r.stdout
    assert "kind gone" not in r.stdout and "kind send-email" not in r.stdout, r.stdout
    r = fleetless("status", "--handlers", str(h), "--json", dsn=dsn)
    assert json.loads(r.stdout)["no_handler"] == [{"kind": "sendemail", "pending": 2, "did_you_mean": ["send-email"]},
                                                  {"kind": "zzz", "pending": 1, "did_you_mean": []}], r.stdout
    assert "no_handler" not in json.loads(fleetless("status", "--json", dsn=dsn).stdout)  # no handlers: no claim
    r = fleetless("kinds", "--handlers", str(h), dsn=dsn)
    assert r.returncode == 0 and line in r.stdout.splitlines(), r
    rows = {row["kind"]: row for row in json.loads(fleetless("kinds", "--handlers", str(h), "--json", dsn=dsn).stdout)}
    assert sorted(rows) == ["report", "send-email", "sendemail", "zzz"], rows
    assert [rows["sendemail"][k] for k in ("handler", "pending", "did_you_mean")] == [False, 2, ["send-email"]]
    r = fleetless("kinds", "--handlers", str(h), "--json")  # no database given: the directory alone, as before
    assert r.returncode == 0 and sorted(row["kind"] for row in json.loads(r.stdout)) == ["report", "send-email"], r
    r = fleetless("status", "--handlers", str(h / "nope"), dsn=dsn)
    assert (r.returncode, r.stderr) == (1, f"fleetless: error: handlers directory {h / 'nope'} does not exist\n"), r


def test_cli_enqueue_of_a_misspelt_kind_says_which_it_may_have_meant_and_enqueues_it(
        dsn: str, queue: Queue, fleetless, handlers, sql) -> None:
    """Issue 28: `fleetless enqueue resise` was accepted without a word and the job died ~15
    minutes later. Where the CLI knows the handlers (--handlers, FLEETLESS_HANDLERS) it names the
    close ones; the job is still enqueued (a deploy may be adding its handler)."""
    h = handlers(**{"resize.py": "", "report.py": ""})
    for how in (["--handlers", str(h)], []):
        r = fleetless("enqueue", "resise", "{}", *how, env={"FLEETLESS_HANDLERS": str(h)}, dsn=dsn)
        assert r.returncode == 0 and r.stdout.strip().isdigit(), r
        assert r.stderr.startswith("fleetless: warning: no handler for kind 'resise' (did you mean resize?): "), r
    r = fleetless("enqueue", "zzz", "{}", "--handlers", str(h), dsn=dsn)  # nothing close: no guess
    assert "did you mean" not in r.stderr and "no handler for kind 'zzz': neither" in r.stderr, r.stderr
    assert sql("SELECT kind FROM fleetless.jobs ORDER BY id") == [("resise",), ("resise",), ("zzz",)]


def test_cli_enqueue_warns_about_a_kind_without_handler_and_leaves_max_attempts_to_the_kind(
        dsn: str, queue: Queue, fleetless, handlers, sql) -> None:
    h = settings_file(handlers(**{"a.py": ""}), "[kinds.a]\nmax_attempts = 7\n")
    r = fleetless("enqueue", "a", "{}", env={"FLEETLESS_HANDLERS": str(h)}, dsn=dsn)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    r = fleetless("enqueue", "a", "{}", "--max-attempts", "2", "--handlers", str(h), dsn=dsn)
    assert r.returncode == 0 and r.stderr == ""
    r = fleetless("enqueue", "nobody", "{}", "--handlers", str(h), dsn=dsn)
    assert r.returncode == 0
    assert r.stderr.strip() == (f"fleetless: warning: no handler for kind 'nobody': neither nobody.py nor"
                                f" an executable nobody in {h}; a drain gives the job back until a drainer has one")
    # a file meant for it, misnamed (newcomer review: jobs/script-out.sh was kind 'script-out.sh')
    (h / "script-out.sh").write_text("#!/bin/sh\necho hi\n")
    (h / "script-out.sh").chmod(0o755)
    (h / "plain").write_text("echo hi\n")
    r = fleetless("enqueue", "script-out", "{}", "--handlers", str(h), dsn=dsn)
    assert "(script-out.sh is there, but a handler's file name is the kind itself: rename it script-out.py," \
           " or script-out with its #! line and chmod +x, or enqueue kind 'script-out.sh')" in r.stderr, r.stderr
    r = fleetless("enqueue", "plain", "{}", "--handlers", str(h), dsn=dsn)
    assert "(plain is there but not executable: chmod +x it)" in r.stderr, r.stderr
    sql("DELETE FROM fleetless.jobs WHERE kind IN ('script-out', 'plain')")
    # 3 until a drain claims it; then the kind's (tests/test_kind_limits.py)
    assert sql("SELECT kind, max_attempts, max_attempts_default FROM fleetless.jobs ORDER BY id") == [
        ("a", 3, True), ("a", 2, False), ("nobody", 3, True)]
