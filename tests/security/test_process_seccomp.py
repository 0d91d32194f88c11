"""A process-tier job gets the seccomp filter of bwrap and the fork server (issue 25, second round)
and does not see other jobs' workspaces in its mount table, for every drainer user: root (jobs as
leased uids), ``fleetless-ci`` (a subordinate uid range: jobs as uids of it) and ``fleetless-ci2``
(no range: jobs as the drainer's own uid, in a user namespace its supervisor makes).

Before, a process-tier job ran with ``Seccomp: 0``: it could make user namespaces of its own
(``unshare -Ur``, where it holds every capability over what it makes there) and reach the kernel's
keyrings, ``bpf``, ``io_uring`` and the rest of what the filter denies; and its
``/proc/self/mountinfo`` listed the other running jobs' workspace tmpfs mounts.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
from pathlib import Path
from typing import Any

import pytest

from fleetless import Queue
from fleetless.sandbox import _diskcap

from .drains import drain, handlers_dir, need_tier, need_user, open_to_jobs, shared, work_dir

__all__ = ["shared"]  # the fixture, imported for the tests below

USERS = [pytest.param(None, id="root-drainer"),
         pytest.param(os.environ.get("FLEETLESS_TEST_SUBUID_USER", "fleetless-ci"), id="subuid-range"),
         pytest.param(os.environ.get("FLEETLESS_TEST_PLAIN_USER", "fleetless-ci2"), id="no-range")]


def drainer_uid(user: str | None) -> int | None:
    """The uid to start the drain as (None: the test's own: root's, or ``user``'s where the tests
    run as it, as ``.ci/unprivileged`` runs them), else skip."""
    if user is None:
        need_user(None)
        return None
    try:
        uid = pwd.getpwnam(user).pw_uid
    except KeyError:
        if os.environ.get("FLEETLESS_REQUIRE_TIERS") and os.getuid() == 0:
            pytest.fail(f"no user {user} (.ci/run makes it)")
        pytest.skip(f"no user {user} (.ci/run makes it)")
    if os.getuid() == uid:
        return None
    if os.getuid() != 0:
        pytest.skip(f"needs root, or to run as {user}")
    return uid


#: What the kernel lets the job do: its seccomp mode, no_new_privs, new namespaces, keyrings; and
#: whether ordinary work (fork, threads, subprocess) still runs.
PROBE = """
import ctypes, errno, json, os, platform, subprocess, threading

status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
out = {"seccomp": status["Seccomp"].strip(), "nnp": status["NoNewPrivs"].strip()}
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

def err(call):
    try:
        call()
        return "ok"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))

def c_unshare(flags):
    if libc.unshare(ctypes.c_int(flags)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
out["os_unshare"] = err(lambda: (getattr(os, "unshare", None) or c_unshare)(CLONE_NEWUSER))
out["c_unshare_net"] = err(lambda: c_unshare(CLONE_NEWUSER | CLONE_NEWNET))
r = subprocess.run(["unshare", "-Ur", "true"], capture_output=True, text=True)
out["unshare_cli"] = [r.returncode, r.stderr.strip()[-80:]]
r = subprocess.run(["unshare", "-Urn", "true"], capture_output=True, text=True)
out["unshare_urn"] = r.returncode
ADD_KEY, KEYCTL = {"x86_64": (248, 250), "aarch64": (217, 219)}[platform.machine()]

def syscall(number, *args):
    r = libc.syscall(ctypes.c_long(number), *args)
    if r < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))

out["keyctl"] = err(lambda: syscall(KEYCTL, ctypes.c_long(0), ctypes.c_long(-3), ctypes.c_long(0)))
out["add_key"] = err(lambda: syscall(ADD_KEY, ctypes.c_char_p(b"user"), ctypes.c_char_p(b"fleetless-probe"),
                                     ctypes.c_char_p(b"v"), ctypes.c_size_t(1), ctypes.c_long(-3)))
out["memfd_secret"] = err(lambda: syscall(447, ctypes.c_long(0)))  # pages no memory watch counts
pid = os.fork()
if pid == 0:
    os._exit(7)
