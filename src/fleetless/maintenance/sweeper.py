"""The sandbox sweeper: what sandboxes of drainers that died left on this host.

What it does: asks the drain's sandbox tier to remove leftovers whose drainer no longer runs
(workspaces, handler snapshots, cgroups). Leftovers of live drainers are never touched.

When it can go wrong: an unusable work directory (full disk, wrong permissions) raises OSError;
the drain then stops before it claims anything.

Reports: how many leftovers it removed.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..sandbox import Sandbox

__all__ = ["Result", "Settings", "run_once"]


@dataclass(frozen=True)
class Settings:
    #: The sandbox tier whose leftovers are swept (every tier sweeps workspaces).
    backend: type[Sandbox]
    #: Other tiers this drain runs kinds in (fleetless.toml's per-kind tier): swept as well.
    also: tuple[type[Sandbox], ...] = ()


@dataclass(frozen=True)
class Result:
    removed: int = 0


def run_once(settings: Settings) -> Result:
    swept = dict.fromkeys([settings.backend, *settings.also])
    return Result(sum(backend.sweep() for backend in swept))
