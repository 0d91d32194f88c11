"""The ``forkserver`` tier through real drains: jobs keep the handler contract and their isolation,
and the fork server itself leaks nothing from one job to the next (issue 11).

Every outcome is read from the table; what the fork server is asserted on beside that (how many
servers ran) is read from the drainer process's client, which started them.
"""

from __future__ import annotations

import json
import os
import threading
import uuid
from collections import Counter
from pathlib import Path

import pytest

from fleetless import Queue
from fleetless.drainer import DrainConfig, Drainer
from fleetless.sandbox import Limits, SandboxUnavailable
from fleetless.sandbox.forkserver import client

from proctools import alive, descendants, pids_with, wait_for

MiB = 1024 * 1024
pytestmark = pytest.mark.usefixtures("private_workdir")


@pytest.fixture(autouse=True)
def _tier(require_tier) -> None:
    require_tier("forkserver")


@pytest.fixture(autouse=True)
def _fresh_servers():
    """Each test starts without a server of an earlier test, and leaves none running."""
    client.close_all()
    yield
    client.close_all()


def _drain(queue: Queue, handlers_dir: Path, concurrency: int = 1, **limits: object) -> None:
    lim = Limits(**{"memory_bytes": 256 * MiB, **limits})  # type: ignore[arg-type]
    Drainer(queue, DrainConfig(handlers_dir=handlers_dir, sandbox="forkserver", concurrency=concurrency,
                               timeout=60, limits=lim)).run()


