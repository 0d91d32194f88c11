"""Snapshots of the ``microvm`` guest: boot once, restore a copy of it for every job.

Building (:func:`build_snapshot`, run by ``fleetless microvm build-image``): the guest boots
with its RAM in a file (``memory-backend-file``, ``share=on``) and the in-guest runner started
as an *agent* (see :mod:`fleetless.sandbox.microvm.guest_init`): it sets the guest up, imports what
handlers commonly import, says ``ready`` and blocks reading its serial channel. The host then
stops the VM and migrates its device state to a file with the ``x-ignore-shared`` capability
(the RAM is not copied: it is the file). The result, in ``<image>/snapshots/<mem>m-<cpus>c/``:
``ram`` (the guest's memory), ``state`` (devices and vCPUs, tens of KB) and ``snapshot.json``
(the key below; written last).

Restoring (:func:`restore`, one per job, never reused): QEMU starts, with no kernel or
initrd, on the same RAM file
mapped ``share=off`` (copy-on-write: the template never changes), ``-incoming defer``, then
``migrate-incoming`` of the state over QMP; the VM resumes inside the agent's read. The host
writes the job over the channel: a nonce, the wall clock, 64 fresh random bytes, the jobs and
the handlers' and workspace's files. The agent sets the clock and reseeds the kernel's RNG
before anything of the job runs.

A snapshot is keyed on the QEMU version, the image's files (kernel and initramfs hashes), the
runner's source, the accelerator and the VM's shape (RAM, vCPUs). When it cannot be used (none
built for this shape, another key, a missing file, a network job, too many bytes for the
channel) the job cold-boots, and the reason is logged once per process and reason.
``FLEETLESS_MICROVM_SNAPSHOT=off`` turns restores off (every job cold-boots, nothing logged).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import secrets
import shutil
import socket
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleetless.sandbox import SandboxUnavailable
from fleetless.sandbox.microvm.image import CpioWriter, ImageInfo

if TYPE_CHECKING:
    from fleetless.sandbox.microvm import BootOutcome, Control

log = logging.getLogger("fleetless.sandbox.microvm")

__all__ = ["DEFAULT_MEMORY_MIB", "MAX_CHANNEL_BYTES", "Snapshot", "build_snapshot", "find",
           "restore", "say_once", "snapshot_dir", "usable"]

#: Bumped whenever what a snapshot holds changes (2: saved from a running VM, so that a copy
#: resumes by itself once its state is loaded; format 1 was saved paused and needed a ``cont``;
#: 3: its key names the guest CPU).
SNAPSHOT_FORMAT = 3
#: The shape ``build-image`` snapshots: the default ``Limits`` (512 MiB, 1 vCPU).
DEFAULT_MEMORY_MIB = 512
#: Handlers + workspace bytes the restored agent takes over its serial channel; more cold-boots.
MAX_CHANNEL_BYTES = 1 << 20
_TEMPLATE_INIT = b"""#!/bin/sh
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sysfs /sys
/bin/busybox mount -t devtmpfs devtmpfs /dev
exec /bin/busybox env -i /usr/bin/python3 -B /fleetless/runner.py
"""


@dataclass(frozen=True)
class Snapshot:
    directory: Path
    key: dict[str, Any]

    @property
    def ram(self) -> Path:
        return self.directory / "ram"

    @property
    def state(self) -> Path:
        return self.directory / "state"


def snapshot_dir(image: ImageInfo, memory_mib: int, cpus: int) -> Path:
    return image.directory / "snapshots" / f"{memory_mib}m-{cpus}c"


_hash_cache: dict[tuple[str, int, int], str] = {}
_hash_lock = threading.Lock()


def _file_hash(path: Path) -> str:
    st = os.stat(path)
    key = (str(path), st.st_mtime_ns, st.st_size)
    with _hash_lock:
        if key not in _hash_cache:
            h = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
            _hash_cache[key] = h.hexdigest()
        return _hash_cache[key]


_version_cache: dict[tuple[str, int, int], str] = {}


def qemu_version(binary: str) -> str:
    """The first line of ``qemu -version`` (cached per binary file)."""
    st = os.stat(binary)
    key = (binary, st.st_mtime_ns, st.st_size)
    if key not in _version_cache:
        out = subprocess.run([binary, "-version"], capture_output=True, text=True, check=False)
        _version_cache[key] = (out.stdout.splitlines() or ["unknown"])[0].strip()
    return _version_cache[key]


def _runner_source() -> bytes:
    from fleetless.sandbox.microvm import _RUNNER

    return _RUNNER.read_bytes()


def guest_cpu_identity(accel: str) -> str:
    """The CPU a snapshot's guest saw. Under TCG, QEMU's emulated model (its version is keyed
    apart); under KVM (``-cpu host``) the host's model and flags: a copy restored on another CPU
    would find features gone that its kernel and programs already chose to use."""
    from fleetless.sandbox import microvm

    model = microvm.guest_cpu(accel)
    if model != "host":
        return f"{accel}:{model}"
    name = flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                field, _, value = line.partition(":")
                field = field.strip()
                if field == "model name" and not name:
                    name = value.strip()
                elif field == "flags" and not flags:
                    flags = value.strip()
                if name and flags:
                    break
    except OSError:
        pass
    return f"{accel}:host:{name}:{hashlib.sha256(flags.encode()).hexdigest()[:16]}"


def snapshot_key(image: ImageInfo, binary: str, memory_mib: int, cpus: int,
                 accel: str) -> dict[str, Any]:
    """What a snapshot must match to be restored."""
    image_hash = hashlib.sha256(
        f"{_file_hash(image.kernel)}:{_file_hash(image.initramfs)}".encode()).hexdigest()
    return {"format": SNAPSHOT_FORMAT, "qemu": qemu_version(binary), "image": image_hash,
            "runner": hashlib.sha256(_runner_source() + _TEMPLATE_INIT).hexdigest(),
            "accel": accel, "cpu": guest_cpu_identity(accel), "memory_mib": memory_mib, "cpus": cpus}


_KEY_WORDS = {"format": "the snapshot format changed", "qemu": "QEMU version changed",
              "image": "the image changed since the snapshot",
              "runner": "the guest runner changed since the snapshot",
              "accel": "the accelerator changed", "cpu": "the host CPU changed since the snapshot",
              "memory_mib": "RAM size differs",
              "cpus": "vCPU count differs"}


def find(image: ImageInfo, binary: str, memory_mib: int, cpus: int,
         accel: str) -> Snapshot | str:
    """The usable snapshot for this shape, or why there is none (one line)."""
    directory = snapshot_dir(image, memory_mib, cpus)
    try:
        stored = json.loads((directory / "snapshot.json").read_text())
    except (OSError, ValueError):
        return (f"no snapshot for {memory_mib} MiB / {cpus} vCPU in {directory.parent} "
                "(run `fleetless microvm build-image --snapshot-memory "
                f"{memory_mib} --snapshot-cpus {cpus}`)")
    try:
        want = snapshot_key(image, binary, memory_mib, cpus, accel)
    except OSError as exc:
        return f"cannot key the snapshot: {exc}"
    for field, words in _KEY_WORDS.items():
        if stored.get(field) != want[field]:
            if field == "qemu":
                return f"{words} (snapshot: {stored.get(field)!r}, now: {want[field]!r})"
            return words
    snap = Snapshot(directory, stored)
    for path in (snap.ram, snap.state):
        if not path.is_file():
            return f"snapshot file missing: {path}"
    if snap.ram.stat().st_size != memory_mib << 20:
        return f"snapshot RAM file has the wrong size: {snap.ram}"
    return snap


_said: set[str] = set()
_said_lock = threading.Lock()


def usable(image: ImageInfo, binary: str, memory_mib: int, cpus: int, accel: str,
           network: bool) -> Snapshot | None:
    """The snapshot to restore for a job, or None (cold boot; the reason logged once)."""
    if os.environ.get("FLEETLESS_MICROVM_SNAPSHOT") == "off":
        return None  # the operator's opt-out: a cold boot, nothing to say
    found: Snapshot | str
    if network:
        found = "network jobs need a network device the snapshot does not have"
    else:
        found = find(image, binary, memory_mib, cpus, accel)
    if isinstance(found, Snapshot):
        return found
    say_once(found)
    return None


def say_once(reason: str) -> None:
    """Log why a job cold-boots instead of restoring, once per process and reason."""
    with _said_lock:
        if reason in _said:
            return
        _said.add(reason)
    log.warning("microvm: cold boot instead of a snapshot restore: %s", reason)


# --------------------------------------------------------------------------- QMP


class _Qmp:
    """A minimal QMP client over a connected socket."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.deadline = deadline
        self.buf = b""
        self.events: list[tuple[str, Any]] = []
        self._read()  # greeting
        self.cmd("qmp_capabilities")

    def _read(self) -> dict[str, Any]:
        while b"\n" not in self.buf:
            self.sock.settimeout(max(0.01, self.deadline - time.monotonic()))
            chunk = self.sock.recv(65536)
            if not chunk:
                raise OSError("QEMU closed its monitor")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        msg: dict[str, Any] = json.loads(line)
        return msg

    def cmd(self, name: str, **args: Any) -> Any:
        msg: dict[str, Any] = {"execute": name}
        if args:
            msg["arguments"] = args
        self.sock.sendall(json.dumps(msg).encode() + b"\n")
        while True:
            reply = self._read()
            if "event" in reply:
                self.events.append((str(reply["event"]), reply.get("data")))
                continue
            if "error" in reply:
                raise OSError(f"QMP {name}: {reply['error'].get('desc')}")
            return reply.get("return")

    def wait_migration(self) -> None:
        """Until the incoming migration completed (an OSError if it failed)."""
        seen = 0
        while True:
            for name, data in self.events[seen:]:
                status = (data or {}).get("status")
                if name == "MIGRATION" and status == "completed":
                    return
                if name == "MIGRATION" and status in ("failed", "cancelled"):
                    raise OSError(f"incoming migration {status}")
            seen = len(self.events)
            reply = self._read()
            if "event" in reply:
                self.events.append((str(reply["event"]), reply.get("data")))


