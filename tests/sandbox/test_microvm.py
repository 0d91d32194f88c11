"""The ``microvm`` tier against real QEMU (no mocks); every exec boots a VM (~2 s under TCG).

Skipped when ``qemu-system-x86_64`` or the image is missing; CI installs
``qemu-system-x86 busybox-static lz4`` and runs ``python -m fleetless.sandbox.microvm_image``
first, so the tests run there.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from fleetless.sandbox import ExecResult, Limits, SandboxUnavailable, Template
from fleetless.sandbox.microvm import MicroVMSandbox, accel, network_mode

from proctools import alive

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


def test_python_handler_reads_payload(tmp_path: Path) -> None:
    h = _handlers(tmp_path, add_py="""
        import json, sys
        d = json.load(open(sys.argv[1]))
        print(json.dumps({"sum": d["a"] + d["b"]}))
    """)
    sbx, res = _run_py(h, "add", b'{"a": 2, "b": 40}')
    assert res.exit_code == 0 and res.killed is None, res
    assert json.loads(res.stdout) == {"sum": 42}
    assert sbx.last_boot is not None and sbx.last_boot.accel == accel()


def test_exit_1_keeps_stderr_tail_and_stdout_head(tmp_path: Path) -> None:
    # An executable handler (shebang), as the drainer runs non-Python ones.
    h = _handlers(tmp_path, fail="""
        #!/bin/sh
        echo START
        seq 1 20000
        seq 1 20000 >&2
        echo "boom: payload was $(cat "$1")" >&2
        exit 1
    """)
    limits = Limits(memory_bytes=128 * MiB, stdout_bytes=100, stderr_bytes=200)
    sbx = MicroVMSandbox.create(Template(h, limits), ttl_seconds=120)
    with sbx:
        sbx.write("p.txt", "xyz")
        res = sbx.exec([f"{sbx.handlers_path}/fail", f"{sbx.workspace_path}/p.txt"], 30)
    assert res.exit_code == 1 and res.killed is None, res
    assert res.stdout.startswith("START\n1\n2\n") and len(res.stdout) == 100
    assert res.stderr.endswith("boom: payload was xyz\n") and len(res.stderr) == 200


def test_timeout_kills_the_vm(tmp_path: Path) -> None:
    h = _handlers(tmp_path, slow_py="""
        import time
        print("started", flush=True)
        time.sleep(600)
    """)
    started = time.monotonic()
    sbx, res = _run_py(h, "slow", b"{}", timeout=2)
    elapsed = time.monotonic() - started
    assert res.killed == "killed: timeout after 2 s", res
    assert res.exit_code == -signal.SIGKILL
    assert res.stdout == "started\n"
    assert elapsed < 30
    assert sbx.last_boot is not None and not alive(sbx.last_boot.pid)  # this VM's qemu is gone
    # (not "no new qemu at all": other VMs may be booting on the same machine)


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
                "env": dict(os.environ),
                "uid": os.getuid(), "cwd": os.getcwd(),
                "payload": open(sys.argv[1]).read(),
                "root": attempt(lambda: os.listdir("/root")),
                "shadow": attempt(lambda: open("/etc/shadow").read()),
                "host_path": os.path.exists(sys.argv[2]),
                "work": os.path.exists("/work"),
                "net": sorted(os.listdir("/sys/class/net")),
                "netdev": [l.split(":")[0].strip() for l in open("/proc/net/dev").readlines()[2:]],
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


def test_job_sees_only_the_template_env(inside: dict[str, object]) -> None:
    assert inside["env"] == {"FOO": "bar", "HOME": "/workspace"}  # HOME: the workspace, in every tier
    assert inside["uid"] == 65534 and inside["cwd"] == "/workspace"
    assert inside["payload"] == "{}"


def test_job_sees_no_host_files(inside: dict[str, object]) -> None:
    assert inside["root"] == ["error", "PermissionError"]
    assert inside["shadow"] == ["error", "FileNotFoundError"]
    assert inside["host_path"] is False and inside["work"] is False


def test_no_network_interface_but_lo(inside: dict[str, object]) -> None:
    assert inside["net"] == ["lo"]
    assert inside["netdev"] == ["lo"]


def test_handlers_read_only_workspace_writable(inside: dict[str, object]) -> None:
    assert inside["write_handlers"] == ["error", "PermissionError"]
    assert inside["write_handler"] == ["error", "PermissionError"]
    assert inside["write_workspace"] == ["ok", True]
    assert inside["write_tmp"] == ["ok", True]
    # The result channel and the console are out of the job's reach.
    assert inside["channel"][0] == "error"  # type: ignore[index]
    assert inside["console"][0] == "error"  # type: ignore[index]
    assert inside["serial0"][0] == "error"  # type: ignore[index]


def test_memory_bomb_is_contained(tmp_path: Path) -> None:
    h = _handlers(tmp_path, bomb_py="""
        chunks = []
        while True:
            chunks.append(b"x" * (4 << 20))
    """)
    _sbx, res = _run_py(h, "bomb", b"{}", limits=Limits(memory_bytes=128 * MiB))
    assert res.exit_code == -signal.SIGKILL, res
    assert res.killed == "killed: memory limit 128 MiB exceeded", res


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


def test_kill_during_exec_leaves_nothing(tmp_path: Path) -> None:
    h = _handlers(tmp_path, slow_py="import time\ntime.sleep(600)\n")
    tmp_before = set(os.listdir("/tmp"))
    before = _qemu_pids()
    sbx = MicroVMSandbox.create(Template(h, Limits(memory_bytes=128 * MiB)), ttl_seconds=120)
    sbx.write("payload.json", "{}")
    results: list[ExecResult] = []
    t = threading.Thread(target=lambda: results.append(
        sbx.exec([sbx.python, f"{sbx.handlers_path}/slow.py"], 300)))
    t.start()
    deadline = time.monotonic() + 30
    while not (_qemu_pids() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    spawned = _qemu_pids() - before
    assert spawned, "no qemu process was started"
    sbx.kill()
    sbx.kill()  # idempotent
    t.join(15)
    assert not t.is_alive()
    assert results and results[0].killed == "killed: sandbox destroyed", results
    assert not any(alive(p) for p in spawned)
    leftovers = {n for n in set(os.listdir("/tmp")) - tmp_before if "fleetless" in n}
    assert not leftovers


def test_parent_death_kills_the_vm(tmp_path: Path) -> None:
    h = _handlers(tmp_path, slow_py="import time\ntime.sleep(600)\n")
    script = textwrap.dedent(f"""
        from pathlib import Path
        from fleetless.sandbox import Limits, Template
        from fleetless.sandbox.microvm import MicroVMSandbox
        sbx = MicroVMSandbox.create(Template(Path({str(h)!r}), Limits(memory_bytes=128 << 20)))
        sbx.exec([sbx.python, "/handlers/slow.py"], 300)
    """)
    before = _qemu_pids()
    child = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 30
    spawned: set[int] = set()
    while time.monotonic() < deadline:
        spawned = {p for p in _qemu_pids() - before if _ppid(p) == child.pid}
        if spawned:
            break
        time.sleep(0.05)
    try:
        assert spawned, "the child started no qemu"
        time.sleep(0.5)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    deadline = time.monotonic() + 10
    while any(alive(p) for p in spawned) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in spawned)


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return -1
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def test_network_limit_gives_a_restricted_interface(tmp_path: Path) -> None:
    # Only looks at the interfaces: no packet is sent anywhere.
    h = _handlers(tmp_path, ifaces_py='import os\nprint(" ".join(sorted(os.listdir("/sys/class/net"))))\n')
    limits = Limits(memory_bytes=128 * MiB, network=True)
    assert network_mode() == "restricted" or os.environ.get("FLEETLESS_MICROVM_NETWORK") == "user"
    _sbx, res = _run_py(h, "ifaces", b"{}", limits=limits)
    assert res.exit_code == 0, res
    assert res.stdout.split() == ["eth0", "lo"]
