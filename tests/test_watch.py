"""Watch mode's wait strategy: one watcher per queue set (its row of the watchers table), woken by the
NOTIFY of committed enqueues only, and riding out a lost connection."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from fleetless import Queue
from fleetless.drainer import DrainConfig, Drainer, sleep_for
from fleetless.watch import Watcher

from proctools import wait_for


def watcher(queue: Queue, queues: list[str] | None = None) -> Watcher:
    return Watcher(queue.conninfo, schema=queue.schema, channel=queue.channel, queues=queues,
                   wake=threading.Event())


def test_one_watcher_per_queue_set(queue: Queue) -> None:
    first = watcher(queue)
    assert first.acquire()
    assert not watcher(queue).acquire()  # the cron tick's one query: someone is watching already
    other = watcher(queue, ["mail"])
    assert other.acquire()  # another set of queues has its own watcher
    first.close()
    again = watcher(queue)
    assert again.acquire()  # the first watcher freed its row as it closed
    again.close()
    other.close()


def test_committed_enqueues_wake_the_watcher_and_rolled_back_ones_do_not(queue: Queue, dsn: str) -> None:
    w = watcher(queue, ["default", "mail"])
    assert w.acquire()
    with psycopg.connect(dsn) as c:
        queue.enqueue("k", {}, queue="mail", conn=c)
        c.rollback()
    queue.enqueue("k", {}, queue="other")  # not a queue of this watcher
    queue.enqueue("k", {}, queue="mail")
    wait_for(w.wake.is_set, what="the wake-up")
    # notifications arrive in commit order: anything the rollback had sent would come first
    assert w.heard == ["mail"]
    w.close()


def test_a_lost_connection_is_ridden_out(queue: Queue, dsn: str, sql: Callable[..., list[Any]]) -> None:
    w = watcher(queue)
    assert w.acquire()
    sql("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE (query LIKE 'LISTEN%%'"
        " OR query LIKE '%%fleetless.watchers%%') AND pid <> pg_backend_pid() AND datname = current_database()")
    wait_for(w.wake.is_set, what="the wake-up after reconnecting")  # it looks once: it may have missed some
    w.wake.clear()
    wait_for(lambda: sql("SELECT count(*) FROM pg_stat_activity WHERE (query LIKE 'LISTEN%%'"
                         " OR query LIKE '%%fleetless.watchers%%') AND pid <> pg_backend_pid()"
                         " AND datname = current_database()") == [(1,)], what="the new LISTEN")
    queue.enqueue("k", {}, queue="after")
    wait_for(lambda: w.heard[-1:] == ["after"], what="a notification on the new connection")
    assert not w.lost
    w.close()


def test_the_loop_sleeps_until_the_next_due_job_or_the_idle_exit() -> None:
    assert sleep_for(None, None) == 60.0
    assert sleep_for(2.5, None) == 2.5
    assert sleep_for(-1.0, 10.0) == 0.0  # due already
    assert sleep_for(30.0, 4.0) == 4.0


def test_a_watcher_waits_instead_of_spinning_on_a_due_job_another_transaction_holds(
        queue: Queue, dsn: str, sql: Callable[..., list[Any]], handlers: Callable[..., Any]) -> None:
    """Issue 26.5: a due job whose row another transaction has locked is due for next_due but not
    claimable; on 61e842d the watcher claimed again at once, ~2,000 claims and commits a second.
    Now it looks again after 50 ms, doubling up to 1 s: a handful of claims in the two seconds the
    lock is held here (at most 30: a slower machine only claims less). Once the
    lock goes, the job runs."""
    h = handlers(**{"ok.py": "print('ok')"})
    job = queue.enqueue("ok", {})
    drainer = Drainer(queue, DrainConfig(handlers_dir=h, watch=True, concurrency=1))
    claims: list[int] = []
    claim = queue.claim

    def counted(*args: Any, **kwargs: Any) -> Any:
        claims.append(1)
        return claim(*args, **kwargs)

    holder = psycopg.connect(dsn)
    holder.execute("SELECT id FROM fleetless.jobs WHERE id = %s FOR UPDATE", (job,))
    queue.claim = counted  # type: ignore[method-assign]
    t = threading.Thread(target=drainer.run)
    t.start()
    try:
        wait_for(lambda: len(claims) >= 2, what="the watcher to try the held job")
        before = len(claims)
        time.sleep(2.0)  # the window the claims are counted in (the rule is a rate, not a duration)
        during = len(claims) - before
        holder.rollback()
        wait_for(lambda: sql("SELECT status FROM fleetless.jobs WHERE id = %s", job) == [("done",)],
                 what="the job to run once its row is free")
    finally:
        holder.close()
        drainer.stop(grace=0)
        t.join(60)
    assert not t.is_alive()
    assert during <= 30, during


def test_a_watcher_whose_loop_stops_turning_is_taken_over_after_its_lease(queue: Queue, sql) -> None:
    # Issue 26 item 6, a hung watcher: its LISTEN thread lives on, but it renews the heartbeat only
    # while the drain loop turns (alive()); once the heartbeat is older than the lease, another
    # watcher takes the set over and the hung one, if it ever comes back, is told it lost.
    live = Watcher(queue.conninfo, schema=queue.schema, channel=queue.channel, queues=["hung"],
                   wake=threading.Event(), lease=3)
    assert live.acquire()
    try:
        first = sql("SELECT heartbeat_at FROM fleetless.watchers WHERE queues = 'hung'")
        wait_for(lambda: (live.alive(), sql("SELECT heartbeat_at FROM fleetless.watchers WHERE queues = 'hung'"))[1]
                 != first, 30, "a renewed heartbeat while the loop turns")
        assert not watcher(queue, ["hung"]).acquire()  # alive: a tick exits
        # the loop stops turning (alive() no longer called): the heartbeat ages past the lease
        other = watcher(queue, ["hung"])
        wait_for(other.acquire, 30, "another watcher to take over the hung one's queues")
        # its loop turns again: the next heartbeat finds the row taken over
        wait_for(lambda: (live.alive(), live.lost)[1], 30, "the hung watcher to learn it lost its queues")
        other.close()
    finally:
        live.close()


GATED = """
    import os, time
    def handle(payload):
        gate = payload.get("gate")
        if gate:  # runs until the test opens its gate (bounded)
            open(gate + ".started", "w").close()
            give_up = time.monotonic() + 120
            while not os.path.exists(gate) and time.monotonic() < give_up:
                time.sleep(0.02)
        return payload["n"]
