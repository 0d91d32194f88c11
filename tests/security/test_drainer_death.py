"""Issue 26 item 6: nothing may outlive a drain, also without cgroups. A drainer SIGKILLed in the
middle of a job (one job per sandbox, a batch, and a watcher's batch with its spare sandboxes
waiting) leaves none of its processes, on every tier, as root and as an unprivileged user (no
cgroup to kill): the process tier's supervisor (``PR_SET_PDEATHSIG``), bwrap and its child
(``--die-with-parent``), the fork server (its control socket's end) and its jobs' inits
(``PR_SET_PDEATHSIG``), the batch runners (their channel's or stdout's end), a microVM's QEMU
(``PR_SET_PDEATHSIG``). Hermetic: only the drainer's own descendants, recorded by pid and start
time just before the kill, are looked at."""

from __future__ import annotations

import os
import pwd
import signal
import subprocess
import uuid
from pathlib import Path

import pytest

from fleetless import Queue

from .drains import drain, handlers_dir, need_tier, shared, work_dir  # noqa: F401 (shared: a fixture)
from proctools import descendants, wait_for

TIERS = ["process", "bwrap", "forkserver", "microvm"]
#: A script handler: in batch mode too its job is a process of its own. It names itself (its comm),
#: as the fork server's jobs run their code without an exec of their own.
SLEEPER = """
    import ctypes, time
    ctypes.CDLL(None).prctl(15, b"fl-sleeper-job", 0, 0, 0)  # PR_SET_NAME
    time.sleep(300)
"""


def _started(pid: int) -> bytes | None:
    """The start time of a live ``pid`` (None once it is gone or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2:].split()
    return None if fields[0] in (b"Z", b"X") else fields[19]


def _running_job(pids: list[int], tier: str) -> bool:
    """Whether the job itself runs among ``pids`` (its handler on the host; a microVM's QEMU)."""
    want, where = (b"qemu-system", "cmdline") if tier == "microvm" else (b"fl-sleeper-job", "comm")
    for pid in pids:
        try:
            with open(f"/proc/{pid}/{where}", "rb") as f:
                if want in f.read():
                    return True
        except OSError:
            continue
    return False


def _runners(pids: list[int]) -> int:
    """How many batch runners run among ``pids`` (the job's own and the spares')."""
    n = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                n += b"_fleetless_batch.py" in f.read()
        except OSError:
            continue
    return n


def _users() -> list[object]:
    if os.getuid() != 0:  # as .ci/unprivileged runs it: the user running the tests
        return [pytest.param(None, id="self")]
    try:
        ci2 = pwd.getpwnam("fleetless-ci2").pw_uid
    except KeyError:
        ci2 = None
    return [pytest.param(None, id="root"),
            pytest.param(ci2, id="fleetless-ci2",
                         marks=pytest.mark.skipif(ci2 is None, reason="no user fleetless-ci2"))]


@pytest.mark.parametrize("mode", ["per-job", "batch", "batch-watch"])
@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("user", _users())
def test_a_sigkilled_drainer_mid_job_leaves_none_of_its_processes(
        dsn: str, queue: Queue, shared: Path, tier: str, mode: str, user: int | None) -> None:  # noqa: F811
    need_tier(tier)
    if tier == "microvm" and user is not None:
        pytest.skip("the microVM tier's image and accelerator are set up for root here")
    if tier == "forkserver" and user is not None:  # (a drainer as this user: need_tier said it)
        pytest.skip("fleetless-ci2 has no subordinate uid range: no fork server for it")
    if tier in ("microvm", "forkserver") and mode == "batch-watch":
        pytest.skip(f"a {tier} watcher starts no spare sandbox (its jobs' workspace is not the host's)")
    per_sandbox = 1 if mode == "per-job" else 3
    name = f"death-{uuid.uuid4().hex[:8]}"  # a queue of its own: a killed watcher keeps its row a lease long
    # a watcher keeps spare sandboxes, their runners waiting for a batch: they must die too
    extra = ["--watch", "--idle-exit=300s"] if mode == "batch-watch" else []
    h = handlers_dir(shared, **{"sleeper.py": SLEEPER})
    work = work_dir(shared, user)
    for _ in range(per_sandbox):
        queue.enqueue("sleeper", {}, timeout=600, queue=name)
    proc = drain(dsn, h, work, f"--per-sandbox={per_sandbox}", "--timeout=600", f"--queue={name}", *extra,
                 tier=tier, user=user, start=True)
    assert isinstance(proc, subprocess.Popen)
    try:
        started = wait_for(lambda: (_running_job(descendants(proc.pid), tier)
                                    and (not extra or _runners(descendants(proc.pid)) >= 2)) or proc.poll() is not None,
                           timeout=180, what="the job to run (and a watcher's spare sandbox to wait)")
        mine = {pid: _started(pid) for pid in descendants(proc.pid)}
    finally:
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    assert started is True and proc.returncode == -signal.SIGKILL, err[-2000:]

    def left() -> list[str]:
        out = []
        for pid, born in mine.items():
            if born is not None and _started(pid) == born:
                try:
                    out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120])
                except OSError:
                    continue
        return out

    try:
        wait_for(lambda: not left(), timeout=60, what="every process of the killed drainer to die")
    except AssertionError:
        raise AssertionError(f"left: {left()}\n{err[-2000:]}") from None
