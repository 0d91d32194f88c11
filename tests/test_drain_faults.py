"""What a drain does when something other than the job goes wrong (issue 14): an error nobody
planned for, a payload or outcome the database or Python cannot handle, a deploy swapping the
handlers under it, a sandbox that keeps breaking, a reaper running beside it. Real PostgreSQL,
real drains; outcomes read from the table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from test_drainer import drain, private_workdir  # noqa: F401  (the autouse fixture, and the helper)

from fleetless import Queue, RetryPolicy
from fleetless.drainer import DrainError
from fleetless.queue import MAX_RELEASES

from conftest import ADMIN_DSN, _dsn_for, _fleetless
from proctools import wait_for


def _cli_drain(dsn: str, h: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fleetless.cli", "drain", "--handlers", str(h), *extra],
        env={**os.environ, "DATABASE_URL": dsn}, capture_output=True, text=True, timeout=300)


# -- payloads and outcomes that cannot be handled -------------------------------------------------

def test_a_payload_nested_2000_levels_by_another_producer_fails_alone(queue: Queue, handlers, sql) -> None:
    h = handlers(**{"ok.py": "import json, sys; json.load(open(sys.argv[1])); print('ok')"})
    deep = "[" * 2000 + "]" * 2000  # valid jsonb, written with plain SQL: no enqueue() check on the way
    sql("INSERT INTO fleetless.jobs (kind, payload, max_attempts, priority) VALUES ('ok', %s::jsonb, 1, 9)", deep)
    queue.enqueue_many([("ok", {"i": i}) for i in range(4)])
    summary = drain(queue, h).summary
    assert sql("SELECT status, count(*) FROM fleetless.jobs GROUP BY 1 ORDER BY 1") == [("dead", 1), ("done", 4)]
    (error,) = sql("SELECT last_error FROM fleetless.jobs WHERE status = 'dead'")[0]
    assert "RecursionError" in str(error)  # the handler's own failure: the drain never parsed it
    assert (summary.claimed, summary.done, summary.dead) == (5, 4, 1)


@pytest.fixture
def odd_encoding_dsn(request: pytest.FixtureRequest) -> Iterator[str]:
    name = f"fleetless_t_enc_{request.param.lower()}_{os.getpid()}"
    with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}" ENCODING \'{request.param}\' TEMPLATE template0'
                      " LC_COLLATE 'C' LC_CTYPE 'C'")
    try:
        yield _dsn_for(name)
    finally:
        with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.mark.parametrize("odd_encoding_dsn", ["LATIN1", "SQL_ASCII"], indirect=True)
def test_init_refuses_a_database_that_is_not_utf8_in_one_line(odd_encoding_dsn: str) -> None:
    r = _fleetless("init", dsn=odd_encoding_dsn)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        f"fleetless: error: database encoding is {'SQL_ASCII' if 'sql_ascii' in odd_encoding_dsn else 'LATIN1'};"
        " fleetless needs UTF8 (CREATE DATABASE ... ENCODING 'UTF8' TEMPLATE template0)"]
    with psycopg.connect(odd_encoding_dsn) as c:  # and nothing was created
        assert c.execute("SELECT count(*) FROM pg_namespace WHERE nspname = 'fleetless'").fetchone() == (0,)


# -- a deploy swaps the handlers mid-drain ---------------------------------------------------------

def _release(root: Path, name: str, *, with_kind: bool = True) -> Path:
    folder = root / name
    folder.mkdir()
    folder.chmod(0o755)
    (folder / "first.py").write_text(
        "import json, os, sys, time\n"
        "flag = json.load(open(sys.argv[1]))['until']\n"
        "open(flag + '.started', 'w').close()\n"
        "while not os.path.exists(flag):\n    time.sleep(0.05)\n"
        f"print({name!r})\n")
    if with_kind:
        (folder / "later.py").write_text(f"print({name!r})\n")
    return folder


def _swap_while_first_runs(root: Path, current: Path, new: Path) -> None:
    wait_for(lambda: (root / "signals" / "go.started").exists(), what="the first job's handler running")
    tmp = root / "current.new"
    tmp.symlink_to(new)
    tmp.replace(current)  # atomic, as deploy tools do it
    for leftover in (root / "v1").iterdir():
        leftover.unlink()
    (root / "v1").rmdir()
    (root / "signals" / "go").touch()


def _drain_across_a_deploy(queue: Queue, sql, tmp_path: Path, *, v2_has_later: bool) -> None:  # type: ignore[no-untyped-def]
    """handlers/current -> v1; the first job runs; the deploy points current at v2 and deletes v1."""
    root = tmp_path / "app"
    root.mkdir()
    root.chmod(0o755)
    current = root / "current"
    current.symlink_to(_release(root, "v1"))
    v2 = _release(root, "v2", with_kind=v2_has_later)
    (root / "signals").mkdir()
    (root / "signals").chmod(0o777)  # the job may run as another uid (a root drainer's process tier)
    queue.enqueue("first", {"until": str(root / "signals" / "go")}, priority=9)
    threading.Thread(target=_swap_while_first_runs, args=(root, current, v2), daemon=True).start()
    drain(queue, current, concurrency=1, batch=1)


def test_a_deploy_that_swaps_the_handlers_symlink_mid_drain_is_followed(queue: Queue, sql, tmp_path: Path) -> None:
    queue.enqueue_many([("later", {})] * 3)
    _drain_across_a_deploy(queue, sql, tmp_path, v2_has_later=True)
    assert sql("SELECT kind, status, result, count(*) FROM fleetless.jobs GROUP BY 1, 2, 3 ORDER BY 1") == [
        ("first", "done", "v1\n", 1),
        ("later", "done", "v2\n", 3)]


# -- a sandbox that breaks every time ---------------------------------------------------------------

def test_a_job_whose_sandbox_breaks_every_time_is_charged_after_a_bounded_number_of_releases(
        queue: Queue, handlers, sql, monkeypatch: pytest.MonkeyPatch) -> None:
    from fleetless.sandbox import _workspace

    def broken() -> Path:
        raise OSError(28, "No space left on device")

    h = handlers(**{"a.py": "print(1)"})
    job = queue.enqueue("a", {}, max_attempts=2)
    monkeypatch.setattr(_workspace, "create", broken)
    rows = []
    for _ in range(2 * MAX_RELEASES):
        with pytest.raises(DrainError, match="sandbox error"):
            drain(queue, h, concurrency=1, retry=RetryPolicy(0, 0))
        rows.append(sql("SELECT status, attempts, releases FROM fleetless.jobs WHERE id = %s", job)[0])
    # Released (uncharged) MAX_RELEASES - 1 times, then charged; after the second charge, dead.
    assert rows[MAX_RELEASES - 2] == ("pending", 0, MAX_RELEASES - 1)
    assert rows[MAX_RELEASES - 1] == ("pending", 1, 0)
    assert rows[-1] == ("dead", 2, 0)
    (error,) = sql("SELECT last_error FROM fleetless.jobs WHERE id = %s", job)[0]
    assert str(error).startswith(f"released {MAX_RELEASES} times in a row; charged as an attempt: sandbox error")


# -- a reaper beside live drains ----------------------------------------------------------------------

def test_a_reaper_in_a_tight_loop_beside_long_drains_never_takes_a_live_drainers_job(
        dsn: str, queue: Queue, handlers, sql) -> None:
    """The lease covers creating the sandbox, the whole timeout, the teardown and the outcome's
    write, even with the least grace allowed: eight jobs that overrun their 2 s timeout, two
    drains, and a reaper returning expired claims as fast as it can the whole time."""
    h = handlers(**{"long.py": "import time; time.sleep(30)"})
    queue.enqueue_many({"kind": "long", "payload": {}, "max_attempts": 1} for _ in range(8))
    stop = threading.Event()
    reaped: list[int] = []

    def reaper() -> None:
        q = Queue(dsn)
        while not stop.is_set():
            reaped.extend(q.reap())
        q.close()

    t = threading.Thread(target=reaper)
    t.start()
    try:
        drains = [subprocess.Popen(
            [sys.executable, "-m", "fleetless.cli", "drain", "--handlers", str(h), "--concurrency", "2",
             "--batch", "1", "--timeout", "2", "--lease-grace", "3"],
            env={**os.environ, "DATABASE_URL": dsn}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]
        outs = [d.communicate(timeout=300) for d in drains]
    finally:
        stop.set()
        t.join()
    assert [d.returncode for d in drains] == [0, 0], outs
    assert reaped == []
    assert "fenced out" not in "".join(o for o, _ in outs)
    rows = sql("SELECT status, attempts, last_error FROM fleetless.jobs")
    assert len(rows) == 8 and all(r[0] == "dead" and r[1] == 1 for r in rows), rows
    assert all(str(r[2]).startswith("killed: timeout after") for r in rows), rows


def test_payload_json_reaches_the_handler_as_stored(queue: Queue, handlers, sql) -> None:
    h = handlers(**{"raw.py": "import sys; print(open(sys.argv[1]).read())"})
    job = queue.enqueue("raw", {"b": [1, 2.5, "é"], "a": None})
    drain(queue, h)
    (result,) = sql("SELECT result FROM fleetless.jobs WHERE id = %s", job)[0]
    assert json.loads(str(result)) == {"a": None, "b": [1, 2.5, "é"]}


@pytest.mark.parametrize("path", ["release", "finish_many"])
def test_releases_are_bounded_through_either_write_path(queue: Queue, sql, path: str) -> None:
    from fleetless.job import Outcome

    job_id = queue.enqueue("a", {}, max_attempts=1)
    statuses = []
    for _ in range(MAX_RELEASES):
        (job,) = queue.claim(1)
        if path == "release":
            statuses.append(queue.release(job, "sandbox broke"))
        else:
            statuses.append(queue.finish_many([(job, Outcome("release", error="sandbox broke"))])[job.id])
    assert [str(s) for s in statuses] == ["pending"] * (MAX_RELEASES - 1) + ["dead"]
    assert sql("SELECT status, attempts, releases, last_error FROM fleetless.jobs WHERE id = %s", job_id) == [
        ("dead", 1, 0, f"released {MAX_RELEASES} times in a row; charged as an attempt: sandbox broke")]
    assert sql("SELECT outcome, count(*) FROM fleetless.job_attempts GROUP BY 1 ORDER BY 1") == [
        ("dead", 1), ("released", MAX_RELEASES - 1)]
