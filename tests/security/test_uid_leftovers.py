"""Nothing of a process-tier job outlives its uid's lease (issue 25, item 4): its temporary files
(a setuid copy of an interpreter in the host's /tmp), its kernel keys, its processes, wherever they
run. Each test runs a real ``fleetless drain`` as root (jobs as leased host uids) and as a non-root
user with a subordinate range (``fleetless-ci``: jobs as uids of that range), and reads the outcome
from the jobs table and the host.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest

from fleetless import Queue

from .drains import drain, handlers_dir, need_tier, open_to_jobs, shared, work_dir
from .test_subuid_jobs import subuid_user
from proctools import wait_for

__all__ = ["shared"]  # the fixture, imported for the tests below

DRAINERS = [pytest.param("root", id="root-drainer"), pytest.param("subuid", id="subuid-drainer")]

KEYS = """
    import ctypes, os, platform
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    KEYCTL = {"x86_64": 250, "aarch64": 219}[platform.machine()]
    ADD_KEY = {"x86_64": 248, "aarch64": 217}[platform.machine()]
    RINGS = {"session": -3, "user": -4, "user-session": -5}

    def add_key(desc, data, ring):
        r = libc.syscall(ctypes.c_long(ADD_KEY), b"user", desc.encode(), data.encode(), ctypes.c_long(len(data)),
                         ctypes.c_long(ring))
        return "added" if r >= 0 else os.strerror(ctypes.get_errno())

    def find_key(desc, ring):
        key = libc.syscall(ctypes.c_long(KEYCTL), ctypes.c_long(10), ctypes.c_long(ring), b"user", desc.encode(),
                           ctypes.c_long(0))  # KEYCTL_SEARCH
        if key < 0:
            return None
        buf = ctypes.create_string_buffer(256)
        n = libc.syscall(ctypes.c_long(KEYCTL), ctypes.c_long(11), ctypes.c_long(key), buf, ctypes.c_long(256))
        return buf.raw[:n].decode() if n >= 0 else "unreadable"
"""

#: The first job of the uid: a setuid copy of its interpreter in each shared temporary directory,
#: a key in each keyring it can reach.
LEAVE = KEYS + """
    import json, shutil, sys
    args = json.load(open(sys.argv[1]))
    out = {"nnp": [l.split()[1] for l in open("/proc/self/status") if l.startswith("NoNewPrivs:")][0]}
    for d in ("/tmp", "/var/tmp", "/dev/shm"):
        try:
            target = os.path.join(d, args["name"])
            shutil.copy(sys.executable, target)
            os.chmod(target, 0o4755)
            out[d] = "left"
        except OSError as exc:
            out[d] = type(exc).__name__
    for name, ring in RINGS.items():
        out[name] = add_key(args["name"], args["secret"], ring)
    open(os.path.join(args["seen"], f"uid-{args['n']}"), "w").close()  # (the host sees its uid)
    print(json.dumps(out))
"""

#: The next job of the same uid: what is left of the first.
LOOK = KEYS + """
    import json, sys
    args = json.load(open(sys.argv[1]))
    out = {d: os.path.exists(os.path.join(d, args["name"])) for d in ("/tmp", "/var/tmp", "/dev/shm")}
    out.update({name: find_key(args["name"], ring) for name, ring in RINGS.items()})
    open(os.path.join(args["seen"], f"uid-{args['n']}"), "w").close()
    print(json.dumps(out))
"""

#: Waits (bounded) for the test's ``go`` after leaving a marker the host sees the uid of.
WAIT = """
    import json, os, sys, time
    args = json.load(open(sys.argv[1]))
    open(os.path.join(args["seen"], "marker"), "w").close()
    give_up = time.monotonic() + 120
    while not os.path.exists(os.path.join(args["seen"], "go")) and time.monotonic() < give_up:
        time.sleep(0.02)
    print("went")
