"""Workspace cleanup that no workspace can turn against the host (issue 7, items 2, 3 and 5a).

Whatever a job leaves in its workspace (symlinks to host directories, a tree 1,500 levels deep,
0000 directories, read-only files), the drainer removes it without following a link, without
recursion, and without ever failing a drain; what it still cannot remove is moved aside into
``<work dir>/quarantine`` and reported once. Every symlink target is a directory the test made.
"""

from __future__ import annotations

import os
import stat
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from fleetless import Queue
from fleetless.sandbox import _workspace

from .drains import AS_ROOT_AND_NOT, drain, handlers_dir, need_tier, need_user, shared, work_dir
from proctools import leftovers

__all__ = ["shared"]  # the fixture, imported for the tests below

HOSTILE_TREE = """
    import os, sys
    target = sys.argv[1].rsplit("/", 1)[0] + "/payload.json"
    import json
    bait = json.load(open(sys.argv[1]))["bait"]
    os.symlink(bait, "evil-dir")
    os.symlink(bait + "/inside.txt", "evil-file")
    os.makedirs("locked/deeper")
    open("locked/deeper/ro.txt", "w").write("x")
    os.chmod("locked/deeper/ro.txt", 0o444)
    os.symlink(bait, "locked/deeper/evil-dir")
    os.chmod("locked/deeper", 0)
    os.chmod("locked", 0)
    print("left a hostile tree")
"""

DEEP_TREE = """
    import os
    for _ in range(1500):
        os.mkdir("d")
        os.chdir("d")
    open("bottom.txt", "w").write("x")
    print("deep")
"""


def bait_dir(base: Path) -> Path:
    """A directory of the test's own that a job's symlinks point at (mode 0755, one file)."""
    bait = base / "bait"
    bait.mkdir(mode=0o755)
    bait.chmod(0o755)
    (bait / "inside.txt").write_text("keep me")
    (bait / "inside.txt").chmod(0o644)
    return bait


def assert_untouched(bait: Path) -> None:
    assert stat.S_IMODE(bait.stat().st_mode) == 0o755, oct(bait.stat().st_mode)
    assert (bait / "inside.txt").read_text() == "keep me"
    assert stat.S_IMODE((bait / "inside.txt").stat().st_mode) == 0o644


def test_remove_never_follows_a_symlink_and_handles_0000_dirs_and_read_only_files(tmp_path: Path) -> None:
    bait = bait_dir(tmp_path)
    ws = tmp_path / "ws"
    (ws / "a" / "b").mkdir(parents=True)
    (ws / "a" / "b" / "ro").write_text("x")
    (ws / "a" / "b" / "ro").chmod(0o444)
    for link in (ws / "evil-dir", ws / "a" / "evil-dir", ws / "a" / "b" / "evil-dir"):
        link.symlink_to(bait)
    (ws / "evil-file").symlink_to(bait / "inside.txt")
    (ws / "a" / "b").chmod(0)
    (ws / "a").chmod(0)
    assert _workspace.remove(ws)
    assert not os.path.lexists(ws)
    assert_untouched(bait)


