"""A kind's ``batch_isolation = "shared"`` (issue 27): its handle() jobs of a batch run one after
another in the batch runner's own process, on the process, bwrap and forkserver tiers, through real
drains, with every outcome read from the table.

What holds as in process mode: each job's own result, error, print() output, environment and
directory; an exception is its job's alone; a timeout is enforced (by the runner's timer, and from
outside by the drainer when a job switches that off), and the jobs after a timed-out one run on in
a fresh sandbox, uncharged. What does not (docs/isolation.md, "Shared batches"): a job reaches the
later jobs of its own batch (their payloads, their results), never another batch's.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fleetless import Queue, Status
from fleetless.drainer import DrainConfig, Drainer

from proctools import wait_for

pytestmark = pytest.mark.usefixtures("private_workdir")
TIERS = ["process", "bwrap", "forkserver"]
SQL = Callable[..., list[Any]]

MODULE = """
    import os, signal, time
    SEEN = []  # the jobs this process ran: grows in a shared batch, one in a fork of its own
    LEFT = []  # the processes a job of this process left
    signal.signal(signal.SIGALRM, lambda *_: None)  # the module's own: the runner's timer is set again per job
    def handle(payload):
        found = sorted(os.listdir("."))  # what an earlier job left in its directory, if any
        open("left-behind", "w").close()
        SEEN.append(payload["n"])
        print("printed", payload["n"])
        if payload.get("raise"):
            raise ValueError("boom " + str(payload["n"]))
        if payload.get("exit"):  # takes the runner's process down with it
            os._exit(3)
        if payload.get("leave"):  # a process left behind, in a session of its own
            import subprocess
            LEFT.append(subprocess.Popen(["sleep", "300"], start_new_session=True).pid)
            return {"left": LEFT[-1]}
        if payload.get("look"):  # the next job: is it alive?
            return {"alive": [p for p in LEFT if os.path.exists("/proc/%d" % p)], "ran": len(SEEN)}
        if payload.get("no_timer"):  # switches the runner's own timer off: stopped from outside
            signal.signal(signal.SIGALRM, signal.SIG_IGN)
        if payload.get("sleep"):
            time.sleep(payload["sleep"])
        return {"n": payload["n"], "pid": os.getpid(), "ran": len(SEEN), "cwd": os.getcwd(), "found": found,
                "job": os.environ["FLEETLESS_JOB_ID"], "tmp": os.environ["TMPDIR"]}
"""

TOML = """
[kinds.shared]
batch_isolation = "shared"
"""


def _with_toml(h: Path) -> Path:
    (h / "fleetless.toml").write_text(TOML)
    return h


def _drain(queue: Queue, h: Path, tier: str, per_sandbox: int) -> None:
    Drainer(queue, DrainConfig(handlers_dir=h, sandbox=tier, per_sandbox=per_sandbox, concurrency=1)).run()


def _rows(sql: SQL, ids: list[int]) -> list[tuple[Any, ...]]:
    """(status, attempts, result_json, result, last_error) of each job, in ``ids``' order."""
    got = {r[0]: r[1:] for r in sql("SELECT id, status, attempts, result_json, result, last_error"
                                     " FROM fleetless.jobs WHERE id = ANY(%s)", ids)}
    return [got[i] for i in ids]