# --------------------------------------------------------------------------- building


def _template_initrd(image: ImageInfo, nonce: str, tmp_bytes: int) -> bytes:
    cpio = CpioWriter()
    cpio.dir("fleetless", 0o700)
    cpio.file("init", _TEMPLATE_INIT, 0o755)
    cpio.file("fleetless/runner.py", _runner_source(), 0o600)
    cpio.file("fleetless/jobs.json", json.dumps(
        {"mode": "agent", "nonce": nonce, "tmp_bytes": tmp_bytes}).encode(), 0o600)
    return image.initramfs.read_bytes() + cpio.finish()


def build_snapshot(image: ImageInfo, memory_mib: int = DEFAULT_MEMORY_MIB, cpus: int = 1,
                   accel: str | None = None) -> Path:
    """Boot the template once and save it as a snapshot; returns its directory.

    Does nothing when a snapshot with the current key is there. Raises
    :class:`SandboxUnavailable` with a one-line reason when it cannot be made.
    """
    from fleetless.sandbox import microvm

    binary = microvm._qemu_binary()
    if binary is None:
        raise SandboxUnavailable("qemu-system-x86_64 not found: apt-get install -y qemu-system-x86")
    accel = accel or microvm.accel(image)
    target = snapshot_dir(image, memory_mib, cpus)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if isinstance(find(image, binary, memory_mib, cpus, accel), Snapshot):
            return target
        key = snapshot_key(image, binary, memory_mib, cpus, accel)
        work = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
        try:
            _boot_and_save(image, binary, accel, memory_mib, cpus, work)
            (work / "initrd").unlink()  # a restore needs no kernel or initrd
            (work / "snapshot.json").write_text(json.dumps(key, indent=2) + "\n")
            old = target.parent / f".old-{os.getpid()}-{secrets.token_hex(4)}"
            if target.exists():
                os.replace(target, old)
            os.replace(work, target)
            shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return target


