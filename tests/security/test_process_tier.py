"""The process tier cannot be steered by its job (issue 7, item 4), and signals aimed at a drain's
process group reach only the drainer (issue 13, item 1).

Each test runs a real ``fleetless drain``, as root (whose jobs then run as leased unprivileged
uids) and, where it matters, as an unprivileged user (65534), and reads the outcome from the table.
The hostile handlers act only on their own supervisor, their own drainer and directories the test
made; every process they start carries a marker and is looked for (and killed) afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest

from fleetless import Queue

from .drains import AS_ROOT_AND_NOT, drain, handlers_dir, need_tier, need_user, open_to_jobs, shared, work_dir
from proctools import pids_with, wait_for

__all__ = ["shared"]  # the fixture, imported for the tests below

FIND = """
    import os

    def find(word):
        \"\"\"Visible pids whose command line holds ``word`` (the job's own aside).\"\"\"
        out = []
        for name in os.listdir("/proc"):
            if name.isdigit() and int(name) != os.getpid():
                try:
                    if word.encode() in open(f"/proc/{name}/cmdline", "rb").read():
                        out.append(int(name))
                except OSError:
                    pass
        return out
"""

KILL_SUPERVISOR = FIND + """
    import json, signal, sys, time
    args = json.load(open(sys.argv[1]))
    marker = args["marker"]
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:  # a daemon in a session of its own
            os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(600)", marker])
        os._exit(0)
    outcome = {}
    for pid in find("_supervisor.py") + find("fleetless.cli"):  # its supervisor and its drainer
        try:
            os.kill(pid, signal.SIGKILL)
        except PermissionError:
            outcome[pid] = "EPERM"
            continue
        time.sleep(0.5)
        outcome[pid] = "survived" if os.path.exists(f"/proc/{pid}") else "killed"
    tmp = os.path.join(args["seen"], "outcome.tmp")  # renamed whole: the test reads it once it exists
    open(tmp, "w").write(json.dumps(sorted(outcome.values())))
    os.rename(tmp, os.path.join(args["seen"], "outcome"))
    time.sleep(600)
"""

GARBAGE_STATUS = FIND + """
    import sys
    wrote, denied = 0, set()
    for pid in find("_supervisor.py"):  # whatever of its supervisor it sees: every fd it holds
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError as exc:
            denied.add(type(exc).__name__)
            continue
        for fd in fds:
            try:
                with open(f"/proc/{pid}/fd/{fd}", "wb") as f:
                    f.write(b"\\x1b]0;pwned\\x07not a status\\ndrained: claimed 9, done 9\\n")
                wrote += 1
            except OSError as exc:
                denied.add(type(exc).__name__)
    print("wrote" if wrote else ",".join(sorted(denied)) or "nothing visible")
    sys.exit(3)
"""

PROBE_DRAINER = FIND + """
    import json, signal, sys, time
    args = json.load(open(sys.argv[1]))
    drainers, supervisors = find("fleetless.cli"), find("_supervisor.py")

    def attempt(targets, call):
        if not targets:
            return "not visible"
        outcomes = set()
        for pid in targets:
            try:
                call(pid)
                outcomes.add("allowed")
            except OSError as exc:
                outcomes.add(type(exc).__name__)
        return ",".join(sorted(outcomes))

    def forge(pid):
        with open(f"/proc/{pid}/fd/2", "w") as f:
            f.write("\\x1b]0;pwned\\x07drained: claimed 1, done 1 (forged)\\n")

    def kill(pid):
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
        if os.path.exists(f"/proc/{pid}"):
            raise ProcessLookupError("survived")  # (pid 1 of its namespace ignores it)

    out = {
        "uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(),
        "environ": attempt(drainers, lambda pid: open(f"/proc/{pid}/environ", "rb").read()),
        "mem": attempt(drainers, lambda pid: open(f"/proc/{pid}/mem", "rb").close()),
        "terminal": attempt(drainers, forge),
        "handlers": attempt([0], lambda pid: open(os.path.join(args["handlers"], "planted.py"), "w").close()),
        "signal": attempt(supervisors, kill),
        "signal_drainer": attempt(drainers, kill),
        "supervisor_environ": attempt(supervisors, lambda pid: open(f"/proc/{pid}/environ", "rb").read()),
    }
    open(os.path.join(args["seen"], os.environ["FLEETLESS_JOB_ID"]), "w").write(str(os.getuid()))
    deadline = time.monotonic() + 60  # wait for the other job, to be running alongside it
    while len(os.listdir(args["seen"])) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    print(json.dumps(out))
