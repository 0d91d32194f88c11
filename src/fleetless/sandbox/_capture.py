"""Bounded capture of a child's stdout and stderr with a deadline.

A job may write a gigabyte to stdout; we keep the head of stdout (the result) and the tail of
stderr (the error) and drop the rest as it arrives, so the drainer's memory stays flat.
"""

from __future__ import annotations

import os
import re
import selectors
import time
from collections.abc import Callable
from typing import IO

#: Reads of one run after which the pump pauses STREAM_PAUSE seconds between reads: a run that
#: writes in many small pieces (a batch of small jobs, a line each) is read in gathered chunks.
STREAM_READS = 32
STREAM_PAUSE = 0.002
#: A read shorter than this is a small write (a line); a writer that fills the pipe is not paused.
STREAM_SMALL = 16384


class Captured:
    """``observer``, when given, sees each chunk of stdout as it arrives (the batch runner's
    records, from which the drainer keeps each job of a batch to its own deadline)."""

    def __init__(self, stdout_cap: int, stderr_cap: int,
                 observer: Callable[[bytes], None] | None = None) -> None:
        self._observer = observer
        self._out = bytearray()
        self._err = bytearray()
        self._out_cap = stdout_cap
        self._err_cap = stderr_cap
        self.stdout_cut = False  # True once a byte of stdout was dropped

    def add_out(self, chunk: bytes) -> None:
        if self._observer is not None:
            self._observer(chunk)
        room = self._out_cap - len(self._out)
        if room > 0:
            self._out += chunk[:room]
        if len(chunk) > room:
            self.stdout_cut = True

    def add_err(self, chunk: bytes) -> None:
        self._err += chunk
        if len(self._err) > 2 * self._err_cap:
            del self._err[: len(self._err) - self._err_cap]

    @property
    def stdout(self) -> str:
        return self._out.decode("utf-8", "replace")

    @property
    def stderr(self) -> str:
        return bytes(self._err[-self._err_cap :]).decode("utf-8", "replace")


def parse_status(raw: bytes) -> int | None:
    """The job's wait status from the one line ``status N`` of its supervisor (the process tier's
    supervisor, the fork server's init); None for anything else (which only a job that wrote into
    its supervisor's pipe can cause)."""
    m = re.fullmatch(rb"status (\d{1,5})\n", raw)
    if m is None or int(m.group(1)) > 0xFFFF:
        return None
    return int(m.group(1))


def pump(
    stdout: IO[bytes],
    stderr: IO[bytes],
    captured: Captured,
    deadline: float,
    on_deadline: Callable[[], None],
    drain_after_kill: float = 2.0,
    exited: tuple[int, Callable[[], None]] | None = None,
) -> bool:
    """Read both pipes until EOF. At ``deadline`` call ``on_deadline`` (which kills the job) once,
    then keep reading for at most ``drain_after_kill`` seconds. Returns True if the deadline hit.

    ``exited`` is ``(pidfd, on_exit)`` for the process whose tree holds the pipes (a supervisor):
    when it ends, ``on_exit`` is called once (to kill whatever of the tree it left behind), and
    the pipes are read for at most ``drain_after_kill`` seconds more, so a process that escaped
    the tree and holds a pipe open cannot keep the drain waiting until the deadline."""
    sel = selectors.DefaultSelector()
    sel.register(stdout, selectors.EVENT_READ, captured.add_out)
    sel.register(stderr, selectors.EVENT_READ, captured.add_err)
    cutoff: float | None = None

    def ended(_: bytes) -> None:
        nonlocal cutoff
        assert exited is not None
        sel.unregister(exited[0])
        exited[1]()
        cutoff = time.monotonic() + drain_after_kill

    if exited is not None:
        sel.register(exited[0], selectors.EVENT_READ, ended)
    open_pipes = 2
    hit = False
    reads = 0
    try:
        while open_pipes:
            now = time.monotonic()
            if cutoff is not None and now >= cutoff:
                break
            remaining = deadline - now
            if remaining <= 0:
                if hit:
                    break  # something outside the job's tree holds the pipe; give up on it
                hit = True
                on_deadline()
                deadline = time.monotonic() + drain_after_kill
                continue
            wait = min(remaining, 1.0) if cutoff is None else min(remaining, cutoff - now)
            small = False
            for key, _ in sel.select(timeout=wait):
                if exited is not None and key.fd == exited[0]:
                    key.data(b"")
                    continue
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    open_pipes -= 1
                else:
                    key.data(chunk)
                    reads += 1
                    small = len(chunk) < STREAM_SMALL
            if small and reads > STREAM_READS:
                # A stream of small writes (a batch runner's one line per job): let them gather
                # in the pipe for a moment rather than waking (and making the writer wake us)
                # once per line. Only the moment of reading moves; nothing written is lost. A
                # writer filling the pipe (large chunks) is read at full speed: a 2 ms pause per
                # 64 KiB pipe would cap it at 32 MiB/s (1 GiB of stdout past a 30 s timeout).
                time.sleep(STREAM_PAUSE)
    finally:
        sel.close()
    return hit
