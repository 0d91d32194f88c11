"""The claim, next_due, the reads of ``status`` and /metrics, and retention read what they need and
stop, whatever the backlog and the finished history beside them (issue 26: at 1M pending + 5M
finished rows each of them read the whole of one or the other). Checked on their plans, with
EXPLAIN ANALYZE (run in a transaction rolled back), at a size CI can afford: 60,000 pending jobs
due in one queue, 140,000 finished ones and their attempts, and a queue with nothing due."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from fleetless import Queue
from fleetless.attempt_totals import DURATION_BUCKETS, bucket_params
from fleetless.insights import STEP_FOLD_BATCH, TAIL_MAX


@pytest.fixture(scope="module")
def big(dsn: str) -> Iterator[Queue]:
    q = Queue(dsn)
    q.init()
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("""
            INSERT INTO fleetless.jobs (kind, payload, queue, run_after)
            SELECT 'k' || (i % 5), '{}', 'backlog', now() - interval '1 hour' FROM generate_series(1, 60000) i""")
        c.execute("""
            INSERT INTO fleetless.jobs (kind, payload, queue, run_after)
            SELECT 'k1', '{}', 'idle', now() + interval '1 hour' FROM generate_series(1, 10)""")
        c.execute("""
            INSERT INTO fleetless.jobs (kind, payload, queue, status, attempts, started_at, finished_at)
            SELECT 'k' || (i % 5), '{}', 'backlog', CASE WHEN i % 10 = 0 THEN 'dead' ELSE 'done' END, 1,
                   now() - make_interval(secs => i * 3.0), now() - make_interval(secs => i * 3.0)
            FROM generate_series(1, 140000) i""")  # the oldest ~4.9 days old: none due for retention
        c.execute("""
            INSERT INTO fleetless.job_attempts (job_id, attempt, outcome, started_at, finished_at, duration_seconds)
            SELECT id, 1, status, started_at, finished_at, 0.5 FROM fleetless.jobs WHERE status <> 'pending'""")
        c.execute("UPDATE fleetless.attempt_totals_mark SET last_id = (SELECT max(id) FROM fleetless.job_attempts)")
        c.execute("VACUUM ANALYZE fleetless.jobs")
        c.execute("VACUUM ANALYZE fleetless.job_attempts")
    q.compact_counts()
    yield q
    q.close()


def plan(q: Queue, name: str, params: dict[str, Any]) -> dict[str, Any]:
    with psycopg.connect(q.conninfo) as c:
        c.execute("SET jit = off")
        row = c.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + q._q[name], params).fetchone()
        c.rollback()
    assert row is not None
    data = row[0] if not isinstance(row[0], str) else json.loads(row[0])
    return data[0]["Plan"]  # type: ignore[no-any-return]


def nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", []):
        yield from nodes(child)


def read(node: dict[str, Any]) -> int:
    """Rows a plan node looked at: those it returned and those its filter removed, every loop."""
    loops = node.get("Actual Loops", 1)
    return int((node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0)
                + node.get("Rows Removed by Index Recheck", 0)) * loops)


def assert_reads_little(root: dict[str, Any], most: int = 200) -> None:
    scans = [n for n in nodes(root) if "Relation Name" in n]
    assert scans, root
    for n in scans:
        assert n["Node Type"] != "Seq Scan" or n["Relation Name"] not in ("jobs", "job_attempts"), n
        assert read(n) <= most, (n["Node Type"], n.get("Index Name"), read(n))


CLAIM = {"token": "00000000-0000-0000-0000-000000000001", "claimed_by": "plan:1", "tier": "process",
         "kinds": None, "default_timeout": 600.0, "ttl": 900.0, "grace": 60.0, "skip_kinds": None, "n": 10}


def test_a_claim_from_a_queue_with_nothing_due_reads_only_that_queue(big: Queue) -> None:
    root = plan(big, "claim", {**CLAIM, "queues": ["idle"]})
    assert_reads_little(root)
    assert any(n.get("Index Name") in ("jobs_queue_claim_idx", "jobs_queue_due_idx") for n in nodes(root)), [
        (n["Node Type"], n.get("Index Name"), read(n)) for n in nodes(root)]


def test_a_claim_from_the_backlog_reads_about_the_rows_it_claims(big: Queue) -> None:
    assert_reads_little(plan(big, "claim", {**CLAIM, "queues": ["backlog"]}))
    assert_reads_little(plan(big, "claim", {**CLAIM, "queues": None}))


def test_next_due_of_a_queue_with_nothing_due_reads_its_first_row(big: Queue) -> None:
    root = plan(big, "next_due", {"queues": ["idle"], "skip_kinds": None})
    assert_reads_little(root, most=5)
    assert any(n.get("Index Name") == "jobs_queue_due_idx" for n in nodes(root))
    root = plan(big, "next_due", {"queues": None, "skip_kinds": None})  # every queue
    assert_reads_little(root, most=5)


# A drain that skips kinds (every kind with a concurrency or rate limit, claimed apart; the kinds
# it cannot run): the backlog's five kinds all skipped, or all but one (issue 26: the claim read
# every due row of the skipped kinds, 0.6-1.06 s at 1M pending).
ALL_KINDS = [f"k{i}" for i in range(5)]


@pytest.mark.parametrize("queues", [None, ["backlog"], ["idle", "backlog"]])
@pytest.mark.parametrize("name", ["claim", "claim_kind"])
def test_a_claim_that_skips_the_backlogs_kinds_never_reads_their_backlog(big: Queue, name: str,
                                                                         queues: list[str] | None) -> None:
    assert_reads_little(plan(big, name, {**CLAIM, "queues": queues, "skip_kinds": ALL_KINDS}))
    assert_reads_little(plan(big, name, {**CLAIM, "queues": queues, "skip_kinds": ALL_KINDS[1:]}))  # k0 taken


@pytest.mark.parametrize("queues", [None, ["backlog"], ["idle"]])
def test_next_due_that_skips_the_backlogs_kinds_never_reads_their_backlog(big: Queue,
                                                                          queues: list[str] | None) -> None:
    assert_reads_little(plan(big, "next_due", {"queues": queues, "skip_kinds": ALL_KINDS}), most=20)
    assert_reads_little(plan(big, "next_due", {"queues": queues, "skip_kinds": ALL_KINDS[2:]}), most=20)


def test_next_due_that_skips_kinds_is_the_first_due_time_of_the_others(big: Queue) -> None:
    assert big.next_due(None, ALL_KINDS) is None
    assert big.next_due(["backlog"], ALL_KINDS) is None
    assert big.next_due(["backlog"], ALL_KINDS[1:]) == pytest.approx(-3600, abs=60)
    assert big.next_due(["idle"], ["k0"]) == pytest.approx(3600, abs=60)
    assert big.next_due(["idle"], ["k1"]) is None
    assert big.next_due(None, ["k0"]) == pytest.approx(-3600, abs=60)


@pytest.mark.parametrize("name", ["counts", "insight_counts", "pending_times", "insight_oldest_due_by_queue"])
def test_the_reads_of_status_and_metrics_never_count_the_jobs_table(big: Queue, name: str) -> None:
    assert_reads_little(plan(big, name, {}), most=50)


def test_the_counts_they_read_are_the_tables(big: Queue) -> None:
    assert big.stats()["by_status"] == {"pending": 60010, "running": 0, "done": 126000, "dead": 14000,
                                        "cancelled": 0, "waiting": 0}


def test_the_attempt_totals_read_only_the_tail_after_the_mark(big: Queue) -> None:
    mark = big.query("attempt_totals_mark")[0]["last_id"]
    root = plan(big, "attempt_totals", {"after": mark, "tail": TAIL_MAX, **BOUNDS})
    assert_reads_little(root, most=50)


BOUNDS = bucket_params([float(b) for b in DURATION_BUCKETS])


def test_a_scrape_beside_an_unfolded_history_reads_a_bounded_tail_and_folds_a_bounded_step(big: Queue) -> None:
    # Issue 26: with the history not folded yet (mark 0 here, 140,000 attempts after it) a scrape
    # read the whole tail, and its fold hashed the whole jobs table: 4-15 s a scrape at 5M.
    root = plan(big, "attempt_totals", {"after": 0, "tail": TAIL_MAX, **BOUNDS})
    assert_reads_little(root, most=TAIL_MAX)
    root = plan(big, "attempt_fold_upto", {"after": 0, "margin": 600, "batch": STEP_FOLD_BATCH})
    assert_reads_little(root, most=STEP_FOLD_BATCH)
    root = plan(big, "fold_attempt_totals", {"after": 0, "upto": STEP_FOLD_BATCH, **BOUNDS})
    assert_reads_little(root, most=STEP_FOLD_BATCH)


AGES = {"done": 7 * 86400.0, "cancelled": 7 * 86400.0, "dead": 30 * 86400.0, "limit": 500, "graphs": [], **BOUNDS}


def test_a_retention_pass_with_nothing_due_reads_no_finished_rows(big: Queue) -> None:
    assert_reads_little(plan(big, "prune_batch", AGES), most=5)


def test_a_retention_pass_reads_about_the_rows_it_deletes(big: Queue) -> None:
    root = plan(big, "prune_batch", {**AGES, "done": 86400.0, "dead": 86400.0})  # ~100,000 due
    assert_reads_little(root, most=1000)
    assert root["Plans"][0]["Actual Rows"] == 500 or any(n.get("Actual Rows") == 500 for n in nodes(root))


def _shape(q: Queue, text: str, params: dict[str, Any]) -> list[tuple[str, str | None, float]]:
    """Each scan of jobs in a plan (EXPLAIN, not run): its node, index and estimated rows."""
    with psycopg.connect(q.conninfo) as c:
        c.execute("SET jit = off")
        row = c.execute("EXPLAIN (FORMAT JSON) " + text, params).fetchone()
    assert row is not None
    data = row[0] if not isinstance(row[0], str) else json.loads(row[0])
    return [(n["Node Type"], n.get("Index Name"), float(n["Plan Rows"])) for n in nodes(data[0]["Plan"])
            if n.get("Relation Name") == "jobs"]


@pytest.mark.parametrize("queues", [None, ["backlog"], ["idle", "backlog"]])
@pytest.mark.parametrize("skip_kinds", [None, ALL_KINDS[1:]])
@pytest.mark.parametrize("name", ["claim", "claim_kind"])
def test_the_queue_gate_leaves_the_claims_plan_as_it_was(big: Queue, name: str, skip_kinds: list[str] | None,
                                                         queues: list[str] | None) -> None:
    """With no queue paused or limited, the claim statements plan as they did before queue_settings:
    the same scans of the same indexes, their row estimates within 1% (the gate is one InitPlan over
    the empty queue_settings, run once per statement)."""
    gated = big._q[name]
    ungated = re.sub(r"AND \(CASE WHEN [a-z.]+ = ANY\(ARRAY\(SELECT queue FROM [^)]*queue_settings.*?END\) IS NOT NULL",
                     "", gated, flags=re.S)
    assert ungated != gated and "queue_settings" not in ungated
    params = {**CLAIM, "queues": queues, "skip_kinds": skip_kinds}
    before, after = _shape(big, ungated, params), _shape(big, gated, params)
    assert [s[:2] for s in after] == [s[:2] for s in before]
    assert all(abs(a[2] - b[2]) <= 0.01 * b[2] + 1 for a, b in zip(after, before, strict=True)), (before, after)
    assert [s for s in after if s[0] == "Seq Scan"] == []
