"""``fleetless doctor``: which sandbox tiers work here, why not where they do not, start-up cost."""

from __future__ import annotations

import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import click

from .sandbox import Template, available_backends, default_python, get_backend
from .sandbox._caps import caps_in_full

RUNS = 3


def _bare_python_ms(python: str) -> float:
    times = []
    for _ in range(RUNS):
        t = time.perf_counter()
        subprocess.run([python, "-c", "print(1)"], check=True, capture_output=True)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def _probe(name: str, handlers: Path) -> tuple[bool, str]:
    """(works, detail) for one backend: the check, then a trivial job timed end to end."""
    try:
        backend = get_backend(name)
        backend.check()
    except Exception as exc:  # any reason a tier cannot run is an answer here
        return False, str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    times = []
    runs = 1 if name == "microvm" else RUNS
    try:
        for _ in range(runs):
            t = time.perf_counter()
            with backend.create(Template(handlers_dir=handlers), ttl_seconds=120) as sbx:
                r = sbx.exec([sbx.python, f"{sbx.handlers_path}/ping.py"], 120)
            times.append(time.perf_counter() - t)
            if not r.ok or r.stdout.strip() != "pong":
                return False, f"trivial job failed: exit {r.exit_code} {r.killed or ''} {r.stderr[-200:]}"
    except Exception as exc:
        return False, f"trivial job failed: {exc}"
    detail = f"trivial job end to end {statistics.median(times) * 1000:.0f} ms"
    if backend.describe():
        detail += f"; {backend.describe()}"
    return True, detail


def _handler_python(name: str, handlers: Path) -> str | None:
    """The interpreter a drain on tier ``name`` runs ``.py`` handlers with (None: cannot say)."""
    try:
        return get_backend(name).handler_python(Template(handlers_dir=handlers))
    except Exception:  # a tier that cannot run here has no answer; its probe says why
        return None


def _workdir() -> dict[str, Any]:
    """``{"path", "ok", "detail"}``: the work directory a drain here would use, or why it refuses it."""
    from .sandbox import _workspace

    try:
        path = _workspace.root()
    except OSError as exc:
        return {"path": None, "ok": False, "detail": str(exc)}
    return {"path": str(path), "ok": True,
            "detail": f"{path}: this user's own, no one else may write or swap it"}


def check(handlers_dir: Path | None = None) -> dict[str, Any]:
    """``{"python", "python_startup_ms", "workdir": {"path", "ok", "detail"},
    "tiers": [{"name", "ok", "detail", "python", "caps"}, ...]}``:
    ``caps`` says which resource caps hold for the tier's jobs (``Sandbox.caps``, default limits);
    ``python`` is what the process tier runs ``.py`` handlers with, each tier's its own (the
    drain's choice, not a guess: a root drainer's venv under /root is still the handlers' own
    where the tier binds it). With ``handlers_dir``, each working tier also has ``"kinds"``:
    ``{kind: None or why a drain there would not claim it}`` (:func:`kinds_report`), and the report
    ``"shared_kinds"``: the kinds whose batches run in one process (``batch_isolation = "shared"``)."""
    tiers = []
    with tempfile.TemporaryDirectory(prefix="fleetless-doctor-") as tmp:
        handlers = Path(tmp)
        handlers.chmod(0o755)
        (handlers / "ping.py").write_text("print('pong')\n")
        (handlers / "ping.py").chmod(0o644)
        python = _handler_python("process", handlers) or default_python()
        startup = _bare_python_ms(python)
        for name in available_backends():
            ok, detail = _probe(name, handlers)
            tiers.append({"name": name, "ok": ok, "detail": detail,
                          "python": _handler_python(name, handlers) if ok else None,
                          "caps": get_backend(name).caps() if ok else None})
    out: dict[str, Any] = {"python": python, "python_startup_ms": round(startup, 1), "workdir": _workdir(),
                           "tiers": tiers}
    if handlers_dir is not None:
        from . import kinds

        per_tier = kinds_report(handlers_dir, [str(t["name"]) for t in tiers if t["ok"]])
        for t in tiers:
            t["kinds"] = per_tier.get(str(t["name"]))
        out["shared_kinds"] = sorted(k for k, ks in kinds.load(handlers_dir).items() if ks.shared)
    return out


def kinds_report(handlers_dir: Path, tiers: list[str]) -> dict[str, dict[str, str | None]]:
    """``{tier: {kind: None (runs) or why it is not claimed}}`` for the kinds of ``handlers_dir``
    (each with its fleetless.toml ``interpreter``), on each tier that works here: what a drain
    there would refuse before claiming (:func:`.handlers.unrunnable`)."""
    from dataclasses import replace

    from . import handlers, kinds
    from .sandbox import SandboxUnavailable

    settings = kinds.load(handlers_dir)
    interpreters = {k: ks.interpreter for k, ks in settings.items() if ks.interpreter is not None}
    template = Template(handlers_dir=handlers_dir)
    out: dict[str, dict[str, str | None]] = {}
    for tier in tiers:
        backend = get_backend(tier)
        found = handlers.unrunnable(handlers_dir, backend, template, interpreters)
        for kind, python in interpreters.items():
            if kind not in found:
                try:
                    backend.check_template(replace(template, python=python))
                except SandboxUnavailable as exc:
                    found[kind] = f"interpreter {python}: {exc}"
        out[tier] = {kind: found.get(kind) for kind in sorted(handlers.kinds(handlers_dir))}
    return out


def run(handlers_dir: Path | None = None) -> None:
    report = check(handlers_dir)
    click.echo(f"bare {report['python']} start-up: {report['python_startup_ms']:.0f} ms (median of {RUNS})")
    click.echo(f"work dir {'ok' if report['workdir']['ok'] else 'refused':<12} {report['workdir']['detail']}")
    for tier in report["tiers"]:
        python = f"; .py handlers run under {tier['python']}" if tier["python"] else ""
        click.echo(f"{tier['name']:<8} {'ok' if tier['ok'] else 'unavailable':<12} {tier['detail']}{python}")
        if tier["caps"]:  # a line a cap (they were one line of ~1,000 characters)
            for line in caps_in_full(tier["name"], tier["caps"]):
                click.echo(f"         {line}")
        for kind, why in (tier.get("kinds") or {}).items():
            click.echo(f"         kind {kind}: " + ("runs" if why is None else f"not claimed here: {why}"))
    if report.get("shared_kinds"):
        click.echo(f"batches  shared       kinds {', '.join(report['shared_kinds'])}: batch_isolation = \"shared\","
                   " their batch's handle() jobs in one process (trusted code only: docs/isolation.md)")
