"""PostgreSQL goes away mid-drain: backends terminated, connections refused, the server stopped and
started again. The drainer rides it out and writes every outcome (fenced by its claim token), or
gives up with one line, killing its sandboxes; no job is lost, the next drain finishes the work."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from fleetless import Queue

from .conftest import APP_NAME, executions, processes_mentioning
from proctools import leftovers, pids_with, wait_for

ADMIN_DSN = os.environ.get("FLEETLESS_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
# The drainer as a user runs it, but giving up on the database after 2 s instead of 30.
SHORT_DB_RETRY = ("-c", "import sys, fleetless.drainer as d; d.DB_RETRY_SECONDS = 2.0; sys.argv[0] = 'fleetless';"
                  " from fleetless.cli import main; main()")


def terminate_drainer_backends(dsn: str) -> int:
    """pg_terminate_backend on every connection of a chaos drainer to this test's database."""
    dbname = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
    with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
        rows = admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = %s AND application_name = %s AND pid <> pg_backend_pid()",
            (dbname, APP_NAME)).fetchall()
    return sum(1 for (ok,) in rows if ok)


def allow_connections(dsn: str, allow: bool) -> None:
    dbname = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
    with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
        admin.execute(f'ALTER DATABASE "{dbname}" WITH ALLOW_CONNECTIONS {str(allow).lower()}')


@pytest.fixture
def database_away(dsn: str) -> Iterator[Callable[[], None]]:
    """``database_away()``: new connections to the test database are refused (even a superuser's)
    and the drainers' open ones are terminated; connections come back at the end of the test or on
    ``allow_connections(dsn, True)``."""

    def away() -> None:
        allow_connections(dsn, False)
        terminate_drainer_backends(dsn)

    yield away
    allow_connections(dsn, True)


def test_terminated_backends_are_reconnected_and_every_job_finishes_once(
        dsn: str, queue: Queue, sql: Any, handlers: Any, tmp_path: Path, start_drain: Any) -> None:
    log = tmp_path / "runs.log"
    h = handlers(nap=f"""
        #!/bin/sh
        echo "$FLEETLESS_JOB_ID $FLEETLESS_ATTEMPT" >> {log}
        sleep 0.2
        echo "$FLEETLESS_JOB_ID"
    """)
    queue.enqueue_many([("nap", {"i": i}) for i in range(40)])
    drain = start_drain(dsn, h, "--concurrency", "3", "--lease-grace", "3", "--timeout", "10")
    wait_for(lambda: log.exists(), what="the first job to start")
    terminated = 0
    for _ in range(8):
        terminated += terminate_drainer_backends(dsn)
        time.sleep(0.4)
    assert drain.wait() == 0, drain.stderr
    assert terminated >= 4
    assert "fleetless: database unavailable (terminating connection due to administrator command); retrying\n" \
        in drain.stderr
    assert "drained: claimed 40, done 40" in drain.stdout
    assert sql("SELECT status, attempts, count(*) FROM fleetless.jobs GROUP BY 1, 2") == [("done", 1, 40)]
    assert {job: runs for job, runs in executions(log).items() if runs != [1]} == {}


def test_a_job_that_finishes_while_the_database_is_away_gets_its_outcome_written_after_reconnect(
        dsn: str, queue: Queue, sql: Any, handlers: Any, tmp_path: Path, start_drain: Any,
        database_away: Callable[[], None]) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    h = handlers(slow=f"""
        #!/bin/sh
        touch {marks}/started
        sleep 1.5
        touch {marks}/finished
        echo "finished attempt $FLEETLESS_ATTEMPT"
    """)
    job_id = queue.enqueue("slow", {})
    drain = start_drain(dsn, h, "--concurrency", "1", "--lease-grace", "60")
    wait_for(lambda: (marks / "started").exists(), what="the job to start")
    database_away()
    wait_for(lambda: (marks / "finished").exists(), what="the job to finish")
    time.sleep(2)  # the drainer is retrying its write now
    assert sql("SELECT status FROM fleetless.jobs") == [("running",)]
    allow_connections(dsn, True)
    assert drain.wait(timeout=60) == 0, drain.stderr
    assert "database unavailable" in drain.stderr and "drained: claimed 1, done 1" in drain.stdout
    assert sql("SELECT id, status, attempts, result FROM fleetless.jobs") == [
        (job_id, "done", 1, "finished attempt 1\n")]


