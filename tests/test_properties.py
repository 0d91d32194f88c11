"""Hostile input, by property: whatever reaches ``Queue`` or the CLI is either stored and read back
exactly, or refused with a one-line ValueError (CLI: one ``fleetless: error:`` line, non-zero exit)
and nothing is written. Strings that reach SQL are inert. Payloads and results are size-capped."""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from fleetless import Queue
from fleetless.queue import DEFAULT_MAX_ATTEMPTS, RESULT_CUT_MARKER

Sql = Callable[..., list[tuple[object, ...]]]

def fuzz(examples: int) -> settings:
    """Hypothesis settings for tests that use the (function-scoped) database fixtures."""
    return settings(max_examples=examples, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])
KIND_RE = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")
QUEUE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")
PG_INT = 2**31 - 1
HUNDRED_YEARS = 100 * 365 * 86400

EVIL = [
    "a'; DROP TABLE fleetless.jobs; --",
    'x"; DROP TABLE fleetless.jobs; --',
    "x); DROP TABLE fleetless.jobs; --",
    "$$; DROP TABLE fleetless.jobs; $$",
    "1 OR 1=1",
    "default' OR '1'='1",
    "fleetless.jobs; DROP TABLE fleetless.canary",
    "\\'; DROP TABLE fleetless.jobs; --",
    "fleetless\n",  # passes a "^...$" regex: "$" also matches before a final newline
]
# Strings that are hard for JSON, jsonb, COPY's text format and SQL quoting.
NASTY = [
    "", "\x00", "a\x00b", "\\u0000", "\\\\u0000", "\\\\\\u0000", "\ud800", "\udcff", "\\", '"', "\\N", "\\.",
    "\t\n\r", "\u2028\u2029", "\ufeff", "\U0001f600", "'", "$$", "%s", "%(kind)s", "{schema}", *EVIL,
]
text_any = st.one_of(st.text(st.characters(exclude_categories=())), st.sampled_from(NASTY))


def json_values(keys: st.SearchStrategy[str], strings: st.SearchStrategy[str]) -> st.SearchStrategy[Any]:
    leaves = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), strings)
    return st.recursive(
        leaves, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(keys, inner, max_size=5),
        max_leaves=30)


payloads = st.one_of(json_values(text_any, text_any), st.sampled_from(NASTY))