def test_remove_handles_any_depth_without_recursion(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    fd = os.open(ws, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(2500):  # past Python's recursion limit and PATH_MAX
            os.mkdir("d", dir_fd=fd)
            new = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = new
        os.close(fd)
        assert _workspace.remove(ws)
        assert not os.path.lexists(ws)
    finally:  # pytest's own clean-up of old temporary directories recurses
        subprocess.run(["rm", "-rf", str(ws)], check=False)


def test_what_cannot_be_removed_in_time_is_moved_aside_once(tmp_path: Path, monkeypatch: Any,
                                                            caplog: Any) -> None:
    monkeypatch.setenv("FLEETLESS_WORKDIR", str(tmp_path / "work"))
    ws = _workspace.create()
    (ws / "f").write_text("x")
    assert not _workspace.remove(ws, seconds=-1)
    assert not ws.exists() and (_workspace.quarantine_dir() / ws.name / "f").exists()
    assert [r.getMessage() for r in caplog.records] == [
        f"cannot remove {ws} (removal took too long); moved it to {_workspace.quarantine_dir() / ws.name}, "
        "for an operator to delete"]
    assert _workspace.sweep() == 0  # never swept (nor reported) again
    assert len(caplog.records) == 1


def test_two_sweeps_racing_over_the_same_dead_drainers_workspaces_both_succeed_and_leave_nothing(
        tmp_path: Path, monkeypatch: Any, caplog: Any) -> None:
    # A killed drainer's watchdog and the next drain's sweep remove the same workspaces at once
    # (the chaos suite once found an empty ``quarantine`` left behind by that race).
    monkeypatch.setenv("FLEETLESS_WORKDIR", str(tmp_path / "work"))
    gone = subprocess.Popen(["true"])
    gone.wait()
    for i in range(20):
        ws = _workspace.root() / f"ws-{gone.pid}-{i:03d}"
        for a in range(6):
            for b in range(6):
                (ws / f"a{a}" / f"b{b}" / "c").mkdir(parents=True)
                (ws / f"a{a}" / f"b{b}" / "c" / "f").write_text("x")
    barrier = threading.Barrier(4)
    outcomes: list[int] = []

    def sweep() -> None:
        barrier.wait()
        outcomes.append(_workspace.sweep())

    threads = [threading.Thread(target=sweep) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert list(_workspace.root().iterdir()) == []
    assert sum(outcomes) >= 20
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == []


def test_a_directory_another_remover_hoists_into_the_top_after_it_looked_empty_is_removed_too(
        tmp_path: Path, monkeypatch: Any, caplog: Any) -> None:
    # Two removers on one tree: one finds the top empty while the other is still moving a
    # subdirectory's own subdirectories up into it; the first one's rmdir then meets ENOTEMPTY
    # (it quarantined the tree, seen as a leftover quarantine after a SIGKILLed non-root drainer).
    monkeypatch.setenv("FLEETLESS_WORKDIR", str(tmp_path / "work"))
    ws = _workspace.create()
    (ws / "a" / "b").mkdir(parents=True)
    real_empty = _workspace._empty
    calls = []

    def empty_then_a_concurrent_hoist(top: int, deadline: float) -> None:
        real_empty(top, deadline)
        calls.append(top)
        if len(calls) == 1:
            os.mkdir(".fleetless-rm-other-1", dir_fd=top)  # what the other remover hoisted

    monkeypatch.setattr(_workspace, "_empty", empty_then_a_concurrent_hoist)
    assert _workspace.remove(ws)
    assert not ws.exists() and not _workspace.quarantine_dir().exists()
    assert len(calls) == 2
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == []


@pytest.mark.parametrize("tier", ["process", "bwrap"])
@pytest.mark.parametrize("user", AS_ROOT_AND_NOT)
def test_a_jobs_symlinks_to_host_dirs_are_removed_not_followed(
        tier: str, user: int | None, dsn: str, queue: Queue, sql: Any, shared: Path) -> None:
    need_user(user)
    need_tier(tier)
    bait = bait_dir(shared)
    h = handlers_dir(shared, **{"hostile.py": HOSTILE_TREE})
    work = work_dir(shared, user)
    queue.enqueue("hostile", {"bait": str(bait)})
    r = drain(dsn, h, work, "--concurrency", "1", tier=tier, user=user)
    assert r.returncode == 0, r.stderr
    assert sql("SELECT status, attempts, result FROM fleetless.jobs") == [("done", 1, "left a hostile tree\n")]
    assert_untouched(bait)
    assert leftovers(work) == []


@pytest.mark.parametrize("tier", ["process", "bwrap"])
def test_a_1500_deep_tree_is_removed_and_every_later_drain_still_works(
        tier: str, dsn: str, queue: Queue, sql: Any, shared: Path) -> None:
    need_tier(tier)
    h = handlers_dir(shared, **{"deep.py": DEEP_TREE, "ok.py": "print('ok')"})
    work = work_dir(shared, None)
    queue.enqueue("deep", {})
    r = drain(dsn, h, work, "--concurrency", "1", tier=tier)
    assert r.returncode == 0, r.stderr
    assert sql("SELECT kind, status, attempts FROM fleetless.jobs") == [("deep", "done", 1)]
    assert leftovers(work) == []
    queue.enqueue("ok", {})
    again = drain(dsn, h, work, tier=tier)
    assert again.returncode == 0, again.stderr
    assert sql("SELECT kind, status FROM fleetless.jobs ORDER BY id") == [("deep", "done"), ("ok", "done")]


def test_a_dead_drainers_workspace_that_cannot_be_removed_never_stops_a_drain(
        dsn: str, queue: Queue, sql: Any, shared: Path) -> None:
    """A leftover workspace holding an immutable file (unlink: EPERM, even for root) is moved aside
    by the first drain's sweep and reported once; later drains say nothing of it and run their jobs.
    (A mount point inside one no longer stops its removal: the sweep detaches it, as it does a
    workspace's own tmpfs, issue 25 item 8.)"""
    need_user(None)
    h = handlers_dir(shared, **{"ok.py": "print('ok')"})
    work = work_dir(shared, None)
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid whose process has ended: the leftover's "drainer" is dead
    stale = work / f"ws-{gone.pid}-stale"
    (stale / "mnt").mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "fleetless-test", str(stale / "mnt")],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    (stale / "stuck").write_text("")
    frozen = subprocess.run(["chattr", "+i", str(stale / "stuck")], capture_output=True, text=True)
    if frozen.returncode != 0:
        subprocess.run(["umount", str(stale / "mnt")], capture_output=True)
        pytest.skip(f"cannot make a file immutable here: {frozen.stderr.strip()}")
    moved = work / "quarantine" / stale.name
    try:
        queue.enqueue("ok", {})
        first = drain(dsn, h, work)
        assert first.returncode == 0, first.stderr
        assert first.stderr.count(str(stale)) == 1 and "moved it to" in first.stderr, first.stderr
        assert (moved / "stuck").exists() and not (moved / "mnt").is_mount() and not stale.exists()
        queue.enqueue("ok", {})
        second = drain(dsn, h, work)
        assert second.returncode == 0, second.stderr
        assert stale.name not in second.stderr
        assert sql("SELECT status, count(*) FROM fleetless.jobs GROUP BY 1") == [("done", 2)]
    finally:
        for path in (moved / "stuck", stale / "stuck"):
            subprocess.run(["chattr", "-i", str(path)], capture_output=True)
        for path in (moved / "mnt", stale / "mnt"):
            subprocess.run(["umount", str(path)], capture_output=True)


def test_a_nonroot_drainers_handler_snapshots_are_removed(dsn: str, queue: Queue, sql: Any, shared: Path) -> None:
    """The process tier's read-only handlers snapshots (``hs-*``, 0555) go with the drain."""
    need_user(65534)
    h = handlers_dir(shared, **{"ok.py": "print('ok')"})
    work = work_dir(shared, 65534)
    queue.enqueue_many([{"kind": "ok", "payload": {}}] * 3)
    r = drain(dsn, h, work, user=65534)
    assert r.returncode == 0, r.stderr
    assert sql("SELECT status, count(*) FROM fleetless.jobs GROUP BY 1") == [("done", 3)]
    assert leftovers(work) == []
