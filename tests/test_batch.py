"""Batch mode's runner on real sandboxes: many jobs of one kind per sandbox, each with its own
outcome, each in a fork of the runner (a job that dies is charged alone and the rest run on)."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fleetless.batch import Runner, Slot
from fleetless.job import Job, Outcome
from fleetless.sandbox import Limits, Template, get_backend

from proctools import wait_for

pytestmark = pytest.mark.usefixtures("private_workdir")
TIERS = ["process", "bwrap", "microvm"]


def jobs(kind: str, payloads: list[object], timeout: int | None = None) -> list[Job]:
    return [Job(id=i + 1, kind=kind, payload_json=json.dumps(p), attempts=1, max_attempts=3, claim_token=uuid.uuid4(),
                timeout_seconds=timeout) for i, p in enumerate(payloads)]


def runner(tier: str, folder: Path, **kw: float) -> Runner:
    template = Template(handlers_dir=folder.resolve(), limits=Limits(memory_bytes=512 * 1024 * 1024),
                        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
    return Runner(get_backend(tier), template, **kw)


def summary(outcomes: list[tuple[Job, Outcome]]) -> list[tuple[int, str, object]]:
    out: list[tuple[int, str, object]] = []
    for job, o in outcomes:
        if o.action == "done":
            out.append((job.id, "done", json.loads(o.result_json) if o.result_json is not None else o.result))
        else:
            out.append((job.id, o.action, (o.error or "").splitlines()[0]))
    return out


MODULE = """
    import os, signal, time
    calls = 0  # counts the calls: each job starts from the imported module, not from another job's state

    def handle(payload):
        global calls
        calls += 1
        what = payload["do"]
        if what == "raise":
            raise ValueError("no good: " + str(payload.get("n")))
        if what == "exit":
            os._exit(7)
        if what == "segv":
            os.kill(os.getpid(), signal.SIGSEGV)
        if what == "sleep":
            time.sleep(payload["s"])
        if what == "spin":
            sum(range(10**12))  # one C call: no signal handler runs until it returns
        if what == "nan":
            return float("nan")
        return {"calls": calls, "job": os.environ["FLEETLESS_JOB_ID"], "n": payload.get("n")}
"""


@pytest.mark.parametrize("tier", TIERS)
def test_a_batch_keeps_each_jobs_outcome_and_survives_a_job_that_kills_the_sandbox(
        tier: str, handlers: Callable[..., Path], require_tier: Callable[[str], None]) -> None:
    require_tier(tier)
    h = handlers(**{"mod.py": MODULE})
    batch = jobs("mod", [{"do": "ok", "n": 1}, {"do": "raise", "n": 2}, {"do": "ok", "n": 3},
                         {"do": "exit"}, {"do": "ok", "n": 5}, {"do": "nan"}, {"do": "segv"}, {"do": "ok", "n": 8}])
    outcomes, fatal = runner(tier, h).run(batch, Slot())
    assert fatal is None
    assert summary(outcomes) == [
        (1, "done", {"calls": 1, "job": "1", "n": 1}),
        (2, "fail", "ValueError: no good: 2"),
        (3, "done", {"calls": 1, "job": "3", "n": 3}),  # a fork of the runner: no job sees another's state
        (4, "fail", "exit code 7 (handle() did not return)"),
        (5, "done", {"calls": 1, "job": "5", "n": 5}),
        (6, "fail", "handle() returned a value JSON cannot hold (float: Out of range float values are not JSON"
                    " compliant); dead without retries (return None, a bool, a number, a string, or lists and"
                    " dicts of them)"),
        (7, "fail", "killed by SIGSEGV"),
        (8, "done", {"calls": 1, "job": "8", "n": 8}),
    ]
    assert outcomes[5][1].permanent  # decided once: the same payload returns NaN again
    error = outcomes[1][1].error or ""
    assert "Traceback" in error and 'raise ValueError("no good: "' in error  # the traceback's tail


@pytest.mark.parametrize("tier", TIERS)
def test_no_job_of_a_batch_starts_past_its_lease_also_in_a_microvm_guest(
        tier: str, handlers: Callable[..., Path], require_tier: Callable[[str], None],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Audit (issue 26, item 2, microVM): a guest's runner had no start-by time for its jobs (its
    clock is its own), so a SIGSTOPped drainer's VM went on starting jobs after their leases ended
    and another drainer had reaped them. Each job now gets one on the guest's clock too: leases
    that leave each job about 3 s after the runner starts, jobs of 2 s, so the first two start and
    the rest are given back uncharged, never started."""
    require_tier(tier)
    h = handlers(**{"mod.py": MODULE})
    backend = get_backend(tier)
    made: list[object] = []
    create = backend.create

    def counted(*args: Any, **kwargs: Any) -> Any:
        made.append(None)
        return create(*args, **kwargs)

    monkeypatch.setattr(backend, "create", counted)
    timeout = 30
    # the lease as the drainer last knew it, fixed now: each job's timeout, the sandbox's start
    # allowance (a VM's boot) and 3 s
    ends = time.monotonic() + timeout + backend.overhead_seconds + 3
    outcomes, _ = runner(tier, h, not_after=lambda job: ends).run(
        jobs("mod", [{"do": "sleep", "s": 2}] * 4, timeout=timeout), Slot())
    if tier == "microvm":  # the runner's clock starts after the boot, which the 3 s do not count
        assert [(j.id, o.action) for j, o in outcomes] == [(1, "done"), (2, "done"), (3, "release"), (4, "release")]
    else:  # the host's clock: the start of the sandbox counts against the 3 s
        assert [o.action for _, o in outcomes][:1] == ["done"] and outcomes[-1][1].action == "release"
    assert all("lease ended before it started" in (o.error or "") for _, o in outcomes if o.action == "release")
    # the host asks what the guest asks: no further sandbox for jobs its runner would call too late
    # (it booted VM after VM for a minute, each saying at once that the job was too late)
    assert len(made) == 1, made


