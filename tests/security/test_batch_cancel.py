"""Issue 26 item 1, on every tier and batch mode: a cancel of a job waiting in a running batch never
starts it and leaves the job running alone (it ends done); a cancel of the job running ends it
alone, and the jobs after it run. Channel mode (process and bwrap, as root and as the unprivileged
users .ci/unprivileged runs this file as) sends a cancelled job nothing; file mode (the fork server,
and, before 648ecd2, process and bwrap under a drainer with a subordinate range) tells the runner
to start no other job (SIGUSR1) and runs the rest, the cancelled one left out, in a fresh sandbox.
A cancel of a job that has ended stops nothing (file mode destroyed the sandbox, and the job
running then was charged a failed attempt and ran again). The gated job runs until the test signals it, found among this
process's own descendants by the name it gives itself."""

from __future__ import annotations

import os
import signal
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

from fleetless import Queue, Status
from fleetless import batch as batch_module
from fleetless.drainer import DrainConfig, Drainer

from proctools import descendants, wait_for

pytestmark = pytest.mark.usefixtures("private_workdir")

GATED = """
    import ctypes, signal
    def handle(payload):
        if payload.get("gated"):  # runs until the test sends SIGUSR2 (bounded)
            signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR2])
            ctypes.CDLL(None).prctl(15, b"fl-gated-job", 0, 0, 0)  # PR_SET_NAME: the test finds it
            signal.sigtimedwait([signal.SIGUSR2], 120)
        return payload["n"]
"""


def _named(comm: bytes) -> list[int]:
    """This process's descendants whose name (``/proc/<pid>/comm``) is ``comm``."""
    found = []
    for pid in descendants(os.getpid()):
        try:
            if Path(f"/proc/{pid}/comm").read_bytes().strip() == comm:
                found.append(pid)
        except OSError:
            continue
    return found


def _gated() -> list[int]:
    """This process's descendants that are the gated job, waiting for its signal."""
    return _named(b"fl-gated-job")


#: The same, from a module that sets SIGUSR1's action when imported (in the runner's process).
GATED_OWN_USR1 = "import signal\nsignal.signal(signal.SIGUSR1, signal.SIG_DFL)\n" + textwrap.dedent(GATED)


def _start_batch_drain(queue: Queue, h: Any, tier: str,
                       monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Thread, threading.Event]:
    """A drain of batches of 4 in a thread, started, and an event set once it acts on a cancel
    (its slot's kill_current)."""
    seen = threading.Event()
    original = batch_module.Slot.kill_current

    def kill_current(self: batch_module.Slot) -> None:  # the drainer acted on the cancel
        original(self)
        seen.set()

    monkeypatch.setattr(batch_module.Slot, "kill_current", kill_current)
    drainer = Drainer(queue, DrainConfig(handlers_dir=h, sandbox=tier, per_sandbox=4, concurrency=1))
    thread = threading.Thread(target=drainer.run)
    thread.start()
    return thread, seen


