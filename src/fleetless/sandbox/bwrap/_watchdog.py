"""One watchdog per drainer process: when the drainer dies, by any signal, kill and remove what its
sandboxes left (per-job cgroups, their processes, workspaces). While the drainer lives, it also
kills each job's cgroups at the job's deadline, so a job never outlives its lease even when the
drainer is stopped (SIGSTOP, a frozen VM) and cannot kill it itself.

The drainer holds the write end of a pipe whose read end is this process's stdin; the kernel closes
it however the drainer ends, so EOF here means "the drainer is gone". Parent-death signals are not
enough on their own: the kernel clears them when a process changes credentials, which every bwrap
sandbox does (uid 65534), so a sandbox's pid 1 can outlive its monitor. The cgroups cannot.

    python -m fleetless.sandbox.bwrap._watchdog DRAINER_PID

The drainer writes one line per exec on the pipe: ``DEADLINE\tDIR\tDIR...\n``, DEADLINE in
CLOCK_MONOTONIC seconds (the same clock in every process), the DIRs the job's cgroups. Groups
already removed by then (the job ended) are skipped. Without cgroups (an unprivileged drainer)
the one DIR is ``pid:PID:START``: the job's bwrap, killed (its pid namespace dies with it) if
the pid still names the process that started at START (``/proc/PID/stat`` field 22).
"""

from __future__ import annotations

import heapq
import os
import select
import signal
import sys
import time
from pathlib import Path

from .. import _workspace, bwrap, cgroups


def _enforce(due: list[tuple[float, list[str]]]) -> None:
    now = time.monotonic()
    while due and due[0][0] <= now:
        _, dirs = heapq.heappop(due)
        for target in dirs:
            if target.startswith("pid:"):
                _kill_pid(target)
        live = [Path(d) for d in dirs if not d.startswith("pid:") and os.path.isdir(d)]
        if live:
            cgroups.kill_paths(live)


def _kill_pid(target: str) -> None:
    """SIGKILL ``pid:PID:START`` if PID still is the process that started at START."""
    try:
        _, pid, start = target.split(":")
        if _workspace.start_time(int(pid)) == int(start):
            os.kill(int(pid), signal.SIGKILL)
    except (OSError, ValueError):  # gone, or not ours to kill
        pass


def main() -> None:
    owner = int(sys.argv[1])
    due: list[tuple[float, list[str]]] = []  # (deadline, cgroup dirs), a heap
    pending = b""
    while True:
        wait = max(due[0][0] - time.monotonic(), 0.0) if due else None
        if select.select([0], [], [], wait)[0]:
            data = os.read(0, 4096)
            if not data:
                break
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                try:
                    when, *dirs = line.decode().split("\t")
                    heapq.heappush(due, (float(when), dirs))
                except ValueError:  # never let a bad line end the watchdog: it also cleans up
                    continue
        _enforce(due)
    # The drainer is gone: every sandbox it left dies now, not at its deadline (without cgroups,
    # an unprivileged drainer's, a bwrap is known only by its pid: sweep() cannot find it).
    for _, dirs in due:
        for target in dirs:
            if target.startswith("pid:"):
                _kill_pid(target)
    deadline = time.monotonic() + 10
    while _workspace.pid_alive(owner) and time.monotonic() < deadline:
        time.sleep(0.01)
    bwrap.sweep()
    _workspace.sweep()


if __name__ == "__main__":
    main()
