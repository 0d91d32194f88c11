"""Job keys: at most one pending or running job per key, decided by a unique partial index, under
concurrent enqueues, inside callers' transactions and in enqueue_many."""

from __future__ import annotations

import threading

import psycopg
import pytest

from fleetless import Queue
from fleetless.queue import DuplicateJob

from proctools import wait_for


def test_a_duplicate_key_returns_the_existing_job_and_writes_nothing(queue: Queue, sql) -> None:
    first = queue.enqueue("invoice", {"n": 1}, key="invoice-42")
    assert queue.enqueue("invoice", {"n": 2}, key="invoice-42") == first
    assert sql("SELECT id, payload, key FROM fleetless.jobs") == [(first, {"n": 1}, "invoice-42")]
    assert queue.enqueue("invoice", {}, key="invoice-43") != first


def test_a_key_is_free_again_once_its_job_has_finished(queue: Queue, sql) -> None:
    first = queue.enqueue("invoice", {}, key="k")
    (job,) = queue.claim(1)
    assert queue.enqueue("invoice", {}, key="k") == first  # running still holds it
    queue.complete(job)
    second = queue.enqueue("invoice", {}, key="k")
    assert second != first
    assert sql("SELECT id, status FROM fleetless.jobs ORDER BY id") == [(first, "done"), (second, "pending")]


def test_replace_gives_a_pending_job_the_new_payload_but_leaves_a_running_one(queue: Queue, sql) -> None:
    job_id = queue.enqueue("invoice", {"v": 1}, key="k")
    assert queue.enqueue("invoice", {"v": 2}, key="k", on_duplicate="replace", priority=5) == job_id
    assert sql("SELECT payload, priority FROM fleetless.jobs") == [({"v": 2}, 5)]
    queue.claim(1)
    assert queue.enqueue("invoice", {"v": 3}, key="k", on_duplicate="replace") == job_id
    assert sql("SELECT payload, status FROM fleetless.jobs") == [({"v": 2}, "running")]


def test_raise_names_the_existing_job_and_leaves_the_callers_transaction_usable(dsn: str, queue: Queue,
                                                                               sql) -> None:
    existing = queue.enqueue("invoice", {}, key="k")
    with psycopg.connect(dsn) as conn:
        with pytest.raises(DuplicateJob) as err:
            queue.enqueue("invoice", {}, key="k", on_duplicate="raise", conn=conn)
        assert err.value.existing_id == existing
        other = queue.enqueue("invoice", {}, key="other", conn=conn)  # the transaction goes on
    assert sql("SELECT id FROM fleetless.jobs ORDER BY id") == [(existing,), (other,)]


def test_bad_keys_are_one_line_errors(queue: Queue) -> None:
    for bad in ("", "x" * 256, "a\x00b", 42):
        with pytest.raises(ValueError, match="key must be a string of 1 to 255"):
            queue.enqueue("a", {}, key=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="on_duplicate must be one of"):
        queue.enqueue("a", {}, key="k", on_duplicate="merge")  # type: ignore[arg-type]


