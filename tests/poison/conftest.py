"""Poison pills through real drains: the tier parametrisation, the drain runner, the leftover checks.

Each pill runs in a real drain (an in-process :class:`Drainer`, or the ``fleetless drain`` CLI
where the drainer's own environment must hold secrets) beside ten well-behaved jobs, with small
limits (:data:`LIMITS`). After the drain, :func:`leftovers` looks for anything of the drain's jobs
still on the host: workspaces under ``FLEETLESS_WORKDIR``, per-job cgroups of the drainer, and
processes (every job of a run carries a unique marker in its environment, the setsid daemon also
in its argv; QEMU inherits it from the drainer).

The process and bwrap tiers run one drain per pill (a few hundred milliseconds each). A microVM
boots per job (~2 s here), so the microvm tier runs every pill in **one** drain
(:func:`microvm_batch`, concurrency 2), and each microvm test reads its pill's outcome from it.

A tier that cannot run here is skipped with its reason, unless ``FLEETLESS_REQUIRE_TIERS``
(comma-separated, as CI sets it) names it: then its tests fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest

from fleetless import Queue
from fleetless.drainer import DrainConfig, Drainer
from fleetless.sandbox import Limits, Sandbox, SandboxUnavailable, cgroups, get_backend

from .pills import GOOD, HANDLERS, Pill, pills
from proctools import alive

MiB = 1024 * 1024
TIERS = ("process", "bwrap", "forkserver", "microvm")
#: The limits of every poison drain: small, so that pills hit them fast.
LIMITS = Limits(memory_bytes=256 * MiB, pids=64, cpus=1.0, file_size_bytes=64 * MiB, tmp_bytes=32 * MiB)
GOOD_JOBS = 10
#: The microvm batch drain's TTL. It must cover a good job's slowest cold boot: ~2 s under TCG on
#: a quiet machine, but 15 s and more while other suites share the two cores (a clean-clone CI run
#: under load saw every good job "killed: ttl of 15 s expired"); the pill that sleeps past its TTL
#: is the only one that waits for it.
MICROVM_TTL = 60.0
#: How long a process/bwrap job may run unless the pill sets its own timeout.
DRAIN_TIMEOUT = 30.0
RUN_VAR = "FLEETLESS_POISON_RUN"


# -- tiers -------------------------------------------------------------------------------------
def tier_unavailable(tier: str) -> str | None:
    """Why ``tier`` cannot run here, or None."""
    try:
        get_backend(tier).check()
    except SandboxUnavailable as exc:
        return str(exc)
    return None


def required_tiers() -> set[str]:
    return {t.strip() for t in os.environ.get("FLEETLESS_REQUIRE_TIERS", "").split(",") if t.strip()}


def require_tier(tier: str) -> None:
    """Skip with the reason when ``tier`` cannot run here; fail instead where it is required."""
    reason = tier_unavailable(tier)
    if reason is None:
        return
    if tier in required_tiers():
        pytest.fail(f"sandbox tier {tier} is required here (FLEETLESS_REQUIRE_TIERS) but unavailable: {reason}")
    pytest.skip(f"sandbox tier {tier} unavailable: {reason}")


@pytest.fixture(params=[pytest.param(t, marks=pytest.mark.slow) if t == "microvm" else t for t in TIERS])
def tier(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    require_tier(name)
    return name


# -- outcomes ----------------------------------------------------------------------------------
@dataclass
class Row:
    id: int
    kind: str
    status: str
    attempts: int
    result: str | None
    last_error: str | None
    started_at: Any
    finished_at: Any

    @property
    def said(self) -> str:
        """Everything the job's row says, for assertions and failure messages."""
        return f"{self.result or ''}\n{self.last_error or ''}"


@dataclass
class Outcome:
    """What one drain left: the rows, what the host still holds, what the drain cost."""

    tier: str
    rows: dict[str, Row]  # pill jobs by kind
    good: list[Row]
    leftovers: list[str]
    summary: str
    seconds: float
    rss_growth: int | None = None  # the drainer's RSS growth during the drain (in-process drains)
    context: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, kind: str) -> Row:
        return self.rows[kind]

    def assert_contained(self) -> None:
        """The ten well-behaved jobs are done with their own results, and nothing is left."""
        for row in self.good:
            n = int(json.loads(row.result or "{}").get("n", -1)) if row.status == "done" else -1
            want = json.dumps({"n": n, "square": n * n, "child": "42"}) + "\n"
            assert row.status == "done" and row.result == want and row.attempts == 1, (self.tier, row)
        assert sorted(json.loads(r.result or "{}")["n"] for r in self.good) == list(range(GOOD_JOBS))
        assert self.leftovers == [], (self.tier, self.leftovers)


