"""The ``microvm`` tier restoring a snapshot per job (real QEMU, real drains).

A snapshot is built for 128 MiB guests (the tests' size; ``build-image`` builds the default
512 MiB one) in the image's cache, once. Skipped like ``test_microvm.py`` when QEMU or the image
is missing.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import textwrap
import threading
import time
from pathlib import Path

import pytest

from fleetless import Queue
from fleetless.drainer import DrainConfig, Drainer
from fleetless.sandbox import ExecResult, Limits, SandboxUnavailable, Template, microvm
from fleetless.sandbox.microvm import MicroVMSandbox
from fleetless.sandbox.microvm import snapshot as microvm_snapshot
from fleetless.sandbox.microvm.guest_init import AGENT_WAIT
from fleetless.sandbox.microvm.image import load_image

MiB = 1024 * 1024
MEMORY = 128 * MiB


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


@pytest.fixture(autouse=True)
def _restores_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLEETLESS_MICROVM_SNAPSHOT", raising=False)  # the default: restores


@pytest.fixture(scope="module")
def snapshot() -> Path:
    return microvm_snapshot.build_snapshot(load_image(), MEMORY // MiB, 1)


def _handlers(tmp_path: Path, **handlers: str) -> Path:
    d = tmp_path / "handlers"
    d.mkdir(exist_ok=True)
    for name, body in handlers.items():
        (d / name).write_text(textwrap.dedent(body).lstrip())
    return d


def _run(handlers: Path, kind: str, payload: bytes = b"{}", env: dict[str, str] | None = None,
         timeout: float = 60) -> tuple[MicroVMSandbox, ExecResult]:
    sbx = MicroVMSandbox.create(Template(handlers, Limits(memory_bytes=MEMORY), env or {}),
                                ttl_seconds=180)
    with sbx:
        sbx.write("payload.json", payload)
        res = sbx.exec([sbx.python, f"{sbx.handlers_path}/{kind}.py",
                        f"{sbx.workspace_path}/payload.json"], timeout)
    return sbx, res


def test_a_restored_guest_runs_the_python_handler_contract(snapshot: Path, tmp_path: Path) -> None:
    h = _handlers(tmp_path, **{"add.py": """
        import atexit, json, os, sys
        atexit.register(lambda: print("atexit ran"))
        d = json.load(open(sys.argv[1]))
        print(json.dumps({"sum": d["a"] + d["b"], "name": __name__, "argv": sys.argv,
                          "cwd": os.getcwd(), "uid": os.getuid(), "path0": sys.path[0],
                          "env": sorted(os.environ)}))
    """, "boom.py": """
        print("before")
        1 / 0
    """, "three.py": """
        import sys
        sys.stderr.write("bad input\\n")
        sys.exit(3)
    """})
    sbx, res = _run(h, "add", b'{"a": 2, "b": 40}', env={"LANG": "C.UTF-8"})
    assert sbx.last_boot is not None and sbx.last_boot.restored, sbx.last_boot
    assert res.exit_code == 0 and res.killed is None, res
    first, second = res.stdout.splitlines()
    assert json.loads(first) == {"sum": 42, "name": "__main__",
                                 "argv": ["/handlers/add.py", "/workspace/payload.json"],
                                 "cwd": "/workspace", "uid": 65534, "path0": "/handlers",
                                 "env": ["HOME", "LANG"]}
    assert second == "atexit ran"
    sbx, res = _run(h, "boom")
    assert sbx.last_boot is not None and sbx.last_boot.restored
    assert (res.exit_code, res.stdout) == (1, "before\n"), res
    assert res.stderr.startswith("Traceback (most recent call last):\n  File \"/handlers/boom.py\"")
    assert res.stderr.endswith("ZeroDivisionError: division by zero\n")
    sbx, res = _run(h, "three")
    assert sbx.last_boot is not None and sbx.last_boot.restored
    assert (res.exit_code, res.stderr) == (3, "bad input\n"), res


def test_two_restored_guests_get_different_random_bytes_and_the_current_time(
        snapshot: Path, tmp_path: Path) -> None:
    h = _handlers(tmp_path, **{"rand.py": """
        import json, os, random, time, uuid
        print(json.dumps({"urandom": os.urandom(16).hex(), "random": random.random(),
                          "uuid": str(uuid.uuid4()), "time": time.time()}))
    """})
    seen = []
    for _ in range(2):
        before = time.time()
        sbx, res = _run(h, "rand")
        after = time.time()
        assert sbx.last_boot is not None and sbx.last_boot.restored
        assert res.exit_code == 0, res
        out = json.loads(res.stdout)
        # the guest's clock is the host's at restore (give a slow host's serial link 30 s)
        assert before - 1 <= out["time"] <= after + 30, (before, out["time"], after)
        seen.append(out)
    for field in ("urandom", "random", "uuid"):
        assert seen[0][field] != seen[1][field], field


def test_a_handler_setting_pythonpath_runs_in_a_fresh_interpreter(snapshot: Path,
                                                                  tmp_path: Path) -> None:
    h = _handlers(tmp_path, **{"path.py": """
        import sys
        print("/opt/extra" in sys.path)
    """})
    sbx, res = _run(h, "path", env={"PYTHONPATH": "/opt/extra"})
    assert sbx.last_boot is not None and sbx.last_boot.restored
    assert (res.exit_code, res.stdout) == (0, "True\n"), res


@pytest.fixture()
def private_image(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The image, hard-linked into a cache of this test's own, with a 128 MiB snapshot."""
    src = load_image().directory
    d = tmp_path / "cache"
    d.mkdir()
    for name in ("vmlinux", "initramfs.cpio", "manifest.json", "accel.json"):
        if (src / name).exists():
            try:
                os.link(src / name, d / name)
            except OSError:
                shutil.copyfile(src / name, d / name)
    monkeypatch.setenv("FLEETLESS_CACHE", str(d))
    microvm_snapshot.build_snapshot(load_image(d), MEMORY // MiB, 1)
    return d


def _edit_key(image_dir: Path, **changes: str) -> None:
    path = image_dir / "snapshots" / f"{MEMORY // MiB}m-1c" / "snapshot.json"
    key = json.loads(path.read_text())
    key.update(changes)
    path.write_text(json.dumps(key))


def _fallback_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if "cold boot instead of a snapshot restore" in r.getMessage()]


