"""Real ``fleetless drain`` runs for the security tests, as root or as an unprivileged user (65534),
in directories that user can reach, and the checks they share.

Every directory here is made by the test (under the system temporary directory, mode 0755 so that
an unprivileged drainer can reach it) and removed afterwards; nothing else on the host is touched.
"""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import fleetless
from fleetless.sandbox import SandboxUnavailable, get_backend

SRC = str(Path(fleetless.__file__).resolve().parent.parent)
_FOR_OTHERS: list[str] = []


def _others_reach(path: str) -> bool:
    """Whether a user who is neither the owner nor in the group may enter ``path`` and all above it."""
    p = Path(path)
    for folder in (p, *p.parents):
        try:
            if not folder.stat().st_mode & 0o001:
                return False
        except OSError:
            return False
    return True


def pythonpath_for_others() -> list[str]:
    """The source tree and this venv's site-packages as another user (a drainer as 65534 or
    fleetless-ci) can import them: where they are, if every user may reach them; else a copy,
    made once per test session in a temporary directory every user may read (a checkout under
    /root, mode 0700: the suite must pass from there too) and removed at its end."""
    site = [p for p in sys.path if p.endswith("site-packages")]
    if all(_others_reach(p) for p in (SRC, *site)):
        return [SRC, *site]
    if not _FOR_OTHERS:
        import atexit
        import shutil

        copy = Path(tempfile.mkdtemp(prefix="fleetless-src-", dir="/tmp"))
        atexit.register(shutil.rmtree, copy, True)
        subprocess.run(["cp", "-a", SRC, str(copy / "src")], check=True)
        for i, path in enumerate(site):
            subprocess.run(["cp", "-a", path, str(copy / f"site-{i}")], check=True)
        subprocess.run(["chmod", "-R", "a+rX", str(copy)], check=True)
        copy.chmod(0o755)
        _FOR_OTHERS.extend([str(copy / "src"), *(str(copy / f"site-{i}") for i in range(len(site)))])
    return list(_FOR_OTHERS)

NOBODY = 65534
AS_ROOT_AND_NOT = [pytest.param(None, id="root-drainer"), pytest.param(NOBODY, id="nonroot-drainer")]


def primary_gid(user: int) -> int:
    """The user's group in /etc/passwd (its own number for one without an entry, as 65534 is)."""
    try:
        return pwd.getpwuid(user).pw_gid
    except KeyError:
        return user


def need_tier(tier: str) -> None:
    """Skip where the tier cannot run, unless FLEETLESS_REQUIRE_TIERS names it (as CI does)."""
    try:
        get_backend(tier).check()
    except SandboxUnavailable as exc:
        if tier in os.environ.get("FLEETLESS_REQUIRE_TIERS", "").split(","):
            pytest.fail(f"sandbox tier {tier} is required here but unavailable: {exc}")
        pytest.skip(f"sandbox tier {tier} unavailable: {exc}")


def need_user(user: int | None) -> None:
    if user is not None and os.getuid() != 0:
        pytest.skip("needs root to start a drainer as another user")
    if user is None and os.getuid() != 0:
        pytest.skip("the root-drainer case needs root")


@pytest.fixture
def shared() -> Iterator[Path]:
    """A fresh directory every user can traverse (handlers, work directory, logs go inside)."""
    path = Path(tempfile.mkdtemp(prefix="fleetless-sec-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", str(path)], check=False)


def handlers_dir(base: Path, **files: str) -> Path:
    """``name=source``: ``.py`` files are Python handlers, others executables."""
    folder = base / "handlers"
    folder.mkdir(mode=0o755, exist_ok=True)
    folder.chmod(0o755)
    for name, source in files.items():
        path = folder / name
        path.write_text(textwrap.dedent(source).lstrip())
        path.chmod(0o644 if name.endswith(".py") else 0o755)
    return folder


def work_dir(base: Path, user: int | None) -> Path:
    """The drain's FLEETLESS_WORKDIR, owned by the user the drainer runs as."""
    work = base / "work"
    work.mkdir(mode=0o711, exist_ok=True)
    if user is not None:
        os.chown(work, user, primary_gid(user))
    return work


def drain(dsn: str, handlers: Path, work: Path, *args: str, tier: str = "process", user: int | None = None,
          timeout: float = 180, start: bool = False, env: dict[str, str] | None = None,
          ) -> subprocess.CompletedProcess[str] | subprocess.Popen[str]:
    """Run ``fleetless drain`` as a user would (as ``user`` when given); ``start=True`` returns the
    running process (its own process group, so that a test can signal the group as a terminal
    or systemd would) instead of waiting for it."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "DATABASE_URL": dsn,
           "FLEETLESS_WORKDIR": str(work), **(env or {})}
    python = sys.executable
    path = [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
    if user is not None:  # this interpreter may live where that user cannot go (a pyenv under /root)
        python = "/usr/bin/python3"
        path += pythonpath_for_others()
    if path:
        env["PYTHONPATH"] = ":".join(path)
    argv = [python, "-m", "fleetless.cli", "drain", "--handlers", str(handlers), "--sandbox", tier, *args]
    creds: dict[str, object] = {} if user is None else {"user": user, "group": primary_gid(user), "extra_groups": []}
    if start:
        return subprocess.Popen(argv, env=env, text=True, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, process_group=0, cwd=str(work.parent),
                                **creds)  # type: ignore[call-overload]
    return subprocess.run(argv, env=env, text=True, capture_output=True, timeout=timeout,  # type: ignore[call-overload]
                          cwd=str(work.parent), **creds)


def open_to_jobs(folder: Path) -> Path:
    """A directory every job (each under a uid of its own) can create files in."""
    folder.mkdir(exist_ok=True)
    folder.chmod(0o1777)
    return folder