out["fork"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
seen = []
threads = [threading.Thread(target=seen.append, args=(i,)) for i in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
out["threads"] = sorted(seen)
out["subprocess"] = subprocess.run(["sh", "-c", "echo hi; (echo there) | cat"], capture_output=True,
                                   text=True).stdout.split()
print(json.dumps(out))
"""


@pytest.mark.parametrize("user", USERS)
def test_a_process_tier_job_runs_under_the_seccomp_filter_and_makes_no_namespaces(
        user: str | None, dsn: str, queue: Queue, sql: Any, shared: Path) -> None:
    """``Seccomp: 2`` and ``NoNewPrivs: 1`` in the job's status; ``unshare -Ur`` and
    ``unshare(CLONE_NEWUSER)`` fail (EPERM), so do ``keyctl`` and ``add_key``; fork, threads and
    subprocesses (clone3 answered ENOSYS: the C library falls back to clone) still work."""
    need_tier("process")
    uid = drainer_uid(user)
    h = handlers_dir(shared, **{"probe.py": PROBE})
    work = work_dir(shared, uid)
    job = queue.enqueue("probe", {}, max_attempts=1)
    r = drain(dsn, h, work, tier="process", user=uid)
    assert not isinstance(r, subprocess.Popen)
    assert r.returncode == 0, r.stderr
    [(status, result, error)] = sql("SELECT status, result, last_error FROM fleetless.jobs WHERE id = %s", job)
    assert status == "done", (error, r.stderr)
    out = json.loads(result)
    assert (out["seccomp"], out["nnp"]) == ("2", "1"), out
    assert out["os_unshare"] == "EPERM" and out["c_unshare_net"] == "EPERM", out
    assert out["unshare_cli"][0] != 0 and out["unshare_urn"] != 0, out
    assert out["keyctl"] == "EPERM" and out["add_key"] == "EPERM" and out["memfd_secret"] == "EPERM", out
    assert out["fork"] == 7 and out["threads"] == [0, 1, 2, 3] and out["subprocess"] == ["hi", "there"], out
    assert "NO seccomp filter" not in r.stderr, r.stderr


#: Two jobs at once: each says where its workspace is, waits for the other's, then reads its
#: mount table.
MOUNTS = """
import json, os, sys, time
args = json.load(open(sys.argv[1]))
me = os.getcwd()
name = os.path.join(args["seen"], os.path.basename(me))
with open(name + ".part", "w") as f:  # renamed whole: the other job never reads it half-written
    f.write(me)
os.rename(name + ".part", name)

def said():
    return [n for n in os.listdir(args["seen"]) if not n.endswith(".part")]

give_up = time.monotonic() + 60
while len(said()) < 2 and time.monotonic() < give_up:
    time.sleep(0.01)
others = [open(os.path.join(args["seen"], n)).read() for n in said()]
points = [line.split()[4].replace("\\\\040", " ") for line in open("/proc/self/mountinfo")]
print(json.dumps({"me": me, "others": [o for o in others if o != me], "points": points}))
"""


@pytest.mark.parametrize("user", USERS)
def test_a_process_tier_job_sees_no_other_jobs_workspace_mount(
        user: str | None, dsn: str, queue: Queue, sql: Any, shared: Path) -> None:
    """With two jobs running at once, neither's ``/proc/self/mountinfo`` names the other's
    workspace (a capped tmpfs under a root drainer, and in a ranged drainer's holder namespace), nor
    any mount under the work directory but its own workspace. (A drainer without a range caps no
    process-tier workspace: there is none to see.) Another drainer's capped workspace elsewhere (a
    decoy the test mounts on the host) is hidden from a root drainer's job, and still listed for a
    non-root drainer's, where the kernel locked it in (what remains: docs/isolation.md)."""
    need_tier("process")
    uid = drainer_uid(user)
    h = handlers_dir(shared, **{"mounts.py": MOUNTS})
    work = work_dir(shared, uid)
    seen = open_to_jobs(shared / "seen")
    ids = [queue.enqueue("mounts", {"seen": str(seen)}, max_attempts=1) for _ in range(2)]
    decoy = shared / "another-drainers-ws"  # a root drainer's workspace elsewhere, mounted as it would be
    decoy.mkdir()
    if os.getuid() == 0:
        _diskcap.mount(decoy, 1 << 20, 16, 0, 0)
    try:
        r = drain(dsn, h, work, "--concurrency", "2", tier="process", user=uid)
    finally:
        if os.getuid() == 0:
            _diskcap.release(decoy)
    assert not isinstance(r, subprocess.Popen)
    assert r.returncode == 0, r.stderr
    outs = []
    for job in ids:
        [(status, result, error)] = sql("SELECT status, result, last_error FROM fleetless.jobs WHERE id = %s", job)
        assert status == "done", (error, r.stderr)
        outs.append(json.loads(result))
    for out in outs:
        assert len(out["others"]) == 1, out  # the two ran at once
        other = out["others"][0]
        assert not [p for p in out["points"] if p == other or p.startswith(other + "/")], out
        under_work = [p for p in out["points"] if p.startswith(str(work) + "/")]
        assert all(p == out["me"] or p.startswith(out["me"] + "/") for p in under_work), (under_work, out["me"])
        # Another drainer's workspace mounted in the host's mount namespace: detached for a root
        # drainer's job; the kernel locks it into a non-root drainer's job's namespace (a copy
        # from a more privileged one), where it stays listed (docs/isolation.md).
        assert (str(decoy) in out["points"]) == (user is not None and os.getuid() == 0), out