# -- what a drain leaves on the host ------------------------------------------------------------
def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def _processes() -> Iterator[tuple[int, bytes, bytes]]:
    """(pid, cmdline, environ) of every live host process we can read."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        stat = _read(f"/proc/{name}/stat")
        if not stat:
            continue
        rest = stat[stat.rindex(b")") + 2 :].split()
        if rest[0] in (b"Z", b"X"):
            continue
        yield int(name), _read(f"/proc/{name}/cmdline"), _read(f"/proc/{name}/environ")


def _cgroup_bases() -> list[Path]:
    layout = cgroups.detect()
    bases = list(layout.v1.values())
    if layout.unified is not None:
        bases.append(layout.unified)
    return bases


def _launcher_groups() -> set[str]:
    """Groups of the bwrap tier's pre-warmed launchers and the fork server's ready inits
    (limit-less, no job in them yet)."""
    try:
        from fleetless.sandbox.bwrap import _launcher
    except ImportError:
        return set()
    from fleetless.sandbox.forkserver import client

    return client.pool.ready_groups() | {
        launcher.cgroup.name for launcher in list(_launcher._pool._ready) if launcher.cgroup is not None}


@dataclass
class Spy:
    """What every sandbox of a drain held on the host, recorded when it was created."""

    workspaces: list[Path] = field(default_factory=list)
    cgroup_dirs: list[Path] = field(default_factory=list)
    sandboxes: list[Sandbox] = field(default_factory=list)

    def install(self, tier: str, monkeypatch: pytest.MonkeyPatch) -> None:
        cls = get_backend(tier)
        original = cls.create

        def create(template: Any, ttl_seconds: float = 900) -> Sandbox:
            sbx = original(template, ttl_seconds)
            self.sandboxes.append(sbx)
            ws = getattr(sbx, "host_workspace", None) or getattr(sbx, "_workspace", None)
            if isinstance(ws, Path):
                self.workspaces.append(ws)
            cg = getattr(sbx, "cgroup", None)
            if cg is not None:
                self.cgroup_dirs += list(cg.dirs)
            return sbx

        monkeypatch.setattr(cls, "create", create)


def _scan(run_id: str, workdir: Path, spy: Spy | None, drainer_pid: int, ignore_groups: set[str]) -> list[str]:
    found: list[str] = []
    if workdir.exists():
        found += [f"workspace {p}" for p in sorted(workdir.glob("ws-*"))]
    if spy is not None:
        found += [f"workspace {p}" for p in spy.workspaces if p.exists() and f"workspace {p}" not in found]
        found += [f"cgroup {d}" for d in spy.cgroup_dirs if d.exists()]
        for sbx in spy.sandboxes:
            boot = getattr(sbx, "last_boot", None)
            if boot is not None and boot.pid and alive(boot.pid):
                found.append(f"qemu pid {boot.pid}")
    # The marker is in every job's environment (and so the process tier's supervisor's), in bwrap's
    # command line (--setenv) and in QEMU's environment (inherited from the drainer). The bwrap
    # tier's watchdog belongs to the drainer process, not to a job (it inherits the environment
    # the drainer had when it started it, marker included).
    mark = run_id.encode()
    me = os.getpid()
    for pid, cmdline, environ in _processes():
        if pid == me or b"fleetless.sandbox.bwrap._watchdog" in cmdline:
            continue
        if mark in cmdline or mark in environ:
            command = cmdline.replace(bytes(1), b" ").decode(errors="replace")[:120]
            found.append(f"process {pid}: {command}")
    prefix = f"{cgroups.PREFIX}{drainer_pid}-"
    allowed = _launcher_groups() | ignore_groups if drainer_pid == me else ignore_groups
    for base in _cgroup_bases():
        try:
            entries = list(base.iterdir())
        except OSError:
            continue
        found += [f"cgroup {e}" for e in entries
                  if e.name.startswith(prefix) and e.name not in allowed and f"cgroup {e}" not in found]
    return found


def leftovers(run_id: str, workdir: Path, spy: Spy | None, drainer_pid: int,
              ignore_groups: set[str] | None = None, settle: float = 5.0) -> list[str]:
    """Anything of the drain's jobs still on the host (given ``settle`` seconds to go away)."""
    deadline = time.monotonic() + settle
    while True:
        found = _scan(run_id, workdir, spy, drainer_pid, ignore_groups or set())
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(0.1)


