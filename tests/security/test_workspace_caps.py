"""A job's workspace is capped in bytes and files where the drainer can mount a tmpfs for it (issue
25, item 8): a root drainer's process and bwrap jobs. Before, a job created 150,000 files (or
filled the disk) in its workspace on the work directory's disk. Each test runs a real
``fleetless drain`` and reads the outcome from the jobs table and the host's work directory.
"""

from __future__ import annotations

import os
import pwd
import subprocess
from pathlib import Path
from typing import Any

import pytest

from fleetless import Queue
from fleetless.sandbox import Limits, _subuid, get_backend

from .drains import drain, handlers_dir, need_tier, shared, work_dir
from proctools import leftovers

__all__ = ["shared"]  # the fixture, imported for the tests below

#: 150,000 files in the workspace (its cwd), one at a time: how many it made, and why it stopped.
MANY_FILES = """
    import os
    made = 0
    try:
        os.mkdir("many")
        for made in range(150_000):
            open(f"many/{made}", "w").close()
        made = 150_000
    except OSError as exc:
        print(f"made {made} files: {exc.strerror}")
        raise SystemExit(1)
    print(f"made {made} files")
"""

#: What a normal job does: a few hundred files and 8 MiB.
NORMAL = """
    import os
    os.mkdir("out")
    for i in range(300):
        open(f"out/{i}", "w").write("x" * 100)
    open("big", "wb").write(b"y" * (8 << 20))
    print("normal", len(os.listdir("out")), os.path.getsize("big"))
"""


def root_only_venv(base: Path) -> str:
    """A virtual environment (of /usr/bin/python3, readable by all) in a directory only root may
    search (mode 0700, as ``/root``): the usual root install. Its python."""
    private = base / "root-only"
    private.mkdir(mode=0o700)
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(private / "venv")], check=True)
    subprocess.run(["chmod", "-R", "a+rX", str(private / "venv")], check=True)
    private.chmod(0o700)
    return str(private / "venv" / "bin" / "python")


@pytest.mark.parametrize("tier", ["process", "bwrap", "forkserver", "bwrap-root-only-venv"])
def test_a_job_making_150000_files_gets_enospc_in_its_own_tmpfs_and_a_normal_job_is_unaffected(
        tier: str, dsn: str, queue: Queue, sql: Any, shared: Path) -> None:
    """Root drainer (forkserver: its workspace always was a tmpfs, now with ``nr_inodes`` too): the
    job stops at ``Limits.inodes`` (16,384) files with ``No space left on
    device`` and is charged (dead after its one attempt); nothing of it was ever in the work
    directory on the host's disk, which is empty afterwards; a normal job (300 files, 8 MiB) in
    the same drain is done. The drain's caps say the workspace is capped. bwrap also with the
    handlers' interpreter in a venv under a directory the job uids cannot search (its launcher binds
    it back in a mount namespace of its own): before, that namespace was made before the workspace's
    tmpfs and did not see it, and the job made all 150,000 files on the disk."""
    venv = tier == "bwrap-root-only-venv"
    tier = "bwrap" if venv else tier
    need_tier(tier)
    if os.getuid() != 0:
        pytest.skip("only a root drainer mounts a tmpfs per workspace")
    # /usr/bin/python3: every uid reaches it, so a bwrap launcher needs no mount namespace of its own
    python = root_only_venv(shared) if venv else "/usr/bin/python3"
    h = handlers_dir(shared, **{"many.py": MANY_FILES, "normal.py": NORMAL})
    work = work_dir(shared, None)
    many = queue.enqueue("many", {}, max_attempts=1)
    normal = queue.enqueue("normal", {}, max_attempts=1)
    r = drain(dsn, h, work, "-v", "--python", python, tier=tier)
    assert r.returncode == 0, r.stderr
    [(status, result, error)] = sql("SELECT status, result, last_error FROM fleetless.jobs WHERE id = %s", many)
    assert status == "dead", (status, result, error)
    said = f"{result} {error}"
    assert "No space left on device" in said, said
    made = int(said.split("made ", 1)[1].split()[0])
    assert 16_000 < made < Limits().inodes, said
    [(status, result)] = sql("SELECT status, result FROM fleetless.jobs WHERE id = %s", normal)
    assert (status, result) == ("done", f"normal 300 {8 << 20}\n"), result
    assert leftovers(work) == [] and not (work / "quarantine").exists()
    if tier == "forkserver":  # its workspace was a tmpfs of its own already: now with an inode cap
        assert "(workspace 512 MiB and 16384 files)" in r.stderr, r.stderr
    else:
        assert "disk capped by a tmpfs workspace of 512 MiB and 16384 files" in r.stderr, r.stderr


