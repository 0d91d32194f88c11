"""Per-kind settings the claim applies (fleetless.toml): global concurrency and rate limits,
enforced in the claim against the table across racing drainer processes; a kind's sandbox tier
and batch size; a kind's max_attempts for jobs enqueued without one. Every assertion reads the
table (jobs, job_attempts), never a drainer's memory."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, ClassVar

import psycopg
import pytest

from fleetless import Queue
from fleetless.drainer import DrainConfig, Drainer, DrainError
from fleetless.kinds import load

pytestmark = pytest.mark.usefixtures("private_workdir")

#: Several drainers at once: each a process of its own that drains again and again (one-shot
#: drains, as cron would start them) until no job is pending or running.
DRAINER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from fleetless import Queue
    from fleetless.drainer import DrainConfig, Drainer
    dsn, handlers, concurrency = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    q = Queue(dsn)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        Drainer(q, DrainConfig(handlers_dir=handlers, concurrency=concurrency, sandbox="process")).run()
        with q._connection() as c:
            (left,) = c.execute("SELECT count(*) FROM fleetless.jobs WHERE status IN ('pending', 'running')").fetchone()
        if left == 0:
            break
        time.sleep(0.05)
""")


def settings_file(folder: Path, text: str) -> Path:
    (folder / "fleetless.toml").write_text(textwrap.dedent(text).lstrip())
    return folder


