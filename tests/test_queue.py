"""The jobs table: enqueue, claim, finish (fenced), reap, operator repairs. Outcomes are read
back from the table."""

from __future__ import annotations

import datetime as dt
import threading

import psycopg
import pytest

from fleetless import Queue, Status
from fleetless.queue import RESULT_CUT_MARKER, JobNotFound


def test_schema_has_the_seeds_columns_and_partial_claim_index(queue: Queue, sql) -> None:
    cols = {r[0]: (r[1], r[2]) for r in sql(
        "SELECT column_name, data_type, column_default FROM information_schema.columns"
        " WHERE table_schema = 'fleetless' AND table_name = 'jobs'")}
    for name in ("id", "kind", "payload", "status", "attempts", "max_attempts", "run_after", "locked_at",
                 "last_error", "created_at", "queue", "priority", "result", "claim_token",
                 "timeout_seconds", "started_at", "finished_at", "lease_expires_at"):
        assert name in cols, name
    assert cols["payload"][0] == "jsonb"
    assert cols["status"][1].startswith("'pending'")
    assert cols["max_attempts"][1] == "3"
    assert cols["claim_token"][0] == "uuid"
    (indexdef,) = sql("SELECT indexdef FROM pg_indexes WHERE indexname = 'jobs_claim_idx'")[0]
    assert "(run_after)" in indexdef and "WHERE (status = 'pending'::text)" in indexdef


def test_init_is_idempotent_and_concurrent_inits_do_not_collide(dsn: str, queue: Queue) -> None:
    errors: list[BaseException] = []

    def init() -> None:
        try:
            Queue(dsn).init()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=init) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert queue.init() == []


def test_status_outside_the_five_is_refused_by_the_table(queue: Queue, sql) -> None:
    job_id = queue.enqueue("greet", {})
    with pytest.raises(psycopg.errors.CheckViolation):
        sql("UPDATE fleetless.jobs SET status = 'weird' WHERE id = %s", job_id)


def test_enqueue_in_a_rolled_back_transaction_leaves_nothing(dsn: str, queue: Queue, sql) -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS orders (id int)")
        queue.enqueue("greet", {"order": 1}, conn=conn)
        queue.enqueue_many([("greet", {"order": 2})], conn=conn)
        conn.rollback()
    assert sql("SELECT count(*) FROM fleetless.jobs") == [(0,)]


def test_enqueue_in_a_committed_transaction_appears_with_the_app_write(dsn: str, queue: Queue, sql) -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS orders (id int)")
        conn.execute("INSERT INTO orders VALUES (7)")
        job_id = queue.enqueue("greet", {"order": 7}, conn=conn)
        assert sql("SELECT count(*) FROM fleetless.jobs") == [(0,)]  # not visible before commit
        conn.commit()
    assert sql("SELECT kind, payload, status FROM fleetless.jobs WHERE id = %s", job_id) == [
        ("greet", {"order": 7}, "pending")]


def test_enqueue_options_are_stored(queue: Queue, sql) -> None:
    when = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    a = queue.enqueue("report", {"x": 1}, max_attempts=5, run_after=when, queue="reports", priority=7,
                      timeout=42)
    b = queue.enqueue("report", [1, 2], delay=120)
    row = sql("SELECT max_attempts, run_after, queue, priority, timeout_seconds FROM fleetless.jobs"
              " WHERE id = %s", a)[0]
    assert row == (5, when, "reports", 7, 42)
    (delay,) = sql("SELECT extract(epoch FROM run_after - created_at) FROM fleetless.jobs WHERE id = %s", b)[0]
    assert 119 <= float(delay) <= 121


