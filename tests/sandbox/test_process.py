"""The process tier: supervised tree, scrubbed environment, rlimits, workspace lifecycle."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fleetless.sandbox import Limits, Template, get_backend
from fleetless.sandbox.process import ProcessSandbox

MiB = 1024 * 1024


@pytest.fixture
def hdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FLEETLESS_WORKDIR", str(tmp_path / "work"))
    d = tmp_path / "handlers"
    d.mkdir()
    return d


def script(hdir: Path, name: str, source: str) -> str:
    (hdir / name).write_text(textwrap.dedent(source))
    return name


def run(hdir: Path, source: str, *, timeout: float = 10, ttl: float = 60, limits: Limits | None = None,
        env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    name = script(hdir, "job.py", source)
    template = Template(handlers_dir=hdir, limits=limits or Limits(), env=env or {"PATH": "/usr/bin:/bin"})
    with get_backend("process").create(template, ttl) as sbx:
        sbx.write("payload.json", '{"n": 1}')
        return sbx.exec([sbx.python, f"{sbx.handlers_path}/{name}", f"{sbx.workspace_path}/payload.json"],
                        timeout), sbx.workspace_path


def test_payload_in_stdout_out_exit_code_and_stderr(hdir: Path) -> None:
    r, ws = run(hdir, """
        import json, sys
        print(json.load(open(sys.argv[1]))["n"] + 1)
        sys.stderr.write("warn\\n")
        sys.exit(4)
    """)
    assert (r.exit_code, r.stdout, r.stderr, r.killed, r.ok) == (4, "2\n", "warn\n", None, False)
    assert not os.path.exists(ws)


def test_only_the_template_environment_reaches_the_job(hdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATABASE_URL", "postgresql://secret")
    env = {"PATH": "/usr/bin", "LANG": "C.UTF-8", "ONLY": "1"}
    r, ws = run(hdir, "import os; print(sorted(os.environ.items()))", env=env)
    assert r.stdout.strip() == str(sorted({**env, "HOME": ws}.items()))


def test_address_space_limit_stops_a_memory_bomb(hdir: Path) -> None:
    r, _ = run(hdir, "x = bytearray(4 * 1024**3)", limits=Limits(memory_bytes=256 * MiB))
    assert r.exit_code == 1 and "MemoryError" in r.stderr


def test_cpu_seconds_limit_is_named(hdir: Path) -> None:
    r, _ = run(hdir, "while True: pass", timeout=30, limits=Limits(cpu_seconds=1))
    assert r.killed == "killed: cpu time limit 1 s exceeded"


def test_file_size_limit_is_named(hdir: Path) -> None:
    r, _ = run(hdir, "open('big', 'wb').write(b'x' * (4 * 1024 * 1024))", limits=Limits(file_size_bytes=MiB))
    assert r.exit_code == 1 and "File too large" in r.stderr  # Python ignores SIGXFSZ
    template = Template(handlers_dir=hdir, limits=Limits(file_size_bytes=MiB))
    with get_backend("process").create(template, 10) as sbx:
        r = sbx.exec(["/bin/sh", "-c", "exec head -c 4000000 /dev/zero > big"], 10)
    assert r.killed == "killed: file size limit 1 MiB exceeded"


def test_ttl_bounds_the_exec_when_shorter_than_the_timeout(hdir: Path) -> None:
    r, _ = run(hdir, "import time; time.sleep(60)", timeout=30, ttl=1)
    assert r.killed == "killed: ttl of 1 s expired"


def test_leftover_children_die_when_the_job_exits(hdir: Path, tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    r, _ = run(hdir, f"""
        import os, time
        if os.fork() == 0:
            os.setsid()
            open({str(pidfile)!r}, "w").write(str(os.getpid()))
            time.sleep(600)
        while not os.path.exists({str(pidfile)!r}):
            time.sleep(0.01)
    """)
    assert r.exit_code == 0
    pid = int(pidfile.read_text())
    time.sleep(0.1)
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split(") ")[1][0] == "Z"


def test_sandbox_dies_with_a_sigkilled_parent_and_sweep_removes_leftovers(hdir: Path, tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    script(hdir, "sleep.py", f"""
        import os, time
        open({str(pidfile)!r}, "w").write(str(os.getpid()))
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        from pathlib import Path
        from fleetless.sandbox import Template, get_backend
        sbx = get_backend("process").create(Template(handlers_dir=Path({str(hdir)!r})), 600)
        sbx.exec([sbx.python, sbx.handlers_path + "/sleep.py"], 600)
    """)], env=os.environ.copy())
    deadline = time.monotonic() + 20
    while not pidfile.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = int(pidfile.read_text())
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{pid}")
    ProcessSandbox.sweep()
    assert list((tmp_path / "work").iterdir()) == []


def test_write_refuses_paths_outside_the_workspace(hdir: Path) -> None:
    with get_backend("process").create(Template(handlers_dir=hdir), 10) as sbx, pytest.raises(ValueError):
        sbx.write("../escape", "x")


def test_unknown_backend_is_a_one_line_error() -> None:
    with pytest.raises(ValueError, match="unknown sandbox backend 'docker'"):
        get_backend("docker")


def test_handlers_are_a_read_only_snapshot_refreshed_when_they_change(hdir: Path) -> None:
    script(hdir, "job.py", "print('v1')")
    template = Template(handlers_dir=hdir)
    with get_backend("process").create(template, 10) as sbx:
        assert sbx.handlers_path != str(hdir)
        r = sbx.exec(["/bin/sh", "-c", f"echo hacked > {sbx.handlers_path}/job.py"], 10)
        assert r.exit_code != 0 or os.geteuid() == 0  # root ignores modes: see docs/isolation.md
        first = sbx.handlers_path
    assert (hdir / "job.py").read_text() == "print('v1')"  # the original is never the job's
    script(hdir, "job.py", "print('v2')")
    with get_backend("process").create(template, 10) as sbx:
        assert sbx.handlers_path != first
        r = sbx.exec([sbx.python, f"{sbx.handlers_path}/job.py"], 10)
    assert r.stdout == "v2\n"
    mode = os.stat(f"{sbx.handlers_path}/job.py").st_mode & 0o777
    assert mode == 0o444
