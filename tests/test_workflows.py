"""Workflows (issue 29): jobs that wait for other jobs (enqueue after=[ids]), released by the finish
of their last parent (migration 020's trigger), through real PostgreSQL and real drains.
Assertions read the table."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from fleetless import Enqueued, Queue, db
from fleetless.drainer import DrainConfig, Drainer
from fleetless.queue import DuplicateJob

from proctools import wait_for

pytestmark = pytest.mark.usefixtures("private_workdir")
SQL = Callable[..., list[Any]]

ECHO = """
    def handle(payload):
        if payload.get("fail"):
            raise RuntimeError("asked to fail")
        return {"me": payload.get("n"), "parents": payload.get("_parents")}
"""


def _drain(queue: Queue, h: Path, **config: Any) -> Any:
    return Drainer(queue, DrainConfig(handlers_dir=h, timeout=60, **{"concurrency": 2, **config})).run()


def _status(sql: SQL, *ids: int) -> list[str]:
    rows = dict(sql("SELECT id, status FROM fleetless.jobs WHERE id = ANY(%s)", list(ids)))
    return [rows[i] for i in ids]


def _starts_after_parents(sql: SQL) -> None:
    """Every attempt of every child started after each of its parents finished (the table's clocks)."""
    early = sql("""
        SELECT d.child_id, d.parent_id FROM fleetless.job_dependencies d
        JOIN fleetless.job_attempts a ON a.job_id = d.child_id
        JOIN fleetless.jobs p ON p.id = d.parent_id
        WHERE p.finished_at IS NULL OR a.started_at < p.finished_at""")
    assert early == []


def test_a_child_waits_for_its_parent_and_reads_its_result(queue: Queue, handlers, sql: SQL) -> None:
    h = handlers(**{"echo.py": ECHO})
    a = queue.enqueue("echo", {"n": "a"})
    b = queue.enqueue("echo", {"n": "b"}, after=[a])
    c = queue.enqueue("echo", {"n": "c"}, after=[b])
    assert _status(sql, a, b, c) == ["pending", "waiting", "waiting"]
    assert [j.id for j in queue.claim(10)] == [a]  # the children are never claimed while they wait
    sql("UPDATE fleetless.jobs SET status = 'pending', attempts = 0 WHERE id = %s", a)
    _drain(queue, h, per_sandbox=1)
    assert _status(sql, a, b, c) == ["done", "done", "done"]
    results = dict(sql("SELECT id, result_json FROM fleetless.jobs"))
    assert results[b]["parents"] == {str(a): {"me": "a", "parents": None}}
    assert results[c]["parents"][str(b)]["me"] == "b"
    _starts_after_parents(sql)


@pytest.mark.parametrize("per_sandbox", [1, 50])
def test_fan_out_fan_in_and_a_diamond_drain_in_order(queue: Queue, handlers, sql: SQL, per_sandbox: int) -> None:
    h = handlers(**{"echo.py": ECHO})
    ids = queue.enqueue_many(
        [{"kind": "echo", "payload": {"n": "root"}, "name": "root"}]
        + [{"kind": "echo", "payload": {"n": i}, "name": f"mid{i}", "after": ["root"]} for i in range(20)]
        + [{"kind": "echo", "payload": {"n": "sink"}, "after": [f"mid{i}" for i in range(20)]}]
        + [{"kind": "echo", "payload": {"n": "a"}, "name": "a"},
           {"kind": "echo", "payload": {"n": "b"}, "name": "b", "after": ["a"]},
           {"kind": "echo", "payload": {"n": "c"}, "name": "c", "after": ["a"]},
           {"kind": "echo", "payload": {"n": "d"}, "after": ["b", "c"]}])
    assert sql("SELECT status, count(*) FROM fleetless.jobs GROUP BY 1 ORDER BY 1") == [
        ("pending", 2), ("waiting", 24)]
    _drain(queue, h, per_sandbox=per_sandbox)
    assert sql("SELECT status, count(*), max(attempts) FROM fleetless.jobs GROUP BY 1") == [("done", 26, 1)]
    sink = dict(sql("SELECT id, result_json FROM fleetless.jobs"))[ids[21]]
    assert sorted(sink["parents"]) == sorted(str(i) for i in ids[1:21])
    _starts_after_parents(sql)


@pytest.mark.parametrize("policy", ["cancel", "run"])
def test_a_failed_parent_cancels_its_descendants_or_lets_them_run(queue: Queue, handlers, sql: SQL,
                                                                  policy: str) -> None:
    h = handlers(**{"echo.py": ECHO})
    a = queue.enqueue("echo", {"fail": True}, max_attempts=1)
    ok = queue.enqueue("echo", {})
    b = queue.enqueue("echo", {}, after=[a, ok], on_parent_failure=policy)  # type: ignore[arg-type]
    c = queue.enqueue("echo", {}, after=[b])
    d = queue.enqueue("echo", {}, after=[c], on_parent_failure="run")
    _drain(queue, h)
    rows = {r[0]: r[1:] for r in sql("SELECT id, status, last_error FROM fleetless.jobs")}
    assert rows[a][0] == "dead" and rows[ok][0] == "done"
    if policy == "cancel":
        assert rows[b] == ("cancelled", f"parent job {a} ended dead (on_parent_failure: cancel)")
        assert rows[c] == ("cancelled", f"parent job {b} was cancelled: one of its parents failed"
                                        " (on_parent_failure: cancel)")
        assert rows[d][0] == "done"  # "run": a cancelled parent counts as ended
    else:
        assert [rows[x][0] for x in (b, c, d)] == ["done", "done", "done"]
    _starts_after_parents(sql)


def test_enqueue_after_an_ended_parent(queue: Queue, sql: SQL) -> None:
    done = queue.enqueue("echo", {})
    dead = queue.enqueue("echo", {})
    sql("UPDATE fleetless.jobs SET status = 'done', result_json = '{\"x\": 1}', finished_at = now() WHERE id = %s",
        done)
    sql("UPDATE fleetless.jobs SET status = 'dead', finished_at = now() WHERE id = %s", dead)
    ready = queue.enqueue("echo", {"k": 1}, after=[done])
    doomed = queue.enqueue("echo", {}, after=[done, dead])
    runs = queue.enqueue("echo", {}, after=[dead], on_parent_failure="run")
    assert _status(sql, ready, doomed, runs) == ["pending", "cancelled", "pending"]
    assert queue.get(ready)["payload"] == {"k": 1, "_parents": {str(done): {"x": 1}}}
    assert queue.get(doomed)["last_error"] == (f"parent job {dead} had ended dead before this job was enqueued"
                                               " (on_parent_failure: cancel)")
    with pytest.raises(ValueError, match=r"after: no job with id 999999"):
        queue.enqueue("echo", {}, after=[done, 999999])
    with pytest.raises(ValueError, match=r"job #1: after: no earlier item is named 'nope'"):
        queue.enqueue_many([("echo", {}), {"kind": "echo", "payload": {}, "after": ["nope"]}])
    assert sql("SELECT count(*) FROM fleetless.jobs") == [(5,)]  # nothing of the bad calls was written


def test_enqueue_after_joins_the_callers_transaction(queue: Queue, dsn: str, sql: SQL) -> None:
    a = queue.enqueue("echo", {})
    with psycopg.connect(dsn) as conn:
        b = queue.enqueue("echo", {}, after=[a], conn=conn)
        conn.rollback()
    assert sql("SELECT id FROM fleetless.jobs") == [(a,)]
    assert sql("SELECT count(*) FROM fleetless.job_dependencies") == [(0,)]
    assert b != a


def test_cancel_retry_and_run_now_of_a_workflow(queue: Queue, sql: SQL) -> None:
    a = queue.enqueue("echo", {})
    b = queue.enqueue("echo", {}, after=[a])
    c = queue.enqueue("echo", {}, after=[b])
    with pytest.raises(ValueError, match=f"job {b} is waiting for its parents"):
        queue.run_now(b)
    queue.cancel(a)
    assert _status(sql, a, b, c) == ["cancelled", "cancelled", "cancelled"]
    assert queue.retry(a) == []  # the children stay cancelled unless asked
    assert _status(sql, a, b, c) == ["pending", "cancelled", "cancelled"]
    queue.cancel(a)
    assert sorted(queue.retry(a, children=True)) == [b, c]
    assert _status(sql, a, b, c) == ["pending", "waiting", "waiting"]
    assert sql("SELECT id, parents_left FROM fleetless.jobs ORDER BY id") == [(a, 0), (b, 1), (c, 1)]
    (job,) = queue.claim(1)
    queue.complete(job, "hi")
    assert _status(sql, a, b, c) == ["done", "pending", "waiting"]
    assert queue.get(b)["payload"]["_parents"] == {str(a): "hi"}


def test_a_fan_in_is_released_once_by_racing_finishers(queue: Queue, dsn: str, sql: SQL) -> None:
    """Finishers on 4 connections end 2,000 parents at once, in interleaved batches: the child's
    counter is decremented once per parent and it becomes pending exactly once, by the last."""
    parents = queue.enqueue_many([("echo", {})] * 2000)
    child = queue.enqueue("echo", {}, after=parents)
    claimed = queue.claim(2000)
    assert len(claimed) == 2000
    start = threading.Barrier(4)

    def finish(part: list[Any]) -> None:
        q = Queue(dsn)
        start.wait()
        for i in range(0, len(part), 50):
            for job in part[i:i + 50]:
                q.complete(job, None)
        q.close()

    threads = [threading.Thread(target=finish, args=(claimed[k::4],)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sql("SELECT status, parents_left FROM fleetless.jobs WHERE id = %s", child) == [("pending", 0)]
    assert len(queue.get(child)["payload"]["_parents"]) == 2000


def test_racing_batch_drainers_release_a_10000_parent_fan_in_exactly_once(queue: Queue, dsn: str, handlers,
                                                                         sql: SQL, tmp_path: Path) -> None:
    """Four drainer processes race over 10,000 parents of one child: the child becomes pending once
    (a test trigger logs every waiting -> pending change of it), runs once, after the last parent."""
    import subprocess
    import sys
    import textwrap

    h = handlers(**{"noop.py": "def handle(payload):\n    return None\n"})
    parents = queue.enqueue_many([("noop", {})] * 10_000)
    child = queue.enqueue("noop", {"sink": True}, after=parents)
    sql("CREATE TABLE test_releases (id bigint, at timestamptz DEFAULT clock_timestamp())")
    sql("""CREATE FUNCTION test_log_release() RETURNS trigger LANGUAGE plpgsql AS $$
           BEGIN INSERT INTO test_releases (id) VALUES (NEW.id); RETURN NULL; END $$""")
    sql("""CREATE TRIGGER test_log_release AFTER UPDATE ON fleetless.jobs FOR EACH ROW
           WHEN (OLD.status = 'waiting' AND NEW.status = 'pending') EXECUTE FUNCTION test_log_release()""")
    code = textwrap.dedent(f"""
        from pathlib import Path
        from fleetless import Queue
        from fleetless.drainer import DrainConfig, Drainer
        Drainer(Queue({dsn!r}), DrainConfig(handlers_dir=Path({str(h)!r}), per_sandbox=250, concurrency=1,
                                            timeout=120)).run()
    """)
    try:
        drains = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(4)]
        for d in drains:
            assert d.wait(timeout=600) == 0
        # a drainer that found nothing claimable exits; one more drain runs whatever is left
        _drain(queue, h, per_sandbox=250)
    finally:
        sql("DROP TRIGGER IF EXISTS test_log_release ON fleetless.jobs")
    assert sql("SELECT id FROM test_releases") == [(child,)]
    assert sql("SELECT status, count(*), max(attempts) FROM fleetless.jobs GROUP BY 1") == [("done", 10_001, 1)]
    assert sql("SELECT count(*) FROM fleetless.job_attempts WHERE job_id = %s", child) == [(1,)]
    assert sql("""SELECT count(*) FROM fleetless.job_attempts a, fleetless.jobs p
                  WHERE a.job_id = %s AND p.id <> a.job_id AND a.started_at < p.finished_at""", child) == [(0,)]


def test_the_claim_of_jobs_without_parents_reads_what_it_read_before(queue: Queue, dsn: str, sql: SQL) -> None:
    """5 pending jobs beside 20,000 waiting ones: the claim's plan is the one it has beside 20,000
    finished jobs (the same nodes and indexes: waiting rows are outside its partial indexes), reads
    about the rows it claims and never scans the table."""
    from test_query_plans import CLAIM, assert_reads_little, nodes, plan

    def shape(root: dict[str, Any]) -> list[tuple[Any, ...]]:
        return [(n["Node Type"], n.get("Index Name"), n.get("Relation Name")) for n in nodes(root)]

    queue.enqueue_many([("plain", {})] * 5)
    root_id = queue.enqueue("plain", {}, delay=3600)
    queue.enqueue_many([{"kind": "child", "payload": {}, "after": [root_id]}] * 20_000)
    sql("ANALYZE fleetless.jobs")
    waiting = plan(queue, "claim", {**CLAIM, "queues": None})
    sql("UPDATE fleetless.jobs SET status = 'done', finished_at = now() WHERE status = 'waiting'")
    sql("ANALYZE fleetless.jobs")
    finished = plan(queue, "claim", {**CLAIM, "queues": None})
    assert shape(waiting) == shape(finished)
    for root in (waiting, finished):
        assert_reads_little(root, most=20)
        assert root["Actual Rows"] == 5


def test_the_command_line_enqueues_after_and_shows_the_graph(queue: Queue, dsn: str, fleetless, sql: SQL) -> None:
    a = int(fleetless("enqueue", "echo", '{"n": 1}', dsn=dsn).stdout)
    b = int(fleetless("enqueue", "echo", dsn=dsn).stdout)
    made = fleetless("enqueue", "echo", "--after", str(a), "--after", str(b), "--on-parent-failure", "run", dsn=dsn)
    assert made.returncode == 0, made.stderr
    c = int(made.stdout)
    assert sql("SELECT status, parents_left, on_parent_failure FROM fleetless.jobs WHERE id = %s", c) == [
        ("waiting", 2, "run")]
    shown = fleetless("show", str(c), dsn=dsn)
    assert "parents (2):" in shown.stdout and f"\n{a}" in shown.stdout.split("parents (2):")[1]
    parent = fleetless("show", str(a), "--json", dsn=dsn)
    import json
    data = json.loads(parent.stdout)
    assert data["n_children"] == 1 and data["children"][0]["id"] == c
    assert data["children_by_status"] == {"waiting": 1}
    keyed = [fleetless("enqueue", "echo", "--after", str(a), "--key", "nightly-c", dsn=dsn) for _ in range(2)]
    assert keyed[0].returncode == keyed[1].returncode == 0 and keyed[0].stdout == keyed[1].stdout
    assert "already pending, running or waiting: nothing new was enqueued" in keyed[1].stderr
    assert sql("SELECT count(*) FROM fleetless.jobs WHERE key = 'nightly-c' AND status = 'waiting'") == [(1,)]
    missing = fleetless("enqueue", "echo", "--after", "424242", dsn=dsn)
    assert missing.returncode != 0 and "after: no job with id 424242" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1


def test_a_watching_drainer_takes_a_released_child_when_woken(queue: Queue, dsn: str, handlers, sql: SQL) -> None:
    """The child's queue is NOTIFYed by the finish that releases it: a watcher whose heartbeat (its
    longest sleep) is minutes apart and that has nothing pending wakes for it and runs it."""
    from proctools import wait_for

    h = handlers(**{"echo.py": ECHO})
    parent = queue.enqueue("echo", {"n": "p"}, queue="elsewhere")  # not the watcher's queue
    child = queue.enqueue("echo", {"n": "c"}, after=[parent])
    drainer = Drainer(queue, DrainConfig(handlers_dir=h, watch=True, queues=("default",), concurrency=1,
                                         watch_lease=900, timeout=60))
    t = threading.Thread(target=drainer.run)
    t.start()
    try:
        wait_for(lambda: sql("SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'LISTEN%%'"
                             " AND datname = current_database()") == [(1,)], what="the watcher to listen")
        producer = Queue(dsn)
        (job,) = producer.claim(1, queues=["elsewhere"])
        producer.complete(job, "parent's output")
        producer.close()
        wait_for(lambda: _status(sql, child) == ["done"], timeout=60, what="the released child to run")
        assert drainer._watcher is not None and "default" in drainer._watcher.heard
    finally:
        drainer.stop(grace=0)
        t.join(30)
    assert not t.is_alive()
    assert dict(sql("SELECT id, result_json FROM fleetless.jobs"))[child]["parents"] == {str(parent): "parent's output"}


def test_retention_keeps_a_parent_while_a_child_waits(queue: Queue, sql: SQL) -> None:
    parent = queue.enqueue("echo", {})
    other = queue.enqueue("echo", {})
    child = queue.enqueue("echo", {}, after=[parent, other])
    sql("UPDATE fleetless.jobs SET status = 'done', finished_at = now() - interval '30 days' WHERE id = %s", parent)
    assert queue.prune_batch({"done": 86400.0}) == 0  # its child still waits (for the other parent)
    for job in queue.claim(5):
        queue.complete(job, None)
    (job,) = queue.claim(5)
    assert job.id == child
    queue.complete(job, None)
    sql("UPDATE fleetless.jobs SET finished_at = now() - interval '30 days'")
    assert queue.prune_batch({"done": 86400.0}) == 3
    assert sql("SELECT count(*) FROM fleetless.job_dependencies") == [(0,)]


def _labels(sql: SQL, *ids: int) -> list[int | None]:
    rows = dict(sql("SELECT id, graph_id FROM fleetless.jobs WHERE id = ANY(%s)", list(ids)))
    return [rows[i] for i in ids]


def test_retention_prunes_a_graph_as_a_whole(queue: Queue, sql: SQL) -> None:
    """A finished job goes only once every job of its graph has finished and is past its age: not
    a grandparent while its grandchild waits, nor a sibling while another runs (both went before,
    when only a job's own children were looked at), nor any while one of them is young."""
    plain = queue.enqueue("echo", {})
    a = queue.enqueue("echo", {})
    b = queue.enqueue("echo", {}, after=[a])
    e = queue.enqueue("echo", {}, after=[a])           # b's sibling, a leaf
    d = queue.enqueue("echo", {})
    c = queue.enqueue("echo", {}, after=[b, d])        # a's grandchild, also waiting for d
    assert _labels(sql, plain, a, b, e, d, c) == [None, a, a, a, a, a]
    old = "UPDATE fleetless.jobs SET status = 'done', finished_at = now() - interval '30 days' WHERE id = ANY(%s)"
    sql(old, [plain, a, b, e])
    assert _status(sql, c) == ["waiting"]
    assert queue.prune_batch({"done": 86400.0}) == 1   # plain only: c still waits, d is pending
    (job,) = queue.claim(5)
    assert job.id == d
    queue.complete(job, None)
    (job,) = queue.claim(5)
    assert job.id == c
    queue.complete(job, None)
    assert queue.prune_batch({"done": 86400.0}) == 0   # all done, c and d inside their age
    sql("UPDATE fleetless.jobs SET finished_at = now() - interval '30 days' WHERE id = %s", d)
    assert queue.prune_batch({"done": 86400.0}) == 0   # c still is
    assert queue.prune(86400.0) == 0
    sql("UPDATE fleetless.jobs SET finished_at = now() - interval '30 days' WHERE id = %s", c)
    sql("UPDATE fleetless.jobs SET status = 'dead' WHERE id = %s", e)
    assert queue.prune_batch({"done": 86400.0}) == 0   # a dead job kept (no age for dead) keeps its graph
    assert queue.prune_batch({"done": 86400.0, "dead": 86400.0}) == 5
    assert sql("SELECT count(*) FROM fleetless.jobs") == [(0,)]
    assert sql("SELECT count(*) FROM fleetless.job_dependencies") == [(0,)]


def test_a_child_joining_two_graphs_makes_them_one(queue: Queue, sql: SQL, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every job of a connected graph carries the graph's smallest id, also when a later child, or
    a later lot of one enqueue_many, joins graphs labelled apart before."""
    p1 = queue.enqueue("echo", {})
    q1 = queue.enqueue("echo", {}, after=[p1])
    p2 = queue.enqueue("echo", {})
    q2 = queue.enqueue("echo", {}, after=[p2])
    assert _labels(sql, p1, q1, p2, q2) == [p1, p1, p2, p2]
    r = queue.enqueue("echo", {}, after=[q2, q1])
    assert _labels(sql, p1, q1, p2, q2, r) == [p1] * 5
    import fleetless.queue as queue_module
    monkeypatch.setattr(queue_module, "ENQUEUE_CHUNK", 3)  # one enqueue_many, written in lots of 3
    ids = queue.enqueue_many([
        {"kind": "echo", "payload": {}, "name": "x"},
        {"kind": "echo", "payload": {}, "name": "x1", "after": ["x"]},
        {"kind": "echo", "payload": {}, "name": "y"},
        {"kind": "echo", "payload": {}, "name": "y1", "after": ["y"]},
        {"kind": "echo", "payload": {}, "name": "z"},
        {"kind": "echo", "payload": {}, "name": "z1", "after": ["z", "y1"]},
        {"kind": "echo", "payload": {}, "after": ["x1", "z1"]},
        {"kind": "echo", "payload": {}},
    ])
    assert _labels(sql, *ids) == [ids[0]] * 7 + [None]


def test_a_child_added_to_a_graph_while_it_is_relabelled_takes_the_new_label(
        queue: Queue, dsn: str, sql: SQL) -> None:
    """An enqueue joins two graphs (relabelling the larger-labelled one) while another, uncommitted,
    adds a child to that one: the relabel waits for it and, run again until it moves no job, takes
    its child too (run once, it left the child with a label no other job had: pruned on its own)."""
    p1 = queue.enqueue("echo", {})
    p2 = queue.enqueue("echo", {})
    q2 = queue.enqueue("echo", {}, after=[p2])
    with psycopg.connect(dsn) as conn:
        late = queue.enqueue("echo", {}, after=[q2], conn=conn)
        holder = conn.info.backend_pid
        out: list[Any] = []
        joining = _in_thread(dsn, lambda q: q.enqueue("echo", {}, after=[p1, q2]), out)
        wait_for(lambda: _blocked_behind(sql, holder), what="the relabel to wait for the uncommitted child")
        conn.commit()
    joining.join(10)
    (r,) = out
    assert _labels(sql, p1, p2, q2, late, r) == [p1] * 5


def test_the_dashboards_job_page_shows_the_workflow(queue: Queue) -> None:
    from starlette.testclient import TestClient

    from fleetless.web import create_app

    a = queue.enqueue("extract", {})
    b = queue.enqueue("merge", {}, after=[a], on_parent_failure="run")
    client = TestClient(create_app(queue))
    parent = client.get(f"/jobs/{a}").text
    assert "<h2>Workflow</h2>" in parent and f'<a href="/jobs/{b}">{b}</a>' in parent
    assert 'id="children-by-status">children by status: waiting 1' in parent
    child = client.get(f"/jobs/{b}").text
    assert f'<a href="/jobs/{a}">{a}</a>' in child and 'id="field-parents_left">1<' in child
    assert 'id="cancel"' in child and 'id="run-now"' not in child
    assert "<h2>Workflow</h2>" not in client.get(f"/jobs/{queue.enqueue('plain', {})}").text


def test_one_batch_drain_runs_every_layer_of_a_layered_graph(queue: Queue, handlers, sql: SQL) -> None:
    """Layers of 40, each job after 3 of the layer before, two slots of 20: a layer is released by
    outcomes the completer's background thread writes, possibly while the drain finds nothing to
    claim; the drain waits for that write and claims again instead of exiting (it exited after the
    first layer, 500 of 10,000, in bench/bench_workflows.py)."""
    import random

    h = handlers(**{"noop.py": "def handle(payload):\n    return None\n"})
    rng = random.Random(7)
    items: list[dict[str, Any]] = []
    for layer in range(8):
        for i in range(40):
            item: dict[str, Any] = {"kind": "noop", "payload": {}, "name": f"{layer}.{i}"}
            if layer:
                item["after"] = [f"{layer - 1}.{p}" for p in rng.sample(range(40), 3)]
            items.append(item)
    queue.enqueue_many(items)
    _drain(queue, h, per_sandbox=20, concurrency=2)
    assert sql("SELECT status, count(*) FROM fleetless.jobs GROUP BY 1") == [("done", 320)]
    _starts_after_parents(sql)


def _trigger_plans(dsn: str, statement: str) -> list[dict[str, Any]]:
    """The plans (EXPLAIN ANALYZE, as auto_explain logs them) of every statement ``statement`` ran,
    the trigger's own included, on a fresh connection (the trigger plans its queries anew)."""
    import json

    plans: list[dict[str, Any]] = []

    def keep(diag: psycopg.errors.Diagnostic) -> None:
        text = diag.message_primary or ""
        if "{" in text:
            plans.append(json.loads(text[text.index("{"):])["Plan"])

    with psycopg.connect(dsn, autocommit=True) as c:
        c.add_notice_handler(keep)
        c.execute("LOAD 'auto_explain'")
        for setting in ("auto_explain.log_min_duration = 0", "auto_explain.log_nested_statements = on",
                        "auto_explain.log_analyze = on", "auto_explain.log_format = json",
                        "client_min_messages = log"):
            c.execute(f"SET {setting}")
        c.execute(statement)
    return plans


def test_releasing_3000_children_compares_each_changed_row_once(queue: Queue, dsn: str, sql: SQL) -> None:
    """The finish of a fan-out's root releases its 3,000 children with one update, which fires the
    trigger again (3,000 rows waiting -> pending). No statement of either firing pairs every changed
    row with every other: the trigger paired the statement's rows before and after by id in a
    nested loop planned for one row (its first run, the root's), 9,000,000 comparisons here and
    100,000,000 for bench_workflows' 10,000-job fan-out (9.2 s of a 9.6 s finish: fan-out 0.5x of
    the no-dependency throughput)."""
    from test_query_plans import nodes

    root = queue.enqueue("noop", {})
    queue.enqueue_many([{"kind": "noop", "payload": {}, "after": [root]}] * 3000)
    plans = _trigger_plans(dsn, f"UPDATE fleetless.jobs SET status = 'done', finished_at = now() WHERE id = {root}")
    assert sql("SELECT status, count(*) FROM fleetless.jobs GROUP BY 1 ORDER BY 1") == [("done", 1), ("pending", 3000)]
    assert len(plans) > 1  # the update and the trigger's statements
    compared = max(n.get("Rows Removed by Join Filter", 0) + n.get("Actual Rows", 0) * n.get("Actual Loops", 1)
                   for plan in plans for n in nodes(plan))
    assert compared <= 4 * 3000


def _blocked_behind(sql: SQL, holder: int) -> set[int]:
    """The backends waiting, directly or in turn, for a lock ``holder`` holds (this test's own)."""
    rows = sql("SELECT pid, pg_blocking_pids(pid) FROM pg_stat_activity WHERE wait_event_type = 'Lock'")
    behind: set[int] = set()
    grew = True
    while grew:
        grew = False
        for pid, blockers in rows:
            if pid not in behind and ({holder} | behind) & set(blockers):
                behind.add(pid)
                grew = True
    return behind


def _in_thread(dsn: str, call: Callable[[Queue], Any], out: list[Any]) -> threading.Thread:
    """``call`` on a Queue of its own in a thread; what it returns or raises goes to ``out``."""
    def run() -> None:
        q = Queue(dsn)
        try:
            out.append(call(q))
        except Exception as exc:
            out.append(exc)
        finally:
            q.close()
    t = threading.Thread(target=run)
    t.start()
    return t


def test_a_retry_racing_its_parents_finish_releases_the_child(queue: Queue, dsn: str, sql: SQL) -> None:
    """retry(child) counted its unfinished parents without locking them and the parent's finish
    released only waiting children: with the finish committed between the two, the child waited
    forever (parents_left 1, its parent done). A third session's lock on the child holds the retry
    between its count and its write while the finish runs."""
    p = queue.enqueue("p", {}, queue="qx")
    c = queue.enqueue("c", {}, after=[p])
    queue.cancel(c)
    (job,) = queue.claim(1, queues=["qx"])
    retried: list[Any] = []
    finished: list[Any] = []
    with psycopg.connect(dsn) as holder:
        holder.execute("SELECT FROM fleetless.jobs WHERE id = %s FOR UPDATE", (c,))
        pid = holder.info.backend_pid
        retrying = _in_thread(dsn, lambda q: q.retry(c), retried)
        wait_for(lambda: len(_blocked_behind(sql, pid)) == 1, what="the retry waiting for the child's row")
        finishing = _in_thread(dsn, lambda q: q.complete(job, "r"), finished)
        wait_for(lambda: finished or len(_blocked_behind(sql, pid)) == 2, what="the finish done or waiting")
        holder.rollback()
    retrying.join()
    finishing.join()
    assert retried == [[]] and finished == [True]
    assert sql("SELECT status, parents_left FROM fleetless.jobs WHERE id = %s", c) == [("pending", 0)]
    assert queue.get(c)["payload"]["_parents"] == {str(p): "r"}



def test_retry_children_racing_another_parents_finish_releases_the_child(queue: Queue, dsn: str, sql: SQL) -> None:
    """retry_children counted a revived child's other parents without locking them, as retry did:
    the other parent's finish, committed meanwhile, skipped the child (still cancelled), and the
    child waited for it forever."""
    x = queue.enqueue("x", {})
    p = queue.enqueue("p", {}, queue="qx")
    c = queue.enqueue("c", {}, after=[x, p])
    queue.cancel(x)
    assert _status(sql, c) == ["cancelled"]
    (job,) = queue.claim(1, queues=["qx"])
    retried: list[Any] = []
    finished: list[Any] = []
    with psycopg.connect(dsn) as holder:
        holder.execute("SELECT FROM fleetless.jobs WHERE id = %s FOR UPDATE", (c,))
        pid = holder.info.backend_pid
        retrying = _in_thread(dsn, lambda q: q.retry(x, children=True), retried)
        wait_for(lambda: len(_blocked_behind(sql, pid)) == 1, what="the retry waiting for the child's row")
        finishing = _in_thread(dsn, lambda q: q.complete(job, "r"), finished)
        wait_for(lambda: finished or len(_blocked_behind(sql, pid)) == 2, what="the finish done or waiting")
        holder.rollback()
    retrying.join()
    finishing.join()
    assert retried == [[c]] and finished == [True]
    assert sql("SELECT status, parents_left FROM fleetless.jobs WHERE id = %s", c) == [("waiting", 1)]
    (job,) = queue.claim(1)
    assert job.id == x
    queue.complete(job, "x")
    assert sql("SELECT status, parents_left FROM fleetless.jobs WHERE id = %s", c) == [("pending", 0)]

def test_enqueue_many_refuses_an_item_after_its_own_or_a_later_items_id(queue: Queue, sql: SQL) -> None:
    """enqueue_many reserves its ids before the COPY and checked the parents after it, so an item
    after its own id (or a later item's) was written waiting for itself, forever."""
    existing = queue.enqueue("k", {})

    def next_id() -> int:
        return int(sql("SELECT last_value FROM fleetless.jobs_id_seq")[0][0]) + 1

    n = next_id()
    with pytest.raises(ValueError, match=rf"^job #0: after names job id {n}, its own in this call;") as own:
        queue.enqueue_many([{"kind": "k", "payload": {}, "after": [n]}])
    assert "\n" not in str(own.value)
    n = next_id()
    with pytest.raises(ValueError, match=rf"^job #1: after names job id {n + 2}, a later item's"):
        queue.enqueue_many([("k", {}), {"kind": "k", "payload": {}, "after": [n + 2]}, ("k", {})])
    n = next_id()
    with pytest.raises(ValueError, match=rf"^job #0: after names job id {n + 1}, a later item's"):
        queue.enqueue_many([{"kind": "k", "payload": {}, "after": [n + 1]},
                            {"kind": "k", "payload": {}, "after": [n]}])  # a cycle of two
    assert sql("SELECT id FROM fleetless.jobs") == [(existing,)]
    assert sql("SELECT count(*) FROM fleetless.job_dependencies") == [(0,)]
    n = next_id()  # an earlier item's id is fine, as its name is
    ids = queue.enqueue_many([("k", {}), {"kind": "k", "payload": {}, "after": [n, existing]}])
    assert ids == [n, n + 1] and _status(sql, *ids) == ["pending", "waiting"]


def test_a_parent_deleted_while_a_child_is_enqueued_is_no_job(queue: Queue, dsn: str, sql: SQL) -> None:
    """enqueue(after=) counted its parents without locking them, and settle_children took a parent
    that no longer existed for done: a cancelled parent deleted between the two let its child
    run. A third session's lock on the parent orders the delete first, the enqueue behind it."""
    p = queue.enqueue("p", {})
    queue.cancel(p)
    deleted: list[Any] = []
    enqueued: list[Any] = []
    with psycopg.connect(dsn) as holder:
        holder.execute("SELECT FROM fleetless.jobs WHERE id = %s FOR UPDATE", (p,))
        pid = holder.info.backend_pid
        deleting = _in_thread(dsn, lambda q: q.delete(p), deleted)
        wait_for(lambda: len(_blocked_behind(sql, pid)) == 1, what="the delete waiting for the parent's row")
        enqueuing = _in_thread(dsn, lambda q: q.enqueue("c", {}, after=[p]), enqueued)
        wait_for(lambda: enqueued or len(_blocked_behind(sql, pid)) == 2, what="the enqueue done or waiting")
        holder.rollback()
    deleting.join()
    enqueuing.join()
    assert deleted == [None]
    assert len(enqueued) == 1 and isinstance(enqueued[0], ValueError)
    assert str(enqueued[0]) == f"after: no job with id {p}"
    assert sql("SELECT id, status FROM fleetless.jobs") == []


def test_retry_children_leaves_a_child_that_another_dead_parent_doomed(queue: Queue, sql: SQL) -> None:
    """retry(B, children=True) revived a child of A and B that A's death had cancelled: it waited
    for B alone and ran while A was still dead."""
    a = queue.enqueue("a", {})
    b = queue.enqueue("b", {})
    c = queue.enqueue("c", {}, after=[a, b])
    d = queue.enqueue("d", {}, after=[c])
    sql("UPDATE fleetless.jobs SET status = 'dead', finished_at = now() WHERE id = %s", a)
    sql("UPDATE fleetless.jobs SET status = 'dead', finished_at = now() WHERE id = %s", b)
    assert sql("SELECT last_error FROM fleetless.jobs WHERE id = %s", c) == [
        (f"parent job {a} ended dead (on_parent_failure: cancel)",)]
    assert queue.retry(b, children=True) == []
    assert _status(sql, a, b, c, d) == ["dead", "pending", "cancelled", "cancelled"]
    assert sorted(queue.retry(a, children=True)) == [c, d]  # now no parent of c is dead
    assert sql("SELECT id, status, parents_left FROM fleetless.jobs WHERE id IN (%s, %s) ORDER BY id", c, d) == [
        (c, "waiting", 2), (d, "waiting", 1)]


def test_enqueue_after_many_missing_ids_names_the_first_20(queue: Queue) -> None:
    """Every missing parent was in the error: 400 KB for 60,000 ids."""
    with pytest.raises(ValueError) as missing:
        queue.enqueue("k", {}, after=range(10**9, 10**9 + 60_000))
    listed = ", ".join(str(i) for i in range(10**9, 10**9 + 20))
    assert str(missing.value) == f"after: no job with id {listed} and 59980 more"


def _edges(sql: SQL) -> list[tuple[int, int]]:
    return [tuple(r) for r in sql("SELECT parent_id, child_id FROM fleetless.job_dependencies ORDER BY 1, 2")]


def test_a_child_with_a_key_is_enqueued_once_and_a_replace_never_rewires_it(queue: Queue, sql: SQL) -> None:
    """A waiting child holds its key: enqueued again it is returned (existing), whatever parents
    the enqueue names; replace takes only with the same parents and on_parent_failure."""
    a = queue.enqueue("echo", {})
    other = queue.enqueue("echo", {})
    child = queue.enqueue("echo", {"v": 1}, after=[a], key="ck")
    assert _status(sql, child) == ["waiting"] and (child.existing, child.replaced) == (False, False)
    again = queue.enqueue("echo", {"v": 2}, after=[a], key="ck")
    assert again == child and (again.existing, again.replaced) == (True, False)
    elsewhere = queue.enqueue("echo", {"v": 2}, after=[other], key="ck")  # existing: returned unchanged
    assert elsewhere == child and elsewhere.existing
    assert queue.enqueue("echo", {"v": 2}, key="ck") == child  # an enqueue without parents finds it too
    with pytest.raises(DuplicateJob, match=f"job {child} with key 'ck' is already pending, running or waiting"):
        queue.enqueue("echo", {}, after=[a], key="ck", on_duplicate="raise")
    replaced = queue.enqueue("echo", {"v": 3}, after=[a], key="ck", on_duplicate="replace", priority=5)
    assert replaced == child and replaced.replaced
    for refused in ({"after": [a, other]}, {"after": [other]}, {"after": [a], "on_parent_failure": "run"}, {}):
        with pytest.raises(ValueError, match=f"job {child} with key 'ck' has other parents .* replace never"
                                             " rewires a workflow"):
            queue.enqueue("echo", {"v": 4}, key="ck", on_duplicate="replace", **refused)
    assert sql("SELECT payload, priority, status, parents_left FROM fleetless.jobs WHERE id = %s", child) == [
        ({"v": 3}, 5, "waiting", 1)]
    assert _edges(sql) == [(a, child)] and sql("SELECT count(*) FROM fleetless.jobs") == [(3,)]
    (job,) = queue.claim(1)  # a: the child becomes pending with a's result; a replace merges it again
    queue.complete(job, "out-a")
    assert queue.get(child)["payload"] == {"v": 3, "_parents": {str(a): "out-a"}}
    queue.enqueue("echo", {"v": 5}, after=[a], key="ck", on_duplicate="replace")
    assert queue.get(child)["payload"] == {"v": 5, "_parents": {str(a): "out-a"}}
    # a keyed job without parents is found by a keyed enqueue with parents, and a replace refused
    plain = queue.enqueue("echo", {}, key="pk")
    assert queue.enqueue("echo", {}, after=[a], key="pk") == plain
    with pytest.raises(ValueError, match="has other parents"):
        queue.enqueue("echo", {}, after=[a], key="pk", on_duplicate="replace")
    with pytest.raises(ValueError, match="after: no job with id 999999"):
        queue.enqueue("echo", {}, after=[999999], key="new")
    # a keyed job is a parent like any other
    after_keyed = queue.enqueue("echo", {}, after=[plain])
    assert _status(sql, after_keyed) == ["waiting"] and (plain, after_keyed) in _edges(sql)


def test_enqueue_many_keyed_items_are_parents_and_children_and_a_retry_of_the_call_finds_them(
        queue: Queue, sql: SQL) -> None:
    """A graph with keys, enqueued twice (as after a lost reply): its keyed jobs are found, not written
    again, and the later items follow the jobs the keys resolved to."""
    def items(v: int) -> list[dict[str, Any]]:
        return [{"kind": "echo", "payload": {"v": v}, "name": "root", "key": "root-1"},
                {"kind": "echo", "payload": {}, "name": "plain"},
                {"kind": "echo", "payload": {}, "name": "mid", "after": ["root", "plain"], "key": "mid-1"},
                {"kind": "echo", "payload": {}, "after": ["mid"], "priority": 2},
                {"kind": "echo", "payload": {}, "name": "leaf", "after": ["mid", "root"], "key": "leaf-1"}]
    root, plain, mid, tail, leaf = queue.enqueue_many(items(1))
    assert _status(sql, root, plain, mid, tail, leaf) == ["pending", "pending", "waiting", "waiting", "waiting"]
    assert _edges(sql) == sorted([(root, mid), (plain, mid), (mid, tail), (mid, leaf), (root, leaf)])
    root2, plain2, mid2, tail2, leaf2 = queue.enqueue_many(items(2))
    assert (root2, mid2, leaf2) == (root, mid, leaf) and len({plain, plain2, tail, tail2}) == 4
    assert (mid2, tail2) in _edges(sql) and len(_edges(sql)) == 6  # the found mid kept its own parents
    assert queue.get(root)["payload"] == {"v": 1}
    with pytest.raises(ValueError, match=r"job #2: job \d+ with key 'mid-1' has other parents"):
        queue.enqueue_many(items(3), on_duplicate="replace")
    with pytest.raises(DuplicateJob):
        queue.enqueue_many(items(3), on_duplicate="raise")
    assert sql("SELECT count(*) FROM fleetless.jobs") == [(7,)]  # nothing of the refused calls


def test_a_retried_cancelled_child_waits_without_the_cancel_text(queue: Queue, sql: SQL) -> None:
    """retry of an operator-cancelled child: it waits again, and last_error no longer says it was
    cancelled (show and the dashboard read it as why)."""
    a = queue.enqueue("echo", {})
    b = queue.enqueue("echo", {}, after=[a])
    c = queue.enqueue("echo", {}, after=[b])
    queue.cancel(b)
    assert queue.get(b)["last_error"].startswith("cancelled: an operator cancelled the job while it was waiting")
    assert queue.get(c)["last_error"] == f"parent job {b} ended cancelled (on_parent_failure: cancel)"
    queue.retry(b)
    queue.retry(c)
    assert sql("SELECT id, status, last_error FROM fleetless.jobs WHERE id IN (%s, %s) ORDER BY id", b, c) == [
        (b, "waiting", None), (c, "waiting", None)]


def test_two_enqueues_of_a_keyed_child_at_once_make_one_job(queue: Queue, dsn: str, sql: SQL) -> None:
    """The key's unique index covers waiting jobs (migration 027): a second enqueue of a keyed child
    while the first is uncommitted waits for it, then returns the first's child."""
    a = queue.enqueue("echo", {})
    with psycopg.connect(dsn) as conn:
        first = queue.enqueue("echo", {}, after=[a], key="once", conn=conn)
        holder = conn.info.backend_pid
        out: list[Any] = []
        second = _in_thread(dsn, lambda q: q.enqueue("echo", {}, after=[a], key="once"), out)
        wait_for(lambda: _blocked_behind(sql, holder), what="the second enqueue to wait for the first")
        conn.commit()
    second.join(10)
    assert out == [first] and out[0].existing
    assert sql("SELECT count(*) FROM fleetless.jobs WHERE key = 'once'") == [(1,)]
    assert _edges(sql) == [(a, first)]


def test_show_prints_a_childs_parent_results_one_parent_a_line(queue: Queue, dsn: str, fleetless, sql: SQL) -> None:
    """`fleetless show` of a released child: the payload's own keys on one line, then each parent's
    result on a line of its own (it printed all of _parents, up to 256 KiB, on the payload's line)."""
    a = queue.enqueue("echo", {})
    b = queue.enqueue("echo", {})
    child = queue.enqueue("echo", {"day": "2026-12-03"}, after=[a, b])
    long = "x" * 600
    sql("UPDATE fleetless.jobs SET status = 'done', finished_at = now(), result_json = %s WHERE id = %s",
        psycopg.types.json.Jsonb({"rows": 3}), a)
    sql("UPDATE fleetless.jobs SET status = 'done', finished_at = now(), result = %s WHERE id = %s", long, b)
    assert _status(sql, child) == ["pending"]
    shown = fleetless("show", str(child), dsn=dsn)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    at = lines.index('payload: {"day": "2026-12-03"}')
    assert lines[at + 1] == "payload _parents (the results of 2 parents, by id):"
    assert lines[at + 2] == f'  {a}: {{"rows": 3}}'
    assert lines[at + 3] == f'  {b}: "{"x" * 499}... (602 characters; --json has it whole)'
    import json
    assert json.loads(fleetless("show", str(child), "--json", dsn=dsn).stdout)["payload"]["_parents"] == {
        str(a): {"rows": 3}, str(b): long}


def _plan_nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
    return [node, *(n for child in node.get("Plans", []) for n in _plan_nodes(child))]


def _read(node: dict[str, Any]) -> int:
    """Rows a plan node looked at: those it returned and those its filter removed, every loop."""
    return int((node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0)) * node.get("Actual Loops", 1))


def _prune_plan(queue: Queue, dsn: str, ages: dict[str, float | None], graphs: list[int]) -> dict[str, Any]:
    """EXPLAIN ANALYZE of one retention pass's statement (500 rows, the graphs given), rolled back."""
    from fleetless.attempt_totals import DURATION_BUCKETS, bucket_params
    params = {"done": None, "cancelled": None, "dead": None, **ages, "limit": 500, "graphs": graphs,
              **bucket_params([float(b) for b in DURATION_BUCKETS])}
    with psycopg.connect(dsn) as c:
        (plan,) = c.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + queue._q["prune_batch"], params).fetchone()
        c.rollback()
    return plan[0]["Plan"]  # type: ignore[no-any-return]


def test_retention_probes_a_graph_and_never_walks_it(queue: Queue, dsn: str, sql: SQL) -> None:
    """Retention beside two old chains of 2,000 done jobs, the older one held by one job still
    waiting: the pass checks each graph once, a few probes of jobs_graph_idx that stop at their
    first entry (EXPLAIN ANALYZE), not once per job (2,000 probes for the held chain before), and
    deletes 500 of the free chain's jobs; the run's next passes go on with that chain from where
    the pass left off, until only the held chain is left."""
    from fleetless.maintenance import pruner
    # written as drains would have left them (inserted so: no dead row versions for the probes to
    # step over, which only a vacuum would clear on a machine whose other transactions hold it back)
    sql("""INSERT INTO fleetless.jobs (id, kind, payload, status, attempts, finished_at, graph_id)
           SELECT i, 'echo', '{}', CASE WHEN i = 2000 THEN 'waiting' ELSE 'done' END, 1,
                  CASE WHEN i < 2000 OR i > 2000 THEN now() - interval '30 days' + make_interval(secs => i) END,
                  CASE WHEN i <= 2000 THEN 1 ELSE 2001 END
           FROM generate_series(1, 4000) i""")
    sql("""INSERT INTO fleetless.job_dependencies (parent_id, child_id)
           SELECT i, i + 1 FROM generate_series(1, 3999) i WHERE i <> 2000""")
    sql("ANALYZE fleetless.jobs")
    held, free = list(range(1, 2001)), list(range(2001, 4001))
    plan = _prune_plan(queue, dsn, {"done": 86400.0}, [1, 2001])
    graph_scans = [n for n in _plan_nodes(plan) if n.get("Index Name") == "jobs_graph_idx"]
    assert graph_scans and max(n["Actual Loops"] for n in graph_scans) <= 2  # per graph, not per job
    assert sum(_read(n) for n in graph_scans) <= 500 + 8  # the free chain's 500 rows and the probes
    with psycopg.connect(dsn) as c:  # the graphs are found one probe each (a loose index scan)
        (found,) = c.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + queue._q["prune_graphs_next"],
                             {"after": 0, "graphs": 500}).fetchone()
    scans = [n for n in _plan_nodes(found[0]["Plan"]) if n.get("Relation Name") == "jobs"]
    assert scans and all(n.get("Index Name") == "jobs_graph_idx" and _read(n) <= 3 for n in scans), scans
    assert queue.prune_pass({"done": 86400.0}, limit=500) == (500, True)
    assert sql("SELECT count(*) FROM fleetless.jobs WHERE id = ANY(%s)", held) == [(2000,)]
    assert sql("SELECT count(*) FROM fleetless.jobs WHERE id = ANY(%s)", free) == [(1500,)]
    assert sql("SELECT position FROM fleetless.maintenance_runs WHERE name = 'retention_graphs'") == [(2000,)]
    result = pruner.run_once(queue, pruner.Settings(ages=(("done", 86400.0),), batch_size=500))
    assert (result.deleted, result.more) == (1500, False)
    assert sql("SELECT count(*) FROM fleetless.jobs WHERE id = ANY(%s)", held) == [(2000,)]
    assert sql("SELECT count(*) FROM fleetless.jobs") == [(2000,)]


