"""job_counts (migration 016): the counts by queue, kind and status that ``status`` and /metrics
read instead of counting the jobs table stay exact through every job-changing path, racing drainers
included, and ``fleetless init --recount`` repairs them. Each test compares them with a count of
the table itself."""

from __future__ import annotations

import datetime as dt
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner

from fleetless import Queue
from fleetless.cli import cli
from fleetless.insights import Insights
from fleetless.job import Outcome


def truth(sql: Any) -> dict[tuple[str, str, str], int]:
    return {(q, k, s): n for q, k, s, n in sql(
        "SELECT queue, kind, status, count(*) FROM fleetless.jobs GROUP BY 1, 2, 3")}


def counted(sql: Any) -> dict[tuple[str, str, str], int]:
    return {(q, k, s): n for q, k, s, n in sql(
        "SELECT queue, kind, status, sum(n) FROM fleetless.job_counts GROUP BY 1, 2, 3 HAVING sum(n) <> 0")}


def assert_exact(sql: Any) -> None:
    assert counted(sql) == truth(sql)


def test_counts_follow_every_job_changing_path(queue: Queue, sql: Any) -> None:
    a = queue.enqueue("a", {"x": 1})
    queue.enqueue("b", {}, queue="q2", priority=3, max_attempts=1)
    queue.enqueue("c", {}, key="k1")
    queue.enqueue("c", {"new": True}, key="k1", on_duplicate="replace")  # an upsert: no new job
    queue.enqueue("c", {}, key="k1")  # a duplicate: nothing written
    queue.enqueue_many([("d", {})] * 5 + [("e", {"y": 2})] * 3)  # COPY
    queue.enqueue_many([{"kind": "d", "payload": {}, "queue": "q3", "max_attempts": 2}] * 2)  # COPY with every option
    assert_exact(sql)
    assert counted(sql)[("default", "d", "pending")] == 5

    jobs = queue.claim(4)
    assert_exact(sql)
    queue.complete(jobs[0], "ok")
    queue.fail(jobs[1], "boom", delay=0)  # back to pending
    queue.fail(jobs[2], "boom", delay=0, permanent=True)  # dead
    queue.release(jobs[3], "stopping")
    assert_exact(sql)

    more = queue.claim(6)
    queue.finish_many([(more[0], Outcome("done")), (more[1], Outcome("fail", error="x")),
                       (more[2], Outcome("release", error="y"))])
    queue.finish_many([(more[3], Outcome("done")), (more[4], Outcome("done"))])  # finish_done
    assert_exact(sql)
    sql("UPDATE fleetless.jobs SET lease_expires_at = now() - interval '1 second' WHERE id = %s", more[5].id)
    queue.reap()
    assert_exact(sql)

    pending = [r[0] for r in sql("SELECT id FROM fleetless.jobs WHERE status = 'pending' ORDER BY id")]
    queue.cancel(pending[0])
    running = queue.claim(1, one_kind=True)  # claim_kind
    queue.cancel(running[0].id)  # a mark only: the status stays running
    assert_exact(sql)
    queue.retry(pending[0])
    queue.retry_all_dead()
    assert_exact(sql)
    sql("UPDATE fleetless.jobs SET status = 'done', finished_at = now() - interval '30 days'"
        " WHERE id = %s", a)
    queue.delete(a)
    assert_exact(sql)
    sql("UPDATE fleetless.jobs SET status = 'done', finished_at = now() - interval '30 days'"
        " WHERE status = 'pending' AND kind = 'e'")
    assert queue.prune(dt.timedelta(days=7)) >= 1
    assert_exact(sql)

    sql("INSERT INTO fleetless.jobs (kind, payload, queue) VALUES ('raw', '{}', 'by-hand')")  # an operator's own SQL
    sql("DELETE FROM fleetless.jobs WHERE kind = 'b'")
    assert_exact(sql)


def test_a_rolled_back_enqueue_counts_nothing(queue: Queue, dsn: str, sql: Any) -> None:
    with psycopg.connect(dsn) as conn:
        Queue(conn).enqueue("a", {})
        Queue(conn).enqueue_many([("b", {})] * 3, conn=conn)
        conn.rollback()
    queue.enqueue("c", {})
    assert counted(sql) == {("default", "c", "pending"): 1} == truth(sql)