class RssSampler:
    """Peak RSS growth of this process while it runs (the drainer's memory must stay flat)."""

    def __init__(self) -> None:
        self.base = self._rss()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    @staticmethod
    def _rss() -> int:
        for line in _read("/proc/self/status").decode().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def _loop(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self._rss())

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def growth(self) -> int:
        return self.peak - self.base


# -- running pills ----------------------------------------------------------------------------
def write_handlers(folder: Path) -> Path:
    folder.mkdir(parents=True)
    folder.chmod(0o755)
    folder.parent.chmod(0o755)
    for name, source in HANDLERS.items():
        path = folder / name
        path.write_text(textwrap.dedent(source).lstrip())
        path.chmod(0o644 if name.endswith(".py") else 0o755)
    return folder


@dataclass
class Context:
    """Per-run values the pills' payloads carry."""

    run_id: str
    workdir: Path
    handlers: Path
    usr_file: str
    secret: str

    @classmethod
    def make(cls, tmp: Path, workdir: Path | None = None) -> Context:
        run_id = f"poison-{uuid.uuid4().hex}"
        return cls(run_id=run_id, workdir=workdir or tmp / "work", handlers=write_handlers(tmp / "handlers"),
                   usr_file=f"/usr/fleetless-{run_id}.txt", secret=f"s3cret-{uuid.uuid4().hex}")

    def pills(self, sibling_wait: float) -> dict[str, Pill]:
        return pills(workdir=str(self.workdir), usr_file=self.usr_file, secret=self.secret, marker=self.run_id,
                     sibling_wait=sibling_wait)

    def environment(self) -> dict[str, str]:
        """What the drainer's environment holds on top of the test's: secrets and the run marker."""
        return {"PGPASSWORD": f"pw-{self.secret}", "FLEETLESS_POISON_SECRET": self.secret,
                RUN_VAR: self.run_id, "FLEETLESS_WORKDIR": str(self.workdir)}


def _schema() -> str:
    return f"poison_{uuid.uuid4().hex[:12]}"


def enqueue(queue: Queue, chosen: list[Pill]) -> None:
    """Each pill (one attempt: its failure is final), then a good job of the same priority, so that
    at concurrency 2 a good job is claimed beside each pill; the remaining good jobs last."""
    good = [(GOOD, {"n": i}) for i in range(GOOD_JOBS)]
    for pill in chosen:
        for job in pill.jobs:
            queue.enqueue(job.kind, job.payload, max_attempts=1, priority=job.priority, timeout=job.timeout)
        if good:
            kind, payload = good.pop(0)
            queue.enqueue(kind, payload, priority=pill.jobs[-1].priority)
    queue.enqueue_many(good)


def read_rows(dsn: str, schema: str, chosen: list[Pill]) -> tuple[dict[str, Row], list[Row]]:
    with psycopg.connect(dsn, autocommit=True) as c:
        fetched = c.execute(
            f"SELECT id, kind, status, attempts, result, last_error, started_at, finished_at "
            f"FROM {schema}.jobs ORDER BY id").fetchall()
    rows = [Row(*r) for r in fetched]
    kinds = {job.kind for pill in chosen for job in pill.jobs}
    return {r.kind: r for r in rows if r.kind in kinds}, [r for r in rows if r.kind == GOOD]


