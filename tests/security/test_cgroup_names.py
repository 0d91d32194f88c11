"""A job's ``/proc/self/cgroup`` names no cgroup of the host (issue 25: a job learns nothing of its
drainer or of other jobs), on every tier that runs on the host's kernel and for every drainer user:
root, ``fleetless-ci`` (a subordinate uid range) and ``fleetless-ci2`` (none; no fork server).

Each job gets a cgroup namespace rooted at its own cgroup (or at wherever it was started, where no
cgroup is made for it), so every line reads ``N:controllers:/``. Before, a root drainer's
process-tier and fork-server jobs read their cgroups' host paths, ``fleetless-<drainer pid>-…``
(the drainer's pid) under the host's own hierarchy (a container's ``/process_api/<id>``), and a
non-root drainer's process-tier and fork-server jobs that hierarchy; bwrap's jobs already had one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fleetless import Queue

from .drains import drain, handlers_dir, need_tier, shared, work_dir
from .test_process_seccomp import USERS, drainer_uid

__all__ = ["shared"]  # the fixture, imported for the tests below

CGROUP = """
import json
print(json.dumps(open("/proc/self/cgroup").read().splitlines()))
"""


@pytest.mark.parametrize("tier", ["process", "bwrap", "forkserver"])
@pytest.mark.parametrize("user", USERS)
def test_a_jobs_cgroup_file_names_no_host_cgroup(
        user: str | None, tier: str, dsn: str, queue: Queue, sql: Any, shared: Path) -> None:
    need_tier(tier)
    uid = drainer_uid(user)
    if tier == "forkserver" and user is not None and "ci2" in user:
        pytest.skip("the fork server needs a root drainer or a subordinate uid range")
    h = handlers_dir(shared, **{"cgroup.py": CGROUP})
    work = work_dir(shared, uid)
    queue.enqueue("cgroup", {}, max_attempts=1)
    r = drain(dsn, h, work, tier=tier, user=uid)
    assert r.returncode == 0, r.stderr
    [(status, result, error)] = sql("SELECT status, result, last_error FROM fleetless.jobs")
    assert status == "done", (error, r.stderr)
    lines = json.loads(result)
    assert lines and all(line.split(":", 2)[2] == "/" for line in lines), lines
