"""Which resource caps hold for a tier's jobs on this host, and how (``Sandbox.caps``), in words for
``fleetless doctor`` and the drain's first log lines. Every cap is said as held (``capped by ...``)
or not (``NOT capped: ...``): never a cap that the host cannot give. Each is said in full (doctor,
its ``--json``) and, where that is long, in short (:class:`Cap`): a drain says each cap on a line of
its own in under 100 characters (:func:`caps_lines`), and points to doctor for the rest.

Pids are held by a pids cgroup where the drainer can write one, and by ``RLIMIT_NPROC`` where the
kernel counts it for the job alone: since Linux 5.14 the count is per user namespace and uid, so a
job in a user namespace of its own (bwrap's, the process tier's supervisor's) or under a uid of its
own (a leased or subordinate uid) counts only its own processes and threads, whoever else runs as
the same host uid (tests/security/test_caps.py).

The words for each cap are made here, once, for the host tiers (process, bwrap, forkserver):
:func:`tier_caps` from what the tier found (its cgroups, how it holds pids).

CPU cores are capped only by a cpu cgroup. Without one, what holds is ``RLIMIT_CPU`` (each process's
CPU seconds, the timeout's by default) and the job's priority: process and bwrap jobs run at nice
:data:`JOB_NICE` with ``RLIMIT_NICE`` 0, so they cannot raise it again, and a busy job yields the
CPU to the drainer and PostgreSQL (tests/security/test_caps.py).
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from . import Limits

__all__ = ["CAPS", "JOB_NICE", "NOT", "Cap", "caps_in_full", "caps_lines", "held", "nproc_counts_per_namespace",
           "short", "tier_caps", "workspaces_capped", "workspaces_uncapped_why"]

#: The caps every tier reports, in this order.
CAPS = ("pids", "memory", "cpu", "disk")
#: How a cap that does not hold starts.
NOT = "NOT capped"
#: The nice value of every process and bwrap job (and all it starts; it cannot lower it).
JOB_NICE = 10
MiB = 1024 * 1024


class Cap(str):
    """A cap's words in full (the str itself: doctor, ``--json``, every ``startswith``) and
    ``short``, the same said in under ~80 characters for the drain's line: how it holds and at
    what, without the asides (what the watch does not count, how to get a cap not held)."""

    short: str

    def __new__(cls, full: str, short: str) -> Cap:
        made = super().__new__(cls, full)
        made.short = short
        return made


def short(text: str) -> str:
    """A cap's words in short (:class:`Cap`), or as they are where they are short already."""
    return text.short if isinstance(text, Cap) else text


def nproc_counts_per_namespace() -> bool:
    """Whether this kernel counts ``RLIMIT_NPROC`` per user namespace and uid (Linux 5.14 and later)
    rather than per host uid across every namespace."""
    found = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return found is not None and (int(found[1]), int(found[2])) >= (5, 14)


def held(caps: dict[str, str]) -> dict[str, bool]:
    """Per cap: whether it holds."""
    return {name: not text.startswith(NOT) for name, text in caps.items()}


def caps_in_full(tier: str, caps: dict[str, str]) -> list[str]:
    """Doctor's lines: a heading, then each cap in full on a line of its own (``  memory capped
    by RLIMIT_AS per process (512 MiB each) and the drainer summing ...``)."""
    return [f"caps ({tier}), in full:"] + [f"  {name} {caps[name]}" for name in CAPS if name in caps]


def caps_lines(tier: str, caps: dict[str, str], unfiltered: str | None = None) -> list[str]:
    """The drain's lines: a heading, then one short line per cap (``  memory capped at 512 MiB:
    ...``), and one for a missing seccomp filter (``unfiltered``: why)."""
    lines = [f"caps ({tier}) of each job, in short (in full: fleetless doctor):"]
    lines += [f"  {name} {short(caps[name])}" for name in CAPS if name in caps]
    if unfiltered is not None:
        lines.append(f"  jobs run with NO seccomp filter: {unfiltered}")
    return lines