@pytest.mark.parametrize("tier", ["process", "bwrap"])
def test_each_job_of_a_batch_has_its_own_timeout(tier: str, handlers: Callable[..., Path],
                                                 require_tier: Callable[[str], None]) -> None:
    require_tier(tier)
    h = handlers(**{"mod.py": MODULE})
    batch = jobs("mod", [{"do": "sleep", "s": 0.3}, {"do": "sleep", "s": 60}, {"do": "spin"}, {"do": "ok", "n": 4}],
                 timeout=1)
    outcomes, _ = runner(tier, h).run(batch, Slot())
    assert summary(outcomes) == [
        (1, "done", {"calls": 1, "job": "1", "n": None}),
        (2, "fail", "killed: timeout after 1 s"),
        (3, "fail", "killed: timeout after 1 s"),  # stopped from outside its process, even in a C call
        (4, "done", {"calls": 1, "job": "4", "n": 4}),
    ]


@pytest.mark.parametrize("tier", ["process", "bwrap"])
def test_script_handlers_run_one_process_per_job_in_a_batch(tier: str, handlers: Callable[..., Path],
                                                            require_tier: Callable[[str], None]) -> None:
    require_tier(tier)
    h = handlers(**{"script.py": """
        import json, os, sys, time
        p = json.load(open(sys.argv[1]))
        if p == "fail":
            sys.stderr.write("bad\\n"); sys.exit(3)
        if p == "hang":
            time.sleep(60)
        if p == "die":
            os.kill(os.getpid(), 9)
        print(p, os.environ["FLEETLESS_JOB_ID"], os.getcwd() == os.environ["HOME"])
    """, "shell": """
        #!/bin/sh
        echo "shell saw $(cat "$1")"
    """})
    outcomes, _ = runner(tier, h).run(jobs("script", ["a", "fail", "hang", "die", "b"], timeout=1), Slot())
    assert summary(outcomes) == [
        (1, "done", "a 1 True\n"), (2, "fail", "exit code 3: bad"), (3, "fail", "killed: timeout after 1 s"),
        (4, "fail", "killed by SIGKILL"), (5, "done", "b 5 True\n"),
    ]
    assert outcomes[1][1].error == "exit code 3: bad\nbad"
    outcomes, _ = runner(tier, h).run(jobs("shell", [1, 2]), Slot())
    assert summary(outcomes) == [(1, "done", "shell saw 1\n"), (2, "done", "shell saw 2\n")]


def test_a_module_that_cannot_be_imported_fails_each_job(handlers: Callable[..., Path]) -> None:
    h = handlers(**{"broken.py": "import no_such_module\ndef handle(p):\n    return p\n"})
    outcomes, _ = runner("process", h).run(jobs("broken", [1, 2]), Slot())
    assert [o.action for _, o in outcomes] == ["fail", "fail"]
    assert (outcomes[0][1].error or "").startswith(
        "cannot import the handler: ModuleNotFoundError: No module named 'no_such_module'")


