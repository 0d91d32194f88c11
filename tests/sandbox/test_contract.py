"""The sandbox protocol's contract, one suite run against every tier (as Oban's engine tests and
River's driver tests run against each implementation).

Every tier registered in ``fleetless.sandbox`` runs these tests: a new tier inherits them by
registering itself, and says here (``PROMISES``) only where it promises less or differently. What
each test checks is what the protocol (``fleetless/sandbox/__init__.py``) states for every tier:
exit codes and captured output, the cut of a long stdout and stderr, the timeout and TTL kills
and their wording, the memory and pids caps, no network, the exact environment, writes kept in
the workspace, exec never raising for the job's own failures, and kill() idempotent, returning
only once every process of the job is gone and its workspace removed.

Tier-specific behaviour (bwrap's uid and mount view, the process tier's rlimit wording, the microVM's
frames and boots) stays in ``test_<tier>.py``. A microVM boots per exec (seconds under TCG), so only
the cases marked ``microvm`` run on it, with generous timeouts; no test asserts on wall time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fleetless.sandbox import (
    ExecResult,
    Limits,
    Sandbox,
    SandboxUnavailable,
    Template,
    available_backends,
    cgroups,
    get_backend,
)

from proctools import alive, pids_with, wait_for

MiB = 1024 * 1024
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "ONLY": "this"}


@dataclass(frozen=True)
class Promises:
    """Where a tier promises less than (or other than) the whole contract."""

    #: No interface but loopback (the process tier: where the kernel gives its jobs namespaces,
    #: ``jobs_own_network``; else they share the drainer's network, docs/isolation.md).
    no_network: bool = True
    #: A job over ``memory_bytes`` is killed and told so ("killed: memory limit N MiB exceeded").
    #: False: the cap is an address-space rlimit, so the job's allocation fails instead.
    memory_kill: bool = True
    #: The memory and pids caps are cgroups, which only a drainer that can write them gets.
    caps_need_cgroups: bool = True
    #: A fork bomb is killed when it reaches ``pids`` and the kill names it; False: an rlimit stops
    #: its forks and it runs on to its timeout.
    pids_kill: bool = True
    #: Each exec boots a machine: only the tests marked for it run (see ``contract``).
    boots: bool = False
    #: A sandbox runs one exec (the drainer never runs more); a second is refused.
    one_exec: bool = False
    #: Variables the tier adds to the template's environment besides HOME.
    extra_env: frozenset[str] = frozenset()
    #: kill() returns only once every process of the job is gone. False: it signals them and
    #: returns, and they are gone moments later (a gap, said in docs/guarantees.md).
    kill_waits: bool = True


PROMISES: dict[str, Promises] = {
    "process": Promises(memory_kill=False,
                        extra_env=frozenset({"TMPDIR"})),  # in its workspace: the host's /tmp is shared
    "bwrap": Promises(extra_env=frozenset({"PWD"})),  # bubblewrap's --chdir sets PWD
    "forkserver": Promises(one_exec=True),
    "microvm": Promises(caps_need_cgroups=False, pids_kill=False, boots=True),
}


def _unavailable(name: str) -> str | None:
    try:
        get_backend(name).check()
    except SandboxUnavailable as exc:
        return str(exc)
    return None


def _tier_param(name: str) -> Any:
    marks = [pytest.mark.slow] if PROMISES.get(name, Promises()).boots else []
    return pytest.param(name, marks=marks, id=name)


def contract(*, microvm: bool = False) -> pytest.MarkDecorator:
    """Run the test on every registered tier; on booting tiers only when ``microvm``."""
    names = [n for n in available_backends() if microvm or not PROMISES.get(n, Promises()).boots]
    return pytest.mark.parametrize("tier", [_tier_param(n) for n in names], indirect=True)


@dataclass
class Tier:
    """One tier under test, with what the suite needs to watch it from the host."""

    name: str
    backend: type[Sandbox]
    promises: Promises
    handlers_dir: Path
    workdir: Path
    made: list[Sandbox]

    def create(self, *, ttl: float = 120, env: dict[str, str] | None = None, **limits: Any) -> Sandbox:
        base = {"memory_bytes": 128 * MiB} if self.promises.boots else {}
        template = Template(self.handlers_dir, Limits(**{**base, **limits}), dict(ENV if env is None else env))
        sbx = self.backend.create(template, ttl)
        self.made.append(sbx)
        return sbx

    def handler(self, name: str, source: str) -> None:
        path = self.handlers_dir / name
        path.write_text(textwrap.dedent(source).lstrip())
        path.chmod(0o755)

    def run(self, sbx: Sandbox, name: str, *args: str, payload: object = None, timeout: float = 60) -> ExecResult:
        sbx.write("payload.json", json.dumps(payload))
        return sbx.exec([sbx.python, f"{sbx.handlers_path}/{name}", f"{sbx.workspace_path}/payload.json", *args],
                        timeout)

    def processes(self, marker: str, parent: int | None = None) -> list[int]:
        """Host processes that run the job carrying ``marker``: its own (host tiers), or its
        machine's (a VM started by ``parent``, default this process: the job lives inside it)."""
        if self.promises.boots:
            return _qemu_children(os.getpid() if parent is None else parent)
        return pids_with(marker)

    def left_on_host(self, name: str) -> list[Path]:
        """Files called ``name`` under FLEETLESS_WORKDIR, where a tier keeps what it has of a job's
        workspace on the host disk (a VM's or a tmpfs workspace has nothing there to leave)."""
        return sorted(self.workdir.rglob(name)) if self.workdir.exists() else []

    def require_caps(self) -> None:
        if self.promises.caps_need_cgroups and not (cgroups.available().memory and cgroups.available().pids):
            pytest.skip(f"{self.name}: no writable memory/pids cgroup (not root, or not delegated)")


