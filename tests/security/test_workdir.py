"""The work directory cannot be squatted by another user (issue 25, item 3).

A drainer keeps its workspaces and the copies its sandboxes run from (the handlers snapshot, bwrap's
``/etc``) in its work directory. One another user made first, or could write or swap, would let that
user change what the drainer's jobs run. The default one is ``<tmp>/fleetless-<uid>-<random>``, found
again only if it is the drainer user's own and no one else may write it; a ``FLEETLESS_WORKDIR``
that fails that check is refused with one line before anything is claimed.

Each test runs a real ``fleetless drain`` with ``TMPDIR`` pointing at a sticky directory the test
made (its "/tmp"), and reads the outcome from the jobs table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fleetless import Queue

from .drains import NOBODY, drain, handlers_dir, need_tier, need_user, primary_gid, pythonpath_for_others, shared

__all__ = ["shared"]  # the fixture, imported for the tests below

ECHO = """
    import json, sys
    print(json.load(open(sys.argv[1]))["n"])
"""


def sticky_tmp(base: Path) -> Path:
    """A directory like /tmp: everyone may create in it, only an entry's owner may remove it."""
    tmp = base / "tmp"
    tmp.mkdir()
    tmp.chmod(0o1777)
    return tmp


def default_drain(dsn: str, handlers: Path, tmp: Path, *args: str, tier: str = "process",
                  user: int | None = None) -> subprocess.CompletedProcess[str]:
    """``fleetless drain`` with no FLEETLESS_WORKDIR: the default work directory, under ``tmp``."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "DATABASE_URL": dsn, "TMPDIR": str(tmp)}
    python = sys.executable
    path = [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
    if user is not None:
        python = "/usr/bin/python3"
        path += pythonpath_for_others()
    if path:
        env["PYTHONPATH"] = ":".join(path)
    creds: dict[str, object] = {} if user is None else {"user": user, "group": primary_gid(user), "extra_groups": []}
    return subprocess.run(  # type: ignore[call-overload, no-any-return]
        [python, "-m", "fleetless.cli", "drain", "--handlers", str(handlers), "--sandbox", tier, *args],
        env=env, text=True, capture_output=True, timeout=180, cwd=str(tmp.parent), **creds)


JOBS = "SELECT status, attempts, result FROM fleetless.jobs ORDER BY id"


@pytest.mark.parametrize("how", ["symlink", "symlinked-parent", "other-owner", "mode-0777", "file"])
def test_a_work_directory_others_could_swap_or_write_is_refused_before_any_claim(
        queue: Queue, dsn: str, sql: Any, shared: Path, how: str) -> None:
    """FLEETLESS_WORKDIR must be a real directory (no symlink at any step) of the drainer's user that
    no one else may write: else the drain stops with one line and claims nothing."""
    need_user(None)
    h = handlers_dir(shared, **{"echo.py": ECHO})
    planted = shared / "planted"
    planted.mkdir(mode=0o777)
    planted.chmod(0o777)
    os.chown(planted, NOBODY, primary_gid(NOBODY))
    work = shared / "work"
    if how == "symlink":
        work.symlink_to(planted)
    elif how == "symlinked-parent":
        (shared / "link").symlink_to(planted)
        work = shared / "link" / "work"
    elif how == "other-owner":
        work.mkdir(mode=0o711)
        os.chown(work, NOBODY, primary_gid(NOBODY))
    elif how == "mode-0777":
        work.mkdir()
        work.chmod(0o777)
    else:
        work.write_text("")
    queue.enqueue("echo", {"n": 1})
    r = drain(dsn, h, work)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot use the sandbox work directory: refusing" in lines[0], r.stderr
    assert sql(JOBS) == [("pending", 0, None)]
    assert list(planted.iterdir()) == []  # nothing of the drain went where the link pointed


@pytest.mark.parametrize("tier", ["process", "bwrap"])
def test_the_default_work_directory_is_never_one_another_user_made_first(
        queue: Queue, dsn: str, sql: Any, shared: Path, tier: str) -> None:
    """Names another user made first in the tmp dir (the old predictable ``fleetless-<uid>``, and
    ``fleetless-<uid>-*`` ones: a symlink, a directory of theirs, one anyone may write) are never
    used: the drain makes a directory of its own, 0711, and its jobs run."""
    need_user(None)
    need_tier(tier)
    h = handlers_dir(shared, **{"echo.py": ECHO})
    tmp = sticky_tmp(shared)
    planted = shared / "planted"
    planted.mkdir(mode=0o777)
    planted.chmod(0o777)
    os.chown(planted, NOBODY, primary_gid(NOBODY))
    uid = os.geteuid()
    squats = [tmp / f"fleetless-{uid}", tmp / f"fleetless-{uid}-!link", tmp / f"fleetless-{uid}-!theirs",
              tmp / f"fleetless-{uid}-!open"]
    squats[0].symlink_to(planted)
    squats[1].symlink_to(planted)
    squats[2].mkdir(mode=0o711)
    os.chown(squats[2], NOBODY, primary_gid(NOBODY))
    squats[3].mkdir()
    squats[3].chmod(0o777)
    queue.enqueue_many([("echo", {"n": n}) for n in range(3)])
    r = default_drain(dsn, h, tmp, tier=tier)
    assert r.returncode == 0, r.stderr
    assert [(s, a) for s, a, _ in sql(JOBS)] == [("done", 1)] * 3
    assert list(planted.iterdir()) == [] and list(squats[2].iterdir()) == [] and list(squats[3].iterdir()) == []
    own = [p for p in tmp.iterdir() if p.name.startswith(f"fleetless-{uid}-") and p not in squats]
    assert len(own) == 1, own
    st = own[0].lstat()
    assert own[0].is_dir() and not own[0].is_symlink() and st.st_uid == uid and st.st_mode & 0o777 == 0o711

    queue.enqueue("echo", {"n": 9})  # the next drain finds the same directory again
    r = default_drain(dsn, h, tmp, tier=tier)
    assert r.returncode == 0, r.stderr
    assert [p for p in tmp.iterdir() if p.name.startswith(f"fleetless-{uid}-") and p not in squats] == own


SQUAT = """
    import json, os, sys
    args = json.load(open(sys.argv[1]))
    made = []
    for uid in args["uids"]:  # the default names of every user, old and new style
        for name in (f"fleetless-{uid}", f"fleetless-{uid}-!squat", f"fleetless-run-{uid}-!squat"):
            path = os.path.join(args["tmp"], name)
            try:
                os.mkdir(path)
                os.chmod(path, 0o777)
                os.mkdir(os.path.join(path, "job-uids"), 0o777)
                made.append(name)
            except OSError as exc:
                made.append(f"{name}: {type(exc).__name__}")
    work = os.path.dirname(os.getcwd())  # whatever it can reach of its own drainer's work directory
    try:
        os.mkdir(os.path.join(work, "hs-1-planted"))
        made.append("hs-1-planted")
    except OSError as exc:
        made.append(f"hs-1-planted: {type(exc).__name__}")
    print(json.dumps(made))
