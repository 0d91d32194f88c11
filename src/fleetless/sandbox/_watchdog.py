"""One watchdog per drainer process: when the drainer dies, by any signal, kill and remove what its
sandboxes left (per-job cgroups, their processes, workspaces).

The drainer holds the write end of a pipe whose read end is this process's stdin; the kernel closes
it however the drainer ends, so EOF here means "the drainer is gone". Parent-death signals are not
enough on their own: the kernel clears them when a process changes credentials, which every bwrap
sandbox does (uid 65534), so a sandbox's pid 1 can outlive its monitor. The cgroups cannot.

    python -m fleetless.sandbox._watchdog DRAINER_PID
"""

from __future__ import annotations

import os
import sys
import time

from . import _workspace, bwrap


def main() -> None:
    owner = int(sys.argv[1])
    while True:
        try:
            if not os.read(0, 4096):
                break
        except InterruptedError:
            continue
    deadline = time.monotonic() + 10
    while _workspace.pid_alive(owner) and time.monotonic() < deadline:
        time.sleep(0.01)
    bwrap.sweep()
    _workspace.sweep()


if __name__ == "__main__":
    main()
