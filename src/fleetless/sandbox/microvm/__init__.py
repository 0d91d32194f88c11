"""The ``microvm`` sandbox tier: every job runs in its own QEMU ``microvm`` virtual machine.

``create`` and ``write`` only stage (in memory); ``exec`` boots the VM with everything in it:

* kernel and base initramfs (busybox + python) come from the image built by
  :func:`fleetless.sandbox.microvm.image.build_image`;
* a second, per-boot newc archive is appended to the base one (the kernel unpacks
  concatenated archives): ``/init``, the runner (:mod:`fleetless.sandbox.microvm.guest_init`), the
  handlers at ``/handlers`` (root-owned, read-only), the workspace at ``/workspace`` (owned by
  the job's uid 65534) and the job list (argv, env, timeout, output caps, rlimits);
* the result comes back over a second serial port that only the runner holds, as framed
  records carrying a per-boot nonce (see the runner's docstring); the job's output reaches
  the host only base64-encoded inside those records, so it cannot forge one;
* the combined initramfs is a ``memfd`` passed to QEMU, and both serial ports are pipes: nothing
  of a job is ever written to the host's disk, so there is nothing to clean up but the process.

The VM gets ``limits.memory_bytes`` of RAM (at least :data:`MIN_MEMORY_MIB`), ``ceil(cpus)``
vCPUs and no network device at all unless ``limits.network`` (then a QEMU user-mode network
restricted to the guest itself: see ``docs/microvm.md``). QEMU is SIGKILLed at the job's
timeout, at the sandbox's TTL, by :meth:`MicroVMSandbox.kill` and, through
``PR_SET_PDEATHSIG``, when the thread that spawned it dies.

The engine (QEMU) sits behind :class:`_QemuEngine`; another VMM (Firecracker) would provide
the same ``argv``/``accel`` shape and reuse the runner, archive and framing.
"""

from __future__ import annotations

import base64
import ctypes
import json
import logging
import math
import os
import re
import secrets
import selectors
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from fleetless.sandbox import ExecResult, Limits, MiB, Sandbox, SandboxUnavailable, Template
from fleetless.sandbox._caps import NOT
from fleetless.sandbox._limits import rlimit_kill_reason
from fleetless.sandbox.microvm.image import CpioWriter, ImageInfo, guest_has_program, load_image

__all__ = ["MIN_MEMORY_MIB", "Control", "GuestJob", "MicroVMSandbox", "accel", "boot", "network_mode"]

#: Guest RAM below which the kernel + initramfs + python do not fit (the job gets the rest).
MIN_MEMORY_MIB = 128
JOB_UID = 65534
GUEST_PYTHON = "/usr/bin/python3"
GUEST_WORKSPACE = "/workspace"
GUEST_HANDLERS = "/handlers"
#: How long a boot may take before the first record (TCG on a loaded host is slow).
BOOT_TIMEOUT = 60.0
#: Grace after the job's timeout for the runner to report before the host kills the VM.
REPORT_GRACE = 5.0
MAGIC = b"FLEETLESS1"
#: Bytes of the guest console kept for diagnostics.
CONSOLE_KEEP = 8192
_RUNNER = Path(__file__).with_name("guest_init.py")

_INIT = b"""#!/bin/sh
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sysfs /sys
/bin/busybox mount -t devtmpfs devtmpfs /dev
exec /usr/bin/python3 -I -S -B /fleetless/runner.py
"""


def _fmt_seconds(seconds: float) -> str:
    return f"{seconds:g}" if seconds != int(seconds) else str(int(seconds))


