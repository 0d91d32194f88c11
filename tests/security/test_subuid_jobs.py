"""A non-root drainer whose user has a subordinate uid range (``/etc/subuid``, ``/etc/subgid``) and
``newuidmap`` runs every bwrap and process job as a leased uid of that range, never as itself
(issue 7: "no job is ever host root, nor the drainer's own uid, whoever runs the drainer").

The drainer user is ``$FLEETLESS_TEST_SUBUID_USER`` (default ``fleetless-ci``, which ``.ci/run``
creates with the range 1600000000:65536). Each job first leaves a marker in its workspace and
waits for a ``go`` file there: while it waits the test reads the marker's owner and the job's
processes in ``/proc`` on the host, then writes ``go`` (as root) and the job goes on.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from fleetless import Queue
from fleetless.sandbox._workspace import start_time

from .drains import drain, handlers_dir, need_tier, open_to_jobs, pythonpath_for_others, shared, work_dir
from proctools import descendants, leftovers

__all__ = ["shared"]  # the fixture, imported for the tests below

TIERS = ["bwrap", "process", "forkserver"]
USER = os.environ.get("FLEETLESS_TEST_SUBUID_USER", "fleetless-ci")

#: Every job's first lines: a marker in its workspace, then wait (bounded) for the test's ``go``.
PROLOGUE = """
    import json, os, sys, time
    payload = json.load(open(sys.argv[1]))
    open("marker", "w").write(str(os.getpid()))
    give_up = time.monotonic() + payload.get("wait", 120)
    while not os.path.exists("go") and time.monotonic() < give_up:
        time.sleep(0.02)
"""


def subuid_user() -> tuple[int, range]:
    """The drainer user's uid and its subordinate uids; skip (fail where CI requires the tiers)."""
    why = ""
    try:
        uid = pwd.getpwnam(USER).pw_uid
    except KeyError:
        uid, why = -1, f"no user {USER}"
    ranges = {}
    for path in ("/etc/subuid", "/etc/subgid"):
        try:
            rows = [line.strip().split(":") for line in open(path)]
        except OSError:
            rows = []
        mine = [r for r in rows if len(r) == 3 and r[0] in (USER, str(uid))]
        ranges[path] = [range(int(r[1]), int(r[1]) + int(r[2])) for r in mine]
    if not why and not (ranges["/etc/subuid"] and ranges["/etc/subgid"]):
        why = f"{USER} has no line in /etc/subuid and /etc/subgid"
    if not why and not (shutil.which("newuidmap") and shutil.which("newgidmap")):
        why = "newuidmap/newgidmap missing (apt-get install uidmap)"
    if not why and os.getuid() != 0:
        why = "needs root to start a drainer as another user"
    if why:
        if os.environ.get("FLEETLESS_REQUIRE_TIERS"):
            pytest.fail(f"a non-root drainer with a subordinate range is required here: {why}")
        pytest.skip(why)
    return uid, ranges["/etc/subuid"][0]


def hdir(base: Path, **bodies: str) -> Path:
    return handlers_dir(base, **{f"{k}.py": textwrap.dedent(PROLOGUE) + textwrap.dedent(v) for k, v in bodies.items()})


def holder_roots(proc: subprocess.Popen[str]) -> list[Path]:
    """``/proc/PID/root`` of one process per mount namespace among the drain's own processes other
    than the test's: the drainer's holder keeps each workspace's capped tmpfs in a namespace of its
    own (``_subuid.Holder.cap``), so the host sees only an empty directory there."""
    own = os.stat("/proc/self/ns/mnt").st_ino
    roots: dict[int, tuple[int, int]] = {}  # namespace -> (start time, pid) of its oldest: the holder
    for pid in descendants(proc.pid):
        try:
            ino = os.stat(f"/proc/{pid}/ns/mnt").st_ino
            oldest = (start_time(pid), pid)
        except OSError:
            continue
        if ino != own and oldest < roots.get(ino, oldest):
            roots[ino] = oldest
        roots.setdefault(ino, oldest)
    return [Path(f"/proc/{pid}/root") for ino, (_, pid) in roots.items() if ino != own]