def test_enqueue_many_uses_one_copy_and_returns_ids_in_order(queue: Queue, sql) -> None:
    items = [("greet", {"i": i}) for i in range(3000)]
    items.append({"kind": "report", "payload": {"last": True}, "priority": 3, "delay": 60, "timeout": 5})
    ids = queue.enqueue_many(items)
    assert len(ids) == 3001 and ids == sorted(ids)
    assert sql("SELECT payload FROM fleetless.jobs WHERE id = %s", ids[10]) == [({"i": 10},)]
    row = sql("SELECT kind, priority, timeout_seconds, run_after > now() FROM fleetless.jobs WHERE id = %s",
              ids[-1])
    assert row == [("report", 3, 5, True)]


ROW = ("SELECT kind, payload, status, attempts, max_attempts, max_attempts_default, queue, priority,"
       " timeout_seconds, key, releases, run_after = created_at FROM fleetless.jobs WHERE id = %s")


def test_the_default_options_statements_write_what_the_general_ones_write(queue: Queue, sql) -> None:
    """enqueue(kind, payload) and enqueue_many's (kind, payload) items take leaner statements (three
    parameters, three COPY columns, the rest the columns' defaults): their rows are the general
    statement's with the same options, and ids follow the order given whichever COPY wrote them."""
    lean = queue.enqueue("greet", {"a": [1, "x"]})
    general = queue._run("enqueue", {**queue.job_params("greet", {"a": [1, "x"]}), "channel": queue.channel})
    assert sql(ROW, lean) == sql(ROW, general[0]["id"]) == [
        ("greet", {"a": [1, "x"]}, "pending", 0, 3, True, "default", 0, None, None, 0, True)]
    ids = queue.enqueue_many([("greet", {"a": [1, "x"]}), {"kind": "report", "payload": {}, "priority": 5},
                              ("greet", {}), {"kind": "once", "payload": {}, "key": "k1"}, ("greet", {})])
    plain = [ids[0], ids[1], ids[2], ids[4]]
    assert plain == sorted(plain) and len(set(ids)) == 5
    assert sql(ROW, ids[0]) == sql(ROW, lean)
    assert sql("SELECT kind, priority, max_attempts_default, key FROM fleetless.jobs WHERE id = ANY(%s) ORDER BY id",
               ids[1:4]) == [("report", 5, True, None), ("greet", 0, True, None), ("once", 0, True, "k1")]


def test_enqueue_on_a_callers_connection_with_dict_rows_returns_the_ids(queue: Queue, dsn: str, sql) -> None:
    """The caller's connection may make dicts of rows (its row_factory): the ids come back all the
    same, and the jobs are written once."""
    from psycopg.rows import dict_row

    with psycopg.connect(dsn, row_factory=dict_row) as c:
        one = queue.enqueue("greet", {})
        two = queue.enqueue("greet", {"x": 1}, conn=c, priority=2)
        many = queue.enqueue_many([("greet", {}), {"kind": "greet", "payload": {}, "key": "k"}], conn=c)
    assert sql("SELECT id FROM fleetless.jobs ORDER BY id") == [(i,) for i in sorted([one, two, *many])]


def test_enqueue_many_options_are_every_items_defaults_and_an_items_own_win(queue: Queue, sql) -> None:
    """Issue 28: ``enqueue_many(..., queue=..., priority=...)`` applies to every item, the (kind,
    payload) tuples the lean COPY would write from the columns' defaults too; an item's own option wins."""
    ids = queue.enqueue_many([("greet", {"i": 0}), {"kind": "greet", "payload": {}, "queue": "own"},
                              {"kind": "greet", "payload": {}, "priority": 9, "key": "k"}, ("greet", {"i": 3})],
                             queue="bulk", priority=2, max_attempts=7, delay=60)
    rows = sql("SELECT id, queue, priority, max_attempts, run_after > now() + interval '50 seconds'"
               " FROM fleetless.jobs ORDER BY id")
    assert [r[0] for r in rows] == sorted(ids) and len(set(ids)) == 4
    got = {r[0]: r[1:] for r in rows}
    assert [got[i] for i in ids] == [("bulk", 2, 7, True), ("own", 2, 7, True), ("bulk", 9, 7, True),
                                     ("bulk", 2, 7, True)]