def test_a_retention_pass_beside_many_old_held_graphs_reads_none_of_their_jobs(
        queue: Queue, dsn: str, sql: SQL) -> None:
    """Audit (issue 29): 4 graphs of 1,000 done jobs, each held by one job still waiting and older
    than every other finished job, lay at the front of every pass's scan, which probed each of
    their jobs (1M such rows: 2.7-5.6 s a pass). Now the pass's scans of jobs read about the 500
    rows it deletes (EXPLAIN ANALYZE; 4,496 rows in one scan before), the held graphs each cost a probe, and the
    same pass prunes the 500 oldest due jobs in no graph."""
    sql("""INSERT INTO fleetless.jobs (id, kind, payload, status, attempts, finished_at, graph_id)
           SELECT i, 'echo', '{}', CASE WHEN i % 1000 = 0 THEN 'waiting' ELSE 'done' END, 1,
                  CASE WHEN i % 1000 <> 0 THEN now() - interval '60 days' + make_interval(secs => i) END,
                  (i - 1) / 1000 * 1000 + 1
           FROM generate_series(1, 4000) i""")
    sql("""INSERT INTO fleetless.jobs (id, kind, payload, status, attempts, finished_at)
           SELECT i, 'echo', '{}', 'done', 1, now() - interval '30 days' + make_interval(secs => i)
           FROM generate_series(4001, 4600) i""")
    sql("ANALYZE fleetless.jobs")
    plan = _prune_plan(queue, dsn, {"done": 86400.0}, [1, 1001, 2001, 3001])
    scans = [(n["Node Type"], n.get("Index Name"), _read(n)) for n in _plan_nodes(plan)
             if n.get("Relation Name") == "jobs" and n["Node Type"] != "ModifyTable"]
    assert all(read <= 500 for _, _, read in scans), [s for s in scans if s[2] > 4]  # the due rows, found, locked
    assert sum(read for _, index, read in scans if index == "jobs_graph_idx") <= 4, scans  # a probe a graph
    assert [r["id"] for r in queue._run("prune_graphs_next", {"after": 0, "graphs": 500})] == [1, 1001, 2001, 3001]
    assert queue.prune_batch({"done": 86400.0}, limit=500) == 500
    assert sql("SELECT min(id), count(*) FROM fleetless.jobs WHERE id > 4000") == [(4501, 100)]
    assert sql("SELECT count(*) FROM fleetless.jobs WHERE id <= 4000") == [(4000,)]



