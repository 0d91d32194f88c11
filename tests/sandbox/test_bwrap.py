"""What only the bwrap tier does, against the real bubblewrap and this host's real cgroups (no
mocks): identity, the mount view, the watchdog. What every tier promises (results, limits, kills, no
network, the exact environment, the workspace's end) is tested once in ``test_contract.py``.

Every handler is written by its test into ``tmp_path``. No test sends a packet to anything but
loopback: network checks read /proc/net and /sys/class/net inside the sandbox.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from security.drains import pythonpath_for_others

from fleetless.sandbox import ExecResult, Limits, SandboxUnavailable, Template, cgroups
from fleetless.sandbox import bwrap as bw
from fleetless.sandbox.bwrap import BwrapSandbox
from fleetless.sandbox.bwrap._filesystem import interpreter_paths

from proctools import pids_with, wait_for

MiB = 1024 * 1024

SRC = str(Path(__file__).resolve().parents[2] / "src")
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}

try:
    BwrapSandbox.check()
    _unavailable = ""
except SandboxUnavailable as exc:
    _unavailable = str(exc)

pytestmark = pytest.mark.skipif(bool(_unavailable), reason=f"bwrap cannot run here: {_unavailable}")

needs_cgroups = pytest.mark.skipif(
    not (cgroups.available().memory and cgroups.available().pids),
    reason="no writable memory/pids cgroup (not root, or not delegated)",
)


@pytest.fixture
def handlers(tmp_path: Path) -> Callable[..., Path]:
    folder = tmp_path / "handlers"
    folder.mkdir()

    def write(**files: str) -> Path:
        for name, source in files.items():
            path = folder / name
            path.write_text(textwrap.dedent(source).lstrip())
            path.chmod(0o755)
        return folder

    return write


@pytest.fixture
def sandboxes() -> Iterator[list[BwrapSandbox]]:
    made: list[BwrapSandbox] = []
    yield made
    for s in made:
        s.kill()


def make(
    sandboxes: list[BwrapSandbox], folder: Path, ttl: float = 60, env: dict[str, str] | None = None, **limits: object
) -> BwrapSandbox:
    sbx = BwrapSandbox.create(Template(folder, Limits(**limits), dict(ENV if env is None else env)), ttl)  # type: ignore[arg-type]
    sandboxes.append(sbx)
    return sbx


def run_py(sbx: BwrapSandbox, kind: str, payload: object = None, timeout: float = 20) -> ExecResult:
    sbx.write("payload.json", json.dumps(payload))
    return sbx.exec([sbx.python, f"{sbx.handlers_path}/{kind}.py", f"{sbx.workspace_path}/payload.json"], timeout)


# -- results ------------------------------------------------------------------------------------


def test_runs_as_65534_without_capabilities_even_as_root(
    handlers: Callable[..., Path], sandboxes: list[BwrapSandbox]
) -> None:
    folder = handlers(
        **{
            "who.py": """
            import ctypes, json, os
            status = dict(l.split(":\\t", 1) for l in open("/proc/self/status").read().splitlines() if ":\\t" in l)
            libc = ctypes.CDLL(None, use_errno=True)
            userns = libc.unshare(0x10000000)  # CLONE_NEWUSER
            print(json.dumps({"uid": os.getuid(), "euid": os.geteuid(), "gid": os.getgid(),
                "groups": os.getgroups(), "CapEff": status["CapEff"].strip(), "CapPrm": status["CapPrm"].strip(),
                "CapBnd": status["CapBnd"].strip(), "NoNewPrivs": status["NoNewPrivs"].strip(),
                "userns": userns, "errno": ctypes.get_errno(), "pid": os.getpid(),
                "hostname": os.uname().nodename}))
            """
        }
    )
    r = run_py(make(sandboxes, folder), "who")
    assert r.ok, r
    info = json.loads(r.stdout)
    assert info["uid"] == info["euid"] == info["gid"] == 65534
    assert info["CapEff"] == info["CapPrm"] == info["CapBnd"] == "0000000000000000"
    assert info["NoNewPrivs"] == "1"
    assert info["userns"] == -1  # nested user namespaces are disabled
    assert info["pid"] < 10  # its own pid namespace
    assert info["hostname"] == "fleetless"
    if os.getuid() == 0:
        assert os.getuid() == 0  # the point: the drainer (this test) is root, the job is not


def test_cannot_read_host_secrets_or_drainer_environment(
    handlers: Callable[..., Path], sandboxes: list[BwrapSandbox], monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = f"hunter2-{uuid.uuid4().hex}"
    monkeypatch.setenv("DATABASE_URL", f"postgresql://app:{secret}@db/prod")
    monkeypatch.setenv("SECRET", secret)
    folder = handlers(
        **{
            "snoop.py": """
            import json, os, sys
            secret = sys.argv[2]
            out = {"env": dict(os.environ)}
            for path in ["/root", "/etc/shadow", "/home", "/proc/1/environ", "/etc/passwd", "/work"]:
                try:
                    if os.path.isdir(path):
                        out[path] = "listed: " + ",".join(sorted(os.listdir(path)))
                    else:
                        data = open(path, "rb").read()
                        out[path] = "SECRET FOUND" if secret.encode() in data else "read, no secret"
                except OSError as exc:
                    out[path] = type(exc).__name__
            leaks = []
            for pid in os.listdir("/proc"):
                if pid.isdigit():
                    for f in ("environ", "cmdline"):
                        try:
                            if secret.encode() in open(f"/proc/{pid}/{f}", "rb").read():
                                leaks.append(f"{pid}/{f}")
                        except OSError:
                            pass
            out["leaks"] = leaks
            out["etc"] = sorted(os.listdir("/etc"))
            print(json.dumps(out))
            """
        }
    )
    snoop = folder / "snoop.py"  # the secret in two halves: neither the file nor argv contains it
    snoop.write_text(snoop.read_text().replace("secret = sys.argv[2]", f"secret = {secret[:8]!r} + {secret[8:]!r}"))
    r = run_py(make(sandboxes, folder), "snoop")
    assert r.ok, r
    out = json.loads(r.stdout)
    assert secret not in r.stdout
    assert set(out["env"]) <= {*ENV, "HOME", "PWD", "LC_CTYPE"}, out["env"]
    # Of /root, /home and /work a job sees at most the way to the handlers' interpreter (its
    # prefix, its virtual environment, the source of an editable install), bound read-only.
    bound = interpreter_paths(BwrapSandbox.handler_python(Template(folder)))
    for top in ("/root", "/home", "/work"):
        shown = sorted({p[len(top) + 1:].split("/")[0] for p in bound if p.startswith(top + "/")})
        assert out[top] == (f"listed: {','.join(shown)}" if shown else "FileNotFoundError"), (top, out[top])
    assert out["/etc/shadow"] == "FileNotFoundError"
    assert out["/proc/1/environ"] in ("read, no secret", "PermissionError")
    assert out["/etc/passwd"] == "read, no secret"
    assert out["leaks"] == []
    assert "shadow" not in out["etc"] and "gshadow" not in out["etc"]


def test_cannot_see_another_jobs_workspace(handlers: Callable[..., Path], sandboxes: list[BwrapSandbox]) -> None:
    folder = handlers(
        **{
            "peek.py": """
            import json, sys
            target = json.load(open(sys.argv[1]))["path"]
            try:
                print("READ " + open(target).read())
            except OSError as exc:
                print(type(exc).__name__)
            """
        }
    )
    first = make(sandboxes, folder)
    second = make(sandboxes, folder)
    first.write("secret.txt", "first job's data")
    assert first.host_workspace is not None and second.host_workspace is not None
    assert first.host_workspace != second.host_workspace
    r = run_py(second, "peek", {"path": str(first.host_workspace / "secret.txt")})
    assert r.ok and r.stdout.strip() == "FileNotFoundError", r
    assert (first.host_workspace.stat().st_mode & 0o077) == 0  # and not readable by other host users


def test_read_only_system_and_handlers_writable_workspace_and_tmp(
    handlers: Callable[..., Path], sandboxes: list[BwrapSandbox]
) -> None:
    folder = handlers(
        **{
            "write.py": """
            import json, os
            out = {}
            for path in ["/usr/evil", "/usr/bin/python3", "/handlers/write.py", "/handlers/new.py", "/etc/passwd",
                         "/workspace/out.txt", "/tmp/scratch", "/dev/shm/x"]:
                try:
                    with open(path, "a") as f:
                        f.write("x")
                    out[path] = "written"
                except OSError as exc:
                    out[path] = type(exc).__name__
            try:
                os.chmod("/handlers/write.py", 0o777)
                out["chmod"] = "changed"
            except OSError as exc:
                out["chmod"] = type(exc).__name__
            print(json.dumps(out))
            """
        }
    )
    sbx = make(sandboxes, folder)
    r = run_py(sbx, "write")
    assert r.ok, r
    out = json.loads(r.stdout)
    for path in ["/usr/evil", "/usr/bin/python3", "/handlers/write.py", "/handlers/new.py", "/etc/passwd"]:
        assert out[path] in ("OSError", "PermissionError"), (path, out)
    assert out["chmod"] in ("OSError", "PermissionError")
    assert out["/workspace/out.txt"] == out["/tmp/scratch"] == out["/dev/shm/x"] == "written"
    assert sbx.host_workspace is not None and (sbx.host_workspace / "out.txt").read_text() == "x"
    assert not (folder / "new.py").exists()


def test_tmp_is_size_capped(handlers: Callable[..., Path], sandboxes: list[BwrapSandbox]) -> None:
    folder = handlers(
        **{
            "fill.py": """
            import errno
            try:
                with open("/tmp/big", "wb") as f:
                    for _ in range(64):
                        f.write(b"x" * (1 << 20))
                print("wrote 64 MiB")
            except OSError as exc:
                print(errno.errorcode[exc.errno])
            """
        }
    )
    r = run_py(make(sandboxes, folder, tmp_bytes=8 * MiB), "fill")
    assert r.ok and r.stdout.strip() == "ENOSPC", r


# -- network -----------------------------------------------------------------------------------
NET_PROBE = """
import errno, json, os, socket
out = {"dev": [l.split(":")[0].strip() for l in open("/proc/net/dev").read().splitlines()[2:]],
       "routes": open("/proc/net/route").read().splitlines()[1:],
       "sys": sorted(os.listdir("/sys/class/net")) if os.path.isdir("/sys/class/net") else None}
