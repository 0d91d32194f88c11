"""Before claiming, a drain checks that each handler's interpreter (the ``#!`` line's, or the
``.py`` handlers' python) exists where its jobs would run. A kind that cannot run is not claimed,
is named in one line, and spends no attempt; the microVM guest can be given what it lacks."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest
from security.drains import pythonpath_for_others

import fleetless
from fleetless import Queue
from fleetless.drainer import DrainConfig, Drainer
from fleetless.sandbox import jobs_cannot_reach

pytestmark = pytest.mark.usefixtures("private_workdir")


def drain(queue: Queue, handlers_dir: Path, **options: object) -> Drainer:
    options.setdefault("concurrency", 2)
    drainer = Drainer(queue, DrainConfig(handlers_dir=handlers_dir, **options))  # type: ignore[arg-type]
    drainer.run()
    return drainer


@pytest.mark.parametrize("tier", ["process", "bwrap"])
def test_a_kind_whose_interpreter_is_missing_is_not_claimed_and_spends_no_attempt(
        tier: str, queue: Queue, handlers, sql, require_tier, caplog: pytest.LogCaptureFixture) -> None:
    require_tier(tier)
    h = handlers(**{
        "ok.py": "print('fine')",
        "nobash": "#!/opt/nowhere/bash\necho never\n",
        "noenv": "#!/usr/bin/env no-such-interpreter-here\nprint('never')\n",
        "notascript": "echo no shebang line\n",
        "sh": "#!/bin/sh\necho shell\n",
        "envsh": "#!/usr/bin/env sh\necho env-shell\n",
    })
    ids = {kind: queue.enqueue(kind, {}, max_attempts=1)
           for kind in ("ok", "nobash", "noenv", "notascript", "sh", "envsh")}
    with caplog.at_level(logging.WARNING, logger="fleetless.drainer"):
        drainer = drain(queue, h, sandbox=tier)
    rows = {kind: sql("SELECT status, attempts, last_error FROM fleetless.jobs WHERE id = %s", i)[0]
            for kind, i in ids.items()}
    for kind in ("ok", "sh", "envsh"):
        assert rows[kind][:2] == ("done", 1), (kind, rows[kind])
    for kind in ("nobash", "noenv", "notascript"):
        assert rows[kind] == ("pending", 0, None), (kind, rows[kind])
    assert drainer.summary.claimed == 3
    lines = {r.getMessage() for r in caplog.records if r.getMessage().startswith("not claiming")}
    assert any(line.startswith("not claiming kind 'nobash': its interpreter /opt/nowhere/bash "
                               f"(#!/opt/nowhere/bash) does not exist in the {tier} sandbox") for line in lines), lines
    assert any(line.startswith("not claiming kind 'noenv': its interpreter no-such-interpreter-here "
                               "(#!/usr/bin/env no-such-interpreter-here) is not on PATH ") for line in lines), lines
    assert "not claiming kind 'notascript': notascript has no #! line and is not a program" in lines
    assert len(lines) == 3


def test_the_cli_names_each_kind_it_does_not_claim_in_one_line(dsn: str, queue: Queue, handlers, fleetless,
                                                               sql) -> None:
    h = handlers(**{"nobash": "#!/opt/nowhere/bash\necho never\n"})
    queue.enqueue("nobash", {}, max_attempts=1)
    r = fleetless("drain", "--handlers", str(h), dsn=dsn)
    assert r.returncode == 0, r.stderr
    assert [line for line in r.stderr.splitlines() if "nobash" in line] == [
        "fleetless: not claiming kind 'nobash': its interpreter /opt/nowhere/bash (#!/opt/nowhere/bash) "
        "does not exist in the process sandbox"]
    assert "claimed 0" in r.stdout
    assert sql("SELECT status, attempts FROM fleetless.jobs") == [("pending", 0)]


def _wheel(folder: Path) -> Path:
    """A pure-Python wheel of an "app" package, made here (no index is asked)."""
    files = {
        "invoicing/__init__.py": "def total(lines):\n    return sum(lines)\n",
        "invoicing-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: invoicing\nVersion: 1.0\n",
        "invoicing-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                         "Tag: py3-none-any\n",
    }
    path = folder / "invoicing-1.0-py3-none-any.whl"
    record = []
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
            digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
            record.append(f"{name},sha256={digest},{len(text)}")
        record.append("invoicing-1.0.dist-info/RECORD,,")
        z.writestr("invoicing-1.0.dist-info/RECORD", "\n".join(record) + "\n")
    return path


def _bash_deb(folder: Path) -> Path:
    """A Debian package holding this host's /bin/bash, made here (no mirror is asked)."""
    root = folder / "deb"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "bin").mkdir()
    shutil.copy2(shutil.which("bash") or "/bin/bash", root / "bin" / "bash")
    (root / "DEBIAN" / "control").write_text(
        "Package: test-bash\nVersion: 1.0\nArchitecture: amd64\nMaintainer: t <t@example.org>\nDescription: t\n")
    subprocess.run(["chmod", "-R", "go-w", str(root)], check=True)  # dpkg-deb refuses a 0777 DEBIAN (tmp ACL)
    out = folder / "test-bash.deb"
    subprocess.run(["dpkg-deb", "-b", str(root), str(out)], check=True, capture_output=True)
    return out


