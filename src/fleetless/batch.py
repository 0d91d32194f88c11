"""Running claimed jobs in sandboxes: one job per sandbox, or a batch of one kind per sandbox.

:meth:`Runner.run` takes jobs of one kind and returns each job's :class:`~fleetless.job.Outcome`;
the completer writes them. How a batch runs:

- A script or executable handler with one job: the seed's shape, ``exec`` of the handler itself.
- Otherwise the in-sandbox batch runner (``sandbox/_batch_runner.py``) is written into the
  workspace with the jobs and runs them in order, one result line each: a ``handle(payload)``
  module is imported once and called per job; a script runs as one process per job.
- Each job keeps its own outcome. A job that takes the sandbox down (os._exit, a segfault, the
  memory limit, a timeout the interpreter could not stop, the TTL) is charged alone: the jobs
  before it keep their results, and the ones after it run on in a fresh sandbox, charged nothing.
- When the drainer stops (:meth:`Slot.abort`), the sandbox is destroyed and every job without a
  result is released: back to pending with its attempt given back.
"""

from __future__ import annotations

import json
import re
import signal
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from . import handlers
from .job import Job, Outcome
from .retry import MAX_ERROR_CHARS
from .sandbox import ExecResult, Sandbox, Template

__all__ = ["RUNNER_NAME", "Runner", "Slot", "describe_failure", "job_env"]

RUNNER = Path(__file__).parent / "sandbox" / "_batch_runner.py"
RUNNER_NAME = "_fleetless_batch.py"
#: Seconds the batch runner's watchdog allows past a job's timeout before it stops the sandbox.
HARD_GRACE = 2.0
#: Room for one job's record on the runner's stdout, beyond the job's own stdout.
RECORD_OVERHEAD = 8 * 1024
_NUL_ESCAPE = re.compile(r"(?<!\\)((?:\\\\)*)\\u0000")
RELEASED_STOPPING = "released: the drainer stopped before the job finished"


def describe_failure(r: ExecResult) -> str:
    """last_error for a failed run: what happened in one line, then the tail of stderr."""
    if r.killed:
        head = r.killed
    elif r.exit_code < 0:
        try:
            name = signal.Signals(-r.exit_code).name
        except ValueError:
            name = f"signal {-r.exit_code}"
        head = f"killed by {name}"
    else:
        head = f"exit code {r.exit_code}"
    tail = r.stderr.rstrip()
    if not tail:
        return head
    room = MAX_ERROR_CHARS - len(head) - 1
    return f"{head}\n{tail[-room:]}"


def job_env(job: Job, base: dict[str, str]) -> dict[str, str]:
    """One job's whole environment: the drain's, plus who it is."""
    return {**base, **_own_env(job)}


def _own_env(job: Job) -> dict[str, str]:
    return {"FLEETLESS_JOB_ID": str(job.id), "FLEETLESS_ATTEMPT": str(job.attempts), "FLEETLESS_KIND": job.kind}