s = socket.socket()
s.settimeout(3)
try:
    s.connect(("127.0.0.1", 5432))
    out["pg"] = "connected"
except OSError as exc:
    out["pg"] = errno.errorcode.get(exc.errno or 0, str(exc))
print(json.dumps(out))
"""


def test_network_shared_only_when_allowed(handlers: Callable[..., Path], sandboxes: list[BwrapSandbox]) -> None:
    host_ifaces = [line.split(":")[0].strip() for line in Path("/proc/net/dev").read_text().splitlines()[2:]]
    if host_ifaces == ["lo"]:
        pytest.skip("the host has no interface but lo")
    r = run_py(make(sandboxes, handlers(**{"net.py": NET_PROBE}), network=True), "net")
    assert r.ok, r
    out = json.loads(r.stdout)
    assert sorted(out["dev"]) == sorted(host_ifaces)  # read only: no packet is sent anywhere but lo


# -- limits and kills --------------------------------------------------------------------------


SETSID_DAEMON = """
import os, subprocess, sys
marker = sys.argv[2]
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", marker])
    os._exit(0)
os.wait()
print("daemon started", flush=True)
if len(sys.argv) > 3:
    import time
    time.sleep(float(sys.argv[3]))
"""


def test_kill_removes_the_jobs_cgroups_during_an_exec_and_without_one(
    handlers: Callable[..., Path], sandboxes: list[BwrapSandbox]
) -> None:
    """Its processes and workspace: test_contract.py. Its cgroups are bwrap's own."""
    marker = f"fleetless-marker-{uuid.uuid4().hex}"
    folder = handlers(**{"daemon.py": SETSID_DAEMON})
    sbx = make(sandboxes, folder)
    sbx.write("payload.json", "{}")
    cg_dirs = list(sbx.cgroup.dirs) if sbx.cgroup else []
    assert all(d.is_dir() for d in cg_dirs)
    t = threading.Thread(
        target=lambda: sbx.exec([sbx.python, "/handlers/daemon.py", "/workspace/payload.json", marker, "60"], 60))
    t.start()
    wait_for(lambda: len(pids_with(marker)) >= 2, 30, what="job and daemon both running")
    sbx.kill()  # cancel from another thread, as the drainer does
    assert not any(d.exists() for d in cg_dirs)
    t.join(30)
    assert not t.is_alive()
    idle = BwrapSandbox.create(Template(folder, Limits(), ENV))
    cg_dirs = list(idle.cgroup.dirs) if idle.cgroup else []
    idle.kill()
    assert not any(d.exists() for d in cg_dirs)


