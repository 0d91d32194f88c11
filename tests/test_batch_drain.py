"""Batch mode and watch mode through real drains: many jobs of one kind per sandbox, each with its
own fenced outcome; leases renewed while a batch runs; outcomes written in batches; a watcher
that picks work up as it is enqueued. Assertions read the table."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from fleetless import Queue, Status
from fleetless.drainer import DrainConfig, Drainer

from proctools import wait_for

pytestmark = pytest.mark.usefixtures("private_workdir")
TIERS = ["process", "bwrap", "microvm"]
SQL = Callable[..., list[Any]]


MODULE = """
    import os, time
    INTERPRETER = os.urandom(8).hex()  # one per import: which jobs shared an interpreter
    def handle(payload):
        what = payload.get("do", "ok")
        if what == "raise":
            raise RuntimeError("bad payload " + str(payload["n"]))
        if what == "exit":
            os._exit(9)
        if what == "sleep":
            time.sleep(payload["s"])
        return {"n": payload["n"], "interpreter": INTERPRETER}
"""


@pytest.mark.parametrize("tier", TIERS)
def test_a_batch_drain_stores_each_jobs_own_outcome(tier: str, queue: Queue, handlers, sql: SQL,
                                                    require_tier) -> None:
    require_tier(tier)
    h = handlers(**{"mod.py": MODULE, "script.py": """
        import json, sys
        n = json.load(open(sys.argv[1]))["n"]
        if n == 2:
            sys.exit(4)
        print("script", n)
    """})
    ids = queue.enqueue_many([{"kind": "mod", "payload": p, "max_attempts": 1 if p.get("do") == "raise" else 3}
                              for p in ({"n": 0}, {"n": 1, "do": "raise"}, {"n": 2}, {"n": 3, "do": "exit"},
                                        {"n": 4}, {"n": 5})])
    scripts = queue.enqueue_many([("script", {"n": n}) for n in range(4)])
    summary = Drainer(queue, DrainConfig(handlers_dir=h, sandbox=tier, per_sandbox=10, concurrency=2,
                                         timeout=60)).run()
    rows = {r[0]: r[1:] for r in sql("SELECT id, status, attempts, result_json, result, last_error"
                                     " FROM fleetless.jobs")}
    assert [rows[i][0] for i in ids] == ["done", "dead", "done", "pending", "done", "done"]
    assert rows[ids[0]][2]["n"] == 0 and rows[ids[2]][2]["n"] == 2
    assert str(rows[ids[1]][4]).startswith("RuntimeError: bad payload 1\nTraceback")
    assert str(rows[ids[3]][4]).startswith("exit code 9")  # its own process died: charged alone
    assert all(rows[i][1] == 1 for i in ids)  # nobody else lost an attempt
    # each job ran in a fork of one runner, which its neighbour's death did not take down
    same = [rows[i][2]["interpreter"] for i in (ids[0], ids[2], ids[4], ids[5])]
    assert len(set(same)) == 1
    assert [rows[i][:2] + rows[i][3:4] for i in scripts] == [
        ("done", 1, "script 0\n"), ("done", 1, "script 1\n"), ("pending", 1, ""), ("done", 1, "script 3\n")]
    assert (summary.done, summary.failed, summary.dead, summary.fenced_out) == (7, 2, 1, 0)


def test_batch_claims_take_one_kind_and_every_kind_progresses(queue: Queue, handlers, sql: SQL) -> None:
    h = handlers(**{f"k{i}.py": "import os\nI = os.urandom(8).hex()\ndef handle(p):\n    return I\n"
                    for i in range(3)})
    queue.enqueue_many([(f"k{i % 3}", {"i": i}) for i in range(30)])
    Drainer(queue, DrainConfig(handlers_dir=h, per_sandbox=4, concurrency=1)).run()
    assert sql("SELECT status, count(*) FROM fleetless.jobs GROUP BY 1") == [("done", 30)]
    # one sandbox (one interpreter) never served two kinds
    pids = sql("SELECT result_json, array_agg(DISTINCT kind) FROM fleetless.jobs GROUP BY 1")
    assert all(len(kinds) == 1 for _, kinds in pids)


def test_a_long_batch_keeps_its_leases_while_its_drainer_lives(queue: Queue, handlers, sql: SQL) -> None:
    """Each job's lease is its 1 s timeout plus 3 s of grace; the batch takes far longer, and a
    reaper running all along finds nothing to reap."""
    h = handlers(**{"mod.py": MODULE})
    queue.enqueue_many([{"kind": "mod", "payload": {"n": i, "do": "sleep", "s": 0.5}, "timeout": 1}
                        for i in range(12)])
    stop = threading.Event()
    reaped: list[int] = []

    def reaper() -> None:
        q = Queue(queue.conninfo)
        while not stop.is_set():
            reaped.extend(q.reap())
            stop.wait(0.1)
        q.close()

    t = threading.Thread(target=reaper)
    t.start()
    try:
        Drainer(queue, DrainConfig(handlers_dir=h, per_sandbox=12, concurrency=1, lease_grace=3)).run()
    finally:
        stop.set()
        t.join()
    assert reaped == []
    assert sql("SELECT status, attempts, count(*) FROM fleetless.jobs GROUP BY 1, 2") == [("done", 1, 12)]


def _drain_process(dsn: str, h: Path, *args: str, config: str = "") -> subprocess.Popen[bytes]:
    """A drainer in its own process (config: extra DrainConfig arguments, as Python)."""
    code = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from fleetless import Queue
        from fleetless.drainer import DrainConfig, Drainer
        Drainer(Queue({dsn!r}), DrainConfig(handlers_dir=Path({str(h)!r}), {config})).run()
    """)
    return subprocess.Popen([sys.executable, "-c", code, *args], env={**os.environ})


