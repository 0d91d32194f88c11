"""A real PgBouncer (Debian's ``pgbouncer``), started by a test or a benchmark on a port of its own.

``PgBouncer(upstream_host=..., pool_mode="transaction").start()`` writes a private configuration
(trust authentication for ``postgres``, one wildcard database entry forwarding every database name
to the upstream server), runs ``pgbouncer`` in the foreground (as ``postgres`` when we are root:
PgBouncer refuses to run as root) and waits until it accepts connections. ``prefix`` runs it
through a wrapper, e.g. ``ip netns exec NS`` for a pooler inside a test network namespace.
``stop()`` ends it and removes its files; ``dsn(dbname)`` connects through it.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"


def free_port() -> int:
    """A TCP port nothing on the loopback listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def skip_unless_possible(why: str | None) -> None:
    """Skip the test, saying why, unless the environment says these tests must run
    (``FLEETLESS_REQUIRE_HOSTS=1``, as CI sets): then fail."""
    import pytest

    if why is None:
        return
    if os.environ.get("FLEETLESS_REQUIRE_HOSTS") == "1":
        pytest.fail(f"required here (FLEETLESS_REQUIRE_HOSTS=1) but impossible: {why}")
    pytest.skip(why)


def unavailable() -> str | None:
    """Why PgBouncer cannot be started here (None when it can)."""
    if not os.path.exists(PGBOUNCER):
        return "pgbouncer is not installed (Debian package pgbouncer; .ci/run installs it)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no postgres user to run pgbouncer as"
    return None


class PgBouncer:
    def __init__(self, *, upstream_host: str = "127.0.0.1", upstream_port: int = 5432,
                 listen_addr: str = "127.0.0.1", listen_port: int | None = None,
                 pool_mode: str = "transaction", pool_size: int = 4, max_client_conn: int = 500,
                 prefix: tuple[str, ...] = ()) -> None:
        self.upstream_host, self.upstream_port = upstream_host, upstream_port
        self.listen_addr = listen_addr
        self.port = listen_port or free_port()
        self.pool_mode, self.pool_size, self.max_client_conn = pool_mode, pool_size, max_client_conn
        self.prefix = prefix
        self.dir = Path(tempfile.mkdtemp(prefix="fleetless-pgbouncer-"))
        self.proc: subprocess.Popen[bytes] | None = None

    def dsn(self, dbname: str, user: str = "postgres") -> str:
        return f"postgresql://{user}@{self.listen_addr}:{self.port}/{dbname}"

    @property
    def log(self) -> str:
        path = self.dir / "pgbouncer.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def _write_config(self) -> Path:
        (self.dir / "users.txt").write_text('"postgres" ""\n')
        ini = self.dir / "pgbouncer.ini"
        ini.write_text(
            "[databases]\n"
            f"* = host={self.upstream_host} port={self.upstream_port}\n"
            "[pgbouncer]\n"
            f"listen_addr = {self.listen_addr}\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = trust\n"
            f"auth_file = {self.dir / 'users.txt'}\n"
            f"pool_mode = {self.pool_mode}\n"
            f"default_pool_size = {self.pool_size}\n"
            f"max_client_conn = {self.max_client_conn}\n"
            "admin_users = postgres\n"
            f"logfile = {self.dir / 'pgbouncer.log'}\n"
        )
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            for path in (self.dir, *self.dir.iterdir()):
                os.chown(path, pw.pw_uid, pw.pw_gid)
        return ini

    def start(self, timeout: float = 30) -> PgBouncer:
        ini = self._write_config()
        as_user: tuple[str, ...] = ()
        if os.geteuid() == 0:  # after the prefix (entering a namespace needs root), drop to postgres
            as_user = ("setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups", "--pdeathsig=KILL")
        self.proc = subprocess.Popen([*self.prefix, *as_user, PGBOUNCER, str(ini)],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pgbouncer exited with {self.proc.returncode}:\n{self.log[-2000:]}")
            # From where the clients are (the prefix's namespace): pg_isready answers through it.
            probe = subprocess.run([*self.prefix, "pg_isready", "-q", "-h", self.listen_addr, "-p", str(self.port),
                                    "-U", "postgres", "-d", "postgres", "-t", "2"], stdin=subprocess.DEVNULL)
            if probe.returncode == 0:
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"pgbouncer did not accept connections in {timeout} s:\n{self.log[-2000:]}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> PgBouncer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