def test_a_job_without_handler_is_given_back_with_a_delay_or_dead_at_once(handlers: Callable[..., Path]) -> None:
    (given_back,), _ = runner("process", handlers()).run(jobs("nothing", [1]), Slot())
    assert (given_back[1].action, given_back[1].delay) == ("release", 60.0)
    outcomes, _ = runner("process", handlers(), no_handler_delay=None).run(jobs("nothing", [1]), Slot())  # type: ignore[arg-type]
    assert outcomes[0][1].permanent and (outcomes[0][1].error or "").startswith("no handler for kind 'nothing'")


def test_aborting_a_batch_releases_every_job_without_a_result(handlers: Callable[..., Path],
                                                             tmp_path: Path) -> None:
    marker = tmp_path / "started"
    h = handlers(**{"mod.py": f"""
        import time
        def handle(p):
            if p == "wait":
                open({str(marker)!r}, "w").close()
                time.sleep(60)
            return p
    """})
    slot = Slot()
    got: list[tuple[list[tuple[Job, Outcome]], str | None]] = []
    t = threading.Thread(target=lambda: got.append(runner("process", h).run(jobs("mod", ["a", "wait", "c"]), slot)))
    t.start()
    wait_for(marker.exists, what="the second job to start")
    slot.abort()
    t.join(30)
    outcomes, fatal = got[0]
    assert fatal is None
    assert summary(outcomes) == [(1, "done", "a"), (2, "release", "released: the drainer stopped before the job "
                                                                    "finished"),
                                 (3, "release", "released: the drainer stopped before the job finished")]


def test_teardown_destroys_with_at_most_limit_threads_kept_for_the_drain_and_gone_after_close() -> None:
    from fleetless.batch import Teardown

    class Fake:
        name = "fake"

        def __init__(self) -> None:
            self.killed = threading.Event()

        def kill(self) -> None:
            time.sleep(0.001)
            self.killed.set()

    def teardown_threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == "teardown"}

    before = teardown_threads()
    teardown = Teardown(2)
    seen: set[threading.Thread] = set()
    fakes = [Fake() for _ in range(40)]
    for fake in fakes:
        teardown.hand_over(fake)  # type: ignore[arg-type]
        seen |= teardown_threads() - before
    teardown.close()
    assert all(f.killed.is_set() for f in fakes) and (teardown.finished, teardown.failure) == (40, None)
    assert 1 <= len(seen) <= 2  # reused, not one per sandbox
    for thread in seen:
        thread.join(5)
        assert not thread.is_alive()
    late = Fake()
    teardown.hand_over(late)  # type: ignore[arg-type]  # after close: inline
    assert late.killed.is_set()


