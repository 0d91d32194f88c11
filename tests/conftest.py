"""Shared fixtures: a real PostgreSQL database per test module, handler directories, a CLI runner.

The server is the one at ``FLEETLESS_TEST_PG`` (default: 127.0.0.1:5432 as user postgres, as on
these machines and in CI). Each test module gets a database of its own, created for it and
dropped afterwards, so no test depends on what another run left behind.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import tempfile
import textwrap
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

from fleetless import Queue

ADMIN_DSN = os.environ.get("FLEETLESS_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
# The CLI's default tier is auto (bwrap where it works). Tests that drive `fleetless drain` without
# --sandbox were written for the process tier: pin it for them (and every drainer they spawn);
# the tests of the default itself clear it with env={"FLEETLESS_SANDBOX": ""}.
os.environ.setdefault("FLEETLESS_SANDBOX", "process")


# -- test directories a root drainer's jobs can reach -------------------------------------------
# Under a root drainer, jobs run as unprivileged uids, and bwrap (running as one) binds the work
# directory by path: every directory on the way must be searchable by other users. pytest's default
# base, /tmp/pytest-of-root, is 0700 and every new pytest session (other checkouts on this host
# included) resets it to 0700, under the feet of a running one; so a root session gets a base of its
# own (made searchable by _searchable_basetemp below), removed at the end.
#
# Process-tier jobs get private /tmp, /var/tmp, /dev/shm and /run/lock (issue 25, item 4), so the
# directories a test shares with its jobs (markers, logs) cannot be there: the session's temporary
# directory (tempfile's, and so pytest's) is under /var/lib/fleetless-tests for root, else under
# ~/.cache/fleetless-tests, removed at the end.
def _job_visible_base() -> str:
    if os.geteuid() == 0:
        return "/var/lib/fleetless-tests"
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fleetless-tests")


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("FLEETLESS_TEST_TMP") is None:
        top = _job_visible_base()
        os.makedirs(top, mode=0o755, exist_ok=True)
        os.chmod(top, 0o755)
        session = tempfile.mkdtemp(prefix="session-", dir=top)
        os.chmod(session, 0o755)
        os.environ["FLEETLESS_TEST_TMP"] = os.environ["TMPDIR"] = tempfile.tempdir = session
        config.add_cleanup(lambda: subprocess.run(["rm", "-rf", "--one-file-system", session], check=False,
                                                  capture_output=True))  # (a non-root run: what it cannot remove stays)
    if config.option.basetemp is None and os.geteuid() == 0:
        base = tempfile.mkdtemp(prefix="fleetless-pytest-")
        config.option.basetemp = base
        config.add_cleanup(lambda: subprocess.run(["rm", "-rf", base], check=False))



def _dsn_for(dbname: str) -> str:
    info = psycopg.conninfo.conninfo_to_dict(ADMIN_DSN)
    info["dbname"] = dbname
    return psycopg.conninfo.make_conninfo(**info)  # type: ignore[arg-type]


@pytest.fixture(scope="session", autouse=True)
def _searchable_basetemp(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A root drainer runs process-tier jobs as unprivileged uids (issue 7): they must be able to
    pass through pytest's temporary directories (0700) to the handlers and workspaces in them."""
    base = tmp_path_factory.getbasetemp()
    for folder in (base.parent, base):
        folder.chmod(folder.stat().st_mode & 0o7777 | 0o011)  # (keeps /tmp's sticky bit)


def shared_with_jobs(folder: Path) -> Path:
    """Let a root drainer's jobs, each running as a uid of its own, create files in ``folder`` (and
    below) and append to one another's, as a drainer's own jobs could before issue 7: mode 1777
    and a default ACL ``rwx`` for everyone (it overrides the umask for what is created inside)."""
    entries = b"".join(struct.pack("<HHI", tag, 7, 0xFFFFFFFF) for tag in (0x01, 0x04, 0x20))
    os.setxattr(folder, "system.posix_acl_default", struct.pack("<I", 2) + entries)
    folder.chmod(0o1777)
    return folder


