"""A job's environment is exactly what docs/isolation.md's tables say, on every tier (microvm: a
root drainer's) and for every drainer user (root, ``fleetless-ci`` with a subordinate uid range,
``fleetless-ci2`` without; no fork server for that one): the drain's ``PATH`` and ``LANG``, what
``--pass-env`` passed, the job's own ``FLEETLESS_*`` variables and ``HOME`` (its workspace), and
per tier ``TMPDIR`` (process: in its workspace) or ``PWD`` (bwrap sets it for its ``--chdir``).
Nothing else of the drainer's environment (a secret in it here) reaches the job.
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

ENVIRON = """
import json, os
print(json.dumps({"env": dict(os.environ), "cwd": os.getcwd()}))
"""

#: What each tier adds to every job's environment (beyond the drain's and the job's own).
PER_TIER = {"process": {"TMPDIR"}, "bwrap": {"PWD"}, "forkserver": set(), "microvm": set()}


@pytest.mark.parametrize("tier", ["process", "bwrap", "forkserver", pytest.param("microvm", marks=pytest.mark.slow)])
@pytest.mark.parametrize("user", USERS)
def test_a_jobs_environment_is_the_drains_its_own_and_its_home(
        user: str | None, tier: str, dsn: str, queue: Queue, sql: Any, shared: Path) -> None:
    need_tier(tier)
    uid = drainer_uid(user)
    if tier == "forkserver" and user is not None and "ci2" in user:
        pytest.skip("the fork server needs a root drainer or a subordinate uid range")
    if tier == "microvm" and user is not None:
        pytest.skip("the guest image is built for the root drainer here")
    h = handlers_dir(shared, **{"environ.py": ENVIRON})
    work = work_dir(shared, uid)
    job = queue.enqueue("environ", {}, max_attempts=1)
    r = drain(dsn, h, work, "--pass-env", "PASSED=yes", tier=tier, user=uid,
              env={"FLEETLESS_TEST_SECRET": "do-not-leak"})
    assert r.returncode == 0, r.stderr
    [(status, result, error)] = sql("SELECT status, result, last_error FROM fleetless.jobs")
    assert status == "done", (error, r.stderr)
    out = json.loads(result)
    env, cwd = out["env"], out["cwd"]
    assert set(env) == {"PATH", "LANG", "PASSED", "HOME", "FLEETLESS_JOB_ID", "FLEETLESS_KIND",
                        "FLEETLESS_ATTEMPT", "FLEETLESS_SNOOZES", *PER_TIER[tier]}, env
    assert (env["PASSED"], env["FLEETLESS_JOB_ID"], env["FLEETLESS_KIND"]) == ("yes", str(job), "environ"), env
    assert env["HOME"] == cwd and (cwd == "/workspace") == (tier != "process"), (env, cwd)
    if tier == "process":
        assert env["TMPDIR"] == f"{cwd}/.tmp", env
    if tier == "bwrap":
        assert env["PWD"] == "/workspace", env
    assert "do-not-leak" not in json.dumps(out), out