def tier_caps(limits: Limits, *, pids: list[str], no_pids: str, memory_cgroup: str | None,
              cpu_cgroup: str | None, disk_extra: str = "", nice: bool = True, own_mounts: bool = False,
              memfds_seen: bool = True) -> dict[str, str]:
    """A host tier's caps in words: ``pids`` says how pids are held ("" entries left out; none:
    ``no_pids`` says why not), ``memory_cgroup``/``cpu_cgroup`` name the cgroup version holding
    each (None: none is writable), ``disk_extra`` what else holds the disk (/tmp's size), ``nice``
    whether jobs run at :data:`JOB_NICE`, ``own_mounts`` whether the tier caps a non-root drainer's
    workspaces without a subordinate range too (:func:`workspaces_capped`), ``memfds_seen`` whether
    the drainer's watch (no memory cgroup) can read the job's open memfds (:mod:`._tree`)."""
    from . import _tree

    out: dict[str, str] = {}
    if limits.pids is None:
        out["pids"] = f"{NOT}: --pids not set"
    elif pids:
        out["pids"] = Cap(f"capped by {' and '.join(pids)} at {limits.pids}",
                          f"capped by {' and '.join(p.split(' (it counts')[0] for p in pids)} at {limits.pids}")
    else:
        out["pids"] = f"{NOT}: {no_pids}"
    if limits.memory_bytes is None:
        out["memory"] = f"{NOT}: --memory not set"
    elif memory_cgroup is not None:
        out["memory"] = f"capped by a memory cgroup ({memory_cgroup}) at {limits.memory_bytes // MiB} MiB"
    else:
        memfds = " and its open memfds" if memfds_seen else ""
        unseen = "" if memfds_seen else ("memfds (the drainer cannot read the job's /proc/<pid>/fd), System V "
                                         "shared memory (the job is in the host's IPC namespace), ")
        if memfds_seen:
            memfds += ", the System V shared memory of its IPC namespace"
        out["memory"] = Cap(f"capped by RLIMIT_AS per process ({limits.memory_bytes // MiB} MiB each) and the drainer "
                            f"summing the job tree's resident anonymous and shared memory{memfds} every "
                            f"{_tree.INTERVAL:g} s, killing it over the cap (not counted: {unseen}{_tree.NOT_COUNTED})",
                            f"capped at {limits.memory_bytes // MiB} MiB by RLIMIT_AS per process and the drainer's "
                            f"watch of the tree")
    seconds = "RLIMIT_CPU ends each process after its CPU seconds (the timeout's, or --cpu-seconds)"
    niced = (f"; jobs run at nice {JOB_NICE} (RLIMIT_NICE 0: they cannot lower it), so a busy job yields the "
             "CPU to the drainer and PostgreSQL") if nice else ""
    held = "RLIMIT_CPU per process" + (f", nice {JOB_NICE}" if nice else "")
    if limits.cpus is None:
        out["cpu"] = Cap(f"{NOT}: --cpus not set; {seconds}{niced}", f"{NOT}: --cpus not set; {held}")
    elif cpu_cgroup is not None:
        out["cpu"] = Cap(f"capped by a cpu cgroup ({cpu_cgroup}) at {limits.cpus:g} cores{niced}",
                         f"capped by a cpu cgroup ({cpu_cgroup}) at {limits.cpus:g} cores" +
                         (f", nice {JOB_NICE}" if nice else ""))
    else:
        out["cpu"] = Cap(f"{NOT} in cores (no cpu cgroup is writable): {seconds}{niced}",
                         f"{NOT} in cores (no cpu cgroup is writable): {held}")
    fsize = "" if limits.file_size_bytes is None else (
        f"RLIMIT_FSIZE caps each file at {limits.file_size_bytes // MiB} MiB")
    extra = "; ".join(x for x in (disk_extra, fsize) if x)
    disk = _disk_text(limits.disk_bytes, limits.inodes, f" ({extra})" if extra else "", own_mounts)
    # in short: without the extras, the reason a cap is not held, or the words saying it again
    out["disk"] = Cap(disk, _disk_text(limits.disk_bytes, limits.inodes, "", own_mounts).split(" (")[0]
                      .removesuffix(", not capped in size or files"))
    return out


def workspaces_capped(own: bool = False) -> bool:
    """Whether this drainer gives workspaces a capped tmpfs (:mod:`._diskcap`): a root drainer does,
    and a non-root one with a subordinate uid range (in its holder's mount namespace); ``own``: also
    one without a range, in a mount holder of its own (:func:`._subuid.mount_holder`: the bwrap tier)."""
    from . import _subuid

    if os.geteuid() == 0 or _subuid.delegation() is not None:
        return True
    return own and _subuid.mount_holder() is not None


def workspaces_uncapped_why(own: bool = False) -> str:
    """Why workspaces are not capped here ("" where they are)."""
    from . import _subuid

    if workspaces_capped(own):
        return ""
    if own:
        why = f"it cannot make a user and mount namespace here: {_subuid.mount_holder_missing()}"
    else:
        why = (f"the process tier mounts one only for a root drainer or one with a subordinate uid range; "
               f"here: {_subuid.missing()}")
    return f"workspaces are on the work directory's disk, not capped in size or files ({why})"


def _disk_text(disk_bytes: int | None, inodes: int | None, extra: str, own: bool = False) -> str:
    """The ``disk`` entry of a tier's caps (process, bwrap): the workspace's tmpfs where this drainer
    mounts one (``own``: see :func:`workspaces_capped`), else the host's disk; ``extra`` is appended."""
    if workspaces_capped(own) and (disk_bytes is not None or inodes is not None):
        size = "" if disk_bytes is None else f" of {disk_bytes // (1024 * 1024)} MiB"
        files = "" if inodes is None else f" and {inodes} files"
        return f"capped by a tmpfs workspace{size}{files} (RAM, as the job writes it){extra}"
    return f"{NOT}: {workspaces_uncapped_why(own) or 'Limits.disk_bytes and Limits.inodes are None'}{extra}"