"""


def drainer(kind: str, shared: Path) -> tuple[int | None, dict[str, str], list[str]]:
    """(the user to drain as, its environment, extra drain flags): root with a one-uid job range of
    its own (so the two jobs share it), or the subordinate-range user."""
    need_tier("process")
    if kind == "root":
        if os.getuid() != 0:
            pytest.skip("the root-drainer case needs root")
        first = 2_000_200_000 + random.randrange(50_000)
        run = shared / "run"
        return None, {"FLEETLESS_RUN_DIR": str(run)}, ["--job-uids", f"{first}-{first}"]
    uid, _ = subuid_user()
    return uid, {"FLEETLESS_RUN_DIR": str(work_dir(shared, uid) / "run")}, []


@pytest.mark.parametrize("kind", DRAINERS)
def test_a_setuid_copy_and_keys_a_job_leaves_do_not_reach_the_next_job_of_its_uid(
        kind: str, dsn: str, queue: Queue, sql: Any, shared: Path) -> None:
    """Job 1 copies its interpreter setuid into /tmp, /var/tmp and /dev/shm and adds a key to its
    session, user and user-session keyrings (refused since the process tier's seccomp filter: EPERM);
    job 2, the next one (as root: on the same uid), finds
    none of it; the host's directories hold none of the copies; both ran with no_new_privs. Before,
    the copies stayed in the host's /tmp and the user keyring's key was read by job 2."""
    user, env, flags = drainer(kind, shared)
    h = handlers_dir(shared, **{"leave.py": LEAVE, "look.py": LOOK})
    work = work_dir(shared, user)
    seen = open_to_jobs(shared / "seen")
    name = f"fleetless-left-{uuid.uuid4().hex}"
    args = {"seen": str(seen), "name": name, "secret": uuid.uuid4().hex}
    first = queue.enqueue("leave", {**args, "n": 1}, max_attempts=1)
    r = drain(dsn, h, work, *flags, user=user, env=env)
    assert r.returncode == 0, r.stderr
    second = queue.enqueue("look", {**args, "n": 2}, max_attempts=1)
    r = drain(dsn, h, work, *flags, user=user, env=env)
    assert r.returncode == 0, r.stderr
    [(s1, r1)] = sql("SELECT status, result FROM fleetless.jobs WHERE id = %s", first)
    [(s2, r2)] = sql("SELECT status, result FROM fleetless.jobs WHERE id = %s", second)
    assert (s1, s2) == ("done", "done"), (r1, r2)
    left, found = json.loads(r1), json.loads(r2)
    assert left["nnp"] == "1", left
    assert left["/tmp"] == left["/var/tmp"] == "left", left  # (in its own tmpfs: gone with it)
    # the seccomp filter (69ec298) refuses keyrings outright: no key can be left; where a job could
    # add one (no filter here), the next job must still find none
    assert {left["user"], left["session"]} <= {"added", "Operation not permitted"}, left
    if kind == "root":  # one uid: the second job ran as the first one's
        assert (seen / "uid-1").stat().st_uid == (seen / "uid-2").stat().st_uid
    assert found == {"/tmp": False, "/var/tmp": False, "/dev/shm": False, "session": None, "user": None,
                     "user-session": None}, found
    for d in ("/tmp", "/var/tmp", "/dev/shm"):
        assert not os.path.exists(os.path.join(d, name)), d


@pytest.mark.parametrize("kind", DRAINERS)
def test_a_process_of_the_jobs_uid_outside_its_tree_is_dead_when_the_job_ends(
        kind: str, dsn: str, queue: Queue, sql: Any, shared: Path) -> None:
    """A process running as the job's uid outside the job's tree (as one would that ran a setuid
    copy the job left: here the test starts it) is killed when the job ends, before its uid's lease
    is released; the job is ``done``. Before, it went on running for the next job of that uid."""
    user, env, flags = drainer(kind, shared)
    h = handlers_dir(shared, **{"wait.py": WAIT})
    work = work_dir(shared, user)
    seen = open_to_jobs(shared / "seen")
    job = queue.enqueue("wait", {"seen": str(seen)}, max_attempts=1)
    proc = drain(dsn, h, work, *flags, user=user, env=env, start=True)
    assert isinstance(proc, subprocess.Popen)
    daemon: subprocess.Popen[bytes] | None = None
    try:
        wait_for(lambda: (seen / "marker").exists() or proc.poll() is not None, timeout=120, what="the job")
        assert proc.poll() is None, proc.communicate()
        uid = (seen / "marker").stat().st_uid
        assert uid != 0 and uid != (user or 0)
        daemon = subprocess.Popen(["sleep", "600"], user=uid, group=uid, extra_groups=[], cwd="/")
        (seen / "go").write_text("")
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
        wait_for(lambda: daemon is not None and daemon.poll() is not None, timeout=30,
                 what=f"the process of uid {uid} to die")
        assert daemon.returncode == -9
    finally:
        proc.kill()
        if daemon is not None and daemon.poll() is None:
            daemon.kill()
            daemon.wait()
    [(status, result)] = sql("SELECT status, result FROM fleetless.jobs WHERE id = %s", job)
    assert (status, result.strip()) == ("done", "went"), result
