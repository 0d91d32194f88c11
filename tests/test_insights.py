"""The read service every front end uses, and its presentation helpers, against a real table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fleetless import Queue
from fleetless.drainer import DrainConfig, Drainer
from fleetless.events import JobFinished, NullReporter
from fleetless.insights import (
    DURATION_BUCKETS,
    Insights,
    age,
    error_head,
    exception_line,
    html_text,
    printable,
    size,
)
from fleetless.job import Job
from fleetless.queue import JobNotFound

TRACEBACK = """Traceback (most recent call last):
  File "/tmp/fleetless-ws-1/handlers/invoice.py", line 9, in <module>
    main()
  File "/tmp/fleetless-ws-1/handlers/invoice.py", line 7, in main
    raise ValueError(f"invoice {n} has no lines")
ValueError: invoice 42 has no lines
"""


def test_a_python_tracebacks_own_line_names_the_error() -> None:
    assert exception_line(TRACEBACK) == "ValueError: invoice 42 has no lines"
    chained = TRACEBACK + "\nDuring handling of the above exception, another exception occurred:\n\n" + \
        TRACEBACK.replace("ValueError: invoice 42 has no lines", "KeyError: 'lines'")
    assert exception_line(chained) == "KeyError: 'lines'"
    assert exception_line("warming up\nconnect failed: 503\n\n") == "connect failed: 503"
    assert exception_line("  \n") is None


def test_error_head_is_the_first_line_and_reads_old_rows_too() -> None:
    assert error_head("exit code 1: ValueError: invoice 42 has no lines\n" + TRACEBACK) == \
        "exit code 1: ValueError: invoice 42 has no lines"
    assert error_head("exit code 1\n" + TRACEBACK) == "exit code 1: ValueError: invoice 42 has no lines"
    assert error_head("killed: timeout after 2 s") == "killed: timeout after 2 s"
    assert error_head(None) is None and error_head("") is None
    assert len(error_head("x" * 5000) or "") == 200


def test_job_output_is_escaped_for_terminals_and_pages() -> None:
    evil = "a\x1b]52;c;cHduZWQ=\x07b\r<script>alert('x')</script>&"
    assert printable(evil) == "a\\x1b]52;c;cHduZWQ=\\x07b\\x0d<script>alert('x')</script>&"
    shown = html_text(evil)
    assert "<" not in shown and ">" not in shown and "'" not in shown and "\x1b" not in shown
    assert shown.endswith("&lt;/script&gt;&amp;")
    assert html_text(None) == ""


def test_text_that_reorders_or_breaks_lines_invisibly_is_shown_escaped() -> None:
    # U+202E (right-to-left override) and U+2066 (left-to-right isolate) make a terminal show a
    # line in another order than it is stored; U+2028 breaks it where no newline is; a tag
    # character and a zero-width space hide text. Ordinary letters and emoji pass unchanged.
    evil = "invoice\u202efdp.exe\u2066x\u2069\u2028fake line\u200b\U000e0041"
    assert printable(evil) == "invoice\\u202efdp.exe\\u2066x\\u2069\\u2028fake line\\u200b\\U000e0041"
    assert printable("café 日本 👍 tab\there\nnext") == "café 日本 👍 tab\there\nnext"
    assert "\u202e" not in html_text("a\u202eb")


def test_ages_and_sizes_read_as_an_operator_expects() -> None:
    assert [age(s) for s in (None, -3, 4.2, 90, 7200, 129600)] == ["-", "0.0s", "4.2s", "1.5m", "2.0h", "1.5d"]
    assert [size(n) for n in (None, 0, 512, 1536, 64 * 1024 * 1024, 3 * 1024**4)] == \
        ["-", "0 B", "512 B", "1.5 KiB", "64.0 MiB", "3072.0 GiB"]


def test_jobs_pages_newest_first_with_error_heads(queue: Queue, sql: Any) -> None:
    ids = queue.enqueue_many([("a", {})] * 5 + [("b", {})] * 2)
    sql("UPDATE fleetless.jobs SET status = 'dead', last_error = %s WHERE id = %s",
        "exit code 1\n" + TRACEBACK, ids[0])
    insights = Insights(queue)
    first = insights.jobs(limit=3)
    assert [r["id"] for r in first] == ids[:-4:-1]
    second = insights.jobs(limit=3, before=first[-1]["id"])
    assert [r["id"] for r in second] == ids[3:0:-1]
    (dead,) = insights.jobs(status="dead")
    assert dead["error_head"] == "exit code 1: ValueError: invoice 42 has no lines"
    assert "last_error" not in dead
    assert [r["kind"] for r in insights.jobs(kind="b")] == ["b", "b"]


def test_overview_counts_running_and_per_minute_from_the_table(queue: Queue, sql: Any) -> None:
    queue.enqueue_many([("a", {})] * 3 + [{"kind": "b", "payload": {}, "queue": "mail"}] * 2)
    (job,) = queue.claim(1, claimed_by="host-1:42", tier="bwrap")
    queue.complete(queue.claim(1)[0])
    failed = queue.claim(1)[0]
    queue.fail(failed, "exit code 1: boom", delay=0, permanent=True)
    sql("UPDATE fleetless.jobs SET started_at = now() - interval '90 seconds' WHERE id = %s", job.id)
    o = Insights(queue).overview(hours=1)
    assert o.total == 5
    assert o.by_status == {"pending": 2, "running": 1, "done": 1, "dead": 1, "cancelled": 0, "waiting": 0}
    assert dict(o.by_queue.rows) == {"mail": {"pending": 2}, "default": {"running": 1, "done": 1, "dead": 1}}
    assert dict(o.by_kind.rows)["b"] == {"pending": 2}
    (running,) = o.running.rows
    assert (running["id"], running["claimed_by"], running["tier"]) == (job.id, "host-1:42", "bwrap")
    assert 89 <= running["elapsed_seconds"] < 600
    assert len(o.per_minute) == 60
    assert sum(m["done"] for m in o.per_minute) == 1 and sum(m["failed"] for m in o.per_minute) == 1
    assert o.oldest_due_age_seconds is not None and o.oldest_due_age_seconds >= 0


def test_the_per_minute_chart_counts_attempts_so_each_retry_is_a_failure(queue: Queue, sql: Any) -> None:
    flaky = queue.enqueue("flaky", {}, max_attempts=3)
    for _ in range(3):  # fails each time: retried, retried, then dead
        (job,) = queue.claim(1)
        queue.fail(job, "exit code 1: boom", delay=0)
    queue.enqueue("ok", {})
    queue.complete(queue.claim(1)[0])
    released = queue.enqueue("released", {})
    queue.release(queue.claim(1)[0], "drainer stopping")  # given back: neither done nor failed
    assert [a["outcome"] for a in queue.attempts(flaky)] == ["failed", "failed", "dead"]
    assert sql("SELECT count(*) FROM fleetless.job_attempts WHERE job_id = %s", released) == [(1,)]
    minutes = Insights(queue).per_minute(hours=1)
    assert (sum(m["done"] for m in minutes), sum(m["failed"] for m in minutes)) == (1, 3)
    # Attempts that ended before the window are not counted, whatever their jobs' rows say.
    sql("UPDATE fleetless.job_attempts SET finished_at = now() - interval '2 hours' WHERE job_id = %s", flaky)
    minutes = Insights(queue).per_minute(hours=1)
    assert (sum(m["done"] for m in minutes), sum(m["failed"] for m in minutes)) == (1, 0)


def test_long_lists_are_read_a_page_at_a_time(queue: Queue, sql: Any) -> None:
    queue.enqueue_many([{"kind": f"kind-{i:03}", "payload": {}, "queue": f"queue-{i:03}"} for i in range(7)])
    running = queue.claim(5)
    one = running[0].id
    sql("INSERT INTO fleetless.job_attempts (job_id, attempt, outcome) SELECT %s, n, 'released' "
        "FROM generate_series(1, 7) AS n", one)
    insights = Insights(queue)
    o = insights.overview(size=3, kinds_page=3, queues_page=2, running_page=2)
    assert [name for name, _ in o.by_kind.rows] == ["kind-006"] and not o.by_kind.more
    assert [name for name, _ in o.by_queue.rows] == ["queue-003", "queue-004", "queue-005"] and o.by_queue.more
    assert len(o.running.rows) == 2 and not o.running.more
    assert [r["id"] for r in insights.running(1, 3).rows + insights.running(2, 3).rows] == [j.id for j in running]
    pages = [insights.attempts_page(one, n, 3) for n in (1, 2, 3)]
    assert [[a["attempt"] for a in p.rows] for p in pages] == [[1, 2, 3], [4, 5, 6], [7]]
    assert [p.more for p in pages] == [True, True, False]
    assert insights.attempts_page(running[1].id).rows == []
    for bad in (0, -1):
        with pytest.raises(ValueError, match="numbered from 1"):
            insights.running(bad)
    with pytest.raises(JobNotFound):
        insights.attempts_page(10**9)


def test_metrics_count_every_ended_attempt_by_kind_even_after_pruning(queue: Queue, sql: Any) -> None:
    ids = queue.enqueue_many([("a", {})] * 4 + [("b", {})])
    for job in queue.claim(5):
        sql("UPDATE fleetless.jobs SET started_at = now() - make_interval(secs => %s) WHERE id = %s",
            job.id * 20, job.id)
        if job.kind == "a":
            queue.complete(job)
        else:
            queue.fail(job, "exit code 1: boom", delay=0)  # attempts left: retry
    sql("UPDATE fleetless.job_attempts SET duration_seconds = 60 WHERE job_id = %s", ids[2])  # exactly a bound
    m = Insights(queue).metrics()
    cumulative, total_seconds, n = m.durations[("a", "done")]
    assert n == 4 and 199 <= total_seconds <= 202  # 20 + 40 + 60 + 80
    by_bound = dict(zip(DURATION_BUCKETS, cumulative, strict=True))
    assert (by_bound[10], by_bound[30], by_bound[60], by_bound[120]) == (0, 1, 3, 4)  # le: 60 s is in 60
    assert m.durations[("b", "failed")][2] == 1
    assert m.finished == [("a", "done", 4), ("b", "failed", 1)]
    assert sql("SELECT count(*) FROM fleetless.attempt_totals") == [(0,)]  # too recent to fold yet
    assert m.jobs == [("default", "b", "pending", 1)] and m.kept == [("a", "done", 4)]
    assert m.oldest_due_age.keys() == {"default"}

    # Older attempts are folded into the running totals; pruning their jobs does not lower them.
    sql("UPDATE fleetless.job_attempts SET finished_at = now() - interval '1 hour'")
    assert Insights(queue).metrics().finished == m.finished
    assert sql("SELECT sum(n) FROM fleetless.attempt_totals") == [(5,)]
    assert queue.prune_batch({"done": 0}) == 4  # the a jobs, with their (folded) history
    assert sql("SELECT count(*) FROM fleetless.job_attempts WHERE job_id IN (SELECT id FROM fleetless.jobs)") == \
        sql("SELECT count(*) FROM fleetless.job_attempts")
    queue.complete(queue.claim(1)[0])  # b, attempt 2: not folded, read live
    after = Insights(queue).metrics()
    assert after.finished == [("a", "done", 4), ("b", "done", 1), ("b", "failed", 1)]
    assert after.durations[("a", "done")] == m.durations[("a", "done")]
    # A fold from a stale mark (another scrape folded first) changes nothing.
    before = sql("SELECT kind, outcome, bound, n FROM fleetless.attempt_totals ORDER BY 1, 2, 3")
    queue.query("fold_attempt_totals", {"after": 0, "upto": 10, "bounds": [1.0], "negated": [-1.0]})
    assert sql("SELECT kind, outcome, bound, n FROM fleetless.attempt_totals ORDER BY 1, 2, 3") == before
    assert ids


def test_deleting_a_job_soon_after_it_ended_never_lowers_the_attempt_counters(queue: Queue, sql: Any) -> None:
    """`fleetless delete` of a job whose attempts no scrape has folded yet (they ended within the
    fold margin) keeps them in the counters: before, they left with the job and the counter
    dropped, which Prometheus reads as a reset."""
    sql("TRUNCATE fleetless.attempt_totals")  # the fixture's TRUNCATE … RESTART IDENTITY reuses attempt ids
    sql("UPDATE fleetless.attempt_totals_mark SET last_id = 0")
    first, second = (queue.enqueue("del", {}, queue="deleting") for _ in range(2))
    for job in queue.claim(2, queues=["deleting"]):
        sql("UPDATE fleetless.jobs SET started_at = now() - interval '5 seconds' WHERE id = %s", job.id)
        queue.complete(job)
    before = Insights(queue).metrics()
    assert _of_del(before) == [("del", "done", 2)]
    queue.delete(first)
    after = Insights(queue).metrics()
    assert _of_del(after) == [("del", "done", 2)]
    assert after.durations[("del", "done")] == before.durations[("del", "done")]
    # Once the rest is old enough to fold, the deleted job's attempt is not counted a second time.
    sql("UPDATE fleetless.job_attempts SET finished_at = now() - interval '1 hour'")
    assert _of_del(Insights(queue).metrics()) == [("del", "done", 2)]
    queue.delete(second)  # already folded: nothing added
    assert _of_del(Insights(queue).metrics()) == [("del", "done", 2)]
    assert sql("SELECT sum(n) FROM fleetless.attempt_totals WHERE kind = 'del'") == [(2,)]


def test_pruning_inside_the_fold_margin_never_lowers_the_attempt_counters(queue: Queue, sql: Any) -> None:
    """Retention or `prune --older-than` under ten minutes, before a scrape folded the jobs'
    attempts: they are added to the totals as the jobs go (they used to go with them)."""
    sql("TRUNCATE fleetless.attempt_totals")  # the fixture's TRUNCATE … RESTART IDENTITY reuses attempt ids
    sql("UPDATE fleetless.attempt_totals_mark SET last_id = 0")
    for _ in range(3):
        queue.enqueue("del", {}, queue="deleting")
    for job in queue.claim(3, queues=["deleting"]):
        queue.complete(job)
    assert _of_del(Insights(queue).metrics()) == [("del", "done", 3)]
    assert queue.prune_batch({"done": 0}, limit=2) == 2
    assert _of_del(Insights(queue).metrics()) == [("del", "done", 3)]
    assert queue.prune_batch({"done": 0}) == 1
    assert _of_del(Insights(queue).metrics()) == [("del", "done", 3)]
    assert sql("SELECT count(*) FROM fleetless.job_attempts") == [(0,)]


def _of_del(m: Any) -> list[tuple[str, str, int]]:
    return [f for f in m.finished if f[0] == "del"]


class Recorder(NullReporter):
    def __init__(self) -> None:
        self.events: list[JobFinished] = []
        self.claimed_ids: list[int] = []

    def claimed(self, job: Job) -> None:
        self.claimed_ids.append(job.id)

    def finished(self, event: JobFinished) -> None:
        self.events.append(event)


def test_the_drainer_reports_each_claim_and_outcome(queue: Queue, handlers: Any, sql: Any) -> None:
    h = handlers(**{
        "ok.py": "print('fine')",
        "bad.py": "raise ValueError('invoice 42 has no lines')",
    })
    ok = queue.enqueue("ok", {})
    bad = queue.enqueue("bad", {}, max_attempts=1)
    failed = queue.enqueue("bad", {}, max_attempts=2)
    recorder = Recorder()
    Drainer(queue, DrainConfig(handlers_dir=Path(h), concurrency=2), reporter=recorder).run()
    assert sorted(recorder.claimed_ids) == [ok, bad, failed]
    got = {e.id: (e.outcome, e.attempt, e.tier, e.error_head) for e in recorder.events}
    # a plain failure with attempts left is 'failed', as the attempt history says (it was 'retried')
    head = "exit code 1: ValueError: invoice 42 has no lines"
    assert got == {ok: ("done", 1, "process", None), bad: ("dead", 1, "process", head),
                   failed: ("failed", 1, "process", head)}
    assert all(e.duration > 0 for e in recorder.events)
    assert json.loads(json.dumps(recorder.events[0].as_dict()))["kind"] in ("ok", "bad")
    stored = sql("SELECT last_error FROM fleetless.jobs WHERE id = %s", bad)[0][0]
    assert str(stored).startswith(head + "\nTraceback (most recent call last):")