PARENT = """
import json, sys
sys.path.insert(0, {src!r})
from pathlib import Path
from fleetless.sandbox import Limits, Template
from fleetless.sandbox.bwrap import BwrapSandbox
sbx = BwrapSandbox.create(Template(Path({folder!r}), Limits(), {{"PATH": "/usr/bin:/bin"}}), 600)
sbx.write("payload.json", "{{}}")
print(json.dumps({{"workspace": str(sbx.host_workspace),
                  "cgroups": [str(d) for d in sbx.cgroup.dirs] if sbx.cgroup else []}}), flush=True)
sbx.exec([sbx.python, "/handlers/daemon.py", "/workspace/payload.json", {marker!r}, "600"], 600)
"""


def test_drainer_sigkill_kills_the_job_and_sweep_cleans_up(handlers: Callable[..., Path]) -> None:
    marker = f"fleetless-marker-{uuid.uuid4().hex}"
    folder = handlers(**{"daemon.py": SETSID_DAEMON})
    code = PARENT.format(src=SRC, folder=str(folder), marker=marker)
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        info = json.loads(parent.stdout.readline())
        wait_for(lambda: len(pids_with(marker)) >= 2, 15, what="the job to start")
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    wait_for(lambda: not pids_with(marker), 5, what="the job's processes to be gone")
    workspace = Path(info["workspace"])
    dirs = [Path(d) for d in info["cgroups"]]
    # the dead drainer's watchdog removes its workspace and cgroups; sweep() is the backstop
    wait_for(lambda: not workspace.exists() and not any(d.exists() for d in dirs), 10,
             what="the watchdog to remove the workspace and cgroups")
    bw.sweep()
    leftovers = [p for d in dirs for p in d.parent.glob(f"{cgroups.PREFIX}{parent.pid}-*")]
    assert leftovers == []  # its prepared (pooled) groups too