def test_a_dead_drainers_batch_is_reaped_and_runs_again(dsn: str, queue: Queue, handlers, sql: SQL,
                                                        tmp_path: Path) -> None:
    """SIGKILL between the jobs' ends and the flush: nothing was acknowledged, the leases lapse
    (nobody renews them), the reaper returns the jobs and they run again: at least once."""
    marks = tmp_path / "marks"
    marks.mkdir(mode=0o777)
    h = handlers(**{"mark.py": f"""
        import os, time
        def handle(p):
            open(os.path.join({str(marks)!r}, str(p["n"])), "w").close()
            if p.get("hold"):
                time.sleep(600)
            return p["n"]
    """})
    ids = queue.enqueue_many([{"kind": "mark", "payload": {"n": i}, "timeout": 1} for i in range(5)])
    queue.enqueue("mark", {"n": 99, "hold": True}, priority=-1, timeout=600)  # keeps the drainer busy
    proc = _drain_process(dsn, h, config="per_sandbox=5, concurrency=2, lease_grace=3, flush_interval=3600,"
                                        " flush_size=10**6")
    wait_for(lambda: len(list(marks.iterdir())) == 6, what="every job to have run")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert sql("SELECT count(*) FROM fleetless.jobs WHERE status = 'running'") == [(6,)]  # none written
    wait_for(lambda: len(queue.reap()) > 0 or sql("SELECT count(*) FROM fleetless.jobs WHERE id = ANY(%s)"
                                                  " AND status = 'pending'", ids) == [(5,)],
             what="the dead drainer's leases to lapse")
    wait_for(lambda: sql("SELECT count(*) FROM fleetless.jobs WHERE id = ANY(%s) AND status = 'pending'", ids)
             == [(5,)], what="the batch to be reaped")
    for path in marks.iterdir():
        path.unlink()
    sql("UPDATE fleetless.jobs SET status = 'cancelled' WHERE id <> ALL(%s)", ids)
    Drainer(queue, DrainConfig(handlers_dir=h, per_sandbox=5, concurrency=1)).run()
    assert sql("SELECT status, attempts, count(*) FROM fleetless.jobs WHERE id = ANY(%s) GROUP BY 1, 2", ids) == [
        ("done", 2, 5)]