#: (user, whether CI gives it a subordinate uid range)
USERS = [pytest.param(os.environ.get("FLEETLESS_TEST_SUBUID_USER", "fleetless-ci"), True, id="subuid-range"),
         pytest.param(os.environ.get("FLEETLESS_TEST_PLAIN_USER", "fleetless-ci2"), False, id="no-range")]


def drainer_uid(user: str) -> int | None:
    """The uid to start the drain as (None: the test's own, when it runs as ``user``), else skip."""
    try:
        uid = pwd.getpwnam(user).pw_uid
    except KeyError:
        pytest.skip(f"no user {user} (.ci/run makes it)")
    if os.getuid() == uid:
        return None
    if os.getuid() != 0:
        pytest.skip(f"needs root, or to run as {user}")
    return uid


@pytest.mark.parametrize(("user", "ranged"), USERS)
@pytest.mark.parametrize("tier", ["process", "bwrap"])
def test_an_unprivileged_drainers_job_making_150000_files_gets_enospc_in_a_tmpfs_of_its_holder(
        tier: str, user: str, ranged: bool, dsn: str, queue: Queue, sql: Any, shared: Path) -> None:
    """A non-root drainer with a subordinate uid range caps its workspaces too, on a tmpfs in its
    holder's mount namespace (``_subuid.Holder.cap``), and so does its bwrap tier without a range
    (a mount holder mapping only its uid, ``_subuid.mount_holder``): the job stops at 16,384 files
    with ``No space left on device``, charged; the normal job beside it is done; the work directory
    is empty afterwards. Before, it made all 150,000 files on the work directory's disk. The
    process tier without a range says the disk is NOT capped (and the job makes them all)."""
    need_tier(tier)
    uid = drainer_uid(user)
    h = handlers_dir(shared, **{"many.py": MANY_FILES, "normal.py": NORMAL})
    work = work_dir(shared, uid)
    many = queue.enqueue("many", {}, max_attempts=1)
    normal = queue.enqueue("normal", {}, max_attempts=1)
    r = drain(dsn, h, work, "-v", tier=tier, user=uid)
    assert r.returncode == 0, r.stderr
    [(status, result, error)] = sql("SELECT status, result, last_error FROM fleetless.jobs WHERE id = %s", many)
    said = f"{result} {error}"
    [(nstatus, nresult)] = sql("SELECT status, result FROM fleetless.jobs WHERE id = %s", normal)
    assert (nstatus, nresult) == ("done", f"normal 300 {8 << 20}\n"), (nresult, r.stderr)
    if ranged or tier == "bwrap":
        assert status == "dead" and "No space left on device" in said, (status, said, r.stderr)
        made = int(said.split("made ", 1)[1].split()[0])
        assert 16_000 < made < Limits().inodes, said
        assert "disk capped by a tmpfs workspace of 512 MiB and 16384 files" in r.stderr, r.stderr
    else:
        assert status == "done" and "made 150000 files" in said, (status, said)
        assert "disk NOT capped: workspaces are on the work directory's disk" in r.stderr, r.stderr
    assert leftovers(work) == [] and not (work / "quarantine").exists()


def test_caps_say_where_workspaces_are_not_capped() -> None:
    """A drainer that cannot mount (process tier: non-root without a subordinate range) says so in
    its caps (``fleetless doctor``, the drain's first lines); a root one, one with a range, and
    bwrap's, name the tmpfs's size and files."""
    for tier in ("process", "bwrap"):
        disk = get_backend(tier).caps(Limits())["disk"]
        if os.getuid() == 0 or _subuid.delegation() is not None or tier == "bwrap":
            assert disk.startswith("capped by a tmpfs workspace of 512 MiB and 16384 files"), disk
        else:
            assert disk.startswith("NOT capped: workspaces are on the work directory's disk"), disk