# -- host compatibility ------------------------------------------------------------------------
def test_enforced_caps_and_check() -> None:
    BwrapSandbox.check()
    caps = bw.enforced_caps()
    assert caps[-1].startswith("rlimits")
    if os.getuid() == 0 and cgroups.available().memory:
        mode = cgroups.available().layout.mode
        assert f"memory (cgroup {mode})" in caps


CHECK_ONLY = """
import json, os, sys
sys.path.insert(0, {src!r})
from fleetless.sandbox import _workspace
from fleetless.sandbox.bwrap import BwrapSandbox
BwrapSandbox.check()
print(json.dumps(sorted(p.name for p in _workspace.root().glob(f"etc-{{os.getpid()}}-*"))))
"""


def test_the_tier_check_copies_no_etc_so_an_empty_cron_tick_stays_cheap() -> None:
    # The /etc copy (hundreds of symlinks) was half an empty tick's time: it waits for a sandbox.
    out = subprocess.run([sys.executable, "-c", CHECK_ONLY.format(src=SRC)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []


def test_warm_probes_the_interpreter_once_beside_the_check_and_a_bad_one_still_fails_the_check(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``warm`` starts the interpreter's probe in the background (a cron tick's ~20 ms, beside the
    tier's own probe); ``check_template`` waits for it instead of starting a second. A probe that
    fails in the background is asked again by the check, which says what is wrong in one line."""
    from fleetless.sandbox.bwrap import _filesystem

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    probes: list[str] = []
    real_run = subprocess.run

    def counting_run(argv: Any, *args: Any, **kwargs: Any) -> Any:
        if argv and argv[0] in (python, str(tmp_path / "nowhere" / "python")):
            probes.append(argv[0])
            time.sleep(0.2)  # a slow probe: the check comes while it runs
        return real_run(argv, *args, **kwargs)

    monkeypatch.setattr(_filesystem.subprocess, "run", counting_run)
    BwrapSandbox.warm(Template(tmp_path, python=python))
    assert str(venv) in interpreter_paths(python)
    assert probes == [python]

    bad = str(tmp_path / "nowhere" / "python")
    BwrapSandbox.warm(Template(tmp_path, python=bad))
    with pytest.raises(SandboxUnavailable, match=f"cannot use {bad} as the handler interpreter"):
        interpreter_paths(bad)
    for thread in threading.enumerate():
        if thread.name == "fleetless-interpreter-probe":
            thread.join()
    assert probes == [python, bad, bad]  # the background's and the check's own


ETC_COPY = """
import sys, time
sys.path.insert(0, {src!r})
from fleetless.sandbox.bwrap._filesystem import etc_dir
from fleetless.sandbox.bwrap._seccomp import seccomp_file
start = float(sys.argv[1])
time.sleep(max(start - time.time(), 0))  # every process at once: they race to make the copies
print(etc_dir(False), seccomp_file(), "pyseccomp" in sys.modules)
"""


def test_drainers_share_one_etc_copy_and_a_stale_one_is_swept_after_its_grace(tmp_path: Path) -> None:
    """Drainers whose jobs run as leased uids share one /etc copy and one seccomp filter, kept after
    they exit: four drainer processes racing to make them all get the same whole copies and leave
    no half-made one, and a later drainer does not even import pyseccomp. A shared copy the host's
    files no longer make is swept once it is a day old (a job of an older drainer may still have it
    bound before that); the current one never is."""
    if os.geteuid() != 0:
        pytest.skip("shared only where jobs run as leased uids (here: a root drainer)")
    work = tmp_path / "work"
    env = {**os.environ, "FLEETLESS_WORKDIR": str(work)}
    at = f"{time.time() + 1.5:.3f}"
    procs = [subprocess.Popen([sys.executable, "-c", ETC_COPY.format(src=SRC), at], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(4)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    copies = {tuple(out.split()[:2]) for out, _ in outs}
    assert len(copies) == 1, copies
    shared, bpf = (Path(p) for p in copies.pop())
    assert shared.name.startswith("etc-shared-") and shared.parent == work
    assert bpf.parent.name.startswith("bpf-shared-") and bpf.parent.parent == work and bpf.stat().st_size > 0
    # whole, and no half-made copy left
    assert sorted(p.name for p in work.iterdir()) == sorted([shared.name, bpf.parent.name])
    later = subprocess.run([sys.executable, "-c", ETC_COPY.format(src=SRC), "0"], env=env, capture_output=True,
                           text=True, timeout=120)
    assert later.stdout.split() == [str(shared), str(bpf), "False"], later
    assert (shared / "passwd").read_text().startswith("nobody:x:")
    assert (shared / "ssl").is_dir() or not Path("/etc/ssl").is_dir()

    stale_old, stale_new = work / "etc-shared-0000000000000000dead", work / "etc-shared-0000000000000000beef"
    stale_bpf = work / "bpf-shared-0000000000000000dead"
    for stale in (stale_old, stale_new, stale_bpf):
        stale.mkdir()
        (stale / "passwd").write_text("old")

    def ago(days: float, *paths: Path) -> None:
        for path in paths:
            os.utime(path, (time.time() - days * 86400, time.time() - days * 86400))

    def sweep() -> list[str]:
        out = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {SRC!r}); "
                              "from fleetless.sandbox import bwrap; print(bwrap.sweep())"],
                             env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return sorted(p.name for p in work.iterdir())

    ago(30, stale_old, stale_bpf)  # made long ago, replaced minutes ago (by the copies above): kept
    everything = sorted([shared.name, bpf.parent.name, stale_old.name, stale_new.name, stale_bpf.name])
    assert sweep() == everything
    ago(2, shared, bpf.parent)  # replaced two days ago: gone; one made after its replacement stays
    ago(1, stale_new)
    assert sweep() == sorted([shared.name, bpf.parent.name, stale_new.name])


def test_an_in_place_edit_inside_a_copied_directory_makes_a_new_copy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sandbox's ``/etc`` copies whole directories (``/etc/ssl/certs``, ``/etc/ld.so.conf.d``):
    a file edited in place inside one (a CA appended to the bundle) changes no directory's mtime,
    yet the next copy holds the edit; a copy whose sources did not change is reused."""
    from fleetless.sandbox import _workspace

    monkeypatch.setenv("FLEETLESS_WORKDIR", str(tmp_path / "work"))
    monkeypatch.setattr(_workspace, "BELOW_TTL", 0.0)  # else looked at again after 10 s
    source = tmp_path / "certs"
    (source / "deeper").mkdir(parents=True)
    bundle = source / "deeper" / "bundle.crt"
    bundle.write_text("first CA\n")
    (source / "link.pem").symlink_to(bundle)

    def copy() -> Path:
        return _workspace.cached_copy("etc-test", "key", _workspace.signature([str(source)]),
                                      lambda d: shutil.copytree(source, d / "certs", symlinks=True))

    first = copy()
    assert copy() == first
    mtimes = (source.stat().st_mtime_ns, (source / "deeper").stat().st_mtime_ns)
    with open(bundle, "a") as f:
        f.write("second CA\n")
    assert (source.stat().st_mtime_ns, (source / "deeper").stat().st_mtime_ns) == mtimes
    second = copy()
    assert second != first
    assert (second / "certs" / "deeper" / "bundle.crt").read_text() == "first CA\nsecond CA\n"


def test_a_work_directory_others_may_write_or_a_planted_copy_is_never_shared(tmp_path: Path) -> None:
    """A shared copy is used only from a work directory of the drainer's own user that no one else
    may write (another one is refused altogether), and only if it is a real directory of that
    user: else the drainer makes its own copy, as it did before copies were shared."""
    if os.geteuid() != 0:
        pytest.skip("shared only where jobs run as leased uids (here: a root drainer)")
    from fleetless.sandbox import _workspace
    from fleetless.sandbox.bwrap import _filesystem

    open_work = tmp_path / "open"
    open_work.mkdir(mode=0o777)
    open_work.chmod(0o777)
    out = subprocess.run([sys.executable, "-c", ETC_COPY.format(src=SRC), "0"], capture_output=True, text=True,
                         env={**os.environ, "FLEETLESS_WORKDIR": str(open_work)}, timeout=120)
    assert out.returncode != 0 and not out.stdout  # others may write it: refused (issue 25, item 3)
    assert "refusing the work directory" in out.stderr and "writable by others" in out.stderr

    work = tmp_path / "work"
    work.mkdir(mode=0o711)
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "ld.so.preload").write_text("/tmp/evil.so\n")
    name = _workspace.shared_name("etc", _filesystem._etc_key(False),
                                  _workspace.signature(_filesystem._etc_paths(False)))
    (work / name).symlink_to(planted)
    out = subprocess.run([sys.executable, "-c", ETC_COPY.format(src=SRC), "0"], capture_output=True, text=True,
                         env={**os.environ, "FLEETLESS_WORKDIR": str(work)}, timeout=120)
    assert out.returncode == 0, out.stderr
    etc = Path(out.stdout.split()[0])
    assert etc.name != name and "-shared-" not in etc.name and not (etc / "ld.so.preload").exists()
    assert (work / name).is_symlink() and (planted / "ld.so.preload").exists()  # left alone


def test_venv_interpreter_outside_usr_is_bound(handlers: Callable[..., Path], sandboxes: list[BwrapSandbox]) -> None:
    """A venv outside /usr (made here from the system python, in a directory every user can reach,
    as a root drainer's job uids must) runs handlers: its prefix is bound at the same path."""
    base = Path(tempfile.mkdtemp(prefix="fleetless-venv-"))
    try:
        base.chmod(0o755)
        subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(base / "venv")], check=True)
        python = str(base / "venv" / "bin" / "python")
        folder = handlers(**{"ver.py": "import sys\nprint(sys.prefix, sys.version_info[:2] >= (3, 9))\n"})
        sbx = BwrapSandbox.create(Template(folder, Limits(), ENV, python=python))
        sandboxes.append(sbx)
        r = run_py(sbx, "ver")
        assert r.ok and r.stdout.split() == [str(base / "venv"), "True"], r
    finally:
        shutil.rmtree(base)