def test_concurrent_enqueues_of_one_key_make_exactly_one_job(dsn: str, queue: Queue, sql) -> None:
    n = 8
    barrier = threading.Barrier(n)
    got: list[int] = []

    def enqueue() -> None:
        q = Queue(dsn)
        try:
            barrier.wait()
            for i in range(20):
                got.append(q.enqueue("invoice", {}, key=f"k{i}"))
        finally:
            q.close()

    threads = [threading.Thread(target=enqueue) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == n * 20
    assert sql("SELECT count(*), count(DISTINCT key) FROM fleetless.jobs") == [(20, 20)]
    assert set(got) == {r[0] for r in sql("SELECT id FROM fleetless.jobs")}


@pytest.mark.parametrize("commit", [True, False])
def test_an_enqueue_waits_for_an_uncommitted_duplicate_and_follows_its_fate(dsn: str, queue: Queue, sql,
                                                                            commit: bool) -> None:
    with psycopg.connect(dsn) as conn:
        held = queue.enqueue("invoice", {"from": "txn"}, key="k", conn=conn)
        result: list[int] = []
        t = threading.Thread(target=lambda: result.append(Queue(dsn).enqueue("invoice", {"from": "b"}, key="k")))
        t.start()
        wait_for(lambda: sql("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                             " AND datname = current_database()") == [(1,)], what="the second enqueue to wait")
        if commit:
            conn.commit()
        else:
            conn.rollback()
    t.join(timeout=30)
    rows = sql("SELECT id, payload FROM fleetless.jobs WHERE status = 'pending'")
    if commit:
        assert result == [held] and rows == [(held, {"from": "txn"})]
    else:
        assert len(rows) == 1 and rows[0][1] == {"from": "b"} and result == [rows[0][0]]


def test_enqueue_many_with_keys_returns_ids_in_order_one_job_per_key(queue: Queue, sql) -> None:
    existing = queue.enqueue("a", {"v": 0}, key="k1")
    ids = queue.enqueue_many([
        ("a", {"v": 1}),
        {"kind": "a", "payload": {"v": 2}, "key": "k1"},
        {"kind": "a", "payload": {"v": 3}, "key": "k2"},
        {"kind": "a", "payload": {"v": 4}, "key": "k2"},
        ("a", {"v": 5}),
    ])
    assert ids[1] == existing and ids[2] == ids[3] and len(set(ids)) == 4
    assert sql("SELECT id, payload->>'v', key FROM fleetless.jobs ORDER BY id") == sorted([
        (existing, "0", "k1"), (ids[0], "1", None), (ids[2], "3", "k2"), (ids[4], "5", None)])
    with pytest.raises(DuplicateJob):
        queue.enqueue_many([("a", {"v": 6}), {"kind": "a", "payload": {}, "key": "k1", "on_duplicate": "raise"}])
    assert sql("SELECT count(*) FROM fleetless.jobs") == [(4,)]  # all or none


def test_enqueue_many_with_keys_in_a_rolled_back_transaction_leaves_nothing(dsn: str, queue: Queue,
                                                                           sql) -> None:
    with psycopg.connect(dsn) as conn:
        queue.enqueue_many([{"kind": "a", "payload": {}, "key": "k"}, ("a", {})], conn=conn)
        conn.rollback()
    assert sql("SELECT count(*) FROM fleetless.jobs") == [(0,)]
    assert queue.enqueue("a", {}, key="k") > 0


def test_retrying_a_dead_job_whose_key_is_taken_is_refused(queue: Queue, sql) -> None:
    queue.enqueue("a", {}, key="k", max_attempts=1)
    (job,) = queue.claim(1)
    queue.fail(job, "boom", delay=0)
    newer = queue.enqueue("a", {}, key="k")
    with pytest.raises(ValueError, match="has a key that a pending, running or waiting job holds"):
        queue.retry(job.id)
    assert queue.retry_all_dead() == []
    queue.cancel(newer)
    assert queue.retry_all_dead() == [job.id]


def test_cli_enqueue_key_prints_the_existing_id(dsn: str, queue: Queue, fleetless) -> None:
    first = fleetless("enqueue", "a", "{}", "--key", "nightly", dsn=dsn)
    again = fleetless("enqueue", "a", "{}", "--key", "nightly", dsn=dsn)
    assert first.returncode == again.returncode == 0 and first.stdout == again.stdout
    dup = fleetless("enqueue", "a", "{}", "--key", "nightly", "--on-duplicate", "raise", dsn=dsn)
    assert dup.returncode == 1
    assert dup.stderr.strip() == f"fleetless: error: job {first.stdout.strip()} with key 'nightly' is already" \
        " pending, running or waiting"


def test_the_returned_id_says_whether_the_key_was_already_held(queue: Queue) -> None:
    first = queue.enqueue("invoice", {"v": 1}, key="k")
    assert (first.existing, first.replaced) == (False, False)
    again = queue.enqueue("invoice", {"v": 2}, key="k")
    assert again == first and (again.existing, again.replaced) == (True, False)
    replaced = queue.enqueue("invoice", {"v": 3}, key="k", on_duplicate="replace")
    assert replaced == first and (replaced.existing, replaced.replaced) == (True, True)
    queue.claim(1)
    running = queue.enqueue("invoice", {"v": 4}, key="k", on_duplicate="replace")
    assert (running.existing, running.replaced) == (True, False)  # a running job is left alone
    plain = queue.enqueue("invoice", {})
    assert (plain.existing, plain.replaced) == (False, False) and isinstance(plain, int)


def test_replace_keeps_the_jobs_due_time_unless_a_new_one_is_given(queue: Queue, sql) -> None:
    job_id = queue.enqueue("digest", {"v": 1}, key="k", delay=3600)
    queue.enqueue("digest", {"v": 2}, key="k", on_duplicate="replace")
    (due,) = sql("SELECT extract(epoch FROM run_after - now())::int, payload FROM fleetless.jobs")
    assert 3500 < due[0] <= 3600 and due[1] == {"v": 2}
    queue.enqueue("digest", {"v": 3}, key="k", on_duplicate="replace", delay=60)
    assert 0 < sql("SELECT extract(epoch FROM run_after - now())::int FROM fleetless.jobs WHERE id = %s",
                   job_id)[0][0] <= 60


def test_cli_enqueue_key_says_when_it_returned_an_existing_job(dsn: str, queue: Queue, fleetless) -> None:
    import json

    first = fleetless("enqueue", "a", "{}", "--key", "nightly", "--json", dsn=dsn)
    assert json.loads(first.stdout)["existing"] is False and first.stderr == ""
    again = fleetless("enqueue", "a", "{}", "--key", "nightly", dsn=dsn)
    assert again.stdout.strip() == str(json.loads(first.stdout)["id"])
    assert "already pending, running or waiting: nothing new was enqueued" in again.stderr
    shown = json.loads(fleetless("enqueue", "a", '{"v": 2}', "--key", "nightly", "--on-duplicate", "replace",
                                 "--json", dsn=dsn).stdout)
    assert shown == {"id": json.loads(first.stdout)["id"], "existing": True, "replaced": True}


def test_retry_all_dead_skips_a_job_whose_key_an_enqueue_committing_meanwhile_took(dsn: str, queue: Queue,
                                                                                     sql) -> None:
    """Issue 26.10: a keyed enqueue, not yet committed when `retry --all-dead` runs, takes the dead
    job's key; the retry's update of that job waits on the key's index entry and, once the enqueue
    commits, fails on it. On 61e842d that aborted the whole retry (no dead job retried); the docs
    say the job is skipped: now it is, and every other dead job is retried."""
    queue.enqueue_many([{"kind": "a", "payload": {}, "key": "k", "max_attempts": 1},
                        {"kind": "b", "payload": {}, "max_attempts": 1}])
    keyed, plain = sorted(queue.claim(2), key=lambda j: j.kind)
    queue.fail(keyed, "boom", delay=0)
    queue.fail(plain, "boom", delay=0)
    result: list[list[int]] = []
    errors: list[BaseException] = []

    def retry_all() -> None:
        q = Queue(dsn)
        try:
            result.append(q.retry_all_dead())
        except BaseException as exc:  # the test reports it
            errors.append(exc)
        finally:
            q.close()

    with psycopg.connect(dsn) as conn:
        newer = queue.enqueue("a", {"new": True}, key="k", conn=conn)  # not committed yet
        t = threading.Thread(target=retry_all)
        t.start()
        wait_for(lambda: sql("SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)"
                             " WHERE a.datname = current_database() AND l.locktype = 'transactionid'"
                             " AND NOT l.granted") == [(1,)] or not t.is_alive(),
                 what="the retry to wait for the enqueue")
        conn.commit()
    t.join(timeout=60)
    assert errors == [] and result == [[plain.id]]
    assert dict(sql("SELECT id, status FROM fleetless.jobs")) == {
        keyed.id: "dead", plain.id: "pending", newer: "pending"}


def test_cli_replace_keeps_the_delay_unless_a_new_one_is_given(dsn: str, queue: Queue, fleetless, sql) -> None:
    """Issue 28: ``enqueue --key K --on-duplicate replace`` without ``--delay`` keeps the job's due time;
    with one, takes it."""
    first = fleetless("enqueue", "digest", '{"v": 1}', "--key", "k", "--delay", "1h", dsn=dsn)
    again = fleetless("enqueue", "digest", '{"v": 2}', "--key", "k", "--on-duplicate", "replace", dsn=dsn)
    assert first.returncode == again.returncode == 0 and first.stdout == again.stdout, again
    due = "SELECT extract(epoch FROM run_after - now())::int, payload FROM fleetless.jobs"
    (row,) = sql(due)
    assert 3500 < row[0] <= 3600 and row[1] == {"v": 2}, row
    fleetless("enqueue", "digest", '{"v": 3}', "--key", "k", "--on-duplicate", "replace", "--delay", "60s", dsn=dsn)
    (row,) = sql(due)
    assert 0 < row[0] <= 60 and row[1] == {"v": 3}, row
