"""Per-job cgroups on this host's real cgroup filesystem (no mocks)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleetless.sandbox import cgroups

from proctools import alive

MiB = 1024 * 1024
CAPS = cgroups.available()
needs_cgroups = pytest.mark.skipif(not CAPS.any, reason=f"no writable cgroup here: {CAPS.reason}")

HYBRID_CGROUP = """\
9:name=systemd:/
8:pids:/
4:memory:/process_api/abc
1:cpu:/
0::/
"""
HYBRID_MOUNTINFO = """\
30 25 0:26 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
31 25 0:27 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
32 25 0:28 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
33 25 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
"""


def test_detect_hybrid_v1_layout_from_texts() -> None:
    layout = cgroups.detect(HYBRID_CGROUP, HYBRID_MOUNTINFO)
    assert layout.mode == "v1"
    assert layout.v1["memory"] == Path("/sys/fs/cgroup/memory/process_api/abc")  # nested: under our own
    assert layout.v1["pids"] == Path("/sys/fs/cgroup/pids")
    assert layout.v1["cpu"] == Path("/sys/fs/cgroup/cpu,cpuacct")
    assert layout.unified == Path("/sys/fs/cgroup/unified")


def test_detect_pure_v2_layout_from_texts() -> None:
    layout = cgroups.detect(
        "0::/system.slice/fleetless.service\n", "40 1 0:30 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"
    )
    assert layout.mode == "v2" and layout.v1 == {}
    assert layout.unified == Path("/sys/fs/cgroup/system.slice/fleetless.service")
    # a drainer already moved into its leaf creates job groups next to the leaf, not below it
    moved = cgroups.detect(
        "0::/system.slice/fleetless.service/fleetless-drainer-42\n",
        "40 1 0:30 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
    )
    assert moved.unified == Path("/sys/fs/cgroup/system.slice/fleetless.service")


def test_detect_with_a_cgroup_namespace_mount_root() -> None:
    layout = cgroups.detect(
        "4:memory:/docker/abc/job\n", "31 25 0:27 /docker/abc /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
    )
    assert layout.v1["memory"] == Path("/sys/fs/cgroup/memory/job")


def test_detect_this_host() -> None:
    layout = cgroups.detect()
    own = dict(line.split(":", 2)[1:] for line in Path("/proc/self/cgroup").read_text().splitlines())
    if layout.mode == "v1":
        for controller, path in layout.v1.items():
            key = next(k for k in own if controller in k.split(","))
            assert str(path).endswith(own[key].rstrip("/")) and path.is_dir()
    elif layout.mode == "v2":
        assert layout.unified is not None and layout.unified.is_dir()


@needs_cgroups
def test_create_limit_attach_kill_remove() -> None:
    cg = cgroups.JobCgroup(64 * MiB, 16, 0.5)
    try:
        assert cg.dirs and all(d.is_dir() for d in cg.dirs)
        assert all(d.name.startswith(f"fleetless-{os.getpid()}-") for d in cg.dirs)
        if CAPS.layout.mode == "v1":
            mem = CAPS.layout.v1["memory"] / cg.name
            assert (mem / "memory.limit_in_bytes").read_text().strip() == str(64 * MiB)
            assert (CAPS.layout.v1["pids"] / cg.name / "pids.max").read_text().strip() == "16"
            assert (CAPS.layout.v1["cpu"] / cg.name / "cpu.cfs_quota_us").read_text().strip() == "50000"
        # a process that double-forks a setsid daemon: both are in the groups, both die
        p = subprocess.Popen(
            ["/bin/sh", "-c", "setsid sleep 300 & sleep 300"], start_new_session=True, stdout=subprocess.DEVNULL
        )
        cg.attach(p.pid)
        time.sleep(0.05)
        p2 = subprocess.Popen(["/bin/sh", "-c", "sleep 300"])
        cg.attach(p2.pid)
        assert {p.pid, p2.pid} <= cg.pids()
        cg.kill()
        assert p.wait(5) == -signal.SIGKILL and p2.wait(5) == -signal.SIGKILL
    finally:
        assert cg.remove()
    assert not any(d.exists() for d in cg.dirs)


@needs_cgroups
def test_remove_kills_a_process_still_in_the_groups_then_removes_every_group() -> None:
    """``remove`` first tries the groups as if empty (the usual case, nothing to list): a group
    still holding a process refuses, and then what is in it is killed before every group goes."""
    cg = cgroups.JobCgroup(None, None, None)
    made = list(cg.dirs)
    p = subprocess.Popen(["sleep", "300"])
    try:
        cg.attach(p.pid)
        assert cg.remove()
        assert p.wait(5) == -signal.SIGKILL
        assert made and not any(d.exists() for d in made)
    finally:
        p.kill()
        p.wait()


@needs_cgroups
def test_children_inherit_and_all_die() -> None:
    cg = cgroups.JobCgroup(None, None, None)
    try:
        # a shell that joins the groups itself, then starts a setsid daemon
        files = " ".join(f"'{f}'" for f in cg.procs_files())
        p = subprocess.Popen(
            ["/bin/sh", "-c", f"for f in {files}; do echo 0 > $f; done; setsid sleep 300 & wait"],
            stdout=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 5
        while len(cg.pids()) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(cg.pids()) >= 2  # the shell and its setsid child
        cg.kill()
        p.wait(5)
        deadline = time.monotonic() + 5
        while cg.pids() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert cg.pids() == set()
    finally:
        assert cg.remove()


@needs_cgroups
@pytest.mark.skipif(not CAPS.pids, reason="no pids controller")
def test_pids_limit_is_detected() -> None:
    cg = cgroups.JobCgroup(None, 4, None)
    try:
        files = " ".join(f"'{f}'" for f in cg.procs_files())
        script = f"for f in {files}; do echo 0 > $f; done; for i in 1 2 3 4 5 6 7 8; do sleep 5 & done; kill 0"
        subprocess.run(["/bin/sh", "-c", script], capture_output=True, start_new_session=True)
        assert cg.pids_limit_hit()
    finally:
        assert cg.remove()


@needs_cgroups
@pytest.mark.skipif(not CAPS.memory, reason="no memory controller")
def test_oom_kill_is_detected() -> None:
    cg = cgroups.JobCgroup(32 * MiB, None, None)
    try:
        files = cg.procs_files()
        code = (
            "import sys\nfor f in sys.argv[1:]:\n    open(f, 'w').write('0')\n"
            "hog = [b'x' * (1 << 20) for _ in range(1024)]\n"
        )
        r = subprocess.run([sys.executable, "-c", code, *files], capture_output=True)
        assert r.returncode == -signal.SIGKILL
        assert cg.oom_killed()
    finally:
        assert cg.remove()


@needs_cgroups
@pytest.mark.parametrize("how", ["freezer", "signal"])
def test_fallback_kill_paths(how: str) -> None:
    if how == "freezer" and "freezer" not in CAPS.layout.v1 and CAPS.layout.mode == "v1":
        pytest.skip("no freezer hierarchy")
    cg = cgroups.JobCgroup(None, None, None, kill_via=how)
    try:
        files = " ".join(f"'{f}'" for f in cg.procs_files())
        p = subprocess.Popen(
            ["/bin/sh", "-c", f"for f in {files}; do echo 0 > $f; done; setsid sleep 300 & sleep 300"],
            stdout=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 5
        while len(cg.pids()) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        cg.kill()
        assert p.wait(5) == -signal.SIGKILL
        deadline = time.monotonic() + 5
        while cg.pids() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert cg.pids() == set()
    finally:
        assert cg.remove()


@needs_cgroups
def test_sweep_removes_groups_of_a_dead_drainer_and_kills_what_is_inside() -> None:
    src = str(Path(__file__).resolve().parents[2] / "src")
    code = f"""
