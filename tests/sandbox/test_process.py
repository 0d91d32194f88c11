"""What only the process tier does. What every tier promises (results, limits, kills, the
environment, the workspace's end) is tested once for all tiers in ``test_contract.py``."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from fleetless.sandbox import Template, get_backend


@pytest.fixture
def hdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FLEETLESS_WORKDIR", str(tmp_path / "work"))
    d = tmp_path / "handlers"
    d.mkdir()
    return d


def script(hdir: Path, name: str, source: str) -> str:
    (hdir / name).write_text(textwrap.dedent(source))
    return name


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


def test_a_write_after_kill_is_refused_and_makes_no_workspace_again(hdir: Path) -> None:
    """The drainer's stop destroys sandboxes from another thread, possibly between a sandbox's
    creation and its payload's write: the write must not bring the workspace back (the exec after
    it then runs nothing: test_contract's test_an_exec_after_kill_runs_nothing_and_says_why)."""
    sbx = get_backend("process").create(Template(handlers_dir=hdir), 60)
    sbx.kill()
    with pytest.raises(RuntimeError, match="sandbox already destroyed"):
        sbx.write("payload.json", "{}")
    assert not os.path.exists(sbx.workspace_path)


def test_the_supervisor_removes_a_workspace_with_the_drainers_own_remover(tmp_path: Path) -> None:
    """The supervisor, a small program started by path, loads ``sandbox/_workspace.py`` by path
    when it dies with its drainer; it must find it wherever the tier's package puts it (else the
    workspace is left to the next drain's sweep)."""
    import importlib.util

    from fleetless.sandbox import process

    spec = importlib.util.spec_from_file_location("_fleetless_supervisor", process._SUPERVISOR)
    assert spec is not None and spec.loader is not None
    supervisor = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(supervisor)
    workspace = tmp_path / "ws"
    (workspace / "deep").mkdir(parents=True)
    (workspace / "deep" / "file").write_text("x")
    supervisor._remove_workspace(str(workspace))
    assert not workspace.exists()


SECCOMP = "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('Seccomp:')][0])"


def test_jobs_get_the_seccomp_filter_and_where_it_cannot_be_built_doctor_and_the_caps_line_say_so(
        hdir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A job runs under bwrap's seccomp filter (mode 2), also uncontained
    (``FLEETLESS_PROCESS_CONTAIN=0``); where pyseccomp or libseccomp is missing it runs without one
    (mode 0), and ``doctor``'s line for the tier and the drain's caps line (a warning) say so and why.
    The drainer users' cases: tests/security/test_process_seccomp.py."""
    import logging

    from fleetless import cli
    from fleetless.sandbox import Limits, process

    script(hdir, "seccomp.py", SECCOMP)
    backend = get_backend("process")
    assert process.unfiltered() is None, process.unfiltered()
    assert "seccomp deny-list" in backend.describe()
    for contain in ("1", "0"):
        monkeypatch.setenv(process.CONTAIN_ENV, contain)
        with backend.create(Template(handlers_dir=hdir), 30) as sbx:
            r = sbx.exec([sbx.python, f"{sbx.handlers_path}/seccomp.py"], 30)
        assert (r.exit_code, r.stdout) == (0, "2\n"), (contain, r)
    monkeypatch.setattr(process, "_unfiltered", ["cannot build the seccomp filter (pyseccomp, libseccomp2): gone"])
    assert "jobs run with NO seccomp filter: cannot build the seccomp filter" in backend.describe()
    with backend.create(Template(handlers_dir=hdir), 30) as sbx:
        r = sbx.exec([sbx.python, f"{sbx.handlers_path}/seccomp.py"], 30)
    assert (r.exit_code, r.stdout) == (0, "0\n"), r
    with caplog.at_level(logging.INFO, logger="fleetless.cli"):
        cli._log_caps("process", Limits())
    said = [r for r in caplog.records if r.name == "fleetless.cli"]
    assert said[0].getMessage().startswith("caps (process) of each job, in short"), said[0].getMessage()
    assert all(r.levelno == logging.WARNING for r in said)
    assert said[-1].getMessage() == ("  jobs run with NO seccomp filter: cannot build the seccomp filter "
                                     "(pyseccomp, libseccomp2): gone"), said[-1].getMessage()


def test_a_filter_the_kernel_refuses_fails_the_job_which_never_runs_unfiltered(
        hdir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A filter that was built but does not load (here: one BPF instruction and no return, which
    the kernel rejects) fails the job as an exec failure: it does not run without its filter."""
    from fleetless.sandbox.bwrap import _seccomp

    bogus = tmp_path / "bogus.bpf"
    bogus.write_bytes(bytes(8))
    monkeypatch.setattr(_seccomp, "seccomp_file", lambda: bogus)
    script(hdir, "seccomp.py", SECCOMP)
    with get_backend("process").create(Template(handlers_dir=hdir), 30) as sbx:
        r = sbx.exec([sbx.python, f"{sbx.handlers_path}/seccomp.py"], 30)
    assert r.exit_code == 127 and r.stdout == "", r
    assert "cannot load the seccomp filter: Invalid argument" in r.stderr, r.stderr
