"""The host uid allocator of root drainers: one unprivileged uid per running job, never shared.

Each test uses a run directory of its own (``FLEETLESS_RUN_DIR``) and a range of its own, so the
leases of drains running elsewhere on the host are never touched.
"""

from __future__ import annotations

import grp
import os
import pwd
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fleetless.sandbox import SandboxUnavailable, _hostuid
from fleetless.sandbox._hostuid import UidRange

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="only a root drainer leases job uids")

RANGE = UidRange(2_000_100_000, 2_000_100_003)


@pytest.fixture(autouse=True)
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(_hostuid.RUN_DIR_ENV, str(tmp_path / "run"))
    return tmp_path / "run"


def test_the_default_range_is_unprivileged_and_owns_no_user_of_this_host() -> None:
    users = {int(line.split(":")[2]) for line in Path("/etc/passwd").read_text().splitlines() if line.count(":") >= 6}
    assert 0 not in _hostuid.DEFAULT_RANGE and not users & set(range(2_000_000_000, 2_000_065_536))
    assert str(_hostuid.DEFAULT_RANGE) == "2000000000-2000065535"


def test_concurrent_leases_get_distinct_uids_and_a_released_uid_is_reused_last() -> None:
    """Leases go round the range (issue 25, item 4): a uid just given back is handed out again only
    after every other free one, never straight to the next job."""
    a, b, c = (_hostuid.lease(RANGE) for _ in range(3))
    assert len({a.uid, b.uid, c.uid}) == 3 and all(x.uid in RANGE and x.gid == x.uid for x in (a, b, c))
    b.release()
    b.release()  # idempotent
    d = _hostuid.lease(RANGE)
    assert d.uid not in (a.uid, b.uid, c.uid)  # the range's fourth uid, not the one just freed
    d.release()
    e = _hostuid.lease(RANGE)
    assert e.uid == b.uid  # round the range: the older of the two free ones
    f = _hostuid.lease(RANGE)
    assert f.uid == d.uid
    for x in (a, c, e, f):
        x.release()


def test_an_exhausted_range_is_one_clear_error() -> None:
    held = [_hostuid.lease(RANGE) for _ in range(len(RANGE))]
    with pytest.raises(SandboxUnavailable, match="all 4 job uids of 2000100000-2000100003 are in use"):
        _hostuid.lease(RANGE)
    for x in held:
        x.release()


def test_leases_of_another_drainer_process_are_respected_and_freed_when_it_dies(run_dir: Path) -> None:
    """Two drainer processes on one host never share a uid; a SIGKILLed holder frees its uid once
    no process runs as it any more."""
    script = textwrap.dedent(f"""
        import os, sys, time
        from fleetless.sandbox import _hostuid
        held = _hostuid.lease(_hostuid.UidRange({RANGE.first}, {RANGE.last}))
        print(held.uid, flush=True)
        time.sleep(600)
    """)
    env = {**os.environ, _hostuid.RUN_DIR_ENV: str(run_dir)}
    other = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env, text=True)
    assert other.stdout is not None
    theirs = int(other.stdout.readline())
    mine = _hostuid.lease(RANGE)
    assert mine.uid != theirs
    # a "job" still running as their uid: their uid is not handed out after their death
    job = subprocess.Popen(["sleep", "600"], user=theirs, group=theirs, extra_groups=[])
    other.send_signal(signal.SIGKILL)
    other.wait()
    second = _hostuid.lease(RANGE)
    assert second.uid not in (theirs, mine.uid)
    job.kill()
    job.wait()
    third = _hostuid.lease(RANGE)  # (the range's last uid: leases go round it)
    fourth = _hostuid.lease(RANGE)
    assert fourth.uid == theirs  # no process runs as it now: free again
    for x in (mine, second, third, fourth):
        x.release()


