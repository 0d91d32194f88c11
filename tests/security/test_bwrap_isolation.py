"""Hostile bwrap jobs under a root drainer (as CI runs them) and under a non-root one (issue 7).

One probe handler measures what a job can do to the host; the tests assert the outcome and
``docs/isolation.md`` shows it as a table. Harmless by construction: the only host value a job
tries to write is ``/proc/sys/kernel/core_pattern``, with the value it has just read; the denied
system calls are made with arguments that do nothing even where they are allowed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fleetless import Queue
from fleetless.sandbox import Limits, SandboxUnavailable, Template, _hostuid
from fleetless.sandbox.bwrap import BwrapSandbox

from .drains import pythonpath_for_others

SRC = str(Path(__file__).resolve().parents[2] / "src")
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="measures a root drainer")

#: x86_64 numbers of the calls the probe makes, with arguments that change nothing where allowed.
DENIED_CALLS = {
    "add_key": (248, 0, 0, 0, 0, 0), "request_key": (249, 0, 0, 0, 0), "keyctl": (250, 0, -3, 0),
    "mount": (165, 0, 0, 0, 0, 0), "umount2": (166, 0, 0), "pivot_root": (155, 0, 0),
    "unshare": (272, 0), "setns": (308, -1, 0), "clone(CLONE_NEWUSER)": (56, 0x10000000 | 17, 0, 0, 0, 0),
    "bpf": (321, -1, 0, 0), "perf_event_open": (298, 0, 0, -1, -1, 0), "userfaultfd": (323, 0),
    "init_module": (175, 0, 0, 0), "finit_module": (313, -1, 0, 0), "delete_module": (176, 0, 0),
    "kexec_load": (246, 0, 0, 0, 0), "kexec_file_load": (320, -1, -1, 0, 0, 0),
    "ptrace": (101, 12, 999_999, 0, 0), "process_vm_readv": (310, 1, 0, 0, 0, 0, 0),
    "acct": (163, 0), "swapoff": (168, 0), "reboot": (169, 0, 0, 0, 0),
    "settimeofday": (164, 0, 0), "clock_settime": (227, 0, 0),
    "open_by_handle_at": (304, -1, 0, 0), "name_to_handle_at": (303, -100, 0, 0, 0, 0),
    "iopl": (172, 0), "ioperm": (173, 0, 0, 0), "quotactl": (179, 0, 0, 0, 0),
    "io_uring_setup": (425, 0, 0), "x32 unshare": (0x40000000 | 272, 0), "memfd_secret": (447, 0),
}

PROBE = textwrap.dedent(r'''
    import ctypes, errno, json, mmap, os, shutil, stat, struct, subprocess, sys, threading
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    out = {"uid": os.getuid()}

    def result(ret):
        return "ok" if ret >= 0 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))

    calls = json.load(open(sys.argv[1]))["calls"]
    out["calls"] = {name: result(libc.syscall(*[ctypes.c_long(a) for a in args])) for name, args in calls.items()}
    out["calls"]["clone3"] = result(libc.syscall(ctypes.c_long(435), ctypes.c_long(0), ctypes.c_long(0)))
    # the i386 ABI (int 0x80): unshare(0) is call 310 there
    code = b"\x53\xb8" + struct.pack("<I", 310) + b"\x31\xdb\xcd\x80\x5b\xc3"
    page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    page.write(code)
    ret = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(page)))()
    out["calls"]["i386 unshare"] = "ok" if ret >= 0 else errno.errorcode.get(-ret, str(-ret))

    def attempt(f):
        try:
            f()
            return "ok"
        except OSError as exc:
            return errno.errorcode.get(exc.errno, str(exc.errno))

    def rewrite_core_pattern():  # with the value it has now: changes nothing where it is allowed
        value = open("/proc/sys/kernel/core_pattern").read()
        with open("/proc/sys/kernel/core_pattern", "w") as f:
            f.write(value)

    out["write /proc/sys/kernel/core_pattern"] = attempt(rewrite_core_pattern)
    out["read /proc/timer_list (0400 root)"] = attempt(lambda: open("/proc/timer_list").read(1))
    out["mknod a device"] = attempt(lambda: os.mknod("null-copy", 0o666 | stat.S_IFCHR, os.makedev(1, 3)))
    out["pid1 cmdline"] = open("/proc/1/cmdline", "rb").read().decode().split("\0")
    out["pid1 environ"] = open("/proc/1/environ", "rb").read().decode()
    out["workspace mount"] = [m.split()[5] for m in open("/proc/self/mountinfo") if m.split()[4] == "/workspace"]
    # a setuid copy of id, left for the host to try, in a workspace it tries to open to everyone
    shutil.copy("/usr/bin/id", "id-suid")
    os.chmod("id-suid", 0o4755)
    out["chmod 0777 its workspace"] = attempt(lambda: os.chmod(".", 0o777))
    out["own setuid copy runs as"] = subprocess.run(["./id-suid", "-u"], capture_output=True, text=True).stdout.strip()
    # ordinary work still runs under the filter: threads, fork/exec, a shell script
    box = []
    t = threading.Thread(target=lambda: box.append(sum(range(1000))))
    t.start()
    t.join()
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    script = subprocess.run(["sh", "-c", "echo $((6 * 7)) | cat"], capture_output=True, text=True)
    out["ordinary"] = [box == [499500], os.waitpid(pid, 0)[1] >> 8 == 7, script.stdout.strip()]
    open("made-by-job", "w").write("x")
    print(json.dumps(out))
''')


@pytest.fixture(autouse=True)
def _bwrap(require_tier: Callable[[str], None]) -> None:
    require_tier("bwrap")


@pytest.fixture
def handlers(tmp_path: Path) -> Path:
    folder = tmp_path / "handlers"
    folder.mkdir()
    (folder / "probe.py").write_text(PROBE)
    return folder


@pytest.fixture
def sandboxes() -> Iterator[contextlib.ExitStack]:
    """Sandboxes entered on it are killed after the test."""
    with contextlib.ExitStack() as stack:
        yield stack


def probe(sbx: BwrapSandbox) -> dict[str, Any]:
    sbx.write("payload.json", json.dumps({"calls": DENIED_CALLS}))
    r = sbx.exec([sbx.python, "/handlers/probe.py", "/workspace/payload.json"], 60)
    assert r.ok, r
    out: dict[str, Any] = json.loads(r.stdout)
    return out


def assert_confined(out: dict[str, Any]) -> None:
    """What holds for every bwrap job, root drainer or not."""
    assert out["calls"] == {**{name: "EPERM" for name in DENIED_CALLS}, "clone3": "ENOSYS", "i386 unshare": "EPERM"}
    assert out["write /proc/sys/kernel/core_pattern"] in ("EACCES", "EPERM", "EROFS")
    assert out["read /proc/timer_list (0400 root)"] in ("EACCES", "EPERM")
    assert out["mknod a device"] == "EPERM"
    assert out["pid1 cmdline"][:4] == ["./bwrap", "--args", "3", "--"], out["pid1 cmdline"]
    # after "--" only the job's own argv: its interpreter (which the job runs anyway) and /handlers/…
    # (a drainer without a pids cgroup runs it under prlimit --nproc: the pids cap, issue 25 item 2)
    argv = out["pid1 cmdline"][4:]
    if argv[0].endswith("/prlimit"):
        assert argv[1].startswith("--nproc=") and argv[2] == "--", argv
        argv = argv[3:]
    assert argv[1].startswith("/handlers/"), out["pid1 cmdline"]
    assert not any(p.startswith(("/tmp/", "/work/", "/root/", "/run/")) for p in out["pid1 cmdline"][5:])
    assert out["pid1 environ"] == ""
    assert all({"nosuid", "nodev"} <= set(opts.split(",")) for opts in out["workspace mount"]), out
    assert out["own setuid copy runs as"] == "65534"  # nosuid and no_new_privs: no elevation inside
    assert out["ordinary"] == [True, True, "42"]


@root_only
def test_a_root_drainers_job_is_an_unprivileged_host_uid_and_confined(
    handlers: Path, sandboxes: contextlib.ExitStack
) -> None:
    """Issue 7 item 1: the job was host uid 0 (it rewrote core_pattern, read root-only /proc files,
    left a setuid-root binary). Now it is a leased uid of the job range, and the seccomp filter,
    ``/proc/1/cmdline`` and nosuid/nodev workspace hold."""
    sbx = sandboxes.enter_context(BwrapSandbox.create(Template(handlers, Limits(), ENV)))
    out = probe(sbx)
    assert_confined(out)
    assert sbx.host_workspace is not None
    owner = (sbx.host_workspace / "made-by-job").stat().st_uid
    assert owner in _hostuid.configured_range() and owner not in (0, os.getuid()), owner
    assert (sbx.host_workspace / "id-suid").stat().st_uid == owner  # setuid to it grants nothing of root's
    assert out["chmod 0777 its workspace"] == "ok"  # its own: the parent is what keeps others out


@root_only
def test_a_setuid_file_left_in_a_workspace_runs_for_no_other_user(
    handlers: Path, sandboxes: contextlib.ExitStack
) -> None:
    """The job left a setuid copy of ``id`` and made its workspace 0777: another host user cannot
    reach it (the workspace's parent, outside the sandbox, is root's, group the job's gid, 0710),
    and root running it stays root: the workspace is the job's own tmpfs, mounted ``nosuid``
    (issue 25 item 8), so the bit means nothing on the host either. (Before that tmpfs, root running
    it became the job's unprivileged uid.)"""
    sbx = sandboxes.enter_context(BwrapSandbox.create(Template(handlers, Limits(), ENV)))
    probe(sbx)
    assert sbx.host_workspace is not None
    copy = sbx.host_workspace / "id-suid"
    # (not through setpriv: it keeps root's capabilities until its execve, which then succeeds)
    with pytest.raises(PermissionError):
        subprocess.run([str(copy), "-u"], user=65534, group=65534, extra_groups=[])
    as_root = subprocess.run([str(copy), "-u"], capture_output=True, text=True)
    st = copy.stat()
    assert st.st_mode & 0o4000 and st.st_uid != 0, oct(st.st_mode)  # the job's, setuid
    assert as_root.stdout.strip() == "0", as_root


@root_only
def test_concurrent_jobs_have_distinct_host_uids(handlers: Path, sandboxes: contextlib.ExitStack) -> None:
    (handlers / "own.py").write_text("open('/workspace/mine', 'w').write('x')\n")
    boxes = [sandboxes.enter_context(BwrapSandbox.create(Template(handlers, Limits(), ENV))) for _ in range(3)]
    owners = []
    for sbx in boxes:
        r = sbx.exec([sbx.python, "/handlers/own.py"], 30)
        assert r.ok, r
        assert sbx.host_workspace is not None
        owners.append((sbx.host_workspace / "mine").stat().st_uid)
    assert len(set(owners)) == 3 and all(o in _hostuid.configured_range() for o in owners), owners


@root_only
def test_a_handler_interpreter_only_root_can_reach_is_one_clear_error(handlers: Path, tmp_path: Path) -> None:
    """An interpreter whose own directory other users may not read (a 0700 venv) cannot be bound
    for the job's uid: one clear error before anything runs. (One merely *under* a directory only
    root may search is bound back: test_handler_interpreters.py's root-only venv test.)"""
    hidden = tmp_path / "hidden"
    hidden.mkdir(mode=0o700)
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(hidden / "venv")], check=True)
    (hidden / "venv").chmod(0o700)
    with pytest.raises(SandboxUnavailable, match=r"venv is not readable by other users"):
        BwrapSandbox.create(Template(handlers, Limits(), ENV, python=str(hidden / "venv" / "bin" / "python")))