def test_a_reaped_batchs_late_finish_is_fenced_out(queue: Queue, handlers, sql: SQL, tmp_path: Path) -> None:
    go = tmp_path / "go"
    started = tmp_path / "started"
    h = handlers(**{"wait.py": f"""
        import os, time
        def handle(p):
            open({str(started)!r}, "w").close()
            while not os.path.exists({str(go)!r}):
                time.sleep(0.02)
            return "late"
    """})
    queue.enqueue_many([("wait", {}) for _ in range(3)])
    drainer = Drainer(queue, DrainConfig(handlers_dir=h, per_sandbox=3, concurrency=1, queues=("default",)))
    done: list[Any] = []
    t = threading.Thread(target=lambda: done.append(drainer.run()))
    t.start()
    wait_for(started.exists, what="the batch to start")
    other = Queue(queue.conninfo)
    # the other drainer's queue: once reaped, the rows are pending where this drain's own claims
    # (the one ahead while the batch runs, the one after it) cannot take them back first
    sql("UPDATE fleetless.jobs SET queue = 'other'")
    assert len(other.reap(older_than=0)) == 3  # as if the lease had lapsed
    taken = other.claim(3, queues=("other",))  # and another drainer took the jobs
    assert len(taken) == 3
    go.touch()
    t.join(60)
    assert done and done[0].fenced_out == 3 and done[0].done == 0
    assert sorted(sql("SELECT status, claim_token::text, result_json FROM fleetless.jobs")) == sorted(
        ("running", str(j.claim_token), None) for j in taken)
    other.close()


def test_two_batch_drainers_race_and_every_job_runs_once(dsn: str, queue: Queue, handlers, sql: SQL,
                                                         tmp_path: Path) -> None:
    log = tmp_path / "log"
    log.touch(mode=0o666)
    h = handlers(**{"once.py": f"""
        import os
        def handle(p):
            fd = os.open({str(log)!r}, os.O_WRONLY | os.O_APPEND)
            os.write(fd, b"%d\\n" % p["n"])
            os.close(fd)
    """})
    queue.enqueue_many([("once", {"n": i}) for i in range(400)])
    procs = [_drain_process(dsn, h, config="per_sandbox=25, concurrency=2") for _ in range(2)]
    for p in procs:
        assert p.wait(300) == 0
    runs = log.read_text().split()
    assert sorted(map(int, runs)) == list(range(400))
    assert sql("SELECT status, attempts, count(*) FROM fleetless.jobs GROUP BY 1, 2") == [("done", 1, 400)]


# -- watch mode ---------------------------------------------------------------------------------


LISTENING = "SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'LISTEN%%' AND datname = current_database()"


def test_a_watcher_picks_up_jobs_enqueued_after_it_started_and_exits_when_idle(
        queue: Queue, handlers, sql: SQL, dsn: str) -> None:
    h = handlers(**{"mod.py": MODULE})
    proc = subprocess.Popen([sys.executable, "-m", "fleetless.cli", "drain", "--handlers", str(h), "--watch",
                             "--idle-exit", "10s", "--per-sandbox", "5"],
                            env={**os.environ, "DATABASE_URL": dsn}, stdout=subprocess.PIPE, text=True)
    wait_for(lambda: sql(LISTENING) == [(1,)], what="the watcher to listen")
    first = queue.enqueue("mod", {"n": 1})
    wait_for(lambda: sql("SELECT status FROM fleetless.jobs WHERE id = %s", first) == [("done",)],
             what="the new job to be done")
    later = queue.enqueue("mod", {"n": 2}, delay=1.0)
    wait_for(lambda: sql("SELECT status FROM fleetless.jobs WHERE id = %s", later) == [("done",)],
             what="the delayed job to be done")
    assert sql("SELECT started_at >= run_after FROM fleetless.jobs WHERE id = %s", later) == [(True,)]
    out, _ = proc.communicate(timeout=120)  # then idle for 10 s: it exits on its own
    assert proc.returncode == 0 and "claimed 2, done 2" in out


