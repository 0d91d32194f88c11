"""The floors under issue 27's targets, measured in one run: can they be met on this host at all?

    .venv/bin/python bench/bench_floor.py [--jobs 30000] [--reps 3] [--forks 2000] [--perjob 150]

Prints, same run (ratios only mean anything against figures of the same run):

(i)   the peers, whole processes, on ``--jobs`` no-op jobs: the raw-SQL ceiling (claim 100 + one
      UPDATE per batch, ``bench/peers/raw_drain.py``) and PgQueuer (asyncpg, batch 200, drain mode).
(ii)  batch mode's floor with a process per job, no database at all: a loop that ``fork()``s a child
      which calls a no-op ``handle()`` and exits while the parent ``waitpid()``s, on 1 process and 2
      (both cores); then the same with the per-job steps docs/isolation.md promises for a batch's
      job (its own process group, a pipe for its line and one for its result, stdout/stderr pipes,
      a fresh workspace directory made and removed, the group killed after it), first forked by the
      runner itself, then as the runner must (each job a fork of a *template* that never read a job:
      the runner asks it over a socket, the template forks, waits, kills the leftovers and reports
      back). A batch's jobs share the sandbox's uid: no per-job setuid is promised. Each line is
      jobs/s and that against PgQueuer's and raw SQL's jobs/s: a drain's jobs/s can only be lower.
(iii) per-job mode at concurrency 1: a bare ``/usr/bin/python3 one.py payload.json`` start (``print(1)``)
      against the floor of a per-job sandbox that keeps bwrap's promises (root only): a warm server
      (the fork server's own ``_server.py``: its minimal root, pre-imports, compiled script) that per
      job makes a fresh pid namespace (``unshare`` + ``fork``: init), the job's cgroups (memory,
      pids, cpu, unified: made, joined, removed), fresh mount/IPC/UTS/net/cgroup namespaces, ``/proc``,
      a tmpfs workspace, ``/tmp`` and ``/dev/shm``, then forks the job (setsid, rlimits, a leased
      uid, no_new_privs, the seccomp filter, ``runpy`` of the compiled handler), waits and reaps it;
      and the actual ``fleetless drain`` with no tier flag at ``--concurrency 1`` (wall time per job of
      a whole drain, and the marginal per job between a short and a long drain).

Needs a root drainer for (iii)'s floor and the peers' venv for PgQueuer (``bash bench/peers/setup.sh``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable

# -- (ii) the fork loops: run as a fresh interpreter each (``--fork-loop VARIANT N OUT``), so that
# what is forked is a small interpreter, as the batch runner is (not this bench with psycopg loaded)


def _handle(payload: object) -> None:
    return None


def _fork_bare(n: int) -> None:
    for _ in range(n):
        pid = os.fork()
        if pid == 0:
            _handle({"i": 1})
            os._exit(0)
        os.waitpid(pid, 0)


def _job_steps(home: str, job_r: int, w: int, out_w: int, err_w: int) -> None:
    """In the job's process: its own group, its line, its stdout/stderr, its directory, the call,
    its report. Never returns."""
    try:
        os.setpgid(0, 0)
        line = b""
        while chunk := os.read(job_r, 65536):
            line += chunk
        job = json.loads(line)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.chdir(home)
        os.environ["FLEETLESS_JOB_ID"] = str(job["id"])
        os.environ["TMPDIR"] = os.environ["HOME"] = home
        _handle(job["payload"])
        os.write(w, b'{"ok": true}')
    finally:
        os._exit(0)


def _runner_side(n: int, work: str, fork: Callable[[str, tuple[int, ...]], int], end: Callable[[int], None]) -> None:
    """The runner's per-job steps around ``fork`` and ``end``: directory, pipes, line, report and
    output read to their ends, the job's end (its leftovers killed), directory removed."""
    for i in range(n):
        home = os.path.join(work, f"job-{i}")
        os.mkdir(home, 0o700)
        job_r, job_w = os.pipe()
        r, w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        pid = fork(home, (job_r, w, out_w, err_w))
        for fd in (job_r, w, out_w, err_w):
            os.close(fd)
        os.write(job_w, json.dumps({"id": i, "payload": {"i": i}}).encode())
        os.close(job_w)
        data = b""
        while chunk := os.read(r, 65536):
            data += chunk
        end(pid)
        for fd in (out_r, err_r):
            while os.read(fd, 65536):
                pass
        for fd in (r, out_r, err_r):
            os.close(fd)
        assert data == b'{"ok": true}', data
        os.rmdir(home)


