"""Handlers that decide their own outcome (issue 28): a ``handle()`` raising ``fleetless.outcomes``'
Discard, Snooze or Retry, a script exiting 90, 91 or 92, in per-job and batch mode, on the real
sandboxes, each outcome asserted in the jobs table and the attempt history. A bad value fails the
attempt with a one-line error; no job is lost.

The contract runs on process, bwrap and forkserver; on the microVM (a kernel per sandbox under
emulation) the whole matrix too, per-job and batch (about 20 s here), and a smoke case: its guest
python has no fleetless, so the batch runner's copy of ``fleetless.outcomes`` is what the handler
imports there."""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fleetless import Queue
from fleetless.decisions import from_exit, from_handle
from fleetless.drainer import DrainConfig, Drainer, Summary
from fleetless.job import Outcome, Run
from fleetless.outcomes import MAX_SNOOZES, Discard, Retry, Snooze

pytestmark = pytest.mark.usefixtures("private_workdir")
SQL = Callable[..., list[Any]]

#: A handle() module: the payload says what it decides. "bad" gets past Snooze's own check (an
#: attribute set after the fact) so that the drainer's check of what the sandbox sent is what runs.
MODULE = """
    from fleetless.outcomes import Discard, Retry, Snooze

    def handle(payload):
        do = payload["do"]
        print("said by", do)
        if do == "discard":
            raise Discard("payload version 1 is no longer supported")
        if do == "snooze":
            raise Snooze(1000, reason="upstream not ready")
        if do == "retry":
            raise Retry(after=1000, reason="429 from upstream")
        if do == "retry_policy":
            raise Retry(reason="flaky")
        if do == "bad":
            e = Snooze(1)
            e.seconds = "soon"
            raise e
        if do == "negative":
            raise Snooze(-5)
        if do == "huge":
            e = Retry(after=1)
            e.after = 10**5000
            raise e
        return {"done": do}
"""

#: A script (no handle()): it decides by its exit code, the last line of stderr saying how long.
SCRIPT = """
    import json, sys
    do = json.load(open(sys.argv[1]))["do"]
    print("said by", do)
    codes = {"discard": (90, "payload version 1 is no longer supported"), "snooze": (91, "1000 upstream not ready"),
             "retry": (92, "1000 429 from upstream"), "bad": (91, "soon"), "negative": (91, "-5"),
             "huge": (92, "1e300")}
    if do in codes:
        code, line = codes[do]
        print("some noise first", file=sys.stderr)
        print(line, file=sys.stderr)
        sys.exit(code)
    print(json.dumps({"done": do}))
"""

CASES = ["discard", "snooze", "retry", "bad", "negative", "done"]


def _drain(dsn: str, h: Path, tier: str, per_sandbox: int) -> Summary:
    summary = Drainer(Queue(dsn), DrainConfig(handlers_dir=h, sandbox=tier, per_sandbox=per_sandbox, concurrency=2,
                                              timeout=300 if tier == "microvm" else 60)).run()
    assert summary.claimed >= 1
    return summary


def _row(sql: SQL, job_id: int) -> dict[str, Any]:
    rows = sql("SELECT status, attempts, snoozes, last_error, extract(epoch FROM run_after - now())::float8"
               " FROM fleetless.jobs WHERE id = %s", job_id)
    status, attempts, snoozes, error, due_in = rows[0]
    history = [tuple(r) for r in sql("SELECT attempt, outcome, exit_code, error_head FROM fleetless.job_attempts"
                                     " WHERE job_id = %s ORDER BY id", job_id)]
    return {"status": status, "attempts": attempts, "snoozes": snoozes, "error": error, "due_in": due_in,
            "history": history}


def _check(case: str, got: dict[str, Any], script: bool) -> None:
    """What each decision must leave in the table (max_attempts 3, one attempt run)."""
    hist = got["history"]
    assert len(hist) == 1, got
    _, outcome, exit_code, head = hist[0]
    if script:
        assert exit_code == {"discard": 90, "snooze": 91, "retry": 92, "bad": 91, "negative": 91,
                             "done": 0}[case], got
    if case == "discard":  # dead at once, attempts left or not
        assert (got["status"], got["attempts"], outcome) == ("dead", 1, "discarded"), got
        assert got["error"].startswith("discarded") and "payload version 1 is no longer supported" in got["error"]
    elif case == "snooze":  # pending after its delay, the attempt given back, counted
        assert (got["status"], got["attempts"], got["snoozes"], outcome) == ("pending", 0, 1, "snoozed"), got
        assert 900 < got["due_in"] <= 1000, got
        assert got["error"].startswith("snoozed for 1000 s") and "upstream not ready" in got["error"], got
    elif case == "retry":  # a failed attempt, due after the handler's own delay (not the backoff's)
        assert (got["status"], got["attempts"], got["snoozes"], outcome) == ("pending", 1, 0, "retried"), got
        assert 900 < got["due_in"] <= 1000, got
        assert got["error"].startswith("retry requested in 1000 s") and "429 from upstream" in got["error"], got
    elif case in ("bad", "negative"):  # a failure as any other: charged, the policy's backoff, one line
        assert (got["status"], got["attempts"], got["snoozes"], outcome) == ("pending", 1, 0, "failed"), got
        assert got["due_in"] < 900, got  # the default policy's first backoff: 2 min (+ jitter)
        first = got["error"].splitlines()[0]
        if script:
            assert first.startswith("exit code 91 (snooze) needs 'SECONDS [REASON]'"), first
        elif case == "bad":
            assert first.startswith("handle() raised Snooze with a bad delay: not a number"), first
        else:
            assert first.startswith("ValueError: Snooze seconds must be from 0"), first
        assert head.splitlines()[0] == first
    else:
        assert (got["status"], got["attempts"], outcome) == ("done", 1, "done"), got


