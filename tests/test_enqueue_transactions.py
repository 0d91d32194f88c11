"""A job exists only if the caller's transaction commits: every write that takes ``conn=`` joins
the caller's transaction even as its very first statement, inside psycopg's own ``transaction()``
blocks, and on a pooled connection."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from fleetless import Queue

WRITES: dict[str, Callable[[Queue, psycopg.Connection[Any]], object]] = {
    "enqueue": lambda q, c: q.enqueue("greet", {"n": 1}, conn=c),
    "enqueue_many": lambda q, c: q.enqueue_many([("greet", {"n": 1}), ("greet", {"n": 2})], conn=c),
}


class Boom(Exception):
    pass


@pytest.mark.parametrize("write", list(WRITES))
def test_a_write_as_the_first_statement_of_a_rolled_back_transaction_leaves_nothing(
        dsn: str, queue: Queue, sql, write: str) -> None:
    with pytest.raises(Boom), psycopg.connect(dsn) as conn:
        WRITES[write](queue, conn)
        raise Boom
    assert sql("SELECT count(*) FROM fleetless.jobs") == [(0,)]


@pytest.mark.parametrize("write", list(WRITES))
def test_a_write_as_the_first_statement_then_rollback_leaves_nothing(dsn: str, queue: Queue, sql,
                                                                      write: str) -> None:
    with psycopg.connect(dsn) as conn:
        WRITES[write](queue, conn)
        conn.rollback()
    assert sql("SELECT count(*) FROM fleetless.jobs") == [(0,)]


@pytest.mark.parametrize("write", list(WRITES))
def test_a_write_inside_psycopgs_transaction_block_rolls_back_with_it(dsn: str, queue: Queue, sql,
                                                                       write: str) -> None:
    with psycopg.connect(dsn) as conn:
        with pytest.raises(Boom), conn.transaction():
            WRITES[write](queue, conn)
            raise Boom
        with pytest.raises(Boom), psycopg.connect(dsn, autocommit=True) as auto, auto.transaction():
            WRITES[write](queue, auto)
            raise Boom
    assert sql("SELECT count(*) FROM fleetless.jobs") == [(0,)]


@pytest.mark.parametrize("write", list(WRITES))
def test_a_write_on_a_pooled_connection_rolls_back_with_it(dsn: str, queue: Queue, sql, write: str) -> None:
    with ConnectionPool(dsn, min_size=1, max_size=1, open=True) as pool:
        with pytest.raises(Boom), pool.connection() as conn:
            WRITES[write](queue, conn)
            raise Boom
        assert sql("SELECT count(*) FROM fleetless.jobs") == [(0,)]
        with pool.connection() as conn:
            WRITES[write](queue, conn)
        assert sql("SELECT count(*) FROM fleetless.jobs WHERE status = 'pending'") != [(0,)]


@pytest.mark.parametrize("write", list(WRITES))
def test_a_write_as_the_first_statement_of_a_committed_transaction_appears_on_commit(
        dsn: str, queue: Queue, sql, write: str) -> None:
    with psycopg.connect(dsn) as conn:
        WRITES[write](queue, conn)
        assert sql("SELECT count(*) FROM fleetless.jobs") == [(0,)]  # not before the commit
    assert sql("SELECT count(*) FROM fleetless.jobs") != [(0,)]


def test_a_failing_enqueue_many_inside_the_callers_transaction_leaves_it_usable(
        dsn: str, queue: Queue, sql) -> None:
    with psycopg.connect(dsn) as conn:
        first = queue.enqueue("greet", {"kept": True}, conn=conn)
        with pytest.raises(ValueError, match="job #1"):
            queue.enqueue_many([("greet", {}), ("Bad Kind", {})], conn=conn)
        queue.enqueue_many([("greet", {"also": True})], conn=conn)
    assert sql("SELECT id FROM fleetless.jobs ORDER BY id")[0] == (first,)
    assert sql("SELECT count(*) FROM fleetless.jobs") == [(2,)]


def test_enqueue_many_streams_a_generator_in_chunks_and_a_late_bad_item_writes_nothing(
        queue: Queue, sql) -> None:
    from fleetless.queue import ENQUEUE_CHUNK

    n = 2 * ENQUEUE_CHUNK + 7

    def jobs(bad_at: int | None):  # type: ignore[no-untyped-def]
        for i in range(n):
            yield ("Bad Kind" if i == bad_at else "greet", {"i": i})

    with pytest.raises(ValueError, match=rf"job #{ENQUEUE_CHUNK + 3}: invalid job kind"):
        queue.enqueue_many(jobs(ENQUEUE_CHUNK + 3))
    assert sql("SELECT count(*) FROM fleetless.jobs") == [(0,)]
    ids = queue.enqueue_many(jobs(None))
    assert len(ids) == n and ids == sorted(ids)
    assert sql("SELECT payload FROM fleetless.jobs WHERE id = %s", ids[-1]) == [({"i": n - 1},)]


def test_a_queue_built_on_a_connection_pool_takes_each_statement_from_the_pool(dsn: str, queue: Queue, sql) -> None:
    """``Queue(pool)``: fleetless imports psycopg_pool only when the app has (a drain's start does
    not pay for it); the pool it is given is still recognised and used, never left holding a
    connection."""
    with ConnectionPool(dsn, min_size=1, max_size=1, open=True) as pool:
        q = Queue(pool)
        job_id = q.enqueue("greet", {"n": 1})
        (job,) = q.claim(1)
        assert job.id == job_id and q.complete(job, "ok")
        assert pool.get_stats()["pool_available"] == 1  # returned after each statement
        q.close()
    assert sql("SELECT status FROM fleetless.jobs") == [("done",)]
