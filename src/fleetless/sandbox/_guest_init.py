"""The in-guest runner of the ``microvm`` tier: PID 1 of the VM, after a tiny ``/init`` shell.

This file is copied into every boot's per-job initramfs as ``/fleetless/runner.py`` and runs
with the guest's python (standard library only; it must not import ``fleetless``).

It reads the job list ``/fleetless/jobs.json`` (root-only; deleted once read)::

    {"nonce": "<hex>", "uid": 65534, "gid": 65534, "tmp_bytes": 67108864,
     "jobs": [{"id": "0", "argv": [...], "env": {...}, "cwd": "/workspace",
               "timeout": 10.0, "stdout_bytes": 65536, "stderr_bytes": 65536,
               "rlimits": {"NPROC": 128, "NOFILE": 256, "FSIZE": ..., "CPU": ...}}]}

and runs the jobs one after the other (batch mode runs many in one boot), each as an
unprivileged user in its own process group, killing every leftover process between jobs.

Results go to the host over the second serial port (``/dev/ttyS1``), which only this runner
holds: it opens the device, then removes its node, and the jobs run as another uid anyway.
Every record is one line ``FLEETLESS1 <nonce> <kind> <json>``; kinds: ``hello`` (booted),
``start`` (job id), ``result`` (id, exit_code, stdout/stderr base64, duration, timed_out,
oom), ``error`` (the runner failed) and ``done`` (all jobs ran; the host may stop the VM).
The job's stdout/stderr are pipes read by the runner; it never writes to the channel.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import resource
import selectors
import signal
import subprocess
import sys
import time
from typing import Any

CHANNEL = "/dev/ttyS1"
JOBS = "/fleetless/jobs.json"
MAGIC = "FLEETLESS1"
F_SETPIPE_SZ = 1031
#: Size of the job's stdout/stderr pipes and of each read (the kernel's default pipe-max-size).
PIPE_BYTES = 1 << 20
NET_MODULES = ("virtio_ring", "virtio", "virtio_mmio", "failover", "net_failover", "virtio_net")


class Channel:
    def __init__(self, path: str, nonce: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_NOCTTY | os.O_CLOEXEC)
        self.nonce = nonce
        try:
            import termios

            attrs = termios.tcgetattr(self.fd)
            attrs[1] &= ~termios.OPOST  # no \n -> \r\n translation
            termios.tcsetattr(self.fd, termios.TCSANOW, attrs)
        except Exception:
            pass

    def send(self, kind: str, body: dict[str, Any]) -> None:
        line = f"\n{MAGIC} {self.nonce} {kind} {json.dumps(body, separators=(',', ':'))}\n"
        data = line.encode()
        while data:
            n = os.write(self.fd, data)
            data = data[n:]

    def drain(self) -> None:
        try:
            import termios

            termios.tcdrain(self.fd)
        except Exception:
            pass


def sh(*argv: str) -> None:
    subprocess.run(argv, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def oom_kills() -> int:
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def kill_all_jobs() -> None:
    """SIGKILL every process but this one (PID 1 is spared by the kernel), then reap them."""
    try:
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:
        pass
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.005)


def run_job(job: dict[str, Any], uid: int, gid: int) -> dict[str, Any]:
    stdout_cap = int(job.get("stdout_bytes", 65536))
    stderr_cap = int(job.get("stderr_bytes", 65536))
    timeout = float(job["timeout"])
    rlimits: dict[str, int] = {k: int(v) for k, v in job.get("rlimits", {}).items()}

    def preexec() -> None:
        # In the child, still root: make the job the OOM killer's first choice (the runner
        # is exempt; a non-dumpable process could not do it after setuid), cap it, drop root.
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
        for name, value in rlimits.items():
            res = getattr(resource, f"RLIMIT_{name}", None)
            if res is not None:
                resource.setrlimit(res, (value, value))
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)

    oom_before = oom_kills()
    started = time.monotonic()
    try:
        proc = subprocess.Popen(
            job["argv"], cwd=job.get("cwd", "/workspace"), env=job.get("env", {}),
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            process_group=0, preexec_fn=preexec,
            close_fds=True,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        code = 127 if isinstance(exc, FileNotFoundError) else 126
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        msg = f"fleetless: cannot execute {job['argv'][0]}: {reason}\n"
        return {"id": job["id"], "exit_code": code, "stdout": "",
                "stderr": base64.b64encode(msg.encode()).decode(), "duration": 0.0,
                "timed_out": False, "oom": False}
    assert proc.stdout is not None and proc.stderr is not None
    for pipe in (proc.stdout, proc.stderr):
        # Big pipes: every read is a round trip through the emulated CPU (TCG), so a job
        # writing a gigabyte costs ~16x fewer of them than with the default 64 KiB.
        try:
            fcntl.fcntl(pipe.fileno(), F_SETPIPE_SZ, PIPE_BYTES)
        except OSError:
            pass
    devnull = os.open("/dev/null", os.O_WRONLY | os.O_CLOEXEC)
    out = bytearray()
    out_cut = False
    err = bytearray()
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "out")
    sel.register(proc.stderr, selectors.EVENT_READ, "err")
    deadline = started + timeout
    timed_out = False
    exited = False
    while sel.get_map():
        if not exited and proc.poll() is not None:
            # The job is over: its leftovers (background children) go too, so the pipes close.
            exited = True
            kill_all_jobs_but(proc)
        remaining = deadline - time.monotonic()
        if remaining <= 0 and not exited:
            timed_out = True
            exited = True
            kill_all_jobs_but(None)
        events = sel.select(timeout=0.05 if exited else min(max(remaining, 0.0), 0.05))
        for key, _ in events:
            if key.data == "out" and len(out) >= stdout_cap:
                # Past the cap: drop what the job writes without copying it through Python.
                try:
                    if os.splice(key.fd, devnull, PIPE_BYTES, flags=os.SPLICE_F_NONBLOCK):
                        out_cut = True
                        continue
                    chunk = b""
                except BlockingIOError:
                    continue
                except (OSError, AttributeError):
                    chunk = os.read(key.fd, PIPE_BYTES)
            else:
                chunk = os.read(key.fd, PIPE_BYTES)
            if not chunk:
                sel.unregister(key.fileobj)
                continue
            if key.data == "out":
                room = stdout_cap - len(out)
                out_cut = out_cut or len(chunk) > room
                if room > 0:
                    out += chunk[:room]
            else:
                err += chunk
                if len(err) > stderr_cap:
                    del err[: len(err) - stderr_cap]
    sel.close()
    os.close(devnull)
    proc.stdout.close()
    proc.stderr.close()
    code = proc.wait()
    duration = time.monotonic() - started
    kill_all_jobs()
    oom = code == -signal.SIGKILL and not timed_out and oom_kills() > oom_before
    return {"id": job["id"], "exit_code": code, "stdout": base64.b64encode(bytes(out)).decode(),
            "stderr": base64.b64encode(bytes(err)).decode(), "duration": round(duration, 4),
            "timed_out": timed_out, "oom": oom, "stdout_cut": out_cut}


def kill_all_jobs_but(proc: subprocess.Popen[bytes] | None) -> None:
    """Kill every process except PID 1, without reaping ``proc`` (Popen reaps it)."""
    try:
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if proc is not None:
        proc.poll()


def setup(tmp_bytes: int, network: bool) -> None:
    os.chmod("/dev/console", 0o600)
    for name in os.listdir("/dev"):
        if name.startswith(("tty", "vcs", "mem", "kmsg", "port", "hvc", "vport")):
            try:
                os.chmod(f"/dev/{name}", 0o600)
            except OSError:
                pass
    sh("/bin/busybox", "mount", "-t", "tmpfs", "-o", f"size={tmp_bytes},mode=1777,nosuid,nodev",
       "tmpfs", "/tmp")
    sh("/bin/busybox", "ip", "link", "set", "lo", "up")
    if network:
        # virtio-mmio network device (QEMU user-mode stack, slirp's fixed addresses).
        for mod in NET_MODULES:
            sh("/bin/busybox", "insmod", f"/lib/modules/fleetless/{mod}.ko")
        for argv in (("ip", "link", "set", "eth0", "up"),
                     ("ip", "addr", "add", "10.0.2.15/24", "dev", "eth0"),
                     ("ip", "route", "add", "default", "via", "10.0.2.2")):
            sh("/bin/busybox", *argv)
        with open("/etc/resolv.conf", "w") as f:
            f.write("nameserver 10.0.2.3\n")
    sh("/bin/busybox", "hostname", "fleetless")
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("-1000")
    except OSError:
        pass


def main() -> None:
    with open(JOBS) as f:
        desc = json.load(f)
    os.unlink(JOBS)
    channel = Channel(CHANNEL, desc["nonce"])
    os.unlink(CHANNEL)
    try:
        setup(int(desc.get("tmp_bytes", 64 << 20)), bool(desc.get("network", False)))
        channel.send("hello", {"uptime": open("/proc/uptime").read().split()[0]})
        uid = int(desc.get("uid", 65534))
        gid = int(desc.get("gid", 65534))
        for job in desc["jobs"]:
            channel.send("start", {"id": job["id"]})
            channel.send("result", run_job(job, uid, gid))
        channel.send("done", {})
    except BaseException as exc:
        channel.send("error", {"error": f"{type(exc).__name__}: {exc}"})
    channel.drain()
    # Stop the VM at once (the host stops it as soon as it reads "done" anyway).
    try:
        with open("/proc/sysrq-trigger", "w") as f:
            f.write("b")
    except OSError:
        pass
    sys.exit(0)


if __name__ == "__main__":
    main()
