"""Replies lost at the worst moment: the statement committed, the connection dropped before the
drainer read the answer. A TCP proxy on loopback (``tests/pgproxy.py``) does it for real. The
drainer retries (it cannot tell a lost reply from a statement that never ran), and the retry must
find what the lost attempt did instead of doing it again or calling it someone else's."""

from __future__ import annotations

import pytest
from pgproxy import pg_proxy

from fleetless import Queue, Status
from fleetless.db import DatabaseUnavailable
from fleetless.drainer import DrainConfig, Drainer

CLAIM = b"attempts = j.attempts + 1"  # in the claim statement only
COMPLETE = b"SET status = 'done'"
FAIL = b"max_attempts AND NOT"
RELEASE = b"times in a row; charged"


def test_a_claim_whose_reply_is_lost_runs_every_job_it_claimed(dsn: str, queue: Queue, handlers, sql) -> None:
    h = handlers(**{"ok.py": "print('ran')"})
    queue.enqueue_many({"kind": "ok", "payload": {"i": i}, "max_attempts": 1} for i in range(5))
    with pg_proxy(dsn) as proxy:
        proxy.drop_reply_to(CLAIM)
        through = Queue(proxy.dsn)
        summary = Drainer(through, DrainConfig(handlers_dir=h, concurrency=2, batch=5)).run()
        through.close()
    assert proxy.dropped == [CLAIM]
    # Nothing stranded running until its lease ends, nothing charged an attempt it did not run.
    assert sql("SELECT status, attempts, result, count(*) FROM fleetless.jobs GROUP BY 1, 2, 3") == [
        ("done", 1, "ran\n", 5)]
    assert (summary.claimed, summary.done, summary.fenced_out) == (5, 5, 0)


def test_every_fenced_write_retried_after_a_lost_reply_reports_its_own_outcome(dsn: str, queue: Queue,
                                                                                sql) -> None:
    for _ in range(3):
        queue.enqueue("k", {})
    with pg_proxy(dsn) as proxy:
        through = Queue(proxy.dsn)
        done, failed, released = through.claim(3)
        for marker, write, expected in (
            (COMPLETE, lambda: through.complete(done, "r"), True),
            (FAIL, lambda: through.fail(failed, "boom", delay=0), Status.PENDING),
            (RELEASE, lambda: through.release(released, "stopping"), Status.PENDING),
        ):
            proxy.drop_reply_to(marker)
            with pytest.raises(DatabaseUnavailable):
                write()
            assert write() == expected  # the retry: the write is ours, not someone else's
        through.close()
    assert sql("SELECT status, attempts FROM fleetless.jobs ORDER BY id") == [
        ("done", 1), ("pending", 1), ("pending", 0)]
    # Once another claim holds the job, the old token is fenced out as before.
    assert len(queue.claim(2)) == 2
    assert queue.fail(released, "stale", delay=0) is None
    assert queue.release(failed, "stale") is None
