"""(3) Per-job mode: jobs/s of `fleetless drain --concurrency 2` per tier on `print(1)` handlers,
against the same jobs run with no sandbox (`python3 handler.py payload.json`, two at a time); and
with no tier flag at all (`--sandbox auto`, what a user who types the README's command gets), also
(run as root) by an unprivileged drainer whose user has a subordinate uid range
(``$FLEETLESS_TEST_SUBUID_USER``, default ``fleetless-ci`` as ``.ci/run`` makes it; issue 27), under
``/usr/bin/python3`` with this tree's sources and packages on its path."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psycopg

from fleetless import Queue
from fleetless.sandbox import SandboxUnavailable, choose_tier, get_backend

from . import VENV_PY, Context, Section, fmt, median, run_process, scratch_db, spread


def _bare(folder: str, n: int) -> float:
    payload = Path(folder, "payload.json")
    payload.write_text(json.dumps({"i": 1}))
    t = time.perf_counter()
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda _: subprocess.run(["/usr/bin/python3", f"{folder}/one.py", str(payload)], check=True,
                                               capture_output=True), range(n)))
    return n / (time.perf_counter() - t)


RUNUSER = shutil.which("runuser", path="/usr/sbin:/sbin:/usr/bin:/bin") or "runuser"


def _unprivileged() -> tuple[str, dict[str, str]] | None:
    """(user, environment) of the unprivileged drainer with a subordinate range, or None where the
    bench cannot run one (not root, no such user or range, this tree not readable by others)."""
    user = os.environ.get("FLEETLESS_TEST_SUBUID_USER", "fleetless-ci")
    if os.geteuid() != 0 or not os.path.isabs(RUNUSER):
        return None
    try:
        pwd.getpwnam(user)
        with open("/etc/subuid") as f:
            if not any(line.startswith(f"{user}:") for line in f):
                return None
    except (KeyError, OSError):
        return None
    src = str(Path(__file__).resolve().parents[2] / "src")
    path = [src, *(p for p in sys.path if p.endswith("site-packages"))]
    probe = subprocess.run([RUNUSER, "-u", user, "--", "/usr/bin/python3", "-c", "import fleetless, psycopg"],
                           env={"PYTHONPATH": ":".join(path), "PATH": "/usr/bin:/bin"}, capture_output=True, cwd="/")
    if probe.returncode != 0:
        return None
    return user, {"PYTHONPATH": ":".join(path), "PATH": "/usr/bin:/bin"}


def run(ctx: Context) -> Section:
    sizes = {"process": 200, "bwrap": 200, "forkserver": 200, "microvm": 6}
    if ctx.quick:
        sizes = {"process": 20, "bwrap": 20, "forkserver": 20, "microvm": 2}
    tiers = []
    for tier in sizes:
        try:
            get_backend(tier).check()
            tiers.append(tier)
        except SandboxUnavailable:
            pass
    cases: dict[str, list[float]] = {"no sandbox (python3 handler.py)": []}  # /usr/bin/python3, as the tiers
    cases.update({f"{t} tier": [] for t in tiers})
    auto, _ = choose_tier("auto")  # the tier the drain with no flag picks here
    cases[f"no tier flag (auto: {auto})"] = []
    other = _unprivileged()
    other_label = ""
    if other is not None:
        user, env = other
        said = subprocess.run([RUNUSER, "-u", user, "--", "/usr/bin/python3", "-c",
                               "from fleetless.sandbox import choose_tier; print(choose_tier('auto')[0])"],
                              env=env, capture_output=True, text=True, cwd="/").stdout.strip()
        other_label = f"no tier flag, drainer {user} with a subordinate range (auto: {said})"
        cases[other_label] = []
    with scratch_db() as dsn, tempfile.TemporaryDirectory() as folder, tempfile.TemporaryDirectory() as work:
        Path(folder, "one.py").write_text("print(1)\n")
        os.chmod(folder, 0o755)
        if other is not None:  # (not in the handlers' folder, which each drain snapshots)
            os.chmod(work, 0o711)  # its jobs pass it, as the work directory check asks
            os.chown(work, pwd.getpwnam(other[0]).pw_uid, pwd.getpwnam(other[0]).pw_gid)
        q = Queue(dsn)
        q.init()
        for _ in range(ctx.reps):
            for label in cases:
                if label.startswith("no sandbox"):
                    cases[label].append(_bare(folder, sizes["process"]))
                    continue
                tier = auto if label.startswith("no tier flag") else label.split()[0]
                flag = [] if label.startswith("no tier flag") else ["--sandbox", tier]
                with psycopg.connect(dsn, autocommit=True) as c:
                    c.execute("TRUNCATE fleetless.jobs, fleetless.job_attempts CASCADE")
                n = sizes["forkserver"] if label == other_label else sizes[tier]
                q.enqueue_many(("one", {"i": i}) for i in range(n))
                head, env = [VENV_PY], {"DATABASE_URL": dsn, "FLEETLESS_SANDBOX": ""}
                if label == other_label and other is not None:
                    head = [RUNUSER, "-u", other[0], "--", "/usr/bin/python3"]
                    env.update(other[1], FLEETLESS_WORKDIR=work, HOME=work)
                wall, _, _ = run_process([*head, "-m", "fleetless.cli", "drain", "--handlers", folder, *flag,
                                          "--concurrency", "2"], env=env)
                cases[label].append(n / wall)
        q.close()
    s = Section("perjob", "(3) Per-job mode: one sandbox per job, --concurrency 2", "bench/run.py --only perjob",
                ctx, ["tier", "jobs/s", "/ no sandbox"], raw=cases)
    bare = median(cases["no sandbox (python3 handler.py)"])
    for label, values in cases.items():
        s.rows.append([label, f"{fmt(median(values))} [{spread(values)}]", f"{median(values) / bare:.2f}"])
        s.add_bar(label, values)
    s.notes.append("Jobs per repetition: " + ", ".join(f"{t} {sizes[t]}" for t in tiers)
                   + " (the drain is a whole process: its start is included).")
    if other_label:
        s.notes.append(f"`{other_label}`: {sizes['forkserver']} jobs, the drain started by `runuser` under "
                       "/usr/bin/python3 (the bare case's interpreter), its own work directory.")
    return s
