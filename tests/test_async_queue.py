"""AsyncQueue on psycopg's AsyncConnection and on asyncpg: a job exists only if the app's
transaction commits; enqueue_many is all or none with the call's defaults; wait is woken by the
finish."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import asyncpg
import psycopg
import pytest
from test_workflows import _blocked_behind

import fleetless.queue as queue_module
from fleetless import AsyncQueue, Queue, WaitTimeout, db
from fleetless.async_queue import asyncpg_dsn
from fleetless.queue import DuplicateJob

from proctools import wait_for

DRIVERS = ["psycopg", "asyncpg"]


async def _connect(driver: str, dsn: str) -> Any:
    if driver == "asyncpg":
        return await asyncpg.connect(asyncpg_dsn(dsn))
    return await psycopg.AsyncConnection.connect(dsn)


async def _in_transaction(driver: str, conn: Any, body: Any, commit: bool) -> Any:
    if driver == "asyncpg":
        tx = conn.transaction()
        await tx.start()
        result = await body()
        await (tx.commit() if commit else tx.rollback())
        return result
    result = await body()
    await (conn.commit() if commit else conn.rollback())
    return result


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_job_exists_only_if_the_apps_transaction_commits(queue: Queue, dsn: str, sql: Any, driver: str) -> None:
    async def main() -> tuple[int, int]:
        conn = await _connect(driver, dsn)
        q = AsyncQueue(conn)
        try:
            kept = await _in_transaction(driver, conn, lambda: q.enqueue("invoice", {"n": 1}, queue="billing",
                                                                          priority=3), True)
            await _in_transaction(driver, conn, lambda: q.enqueue("invoice", {"n": 2}), False)
            many = await _in_transaction(driver, conn, lambda: q.enqueue_many(
                [("thumb", {"i": i}) for i in range(3)] + [{"kind": "thumb", "payload": {}, "priority": 9}],
                queue="media"), False)
            assert len(many) == 4
            return kept, (await q.get(kept))["priority"]
        finally:
            await conn.close()

    kept, priority = asyncio.run(main())
    assert priority == 3
    assert sql("SELECT id, kind, payload, queue FROM fleetless.jobs") == [(kept, "invoice", {"n": 1}, "billing")]


@pytest.mark.parametrize("driver", DRIVERS)
def test_enqueue_many_is_ordered_takes_defaults_and_is_all_or_none(queue: Queue, dsn: str, sql: Any,
                                                                    driver: str) -> None:
    async def main() -> list[int]:
        q = AsyncQueue(dsn, driver=driver)
        ids = await q.enqueue_many([("a", {"i": i}) for i in range(50)] + [{"kind": "b", "payload": {},
                                                                          "queue": "own", "key": "k1"}],
                                   queue="bulk", priority=2)
        with pytest.raises(ValueError, match="job #1: invalid job kind"):
            await q.enqueue_many([("a", {}), ("bad kind!", {})])
        with pytest.raises(DuplicateJob):
            await q.enqueue("b", {}, key="k1", on_duplicate="raise")
        again = await q.enqueue("b", {}, key="k1")
        assert again == ids[-1] and again.existing
        return ids

    ids = asyncio.run(main())
    rows = sql("SELECT id, payload, queue, priority FROM fleetless.jobs ORDER BY id")
    assert [r[0] for r in rows] == ids
    assert [r[1] for r in rows[:50]] == [{"i": i} for i in range(50)]
    assert {(r[2], r[3]) for r in rows[:50]} == {("bulk", 2)} and rows[50][2:] == ("own", 2)


@pytest.mark.parametrize("driver", DRIVERS)
def test_async_wait_is_woken_by_the_finish(queue: Queue, dsn: str, driver: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import fleetless.async_queue as async_module

    monkeypatch.setattr(async_module, "WAIT_RECHECK", 3600.0)  # only the NOTIFY can wake it in time
    monkeypatch.setattr(queue_module, "WAIT_RECHECK", 3600.0)
    job_id = queue.enqueue("render", {})

    def finish() -> None:
        other = Queue(dsn)
        (job,) = other.claim(1)
        other.complete(job, "ok")
        other.close()

    async def main() -> Any:
        q = AsyncQueue(dsn, driver=driver)
        with pytest.raises(WaitTimeout, match="it is pending"):
            await q.wait(job_id, timeout=0.2)
        waiting = asyncio.create_task(q.wait(job_id, timeout=60))
        await asyncio.sleep(0)  # (the finish may come before or after the waiter registers: both hold)
        await asyncio.to_thread(finish)
        return await waiting

    finished = asyncio.run(main())
    assert (finished.status, finished.result) == ("done", "ok")


def test_the_async_queue_needs_a_database_and_names_a_bad_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DATABASE_URL", raising=False)
    with pytest.raises(ValueError, match="no database given"):
        AsyncQueue()
    with pytest.raises(ValueError, match="driver must be psycopg or asyncpg, not 'aiopg'"):
        AsyncQueue("postgresql://x", driver="aiopg")  # type: ignore[arg-type]




@pytest.mark.parametrize("driver", DRIVERS)
def test_async_workflows_enqueue_after_and_a_graph_in_the_apps_transaction(queue: Queue, dsn: str, sql: Any,
                                                                           driver: str) -> None:
    done = queue.enqueue("a", {})
    sql("UPDATE fleetless.jobs SET status = 'done', result = 'out', finished_at = now() WHERE id = %s", done)

    async def scenario(commit: bool) -> list[int]:
        conn = await _connect(driver, dsn)
        try:
            aq = AsyncQueue(conn)

            async def body() -> list[int]:
                ready = await aq.enqueue("b", {"x": 1}, after=[done])
                graph = await aq.enqueue_many([
                    {"kind": "c", "payload": {}, "name": "c"},
                    {"kind": "d", "payload": {}, "name": "d", "after": ["c", done]},
                    {"kind": "e", "payload": {}, "after": ["d"], "on_parent_failure": "run"}])
                return [ready, *graph]

            return list(await _in_transaction(driver, conn, body, commit))
        finally:
            await conn.close()

    asyncio.run(scenario(commit=False))
    assert sql("SELECT count(*) FROM fleetless.jobs") == [(1,)]
    assert sql("SELECT count(*) FROM fleetless.job_dependencies") == [(0,)]
    ready, c, d, e = asyncio.run(scenario(commit=True))
    rows = {r[0]: r[1:] for r in sql("SELECT id, status, parents_left, payload FROM fleetless.jobs")}
    assert rows[ready] == ("pending", 0, {"x": 1, "_parents": {str(done): "out"}})
    assert [rows[j][:2] for j in (c, d, e)] == [("pending", 0), ("waiting", 1), ("waiting", 1)]
    with pytest.raises(ValueError, match="after: no job with id 987654"):
        asyncio.run(AsyncQueue(dsn).enqueue("x", {}, after=[987654]))


@pytest.mark.parametrize("driver", DRIVERS)
def test_async_keyed_children_and_keyed_parents_in_a_graph(queue: Queue, dsn: str, sql: Any, driver: str) -> None:
    """AsyncQueue takes keys with workflows as Queue does: a keyed child is written once (found
    again by its key), a keyed item is a parent in enqueue_many, and a replace never rewires."""
    parent = queue.enqueue("a", {})

    async def scenario() -> tuple[list[int], list[int]]:
        conn = await _connect(driver, dsn)
        try:
            aq = AsyncQueue(conn)

            async def body() -> tuple[list[int], list[int]]:
                child = await aq.enqueue("b", {}, after=[parent], key="child")
                again = await aq.enqueue("b", {}, after=[parent], key="child")
                assert again == child and again.existing
                with pytest.raises(ValueError, match="replace never rewires a workflow"):
                    await aq.enqueue("b", {}, key="child", on_duplicate="replace")
                graph = [{"kind": "c", "payload": {}, "name": "root", "key": "root"},
                         {"kind": "d", "payload": {}, "after": ["root"], "key": "leaf"}]
                return [child, again], [*await aq.enqueue_many(graph), *await aq.enqueue_many(graph)]

            return await _in_transaction(driver, conn, body, commit=True)  # type: ignore[no-any-return]
        finally:
            await conn.close()

    (child, _), (root, leaf, root2, leaf2) = asyncio.run(scenario())
    assert (root2, leaf2) == (root, leaf)
    assert sql("SELECT parent_id, child_id FROM fleetless.job_dependencies ORDER BY 1") == [
        (parent, child), (root, leaf)]
    assert sql("SELECT count(*) FROM fleetless.jobs") == [(4,)]


@pytest.mark.parametrize("driver", DRIVERS)
def test_attempts_reads_the_history_in_its_words(queue: Queue, dsn: str, sql: Any, driver: str) -> None:
    """AsyncQueue.attempts, as Queue.attempts: the history's words and a snooze's count (issue 28:
    the async API had no read of it); JobNotFound for no such job, [] for one never run."""
    from fleetless.queue import JobNotFound

    job, fresh = queue.enqueue("k", {}), queue.enqueue("k", {})
    sql("INSERT INTO fleetless.job_attempts (job_id, attempt, outcome, snooze) VALUES (%s, 1, 'failed', NULL),"
        " (%s, 2, 'retried', NULL), (%s, 3, 'snoozed', 1), (%s, 3, 'retry', NULL)", job, job, job, job)

    async def main() -> tuple[list[Any], list[Any]]:
        conn = await _connect(driver, dsn)
        try:
            q = AsyncQueue(conn)
            with pytest.raises(JobNotFound):
                await q.attempts(10**12)
            return await q.attempts(job), await q.attempts(fresh)
        finally:
            await conn.close()

    rows, none = asyncio.run(main())
    assert [(r["attempt"], r["outcome"], r["snooze"]) for r in rows] == [
        (1, "failed", None), (2, "retried", None), (3, "snoozed", 1), (3, "failed", None)], rows
    assert rows == queue.attempts(job) and none == []


@pytest.mark.parametrize("driver", DRIVERS)
def test_two_async_enqueues_joining_the_same_two_graphs_at_once_take_turns(queue: Queue, dsn: str, sql: Any,
                                                                          driver: str) -> None:
    """As test_workflows.py::test_two_enqueues_joining_the_same_two_graphs_at_once_take_turns, on
    AsyncQueue: the second join waits for the first's graph_joins slots, not a deadlock."""
    a = queue.enqueue("echo", {})
    a1 = queue.enqueue("echo", {}, after=[a])
    b = queue.enqueue("echo", {})
    b1 = queue.enqueue("echo", {}, after=[b])
    out: list[Any] = []

    def join(after: list[int]) -> threading.Thread:
        async def main() -> None:
            try:
                out.append(await AsyncQueue(dsn, driver=driver).enqueue("echo", {}, after=after))
            except Exception as exc:
                out.append(exc)
        t = threading.Thread(target=asyncio.run, args=(main(),))
        t.start()
        return t

    with psycopg.connect(dsn) as holder:
        holder.execute("SELECT FROM fleetless.jobs WHERE id = %s FOR SHARE", (b1,))
        pid = holder.info.backend_pid
        one = join([a, b])
        wait_for(lambda: len(_blocked_behind(sql, pid)) == 1, what="the first join's relabel waiting for b1")
        two = join([a1, b1])
        wait_for(lambda: len(_blocked_behind(sql, pid)) == 2, what="the second join waiting too")
        holder.rollback()
    one.join(30)
    two.join(30)
    assert all(isinstance(x, int) for x in out) and len(out) == 2, out
    rows = dict(sql("SELECT id, graph_id FROM fleetless.jobs WHERE id = ANY(%s)", [a1, b, b1, *out]))
    assert set(rows.values()) == {a}


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_deadlock_that_aborts_an_async_enqueue_says_so_and_to_retry(queue: Queue, dsn: str, sql: Any,
                                                                      driver: str) -> None:
    """As test_workflows.py::test_a_deadlock_that_aborts_an_enqueue_says_so_and_to_retry, on both
    drivers: asyncpg's said 'database: deadlock detected' with its DETAIL lines, psycopg's
    'database unavailable: deadlock detected'."""
    p = queue.enqueue("echo", {})
    q = queue.enqueue("echo", {})

    async def main() -> None:
        conn = await _connect(driver, dsn)
        aq = AsyncQueue(dsn, driver=driver)
        tx = conn.transaction() if driver == "asyncpg" else None
        if tx is not None:
            await tx.start()
        with psycopg.connect(dsn) as other:
            try:
                await aq.enqueue("echo", {}, after=[p], conn=conn)  # p FOR SHARE until the transaction ends
                pid = await conn.fetchval("SELECT pg_backend_pid()") if tx is not None else conn.info.backend_pid
                other.execute("SET deadlock_timeout = '1min'")  # the app's session is the one that breaks it
                other.execute("SELECT FROM fleetless.jobs WHERE id = %s FOR UPDATE", (q,))
                updating = threading.Thread(target=other.execute,
                                            args=("UPDATE fleetless.jobs SET priority = 1 WHERE id = %s", (p,)))
                updating.start()
                await asyncio.to_thread(wait_for, lambda: _blocked_behind(sql, pid),
                                        what="the update waiting for the app's lock")
                with pytest.raises(db.TransactionConflict) as raised:
                    await aq.enqueue("echo", {}, after=[q], conn=conn)
                assert str(raised.value) == "deadlock detected: retry the transaction"
            finally:
                await (tx.rollback() if tx is not None else conn.rollback())
                await conn.close()
            updating.join(30)
            other.commit()

    asyncio.run(main())
    assert sql("SELECT priority FROM fleetless.jobs WHERE id = %s", p) == [(1,)]