@pytest.mark.parametrize("per_sandbox", [1, 4], ids=["per-job", "batch"])
@pytest.mark.parametrize("tier", ["process", "bwrap", "forkserver", "microvm"])
def test_each_decision_on_each_tier(queue: Queue, dsn: str, sql: SQL, handlers: Callable[..., Path],
                                    require_tier: Callable[[str], None], tier: str, per_sandbox: int) -> None:
    require_tier(tier)
    h = handlers(**{"mod.py": MODULE, "scr.py": SCRIPT})
    ids = {(kind, case): queue.enqueue(kind, {"do": case}, max_attempts=3)
           for kind in ("mod", "scr") for case in CASES}
    summary = _drain(dsn, h, tier, per_sandbox)
    for (kind, case), job_id in ids.items():
        _check(case, _row(sql, job_id), script=kind == "scr")
    # the history's words: 'retried' is a handler's Retry alone, a plain failure 'failed' (issue 28:
    # the summary said 'retried 6' for both)
    assert (summary.snoozed, summary.done, summary.dead, summary.retried, summary.failed) == (2, 2, 2, 2, 4), summary
    assert summary.discarded == 2, summary  # both dead jobs' handlers raised Discard
    assert ", failed 4, dead 2 (2 discarded), 2 retried, 2 snoozed" in summary.line(), summary.line()


def test_the_drain_log_says_failed_retried_or_discarded_as_the_history_does(dsn: str, queue: Queue, fleetless: Any,
                                                                   handlers: Callable[..., Path]) -> None:
    """Issue 28: `job 96 (resize) attempt 1: retried in 0.1 s …` for a plain failure, while show and
    /metrics said 'failed'. Now the line, --log-format json's outcome and the summary use the
    history's words, and say when the job is due again."""
    h = handlers(**{"mod.py": MODULE})
    retry, bad, done, discard = (queue.enqueue("mod", {"do": do}) for do in ("retry", "bad", "done", "discard"))
    r = fleetless("-v", "drain", "--handlers", str(h), "--sandbox", "process", dsn=dsn)
    assert r.returncode == 0, r.stderr
    lines = {int(m.group(1)): m.group(2) for m in re.finditer(r"^fleetless: job (\d+) \(mod\) attempt 1: (.*)$",
                                                               r.stderr, re.MULTILINE)}
    assert re.fullmatch(r"retried in [\d.]+ s on process, retry in 16\.7m: retry requested in 1000 s: "
                        r"429 from upstream", lines[retry]), lines
    assert re.fullmatch(r"failed in [\d.]+ s on process, retry in (1\.\d|2\.\d)m: handle\(\) raised Snooze with "
                        r"a bad delay: .*", lines[bad]), lines
    assert re.fullmatch(r"done in [\d.]+ s on process", lines[done]), lines
    # a Discard: dead in the table, 'discarded' in the history, and so in the line and the summary
    # (issue 28's newcomer: the drain said 'dead' where `fleetless show` said 'discarded')
    assert re.fullmatch(r"discarded in [\d.]+ s on process: discarded: .*", lines[discard]), lines
    assert r.stdout.startswith("drained: claimed 4, done 1, failed 1, dead 1 (1 discarded), 1 retried in "), r.stdout
    queue.run_now(retry)
    queue.run_now(bad)
    r = fleetless("--log-format", "json", "-v", "drain", "--handlers", str(h), "--sandbox", "process", dsn=dsn)
    events = {e["id"]: e for e in map(json.loads, r.stderr.splitlines()) if e.get("event") == "job_finished"}
    assert (events[retry]["outcome"], events[bad]["outcome"]) == ("retried", "failed"), events
    assert events[retry]["retry_in"] == 1000 and 100 < events[bad]["retry_in"] < 300, events  # 2nd backoff: 4 min


def test_a_snooze_is_fenced_by_its_claim_and_a_cancel_wins(queue: Queue, sql: SQL) -> None:
    """A snooze is written by the same fenced statement as every outcome: a claim reaped and taken
    over writes nothing (no snooze counted), and a job an operator cancelled while it ran ends
    cancelled, not pending."""
    fenced, cancelled = queue.enqueue("k", {}), queue.enqueue("k", {})
    jobs = {j.id: j for j in queue.claim(2)}
    sql("UPDATE fleetless.jobs SET claim_token = gen_random_uuid() WHERE id = %s", fenced)
    sql("UPDATE fleetless.jobs SET cancel_requested_at = now() WHERE id = %s", cancelled)
    snooze = Outcome("snooze", error="snoozed for 30 s", delay=30.0, decided="snooze", run=RUN)
    written = queue.finish_many([(jobs[fenced], snooze), (jobs[cancelled], snooze)])
    assert fenced not in written and written[cancelled] == "cancelled", written
    assert sql("SELECT status, attempts, snoozes FROM fleetless.jobs WHERE id = %s", fenced) == [("running", 1, 0)]
    assert sql("SELECT outcome FROM fleetless.job_attempts WHERE job_id = %s", fenced) == []
    assert sql("SELECT outcome FROM fleetless.job_attempts WHERE job_id = %s", cancelled) == [("cancelled",)]


