"""The ``process`` tier: a supervised process tree with a scrubbed environment and rlimits.

What it isolates: the environment (only what the template passes), the working directory (a fresh
private workspace, removed afterwards), resources by rlimit (address space, CPU seconds, file size,
open files), and the process tree (own session; a supervising subreaper kills every descendant at
exit, timeout, TTL and when the drainer dies, even by SIGKILL). What it does not: the filesystem
and the network are the drainer user's. Use ``bwrap`` or ``microvm`` for untrusted code.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

from . import ExecResult, Sandbox, SandboxUnavailable, Template, _capture, _workspace, default_python

_SUPERVISOR = str(Path(__file__).with_name("_supervisor.py"))


def describe_signal(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def rlimits_for(template: Template, timeout_seconds: float) -> dict[str, int]:
    limits = template.limits
    out: dict[str, int] = {}
    if limits.memory_bytes is not None:
        out["RLIMIT_AS"] = limits.memory_bytes
    cpu = limits.cpu_seconds if limits.cpu_seconds is not None else math.ceil(timeout_seconds) + 1
    out["RLIMIT_CPU"] = cpu
    if limits.file_size_bytes is not None:
        out["RLIMIT_FSIZE"] = limits.file_size_bytes
    if limits.open_files is not None:
        out["RLIMIT_NOFILE"] = limits.open_files
    out["RLIMIT_CORE"] = 0
    return out


def rlimit_kill_reason(exit_code: int, rlimits: dict[str, int]) -> str | None:
    """Words for a death that an rlimit caused (the kernel signals the job itself)."""
    if exit_code == -signal.SIGXCPU and "RLIMIT_CPU" in rlimits:
        return f"killed: cpu time limit {rlimits['RLIMIT_CPU']} s exceeded"
    if exit_code == -signal.SIGXFSZ and "RLIMIT_FSIZE" in rlimits:
        return f"killed: file size limit {rlimits['RLIMIT_FSIZE'] // (1024 * 1024)} MiB exceeded"
    return None


def handlers_snapshot(folder: Path) -> Path:
    """A read-only copy of the handlers directory (directories 0555, files 0444, or 0555 where the
    original is executable) that jobs run from, made again when the original changes. Jobs
    therefore cannot change the handlers other jobs run, short of a deliberate chmod (or being
    root, which the process tier does not defend against: use bwrap or microvm for that)."""
    folder = folder.resolve()
    files = sorted(os.path.join(d, f) for d, _, names in os.walk(folder) for f in names)

    def build(copy: Path) -> None:
        shutil.copytree(folder, copy, dirs_exist_ok=True)
        for dirpath, _, filenames in os.walk(copy, topdown=False):
            for name in filenames:
                target = os.path.join(dirpath, name)
                os.chmod(target, 0o555 if os.stat(target).st_mode & 0o111 else 0o444)
            os.chmod(dirpath, 0o555)

    return _workspace.cached_copy("hs", folder, _workspace.signature(files), build)


class ProcessSandbox(Sandbox):
    name: ClassVar[str] = "process"

    def __init__(self, template: Template, ttl_seconds: float) -> None:
        self._template = template
        self._ttl = ttl_seconds
        self._born = time.monotonic()
        self._proc: subprocess.Popen[bytes] | None = None
        self.handlers_path = str(handlers_snapshot(template.handlers_dir))  # may fail: nothing made yet
        self._workspace = _workspace.create()
        self.workspace_path = str(self._workspace)
        self.python = template.python or default_python()

    @classmethod
    def check_template(cls, template: Template) -> None:
        """The handlers' interpreter is the host's: one that is not there would fail every ``.py``
        job and spend its attempts."""
        python = template.python
        if python is None:
            default_python()
            return
        path = template.env.get("PATH", os.defpath)
        if shutil.which(python, path=path) is None:
            raise SandboxUnavailable(
                f"cannot use {python} as the handler interpreter: no executable file by that name"
                + ("" if "/" in python else f" on PATH {path}"))

    @classmethod
    def create(cls, template: Template, ttl_seconds: float = 900) -> ProcessSandbox:
        if not template.handlers_dir.is_dir():
            raise SandboxUnavailable(f"handlers directory {template.handlers_dir} does not exist")
        try:
            return cls(template, ttl_seconds)
        except OSError as exc:
            raise SandboxUnavailable(f"cannot prepare a process sandbox: {exc}") from None

    def write(self, path: str, data: bytes | str) -> None:
        target = (self._workspace / path).resolve()
        if not target.is_relative_to(self._workspace):
            raise ValueError(f"path {path!r} is outside the workspace")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data.encode() if isinstance(data, str) else data)

    def exec(self, argv: Sequence[str], timeout_seconds: float) -> ExecResult:
        started = time.monotonic()
        ttl_left = self._ttl - (started - self._born)
        budget = min(timeout_seconds, ttl_left)
        reason = (
            f"killed: timeout after {timeout_seconds:g} s"
            if timeout_seconds <= ttl_left
            else f"killed: ttl of {self._ttl:g} s expired"
        )
        rlimits = rlimits_for(self._template, timeout_seconds)
        status_r, status_w = os.pipe()
        limits_arg = ",".join(f"{k}={v}" for k, v in rlimits.items()) or "-"
        try:
            self._proc = proc = subprocess.Popen(
                [sys.executable, "-I", "-S", _SUPERVISOR, str(status_w), self.workspace_path, limits_arg,
                 "--", *argv],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(status_w,),
                cwd=self.workspace_path,
                env={"HOME": self.workspace_path, **self._template.env},
            )
        finally:
            os.close(status_w)
        assert proc.stdout is not None and proc.stderr is not None
        captured = _capture.Captured(self._template.limits.stdout_bytes, self._template.limits.stderr_bytes)
        try:
            hit = _capture.pump(
                proc.stdout, proc.stderr, captured, started + max(budget, 0), self._stop_supervisor
            )
            proc.wait()
            with os.fdopen(status_r, "rb") as f:
                raw = f.read()
        finally:
            proc.stdout.close()
            proc.stderr.close()
        killed: str | None = reason if hit else None
        if raw:
            status = int(raw)
            exit_code = (
                -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            )
        else:  # the supervisor was stopped before the job ended
            exit_code = -signal.SIGKILL
            killed = killed or "killed: sandbox destroyed"
        if killed is None:
            killed = rlimit_kill_reason(exit_code, rlimits)
        return ExecResult(exit_code, captured.stdout, captured.stderr, time.monotonic() - started, killed,
                          stdout_cut=captured.stdout_cut)

    def _stop_supervisor(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            self._stop_supervisor()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        _workspace.remove(self._workspace)