NONROOT = """
import json, sys
from pathlib import Path
from fleetless.sandbox import Limits, Template
from fleetless.sandbox.bwrap import BwrapSandbox
sbx = BwrapSandbox.create(Template(Path({folder!r}), Limits(), {{"PATH": "/usr/bin:/bin"}}), 120)
sbx.write("payload.json", json.dumps({{"calls": {calls!r}}}))
r = sbx.exec([sbx.python, "/handlers/probe.py", "/workspace/payload.json"], 60)
owner = (sbx.host_workspace / "made-by-job").stat().st_uid
print(json.dumps({{"ok": r.ok, "stdout": r.stdout, "stderr": r.stderr, "owner": owner,
                  "workspace": str(sbx.host_workspace)}}), flush=True)
sys.stdin.readline()  # the test tries the job's setuid copy as another user meanwhile
sbx.kill()
"""


@root_only
def test_a_non_root_drainers_job_is_confined_the_same_way() -> None:
    """The same probe with the drainer running as 65534 (``nobody``): the job is the drainer's own
    uid on the host (an unprivileged user namespace can map no other), everything else holds."""
    folder = Path(tempfile.mkdtemp(prefix="fleetless-sec-"))
    workdir = Path(tempfile.mkdtemp(prefix="fleetless-sec-ws-"))
    try:
        folder.chmod(0o755)
        (folder / "probe.py").write_text(PROBE)
        os.chown(workdir, 65534, 65534)
        workdir.chmod(0o711)  # as the default work directory: others may pass, not list
        env = {"PYTHONPATH": ":".join(pythonpath_for_others()), "FLEETLESS_WORKDIR": str(workdir),
               "PATH": "/usr/bin:/bin"}
        code = NONROOT.format(folder=str(folder), calls=DENIED_CALLS)
        drainer = subprocess.Popen(["/usr/bin/python3", "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, env=env, user=65534, group=65534,
                                   extra_groups=[])
        try:
            assert drainer.stdout is not None and drainer.stdin is not None
            line = drainer.stdout.readline()
            if not line:
                _, err = drainer.communicate(timeout=60)
                if "cannot create namespaces" in err:
                    pytest.skip(f"unprivileged user namespaces are not available: {err[-300:]}")
                raise AssertionError(err)
            result = json.loads(line)
            assert result["ok"], result
            out = json.loads(result["stdout"])
            assert_confined(out)
            assert result["owner"] == 65534  # the drainer's uid: the one thing a root drainer does better
            with pytest.raises(PermissionError):  # another user, while the job's workspace exists
                subprocess.run([f"{result['workspace']}/id-suid", "-u"], user=65533, group=65533, extra_groups=[])
            drainer.stdin.write("\n")
            drainer.stdin.flush()
            assert drainer.wait(timeout=60) == 0
        finally:
            if drainer.poll() is None:
                drainer.kill()
                drainer.wait()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)