def test_a_retry_on_the_last_attempt_is_dead_and_a_default_retry_backs_off(
        queue: Queue, dsn: str, sql: SQL, handlers: Callable[..., Path]) -> None:
    h = handlers(**{"mod.py": MODULE, "scr.py": SCRIPT})
    last = [queue.enqueue(kind, {"do": "retry"}, max_attempts=1) for kind in ("mod", "scr")]
    policy = queue.enqueue("mod", {"do": "retry_policy"}, max_attempts=3)
    huge = queue.enqueue("scr", {"do": "huge"}, max_attempts=3)
    huge_int = queue.enqueue("mod", {"do": "huge"}, max_attempts=3)
    _drain(dsn, h, "process", 1)
    for job_id in last:  # max_attempts still applies to a retry the handler asked for
        got = _row(sql, job_id)
        assert (got["status"], got["attempts"], got["history"][0][1]) == ("dead", 1, "dead"), got
    got = _row(sql, policy)
    assert (got["status"], got["history"][0][1]) == ("pending", "retried"), got  # the policy's delay, its decision
    assert got["due_in"] < 900 and got["error"].startswith("retry requested: flaky"), got
    got = _row(sql, huge)  # 1e300 s: out of range, a failure as any other
    assert (got["status"], got["attempts"], got["history"][0][1]) == ("pending", 1, "failed"), got
    assert "1e+300 s is out of range" in got["error"].splitlines()[0], got
    got = _row(sql, huge_int)  # an int no float holds, set on the exception after it was made
    assert (got["status"], got["attempts"], got["history"][0][1]) == ("pending", 1, "failed"), got
    assert got["error"].splitlines()[0] == ("handle() raised Retry with a bad delay: not a number of seconds:"
                                            " 'an integer too large'"), got


def test_a_retry_on_the_last_attempt_says_no_attempts_are_left_wherever_the_error_is_shown(
        queue: Queue, dsn: str, sql: SQL, handlers: Callable[..., Path], fleetless: Callable[..., Any]) -> None:
    """The dead job's error does not read as a retry to come: it begins "no attempts left (N/N); " in
    the table, the drain's line and event, `jobs --status dead`, `wait` and the job page, which
    shows it once (its history row keeps the request as the handler made it)."""
    h = handlers(**{"mod.py": MODULE, "scr.py": SCRIPT})
    mod, scr = (queue.enqueue(kind, {"do": "retry"}, max_attempts=1) for kind in ("mod", "scr"))
    r = fleetless("--log-format", "json", "-v", "drain", "--handlers", str(h), "--sandbox", "process", dsn=dsn)
    events = {e["id"]: e for e in map(json.loads, r.stderr.splitlines()) if e.get("event") == "job_finished"}
    heads = {mod: "no attempts left (1/1); retry requested in 1000 s: 429 from upstream",
             scr: "no attempts left (1/1); retry requested in 1000 s (exit code 92): 429 from upstream"}
    for job_id, head in heads.items():
        assert (events[job_id]["outcome"], events[job_id]["error_head"]) == ("dead", head), events  # the drain's line
        got = _row(sql, job_id)
        assert (got["status"], got["error"].splitlines()[0]) == ("dead", head), got
        assert got["history"][0][3].splitlines()[0] == head.removeprefix("no attempts left (1/1); "), got
        r = fleetless("wait", str(job_id), dsn=dsn)
        assert (r.returncode, r.stderr) == (4, f"fleetless: error: job {job_id} is dead: {head}\n"), r
    assert sql("SELECT last_error FROM fleetless.jobs WHERE id = %s", scr)[0][0].splitlines()[1:] == [
        "some noise first"]  # the script's stderr stays below the first line
    listed = fleetless("jobs", "--status", "dead", dsn=dsn)
    assert listed.returncode == 0 and listed.stdout.count("no attempts left (1/1); retry requested in 1000 s") == 2, \
        listed.stdout
    from starlette.testclient import TestClient

    from fleetless.web import create_app

    page = TestClient(create_app(queue)).get(f"/jobs/{mod}").text
    assert page.count(heads[mod]) == 1, page  # its Error section; the history row has the request alone


@pytest.mark.parametrize("per_sandbox", [1, 4], ids=["per-job", "batch"])
def test_snoozes_are_bounded(queue: Queue, dsn: str, sql: SQL, handlers: Callable[..., Path],
                             per_sandbox: int) -> None:
    """A job that has snoozed MAX_SNOOZES times: its next snooze is charged as a failed attempt
    (due after the snooze's delay), with an error saying so; on its last attempt it is dead."""
    h = handlers(**{"mod.py": MODULE, "scr.py": SCRIPT})
    ids = [queue.enqueue(kind, {"do": "snooze"}, max_attempts=m) for kind in ("mod", "scr") for m in (3, 1)]
    sql("UPDATE fleetless.jobs SET snoozes = %s", MAX_SNOOZES)
    _drain(dsn, h, "process", per_sandbox)
    for job_id, status in zip(ids, ["pending", "dead", "pending", "dead"], strict=True):
        got = _row(sql, job_id)
        assert (got["status"], got["attempts"], got["snoozes"]) == (status, 1, MAX_SNOOZES), got
        assert got["history"][0][1] == ("failed" if status == "pending" else "dead"), got
        assert got["error"].startswith(f"snoozed {MAX_SNOOZES} times already, the most a job may; charged"), got
        if status == "pending":
            assert 900 < got["due_in"] <= 1000, got


