"""What the process tier's own pid and mount namespaces cost per job, against the same tier
without them (``FLEETLESS_PROCESS_CONTAIN=0``), interleaved in one run so load spreads over both;
and what its network namespace (loopback only, the default) costs against a job of a kind with
``network = true`` (the same namespaces but the network, the host's).

    python bench/bench_process_contain.py [--rounds 40]

Each round: bare ``python3 -c 'print(1)'``, then one process-tier job with the namespaces, then
one with them but the host's network (``limits.network``), then one without (create, write a
payload, exec ``python3 handler.py payload.json``, kill). Prints the medians in ms and their
ratios to bare Python and to each other.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from fleetless.sandbox import Template
from fleetless.sandbox.process import CONTAIN_ENV, ProcessSandbox


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    rounds = parser.parse_args().rounds
    folder = Path(tempfile.mkdtemp(prefix="fleetless-bench-"))
    folder.chmod(0o755)
    (folder / "one.py").write_text("print(1)\n")
    (folder / "one.py").chmod(0o644)
    template = Template(handlers_dir=folder, env={"PATH": "/usr/bin:/bin"})
    networked = dataclasses.replace(template, limits=dataclasses.replace(template.limits, network=True))

    def job(contain: str, network: bool = False) -> float:
        os.environ[CONTAIN_ENV] = contain
        start = time.perf_counter()
        with ProcessSandbox.create(networked if network else template) as sbx:
            sbx.write("payload.json", "{}")
            r = sbx.exec([sbx.python, f"{sbx.handlers_path}/one.py", "payload.json"], 30)
            assert r.ok, r
        return time.perf_counter() - start

    def bare() -> float:
        start = time.perf_counter()
        subprocess.run(["/usr/bin/python3", "-c", "print(1)"], capture_output=True, check=True)
        return time.perf_counter() - start

    for _ in range(3):  # warm caches (the handlers snapshot, the interpreter's pages)
        bare(), job("1"), job("1", network=True), job("0")
    times: dict[str, list[float]] = {"bare python": [], "namespaces": [], "host network": [], "no namespaces": []}
    for _ in range(rounds):
        times["bare python"].append(bare())
        times["namespaces"].append(job("1"))
        times["host network"].append(job("1", network=True))
        times["no namespaces"].append(job("0"))
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, m in medians.items():
        print(f"  {name:14s} {m * 1000:7.1f} ms  x {m / medians['bare python']:.2f} of bare python")
    print(f"  namespaces / no namespaces: {medians['namespaces'] / medians['no namespaces']:.2f}")
    print(f"  namespaces (own network) / host network: {medians['namespaces'] / medians['host network']:.2f}")


if __name__ == "__main__":
    main()