def test_the_filter_is_built_once_per_drainer_process() -> None:
    from fleetless.sandbox.bwrap import _seccomp

    assert _seccomp.bpf() is _seccomp.bpf() and len(_seccomp.bpf()) % 8 == 0


@root_only
def test_drain_runs_jobs_as_uids_of_the_job_uids_flag(
    dsn: str, queue: Queue, fleetless: Callable[..., subprocess.CompletedProcess[str]], handlers: Path,
    tmp_path: Path,
) -> None:
    """``fleetless drain --job-uids FIRST-LAST`` (or ``FLEETLESS_JOB_UIDS``) is the range jobs lease
    from; the lease files of this drain's own run directory show which uids it used."""
    (handlers / "ok.py").write_text("print('fine')\n")
    queue.enqueue("ok", {})
    run_dir = tmp_path / "run"
    r = fleetless("drain", "--handlers", str(handlers), "--sandbox", "bwrap", "--job-uids", "2000300000-2000300009",
                  dsn=dsn, env={_hostuid.RUN_DIR_ENV: str(run_dir)})
    assert r.returncode == 0 and "done 1" in r.stdout, r.stderr
    assert sorted(p.name for p in (run_dir / "job-uids").iterdir())[:1] == ["2000300000"]
    bad = fleetless("drain", "--handlers", str(handlers), "--sandbox", "bwrap", dsn=dsn,
                    env={_hostuid.ENV: "2000300000"})
    assert bad.returncode == 2 and "is not FIRST-LAST" in bad.stderr, bad.stderr