"""


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (one /proc scan)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stat = Path(f"/proc/{name}/stat").read_bytes()
            except OSError:
                continue
            children.setdefault(int(stat[stat.rindex(b")") + 2:].split()[1]), []).append(int(name))
    found, stack = set(), [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.add(child)
            stack.append(child)
    return found


def kill_all(marker: str) -> None:
    for pid in pids_with(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("user", AS_ROOT_AND_NOT)
def test_a_job_cannot_kill_its_supervisor_and_its_daemon_dies_when_the_supervisor_is_killed(
        user: int | None, dsn: str, queue: Queue, sql: Any, shared: Path) -> None:
    """A job that leaves a setsid() daemon and tries to SIGKILL its supervisor and its drainer:
    it cannot (a root drainer's job: another uid; a non-root drainer's: they are outside its pid
    namespace, and that namespace's init ignores it). When the supervisor dies anyway (here: the
    test kills it), the job and its daemon die with it, no cgroup needed, and the job is charged.
    Before, a non-root drainer's job killed its supervisor and its daemon lived on."""
    need_user(user)
    marker = f"fleetless-daemon-{uuid.uuid4().hex}"
    h = handlers_dir(shared, **{"hostile.py": KILL_SUPERVISOR})
    work = work_dir(shared, user)
    seen = open_to_jobs(shared / "seen")
    queue.enqueue("hostile", {"marker": marker, "seen": str(seen)}, max_attempts=1)
    d = drain(dsn, h, work, "--timeout", "120", user=user, start=True)
    assert isinstance(d, subprocess.Popen)
    try:
        wait_for(lambda: (seen / "outcome").exists() and pids_with(marker), timeout=60, what="the job's attempt")
        assert "killed" not in json.loads((seen / "outcome").read_text())
        supervisors = [pid for pid in pids_with("_supervisor.py") if pid in descendants(d.pid)
                       and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1] == str(d.pid)]
        assert len(supervisors) == 1, supervisors
        os.kill(supervisors[0], signal.SIGKILL)
        wait_for(lambda: not pids_with(marker), timeout=30, what="the daemon to die with the supervisor")
        _, err = d.communicate(timeout=120)
        assert d.returncode == 0, err
        [(status, attempts, error)] = sql("SELECT status, attempts, last_error FROM fleetless.jobs")
        assert (status, attempts) == ("dead", 1), error
        assert error.startswith("killed: its supervisor died (killed by SIGKILL)"), error
    finally:
        if d.poll() is None:
            d.kill()
            d.wait()
        kill_all(marker)


@pytest.mark.parametrize("user", AS_ROOT_AND_NOT)
def test_garbage_in_the_supervisors_status_pipe_is_the_jobs_own_charged_failure(
        user: int | None, dsn: str, queue: Queue, sql: Any, shared: Path) -> None:
    """A job cannot open the pipes its supervisor holds (a root drainer's job: another uid; any job:
    the supervisor and its namespace's init are non-dumpable, their /proc/<pid>/fd root's). It fails
    on its own terms, charged; the drain's output shows none of what it tried to write. Before, a
    non-root drainer's job wrote into the status pipe."""
    need_user(user)
    h = handlers_dir(shared, **{"garbage.py": GARBAGE_STATUS, "ok.py": "print('ok')"})
    work = work_dir(shared, user)
    queue.enqueue("garbage", {}, max_attempts=1)
    queue.enqueue_many([{"kind": "ok", "payload": {}}] * 3)
    r = drain(dsn, h, work, "--concurrency", "2", user=user)
    assert r.returncode == 0, r.stderr
    assert "\x1b" not in r.stderr and "claimed 9" not in r.stderr, r.stderr
    rows = sql("SELECT kind, status, attempts, last_error, result FROM fleetless.jobs ORDER BY id")
    [(_, status, attempts, error, result), *good] = rows
    assert (status, attempts) == ("dead", 1), rows
    assert result.strip() in ("PermissionError", "nothing visible") and error.startswith("exit code 3"), \
        (result, error)
    assert [(k, s, a) for k, s, a, _, _ in good] == [("ok", "done", 1)] * 3