@pytest.mark.parametrize("driver", DRIVERS)
def test_an_async_join_whose_graph_joined_another_meanwhile_takes_that_graphs_slot_too(
        queue: Queue, dsn: str, sql: Any, driver: str) -> None:
    """As test_workflows.py::test_a_join_whose_graph_joined_another_meanwhile_takes_that_graphs_slot_too,
    on AsyncQueue: the savepoint given back and the slots taken again, on both drivers."""
    from fleetless.graphs import JOIN_SLOTS

    a = queue.enqueue("echo", {})
    queue.enqueue("echo", {}, after=[a])
    b = queue.enqueue("echo", {})
    b1 = queue.enqueue("echo", {}, after=[b])
    c = queue.enqueue("echo", {})
    c1 = queue.enqueue("echo", {}, after=[c])
    out: list[Any] = []

    async def main() -> None:
        try:
            out.append(await AsyncQueue(dsn, driver=driver).enqueue("echo", {}, after=[b1, c1]))
        except Exception as exc:
            out.append(exc)

    with psycopg.connect(dsn) as holder:
        holder.execute("SELECT FROM fleetless.graph_joins WHERE slot = %s FOR UPDATE", (c % JOIN_SLOTS,))
        joining = threading.Thread(target=asyncio.run, args=(main(),))
        joining.start()
        wait_for(lambda: _blocked_behind(sql, holder.info.backend_pid), what="the join waiting for C's slot")
        holder.execute("UPDATE fleetless.jobs SET graph_id = %s WHERE graph_id = %s", (a, c))
        holder.commit()
    joining.join(30)
    assert len(out) == 1 and isinstance(out[0], int), out
    rows = dict(sql("SELECT id, graph_id FROM fleetless.jobs WHERE id = ANY(%s)", [b, b1, c, c1, out[0]]))
    assert set(rows.values()) == {a}