def _qemu_children(parent: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1: stat.rindex(")")]
        if comm.startswith("qemu-system") and int(stat[stat.rindex(")") + 2:].split()[1]) == parent:
            found.append(int(entry))
    return [p for p in found if alive(p)]


@pytest.fixture
def tier(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Tier]:
    name: str = request.param
    reason = _unavailable(name)
    if reason is not None:
        pytest.skip(f"{name} cannot run here: {reason}")
    workdir = tmp_path / "work"
    monkeypatch.setenv("FLEETLESS_WORKDIR", str(workdir))
    handlers = tmp_path / "handlers"
    handlers.mkdir()
    handlers.chmod(0o755)
    t = Tier(name, get_backend(name), PROMISES.get(name, Promises()), handlers, workdir, [])
    yield t
    for sbx in t.made:
        sbx.kill()


def test_every_registered_tier_runs_the_contract() -> None:
    ids = [p.id for p in contract(microvm=True).args[1]]
    assert ids == available_backends()


def test_an_unknown_tier_is_a_one_line_error() -> None:
    with pytest.raises(ValueError, match="unknown sandbox backend 'docker'"):
        get_backend("docker")


# -- results ------------------------------------------------------------------------------------

@contract(microvm=True)
def test_payload_in_result_out_exit_code_and_both_streams_cut(tier: Tier) -> None:
    tier.handler("job.py", """
        import json, sys
        print("doubled", json.load(open(sys.argv[1]))["n"] * 2)
        print("line " * 100)
        sys.stderr.write("noise\\n" * 5000)
        sys.stderr.write("the real error\\n")
        sys.exit(3)
    """)
    sbx = tier.create(stdout_bytes=100, stderr_bytes=200)
    r = tier.run(sbx, "job.py", payload={"n": 21}, timeout=120)
    assert (r.exit_code, r.killed, r.ok) == (3, None, False), r
    assert r.stdout.startswith("doubled 42\nline line ") and len(r.stdout) == 100 and r.stdout_cut
    assert r.stderr.endswith("noise\nthe real error\n") and len(r.stderr) == 200


