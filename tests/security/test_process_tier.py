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

KILL_SUPERVISOR = """
    import json, os, signal, sys, time
    marker = json.load(open(sys.argv[1]))["marker"]
    supervisor = os.getppid()
    r, w = os.pipe()
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:  # a daemon in a session of its own that kills the job's supervisor
            try:
                os.kill(supervisor, signal.SIGKILL)
                outcome = "killed"
            except PermissionError:
                outcome = "EPERM"
            os.write(w, outcome.encode())
            os.close(w)
            os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(600)", marker])
        os._exit(0)
    os.close(w)
    outcome = os.read(r, 100).decode()
    print(outcome, flush=True)
    if outcome != "killed":
        sys.exit(3)
    time.sleep(600)
"""

GARBAGE_STATUS = """
    import os, sys
    supervisor = os.getppid()
    argv = open(f"/proc/{supervisor}/cmdline", "rb").read().split(b"\\0")
    fd = int(argv[4])  # python -I -S _supervisor.py STATUS_FD ...
    try:
        with open(f"/proc/{supervisor}/fd/{fd}", "wb") as f:
            f.write(b"\\x1b]0;pwned\\x07not a status\\ndrained: claimed 9, done 9\\n")
    except OSError as exc:
        print(type(exc).__name__)
        sys.exit(3)
    print("wrote")
"""

PROBE_DRAINER = """
    import json, os, signal, sys, time
    args = json.load(open(sys.argv[1]))
    supervisor = os.getppid()
    stat = open(f"/proc/{supervisor}/stat").read()
    drainer = int(stat[stat.rindex(")") + 2:].split()[1])

    def attempt(name, call):
        try:
            call()
            return "allowed"
        except OSError as exc:
            return type(exc).__name__

    def forge():
        with open(f"/proc/{drainer}/fd/2", "w") as f:
            f.write("\\x1b]0;pwned\\x07drained: claimed 1, done 1 (forged)\\n")

    out = {
        "uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(),
        "environ": attempt("environ", lambda: open(f"/proc/{drainer}/environ", "rb").read()),
        "mem": attempt("mem", lambda: open(f"/proc/{drainer}/mem", "rb").close()),
        "terminal": attempt("terminal", forge),
        "handlers": attempt("handlers", lambda: open(os.path.join(args["handlers"], "planted.py"), "w").close()),
        "signal": attempt("signal", lambda: os.kill(supervisor, 0)),
        "signal_drainer": attempt("signal", lambda: os.kill(drainer, 0)),
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
def test_a_setsid_daemon_that_kills_its_supervisor_is_killed_with_the_job_and_the_job_is_charged(
        user: int | None, dsn: str, queue: Queue, sql: Any, shared: Path) -> None:
    need_user(user)
    marker = f"fleetless-daemon-{uuid.uuid4().hex}"
    h = handlers_dir(shared, **{"hostile.py": KILL_SUPERVISOR})
    work = work_dir(shared, user)
    queue.enqueue("hostile", {"marker": marker}, max_attempts=1)
    try:
        r = drain(dsn, h, work, "--timeout", "120", user=user)
        assert r.returncode == 0, r.stderr
        [(status, attempts, error, result)] = sql("SELECT status, attempts, last_error, result FROM fleetless.jobs")
        assert (status, attempts) == ("dead", 1), error
        if user is None:
            # A root drainer's job runs as a uid of its own: its supervisor (root) is out of reach;
            # its daemon dies with the job's tree all the same.
            assert result.strip() == "EPERM" and error.startswith("exit code 3"), (result, error)
            wait_for(lambda: not pids_with(marker), timeout=10, what="the daemon to be gone")
        else:
            # A non-root drainer's job can kill its supervisor: that is the job's own failure,
            # charged at once (not after its timeout). Its daemon dies too only where the drainer
            # can make a cgroup (not here: see docs/isolation.md).
            assert error.startswith("killed: its supervisor died (killed by SIGKILL)"), error
    finally:
        kill_all(marker)


@pytest.mark.parametrize("user", AS_ROOT_AND_NOT)
def test_garbage_in_the_supervisors_status_pipe_is_the_jobs_own_charged_failure(
        user: int | None, dsn: str, queue: Queue, sql: Any, shared: Path) -> None:
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
    if user is None:  # a root drainer's job cannot even open its supervisor's pipe
        assert result.strip() == "PermissionError" and error.startswith("exit code 3"), (result, error)
    else:
        assert error.startswith("killed: the job wrote into its supervisor's status pipe"), error
    assert [(k, s, a) for k, s, a, _, _ in good] == [("ok", "done", 1)] * 3


def test_a_root_drainers_jobs_run_as_distinct_unprivileged_uids_that_cannot_reach_the_drainer(
        dsn: str, queue: Queue, sql: Any, shared: Path) -> None:
    need_user(None)
    h = handlers_dir(shared, **{"probe.py": PROBE_DRAINER})
    work = work_dir(shared, None)
    seen = open_to_jobs(shared / "seen")
    queue.enqueue_many([{"kind": "probe", "payload": {"handlers": str(h), "seen": str(seen)}}] * 2)
    r = drain(dsn, h, work, "--concurrency", "2", env={"FLEETLESS_TEST_SECRET": "do-not-leak"})
    assert r.returncode == 0, r.stderr
    assert "forged" not in r.stderr and "\x1b" not in r.stderr, r.stderr
    rows = sql("SELECT status, result FROM fleetless.jobs ORDER BY id")
    assert [s for s, _ in rows] == ["done", "done"], rows
    probes = [json.loads(result) for _, result in rows]
    assert len({p["uid"] for p in probes}) == 2  # two jobs at once: two uids
    for p in probes:
        assert p["uid"] not in (0, os.getuid()) and p["gid"] == p["uid"] and p["groups"] == [], p
        for what in ("environ", "mem", "terminal", "handlers", "signal", "signal_drainer"):
            assert p[what] == "PermissionError", (what, p)
    assert sorted(os.listdir(h)) == ["probe.py"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("tier", ["process", "bwrap", pytest.param("microvm", marks=pytest.mark.slow)])
def test_a_signal_to_the_drains_process_group_winds_down_the_drain_without_charging_a_job(
        tier: str, sig: signal.Signals, dsn: str, queue: Queue, sql: Any, shared: Path) -> None:
    """Ctrl-C at a terminal (SIGINT to the foreground process group) or ``kill -TERM -- -PGID``:
    the drainer stops claiming and lets the running jobs finish within the grace; no job is
    killed, charged or released."""
    need_tier(tier)
    kind = f"sleepy{uuid.uuid4().hex[:12]}"
    h = handlers_dir(shared, **{f"{kind}.py": "import time\ntime.sleep(4)\nprint('finished')\n"})
    work = work_dir(shared, None)
    queue.enqueue_many([{"kind": kind, "payload": {}, "max_attempts": 1}] * 4)
    d = drain(dsn, h, work, "--concurrency", "2", "--shutdown-grace", "120", tier=tier, start=True)
    assert isinstance(d, subprocess.Popen)
    try:
        wait_for(lambda: len(set(pids_with("qemu-system" if tier == "microvm" else f"{kind}.py"))
                             & descendants(d.pid)) >= 2, timeout=120, what="two jobs running")
        os.killpg(d.pid, sig)  # the whole process group, as a terminal or `kill -- -PGID` does
        out, err = d.communicate(timeout=180)
    finally:
        if d.poll() is None:
            d.kill()
            d.wait()
    assert d.returncode == 0, err
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