def _boot_and_save(image: ImageInfo, binary: str, accel: str, memory_mib: int, cpus: int,
                   work: Path) -> None:
    from fleetless.sandbox import microvm

    nonce = secrets.token_hex(16)
    initrd = work / "initrd"
    initrd.write_bytes(_template_initrd(image, nonce, 64 << 20))
    ram = work / "ram"
    with open(ram, "wb") as f:
        f.truncate(memory_mib << 20)
    os.chmod(ram, stat.S_IRUSR | stat.S_IWUSR)
    con_r, con_w = os.pipe()
    chan_r, chan_w = os.pipe()
    mine, theirs = socket.socketpair()
    deadline = time.monotonic() + microvm.BOOT_TIMEOUT * 2
    argv = microvm._QemuEngine(binary, image).argv(
        accel=accel, memory_mib=memory_mib, cpus=cpus, initrd_fd=str(initrd),
        console_fd=con_w, channel_fd=chan_w, network=None, ram_file=ram, ram_shared=True,
        qmp_fd=theirs.fileno())
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE,
                            pass_fds=(con_w, chan_w, theirs.fileno()), start_new_session=True)
    os.close(con_w)
    os.close(chan_w)
    theirs.close()
    console = bytearray()
    try:
        qmp = _Qmp(mine, deadline)
        chan = b""
        marker = f"FLEETLESS1 {nonce} ready".encode()
        while marker not in chan:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SandboxUnavailable("cannot build the microvm snapshot: the template did not "
                                         f"get ready: {bytes(console[-400:]).decode(errors='replace')}")
            import select

            ready, _, _ = select.select([chan_r, con_r], [], [], 0.2)
            for fd in ready:
                data = os.read(fd, 65536)
                if fd == chan_r:
                    chan += data
                else:
                    console += data
                    del console[:-4096]
        # Migrated while it runs (the agent idles in its read): the state then records the VM as
        # running, and QEMU starts each restored copy by itself when the state is loaded. A
        # state saved after ``stop`` records "paused": a copy then resumes only on a ``cont``
        # that arrives *after* the load (one that arrives during it is ignored), a race that
        # left restores paused for ever under load.
        qmp.cmd("migrate-set-capabilities",
                capabilities=[{"capability": "x-ignore-shared", "state": True}])
        qmp.cmd("migrate", uri=f"exec:cat > {work / 'state'}")
        while True:
            status = qmp.cmd("query-migrate").get("status")
            if status == "completed":
                break
            if status in ("failed", "cancelled") or time.monotonic() > deadline:
                raise SandboxUnavailable(f"cannot build the microvm snapshot: migration {status}")
            time.sleep(0.05)
        try:
            qmp.cmd("quit")
        except OSError:
            pass
        proc.wait(timeout=30)
    except OSError as exc:
        err = proc.stderr.read(4096).decode(errors="replace") if proc.stderr and \
            proc.poll() is not None else ""
        raise SandboxUnavailable(f"cannot build the microvm snapshot: {exc} {err}".strip()) from None
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if proc.stderr:
            proc.stderr.close()
        mine.close()
        os.close(con_r)
        os.close(chan_r)