def test_the_cron_tick_leaves_a_running_watcher_alone(queue: Queue, handlers, sql: SQL, dsn: str,
                                                      fleetless) -> None:
    h = handlers(**{"mod.py": MODULE})
    drainer = Drainer(queue, DrainConfig(handlers_dir=h, watch=True, concurrency=1))
    t = threading.Thread(target=drainer.run)
    t.start()
    wait_for(lambda: sql(LISTENING) == [(1,)], what="the watcher to listen")
    tick = fleetless("drain", "--handlers", str(h), "--watch", dsn=dsn)  # one query, then it exits
    assert tick.returncode == 0 and "a watcher is already draining these queues" in tick.stdout
    other = fleetless("drain", "--handlers", str(h), "--watch", "--queue", "other", "--idle-exit", "0.1s", dsn=dsn)
    assert other.returncode == 0 and "claimed 0" in other.stdout  # other queues: a watcher of its own
    drainer.stop(grace=0)
    t.join(30)
    assert not t.is_alive()


def test_a_watcher_rides_out_a_lost_connection(queue: Queue, handlers, sql: SQL, dsn: str) -> None:
    h = handlers(**{"mod.py": MODULE})
    drainer = Drainer(queue, DrainConfig(handlers_dir=h, watch=True, idle_exit=30, concurrency=1))
    t = threading.Thread(target=drainer.run)
    t.start()
    wait_for(lambda: sql(LISTENING) == [(1,)], what="the watcher to listen")
    sql("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database()"
        " AND pid <> pg_backend_pid()")  # every connection of the drainer goes
    wait_for(lambda: sql(LISTENING) == [(1,)], what="the watcher to listen again")
    # the app enqueues on a connection of its own (the drainer's Queue may still be reconnecting)
    producer = Queue(dsn)
    try:
        job = producer.enqueue("mod", {"n": 7})
    finally:
        producer.close()
    wait_for(lambda: sql("SELECT status FROM fleetless.jobs WHERE id = %s", job) == [("done",)],
             what="the job enqueued after the reconnect")
    drainer.stop(grace=0)
    t.join(30)
    assert not t.is_alive()
    assert drainer.summary.done == 1


def test_idle_exit_needs_watch() -> None:
    with pytest.raises(ValueError, match="--idle-exit needs --watch"):
        DrainConfig(handlers_dir=Path("."), idle_exit=5)
    with pytest.raises(ValueError, match="--per-sandbox"):
        DrainConfig(handlers_dir=Path("."), per_sandbox=0)




ODD_RESULTS = """
    def handle(payload):
        return {"nul": "a\\x00b", "lone": "x\\ud800y", "pair": "\\U0001F600", "accent": "\\u00e9t\\u00e9",
                "escaped": "\\\\u0000"}.get(payload.get("what"), payload["n"])
"""


def test_a_result_with_a_nul_or_a_lone_surrogate_is_stored_for_its_job_alone_and_its_neighbours_keep_theirs(
        queue: Queue, handlers, sql: SQL) -> None:
    """What jsonb refuses is replaced in that job's result only (NUL by U+FFFD, a lone surrogate
    by "?"), whether the batch's other results took the path that does not decode them or not."""
    h = handlers(**{"odd.py": ODD_RESULTS})
    whats = ["plain", "nul", "plain", "lone", "pair", "accent", "escaped", "plain"]
    ids = queue.enqueue_many([("odd", {"n": i, "what": w}) for i, w in enumerate(whats)])
    Drainer(queue, DrainConfig(handlers_dir=h, sandbox="process", per_sandbox=10, concurrency=1)).run()
    rows = dict(sql("SELECT id, result_json FROM fleetless.jobs WHERE status = 'done'"))
    assert [rows.get(i) for i in ids] == [0, "a\ufffdb", 2, "x?y", "\U0001F600", "\u00e9t\u00e9", "\\u0000", 7]


FORGER = """
    import os
    def handle(payload):
        forged = payload.get("forge")
        if forged is not None:  # write records of its own on the runner's result pipe
            mine = os.readlink("/proc/self/fd/2")
            for fd in os.listdir("/proc/self/fd"):
                try:
                    target = os.readlink(f"/proc/self/fd/{fd}")
                except OSError:
                    continue
                if int(fd) > 2 and target.startswith("pipe:") and target != mine:
                    os.write(int(fd), forged.encode())
        return payload["n"]
"""