def test_microvm_does_not_claim_bash_or_a_host_venv_python_until_the_image_has_them(
        queue: Queue, handlers, sql, require_tier, caplog: pytest.LogCaptureFixture) -> None:
    """The default guest has busybox's sh and the standard library only: a #!/bin/bash handler,
    and .py handlers under --python of the host's venv, are not claimed (one line each, naming
    build-image); nothing boots, nothing is charged."""
    require_tier("microvm")
    h = handlers(**{"script": "#!/bin/bash\necho ${BASH_VERSINFO[0]}\n", "app.py": "print(1)"})
    script = queue.enqueue("script", {}, max_attempts=1)
    app = queue.enqueue("app", {}, max_attempts=1)
    with caplog.at_level(logging.WARNING, logger="fleetless.drainer"):
        drainer = drain(queue, h, sandbox="microvm", python=sys.executable)
    assert drainer.summary.claimed == 0
    assert sql("SELECT id, status, attempts FROM fleetless.jobs ORDER BY id") == [
        (script, "pending", 0), (app, "pending", 0)]
    lines = sorted(r.getMessage() for r in caplog.records if r.getMessage().startswith("not claiming"))
    assert lines == [
        f"not claiming kind 'app': its interpreter {sys.executable} (for .py handlers) does not exist in the "
        "microvm sandbox (add it to the guest: fleetless microvm build-image --apt PACKAGE or --pip REQUIREMENT)",
        "not claiming kind 'script': its interpreter /bin/bash (#!/bin/bash) does not exist in the microvm "
        "sandbox (add it to the guest: fleetless microvm build-image --apt PACKAGE or --pip REQUIREMENT)",
    ]