def drain(dsn: str, tier: str, ctx: Context, chosen: list[Pill], monkeypatch: pytest.MonkeyPatch, *,
          ttl: float, via_cli: bool, ignore_groups: set[str] | None = None,
          limits: Limits = LIMITS) -> Outcome:
    """Run ``chosen`` pills and ten good jobs through one real drain on ``tier`` (with ``limits``)."""
    schema = _schema()
    queue = Queue(dsn, schema=schema)
    queue.init()
    enqueue(queue, chosen)
    queue.close()
    for name, value in ctx.environment().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("DATABASE_URL", dsn)
    started = time.monotonic()
    rss: int | None = None
    spy: Spy | None = None
    if via_cli:
        env = {**os.environ, "FLEETLESS_SCHEMA": schema}
        proc = subprocess.Popen(
            [sys.executable, "-m", "fleetless.cli", "drain", "--handlers", str(ctx.handlers), "--sandbox", tier,
             "--concurrency", "2", "--timeout", f"{DRAIN_TIMEOUT:g}", "--ttl", f"{ttl:g}",
             "--memory", f"{LIMITS.memory_bytes}", "--pids", str(LIMITS.pids), "--pass-env", RUN_VAR],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, (out, err)
        summary, drainer_pid = out.strip().splitlines()[-1], proc.pid
    else:
        spy = Spy()
        spy.install(tier, monkeypatch)
        config = DrainConfig(handlers_dir=ctx.handlers, sandbox=tier, concurrency=2, timeout=DRAIN_TIMEOUT, ttl=ttl,
                             limits=limits, pass_env=(RUN_VAR,))
        queue = Queue(dsn, schema=schema)
        try:
            with RssSampler() as sampler:
                summary = Drainer(queue, config).run().line()
            rss = sampler.growth
        finally:
            queue.close()
        drainer_pid = os.getpid()
    seconds = time.monotonic() - started
    rows, good = read_rows(dsn, schema, chosen)
    left = leftovers(ctx.run_id, ctx.workdir, spy, drainer_pid, ignore_groups)
    return Outcome(tier, rows, good, left, summary, seconds, rss, context={"ctx": ctx, "pills": chosen})


# -- the fixtures the tests use -----------------------------------------------------------------
@pytest.fixture(scope="module")
def microvm_batch(dsn: str, tmp_path_factory: pytest.TempPathFactory) -> Outcome:
    """Every pill in one microvm drain (concurrency 2, TTL :data:`MICROVM_TTL`) beside ten good jobs."""
    require_tier("microvm")
    # Restores are the tier's default: a snapshot of this suite's RAM size (build-image makes the
    # 512 MiB one), so that the pills run where jobs run (a cold boot per job otherwise).
    from fleetless.sandbox.microvm.image import load_image
    from fleetless.sandbox.microvm.snapshot import build_snapshot

    build_snapshot(load_image(), (LIMITS.memory_bytes or 0) // MiB, 1)
    ctx = Context.make(tmp_path_factory.mktemp("microvm-poison"))
    chosen = list(ctx.pills(sibling_wait=4).values())
    with pytest.MonkeyPatch.context() as mp:  # undone before the module's other tests run
        outcome = drain(dsn, "microvm", ctx, chosen, mp, ttl=MICROVM_TTL, via_cli=False)
    return outcome


@pytest.fixture
def poison(tier: str, dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
           request: pytest.FixtureRequest) -> Callable[[str], Outcome]:
    """``poison(name)``: the outcome of that pill beside ten good jobs on this test's tier
    (``workdir``: where the drain's FLEETLESS_WORKDIR is, default a directory in ``tmp_path``;
    ``limits``: the drain's, default :data:`LIMITS`; not for the microvm batch or a CLI pill)."""

    def run(name: str, workdir: Path | None = None, limits: Limits = LIMITS) -> Outcome:
        if tier == "microvm":
            assert limits is LIMITS, "the microvm batch drains with LIMITS only"
            outcome: Outcome = request.getfixturevalue("microvm_batch")
            assert name in {job.kind for p in outcome.context["pills"] for job in p.jobs} | {
                p.name for p in outcome.context["pills"]}
            return outcome
        ctx = Context.make(tmp_path, workdir)
        if name == "fork_bomb" and get_backend(tier).caps(LIMITS)["pids"].startswith("NOT"):
            pytest.skip(f"{tier} does not cap processes here (Sandbox.caps); a fork bomb is not run on this host")
        pill = ctx.pills(sibling_wait=4)[name]
        try:
            outcome = drain(dsn, tier, ctx, [pill], monkeypatch, ttl=pill.ttl or 60, via_cli=pill.via_cli,
                            limits=limits)
        finally:
            if os.path.exists(ctx.usr_file):
                os.unlink(ctx.usr_file)
        return outcome

    return run
