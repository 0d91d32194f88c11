"""Importing fleetless imports psycopg without psycopg's version lookups (a cron tick's start-up:
BENCHMARKS.md (6)), with the same versions, and as psycopg always imports wherever that would not
hold."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _python(code: str, path: list[str] | None = None) -> str:
    prefix = "".join(f"sys.path.insert(0, {p!r})\n" for p in [str(SRC), *(path or [])])
    out = subprocess.run([sys.executable, "-c", "import sys\n" + prefix + textwrap.dedent(code)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_importing_fleetless_skips_psycopgs_metadata_lookup_and_keeps_its_versions() -> None:
    out = json.loads(_python("""
        import json, sys
        import fleetless, psycopg, psycopg_binary
        skipped = "importlib.metadata" not in sys.modules
        from importlib import metadata
        print(json.dumps([skipped, psycopg.__version__, metadata.version("psycopg"),
                          psycopg_binary.__version__, metadata.version("psycopg-binary")]))
    """))
    assert out[0] is True
    assert out[1] == out[2] and out[3] == out[4]


def _fake_psycopg(root: Path, version_py: str, init_py: str, dists: list[str]) -> None:
    (root / "psycopg").mkdir()
    (root / "psycopg" / "version.py").write_text(version_py)
    (root / "psycopg" / "__init__.py").write_text(init_py)
    for dist in dists:
        (root / dist).mkdir()


def _load_driver_then_psycopg(root: Path) -> str:
    # _driver alone (fleetless's own package would import the real psycopg's API it needs)
    return _python(f"""
        import importlib.util
        spec = importlib.util.spec_from_file_location("fleetless_driver", {str(SRC / "fleetless" / "_driver.py")!r})
        driver = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(driver)
        import psycopg
        print(psycopg.__version__, psycopg.extra)
    """, path=[str(root)])


def test_a_psycopg_whose_version_module_holds_more_imports_as_it_always_does(tmp_path: Path) -> None:
    _fake_psycopg(tmp_path, "__version__ = '9.9'\nextra = 'real module'\n",
                  "from .version import __version__, extra\n", ["psycopg-9.9.dist-info"])
    assert _load_driver_then_psycopg(tmp_path) == "9.9 real module\n"


def test_without_one_dist_info_psycopg_looks_its_version_up_itself(tmp_path: Path) -> None:
    _fake_psycopg(tmp_path, "__version__ = 'looked up'\nextra = 'its own'\n",
                  "from .version import __version__, extra\n", ["psycopg-9.9.dist-info", "psycopg-9.8.dist-info"])
    assert _load_driver_then_psycopg(tmp_path) == "looked up its own\n"