def test_enqueue_many_with_one_bad_item_writes_nothing(queue: Queue, sql) -> None:
    with pytest.raises(ValueError, match=r"job #2: invalid job kind"):
        queue.enqueue_many([("a", {}), ("b", {}), ("Bad Kind", {})])
    assert sql("SELECT count(*) FROM fleetless.jobs") == [(0,)]


@pytest.mark.parametrize("kind", ["../etc/passwd", "A B", "", "a..b", "UPPER", "-lead", "x" * 65, "a/b",
                                  "a\x00b", "é"])
def test_bad_kind_names_are_refused_before_sql(queue: Queue, sql, kind: str) -> None:
    with pytest.raises(ValueError, match="invalid job kind"):
        queue.enqueue(kind, {})
    assert sql("SELECT count(*) FROM fleetless.jobs") == [(0,)]


def test_bad_kinds_are_also_refused_by_the_table_itself(queue: Queue, sql) -> None:
    with pytest.raises(psycopg.errors.CheckViolation):
        sql("INSERT INTO fleetless.jobs (kind, payload) VALUES ('../etc/passwd', '{}')")


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"s": "a\x00b"}, "NUL"),
        ({"s": "\ud800"}, "surrogate"),
        ({"x": float("nan")}, "not JSON-serialisable"),
        ({"x": object()}, "not JSON-serialisable"),
    ],
)
def test_payloads_jsonb_cannot_store_are_refused_clearly(queue: Queue, payload: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        queue.enqueue("greet", payload)


def test_payload_over_the_size_limit_is_refused(dsn: str, queue: Queue) -> None:
    small = Queue(dsn, max_payload_bytes=1000)
    with pytest.raises(ValueError, match="over the limit of 1000 bytes"):
        small.enqueue("greet", {"blob": "x" * 2000})
    small.close()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_attempts": 0}, "max_attempts"),
        ({"priority": 2**40}, "priority"),
        ({"delay": -1}, "delay"),
        ({"timeout": 0}, "timeout"),
        ({"queue": "bad queue"}, "invalid queue name"),
        ({"run_after": dt.datetime(2030, 1, 1)}, "timezone-aware"),
    ],
)
def test_bad_options_are_refused(queue: Queue, options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        queue.enqueue("greet", {}, **options)  # type: ignore[arg-type]


def test_claim_takes_due_jobs_by_priority_then_due_time(queue: Queue, sql) -> None:
    low = queue.enqueue("a", {})
    high = queue.enqueue("a", {}, priority=5)
    later = queue.enqueue("a", {}, delay=3600)
    other = queue.enqueue("a", {}, queue="other")
    jobs = queue.claim(10, queues=["default"])
    assert [j.id for j in jobs] == [high, low]
    assert all(j.attempts == 1 for j in jobs)
    rows = sql("SELECT id, status, claim_token IS NOT NULL, locked_at IS NOT NULL, started_at IS NOT NULL,"
               " lease_expires_at > now() FROM fleetless.jobs ORDER BY id")
    assert rows == [
        (low, "running", True, True, True, True),
        (high, "running", True, True, True, True),
        (later, "pending", False, False, False, None),
        (other, "pending", False, False, False, None),
    ]
    assert [j.id for j in queue.claim(10)] == [other]


def test_lease_is_timeout_plus_grace_and_job_timeout_overrides(queue: Queue, sql) -> None:
    a = queue.enqueue("a", {})
    b = queue.enqueue("a", {}, timeout=5)
    queue.claim(2, default_timeout=100, ttl=900, lease_grace=10)
    rows = dict(sql("SELECT id, round(extract(epoch FROM lease_expires_at - locked_at)) FROM fleetless.jobs"))
    assert rows[a] == 110 and rows[b] == 15


def test_two_claimers_never_get_the_same_job(dsn: str, queue: Queue) -> None:
    queue.enqueue_many([("a", {"i": i}) for i in range(500)])
    seen: list[list[int]] = [[], []]

    def claimer(k: int) -> None:
        q = Queue(dsn)
        while jobs := q.claim(7):
            seen[k].extend(j.id for j in jobs)
        q.close()

    threads = [threading.Thread(target=claimer, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen[0]) + len(seen[1]) == 500
    assert set(seen[0]).isdisjoint(seen[1])


def test_complete_stores_result_capped_and_clean(queue: Queue, sql) -> None:
    queue.enqueue("a", {})
    (job,) = queue.claim(1)
    assert queue.complete(job, "x\x00y" + "z" * 100_000)
    status, result, error, finished = sql(
        "SELECT status, result, last_error, finished_at IS NOT NULL FROM fleetless.jobs")[0]
    assert status == "done" and error is None and finished
    assert isinstance(result, str) and result.startswith("x\ufffdy")
    assert result == ("x\ufffdy" + "z" * 100_000)[:64 * 1024] + RESULT_CUT_MARKER


def test_fail_with_attempts_left_goes_back_to_pending_after_the_delay(queue: Queue, sql) -> None:
    queue.enqueue("a", {}, max_attempts=2)
    (job,) = queue.claim(1)
    assert queue.fail(job, "boom", delay=125) is Status.PENDING
    status, error, wait, token = sql(
        "SELECT status, last_error, extract(epoch FROM run_after - now()), locked_at FROM fleetless.jobs")[0]
    assert status == "pending" and error == "boom" and token is None
    assert 120 < float(wait) <= 125  # type: ignore[arg-type]
    assert queue.claim(1) == []  # not due yet


def test_exhausted_or_permanent_failure_is_dead_with_the_error_tail(queue: Queue, sql) -> None:
    queue.enqueue("a", {}, max_attempts=1)
    queue.enqueue("b", {}, max_attempts=3)
    a, b = queue.claim(2)
    assert queue.fail(a, "head " + "e" * 5000 + " the end", delay=0) is Status.DEAD
    assert queue.fail(b, "no handler", delay=0, permanent=True) is Status.DEAD
    rows = sql("SELECT status, length(last_error), right(last_error, 7), finished_at IS NOT NULL"
               " FROM fleetless.jobs ORDER BY id")
    assert rows == [("dead", 2000, "the end", True), ("dead", 10, "handler", True)]


def test_finish_is_fenced_on_the_claim_token(queue: Queue, sql) -> None:
    """A drainer whose lease was reaped cannot overwrite the outcome of the one that took over."""
    queue.enqueue("a", {})
    (old,) = queue.claim(1, lease_grace=0, default_timeout=1)
    sql("UPDATE fleetless.jobs SET lease_expires_at = now() - interval '1 second'")
    assert queue.reap() == {old.id: Status.PENDING}
    (new,) = queue.claim(1)
    assert new.id == old.id and new.claim_token != old.claim_token and new.attempts == 2
    assert queue.complete(new, "second drainer's result")
    # The first drainer wakes up and reports: every write is refused.
    assert queue.complete(old, "stale") is False
    assert queue.fail(old, "stale", delay=0) is None
    assert queue.release(old, "stale") is None
    assert sql("SELECT status, result, attempts FROM fleetless.jobs") == [("done", "second drainer's result", 2)]


def test_stale_claim_cannot_finish_even_before_the_job_is_reclaimed(queue: Queue, sql) -> None:
    queue.enqueue("a", {})
    (old,) = queue.claim(1)
    sql("UPDATE fleetless.jobs SET lease_expires_at = now() - interval '1 second'")
    queue.reap()
    assert queue.complete(old, "late") is False
    assert sql("SELECT status FROM fleetless.jobs") == [("pending",)]


def test_reaper_returns_expired_leases_and_kills_exhausted_ones(queue: Queue, sql) -> None:
    queue.enqueue("a", {}, max_attempts=3)
    queue.enqueue("b", {}, max_attempts=1)
    queue.enqueue("c", {})
    queue.claim(3)
    sql("UPDATE fleetless.jobs SET lease_expires_at = now() - interval '1 second' WHERE kind IN ('a', 'b')")
    reaped = queue.reap()
    assert sorted(reaped.values()) == [Status.DEAD, Status.PENDING]
    rows = sql("SELECT kind, status, claim_token IS NULL, last_error LIKE 'claim expired%%' FROM fleetless.jobs"
               " ORDER BY id")
    assert rows == [("a", "pending", True, True), ("b", "dead", True, True), ("c", "running", False, None)]


def test_reaper_older_than_uses_locked_at_as_in_the_seed(queue: Queue, sql) -> None:
    queue.enqueue("a", {})
    queue.claim(1, default_timeout=3600)
    assert queue.reap() == {}
    sql("UPDATE fleetless.jobs SET locked_at = now() - interval '31 minutes'")
    assert list(queue.reap(older_than=dt.timedelta(minutes=30)).values()) == [Status.PENDING]


def test_release_gives_the_attempt_back(queue: Queue, sql) -> None:
    queue.enqueue("a", {})
    (job,) = queue.claim(1)
    assert queue.release(job, "drainer stopping")
    assert sql("SELECT status, attempts, last_error FROM fleetless.jobs") == [("pending", 0, "drainer stopping")]


def test_retry_and_cancel_by_operators(queue: Queue, sql) -> None:
    dead = queue.enqueue("a", {}, max_attempts=1)
    pending = queue.enqueue("b", {})
    (job,) = queue.claim(1)
    queue.fail(job, "boom", delay=0)
    queue.retry(dead)
    assert sql("SELECT status, attempts, max_attempts, run_after <= now() FROM fleetless.jobs WHERE id = %s",
               dead) == [("pending", 1, 2, True)]
    queue.cancel(pending)
    with pytest.raises(ValueError, match=f"job {pending} is cancelled; only pending or running jobs can be cancelled"):
        queue.cancel(pending)
    with pytest.raises(ValueError, match="only dead or cancelled jobs can be retried"):
        queue.retry(dead)
    with pytest.raises(JobNotFound, match="no job with id 999"):
        queue.cancel(999)
    queue.retry(pending)
    assert sql("SELECT status FROM fleetless.jobs ORDER BY id") == [("pending",), ("pending",)]


def test_retry_all_dead(queue: Queue) -> None:
    queue.enqueue_many([{"kind": "a", "payload": {}, "max_attempts": 1}] * 3)
    for job in queue.claim(3):
        queue.fail(job, "x", delay=0)
    assert len(queue.retry_all_dead()) == 3
    assert queue.stats()["by_status"]["pending"] == 3


def test_stats_counts_and_ages(queue: Queue, sql) -> None:
    queue.enqueue("a", {})
    queue.enqueue("b", {}, delay=600)
    sql("UPDATE fleetless.jobs SET run_after = now() - interval '90 seconds' WHERE kind = 'a'")
    s = queue.stats()
    assert s["by_status"]["pending"] == 2 and s["by_kind"] == {"a": {"pending": 1}, "b": {"pending": 1}}
    assert 89 < s["oldest_due_age_seconds"] < 100
    assert 500 < s["next_due_in_seconds"] <= 600


def test_prune_deletes_old_finished_jobs_but_keeps_dead_unless_asked(queue: Queue, sql) -> None:
    queue.enqueue_many([{"kind": "a", "payload": {}, "max_attempts": 1}] * 2)
    done, dead = queue.claim(2)
    queue.complete(done)
    queue.fail(dead, "x", delay=0)
    sql("UPDATE fleetless.jobs SET finished_at = now() - interval '8 days'")
    assert queue.prune(7 * 86400) == 1
    assert queue.prune(7 * 86400, include_dead=True) == 1
    assert sql("SELECT count(*) FROM fleetless.jobs") == [(0,)]


@pytest.mark.parametrize("evil", ["a'; DROP TABLE fleetless.jobs; --", "x\") OR 1=1 --", "default'--"])
def test_sql_injection_in_strings_is_inert(queue: Queue, sql, evil: str) -> None:
    with pytest.raises(ValueError):
        queue.enqueue(evil, {})
    with pytest.raises(ValueError):
        queue.enqueue("a", {}, queue=evil)
    job_id = queue.enqueue("a", {evil: evil})
    assert sql("SELECT payload FROM fleetless.jobs WHERE id = %s", job_id) == [({evil: evil},)]
    with pytest.raises(ValueError):
        Queue("dbname=x", schema=evil)


def test_enqueue_notifies_watchers_in_its_own_transaction(queue: Queue, dsn: str) -> None:
    """A committed enqueue wakes watchers (payload: its queue); a rolled-back one wakes no one;
    enqueue_many notifies once. Each check ends with a later enqueue, so nothing is waited for
    that might never come: what arrives before it is all there is."""
    listener = psycopg.connect(dsn, autocommit=True)
    listener.execute(f'LISTEN "{queue.channel}"')

    def heard(n: int) -> list[str]:
        return [note.payload for note in listener.notifies(timeout=30, stop_after=n)]

    with psycopg.connect(dsn) as c:
        queue.enqueue("k", {}, queue="rolled", conn=c)
        c.rollback()
    queue.enqueue("k", {}, queue="mail")
    assert heard(1) == ["mail"]
    queue.enqueue_many([("k", {}), {"kind": "k", "payload": {}, "queue": "b"}, ("k", {})])
    queue.enqueue("k", {}, queue="last")
    assert heard(2) == ["b,default", "last"]
    listener.close()


def test_a_queues_own_direct_connection_prepares_the_single_enqueue_and_nothing_else(
        queue: Queue, dsn: str, sql) -> None:
    """Preparing halves the server's work for a one-row INSERT (bench/run.py --only enqueue). Only
    the enqueue asks for it, and only on the queue's own connection once it is known to reach
    the server directly; through a transaction pooler nothing is prepared
    (test_pooler.test_the_same_queries_from_several_clients_never_trip_over_prepared_statements)."""
    q = Queue(dsn)
    try:
        for i in range(8):
            q.enqueue("k", {"i": i})
        (job,) = q.claim(1)
        assert q.complete(job, "ok")
        q.stats()
        with q._connection() as c:
            prepared = [r[0] for r in c.execute("SELECT statement FROM pg_prepared_statements")]
        assert len(prepared) == 1 and "INSERT INTO" in prepared[0] and "pg_notify" in prepared[0]
        with psycopg.connect(dsn, prepare_threshold=None) as caller:  # the caller decides on its own
            for i in range(8):
                q.enqueue("k", {"mine": i}, conn=caller)
            assert caller.execute("SELECT count(*) FROM pg_prepared_statements").fetchone() == (0,)
    finally:
        q.close()
    assert sql("SELECT count(*) FROM fleetless.jobs") == [(16,)]


def test_queue_reads_database_url_and_fleetless_schema_as_the_cli_does(
        dsn: str, sql, fleetless, monkeypatch: pytest.MonkeyPatch) -> None:
    """An app with FLEETLESS_SCHEMA=t10 writes where `fleetless status` (same environment) reads."""
    monkeypatch.setenv("DATABASE_URL", dsn)
    monkeypatch.setenv("FLEETLESS_SCHEMA", "app_t10")
    q = Queue()
    assert q.schema == "app_t10"
    q.init()
    job_id = q.enqueue("greet", {})
    q.close()
    assert sql("SELECT id FROM app_t10.jobs") == [(job_id,)]
    r = fleetless("status", "--json", dsn=dsn, env={"FLEETLESS_SCHEMA": "app_t10"})
    assert r.returncode == 0, r.stderr
    assert '"pending": 1' in r.stdout
    # Explicit arguments still win over the environment.
    explicit = Queue(dsn, schema="fleetless")
    assert explicit.schema == "fleetless"
    explicit.close()
    monkeypatch.delenv("DATABASE_URL")
    with pytest.raises(ValueError, match="DATABASE_URL"):
        Queue()


def test_enqueue_many_into_many_queues_splits_its_notify_under_the_payload_limit(queue: Queue, dsn: str,
                                                                                  sql) -> None:
    """150 queues of 60-character names are 9,150 bytes of names: over NOTIFY's 8,000-byte payload
    limit in one payload, which failed the whole enqueue_many on 61e842d. Now the queues go out as
    several payloads, each under the limit, and every queue is named in one of them."""
    names = [f"q{i:03d}-" + "x" * 55 for i in range(150)]
    listener = psycopg.connect(dsn, autocommit=True)
    listener.execute(f'LISTEN "{queue.channel}"')
    ids = queue.enqueue_many([{"kind": "k", "payload": {}, "queue": name} for name in names])
    assert len(ids) == 150
    assert sql("SELECT count(DISTINCT queue) FROM fleetless.jobs WHERE status = 'pending'") == [(150,)]
    queue.enqueue("k", {}, queue="last")
    heard = []
    for note in listener.notifies(timeout=30):
        if note.payload == "last":
            break
        heard.append(note.payload)
    listener.close()
    assert len(heard) == 2 and all(len(p.encode()) < 8000 for p in heard)
    assert sorted(",".join(heard).split(",")) == names


def test_run_now_and_retry_wake_watchers_as_an_enqueue_does(queue: Queue, dsn: str) -> None:
    """Issue 26.10: on 61e842d `run-now`, `retry` and `retry --all-dead` sent no NOTIFY, so an idle
    watcher started the job up to a minute later. Each now notifies the job's queue in its own
    transaction. The check ends with a later enqueue, so nothing is waited for that might never
    come: what arrives before it is all there is."""
    later = queue.enqueue("k", {}, queue="later", delay=3600)
    dead = queue.enqueue("k", {}, queue="dead", max_attempts=1)
    also_dead = queue.enqueue("k", {}, queue="also", max_attempts=1)
    for job in queue.claim(2):
        queue.fail(job, "boom", delay=0)
    listener = psycopg.connect(dsn, autocommit=True)
    listener.execute(f'LISTEN "{queue.channel}"')
    queue.run_now(later)
    queue.retry(dead)
    (claimed,) = queue.claim(1, queues=["dead"])
    queue.fail(claimed, "boom again", delay=0)
    assert sorted(queue.retry_all_dead()) == sorted([dead, also_dead])
    queue.enqueue("k", {}, queue="last")
    heard = []
    for note in listener.notifies(timeout=30):
        heard.append(note.payload)
        if note.payload == "last":
            break
    listener.close()
    assert heard[:2] == ["later", "dead"] and sorted(heard[2:4]) == ["also", "dead"] and heard[4:] == ["last"]


def test_a_claim_that_skips_kinds_takes_the_others_in_claim_order_across_kinds_and_queues(
        queue: Queue, dsn: str) -> None:
    a1 = queue.enqueue("a", {})
    skipped = [queue.enqueue("s", {}, priority=9) for _ in range(3)]
    b_high = queue.enqueue("b", {}, priority=5, queue="other")
    a_high = queue.enqueue("a", {}, priority=5)
    queue.enqueue("b", {}, delay=3600)
    b1 = queue.enqueue("b", {})
    a2 = queue.enqueue("a", {})
    # a concurrent claim holds a1: passed over, as by the claim without skip_kinds
    with psycopg.connect(dsn) as other:
        other.execute("SELECT 1 FROM fleetless.jobs WHERE id = %s FOR UPDATE", (a1,))
        assert [j.id for j in queue.claim(3, skip_kinds=["s"])] == [b_high, a_high, b1]
        assert [j.id for j in queue.claim(10, skip_kinds=["s"], queues=["default"])] == [a2]
    assert [j.id for j in queue.claim(10, skip_kinds=["s", "b"], one_kind=True)] == [a1]
    assert queue.claim(10, skip_kinds=["s", "b", "a"], one_kind=True) == []
    assert [j.id for j in queue.claim(10)] == skipped