# --------------------------------------------------------------------------- restoring


def _channel_payload(jobs: Sequence[Any], handlers_dir: Path, nonce: str,
                     tmp_bytes: int) -> tuple[dict[str, Any], bytes] | str:
    """The header (its clock set when sent) and the files' bytes the restored agent reads; or
    why they cannot be sent."""
    from fleetless.sandbox.microvm import GUEST_HANDLERS, JOB_UID

    entries: list[list[Any]] = []
    blobs: list[bytes] = []
    size = 0

    def add(path: str, kind: str, mode: int, uid: int, extra: Any, data: bytes = b"") -> None:
        nonlocal size
        entries.append([path, kind, mode, uid, extra])
        if data:
            blobs.append(data)
            size += len(data)

    add(GUEST_HANDLERS, "d", 0o555, 0, 0)
    for root, dirnames, filenames in os.walk(handlers_dir):
        dirnames.sort()
        rel = os.path.relpath(root, handlers_dir)
        base = GUEST_HANDLERS if rel == "." else f"{GUEST_HANDLERS}/{rel}"
        for d in list(dirnames):
            p = Path(root, d)
            if p.is_symlink():
                add(f"{base}/{d}", "l", 0o777, 0, os.readlink(p))
                dirnames.remove(d)
            else:
                add(f"{base}/{d}", "d", 0o555, 0, 0)
        for name in sorted(filenames):
            p = Path(root, name)
            st = p.lstat()
            if stat.S_ISLNK(st.st_mode):
                add(f"{base}/{name}", "l", 0o777, 0, os.readlink(p))
            elif stat.S_ISREG(st.st_mode):
                data = p.read_bytes()
                add(f"{base}/{name}", "f", 0o555 if st.st_mode & 0o111 else 0o444, 0,
                    len(data), data)
        if size > MAX_CHANNEL_BYTES:
            break
    descs = []
    for i, job in enumerate(jobs):
        ws = job.workspace.rstrip("/")
        parts = ws.strip("/").split("/")
        for k in range(1, len(parts)):
            add("/" + "/".join(parts[:k]), "d", 0o755, 0, 0)
        add(ws, "d", 0o755, JOB_UID, 0)
        for rel, data in sorted(job.files.items()):
            relparts = rel.split("/")
            for k in range(1, len(relparts)):
                add(f"{ws}/{'/'.join(relparts[:k])}", "d", 0o755, JOB_UID, 0)
            add(f"{ws}/{rel}", "f", 0o644, JOB_UID, len(data), data)
        descs.append({"id": str(i), "argv": list(job.argv), "env": dict(job.env), "cwd": ws,
                      "timeout": job.timeout, "stdout_bytes": job.stdout_bytes,
                      "stderr_bytes": job.stderr_bytes, "rlimits": job.rlimits,
                      "stream": job.stream})
    if size > MAX_CHANNEL_BYTES:
        return (f"the job's handlers and files are more than the {MAX_CHANNEL_BYTES >> 20} MiB a "
                "restored guest takes over its channel")
    header = {"nonce": nonce, "time_ns": 0, "entropy": secrets.token_hex(64),
              "uid": JOB_UID, "gid": JOB_UID, "tmp_bytes": tmp_bytes, "jobs": descs,
              "entries": entries, "bytes": size}
    return header, b"".join(blobs)


