"""`fleetless demo`: on the embedded PostgreSQL when no database is given, and on a real one."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest


def test_demo_runs_on_the_embedded_server_as_the_readme_says(fleetless, tmp_path: Path) -> None:
    """`fleetless demo` with no database and no options: embedded PostgreSQL, the bwrap tier where
    it works (else process)."""
    from fleetless.sandbox import choose_tier

    r = fleetless("demo", env={"XDG_DATA_HOME": str(tmp_path / "data"), "FLEETLESS_SANDBOX": ""}, timeout=300)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "starting an embedded PostgreSQL" in out
    tier, note = choose_tier("auto")
    assert f"{note}\n" in out and note.startswith(f"sandbox: {tier} (auto: ")
    assert f"draining with the '{tier}' sandbox" in out
    assert "drained: claimed" in out
    assert "killed: timeout after 2 s" in out
    assert "upstream API answered 503" in out
    assert "Hello, user 0!" in out
    assert (tmp_path / "data" / "fleetless" / "pg" / "PG_VERSION").exists()


def test_demo_on_a_given_database_leaves_its_outcome_in_the_table(dsn: str, fleetless, sql) -> None:
    r = fleetless("demo", "--sandbox", "process", dsn=dsn, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = {kind: (status, attempts, error) for kind, status, attempts, error in sql(
        "SELECT kind, status, attempts, last_error FROM fleetless_demo.jobs WHERE status <> 'done'")}
    assert rows["flaky"][:2] == ("dead", 3)
    assert rows["slow"] == ("dead", 1, "killed: timeout after 2 s")
    # given back for 60 s, uncharged, as a real drain does (it was dead 1/3 at once: the demo taught
    # a default no drain has)
    assert rows["resize-image"][0:2] == ("pending", 0) and "no handler" in str(rows["resize-image"][2])
    assert "given back uncharged, due again in 60 s" in str(rows["resize-image"][2])
    (say,) = [line for line in r.stdout.splitlines() if "has no handler here" in line]
    assert "due again in 60 s" in say and "--no-handler-delay 0 makes it dead at once" in say
    assert "9 done, 2 dead, 1 given back in " in r.stdout
    assert sql("SELECT count(*) FROM fleetless_demo.jobs WHERE status = 'done'") == [(9,)]
    again = fleetless("demo", "--sandbox", "process", dsn=dsn, timeout=300)  # repeatable
    assert again.returncode == 0, again.stderr


def test_demo_rows_are_whole_and_its_handlers_stay_for_the_user_to_read(dsn: str, fleetless) -> None:
    """The "no handler" row names the whole directory (not cut mid-path), and the demo says where
    the handlers it ran are; they are still there afterwards."""
    r = fleetless("demo", "--sandbox", "process", dsn=dsn, timeout=300)
    assert r.returncode == 0, r.stderr
    m = re.search(r"The handlers that ran are in (\S+) \(([^)]*)\)", r.stdout)
    assert m, r.stdout
    folder = Path(m.group(1))
    try:
        assert (folder / "greet.py").read_text().strip() and "greet.py" in m.group(2)
        assert f"fleetless drain --handlers {folder}" in r.stdout
        (row,) = [line for line in r.stdout.splitlines() if " resize-image " in line]
        assert f"resize-image in {folder}; given back uncharged, due again in 60 s" in row, row
    finally:
        shutil.rmtree(folder.parent)


def test_demo_answers_json_with_every_jobs_row_and_its_lines_on_stderr(dsn: str, fleetless) -> None:
    """`--json` on the demo too (issue 10: every command that reports): stdout is one JSON object
    (the tier, the drain's summary with drain --json's names, each job's row); the words go to stderr."""
    r = fleetless("demo", "--sandbox", "process", "--json", dsn=dsn, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["tier"] == "process" and "drained: claimed" in r.stderr
    assert (out["summary"]["done"], out["summary"]["dead"], out["summary"]["released"]) == (9, 2, 1)
    rows = {j["kind"]: j for j in out["jobs"] if j["status"] != "done"}
    assert rows["slow"]["outcome"] == "killed: timeout after 2 s" and rows["flaky"]["attempts"] == 3
    assert len(out["jobs"]) == 12 and Path(out["handlers"]).is_dir()
    shutil.rmtree(Path(out["handlers"]).parent)


def test_demo_for_a_user_whose_home_does_not_exist_keeps_its_data_in_a_temp_dir_of_its_own() -> None:
    """A service account (``fleetless-ci``) whose home does not exist, no ``XDG_DATA_HOME``: the demo
    says in one line where the embedded server's data goes instead (``<tmp>/fleetless-<uid>/pg``, a
    0700 directory of that user's) and runs. Before, a 60-line traceback ending in ``Permission denied``."""
    import pwd
    import subprocess
    import tempfile

    from test_installs import install

    user = os.environ.get("FLEETLESS_TEST_SUBUID_USER", "fleetless-ci")
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        pytest.skip(f"no user {user}")
    if os.geteuid() != 0 or not os.path.exists("/usr/bin/python3"):
        pytest.skip("needs root (to run as another user) and /usr/bin/python3")
    top = Path(tempfile.mkdtemp(prefix="fleetless-demo-home-"))
    try:
        top.chmod(0o755)
        python = install(top / "install", "/usr/bin/python3")  # the test venv's python is under /root
        tmp = top / "tmp"
        tmp.mkdir()
        tmp.chmod(0o1777)
        home = top / "no-such-home"  # its parent is root's: the user cannot make it
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(home), "TMPDIR": str(tmp)}
        r = subprocess.run([str(python), "-m", "fleetless.cli", "demo"], env=env, capture_output=True, text=True,
                           timeout=300, cwd="/", user=pw.pw_uid, group=pw.pw_gid, extra_groups=[])
        assert r.returncode == 0, r.stderr
        data = tmp / f"fleetless-{pw.pw_uid}" / "pg"
        assert r.stdout.splitlines()[0] == (
            f"{home}/.local/share/fleetless cannot be made (Permission denied: {home}): the embedded "
            f"PostgreSQL's data goes to {data} (XDG_DATA_HOME chooses another place)"), r.stdout
        assert "9 done, 2 dead, 1 given back in " in r.stdout and "Traceback" not in r.stderr
        assert (data / "PG_VERSION").exists() and not home.exists()
        st = data.parent.stat()
        assert (st.st_uid, st.st_mode & 0o777) == (pw.pw_uid, 0o700)
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", str(top)], check=False)


def test_demo_whose_data_home_cannot_be_made_says_so_in_one_line(fleetless) -> None:
    """An ``XDG_DATA_HOME`` the demo cannot write: one line naming it and DATABASE_URL, exit 1 (the
    user chose that place: no fall back)."""
    r = fleetless("demo", env={"XDG_DATA_HOME": "/proc/no-such-dir"}, timeout=60)
    assert (r.returncode, r.stdout) == (1, ""), r.stderr
    assert r.stderr == ("fleetless: error: cannot make /proc/no-such-dir/fleetless (No such file or directory: "
                        "/proc/no-such-dir); set XDG_DATA_HOME to a directory you can write, or DATABASE_URL "
                        "to use your own PostgreSQL\n")