@pytest.mark.parametrize("tier", TIERS)
def test_shared_jobs_run_in_one_process_each_with_its_own_result_output_and_directory(
        tier: str, queue: Queue, handlers, sql: SQL, require_tier) -> None:
    """Mixed with a process kind in the same drain: the shared kind's batch is one process that ran
    its jobs in turn; the process kind's jobs each ran in a fresh fork (its SEEN holds itself)."""
    require_tier(tier)
    h = _with_toml(handlers(**{"shared.py": MODULE, "proc.py": MODULE}))
    shared = queue.enqueue_many([{"kind": "shared", "payload": {"n": i}, "timeout": 30} for i in range(5)])
    proc = queue.enqueue_many([{"kind": "proc", "payload": {"n": i}, "timeout": 30} for i in range(5)])
    _drain(queue, h, tier, 5)
    rows = _rows(sql, shared + proc)
    assert [r[:2] for r in rows] == [("done", 1)] * 10
    results = [r[2] for r in rows]
    assert [r["n"] for r in results] == [0, 1, 2, 3, 4] * 2
    assert [r["job"] for r in results] == [str(i) for i in shared + proc]  # its own FLEETLESS_JOB_ID
    assert all(r["cwd"] == r["tmp"] and r["found"] == [] for r in results)  # an empty directory, its TMPDIR
    assert len({r["cwd"] for r in results[5:]}) == 5  # process: a directory of its own
    # shared: one directory per batch, emptied between jobs (what the earlier job left is gone)
    assert len({r["cwd"] for r in results[:5]}) < 5
    assert [r[3] for r in rows] == [f"printed {i}\n" for i in range(5)] * 2  # its own print()s alone
    assert [r["ran"] for r in results[5:]] == [1] * 5  # process: each job in a fork of its own
    by_pid: dict[int, list[int]] = {}
    for r in results[:5]:
        by_pid.setdefault(r["pid"], []).append(r["ran"])
    assert len(by_pid) < 5  # shared: jobs ran in one process, one after another
    assert all(ran == list(range(1, len(ran) + 1)) for ran in by_pid.values())


@pytest.mark.parametrize("tier", TIERS)
def test_an_exception_fails_its_own_job_alone_and_the_batch_runs_on_in_the_same_process(
        tier: str, queue: Queue, handlers, sql: SQL, require_tier) -> None:
    require_tier(tier)
    h = _with_toml(handlers(**{"shared.py": MODULE}))
    ids = queue.enqueue_many([{"kind": "shared", "payload": {"n": i, "raise": i == 2}, "timeout": 30,
                               "max_attempts": 1} for i in range(5)])
    _drain(queue, h, tier, 5)
    rows = _rows(sql, ids)
    assert [r[:2] for r in rows] == [("done", 1)] * 2 + [("dead", 1)] + [("done", 1)] * 2
    assert rows[2][4].startswith("ValueError: boom 2")
    assert rows[2][3] == "printed 2\n"  # what it printed before it raised: its own
    done = [r[2] for r in rows if r[0] == "done"]
    assert [r["n"] for r in done] == [0, 1, 3, 4]
    assert len({r["pid"] for r in done}) == 1  # the same process before and after the exception
    assert [r["ran"] for r in done] == [1, 2, 4, 5]


@pytest.mark.parametrize("tier", TIERS)
def test_a_shared_job_that_ends_the_process_is_charged_alone_and_the_rest_run_in_a_fresh_sandbox(
        tier: str, queue: Queue, handlers, sql: SQL, require_tier) -> None:
    require_tier(tier)
    h = _with_toml(handlers(**{"shared.py": MODULE}))
    ids = queue.enqueue_many([{"kind": "shared", "payload": {"n": i, "exit": i == 1}, "timeout": 30,
                               "max_attempts": 1} for i in range(4)])
    _drain(queue, h, tier, 4)
    rows = _rows(sql, ids)
    assert [r[:2] for r in rows] == [("done", 1), ("dead", 1), ("done", 1), ("done", 1)]
    assert "exit code 3" in rows[1][4]
    assert [rows[i][2]["ran"] for i in (0, 2, 3)] == [1, 1, 2]  # after it: a fresh process