def test_an_outcome_written_after_reconnect_is_fenced_when_the_claim_was_reaped_meanwhile(
        dsn: str, queue: Queue, sql: Any, handlers: Any, tmp_path: Path, start_drain: Any,
        database_away: Callable[[], None]) -> None:
    log = tmp_path / "runs.log"
    h = handlers(slow=f"""
        #!/bin/sh
        echo "$FLEETLESS_JOB_ID $FLEETLESS_ATTEMPT" >> {log}
        [ "$FLEETLESS_ATTEMPT" = 1 ] && sleep 1.5
        echo "attempt $FLEETLESS_ATTEMPT"
    """)
    job_id = queue.enqueue("slow", {}, timeout=2)  # lease: 2 s (+ grace 0)
    drain = start_drain(dsn, h, "--concurrency", "1", "--lease-grace", "3")
    wait_for(lambda: log.exists(), what="the job to start")
    database_away()
    # While the drainer cannot write, its lease runs out and an operator (connected already) reaps.
    wait_for(lambda: sql("SELECT lease_expires_at < now() FROM fleetless.jobs") == [(True,)], what="lease expiry")
    assert queue_reap(sql) == [(job_id, "pending")]
    allow_connections(dsn, True)
    assert drain.wait(timeout=60) == 0, drain.stderr
    # Its late outcome was not written; the reaped job, due again, was claimed anew and finished.
    assert "drained: claimed 2, done 1, failed 0, dead 0, 1 fenced out" in drain.stdout
    assert sql("SELECT status, attempts, result FROM fleetless.jobs") == [("done", 2, "attempt 2\n")]
    assert executions(log) == {job_id: [1, 2]}


def queue_reap(sql: Any) -> list[tuple[object, ...]]:
    """The reaper's own statement, run on the test's open connection (new ones are refused)."""
    from fleetless import db

    return sql(db.queries()["reap"].replace("%(older_than)s", "NULL"))


def test_a_drainer_that_cannot_reach_the_database_exits_3_in_one_line_and_kills_its_sandboxes(
        dsn: str, queue: Queue, sql: Any, handlers: Any, tmp_path: Path, workdir: Path, start_drain: Any,
        fleetless: Any, database_away: Callable[[], None]) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    marker = f"fleetless-hang-{time.monotonic_ns()}"  # (a job's pids are its pid namespace's)
    h = handlers(hang=f"""
        #!/bin/sh
        if [ "$FLEETLESS_ATTEMPT" = 1 ]; then
            echo $$ > {pids}/job
            exec /usr/bin/python3 -c 'import time; time.sleep(600)' {marker}
        fi
        echo "attempt $FLEETLESS_ATTEMPT"
    """)
    job_id = queue.enqueue("hang", {}, timeout=3)
    # Concurrency 2 with one job: the free slot keeps claiming, so the loss is noticed at once.
    drain = start_drain(dsn, h, "--concurrency", "2", "--lease-grace", "3", prefix=SHORT_DB_RETRY)
    wait_for(lambda: (pids / "job").exists() and pids_with(marker), what="the job to start")
    database_away()
    assert drain.wait(timeout=30) == 3, drain.stderr
    lines = drain.stderr.strip().splitlines()
    assert all(line.startswith("fleetless: ") for line in lines), drain.stderr  # no traceback
    assert [line for line in lines if line.startswith("fleetless: error: ")] == [lines[-1]]
    assert lines[-1].startswith("fleetless: error: lost the database connection: "), lines[-1]
    wait_for(lambda: not pids_with(marker), timeout=10, what="the job to be killed")
    assert processes_mentioning(str(workdir)) == []
    wait_for(lambda: not leftovers(workdir), timeout=10, what="the workspace to be removed")
    # The claim is still held until its lease runs out; then the next drain reaps it and finishes.
    allow_connections(dsn, True)
    assert sql("SELECT status, attempts FROM fleetless.jobs") == [("running", 1)]
    wait_for(lambda: sql("SELECT lease_expires_at < now() FROM fleetless.jobs") == [(True,)], what="lease expiry")
    again = fleetless("drain", "--handlers", str(h), dsn=dsn)
    assert again.returncode == 0 and "1 reaped" in again.stdout, again.stderr
    assert sql("SELECT id, status, attempts, result FROM fleetless.jobs") == [(job_id, "done", 2, "attempt 2\n")]


# -- a full server restart -------------------------------------------------------------------------

def _pg_bindir() -> Path | None:
    for version in sorted(os.listdir("/etc/postgresql"), reverse=True) if os.path.isdir("/etc/postgresql") else []:
        path = Path(f"/usr/lib/postgresql/{version}/bin")
        if (path / "pg_ctl").exists():
            return path
    return None


