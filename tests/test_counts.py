"""job_counts (migration 016): the counts by queue, kind and status that ``status`` and /metrics
read instead of counting the jobs table stay exact through every job-changing path, racing drainers
included, and ``fleetless init --recount`` repairs them. Each test compares them with a count of
the table itself."""

from __future__ import annotations

import datetime as dt
import threading
from typing import Any

import psycopg
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
    assert queue.stats()["by_status"] == {"pending": 13, "running": 0, "done": 7, "dead": 0, "cancelled": 0}


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