@pytest.mark.parametrize("tier", TIERS)
def test_the_processes_a_shared_job_left_are_killed_before_the_next_job(
        tier: str, queue: Queue, handlers, sql: SQL, require_tier) -> None:
    require_tier(tier)
    h = _with_toml(handlers(**{"shared.py": MODULE}))
    ids = queue.enqueue_many([{"kind": "shared", "payload": {"n": i, "leave": i == 0, "look": i == 1},
                               "timeout": 30} for i in range(2)])
    _drain(queue, h, tier, 2)
    rows = _rows(sql, ids)
    assert [r[:2] for r in rows] == [("done", 1)] * 2
    assert rows[0][2]["left"] > 0
    assert rows[1][2] == {"alive": [], "ran": 2}  # the same process, and what job 0 left is gone


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("no_timer", [False, True], ids=["timer", "timer-switched-off"])
def test_a_timed_out_shared_job_is_killed_alone_and_the_jobs_after_it_run_in_a_fresh_sandbox(
        tier: str, no_timer: bool, queue: Queue, handlers, sql: SQL, require_tier) -> None:
    """The runner's timer stops it at its timeout; one that switched the timer off is stopped from
    outside (the drainer destroys the sandbox HOST_GRACE past it). Either way it alone is charged:
    the jobs before it keep their results, the jobs after it run once, in another process that
    never ran it (a fresh sandbox: nothing it left reaches them), at their first attempt."""
    require_tier(tier)
    h = _with_toml(handlers(**{"shared.py": MODULE}))
    ids = queue.enqueue_many([{"kind": "shared", "payload": {"n": i, "sleep": 60 if i == 2 else 0,
                                                             "no_timer": no_timer and i == 2},
                               "timeout": 1, "max_attempts": 1} for i in range(5)])
    _drain(queue, h, tier, 5)
    rows = _rows(sql, ids)
    assert [r[:2] for r in rows] == [("done", 1)] * 2 + [("dead", 1)] + [("done", 1)] * 2
    assert rows[2][4].startswith("killed: timeout after 1 s")
    # the runner's timer stopped it (its print() kept, though the module set its own SIGALRM
    # handler at import), or the drainer's kill of its sandbox (nothing of it kept)
    assert rows[2][3] == (None if no_timer else "printed 2\n")
    before, after = [rows[i][2] for i in (0, 1)], [rows[i][2] for i in (3, 4)]
    assert [r["ran"] for r in before] == [1, 2]
    assert [r["ran"] for r in after] == [1, 2]  # a fresh process: it never ran job 2
    assert len({r["pid"] for r in before}) == 1 and len({r["pid"] for r in after}) == 1


ATTACKER = """
    import gc, os, sys, threading, time
    PROCESS = os.urandom(8).hex()  # one per import: which jobs ran in the attacker's process
    FOUND = set()  # secrets of other jobs, seen by the thread job 0 leaves behind

    def _watch():
        while True:
            for o in gc.get_objects():
                if isinstance(o, dict):  # a job's line, as the runner decoded it
                    for v in list(o.values()):
                        for w in list(v.values()) if isinstance(v, dict) else [v]:
                            if isinstance(w, str) and w.startswith("secret-"):
                                FOUND.add(w)
            time.sleep(0.002)

    def _forged(payload):
        time.sleep(0.1)  # the thread's scan sees this payload meanwhile
        payload["secret"] = "altered"  # changes the payload the runner holds
        return {"forged": True, "found": sorted(FOUND), "process": PROCESS}

    def handle(payload):
        if payload["n"] == 0:  # the attacker: a thread left running, and the runner's handle() replaced
            threading.Thread(target=_watch, daemon=True).start()
            frame = sys._getframe(1)
            while frame is not None:  # up the stack, to the runner that called it
                runner = frame.f_locals.get("self")
                if hasattr(runner, "shared_one"):
                    runner.handle = _forged
                    break
                frame = frame.f_back
        return {"own": payload["secret"], "process": PROCESS}
"""


@pytest.mark.parametrize("tier", TIERS)
def test_a_shared_job_reaches_the_later_jobs_of_its_own_batch_and_no_other_batch(
        tier: str, queue: Queue, handlers, sql: SQL, require_tier) -> None:
    """What docs/isolation.md says a job of a shared batch can do, done: its thread, left running,
    reads a later job's payload in the runner's memory; its replacement of the runner's handle()
    changes that payload and forges that job's result. Jobs of the next batch (a fresh sandbox)
    are out of its reach, and so are the jobs before it."""
    require_tier(tier)
    h = _with_toml(handlers(**{"shared.py": ATTACKER}))
    ids = queue.enqueue_many([{"kind": "shared", "payload": {"n": i, "secret": f"secret-{i}"}, "timeout": 30}
                              for i in range(4)])
    _drain(queue, h, tier, 2)  # batches of two: [0, 1] and [2, 3]
    rows = _rows(sql, ids)
    assert [r[:2] for r in rows] == [("done", 1)] * 4
    results = [r[2] for r in rows]
    assert results[0]["own"] == "secret-0"
    attacker = results[0]["process"]
    forged = [i for i, r in enumerate(results) if r.get("forged")]
    assert forged and all(results[i]["process"] == attacker for i in forged)  # its own batch's jobs alone
    assert all(f"secret-{i}" in results[i]["found"] for i in forged)  # their payloads, read
    others = [i for i in range(1, 4) if i not in forged]
    assert others  # the next batch: not reached
    assert all(results[i] == {"own": f"secret-{i}", "process": results[i]["process"]} for i in others)
    assert all(results[i]["process"] != attacker for i in others)
    payloads = {r[0]: r[1] for r in sql("SELECT id, payload FROM fleetless.jobs WHERE id = ANY(%s)", ids)}
    assert [payloads[i]["secret"] for i in ids] == [f"secret-{i}" for i in range(4)]  # the table's: untouched
    json.dumps(results)  # (every result is plain JSON)