"""


@pytest.mark.parametrize("per_sandbox", [1, 2], ids=["per-job", "batch"])
def test_a_watcher_that_lost_its_lease_claims_nothing_more_and_exits_once_its_jobs_end(
        queue: Queue, sql, handlers, tmp_path, private_workdir, per_sandbox: int) -> None:
    """Issue 26: a watcher whose queues' row was taken over (its heartbeat was older than its
    lease) used to go on claiming while its jobs ran. Now: its running job finishes (done, fenced
    as usual), a job enqueued after the loss is never claimed by it, and it exits."""
    gates = tmp_path / "gates"
    gates.mkdir()
    gates.chmod(0o777)
    gate = str(gates / "open")
    h = handlers(**{"gated.py": GATED})
    lost = f"lost-{per_sandbox}"  # a queue of its own: the row this case's watcher loses stays taken
    first = queue.enqueue("gated", {"n": 0, "gate": gate}, queue=lost)
    drainer = Drainer(queue, DrainConfig(handlers_dir=h, sandbox="process", concurrency=2, per_sandbox=per_sandbox,
                                         watch=True, idle_exit=300, watch_lease=3, queues=(lost,)))
    turns = [0]
    thread = threading.Thread(target=drainer.run)
    thread.start()
    try:
        wait_for(lambda: Path(gate + ".started").exists(), timeout=180, what="the first job to start")
        w = drainer._watcher
        assert w is not None
        original = w.alive

        def alive() -> None:  # counts the drain loop's turns
            turns[0] += 1
            original()

        w.alive = alive  # type: ignore[method-assign]
        # a cron tick took the queues over (as after this watcher's heartbeat outlived its lease)
        sql("UPDATE fleetless.watchers SET holder = 'another-tick' WHERE queues = %s", lost)
        wait_for(lambda: w.lost, timeout=30, what="the watcher to learn it lost its queues")
        second = queue.enqueue("gated", {"n": 1}, queue=lost)
        seen = turns[0]
        # two more turns of the loop (each claims while a slot is free): its chance to claim the job
        wait_for(lambda: turns[0] >= seen + 2, timeout=30, what="the drain loop to turn")
        assert sql("SELECT status, attempts FROM fleetless.jobs WHERE id = %s", second) == [("pending", 0)]
    finally:
        Path(gate).touch()
        thread.join(timeout=120)
    assert not thread.is_alive()
    assert sql("SELECT id, status FROM fleetless.jobs ORDER BY id") == [(first, "done"), (second, "pending")]