def test_truncate_empties_the_counts(queue: Queue, sql: Any) -> None:
    queue.enqueue_many([("a", {})] * 3)
    sql("TRUNCATE fleetless.jobs CASCADE")
    assert counted(sql) == {}


def test_compaction_keeps_the_sums_and_leaves_one_row_per_key(queue: Queue, sql: Any) -> None:
    for _ in range(20):
        queue.enqueue("a", {})
    for job in queue.claim(7):
        queue.complete(job)
    before = counted(sql)
    queue.compact_counts()
    assert counted(sql) == before == truth(sql)
    assert sql("SELECT count(*) FROM fleetless.job_counts") == [(2,)]  # (a, pending), (a, done)
    assert queue.stats()["by_status"] == {"pending": 13, "running": 0, "done": 7, "dead": 0, "cancelled": 0,
                                            "waiting": 0}


def test_counts_stay_exact_with_racing_drainers_and_folds(queue: Queue, dsn: str, sql: Any) -> None:
    queue.enqueue_many([{"kind": f"k{i % 3}", "payload": {}, "queue": "race"} for i in range(600)])
    errors: list[BaseException] = []

    def drainer(i: int) -> None:
        q = Queue(dsn)
        late = 0
        try:
            while jobs := q.claim(7, queues=["race"]):
                q.finish_many([(j, Outcome("done") if j.id % 4 else Outcome("fail", error="e", permanent=True))
                               for j in jobs])
                if i == 0 and late < 20:
                    q.enqueue("late", {}, queue="race", max_attempts=1)
                    late += 1
                if i == 1:
                    q.compact_counts()
        except BaseException as exc:
            errors.append(exc)
        finally:
            q.close()

    threads = [threading.Thread(target=drainer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        queue.compact_counts()  # folds racing the drainers' writes
        for t in threads:
            t.join(0.05)
    assert errors == []
    assert_exact(sql)
    assert sum(n for (q, _, s), n in counted(sql).items() if q == "race" and s in ("done", "dead")) >= 600


def test_recount_repairs_counts_a_trigger_did_not_see(queue: Queue, sql: Any, dsn: str) -> None:
    queue.enqueue_many([("a", {})] * 4)
    sql("ALTER TABLE fleetless.jobs DISABLE TRIGGER job_counts_updated")
    sql("UPDATE fleetless.jobs SET status = 'dead', finished_at = now() WHERE id <= 2")
    sql("ALTER TABLE fleetless.jobs ENABLE TRIGGER job_counts_updated")
    sql("INSERT INTO fleetless.job_counts VALUES ('ghost', 'g', 'done', 5)")
    assert counted(sql) != truth(sql)
    result = CliRunner().invoke(cli, ["--database-url", dsn, "init", "--recount", "--json"])
    assert result.exit_code == 0, result.output
    assert '"wrong": 3' in result.output  # (a, pending) and (a, dead) differ, (ghost) is gone
    assert_exact(sql)
    assert Insights(queue).overview().by_status["dead"] == 2


def test_init_folds_an_existing_attempt_history_once(queue: Queue, sql: Any, dsn: str) -> None:
    """Issue 26: after an upgrade, /metrics' first ~25 scrapes each folded 200,000 attempts of a
    long history (9-13 s each); `fleetless init` now folds it all, so every scrape reads a short tail."""
    queue.enqueue_many([("a", {})] * 3)
    sql("UPDATE fleetless.jobs SET status = 'done', finished_at = now() - interval '1 day'")
    sql("INSERT INTO fleetless.job_attempts (job_id, attempt, outcome, finished_at, duration_seconds)"
        " SELECT id, 1, 'done', now() - interval '1 day', 0.2 FROM fleetless.jobs")
    sql("TRUNCATE fleetless.attempt_totals")
    sql("UPDATE fleetless.attempt_totals_mark SET last_id = 0")
    result = CliRunner().invoke(cli, ["--database-url", dsn, "init"])
    assert result.exit_code == 0, result.output
    assert sql("SELECT last_id FROM fleetless.attempt_totals_mark") == sql("SELECT max(id) FROM fleetless.job_attempts")
    assert sql("SELECT kind, outcome, n FROM fleetless.attempt_totals") == [("a", "done", 3)]


def _history(queue: Queue, sql: Any, n: int) -> None:
    """``n`` jobs of kind a, done a day ago, each with its attempt; the totals not folded at all
    (as on a database upgraded past migration 009 without `fleetless init` folding it)."""
    queue.enqueue_many([("a", {})] * n)
    sql("UPDATE fleetless.jobs SET status = 'done', finished_at = now() - interval '1 day'")
    sql("INSERT INTO fleetless.job_attempts (job_id, attempt, outcome, finished_at, duration_seconds)"
        " SELECT id, 1, 'done', now() - interval '1 day', 0.2 FROM fleetless.jobs")
    sql("TRUNCATE fleetless.attempt_totals")
    sql("UPDATE fleetless.attempt_totals_mark SET last_id = 0")


def _done(snapshot: Any) -> int:
    return sum(n for kind, outcome, n in snapshot.finished if (kind, outcome) == ("a", "done"))


def test_scrapes_of_an_unfolded_history_count_a_bounded_tail_and_rise_to_the_exact_figure(
        queue: Queue, sql: Any, monkeypatch: Any) -> None:
    """Issue 26: a scrape read the whole unfolded tail (4-15 s at 5M attempts). Now each scrape
    folds a bounded step and counts a bounded tail: never more than the truth, never less than the
    scrape before, and exact once the folds have caught up."""
    import fleetless.insights as insights

    monkeypatch.setattr(insights, "STEP_FOLD_BATCH", 7)
    monkeypatch.setattr(insights, "TAIL_MAX", 5)
    _history(queue, sql, 40)
    seen = []
    for _ in range(8):
        seen.append(_done(Insights(queue).metrics()))
    assert seen == sorted(seen) and seen[0] < 40 and seen[-1] == 40, seen
    assert sql("SELECT last_id FROM fleetless.attempt_totals_mark") == sql("SELECT max(id) FROM fleetless.job_attempts")


def test_a_retention_run_folds_a_bounded_step_of_the_attempt_history(queue: Queue, sql: Any) -> None:
    from fleetless.maintenance import retention

    _history(queue, sql, 12)
    first = sql("SELECT min(id) FROM fleetless.job_attempts")[0][0]
    retention.run_once(queue, retention.Settings(every=None, fold_batch=5))
    assert sql("SELECT last_id FROM fleetless.attempt_totals_mark") == [(first + 4,)]
    assert sql("SELECT sum(n) FROM fleetless.attempt_totals") == [(5,)]


@pytest.fixture
def reader(dsn: str, queue: Queue) -> Iterator[str]:
    """The DSN of a role granted only USAGE on the schema and SELECT on its tables (a read-only
    monitoring role)."""
    role = f"fleetless_t_reader_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(f'CREATE ROLE "{role}" LOGIN')
        admin.execute(f'GRANT USAGE ON SCHEMA fleetless TO "{role}"')
        admin.execute(f'GRANT SELECT ON ALL TABLES IN SCHEMA fleetless TO "{role}"')
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    info["user"] = role
    try:
        yield psycopg.conninfo.make_conninfo(**info)  # type: ignore[arg-type]
    finally:
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,))
            admin.execute(f'DROP OWNED BY "{role}"')
            admin.execute(f'DROP ROLE IF EXISTS "{role}"')