def test_retention_looks_at_a_bounded_number_of_graphs_a_pass_from_where_the_last_left_off(
        queue: Queue, sql: SQL) -> None:
    """A pass looks at as many graphs as its batch size, after the last graph the pass before it
    looked at (kept in the database), then goes round again from the first."""
    graphs = []
    for _ in range(3):
        first = queue.enqueue("echo", {})
        graphs.append((first, queue.enqueue("echo", {}, after=[first])))
    (a1, _), (b1, _), (c1, c2) = graphs
    sql("UPDATE fleetless.jobs SET status = 'done', attempts = 1, finished_at = now() - interval '30 days'"
        " WHERE id = ANY(%s)", [a1, b1, c1, c2])
    ages = {"done": 86400.0}
    assert queue.prune_pass(ages, limit=2) == (0, True)  # a and b, held by their waiting children
    assert queue.prune_pass(ages, limit=2) == (2, True)  # c, as a whole (it may have had more)
    assert queue.prune_pass(ages, limit=2) == (0, False)  # none after c: round again from a
    assert queue.prune_pass(ages, limit=2) == (0, True)
    assert sorted(r[0] for r in sql("SELECT id FROM fleetless.jobs")) == [a for g in graphs[:2] for a in g]

def test_retention_keeps_a_parent_an_older_enqueuer_wrote_while_its_child_waits(queue: Queue, sql: SQL) -> None:
    """Mixed versions (audit, issue 29): an enqueuer older than migration 028 writes a workflow's
    edges with no graph labels. A finished parent of such a child still waiting is kept (the child
    reads its result when it is released): it was pruned, its result lost to the child's _parents.
    So is a labelled graph's job that such an enqueuer gave an unlabelled child."""
    parent, other, child = (queue.enqueue("echo", {}) for _ in range(3))
    a = queue.enqueue("echo", {})
    b = queue.enqueue("echo", {}, after=[a])
    late = queue.enqueue("echo", {})
    sql("UPDATE fleetless.jobs SET status = 'waiting' WHERE id = ANY(%s)", [child, late])
    sql("INSERT INTO fleetless.job_dependencies (parent_id, child_id) VALUES (%s, %s), (%s, %s), (%s, %s)",
        parent, child, other, child, b, late)
    sql("UPDATE fleetless.jobs SET status = 'done', attempts = 1, finished_at = now() - interval '30 days'"
        " WHERE id = ANY(%s)", [parent, a, b])
    assert _labels(sql, parent, other, child, a, b, late) == [None, None, None, a, a, None]
    assert queue.prune_batch({"done": 86400.0}) == 1  # a only: b's unlabelled child waits
    assert queue.prune_batch({"done": 86400.0}, limit=500) == 0
    assert sorted(r[0] for r in sql("SELECT id FROM fleetless.jobs")) == sorted([parent, other, child, b, late])
    sql("UPDATE fleetless.jobs SET status = 'done', finished_at = now() - interval '30 days'"
        " WHERE id = ANY(%s)", [other, child, late])
    assert queue.prune_batch({"done": 86400.0}, limit=500) == 5