def test_build_image_adds_debian_packages_and_python_requirements_to_the_guest(
        dsn: str, queue: Queue, handlers, sql, require_tier, fleetless, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    """`fleetless microvm build-image --apt ... --pip ...` makes an image of its own (the default
    one is untouched); drains with it run a #!/bin/bash handler and a .py handler importing the
    app's package."""
    require_tier("microvm")
    from fleetless.sandbox.microvm.image import default_cache_dir, load_image

    default_before = load_image().manifest["initramfs_sha256"]
    deb, wheel = _bash_deb(tmp_path), _wheel(tmp_path)
    built = fleetless("microvm", "build-image", "--apt", str(deb), "--pip", str(wheel),
                      env={"PIP_NO_INDEX": "1"}, timeout=600)
    assert built.returncode == 0, built.stderr
    image_dir = Path(built.stdout.split("microvm image ready: ", 1)[1].split()[0])
    assert image_dir.parent == default_cache_dir() and image_dir.name.startswith("extras-")
    request.addfinalizer(lambda: shutil.rmtree(image_dir, ignore_errors=True))  # ~70 MB, keyed on tmp paths
    assert f"FLEETLESS_CACHE={image_dir} fleetless drain --sandbox microvm" in built.stdout
    assert load_image().manifest["initramfs_sha256"] == default_before
    h = handlers(**{"script": "#!/bin/bash\necho \"bash ${BASH_VERSINFO[0]}\"\n",
                    "bill.py": "import invoicing, json, sys\n"
                               "print(invoicing.total(json.load(open(sys.argv[1]))['lines']))\n"})
    script = queue.enqueue("script", {}, max_attempts=1)
    bill = queue.enqueue("bill", {"lines": [1, 2, 39]}, max_attempts=1)
    monkeypatch.setenv("FLEETLESS_CACHE", str(image_dir))
    drain(queue, h, sandbox="microvm", timeout=120, ttl=300)
    rows = dict((i, (s, r)) for i, s, r in sql("SELECT id, status, coalesce(result, last_error) FROM fleetless.jobs"))
    assert rows[script] == ("done", f"bash {subprocess.run(['bash', '-c', 'echo ${BASH_VERSINFO[0]}'], capture_output=True, text=True).stdout}"), rows  # noqa: E501
    assert rows[bill] == ("done", "42\n"), rows


def test_build_image_answers_json(require_tier, fleetless) -> None:
    """`--json` on build-image too (issue 10: every command that reports): the default image
    (built, or found cached) and its snapshots, as paths, and no environment to drain with it."""
    require_tier("microvm")
    from fleetless.sandbox.microvm_image import default_cache_dir

    r = fleetless("microvm", "build-image", "--json", timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert Path(out["image"]) == default_cache_dir() and out["drain_env"] == {}
    assert out["snapshots"] and all(Path(s).parent.parent == default_cache_dir() for s in out["snapshots"]), out


def _app_venv(base: Path) -> Path:
    """A virtual environment every user can reach (made from the system python3), holding an app
    package of its own in its site-packages; returns its python."""
    venv = base / "venv"
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True)
    (site,) = (venv / "lib").glob("python3*/site-packages")
    (site / "invoicing").mkdir()
    (site / "invoicing" / "__init__.py").write_text("def total(lines):\n    return sum(lines)\n")
    subprocess.run(["chmod", "-R", "a+rX", str(base)], check=True)
    return venv / "bin" / "python"


def _drain_under(python: Path | str, dsn: str, handlers_dir: Path, work: Path, tier: str,
                 extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`fleetless drain` run by ``python`` (fleetless and its dependencies found through PYTHONPATH,
    which no job inherits)."""
    src = str(Path(fleetless.__file__).resolve().parent.parent)
    path = [src, *(p for p in sys.path if p.endswith("site-packages"))]
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "DATABASE_URL": dsn,
           "FLEETLESS_WORKDIR": str(work), "PYTHONPATH": ":".join(path), **(extra_env or {})}
    return subprocess.run([str(python), "-m", "fleetless.cli", "drain", "--handlers", str(handlers_dir),
                           "--sandbox", tier], env=env, text=True, capture_output=True, timeout=300)


@pytest.mark.parametrize("tier", ["process", "bwrap", "forkserver"])
def test_py_handlers_run_under_the_apps_interpreter_and_import_its_packages(
        tier: str, dsn: str, queue: Queue, sql, require_tier, tmp_path: Path) -> None:
    """With no --python, .py handlers run under the interpreter fleetless runs under (the app's
    virtual environment) and import the app's packages from it; bwrap binds it read-only. Under
    a root drainer the jobs' unprivileged uids reach it (it is where they can). The venv is under
    the tmp dir: the fork server's jobs, each with a /tmp of its own, still see it (issue 25, item 1)."""
    require_tier(tier)
    base = Path(tempfile.mkdtemp(prefix="fleetless-venv-"))
    try:
        base.chmod(0o755)
        python = _app_venv(base)
        h = base / "handlers"
        h.mkdir(mode=0o755)
        (h / "bill.py").write_text("import invoicing, json, sys\n"
                                   "print(sys.executable, invoicing.total(json.load(open(sys.argv[1]))['lines']))\n")
        (h / "bill.py").chmod(0o644)
        job = queue.enqueue("bill", {"lines": [1, 2, 39]}, max_attempts=1)
        work = base / "work"
        work.mkdir(mode=0o711)
        r = _drain_under(python, dsn, h, work, tier)
        assert r.returncode == 0, r.stderr
        (status, result, error), = sql("SELECT status, result, last_error FROM fleetless.jobs WHERE id = %s", job)
        assert (status, error, result) == ("done", None, f"{python} 42\n")
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", str(base)], check=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="the unprivileged job uids exist under a root drainer only")
def test_a_root_drainer_whose_interpreter_jobs_cannot_reach_says_so_and_uses_the_system_python(
        dsn: str, queue: Queue, sql, tmp_path: Path) -> None:
    """fleetless under a Python only root can reach (here: a pyenv under /root, if that is where
    this test runs), on a process tier that cannot bind it back (no namespaces: here turned off
    with FLEETLESS_PROCESS_CONTAIN=0): one line says .py handlers run under /usr/bin/python3
    instead, and why; jobs run (not charged for a missing interpreter)."""
    if jobs_cannot_reach(sys.executable) is None:
        pytest.skip(f"{sys.executable} is reachable by other users here")
    base = Path(tempfile.mkdtemp(prefix="fleetless-venv-"))
    try:
        base.chmod(0o755)
        h = base / "handlers"
        h.mkdir(mode=0o755)
        (h / "which.py").write_text("import sys; print(sys.executable)\n")
        (h / "which.py").chmod(0o644)
        job = queue.enqueue("which", {}, max_attempts=1)
        work = base / "work"
        work.mkdir(mode=0o711)
        r = _drain_under(sys.executable, dsn, h, work, "process", {"FLEETLESS_PROCESS_CONTAIN": "0"})
        assert r.returncode == 0, r.stderr
        notes = [line for line in r.stderr.splitlines() if "handlers run under /usr/bin/python3" in line]
        assert len(notes) == 1 and f"not {sys.executable} (fleetless's own)" in notes[0], r.stderr
        assert sql("SELECT status, result FROM fleetless.jobs WHERE id = %s", job) == [("done", "/usr/bin/python3\n")]
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", str(base)], check=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="makes files of another owner and drains as another user")
@pytest.mark.parametrize("user", [None, 65534], ids=["root-drainer", "nonroot-drainer"])
@pytest.mark.parametrize("tier", ["process", "bwrap"])
def test_an_interpreter_the_jobs_uid_cannot_execute_is_not_claimed_and_spends_no_attempt(
        tier: str, user: int | None, dsn: str, queue: Queue, sql, require_tier) -> None:
    """An interpreter that exists but that the job's uid may not execute (root's, mode 0700: a root
    drainer's jobs are unprivileged uids, a non-root drainer's its own uid): its kinds are not
    claimed, one line each naming the kind and the interpreter; nothing is charged. Before, a root
    drainer (whose own access check passes) claimed them and every job failed with exit code 127."""
    require_tier(tier)
    base = Path(tempfile.mkdtemp(prefix="fleetless-noexec-"))
    try:
        base.chmod(0o755)
        (base / "bin").mkdir(mode=0o755)
        python, sh = base / "bin" / "python3", base / "bin" / "sh"
        shutil.copy2(os.path.realpath("/usr/bin/python3"), python)
        shutil.copy2(os.path.realpath("/bin/sh"), sh)
        python.chmod(0o700)
        sh.chmod(0o700)
        h = base / "handlers"
        h.mkdir(mode=0o755)
        (h / "viapy.py").write_text("print('never')\n")
        (h / "viash").write_text(f"#!{sh}\necho never\n")
        (h / "fine").write_text("#!/bin/sh\necho fine\n")
        for f, mode in (("viapy.py", 0o644), ("viash", 0o755), ("fine", 0o755)):
            (h / f).chmod(mode)
        ids = {kind: queue.enqueue(kind, {}, max_attempts=1) for kind in ("viapy", "viash", "fine")}
        work = base / "work"
        work.mkdir(mode=0o711)
        if user is not None:
            os.chown(work, user, user)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "DATABASE_URL": dsn,
               "FLEETLESS_WORKDIR": str(work), "PYTHONPATH": ":".join(
                   pythonpath_for_others() if user is not None else
                   [str(Path(fleetless.__file__).resolve().parent.parent),
                    *(p for p in sys.path if p.endswith("site-packages"))])}
        creds: dict[str, object] = {} if user is None else {"user": user, "group": user, "extra_groups": []}
        kinds_toml = h / "fleetless.toml"  # .py handlers of kind viapy run under the 0700 copy
        kinds_toml.write_text(f'[kinds.viapy]\ninterpreter = "{python}"\n')
        kinds_toml.chmod(0o644)
        r = subprocess.run(["/usr/bin/python3", "-m", "fleetless.cli", "drain", "--handlers", str(h),
                            "--sandbox", tier], env=env, text=True, capture_output=True, timeout=300,
                           cwd=str(base), **creds)  # type: ignore[call-overload]
        assert r.returncode == 0, r.stderr
        rows = {kind: sql("SELECT status, attempts FROM fleetless.jobs WHERE id = %s", i)[0] for kind, i in ids.items()}
        assert rows == {"viapy": ("pending", 0), "viash": ("pending", 0), "fine": ("done", 1)}, (rows, r.stderr)
        lines = [line for line in r.stderr.splitlines() if "not claiming" in line]
        assert sorted(lines) == sorted([
            f"fleetless: not claiming kind 'viapy': its interpreter {python} (for .py handlers) exists but the "
            f"job's uid cannot execute it (mode 0700, owner uid 0)",
            f"fleetless: not claiming kind 'viash': its interpreter {sh} (#!{sh}) exists but the job's uid "
            f"cannot execute it (mode 0700, owner uid 0)"]), r.stderr
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", str(base)], check=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="the unprivileged job uids exist under a root drainer only")
@pytest.mark.parametrize("tier", ["process", "bwrap", "forkserver"])
def test_a_root_drainers_own_venv_under_a_root_only_directory_is_the_handlers_interpreter(
        tier: str, dsn: str, queue: Queue, sql, require_tier) -> None:
    """fleetless run by root from a virtual environment inside a directory only root may search
    (as a venv in /root, mode 0700): jobs, which run as unprivileged uids, still run under it and
    import the app's packages from it (bwrap: each launcher binds it back in a mount namespace of its
    own; process: the job's own mount namespace does), and see nothing else of that directory.
    Before, .py handlers ran under /usr/bin/python3."""
    require_tier(tier)
    # 0700, like /root; not under /tmp, which every job has a private one of (the fork server's
    # job mounts its /tmp over the server's root, hiding an interpreter bound below /tmp)
    private = Path(tempfile.mkdtemp(prefix="fleetless-rootonly-", dir="/var/tmp"))
    outside = Path(tempfile.mkdtemp(prefix="fleetless-venv-"))
    try:
        assert private.stat().st_mode & 0o777 == 0o700
        python = _app_venv(private)  # (makes its venv a+rX: what matters is the 0700 directory above)
        private.chmod(0o700)
        (private / "secret").write_text("root's own\n")
        outside.chmod(0o755)
        h = outside / "handlers"
        h.mkdir(mode=0o755)
        (h / "bill.py").write_text(
            "import invoicing, json, os, sys\n"
            "try:\n    seen = sorted(os.listdir(os.path.dirname(sys.prefix)))\n"
            "except OSError as exc:\n    seen = type(exc).__name__\n"
            "print(sys.executable, invoicing.total(json.load(open(sys.argv[1]))['lines']), seen, os.getuid())\n")
        (h / "bill.py").chmod(0o644)
        job = queue.enqueue("bill", {"lines": [1, 2, 39]}, max_attempts=1)
        work = outside / "work"
        work.mkdir(mode=0o711)
        r = _drain_under(python, dsn, h, work, tier)
        assert r.returncode == 0, r.stderr
        assert "handlers run under /usr/bin/python3" not in r.stderr
        (status, result, error), = sql("SELECT status, result, last_error FROM fleetless.jobs WHERE id = %s", job)
        assert (status, error) == ("done", None), result
        executable, total, seen, uid = result.split()
        assert (executable, total, seen) == (str(python), "42", "['venv']"), result
        assert int(uid) != 0 and (tier in ("process", "forkserver") or int(uid) == 65534), result
    finally:
        for folder in (private, outside):
            subprocess.run(["rm", "-rf", "--one-file-system", str(folder)], check=False)


def test_doctor_with_handlers_says_per_tier_which_kinds_a_drain_would_not_claim(fleetless, tmp_path: Path) -> None:
    """``fleetless doctor --handlers DIR``: for each tier that works here, each kind runs or is named
    with why a drain there would refuse it before claiming (a kind's ``interpreter`` included)."""
    h = tmp_path / "kinds"
    h.mkdir(mode=0o755)
    (h / "ok.py").write_text("print(1)\n")
    (h / "bad.py").write_text("print(2)\n")
    (h / "fleetless.toml").write_text('[kinds.bad]\ninterpreter = "/nonexistent/python3"\n'
                                      '[kinds.ok]\nbatch_isolation = "shared"\n')
    for f in h.iterdir():
        f.chmod(0o644)
    r = fleetless("doctor", "--json", "--handlers", str(h), timeout=600)
    assert r.returncode == 0, r.stderr
    tiers = [t for t in json.loads(r.stdout)["tiers"] if t["ok"]]
    assert tiers
    assert json.loads(r.stdout)["shared_kinds"] == ["ok"]  # batch_isolation = "shared" (issue 27)
    for t in tiers:
        assert t["kinds"]["ok"] is None, t
        assert "/nonexistent/python3" in t["kinds"]["bad"], t


def test_the_imports_asked_of_a_fallback_interpreter_are_the_apps_packages_only(tmp_path: Path) -> None:
    """What a drain asks of the interpreter a tier fell back to (issue 28): the handler's absolute
    imports that the drainer's interpreter finds; not the standard library, not a module beside the
    handler, not ``fleetless`` (the batch runner serves ``fleetless.outcomes``), not a relative one."""
    from fleetless import handler_imports

    if not os.path.exists("/usr/bin/python3"):
        pytest.skip("no /usr/bin/python3")
    (tmp_path / "helper.py").write_text("X = 1\n")
    handler = tmp_path / "job.py"
    handler.write_text("import json, os.path\nimport helper\nfrom fleetless.outcomes import Snooze\n"
                       "def handle(payload):\n    import psycopg\n    from cronsim import CronSim\n"
                       "    import no_such_package_anywhere\n    return 1\n")
    assert handler_imports.missing(handler, "/usr/bin/python3") == ["cronsim", "psycopg"]
    assert handler_imports.missing(handler, sys.executable) == []