def test_status_and_metrics_work_for_a_role_that_may_only_read(queue: Queue, sql: Any, reader: str,
                                                                fleetless: Any) -> None:
    """Issue 26: both failed for a SELECT-only role (permission denied), because their reads first
    compacted the counts and folded the attempt totals. They skip that upkeep quietly there."""
    _history(queue, sql, 3)
    queue.enqueue("b", {})
    queue.enqueue("b", {})  # two statements: job_counts has rows to compact
    rows_before = sql("SELECT count(*) FROM fleetless.job_counts")
    ro = Queue(reader)
    assert ro.stats()["by_status"] == {"pending": 2, "running": 0, "done": 3, "dead": 0, "cancelled": 0,
                                           "waiting": 0}
    snapshot = Insights(ro).metrics()
    ro.close()
    assert _done(snapshot) == 3
    assert sql("SELECT count(*) FROM fleetless.job_counts") == rows_before  # nothing written
    assert sql("SELECT last_id FROM fleetless.attempt_totals_mark") == [(0,)]
    for args in (["status"], ["metrics"]):
        out = fleetless(*args, dsn=reader)
        assert out.returncode == 0 and out.stderr == "", (args, out.stderr)
    assert 'fleetless_jobs{kind="b",queue="default",status="pending"} 2.0' in fleetless("metrics", dsn=reader).stdout
