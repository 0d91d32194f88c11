"""Poison pills, one test per pill per sandbox tier, each through a real drain beside ten
well-behaved jobs that must all end ``done`` (see conftest.py for how drains run and what
"nothing left behind" checks).

Every test states what the tier does with the pill: *contained* (killed or denied, and said so in
the job's row) or, where the tier cannot contain it, *not contained*: the test then asserts that
the pill succeeded, and docs/isolation.md ("Poison pills") says so too. The process tier runs jobs
with the host's filesystem (as a uid of their own, or the drainer's user) and, where the kernel
gives them namespaces, a network namespace with only loopback: it contains resources, the process
tree, the environment and the network, not files the job's uid may reach. The forkserver tier (a minimal root and fresh
namespaces per job, like bwrap) answers every pill as bwrap does.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from fleetless.queue import RESULT_CUT_MARKER
from fleetless.sandbox import _caps, _subuid, cgroups, get_backend
from fleetless.sandbox._caps import NOT

from .conftest import LIMITS, MICROVM_TTL, Context, Outcome, require_tier
from .pills import HANDLERS

Poison = Callable[..., Outcome]
ROOT = os.geteuid() == 0
#: Jobs run as leased uids, not the drainer's: a root drainer's, or a non-root drainer's whose user
#: has a subordinate uid range (tests/security/test_subuid_jobs.py)
LEASED = ROOT or _subuid.delegation() is not None


#: The tiers that build a minimal root and namespaces per job (the fork server: bwrap's view).
NAMESPACED = ("bwrap", "forkserver")


def _bwrap_has(controller: str) -> bool:
    return bool(getattr(cgroups.available(), controller))


def _ctx(o: Outcome) -> Context:
    ctx: Context = o.context["ctx"]
    return ctx


def _failed_with(lines: list[str]) -> str:
    """A pill's last_error when it exits 1 after printing ``lines`` on stderr: the head names the
    exit code and the last line said, then the stderr itself."""
    return f"exit code 1: {lines[-1]}\n" + "\n".join(lines)


def _said_after_head(text: str) -> list[str]:
    """The lines a pill printed: a result as it is, or a last_error without its one-line head."""
    if text.startswith("exit code 1: "):
        text = text.partition("\n")[2]
    return text.splitlines()


# -- resources ---------------------------------------------------------------------------------
def test_memory_bomb(tier: str, poison: Poison) -> None:
    """Allocating 4 GiB (every page written) with a 256 MiB limit.

    process: RLIMIT_AS refuses the allocation; Python says ``MemoryError`` and exits 1.
    bwrap: the job's memory cgroup OOM-kills it. microvm: the guest's OOM killer (guest RAM =
    the limit) kills it."""
    o = poison("memory_bomb")
    o.assert_contained()
    row = o["memory_bomb"]
    assert row.status == "dead" and row.result in (None, ""), row
    if tier == "process" or (tier in NAMESPACED and not _bwrap_has("memory")):
        assert row.last_error is not None and row.last_error.startswith("exit code 1: MemoryError\n"), row
        assert row.last_error.endswith("MemoryError"), row
    else:
        assert row.last_error == "killed: memory limit 256 MiB exceeded", row


def test_fork_bomb(tier: str, poison: Poison) -> None:
    """``while True: os.fork()`` with pids = 64 and a 2 s timeout.

    bwrap: the pids cgroup refuses forks past 64, and the timeout kills the tree (reported as
    both). microvm: RLIMIT_NPROC 64 in the guest (the job is the guest's only unprivileged user)
    refuses forks; the timeout kills the tree.

    process: the job's pids cgroup (where the drainer can write one: root, or a delegated cgroup)
    refuses forks past 64 and the supervisor kills the tree at the timeout, worded as for bwrap.
    Where no pids cgroup is writable (an unprivileged drainer), RLIMIT_NPROC counted for the job
    alone refuses them on bwrap and process (``Sandbox.caps``); the timeout kills the tree. Where
    the tier says pids are not capped, the test is skipped rather than run a fork bomb on the host."""
    held = get_backend(tier).caps(LIMITS)["pids"]
    if held.startswith(NOT):
        pytest.skip(f"{tier}: pids {held}; a fork bomb is not run on this host")
    o = poison("fork_bomb")
    o.assert_contained()
    row = o["fork_bomb"]
    assert row.status == "dead", row
    if tier in (*NAMESPACED, "process") and "cgroup" in held:
        assert row.last_error == f"killed: pids limit {LIMITS.pids} reached (timeout after 2 s)", row
    elif tier == "forkserver" and not _bwrap_has("memory"):  # (a subordinate-range drainer's)
        # RLIMIT_NPROC refuses the forks past 64 (test_caps.py counts them); the drainer's watch on
        # the tree's memory counts each fork's copy-on-write share of the pre-warmed server again
        # and may end it first
        assert row.last_error in ("killed: timeout after 2 s", "killed: memory limit 256 MiB exceeded"), row
    else:
        assert row.last_error == "killed: timeout after 2 s", row


def test_busy_loop_past_the_timeout(tier: str, poison: Poison) -> None:
    """``while True: pass`` with a 2 s timeout: killed at the timeout in every tier."""
    o = poison("busy_loop")
    o.assert_contained()
    row = o["busy_loop"]
    assert (row.status, row.last_error) == ("dead", "killed: timeout after 2 s"), row
    assert 1.5 <= (row.finished_at - row.started_at).total_seconds() < (40 if tier == "microvm" else 10)


def test_sleep_past_the_ttl(tier: str, poison: Poison) -> None:
    """A job with a 600 s timeout that sleeps for an hour in a drain whose sandbox TTL is 2 s
    (microvm: 15 s — a boot takes ~2 s here, so the batch drain's good jobs need more): killed at
    the TTL, which bounds every job whatever its own timeout."""
    o = poison("sleep_past_ttl")
    o.assert_contained()
    row = o["sleep_past_ttl"]
    ttl = f"{MICROVM_TTL:g}" if tier == "microvm" else "2"
    assert (row.status, row.last_error) == ("dead", f"killed: ttl of {ttl} s expired"), row
    assert (row.finished_at - row.started_at).total_seconds() < float(ttl) + 10


def test_segfault(tier: str, poison: Poison) -> None:
    """A read of address 0: the job dies of SIGSEGV, which is named."""
    o = poison("segfault")
    o.assert_contained()
    row = o["segfault"]
    assert (row.status, row.last_error) == ("dead", "killed by SIGSEGV"), row


def test_one_gib_to_stdout(tier: str, poison: Poison) -> None:
    """1 GiB written to stdout: the job is done, its result is the first 64 KiB, the rest is read
    and dropped as it arrives (the drainer's memory stays flat). microvm: the runner drops it in
    the guest; only 64 KiB cross the serial channel."""
    o = poison("stdout_1gib")
    o.assert_contained()
    row = o["stdout_1gib"]
    assert row.status == "done", (row.status, row.last_error)
    assert row.result == "y" * LIMITS.stdout_bytes + RESULT_CUT_MARKER
    assert o.rss_growth is not None and o.rss_growth < 64 * 1024 * 1024, o.rss_growth
    assert (row.finished_at - row.started_at).total_seconds() < (30 if tier == "microvm" else 15)


def test_one_gib_file_in_the_workspace(tier: str, poison: Poison) -> None:
    """``dd`` of 1 GiB into one workspace file with a 64 MiB file size limit: RLIMIT_FSIZE stops it
    at 64 MiB (SIGXFSZ) in every tier, named as the file size limit."""
    o = poison("workspace_1gib")
    o.assert_contained()
    row = o["workspace_1gib"]
    assert (row.status, row.last_error) == ("dead", "killed: file size limit 64 MiB exceeded"), row


def test_one_gib_in_many_workspace_files(tier: str, poison: Poison) -> None:
    """1 GiB into the workspace as 32 files of 32 MiB, each under the file size limit.

    microvm: contained — the workspace lives in guest RAM; the guest's root tmpfs fills up and the
    write fails (``No space left on device``) or the guest OOM killer stops the job.

    forkserver: contained — the workspace is a tmpfs of the job's mount namespace, RAM charged to
    its memory cgroup: the memory limit kills it; without one (a non-root drainer with a subordinate
    range) the tmpfs's own size, the memory limit, stops it: ``No space left on device``.

    process under a root drainer: contained — the workspace is a tmpfs of its own (issue 25, item 8;
    ``Limits.disk_bytes``, 512 MiB): ``No space left on device``, the job is charged; where the job
    has a memory cgroup (256 MiB here) its tmpfs pages are charged to it first: the memory limit
    kills it.

    bwrap: contained the same way where its launcher shares the drainer's mount namespace (a root
    drainer whose handlers' interpreter every uid can reach: tests/security/test_workspace_caps.py);
    otherwise, and on both tiers under a non-root drainer, **not contained** — the workspace is on
    the disk-backed ``FLEETLESS_WORKDIR`` (no disk quota; see docs/isolation.md): the job writes its
    1 GiB and is done; the workspace is removed afterwards. (bwrap with the work directory on a
    tmpfs does contain it: test_one_gib_in_workspace_files_on_a_tmpfs_workdir.)"""
    o = poison("workspace_1gib_files")
    o.assert_contained()
    row = o["workspace_1gib_files"]
    if tier == "microvm":
        assert row.status == "dead", row
        assert row.last_error is not None and (
            row.last_error.startswith("killed: memory limit 256 MiB exceeded")
            or "No space left on device" in row.last_error), row
    elif tier == "forkserver" and _bwrap_has("memory"):  # a tmpfs of the job's: RAM of its memory cgroup
        assert (row.status, row.last_error) == ("dead", "killed: memory limit 256 MiB exceeded"), row
    elif tier == "forkserver":  # a tmpfs of the job's, of the memory limit's size
        assert row.status == "dead" and "No space left on device" in (row.last_error or ""), row
    elif tier == "process" and _caps.workspaces_capped():
        assert row.status == "dead" and ("No space left on device" in (row.last_error or "") or (
            row.last_error or "").startswith("killed: memory limit 256 MiB exceeded")), row
    elif tier == "bwrap" and row.status == "dead":  # capped (see above)
        assert "No space left on device" in (row.last_error or "") or (row.last_error or "").startswith(
            "killed: memory limit 256 MiB exceeded"), row
    else:
        assert (row.status, row.result) == ("done", "wrote 1024 MiB to the workspace\n"), row


@pytest.mark.parametrize("tier", ["bwrap"])
def test_one_gib_in_workspace_files_on_a_tmpfs_workdir(tier: str, poison: Poison, tmp_path: Path) -> None:
    """bwrap with ``FLEETLESS_WORKDIR`` on a tmpfs (/dev/shm): what the job writes to its workspace
    is RAM charged to its memory cgroup, so 1 GiB in files is stopped by the memory limit."""
    require_tier("bwrap")
    if not _bwrap_has("memory"):
        pytest.skip("no writable memory cgroup for bwrap here")
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm")
    workdir = shm / f"fleetless-poison-{os.getpid()}-{tmp_path.name}"
    try:
        o = poison("workspace_1gib_files", workdir=workdir)
        o.assert_contained()
        row = o["workspace_1gib_files"]
        assert (row.status, row.last_error) == ("dead", "killed: memory limit 256 MiB exceeded"), row
    finally:
        shutil.rmtree(workdir, ignore_errors=True)



# -- files -------------------------------------------------------------------------------------
def test_write_to_usr_and_the_handler_directory(tier: str, poison: Poison) -> None:
    """Create a file in /usr, plant a new handler next to its own, append to its own handler.

    bwrap: /usr and /handlers are read-only binds (``Read-only file system``); under a root drainer
    the job's own handler is a root-owned 0444 file of the snapshot, so appending to it is refused
    by its mode first (``Permission denied``). microvm: the job is uid 65534 in the guest;
    /usr and /handlers belong to root (``Permission denied``); and nothing of the guest reaches the
    host anyway.

    process: jobs run from a read-only snapshot of the handlers (0555/0444), so the handlers
    directory itself is never the job's; the job is denied all three: a non-root drainer's job by
    the modes, a root drainer's because it runs as an unprivileged uid of its own (issue 7)."""
    o = poison("write_system")
    o.assert_contained()
    row = o["write_system"]
    ctx = _ctx(o)
    lines = _said_after_head(row.result or row.last_error or "")
    if tier == "process":
        snapshot = Path(lines[2].rsplit(": ", 1)[0]).parent  # where the job's handlers are
        assert snapshot != ctx.handlers.resolve()
        outcome = "denied (Permission denied)"
        assert lines == [f"{ctx.usr_file}: {outcome}", f"{snapshot}/planted.py: {outcome}",
                         f"{snapshot}/write_system.py: {outcome}"], row
        assert row.status == "dead", row
        assert not (ctx.handlers / "planted.py").exists()  # the original directory is never the job's
        assert (ctx.handlers / "write_system.py").read_text() == \
            textwrap.dedent(HANDLERS["write_system.py"]).lstrip()
        return
    own = "/handlers/write_system.py"
    planted = own.replace("write_system.py", "planted.py")
    reason = "Read-only file system" if tier in NAMESPACED else "Permission denied"
    # a root drainer's bwrap job is an unprivileged uid and its handlers a 0444 snapshot: the mode
    # refuses the append before the read-only mount does
    own_reason = "Permission denied" if tier in NAMESPACED and LEASED else reason
    assert row.status == "dead", row
    assert lines == [f"{ctx.usr_file}: denied ({reason})", f"{planted}: denied ({reason})",
                     f"{own}: denied ({own_reason})"], row
    assert row.last_error == _failed_with(lines), row
    assert not Path(ctx.usr_file).exists() and not (ctx.handlers / "planted.py").exists()
    assert (ctx.handlers / "write_system.py").read_text() == textwrap.dedent(HANDLERS["write_system.py"]).lstrip()


def test_read_etc_shadow_and_root(tier: str, poison: Poison) -> None:
    """Read /etc/shadow, list /root.

    bwrap: neither exists in the sandbox (but for the way to the handlers' interpreter, bound
    read-only, where that is under /root). microvm: the guest has no /etc/shadow, and its /root is
    root's (0700).

    process: the job reads what its uid can: the drainer's user's files with a non-root drainer;
    with a root drainer, only what any unprivileged user can (it runs as a leased uid): here
    neither, in both cases; but where the handlers' interpreter lives under /root (pyenv), a root
    drainer's job sees /root as a tmpfs holding only the way to it. See docs/isolation.md."""
    o = poison("read_secrets")
    o.assert_contained()
    row = o["read_secrets"]
    lines = (row.result or "").splitlines()
    if tier == "process":
        shown = _interpreter_entries("/root", tier) if os.geteuid() == 0 else set()
        root = f"listed {len(shown)} entries" if shown else "denied (Permission denied)"
        assert lines == ["/etc/shadow: denied (Permission denied)", f"/root: {root}"], row
        assert row.status == ("done" if shown else "dead"), row
        return
    shown = _interpreter_entries("/root") if tier in NAMESPACED else set()
    if shown:  # the handlers' interpreter lives under /root (pyenv): only the way to it is there
        assert lines == ["/etc/shadow: denied (No such file or directory)", f"/root: listed {len(shown)} entries"]
        assert row.status == "done", row
        return
    root = "No such file or directory" if tier in NAMESPACED else "Permission denied"
    assert lines == ["/etc/shadow: denied (No such file or directory)", f"/root: denied ({root})"], row
    assert (row.status, row.last_error) == ("dead", _failed_with(lines)), row


def _interpreter_entries(top: str, tier: str = "bwrap") -> set[str]:
    """What of ``top`` a bwrap job sees: the first step towards each path bound for the default
    handler interpreter (its prefixes, its virtual environment, an editable install's source);
    a root drainer's process-tier job: the same, where ``top`` is in the way to it."""
    from fleetless.sandbox import Template, get_backend
    from fleetless.sandbox.bwrap._filesystem import interpreter_paths

    python = get_backend(tier).handler_python(Template(Path("/")))
    return {p[len(top) + 1:].split("/")[0] for p in interpreter_paths(python)
            if p.startswith(top + "/")}


def test_read_proc_1_environ_and_the_drainers_environment(tier: str, poison: Poison) -> None:
    """The drainer's environment holds DATABASE_URL, PGPASSWORD and a secret (process and bwrap:
    a ``fleetless drain`` process started with them; microvm: the in-process drainer, whose QEMU
    children inherit them). The job looks in its own environment, /proc/1/environ and every
    /proc/*/environ it can read.

    Every tier: the job's own environment has none of them (only ``template.env``).
    bwrap: its /proc shows only its own pid namespace; pid 1 is bwrap's reaper, started with an
    empty environment. microvm: the guest's /proc holds no host process; pid 1 (the runner) is
    root's.

    process: **not contained with a non-root drainer without a subordinate uid range** where the
    kernel gives the job no pid namespace — the job runs as the drainer's user, so it reads the
    drainer's /proc/<pid>/environ and finds the secret; in a pid namespace of its own (as
    fleetless-ci2 in .ci/unprivileged) it sees no host process and finds nothing. A root drainer's job runs as an
    unprivileged uid of its own and finds nothing. See docs/isolation.md."""
    o = poison("read_environment")
    o.assert_contained()
    row = o["read_environment"]
    ctx = _ctx(o)
    lines = (row.result or "").splitlines()
    assert lines[0] == "own environment: none of DATABASE_URL, PGPASSWORD, FLEETLESS_POISON_SECRET", row
    found = any(line.startswith(f"found FLEETLESS_POISON_SECRET={ctx.secret} in /proc/") for line in lines)
    if tier == "process" and not LEASED and found:  # uncontained: the drainer's /proc is the job's uid's
        assert row.status == "done", row
        return
    if tier == "process":
        assert row.status == "dead" and ctx.secret not in row.said and lines[-1] == "found no secret", row
        return
    assert row.status == "dead" and ctx.secret not in row.said, row
    assert lines[-1] == "found no secret", row
    if tier == "bwrap":  # bwrap's own pid 1, with an empty environment (not even the drainer's PWD)
        assert lines[1] == "/proc/1/environ: read, variables: none", row
    else:
        assert lines[1] == "/proc/1/environ: denied (Permission denied)", row
    assert row.last_error == _failed_with(lines), row


def test_read_a_sibling_jobs_workspace(tier: str, poison: Poison) -> None:
    """Two jobs at once: one writes a secret into its workspace and waits; the other looks for it
    under the host's FLEETLESS_WORKDIR and next to its own workspace, for up to 4 s.

    bwrap: the sibling's workspace is not even visible (each job sees only its own at /workspace;
    the host's work directory is not mounted). microvm: each job is in its own VM.

    process: **not contained with a non-root drainer without a subordinate uid range** — every
    workspace belongs to the drainer's
    user, so a job lists the work directory next to its own and reads its sibling's files. A root
    drainer's jobs run as distinct uids, each owning only its own workspace (0700) in a work
    directory others may pass through but not list (0711): the sibling sees nothing."""
    o = poison("sibling_workspace")
    o.assert_contained()
    writer, reader = o["sibling_writer"], o["sibling_reader"]
    ctx = _ctx(o)
    assert writer.started_at < reader.finished_at and reader.started_at < writer.finished_at  # at once
    assert writer.status == "done", writer
    if tier == "process" and not LEASED:
        assert reader.status == "done" and f": {ctx.secret}" in (reader.result or ""), reader
        assert (reader.result or "").startswith(f"read {ctx.workdir}/ws-"), reader
        assert (writer.result or "").endswith("the sibling read it\n"), writer
        return
    assert reader.status == "dead" and ctx.secret not in reader.said, reader
    assert reader.last_error is not None and reader.last_error.startswith(
        "exit code 1: no sibling workspace visible: nothing matches "), reader
    assert (writer.result or "").endswith("no sibling came\n"), writer


# -- network -----------------------------------------------------------------------------------
def _own_network(tier: str) -> bool:
    """Whether ``tier``'s jobs get a network namespace (or VM) of their own here: every tier but a
    process tier whose jobs get no namespaces (the kernel refuses them, or FLEETLESS_PROCESS_CONTAIN=0)."""
    if tier != "process":
        return True
    from fleetless.sandbox.process import jobs_own_network

    return jobs_own_network()


def test_connect_to_the_hosts_postgresql(tier: str, poison: Poison) -> None:
    """Connect to 127.0.0.1:5432 and log in as postgres (the test server trusts local connections).

    bwrap, forkserver, process: the job has its own network namespace with only loopback; its
    127.0.0.1 is its own (``Connection refused``). microvm: no network device at all; the guest's
    loopback is its own.

    process: **not contained only where the kernel refuses the job its namespaces** (its fallback,
    said by ``Sandbox.caps`` and ``fleetless doctor``): the job then shares the host's network and
    reaches the database the drainer uses (here it even logs in). See docs/isolation.md."""
    o = poison("connect_postgres")
    o.assert_contained()
    row = o["connect_postgres"]
    if not _own_network(tier):
        assert row.status == "done" and (row.result or "").startswith("127.0.0.1:5432: connected"), row
        return
    assert (row.status, row.last_error) == ("dead", _failed_with(["127.0.0.1:5432: denied (Connection refused)"])), row


def test_connect_to_the_hosts_postgresql_through_its_unix_socket(tier: str, poison: Poison) -> None:
    """Connect to PostgreSQL's Unix socket (/run/postgresql/.s.PGSQL.5432 on Debian: mode 0777,
    trust auth here) and log in as postgres: a network namespace does not hide a socket file.

    bwrap, forkserver: their view holds no /run of the host; process: a job without the network
    gets a /run of its own (it logged in before, red team of issue 25); microvm: its own guest.
    Where the process tier's jobs get no namespaces, the socket is the host's (not contained)."""
    import glob

    if not glob.glob("/run/postgresql/.s.PGSQL.*") and not glob.glob("/var/run/postgresql/.s.PGSQL.*"):
        pytest.skip("the test server has no Unix socket under /run/postgresql")
    o = poison("connect_postgres_socket")
    o.assert_contained()
    row = o["connect_postgres_socket"]
    if not _own_network(tier):
        assert row.status == "done" and ": connected" in (row.result or ""), row
        return
    assert (row.status, row.last_error) == ("dead", _failed_with(["no PostgreSQL socket visible"])), row


def test_a_kind_with_network_reaches_the_hosts_postgresql(tier: str, poison: Poison) -> None:
    """With ``limits.network = True`` the process tier's job keeps the host's network, as the kind
    asks: the same pill connects to 127.0.0.1:5432 (and logs in). (The other tiers' network jobs
    have their own tests: bwrap's ``--share-net``, the fork server's, the microVM's user-mode NIC.)"""
    if tier != "process":
        pytest.skip("limits.network on the process tier only here")
    o = poison("connect_postgres", limits=dataclasses.replace(LIMITS, network=True))
    o.assert_contained()
    row = o["connect_postgres"]
    assert row.status == "done" and (row.result or "").startswith("127.0.0.1:5432: connected"), row


def _host_network_view(handlers: Path) -> dict[str, object]:
    """What the network pill sees when run directly on the host (it only reads files)."""
    out = subprocess.run([sys.executable, str(handlers / "network_probe.py")], capture_output=True, text=True,
                         timeout=30)
    view: dict[str, object] = json.loads(out.stdout)
    return view


def test_look_for_a_way_off_the_machine(tier: str, poison: Poison) -> None:
    """Read /proc/net/dev, /proc/net/route, /proc/net/ipv6_route and /sys/class/net for any
    interface but lo or any route (no packet is sent).

    bwrap: only ``lo``, no route (own network namespace; no /sys). microvm: only ``lo`` (no
    network device unless ``limits.network``). process: only ``lo``, no route (own network
    namespace, and a read-only /sys of it).

    process: **not contained only where the kernel refuses the job its namespaces** — the job
    then sees exactly the host's interfaces and routes. See docs/isolation.md."""
    o = poison("network_probe")
    o.assert_contained()
    row = o["network_probe"]
    view = json.loads((row.result or "{}").splitlines()[0])
    if not _own_network(tier):
        assert row.status == "done", row
        assert view == _host_network_view(_ctx(o).handlers)
        return
    assert (row.status, row.last_error) == (
        "dead", _failed_with(["denied: no interface but lo, no route off the machine"])), row
    assert view["dev"] == ["lo"] and view["routes"] == [] and view["routes6"] == [], view
    assert view["sys_class_net"] == ("denied (No such file or directory)" if tier in NAMESPACED else ["lo"]), view


# -- processes ---------------------------------------------------------------------------------
def test_setsid_grandchild_that_tries_to_outlive_the_job(tier: str, poison: Poison) -> None:
    """The job starts a daemon (fork, setsid, fork, stdio to /dev/null, exec a 600 s sleep with a
    marker in its argv) and exits 0. The job is done, and no process of it is left on the host.

    process: the daemon is in the job's pid namespace, whose init exits with the job (the kernel
    then kills the rest), and the supervisor, a child subreaper, kills every descendant it still
    finds. bwrap: the daemon is in the job's pid namespace and cgroup, which die with it.
    microvm: the runner kills every leftover in the guest, and the VM is destroyed."""
    o = poison("setsid_daemon")
    o.assert_contained()  # no host process carries the run's marker (argv or environment)
    row = o["setsid_daemon"]
    assert row.status == "done" and (row.result or "").startswith("daemon "), row