class Slot:
    """The sandbox a running batch uses right now, so that the drainer can destroy it on stop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sandbox: Sandbox | None = None
        self.aborted = False

    def attach(self, sbx: Sandbox) -> bool:
        """Use ``sbx``; False (and nothing attached) when the slot was aborted already."""
        with self._lock:
            if self.aborted:
                return False
            self._sandbox = sbx
            return True

    def detach(self) -> None:
        with self._lock:
            self._sandbox = None

    def abort(self) -> None:
        """Stop: destroy the sandbox in use (its job is released), start no other."""
        with self._lock:
            self.aborted = True
            sbx = self._sandbox
        if sbx is not None:
            sbx.kill()


class SandboxBroken(Exception):
    """The sandbox failed, not the job: the drain cannot go on with this tier."""


@dataclass(frozen=True)
class Runner:
    backend: type[Sandbox]
    template: Template  # handlers_dir resolved; env = the drain's base environment
    ttl: float = 900
    default_timeout: float = 600

    def timeout_of(self, job: Job) -> float:
        return min(float(job.timeout_seconds or self.default_timeout), self.ttl)

    def run(self, jobs: Sequence[Job], slot: Slot) -> tuple[list[tuple[Job, Outcome]], str | None]:
        """Run ``jobs`` (all of one kind) and return each one's outcome, in order, plus the reason
        the drain must stop when a sandbox broke (every job not run is then released)."""
        if not jobs:
            return [], None
        kind = jobs[0].kind
        assert all(j.kind == kind for j in jobs), "a batch is of one kind"
        handler = handlers.resolve(self.template.handlers_dir, kind)
        if handler is None:
            error = (f"no handler for kind {kind!r}: neither {kind}.py nor an executable {kind} in "
                     f"{self.template.handlers_dir}")
            return [(j, Outcome("fail", error=error, permanent=True)) for j in jobs], None
        done: list[tuple[Job, Outcome]] = []
        left = list(jobs)
        while left:
            if slot.aborted:
                done += [(j, Outcome("release", error=RELEASED_STOPPING)) for j in left]
                break
            try:
                if len(left) == 1 and not handler.module:
                    got = [self._single(left[0], handler, slot)]
                    r = None
                else:
                    got, r = self._batch(left, handler, slot)
            except SandboxBroken as exc:
                error = f"sandbox error ({self.backend.name}): {exc}"
                done += [(j, Outcome("release", error=error)) for j in left]
                return done, error
            done += got
            left = left[len(got):]
            if not left or r is None:
                continue
            if slot.aborted:  # destroyed by the drainer's stop: nobody is charged
                continue
            if r.ok and got:  # the runner stopped before its TTL: the rest go to a fresh sandbox
                continue
            done.append((left[0], Outcome("fail", error=self._death(left[0], handler, r))))
            left = left[1:]
        return done, None

    # -- one sandbox ---------------------------------------------------------------------------

    def _sandbox(self, template: Template, slot: Slot) -> Sandbox:
        try:
            sbx = self.backend.create(template, self.ttl)
        except Exception as exc:
            raise SandboxBroken(str(exc)) from None
        if not slot.attach(sbx):
            sbx.kill()
            raise _Aborted()
        return sbx

    def _single(self, job: Job, handler: handlers.Handler, slot: Slot) -> tuple[Job, Outcome]:
        template = replace(self.template, env=job_env(job, dict(self.template.env)))
        try:
            sbx = self._sandbox(template, slot)
        except _Aborted:
            return job, Outcome("release", error=RELEASED_STOPPING)
        try:
            sbx.write("payload.json", json.dumps(job.payload))
            argv = handler.argv(sbx.handlers_path, sbx.python, f"{sbx.workspace_path}/payload.json")
            r = sbx.exec(argv, self.timeout_of(job))
        except Exception as exc:
            raise SandboxBroken(str(exc)) from None
        finally:
            sbx.kill()
            slot.detach()
        if slot.aborted and r.killed is not None:  # one that ended on its own keeps its outcome
            return job, Outcome("release", error=RELEASED_STOPPING)
        if r.ok:
            return job, Outcome("done", result=r.stdout, result_cut=r.stdout_cut)
        return job, Outcome("fail", error=describe_failure(r), result=r.stdout, result_cut=r.stdout_cut)

    def _batch(self, jobs: Sequence[Job], handler: handlers.Handler,
               slot: Slot) -> tuple[list[tuple[Job, Outcome]], ExecResult | None]:
        limits = self.template.limits
        per_job = limits.stdout_bytes + RECORD_OVERHEAD
        template = replace(self.template, limits=replace(limits, stdout_bytes=per_job * len(jobs) + 65536))
        try:
            sbx = self._sandbox(template, slot)
        except _Aborted:
            return [(j, Outcome("release", error=RELEASED_STOPPING)) for j in jobs], None
        try:
            script = f"{sbx.handlers_path}/{handler.filename}"
            desc = {
                "handler": script, "module": handler.module,
                "argv": handler.argv(sbx.handlers_path, sbx.python, "")[:-1],
                "budget": self.ttl, "grace": HARD_GRACE,
                "stdout_bytes": limits.stdout_bytes, "stderr_bytes": MAX_ERROR_CHARS,
                "jobs": [{"payload": j.payload, "timeout": self.timeout_of(j), "env": _own_env(j)} for j in jobs],
            }
            sbx.write(RUNNER_NAME, RUNNER.read_bytes())
            sbx.write("batch.json", json.dumps(desc))
            ws = sbx.workspace_path
            r = sbx.exec([sbx.python, f"{ws}/{RUNNER_NAME}", f"{ws}/batch.json"], self.ttl)
        except Exception as exc:
            raise SandboxBroken(str(exc)) from None
        finally:
            sbx.kill()
            slot.detach()
        return self._parse(jobs, r.stdout), r

    def _parse(self, jobs: Sequence[Job], stdout: str) -> list[tuple[Job, Outcome]]:
        """The records, in order, up to the first that is missing or not well formed."""
        out: list[tuple[Job, Outcome]] = []
        for line in stdout.splitlines():
            if len(out) == len(jobs):
                break
            try:
                rec = json.loads(line)
                if rec["i"] != len(out):
                    break
                out.append((jobs[len(out)], _outcome(rec)))
            except (ValueError, KeyError, TypeError):
                break
        return out

    def _death(self, job: Job, handler: handlers.Handler, r: ExecResult) -> str:
        """The charged job's last_error when it took the sandbox down."""
        if handler.module and r.killed is None and r.exit_code == 1 and "Timeout (" in r.stderr:
            return f"killed: timeout after {self.timeout_of(job):g} s (stopped by the watchdog)"
        if r.ok:
            return "the batch runner ended without running this job"
        return describe_failure(r)


class _Aborted(Exception):
    pass


def _text(value: object) -> str:
    """Text PostgreSQL accepts: a lone surrogate (from a \\udXXX escape) becomes "?"."""
    return str(value).encode("utf-8", "replace").decode("utf-8")


def _outcome(rec: dict[str, Any]) -> Outcome:
    if "ok" in rec:  # handle()
        if rec["ok"]:
            text = json.dumps(rec["result"], allow_nan=False, ensure_ascii=False, separators=(",", ":"))
            return Outcome("done", result_json=_NUL_ESCAPE.sub(r"\1\\ufffd", _text(text)))
        return Outcome("fail", error=_text(rec["error"]))
    r = ExecResult(int(rec["exit"]), _text(rec["stdout"]), _text(rec["stderr"]), float(rec["duration"]),
                   _text(rec["killed"]) if isinstance(rec["killed"], str) else None,
                   stdout_cut=rec.get("stdout_cut") is True)
    if r.ok:
        return Outcome("done", result=r.stdout, result_cut=r.stdout_cut)
    return Outcome("fail", error=describe_failure(r), result=r.stdout, result_cut=r.stdout_cut)
