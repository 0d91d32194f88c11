"""What a bwrap or fork-server job's mount table (``/proc/self/mountinfo``) tells it of other jobs
and of its drainer (issue 25), for every drainer user: root, ``fleetless-ci`` (a subordinate uid
range) and ``fleetless-ci2`` (none; the fork server needs a range).

Two jobs run at once; the test reads each one's mount table from the host while both are alive
(``/proc/<pid>/mountinfo``, which any user may read: the jobs need no channel to each other).
Neither names another job's workspace, nor any workspace but its own (another drainer's capped
workspace on the host is not listed either); what names the host is the read-only binds of the
interpreter, ``/usr``, ``/etc`` and ``/handlers``, whose sources are the work directory's shared
``etc-shared-*`` (or ``etc-<drainer pid>-*``) and ``hs-<drainer pid>-*`` (docs/isolation.md says so).
"""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest

from fleetless import Queue
from fleetless.sandbox import _diskcap

from .drains import drain, handlers_dir, need_tier, shared, work_dir
from .test_process_seccomp import USERS, drainer_uid
from proctools import pids_with, wait_for

__all__ = ["shared"]  # the fixture, imported for the tests below

#: Becomes a process whose command line carries the marker, alive until the drain's timeout.
LINGER = """
import json, os, sys
marker = json.load(open(sys.argv[1]))["marker"]
os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(600)", marker])
"""

#: The paths a job's mount table may name under the work directory: the drain's read-only /etc
#: (``etc-shared-*``; a drainer without a range: ``etc-<drainer pid>-*``) and handlers snapshot
#: (``hs-<drainer pid>-*``), the same for every job of the drain.
SHARED_SNAPSHOTS = ("etc-", "hs-")


def _fields(line: str) -> tuple[str, str, str]:
    """(root, mount point, source) of a mountinfo line."""
    f = line.split()
    return f[3], f[4], f[f.index("-") + 2]


@pytest.mark.parametrize("tier", ["bwrap", "forkserver"])
@pytest.mark.parametrize("user", USERS)
def test_a_jobs_mount_table_names_no_other_jobs_workspace(
        user: str | None, tier: str, dsn: str, queue: Queue, sql: Any, shared: Path) -> None:
    """Two jobs at once, each mount table read while both run: neither names the other's workspace
    (no ``ws-`` path, no path under the work directory but the shared snapshots), the workspace
    tmpfs mounts are the job's own ``/workspace``, ``/tmp`` and ``/dev/shm``, and another drainer's
    capped workspace mounted on the host (a decoy, root only) is not there."""
    need_tier(tier)
    uid = drainer_uid(user)
    if tier == "forkserver" and user is not None and "ci2" in user:
        pytest.skip("the fork server needs a root drainer or a subordinate uid range")
    marker = f"fleetless-mounts-{uuid.uuid4().hex}"
    h = handlers_dir(shared, **{"linger.py": LINGER})
    work = work_dir(shared, uid)
    queue.enqueue_many([{"kind": "linger", "payload": {"marker": marker}, "max_attempts": 1}] * 2)
    decoy = shared / "another-drainers-ws"
    decoy.mkdir()
    if os.getuid() == 0:
        _diskcap.mount(decoy, 1 << 20, 16, 0, 0)
    d = drain(dsn, h, work, "--concurrency", "2", "--timeout", "20", tier=tier, user=uid, start=True)
    assert isinstance(d, subprocess.Popen)
    try:
        pids = wait_for(lambda: p if len(p := pids_with(marker)) == 2 else None, timeout=20,
                        what="two jobs running at once")
        tables = {pid: Path(f"/proc/{pid}/mountinfo").read_text().splitlines() for pid in pids}
        assert all(pid in pids_with(marker) for pid in pids)  # both still alive: read at once
        _, err = d.communicate(timeout=120)
    finally:
        if d.poll() is None:
            d.kill()
            d.wait()
        if os.getuid() == 0:
            _diskcap.release(decoy)
    assert d.returncode == 0, err
    assert [s for s, in sql("SELECT status FROM fleetless.jobs")] == ["dead", "dead"]  # (their timeout)
    for pid, lines in tables.items():
        fields = [_fields(line) for line in lines]
        named = [(root, point) for root, point, _ in fields]
        assert not [n for n in named if "/ws-" in n[0] + n[1] or str(decoy) in n[0] + n[1]], (pid, lines)
        under_work = [root for root, _ in named if root.startswith(str(work) + "/")]
        assert all(Path(r).relative_to(work).parts[0].startswith(SHARED_SNAPSHOTS) for r in under_work), \
            (pid, under_work)
        tmpfs = sorted(point for root, point, source in fields if source in ("fleetless-workspace", "workspace",
                                                                              "tmpfs")
                       and point not in ("/", "/dev"))
        assert tmpfs == ["/dev/shm", "/tmp", "/workspace"], (pid, lines)