def markers(work: Path, tier: str, proc: subprocess.Popen[str] | None = None) -> list[Path]:
    """The jobs' markers, on the host or in the holder's mount namespace (each file once); the
    forkserver's in each job init's mount namespace, at ``/workspace``."""
    sub = "*/workspace/marker" if tier == "bwrap" else "*/marker"
    found: dict[tuple[int, int], Path] = {}
    for root in [Path("/"), *(holder_roots(proc) if proc is not None else [])]:
        try:
            where = (root / str(work).lstrip("/")).glob(f"ws-{sub}") if tier != "forkserver" else (
                [root / "workspace/marker"] if root != Path("/") and (root / "workspace/marker").exists() else [])
            for m in sorted(where):
                st = m.stat()
                found.setdefault((st.st_dev, st.st_ino), m)
        except OSError:  # a process gone meanwhile, a namespace the test may not enter
            continue
    return sorted(found.values())


def touch_as_owner(folder: Path, name: str) -> None:
    """Create ``folder/name`` as the owner of ``folder`` (a job's workspace, maybe on a tmpfs of
    the holder's user namespace, where a file of root's could not be made: EOVERFLOW), through a
    descriptor the test opened (the owner may not pass ``/proc/HOLDER/root``)."""
    st = folder.stat()
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        subprocess.run(["/usr/bin/python3", "-c", f"import os; os.close(os.open({name!r}, os.O_CREAT | os.O_WRONLY, "
                        f"0o644, dir_fd={fd}))"], pass_fds=(fd,), user=st.st_uid, group=st.st_gid,
                       extra_groups=[], check=True, cwd="/")
    finally:
        os.close(fd)


def uids_of_processes(uids: set[int]) -> set[int]:
    """Host pids running as any of ``uids`` (real uid), from /proc."""
    found = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/status") as f:
                    line = next(li for li in f if li.startswith("Uid:"))
            except (OSError, StopIteration):
                continue
            if int(line.split()[1]) in uids:
                found.add(int(name))
    return found


def debug() -> str:
    import psycopg

    try:
        with psycopg.connect(DEBUG_DSN[0]) as c:
            return str(c.execute("SELECT status, last_error FROM fleetless.jobs").fetchall())
    except Exception as exc:
        return str(exc)


DEBUG_DSN = [""]


def wait_for(what: str, check: Any, seconds: float = 120, proc: subprocess.Popen[str] | None = None) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the drain ended before {what}: {proc.communicate()} {debug()}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def observe(work: Path, tier: str, n: int, proc: subprocess.Popen[str]) -> list[int]:
    uids: list[int] = []
    observe_markers(work, tier, n, proc, uids)
    return uids


def observe_markers(work: Path, tier: str, n: int, proc: subprocess.Popen[str],
                    owners: list[int] | None = None) -> list[Path]:
    """Wait until ``n`` jobs wait in their workspaces; their host uids (the markers' owners, each
    checked against a process of the job running as it); then let them go."""
    found = wait_for(f"{n} waiting jobs", lambda: (m := markers(work, tier, proc)) and len(m) >= n and m,
                     proc=proc)
    uids = [m.stat().st_uid for m in found]
    if owners is not None:  # (read before ``go``: a workspace's tmpfs may be gone right after its job)
        owners += uids
    running = uids_of_processes(set(uids))
    for m in found:
        assert int(m.read_text()) > 0
    assert running, f"no process runs as {uids}"
    for m in found:
        touch_as_owner(m.parent, "go")
    return found


def results(sql: Any) -> list[tuple[Any, ...]]:
    return sql("SELECT status, result FROM fleetless.jobs ORDER BY id")


@pytest.mark.parametrize("tier", TIERS)
def test_a_nonroot_drainers_concurrent_jobs_run_as_distinct_subordinate_uids_never_its_own(
        dsn: str, queue: Queue, sql: Any, shared: Path, tier: str) -> None:
    need_tier(tier)
    DEBUG_DSN[0] = dsn
    uid, subuids = subuid_user()
    h = hdir(shared, who="print('ran')\n")
    work = work_dir(shared, uid)
    queue.enqueue_many([{"kind": "who", "payload": {}}] * 2)
    proc = drain(dsn, h, work, "--concurrency", "2", tier=tier, user=uid, start=True)
    assert isinstance(proc, subprocess.Popen)
    try:
        uids = observe(work, tier, 2, proc)
        _, err = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert len(set(uids)) == 2, uids
    assert all(u in subuids and u != uid for u in uids), (uids, subuids)
    assert [s for s, _ in results(sql)] == ["done", "done"]
    assert "drainer's own uid" not in err
    assert leftovers(work) == []