def test_a_snapshot_of_another_qemu_version_falls_back_to_cold_boot_saying_why_once(
        private_image: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    h = _handlers(tmp_path, **{"ok.py": "print('ok')"})
    sbx, res = _run(h, "ok")
    assert sbx.last_boot is not None and sbx.last_boot.restored and res.stdout == "ok\n"
    _edit_key(private_image, qemu="QEMU emulator version 1.0.0")
    caplog.set_level(logging.WARNING, logger="fleetless.sandbox.microvm")
    for _ in range(2):
        sbx, res = _run(h, "ok")
        assert sbx.last_boot is not None and not sbx.last_boot.restored
        assert (res.exit_code, res.stdout) == (0, "ok\n"), res
    lines = _fallback_lines(caplog)
    assert len(lines) == 1 and "QEMU version changed" in lines[0] \
        and "1.0.0" in lines[0], lines


def test_a_snapshot_of_a_changed_image_or_missing_file_falls_back_to_cold_boot(
        private_image: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    h = _handlers(tmp_path, **{"ok.py": "print('ok')"})
    caplog.set_level(logging.WARNING, logger="fleetless.sandbox.microvm")
    _edit_key(private_image, image="0" * 64)
    sbx, res = _run(h, "ok")
    assert sbx.last_boot is not None and not sbx.last_boot.restored
    assert (res.exit_code, res.stdout) == (0, "ok\n"), res
    assert ["image changed" in line for line in _fallback_lines(caplog)] == [True]
    # rebuilding replaces the stale snapshot; a missing file is said too
    microvm_snapshot.build_snapshot(load_image(private_image), MEMORY // MiB, 1)
    state = private_image / "snapshots" / f"{MEMORY // MiB}m-1c" / "state"
    state.unlink()
    sbx, res = _run(h, "ok")
    assert sbx.last_boot is not None and not sbx.last_boot.restored
    assert (res.exit_code, res.stdout) == (0, "ok\n"), res
    lines = _fallback_lines(caplog)
    assert len(lines) == 2 and "snapshot file missing" in lines[1] and str(state) in lines[1]


def test_a_drain_restores_a_snapshot_per_job(snapshot: Path, queue: Queue, handlers, sql,
                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("FLEETLESS_WORKDIR", str(tmp_path / "work"))
    caplog.set_level(logging.WARNING, logger="fleetless.sandbox.microvm")
    h = handlers(**{"double.py": """
        import json, os, sys
        print(json.load(open(sys.argv[1]))["n"] * 2, os.urandom(8).hex())
    """, "fail.py": """
        import sys
        sys.stderr.write("bad input\\n")
        sys.exit(3)
    """, "hang.py": "import time; print('started', flush=True); time.sleep(600)"})
    ok = [queue.enqueue("double", {"n": n}) for n in range(3)]
    failed = queue.enqueue("fail", {}, max_attempts=1)
    hung = queue.enqueue("hang", {}, max_attempts=1, timeout=2)
    Drainer(queue, DrainConfig(handlers_dir=h, sandbox="microvm", concurrency=2, timeout=60,
                               limits=Limits(memory_bytes=MEMORY))).run()
    rows = {r[0]: r[1:] for r in sql("SELECT id, status, result, last_error FROM fleetless.jobs")}
    results = []
    for n, job in enumerate(ok):
        status, result, error = rows[job]
        assert status == "done" and error is None, rows[job]
        doubled, rand = str(result).split()
        assert int(doubled) == 2 * n
        results.append(rand)
    assert len(set(results)) == 3  # each job its own guest, each with its own entropy
    assert rows[failed][0] == "dead" and rows[failed][2] == "exit code 3: bad input\nbad input"
    assert rows[hung][0] == "dead" and str(rows[hung][2]).startswith("killed: timeout after 2 s")
    assert _fallback_lines(caplog) == []  # every job was a restore


def test_a_copy_resumes_by_itself_however_late_its_state_finishes_loading(
        snapshot: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The state reaches QEMU seconds after it read its monitor's commands (as under load, when
    the load takes longer than the commands). Before snapshots were saved from a running VM, the
    pre-written ``cont`` then came during the load and was ignored: the copy stayed paused and
    the job failed with "vm did not boot within 60 s"."""
    state = (snapshot / "state").read_bytes()

    def slow_state(dirfd: int) -> int:
        r, w = os.pipe()

        def feed() -> None:
            time.sleep(2)  # the delay under test, not a wait for a condition
            try:
                with open(w, "wb") as f:
                    f.write(state)
            except OSError:
                pass  # QEMU is gone: the test's assertions say why

        threading.Thread(target=feed, daemon=True).start()
        return r

    monkeypatch.setattr(microvm_snapshot, "_open_state", slow_state)
    h = _handlers(tmp_path, **{"ok.py": "print('ok')"})
    sbx, res = _run(h, "ok")
    assert sbx.last_boot is not None and sbx.last_boot.restored, sbx.last_boot
    assert (res.exit_code, res.stdout) == (0, "ok\n"), res


def test_a_restored_copy_whose_job_never_comes_stops_by_itself(
        snapshot: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A drainer stopped between spawning a copy and writing its job cannot leave the copy
    behind: the agent's wait, armed before the snapshot, ends it AGENT_WAIT seconds after the
    restore (QEMU exits; nothing of the job ran)."""
    def never_write(fd: int, data: bytes) -> None:  # (restore closes the descriptor itself)
        pass

    monkeypatch.setattr(microvm_snapshot, "_writer", never_write)
    image = load_image()
    snap = microvm_snapshot.find(image, microvm._qemu_binary() or "", MEMORY // MiB, 1,
                                 microvm.accel(image))
    assert isinstance(snap, microvm_snapshot.Snapshot), snap
    h = _handlers(tmp_path, **{"ok.py": "print('ok')"})
    job = microvm.GuestJob([microvm.GUEST_PYTHON, "/handlers/ok.py"], {}, 5.0)
    out = microvm_snapshot.restore(snap, image, [job], h, tmp_bytes=64 * MiB,
                                   hard_deadline=time.monotonic() + AGENT_WAIT + 50)
    assert isinstance(out, microvm.BootOutcome)
    # QEMU exited by itself (the host's deadline would say "ttl"), because the guest reset.
    assert (out.failure, out.results) == ("restore failed", [None]), out
    assert "sysrq: Resetting" in out.console, out


def test_restores_turned_off_cold_boot_without_a_word(
        snapshot: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("FLEETLESS_MICROVM_SNAPSHOT", "off")
    caplog.set_level(logging.WARNING, logger="fleetless.sandbox.microvm")
    h = _handlers(tmp_path, **{"ok.py": "print('ok')"})
    sbx, res = _run(h, "ok")
    assert sbx.last_boot is not None and not sbx.last_boot.restored
    assert (res.exit_code, res.stdout) == (0, "ok\n"), res
    assert _fallback_lines(caplog) == []


def test_a_snapshot_saved_on_another_cpu_is_not_restored(private_image: Path) -> None:
    """Under KVM a guest sees the host's CPU: a snapshot taken on another CPU model (a cache
    copied between hosts, a host moved to new hardware) cold-boots, saying why, instead of
    resuming a kernel that may use features this CPU lacks."""
    image = load_image(private_image)
    binary = microvm._qemu_binary()
    assert binary is not None
    accel = microvm.accel(image)
    assert isinstance(microvm_snapshot.find(image, binary, MEMORY // MiB, 1, accel), microvm_snapshot.Snapshot)
    _edit_key(private_image, cpu="kvm:host:Another CPU:0123456789abcdef")
    assert microvm_snapshot.find(image, binary, MEMORY // MiB, 1, accel) == "the host CPU changed since the snapshot"
