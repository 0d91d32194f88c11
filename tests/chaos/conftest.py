"""Helpers for the chaos tests: real ``fleetless drain`` processes against a real database, killed,
cut off from PostgreSQL or stopped, with a log of every execution kept outside the sandbox.

``FLEETLESS_SOAK=1`` runs the kill test at the issue's full size: 20 SIGKILLs over 2,000 jobs."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

SOAK = os.environ.get("FLEETLESS_SOAK") == "1"
APP_NAME = "fleetless-chaos-drainer"  # PGAPPNAME of every drainer started here: how to find its backends


@pytest.fixture(autouse=True)
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private FLEETLESS_WORKDIR, inherited by every drainer the test starts."""
    work = tmp_path / "work"
    monkeypatch.setenv("FLEETLESS_WORKDIR", str(work))
    return work


class Drain:
    """One ``fleetless drain`` subprocess, its output in files (no pipe to fill up)."""

    def __init__(self, dsn: str, handlers_dir: Path, args: tuple[str, ...], out_dir: Path,
                 env: dict[str, str] | None = None, prefix: tuple[str, ...] = ("-m", "fleetless.cli")) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        stamp = f"{time.monotonic_ns()}"
        self.out_path = out_dir / f"drain-{stamp}.out"
        self.err_path = out_dir / f"drain-{stamp}.err"
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, *prefix, "drain", "--handlers", str(handlers_dir), *args],
                env={**os.environ, "DATABASE_URL": dsn, "PGAPPNAME": APP_NAME, **(env or {})},
                stdout=out, stderr=err, stdin=subprocess.DEVNULL)
        self.killed = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def kill(self) -> None:
        self.killed = True
        self.proc.kill()
        self.proc.wait()

    def wait(self, timeout: float = 60) -> int:
        return self.proc.wait(timeout=timeout)

    @property
    def stdout(self) -> str:
        return self.out_path.read_text()

    @property
    def stderr(self) -> str:
        return self.err_path.read_text()


@pytest.fixture
def start_drain(tmp_path: Path) -> Iterator[Callable[..., Drain]]:
    """``start_drain(dsn, handlers_dir, *args, env=..., prefix=...)``; every drainer still running
    at the end of the test is killed."""
    started: list[Drain] = []

    def start(dsn: str, handlers_dir: Path, *args: str, env: dict[str, str] | None = None,
              prefix: tuple[str, ...] = ("-m", "fleetless.cli")) -> Drain:
        d = Drain(dsn, handlers_dir, args, tmp_path / "drain-output", env, prefix)
        started.append(d)
        return d

    yield start
    for d in started:
        if d.poll() is None:
            d.kill()


def executions(log: Path) -> dict[int, list[int]]:
    """job id -> the attempt numbers under which its handler ran, from lines "<id> <attempt>"."""
    runs: dict[int, list[int]] = collections.defaultdict(list)
    if log.exists():
        for line in log.read_text().splitlines():
            job_id, attempt = line.split()[:2]
            runs[int(job_id)].append(int(attempt))
    return runs


def processes_mentioning(text: str) -> list[tuple[int, str]]:
    """Live processes whose command line or working directory contains ``text`` (e.g. a private
    work directory: a process-tier job names its handler and payload there, and its supervisor,
    whose settings come on a pipe, runs in its workspace)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(") ", 1)[1][0]
        except OSError:
            continue
        try:
            cwd = os.readlink(entry / "cwd")
        except OSError:
            cwd = ""
        if (text in cmdline or text in cwd) and state != "Z":
            found.append((int(entry.name), cmdline))
    return found