@contract()
def test_a_short_result_is_whole_the_cwd_is_the_workspace_and_a_clean_exit_is_ok(tier: Tier) -> None:
    tier.handler("ok.py", "import os, sys\nprint(open(sys.argv[1]).read(), os.getcwd())\n")
    sbx = tier.create()
    r = tier.run(sbx, "ok.py", payload=[1, "two"])
    assert (r.exit_code, r.stdout, r.stderr, r.killed, r.stdout_cut, r.ok) == \
        (0, f'[1, "two"] {sbx.workspace_path}\n', "", None, False, True)


@contract(microvm=True)
def test_executable_handlers_run_by_their_shebang(tier: Tier) -> None:
    tier.handler("shell", '#!/bin/sh\necho "sh got $(cat "$1")"\n')
    tier.handler("envpy", '#!/usr/bin/env python3\nimport sys\nprint("py got", open(sys.argv[1]).read())\n')
    for name, said in (("shell", "sh got 42\n"), ("envpy", "py got 42\n")):
        sbx = tier.create()
        sbx.write("payload.json", "42")
        r = sbx.exec([f"{sbx.handlers_path}/{name}", f"{sbx.workspace_path}/payload.json"], 120)
        assert (r.exit_code, r.stdout, r.killed) == (0, said, None), r