def test_lease_files_are_one_line_written_in_place_and_an_older_drainers_lines_read_alike(run_dir: Path) -> None:
    """A lease writes its pid and a release blanks it, over the same fixed-width line (no truncate:
    one cost 1.5-2.8 ms on this host's ext4, three a job); a blank line is clean, as an older
    fleetless's empty file is, and an older fleetless's shorter cursor line is read as before."""
    folder = run_dir / "job-uids"
    a = _hostuid.lease(RANGE)
    line = (folder / str(a.uid)).read_bytes()
    assert line.strip() == str(os.getpid()).encode() and len(line) == 12
    a.release()
    assert (folder / str(a.uid)).read_bytes() == b" " * 11 + b"\n"
    assert (folder / "next").read_bytes() == f"{a.uid + 1}".ljust(11).encode() + b"\n"
    # a process runs as a.uid, but its file is blank (clean): leased again without a look at /proc
    job = subprocess.Popen(["sleep", "600"], user=a.uid, group=a.uid, extra_groups=[])
    try:
        (folder / "next").write_text(f"{a.uid}\n")  # as an older fleetless wrote it
        again = _hostuid.lease(RANGE)
        assert again.uid == a.uid and len((folder / "next").read_bytes()) == 12
        (folder / str(a.uid + 1)).write_text("")  # an older fleetless's clean file: leased
        older = _hostuid.lease(RANGE)
        assert older.uid == a.uid + 1
        again.release()
        older.release()
    finally:
        job.kill()
        job.wait()


def test_a_range_that_is_not_uids_is_one_clear_line(monkeypatch: pytest.MonkeyPatch) -> None:
    for text, message in [("12", "is not FIRST-LAST"), ("9-3", "first <= last"), ("0-10", "within 1-"),
                          ("60000-70000", "65534")]:
        monkeypatch.setenv(_hostuid.ENV, text)
        with pytest.raises(SandboxUnavailable, match=message):
            _hostuid.configured_range()
    monkeypatch.setenv(_hostuid.ENV, "3000000000-3000000009")
    assert _hostuid.configured_range() == UidRange(3_000_000_000, 3_000_000_009)