def _host_khz() -> int | None:
    """Host TSC frequency for ``tsc_early_khz`` (without it some TCG boots hang calibrating)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("cpu MHz"):
                    return int(float(line.split(":")[1]) * 1000)
    except (OSError, ValueError):
        pass
    return None


def guest_cpu(accel: str) -> str:
    """The ``-cpu`` model: the host's own under KVM, else QEMU's fullest emulated one."""
    return "host" if accel == "kvm" else "max"


def _qemu_binary() -> str | None:
    return os.environ.get("FLEETLESS_QEMU") or shutil.which("qemu-system-x86_64")


# --------------------------------------------------------------------------- jobs and boots


@dataclass
class GuestJob:
    """One job of a boot (batch mode boots once for many)."""

    argv: Sequence[str]
    env: Mapping[str, str]
    timeout: float
    files: dict[str, bytes] = field(default_factory=dict)  # workspace files, relative paths
    stdout_bytes: int = 64 * 1024
    stderr_bytes: int = 64 * 1024
    rlimits: dict[str, int] = field(default_factory=dict)
    workspace: str = GUEST_WORKSPACE
    #: Its stdout comes back as it is written (``out`` records), not only with its result.
    stream: bool = False


@dataclass
class JobOutcome:
    exit_code: int
    stdout: bytes
    stderr: bytes
    duration: float
    timed_out: bool = False
    oom: bool = False
    stdout_cut: bool = False


@dataclass
class BootOutcome:
    """What one boot produced; ``failure`` is set when the VM did not report everything."""

    results: list[JobOutcome | None]
    accel: str
    wall: float
    boot: float | None = None  # seconds from spawn to the runner's first record
    failure: str | None = None  # "deadline", "ttl", "killed", or a reason in words
    detail: str = ""  # tail of console / qemu stderr, for diagnostics
    console: str = ""  # the last 8 KiB of the guest console (kernel messages)
    pid: int = 0  # of the VMM process (gone when boot() returns)
    guest_uptime: float | None = None  # guest clock when the runner started (kernel boot time)
    restored: bool = False  # True: a copy of the snapshot ran the jobs (False: a cold boot)
    partial: bytes = b""  # what the first job without a result streamed before the VM ended


class Control:
    """The host's end of a running VM's channel input: a batch drain's stop (``<nonce> stop``,
    which the guest's runner passes on as SIGUSR1 to the batch runner: see guest_init). A line goes
    out only once the guest has said something on the channel (:meth:`ready`): its port is open
    then, and after a restore the job has been read whole, so nothing is lost or interleaved with
    it. A stop asked for earlier (the VM still booting) waits until then."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._nonce = ""
        self._ready = False
        self._pending = False

    def bind(self, fd: int, nonce: str) -> None:
        with self._lock:
            self._fd, self._nonce, self._ready = fd, nonce, False

    def ready(self) -> None:
        with self._lock:
            if self._fd is not None and not self._ready:
                self._ready = True
                if self._pending:
                    self._send()

    def unbind(self) -> None:
        with self._lock:
            self._fd, self._ready, self._pending = None, False, False

    def stop(self) -> None:
        with self._lock:
            self._pending = True
            if self._ready:
                self._send()

    def _send(self) -> None:
        assert self._fd is not None
        self._pending = False
        try:
            os.write(self._fd, f"{self._nonce} stop\n".encode())  # under PIPE_BUF: whole or not at all
        except OSError:
            pass  # the VM is gone: the reader says why


def _job_archive(jobs: Sequence[GuestJob], handlers_dir: Path, nonce: str,
                 tmp_bytes: int, network: str | None) -> bytes:
    cpio = CpioWriter()
    cpio.dir("fleetless", 0o700)
    cpio.file("init", _INIT, 0o755)
    cpio.file("fleetless/runner.py", _RUNNER.read_bytes(), 0o600)
    cpio.tree(handlers_dir, GUEST_HANDLERS.strip("/"))
    desc: dict[str, Any] = {"nonce": nonce, "uid": JOB_UID, "gid": JOB_UID,
                            "tmp_bytes": tmp_bytes, "network": network is not None, "jobs": []}
    for i, job in enumerate(jobs):
        ws = job.workspace.strip("/")
        parts = ws.split("/")
        for k in range(1, len(parts)):
            cpio.dir("/".join(parts[:k]), 0o755)
        cpio.dir(ws, 0o755, JOB_UID, JOB_UID)
        for rel, data in sorted(job.files.items()):
            relparts = rel.split("/")
            for k in range(1, len(relparts)):
                cpio.dir(f"{ws}/{'/'.join(relparts[:k])}", 0o755, JOB_UID, JOB_UID)
            cpio.file(f"{ws}/{rel}", data, 0o644, JOB_UID, JOB_UID)
        desc["jobs"].append({
            "id": str(i), "argv": list(job.argv), "env": dict(job.env), "cwd": job.workspace,
            "timeout": job.timeout, "stdout_bytes": job.stdout_bytes,
            "stderr_bytes": job.stderr_bytes, "rlimits": job.rlimits, "stream": job.stream,
        })
    cpio.file("fleetless/jobs.json", json.dumps(desc).encode(), 0o600)
    return cpio.finish()