def test_a_forged_result_line_fails_only_its_own_job_and_changes_no_other_row(queue: Queue, handlers,
                                                                              sql: SQL) -> None:
    """A handler writing a record of its own on every pipe it holds, with a result that is not
    JSON and is shaped to read as one more row of the finish statement: the only pipe it reaches
    is its own report to the runner (the channel to the drainer is out of its reach), so its own
    job fails alone, the rest of the batch is done, and a job outside the batch keeps its row."""
    h = handlers(**{"evil.py": FORGER})
    other = queue.enqueue("other", {"n": 99}, delay=3600)
    forged = ('{"i":1,"ok":true,"result":0]],[[' + str(other) + ',"00000000-0000-0000-0000-000000000000",'
              '"done",false,0,null,null,"1",null,null,null,null]]}\n')
    ids = queue.enqueue_many([("evil", {"n": 0}), ("evil", {"n": 1, "forge": forged}), ("evil", {"n": 2}),
                              ("evil", {"n": 3})])
    before = sql("SELECT * FROM fleetless.jobs WHERE id = %s", other)
    summary = Drainer(queue, DrainConfig(handlers_dir=h, sandbox="process", per_sandbox=10, concurrency=1)).run()
    rows = {r[0]: r[1:] for r in sql("SELECT id, status, result_json, last_error FROM fleetless.jobs")}
    assert rows[ids[0]][:2] == ("done", 0)
    assert rows[ids[1]][0] == "pending" and rows[ids[1]][2].startswith("exit code 0 (handle() did not return)")
    assert [rows[i][:2] for i in ids[2:]] == [("done", 2), ("done", 3)]
    assert sql("SELECT * FROM fleetless.jobs WHERE id = %s", other) == before
    assert (summary.done, summary.failed, summary.fenced_out) == (3, 1, 0)


@contextmanager
def _one_batch_running_and_one_ahead(queue: Queue, h: Path, sql: SQL, started: Path) -> Iterator[Drainer]:
    """A drain of batches of 2 on one slot, once its first batch runs (``started`` exists) and
    the next is claimed ahead (4 running rows); on leaving, the drain has ended by itself."""
    drainer = Drainer(queue, DrainConfig(handlers_dir=h, per_sandbox=2, concurrency=1))
    thread = threading.Thread(target=drainer.run)
    thread.start()
    try:
        wait_for(lambda: started.exists() and sql(
            "SELECT count(*) FROM fleetless.jobs WHERE status = 'running'") == [(4,)],
            what="a running batch and one claimed ahead")
        yield drainer
        thread.join(timeout=60)
        assert not thread.is_alive()
    finally:
        drainer.stop(grace=0)
        thread.join(timeout=60)


def test_the_next_batch_is_claimed_while_every_slot_runs_and_a_stop_gives_it_back_uncharged(
        queue: Queue, handlers, sql: SQL, tmp_path: Path) -> None:
    """With every slot busy the drainer claims the next batch ahead (a slot that frees starts it
    without waiting for a claim). A drain stopped meanwhile gives that batch back: its jobs are
    pending again with no attempt charged, and each has a 'released' attempt row."""
    started = tmp_path / "started"
    h = handlers(**{"nap.py": f"""
        import pathlib, time
        def handle(p):
            pathlib.Path({str(started)!r}).touch()
            time.sleep(1.5)
    """})
    ids = queue.enqueue_many([("nap", {"i": i}) for i in range(6)])
    with _one_batch_running_and_one_ahead(queue, h, sql, started) as drainer:
        drainer.stop()  # short jobs finish; the batch claimed ahead never started
    rows = dict((r[0], r[1:]) for r in sql("SELECT id, status, attempts FROM fleetless.jobs"))
    assert [rows[i] for i in ids[2:4]] == [("pending", 0)] * 2  # the batch claimed ahead
    assert [rows[i][0] for i in ids[4:]] == ["pending"] * 2  # never claimed
    assert sql("SELECT job_id, outcome FROM fleetless.job_attempts WHERE job_id = ANY(%s) ORDER BY 1",
               ids[2:4]) == [(ids[2], "released"), (ids[3], "released")]
    assert sql("SELECT count(*) FROM fleetless.jobs WHERE status = 'running'") == [(0,)]


