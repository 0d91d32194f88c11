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
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from test_drainer import drain, private_workdir  # noqa: F401  (the autouse fixture, and the helper)

from fleetless import Queue, RetryPolicy
from fleetless.drainer import DrainConfig, Drainer, DrainError
from fleetless.queue import MAX_RELEASES

from conftest import ADMIN_DSN, _dsn_for, _fleetless
from proctools import wait_for


def _cli_drain(dsn: str, h: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fleetless.cli", "drain", "--handlers", str(h), *extra],
        env={**os.environ, "DATABASE_URL": dsn}, capture_output=True, text=True, timeout=300)


# -- an error nobody planned for ------------------------------------------------------------------

@pytest.fixture
def refuse_done(queue: Queue, sql):  # type: ignore[no-untyped-def]
    """The application's own trigger refuses to let a job whose payload has "refuse" be marked
    done: an error the drainer has no rule for, raised by the finish of one job."""
    sql("""CREATE OR REPLACE FUNCTION refuse_done() RETURNS trigger LANGUAGE plpgsql AS $$
           BEGIN
             IF NEW.status = 'done' AND NEW.payload ? 'refuse' THEN RAISE EXCEPTION 'audit log is full'; END IF;
             RETURN NEW;
           END $$""")
    sql("CREATE TRIGGER refuse_done BEFORE UPDATE ON fleetless.jobs FOR EACH ROW EXECUTE FUNCTION refuse_done()")
    yield
    sql("DROP TRIGGER refuse_done ON fleetless.jobs")


_FOREVER = "import time; time.sleep(600)"  # ends only when its sandbox is destroyed


@pytest.mark.usefixtures("refuse_done")
@pytest.mark.parametrize("mode", ["per-job", "batch"])
def test_an_unexpected_error_from_a_finish_releases_every_held_claim_and_exits_3_in_one_line(
        dsn: str, queue: Queue, handlers, sql, mode: str) -> None:
    # Per-job mode: the refused finish is written inline, in the drain loop. Batch mode: by the
    # completer's own thread, in one statement with the other outcomes of its batch.
    h = handlers(**{"ok.py": "print('ok')", "slow.py": _FOREVER})
    refused = queue.enqueue("ok", {"refuse": True}, priority=9)
    held = [queue.enqueue("slow", {}, priority=5) for _ in range(2)]
    others = queue.enqueue_many([("ok", {})] * 3)
    args = ["--concurrency", "3", "--batch", "3"] if mode == "per-job" else ["--per-sandbox", "4", "--concurrency", "2"]
    r = _cli_drain(dsn, h, *args)
    assert r.returncode == 3, r
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "fleetless: error: unexpected error: database: audit log is full; 3 held claim(s) released"), r.stderr
    # Nothing is left running until its lease ends: what was held is pending, uncharged.
    rows = {r[0]: r[1:] for r in sql("SELECT id, status, attempts FROM fleetless.jobs")}
    assert [rows[i] for i in [refused, *held]] == [("pending", 0)] * 3, rows
    # Per-job mode had not claimed the others yet; batch mode ran them with the refused one, and
    # their outcomes were written row by row when the batch's statement was refused.
    assert [rows[i] for i in others] == [("pending", 0) if mode == "per-job" else ("done", 1)] * 3, rows
    assert sql("SELECT last_error FROM fleetless.jobs WHERE id = %s", refused) == [
        ("released: the drain stopped on an error (database: audit log is full)",)]


def test_an_unexpected_error_from_a_claim_releases_every_held_claim(queue: Queue, handlers, sql) -> None:
    sql("""CREATE OR REPLACE FUNCTION refuse_claim() RETURNS trigger LANGUAGE plpgsql AS $$
           BEGIN
             IF NEW.status = 'running' AND NEW.payload ? 'refuse' THEN RAISE EXCEPTION 'not today'; END IF;
             RETURN NEW;
           END $$""")
    sql("CREATE TRIGGER refuse_claim BEFORE UPDATE ON fleetless.jobs FOR EACH ROW EXECUTE FUNCTION refuse_claim()")
    try:
        h = handlers(**{"slow.py": _FOREVER})
        held = [queue.enqueue("slow", {}, priority=9) for _ in range(2)]
        refused = queue.enqueue("slow", {"refuse": True})
        with pytest.raises(DrainError) as caught:  # one claim at a time: the third one fails
            drain(queue, h, concurrency=3, batch=1)
        assert str(caught.value) == "unexpected error: database: not today; 2 held claim(s) released"
        assert sql("SELECT id, status, attempts FROM fleetless.jobs ORDER BY id") == [
            (held[0], "pending", 0), (held[1], "pending", 0), (refused, "pending", 0)]
    finally:
        sql("DROP TRIGGER refuse_claim ON fleetless.jobs")


