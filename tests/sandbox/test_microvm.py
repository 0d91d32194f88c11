"""What only the ``microvm`` tier does, against real QEMU (no mocks); every exec boots a VM. What
every tier promises (results, limits, kills, no network, the exact environment, the end of the
VM with its drainer) is tested once for all tiers in ``test_contract.py``.

Skipped when ``qemu-system-x86_64`` or the image is missing; CI installs
``qemu-system-x86 busybox-static lz4`` and runs ``python -m fleetless.sandbox.microvm_image``
first, so the tests run there.
"""

from __future__ import annotations

import json
import os
import textwrap
import threading
from pathlib import Path

import pytest

from fleetless.sandbox import ExecResult, Limits, SandboxUnavailable, Template
from fleetless.sandbox.microvm import MicroVMSandbox, accel, network_mode

from proctools import wait_for

MiB = 1024 * 1024


def _unavailable() -> str | None:
    try:
        MicroVMSandbox.check()
    except SandboxUnavailable as exc:
        return str(exc)
    return None


_REASON = _unavailable()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(_REASON is not None, reason=f"microvm tier unavailable: {_REASON}"),
]


def _handlers(tmp_path: Path, **handlers: str) -> Path:
    """Write handlers: ``name_py="..."`` becomes ``name.py``; other names are executables."""
    d = tmp_path / "handlers"
    d.mkdir()
    for key, body in handlers.items():
        name = key[:-3] + ".py" if key.endswith("_py") else key
        path = d / name
        path.write_text(textwrap.dedent(body).lstrip())
        if not name.endswith(".py"):
            path.chmod(0o755)
    return d


def _qemu_pids() -> set[int]:
    pids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        state = stat[stat.rindex(")") + 2]
        if comm.startswith("qemu-system") and state != "Z":
            pids.add(int(entry))
    return pids





def _run_py(handlers: Path, kind: str, payload: bytes, timeout: float = 30,
            limits: Limits | None = None, env: dict[str, str] | None = None,
            ) -> tuple[MicroVMSandbox, ExecResult]:
    tpl = Template(handlers, limits or Limits(memory_bytes=128 * MiB), env or {})
    sbx = MicroVMSandbox.create(tpl, ttl_seconds=120)
    with sbx:
        sbx.write("payload.json", payload)
        res = sbx.exec([sbx.python, f"{sbx.handlers_path}/{kind}.py",
                        f"{sbx.workspace_path}/payload.json"], timeout)
    return sbx, res


def test_accel_is_reported() -> None:
    assert accel() in ("kvm", "tcg")
    assert MicroVMSandbox.accel() == accel()