GATED = """
    import os, time
    def handle(payload):
        gate = payload.get("gate")
        if gate:  # runs until the test opens its gate (bounded)
            open(gate + ".started", "w").close()
            give_up = time.monotonic() + 60
            while not os.path.exists(gate) and time.monotonic() < give_up:
                time.sleep(0.02)
        return payload["n"]
"""


@pytest.mark.parametrize("which", ["waiting", "running"])
def test_a_cancel_in_a_shared_batch_stops_only_the_cancelled_job(which: str, queue: Queue, sql: SQL, handlers,
                                                                tmp_path: Path, require_tier) -> None:
    """As in process mode (test_cancel.py): a cancelled waiting job never starts; a cancelled
    running one (in the runner's own process: its sandbox is destroyed) alone ends cancelled, and
    the jobs after it are done, at their first attempt. Process tier: the gate is a host file."""
    require_tier("process")
    gates = tmp_path / "gates"
    gates.mkdir()
    gates.chmod(0o777)
    gate = str(gates / "open")
    h = handlers(**{"gated.py": GATED})
    (h / "fleetless.toml").write_text('[kinds.gated]\nbatch_isolation = "shared"\n')
    ids = [queue.enqueue("gated", {"n": 0, "gate": gate}, max_attempts=3)]
    ids += [queue.enqueue("gated", {"n": n}, max_attempts=3) for n in (1, 2, 3)]
    drainer = Drainer(queue, DrainConfig(handlers_dir=h, sandbox="process", per_sandbox=4, concurrency=1))
    thread = threading.Thread(target=drainer.run)
    thread.start()
    try:
        wait_for(lambda: Path(gate + ".started").exists(), timeout=60, what="the batch's first job to start")
        victim = ids[3] if which == "waiting" else ids[0]
        assert queue.cancel(victim) is Status.RUNNING
        wait_for(lambda: drainer._cancelled or sql("SELECT status FROM fleetless.jobs WHERE id = %s", victim)
                 != [("running",)], timeout=30, what="the drainer to see the cancel")
        if which == "waiting":
            Path(gate).touch()
        thread.join(timeout=120)
    finally:
        Path(gate).touch()
        thread.join(timeout=120)
    rows = dict(sql("SELECT id, status FROM fleetless.jobs WHERE id = ANY(%s)", ids))
    attempts = dict(sql("SELECT id, attempts FROM fleetless.jobs WHERE id = ANY(%s)", ids))
    if which == "waiting":
        assert [rows[i] for i in ids] == ["done", "done", "done", "cancelled"]
    else:
        assert [rows[i] for i in ids] == ["cancelled", "done", "done", "done"]
    assert all(attempts[i] == 1 for i in ids)


def test_the_drain_names_its_shared_kinds_at_its_start(fleetless, dsn: str, queue: Queue, handlers, sql: SQL) -> None:
    h = _with_toml(handlers(**{"shared.py": MODULE}))
    job = queue.enqueue("shared", {"n": 0}, timeout=30)
    r = fleetless("drain", "--handlers", str(h), "--sandbox", "process", "--per-sandbox", "2", dsn=dsn)
    assert r.returncode == 0, r.stderr
    assert 'kinds shared: batch_isolation = "shared"' in r.stderr and "docs/isolation.md" in r.stderr, r.stderr
    assert sql("SELECT status FROM fleetless.jobs WHERE id = %s", job) == [("done",)]