def test_a_subordinate_uid_process_job_cannot_read_the_drainers_files_environ_or_a_sibling_workspace(
        dsn: str, queue: Queue, sql: Any, shared: Path) -> None:
    need_tier("process")
    uid, _ = subuid_user()
    home = shared / "home"
    home.mkdir(mode=0o755)
    home.chmod(0o755)
    pgpass = home / ".pgpass"
    pgpass.write_text("127.0.0.1:5432:*:app:secret\n")
    os.chown(pgpass, uid, pwd.getpwuid(uid).pw_gid)
    pgpass.chmod(0o600)
    board = open_to_jobs(shared / "board")
    h = hdir(shared, probe="""
        out = {}
        def tried(name, path):
            try:
                open(path, "rb").read()
                out[name] = "read"
            except OSError as exc:
                out[name] = type(exc).__name__
        open("mine.txt", "w").write("sibling secret")
        board = payload["board"]
        mine = os.path.join(board, f".tmp-{os.getpid()}-{time.time()}")
        open(mine, "w").write(os.getcwd())
        os.rename(mine, mine.replace(".tmp-", "ws-"))  # whole, or not there at all
        give_up = time.monotonic() + 120
        while not (len([n for n in os.listdir(board) if n.startswith("ws-")]) >= 2
                   and os.path.exists(os.path.join(board, "drainer"))) and time.monotonic() < give_up:
            time.sleep(0.02)
        for name in os.listdir(board):
            theirs = open(os.path.join(board, name)).read() if name.startswith("ws-") else ""
            if theirs and theirs != os.getcwd():
                tried("sibling", os.path.join(theirs, "mine.txt"))
        open(os.path.join(board, f"read-{os.getpid()}-{time.time()}"), "w").close()
        while len([n for n in os.listdir(board) if n.startswith("read-")]) < 2 and time.monotonic() < give_up:
            time.sleep(0.02)  # the sibling's workspace stays until both have tried
        tried("pgpass", payload["pgpass"])
        drainer = open(os.path.join(board, "drainer")).read()
        tried("environ", f"/proc/{drainer}/environ")
        print(json.dumps(out))
    """)
    work = work_dir(shared, uid)
    payload = {"board": str(board), "pgpass": str(pgpass), "wait": 0}
    queue.enqueue_many([{"kind": "probe", "payload": payload}] * 2)
    proc = drain(dsn, h, work, "--concurrency", "2", tier="process", user=uid, start=True)
    assert isinstance(proc, subprocess.Popen)
    try:
        (board / "drainer").write_text(str(proc.pid))  # the jobs wait for it (and for each other)
        _, err = proc.communicate(timeout=180)
    finally:
        proc.kill()
    rows = results(sql)
    assert [s for s, _ in rows] == ["done", "done"], (rows, err)
    for _, result in rows:
        seen = json.loads(result.strip().splitlines()[-1])
        # (the drainer's /proc entry: not in the job's pid namespace, or not readable)
        assert seen["environ"] in ("PermissionError", "FileNotFoundError"), seen
        assert seen == {"sibling": "PermissionError", "pgpass": "PermissionError", "environ": seen["environ"]}, seen
    assert pgpass.read_text() == "127.0.0.1:5432:*:app:secret\n"
    assert leftovers(work) == []


HOSTILE = """
    top = os.getcwd()
    bait = payload["bait"]
    os.symlink(bait, "evil-dir")
    os.symlink(bait + "/inside.txt", "evil-file")
    os.makedirs("locked/deeper")
    open("locked/deeper/ro.txt", "w").write("x")
    os.chmod("locked/deeper/ro.txt", 0o444)
    os.symlink(bait, "locked/deeper/evil-dir")
    os.chmod("locked/deeper", 0)
    os.chmod("locked", 0)
    os.makedirs("deep")
    os.chdir("deep")
    for _ in range(1500):
        os.mkdir("d")
        os.chdir("d")
    open("bottom.txt", "w").write("x")
    os.chmod(".", 0o555)
    print("left a hostile tree")
    open(os.path.join(top, "made"), "w").write("")
    if payload.get("hang"):
        time.sleep(600)
"""


def bait_dir(base: Path) -> tuple[Path, tuple[int, int, int]]:
    bait = base / "bait"
    bait.mkdir(mode=0o755)
    bait.chmod(0o755)
    (bait / "inside.txt").write_text("keep me")
    st = bait.stat()
    return bait, (st.st_mode, st.st_uid, st.st_gid)


