"""Issue 26, "Also": nothing may outlive a drain. A watch drainer keeps spare batch sandboxes
(their runners waiting for a batch); SIGKILLed, every process it had started (the spares' launchers,
bwrap, supervisors, runners) must die with it, without its help. Hermetic: only the drainer's own
descendants, recorded by pid (and start time, against pid reuse) before the kill, are looked at."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from fleetless import Queue

from proctools import descendants, wait_for

pytestmark = pytest.mark.usefixtures("private_workdir")

DRAINER = """
import sys
from pathlib import Path
from fleetless import Queue
from fleetless.drainer import DrainConfig, Drainer
# a queue of its own per tier: the killed watcher of an earlier case holds its queues' watch lease
Drainer(Queue(sys.argv[1]), DrainConfig(handlers_dir=Path(sys.argv[2]), sandbox=sys.argv[3], per_sandbox=5,
                                        concurrency=2, watch=True, idle_exit=300, queues=(sys.argv[3],))).run()
"""


def _started(pid: int) -> bytes | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2:].split()
    return None if fields[0] in (b"Z", b"X") else fields[19]


def _runners(pids: list[int]) -> int:
    n = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                n += b"_fleetless_batch.py" in f.read()
        except OSError:
            continue
    return n


@pytest.mark.parametrize("tier", ["process", "bwrap"])
def test_a_sigkilled_watch_drainers_spare_sandboxes_die_with_it(tier: str, dsn: str, queue: Queue, handlers,
                                                               require_tier) -> None:
    require_tier(tier)
    h = handlers(**{"n.py": "def handle(payload):\n    return 1\n"})
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(DRAINER), dsn, str(h), tier],
                            env={**os.environ}, stdin=subprocess.DEVNULL)
    try:
        wait_for(lambda: _runners(descendants(proc.pid)) >= 3, timeout=120, what="three spare sandboxes' runners")
        mine = {pid: _started(pid) for pid in descendants(proc.pid)}
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def left() -> list[int]:
        return [pid for pid, born in mine.items() if born is not None and _started(pid) == born]

    wait_for(lambda: not left(), timeout=60, what="every process of the killed drainer to die")