def test_show_and_the_job_page_name_the_decision(queue: Queue, dsn: str, handlers: Callable[..., Path],
                                                fleetless: Callable[..., Any]) -> None:
    h = handlers(**{"mod.py": MODULE})
    snoozed, discarded = queue.enqueue("mod", {"do": "snooze"}), queue.enqueue("mod", {"do": "discard"})
    _drain(dsn, h, "process", 1)
    out = fleetless("show", str(snoozed), dsn=dsn)
    assert out.returncode == 0 and "snoozed" in out.stdout and "\nsnoozes: 1\n" in out.stdout, out
    # one field line about snoozes: the count (a derived "snoozed: True/False" beside it read as a second count)
    assert [line for line in out.stdout.splitlines() if line.startswith("snooze")] == ["snoozes: 1"], out.stdout
    assert json.loads(fleetless("show", str(snoozed), "--json", dsn=dsn).stdout)["snoozed"] is True
    out = fleetless("show", str(discarded), "--json", dsn=dsn)
    assert out.returncode == 0, out
    assert "discarded" in out.stdout, out.stdout
    from starlette.testclient import TestClient

    from fleetless.web import create_app

    page = TestClient(create_app(queue)).get(f"/jobs/{discarded}")
    assert page.status_code == 200 and "<td>discarded</td>" in page.text, page.text
    assert '<span id="field-snoozes">1</span>' in TestClient(create_app(queue)).get(f"/jobs/{snoozed}").text
    assert "discarded: payload version 1 is no longer supported" in page.text
    from fleetless.insights import Insights

    minutes = Insights(queue).per_minute(hours=1)  # the dashboard's chart: a discard is a failure, a snooze neither
    assert sum(m["failed"] for m in minutes) == 1 and sum(m["done"] for m in minutes) == 0, minutes


def test_microvm_smoke(queue: Queue, dsn: str, sql: SQL, handlers: Callable[..., Path],
                       require_tier: Callable[[str], None]) -> None:
    """The guest's python has no fleetless: the handler imports the runner's copy of the module."""
    require_tier("microvm")
    h = handlers(**{"mod.py": MODULE, "scr.py": SCRIPT})
    snoozed, discarded = queue.enqueue("mod", {"do": "snooze"}), queue.enqueue("scr", {"do": "discard"})
    Drainer(Queue(dsn), DrainConfig(handlers_dir=h, sandbox="microvm", per_sandbox=1, concurrency=2,
                                    timeout=300)).run()
    _check("snooze", _row(sql, snoozed), script=False)
    _check("discard", _row(sql, discarded), script=True)


ORIGIN = """
    import fleetless, fleetless.outcomes
    from fleetless.outcomes import Snooze

    def handle(payload):
        if payload.get("snooze"):
            raise Snooze(1000, reason="upstream not ready")
        return {"origin": fleetless.outcomes.__spec__.origin, "package": getattr(fleetless, "__file__", None)}
"""


@pytest.mark.parametrize("older", [False, True], ids=["no-fleetless", "older-fleetless"])
def test_the_runner_serves_fleetless_outcomes_where_the_sandbox_python_has_none(
        queue: Queue, dsn: str, sql: SQL, handlers: Callable[..., Path], tmp_path: Path, older: bool) -> None:
    """A python without fleetless (the system's), or with a fleetless that has no outcomes module
    (an older release on PYTHONPATH): the handler imports the runner's copy, which works the same."""
    h = handlers(**{"orig.py": ORIGIN})
    env: tuple[str, ...] = ()
    if older:
        old = tmp_path / "old"
        (old / "fleetless").mkdir(parents=True)
        (old / "fleetless" / "__init__.py").write_text("OLD = True\n")
        for path in (old, old / "fleetless", old / "fleetless" / "__init__.py"):
            path.chmod(0o755)
        env = (f"PYTHONPATH={old}",)
    returned, snoozed = queue.enqueue("orig", {}), queue.enqueue("orig", {"snooze": True})
    Drainer(Queue(dsn), DrainConfig(handlers_dir=h, sandbox="process", python="/usr/bin/python3", pass_env=env,
                                    timeout=60)).run()
    result = sql("SELECT status, result_json FROM fleetless.jobs WHERE id = %s", returned)[0]
    assert result[0] == "done", result
    assert result[1]["origin"] == "fleetless-batch-runner", result
    assert (result[1]["package"] or "").endswith("old/fleetless/__init__.py") if older else result[1]["package"] is None
    _check("snooze", _row(sql, snoozed), script=False)


# -- the checks of what a sandbox sent, without a sandbox ---------------------------------------------

RUN = Run(tier="process")


@pytest.mark.parametrize(("seconds", "problem"), [
    ("soon", "not a number of seconds: 'soon'"), (-1, "-1 s is out of range"), (True, "not a number"),
    (float("nan"), "out of range"), (1e12, "out of range"), (10**400, "out of range"), (None, "not a number"),
    ([1], "not a number")])
def test_a_bad_snooze_from_handle_is_a_failure_in_one_line(seconds: object, problem: str) -> None:
    o = from_handle({"decided": "snooze", "seconds": seconds, "reason": "x"}, RUN, None, "")
    assert (o.action, o.permanent, o.decided) == ("fail", False, None)
    assert o.error is not None and "\n" not in o.error and problem in o.error, o.error