@pytest.mark.parametrize("tier", TIERS)
def test_what_a_subordinate_uid_job_leaves_is_removed_after_it_and_its_symlink_target_untouched(
        dsn: str, queue: Queue, sql: Any, shared: Path, tier: str) -> None:
    need_tier(tier)
    uid, subuids = subuid_user()
    bait, before = bait_dir(shared)
    h = hdir(shared, hostile=HOSTILE)
    work = work_dir(shared, uid)
    queue.enqueue("hostile", {"bait": str(bait)})
    proc = drain(dsn, h, work, tier=tier, user=uid, start=True)
    assert isinstance(proc, subprocess.Popen)
    try:
        uids = observe(work, tier, 1, proc)
        _, err = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert uids[0] in subuids
    assert results(sql) == [("done", "left a hostile tree\n")], err
    assert leftovers(work) == [] and not (work / "quarantine").exists(), (leftovers(work), err)
    st = bait.stat()
    assert (st.st_mode, st.st_uid, st.st_gid) == before
    assert (bait / "inside.txt").read_text() == "keep me"


@pytest.mark.parametrize("tier", TIERS)
def test_after_a_sigkilled_drainer_no_process_of_its_job_uid_survives_and_the_next_drain_leaves_nothing(
        dsn: str, queue: Queue, sql: Any, shared: Path, tier: str) -> None:
    need_tier(tier)
    uid, subuids = subuid_user()
    bait, before = bait_dir(shared)
    h = hdir(shared, hostile=HOSTILE)
    work = work_dir(shared, uid)
    queue.enqueue("hostile", {"bait": str(bait), "hang": True})
    proc = drain(dsn, h, work, tier=tier, user=uid, start=True)
    assert isinstance(proc, subprocess.Popen)
    try:
        marker, = observe_markers(work, tier, 1, proc)
        uids = [marker.stat().st_uid]
        assert uids[0] in subuids
        wait_for("the hostile tree", (marker.parent / "made").exists)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:
        proc.kill()
    wait_for(f"no process of uid {uids[0]}", lambda: not uids_of_processes(set(uids)))
    r = drain(dsn, h, work, tier=tier, user=uid)  # its sweep; the job is still leased (running)
    assert not isinstance(r, subprocess.Popen)
    assert r.returncode == 0, r.stderr
    wait_for("an empty work directory", lambda: leftovers(work) == [])
    assert not (work / "quarantine").exists() or list((work / "quarantine").iterdir()) == []
    # (the next drain's probe may lease the same uid for a moment: wait, bounded, for it too)
    wait_for(f"no process of uid {uids[0]} after the next drain", lambda: not uids_of_processes(set(uids)))
    st = bait.stat()
    assert (st.st_mode, st.st_uid, st.st_gid) == before
    assert (bait / "inside.txt").read_text() == "keep me"


@pytest.mark.parametrize("tier", TIERS)
def test_doctor_says_a_subordinate_range_drainers_jobs_run_as_uids_of_that_range(tier: str) -> None:
    need_tier(tier)
    uid, subuids = subuid_user()
    code = f"from fleetless.sandbox import get_backend; print(get_backend({tier!r}).describe())"
    r = subprocess.run(["/usr/bin/python3", "-c", code], capture_output=True, text=True, timeout=120, cwd="/",
                       env={"PYTHONPATH": ":".join(pythonpath_for_others()), "PATH": "/usr/bin:/bin"},
                       user=uid, group=pwd.getpwuid(uid).pw_gid, extra_groups=[])
    assert r.returncode == 0, r.stderr
    first, last = subuids[0], subuids[-1]
    said = f"jobs run as host uids {first}-{last} (the drainer user's subordinate range), one each"
    assert said in r.stdout, r.stdout
    assert "drainer's own uid" not in r.stdout