class PrivateServer:
    """A throwaway PostgreSQL cluster on a free loopback port, from the system's binaries, that
    this test may stop and start at will without disturbing any other test or anyone else."""

    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.dir = Path(tempfile.mkdtemp(prefix="fleetless-chaos-pg-"))
        shutil.chown(self.dir, "postgres", "postgres")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.dsn = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self._as_postgres(str(bindir / "initdb"), "-D", str(self.dir / "data"), "-A", "trust", "-U", "postgres",
                          "--no-sync")

    def _as_postgres(self, *argv: str) -> None:
        prefix = ["runuser", "-u", "postgres", "--"] if os.getuid() == 0 else []
        subprocess.run([*prefix, *argv], check=True, capture_output=True, timeout=120, cwd=self.dir)

    def start(self) -> None:
        self._as_postgres(str(self.bindir / "pg_ctl"), "-D", str(self.dir / "data"), "-l", str(self.dir / "log"),
                          "-w", "-o", f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off",
                          "start")

    def stop(self, mode: str = "fast") -> None:
        self._as_postgres(str(self.bindir / "pg_ctl"), "-D", str(self.dir / "data"), "-m", mode, "-w", "stop")

    def destroy(self) -> None:
        try:
            self.stop("immediate")
        except subprocess.CalledProcessError:
            pass
        shutil.rmtree(self.dir, ignore_errors=True)


class SystemCluster:
    """The shared server every test uses (FLEETLESS_CHAOS_RESTART=1 only: other runs lose it)."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.version = sorted(os.listdir("/etc/postgresql"))[-1]

    def _ctl(self, action: str) -> None:
        subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", self.version, "main", action],
                       check=True, capture_output=True, timeout=120)

    def stop(self) -> None:
        self._ctl("stop")

    @staticmethod
    def ready() -> bool:
        return subprocess.run(["pg_isready", "-h", "127.0.0.1", "-q"]).returncode == 0

    def start(self) -> None:
        if not self.ready():
            self._ctl("start")
        wait_for(self.ready, timeout=60, what="the server to accept connections", interval=0.2)


@pytest.fixture(params=["private", "system"])
def server(request: pytest.FixtureRequest, dsn: str) -> Iterator[Any]:
    if request.param == "system":
        if os.environ.get("FLEETLESS_CHAOS_RESTART") != "1" or shutil.which("pg_ctlcluster") is None:
            pytest.skip("restarts the shared PostgreSQL server, breaking anything else using it:"
                        " set FLEETLESS_CHAOS_RESTART=1 to run")
        cluster = SystemCluster(dsn)
        yield cluster
        cluster.start()  # whatever happened, leave it running
        return
    bindir = _pg_bindir()
    if bindir is None or (os.getuid() != 0 and os.environ.get("USER") != "postgres"):
        pytest.skip("needs the system's PostgreSQL binaries and root (to run them as postgres)")
    private = PrivateServer(bindir)
    try:
        private.start()
        with psycopg.connect(private.dsn, autocommit=True) as c:
            c.execute("CREATE DATABASE chaos")
        private.dsn = private.dsn.rsplit("/", 1)[0] + "/chaos"
        yield private
    finally:
        private.destroy()


def test_a_server_restart_mid_drain_is_ridden_out_and_outcomes_are_written_after_it(
        server: Any, handlers: Any, tmp_path: Path, start_drain: Any) -> None:
    log = tmp_path / "runs.log"
    h = handlers(work=f"""
        #!/bin/sh
        echo "$FLEETLESS_JOB_ID $FLEETLESS_ATTEMPT" >> {log}
        sleep 1
        echo "done $FLEETLESS_JOB_ID"
    """)
    queue = Queue(server.dsn)
    queue.init()
    with psycopg.connect(server.dsn, autocommit=True) as c:
        c.execute("TRUNCATE fleetless.jobs, fleetless.job_attempts RESTART IDENTITY CASCADE")
    queue.enqueue_many([("work", {"i": i}) for i in range(12)])
    queue.close()
    drain = start_drain(server.dsn, h, "--concurrency", "3", "--lease-grace", "60")
    wait_for(lambda: log.exists() and len(log.read_text().splitlines()) >= 3, what="jobs to start")
    server.stop()
    time.sleep(2.5)  # the running jobs end while the server is down; the drainer keeps retrying
    server.start()
    assert drain.wait(timeout=90) == 0, drain.stderr
    assert "database unavailable" in drain.stderr
    with psycopg.connect(server.dsn) as c:
        rows = c.execute("SELECT status, attempts, count(*) FROM fleetless.jobs GROUP BY 1, 2").fetchall()
        assert rows == [("done", 1, 12)], rows
    assert {job: runs for job, runs in executions(log).items() if runs != [1]} == {}