@pytest.mark.parametrize("rec", [{"decided": "explode"}, "snooze", None, {"decided": "retry", "seconds": "x"}])
def test_a_malformed_decision_is_a_failure(rec: Any) -> None:
    o = from_handle(rec, RUN, None, "")
    assert o.action == "fail" and not o.permanent and o.decided is None


HISTORY = """
    from fleetless.outcomes import Retry, Snooze

    def handle(payload):
        do = payload["do"]
        if do == "snooze":
            raise Snooze(1000, reason="upstream not ready")
        if do == "retry":
            raise Retry(after=1000, reason="429 from upstream")
        if do == "fail":
            raise ValueError("plain failure")
        return {"done": do}
"""


def test_the_history_tells_a_failure_from_a_retry_and_numbers_snoozes(
        queue: Queue, dsn: str, sql: SQL, handlers: Callable[..., Path], fleetless: Callable[..., Any]) -> None:
    """Issue 28 ("record each in the attempt history"): a plain failure is 'failed', a handler's
    Retry 'retried', in the table, show, show --json and the job page; a snooze gives its attempt
    back, so its row is labelled with the job's snooze count ("1 (snooze 2)"), not as attempt 1
    again and again. A row an older fleetless wrote ('retry') reads as 'failed'."""
    h = handlers(**{"hist.py": HISTORY})
    job = queue.enqueue("hist", {"do": "fail"}, max_attempts=5)
    for do in ("fail", "retry", "snooze", "snooze", "done"):  # one run per drain, each due at once
        sql("UPDATE fleetless.jobs SET payload = %s, run_after = now() WHERE id = %s", json.dumps({"do": do}), job)
        _drain(dsn, h, "process", 1)
    assert sql("SELECT attempt, outcome, snooze FROM fleetless.job_attempts WHERE job_id = %s ORDER BY id", job) == [
        (1, "failed", None), (2, "retried", None), (3, "snoozed", 1), (3, "snoozed", 2), (3, "done", None)]
    sql("INSERT INTO fleetless.job_attempts (job_id, attempt, outcome) VALUES (%s, 4, 'retry')", job)  # older drainer
    out = fleetless("show", str(job), dsn=dsn)
    assert out.returncode == 0, out
    table = out.stdout.split("attempts (6):\n", 1)[1].splitlines()
    assert [tuple(re.split(r"\s{2,}", line)[:2]) for line in table[1:]] == [
        ("1", "failed"), ("2", "retried"), ("3 (snooze 1)", "snoozed"), ("3 (snooze 2)", "snoozed"), ("3", "done"),
        ("4", "failed")], table
    assert [(a["attempt"], a["outcome"], a["snooze"]) for a in queue.attempts(job)] == [  # the Python read
        (1, "failed", None), (2, "retried", None), (3, "snoozed", 1), (3, "snoozed", 2), (3, "done", None),
        (4, "failed", None)]
    data = json.loads(fleetless("show", str(job), "--json", dsn=dsn).stdout)
    assert [(a["attempt"], a["outcome"], a["snooze"]) for a in data["attempts"]] == [
        (1, "failed", None), (2, "retried", None), (3, "snoozed", 1), (3, "snoozed", 2), (3, "done", None),
        (4, "failed", None)], data["attempts"]
    from starlette.testclient import TestClient

    from fleetless.web import create_app

    page = TestClient(create_app(queue)).get(f"/jobs/{job}").text
    # the two snoozes in a row are one row of the dashboard's history, opening to both (2d685cb)
    for cells in ("<td>1</td><td>failed</td>", "<td>2</td><td>retried</td>",
                  '<td>3 (snoozes 1-2)</td><td class="snoozed">snoozed</td>', "snoozed 2 times between",
                  "<td>3</td><td>done</td>", "<td>4</td><td>failed</td>"):
        assert cells in page.replace('<td class="n">', "<td>"), (cells, page)
    from fleetless.insights import Insights

    minutes = Insights(queue).per_minute(hours=1)  # failed, retried and the old 'retry' are failures
    assert sum(m["failed"] for m in minutes) == 3 and sum(m["done"] for m in minutes) == 1, minutes
    # /metrics' totals folded before migration 024 count their 'retry' as 'failed' too
    sql("INSERT INTO fleetless.attempt_totals (kind, outcome, bound, n, seconds) VALUES ('hist', 'retry', -1, 5, 0)")
    metrics = Insights(queue).metrics()
    assert sorted(metrics.finished) == [("hist", "done", 1), ("hist", "failed", 7), ("hist", "retried", 1),
                                        ("hist", "snoozed", 2)], metrics.finished


BIG = """
    def handle(payload):
        print("made it")
        return "x" * payload["n"]
"""


