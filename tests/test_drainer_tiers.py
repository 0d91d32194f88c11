"""The same drain, end to end, on the isolation tiers: the drainer is tier-agnostic, and each
tier keeps the handler contract (payload path, cwd, HOME, result, error, timeout)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleetless import Queue
from fleetless.drainer import DrainConfig, Drainer
from fleetless.sandbox import Limits

from proctools import pids_with, wait_for

TIERS = ["process", "bwrap", "microvm"]


@pytest.fixture(autouse=True)
def private_workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    work = tmp_path / "work"
    monkeypatch.setenv("FLEETLESS_WORKDIR", str(work))
    return work


@pytest.mark.parametrize("tier", TIERS)
def test_each_tier_runs_the_handler_contract(tier: str, queue: Queue, handlers, sql, require_tier,
                                             monkeypatch: pytest.MonkeyPatch, private_workdir: Path) -> None:
    require_tier(tier)
    monkeypatch.setenv("DATABASE_URL", "postgresql://secret@db/prod")
    h = handlers(**{"contract.py": """
        import json, os, sys
        p = json.load(open(sys.argv[1]))
        assert os.getcwd() == os.path.dirname(sys.argv[1]) == os.environ["HOME"]
        print(p["n"] * 2, " ".join(sorted(set(os.environ) - {"PWD"})))  # bwrap's --chdir sets PWD
    """, "fail.py": """
        import sys
        sys.stderr.write("bad input\\n")
        sys.exit(3)
    """, "hang.py": "import time; time.sleep(600)", "shell": """
        #!/bin/sh
        echo "shell saw $(cat "$1")"
    """})
    ok = queue.enqueue("contract", {"n": 21})
    failed = queue.enqueue("fail", {}, max_attempts=1)
    hung = queue.enqueue("hang", {}, max_attempts=1, timeout=2)
    shell = queue.enqueue("shell", {"x": 1})
    Drainer(queue, DrainConfig(handlers_dir=h, sandbox=tier, concurrency=2, timeout=60,
                               limits=Limits(memory_bytes=256 * 1024 * 1024))).run()
    rows = {r[0]: r[1:] for r in sql("SELECT id, status, result, last_error FROM fleetless.jobs")}
    tmpdir = " TMPDIR" if tier == "process" else ""  # (the process tier's jobs' TMPDIR is in their workspace)
    assert rows[ok] == ("done", "42 FLEETLESS_ATTEMPT FLEETLESS_JOB_ID FLEETLESS_KIND FLEETLESS_SNOOZES HOME LANG "
                        f"PATH{tmpdir}\n", None)
    assert rows[failed][0] == "dead" and rows[failed][2] == "exit code 3: bad input\nbad input"
    assert rows[hung][0] == "dead" and str(rows[hung][2]).startswith("killed: timeout after 2 s")
    assert rows[shell] == ("done", 'shell saw {"x": 1}\n', None)
    # every job's workspace is gone (bwrap keeps one /etc copy per drainer process, swept later)
    assert not private_workdir.exists() or list(private_workdir.glob("ws-*")) == []


def test_sigkill_of_a_bwrap_drainer_leaves_no_process_and_the_next_drain_sweeps_and_recovers(
        dsn: str, queue: Queue, handlers, sql, private_workdir: Path, require_tier) -> None:
    require_tier("bwrap")
    from fleetless.sandbox import cgroups

    h = handlers(**{"sleeper.py": """
        import os, sys, time
        if os.environ["FLEETLESS_ATTEMPT"] == "1":
            if os.fork() == 0:
                os.setsid()
                time.sleep(600)
            time.sleep(600)
        print("second attempt")
    """})
    queue.enqueue("sleeper", {}, timeout=3)
    env = {**os.environ, "DATABASE_URL": dsn, "FLEETLESS_WORKDIR": str(private_workdir)}
    proc = subprocess.Popen([sys.executable, "-m", "fleetless.cli", "drain", "--handlers", str(h),
                             "--sandbox", "bwrap", "--lease-grace", "3"], env=env)
    deadline = time.monotonic() + 30
    while len(pids_with("sleeper.py")) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(pids_with("sleeper.py")) >= 2
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while pids_with("sleeper.py") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pids_with("sleeper.py") == []
    # the next drain reaps the claim once its lease (timeout 3 s + grace 3 s) has run out
    wait_for(lambda: sql("SELECT lease_expires_at < now() FROM fleetless.jobs") == [(True,)], timeout=60,
             what="the killed drainer's lease to run out")
    again = subprocess.run([sys.executable, "-m", "fleetless.cli", "drain", "--handlers", str(h),
                            "--sandbox", "bwrap"], env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert sql("SELECT status, attempts, result FROM fleetless.jobs") == [("done", 2, "second attempt\n")]
    assert list(private_workdir.glob("ws-*")) == []
    layout = cgroups.detect()
    bases = [*layout.v1.values(), *([layout.unified] if layout.unified else [])]
    leftovers = [e for base in bases if base.is_dir() for e in base.iterdir()
                 if cgroups._owner_pid(e.name) == proc.pid]
    assert leftovers == []  # the next drain swept the dead drainer's cgroups


def test_sigkill_of_a_per_job_drainer_charges_only_the_job_it_was_running(
        dsn: str, queue: Queue, handlers, sql, private_workdir: Path) -> None:
    """guarantees.md: a kill costs at most the drainer's concurrency in attempts. A per-job drain
    holds no job it has not started (a job claimed ahead of a free slot, as 541b5f4 did for short
    jobs, was charged by the reaper though it never ran: dead at once with max_attempts 1)."""
    kind = f"slow{os.getpid()}x"
    h = handlers(**{"quick.py": "print('ok')", f"{kind}.py": "import time; time.sleep(600)"})
    first = [int(queue.enqueue("quick", {})) for _ in range(3)]
    slow = queue.enqueue(kind, {}, timeout=3)
    after = queue.enqueue("quick", {}, max_attempts=1)
    env = {**os.environ, "DATABASE_URL": dsn, "FLEETLESS_WORKDIR": str(private_workdir)}
    proc = subprocess.Popen([sys.executable, "-m", "fleetless.cli", "drain", "--handlers", str(h),
                             "--sandbox", "process", "--concurrency", "1", "--lease-grace", "3"], env=env,
                            stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: pids_with(f"{kind}.py"), timeout=60, what="the slow job to start")
        # A drain that claims ahead does so within a loop turn of starting the slow job: watch a
        # while for the job behind it to be claimed (it must not be), then kill the drainer.
        with pytest.raises(AssertionError):
            wait_for(lambda: sql("SELECT status FROM fleetless.jobs WHERE id = %s", after) != [("pending",)],
                     timeout=1.5, what="the job behind the slow one to stay pending")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    wait_for(lambda: not pids_with(f"{kind}.py"), timeout=30, what="the slow job's tree to end with its drainer")
    wait_for(lambda: sql("SELECT bool_and(lease_expires_at < now()) FROM fleetless.jobs WHERE status = 'running'")
             in ([(True,)], [(None,)]), timeout=60, what="the killed drainer's leases to run out")
    reaped = subprocess.run([sys.executable, "-m", "fleetless.cli", "reap"], env=env, capture_output=True,
                            text=True, timeout=60)
    assert reaped.returncode == 0, reaped.stderr
    rows = {r[0]: r[1:] for r in sql("SELECT id, status, attempts FROM fleetless.jobs")}
    assert [rows[j] for j in first] == [("done", 1)] * 3
    assert rows[slow] == ("pending", 1)  # the one job it was running: charged, due again
    assert rows[after] == ("pending", 0)  # never started: never charged