@pytest.mark.parametrize("tier", ["process", "bwrap", "forkserver"])
def test_a_range_of_exactly_concurrency_uids_is_enough_while_sandboxes_are_destroyed_beside_claims(
        tier: str, queue, handlers, sql, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-job mode destroys a job's sandbox beside its slot's next claim, so for a moment a slot's
    next sandbox may want a uid its last one still holds: it waits for that teardown instead of
    stopping the drain with "all job uids are in use"."""
    import time

    from fleetless.drainer import DrainConfig, Drainer
    from fleetless.sandbox import get_backend

    backend = get_backend(tier)
    kill = backend.kill

    def slow_kill(self: object) -> None:  # a teardown slower than the next claim
        time.sleep(0.05)
        kill(self)  # type: ignore[arg-type]

    monkeypatch.setenv("FLEETLESS_WORKDIR", str(tmp_path / "work"))
    monkeypatch.setenv(_hostuid.ENV, "2000100010-2000100011")
    monkeypatch.setattr(backend, "kill", slow_kill)
    h = handlers(**{"a.py": "print(1)"})
    queue.enqueue_many([("a", {})] * 12)
    summary = Drainer(queue, DrainConfig(handlers_dir=h, concurrency=2, sandbox=tier)).run()
    assert summary.done == 12
    assert sql("SELECT status, attempts, count(*) FROM fleetless.jobs GROUP BY 1, 2") == [("done", 1, 12)]


def test_leases_kept_in_two_lease_directories_never_share_a_uid(tmp_path: Path) -> None:
    """Red team, 4th pass: drainers whose lease files are in different directories (a non-root
    drainer's follows $XDG_RUNTIME_DIR and $TMPDIR; a user's range may overlap root's) each handed
    out the range's first uid. The host-wide claim of every lease makes the second skip it until
    the first is released."""
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    a = _hostuid.lease(RANGE, folder=one)
    b = _hostuid.lease(RANGE, folder=two)
    assert a.uid != b.uid
    first = a.uid
    a.release()
    c = _hostuid.lease(RANGE, folder=two)  # two's cursor is past b; round the range it finds first free again
    held = [c]
    while c.uid != first:
        c = _hostuid.lease(RANGE, folder=two)
        held.append(c)
    for x in (b, *held):
        x.release()


SHARED = "2000100020-2000100029"
REFUSAL = ('job uid range 2000100020-2000100029 overlaps {path}\'s line "{line}": {who} can run processes as '
           "those {ids}; choose another --job-uids or reserve the range under a name no user has (fleetless-jobs)")


@pytest.fixture
def subids(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str, str], tuple[str, str]]:
    """Point the drainer at copies of /etc/subuid and /etc/subgid (the host's are never touched) and
    at the range :data:`SHARED`; returns a writer of both copies, which answers their paths."""
    monkeypatch.setenv(_hostuid.ENV, SHARED)
    subuid, subgid = tmp_path / "subuid", tmp_path / "subgid"
    monkeypatch.setattr(_hostuid, "SUBUID", str(subuid))
    monkeypatch.setattr(_hostuid, "SUBGID", str(subgid))

    def write(uids: str, gids: str = "") -> tuple[str, str]:
        subuid.write_text(uids)
        subgid.write_text(gids)
        return str(subuid), str(subgid)

    return write


def test_a_range_a_user_of_this_host_may_map_is_refused_naming_the_line(
        subids: Callable[[str, str], tuple[str, str]]) -> None:
    """Red team: a user's /etc/subuid line overlapping the job range lets that user run processes
    as the job uids (newuidmap): a job's uid sweep SIGKILLed them, and they could signal or inspect
    root's jobs. Nothing said so. Now the range is refused, in one line naming the line."""
    path, _ = subids("fleetless-ci:1600000000:65536\nroot:2000100025:10\n", "")
    expected = REFUSAL.format(path=path, line="root:2000100025:10", who="user root", ids="uids")
    with pytest.raises(SandboxUnavailable) as refused:
        _hostuid.configured_range()
    assert str(refused.value) == expected
    with pytest.raises(SandboxUnavailable) as refused:
        _hostuid.lease()  # what every job of a root drainer asks
    assert str(refused.value) == expected

    _, path = subids("", "root:2000100020:1\n")  # the gids alone: the same
    with pytest.raises(SandboxUnavailable) as refused:
        _hostuid.configured_range()
    assert str(refused.value) == REFUSAL.format(path=path, line="root:2000100020:1", who="user root", ids="gids")


def test_a_subordinate_line_naming_a_numeric_owner_or_a_group_is_refused_when_it_is_an_account(
        subids: Callable[[str, str], tuple[str, str]]) -> None:
    path, _ = subids("0:2000100029:5\n", "")
    with pytest.raises(SandboxUnavailable) as refused:
        _hostuid.configured_range()
    assert str(refused.value) == REFUSAL.format(path=path, line="0:2000100029:5", who="user 0 (root)", ids="uids")

    users = {p.pw_name for p in pwd.getpwall()}
    group = next(g for g in grp.getgrall() if g.gr_name not in users)  # a group no user is named after
    _, path = subids("", f"{group.gr_name}:2000100000:100\n")
    with pytest.raises(SandboxUnavailable) as refused:
        _hostuid.configured_range()
    assert str(refused.value) == REFUSAL.format(path=path, line=f"{group.gr_name}:2000100000:100",
                                                who=f"group {group.gr_name}", ids="gids")

    unknown = next(n for n in range(2_999_999_999, 3_000_000_099) if n not in {p.pw_uid for p in pwd.getpwall()})
    subids(f"{unknown}:2000100020:10\n", "")  # a numeric id that is no user: newuidmap serves no one
    assert _hostuid.configured_range() == _hostuid.parse_range(SHARED)


def test_a_reservation_under_a_name_no_user_has_and_lines_beside_the_range_are_fine(
        subids: Callable[[str, str], tuple[str, str]]) -> None:
    with pytest.raises(KeyError):
        pwd.getpwnam("fleetless-jobs")
    reserved = "fleetless-jobs:2000100020:10\n"
    subids(reserved, reserved)
    assert _hostuid.configured_range() == _hostuid.parse_range(SHARED)
    beside = "# a comment\nroot:2000100010:10\nroot:2000100030:10\nbroken line\nroot:2000100020:0\n"
    subids(beside, beside)  # ends just below, starts just above, says nothing, delegates nothing
    assert _hostuid.configured_range() == _hostuid.parse_range(SHARED)
    subids("root:2000100025:10\n", "")  # a changed file is read again
    with pytest.raises(SandboxUnavailable, match="overlaps"):
        _hostuid.configured_range()


def test_the_subordinate_files_are_read_once_until_they_change(
        subids: Callable[[str, str], tuple[str, str]], monkeypatch: pytest.MonkeyPatch) -> None:
    """Every lease checks the range: it costs a stat per file, not a read and account look-ups."""
    subids("fleetless-jobs:2000100020:10\n", "fleetless-jobs:2000100020:10\n")
    reads: list[str] = []
    read = _hostuid._overlapping_owner

    def counted(path: str, kind: str, ids: UidRange) -> str | None:
        reads.append(path)
        return read(path, kind, ids)

    monkeypatch.setattr(_hostuid, "_overlapping_owner", counted)
    for _ in range(50):
        _hostuid.configured_range()
    assert len(reads) == 2


def test_doctor_and_a_drain_say_a_range_a_user_may_map_before_claiming(
        subids: Callable[[str, str], tuple[str, str]], queue: Any, handlers: Any, sql: Any, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from fleetless import doctor
    from fleetless.drainer import DrainConfig, Drainer, DrainError
    from fleetless.sandbox import get_backend

    path, _ = subids("root:2000100020:65536\n", "")
    expected = REFUSAL.format(path=path, line="root:2000100020:65536", who="user root", ids="uids")
    monkeypatch.setenv("FLEETLESS_WORKDIR", str(tmp_path / "work"))
    for tier in ("process", "bwrap"):
        assert expected in get_backend(tier).describe()
    h = handlers(**{"a.py": "print(1)"})
    ok, detail = doctor._probe("process", h)
    assert not ok and expected in detail
    queue.enqueue("a", {})
    for tier in ("process", "bwrap", "forkserver"):
        with pytest.raises(DrainError) as refused:
            Drainer(queue, DrainConfig(handlers_dir=h, sandbox=tier)).run()
        assert expected in str(refused.value) and "\n" not in str(refused.value)
    assert sql("SELECT status, attempts FROM fleetless.jobs") == [("pending", 0)]


def test_the_host_wide_claim_holds_within_one_network_namespace_or_one_run_directory(tmp_path: Path) -> None:
    """The claim of :func:`_hostuid._claim` is an abstract socket name: per network namespace. A
    drainer in another network namespace (``unshare -n``, systemd ``PrivateNetwork=``) with a run
    directory of its own leases the same uid; sharing the run directory keeps them apart."""
    one = UidRange(2_000_100_040, 2_000_100_040)
    script = textwrap.dedent(f"""
        import time
        from fleetless.sandbox import _hostuid
        held = _hostuid.lease(_hostuid.UidRange({one.first}, {one.last}))
        print(held.uid, flush=True)
        time.sleep(600)
    """)
    for theirs, same_uid in ((tmp_path / "theirs", True), (Path(os.environ[_hostuid.RUN_DIR_ENV]), False)):
        env = {**os.environ, _hostuid.RUN_DIR_ENV: str(theirs)}
        other = subprocess.Popen(["unshare", "-n", sys.executable, "-c", script], stdout=subprocess.PIPE, env=env,
                                 text=True)
        try:
            assert other.stdout is not None
            assert int(other.stdout.readline()) == one.first
            if same_uid:
                mine = _hostuid.lease(one)
                assert mine.uid == one.first  # the scope's limit, said in docs/isolation.md
                mine.release()
            else:
                with pytest.raises(SandboxUnavailable, match="in use"):
                    _hostuid.lease(one)
        finally:
            other.kill()
            other.wait()