def _argv(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def _rows(sql) -> dict[int, tuple]:
    return {r[0]: r[1:] for r in sql("SELECT id, status, result, last_error FROM fleetless.jobs")}


def test_jobs_keep_the_handler_contract_through_the_fork_server(queue: Queue, handlers, sql,
                                                               private_workdir: Path) -> None:
    """``python3 handler.py payload.json``: __main__, argv, cwd and HOME, the exact environment, exit
    codes, atexit, SystemExit with a message, an uncaught exception, a signal, KeyboardInterrupt,
    stdout and stderr, a timeout; and a non-Python handler run by exec."""
    h = handlers(**{"contract.py": """
        import atexit, json, os, sys
        p = json.load(open(sys.argv[1]))
        atexit.register(lambda: print("atexit ran"))
        assert __name__ == "__main__" and sys.argv == ["/handlers/contract.py", "/workspace/payload.json"]
        assert os.getcwd() == os.environ["HOME"] == "/workspace" and sys.path[0] == "/handlers"
        print(p["n"] * 2, " ".join(sorted(os.environ)), os.getpid(), os.uname().nodename)
    """, "code.py": "import sys; print('partial'); sys.exit(3)",
        "message.py": "raise SystemExit('bad input')",
        "boom.py": "raise ValueError('no good')",
        "term.py": "import os, signal; os.kill(os.getpid(), signal.SIGTERM)",
        "interrupt.py": "raise KeyboardInterrupt",
        "hang.py": "import time; time.sleep(600)",
        "shell": """
        #!/bin/sh
        echo "shell saw $(cat "$1") as $(id -u) in $(pwd)"
        echo oops >/dev/stderr
    """})
    ok = queue.enqueue("contract", {"n": 21})
    code = queue.enqueue("code", {}, max_attempts=1)
    message = queue.enqueue("message", {}, max_attempts=1)
    boom = queue.enqueue("boom", {}, max_attempts=1)
    term = queue.enqueue("term", {}, max_attempts=1)
    interrupt = queue.enqueue("interrupt", {}, max_attempts=1)
    hung = queue.enqueue("hang", {}, max_attempts=1, timeout=2)
    shell = queue.enqueue("shell", {"x": 1})
    _drain(queue, h, concurrency=2)
    rows = _rows(sql)
    assert rows[ok] == (
        "done", "42 FLEETLESS_ATTEMPT FLEETLESS_JOB_ID FLEETLESS_KIND FLEETLESS_SNOOZES HOME LANG PATH 2 fleetless\n"
                "atexit ran\n", None)
    assert rows[code][0] == "dead" and rows[code][2].startswith("exit code 3")
    assert rows[message][0] == "dead" and rows[message][2].startswith("exit code 1: bad input")
    assert rows[boom][0] == "dead" and "ValueError: no good" in rows[boom][2]
    assert rows[boom][2].startswith("exit code 1")
    assert rows[term][0] == "dead" and "SIGTERM" in rows[term][2]
    assert rows[interrupt][0] == "dead" and "SIGINT" in rows[interrupt][2]
    assert rows[hung][0] == "dead" and rows[hung][2].startswith("killed: timeout after 2 s")
    assert rows[shell][0] == "done" and rows[shell][1].startswith('shell saw {"x": 1} as 20'), rows[shell]
    assert rows[shell][1].endswith(" in /workspace\n")
    # a workspace is a tmpfs of its job's mount namespace: nothing of it is ever in the work directory
    assert not private_workdir.exists() or list(private_workdir.glob("ws-*")) == []


def test_handler_scripts_run_compiled_once_by_the_server_as_python3_compiles_them(
        queue: Queue, handlers, sql, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The server compiles the handlers' top-level scripts once (a job then runs the code object
    instead of compiling its script again) exactly as ``python3 FILE`` would: none of the server's
    own ``__future__`` flags (string annotations), the script's path in tracebacks, a script that
    does not compile failing its own job with the SyntaxError. Too big, not ``.py``, not a file,
    warning when compiled, or too deep for the compiler: left to the job (never the server's end)."""
    h = handlers(**{"annotated.py": """
        import sys
        def f(x: int) -> None:
            raise ValueError("from the handler")
        print(f.__annotations__["x"] is int, __file__, __name__, sys.argv[0])
        f(1)
    """, "broken.py": "def (:\n"})
    annotated = queue.enqueue("annotated", {}, max_attempts=1)
    broken = queue.enqueue("broken", {}, max_attempts=1)
    _drain(queue, h)
    rows = _rows(sql)
    assert rows[annotated][:2] == ("dead", "True /handlers/annotated.py __main__ /handlers/annotated.py\n")
    assert 'File "/handlers/annotated.py", line 3, in f' in rows[annotated][2]
    assert rows[broken][0] == "dead" and "SyntaxError" in rows[broken][2]

    from fleetless.sandbox.forkserver import _server

    (tmp_path / "job.py").write_text("print('compiled at start', __name__)\n")
    (tmp_path / "big.py").write_text("x = 1\n" * (_server._MAX_SCRIPT // 6 + 1))
    (tmp_path / "bad.py").write_text("def (:\n")
    (tmp_path / "notes.txt").write_text("print(1)\n")
    (tmp_path / "pkg.py").mkdir()
    (tmp_path / "deep.py").write_text("x = " + "-" * 100_000 + "1\n")  # RecursionError or MemoryError
    (tmp_path / "warns.py").write_text("x = '\\d'\n")  # python3 warns on every run: its job compiles it
    _server._compiled.clear()
    try:
        _server.compile_scripts(str(tmp_path))
        assert sorted(_server._compiled) == [f"{tmp_path}/job.py"]
        (tmp_path / "job.py").write_text("print('read again')\n")  # (a snapshot never changes: shows which runs)
        _server._run_script(f"{tmp_path}/job.py")
        assert capsys.readouterr().out == "compiled at start __main__\n"
    finally:
        _server._compiled.clear()


def test_a_job_scanning_its_own_memory_finds_no_earlier_jobs_payload(queue: Queue, handlers, sql) -> None:
    """A secret in one job's payload (and in its memory, many times over) is nowhere in the memory
    of a later job forked from the same server; the scan does find the later job's own secret."""
    h = handlers(**{"holder.py": """
        import json, sys
        p = json.load(open(sys.argv[1]))
        kept = [p["secret"] + " " * i for i in range(1000)]
        print("held")
    """, "scanner.py": """
        import hashlib, json, re, sys
        p = json.load(open(sys.argv[1]))
        own = json.load(open(sys.argv[1]))["own"]  # a secret of its own, as a control
        found = set()
        with open("/proc/self/maps") as maps, open("/proc/self/mem", "rb", 0) as mem:
            for line in maps:
                span, perms = line.split()[:2]
                if "r" not in perms or "[vsyscall]" in line or "[vvar" in line:
                    continue
                lo, hi = (int(x, 16) for x in span.split("-"))
                try:
                    mem.seek(lo)
                    data = mem.read(hi - lo)
                except OSError:
                    continue
                for m in re.finditer(rb"FLEETLESS-SECRET-[0-9a-f]{32}", data):
                    found.add(hashlib.sha256(m.group()).hexdigest())
        print(json.dumps({"earlier": p["earlier"] in found, "own": hashlib.sha256(own.encode()).hexdigest() in found}))
    """})
    secret = f"FLEETLESS-SECRET-{uuid.uuid4().hex}"
    digest = __import__("hashlib").sha256(secret.encode()).hexdigest()
    first = queue.enqueue("holder", {"secret": secret})
    _drain(queue, h)
    scanner = queue.enqueue("scanner", {"earlier": digest, "own": f"FLEETLESS-SECRET-{uuid.uuid4().hex}"})
    _drain(queue, h)  # the same drainer process: the same fork server
    rows = _rows(sql)
    assert rows[first][:2] == ("done", "held\n")
    assert rows[scanner][0] == "done", rows[scanner]
    assert json.loads(rows[scanner][1]) == {"earlier": False, "own": True}
    assert len(client.running()) == 1


def test_a_job_cannot_find_the_drainers_environment(queue: Queue, handlers, sql,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing of the drainer's environment is in the job's environment, in the environment or
    command line of any process it can see, or in its own memory."""
    marker = f"drainer-secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("FLEETLESS_TEST_SECRET", marker)
    h = handlers(**{"look.py": """
        import json, os, sys
        marker = json.load(open(sys.argv[1]))["m"][::-1]
        where = [k for k, v in os.environ.items() if marker in v]
        seen = 0
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            seen += 1
            for name in ("environ", "cmdline"):
                try:
                    if marker.encode() in open(f"/proc/{pid}/{name}", "rb").read():
                        where.append(f"{pid}/{name}")
                except OSError:
                    pass
        with open("/proc/self/maps") as maps, open("/proc/self/mem", "rb", 0) as mem:
            hits = 0
            for line in maps:
                span, perms = line.split()[:2]
                if "r" not in perms or "[v" in line:
                    continue
                lo, hi = (int(x, 16) for x in span.split("-"))
                try:
                    mem.seek(lo)
                    hits += mem.read(hi - lo).count(marker.encode())
                except OSError:
                    pass
        print(json.dumps({"where": where, "processes": seen, "in_memory": hits}))
    """})
    job = queue.enqueue("look", {"m": marker[::-1]})
    _drain(queue, h)
    status, result, _ = _rows(sql)[job]
    assert status == "done"
    found = json.loads(result)
    # the only processes it sees are its init and itself; the marker is only its own copy
    assert found["where"] == [] and found["processes"] == 2 and found["in_memory"] <= 2
    # the server itself: started with an empty environment, one thread, no fd but its socket and
    # its pid namespace's (and /dev/null as 0-2)
    (server,) = client.running()
    assert open(f"/proc/{server.pid}/environ", "rb").read() == b""
    status = open(f"/proc/{server.pid}/status").read()
    assert "\nThreads:\t1\n" in status
    fds = {int(fd): os.readlink(f"/proc/{server.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{server.pid}/fd")}
    assert [fds[n] for n in (0, 1, 2)] == ["/dev/null"] * 3
    assert sorted(t.split(":")[0] for n, t in fds.items() if n > 2) == ["pid", "socket"], fds


def test_a_jobs_setsid_daemon_dies_with_it(queue: Queue, handlers, sql) -> None:
    marker = f"fleetless-daemon-{uuid.uuid4().hex}"
    h = handlers(**{"daemon.py": """
        import json, os, subprocess, sys
        m = json.load(open(sys.argv[1]))["m"]
        subprocess.Popen([sys.executable, "-c", "import os, time; os.fork() or time.sleep(600); time.sleep(600)", m],
                         start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print("left a daemon")
    """})
    job = queue.enqueue("daemon", {"m": marker})
    _drain(queue, h)
    assert _rows(sql)[job][:2] == ("done", "left a daemon\n")
    assert pids_with(marker) == []


def test_memory_and_pids_caps_and_the_timeout_kill_the_job(queue: Queue, handlers, sql) -> None:
    h = handlers(**{"eat.py": "x = bytearray(1024 * 1024 * 1024); x[::4096] = b'x' * len(x[::4096])",
                    "forks.py": """
        import os, time
        while True:
            if os.fork() == 0:
                time.sleep(60)
    """, "spin.py": "while True: pass"})
    eat = queue.enqueue("eat", {}, max_attempts=1)
    forks = queue.enqueue("forks", {}, max_attempts=1, timeout=20)
    spin = queue.enqueue("spin", {}, max_attempts=1, timeout=2)
    _drain(queue, h, memory_bytes=128 * MiB, pids=16)
    rows = _rows(sql)
    assert rows[eat][0] == "dead" and rows[eat][2].startswith("killed: memory limit 128 MiB exceeded"), rows[eat]
    assert rows[forks][0] == "dead" and rows[forks][2].startswith("killed: pids limit 16 reached"), rows[forks]
    assert rows[spin][0] == "dead" and rows[spin][2].startswith("killed: timeout after 2 s"), rows[spin]


def test_concurrent_jobs_run_as_distinct_uids_never_root(queue: Queue, handlers, sql) -> None:
    h = handlers(**{"who.py": """
        import json, os, time
        start = time.time()
        time.sleep(1.5)
        print(json.dumps({"uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(),
                          "fds": sorted(os.listdir("/proc/self/fd")),
                          "caps": [l.split()[1] for l in open("/proc/self/status") if l.startswith("Cap")],
                          "nnp": [l.split()[1] for l in open("/proc/self/status") if l.startswith("NoNewPrivs")],
                          "seccomp": [l.split()[1] for l in open("/proc/self/status") if l.startswith("Seccomp:")],
                          "span": [start, time.time()]}))
    """})
    jobs = [queue.enqueue("who", {}) for _ in range(4)]
    _drain(queue, h, concurrency=2)
    rows = _rows(sql)
    got = [json.loads(rows[j][1]) for j in jobs]
    for g in got:
        assert g["uid"] == g["gid"] and g["uid"] not in (0, os.getuid()) and g["groups"] == []
        assert set(g["caps"]) == {"0000000000000000"} | ({g["caps"][3]} if len(g["caps"]) > 3 else set())
        assert g["caps"][:3] == ["0000000000000000"] * 3  # inheritable, permitted, effective
        assert g["nnp"] == ["1"] and g["seccomp"] == ["2"]
        assert g["fds"] == ["0", "1", "2", "3"]  # stdin, stdout, stderr, and the listing's own
    overlapping = [(a, b) for i, a in enumerate(got) for b in got[i + 1:]
                   if a["span"][0] < b["span"][1] and b["span"][0] < a["span"][1]]
    assert overlapping, "no two jobs ran at once"
    assert all(a["uid"] != b["uid"] for a, b in overlapping)


_SERVER_ID = """
    import json, sys
    print(id(sys.modules["json"]), VERSION)  # the server's address layout: the same for its children
"""


def test_the_server_is_replaced_after_n_jobs_and_when_the_handlers_change(
        queue: Queue, handlers, sql, monkeypatch: pytest.MonkeyPatch) -> None:
    """With FLEETLESS_FORKSERVER_JOBS=2 no server forks more than two jobs' inits (ready inits
    included), and a retired server whose inits are all gone has exited; after the handlers
    change, the next job runs in a new server and the old servers take no more jobs."""
    monkeypatch.setenv(client.JOBS_ENV, "2")
    h = handlers(**{"which.py": _SERVER_ID.replace("VERSION", "1")})
    first = [queue.enqueue("which", {}) for _ in range(5)]
    _drain(queue, h)
    rows = _rows(sql)
    assert all(rows[j][0] == "done" and rows[j][1].split()[1] == "1" for j in first)
    ids = Counter(rows[j][1].split()[0] for j in first)
    assert len(ids) >= 3 and max(ids.values()) <= 2, ids
    servers = client.started()
    assert all(s.jobs <= 2 for s in servers)
    assert all(s.proc.poll() is not None for s in servers if s.retired and s.live == 0)
    monkeypatch.setenv(client.JOBS_ENV, "100")
    handlers(**{"which.py": _SERVER_ID.replace("VERSION", "2")})
    changed = queue.enqueue("which", {})
    _drain(queue, h)
    rows = _rows(sql)
    assert rows[changed][0] == "done" and rows[changed][1].split()[1] == "2"
    assert rows[changed][1].split()[0] not in ids
    assert all(s.retired for s in servers)  # the old handlers' servers fork nothing more
    live = [s for s in client.started() if s.proc.poll() is None and not s.retired]
    assert len(live) == 1 and live[0] not in servers
    # and after FLEETLESS_FORKSERVER_SECONDS: the next job runs in a new server
    client.close_all()
    monkeypatch.setenv(client.SECONDS_ENV, "1")
    early = queue.enqueue("which", {})
    _drain(queue, h)
    before = client.started()
    wait_for(lambda: all(s.expired() for s in before), timeout=30, what="the servers' lifetime to run out")
    late = queue.enqueue("which", {})
    _drain(queue, h)
    rows = _rows(sql)
    assert rows[early][0] == rows[late][0] == "done"
    assert rows[early][1].split()[0] != rows[late][1].split()[0]
    assert len(client.started()) > len(before)  # a new server, not an expired one's ready init


def test_sigkill_of_the_drainer_kills_its_fork_server_and_every_process_of_its_jobs(
        dsn: str, queue: Queue, handlers, sql, private_workdir: Path) -> None:
    """The server and the running job's whole tree (its setsid daemon too) die with a drainer
    killed by SIGKILL, and the next drain sweeps what it left (cgroups, the server's directory) and
    runs the job again."""
    import signal
    import subprocess
    import sys

    from fleetless.sandbox import cgroups

    marker = f"fleetless-killed-{uuid.uuid4().hex}"
    h = handlers(**{"sleeper.py": """
        import json, os, subprocess, sys, time
        if os.environ["FLEETLESS_ATTEMPT"] == "1":
            m = json.load(open(sys.argv[1]))["m"]
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", m], start_new_session=True)
            subprocess.run([sys.executable, "-c", "import time; time.sleep(600)", m])
        print("second attempt")
    """})
    queue.enqueue("sleeper", {"m": marker}, timeout=3)
    env = {**os.environ, "DATABASE_URL": dsn, "FLEETLESS_WORKDIR": str(private_workdir)}
    proc = subprocess.Popen([sys.executable, "-m", "fleetless.cli", "drain", "--handlers", str(h),
                             "--sandbox", "forkserver", "--lease-grace", "3"], env=env)
    wait_for(lambda: len(pids_with(marker)) >= 2, timeout=60, what="the job and its daemon to run")
    servers = [pid for pid in descendants(proc.pid) if _argv(pid)[1:] == ["-s", "-"]]  # python -s -
    assert servers, "no fork server of the drainer"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    wait_for(lambda: not pids_with(marker) and not any(alive(pid) for pid in servers), timeout=30,
             what="the job's processes and the fork server to die")
    wait_for(lambda: sql("SELECT lease_expires_at < now() FROM fleetless.jobs") == [(True,)], timeout=60,
             what="the killed drainer's lease to run out")
    again = subprocess.run([sys.executable, "-m", "fleetless.cli", "drain", "--handlers", str(h),
                            "--sandbox", "forkserver"], env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert sql("SELECT status, attempts, result FROM fleetless.jobs") == [("done", 2, "second attempt\n")]
    assert list(private_workdir.glob(f"srv-{proc.pid}-*")) == []  # swept
    layout = cgroups.detect()
    bases = [*layout.v1.values(), *([layout.unified] if layout.unified else [])]
    assert [e for base in bases if base.is_dir() for e in base.iterdir()
            if cgroups._owner_pid(e.name) == proc.pid] == []


def test_a_pool_closed_while_it_makes_an_init_says_nothing_and_its_thread_ends(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The drain's end (close_all at exit) kills the server under an init the pool is making: that
    init's failure is the close's doing, not a warning for the log, and the filling thread stops
    instead of living on beside the next pool's."""
    making, gate = threading.Event(), threading.Event()

    class Slow:  # an Init whose server is closed under it, as at the drain's end
        def __init__(self, key: object, root: object) -> None:
            making.set()
            gate.wait(10)
            raise SandboxUnavailable("the fork server's job init failed: it exited")

    monkeypatch.setattr(client, "Init", Slow)
    pool = client.Pool(size=1)
    key = client.ServerKey("/usr/bin/python3", "/nonexistent", False)
    with pool._cond:
        pool._roots[key] = lambda: client.RootSpec((), (), None)  # a key in use, with no init ready
    pool.refill()
    assert making.wait(10)
    thread = pool._thread
    assert thread is not None
    pool.close()
    gate.set()
    thread.join(10)
    assert not thread.is_alive()
    assert "fork server pool" not in caplog.text


def test_the_fork_servers_command_line_says_nothing_of_its_configuration(queue: Queue, handlers, sql,
                                                                          private_workdir: Path) -> None:
    """Every job sees its init, forked from the server, as ``/proc/1/cmdline``: it is ``python -s -``
    (the code came on stdin, the configuration on its socket), no paths, no drainer pid (issue 25,
    item 9)."""
    h = handlers(**{"cmdline.py": """
        import json
        print(json.dumps(open("/proc/1/cmdline", "rb").read().decode().split("\\0")))
    """})
    queue.enqueue("cmdline", {})
    _drain(queue, h)
    [(status, result, error)] = _rows(sql).values()
    assert status == "done", error
    argv = json.loads(result)
    assert argv[1:] == ["-s", "-", ""], argv
    assert str(os.getpid()) not in result and "mountpoint" not in result and str(private_workdir) not in result


def test_where_the_seccomp_filter_cannot_be_built_the_tier_is_refused_not_run_unfiltered(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The fork server keeps bwrap's promises or does not run: without the filter (pyseccomp or
    libseccomp missing) check() refuses it with one line saying why, so ``auto`` passes on to the
    next tier. Before, its jobs ran without a filter and nothing said so."""
    from fleetless.sandbox import get_backend
    from fleetless.sandbox.bwrap import _seccomp

    def gone() -> Path:
        raise SandboxUnavailable("cannot build the seccomp filter (pyseccomp, libseccomp2): gone")

    monkeypatch.setattr(_seccomp, "seccomp_file", gone)
    with pytest.raises(SandboxUnavailable) as err:
        get_backend("forkserver").check()
    assert str(err.value) == ("the fork server loads bwrap's seccomp filter into every job: cannot build the"
                              " seccomp filter (pyseccomp, libseccomp2): gone")