def test_retention_racing_an_open_enqueue_of_a_child_keeps_its_graph(queue: Queue, dsn: str, sql: SQL) -> None:
    """Audit (issue 29): a graph g1 -> g2, finished and old; an enqueue of a child after g2 whose
    transaction is still open while retention runs. Retention skipped g2 (the enqueue holds it)
    and pruned g1, part of the graph the enqueue was adding to. Now a graph one of whose jobs
    retention cannot lock is left whole for a later pass; once the enqueue commits, the child
    holds the graph, and is released with g2's result."""
    g1 = queue.enqueue("echo", {})
    g2 = queue.enqueue("echo", {}, after=[g1])
    sql("UPDATE fleetless.jobs SET status = 'done', attempts = 1, result = 'g2',"
        " finished_at = now() - interval '30 days' WHERE id = ANY(%s)", [g1, g2])
    with psycopg.connect(dsn) as t:
        child = int(queue.enqueue("echo", {}, after=[g2], conn=t))
        assert queue.prune_batch({"done": 86400.0}, limit=500) == 0
        assert queue.prune_batch({"done": 86400.0}) == 0
        t.commit()
    assert queue.prune_batch({"done": 86400.0}) == 0
    assert sorted(r[0] for r in sql("SELECT id FROM fleetless.jobs")) == [g1, g2, child]
    assert _status(sql, child) == ["pending"]
    (job,) = queue.claim(1)
    assert job.id == child and job.payload["_parents"] == {str(g2): "g2"}