@pytest.fixture(scope="module")
def inside(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """One boot that reports what a job can see and do inside the guest."""
    os.environ["DATABASE_URL"] = "postgresql://secret@db/prod"
    try:
        h = _handlers(tmp_path_factory.mktemp("inside"), probe_py="""
            import json, os, sys
            def attempt(fn):
                try:
                    return ["ok", fn()]
                except Exception as exc:
                    return ["error", type(exc).__name__]
            def write(path):
                with open(path, "w") as f:
                    f.write("x")
                return True
            print(json.dumps({
                "uid": os.getuid(), "cwd": os.getcwd(),
                "payload": open(sys.argv[1]).read(),
                "root": attempt(lambda: os.listdir("/root")),
                "shadow": attempt(lambda: open("/etc/shadow").read()),
                "host_path": os.path.exists(sys.argv[2]),
                "work": os.path.exists("/work"),
                "write_handlers": attempt(lambda: write("/handlers/new")),
                "write_handler": attempt(lambda: write("/handlers/probe.py")),
                "write_workspace": attempt(lambda: write("/workspace/out.txt")),
                "write_tmp": attempt(lambda: write("/tmp/t")),
                "channel": attempt(lambda: open("/dev/ttyS1", "w")),
                "console": attempt(lambda: write("/dev/console")),
                "serial0": attempt(lambda: write("/dev/ttyS0")),
            }))
        """)
        tpl = Template(h, Limits(memory_bytes=128 * MiB), {"FOO": "bar"})
        with MicroVMSandbox.create(tpl, ttl_seconds=120) as sbx:
            sbx.write("payload.json", "{}")
            res = sbx.exec([sbx.python, f"{sbx.handlers_path}/probe.py",
                            f"{sbx.workspace_path}/payload.json", str(h)], 30)
        assert res.exit_code == 0, res
        result: dict[str, object] = json.loads(res.stdout)
        return result
    finally:
        del os.environ["DATABASE_URL"]


def test_job_runs_as_nobody_in_the_workspace(inside: dict[str, object]) -> None:
    assert inside["uid"] == 65534 and inside["cwd"] == "/workspace"
    assert inside["payload"] == "{}"


def test_job_sees_no_host_files(inside: dict[str, object]) -> None:
    assert inside["root"] == ["error", "PermissionError"]
    assert inside["shadow"] == ["error", "FileNotFoundError"]
    assert inside["host_path"] is False and inside["work"] is False


def test_handlers_read_only_workspace_writable(inside: dict[str, object]) -> None:
    assert inside["write_handlers"] == ["error", "PermissionError"]
    assert inside["write_handler"] == ["error", "PermissionError"]
    assert inside["write_workspace"] == ["ok", True]
    assert inside["write_tmp"] == ["ok", True]
    # The result channel and the console are out of the job's reach.
    assert inside["channel"][0] == "error"  # type: ignore[index]
    assert inside["console"][0] == "error"  # type: ignore[index]
    assert inside["serial0"][0] == "error"  # type: ignore[index]


def test_job_cannot_forge_frames(tmp_path: Path) -> None:
    fake = ('FLEETLESS1 00000000000000000000000000000000 result {"id":"0","exit_code":0,'
            '"stdout":"","stderr":"","duration":0,"timed_out":false,"oom":false}')
    h = _handlers(tmp_path, forge_py=f"""
        import sys
        fake = {fake!r}
        for line in ("", fake, fake.replace("result", "done"), ""):
            print(line)
            print(line, file=sys.stderr)
        sys.stdout.flush()
        sys.exit(3)
    """)
    _sbx, res = _run_py(h, "forge", b"{}")
    assert res.exit_code == 3 and res.killed is None, res
    assert fake in res.stdout and fake in res.stderr


def test_a_watched_jobs_stdout_comes_as_it_is_written_and_survives_the_vms_destruction(tmp_path: Path) -> None:
    """With ``on_stdout`` set (a batch's pacer), the guest sends the job's stdout as it comes: the
    host sees the first line while the job still runs, and what came before the VM was destroyed
    is the exec's stdout (a batch's records of the jobs that ended). Before, a microVM's output
    came back only with its result, and a destroyed VM's exec had none (issue 26)."""
    h = _handlers(tmp_path, talk_py="""
        import sys, time
        print('{"first": 1}', flush=True)
        time.sleep(120)
        print("never")
    """)
    sbx = MicroVMSandbox.create(Template(h, Limits(memory_bytes=128 * MiB), {}), ttl_seconds=300)
    chunks: list[bytes] = []
    sbx.on_stdout = chunks.append
    done: list[ExecResult] = []
    thread = threading.Thread(target=lambda: done.append(
        sbx.exec([sbx.python, f"{sbx.handlers_path}/talk.py"], 200)))
    thread.start()
    try:
        wait_for(lambda: b"\n" in b"".join(chunks), timeout=180, what="the job's first line on the host")
        assert not done  # the job still runs
    finally:
        sbx.kill()
        thread.join(60)
    (res,) = done
    assert res.killed == "killed: sandbox destroyed", res
    assert res.stdout == '{"first": 1}\n' == b"".join(chunks).decode()


def test_a_watched_jobs_streamed_stdout_is_its_result_s_stdout(tmp_path: Path) -> None:
    """A job that ends: its stdout, streamed, is its result's, the cap kept (no copy sent twice)."""
    h = _handlers(tmp_path, many_py="""
        for i in range(2000):
            print(f"line {i}", flush=i % 100 == 0)
    """)
    sbx = MicroVMSandbox.create(Template(h, Limits(memory_bytes=128 * MiB, stdout_bytes=4096), {}),
                                ttl_seconds=300)
    chunks: list[bytes] = []
    sbx.on_stdout = chunks.append
    with sbx:
        res = sbx.exec([sbx.python, f"{sbx.handlers_path}/many.py"], 60)
    assert res.exit_code == 0 and res.killed is None, res
    assert res.stdout_cut and len(res.stdout) == 4096 and res.stdout.startswith("line 0\nline 1\n"), res
    assert b"".join(chunks).decode() == res.stdout


def test_network_limit_gives_a_restricted_interface(tmp_path: Path) -> None:
    # Only looks at the interfaces: no packet is sent anywhere.
    h = _handlers(tmp_path, ifaces_py='import os\nprint(" ".join(sorted(os.listdir("/sys/class/net"))))\n')
    limits = Limits(memory_bytes=128 * MiB, network=True)
    assert network_mode() == "restricted" or os.environ.get("FLEETLESS_MICROVM_NETWORK") == "user"
    sbx, res = _run_py(h, "ifaces", b"{}", limits=limits)
    assert res.exit_code == 0, res
    assert res.stdout.split() == ["eth0", "lo"]
    assert sbx.last_boot is not None and sbx.last_boot.accel == accel()  # each exec reports its boot


def test_the_old_module_names_are_the_subpackages_modules() -> None:
    import fleetless.sandbox.microvm_image as old_image
    import fleetless.sandbox.microvm_snapshot as old_snapshot
    from fleetless.sandbox.microvm import image, snapshot

    assert (old_image, old_snapshot) == (image, snapshot)
    assert old_image is image and old_snapshot is snapshot  # one module: patching either patches both


def test_a_kill_while_popen_has_not_yet_returned_the_vm_waits_for_the_vm(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A QEMU runs from its exec on, but the sandbox learns of it only once ``Popen`` returns: a
    kill in that window returned at once while the machine ran on (the contract's kill test failed
    so under load, one run in many). It now waits for the machine: held here by a Popen that
    returns QEMU's process only when the test says so."""
    import subprocess

    h = _handlers(tmp_path, idle_py="import time; time.sleep(120)")
    real_popen = subprocess.Popen
    spawned = threading.Event()
    release = threading.Event()
    machine: list[subprocess.Popen[bytes]] = []

    def slow_popen(argv: list[str], *args: object, **kwargs: object) -> subprocess.Popen[bytes]:
        proc: subprocess.Popen[bytes] = real_popen(argv, *args, **kwargs)  # type: ignore[call-overload]
        if "qemu-system" in os.path.basename(str(argv[0])) and not machine:
            machine.append(proc)
            spawned.set()
            release.wait(120)  # Popen has not returned: the sandbox holds no process yet
        return proc

    sbx = MicroVMSandbox.create(Template(h, Limits(memory_bytes=128 * MiB), {}), ttl_seconds=300)
    monkeypatch.setattr(subprocess, "Popen", slow_popen)
    done: list[ExecResult] = []
    job = threading.Thread(target=lambda: done.append(sbx.exec([sbx.python, f"{sbx.handlers_path}/idle.py"], 200)))
    job.start()
    killer = threading.Thread(target=sbx.kill)
    try:
        assert spawned.wait(120), "QEMU was never started"
        killer.start()
        killer.join(3)  # before: kill() returned at once, its machine still running
        assert killer.is_alive() or machine[0].poll() is not None, "kill() returned while its VM ran"
    finally:
        release.set()
        if killer.ident is None:
            killer.start()
        killer.join(60)
        job.join(60)
    assert not killer.is_alive() and machine[0].poll() is not None  # kill() returned: the VM is gone
    assert done and done[0].killed == "killed: sandbox destroyed", done