import subprocess, sys, json
sys.path.insert(0, {src!r})
from fleetless.sandbox import cgroups
cg = cgroups.JobCgroup(64 << 20, 16, 1.0)
p = subprocess.Popen(["sleep", "300"], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
cg.attach(p.pid)
print(json.dumps({{"dirs": [str(d) for d in cg.dirs], "pid": p.pid}}), flush=True)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    info = json.loads(out.stdout)
    dirs = [Path(d) for d in info["dirs"]]
    orphan = int(info["pid"])
    assert all(d.exists() for d in dirs)  # the "drainer" exited without cleaning up
    assert cgroups.sweep() >= len(dirs)
    assert not any(d.exists() for d in dirs)
    deadline = time.monotonic() + 5
    while alive(orphan) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not alive(orphan)  # what was inside was killed


def test_enforced_caps_wording() -> None:
    caps = cgroups.enforced_caps()
    if os.getuid() == 0 and CAPS.memory:
        assert any(c.startswith("memory (cgroup v") for c in caps)
    for c in caps:
        assert c.split(" ")[0] in ("memory", "pids", "cpu", "tree")


def test_a_v2_job_gets_one_group_serving_every_controller_and_the_kill(tmp_path: Path) -> None:
    """Pure cgroup v2 cannot be mounted on these v1 hosts, so this runs the v2 half of the
    module against a directory standing in for the drainer's cgroup2 directory: the files it
    writes are the interface files the kernel would parse."""
    caps = cgroups.CgroupCaps(cgroups.Layout("v2", {}, tmp_path), memory=True, pids=True, cpu=True,
                              kill="cgroup.kill")
    cg = cgroups.JobCgroup(64 * MiB, 16, 0.5, caps=caps)
    assert cg.dirs == [tmp_path / cg.name] and cg.kill_via == "cgroup.kill"
    group = cg.dirs[0]
    assert {f.name: f.read_text() for f in group.iterdir()} == {
        "memory.swap.max": "0", "memory.oom.group": "1", "memory.max": str(64 * MiB),
        "pids.max": "16", "cpu.max": "50000 100000"}
    cg.set_limits(None, None, None)
    assert (group / "memory.max").read_text() == "max" and (group / "cpu.max").read_text() == "max 100000"
    assert (group / "pids.max").read_text() == "max"
