"""A drain run end to end: real PostgreSQL, real sandboxes (process tier here; the isolation
tiers have their own suites), outcomes asserted in the table."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from fleetless import Queue, RetryPolicy
from fleetless.drainer import DrainConfig, Drainer, DrainError
from fleetless.queue import RESULT_CUT_MARKER

from proctools import pids_with, wait_for


@pytest.fixture(autouse=True)
def private_workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    work = tmp_path / "work"
    monkeypatch.setenv("FLEETLESS_WORKDIR", str(work))
    return work


def drain(queue: Queue, handlers_dir: Path, **options: object) -> Drainer:
    options.setdefault("concurrency", 2)
    drainer = Drainer(queue, DrainConfig(handlers_dir=handlers_dir, **options))  # type: ignore[arg-type]
    drainer.run()
    return drainer


def test_a_job_runs_with_its_payload_and_its_stdout_becomes_the_result(queue: Queue, handlers, sql,
                                                                      private_workdir: Path) -> None:
    h = handlers(**{"greet.py": """
        import json, os, sys
        p = json.load(open(sys.argv[1]))
        assert os.getcwd() == os.path.dirname(sys.argv[1]) == os.environ["HOME"]
        print(f"Hello, {p['name']}! job {os.environ['FLEETLESS_JOB_ID']} attempt {os.environ['FLEETLESS_ATTEMPT']}")
    """})
    job_id = queue.enqueue("greet", {"name": "Ada"})
    d = drain(queue, h)
    assert sql("SELECT status, attempts, result, last_error, finished_at IS NOT NULL FROM fleetless.jobs") == [
        ("done", 1, f"Hello, Ada! job {job_id} attempt 1\n", None, True)]
    assert (d.summary.claimed, d.summary.done) == (1, 1)
    assert list(private_workdir.glob("ws-*")) == []  # every workspace removed (hs-*: the handlers snapshot)


def test_an_executable_handler_in_any_language_runs_the_same_way(queue: Queue, handlers, sql) -> None:
    h = handlers(shout="""
        #!/bin/sh
        tr a-z A-Z < "$1"
    """)
    queue.enqueue("shout", {"say": "hi"})
    drain(queue, h)
    assert sql("SELECT status, result FROM fleetless.jobs") == [("done", '{"SAY": "HI"}')]


def test_a_job_whose_handler_exits_1_three_times_ends_dead_with_the_stderr_tail(queue: Queue, handlers,
                                                                               sql) -> None:
    h = handlers(**{"flaky.py": """
        import sys
        sys.stderr.write("noise " * 1000)
        sys.stderr.write("\\nConnectionError: upstream said 503\\n")
        sys.exit(1)
    """})
    queue.enqueue("flaky", {}, max_attempts=3)
    expected = [(120, 150), (240, 270)]
    for attempt, (low, high) in enumerate(expected, start=1):
        drain(queue, h)
        status, attempts, wait = sql(
            "SELECT status, attempts, extract(epoch FROM run_after - now()) FROM fleetless.jobs")[0]
        assert (status, attempts) == ("pending", attempt)
        assert low - 2 <= float(wait) <= high, (attempt, wait)  # 2^attempts min + 0-30 s jitter
        drain(queue, h)  # not due yet: nothing to claim
        assert sql("SELECT attempts FROM fleetless.jobs") == [(attempt,)]
        sql("UPDATE fleetless.jobs SET run_after = now()")
    drain(queue, h)
    status, attempts, error = sql("SELECT status, attempts, last_error FROM fleetless.jobs")[0]
    assert (status, attempts) == ("dead", 3)
    assert isinstance(error, str) and len(error) == 2000
    assert error.startswith("exit code 1: ConnectionError: upstream said 503\n")  # what happened, then the tail
    assert error.endswith("ConnectionError: upstream said 503")


def test_backoff_settings_are_the_drainers(queue: Queue, handlers, sql) -> None:
    h = handlers(**{"fail.py": "raise SystemExit(3)"})
    queue.enqueue("fail", {})
    drain(queue, h, retry=RetryPolicy(base_seconds=10, max_jitter_seconds=0))
    (wait,) = sql("SELECT extract(epoch FROM run_after - now()) FROM fleetless.jobs")[0]
    assert 18 <= float(wait) <= 20


def test_a_kind_with_no_handler_here_is_given_back_uncharged_for_a_drainer_that_has_it(queue: Queue, handlers,
                                                                                       sql) -> None:
    # A rolling deploy: this drainer's release lacks the kind; the next release's drainers have it.
    h = handlers(**{"other.py": "print(1)"})
    queue.enqueue("resize-image", {}, max_attempts=3)
    drain(queue, h)
    status, attempts, due_in, error = sql("SELECT status, attempts, extract(epoch FROM run_after - now()),"
                                          " last_error FROM fleetless.jobs")[0]
    assert (status, attempts) == ("pending", 0) and 50 < due_in <= 60
    assert "no handler for kind 'resize-image'" in error and "given back uncharged, due again in 60 s" in error
    with_it = handlers(**{"resize-image.py": "print('resized')"})
    sql("UPDATE fleetless.jobs SET run_after = now()")
    drain(queue, with_it)
    assert sql("SELECT status, attempts, result FROM fleetless.jobs WHERE kind = 'resize-image'") == [
        ("done", 1, "resized\n")]


def test_a_kind_with_no_handler_is_dead_at_once_when_the_delay_is_zero(queue: Queue, handlers, sql,
                                                                         fleetless, dsn: str) -> None:
    h = handlers(**{"other.py": "print(1)"})
    queue.enqueue("resize-image", {}, max_attempts=5)
    r = fleetless("drain", "--handlers", str(h), "--no-handler-delay", "0", dsn=dsn)
    assert r.returncode == 0, r.stderr
    status, attempts, error = sql("SELECT status, attempts, last_error FROM fleetless.jobs")[0]
    assert (status, attempts) == ("dead", 1)
    assert "no handler for kind 'resize-image'" in error


def test_death_by_signal_is_named(queue: Queue, handlers, sql) -> None:
    h = handlers(**{"crash.py": "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"})
    queue.enqueue("crash", {}, max_attempts=1)
    drain(queue, h)
    assert sql("SELECT status, last_error FROM fleetless.jobs") == [("dead", "killed by SIGSEGV")]


def test_a_timeout_kills_the_whole_tree_including_setsid_grandchildren(queue: Queue, handlers, sql,
                                                                      tmp_path: Path) -> None:
    pidfile = tmp_path / "grandchild.pid"
    marker = f"fleetless-grandchild-{uuid.uuid4().hex}"  # (a job's pids are its pid namespace's)
    h = handlers(**{"hang.py": f"""
        import os, sys, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                open({str(pidfile)!r}, "w").write(str(os.getpid()))
                os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(600)", {marker!r}])
            os._exit(0)
        time.sleep(600)
    """})
    queue.enqueue("hang", {}, max_attempts=1, timeout=2)
    drain(queue, h, timeout=600)  # the job's own timeout wins
    assert sql("SELECT status, last_error FROM fleetless.jobs") == [("dead", "killed: timeout after 2 s")]
    assert pidfile.exists() and not pids_with(marker)


def test_the_environment_is_scrubbed(queue: Queue, handlers, sql, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATABASE_URL", "postgresql://secret@db/prod")
    monkeypatch.setenv("PGPASSWORD", "hunter2")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "shh")
    monkeypatch.setenv("ALLOWED_TOKEN", "yes")
    h = handlers(**{"env.py": "import os; print(' '.join(sorted(os.environ)))"})
    queue.enqueue("env", {})
    drain(queue, h, pass_env=("ALLOWED_TOKEN", "MODE=fast"))
    (result,) = sql("SELECT result FROM fleetless.jobs")[0]
    assert str(result).split() == ["ALLOWED_TOKEN", "FLEETLESS_ATTEMPT", "FLEETLESS_JOB_ID", "FLEETLESS_KIND",
                                   "FLEETLESS_SNOOZES", "HOME", "LANG", "MODE", "PATH",
                                   "TMPDIR"]  # (the process tier's, in the workspace)


def test_huge_stdout_is_read_and_capped_without_harm(queue: Queue, handlers, sql) -> None:
    h = handlers(**{"loud.py": """
        import sys
        chunk = "y" * 65536
        for _ in range(160):  # 10 MiB
            sys.stdout.write(chunk)
    """})
    queue.enqueue("loud", {})
    drain(queue, h)
    assert sql("SELECT status, length(result) FROM fleetless.jobs") == [("done", 65536 + len(RESULT_CUT_MARKER))]


def test_a_result_cut_at_64_kib_says_so_in_the_table_and_in_show(dsn: str, queue: Queue, handlers, sql,
                                                                 fleetless) -> None:
    """The stored result ends with a visible marker, `show` says it was cut; a result that fits
    (exactly 64 KiB) carries no marker."""
    h = handlers(**{"loud.py": "import sys; sys.stdout.write('y' * 70000)",
                    "fits.py": "import sys; sys.stdout.write('z' * 65536)"})
    loud = queue.enqueue("loud", {})
    fits = queue.enqueue("fits", {})
    drain(queue, h)
    (result,) = sql("SELECT result FROM fleetless.jobs WHERE id = %s", loud)[0]
    assert result == "y" * 65536 + RESULT_CUT_MARKER
    assert sql("SELECT result FROM fleetless.jobs WHERE id = %s", fits) == [("z" * 65536,)]
    shown = fleetless("show", str(loud), dsn=dsn)
    assert shown.returncode == 0, shown.stderr
    assert "result (cut: only the first 64 KiB of stdout were kept):" in shown.stdout
    assert "output cut here" in shown.stdout
    assert "cut" not in fleetless("show", str(fits), dsn=dsn).stdout


def test_jobs_run_concurrently_up_to_the_limit(queue: Queue, handlers, sql) -> None:
    h = handlers(**{"nap.py": "import time; time.sleep(0.5)"})
    queue.enqueue_many([("nap", {})] * 6)
    drain(queue, h, concurrency=3)
    spans = sql("SELECT started_at, finished_at FROM fleetless.jobs")
    assert all(s is not None for row in spans for s in row)
    most = max(sum(1 for s2, f2 in spans if s2 <= s1 < f2) for s1, _ in spans)  # type: ignore[operator]
    assert 2 <= most <= 3


def test_a_slots_outcome_is_written_in_the_same_commit_as_its_next_claim(queue: Queue, handlers, sql) -> None:
    """Per-job mode: one commit per job, not two. Each job's outcome is durable no later than its
    slot's next job is claimed: the same transaction (the same now()) ended one and started the next."""
    h = handlers(**{"ok.py": "print('ok')"})
    queue.enqueue_many([("ok", {"i": i}) for i in range(4)])
    drain(queue, h, concurrency=1)
    rows = sql("SELECT status, started_at, finished_at FROM fleetless.jobs ORDER BY started_at")
    assert [r[0] for r in rows] == ["done"] * 4
    assert [r[2] for r in rows[:-1]] == [r[1] for r in rows[1:]]