@pytest.mark.parametrize("tier", ["process", "bwrap", "forkserver"])
@pytest.mark.parametrize("which", ["waiting", "running", "waiting-own-usr1", "ended"])
def test_a_cancel_in_a_running_batch_stops_only_the_cancelled_job_in_every_mode(
        which: str, tier: str, queue: Queue, sql: Any, handlers: Any, require_tier: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    require_tier(tier)
    h = handlers(**{"gated.py": GATED_OWN_USR1 if which.endswith("own-usr1") else GATED})
    which = which.removesuffix("-own-usr1")
    # ended: the 2nd job is the gated one, and the 1st, ended already, is cancelled
    ids = [queue.enqueue("gated", {"n": n, "gated": n == (1 if which == "ended" else 0)}, max_attempts=3)
           for n in (0, 1, 2, 3)]
    thread, seen = _start_batch_drain(queue, h, tier, monkeypatch)
    try:
        wait_for(_gated, timeout=120, what="the batch's gated job to run")
        victim = ids[3] if which == "waiting" else ids[0]
        assert queue.cancel(victim) is Status.RUNNING  # claimed with its batch
        wait_for(seen.is_set, timeout=60, what="the drainer to act on the cancel")
        if which in ("waiting", "ended"):
            for pid in _gated():  # the running job ends on its own: done
                os.kill(pid, signal.SIGUSR2)
        thread.join(timeout=180)
    finally:
        for pid in _gated():
            os.kill(pid, signal.SIGUSR2)
        thread.join(timeout=180)
    assert not thread.is_alive()
    rows = {i: (s, a, e) for i, s, a, e in sql(
        "SELECT id, status, attempts, last_error FROM fleetless.jobs WHERE id = ANY(%s)", ids)}
    want = {"waiting": ["done", "done", "done", "cancelled"], "running": ["cancelled", "done", "done", "done"],
            "ended": ["done"] * 4}[which]
    assert [rows[i][0] for i in ids] == want, rows
    assert all(rows[i][1] == 1 for i in ids), rows
    if which == "waiting":  # never started
        assert rows[ids[3]][2].startswith("cancelled: an operator cancelled the job before its turn"), rows


@pytest.mark.parametrize("tier", ["process", "bwrap", "forkserver"])
def test_a_cancel_while_a_batchs_sandbox_is_made_runs_the_rest_without_it(
        tier: str, queue: Queue, sql: Any, handlers: Any, require_tier: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cancel lands after the batch's sandbox exists and before its runner starts: the
    cancelled job never starts, the others run (attempt 1, done), and the drain goes on (it used to
    destroy the sandbox under the batch's file writes: a broken sandbox, the drain's end)."""
    require_tier(tier)
    h = handlers(**{"gated.py": GATED})
    ids = [queue.enqueue("gated", {"n": n}, max_attempts=3) for n in range(3)]
    seen = threading.Event()
    kill_current = batch_module.Slot.kill_current
    make = batch_module.Runner._sandbox
    first = [True]

    def acted(self: batch_module.Slot) -> None:
        kill_current(self)
        seen.set()

    def sandbox(self: batch_module.Runner, *args: Any, **kwargs: Any) -> Any:
        sbx = make(self, *args, **kwargs)
        if first[0]:  # the first sandbox: cancel the 2nd job now, and wait for the drainer to act
            first[0] = False
            assert queue.cancel(ids[1]) is Status.RUNNING
            assert seen.wait(60), "the drainer did not act on the cancel"
        return sbx

    monkeypatch.setattr(batch_module.Slot, "kill_current", acted)
    monkeypatch.setattr(batch_module.Runner, "_sandbox", sandbox)
    summary = Drainer(queue, DrainConfig(handlers_dir=h, sandbox=tier, per_sandbox=3, concurrency=1)).run()
    rows = {i: (s, a, e) for i, s, a, e in sql(
        "SELECT id, status, attempts, last_error FROM fleetless.jobs WHERE id = ANY(%s)", ids)}
    assert [rows[i][0] for i in ids] == ["done", "cancelled", "done"], (rows, summary)
    assert all(rows[i][1] == 1 for i in ids), rows
    assert rows[ids[1]][2].startswith("cancelled: an operator cancelled the job before its turn"), rows


SLEEPER = """
    import time
    def handle(payload):
        time.sleep(payload.get("sleep", 0))
        return payload["n"]
"""


def _vms() -> list[int]:
    """This process's descendants that are a microVM's QEMU."""
    found = []
    for pid in descendants(os.getpid()):
        try:
            if Path(f"/proc/{pid}/comm").read_bytes().startswith(b"qemu-system"):
                found.append(pid)
        except OSError:
            continue
    return found


def test_a_cancel_of_a_job_waiting_in_a_running_microvm_batch_leaves_the_job_running_alone(
        queue: Queue, sql: Any, handlers: Any, require_tier: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 26 item 1 on the microVM tier (file mode in a guest the drainer cannot signal): the
    4th job of a batch of 4 is cancelled while the VM boots or runs the 1st. The drainer's stop
    goes over the VM's channel to the guest's runner, which passes it on to the batch runner
    (SIGUSR1) once it catches it: the 1st job ends done, in its one attempt, the cancelled one never
    starts, and the 2nd and 3rd run in a fresh VM. Before, the drainer destroyed the VM: the 1st job
    was given back uncharged ('released' in its history) and ran again."""
    require_tier("microvm")
    h = handlers(**{"slow.py": SLEEPER})
    ids = [queue.enqueue("slow", {"n": 0, "sleep": 8}, max_attempts=3)]
    ids += [queue.enqueue("slow", {"n": n}, max_attempts=3) for n in (1, 2, 3)]
    seen = threading.Event()
    original = batch_module.Slot.kill_current

    def kill_current(self: batch_module.Slot) -> None:  # the drainer acted on the cancel
        original(self)
        seen.set()

    monkeypatch.setattr(batch_module.Slot, "kill_current", kill_current)
    drainer = Drainer(queue, DrainConfig(handlers_dir=h, sandbox="microvm", per_sandbox=4, concurrency=1,
                                         timeout=120))
    thread = threading.Thread(target=drainer.run)
    thread.start()
    try:
        wait_for(_vms, timeout=120, what="the batch's VM to start")
        assert queue.cancel(ids[3]) is Status.RUNNING  # claimed with its batch
        wait_for(seen.is_set, timeout=60, what="the drainer to act on the cancel")
    finally:
        thread.join(timeout=600)
    assert not thread.is_alive()
    rows = {i: (s, a, e) for i, s, a, e in sql(
        "SELECT id, status, attempts, last_error FROM fleetless.jobs WHERE id = ANY(%s)", ids)}
    assert [rows[i][0] for i in ids] == ["done", "done", "done", "cancelled"], rows
    assert all(rows[i][1] == 1 for i in ids), rows
    assert sql("SELECT attempt, outcome FROM fleetless.job_attempts WHERE job_id = %s ORDER BY id", ids[0]) == [
        (1, "done")]
    assert rows[ids[3]][2].startswith("cancelled: an operator cancelled the job before its turn"), rows


@pytest.mark.parametrize("which", ["running", "ended"])
def test_a_cancel_in_a_running_microvm_batch_after_its_first_job_ends_stops_only_the_cancelled_job(
        which: str, queue: Queue, sql: Any, handlers: Any, require_tier: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 26 on the microVM tier, once the batch's first job has ended and its 2nd runs (120 s, or
    20 s when it is not the one cancelled). ``running``: the 2nd is cancelled; it ends cancelled
    at once, alone, and the 3rd and 4th run (they used to wait for it, and it ended done).
    ``ended``: the 1st, ended already, is cancelled; nothing is stopped and nothing runs twice
    (the VM used to be destroyed: the 1st ended cancelled, and the 2nd ran again). The drainer
    knows which job runs from the batch runner's records, which the guest now streams; the test
    waits for the first of them to reach the drainer."""
    require_tier("microvm")
    h = handlers(**{"slow.py": SLEEPER})
    ids = [queue.enqueue("slow", {"n": 0}, max_attempts=3),
           queue.enqueue("slow", {"n": 1, "sleep": 120 if which == "running" else 20}, max_attempts=3)]
    ids += [queue.enqueue("slow", {"n": n}, max_attempts=3) for n in (2, 3)]
    seen, first_ended = threading.Event(), threading.Event()
    original, seen_stdout = batch_module.Slot.kill_current, batch_module._Pacer._seen

    def kill_current(self: batch_module.Slot) -> None:  # the drainer acted on the cancel
        original(self)
        seen.set()

    def records(self: batch_module._Pacer, chunk: bytes) -> None:  # the drainer saw a job's record
        seen_stdout(self, chunk)
        if self.records() >= 1:
            first_ended.set()

    monkeypatch.setattr(batch_module.Slot, "kill_current", kill_current)
    monkeypatch.setattr(batch_module._Pacer, "_seen", records)
    drainer = Drainer(queue, DrainConfig(handlers_dir=h, sandbox="microvm", per_sandbox=4, concurrency=1,
                                         timeout=300))
    thread = threading.Thread(target=drainer.run)
    thread.start()
    try:
        wait_for(first_ended.is_set, timeout=240, what="the batch's first job's record to reach the drainer")
        victim = ids[1] if which == "running" else ids[0]
        assert queue.cancel(victim) is Status.RUNNING  # claimed with its batch
        wait_for(seen.is_set, timeout=60, what="the drainer to act on the cancel")
    finally:
        thread.join(timeout=600)
    assert not thread.is_alive()
    rows = {i: (s, a, e) for i, s, a, e in sql(
        "SELECT id, status, attempts, last_error FROM fleetless.jobs WHERE id = ANY(%s)", ids)}
    want = ["done", "cancelled", "done", "done"] if which == "running" else ["done"] * 4
    assert [rows[i][0] for i in ids] == want, rows
    assert all(rows[i][1] == 1 for i in ids), rows
    for i in ids:  # one attempt each: none given back, none run twice
        assert len(sql("SELECT attempt FROM fleetless.job_attempts WHERE job_id = %s", i)) == 1, i
    if which == "running":
        assert rows[ids[1]][2].startswith("cancelled: an operator cancelled the job while it ran"), rows


#: A handler whose import takes a while (a heavy module): the runner has named itself, and catches
#: SIGUSR1 only once the import is over.
SLOW_IMPORT = """
    import time
    time.sleep(4)
    def handle(payload):
        return payload["n"]
"""


def _runners() -> list[int]:
    """This process's descendants named as the batch runner names itself (the runner, its template)."""
    return _named(b"fleetless-batch")


@pytest.mark.parametrize("tier", ["forkserver"])  # file mode as root (process and bwrap: channel mode)
def test_a_cancel_while_the_batch_runner_imports_its_handler_waits_for_it_to_catch_the_stop(
        tier: str, queue: Queue, sql: Any, handlers: Any, require_tier: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The 4th job of a file-mode batch is cancelled while the runner, named already, still imports
    its handler: SIGUSR1 then would kill it (its default action), and the first job was charged
    a failed attempt, 'killed by SIGUSR1'. The drainer now sends it once the runner catches it:
    the first three jobs end done in one attempt each, the 4th cancelled without starting."""
    require_tier(tier)
    if os.geteuid() != 0:
        pytest.skip("the fork server needs a root drainer")
    h = handlers(**{"slow.py": SLOW_IMPORT})
    ids = [queue.enqueue("slow", {"n": n}, max_attempts=3) for n in range(4)]
    thread, seen = _start_batch_drain(queue, h, tier, monkeypatch)
    try:
        wait_for(_runners, timeout=60, what="the batch runner to start")
        assert queue.cancel(ids[3]) is Status.RUNNING  # claimed with its batch
        wait_for(seen.is_set, timeout=30, what="the drainer to act on the cancel")
    finally:
        thread.join(timeout=180)
    assert not thread.is_alive()
    assert sql("SELECT status, attempts FROM fleetless.jobs ORDER BY id") == [
        ("done", 1), ("done", 1), ("done", 1), ("cancelled", 1)]
    assert sql("SELECT job_id, outcome FROM fleetless.job_attempts WHERE outcome <> 'done'") == [(ids[3], "cancelled")]