F_SETPIPE_SZ = 1031


def _qmp_errors(sock: socket.socket) -> str:
    """What QEMU's monitor answered with an error (for the one line saying why)."""
    sock.setblocking(False)
    text = b""
    try:
        while chunk := sock.recv(65536):
            text += chunk
    except OSError:
        pass
    errors = [json.loads(line)["error"].get("desc", "") for line in text.splitlines()
              if line.startswith(b'{"error"')]
    return "; ".join(errors)


def _wait_resume(sock: socket.socket, deadline: float, hard_deadline: float | None,
                 cancelled: threading.Event | None) -> bool:
    """Until QEMU's monitor says the VM runs (``RESUME``); False if it did not in time."""
    buf = b""
    end = min(deadline, hard_deadline or deadline)
    while b'"RESUME"' not in buf:
        now = time.monotonic()
        if now >= end or (cancelled is not None and cancelled.is_set()):
            return False
        sock.settimeout(min(0.2, end - now))
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except OSError:
            return False
        if not chunk:
            return False
        buf = buf[-4096:] + chunk
    return True


def _open_state(dirfd: int) -> int:
    """The descriptor QEMU loads the device state from (a test replaces it with a slow pipe)."""
    return os.open("state", os.O_RDONLY, dir_fd=dirfd)


def _writer(fd: int, data: bytes) -> None:
    """Writes the job; the descriptor stays open for the host's control lines (restore closes
    it once this thread has ended)."""
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
    except OSError:
        pass  # QEMU is gone: the reader says why