@pytest.mark.parametrize("per_sandbox", [1, 4], ids=["per-job", "batch"])
def test_a_result_past_the_cap_is_dead_at_once(queue: Queue, dsn: str, sql: SQL, handlers: Callable[..., Path],
                                               per_sandbox: int) -> None:
    """A handle() whose result is past 64 KiB of JSON would return as much on every try: dead on its
    first attempt, whatever attempts are left, with a one-line error naming the size and the cap;
    a result just under the cap is kept (its batch-mates unharmed)."""
    h = handlers(**{"big.py": BIG})
    big = queue.enqueue("big", {"n": 70000}, max_attempts=3)
    fits = queue.enqueue("big", {"n": 65536 - 2}, max_attempts=3)  # 65536 bytes with its quotes
    _drain(dsn, h, "process", per_sandbox)
    got = _row(sql, big)
    assert (got["status"], got["attempts"], [r[1] for r in got["history"]]) == ("dead", 1, ["dead"]), got
    assert "\n" not in got["error"] and "70002 bytes" in got["error"] and "65536" in got["error"], got["error"]
    assert "without retries" in got["error"], got["error"]
    assert sql("SELECT status, length(result_json #>> '{}') FROM fleetless.jobs WHERE id = %s", fits) == [
        ("done", 65534)]


NOT_JSON = """
    import datetime
    def handle(payload):
        return {"set": {1, 2}, "nan": float("nan"), "when": datetime.date(2026, 1, 1)}[payload["what"]]
"""


@pytest.mark.parametrize("per_sandbox", [1, 4], ids=["per-job", "batch"])
def test_a_result_json_cannot_hold_is_dead_at_once(queue: Queue, dsn: str, sql: SQL, handlers: Callable[..., Path],
                                                   per_sandbox: int) -> None:
    """A handle() returning a set, NaN or a date would return it on every try: dead on its first
    attempt with a one-line error naming what JSON could not hold (it was retried max_attempts
    times, each with a traceback)."""
    h = handlers(**{"odd.py": NOT_JSON})
    ids = {what: queue.enqueue("odd", {"what": what}, max_attempts=3) for what in ("set", "nan", "when")}
    _drain(dsn, h, "process", per_sandbox)
    for what, job_id in ids.items():
        got = _row(sql, job_id)
        assert got["history"], what
        assert (got["status"], got["attempts"], [r[1] for r in got["history"]]) == ("dead", 1, ["dead"]), got
        assert "\n" not in got["error"] and "JSON cannot hold" in got["error"], got["error"]
    assert "set" in _row(sql, ids["set"])["error"] and "date" in _row(sql, ids["when"])["error"]
    assert "float" in _row(sql, ids["nan"])["error"]


@pytest.mark.parametrize(("code", "stderr", "action", "delay", "decided"), [
    (90, "why\n", "fail", 0.0, "discard"), (91, "30\n", "snooze", 30.0, "snooze"),
    (91, "0.5 because\n", "snooze", 0.5, "snooze"), (92, "junk\n7 later\n\n", "fail", 7.0, "retry"),
    (91, "", "fail", 0.0, None), (92, "inf\n", "fail", 0.0, None), (92, "later 7\n", "fail", 0.0, None),
    (91, "-1\n", "fail", 0.0, None)])
def test_exit_codes(code: int, stderr: str, action: str, delay: float, decided: str | None) -> None:
    o = from_exit(code, stderr, RUN, None, False)
    assert o is not None and (o.action, o.delay, o.decided) == (action, delay, decided), o
    assert o.error is not None and len(o.error.splitlines()[0]) < 200


def test_a_reason_postgresql_cannot_store_is_made_storable(queue: Queue, sql: SQL) -> None:
    """A lone surrogate in a Snooze's reason: the snooze still stands (not a refused outcome, which
    the completer would turn into a permanent failure)."""
    o = from_handle({"decided": "snooze", "seconds": 5, "reason": "bad \udc80 text \x00"}, RUN, None, "")
    assert o.action == "snooze" and o.error is not None and "\udc80" not in o.error
    job_id = queue.enqueue("k", {})
    (job,) = queue.claim(1)
    assert queue.finish_many([(job, o)]) == {job_id: "pending"}
    assert sql("SELECT outcome FROM fleetless.job_attempts WHERE job_id = %s", job_id) == [("snoozed",)]


def test_other_exit_codes_are_not_decisions() -> None:
    assert all(from_exit(code, "30\n", RUN, None, False) is None for code in (1, 2, 89, 93, 126, 127))


def test_the_exceptions_check_their_values() -> None:
    assert Snooze(datetime.timedelta(minutes=2)).seconds == 120.0
    assert Retry(after=datetime.timedelta(seconds=3)).after == 3.0 and Retry().after is None
    assert Discard("why").reason == "why"
    for bad in (-1, float("inf"), "5", True, 366 * 86400, 10**400):
        with pytest.raises(ValueError, match="Snooze seconds"):
            Snooze(bad)  # type: ignore[arg-type]
    assert json.dumps(Snooze(1).seconds) == "1.0"


#: A handler that snoozes twice (due at once), saying FLEETLESS_SNOOZES and FLEETLESS_ATTEMPT each run.
COUNTING_MODULE = """
    import os
    from fleetless.outcomes import Snooze

    def handle(payload):
        seen = f"attempt {os.environ['FLEETLESS_ATTEMPT']} snoozes {os.environ['FLEETLESS_SNOOZES']}"
        if int(os.environ["FLEETLESS_SNOOZES"]) < 2:
            raise Snooze(0, reason=seen)
        return seen
"""
COUNTING_SCRIPT = """
    import os, sys
    seen = f"attempt {os.environ['FLEETLESS_ATTEMPT']} snoozes {os.environ['FLEETLESS_SNOOZES']}"
    if int(os.environ["FLEETLESS_SNOOZES"]) < 2:
        print("0", seen, file=sys.stderr)
        sys.exit(91)
    print(seen)
"""