@pytest.fixture
def tmp_path(tmp_path: Path) -> Path:
    """pytest's ``tmp_path``, reachable and writable by the jobs of a root drainer (see
    :func:`shared_with_jobs`): many tests have their jobs leave markers and logs in it."""
    return shared_with_jobs(tmp_path)


@pytest.fixture(scope="module")
def dsn(request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh database for this test module."""
    name = f"fleetless_t_{request.module.__name__.rsplit('.', 1)[-1][:30]}_{uuid.uuid4().hex[:8]}".lower()
    with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield _dsn_for(name)
    finally:
        with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def queue(dsn: str) -> Iterator[Queue]:
    """A Queue on an empty, freshly initialised jobs table."""
    q = Queue(dsn)
    q.init()
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("TRUNCATE fleetless.jobs, fleetless.job_attempts, fleetless.maintenance_runs,"
                  " fleetless.job_dependencies, fleetless.queue_settings RESTART IDENTITY CASCADE")
    yield q
    q.close()


@pytest.fixture
def private_workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Sandbox workspaces of this test's drains in a directory of its own (FLEETLESS_WORKDIR), so
    the sweeper and the assertions on leftovers see only this test's. Modules that drain use it
    with ``pytestmark = pytest.mark.usefixtures("private_workdir")``."""
    work = tmp_path / "work"
    monkeypatch.setenv("FLEETLESS_WORKDIR", str(work))
    return work


@pytest.fixture
def sql(dsn: str) -> Iterator[Callable[..., list[tuple[object, ...]]]]:
    """Run SQL against the test database and return the rows: assertions read the table."""
    conn = psycopg.connect(dsn, autocommit=True)

    def run(query: str, *params: object) -> list[tuple[object, ...]]:
        cur = conn.execute(query, params or None)  # type: ignore[arg-type]
        return cur.fetchall() if cur.description else []

    yield run
    conn.close()


@pytest.fixture
def handlers(tmp_path: Path) -> Callable[..., Path]:
    """``handlers(name=source, ...)`` writes handler files into a fresh directory; names ending
    in ``.py`` are Python handlers, others are made executable."""
    folder = tmp_path / "handlers"
    folder.mkdir()
    folder.chmod(0o755)
    shared_with_jobs(tmp_path)  # (the handlers directory itself stays 0755: no job writes it)

    def write(**files: str) -> Path:
        for name, source in files.items():
            path = folder / name.replace("__", "-")
            path.write_text(textwrap.dedent(source).lstrip())
            path.chmod(0o644 if path.suffix == ".py" else 0o755)
        return folder

    return write


def _fleetless(*args: str, dsn: str | None = None, input: str | None = None,
              env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run the real CLI as a user would."""
    full_env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    if dsn:
        full_env["DATABASE_URL"] = dsn
    full_env.update(env or {})
    full_env = {k: v for k, v in full_env.items() if v != "" or k != "FLEETLESS_SANDBOX"}
    return subprocess.run(
        [sys.executable, "-m", "fleetless.cli", *args], input=input, capture_output=True, text=True,
        env=full_env, timeout=timeout,
    )


@pytest.fixture
def fleetless() -> Callable[..., subprocess.CompletedProcess[str]]:
    """``fleetless(*args, dsn=..., input=...)`` runs the real CLI as a user would."""
    return _fleetless


def _require_tier(name: str) -> None:
    """Skip, with the reason, when a sandbox tier cannot run here, unless the environment says it
    must (``FLEETLESS_REQUIRE_TIERS=bwrap,microvm``, as CI does): then fail."""
    from fleetless.sandbox import SandboxUnavailable, get_backend

    try:
        get_backend(name).check()
    except SandboxUnavailable as exc:
        required = {t.strip() for t in os.environ.get("FLEETLESS_REQUIRE_TIERS", "").split(",")}
        if name in required:
            pytest.fail(f"sandbox tier {name} is required here but unavailable: {exc}")
        pytest.skip(f"sandbox tier {name} unavailable: {exc}")


@pytest.fixture
def require_tier() -> Callable[[str], None]:
    """``require_tier("bwrap")``: skip (or, where CI requires the tier, fail) if it cannot run."""
    return _require_tier
