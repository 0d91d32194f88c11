"""A non-root drainer's bwrap jobs are its own uid on the host (no per-job uid without root): the
drain says so once, in one line, and ``fleetless doctor`` (the tier's description) says so too."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from fleetless import Queue

from .drains import NOBODY, drain, handlers_dir, need_tier, need_user, pythonpath_for_others, shared, work_dir
from proctools import leftovers

__all__ = ["shared"]  # the fixture, imported for the tests below

NOTICE = f"jobs run as the drainer's own uid {NOBODY} on the host"


def test_a_nonroot_bwrap_drain_says_once_that_jobs_share_its_uid(dsn: str, queue: Queue, sql: Any,
                                                                  shared: Path) -> None:
    need_tier("bwrap")
    need_user(NOBODY)
    h = handlers_dir(shared, **{"ok.py": "print('ok')"})
    work = work_dir(shared, NOBODY)
    queue.enqueue_many([{"kind": "ok", "payload": {}}] * 3)
    r = drain(dsn, h, work, tier="bwrap", user=NOBODY)
    assert r.returncode == 0, r.stderr
    assert sql("SELECT status, count(*) FROM fleetless.jobs GROUP BY 1") == [("done", 3)]
    notices = [line for line in r.stderr.splitlines() if NOTICE in line]
    assert len(notices) == 1, r.stderr
    assert leftovers(work) == []


def test_a_root_drain_does_not_say_it(dsn: str, queue: Queue, sql: Any, shared: Path) -> None:
    need_tier("bwrap")
    need_user(None)
    h = handlers_dir(shared, **{"ok.py": "print('ok')"})
    work = work_dir(shared, None)
    queue.enqueue("ok", {})
    r = drain(dsn, h, work, tier="bwrap")
    assert r.returncode == 0, r.stderr
    assert sql("SELECT status FROM fleetless.jobs") == [("done",)]
    assert "drainer's own uid" not in r.stderr


def test_doctor_describes_a_nonroot_drainers_jobs_as_its_own_uid() -> None:
    need_user(NOBODY)
    code = "from fleetless.sandbox.bwrap import BwrapSandbox; print(BwrapSandbox.describe())"
    r = subprocess.run(["/usr/bin/python3", "-c", code], capture_output=True, text=True, timeout=120, cwd="/",
                       env={"PYTHONPATH": ":".join(pythonpath_for_others()), "PATH": "/usr/bin:/bin"},
                       user=NOBODY, group=NOBODY, extra_groups=[])
    assert r.returncode == 0, r.stderr
    assert NOTICE in r.stdout, r.stdout