"""


def test_a_process_tier_job_cannot_squat_another_users_next_drain(queue: Queue, dsn: str, sql: Any,
                                                                  shared: Path) -> None:
    """A root drainer's job (a leased uid) makes the default names of every user in the tmp dir,
    mode 0777; the next drain of user 65534 does not use them (they are not its own): its
    workspaces and handlers snapshot go to a directory only it can write, and its job is done."""
    need_user(NOBODY)
    h = handlers_dir(shared, **{"squat.py": SQUAT, "echo.py": ECHO})
    tmp = sticky_tmp(shared)
    queue.enqueue("squat", {"tmp": str(tmp), "uids": [0, NOBODY]})
    r = default_drain(dsn, h, tmp)
    assert r.returncode == 0, r.stderr
    [(status, _, result)] = sql(JOBS)
    assert status == "done", r.stderr
    made = json.loads(str(result)) if not isinstance(result, list) else result
    assert f"fleetless-{NOBODY}-!squat" in made  # it could make the names (tmp is everyone's)
    assert "hs-1-planted" not in made  # but nothing in its own drainer's work directory

    queue.enqueue("echo", {"n": 7})
    r = default_drain(dsn, h, tmp, user=NOBODY)
    assert r.returncode == 0, r.stderr
    assert [(s, a) for s, a, _ in sql(JOBS)][1] == ("done", 1)
    for name in (f"fleetless-{NOBODY}", f"fleetless-{NOBODY}-!squat"):
        assert sorted(p.name for p in (tmp / name).iterdir()) == ["job-uids"], name  # never used
    assert list((tmp / f"fleetless-run-{NOBODY}-!squat" / "job-uids").iterdir()) == []
    own = [p for p in tmp.iterdir() if p.name.startswith(f"fleetless-{NOBODY}-") and "!" not in p.name]
    assert len(own) == 1 and own[0].lstat().st_uid == NOBODY and own[0].lstat().st_mode & 0o022 == 0


def test_a_volume_mounted_for_everyone_gets_a_private_directory_of_the_drainer_inside(
        queue: Queue, dsn: str, sql: Any, shared: Path) -> None:
    """A Kubernetes ``emptyDir`` is a mount point, root's, mode 0777: as FLEETLESS_WORKDIR it is not
    refused but used as /tmp is, through a private ``fleetless-<uid>-<random>`` of the drainer inside."""
    need_user(NOBODY)
    h = handlers_dir(shared, **{"echo.py": ECHO})
    vol = shared / "vol"
    vol.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0777,size=64m", "fleetless-test-vol", str(vol)], check=True)
    try:
        queue.enqueue("echo", {"n": 5})
        r = drain(dsn, h, vol, user=NOBODY)
        assert r.returncode == 0, r.stderr
        assert [(s, a) for s, a, _ in sql(JOBS)] == [("done", 1)]
        own = [p for p in vol.iterdir() if p.name.startswith(f"fleetless-{NOBODY}-")]
        assert len(own) == 1 and own[0].lstat().st_uid == NOBODY and own[0].lstat().st_mode & 0o022 == 0, own
    finally:
        subprocess.run(["umount", "-l", str(vol)], check=False)