def test_max_runtime_stops_claiming_and_finishes_what_it_holds(queue: Queue, handlers, sql) -> None:
    h = handlers(**{"nap.py": "import time; time.sleep(0.6)"})
    queue.enqueue_many([("nap", {})] * 6)
    drain(queue, h, concurrency=1, max_runtime=1.0)
    counts = dict(sql("SELECT status, count(*) FROM fleetless.jobs GROUP BY status"))
    assert counts.get("running", 0) == 0
    assert 1 <= counts["done"] < 6 and counts["pending"] == 6 - counts["done"]


def test_a_missing_handlers_directory_touches_no_job(queue: Queue, sql, tmp_path: Path) -> None:
    queue.enqueue("a", {})
    with pytest.raises(DrainError, match=r"handlers directory .* does not exist"):
        drain(queue, tmp_path / "nope")
    assert sql("SELECT status, attempts FROM fleetless.jobs") == [("pending", 0)]


def test_a_drain_that_never_reached_the_database_says_it_cannot_connect(
        handlers, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not "lost the database connection": it never had one (a wrong DSN, a server that is down)."""
    import fleetless.drainer

    monkeypatch.setattr(fleetless.drainer, "DB_RETRY_SECONDS", 0.5)
    h = handlers(**{"a.py": "print(1)"})
    q = Queue("postgresql://postgres@127.0.0.1:1/nope?connect_timeout=2")
    with pytest.raises(DrainError) as caught:
        drain(q, h)
    assert str(caught.value).startswith("cannot connect to the database: "), caught.value
    assert "lost" not in str(caught.value) and str(caught.value).count("cannot connect") == 1


def test_an_unusable_work_directory_is_reported_before_any_claim(queue: Queue, handlers, sql,
                                                                 tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    h = handlers(**{"a.py": "print(1)"})
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("FLEETLESS_WORKDIR", str(blocker / "sub"))
    queue.enqueue("a", {})
    with pytest.raises(DrainError, match="cannot use the sandbox work directory"):
        drain(queue, h)
    assert sql("SELECT status, attempts FROM fleetless.jobs") == [("pending", 0)]


def test_a_sandbox_that_breaks_mid_drain_returns_the_claim_without_charging_an_attempt(
        queue: Queue, handlers, sql, monkeypatch: pytest.MonkeyPatch) -> None:
    from fleetless.sandbox import _workspace

    def disk_full() -> Path:
        raise OSError(28, "No space left on device")

    h = handlers(**{"a.py": "print(1)"})
    queue.enqueue_many([("a", {})] * 3)
    monkeypatch.setattr(_workspace, "create", disk_full)
    with pytest.raises(DrainError, match=r"sandbox error .*No space left on device"):
        drain(queue, h, concurrency=1)
    rows = sql("SELECT status, attempts, last_error FROM fleetless.jobs ORDER BY id")
    assert rows[0][:2] == ("pending", 0) and "No space left" in str(rows[0][2])
    assert [r[:2] for r in rows[1:]] == [("pending", 0)] * 2  # the drain stopped claiming


def test_a_jobs_sandbox_is_destroyed_beside_its_outcome_and_all_are_gone_when_the_drain_returns(
        queue: Queue, handlers, sql, monkeypatch: pytest.MonkeyPatch, private_workdir: Path) -> None:
    from fleetless.sandbox.process import ProcessSandbox

    kill = ProcessSandbox.kill
    seen: list[tuple[str, float]] = []  # each sandbox's job status when its kill began, and its end

    def kill_after_the_outcome(self: ProcessSandbox) -> None:
        job_id = int(self._template.env["FLEETLESS_JOB_ID"])
        deadline = time.monotonic() + 10  # an inline kill would wait here for an outcome never written
        while (status := sql("SELECT status FROM fleetless.jobs WHERE id = %s", job_id)[0][0]) == "running":
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        kill(self)
        seen.append((str(status), time.monotonic()))

    h = handlers(**{"a.py": "print(1)"})
    queue.enqueue_many([("a", {})] * 6)
    monkeypatch.setattr(ProcessSandbox, "kill", kill_after_the_outcome)
    drain(queue, h, concurrency=2)
    returned = time.monotonic()
    assert sql("SELECT status, attempts FROM fleetless.jobs") == [("done", 1)] * 6
    assert [status for status, _ in seen] == ["done"] * 6  # written while its sandbox still stood
    assert max(t for _, t in seen) <= returned  # and the drain waited for every sandbox to go
    assert list(private_workdir.glob("ws-*")) == []


@pytest.fixture
def kills_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every process-tier sandbox is destroyed, then its kill() raises (a cgroup the kernel keeps)."""
    from fleetless.sandbox.process import ProcessSandbox

    kill = ProcessSandbox.kill

    def failing_kill(self: ProcessSandbox) -> None:
        kill(self)
        raise OSError(16, "Device or resource busy")

    monkeypatch.setattr(ProcessSandbox, "kill", failing_kill)


@pytest.mark.usefixtures("kills_fail")
def test_a_sandbox_that_cannot_be_destroyed_stops_the_drain_and_the_next_job_is_not_charged(
        queue: Queue, handlers, sql) -> None:
    h = handlers(**{"a.py": "import time; time.sleep(0.2); print(1)"})
    queue.enqueue_many([("a", {})] * 3)
    with pytest.raises(DrainError, match=r"sandbox error.*: cannot destroy a sandbox of the process tier: .*busy"):
        drain(queue, h, concurrency=1)
    rows = sql("SELECT status, attempts, coalesce(last_error, '') FROM fleetless.jobs ORDER BY id")
    assert rows[0][:2] == ("done", 1)  # it ran to its end: its outcome stands
    # the kill fails beside the next job's start: that job may still run (its own outcome), and the
    # one after it is refused a sandbox and given back uncharged, naming why
    assert {r[:2] for r in rows} <= {("done", 1), ("pending", 0)}
    assert any(r[:2] == ("pending", 0) and "cannot destroy a sandbox" in r[2] for r in rows)


@pytest.mark.usefixtures("kills_fail")
def test_the_last_sandbox_that_cannot_be_destroyed_still_fails_the_drain(queue: Queue, handlers, sql) -> None:
    h = handlers(**{"a.py": "print(1)"})
    queue.enqueue("a", {})
    with pytest.raises(DrainError, match=r"sandbox error: cannot destroy a sandbox of the process tier: .*busy"):
        drain(queue, h, concurrency=1)
    assert sql("SELECT status, attempts FROM fleetless.jobs") == [("done", 1)]


def test_two_drainers_racing_over_1000_jobs_never_run_one_twice(dsn: str, queue: Queue, handlers, sql,
                                                               tmp_path: Path) -> None:
    h = handlers(ok="""
        #!/bin/sh
        echo "$FLEETLESS_JOB_ID"
    """)
    queue.enqueue_many([("ok", {"i": i}) for i in range(1000)])
    procs = [
        subprocess.Popen([sys.executable, "-m", "fleetless.cli", "drain", "--handlers", str(h),
                          "--concurrency", "2", "--batch", "10"],
                         env={**os.environ, "DATABASE_URL": dsn}, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert sql("SELECT status, attempts, count(*) FROM fleetless.jobs GROUP BY 1, 2") == [("done", 1, 1000)]
    assert sql("SELECT count(*) FROM fleetless.jobs WHERE result <> id || E'\\n'") == [(0,)]
    claimed = [int(o.split("claimed ")[1].split(",")[0]) for o in outs]
    assert sum(claimed) == 1000 and all(c > 0 for c in claimed), outs


def _start_drain(dsn: str, h: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "fleetless.cli", "drain", "--handlers", str(h), "--concurrency", "2", *extra],
        env={**os.environ, "DATABASE_URL": dsn}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_sigkill_of_a_drainer_kills_its_jobs_and_the_next_drain_recovers_them(dsn: str, queue: Queue,
                                                                             handlers, sql,
                                                                             tmp_path: Path,
                                                                             private_workdir: Path,
                                                                             fleetless) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    marker = f"fleetless-sigkilled-{uuid.uuid4().hex}"  # (a job's pids are its pid namespace's)
    h = handlers(**{"work.py": f"""
        import os, sys
        if os.environ["FLEETLESS_ATTEMPT"] == "1":
            sleep = [sys.executable, "-c", "import time; time.sleep(600)", {marker!r}]
            open(os.path.join({str(pids)!r}, str(os.getpid())), "w").close()
            if os.fork() == 0:
                os.setsid()
                open(os.path.join({str(pids)!r}, str(os.getpid())), "w").close()
                os.execv(sys.executable, sleep)
            os.execv(sys.executable, sleep)
        print("recovered")
    """})
    queue.enqueue("work", {}, timeout=3)
    proc = _start_drain(dsn, h, "--lease-grace", "3")
    started = wait_for(lambda: len(list(pids.iterdir())) >= 2, timeout=20, what="job and grandchild")
    assert started
    proc.kill()
    proc.wait()
    wait_for(lambda: not pids_with(marker), timeout=10, what="job processes to die")
    wait_for(lambda: not any(private_workdir.glob("ws-*")), timeout=30, what="workspace removal")
    assert sql("SELECT status, attempts FROM fleetless.jobs") == [("running", 1)]
    # The lease (timeout 3 s + grace 0) has not expired yet: nothing to recover.
    early = fleetless("drain", "--handlers", str(h), dsn=dsn)
    assert early.returncode == 0 and "claimed 0" in early.stdout
    wait_for(lambda: sql("SELECT lease_expires_at < now() FROM fleetless.jobs") == [(True,)], timeout=10,
             what="lease expiry")
    again = fleetless("drain", "--handlers", str(h), dsn=dsn)
    assert again.returncode == 0, again.stderr
    assert "1 reaped" in again.stdout
    assert sql("SELECT status, attempts, result FROM fleetless.jobs") == [("done", 2, "recovered\n")]


def test_sigterm_lets_short_jobs_finish_and_returns_the_claims_of_long_ones(dsn: str, queue: Queue, handlers,
                                                                          sql, tmp_path: Path) -> None:
    marker = tmp_path / "started"
    marker.mkdir()
    h = handlers(**{"short.py": f"""
        import os, time
        open(os.path.join({str(marker)!r}, "short"), "w").close()
        time.sleep(1)
        print("finished")
    """, "long.py": f"""
        import os, time
        open(os.path.join({str(marker)!r}, "long"), "w").close()
        time.sleep(600)
    """})
    short = queue.enqueue("short", {})
    long = queue.enqueue("long", {})
    proc = _start_drain(dsn, h, "--shutdown-grace", "3")
    wait_for(lambda: len(list(marker.iterdir())) == 2, timeout=20, what="both jobs to start")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "1 released" in out
    rows = dict((r[0], r[1:]) for r in sql("SELECT id, status, attempts, last_error FROM fleetless.jobs"))
    assert rows[short] == ("done", 1, None)
    assert rows[long][0:2] == ("pending", 0) and "drainer stopped" in str(rows[long][2])


@pytest.mark.parametrize(("tier", "overhead"), [("process", 0), ("bwrap", 0), ("microvm", 65)])
def test_a_lease_covers_the_timeout_the_grace_and_the_sandboxs_own_overhead(queue: Queue, handlers, sql,
                                                                           tier: str, overhead: int) -> None:
    """A microVM boots before its job's timeout starts: its lease is longer by that much."""
    h = handlers(**{"a.py": "print(1)"})
    queue.enqueue("a", {}, timeout=10)
    drainer = Drainer(queue, DrainConfig(handlers_dir=h, sandbox=tier, lease_grace=20))
    assert len(drainer._claim(1)) == 1
    assert sql("SELECT round(extract(epoch FROM lease_expires_at - locked_at)) FROM fleetless.jobs") == [
        (10 + 20 + overhead,)]