@root_only
def test_a_work_directory_only_root_can_reach_is_one_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a root drainer bwrap binds the workspace as the job's uid: a FLEETLESS_WORKDIR below a
    0700 directory stops the drain before it claims (``check``), with the directory named."""
    hidden = tmp_path / "hidden"
    hidden.mkdir(mode=0o700)
    monkeypatch.setenv("FLEETLESS_WORKDIR", str(hidden / "work"))
    with pytest.raises(SandboxUnavailable, match=f"work directory .* {hidden} is not searchable by other users"):
        BwrapSandbox.check()


REACH_DRAINER = """
import json, os, sys
drainer = json.load(open(sys.argv[1]))["drainer"]
out = {"visible": []}
for name in os.listdir("/proc"):
    if name.isdigit():
        try:
            out["visible"].append(open(f"/proc/{name}/cmdline", "rb").read().replace(b"\\0", b" ").decode())
        except OSError:
            out["visible"].append("?")
def attempt(call):
    try:
        call()
        return "allowed"
    except OSError as exc:
        return type(exc).__name__
out["terminal"] = attempt(lambda: open(f"/proc/{drainer}/fd/2", "w").write("forged\\n"))
out["environ"] = attempt(lambda: open(f"/proc/{drainer}/environ", "rb").read())
out["signal"] = attempt(lambda: os.kill(drainer, 0))
print(json.dumps(out))
"""


@pytest.mark.parametrize("user", [None, 65534], ids=["root-drainer", "nonroot-drainer"])
def test_a_bwrap_job_cannot_reach_its_drainer(user: int | None, dsn: str, queue: Any, sql: Any) -> None:
    """Told its drainer's host pid, a bwrap job finds no such process: its /proc is its own pid
    namespace's (bwrap's pid 1, itself), so it cannot signal the drainer, read its environment nor
    write the operator's terminal through /proc/<drainer>/fd/2; also under a non-root drainer, whose
    jobs are the drainer's own uid on the host (what that uid still shares: docs/isolation.md)."""
    from .drains import drain, handlers_dir, need_user, work_dir
    from proctools import wait_for

    need_user(user)
    base = Path(tempfile.mkdtemp(prefix="fleetless-sec-"))
    d = None
    try:
        base.chmod(0o755)
        h = handlers_dir(base, **{"reach.py": REACH_DRAINER})
        work = work_dir(base, user)
        d = drain(dsn, h, work, "--watch", tier="bwrap", user=user, start=True)
        assert isinstance(d, subprocess.Popen)
        queue.enqueue("reach", {"drainer": d.pid}, max_attempts=1)  # (the running drainer's pid)
        wait_for(lambda: sql("SELECT 1 FROM fleetless.jobs WHERE status IN ('done', 'dead')"), timeout=120,
                 what="the job to finish")
        d.terminate()
        _, err = d.communicate(timeout=120)
        assert "forged" not in err
        [(status, result)] = sql("SELECT status, result FROM fleetless.jobs")
        assert status == "done", result
        out = json.loads(result)
        assert {k: out[k] for k in ("terminal", "environ", "signal")} == {
            "terminal": "FileNotFoundError", "environ": "FileNotFoundError", "signal": "ProcessLookupError"}, out
        assert not any("fleetless.cli" in c for c in out["visible"]), out
        assert len(out["visible"]) <= 3, out  # bwrap's pid 1, the job (and what it runs)
    finally:
        if d is not None and d.poll() is None:
            d.kill()
            d.wait()
        subprocess.run(["rm", "-rf", "--one-file-system", str(base)], check=False)
