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
        # only the job itself names the handler (the process tier's supervisor and its init take
        # their settings on a pipe: issue 25), so the drainer is stopped once the job runs
        wait_for(lambda: descendants_with(drain.pid, marker), timeout=180, what="the job's sandbox running")
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


#: A handle() that switches off everything the in-sandbox runner keeps it to its timeout with:
#: the faulthandler watchdog and the SIGALRM timer (issue 25, item 5).
HOSTILE = """import faulthandler, signal, time

def handle(payload):
    faulthandler.cancel_dump_traceback_later()
    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    signal.setitimer(signal.ITIMER_REAL, 0)
    if payload.get("hostile"):
        time.sleep(3600)
    return "ran"
"""


@pytest.mark.parametrize("tier,per_sandbox", [("process", 1), ("bwrap", 1), ("forkserver", 1), ("microvm", 1),
                                              ("process", 3), ("bwrap", 3), ("forkserver", 3)])
def test_a_handle_that_switches_off_its_own_timers_still_ends_at_its_timeout(
        tier: str, per_sandbox: int, require_tier, dsn: str, queue: Queue, handlers, sql, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The timeout is enforced from outside the job's processes: the tier's own deadline for one
    job, the drainer's pacer for a batch (whose later jobs go on in a fresh sandbox, uncharged)."""
    require_tier(tier)
    monkeypatch.setenv("FLEETLESS_WORKDIR", str(tmp_path / "work"))
    kind = f"hostile-{uuid.uuid4().hex[:8]}"
    h = handlers(**{f"{kind}.py": HOSTILE})
    hostile = queue.enqueue(kind, {"hostile": True}, max_attempts=1)
    innocent = [queue.enqueue(kind, {"n": n}, max_attempts=1) for n in range(per_sandbox - 1)]
    drain = subprocess.run(
        [sys.executable, "-m", "fleetless.cli", "drain", "--handlers", str(h), "--sandbox", tier,
         "--timeout", "3", "--ttl", "120", "--concurrency", "1", "--per-sandbox", str(per_sandbox)],
        env={**os.environ, "DATABASE_URL": dsn}, capture_output=True, text=True, timeout=400)
    assert drain.returncode == 0, drain.stderr
    ((status, error),) = sql("SELECT status, last_error FROM fleetless.jobs WHERE id = %s", hostile)
    assert status == "dead" and str(error).startswith("killed: timeout after 3 s"), (status, error, drain.stderr)
    for job in innocent:  # run after it in a fresh sandbox, charged one attempt only
        assert sql("SELECT status, attempts, result_json FROM fleetless.jobs WHERE id = %s", job) == [
            ("done", 1, "ran")], drain.stderr


def test_an_unprivileged_bwrap_drainers_job_dies_at_its_timeout_while_the_drainer_is_sigstopped(
        dsn: str, queue: Queue, sql, require_tier) -> None:
    """As above, the drainer a user with a subordinate range (``fleetless-ci``), which has no
    cgroup of its own to kill: its watchdog kills the job's bwrap by pid (issue 26, item 2)."""
    import shutil
    import tempfile

    from security.drains import drain, handlers_dir, work_dir
    from security.test_subuid_jobs import subuid_user

    require_tier("bwrap")
    uid, _ = subuid_user()
    base = Path(tempfile.mkdtemp(prefix="fleetless-stop-"))
    base.chmod(0o755)
    try:
        kind = f"stop-{uuid.uuid4().hex[:8]}"
        h = handlers_dir(base, **{f"{kind}.py": "import time\ntime.sleep(3600)\n"})
        job = queue.enqueue(kind, {}, max_attempts=1)
        proc = drain(dsn, h, work_dir(base, uid), "--timeout", "3", "--lease-grace", "20", "--concurrency", "1",
                     tier="bwrap", user=uid, start=True)
        assert isinstance(proc, subprocess.Popen)
        stopped = False
        try:
            wait_for(lambda: len(descendants_with(proc.pid, kind)) >= 1, timeout=180, what="the job running")
            os.kill(proc.pid, signal.SIGSTOP)
            stopped = True
            ((left,),) = sql("SELECT extract(epoch FROM lease_expires_at - now())::float8 FROM fleetless.jobs"
                             " WHERE id = %s", job)
            wait_for(lambda: not descendants_with(proc.pid, kind), timeout=max(float(left), 1.0),  # type: ignore[arg-type]
                     what="the watchdog to kill the job by itself before the lease ends")
            assert sql("SELECT status, now() < lease_expires_at FROM fleetless.jobs WHERE id = %s", job) == [
                ("running", True)]
        finally:
            if stopped:
                os.kill(proc.pid, signal.SIGCONT)
            out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        ((status, error),) = sql("SELECT status, last_error FROM fleetless.jobs WHERE id = %s", job)
        assert status == "dead" and str(error).startswith("killed"), (status, error, out, err)
    finally:
        shutil.rmtree(base, ignore_errors=True)