def storable(value: Any) -> bool:
    """The oracle: JSON that jsonb can hold exactly (no NUL, no lone surrogate, no NaN/inf, no float
    that only an exponent keeps a float: jsonb would give 1e16 back as the integer 10000000000000000)."""
    if isinstance(value, float):
        return math.isfinite(value) and "e+" not in repr(value)
    if isinstance(value, str):
        return "\x00" not in value and not any(0xD800 <= ord(c) <= 0xDFFF for c in value)
    if isinstance(value, list):
        return all(storable(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and storable(k) and storable(v) for k, v in value.items())
    return value is None or isinstance(value, bool | int)


def same_json(sent: Any, got: Any) -> bool:
    """Equal as JSON, floats staying floats. The one normalisation: -0.0 comes back as 0.0 (numeric
    has no negative zero; the two are equal)."""
    if isinstance(sent, bool) or isinstance(got, bool):
        return type(sent) is type(got) and sent == got
    if isinstance(sent, float) or isinstance(got, float):
        return type(sent) is type(got) and sent == got
    if isinstance(sent, list):
        return isinstance(got, list) and len(sent) == len(got) and all(map(same_json, sent, got))
    if isinstance(sent, dict):
        return (isinstance(got, dict) and sent.keys() == got.keys()
                and all(same_json(v, got[k]) for k, v in sent.items()))
    return type(sent) is type(got) and sent == got


def count(sql: Sql) -> int:
    return int(sql("SELECT count(*) FROM fleetless.jobs")[0][0])  # type: ignore[call-overload]


def refused_in_one_line(excinfo: pytest.ExceptionInfo[ValueError]) -> None:
    message = str(excinfo.value)
    assert message and "\n" not in message, repr(message)


# -- the Python API ------------------------------------------------------------------------------

@fuzz(300)
@given(payload=payloads)
@example(payload={"s": "\\u0000"})  # the six characters \u0000: text, not a NUL
@example(payload={"re": "\\\\u0000 and \\u0000"})
@example(payload={"\\u0000": 1})
@example(payload=[1e16, 1e308, -0.0, 5e-324, 2**64, -(2**63)])
@example(payload=[1.5e300])
@example(payload=[1e15, 123456789012345.6, -0.0, 5e-324, 1e-7, 2**64, -(2**63)])
def test_a_payload_is_stored_exactly_or_refused_in_one_line(queue: Queue, sql: Sql, payload: Any) -> None:
    before = count(sql)
    if storable(payload):
        job_id = queue.enqueue("k", payload)
        assert same_json(payload, queue.get(job_id)["payload"])
        assert count(sql) == before + 1
    else:
        with pytest.raises(ValueError) as excinfo:
            queue.enqueue("k", payload)
        refused_in_one_line(excinfo)
        assert count(sql) == before


@pytest.mark.parametrize("payload", [{1: "a", "1": "b"}, {None: 1}, {True: 1, "true": 2}, {1.5: 0},
                                     [{"ok": {2: "x"}}]])
def test_a_payload_with_keys_json_would_silently_rewrite_is_refused(queue: Queue, sql: Sql, payload: Any) -> None:
    # json.dumps turns 1 into "1", None into "null", True into "true": two keys could collapse into
    # one and jsonb would silently keep only the last value.
    with pytest.raises(ValueError, match="keys must be strings") as excinfo:
        queue.enqueue("k", payload)
    refused_in_one_line(excinfo)
    assert count(sql) == 0


@pytest.mark.parametrize("depth", [1, 10, 100, 101, 500, 990, 2_000, 100_000])
def test_deeply_nested_payloads_are_stored_exactly_or_refused_in_one_line(queue: Queue, sql: Sql,
                                                                         depth: int) -> None:
    """The cap is explicit (MAX_PAYLOAD_DEPTH), not wherever the caller's stack runs out."""
    from fleetless.job import MAX_PAYLOAD_DEPTH

    payload: Any = "bottom"
    for i in range(depth):
        payload = [payload] if i % 2 else {"d": payload}
    try:
        job_id = queue.enqueue("k", payload)
    except ValueError as exc:
        assert f"nested deeper than {MAX_PAYLOAD_DEPTH} levels" in str(exc) and depth > MAX_PAYLOAD_DEPTH
        assert count(sql) == 0
        return
    got = queue.get(job_id)["payload"]
    for i in reversed(range(depth)):  # walk down without recursion
        got = got[0] if i % 2 else got["d"]
    assert got == "bottom"


def test_payloads_over_the_limit_are_refused_and_at_the_limit_stored(dsn: str, queue: Queue, sql: Sql) -> None:
    default = Queue(dsn)
    huge = {"blob": "x" * (1024 * 1024)}  # encodes to 1 MiB + 11 bytes
    with pytest.raises(ValueError, match=r"payload is 1048587 bytes, over the limit of 1048576 bytes"):
        default.enqueue("k", huge)
    exact = {"blob": "é" * ((1024 * 1024 - 11) // 2)}  # two bytes each in UTF-8: 1 MiB - 1 byte
    job_id = default.enqueue("k", exact)
    assert queue.get(job_id)["payload"] == exact
    with pytest.raises(ValueError, match="over the limit of 100 bytes"):
        Queue(dsn, max_payload_bytes=100).enqueue_many([("k", {}), ("k", {"x": "y" * 100})])
    assert count(sql) == 1
    default.close()


kinds = st.one_of(st.from_regex(KIND_RE, fullmatch=True), text_any,
                  st.sampled_from(["abc\n", "a\n", "ok\r", "a..b", "../x", "x" * 64, "x" * 65, "é", "A"]))


@fuzz(300)
@given(kind=kinds)
def test_a_kind_is_stored_exactly_or_refused_in_one_line(queue: Queue, sql: Sql, kind: str) -> None:
    before = count(sql)
    if KIND_RE.fullmatch(kind) and ".." not in kind:
        job_id = queue.enqueue(kind, {})
        assert queue.get(job_id)["kind"] == kind
    else:
        with pytest.raises(ValueError, match="invalid job kind") as excinfo:
            queue.enqueue(kind, {})
        refused_in_one_line(excinfo)
        assert count(sql) == before


queue_names = st.one_of(st.from_regex(QUEUE_RE, fullmatch=True), text_any,
                        st.sampled_from(["default\n", "q:1", "Q.a-b_c", "x" * 65]))
numbers = st.one_of(st.integers(), st.floats(), st.none(), st.booleans(), st.text(max_size=2),
                    st.sampled_from([2**31 - 1, -(2**31) + 1, 2**31, 10**400, 1000, 1001, 0]))
aware = st.datetimes(min_value=dt.datetime(1, 1, 1), max_value=dt.datetime(9999, 12, 31, 23, 59),
                     timezones=st.one_of(st.timezones(), st.builds(dt.timezone, st.timedeltas(
                         min_value=-dt.timedelta(hours=23, minutes=59), max_value=dt.timedelta(hours=23, minutes=59)))))


def in_utc_range(when: dt.datetime) -> bool:
    try:
        when.astimezone(dt.UTC)
    except OverflowError:
        return False
    return True


@fuzz(400)
@given(queue_name=queue_names, priority=numbers, max_attempts=numbers,
       delay=st.one_of(st.none(), st.floats(), st.integers(), st.timedeltas()),
       timeout=st.one_of(st.none(), st.floats(), st.integers(), st.sampled_from([0.5, 1, 1.4, PG_INT, PG_INT + 1])),
       run_after=st.one_of(st.none(), aware, st.datetimes()))
@example(queue_name="default", priority=0, max_attempts=3, delay=10**400, timeout=None, run_after=None)
@example(queue_name="default", priority=0, max_attempts=3, delay=None, timeout=10**400, run_after=None)
@example(queue_name="default", priority=0, max_attempts=3, delay=None, timeout=None,
         run_after=dt.datetime(1, 1, 1, tzinfo=dt.timezone(dt.timedelta(hours=5))))
@example(queue_name="default", priority=0, max_attempts=3, delay=None, timeout=None,
         run_after=dt.datetime(9999, 12, 31, 23, tzinfo=dt.timezone(-dt.timedelta(hours=5))))
def test_options_are_stored_exactly_or_refused_in_one_line(queue: Queue, sql: Sql, queue_name: Any, priority: Any,
                                                          max_attempts: Any, delay: Any, timeout: Any,
                                                          run_after: Any) -> None:
    def whole(x: Any, low: int, high: int) -> bool:
        return type(x) is int and low <= x <= high

    seconds = delay.total_seconds() if isinstance(delay, dt.timedelta) else delay

    def finite(x: Any) -> bool:
        return x is None or (isinstance(x, int | float) and not isinstance(x, bool)
                             and abs(x) < 1e300 and math.isfinite(x))

    valid = (
        isinstance(queue_name, str) and bool(QUEUE_RE.fullmatch(queue_name))
        and whole(priority, -PG_INT, PG_INT) and (max_attempts is None or whole(max_attempts, 1, 1000))
        and finite(seconds) and (seconds is None or 0 <= seconds <= HUNDRED_YEARS)
        and finite(timeout) and (timeout is None or 1 <= timeout <= PG_INT)
        and (run_after is None or (run_after.tzinfo is not None and in_utc_range(run_after)))
        and (run_after is None or delay is None)
    )
    before = count(sql)
    options = {"queue": queue_name, "priority": priority, "max_attempts": max_attempts, "delay": delay,
               "timeout": timeout, "run_after": run_after}
    if not valid:
        assume(not isinstance(timeout, bool) and not isinstance(delay, bool))  # bools pass as 0/1 seconds
        with pytest.raises(ValueError) as excinfo:
            queue.enqueue("k", {}, **options)
        refused_in_one_line(excinfo)
        assert count(sql) == before
        return
    job_id = queue.enqueue("k", {}, **options)
    row = queue.get(job_id)
    stored = DEFAULT_MAX_ATTEMPTS if max_attempts is None else max_attempts  # None: the kind's, at claim
    assert (row["queue"], row["priority"], row["max_attempts"]) == (queue_name, priority, stored)
    assert row["timeout_seconds"] == (None if timeout is None else round(timeout))
    if run_after is not None:
        assert row["run_after"] == run_after
    else:
        assert abs((row["run_after"] - row["created_at"]).total_seconds() - (seconds or 0)) < 1e-3


items = st.lists(st.tuples(st.one_of(st.from_regex(KIND_RE, fullmatch=True), kinds), payloads), max_size=8)


@fuzz(150)
@given(jobs=items)
def test_enqueue_many_stores_all_exactly_or_refuses_all(queue: Queue, sql: Sql, jobs: list[tuple[str, Any]]) -> None:
    before = count(sql)
    bad = [i for i, (kind, payload) in enumerate(jobs)
           if not (KIND_RE.fullmatch(kind) and ".." not in kind and storable(payload))]
    if bad:
        with pytest.raises(ValueError, match=rf"^job #{bad[0]}: ") as excinfo:
            queue.enqueue_many(jobs)
        refused_in_one_line(excinfo)
        assert count(sql) == before
        return
    ids = queue.enqueue_many(jobs)
    assert len(ids) == len(jobs) and ids == sorted(ids)
    for job_id, (kind, payload) in zip(ids, jobs, strict=True):
        row = queue.get(job_id)
        assert row["kind"] == kind and same_json(payload, row["payload"])
    assert count(sql) == before + len(jobs)


@pytest.mark.parametrize("evil", EVIL)
def test_sql_injection_through_the_api_is_inert(dsn: str, queue: Queue, sql: Sql, evil: str) -> None:
    job_id = queue.enqueue("k", {evil: evil}, queue="default")
    for call in (lambda: queue.enqueue(evil, {}), lambda: queue.enqueue("k", {}, queue=evil),
                 lambda: queue.list(kind=evil), lambda: queue.list(queue=evil), lambda: queue.list(status=evil),
                 lambda: Queue(dsn, schema=evil)):
        with pytest.raises(ValueError):
            call()
    assert queue.claim(5, queues=[evil]) == []  # a queue filter is a parameter: matches nothing
    assert queue.get(job_id)["payload"] == {evil: evil}
    assert count(sql) == 1


# -- the CLI -------------------------------------------------------------------------------------

def one_error_line(r: subprocess.CompletedProcess[str]) -> None:
    assert r.returncode != 0, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fleetless: error: "), r.stderr


# argv cannot carry NUL nor a lone surrogate (not encodable; newer Hypothesis draws them unless told)
argv_text = st.text(st.characters(exclude_characters="\x00", exclude_categories=("Cs",)), max_size=40)


@fuzz(25)
@given(kind=st.one_of(st.from_regex(KIND_RE, fullmatch=True), argv_text, st.sampled_from(EVIL)),
       text=st.one_of(json_values(argv_text, argv_text).map(json.dumps), argv_text,
                      st.sampled_from(["-", "NaN", "1e999", "[" * 5000, '"\\ud800"', '{"a": "\\u0000"}', "9" * 5000])))
@example(kind="report", text='{"month": "2026-11"}')
@example(kind="abc\n", text="{}")
@example(kind="--help", text="{}")
def test_cli_enqueue_stores_exactly_or_fails_with_one_line(dsn: str, queue: Queue, sql: Sql, fleetless: Any,
                                                           kind: str, text: str) -> None:
    before = count(sql)
    r = fleetless("enqueue", "--", kind, text, dsn=dsn, input="")
    if r.returncode == 0:
        assert r.stderr == ""
        row = queue.get(int(r.stdout))
        assert row["kind"] == kind and same_json(json.loads(text), row["payload"])
        assert count(sql) == before + 1
    else:
        one_error_line(r)
        assert count(sql) == before
        try:
            ok = bool(KIND_RE.fullmatch(kind)) and ".." not in kind and storable(json.loads(text))
        except (ValueError, RecursionError):
            ok = False
        assert not ok, r.stderr


@pytest.mark.parametrize(("kind", "payload"), [(b"ok", b'{"a": "\xff"}'), (b"\xff", b"{}"), (b"ok", b"\xc3")])
def test_cli_enqueue_with_bytes_that_are_not_utf8_fails_with_one_line(dsn: str, queue: Queue, sql: Sql,
                                                                      kind: bytes, payload: bytes) -> None:
    r = subprocess.run([sys.executable, "-m", "fleetless.cli", "enqueue", b"--", kind, payload],
                       capture_output=True, text=True, env={**os.environ, "DATABASE_URL": dsn}, timeout=60)
    one_error_line(r)
    assert count(sql) == 0


@pytest.mark.parametrize("evil", EVIL)
def test_sql_injection_through_every_cli_string_is_inert(dsn: str, queue: Queue, sql: Sql, fleetless: Any,
                                                         tmp_path: Path, evil: str) -> None:
    sql("CREATE TABLE IF NOT EXISTS fleetless.canary (x int)")
    job_id = queue.enqueue("k", {"evil": evil})
    calls = [
        ["enqueue", "--", evil, "{}"], ["enqueue", "--queue", evil, "--", "k", "{}"],
        ["--schema", evil, "status"], ["--schema", evil, "init"],
        ["show", "--", evil], ["retry", "--", evil], ["cancel", "--", evil],
        ["jobs", "--status", evil], ["jobs", "--kind", evil], ["jobs", "--queue", evil],
        ["drain", "--handlers", str(tmp_path), "--queue", evil],
    ]
    for args in calls:
        r = fleetless(*args, dsn=dsn, env={"FLEETLESS_WORKDIR": str(tmp_path / "work")})
        if r.returncode != 0:
            one_error_line(r)
        else:
            assert args[0] == "drain" and "claimed 0" in r.stdout, (args, r.stdout)
    assert sql("SELECT id, status, payload FROM fleetless.jobs") == [(job_id, "pending", {"evil": evil})]
    assert sql("SELECT count(*) FROM fleetless.canary") == [(0,)]
    assert sql("SELECT nspname FROM pg_namespace WHERE nspname NOT LIKE 'pg\\_%%'"
               " AND nspname NOT IN ('public', 'information_schema') ORDER BY 1") == [("fleetless",)]


def test_cli_payload_size_limit_is_configurable_with_a_clear_error(dsn: str, queue: Queue, sql: Sql,
                                                                   fleetless: Any) -> None:
    blob = json.dumps({"blob": "x" * 2000})  # 2,011 bytes once re-encoded compactly
    r = fleetless("enqueue", "k", blob, "--max-payload-bytes", "1K", dsn=dsn)
    one_error_line(r)
    assert "payload is 2011 bytes, over the limit of 1024 bytes" in r.stderr
    assert "--max-payload-bytes" in r.stderr
    one_error_line(fleetless("enqueue", "k", blob, dsn=dsn, env={"FLEETLESS_MAX_PAYLOAD_BYTES": "2000"}))
    assert count(sql) == 0
    ok = fleetless("enqueue", "k", blob, dsn=dsn, env={"FLEETLESS_MAX_PAYLOAD_BYTES": "2011"})
    assert ok.returncode == 0, ok.stderr
    big = json.dumps({"blob": "y" * (1024 * 1024)})
    one_error_line(fleetless("enqueue", "k", "-", input=big, dsn=dsn))  # the default: 1 MiB
    assert fleetless("enqueue", "k", "-", "--max-payload-bytes", "2M", input=big, dsn=dsn).returncode == 0
    assert sql("SELECT length(payload->>'blob') FROM fleetless.jobs ORDER BY id") == [(2000,), (1024 * 1024,)]
    for bad in ("lots", "-1", "0"):
        one_error_line(fleetless("enqueue", "k", "{}", "--max-payload-bytes", bad, dsn=dsn))
    assert count(sql) == 2


# -- results -------------------------------------------------------------------------------------

def drain_measured(dsn: str, handlers_dir: Path, workdir: Path) -> float:
    """Run ``fleetless drain`` and return its own peak RSS (VmHWM) in MiB.

    Not rusage: a forked child's ru_maxrss starts from its parent's peak (here, pytest's), and
    exec keeps it, so it would measure the test runner rather than the drainer."""
    proc = subprocess.Popen([sys.executable, "-m", "fleetless.cli", "drain", "--handlers", str(handlers_dir)],
                            env={**os.environ, "DATABASE_URL": dsn, "FLEETLESS_WORKDIR": str(workdir)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    peak_kib = 0
    while proc.poll() is None:
        try:
            with open(f"/proc/{proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        peak_kib = max(peak_kib, int(line.split()[1]))
        except (FileNotFoundError, ProcessLookupError, ValueError):
            pass
        time.sleep(0.05)
    _, err = proc.communicate()
    assert proc.returncode == 0, err
    assert peak_kib > 0
    return peak_kib / 1024


def test_a_handler_writing_1_gib_to_stdout_is_done_with_64_kib_and_flat_drainer_memory(
        dsn: str, queue: Queue, sql: Sql, handlers: Any, tmp_path: Path, record_property: Any) -> None:
    h = handlers(loud="""
        #!/bin/sh
        yes 'fleetless' | head -c 1073741824
    """)
    queue.enqueue("loud", {})
    started = time.monotonic()
    max_rss_mib = drain_measured(dsn, h, tmp_path / "w")
    record_property("drainer_max_rss_mib_for_1gib_stdout", round(max_rss_mib, 1))
    print(f"\n1 GiB of stdout drained in {time.monotonic() - started:.1f} s; max RSS {max_rss_mib:.0f} MiB")
    assert max_rss_mib < 200
    ((status_, length, result),) = sql("SELECT status, length(result), left(result, 20) FROM fleetless.jobs")
    assert (status_, length, result) == ("done", 65536 + len(RESULT_CUT_MARKER), "fleetless\nfleetless\n")
    with psycopg.connect(dsn) as c:
        assert c.execute("SELECT octet_length(result) FROM fleetless.jobs").fetchone() == (
            65536 + len(RESULT_CUT_MARKER.encode()),)


def test_a_handler_writing_1_gib_to_stderr_fails_with_its_tail_and_flat_drainer_memory(
        dsn: str, queue: Queue, sql: Sql, handlers: Any, tmp_path: Path, record_property: Any) -> None:
    h = handlers(noisy="""
        #!/bin/sh
        yes 'noise' | head -c 1073741824 >&2
        echo 'the real cause' >&2
        exit 4
    """)
    queue.enqueue("noisy", {}, max_attempts=1)
    max_rss_mib = drain_measured(dsn, h, tmp_path / "w")
    record_property("drainer_max_rss_mib_for_1gib_stderr", round(max_rss_mib, 1))
    assert max_rss_mib < 200
    ((status_, error),) = sql("SELECT status, last_error FROM fleetless.jobs")
    assert status_ == "dead" and len(str(error)) == 2000
    assert str(error).startswith("exit code 4: noisthe real cause\n")  # the last line stderr said
    assert str(error).endswith("noise\nnoisthe real cause")  # 2**30 % 6 = 4


def test_a_jobs_output_cannot_drive_the_operators_terminal(dsn: str, queue: Queue, sql: Sql, handlers: Any,
                                                           fleetless: Any, tmp_path: Path) -> None:
    # A job's stdout and stderr become result and last_error, which `jobs` and `show` print. Escape
    # sequences in them could retitle, clear or recolour the terminal, write the clipboard (OSC 52),
    # or hide text behind a carriage return.
    h = handlers(evil=r"""
        #!/bin/sh
        printf 'result \033]52;c;cHduZWQ=\007\033[2J\rfake\n'
        printf 'boom \033[8mhidden\033[0m\r\033]0;title\007\tend\n' >&2
        exit 1
    """)
    job_id = queue.enqueue("evil", {}, max_attempts=1)
    r = fleetless("drain", "--handlers", str(h), dsn=dsn, env={"FLEETLESS_WORKDIR": str(tmp_path / "w")})
    assert r.returncode == 0, r.stderr
    stored = sql("SELECT status, result, last_error FROM fleetless.jobs")[0]
    assert stored[0] == "dead" and "\x1b]52;" in str(stored[1]) and "\x1b[8m" in str(stored[2])  # kept as is
    for args in (["jobs"], ["jobs", "--status", "dead"], ["show", str(job_id)], ["show", str(job_id), "--json"],
                 ["jobs", "--json"]):
        out = fleetless(*args, dsn=dsn)
        assert out.returncode == 0, out.stderr
        assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", out.stdout), (args, out.stdout)
    shown = fleetless("show", str(job_id), dsn=dsn).stdout
    assert "result \\x1b]52;c;cHduZWQ=\\x07\\x1b[2J\\x0dfake" in shown
    assert "boom \\x1b[8mhidden\\x1b[0m\\x0d\\x1b]0;title\\x07\tend" in shown