def race(dsn: str, handlers_dir: Path, drainers: int, concurrency: int) -> None:
    """``drainers`` processes draining the same table at once, until it has nothing left."""
    procs = [subprocess.Popen([sys.executable, "-c", DRAINER, dsn, str(handlers_dir), str(concurrency)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(drainers)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0] * drainers, outs


def most_at_once(intervals: list[tuple[Any, Any]]) -> int:
    """The most attempts that were running at one instant (start inclusive, end exclusive)."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda x: (x[0], x[1]))
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def test_concurrency_holds_across_racing_drainers(dsn: str, queue: Queue, sql, handlers) -> None:
    h = settings_file(handlers(**{"slow.py": "import time; time.sleep(0.6)", "free.py": "print('ok')"}),
                      "[kinds.slow]\nconcurrency = 2\n")
    for i in range(10):
        queue.enqueue("slow", {"i": i})
    for i in range(6):
        queue.enqueue("free", {"i": i})
    race(dsn, h, drainers=3, concurrency=3)  # up to 9 slots between them
    assert sql("SELECT kind, status, count(*) FROM fleetless.jobs GROUP BY 1, 2 ORDER BY 1") == [
        ("free", "done", 6), ("slow", "done", 10)]
    slow = sql("SELECT a.started_at, a.finished_at FROM fleetless.job_attempts a JOIN fleetless.jobs j"
               " ON j.id = a.job_id WHERE j.kind = 'slow'")
    assert len(slow) >= 10, slow  # (an attempt that failed for another reason and ran again counts too)
    assert most_at_once(slow) == 2, slow  # never more than the limit, and the limit was reached
    drainers = sql("SELECT count(DISTINCT pid) FROM fleetless.job_attempts")[0][0]
    assert drainers >= 2, f"the drainers did race: {drainers}"


def test_rate_holds_across_racing_drainers(dsn: str, queue: Queue, sql, handlers) -> None:
    h = settings_file(handlers(**{"tick.py": "print('tick')"}), "[kinds.tick]\nrate = \"3/2s\"\n")
    for i in range(9):
        queue.enqueue("tick", {"i": i})
    race(dsn, h, drainers=3, concurrency=4)
    starts = [s for (s,) in sql("SELECT a.started_at FROM fleetless.job_attempts a ORDER BY 1")]
    assert sql("SELECT status, count(*) FROM fleetless.jobs GROUP BY 1") == [("done", 9)]
    assert len(starts) == 9
    for s in starts:  # no window of 2 s holds more than 3 starts
        in_window = [t for t in starts if 0 <= (s - t).total_seconds() < 2]
        assert len(in_window) <= 3, (s, in_window)
    assert (starts[-1] - starts[0]).total_seconds() >= 4  # 9 starts at 3 per 2 s need two windows more
    assert sql("SELECT count(*) <= 3 FROM fleetless.kind_starts") == [(True,)]  # the log stays small


class CountingCursor(psycopg.Cursor[Any]):
    statements: ClassVar[list[str]] = []

    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
        CountingCursor.statements.append(str(query).split("\n", 1)[0])
        return super().execute(query, params, **kwargs)


def test_a_claim_is_one_statement_unless_a_kind_has_a_limit(dsn: str, queue: Queue, handlers, monkeypatch) -> None:
    monkeypatch.setattr("fleetless.queue.QUEUE_LIMITS_TTL", 3600.0)  # queues' limits: read once, below
    h = settings_file(handlers(**{"a.py": "", "b.py": ""}),
                      "[kinds.a]\nmax_attempts = 5\ntier = \"process\"\nbatch_size = 4\n")
    for kind in ("a", "b", "a"):
        queue.enqueue(kind, {})
    conn = psycopg.connect(dsn, autocommit=True, cursor_factory=CountingCursor)
    counted = Queue(conn)
    drainer = Drainer(counted, DrainConfig(handlers_dir=h))
    drainer._kinds = load(h)
    assert counted.limited_queues() == []  # read at most once a second (QUEUE_LIMITS_TTL): not per claim
    CountingCursor.statements.clear()
    assert len(drainer._claim(10)) == 3
    assert len(CountingCursor.statements) == 1 and conn.info.transaction_status == 0  # autocommit: one round trip

    limited = settings_file(h, "[kinds.a]\nconcurrency = 1\n")
    for kind in ("a", "b", "a"):
        queue.enqueue(kind, {})
    drainer._kinds = load(limited)
    CountingCursor.statements.clear()
    claimed = drainer._claim(10)
    assert sorted(j.kind for j in claimed) == ["b"]  # 'a' is at its limit: 2 of its jobs still run
    # the probe for due limited kinds, the kind's bounded lock wait, its row lock and limited claim,
    # then the others' claim
    assert len(CountingCursor.statements) == 5
    conn.close()


def test_a_kinds_tier_is_applied_by_the_drain(queue: Queue, sql, handlers, require_tier, monkeypatch) -> None:
    require_tier("bwrap")
    from fleetless.sandbox import get_backend

    bwrap, swept = get_backend("bwrap"), []
    real_sweep = bwrap.sweep
    monkeypatch.setattr(bwrap, "sweep", classmethod(lambda cls: swept.append(cls) or real_sweep()))
    probe = "import os; print(os.uname().nodename)"
    h = settings_file(handlers(**{"boxed.py": probe, "plain.py": probe}), "[kinds.boxed]\ntier = \"bwrap\"\n")
    queue.enqueue("boxed", {})
    queue.enqueue("plain", {})
    summary = Drainer(queue, DrainConfig(handlers_dir=h, sandbox="process", concurrency=2)).run()
    assert summary.done == 2
    rows = dict((k, (t, at, r)) for k, t, at, r in sql(
        "SELECT j.kind, j.tier, a.tier, j.result FROM fleetless.jobs j JOIN fleetless.job_attempts a"
        " ON a.job_id = j.id"))
    assert rows["boxed"][:2] == ("bwrap", "bwrap") and rows["plain"][:2] == ("process", "process")
    assert rows["plain"][2].strip() == socket.gethostname()  # the process tier shares the host's UTS namespace
    assert rows["boxed"][2].strip() == "fleetless"  # bwrap has one of its own
    assert swept == [bwrap]  # the drain swept what dead bwrap drainers left, too


def test_a_kinds_batch_size_runs_its_jobs_that_many_per_sandbox(queue: Queue, sql, handlers) -> None:
    pid_module = ("import uuid\nSANDBOX = uuid.uuid4().hex  # one per import: one per sandbox\n\n"
                  "def handle(payload):\n    return SANDBOX\n")
    h = settings_file(handlers(**{"many.py": pid_module, "single.py": pid_module}),
                      "[kinds.many]\nbatch_size = 5\n")
    for i in range(10):
        queue.enqueue("many", {"i": i})
    for i in range(3):
        queue.enqueue("single", {"i": i})
    summary = Drainer(queue, DrainConfig(handlers_dir=h, concurrency=1)).run()  # per_sandbox: 1
    assert summary.done == 13
    sandboxes = dict(sql("SELECT kind, count(DISTINCT result_json) FROM fleetless.jobs GROUP BY kind"))
    assert sandboxes == {"many": 2, "single": 3}


@pytest.mark.parametrize(("text", "error"), [
    ("[kinds.a]\nconcurrency = -1\n", r"\[kinds.a\] concurrency: an integer from 1 to 100000, not -1"),
    ("[kinds.a]\nrate = \"many\"\n", r"\[kinds.a\] rate: a rate such as"),
    ("[kinds.a]\ntier = \"vm\"\n", r"\[kinds.a\] tier: one of bwrap, .*process.*, not 'vm'"),
])
def test_a_bad_limit_or_tier_stops_the_drain_before_it_claims(queue: Queue, sql, handlers, text: str,
                                                               error: str) -> None:
    h = settings_file(handlers(**{"a.py": "print(1)"}), text)
    queue.enqueue("a", {})
    with pytest.raises(DrainError, match=error) as err:
        Drainer(queue, DrainConfig(handlers_dir=h)).run()
    assert "\n" not in str(err.value)
    assert sql("SELECT status, attempts FROM fleetless.jobs") == [("pending", 0)]


def test_a_kinds_tier_that_cannot_run_here_stops_the_drain_before_it_claims(queue: Queue, sql, handlers,
                                                                             monkeypatch) -> None:
    from fleetless.sandbox import SandboxUnavailable, get_backend

    bwrap = get_backend("bwrap")

    def unavailable() -> None:
        raise SandboxUnavailable("bwrap: not installed")

    monkeypatch.setattr(bwrap, "check", staticmethod(unavailable))
    h = settings_file(handlers(**{"a.py": "print(1)"}), "[kinds.a]\ntier = \"bwrap\"\n")
    queue.enqueue("a", {})
    with pytest.raises(DrainError, match=r"fleetless.toml \[kinds.a\] tier: bwrap: not installed"):
        Drainer(queue, DrainConfig(handlers_dir=h, sandbox="process")).run()
    assert sql("SELECT status, attempts FROM fleetless.jobs") == [("pending", 0)]


def test_limits_leave_throttled_jobs_pending_for_a_later_drain(queue: Queue, sql, handlers) -> None:
    h = settings_file(handlers(**{"hourly.py": "print('tick')"}), "[kinds.hourly]\nrate = \"2/1h\"\n")
    for i in range(3):
        queue.enqueue("hourly", {"i": i})
    summary = Drainer(queue, DrainConfig(handlers_dir=h)).run()
    assert (summary.claimed, summary.done) == (2, 2)
    assert sql("SELECT status, attempts FROM fleetless.jobs ORDER BY id") == [
        ("done", 1), ("done", 1), ("pending", 0)]



def test_a_kinds_max_attempts_applies_to_jobs_enqueued_without_one(queue: Queue, sql, handlers) -> None:
    h = settings_file(handlers(**{"flaky.py": "raise SystemExit(1)", "other.py": "raise SystemExit(1)"}),
                      "[kinds.flaky]\nmax_attempts = 2\nbackoff_base = 0\njitter = 0\n"
                      "[kinds.other]\nbackoff_base = 0\njitter = 0\n")
    plain = queue.enqueue("flaky", {})
    own = queue.enqueue("flaky", {}, max_attempts=4)
    keyed = queue.enqueue("flaky", {}, key="k")
    many, many_own = queue.enqueue_many([("flaky", {}), {"kind": "flaky", "payload": {}, "max_attempts": 1}])
    other = queue.enqueue("other", {})
    sql("INSERT INTO fleetless.jobs (kind, payload, max_attempts) VALUES ('flaky', '{}', 5)")  # the seed's way
    for _ in range(10):
        Drainer(queue, DrainConfig(handlers_dir=h)).run()
        if sql("SELECT count(*) FROM fleetless.jobs WHERE status <> 'dead'") == [(0,)]:
            break
    rows = {i: (a, m) for i, a, m in sql("SELECT id, attempts, max_attempts FROM fleetless.jobs")}
    assert [rows[i] for i in (plain, own, keyed, many, many_own, other)] == [
        (2, 2), (4, 4), (2, 2), (2, 2), (1, 1), (3, 3)]  # the kind's; the job's own; else 3
    assert sql("SELECT attempts, max_attempts FROM fleetless.jobs WHERE id > %s", other) == [(5, 5)]
    assert sql("SELECT count(*) FROM fleetless.job_attempts WHERE job_id = %s", plain) == [(2,)]
    # the setting changed: a job without its own takes the new one at its next claim, 3 when unset
    queue.retry(plain)
    settings_file(h, "[kinds.flaky]\nbackoff_base = 0\njitter = 0\n")
    Drainer(queue, DrainConfig(handlers_dir=h)).run()
    assert sql("SELECT status, attempts, max_attempts FROM fleetless.jobs WHERE id = %s", plain) == [("dead", 3, 3)]


def test_a_watching_drain_waits_for_room_under_a_rate_limit(queue: Queue, sql, handlers) -> None:
    h = settings_file(handlers(**{"paced.py": "print('ok')"}), "[kinds.paced]\nrate = \"2/1s\"\n")
    for i in range(6):
        queue.enqueue("paced", {"i": i})
    summary = Drainer(queue, DrainConfig(handlers_dir=h, watch=True, idle_exit=5)).run()
    assert summary.done == 6  # one drain: it looked again once the window let more start
    starts = [s for (s,) in sql("SELECT started_at FROM fleetless.job_attempts ORDER BY 1")]
    assert all(len([t for t in starts if 0 <= (s - t).total_seconds() < 1]) <= 2 for s in starts)


def test_a_schedule_without_max_attempts_takes_its_kinds(queue: Queue, sql, handlers) -> None:
    import datetime as dt

    from fleetless.periodic import Schedule

    h = settings_file(handlers(**{"flaky.py": "raise SystemExit(1)"}),
                      "[kinds.flaky]\nmax_attempts = 2\nbackoff_base = 0\njitter = 0\n")
    sql("DELETE FROM fleetless.schedules")
    queue.add_schedule(Schedule(name="kinds", cron="* * * * *", kind="flaky", payload={"s": "kinds"}))
    queue.add_schedule(Schedule(name="own", cron="* * * * *", kind="flaky", payload={"s": "own"}, max_attempts=4))
    sql("UPDATE fleetless.schedules SET created_at = %s", dt.datetime.now(dt.UTC) - dt.timedelta(seconds=90))
    try:
        for _ in range(10):
            Drainer(queue, DrainConfig(handlers_dir=h)).run()
            if sql("SELECT count(*) FROM fleetless.jobs WHERE status <> 'dead'") == [(0,)]:
                break
        got = sql("SELECT payload->>'s', attempts, max_attempts FROM fleetless.jobs ORDER BY 1")
        assert {row for row in got} == {("kinds", 2, 2), ("own", 4, 4)}, got
    finally:
        sql("DELETE FROM fleetless.schedules")


def test_a_kinds_concurrency_caps_its_batches_in_batch_mode(queue: Queue, sql, handlers) -> None:
    slow_pid = ("import time, uuid\nSANDBOX = uuid.uuid4().hex  # one per import: one per sandbox\n\n"
                "def handle(payload):\n    time.sleep(0.3)\n    return SANDBOX\n")
    h = settings_file(handlers(**{"capped.py": slow_pid}), "[kinds.capped]\nbatch_size = 5\nconcurrency = 2\n")
    for i in range(6):
        queue.enqueue("capped", {"i": i})
    summary = Drainer(queue, DrainConfig(handlers_dir=h, concurrency=3, per_sandbox=10)).run()
    assert summary.done == 6
    spans = sql("SELECT started_at, finished_at FROM fleetless.job_attempts")
    assert len(spans) == 6 and most_at_once(spans) <= 2, spans  # claimed counts as running
    assert sql("SELECT count(DISTINCT result_json) >= 3 FROM fleetless.jobs") == [(True,)]  # <= 2 per sandbox


@pytest.mark.parametrize("per_sandbox", [1, 3], ids=["per-job", "batch"])
def test_a_no_handler_give_back_spends_none_of_its_kinds_rate(queue: Queue, sql, handlers, per_sandbox: int) -> None:
    """Issue 26: a claimed job whose kind has no handler here is given back uncharged
    (--no-handler-delay); it never started, so it must not count in its kind's rate window either
    (it used to: three give-backs spent "3/hour" and the kind's handler, once deployed, ran nothing
    for an hour)."""
    h = handlers(**{"other.py": "def handle(payload):\n    return 1\n"})
    settings_file(h, """
        [kinds.partner]
        rate = "3/hour"
    """)
    sql("DELETE FROM fleetless.kind_starts")  # (the queue fixture leaves an earlier test's starts)
    ids = [queue.enqueue("partner", {"n": n}) for n in range(3)]
    Drainer(queue, DrainConfig(handlers_dir=h, sandbox="process", per_sandbox=per_sandbox)).run()
    assert sql("SELECT status, attempts FROM fleetless.jobs ORDER BY id") == [("pending", 0)] * 3
    assert sql("SELECT count(*) FROM fleetless.kind_starts WHERE kind = 'partner'") == [(0,)]
    (h / "partner.py").write_text("def handle(payload):\n    return payload['n']\n")  # the deploy lands
    sql("UPDATE fleetless.jobs SET run_after = now() WHERE id = ANY(%s)", ids)
    Drainer(queue, DrainConfig(handlers_dir=h, sandbox="process", per_sandbox=per_sandbox)).run()
    assert sql("SELECT status FROM fleetless.jobs ORDER BY id") == [("done",)] * 3