@pytest.mark.parametrize("per_sandbox", [1, 4], ids=["per-job", "batch"])
@pytest.mark.parametrize("tier", ["process", "bwrap", "forkserver"])
def test_handlers_count_their_snoozes_in_fleetless_snoozes(queue: Queue, dsn: str, sql: SQL,
                                                            handlers: Callable[..., Path],
                                                            require_tier: Callable[[str], None], tier: str,
                                                            per_sandbox: int) -> None:
    """FLEETLESS_ATTEMPT stays 1 across snoozes (a snooze gives its attempt back): a handler had no
    way to count them. FLEETLESS_SNOOZES is the job's count before this run, for both kinds of handler."""
    require_tier(tier)
    h = handlers(**{"mod.py": COUNTING_MODULE, "scr.py": COUNTING_SCRIPT})
    ids = {kind: queue.enqueue(kind, {}) for kind in ("mod", "scr")}
    for _ in range(3):  # each snooze is due at once; a drain may or may not take it again itself
        _drain(dsn, h, tier, per_sandbox)
        if sql("SELECT count(*) FROM fleetless.jobs WHERE status = 'pending'") == [(0,)]:
            break
    for kind, job_id in ids.items():
        heads = [r[0] for r in sql("SELECT error_head FROM fleetless.job_attempts WHERE job_id = %s"
                                   " AND outcome = 'snoozed' ORDER BY id", job_id)]
        assert [head.splitlines()[0].rpartition(": ")[2] for head in heads] == [
            "attempt 1 snoozes 0", "attempt 1 snoozes 1"], (kind, heads)
        result = sql("SELECT status, coalesce(result, result_json #>> '{}') FROM fleetless.jobs WHERE id = %s",
                     job_id)
        assert [(status, text.strip()) for status, text in result] == [("done", "attempt 1 snoozes 2")], kind


@pytest.mark.parametrize("tier", ["process", "bwrap", "forkserver"])
def test_each_decision_and_a_result_past_the_cap_in_a_shared_batch(
        queue: Queue, dsn: str, sql: SQL, handlers: Callable[..., Path], require_tier: Callable[[str], None],
        tier: str) -> None:
    """A kind with ``batch_isolation = "shared"`` (its batch's handle() jobs in the runner's own
    process, issue 27) decides and records each outcome as a fork per job does: discarded, snoozed,
    retried (not failed), a bad delay failed; a result past 64 KiB dead at once, its batch-mates
    unharmed."""
    require_tier(tier)
    big = MODULE.replace('        return {"done": do}', '        if do == "big":\n'
                         '            return "x" * 70000\n        return {"done": do}')
    h = handlers(**{"mod.py": big, "fleetless.toml": '[kinds.mod]\nbatch_isolation = "shared"\n'})
    ids = {case: queue.enqueue("mod", {"do": case}, max_attempts=3) for case in [*CASES, "big"]}
    summary = _drain(dsn, h, tier, 8)
    assert summary.claimed == len(ids), summary
    for case in CASES:
        _check(case, _row(sql, ids[case]), script=False)
    got = _row(sql, ids["big"])
    assert (got["status"], got["attempts"], [r[1] for r in got["history"]]) == ("dead", 1, ["dead"]), got
    assert "\n" not in got["error"] and "70002 bytes" in got["error"] and "65536" in got["error"], got["error"]


PRINTS = """
    def handle(payload):
        print("p" * 100000)
        if payload["returns"]:
            return {"value": 1}
"""


@pytest.mark.parametrize("mode", ["per-job", "batch", "shared"])
def test_a_handle_that_prints_past_the_cap_is_kept_marked_cut_as_a_script_is(
        queue: Queue, dsn: str, sql: SQL, handlers: Callable[..., Path], fleetless: Callable[..., Any],
        mode: str) -> None:
    """A script's stdout past 64 KiB is kept, cut and marked so (the job is done, the line says the
    rest was dropped); a handle()'s prints past the cap were cut silently (per-job, batch and shared
    alike): the stored output ended at 65,536 characters with nothing saying more was printed. Now
    the same marker, whether handle() returned a value (its prints are its output) or not."""
    h = handlers(**{"prints.py": PRINTS, "flood.py": "print('f' * 100000)\n"})
    if mode == "shared":
        (h / "fleetless.toml").write_text('[kinds.prints]\nbatch_isolation = "shared"\n')
    from fleetless.queue import RESULT_CUT_MARKER

    ids = [queue.enqueue("prints", {"returns": r}) for r in (True, False)] + [queue.enqueue("flood", {})]
    _drain(dsn, h, "process", 1 if mode == "per-job" else 4)
    for job_id in ids:
        status, result = sql("SELECT status, result FROM fleetless.jobs WHERE id = %s", job_id)[0]
        assert status == "done" and result.endswith(RESULT_CUT_MARKER), (job_id, status, result[-100:])
        assert len(result) == 65536 + len(RESULT_CUT_MARKER), len(result)
    out = fleetless("show", str(ids[0]), dsn=dsn)
    assert "\noutput (cut: only the first 64 KiB of stdout were kept):\n" in out.stdout, out.stdout[-600:]


