"""`fleetless demo`: on the embedded PostgreSQL when no database is given, and on a real one."""

from __future__ import annotations

from pathlib import Path


def test_demo_runs_on_the_embedded_server_as_the_readme_says(fleetless, tmp_path: Path) -> None:
    """`fleetless demo` with no database and no options: embedded PostgreSQL, the bwrap tier where
    it works (else process)."""
    from fleetless.demo import pick_sandbox

    r = fleetless("demo", env={"XDG_DATA_HOME": str(tmp_path / "data")}, timeout=300)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "starting an embedded PostgreSQL" in out
    assert f"draining with the '{pick_sandbox(None)}' sandbox" in out
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
    assert rows["resize-image"][0:2] == ("dead", 1) and "no handler" in str(rows["resize-image"][2])
    assert sql("SELECT count(*) FROM fleetless_demo.jobs WHERE status = 'done'") == [(9,)]
    again = fleetless("demo", "--sandbox", "process", dsn=dsn, timeout=300)  # repeatable
    assert again.returncode == 0, again.stderr