def _fork_steps(n: int, work: str) -> None:
    """Each job forked by the runner itself (no template): the cheapest shape with the steps."""
    import signal

    def fork(home: str, fds: tuple[int, ...]) -> int:
        pid = os.fork()
        if pid == 0:  # the runner's ends of the pipes are not the job's (the template has none)
            keep = sorted(fds)
            for low, high in zip([3, *(k + 1 for k in keep)], [*keep, 256], strict=True):
                os.closerange(low, high)
            _job_steps(home, *fds)
        return pid

    def end(pid: int) -> None:
        os.waitpid(pid, 0)
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    _runner_side(n, work, fork, end)


def _template_steps(n: int, work: str) -> None:
    """Each job a fork of a template that never read a job, as the batch runner does."""
    import signal
    import socket

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    template = os.fork()
    if template == 0:  # the template: forks each job, waits, kills its group, says its status
        ours.close()
        while True:
            msg, fds, _, _ = socket.recv_fds(theirs, 4096, 5)
            if not msg:
                os._exit(0)
            home = msg.decode()
            pid = os.fork()
            if pid == 0:
                theirs.close()
                _job_steps(home, *fds)
            for fd in fds:
                os.close(fd)
            os.setpgid(pid, pid)
            ended = os.pidfd_open(pid)
            socket.send_fds(theirs, [b"p%d" % pid], [ended])
            os.close(ended)
            _, status = os.waitpid(pid, 0)
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            theirs.send(b"s%d,1" % status)
    theirs.close()

    def fork(home: str, fds: tuple[int, ...]) -> int:
        socket.send_fds(ours, [home.encode()], list(fds))
        msg, got, _, _ = socket.recv_fds(ours, 64, 1)
        for fd in got:
            os.close(fd)
        return int(msg[1:])

    def end(pid: int) -> None:
        assert ours.recv(64).startswith(b"s")

    _runner_side(n, work, fork, end)
    ours.close()
    os.waitpid(template, 0)


def fork_loop(variant: str, n: int, work: str) -> None:
    import gc

    gc.collect()
    gc.freeze()  # as the batch runner does after its import
    os.makedirs(work, exist_ok=True)
    t = time.perf_counter()
    {"bare": lambda: _fork_bare(n), "steps": lambda: _fork_steps(n, work),
     "template": lambda: _template_steps(n, work)}[variant]()
    print(json.dumps({"seconds": time.perf_counter() - t}))


# -- (iii) the per-job floor: a warm server built with the fork server's own _server.py ----------
def floor_server(config_path: str) -> None:
    """Run as ``python -s bench_floor.py --floor-server CONFIG`` (root): ``CONFIG`` holds the fork
    server's root spec, the job's uid, how many jobs, the cgroup hierarchies. Prints per-job figures."""
    import runpy
    import signal

    with open(config_path) as f:
        config = json.load(f)
    srv = runpy.run_path(config["server"], run_name="_fleetless_forkserver")
    for name in config["prewarm"]:
        try:
            __import__(name)
        except ImportError:
            pass
    with open(config["seccomp"], "rb") as f:
        seccomp = f.read()
    own_pidns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    cg_dirs = [os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC) for d in config["cgroups"]]
    out = os.dup(1)
    srv["build_root"](config)
    srv["compile_scripts"]("/handlers")
    import gc

    gc.collect()
    gc.freeze()
    spec = {"argv": [config["python"], "/handlers/one.py", "/workspace/payload.json"], "runpy": True,
            "env": {"HOME": "/workspace", "PATH": "/usr/bin:/bin"}, "uid": config["uid"], "gid": config["uid"],
            "rlimits": {"RLIMIT_CORE": [0, 0], "RLIMIT_NOFILE": [1024, 1024]}, "nice": None,
            "tmp_bytes": 64 << 20, "workspace_bytes": 256 << 20, "workspace_inodes": 16384, "network": False}
    libc = srv["_libc"]
    prepared: list[float] = []
    job: list[float] = []
    whole: list[float] = []
    use_cgroups = config["use_cgroups"]
    for i in range(config["jobs"]):
        t0 = time.perf_counter()
        name = f"fleetless-floor-{os.getpid()}-{i}"
        procs: list[int] = []
        if use_cgroups:
            for d in cg_dirs:
                os.mkdir(name, 0o755, dir_fd=d)
                procs.append(os.open(f"{name}/cgroup.procs", os.O_WRONLY | os.O_CLOEXEC, dir_fd=d))
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        ready_r, ready_w = os.pipe()
        srv["_unshare"](srv["CLONE_NEWPID"])
        pid = os.fork()
        if pid != 0:
            libc.setns(own_pidns, srv["CLONE_NEWPID"])
        if pid == 0:  # init
            try:
                for fd in procs:
                    os.write(fd, b"0")
                srv["_prepare"](False)
                os.write(ready_w, b"r")
                srv["_mount_job"](spec)
                with open("/workspace/payload.json", "w") as f:
                    f.write('{"i": 1}')
                child = os.fork()
                if child == 0:
                    srv["_run_job"](spec, out_w, err_w, seccomp)
                os.waitpid(child, 0)
            finally:
                os._exit(0)
        for fd in (out_w, err_w, ready_w, *procs):
            os.close(fd)
        os.read(ready_r, 1)
        t1 = time.perf_counter()
        got = b""
        while chunk := os.read(out_r, 4096):
            got += chunk
        os.waitpid(pid, 0)
        if use_cgroups:
            for d in cg_dirs:
                os.rmdir(name, dir_fd=d)
        t2 = time.perf_counter()
        for fd in (out_r, err_r, ready_r):
            os.close(fd)
        assert got == b"1\n", got
        prepared.append(t1 - t0)
        job.append(t2 - t1)
        whole.append(t2 - t0)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.write(out, json.dumps({"prepare": prepared, "job": job, "whole": whole}).encode())


