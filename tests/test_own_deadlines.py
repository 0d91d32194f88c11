"""Every sandbox enforces its job's deadline by itself, without the drainer: the process tier's
supervisor, bwrap's per-drainer watchdog (through the job's cgroups), the microVM's guest. A
drainer that is stopped (SIGSTOP here; a frozen VM or container alike) cannot make a job outlive
its lease, so no other drainer ever runs the same job concurrently (issue 14, item 6)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from fleetless import Queue

from proctools import alive, wait_for


def descendants_with(root: int, marker: str) -> list[int]:
    """Live descendants of ``root`` whose command line contains ``marker``."""
    parent: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            parent[int(name)] = int(stat[stat.rindex(b")") + 2 :].split()[1])
    found = []
    for pid in parent:
        p = pid
        while p in parent and p != root and p > 1:
            p = parent[p]
        if p != root or pid == root:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read() and alive(pid):
                    found.append(pid)
        except OSError:
            continue
    return found


@pytest.mark.parametrize("tier", ["process", "bwrap", "forkserver", "microvm"])
def test_a_job_dies_at_its_timeout_inside_its_lease_while_its_drainer_is_sigstopped(
        tier: str, require_tier, dsn: str, queue: Queue, handlers, sql, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    require_tier(tier)
    monkeypatch.setenv("FLEETLESS_WORKDIR", str(tmp_path / "work"))
    # microvm: a copy of the snapshot where one was built for 512 MiB (the default; a cold boot
    # otherwise). A stop before the copy got its job is bounded by the agent's own wait
    # (test_a_restored_copy_whose_job_never_comes_stops_by_itself).
    kind = f"stop-{uuid.uuid4().hex[:8]}"
    body = "import time\ntime.sleep(3600)\n"
    if tier == "forkserver":  # a forked job's command line is its server's: exec to show the kind
        body = f"import os, sys\nos.execv(sys.executable, [sys.executable, '-c', {body!r}, {kind!r}])\n"
    h = handlers(**{f"{kind}.py": body})
    job = queue.enqueue(kind, {}, max_attempts=1)
    drain = subprocess.Popen(
        [sys.executable, "-m", "fleetless.cli", "drain", "--handlers", str(h), "--sandbox", tier,
         "--timeout", "3", "--lease-grace", "20", "--concurrency", "1"],
        env={**os.environ, "DATABASE_URL": dsn}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    marker = "qemu-system" if tier == "microvm" else kind  # a VM's job is inside QEMU
    stopped = False
    try:
        # the process tier's supervisor names the handler too and waits for the drainer's go before
        # it forks the job: wait for both, so the drainer is stopped only once the job itself runs
        running = 2 if tier == "process" else 1
        wait_for(lambda: len(descendants_with(drain.pid, marker)) >= running, timeout=180,
                 what="the job's sandbox running")
        os.kill(drain.pid, signal.SIGSTOP)
        stopped = True
        ((left,),) = sql("SELECT extract(epoch FROM lease_expires_at - now())::float8 FROM fleetless.jobs"
                         " WHERE id = %s", job)
        wait_for(lambda: not descendants_with(drain.pid, marker), timeout=max(float(left), 1.0),  # type: ignore[arg-type]
                 what=f"the {tier} sandbox to kill its job by itself before the lease ends")
        # Still the same claim, still inside its lease: nobody else could have taken the job yet.
        assert sql("SELECT status, now() < lease_expires_at FROM fleetless.jobs WHERE id = %s", job) == [
            ("running", True)]
    finally:
        if stopped:
            os.kill(drain.pid, signal.SIGCONT)
        out, err = drain.communicate(timeout=300)
    assert drain.returncode == 0, err
    ((status, error),) = sql("SELECT status, last_error FROM fleetless.jobs WHERE id = %s", job)
    assert status == "dead" and str(error).startswith("killed"), (status, error, out, err)