def test_a_job_cancelled_while_its_batch_waits_to_start_ends_cancelled_without_running(
        queue: Queue, handlers, sql: SQL, tmp_path: Path) -> None:
    ran = tmp_path / "ran"
    ran.mkdir()
    ran.chmod(0o777)
    h = handlers(**{"nap.py": f"""
        import pathlib, time
        def handle(p):
            pathlib.Path({str(ran)!r}, str(p["i"])).touch()
            time.sleep(1.5)
    """})
    ids = queue.enqueue_many([("nap", {"i": i}) for i in range(4)])
    with _one_batch_running_and_one_ahead(queue, h, sql, ran / "0"):
        assert queue.cancel(ids[3]) is Status.RUNNING
    rows = dict((r[0], r[1:]) for r in sql("SELECT id, status, attempts, last_error FROM fleetless.jobs"))
    assert [rows[i][0] for i in ids] == ["done", "done", "done", "cancelled"]
    assert rows[ids[3]][1:] == (1, "cancelled: an operator cancelled the job while it ran")
    assert sorted(p.name for p in ran.iterdir()) == ["0", "1", "2"]  # job 3 never started


PRINTER = """
    import sys

    def handle(payload):
        n, do = payload["n"], payload["do"]
        print(f"job {n} says hello")
        print(f"job {n} warns", file=sys.stderr)
        if do == "raise":
            raise ValueError(f"job {n} failed")
        return None if do == "none" else {"n": n}
"""


@pytest.mark.parametrize("per_sandbox", [1, 4], ids=["per-job", "batch"])
def test_each_handle_jobs_prints_are_its_own_and_kept_when_it_returns(queue: Queue, handlers, sql: SQL, dsn: str,
                                                                      fleetless, per_sandbox: int) -> None:
    """Issue 28 papercut: each job's own output belongs to that job. A handle() that returns a value
    keeps what it printed in ``result`` (its value is ``result_json``); one that returns None has its
    prints as its result; one that raises has them as its result and its own stderr in its error;
    no job's output appears in another's row."""
    h = handlers(**{"printer.py": PRINTER})
    ids = queue.enqueue_many([("printer", {"n": n, "do": do}) for n, do in
                              enumerate(["value", "raise", "none", "value"])], max_attempts=1)
    Drainer(queue, DrainConfig(handlers_dir=h, sandbox="process", per_sandbox=per_sandbox, concurrency=1,
                               timeout=60)).run()
    rows = {r[0]: r[1:] for r in sql("SELECT id, status, result, result_json, last_error FROM fleetless.jobs")}
    assert [rows[i][:3] for i in ids] == [("done", "job 0 says hello\n", {"n": 0}),
                                          ("dead", "job 1 says hello\n", None),
                                          ("done", "job 2 says hello\n", None),
                                          ("done", "job 3 says hello\n", {"n": 3})], rows
    error = rows[ids[1]][3]
    assert error.startswith("ValueError: job 1 failed") and "job 1 warns" in error, error
    for n, job in enumerate(ids):
        others = " ".join(str(v) for v in rows[job])
        assert all(f"job {m} " not in others for m in range(4) if m != n), (n, rows[job])
    from starlette.testclient import TestClient

    from fleetless.web import create_app

    page = TestClient(create_app(queue)).get(f"/jobs/{ids[0]}").text  # the job page shows both
    assert '<h2>Result</h2><pre id=result-json>{\n  &quot;n&quot;: 0\n}</pre>' in page, page
    assert "<h2>Output</h2><pre id=result>job 0 says hello\n</pre>" in page, page
    shown = fleetless("show", str(ids[0]), dsn=dsn).stdout  # and show, as its output
    assert "\noutput:\n  job 0 says hello\n" in shown and 'result_json: {"n": 0}' in shown, shown