# -- the bench --------------------------------------------------------------------------------
def _median(values: list[float]) -> float:
    import statistics

    return statistics.median(values)


def main() -> None:
    import argparse
    import subprocess
    import tempfile
    from pathlib import Path

    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here))
    import psycopg
    from _common import scratch_db
    from suite import VENV_PY, compile_tree, run_process
    from suite.drain import PEERS, PEERS_PY, _fill_raw, _url

    from fleetless import Queue
    from fleetless.sandbox import Template, choose_tier

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=30000, help="no-op jobs per peer drain")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--forks", type=int, default=2000, help="jobs per fork loop")
    ap.add_argument("--perjob", type=int, default=150, help="jobs of the long per-job drain and of the floor")
    args = ap.parse_args()
    compile_tree()
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    print(f"# bench_floor.py, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores, "
          f"load {load} at the start; medians of {args.reps} reps", flush=True)
    from fleetless.sandbox.forkserver import ForkServerSandbox, _root_spec, client

    python = ForkServerSandbox.handler_python(Template(handlers_dir=Path("/")))
    raw: list[float] = []
    pgq: list[float] = []
    forks: dict[str, list[float]] = {}
    bare: list[float] = []
    floor: dict[str, list[float]] = {"whole": [], "prepare": [], "job": [], "whole, no cgroups": []}
    drain: dict[int, list[float]] = {}
    auto, _ = choose_tier("auto")
    short = max(10, args.perjob // 10)
    with scratch_db() as dsn, tempfile.TemporaryDirectory() as folder, \
            tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        Path(folder, "one.py").write_text("print(1)\n")
        Path(folder, "payload.json").write_text('{"i": 1}')
        os.chmod(folder, 0o755)
        q = Queue(dsn)
        q.init()
        for _rep in range(args.reps):
            # (i) the peers
            _fill_raw(dsn, args.jobs)
            wall, _, _ = run_process([VENV_PY, str(PEERS / "raw_drain.py"), dsn, "100"])
            raw.append(args.jobs / wall)
            if os.access(PEERS_PY, os.X_OK):
                run_process([PEERS_PY, str(PEERS / "pgqueuer_drain.py"), "fill", _url(dsn), str(args.jobs)])
                wall, _, _ = run_process([PEERS_PY, str(PEERS / "pgqueuer_drain.py"), "drain", _url(dsn), "200"])
                pgq.append(args.jobs / wall)
            # (ii) the fork loops, on a tmpfs (a root drainer's workspace is one), 1 and 2 at once
            for variant in ("bare", "steps", "template"):
                for procs in (1, 2):
                    each = args.forks // procs
                    runs = [subprocess.Popen([python, "-s", __file__, "--fork-loop", variant, str(each),
                                              f"{shm}/{variant}-{procs}-{k}"], stdout=subprocess.PIPE)
                            for k in range(procs)]
                    t = time.perf_counter()
                    for p in runs:
                        p.communicate()
                    forks.setdefault(f"{variant}, {procs} process{'es' if procs > 1 else ''}", []).append(
                        each * procs / (time.perf_counter() - t))
            # (iii) a bare start, the floor, the drain
            times = []
            for _ in range(args.perjob // 3):
                t = time.perf_counter()
                subprocess.run(["/usr/bin/python3", f"{folder}/one.py", f"{folder}/payload.json"], check=True,
                               capture_output=True)
                times.append(time.perf_counter() - t)
            bare.append(_median(times))
            if os.geteuid() == 0:
                from fleetless.sandbox import _hostuid, cgroups

                caps = cgroups.available()
                layout = caps.layout
                dirs = [str(layout.v1[c]) for c in ("memory", "pids", "cpu") if c in layout.v1] + (
                    [str(layout.unified)] if layout.unified is not None else []) if layout.mode == "v1" else (
                    [str(layout.unified)] if layout.unified is not None else [])
                lease = _hostuid.lease()
                try:
                    root = _root_spec(python, Path(folder), False)
                    for with_cg in (True, False):
                        mount = tempfile.mkdtemp(prefix="floor-", dir="/dev/shm")
                        config = {"server": client.SERVER, "prewarm": list(client.PREWARM), "seccomp": root.seccomp,
                                  "mountpoint": mount, "binds": [list(b) for b in root.binds],
                                  "symlinks": [list(s) for s in root.symlinks], "python": python,
                                  "uid": lease.uid, "jobs": args.perjob, "cgroups": dirs, "use_cgroups": with_cg}
                        cfg = Path(shm, "floor.json")
                        cfg.write_text(json.dumps(config))
                        got = subprocess.run([python, "-s", __file__, "--floor-server", str(cfg)], env={}, cwd="/",
                                             capture_output=True, check=True)
                        os.rmdir(mount)
                        res = json.loads(got.stdout)
                        if with_cg:
                            for k in ("whole", "prepare", "job"):
                                floor[k].append(_median(res[k]))
                        else:
                            floor["whole, no cgroups"].append(_median(res["whole"]))
                finally:
                    lease.release()
            for n in (short, args.perjob):
                with psycopg.connect(dsn, autocommit=True) as c:
                    c.execute("TRUNCATE fleetless.jobs, fleetless.job_attempts CASCADE")
                q.enqueue_many(("one", {"i": i}) for i in range(n))
                wall, _, _ = run_process([VENV_PY, "-m", "fleetless.cli", "drain", "--handlers", folder,
                                          "--concurrency", "1"], env={"DATABASE_URL": dsn, "FLEETLESS_SANDBOX": ""})
                with psycopg.connect(dsn) as c:
                    done = c.execute("SELECT count(*) FROM fleetless.jobs WHERE status = 'done'").fetchone()
                assert done == (n,), f"drain of {n}: {done} done"
                drain.setdefault(n, []).append(wall)
        q.close()
    end_load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    r, p = _median(raw), (_median(pgq) if pgq else float("nan"))
    print(f"\n(i) peers, {args.jobs:,} no-op jobs, whole processes")
    print(f"  raw SQL ceiling (N = 100)       {r:9,.0f} jobs/s   {r / p:5.2f}x PgQueuer")
    print(f"  PgQueuer (asyncpg, batch 200)   {p:9,.0f} jobs/s   {p / r:5.2f}x raw")
    print(f"  targets at --per-sandbox 500: 1.5x PgQueuer = {1.5 * p:,.0f} jobs/s; 0.5x raw = {0.5 * r:,.0f} jobs/s")
    print(f"\n(ii) a process per job, no database ({args.forks:,} jobs a loop, interpreter {python})")
    for label, values in forks.items():
        m = _median(values)
        print(f"  {label:28s} {m:9,.0f} jobs/s   {m / p:5.2f}x PgQueuer   {m / r:5.2f}x raw")
    print("\n(iii) per job at concurrency 1")
    b = _median(bare)
    print(f"  bare /usr/bin/python3 one.py    {1000 * b:6.1f} ms   1.00   (target: <= {700 * b:.1f} ms a job)")
    if floor["whole"]:
        for k, label in (("whole", "floor, whole sandbox"), ("whole, no cgroups", "floor, without the cgroups"),
                         ("prepare", "floor: init + namespaces"), ("job", "floor: the job (mounts..exit)")):
            m = _median(floor[k])
            print(f"  {label:31s} {1000 * m:6.1f} ms   {m / b:.2f}")
    per = _median(drain[args.perjob]) / args.perjob
    marginal = (_median(drain[args.perjob]) - _median(drain[short])) / (args.perjob - short)
    print(f"  fleetless drain (auto: {auto}), {args.perjob} jobs: {1000 * per:6.1f} ms a job   {per / b:.2f}")
    print(f"  fleetless drain, marginal a job ({short} -> {args.perjob} jobs): {1000 * marginal:6.1f} ms   "
          f"{marginal / b:.2f}")
    print(f"\nload {end_load} at the end")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--fork-loop":
        fork_loop(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    elif len(sys.argv) > 1 and sys.argv[1] == "--floor-server":
        floor_server(sys.argv[2])
    else:
        main()