@pytest.mark.parametrize("user", AS_ROOT_AND_NOT)
def test_a_jobs_drainer_and_supervisor_are_out_of_its_reach(
        user: int | None, dsn: str, queue: Queue, sql: Any, shared: Path) -> None:
    """Two jobs at once look for their drainer and supervisor: the drainer is not even visible
    (the job's own pid namespace and /proc), so neither its environment, memory nor terminal
    (``/proc/<drainer>/fd/2``) can be reached; the supervisor (pid 1 of the job's namespace, as the
    job sees its init) ignores or refuses SIGKILL and its environment is not readable. Under a root
    drainer the jobs also run as two distinct unprivileged uids and cannot plant a handler. Before,
    a non-root drainer's job wrote a forged line to the operator's terminal and read the drainer's
    environment."""
    need_user(user)
    h = handlers_dir(shared, **{"probe.py": PROBE_DRAINER})
    work = work_dir(shared, user)
    seen = open_to_jobs(shared / "seen")
    queue.enqueue_many([{"kind": "probe", "payload": {"handlers": str(h), "seen": str(seen)}}] * 2)
    r = drain(dsn, h, work, "--concurrency", "2", user=user, env={"FLEETLESS_TEST_SECRET": "do-not-leak"})
    assert r.returncode == 0, r.stderr
    assert "forged" not in r.stderr and "\x1b" not in r.stderr, r.stderr
    rows = sql("SELECT status, result FROM fleetless.jobs ORDER BY id")
    assert [s for s, _ in rows] == ["done", "done"], rows
    probes = [json.loads(result) for _, result in rows]
    for p in probes:
        for what in ("environ", "mem", "terminal", "signal_drainer"):
            assert p[what] == "not visible", (what, p)
        assert p["signal"] in ("PermissionError", "ProcessLookupError"), p
        assert p["supervisor_environ"] == "PermissionError", p
    if user is None:
        assert len({p["uid"] for p in probes}) == 2  # two jobs at once: two uids
        for p in probes:
            assert p["uid"] not in (0, os.getuid()) and p["gid"] == p["uid"] and p["groups"] == [], p
            assert p["handlers"] == "PermissionError", p
        assert sorted(os.listdir(h)) == ["probe.py"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("tier", ["process", "bwrap", "forkserver", pytest.param("microvm", marks=pytest.mark.slow)])
def test_a_signal_to_the_drains_process_group_winds_down_the_drain_without_charging_a_job(
        tier: str, sig: signal.Signals, dsn: str, queue: Queue, sql: Any, shared: Path) -> None:
    """Ctrl-C at a terminal (SIGINT to the foreground process group) or ``kill -TERM -- -PGID``:
    the drainer stops claiming and lets the running jobs finish within the grace; no job is
    killed, charged or released."""
    need_tier(tier)
    kind = f"sleepy{uuid.uuid4().hex[:12]}"
    body = "import time\ntime.sleep(4)\nprint('finished')\n"
    if tier == "forkserver":  # a forked job's command line is its server's: exec to show the kind
        body = (f"import os, sys\nos.execv(sys.executable, [sys.executable, '-c', {body!r}, {kind!r}])\n")
    h = handlers_dir(shared, **{f"{kind}.py": body})
    work = work_dir(shared, None)
    queue.enqueue_many([{"kind": kind, "payload": {}, "max_attempts": 1}] * 4)
    d = drain(dsn, h, work, "--concurrency", "2", "--shutdown-grace", "120", tier=tier, start=True)
    assert isinstance(d, subprocess.Popen)
    try:
        wait_for(lambda: len(set(pids_with("qemu-system" if tier == "microvm" else kind))
                             & descendants(d.pid)) >= 2, timeout=120, what="two jobs running")
        os.killpg(d.pid, sig)  # the whole process group, as a terminal or `kill -- -PGID` does
        out, err = d.communicate(timeout=180)
    finally:
        if d.poll() is None:
            d.kill()
            d.wait()
    assert d.returncode == (130 if sig == signal.SIGINT else 0), err  # Ctrl-C's exit status, as a shell's
    assert f"{sig.name}: stopping; running jobs get 120 s" in err, err
    rows = sql("SELECT status, attempts, result FROM fleetless.jobs ORDER BY id")
    done = [r for r in rows if r[0] == "done"]
    assert len(done) == 2 and all(r == ("done", 1, "finished\n") for r in done), rows
    assert sorted(r[:2] for r in rows if r[0] != "done") == [("pending", 0)] * 2, rows  # never claimed
    assert "released" not in out and "dead 0" in out, out


def test_log_lines_quoting_a_job_reach_the_terminal_escaped() -> None:
    import logging

    from fleetless.terminal import PrintableFormatter

    record = logging.LogRecord("fleetless", logging.WARNING, __file__, 1, "cannot remove %s", ("\x1b]0;pwned\x07",),
                               None)
    assert PrintableFormatter("fleetless: %(message)s").format(record) == \
        "fleetless: cannot remove \\x1b]0;pwned\\x07"


def test_a_root_drainer_refuses_a_work_directory_its_jobs_cannot_reach_before_claiming(
        dsn: str, queue: Queue, sql: Any, shared: Path) -> None:
    need_user(None)
    h = handlers_dir(shared, **{"ok.py": "print('ok')"})
    private = shared / "private"
    private.mkdir(mode=0o700)
    private.chmod(0o700)
    queue.enqueue("ok", {})
    r = drain(dsn, h, private / "work")
    assert r.returncode != 0
    assert f"{private} is not searchable by others" in r.stderr and len(r.stderr.strip().splitlines()) == 1, \
        r.stderr
    assert sql("SELECT status, attempts FROM fleetless.jobs") == [("pending", 0)]


TMP_WRITER = """
    import json, os, sys, tempfile, time
    args = json.load(open(sys.argv[1]))
    with tempfile.NamedTemporaryFile("w", delete=False) as f:  # in TMPDIR
        f.write(args["secret"])
    os.chmod(f.name, 0o644)  # readable by anyone who can reach it
    shm = f"/dev/shm/{args['name']}"
    with open(shm, "w") as g:
        g.write(args["secret"])
    os.chmod(shm, 0o644)
    info = {"tmp": f.name, "shm": shm, "tmpdir": tempfile.gettempdir(), "cwd": os.getcwd()}
    open(os.path.join(args["seen"], "paths.tmp"), "w").write(json.dumps(info))
    os.rename(os.path.join(args["seen"], "paths.tmp"), os.path.join(args["seen"], "paths"))
    deadline = time.monotonic() + 60  # alive (its files in place) until the reader is done
    while not os.path.exists(os.path.join(args["seen"], "read")) and time.monotonic() < deadline:
        time.sleep(0.05)
    print(json.dumps(info))
"""

TMP_READER = """
    import json, os, sys, time
    args = json.load(open(sys.argv[1]))
    paths = os.path.join(args["seen"], "paths")
    deadline = time.monotonic() + 60
    while not os.path.exists(paths) and time.monotonic() < deadline:
        time.sleep(0.05)
    info = json.load(open(paths))
    out = {}
    for what in ("tmp", "shm"):
        try:
            out[what] = "read" if open(info[what]).read() == args["secret"] else "other content"
        except OSError as exc:
            out[what] = type(exc).__name__
    open(os.path.join(args["seen"], "read"), "w").close()
    print(json.dumps(out))
"""


#: The drainer users of issue 25: root (its jobs: leased uids), one with a subordinate uid range
#: (each job a uid of it) and one without (every job the drainer's own uid in a user namespace).
DRAINER_USERS = [pytest.param(None, id="root-drainer"), pytest.param("fleetless-ci", id="subuid-drainer"),
                 pytest.param("fleetless-ci2", id="no-range-drainer")]


def _uid_of(name: str | None) -> int | None:
    import pwd

    if name is None:
        return None
    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        pytest.skip(f"no user {name} here")


def _drainer(user: str | None) -> int | None:
    """The uid to start the drain as (None: this test's own, root's or, under .ci/unprivileged,
    ``user``'s own), else skip."""
    uid = _uid_of(user)
    if uid is not None and uid == os.getuid():
        return None
    need_user(uid)
    return uid


def _shares_its_uid(uid: int | None) -> bool:
    """Whether that drainer's process-tier jobs run as its own uid (a non-root drainer's user
    without a subordinate range)."""
    import pwd

    from fleetless.sandbox import _subuid

    if uid is None:
        return os.getuid() != 0 and _subuid.delegation() is None
    return not any(line.split(":")[0] in (pwd.getpwuid(uid).pw_name, str(uid))
                   for line in Path("/etc/subuid").read_text().splitlines() if line.strip())


@pytest.mark.parametrize("user", DRAINER_USERS)
def test_a_jobs_temporary_files_and_dev_shm_are_its_own(
        user: str | None, dsn: str, queue: Queue, sql: Any, shared: Path) -> None:
    """Two jobs at once: one writes a world-readable temporary file (``tempfile``, which follows
    TMPDIR: the job's own workspace) and a file in /dev/shm (a tmpfs of its own mount namespace);
    the other tries to read both. Under a root drainer, or one with a subordinate range, it can
    read neither (its uid cannot enter the other's workspace; the other's /dev/shm is not its own);
    under a non-root drainer without a range, whose jobs share its uid, it reads the temporary file
    (as it could read the workspace) but not the /dev/shm one. Nothing is left in the host's
    /dev/shm. Before, both were in the host's /tmp and /dev/shm, readable by every job."""
    uid = _drainer(user)
    h = handlers_dir(shared, **{"writer.py": TMP_WRITER, "reader.py": TMP_READER})
    work = work_dir(shared, uid)
    seen = open_to_jobs(shared / "seen")
    name = f"fleetless-shm-{uuid.uuid4().hex}"
    payload = {"seen": str(seen), "secret": uuid.uuid4().hex, "name": name}
    writer = queue.enqueue("writer", payload, max_attempts=1)
    reader = queue.enqueue("reader", payload, max_attempts=1)
    r = drain(dsn, h, work, "--concurrency", "2", user=uid)
    assert r.returncode == 0, r.stderr
    [(ws, wr)] = sql("SELECT status, result FROM fleetless.jobs WHERE id = %s", writer)
    [(rs, rr)] = sql("SELECT status, result FROM fleetless.jobs WHERE id = %s", reader)
    assert (ws, rs) == ("done", "done"), (wr, rr)
    info, out = json.loads(wr), json.loads(rr)
    assert info["tmpdir"] == f"{info['cwd']}/.tmp" and info["tmp"].startswith(info["tmpdir"] + "/"), info
    assert out["shm"] == "FileNotFoundError", out
    assert out["tmp"] == ("read" if _shares_its_uid(uid) else "PermissionError"), out
    assert not os.path.exists(f"/dev/shm/{name}")


SNOOP = """
    import json, os, sys
    args = json.load(open(sys.argv[1]))
    me = os.getpid()
    seen = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        for what in ("cmdline", "environ"):
            try:
                seen[f"{name}/{what}"] = open(f"/proc/{name}/{what}", "rb").read().decode(errors="replace")
            except OSError as exc:
                seen[f"{name}/{what}"] = type(exc).__name__
    print(json.dumps(seen))
"""

@pytest.mark.parametrize("tier", ["process", "bwrap", "forkserver"])
@pytest.mark.parametrize("user", DRAINER_USERS)
def test_a_job_reads_no_supervisor_configuration_in_any_cmdline_or_environ(
        user: str | None, tier: str, dsn: str, queue: Queue, sql: Any, shared: Path) -> None:
    """A job (every tier on the host's kernel, every drainer user) reads every ``/proc/<pid>/cmdline``
    and ``environ`` it can see but its own: none names
    the drainer's pid, the work directory (its workspace among it) or the handlers directory, nor
    any of the supervisor's settings (its rlimits, uid, deadline, mounts). The job sees its
    namespace's init (a fork of its supervisor) as ``/proc/1``: its command line is
    ``python -I -S <fleetless>/_supervisor.py N``, its settings come on a pipe, and its environment
    (the job's own) is not readable. Before, ``/proc/1/cmdline`` held all of the supervisor's
    arguments: the workspace's path, the work directory's, the rlimits, the job's uid and the
    handlers' path. bwrap's init shows ``bwrap --args N -- <the job's argv>`` (its options come on
    a pipe), the fork server's ``python -s -``."""
    need_tier(tier)
    uid = _drainer(user)
    if tier == "forkserver" and user == "fleetless-ci2":
        pytest.skip("the fork server needs a root drainer or a subordinate uid range")
    h = handlers_dir(shared, **{"snoop.py": SNOOP})
    work = work_dir(shared, uid)
    queue.enqueue("snoop", {}, max_attempts=1)
    d = drain(dsn, h, work, tier=tier, user=uid, start=True)
    assert isinstance(d, subprocess.Popen)
    _, err = d.communicate(timeout=180)
    assert d.returncode == 0, err
    [(status, result, error)] = sql("SELECT status, result, last_error FROM fleetless.jobs")
    assert status == "done", (error, err)
    seen: dict[str, str] = json.loads(result)
    assert "1/cmdline" in seen, seen  # the job's namespace's init, at least
    if tier == "process":  # its supervisor's fork: the program and its settings' descriptor only
        init = seen["1/cmdline"].split("\0")
        assert init[-3].endswith("_supervisor.py") and init[-2].isdigit() and init[-1] == "", init
    for where, text in seen.items():
        words = text.split("\0")
        assert str(d.pid) not in words, (where, words)
        for secret in (str(work), str(h), str(shared), "RLIMIT_"):
            assert secret not in text, (where, secret, words)
        if where.endswith("/environ"):
            assert text in ("PermissionError", ""), (where, text)