def test_an_unexpected_error_looking_up_a_handler_releases_every_held_claim(
        queue: Queue, handlers, sql, monkeypatch: pytest.MonkeyPatch) -> None:
    from fleetless import batch

    real = batch.handlers.resolve

    def resolve(folder: Path, kind: str):  # type: ignore[no-untyped-def]
        if kind == "broken" and threading.current_thread().name.startswith("job"):  # the job's lookup
            raise RuntimeError("handler index is corrupt")
        return real(folder, kind)

    h = handlers(**{"slow.py": _FOREVER, "broken.py": "print('never')"})
    held = queue.enqueue("slow", {}, priority=9)
    broken = queue.enqueue("broken", {})
    monkeypatch.setattr(batch.handlers, "resolve", resolve)
    with pytest.raises(DrainError) as caught:
        drain(queue, h, concurrency=2, batch=2)
    assert str(caught.value) == "unexpected error: RuntimeError: handler index is corrupt; 2 held claim(s) released"
    assert sql("SELECT id, status, attempts FROM fleetless.jobs ORDER BY id") == [
        (held, "pending", 0), (broken, "pending", 0)]


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


@pytest.mark.parametrize("options", [{"concurrency": 2}, {"concurrency": 1, "per_sandbox": 4}],
                         ids=["per-job", "batch"])
def test_an_outcome_the_database_refuses_fails_that_job_alone_permanently(
        queue: Queue, handlers, sql, options: dict[str, int]) -> None:
    sql("ALTER TABLE fleetless.jobs ADD CONSTRAINT no_poison CHECK (result NOT LIKE '%poison%')")
    try:
        h = handlers(**{"echo.py": "import json, sys; print(json.load(open(sys.argv[1]))['say'])"})
        bad = queue.enqueue("echo", {"say": "poison"}, max_attempts=3)
        queue.enqueue_many([("echo", {"say": f"fine {i}"}) for i in range(3)])
        summary = drain(queue, h, **options).summary
        assert sql("SELECT status, attempts, last_error FROM fleetless.jobs WHERE id = %s", bad) == [
            ("dead", 1, 'its outcome cannot be stored: database refused a value: new row for relation "jobs"'
             ' violates check constraint "no_poison"')]
        assert sql("SELECT status, count(*) FROM fleetless.jobs WHERE id <> %s GROUP BY 1", bad) == [("done", 3)]
        assert (summary.done, summary.dead) == (3, 1)
    finally:
        sql("ALTER TABLE fleetless.jobs DROP CONSTRAINT no_poison")


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
    drain(queue, current, concurrency=1, batch=1, no_handler_delay=None)


def test_a_deploy_that_swaps_the_handlers_symlink_mid_drain_is_followed(queue: Queue, sql, tmp_path: Path) -> None:
    queue.enqueue_many([("later", {})] * 3)
    _drain_across_a_deploy(queue, sql, tmp_path, v2_has_later=True)
    assert sql("SELECT kind, status, result, count(*) FROM fleetless.jobs GROUP BY 1, 2, 3 ORDER BY 1") == [
        ("first", "done", "v1\n", 1),
        ("later", "done", "v2\n", 3)]


def test_a_kind_whose_handler_vanishes_mid_drain_is_retried_not_dead(queue: Queue, sql, tmp_path: Path) -> None:
    later = queue.enqueue("later", {})
    _drain_across_a_deploy(queue, sql, tmp_path, v2_has_later=False)
    ((status, attempts, error),) = sql("SELECT status, attempts, last_error FROM fleetless.jobs WHERE id = %s", later)
    assert (status, attempts) == ("pending", 1)
    assert "no handler for kind 'later'" in str(error) and "it had one when the drain started" in str(error)


