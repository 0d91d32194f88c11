"""Same-run A/B of the batch drain: fleetless from two source trees, interleaved, against the raw
ceiling and PgQueuer, whole processes.

    .venv/bin/python bench/ab_drain.py --jobs 15000 --reps 3 --tree before=/work/main/src --tree after=src

``--isolation process,shared`` runs each tree twice a rep: the no-op kind with its default batch
isolation (a fork per job) and with ``batch_isolation = "shared"`` in fleetless.toml (every job of a
batch in the runner's own process); the labels get ``-process`` and ``-shared``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import scratch_db
from suite import compile_tree
from suite.drain import PEERS, PEERS_PY, _fill_fleetless, _fill_raw, _url

from fleetless import Queue

CPU: dict[str, list[float]] = {}
#: the PostgreSQL server's CPU (every postgres process, from /proc) during each drain
SERVER: dict[str, list[float]] = {}
SELF: dict[str, list[float]] = {}
#: the CLI, then the drainer process's own CPU (without its sandboxes) on fd 3's pipe... on stderr
SELF_CPU = """
import resource, runpy, sys
sys.argv[0] = "fleetless"
try:
    runpy.run_module("fleetless.cli", run_name="__main__")
finally:
    r = resource.getrusage(resource.RUSAGE_SELF)
    sys.stderr.write(f"SELFCPU {r.ru_utime + r.ru_stime}\\n")
"""


def server_cpu() -> float:
    """CPU seconds used so far by every live process named postgres, plus the ended ones the
    postmaster has waited for (its children's CPU): a drain's backends end with its connections."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_bytes()
        except OSError:
            continue
        if b"(postgres)" in stat[:64]:
            fields = stat[stat.rindex(b")") + 2:].split()
            total += sum(int(f) for f in fields[11:15])
    return total / tick


def timed(argv: list[str], env: dict[str, str], label: str = "") -> float:
    """Wall seconds of the whole process; its CPU (with its waited-for children: sandboxes,
    runners) goes to CPU[label]."""
    t = time.perf_counter()
    server = server_cpu()
    proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    err = proc.stderr.read().decode()
    _, status, ru = os.wait4(proc.pid, 0)
    SERVER.setdefault(label, []).append(server_cpu() - server)
    for line in err.splitlines():
        if line.startswith("SELFCPU "):
            SELF.setdefault(label, []).append(float(line.split()[1]))
    wall = time.perf_counter() - t
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.returncode == 0, f"{label}: exited {proc.returncode}: {err[-2000:]}"
    CPU.setdefault(label, []).append(ru.ru_utime + ru.ru_stime)
    return wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=15000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--per-sandbox", default="2000")
    ap.add_argument("--tree", action="append", default=[], help="label=path/to/src")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--sandbox", default="process", help="the tier fleetless drains with (auto: the default's)")
    ap.add_argument("--isolation", default="process",
                    help="comma list of the no-op kind's batch_isolation to run each tree with: process, shared")
    a = ap.parse_args()
    n = a.jobs
    trees = [t.split("=", 1) for t in a.tree] or [["tree", "src"]]
    for _, src in trees:  # as an installed package is
        compile_tree(Path(src))
    rates: dict[str, list[float]] = {}
    modes = [m.strip() for m in a.isolation.split(",") if m.strip()]
    with scratch_db() as dsn, tempfile.TemporaryDirectory() as top:
        folders = {}
        for mode in modes:  # a handlers directory per mode: the no-op kind, and its fleetless.toml
            folders[mode] = folder = os.path.join(top, mode)
            os.mkdir(folder)
            Path(folder, "noop.py").write_text("def handle(payload):\n    return None\n")
            Path(folder, "fleetless.toml").write_text(f'[kinds.noop]\nbatch_isolation = "{mode}"\n')
            os.chmod(folder, 0o755)
        os.chmod(top, 0o755)
        Queue(dsn).init()
        for _ in range(a.reps):
            if not a.no_peers:
                _fill_raw(dsn, n)
                w = timed([sys.executable, str(PEERS / "raw_drain.py"), dsn, "100"], {}, "raw")
                rates.setdefault("raw", []).append(n / w)
                subprocess.run([PEERS_PY, str(PEERS / "pgqueuer_drain.py"), "fill", _url(dsn), str(n)], check=True,
                               stdout=subprocess.DEVNULL)
                w = timed([PEERS_PY, str(PEERS / "pgqueuer_drain.py"), "drain", _url(dsn), "200"], {}, "pgqueuer")
                rates.setdefault("pgqueuer", []).append(n / w)
            for (tree, src), mode in [(t, m) for t in trees for m in modes]:
                label = tree if len(modes) == 1 else f"{tree}-{mode}"
                folder = folders[mode]
                _fill_fleetless(dsn, n)
                w = timed([sys.executable, "-c", SELF_CPU, "drain", "--handlers", folder, "--sandbox",
                           a.sandbox, "--per-sandbox", a.per_sandbox, "--concurrency", "2", "--lease-grace", "60"],
                          {"PYTHONPATH": os.path.abspath(src), "DATABASE_URL": dsn}, label)
                import psycopg
                with psycopg.connect(dsn) as c:
                    done = c.execute("SELECT count(*) FROM fleetless.jobs WHERE status = 'done'").fetchone()
                assert done == (n,), f"{label}: {done} of {n} done"
                rates.setdefault(label, []).append(n / w)
    for label, vals in rates.items():
        m = statistics.median(vals)
        extra = ""
        if "raw" in rates:
            extra += f"  /raw {m / statistics.median(rates['raw']):.2f}"
        if "pgqueuer" in rates:
            extra += f"  /pgq {m / statistics.median(rates['pgqueuer']):.2f}"
        cpu = statistics.median(CPU[label]) * 1e6 / n
        print(f"{label:10s} {m:9,.0f} jobs/s  [{', '.join(f'{v:,.0f}' for v in vals)}]{extra}"
              f"  CPU {cpu:.1f} us/job [{', '.join(f'{c * 1e6 / n:.1f}' for c in CPU[label])}]"
              + f"  server {statistics.median(SERVER[label]) * 1e6 / n:.1f} us/job"
              + (f"  drainer alone {statistics.median(SELF[label]) * 1e6 / n:.1f} us/job" if label in SELF else ""))


if __name__ == "__main__":
    main()