def test_the_drain_log_numbers_each_snooze_as_the_history_does(dsn: str, queue: Queue, sql: SQL, fleetless: Any,
                                                               handlers: Callable[..., Path]) -> None:
    """A job snoozing three times (each due at once) then done: the -v lines said `attempt 1:
    snoozed` three times over, as the history did before its snooze column (issue 28: snooze #1
    could not be told from #3). Now `attempt 1 (snooze 2)`, the history's label, and `snooze` in
    --log-format json's event."""
    h = handlers(**{"mod.py": COUNTING_MODULE.replace("< 2", "< 3")})
    job = queue.enqueue("mod", {})
    lines: list[str] = []
    events: list[dict[str, Any]] = []
    for _ in range(4):  # each snooze is due at once: one drain may take the job again, or the next
        r = fleetless("-v", "drain", "--handlers", str(h), "--sandbox", "process", dsn=dsn)
        assert r.returncode == 0, r.stderr
        lines += re.findall(rf"^fleetless: job {job} \(mod\) (attempt .*?): (snoozed|done) in ", r.stderr, re.MULTILINE)
        if sql("SELECT status FROM fleetless.jobs WHERE id = %s", job) == [("done",)]:
            break
    assert lines == [("attempt 1 (snooze 1)", "snoozed"), ("attempt 1 (snooze 2)", "snoozed"),
                     ("attempt 1 (snooze 3)", "snoozed"), ("attempt 1", "done")], lines
    again = queue.enqueue("mod", {})
    for _ in range(4):
        if sql("SELECT status FROM fleetless.jobs WHERE id = %s", again) == [("done",)]:
            break
        r = fleetless("--log-format", "json", "-v", "drain", "--handlers", str(h), "--sandbox", "process", dsn=dsn)
        events += [e for e in map(json.loads, r.stderr.splitlines()) if e.get("event") == "job_finished"]
    assert [(e["attempt"], e["snooze"], e["outcome"]) for e in events] == [
        (1, 1, "snoozed"), (1, 2, "snoozed"), (1, 3, "snoozed"), (1, None, "done")], events


def test_a_snooze_past_the_cap_is_reported_as_the_failure_the_history_records(
        dsn: str, queue: Queue, sql: SQL, fleetless: Any, handlers: Callable[..., Path]) -> None:
    """The table charges a snooze past MAX_SNOOZES as a failed attempt (history `failed`, or `dead`
    on the last attempt), but the drain's line, its JSON event and its summary said `snoozed` with
    the snooze's own reason: an operator read the job as snoozing on. Now they say what the
    history says, with last_error's words."""
    h = handlers(**{"mod.py": MODULE})
    left, last = queue.enqueue("mod", {"do": "snooze"}, max_attempts=3), queue.enqueue("mod", {"do": "snooze"},
                                                                                      max_attempts=1)
    sql("UPDATE fleetless.jobs SET snoozes = %s", MAX_SNOOZES)
    r = fleetless("-v", "drain", "--handlers", str(h), "--sandbox", "process", dsn=dsn)
    assert r.returncode == 0, r.stderr
    said = f"snoozed {MAX_SNOOZES} times already, the most a job may; charged as a failed attempt: snoozed for 1000 s"
    assert re.search(rf"^fleetless: job {left} \(mod\) attempt 1: failed in [\d.]+ s on process, retry in 16\.7m: "
                     rf"{said}", r.stderr, re.MULTILINE), r.stderr
    assert re.search(rf"^fleetless: job {last} \(mod\) attempt 1: dead in [\d.]+ s on process: {said}", r.stderr,
                     re.MULTILINE), r.stderr
    assert r.stdout.startswith("drained: claimed 2, done 0, failed 1, dead 1 in "), r.stdout
    assert [o for (o,) in sql("SELECT outcome FROM fleetless.job_attempts ORDER BY job_id")] == ["failed", "dead"]


def test_a_release_past_the_cap_is_reported_as_the_failure_the_history_records(
        dsn: str, queue: Queue, sql: SQL, fleetless: Any, handlers: Callable[..., Path]) -> None:
    """A kind with no handler here is given back uncharged (issue 28's rolling deploy), but the
    fifth give-back in a row is charged: the history says `failed` (or `dead`), while the drain's
    line said `released …; given back uncharged` and the summary counted it released. Now they
    say what the history says, with last_error's words."""
    from fleetless.queue import MAX_RELEASES

    h = handlers(**{"mod.py": MODULE})
    left, last = queue.enqueue("absent", {}, max_attempts=3), queue.enqueue("absent", {}, max_attempts=1)
    sql("UPDATE fleetless.jobs SET releases = %s", MAX_RELEASES - 1)
    r = fleetless("-v", "drain", "--handlers", str(h), "--sandbox", "process", dsn=dsn)
    assert r.returncode == 0, r.stderr
    said = f"released {MAX_RELEASES} times in a row; charged as an attempt: no handler for kind 'absent'"
    assert re.search(rf"^fleetless: job {left} \(absent\) attempt 1: failed in [\d.]+ s on process, retry in "
                     rf"1\.0m: {said}", r.stderr, re.MULTILINE), r.stderr
    assert re.search(rf"^fleetless: job {last} \(absent\) attempt 1: dead in [\d.]+ s on process: {said}", r.stderr,
                     re.MULTILINE), r.stderr
    assert r.stdout.startswith("drained: claimed 2, done 0, failed 1, dead 1 in "), r.stdout
    assert [o for (o,) in sql("SELECT outcome FROM fleetless.job_attempts ORDER BY job_id")] == ["failed", "dead"]