def test_a_kind_that_never_had_a_handler_is_dead_at_once(queue: Queue, handlers, sql) -> None:
    h = handlers(**{"a.py": "print(1)"})
    queue.enqueue("nowhere", {}, max_attempts=3)
    drain(queue, h, no_handler_delay=None)
    ((status, attempts, error),) = sql("SELECT status, attempts, last_error FROM fleetless.jobs")
    assert (status, attempts) == ("dead", 1)
    assert "no handler for kind 'nowhere'" in str(error) and "it had one" not in str(error)


# -- one job id, two claims ---------------------------------------------------------------------------

def test_a_job_cancelled_retried_and_claimed_again_by_the_same_drain_ends_as_its_new_run_did(
        queue: Queue, handlers, sql, tmp_path: Path) -> None:
    """The drain's bookkeeping is keyed by claim (job id and token), not job id: the cancel of the
    first run must not reach the second run of the same job in the same drain."""
    signals = tmp_path / "signals"
    signals.mkdir()
    signals.chmod(0o777)  # the job may run as another uid (a root drainer's process tier)
    h = handlers(**{"twice.py": f"""
        import os, sys, time
        if os.environ["FLEETLESS_ATTEMPT"] == "1":
            open({str(signals / "first")!r}, "w").close()
            time.sleep(600)  # until its sandbox is killed by the cancel
        sys.exit(1)  # the second run fails by itself
        """, "keeper.py": f"""
        import os, time
        while not os.path.exists({str(signals / "go")!r}):
            time.sleep(0.05)
        """})
    job = queue.enqueue("twice", {}, max_attempts=1, priority=9)
    queue.enqueue("keeper", {})  # keeps the drain going until the second run has ended
    drainer = Drainer(queue, DrainConfig(handlers_dir=h, concurrency=2, batch=1))
    thread = threading.Thread(target=drainer.run)
    thread.start()
    try:
        wait_for(lambda: (signals / "first").exists(), what="the first run to start")
        queue.cancel(job)
        wait_for(lambda: sql("SELECT status FROM fleetless.jobs WHERE id = %s", job) == [("cancelled",)],
                 what="the first run to end cancelled")
        queue.retry(job)  # the operator changes their mind: one more attempt
        wait_for(lambda: sql("SELECT status <> 'running' AND attempts = 2 FROM fleetless.jobs WHERE id = %s",
                             job) == [(True,)], timeout=120, what="the second run to end")
    finally:
        (signals / "go").touch()
        thread.join(timeout=120)
    ((status, error),) = sql("SELECT status, last_error FROM fleetless.jobs WHERE id = %s", job)
    assert (status, str(error).splitlines()[0]) == ("dead", "exit code 1"), error
    assert (drainer.summary.cancelled, drainer.summary.dead, drainer.summary.done) == (1, 1, 1)


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


def test_a_sandbox_slow_to_start_does_not_let_its_lease_expire_under_a_live_drainer(
        dsn: str, queue: Queue, handlers, sql, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lease runs from the claim, the timeout from the exec: a sandbox that takes longer to
    start than the grace would leave the job running past its lease, reaped under its drainer.
    The drainer renews what it holds (per-job mode too), with a reaper in a tight loop beside it."""
    from fleetless.sandbox.process import ProcessSandbox

    real = ProcessSandbox.create.__func__  # type: ignore[attr-defined]

    def slow(cls, template, ttl_seconds=900):  # type: ignore[no-untyped-def]
        time.sleep(4)  # the fault: a start slower than the whole 3 s grace (a loaded host)
        return real(cls, template, ttl_seconds)

    monkeypatch.setattr(ProcessSandbox, "create", classmethod(slow))
    h = handlers(**{"job.py": "import time; time.sleep(1.5); print('ran')"})
    job = queue.enqueue("job", {}, max_attempts=1, timeout=2)
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
        summary = drain(queue, h, concurrency=1, lease_grace=3).summary
    finally:
        stop.set()
        t.join()
    assert reaped == []
    assert sql("SELECT status, attempts, result FROM fleetless.jobs WHERE id = %s", job) == [("done", 1, "ran\n")]
    assert (summary.done, summary.fenced_out) == (1, 0)


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