def test_a_teardown_whose_thread_cannot_start_destroys_inline_and_keeps_its_count(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fleetless.batch import Teardown

    backend = get_backend("process")
    (tmp_path / "handlers").mkdir()
    template = Template(tmp_path / "handlers", Limits())
    teardown = Teardown(1)
    start = threading.Thread.start

    def no_teardown_thread(self: threading.Thread) -> None:
        if self.name == "teardown":
            raise RuntimeError("can't start new thread")
        start(self)

    monkeypatch.setattr(threading.Thread, "start", no_teardown_thread)
    first = backend.create(template)
    workspace = first.host_workspace
    assert workspace is not None and workspace.exists()
    teardown.hand_over(first)  # inline: gone when it returns, nothing left counted as pending
    assert not workspace.exists()
    assert teardown.freed_since(teardown.finished) is False
    monkeypatch.undo()
    second = backend.create(template)
    teardown.hand_over(second)  # the one permit is free again: this does not block
    teardown.close()
    assert (teardown.finished, teardown.failure) == (1, None)
    assert second.host_workspace is None or not second.host_workspace.exists()


def test_a_runner_whose_channel_was_closed_before_it_started_exits_at_once(tmp_path: Path) -> None:
    """Every job of a batch cancelled before its runner opened its channel: the drainer closes its
    end of IN having sent nothing. The runner's blocking open of IN then waited for a writer for
    ever (the drain hung until the sandbox's bound, and a drainer's death left the runner behind:
    re-audit of issue 26). It reads the end of its input at once and exits, having run nothing."""
    import subprocess
    import sys

    from fleetless.batch import CHANNEL_IN, CHANNEL_OUT, RUNNER, _Channel

    chan = _Channel(tmp_path)
    chan.finish()
    try:
        done = subprocess.run([sys.executable, str(RUNNER), str(tmp_path / CHANNEL_IN), str(tmp_path / CHANNEL_OUT)],
                              cwd=tmp_path, capture_output=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert chan.recv(time.monotonic()) is None  # nothing was said
    finally:
        chan.close()
    assert not (tmp_path / CHANNEL_IN).exists() and not (tmp_path / CHANNEL_OUT).exists()


FORGER = """
    import os
    def handle(payload):
        if payload.get("forge"):  # its report pipe is among its fds: say it never started
            for name in os.listdir("/proc/self/fd"):
                fd = int(name)
                if fd > 2:
                    try:
                        os.write(fd, b'R1,"late":true')
                    except OSError:
                        pass
            os._exit(0)
        return "fine"
"""


@pytest.mark.parametrize("tier", ["process", "bwrap", "forkserver"])
def test_a_job_cannot_forge_its_result_line_to_pass_as_never_started(
        tier: str, handlers: Callable[..., Path], require_tier: Callable[[str], None]) -> None:
    """A handle() wrote 'R1,"late":true' to its report pipe: spliced into its result line, the
    drain took it for "too late to start", gave it back uncharged and ran it again, for ever (red
    team, issue 25). Its report must be one JSON value: else it is the job's own failure."""
    require_tier(tier)
    h = handlers(**{"forger.py": FORGER})
    outcomes, fatal = runner(tier, h).run(jobs("forger", [{"forge": True}, {}]), Slot())
    assert fatal is None
    assert summary(outcomes) == [(1, "fail", "the job's report of its result is not one JSON value"),
                                 (2, "done", "fine")]


SQUATTER = """
    import os
    def handle(payload):
        top = os.path.dirname(os.getcwd())  # the batch's workspace: every job's directory is in it
        if payload.get("squat"):
            with open(os.path.join(top, "loot"), "w") as f:
                f.write("left for the next job")
            os.makedirs(os.path.join(top, "deep", "er"))
            os.chmod(os.path.join(top, "deep"), 0)
            os.chmod(top, 0o555)  # the next job's directory cannot be made
            return "squatted"
        return sorted(n for n in os.listdir(top) if not n.startswith("job-") and not n.startswith("_fleetless"))
"""


@pytest.mark.parametrize("tier", ["process", "bwrap", "forkserver"])
def test_a_job_of_a_batch_leaves_nothing_in_the_workspace_for_the_next(
        tier: str, handlers: Callable[..., Path], require_tier: Callable[[str], None]) -> None:
    """A job made the batch's workspace read-only and left files in it: the next job's directory
    could not be made (it was charged: PermissionError), and later jobs read what it left (red
    team, issue 25). Each job finds the workspace as the runner found it."""
    require_tier(tier)
    h = handlers(**{"squat.py": SQUATTER})
    outcomes, fatal = runner(tier, h).run(jobs("squat", [{"squat": True}, {}, {}]), Slot())
    assert fatal is None
    (_, _, first), (_, second_status, second), (_, third_status, third) = summary(outcomes)
    assert (first, second_status, third_status) == ("squatted", "done", "done"), summary(outcomes)
    assert "loot" not in second and "deep" not in second and second == third  # (the tier's own, e.g. .tmp)


SHM_FILLER = """
    import errno
    def handle(payload):
        chunk = b"x" * (1 << 20)
        written = 0
        try:
            with open("/dev/shm/fill", "wb") as f:
                for _ in range(200):
                    f.write(chunk)
                    f.flush()
                    written += 1
        except OSError as exc:
            return {"mib": written, "errno": errno.errorcode.get(exc.errno, exc.errno)}
        return {"mib": written, "errno": None}
"""


def test_bwraps_dev_shm_is_capped_as_its_tmp_is(handlers: Callable[..., Path],
                                                 require_tier: Callable[[str], None]) -> None:
    """/dev/shm was a directory of bwrap's own /dev tmpfs, uncapped: 600 MiB went in under a
    256 MiB --memory where no cgroup holds (red team, issue 25). It is a tmpfs of Limits.tmp_bytes."""
    require_tier("bwrap")
    h = handlers(**{"shm.py": SHM_FILLER})
    template = Template(handlers_dir=h.resolve(), limits=Limits(memory_bytes=512 * 1024 * 1024, tmp_bytes=64 << 20),
                        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
    outcomes, fatal = Runner(get_backend("bwrap"), template).run(jobs("shm", [{}]), Slot())
    assert fatal is None
    ((_, status, result),) = summary(outcomes)
    assert status == "done" and result["errno"] == "ENOSPC" and result["mib"] <= 64, result
