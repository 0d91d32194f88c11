"""Per-kind settings: ``fleetless.toml`` in the handlers directory, next to the handlers.

```toml
[kinds.render-invoice]
timeout = "2m"          # the job's timeout (a job's own --timeout wins)
ttl = "15m"             # its sandbox's lifetime
backoff_base = "30s"    # retry delay = 2^attempts x base + uniform(0, jitter), at most backoff_cap
backoff_cap = "1h"
jitter = "10s"
memory = "1G"           # sandbox caps
cpus = 2
pids = 256
network = true
interpreter = "/usr/bin/python3.12"
max_attempts = 5        # for jobs enqueued without their own max_attempts (applied at each claim)
tier = "bwrap"          # its sandbox tier (the drain's --sandbox for the others)
batch_size = 50         # up to this many of its jobs per sandbox (batch mode)
batch_isolation = "shared"  # batch mode: its handle() jobs in the runner's own process, one after
                        # another (trusted code only: a job can reach the others of its batch;
                        # docs/isolation.md). Default "process": each job a fork of its own
concurrency = 5         # at most 5 of its jobs running at once, across every drainer on every host
rate = "100/min"        # at most 100 of its jobs started in any minute, across every drainer
```

The drain's flags are the defaults; what a kind sets wins over them; what a job was enqueued with
(its own timeout, its max_attempts) wins over the kind. ``concurrency`` and ``rate`` are enforced
by the claim against the table (see :meth:`fleetless.queue.Queue.claim`), so every drain serving
the kind must read the same file (deploy it with the handlers). The file is read with the standard
library's ``tomllib`` when a drain starts; an unknown key, a bad value or a table for a kind whose
name is not a valid kind is a one-line error naming the file, the kind and the key, before
anything is claimed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from ._units import parse_duration, parse_size
from .job import validate_kind
from .periodic import Schedule
from .retry import RetryPolicy
from .sandbox import Limits, available_backends

__all__ = ["FILENAME", "KindSettings", "Rate", "SettingsError", "load", "load_schedules"]

FILENAME = "fleetless.toml"


class SettingsError(ValueError):
    """A one-line error about the settings file."""


@dataclass(frozen=True)
class Rate:
    """At most ``count`` jobs of a kind started in any window of ``seconds``."""

    count: int
    seconds: float


@dataclass(frozen=True)
class KindSettings:
    """One kind's settings; None: the drain's default."""

    timeout: float | None = None  # seconds
    ttl: float | None = None  # seconds
    backoff_base: float | None = None  # seconds
    backoff_cap: float | None = None  # seconds
    jitter: float | None = None  # seconds
    memory: int | None = None  # bytes
    cpus: float | None = None
    pids: int | None = None
    network: bool | None = None
    interpreter: str | None = None
    max_attempts: int | None = None
    tier: str | None = None
    batch_size: int | None = None
    batch_isolation: str | None = None  # "process" (None: the default) or "shared"
    concurrency: int | None = None
    rate: Rate | None = None

    @property
    def shared(self) -> bool:
        """Batch mode runs its handle() jobs in the batch runner's own process (``batch_isolation``)."""
        return self.batch_isolation == "shared"

    @property
    def limited(self) -> bool:
        """A global limit (concurrency or rate) applies: its jobs are claimed under its lock."""
        return self.concurrency is not None or self.rate is not None

    def limits(self, default: Limits) -> Limits:
        return replace(
            default,
            memory_bytes=default.memory_bytes if self.memory is None else self.memory,
            cpus=default.cpus if self.cpus is None else self.cpus,
            pids=default.pids if self.pids is None else self.pids,
            network=default.network if self.network is None else self.network)

    def retry(self, default: RetryPolicy) -> RetryPolicy:
        return RetryPolicy(
            base_seconds=default.base_seconds if self.backoff_base is None else self.backoff_base,
            max_jitter_seconds=default.max_jitter_seconds if self.jitter is None else self.jitter,
            max_delay_seconds=default.max_delay_seconds if self.backoff_cap is None else self.backoff_cap)

    def describe(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
        if self.rate is not None:
            out["rate"] = f"{self.rate.count}/{self.rate.seconds:g}s"
        return out


def _duration(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"a duration such as 90, \"90s\" or \"5m\", not {value!r}")
    seconds = parse_duration(value) if isinstance(value, str) else float(value)
    if not 0 < seconds < 2**31:
        raise ValueError(f"must be positive, not {value!r}")
    return seconds


def _non_negative_duration(value: object) -> float:
    if value == 0:
        return 0.0
    return _duration(value)


def _size(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"a size such as \"512M\" or \"1G\", not {value!r}")
    size = parse_size(value) if isinstance(value, str) else value
    if size < 1024 * 1024:
        raise ValueError(f"must be at least 1M, not {value!r}")
    return size


def _positive_int(value: object, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
        raise ValueError(f"an integer from 1 to {high}, not {value!r}")
    return value


def _cpus(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1024:
        raise ValueError(f"a number of cores above 0, not {value!r}")
    return float(value)


def _bool(value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"true or false, not {value!r}")
    return value


def _path(value: object) -> str:
    if not isinstance(value, str) or not value.startswith("/"):
        raise ValueError(f"an absolute path, not {value!r}")
    return value


_RATE = re.compile(r"^\s*(\d+)\s*/\s*(\S+)\s*$")
_RATE_UNITS = {"s": 1, "sec": 1, "second": 1, "m": 60, "min": 60, "minute": 60, "h": 3600, "hour": 3600,
               "d": 86400, "day": 86400}


def _rate(value: object) -> Rate:
    m = _RATE.match(value) if isinstance(value, str) else None
    if m is None:
        raise ValueError(f"a rate such as \"100/min\", \"5/s\" or \"20/10s\", not {value!r}")
    count, per = int(m.group(1)), m.group(2)
    try:
        seconds = float(_RATE_UNITS[per]) if per in _RATE_UNITS else parse_duration(per)
    except ValueError:
        raise ValueError(f"a rate such as \"100/min\", \"5/s\" or \"20/10s\", not {value!r}") from None
    if not 1 <= count <= 1_000_000 or not 0.001 <= seconds <= 86400:
        raise ValueError(f"from 1 to 1000000 jobs per window of 1 ms to 1 day, not {value!r}")
    return Rate(count, seconds)


#: How the jobs of one batch are kept apart: each in a fork of its own (the default), or one
#: after another in the batch runner's own process (trusted code; docs/isolation.md).
BATCH_ISOLATION = ("process", "shared")


def _batch_isolation(value: object) -> str:
    if value not in BATCH_ISOLATION:
        raise ValueError(f"\"process\" (each job a process of its own) or \"shared\" (the batch's jobs in one"
                         f" process: trusted code only), not {value!r}")
    assert isinstance(value, str)
    return value


def _tier(value: object) -> str:
    if value not in available_backends():
        raise ValueError(f"one of {', '.join(available_backends())}, not {value!r}")
    assert isinstance(value, str)
    return value


_PARSERS: dict[str, Any] = {
    "timeout": _duration, "ttl": _duration, "backoff_base": _non_negative_duration,
    "backoff_cap": _duration, "jitter": _non_negative_duration, "memory": _size, "cpus": _cpus,
    "pids": lambda v: _positive_int(v, 1_000_000), "network": _bool, "interpreter": _path,
    "max_attempts": lambda v: _positive_int(v, 1000), "tier": _tier,
    "batch_size": lambda v: _positive_int(v, 100_000), "batch_isolation": _batch_isolation,
    "concurrency": lambda v: _positive_int(v, 100_000),
    "rate": _rate,
}


def _read(handlers_dir: Path) -> tuple[Path, dict[str, Any]]:
    path = handlers_dir / FILENAME
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return path, {}
    except OSError as exc:
        raise SettingsError(f"{path}: cannot read: {exc.strerror}") from None
    import tomllib  # only a drain whose handlers have a fleetless.toml pays for it (the cron tick)

    try:
        data = tomllib.loads(text.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise SettingsError(f"{path}: not valid TOML: {exc}") from None
    unknown = set(data) - {"kinds", "schedules"}
    if unknown:
        raise SettingsError(f"{path}: unknown table or key {sorted(unknown)[0]!r}"
                            " (only [kinds.<kind>] and [schedules.<name>] tables)")
    return path, data


_SCHEDULE_KEYS = {"cron", "kind", "payload", "timezone", "queue", "max_attempts", "priority", "timeout"}


def load_schedules(handlers_dir: Path) -> list[Schedule]:
    """Periodic jobs declared in the file as ``[schedules.<name>]`` tables (cron, kind, and
    optionally payload, timezone, queue, max_attempts, priority, timeout)."""
    path, data = _read(handlers_dir)
    tables = data.get("schedules", {})
    if not isinstance(tables, dict):
        raise SettingsError(f"{path}: 'schedules' must be a table of [schedules.<name>] tables")
    out = []
    for name, table in tables.items():
        where = f"{path}: [schedules.{name}]"
        if not isinstance(table, dict):
            raise SettingsError(f"{where} must be a table")
        unknown = set(table) - _SCHEDULE_KEYS
        if unknown:
            key = sorted(unknown)[0]
            raise SettingsError(f"{where} {key}: {_unknown_key(key, _SCHEDULE_KEYS)}")
        for required in ("cron", "kind"):
            if required not in table:
                raise SettingsError(f"{where}: needs {required}")
        priority = table.get("priority", 0)
        if isinstance(priority, bool) or not isinstance(priority, int) or not -(2**31) < priority < 2**31:
            raise SettingsError(f"{where} priority: an integer, not {priority!r}")
        try:
            timeout = table.get("timeout")
            out.append(Schedule(
                name=name, cron=table["cron"], kind=table["kind"], payload=table.get("payload", {}),
                timezone=table.get("timezone", "UTC"), queue=table.get("queue", "default"),
                max_attempts=None if "max_attempts" not in table else _positive_int(table["max_attempts"], 1000),
                priority=priority,
                timeout_seconds=None if timeout is None else max(1, round(_duration(timeout)))))
        except (ValueError, TypeError) as exc:
            raise SettingsError(f"{where}: {exc}") from None
    return out


def _unknown_key(key: str, known: Iterable[str]) -> str:
    """``unknown key, did you mean timeout? (known: …)``: the close one first, then every one."""
    import difflib

    close = difflib.get_close_matches(key, sorted(known), n=1)
    hint = f", did you mean {close[0]}?" if close else ""
    return f"unknown key{hint} (known: {', '.join(sorted(known))})"


def load(handlers_dir: Path) -> dict[str, KindSettings]:
    """Every kind's settings from ``handlers_dir/fleetless.toml`` ({} when there is none)."""
    path, data = _read(handlers_dir)
    kinds = data.get("kinds", {})
    if not isinstance(kinds, dict):
        raise SettingsError(f"{path}: 'kinds' must be a table of [kinds.<kind>] tables")
    out: dict[str, KindSettings] = {}
    for kind, table in kinds.items():
        try:
            validate_kind(kind)
        except ValueError as exc:
            raise SettingsError(f"{path}: [kinds.{kind}]: {exc}") from None
        if not isinstance(table, dict):
            raise SettingsError(f"{path}: kinds.{kind} must be a table")
        values: dict[str, Any] = {}
        for key, value in table.items():
            where = f"{path}: [kinds.{kind}] {key}"
            if key not in _PARSERS:
                raise SettingsError(f"{where}: {_unknown_key(key, _PARSERS)}")
            try:
                values[key] = _PARSERS[key](value)
            except ValueError as exc:
                raise SettingsError(f"{where}: {exc}") from None
        out[kind] = KindSettings(**values)
    return out


def found(handlers_dir: Path) -> list[str]:
    """The kinds that have a handler in ``handlers_dir`` (``<kind>.py`` or an executable ``<kind>``)."""
    from . import handlers

    out = set()
    for entry in handlers_dir.iterdir():
        name = entry.name.removesuffix(".py")
        try:
            validate_kind(name)
        except ValueError:
            continue
        if handlers.resolve(handlers_dir, name) is not None:
            out.add(name)
    return sorted(out)