class _QemuEngine:
    """Builds the QEMU command line for one boot."""

    name = "qemu"

    def __init__(self, binary: str, image: ImageInfo) -> None:
        self.binary = binary
        self.image = image

    def argv(self, *, accel: str, memory_mib: int, cpus: int, initrd_fd: int | str,
             console_fd: int, channel_fd: int | None, network: str | None,
             ram_file: Path | None = None, ram_shared: bool = False,
             qmp_fd: int | None = None, restoring: bool = False) -> list[str]:
        """``channel_fd`` None: the channel is QEMU's stdin/stdout (the host writes to the guest,
        as a snapshot's restored agent needs). ``ram_file``: guest RAM is that file, mapped
        shared (building a snapshot) or private, copy-on-write (restoring one). ``qmp_fd``: a
        connected socket for QMP. ``initrd_fd`` may be a path. ``restoring``: no kernel, initrd
        or command line (the guest is already booted in the RAM file; QEMU need not read ~70 MB
        of kernel and initramfs per job)."""
        cmdline = ["console=ttyS0", "quiet", "reboot=t", "panic=-1", "tsc=reliable",
                   "init_on_alloc=0", "nokaslr", "rdinit=/init", "8250.nr_uarts=2",
                   "i8042.noaux", "i8042.nokbd", "pci=off", "cryptomgr.notests",
                   "mitigations=off"]
        cmdline += os.environ.get("FLEETLESS_MICROVM_CMDLINE", "").split()
        khz = _host_khz()
        if khz:
            cmdline.append(f"tsc_early_khz={khz}")
        argv = [
            self.binary, "-M", "microvm,x-option-roms=off,isa-serial=on,rtc=on",
            "-accel", accel, "-cpu", guest_cpu(accel),
            "-m", f"{memory_mib}M", "-smp", str(cpus),
            "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
            "-kernel", str(self.image.kernel),
            "-initrd", initrd_fd if isinstance(initrd_fd, str) else f"/proc/self/fd/{initrd_fd}",
            "-append", " ".join(c for c in cmdline if c),
            "-chardev", f"file,id=con,path=/proc/self/fd/{console_fd}",
            "-serial", "chardev:con",
            "-chardev", f"file,id=chan,path=/proc/self/fd/{channel_fd}" if channel_fd is not None
            else "stdio,id=chan,signal=off",
            "-device", "isa-serial,chardev=chan,iobase=0x2f8,irq=3",
        ]
        if restoring:
            for flag in ("-kernel", "-initrd", "-append"):
                i = argv.index(flag)
                del argv[i:i + 2]
        if ram_file is not None:
            share = "on" if ram_shared else "off"
            argv += ["-object", f"memory-backend-file,id=ram,size={memory_mib}M,"
                                f"mem-path={ram_file},share={share}",
                     "-machine", "memory-backend=ram"]
        if qmp_fd is not None:
            argv += ["-chardev", f"socket,id=qmp,fd={qmp_fd}", "-mon", "chardev=qmp,mode=control"]
        if network is not None:
            # QEMU's user-mode stack (no host privileges, no tap/bridge); "restricted" (the
            # default) cannot reach the host or anything outside the guest.
            restrict = "off" if network == "user" else "on"
            argv += ["-netdev", f"user,id=n0,restrict={restrict}",
                     "-device", "virtio-net-device,netdev=n0"]
        return argv


def network_mode() -> str:
    """What ``limits.network`` gives a job: ``"restricted"`` (default) or ``"user"``.

    ``restricted``: a virtio NIC on QEMU's user-mode stack with ``restrict=on``: the guest has
    an interface but its packets go nowhere (no host, no outside). ``user``
    (``FLEETLESS_MICROVM_NETWORK=user``, an operator's explicit choice): the same stack NATed
    to the host's outbound connections, as an unprivileged process of the host.
    """
    return "user" if os.environ.get("FLEETLESS_MICROVM_NETWORK") == "user" else "restricted"