def test_a_deadlock_that_aborts_an_enqueue_says_so_and_to_retry(queue: Queue, dsn: str, sql: SQL) -> None:
    """A deadlock PostgreSQL breaks by aborting an enqueue (here: the app's transaction holds a
    parent FOR SHARE, another session waits to update it while holding the next parent) was
    DatabaseUnavailable, 'database unavailable: deadlock detected', as if the server were away:
    now TransactionConflict, one line that says what happened and what to do (still a
    DatabaseUnavailable, so what retried it before retries it)."""
    p = queue.enqueue("echo", {})
    q = queue.enqueue("echo", {})
    with psycopg.connect(dsn) as app, psycopg.connect(dsn) as other:
        queue.enqueue("echo", {}, after=[p], conn=app)  # p FOR SHARE until the app's transaction ends
        other.execute("SET deadlock_timeout = '1min'")  # the app's session is the one that breaks it
        other.execute("SELECT FROM fleetless.jobs WHERE id = %s FOR UPDATE", (q,))
        updating = threading.Thread(target=other.execute,
                                    args=("UPDATE fleetless.jobs SET priority = 1 WHERE id = %s", (p,)))
        updating.start()
        try:
            wait_for(lambda: _blocked_behind(sql, app.info.backend_pid), what="the update waiting for the app's lock")
            with pytest.raises(db.TransactionConflict) as raised:
                queue.enqueue("echo", {}, after=[q], conn=app)
        finally:
            app.rollback()
            updating.join(30)
        assert str(raised.value) == "deadlock detected: retry the transaction"
        assert isinstance(raised.value, db.DatabaseUnavailable)
        other.commit()
    assert sql("SELECT priority FROM fleetless.jobs WHERE id = %s", p) == [(1,)]