def restore(snap: Snapshot, image: ImageInfo, jobs: Sequence[Any], handlers_dir: Path, *,
            tmp_bytes: int, hard_deadline: float | None = None, on_spawn: Any = None,
            cancelled: threading.Event | None = None, control: Control | None = None,
            on_stdout: Callable[[bytes], None] | None = None) -> BootOutcome | str:
    """Run ``jobs`` in a fresh copy of the snapshot; a :class:`~microvm.BootOutcome`, or a str
    saying why the snapshot cannot take these jobs (then nothing was started)."""
    from fleetless.sandbox import microvm

    binary = microvm._qemu_binary()
    if binary is None:
        raise SandboxUnavailable("qemu-system-x86_64 not found: apt-get install -y qemu-system-x86")
    nonce = secrets.token_hex(16)
    payload = _channel_payload(jobs, handlers_dir, nonce, tmp_bytes)
    if isinstance(payload, str):
        return payload
    header, blobs = payload
    started = time.monotonic()
    fds: list[int] = []
    proc: subprocess.Popen[bytes] | None = None
    mine = theirs = None
    writer: threading.Thread | None = None
    try:
        con_r, con_w = os.pipe()
        chan_r, chan_w = os.pipe()
        in_r, in_w = os.pipe()
        fds += [con_r, con_w, chan_r, chan_w, in_r, in_w]
        # RAM and state from one build: a concurrent build_snapshot replaces the directory by a
        # rename, so both are opened through one descriptor of it and checked against the key.
        dirfd = os.open(snap.directory, os.O_RDONLY | os.O_DIRECTORY)
        fds.append(dirfd)
        with open(os.open("snapshot.json", os.O_RDONLY, dir_fd=dirfd)) as f:
            if json.load(f) != snap.key:
                return "the snapshot was rebuilt while in use"
        state = _open_state(dirfd)
        fds.append(state)
        ram = os.open("ram", os.O_RDWR, dir_fd=dirfd)  # QEMU maps it private: never written
        fds.append(ram)
        # The QMP commands are in QEMU's monitor before it starts, and no ``cont`` among them:
        # the state was saved from a running VM, so QEMU starts the copy by itself as soon as
        # the state is loaded, whatever this process does meanwhile. (A ``cont`` is no help: one
        # that QEMU reads while the state is still loading is ignored; that race hung restores.)
        # The job is written once the VM runs: bytes that reach the serial port before the vCPU
        # does can leave its interrupt unseen.
        mine, theirs = socket.socketpair()
        caps = [{"capability": "x-ignore-shared", "state": True}]
        for cmd in ({"execute": "qmp_capabilities"},
                    {"execute": "migrate-set-capabilities", "arguments": {"capabilities": caps}},
                    {"execute": "migrate-incoming", "arguments": {"uri": f"fd:{state}"}}):
            mine.sendall(json.dumps(cmd).encode() + b"\n")
        argv = microvm._QemuEngine(binary, image).argv(
            accel=str(snap.key["accel"]), memory_mib=int(snap.key["memory_mib"]),
            cpus=int(snap.key["cpus"]), initrd_fd="", console_fd=con_w,
            channel_fd=None, network=None, ram_file=Path(f"/proc/self/fd/{ram}"), ram_shared=False,
            qmp_fd=theirs.fileno(), restoring=True)
        argv += ["-incoming", "defer"]
        parent = os.getpid()
        proc = subprocess.Popen(
            argv, stdin=in_r, stdout=chan_w, stderr=subprocess.PIPE,
            pass_fds=(con_w, state, ram, theirs.fileno()),
            preexec_fn=lambda: microvm._pdeathsig_preexec(parent), start_new_session=True)
        if on_spawn is not None:
            on_spawn(proc)
        for fd in (con_w, chan_w, in_r, state, ram):
            os.close(fd)
            fds.remove(fd)
        theirs.close()
        resumed = _wait_resume(mine, started + microvm.BOOT_TIMEOUT, hard_deadline, cancelled)
        if resumed:
            header["time_ns"] = time.time_ns()  # the guest's clock, set as it reads this
            data = b"\n" * 64 + json.dumps(header, separators=(",", ":")).encode() + b"\n" + blobs
            try:
                fcntl.fcntl(in_w, F_SETPIPE_SZ, max(len(data), 65536))
            except OSError:
                pass
            writer = threading.Thread(target=_writer, args=(in_w, data), daemon=True)
            writer.start()
            if control is not None:  # ready at the guest's first record: it has read the job whole
                control.bind(in_w, nonce)
        else:
            proc.kill()
        out = microvm._collect(proc, jobs, con_r, chan_r, nonce, str(snap.key["accel"]), started,
                               hard_deadline, cancelled, control, on_stdout)
        out.restored = out.boot is not None
        if not out.restored and out.failure == "vm exited":
            out.failure = "restore failed"
            out.detail = f"{out.detail} {_qmp_errors(mine)}".strip()
        return out
    finally:
        if control is not None:
            control.unbind()
        if proc is not None:
            microvm._reap(proc)
        if writer is not None:  # its write ends once QEMU is gone: then its descriptor is closed
            writer.join(10)
        if mine is not None:
            mine.close()
        if theirs is not None:
            theirs.close()
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass

