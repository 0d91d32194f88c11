"""Batch mode's durability on every sandbox tier (process, bwrap, microvm): a drainer SIGKILLed
between its jobs' ends and the flush, a reaped batch's late finish, two drainers racing, a fork
bomb inside a batch, and a long batch's leases.

Nothing here looks inside the sandbox (bwrap and the microVM see none of the host's files but the
handlers): what the tests wait for is seen from the drainer's side (its completer received an
outcome) or read in the table. The microVM runs under software emulation on CI hosts: its cases
are small and the timeouts generous."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fleetless import Queue
from fleetless.drainer import DrainConfig, Drainer

from proctools import descendants, wait_for

pytestmark = pytest.mark.usefixtures("private_workdir")
TIERS = ["process", "bwrap", "microvm"]
SQL = Callable[..., list[Any]]
#: Seconds to wait for what a drain does: a microVM boots a kernel per sandbox under TCG.
SLOW = {"process": 60.0, "bwrap": 60.0, "microvm": 600.0}

MODULE = """
    import os, time
    INTERPRETER = os.urandom(8).hex()  # one per import: which jobs shared an interpreter
    def handle(payload):
        if payload.get("bomb"):
            while True:
                os.fork()
        if payload.get("sleep"):
            time.sleep(payload["sleep"])
        return {"n": payload["n"], "interpreter": INTERPRETER}
"""

#: A drainer in its own process that touches ``<marks>/<job id>`` when its completer has received
#: the job's outcome (buffered, not yet written): the moment between a job's end and the flush.
DRAINER = """
    import os, sys, time
    from pathlib import Path
    from fleetless import Queue, completer
    from fleetless.drainer import DrainConfig, Drainer
    dsn, handlers, marks, tier = sys.argv[1:5]
    add = completer.Completer.add
    def marked(self, job, outcome):
        add(self, job, outcome)
        Path(marks, str(job.id)).touch()
    completer.Completer.add = marked
    if len(sys.argv) > 5:  # a barrier: claim only once this many drainers are ready to
        Path(marks, f"ready-{os.getpid()}").touch()
        while len(list(Path(marks).glob("ready-*"))) < int(sys.argv[5]):
            time.sleep(0.01)
    Drainer(Queue(dsn), DrainConfig(handlers_dir=Path(handlers), sandbox=tier, {config})).run()
"""


def _drainer(dsn: str, h: Path, marks: Path, tier: str, config: str, *, together: int = 0) -> subprocess.Popen[bytes]:
    """``together``: start draining only once that many drainers sharing ``marks`` are ready."""
    code = textwrap.dedent(DRAINER).replace("{config}", config)
    return subprocess.Popen([sys.executable, "-c", code, dsn, str(h), str(marks), tier,
                             *([str(together)] if together else [])], env={**os.environ})


def _status(sql: SQL, ids: list[int]) -> list[tuple[Any, ...]]:
    return sql("SELECT status, attempts, count(*) FROM fleetless.jobs WHERE id = ANY(%s) GROUP BY 1, 2"
               " ORDER BY 1, 2", ids)


@pytest.mark.parametrize("tier", TIERS)
def test_sigkill_between_the_jobs_end_and_the_flush_runs_them_again(
        tier: str, dsn: str, queue: Queue, handlers, sql: SQL, tmp_path: Path, require_tier) -> None:
    """Nothing was acknowledged: the rows stay running under the dead drainer's claim, are
    reaped once its leases lapse (nobody renews them) and run again: at least once, never lost."""
    require_tier(tier)
    h = handlers(**{"mod.py": MODULE})
    marks = tmp_path / "marks"
    marks.mkdir()
    # a queue of its own per tier: the SIGKILLed watcher of an earlier case holds its queues' watch lease
    ids = queue.enqueue_many([{"kind": "mod", "payload": {"n": i}, "timeout": 1, "queue": tier} for i in range(4)])
    # and a job that runs on after them: a drain whose claim comes back short with nothing running
    # writes what it holds before it waits (aac8e0d), so something must still run for the outcomes
    # to stay unwritten; it is claimed ahead while the batch runs, and started once the batch ends
    sleeper = queue.enqueue("mod", {"n": 9, "sleep": 3600}, timeout=3600, queue=tier)
    # watch mode keeps the drainer alive once the batch is done; the flush timer never fires
    proc = _drainer(dsn, h, marks, tier, "per_sandbox=4, concurrency=1, lease_grace=3, watch=True,"
                                         f" flush_interval=3600, flush_size=10**6, queues=({tier!r},)")
    try:
        wait_for(lambda: len(list(marks.iterdir())) == 4, timeout=SLOW[tier],
                 what="the drainer to hold every job's outcome")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert _status(sql, ids) == [("running", 1, 4)]  # ended, but nothing written
    assert sql("SELECT count(*) FROM fleetless.jobs WHERE result_json IS NOT NULL") == [(0,)]
    sql("DELETE FROM fleetless.jobs WHERE id = %s", sleeper)  # not part of what is checked
    if tier == "microvm":  # its lease carries a minute of boot allowance: reap as if it had lapsed
        assert len(queue.reap(older_than=0)) == 4
    else:
        wait_for(lambda: queue.reap() and _status(sql, ids) == [("pending", 1, 4)], timeout=SLOW[tier],
                 what="the dead drainer's leases to lapse and its batch to be reaped")
    assert _status(sql, ids) == [("pending", 1, 4)]
    summary = Drainer(queue, DrainConfig(handlers_dir=h, sandbox=tier, per_sandbox=4, concurrency=1)).run()
    assert (summary.done, summary.fenced_out) == (4, 0)
    assert _status(sql, ids) == [("done", 2, 4)]


@pytest.mark.parametrize("tier", TIERS)
def test_a_reaped_batchs_late_finish_is_fenced_out(tier: str, queue: Queue, handlers, sql: SQL,
                                                   require_tier) -> None:
    """The batch's outcomes reach the completer only after its claims were reaped and taken by
    another drainer: the fenced write leaves the new owner's rows alone."""
    require_tier(tier)
    h = handlers(**{"mod.py": MODULE})
    queue.enqueue_many([("mod", {"n": i}) for i in range(3)])
    drainer = Drainer(queue, DrainConfig(handlers_dir=h, sandbox=tier, per_sandbox=3, concurrency=1))
    arrived, go = threading.Event(), threading.Event()
    record = drainer._record

    def late(result: Any) -> None:
        arrived.set()
        go.wait(SLOW[tier])
        record(result)

    drainer._record = late  # type: ignore[method-assign]
    done: list[Any] = []
    t = threading.Thread(target=lambda: done.append(drainer.run()))
    t.start()
    other = Queue(queue.conninfo)
    try:
        assert arrived.wait(SLOW[tier]), "the batch did not end"
        assert len(other.reap(older_than=0)) == 3  # as if the leases had lapsed
        taken = other.claim(3)  # and another drainer took the jobs
        assert len(taken) == 3
    finally:
        go.set()
        t.join(SLOW[tier])
        other.close()
    assert done and (done[0].fenced_out, done[0].done) == (3, 0)
    assert sorted(sql("SELECT status, claim_token::text, result_json FROM fleetless.jobs")) == sorted(
        ("running", str(j.claim_token), None) for j in taken)


@pytest.mark.parametrize("tier", TIERS)
def test_two_batch_drainers_race_and_every_job_runs_once(tier: str, dsn: str, queue: Queue, handlers,
                                                         sql: SQL, tmp_path: Path, require_tier) -> None:
    require_tier(tier)
    h = handlers(**{"mod.py": MODULE})
    n, per = (24, 4) if tier == "microvm" else (300, 25)
    ids = queue.enqueue_many([("mod", {"n": i}) for i in range(n)])
    procs = [_drainer(dsn, h, tmp_path, tier, f"per_sandbox={per}, concurrency=2", together=2) for _ in range(2)]
    for p in procs:
        assert p.wait(SLOW[tier] * 5) == 0
    assert _status(sql, ids) == [("done", 1, n)]
    # one attempt each in the history, and each result is the job's own
    assert sql("SELECT count(DISTINCT job_id), count(*) FROM fleetless.job_attempts") == [(n, n)]
    assert sql("SELECT count(*) FROM fleetless.jobs WHERE (result_json->>'n')::int = (payload->>'n')::int") == [(n,)]
    # both took part (they started claiming together)
    assert len({r[0] for r in sql("SELECT DISTINCT pid FROM fleetless.job_attempts")}) == 2


@pytest.mark.parametrize("tier", TIERS)
def test_a_fork_bomb_inside_a_batch_fails_only_itself(tier: str, queue: Queue, handlers, sql: SQL,
                                                      require_tier) -> None:
    """The bomb's job is charged (dead: one attempt); its neighbours are done with their own
    results, and no copy of the runner forked by the bomb reports for another job."""
    require_tier(tier)
    h = handlers(**{"mod.py": MODULE})
    payloads: list[dict[str, Any]] = [{"n": 0}, {"n": 1}, {"n": 2, "bomb": True}, {"n": 3}, {"n": 4}]
    ids = queue.enqueue_many([{"kind": "mod", "payload": p, "max_attempts": 1, "timeout": 10} for p in payloads])
    summary = Drainer(queue, DrainConfig(handlers_dir=h, sandbox=tier, per_sandbox=5, concurrency=1,
                                         timeout=10)).run()
    rows = dict(sql("SELECT id, status FROM fleetless.jobs"))
    assert [rows[i] for i in ids] == ["done", "done", "dead", "done", "done"]
    results = dict(sql("SELECT id, result_json FROM fleetless.jobs WHERE status = 'done'"))
    assert [results[ids[i]]["n"] for i in (0, 1, 3, 4)] == [0, 1, 3, 4]
    assert sql("SELECT attempts, count(*) FROM fleetless.jobs GROUP BY 1") == [(1, 5)]
    assert (summary.done, summary.dead, summary.fenced_out) == (4, 1, 0)


LEAVER = """
    import os, time
    def handle(payload):
        if payload.get("leave"):  # a child and a grandchild that outlive the job, one orphaned
            if os.fork() == 0:
                if os.fork() == 0:
                    time.sleep(60)
                    os._exit(0)
                time.sleep(60)
                os._exit(0)
            time.sleep(0.2)
            return {"left": True}
        me, alive = os.getpid(), []
        for name in os.listdir("/proc"):
            if name.isdigit() and int(name) != me:
                try:
                    stat = open(f"/proc/{name}/stat", "rb").read()
                except OSError:
                    continue
                argv0 = open(f"/proc/{name}/cmdline", "rb").read().split(b"\\0")[0].decode()
                if argv0 and stat[stat.rindex(b")") + 2:].split()[0] not in (b"Z", b"X"):  # not a kernel thread
                    alive.append(argv0)
        return {"others": sorted(alive)}
"""


@pytest.mark.parametrize("tier", TIERS)
def test_processes_a_batch_job_leaves_behind_die_before_the_next_job_starts(
        tier: str, queue: Queue, handlers, sql: SQL, require_tier) -> None:
    """A handle() that forks a child and a grandchild and returns: before the next job of the
    batch runs, neither is alive any more (the next job sees only its sandbox's own processes,
    the same as the batch's first job saw), so a job's leftovers (a fork bomb's copies) can never
    take the sandbox down under a neighbour."""
    require_tier(tier)
    h = handlers(**{"leaver.py": LEAVER})
    ids = queue.enqueue_many([{"kind": "leaver", "payload": p, "max_attempts": 1}
                              for p in ({}, {"leave": True}, {})])
    Drainer(queue, DrainConfig(handlers_dir=h, sandbox=tier, per_sandbox=3, concurrency=1, timeout=30)).run()
    rows = dict(sql("SELECT id, result_json FROM fleetless.jobs"))
    assert rows[ids[1]] == {"left": True}, rows
    assert rows[ids[2]] == rows[ids[0]], rows  # what the first job saw, and no sleeping leftovers


@pytest.mark.parametrize("tier", ["process", "bwrap"])  # a microVM's lease carries a minute of boot allowance
def test_a_long_batch_keeps_its_leases_while_its_drainer_lives(tier: str, queue: Queue, handlers, sql: SQL,
                                                               require_tier) -> None:
    """Each job's lease is its 1 s timeout plus 3 s of grace; the batch takes far longer, and a
    reaper running all along finds nothing to reap."""
    require_tier(tier)
    h = handlers(**{"mod.py": MODULE})
    queue.enqueue_many([{"kind": "mod", "payload": {"n": i, "sleep": 0.5}, "timeout": 1} for i in range(12)])
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
        Drainer(queue, DrainConfig(handlers_dir=h, sandbox=tier, per_sandbox=12, concurrency=1,
                                   lease_grace=3)).run()
    finally:
        stop.set()
        t.join()
    assert reaped == []
    assert sql("SELECT status, attempts, count(*) FROM fleetless.jobs GROUP BY 1, 2") == [("done", 1, 12)]


def _spares_waiting() -> int:
    """How many spare sandboxes' runners wait for a batch: this process (the drainer) holds the
    drainer's end of each one's job pipe (``batch.in``), which the runner unlinks once it has it
    open. Hermetic: only this process's own fds are read."""
    waiting = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").endswith("/batch.in (deleted)"):
                waiting += 1
        except OSError:
            continue
    return waiting


def _spare_waiting() -> bool:
    return _spares_waiting() > 0


def test_spares_are_counted_among_this_tests_own_processes_only(tmp_path: Path) -> None:
    """Issue 26 (hermetic tests): on 61e842d the spare-sandbox tests counted every process on the
    host with a batch.fifo open, so another drain's spares failed them. A process that holds one
    open, started here and then orphaned (no longer a descendant of this test), is not counted."""
    fifo = tmp_path / "batch.fifo"
    os.mkfifo(fifo)
    script = ("import os, sys, time\n"
              "if os.fork():\n    os._exit(0)\n"
              "os.setsid()\n"
              "fd = os.open(sys.argv[1], os.O_RDWR)\n"
              "print(os.getpid(), flush=True)\n"
              "time.sleep(120)\n")
    starter = subprocess.Popen([sys.executable, "-c", script, str(fifo)], stdout=subprocess.PIPE, text=True)
    assert starter.stdout is not None
    orphan = int(starter.stdout.readline())
    starter.wait(30)
    try:
        wait_for(lambda: any(os.readlink(f"/proc/{orphan}/fd/{fd}") == str(fifo)
                             for fd in os.listdir(f"/proc/{orphan}/fd")), what="the orphan to hold the pipe")
        assert orphan not in descendants(os.getpid())
        assert _spares_waiting() == 0
    finally:
        os.kill(orphan, signal.SIGKILL)


# no spare where the job's workspace is not a host directory: a microVM's is a copy, the forkserver's a
# tmpfs of its own mount namespace (that tier keeps job inits forked ahead instead)
@pytest.mark.parametrize("tier", ["process", "bwrap"])
def test_a_watchers_job_runs_in_a_sandbox_started_before_it_came_and_none_outlives_the_watcher(
        tier: str, queue: Queue, handlers, sql: SQL, private_workdir: Path, require_tier) -> None:
    """Watch mode keeps one sandbox started ahead, its runner waiting on a pipe for a batch: the
    job's runner process is older than the enqueue, so pickup skips the sandbox's and the
    interpreter's start. The next spare is started as one is taken; at idle exit none is left."""
    require_tier(tier)
    h = handlers(**{"born.py": """
        import os
        def handle(payload):  # when the batch runner started, in seconds since boot: the parent of
            with open(f"/proc/{os.getppid()}/stat") as f:  # this job's parent (the runner's template)
                runner = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{runner}/stat") as f:
                ticks = int(f.read().rsplit(")", 1)[1].split()[19])
            return ticks / os.sysconf("SC_CLK_TCK")
    """})
    done: list[Any] = []
    drainer = Drainer(queue, DrainConfig(handlers_dir=h, sandbox=tier, per_sandbox=5, concurrency=1, watch=True,
                                         idle_exit=3))
    t = threading.Thread(target=lambda: done.append(drainer.run()))
    t.start()
    try:
        for n in range(2):
            wait_for(_spare_waiting, timeout=SLOW[tier], what="a spare sandbox's runner")
            enqueued = time.clock_gettime(time.CLOCK_BOOTTIME)
            job = queue.enqueue("born", {"n": n})
            wait_for(lambda job=job: sql("SELECT status FROM fleetless.jobs WHERE id = %s", job) == [("done",)],
                     timeout=SLOW[tier], what="the job to be done")
            (born,) = sql("SELECT result_json FROM fleetless.jobs WHERE id = %s", job)[0]
            assert born <= enqueued
    finally:
        t.join(SLOW[tier])
    assert done and (done[0].claimed, done[0].done) == (2, 2)
    assert not _spare_waiting()
    assert not private_workdir.exists() or not list(private_workdir.rglob("batch.in"))