def test_a_child_of_two_jobs_of_a_graph_and_a_join_of_that_graph_at_once_do_not_deadlock(
        queue: Queue, dsn: str, sql: SQL) -> None:
    """An enqueue of a child of q1 and q2 (one graph: it joins nothing) share-locks them in id
    order; a join relabelling their graph at the same moment locked its jobs in the order its plan
    met them (q2 first: q1's row was written again since). Each then waited for the other. A third
    session's share lock on q1 holds the relabel between the two."""
    a = queue.enqueue("echo", {})
    queue.enqueue("echo", {}, after=[a])
    b = queue.enqueue("echo", {})
    q1 = queue.enqueue("echo", {}, after=[b])
    q2 = queue.enqueue("echo", {}, after=[b])
    sql("UPDATE fleetless.jobs SET priority = 1 WHERE id = %s", q1)  # q1's row now after q2's
    joined: list[Any] = []
    child: list[Any] = []
    with psycopg.connect(dsn) as holder:
        holder.execute("SELECT FROM fleetless.jobs WHERE id = %s FOR SHARE", (q1,))
        pid = holder.info.backend_pid
        joining = _in_thread(dsn, lambda q: q.enqueue("echo", {}, after=[a, b]), joined)
        wait_for(lambda: len(_blocked_behind(sql, pid)) == 1, what="the relabel waiting for q1")
        adding = _in_thread(dsn, lambda q: q.enqueue("echo", {}, after=[q1, q2]), child)
        wait_for(lambda: child or len(_blocked_behind(sql, pid)) == 2, what="the child written or waiting")
        holder.rollback()
    joining.join(30)
    adding.join(30)
    assert [type(x) for x in joined + child] == [Enqueued, Enqueued], joined + child
    assert set(_labels(sql, b, q1, q2, *joined, *child)) == {a}