@contract()
def test_exec_never_raises_for_the_jobs_own_failures(tier: Tier) -> None:
    tier.handler("segv.py", "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    sbx = tier.create()
    missing = sbx.exec([f"{sbx.handlers_path}/nope", "x"], 30)
    assert missing.exit_code != 0 and missing.killed is None and "nope" in missing.stderr
    crashed = tier.run(tier.create(), "segv.py")
    assert crashed.exit_code == -signal.SIGSEGV and not crashed.ok


@contract(microvm=True)
def test_the_environment_is_exactly_the_templates_with_home_the_workspace(
    tier: Tier, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DATABASE_URL", "postgresql://app:secret@db/prod")  # the drainer's, never the job's
    tier.handler("env.py", "import json, os\nprint(json.dumps(dict(os.environ)))\n")
    sbx = tier.create()
    r = tier.run(sbx, "env.py", timeout=120)
    assert r.ok, r
    env = json.loads(r.stdout)
    extra = {k: env.pop(k) for k in tier.promises.extra_env if k in env}
    assert env == {**ENV, "HOME": sbx.workspace_path}, extra


# -- limits and kills ---------------------------------------------------------------------------

SLEEPER = """
import sys, time
print("started", flush=True)
time.sleep(600)
"""


@contract(microvm=True)
def test_a_job_past_its_timeout_is_killed_and_told_so(tier: Tier) -> None:
    tier.handler("slow.py", SLEEPER)
    r = tier.run(tier.create(), "slow.py", timeout=2)
    assert (r.killed, r.exit_code, r.stdout) == ("killed: timeout after 2 s", -signal.SIGKILL, "started\n"), r


@contract()
def test_the_ttl_bounds_every_exec_and_nothing_runs_after_it(tier: Tier) -> None:
    tier.handler("slow.py", SLEEPER)
    sbx = tier.create(ttl=1.5)
    r = tier.run(sbx, "slow.py", timeout=60)
    assert (r.killed, r.exit_code) == ("killed: ttl of 1.5 s expired", -signal.SIGKILL), r
    if not tier.promises.one_exec:
        again = tier.run(sbx, "slow.py", timeout=60)
        assert again.killed == "killed: ttl of 1.5 s expired" and again.stdout == "", again


@contract(microvm=True)
def test_a_memory_bomb_does_not_get_past_the_memory_cap(tier: Tier) -> None:
    tier.require_caps()
    tier.handler("bomb.py", """
        hog = []
        for _ in range(4096):  # 4 GiB, every page touched
            hog.append(b"x" * (1 << 20))
        print("survived")
    """)
    r = tier.run(tier.create(memory_bytes=128 * MiB), "bomb.py", timeout=120)
    assert "survived" not in r.stdout and not r.ok, r
    if tier.promises.memory_kill:
        assert (r.killed, r.exit_code) == ("killed: memory limit 128 MiB exceeded", -signal.SIGKILL), r
    else:
        assert r.exit_code == 1 and "MemoryError" in r.stderr, r


@contract()
def test_cpu_seconds_and_file_size_limits_kill_and_are_named(tier: Tier) -> None:
    tier.handler("spin.py", "while True:\n    pass\n")
    r = tier.run(tier.create(cpu_seconds=1), "spin.py", timeout=60)
    assert r.killed == "killed: cpu time limit 1 s exceeded" and not r.ok, r
    sbx = tier.create(file_size_bytes=MiB)
    r = sbx.exec(["/bin/sh", "-c", "exec head -c 4000000 /dev/zero > big"], 60)
    assert r.killed == "killed: file size limit 1 MiB exceeded" and not r.ok, r


FORK_BOMB = """
import json, os, sys, time
marker = json.load(open(sys.argv[1]))["marker"]  # only in the children's command lines
while True:
    try:
        if os.fork() == 0:
            os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(600)", marker])
    except OSError:
        time.sleep(0.01)
"""


@contract()
def test_a_fork_bomb_is_held_to_the_pids_cap_and_its_tree_dies(tier: Tier) -> None:
    tier.require_caps()
    marker = f"fleetless-bomb-{uuid.uuid4().hex}"
    tier.handler("forkbomb.py", FORK_BOMB)
    sbx = tier.create(pids=32)
    seen: list[int] = []
    result: list[ExecResult] = []
    job = threading.Thread(target=lambda: result.append(
        tier.run(sbx, "forkbomb.py", payload={"marker": marker}, timeout=5)))
    job.start()
    while job.is_alive():
        seen.append(len(tier.processes(marker)))
        job.join(0.05)
    (r,) = result
    assert r.killed is not None and not r.ok, r
    if tier.promises.pids_kill:
        assert r.killed.startswith("killed: pids limit 32 reached"), r
    assert max(seen) < 32  # never more than the cap at once (the bomb itself is one of them)
    assert tier.processes(marker) == []
    assert subprocess.run(["true"]).returncode == 0  # the host can still start processes


@contract()
def test_no_network_but_loopback(tier: Tier) -> None:
    if not tier.promises.no_network:
        pytest.skip(f"{tier.name} shares the drainer's network (docs/isolation.md)")
    if tier.name == "process":
        from fleetless.sandbox.process import jobs_own_network, network_words

        if not jobs_own_network():
            pytest.skip(f"process: {network_words()}")
    tier.handler("net.py", NET_PROBE)
    r = tier.run(tier.create(), "net.py", timeout=120)
    assert r.ok, r
    out = json.loads(r.stdout)
    assert (out["dev"], out["routes"]) == (["lo"], []) and out["sys"] in (None, ["lo"])
    assert out["pg"] in ("ECONNREFUSED", "ENETUNREACH")  # the host's PostgreSQL is out of reach


NET_PROBE = """
import errno, json, os, socket
out = {"dev": [l.split(":")[0].strip() for l in open("/proc/net/dev").read().splitlines()[2:]],
       "routes": open("/proc/net/route").read().splitlines()[1:],
       "sys": sorted(os.listdir("/sys/class/net")) if os.path.isdir("/sys/class/net") else None}
s = socket.socket()
s.settimeout(3)
try:
    s.connect(("127.0.0.1", 5432))
    out["pg"] = "connected"
except OSError as exc:
    out["pg"] = errno.errorcode.get(exc.errno or 0, str(exc))
print(json.dumps(out))
"""

# -- the workspace and the end ------------------------------------------------------------------


@contract(microvm=True)
def test_writes_stay_inside_the_workspace(tier: Tier) -> None:
    sbx = tier.create()
    for outside in ("../escape", "/etc/escape", "a/../../escape", ".."):
        with pytest.raises(ValueError):
            sbx.write(outside, "x")
    sbx.write("nested/dir/payload.json", "{}")
    assert not (tier.workdir / "escape").exists() and not Path("/etc/escape").exists()


DAEMON = """
import json, os, sys, time
job = json.load(open(sys.argv[1]))
marker = job["marker"]  # only in the daemon's command line
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(600)", marker])
    os._exit(0)
os.wait()
print("daemon started", flush=True)
time.sleep(job["then_sleep"])
"""


@contract()
def test_a_daemon_the_job_leaves_behind_dies_with_it(tier: Tier) -> None:
    marker = f"fleetless-daemon-{uuid.uuid4().hex}"
    tier.handler("daemon.py", DAEMON)
    r = tier.run(tier.create(), "daemon.py", payload={"marker": marker, "then_sleep": 0})
    assert r.ok and r.stdout == "daemon started\n", r  # the daemon holding stdout kept nothing waiting
    assert tier.processes(marker) == []


@contract(microvm=True)
def test_kill_returns_only_once_the_jobs_tree_and_workspace_are_gone(tier: Tier) -> None:
    marker = f"fleetless-kill-{uuid.uuid4().hex}"
    tier.handler("daemon.py", DAEMON)
    sbx = tier.create()
    mark = f"mark-{uuid.uuid4().hex}"
    sbx.write(mark, "the job's")
    results: list[ExecResult | BaseException] = []

    def run() -> None:
        try:
            results.append(tier.run(sbx, "daemon.py", payload={"marker": marker, "then_sleep": 600}, timeout=600))
        except BaseException as exc:  # the contract: never; said below
            results.append(exc)

    job = threading.Thread(target=run)
    job.start()
    wait_for(lambda: tier.processes(marker), 120, what="the job's daemon (or its VM) to run")
    sbx.kill()  # from another thread, as the drainer cancels
    if tier.promises.kill_waits:
        assert tier.processes(marker) == []  # at once: kill() returned
    else:
        wait_for(lambda: not tier.processes(marker), 30, what="the job's machine to be gone")
    assert tier.left_on_host(mark) == []
    job.join(60)
    assert not job.is_alive()
    sbx.kill()  # idempotent
    (r,) = results
    assert isinstance(r, ExecResult), r
    assert (r.killed, r.exit_code) == ("killed: sandbox destroyed", -signal.SIGKILL), r


@contract(microvm=True)
def test_kills_from_several_threads_at_once_each_return_once_everything_is_gone(
        tier: Tier, monkeypatch: pytest.MonkeyPatch) -> None:
    """A drainer's cancel kills a batch's sandbox from its poll while the batch's own end kills it:
    two kill() calls at once on the fork server closed the workspace's descriptor twice ("Bad file
    descriptor" ended the drain, CI test_batch_cancel). Every call returns without raising, and
    only once the job's tree and workspace are gone (not while another call still tears down)."""
    marker = f"fleetless-kills-{uuid.uuid4().hex}"
    tier.handler("daemon.py", DAEMON)
    sbx = tier.create()
    mark = f"mark-{uuid.uuid4().hex}"
    sbx.write(mark, "the job's")
    close = os.close

    def slow_close(fd: int) -> None:  # widens every check-then-close window of a teardown
        threading.Event().wait(0.05)
        close(fd)

    job = threading.Thread(target=lambda: tier.run(
        sbx, "daemon.py", payload={"marker": marker, "then_sleep": 600}, timeout=600))
    job.start()
    wait_for(lambda: tier.processes(marker), 120, what="the job's daemon (or its VM) to run")
    monkeypatch.setattr(os, "close", slow_close)
    start = threading.Barrier(4)
    seen: list[tuple[list[int], list[str]] | BaseException] = []

    def kill() -> None:
        start.wait()
        try:
            sbx.kill()
            seen.append((tier.processes(marker) if tier.promises.kill_waits else [], tier.left_on_host(mark)))
        except BaseException as exc:  # the contract: never
            seen.append(exc)

    killers = [threading.Thread(target=kill) for _ in range(4)]
    for t in killers:
        t.start()
    for t in killers:
        t.join(120)
    monkeypatch.undo()
    job.join(60)
    assert not job.is_alive()
    assert seen == [([], [])] * 4, seen
    if not tier.promises.kill_waits:
        wait_for(lambda: not tier.processes(marker), 30, what="the job's machine to be gone")


PARENT = """
import json, sys
from pathlib import Path
from fleetless.sandbox import Limits, Template, get_backend
sbx = get_backend({name!r}).create(Template(Path({handlers!r}), Limits(**{limits!r}), {{"PATH": "/usr/bin:/bin"}}), 600)
sbx.write("payload.json", json.dumps({{"marker": {marker!r}, "then_sleep": 600}}))
sbx.exec([sbx.python, sbx.handlers_path + "/daemon.py", sbx.workspace_path + "/payload.json"], 600)
"""


@contract()
def test_a_kill_whose_exec_lets_the_init_go_meanwhile_still_returns_cleanly(
        tier: Tier, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fork server: kill() waits on the job's init after its SIGKILL, while the exec, seeing it
    killed, lets the init go (closes its pidfd). kill() waited on that very descriptor: "Bad file
    descriptor" ended a drain whose cancel killed a batch's sandbox (CI, test_batch_cancel)."""
    if tier.name != "forkserver":
        pytest.skip("the fork server's kill() and exec() share the job's init")
    import fleetless.sandbox.forkserver as fs

    marker = f"fleetless-kill-{uuid.uuid4().hex}"
    tier.handler("daemon.py", DAEMON)
    sbx = tier.create()
    results: list[ExecResult | BaseException] = []
    job = threading.Thread(target=lambda: results.append(
        tier.run(sbx, "daemon.py", payload={"marker": marker, "then_sleep": 600}, timeout=600)))
    send = signal.pidfd_send_signal

    def send_then_let_the_exec_end(fd: int, sig: int, *args: Any) -> None:
        send(fd, sig, *args)
        if threading.current_thread() is threading.main_thread():
            job.join(60)  # the exec has returned and released the init before kill() waits on it

    monkeypatch.setattr(fs.signal, "pidfd_send_signal", send_then_let_the_exec_end)
    job.start()
    wait_for(lambda: tier.processes(marker), 120, what="the job's daemon to run")
    sbx.kill()
    assert not job.is_alive() and tier.processes(marker) == []
    (r,) = results
    assert isinstance(r, ExecResult) and r.killed == "killed: sandbox destroyed", r


@contract(microvm=True)
def test_a_job_dies_with_its_sigkilled_drainer_and_sweep_leaves_nothing(tier: Tier) -> None:
    marker = f"fleetless-orphan-{uuid.uuid4().hex}"
    tier.handler("daemon.py", DAEMON)
    limits = {"memory_bytes": 128 * MiB} if tier.promises.boots else {}
    code = PARENT.format(name=tier.name, handlers=str(tier.handlers_dir), limits=limits, marker=marker)
    drainer = subprocess.Popen([sys.executable, "-c", code], env=os.environ.copy())
    try:
        wait_for(lambda: tier.processes(marker, parent=drainer.pid), 120, what="the drainer's job to run")
    finally:
        drainer.send_signal(signal.SIGKILL)
        drainer.wait()
    wait_for(lambda: not tier.processes(marker, parent=drainer.pid), 30, what="the job to die with its drainer")
    tier.backend.sweep()
    assert [p.name for p in tier.workdir.glob("ws-*")] == []


@contract(microvm=True)
def test_a_sandbox_killed_without_an_exec_leaves_nothing(tier: Tier) -> None:
    sbx = tier.create()
    mark = f"mark-{uuid.uuid4().hex}"
    sbx.write(mark, "the job's")
    sbx.kill()
    sbx.kill()
    assert tier.left_on_host(mark) == []


@contract(microvm=True)
def test_an_exec_after_kill_runs_nothing_and_says_why(tier: Tier) -> None:
    sbx = tier.create()
    sbx.kill()
    r = sbx.exec(["/bin/true"], 5)
    assert (r.killed, r.exit_code, r.stdout) == ("killed: sandbox destroyed", -signal.SIGKILL, ""), r