def _pdeathsig_preexec(parent: int) -> None:
    """In the child: die with the spawning *thread*'s death; and if the parent is gone already."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:
        pass
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


def boot(image: ImageInfo, jobs: Sequence[GuestJob], handlers_dir: Path, *, accel: str,
         memory_mib: int, cpus: int, tmp_bytes: int = 64 * MiB, network: bool = False,
         hard_deadline: float | None = None, on_spawn: Any = None,
         cancelled: threading.Event | None = None, control: Control | None = None,
         on_stdout: Callable[[bytes], None] | None = None) -> BootOutcome:
    """Boot one VM that runs ``jobs`` in order and return their outcomes.

    ``hard_deadline`` (``time.monotonic()`` based) is when the VM is killed whatever happens
    (the sandbox's TTL). Each job's own timeout is enforced by the runner, with the host as a
    backstop ``REPORT_GRACE`` seconds later. ``on_stdout`` is called with each chunk a job marked
    ``stream`` writes to its stdout, as it arrives.
    """
    binary = _qemu_binary()
    if binary is None:
        raise SandboxUnavailable("qemu-system-x86_64 not found: apt-get install -y qemu-system-x86")
    nonce = secrets.token_hex(16)
    net = network_mode() if network else None
    archive = _job_archive(jobs, handlers_dir, nonce, tmp_bytes, net)
    memfd = os.memfd_create("fleetless-initrd", os.MFD_CLOEXEC)
    pipes: list[int] = []
    proc: subprocess.Popen[bytes] | None = None
    started = time.monotonic()
    try:
        with open(image.initramfs, "rb") as base:
            os.sendfile(memfd, base.fileno(), 0, os.fstat(base.fileno()).st_size)
        os.write(memfd, archive)
        con_r, con_w = os.pipe()
        chan_r, chan_w = os.pipe()
        in_r, in_w = os.pipe()  # the channel's other way: the host's control lines (Control)
        pipes += [con_r, con_w, chan_r, chan_w, in_r, in_w]
        engine = _QemuEngine(binary, image)
        argv = engine.argv(accel=accel, memory_mib=memory_mib, cpus=cpus, initrd_fd=memfd,
                           console_fd=con_w, channel_fd=None, network=net)
        parent = os.getpid()
        proc = subprocess.Popen(
            argv, stdin=in_r, stdout=chan_w, stderr=subprocess.PIPE,
            pass_fds=(memfd, con_w), preexec_fn=lambda: _pdeathsig_preexec(parent),
            start_new_session=True,
        )
        if on_spawn is not None:
            on_spawn(proc)
        for fd in (con_w, chan_w, in_r):
            os.close(fd)
        os.close(memfd)
        memfd = -1
        pipes = [con_r, chan_r, in_w]
        if control is not None:
            control.bind(in_w, nonce)
        return _collect(proc, jobs, con_r, chan_r, nonce, accel, started, hard_deadline,
                        cancelled, control, on_stdout)
    finally:
        if control is not None:
            control.unbind()
        if proc is not None:
            _reap(proc)
        if memfd >= 0:
            os.close(memfd)
        for fd in pipes:
            try:
                os.close(fd)
            except OSError:
                pass


def _reap(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        try:
            proc.kill()
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL does not take that long
        pass
    if proc.stderr is not None:
        proc.stderr.close()


_RECORD = re.compile(rb"^FLEETLESS1 ([0-9a-f]+) (\w+) (.*)$")


def _collect(proc: subprocess.Popen[bytes], jobs: Sequence[GuestJob], con_r: int, chan_r: int,
             nonce: str, accel: str, started: float, hard_deadline: float | None,
             cancelled: threading.Event | None, control: Control | None = None,
             on_stdout: Callable[[bytes], None] | None = None) -> BootOutcome:
    assert proc.stderr is not None
    results: list[JobOutcome | None] = [None] * len(jobs)
    streamed = [bytearray() for _ in jobs]  # the stdout of jobs marked stream, so far
    outcome = BootOutcome(results, accel, 0.0, pid=proc.pid)
    console = bytearray()
    qemu_err = bytearray()
    chan = bytearray()
    sel = selectors.DefaultSelector()
    sel.register(con_r, selectors.EVENT_READ, "con")
    sel.register(chan_r, selectors.EVENT_READ, "chan")
    sel.register(proc.stderr, selectors.EVENT_READ, "err")
    job_deadline = started + BOOT_TIMEOUT
    done = False
    try:
        while not done:
            now = time.monotonic()
            if hard_deadline is not None and now >= hard_deadline:
                outcome.failure = "ttl"
                break
            if now >= job_deadline:
                outcome.failure = "deadline"
                break
            if cancelled is not None and cancelled.is_set():
                outcome.failure = "killed"
                break
            limit = min(job_deadline, hard_deadline or job_deadline) - now
            events = sel.select(timeout=min(limit, 0.2))
            if not events and proc.poll() is not None and not sel.get_map():
                break
            for key, _ in events:
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    if not sel.get_map():
                        done = True
                    continue
                if key.data == "con":
                    console += chunk
                    del console[:-CONSOLE_KEEP]
                elif key.data == "err":
                    qemu_err += chunk
                    del qemu_err[:-8192]
                else:
                    chan += chunk
                    *lines, rest = chan.split(b"\n")
                    chan = bytearray(rest)
                    if rest:  # a long record is still arriving: that is not the job overrunning
                        job_deadline = max(job_deadline, time.monotonic() + REPORT_GRACE)
                    for raw in lines:
                        m = _RECORD.match(raw.strip())
                        if not m or m.group(1).decode() != nonce:
                            continue
                        kind = m.group(2).decode()
                        body = json.loads(m.group(3))
                        now = time.monotonic()
                        if outcome.boot is None:
                            outcome.boot = now - started
                            if control is not None:  # the guest holds its channel now
                                control.ready()
                        if kind == "hello":
                            outcome.guest_uptime = float(body.get("uptime", 0.0))
                        elif kind == "start":
                            job = jobs[int(body["id"])]
                            job_deadline = now + job.timeout + REPORT_GRACE
                        elif kind == "out":
                            data = base64.b64decode(body["data"])
                            streamed[int(body["id"])] += data
                            if on_stdout is not None:
                                on_stdout(data)
                        elif kind == "result":
                            i = int(body["id"])
                            results[i] = JobOutcome(
                                int(body["exit_code"]),
                                bytes(streamed[i]) if body.get("streamed") else base64.b64decode(body["stdout"]),
                                base64.b64decode(body["stderr"]), float(body["duration"]),
                                bool(body["timed_out"]), bool(body["oom"]),
                                bool(body.get("stdout_cut", False)))
                            job_deadline = now + BOOT_TIMEOUT  # until the next start/done
                        elif kind == "error":
                            outcome.failure = f"guest runner failed: {body.get('error')}"
                            done = True
                        elif kind == "done":
                            done = True
        if not done and outcome.failure is None:
            outcome.failure = "vm exited"
    finally:
        sel.close()
    if any(r is None for r in results) and cancelled is not None and cancelled.is_set():
        outcome.failure = "killed"  # kill() took the VM down under us: that is why it ended
    if outcome.failure is None and any(r is None for r in results):
        outcome.failure = "vm exited"
    cut = next((i for i, r in enumerate(results) if r is None), None)
    if cut is not None:
        outcome.partial = bytes(streamed[cut])
    outcome.wall = time.monotonic() - started
    outcome.console = console.decode(errors="replace")
    if outcome.failure:
        text = console.decode(errors="replace")
        if "Kernel panic" in text:  # the runner died: what it said is before the panic
            text = text[: text.index("Kernel panic")]
        tail = (bytes(qemu_err).decode(errors="replace") + "\n" + text).strip()
        outcome.detail = " | ".join(line.strip() for line in tail.splitlines()[-6:])
    return outcome


# --------------------------------------------------------------------------- accelerator probe

_accel_lock = threading.Lock()
_accel_cache: dict[str, str] = {}


def _probe_key(binary: str, image: ImageInfo) -> str:
    try:
        qemu_id = f"{os.stat(binary).st_mtime_ns}:{os.stat(binary).st_size}"
    except OSError:
        qemu_id = binary
    return f"{os.uname().release}|{qemu_id}|{image.manifest.get('initramfs_sha256')}"


def accel(image: ImageInfo | None = None) -> str:
    """``"kvm"`` if a KVM guest actually boots here, else ``"tcg"`` (software emulation).

    ``$FLEETLESS_MICROVM_ACCEL`` (``kvm``/``tcg``) overrides. The probe boots the real image
    once with KVM; its result is cached in the process and in the image directory.
    """
    forced = os.environ.get("FLEETLESS_MICROVM_ACCEL")
    if forced in ("kvm", "tcg"):
        return forced
    image = image or load_image()
    binary = _qemu_binary() or "qemu-system-x86_64"
    key = _probe_key(binary, image)
    with _accel_lock:
        if key in _accel_cache:
            return _accel_cache[key]
        cache_file = image.directory / "accel.json"
        try:
            cached = json.loads(cache_file.read_text())
            if cached.get("key") == key and cached.get("accel") in ("kvm", "tcg"):
                _accel_cache[key] = str(cached["accel"])
                return _accel_cache[key]
        except (OSError, ValueError):
            pass
        result, reason = "tcg", "no usable /dev/kvm"
        if os.access("/dev/kvm", os.R_OK | os.W_OK):
            try:
                with tempfile.TemporaryDirectory(prefix="fleetless-probe-") as empty:
                    out = boot(image, [GuestJob(["/bin/true"], {}, 10.0)], Path(empty), accel="kvm",
                               memory_mib=MIN_MEMORY_MIB, cpus=1,
                               hard_deadline=time.monotonic() + 30)
                ok = out.failure is None and out.results[0] is not None \
                    and out.results[0].exit_code == 0
                result = "kvm" if ok else "tcg"
                reason = "kvm guest booted" if ok else f"kvm probe failed: {out.failure} " \
                    f"{out.detail[-300:]}"
            except OSError as exc:
                reason = f"kvm probe failed: {exc}"
        _accel_cache[key] = result
        try:
            tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"key": key, "accel": result, "reason": reason}))
            os.replace(tmp, cache_file)
        except OSError:
            pass
        return result


# --------------------------------------------------------------------------- the sandbox


class MicroVMSandbox(Sandbox):
    """One job, one VM. ``create``/``write`` stage in memory, ``exec`` boots."""

    name: ClassVar[str] = "microvm"
    host_clock: ClassVar[bool] = False
    own_machine: ClassVar[bool] = True
    workspace_path = GUEST_WORKSPACE
    overhead_seconds: ClassVar[float] = BOOT_TIMEOUT + REPORT_GRACE  # a boot, then the report
    handlers_path = GUEST_HANDLERS

    def __init__(self, template: Template, ttl_seconds: float, image: ImageInfo) -> None:
        self.template = template
        self.ttl_seconds = ttl_seconds
        self.image = image
        self.python = self.handler_python(template)
        self.created = time.monotonic()
        self.files: dict[str, bytes] = {}
        self.last_boot: BootOutcome | None = None
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        #: an exec is under way: its QEMU may exist before on_spawn registers it (Popen returns
        #: after the exec), so a kill in that window waits for the registration (_destroy)
        self._running = False
        self._spawned = threading.Condition(self._lock)
        self._cancel = threading.Event()
        self._killed = False
        self._control = Control()  # the running VM's channel input (a batch runner's stop)

    # -- protocol

    @classmethod
    def check(cls) -> None:
        if _qemu_binary() is None:
            raise SandboxUnavailable(
                "qemu-system-x86_64 not found: apt-get install -y qemu-system-x86")
        load_image()

    missing_program_hint: ClassVar[str] = (
        "add it to the guest: fleetless microvm build-image --apt PACKAGE or --pip REQUIREMENT")

    @classmethod
    def handler_python(cls, template: Template) -> str:
        return template.python or GUEST_PYTHON

    @classmethod
    def has_program(cls, template: Template, path: str) -> bool:
        """Looked up in the guest image's initramfs (the per-boot archive adds no programs)."""
        return guest_has_program(load_image(), path)

    @classmethod
    def describe(cls) -> str:
        return f"accelerator: {accel()}"

    @classmethod
    def caps(cls, limits: Limits | None = None) -> dict[str, str]:
        """The guest's own kernel holds them: RAM, vCPUs, RLIMIT_NPROC inside the guest."""
        limits = limits or Limits()
        return {
            "pids": (f"{NOT}: --pids not set" if limits.pids is None else
                     f"capped by RLIMIT_NPROC at {limits.pids} inside the guest (its own kernel and pid space)"),
            "memory": (f"capped by the guest's RAM ({max(MIN_MEMORY_MIB, (limits.memory_bytes or 0) // MiB)} MiB)"),
            "cpu": f"capped by the guest's vCPUs ({math.ceil(limits.cpus or 1)})",
            "disk": "capped by the guest: its workspace and /tmp are in its RAM",
        }

    @classmethod
    def accel(cls) -> str:
        """Which accelerator the VMs run with here: ``"kvm"`` or ``"tcg"``."""
        return accel()

    @classmethod
    def create(cls, template: Template, ttl_seconds: float = 900) -> MicroVMSandbox:
        cls.check()
        if not template.handlers_dir.is_dir():
            raise SandboxUnavailable(f"handlers dir {template.handlers_dir} is not a directory")
        return cls(template, ttl_seconds, load_image())

    def write(self, path: str, data: bytes | str) -> None:
        if self._killed:
            raise RuntimeError("sandbox was killed")
        norm = os.path.normpath(path)
        if norm.startswith(("/", "..")) or norm == ".":
            raise ValueError(f"path must be relative to the workspace: {path!r}")
        self.files[norm] = data.encode() if isinstance(data, str) else bytes(data)

    def _guest_job(self, argv: Sequence[str], timeout: float) -> GuestJob:
        limits = self.template.limits
        rlimits: dict[str, int] = {}
        if limits.pids is not None:
            rlimits["NPROC"] = limits.pids
        if limits.open_files is not None:
            rlimits["NOFILE"] = limits.open_files
        if limits.file_size_bytes is not None:
            rlimits["FSIZE"] = limits.file_size_bytes
        cpu = limits.cpu_seconds if limits.cpu_seconds is not None else math.ceil(timeout) + 5
        rlimits["CPU"] = cpu
        return GuestJob(list(argv), {"HOME": self.workspace_path, **self.template.env}, timeout, dict(self.files),
                        limits.stdout_bytes, limits.stderr_bytes, rlimits,
                        stream=self.on_stdout is not None)  # watched (a batch's pacer): streamed

    def memory_mib(self) -> int:
        mem = self.template.limits.memory_bytes
        return max(MIN_MEMORY_MIB, math.ceil(mem / MiB) if mem else 512)

    def cpus(self) -> int:
        cpus = self.template.limits.cpus
        return max(1, min(math.ceil(cpus) if cpus else 1, os.cpu_count() or 1))

    def exec(self, argv: Sequence[str], timeout_seconds: float) -> ExecResult:
        ttl_deadline = self.created + self.ttl_seconds
        ttl_msg = f"killed: ttl of {_fmt_seconds(self.ttl_seconds)} s expired"
        with self._lock:  # _destroy sets _killed under the lock: it sees this exec, or it sees none
            if self._killed:
                return ExecResult(-signal.SIGKILL, "", "", 0.0, "killed: sandbox destroyed")
            self._running = True
        try:
            if time.monotonic() >= ttl_deadline:
                return ExecResult(-signal.SIGKILL, "", "", 0.0, ttl_msg)
            job = self._guest_job(argv, timeout_seconds)
            limits = self.template.limits
            mem = self.memory_mib()

            def on_spawn(proc: subprocess.Popen[bytes]) -> None:
                with self._lock:
                    self._proc = proc
                    self._spawned.notify_all()
                if self._cancel.is_set():
                    proc.kill()

            out = self._restore(job, mem, ttl_deadline, on_spawn)
            if out is None:
                out = boot(self.image, [job], self.template.handlers_dir, accel=accel(self.image),
                           memory_mib=mem, cpus=self.cpus(), tmp_bytes=limits.tmp_bytes,
                           network=limits.network, hard_deadline=ttl_deadline, on_spawn=on_spawn,
                           cancelled=self._cancel, control=self._control, on_stdout=self.stdout_seen)
        finally:
            with self._lock:
                self._proc = None
                self._running = False
                self._spawned.notify_all()
        self.last_boot = out
        res = out.results[0]
        wall = out.wall
        if res is not None:
            stdout = res.stdout.decode(errors="replace")
            stderr = res.stderr.decode(errors="replace")
            killed = None
            if res.timed_out:
                killed = f"killed: timeout after {_fmt_seconds(timeout_seconds)} s"
            elif res.oom:
                killed = f"killed: memory limit {mem} MiB exceeded"
            else:  # SIGXCPU / SIGXFSZ from the guest's rlimits, named as the other tiers name them
                killed = rlimit_kill_reason(res.exit_code, {f"RLIMIT_{k}": v for k, v in job.rlimits.items()})
            return ExecResult(res.exit_code, stdout, stderr, wall, killed, stdout_cut=res.stdout_cut)
        if out.failure == "ttl":
            killed = ttl_msg
        elif out.failure == "deadline":
            killed = f"killed: timeout after {_fmt_seconds(timeout_seconds)} s" if out.boot is not None \
                else f"killed: vm did not boot within {_fmt_seconds(BOOT_TIMEOUT)} s"
        elif out.failure == "killed":
            killed = "killed: sandbox destroyed"
        else:
            killed = f"killed: vm failed: {out.failure}"
        partial = out.partial.decode(errors="replace")  # what a streamed job wrote before the end
        if out.failure in ("ttl", "killed") or (out.failure == "deadline" and out.boot is not None):
            # The host stopped the VM on purpose: the reason is all there is to say (the kernel
            # console's tail, e.g. "PCI: Fatal: No config space access function found", is noise
            # here; it stays in sbx.last_boot for diagnostics).
            return ExecResult(-signal.SIGKILL, partial, "", wall, killed)
        detail = f"fleetless microvm: {killed}" + (f" ({out.detail})" if out.detail else "")
        return ExecResult(-signal.SIGKILL, partial, detail[-limits.stderr_bytes:], wall, killed)

    def _restore(self, job: GuestJob, mem: int, ttl_deadline: float,
                 on_spawn: Any) -> BootOutcome | None:
        """The job in a copy of the snapshot; None when it must cold-boot instead (the reason
        logged once: see :mod:`fleetless.sandbox.microvm.snapshot`)."""
        from fleetless.sandbox.microvm import snapshot as microvm_snapshot

        binary = _qemu_binary()
        limits = self.template.limits
        if binary is None:
            return None
        snap = microvm_snapshot.usable(self.image, binary, mem, self.cpus(), accel(self.image),
                                       limits.network)
        if snap is None:
            return None
        out = microvm_snapshot.restore(snap, self.image, [job], self.template.handlers_dir,
                                       tmp_bytes=limits.tmp_bytes, hard_deadline=ttl_deadline,
                                       on_spawn=on_spawn, cancelled=self._cancel, control=self._control,
                                       on_stdout=self.stdout_seen)
        if isinstance(out, str):
            microvm_snapshot.say_once(out)
            return None
        if not out.restored and out.failure == "restore failed" and not self._cancel.is_set():
            # The copy died before its runner said anything (nothing of the job ran): a cold
            # boot runs it.
            microvm_snapshot.say_once(f"{out.failure} {out.detail}".strip())
            return None
        return out

    def stop_batch_runner(self) -> bool:
        """Through the guest's runner (the channel): the batch runner starts no other job. A stop
        asked for while the VM boots goes out once the guest holds its channel."""
        if self._killed:
            return False
        self._control.stop()
        return True

    def _destroy(self) -> None:
        self._cancel.set()
        with self._lock:
            self._killed = True
            # A QEMU exists from its exec on, but is registered (on_spawn) only once Popen has
            # returned: wait for that, or for the exec to end (the cancel stops a boot not yet
            # spawned), so that kill() never returns while a machine of this sandbox runs.
            self._spawned.wait_for(lambda: self._proc is not None or not self._running, timeout=30)
            proc = self._proc
        if proc is not None:
            try:
                proc.kill()
            except (ProcessLookupError, OSError):
                pass
            # kill() returns only when the machine is gone (Popen.wait is safe beside the exec's
            # thread waiting for the same process)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                logging.getLogger(__name__).warning("QEMU pid %d did not exit within 30 s of SIGKILL", proc.pid)
        self.files.clear()