def test_a_watcher_keeps_one_spare_sandbox_more_than_its_slots(queue: Queue, handlers, private_workdir: Path,
                                                                require_tier) -> None:
    """As many spares as the slots can take at once, plus one for a job that comes while those are
    being replaced; none is left once the watcher stops."""
    require_tier("process")
    h = handlers(**{"n.py": "def handle(payload):\n    return 1\n"})
    done: list[Any] = []
    drainer = Drainer(queue, DrainConfig(handlers_dir=h, sandbox="process", per_sandbox=5, concurrency=2, watch=True,
                                         idle_exit=120))
    t = threading.Thread(target=lambda: done.append(drainer.run()))
    t.start()
    try:
        wait_for(lambda: _spares_waiting() >= 3, timeout=SLOW["process"], what="three spare sandboxes' runners")
        assert _spares_waiting() == 3
    finally:
        drainer.stop(grace=0)
        t.join(SLOW["process"])
    assert done and not _spare_waiting()




@pytest.mark.parametrize("tier", ["process", "bwrap"])
def test_a_one_shot_batch_runner_starts_the_next_batchs_sandbox_while_a_full_one_runs(
        tier: str, handlers, private_workdir: Path, require_tier) -> None:
    """Issue 27: a batch drain's runner (``spare_after_full``, as a one-shot batch drain makes it)
    starts the next batch's sandbox when it takes a full batch, so that batch's sandbox and runner
    are ready when it comes: its runner is older than the batch. A short batch (the queue's last)
    starts none. (Before: only watch mode started sandboxes ahead.)"""
    import json
    import uuid

    from fleetless.batch import Runner, Slot
    from fleetless.job import Job
    from fleetless.sandbox import Template, get_backend

    require_tier(tier)
    h = handlers(**{"born.py": """
        import os
        def handle(payload):  # when the batch runner started, in seconds since boot: the parent of
            with open(f"/proc/{os.getppid()}/stat") as f:  # this job's parent (the runner's template)
                runner = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{runner}/stat") as f:
                ticks = int(f.read().rsplit(")", 1)[1].split()[19])
            return ticks / os.sysconf("SC_CLK_TCK")
    """})
    template = Template(handlers_dir=h.resolve(), env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
    runner = Runner(get_backend(tier), template, spare_jobs=3, spares=1, spare_after_full=True)

    def batch(n: int) -> list[float]:
        jobs = [Job(id=i + 1, kind="born", payload_json="{}", attempts=1, max_attempts=3, claim_token=uuid.uuid4())
                for i in range(n)]
        outcomes, fatal = runner.run(jobs, Slot())
        assert fatal is None and all(o.action == "done" for _, o in outcomes)
        return [json.loads(o.result_json or "null") for _, o in outcomes]

    try:
        batch(3)  # full: the next batch's sandbox starts as it is taken
        wait_for(lambda: _spare_waiting() or runner._spare.closed, timeout=SLOW[tier],
                 what="the next batch's sandbox, started ahead")
        if runner._spare.closed:  # as watch mode's: a non-root drainer whose jobs are its subordinate uids
            pytest.skip("no pipe into this drainer's jobs' workspaces: its batches run in file mode, no spares")
        seen = time.clock_gettime(time.CLOCK_BOOTTIME)
        assert all(born <= seen for born in batch(3))  # in the sandbox started ahead; starts the next
        wait_for(_spare_waiting, timeout=SLOW[tier], what="the next batch's sandbox, started ahead")
        seen = time.clock_gettime(time.CLOCK_BOOTTIME)
        assert all(born <= seen for born in batch(1))  # short: it starts none
        assert not _spare_waiting() and not runner._spare.starting
    finally:
        runner.close()
    assert not _spare_waiting()
    assert not private_workdir.exists() or not list(private_workdir.rglob("batch.in"))
