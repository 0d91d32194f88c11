"""Simulated hosts: network namespaces a test creates, wired to one bridge, and a private
PostgreSQL cluster reachable only on that bridge's network.

``Network()`` makes a switch namespace holding a bridge; ``add_host(name)`` makes a namespace with
one veth pair onto that bridge and an address in ``SUBNET``. No namespace has a default route and
nothing is wired to the machine's own network, so traffic from a host can only reach the other
test hosts (and its own loopback). ``cut(host)`` takes the host's port on the switch down (a
pulled cable: packets are dropped, connections stay open and resume when it comes back) and
``restore(host)`` brings it up. ``close()`` kills every process left in the namespaces and deletes
them (their veths go with them); namespaces a killed test run left behind are deleted by the next.

Namespace names carry the creating process's pid (``flh<pid>x<random>-<host>``), so parallel runs
never collide and leftovers of dead runs are recognisable. Needs root.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import subprocess
import tempfile
import uuid
from pathlib import Path

from proctools import alive, wait_for

SUBNET = "10.231.0"  # /24, only ever inside the namespaces made here
PG_BIN = Path("/usr/lib/postgresql/15/bin")
_NAME = re.compile(r"^flh(\d+)x[0-9a-f]{4}-")


def unavailable() -> str | None:
    """Why simulated hosts cannot be made here (None when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is missing"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"ip netns does not work here: {probe.stderr.strip()}"
    return None


def _ip(*args: str) -> str:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r.stdout


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]


def _kill_and_delete(ns: str) -> None:
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
    for pid in map(int, pids):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in map(int, pids):
        wait_for(lambda pid=pid: not alive(pid), timeout=30, what=f"pid {pid} in {ns} to die")  # type: ignore[misc]
    subprocess.run(["ip", "netns", "delete", ns], capture_output=True)


def sweep_leftovers() -> list[str]:
    """Delete the namespaces of test runs whose process is gone (a run killed before cleanup)."""
    gone = []
    for ns in _namespaces():
        m = _NAME.match(ns)
        if m and not alive(int(m.group(1))):
            _kill_and_delete(ns)
            gone.append(ns)
    return gone


class Host:
    def __init__(self, network: Network, name: str, address: str) -> None:
        self.network, self.name, self.address = network, name, address
        self.ns = f"{network.prefix}-{name}"

    def prefix(self) -> tuple[str, ...]:
        """Put this in front of a command to run it on this host."""
        return ("ip", "netns", "exec", self.ns)

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.prefix(), *argv], capture_output=True, text=True, check=check,
                              stdin=subprocess.DEVNULL, timeout=60)

    def unsent_bytes(self) -> int:
        """Bytes this host's TCP connections have sent but the other end has not acknowledged:
        above 0 while the link is cut, once a process here has tried to write."""
        out = self.run("ss", "-tnH", "state", "established").stdout
        return sum(int(line.split()[1]) for line in out.splitlines() if line.strip())


class Network:
    def __init__(self) -> None:
        sweep_leftovers()
        self.prefix = f"flh{os.getpid()}x{uuid.uuid4().hex[:4]}"
        self.switch = f"{self.prefix}-sw"
        self.hosts: dict[str, Host] = {}
        self._made: list[str] = []
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")

    def add_host(self, name: str) -> Host:
        host = Host(self, name, f"{SUBNET}.{len(self.hosts) + 1}")
        _ip("netns", "add", host.ns)
        self._made.append(host.ns)
        _ip("-n", host.ns, "link", "set", "lo", "up")
        # One veth pair: "<name>" is the host's port on the switch, "eth0" its own interface.
        _ip("-n", self.switch, "link", "add", name, "type", "veth", "peer", "name", "eth0", "netns", host.ns)
        _ip("-n", self.switch, "link", "set", name, "master", "br0", "up")
        _ip("-n", host.ns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _ip("-n", host.ns, "link", "set", "eth0", "up")
        self.hosts[name] = host
        return host

    def cut(self, host: Host) -> None:
        _ip("-n", self.switch, "link", "set", host.name, "down")

    def restore(self, host: Host) -> None:
        _ip("-n", self.switch, "link", "set", host.name, "up")

    def close(self) -> None:
        for ns in reversed(self._made):
            _kill_and_delete(ns)
        self._made.clear()


class PrivatePostgres:
    """A PostgreSQL cluster of the test's own (``initdb``/``pg_ctl`` from ``PG_BIN``, as the
    ``postgres`` user), running in ``host``'s namespace and listening on its address only, plus a
    Unix socket in a private directory through which the test itself reads the table."""

    def __init__(self, host: Host, port: int = 5432) -> None:
        self.host, self.port = host, port
        self.dir = Path(tempfile.mkdtemp(prefix="fleetless-netns-pg-"))
        self.dir.chmod(0o755)
        self.data = self.dir / "data"
        pw = pwd.getpwnam("postgres")
        os.chown(self.dir, pw.pw_uid, pw.pw_gid)
        self._as_postgres = ("setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups")

    def _pg(self, tool: str, *args: str, timeout: float = 120) -> None:
        r = subprocess.run([*self.host.prefix(), *self._as_postgres, str(PG_BIN / tool), *args],
                           capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=timeout)
        if r.returncode != 0:
            log = self.dir / "log"
            raise RuntimeError(f"{tool} failed: {r.stderr.strip()}\n{log.read_text()[-2000:] if log.exists() else ''}")

    def start(self) -> PrivatePostgres:
        self._pg("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")
        with open(self.data / "pg_hba.conf", "a") as hba:
            hba.write(f"host all all {SUBNET}.0/24 trust\n")
        options = (f"-c listen_addresses={self.host.address} -c port={self.port} "
                   f"-c unix_socket_directories={self.dir} -c fsync=off -c max_connections=200")
        self._pg("pg_ctl", "-D", str(self.data), "-l", str(self.dir / "log"), "-o", options, "-w", "-t", "60", "start")
        return self

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            try:
                self._pg("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "-t", "30", "stop")
            except (RuntimeError, subprocess.TimeoutExpired):
                pid = int((self.data / "postmaster.pid").read_text().split()[0])
                os.kill(pid, signal.SIGKILL)
                wait_for(lambda: not alive(pid), timeout=30, what="the private postmaster to die")
        shutil.rmtree(self.dir, ignore_errors=True)

    def local_dsn(self, dbname: str = "postgres") -> str:
        """For the test itself, through the Unix socket (no network)."""
        return f"host={self.dir} port={self.port} user=postgres dbname={dbname}"

    def dsn(self, dbname: str = "postgres") -> str:
        """For drainers on the test hosts, over the bridge."""
        return f"postgresql://postgres@{self.host.address}:{self.port}/{dbname}"
