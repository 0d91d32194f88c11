"""Per-job cost of each sandbox tier against bare Python start-up, measured in the same run.

    python bench/bench_sandbox.py [--runs 15] [--tiers process,bwrap,microvm]

For each tier: create a sandbox, write a payload, exec `python3 handler.py payload.json` (the
handler prints one line), kill; end to end, median of --runs (microVM: a third as many, it boots a
kernel). The baseline is `python3 handler.py payload.json` run directly by subprocess. Prints each
median in ms and its ratio to the baseline.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, spread

from fleetless.sandbox import Limits, Template, default_python, get_backend


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--tiers", default="process,bwrap,microvm")
    a = ap.parse_args()
    python = default_python()
    with tempfile.TemporaryDirectory(prefix="fleetless-bench-") as tmp:
        hdir = Path(tmp) / "handlers"
        hdir.mkdir()
        Path(tmp).chmod(0o755)
        hdir.chmod(0o755)
        (hdir / "job.py").write_text("import json, sys\nprint(json.load(open(sys.argv[1]))['n'])\n")
        (hdir / "job.py").chmod(0o644)
        payload = Path(tmp) / "payload.json"
        payload.write_text('{"n": 1}')

        def bare() -> None:
            subprocess.run([python, str(hdir / "job.py"), str(payload)], check=True, capture_output=True)

        results: dict[str, list[float]] = {"bare python": []}
        tiers = [t for t in a.tiers.split(",") if t]
        usable = []
        for tier in tiers:
            try:
                get_backend(tier).check()
                usable.append(tier)
                results[tier] = []
            except Exception as exc:
                print(f"{tier}: skipped ({exc})", file=sys.stderr)
        template = Template(handlers_dir=hdir, limits=Limits(memory_bytes=256 * 1024 * 1024))

        def one(tier: str) -> None:
            with get_backend(tier).create(template, 120) as sbx:
                sbx.write("payload.json", '{"n": 1}')
                r = sbx.exec([sbx.python, f"{sbx.handlers_path}/job.py", f"{sbx.workspace_path}/payload.json"], 120)
            if not r.ok or r.stdout.strip() != "1":
                raise SystemExit(f"{tier}: job failed: {r}")

        for i in range(a.runs):  # interleaved, so noise spreads over all tiers
            t = time.perf_counter()
            bare()
            results["bare python"].append(time.perf_counter() - t)
            for tier in usable:
                if tier == "microvm" and i % 3:
                    continue
                t = time.perf_counter()
                one(tier)
                results[tier].append(time.perf_counter() - t)
    base = median(results["bare python"])
    print(f"\nper-job cost, median of runs (python: {python})")
    for name, values in results.items():
        print(f"  {name:12s} {median(values) * 1000:8.1f} ms  x{median(values) / base:5.2f} of bare python"
              f"  [spread {spread(values)}, n={len(values)}]")


if __name__ == "__main__":
    main()