def test_auto_picks_the_fork_server_for_a_subordinate_range_drainer_and_bwrap_without_a_range() -> None:
    """Issue 27: no tier flag gives a drainer with a subordinate range the fork server, and says so in
    the drain's first line; one without a range (fleetless-ci2) keeps bwrap, and the fork server's
    check (doctor's line) says why, naming what to add."""
    uid, _ = subuid_user()
    code = ("from fleetless.sandbox import choose_tier, get_backend, SandboxUnavailable\n"
            "print(choose_tier('auto'))\n"
            "try:\n    get_backend('forkserver').check()\nexcept SandboxUnavailable as exc:\n    print(exc)\n")
    env = {"PYTHONPATH": ":".join(pythonpath_for_others()), "PATH": "/usr/bin:/bin"}
    r = subprocess.run(["/usr/bin/python3", "-c", code], capture_output=True, text=True, timeout=120, cwd="/",
                       env=env, user=uid, group=pwd.getpwuid(uid).pw_gid, extra_groups=[])
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [str(("forkserver", "sandbox: forkserver (auto: a drainer with a subordinate uid "
                                          "range forks each job from a pre-started server into bwrap's namespaces; "
                                          "--sandbox chooses another)"))], r.stdout
    try:
        plain = pwd.getpwnam(os.environ.get("FLEETLESS_TEST_PLAIN_USER", "fleetless-ci2"))
    except KeyError:
        return
    r = subprocess.run(["/usr/bin/python3", "-c", code], capture_output=True, text=True, timeout=120, cwd="/",
                       env=env, user=plain.pw_uid, group=plain.pw_gid, extra_groups=[])
    assert r.returncode == 0, r.stderr
    tier, why = r.stdout.splitlines()
    assert tier.startswith("('bwrap', "), r.stdout
    assert why == ("the fork server needs a root drainer or a subordinate uid range for the drainer's user (its "
                   "server is ns-root over those uids, each job one of them); here: add a line "
                   f"{plain.pw_name}:FIRST:65536 in /etc/subuid and a line {plain.pw_name}:FIRST:65536 in "
                   "/etc/subgid"), why


@pytest.mark.parametrize("tier", TIERS)
def test_drainers_of_one_user_with_lease_files_in_different_places_never_share_a_job_uid(
        dsn: str, queue: Queue, sql: Any, shared: Path, tier: str) -> None:
    """Red team, 4th pass: a non-root drainer keeps its uid leases under ``$XDG_RUNTIME_DIR`` (or
    its ``$TMPDIR``), so a cron drain and a session's drain of one user leased the same host uid,
    and the process tier's uid sweep after one job SIGKILLed the other drainer's running job (dead,
    "killed by SIGKILL"). Every lease is now also claimed host-wide: the second drainer's job gets
    another uid, and the first runs on to done."""
    need_tier(tier)
    uid, subuids = subuid_user()
    h = hdir(shared, who="print('ran')\n")
    runtime = []
    for name in ("session", "cron"):
        d = shared / f"runtime-{name}-{tier}"
        d.mkdir(mode=0o700, exist_ok=True)
        os.chown(d, uid, pwd.getpwuid(uid).pw_gid)
        runtime.append(d)
    queue.enqueue("who", {"wait": 120}, queue="long")
    short = queue.enqueue("who", {"wait": 120}, queue="short")
    work = work_dir(shared, uid)
    long_drain = drain(dsn, h, work, "--queue", "long", tier=tier, user=uid, start=True,
                       env={"XDG_RUNTIME_DIR": str(runtime[0])})
    assert isinstance(long_drain, subprocess.Popen)
    short_drain = None
    try:
        (marker,) = wait_for("the long job to wait", lambda: markers(work, tier, long_drain), proc=long_drain)
        long_uid = marker.stat().st_uid
        short_drain = drain(dsn, h, work, "--queue", "short", tier=tier, user=uid, start=True,
                            env={"XDG_RUNTIME_DIR": str(runtime[1])})
        assert isinstance(short_drain, subprocess.Popen)
        (other,) = wait_for("the short job to wait", lambda: [m for m in markers(work, tier, short_drain)
                                                               if m != marker], proc=short_drain)
        assert other.stat().st_uid != long_uid  # both run at once, each as a uid of its own
        touch_as_owner(other.parent, "go")
        _, err = short_drain.communicate(timeout=180)
        assert short_drain.returncode == 0, err
        assert sql("SELECT status FROM fleetless.jobs WHERE id = %s", short) == [("done",)]
        assert uids_of_processes({long_uid}), "the long job was killed by the other drainer's sweep"
        touch_as_owner(marker.parent, "go")
        _, err = long_drain.communicate(timeout=180)
    finally:
        for p in (long_drain, short_drain):
            if p is not None:
                p.kill()
    assert long_drain.returncode == 0, err
    assert long_uid in subuids
    assert [s for s, _ in results(sql)] == ["done", "done"], results(sql)
