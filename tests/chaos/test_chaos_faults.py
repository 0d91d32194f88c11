"""An operator's mistake or a broken host, not the jobs' fault: a read-only or full work directory, a
missing handlers directory, a sandbox tier that cannot run, an interpreter that does not exist.
Each stops the drain with one error line and a non-zero exit, and leaves every job pending with
its attempts untouched, instead of burning them."""

from __future__ import annotations

import errno
import importlib.util
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fleetless import Queue

from .conftest import processes_mentioning
from proctools import leftovers

JOBS = 5


def stopped_in_one_line(r: subprocess.CompletedProcess[str], fragment: str) -> None:
    assert r.returncode == 3, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert all(line.startswith("fleetless: ") for line in lines), r.stderr  # no traceback
    errors = [line for line in lines if line.startswith("fleetless: error: ")]
    assert errors == [lines[-1]] and fragment in lines[-1], r.stderr


def all_pending_and_unspent(sql: Any) -> None:
    assert sql("SELECT status, attempts, count(*) FROM fleetless.jobs GROUP BY 1, 2") == [("pending", 0, JOBS)]
    # Nothing held (a released row keeps its last token: a retried release recognises its own write).
    assert sql("SELECT count(*) FROM fleetless.jobs WHERE locked_at IS NOT NULL OR lease_expires_at IS NOT NULL"
               " OR status = 'running'") == [(0,)]


@pytest.fixture
def jobs(queue: Queue, handlers: Any) -> Path:
    """JOBS pending jobs and a handlers directory that would run them fine."""
    h = handlers(**{"work.py": "print('ok')", "shell": "#!/bin/sh\necho ok\n"})
    queue.enqueue_many([("work" if i % 2 else "shell", {"i": i}) for i in range(JOBS)])
    return h


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """``tmpfs("ro")``: a fresh tmpfs mounted with those options (root only; skips elsewhere)."""
    mounted: list[Path] = []

    def mount(options: str) -> Path:
        target = tmp_path / f"mnt{len(mounted)}"
        target.mkdir()
        # mode=0755: the work directory must be writable by no one but the drainer (issue 25 item 3)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"mode=0755,{options}", "tmpfs", str(target)],
                           capture_output=True,
                           text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        mounted.append(target)
        return target

    yield mount
    for target in mounted:
        subprocess.run(["umount", "-l", str(target)], check=False)


def test_a_read_only_work_directory_stops_the_drain_and_spends_no_attempt(
        dsn: str, jobs: Path, sql: Any, fleetless: Any, tmpfs: Callable[[str], Path]) -> None:
    work = tmpfs("ro,size=1m")
    r = fleetless("drain", "--handlers", str(jobs), "--concurrency", "2", dsn=dsn,
                  env={"FLEETLESS_WORKDIR": str(work)})
    stopped_in_one_line(r, "Read-only file system")
    all_pending_and_unspent(sql)
    assert processes_mentioning(str(work)) == []


def test_a_full_work_directory_stops_the_drain_and_spends_no_attempt(
        dsn: str, jobs: Path, sql: Any, fleetless: Any, tmpfs: Callable[[str], Path]) -> None:
    work = tmpfs("size=256k")
    fd = os.open(work / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    r = fleetless("drain", "--handlers", str(jobs), "--concurrency", "2", dsn=dsn,
                  env={"FLEETLESS_WORKDIR": str(work)})
    stopped_in_one_line(r, "No space left on device")
    all_pending_and_unspent(sql)
    assert leftovers(work) == ["filler"]  # no workspace left behind


@pytest.mark.parametrize("what", ["missing", "a file", "a typo'd path below a file"])
def test_an_unusable_handlers_directory_stops_the_drain_before_any_claim(
        dsn: str, jobs: Path, sql: Any, fleetless: Any, tmp_path: Path, what: str) -> None:
    path = {"missing": tmp_path / "nope", "a file": jobs / "work.py",
            "a typo'd path below a file": jobs / "work.py" / "handlers"}[what]
    r = fleetless("drain", "--handlers", str(path), dsn=dsn)
    stopped_in_one_line(r, f"handlers directory {path}")
    all_pending_and_unspent(sql)
    assert sql("SELECT count(*) FROM fleetless.jobs WHERE last_error IS NOT NULL") == [(0,)]


def test_a_sandbox_tier_that_cannot_run_stops_the_drain_before_any_claim(
        dsn: str, jobs: Path, sql: Any, fleetless: Any, tmp_path: Path) -> None:
    if importlib.util.find_spec("fleetless.sandbox.microvm") is None:
        pytest.skip("the microvm tier is not in this tree")
    empty = tmp_path / "empty-cache"
    empty.mkdir()
    # QEMU "found" (any executable will do), but no guest image was ever built in this cache.
    r = fleetless("drain", "--handlers", str(jobs), "--sandbox", "microvm", dsn=dsn,
                  env={"FLEETLESS_CACHE": str(empty), "FLEETLESS_QEMU": "/bin/true"})
    stopped_in_one_line(r, "microvm image not built")
    all_pending_and_unspent(sql)
    assert sql("SELECT count(*) FROM fleetless.jobs WHERE last_error IS NOT NULL") == [(0,)]


@pytest.mark.parametrize("python", ["/usr/bin/python9", "python9", "/etc/passwd"])
def test_a_handler_interpreter_that_does_not_exist_stops_the_drain_before_any_claim(
        dsn: str, jobs: Path, sql: Any, fleetless: Any, python: str) -> None:
    # Every .py job would fail with "cannot run /usr/bin/python9" and be retried until dead.
    r = fleetless("drain", "--handlers", str(jobs), "--python", python, dsn=dsn)
    stopped_in_one_line(r, f"cannot use {python} as the handler interpreter")
    all_pending_and_unspent(sql)
    ok = fleetless("drain", "--handlers", str(jobs), "--python", os.path.realpath("/usr/bin/python3"), dsn=dsn)
    assert ok.returncode == 0, ok.stderr
    assert sql("SELECT status, attempts, count(*) FROM fleetless.jobs GROUP BY 1, 2") == [("done", 1, JOBS)]