NONROOT = """
import json, logging, os, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
from pathlib import Path
from fleetless.sandbox import Limits, Template
from fleetless.sandbox.bwrap import BwrapSandbox
sbx = BwrapSandbox.create(Template(Path({folder!r}), Limits(), {{"PATH": "/usr/bin:/bin"}}), 60)
sbx.write("payload.json", "{{}}")
r = sbx.exec([sbx.python, "/handlers/own.py", "/workspace/payload.json"], 20)
out = (sbx.host_workspace / "made-by-job").stat()
print(json.dumps({{"r": [r.exit_code, r.stdout, r.stderr, r.killed], "owner": out.st_uid, "me": os.getuid()}}))
sbx.kill()
"""


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to start a drainer as another user")
def test_non_root_drainer_uid_mapping_and_rlimit_fallback() -> None:
    """A drainer running as an unprivileged user (65534 here): bwrap makes an unprivileged user
    namespace, the job is 65534 inside and can write its workspace; no cgroup is writable, so it
    says once which caps it still enforces."""
    folder = Path(tempfile.mkdtemp(prefix="fleetless-nonroot-"))
    workdir = Path(tempfile.mkdtemp(prefix="fleetless-nonroot-ws-"))
    try:
        folder.chmod(0o755)
        os.chown(workdir, 65534, 65534)
        (folder / "own.py").write_text(
            "import os\nopen('/workspace/made-by-job', 'w').write('x')\nprint(os.getuid(), os.getgid())\n"
        )
        env = {"PYTHONPATH": ":".join(pythonpath_for_others()), "FLEETLESS_WORKDIR": str(workdir),
               "PATH": "/usr/bin:/bin"}
        code = NONROOT.format(folder=str(folder))
        p = subprocess.run(
            ["/usr/bin/python3", "-c", code],
            capture_output=True,
            text=True,
            env=env,
            user=65534,
            group=65534,
            timeout=60,
        )
        if "cannot create namespaces" in p.stderr or "SandboxUnavailable" in p.stderr:
            pytest.skip(f"unprivileged user namespaces are not available: {p.stderr[-300:]}")
        assert p.returncode == 0, p.stderr
        out = json.loads(p.stdout)
        assert out["r"][0] == 0 and out["r"][1].strip() == "65534 65534", out
        assert out["owner"] == out["me"] == 65534  # the job's files belong to the drainer's user
        # said once, in a short line (issue 28: it was ~200 characters), that rlimits hold instead
        [said] = [line for line in p.stderr.splitlines() if "no writable cgroup for" in line]
        message = said.split("bwrap sandbox: ", 1)[1]  # (after the logging format's own prefix)
        assert message.endswith("; rlimits hold its jobs instead") and len(message) <= 90, said
    finally:
        subprocess.run(["rm", "-rf", str(folder), str(workdir)], check=False)