def test_a_join_whose_graph_joined_another_meanwhile_takes_that_graphs_slot_too(
        queue: Queue, dsn: str, sql: SQL) -> None:
    """An enqueue joining graphs B and C read their labels, then waited for C's graph_joins slot;
    meanwhile C joined A (here by hand, as a join does: C's slot held, C's jobs relabelled). It
    finds its parent in A, whose slot it does not hold: it gives its locks back (a savepoint) and
    takes A's, B's and C's in order, then joins A and B."""
    from fleetless.graphs import JOIN_SLOTS

    a = queue.enqueue("echo", {})
    queue.enqueue("echo", {}, after=[a])
    b = queue.enqueue("echo", {})
    b1 = queue.enqueue("echo", {}, after=[b])
    c = queue.enqueue("echo", {})
    c1 = queue.enqueue("echo", {}, after=[c])
    out: list[Any] = []
    with psycopg.connect(dsn) as holder:
        holder.execute("SELECT FROM fleetless.graph_joins WHERE slot = %s FOR UPDATE", (c % JOIN_SLOTS,))
        joining = _in_thread(dsn, lambda q: q.enqueue("echo", {}, after=[b1, c1]), out)
        wait_for(lambda: _blocked_behind(sql, holder.info.backend_pid), what="the join waiting for C's slot")
        holder.execute("UPDATE fleetless.jobs SET graph_id = %s WHERE graph_id = %s", (a, c))
        holder.commit()
    joining.join(30)
    assert [type(x) for x in out] == [Enqueued], out
    assert set(_labels(sql, b, b1, c, c1, *out)) == {a}
