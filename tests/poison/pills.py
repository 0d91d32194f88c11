"""The poison pills and the well-behaved job they run beside, as handler sources.

Every pill does the harmful thing plainly, the way a buggy or hostile handler would. Pills that
*try* something (write, read, connect, look) report each attempt on stdout and stderr in one line
(``<target>: denied (<reason>)`` or what they got) and exit 1 if they were denied everything that
matters, 0 if the harm succeeded: so a contained attempt ends ``dead`` with the denial in
``last_error``, and an uncontained one ends ``done`` with what it got in ``result``.

No pill sends a packet anywhere but to 127.0.0.1 (which, in every tier, is the sandbox's own
loopback: the process tier's where the kernel gives its jobs namespaces; or the host's, for the
process-tier kind with ``network = true``): the network pill only reads /proc/net and /sys/class/net.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GOOD = "good"

HANDLERS: dict[str, str] = {
    # A well-behaved job: reads its payload, writes and reads 1 MiB in its workspace, touches
    # 16 MiB of memory, starts a child process, prints a result that depends on the payload.
    "good.py": """
        import json, os, subprocess, sys
        p = json.load(open(sys.argv[1]))
        data = os.urandom(1 << 20)
        with open("scratch.bin", "wb") as f:
            f.write(data)
        with open("scratch.bin", "rb") as f:
            assert f.read() == data
        buf = bytearray(16 << 20)
        buf[::4096] = b"\\1" * len(range(0, len(buf), 4096))
        child = subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True, check=True)
        print(json.dumps({"n": p["n"], "square": p["n"] ** 2, "child": child.stdout.strip()}))
    """,
    "memory_bomb.py": """
        hog = []
        for _ in range(4096):  # 4 GiB in 1 MiB pieces, every page written
            hog.append(b"x" * (1 << 20))
        print(f"allocated {len(hog)} MiB")
    """,
    "fork_bomb.py": """
        import os, time
        while True:
            try:
                os.fork()
            except OSError:
                time.sleep(0.01)
    """,
    "busy_loop.py": """
        while True:
            pass
    """,
    "sleep_past_ttl.py": """
        import time
        time.sleep(3600)
    """,
    "segfault.py": """
        import faulthandler
        faulthandler.disable()  # no Python traceback: die of the signal like any C crash
        faulthandler._read_null()  # reads address 0
    """,
    "stdout_1gib.py": """
        import sys
        chunk = b"y" * (1 << 20)
        for _ in range(1024):
            sys.stdout.buffer.write(chunk)
        sys.stdout.flush()
        print("wrote 1 GiB to stdout", file=sys.stderr)
    """,
    "workspace_1gib": """
        #!/bin/sh
        # 1 GiB of zeros into one file of the workspace.
        exec dd if=/dev/zero of=big.bin bs=1M count=1024
    """,
    "workspace_1gib_files.py": """
        import sys
        chunk = b"z" * (1 << 20)
        written = 0
        try:
            for i in range(32):  # 32 files of 32 MiB: each under any file size limit of the tests
                with open(f"part{i}.bin", "wb") as f:
                    for _ in range(32):
                        f.write(chunk)
                        written += len(chunk)
        finally:
            print(f"wrote {written >> 20} MiB to the workspace", file=sys.stderr)
            print(f"wrote {written >> 20} MiB to the workspace")
    """,
    "write_system.py": """
        import json, os, sys
        p = json.load(open(sys.argv[1]))
        here = os.path.dirname(os.path.abspath(__file__))
        denied = 0
        for target in (p["usr_file"], os.path.join(here, "planted.py"), os.path.abspath(__file__)):
            try:
                with open(target, "a") as f:
                    f.write("# poisoned\\n")
                line = f"{target}: written"
            except OSError as exc:
                denied += 1
                line = f"{target}: denied ({exc.strerror})"
            print(line)
            print(line, file=sys.stderr)
        sys.exit(1 if denied else 0)
    """,
    "read_secrets.py": """
        import os, sys
        denied = 0
        def report(line):
            print(line)
            print(line, file=sys.stderr)
        try:
            with open("/etc/shadow", "rb") as f:
                report(f"/etc/shadow: read {len(f.read())} bytes")
        except OSError as exc:
            denied += 1
            report(f"/etc/shadow: denied ({exc.strerror})")
        try:
            report(f"/root: listed {len(os.listdir('/root'))} entries")
        except OSError as exc:
            denied += 1
            report(f"/root: denied ({exc.strerror})")
        sys.exit(1 if denied == 2 else 0)
    """,
    "read_environment.py": """
        import os, sys
        NAMES = ("DATABASE_URL", "PGPASSWORD", "FLEETLESS_POISON_SECRET")
        lines = []
        own = [n for n in NAMES if n in os.environ]
        lines.append(f"own environment: {' '.join(own) if own else 'none of ' + ', '.join(NAMES)}")
        try:
            with open("/proc/1/environ", "rb") as f:
                names = sorted(v.split(b"=")[0].decode() for v in f.read().split(b"\\0") if v)
            lines.append(f"/proc/1/environ: read, variables: {' '.join(names) or 'none'}")
        except OSError as exc:
            lines.append(f"/proc/1/environ: denied ({exc.strerror})")
        found, readable, denied = [], 0, 0
        for pid in sorted((e for e in os.listdir("/proc") if e.isdigit()), key=int):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = f.read().decode(errors="replace").split("\\0")
            except OSError:
                denied += 1
                continue
            readable += 1
            for var in env:
                name, _, value = var.partition("=")
                if name == "FLEETLESS_POISON_SECRET":
                    found.append(f"found {var} in /proc/{pid}/environ")
                elif name in NAMES:
                    found.append(f"found {name} in /proc/{pid}/environ")
        lines.append(f"environ of {readable} processes readable, {denied} denied")
        lines += found or ["found no secret"]
        for line in lines:
            print(line)
            print(line, file=sys.stderr)
        sys.exit(0 if found or own else 1)
    """,
    "sibling_writer.py": """
        import json, os, sys, time
        p = json.load(open(sys.argv[1]))
        with open("secret.txt", "w") as f:
            f.write(p["secret"])
        print(f"secret written to {os.path.join(os.getcwd(), 'secret.txt')}", flush=True)
        deadline = time.monotonic() + p["wait"]
        while time.monotonic() < deadline and not os.path.exists("seen"):
            time.sleep(0.05)
        print("the sibling read it" if os.path.exists("seen") else "no sibling came")
    """,
    "sibling_reader.py": """
        import glob, json, os, sys, time
        p = json.load(open(sys.argv[1]))
        mine = os.getcwd()
        patterns = [os.path.join(p["workdir"], "ws-*", "secret.txt"),
                    os.path.join(os.path.dirname(mine), "*", "secret.txt")]
        deadline = time.monotonic() + p["wait"]
        while True:
            hits = sorted({h for pat in patterns for h in glob.glob(pat) if os.path.dirname(h) != mine})
            if hits or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        for hit in hits:
            print(f"read {hit}: {open(hit).read()}")
            open(os.path.join(os.path.dirname(hit), "seen"), "w").close()
        if not hits:
            msg = f"no sibling workspace visible: nothing matches {' or '.join(patterns)}"
            print(msg)
            print(msg, file=sys.stderr)
            sys.exit(1)
    """,
    "connect_postgres.py": """
        import socket, struct, sys
        def report(line, code):
            print(line)
            print(line, file=sys.stderr)
            sys.exit(code)
        try:
            s = socket.create_connection(("127.0.0.1", 5432), timeout=3)
        except OSError as exc:
            report(f"127.0.0.1:5432: denied ({exc.strerror or type(exc).__name__})", 1)
        params = b"user\\0postgres\\0database\\0postgres\\0\\0"
        s.sendall(struct.pack("!ii", 8 + len(params), 196608) + params)
        head = s.recv(9)
        s.sendall(b"X\\0\\0\\0\\4")
        s.close()
        if head[:1] == b"R" and len(head) == 9 and struct.unpack("!i", head[5:9])[0] == 0:
            report("127.0.0.1:5432: connected, logged in as postgres without a password", 0)
        report(f"127.0.0.1:5432: connected, server answered {head[:1]!r}", 0)
    """,
    "connect_postgres_socket.py": """
        import glob, socket, struct, sys
        def report(line, code):
            print(line)
            print(line, file=sys.stderr)
            sys.exit(code)
        found = sorted({p for d in ("/run/postgresql", "/var/run/postgresql", "/tmp")
                        for p in glob.glob(d + "/.s.PGSQL.*") if not p.endswith(".lock")})
        if not found:
            report("no PostgreSQL socket visible", 1)
        for path in found:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(3)
            try:
                s.connect(path)
            except OSError as exc:
                report(f"{path}: denied ({exc.strerror or type(exc).__name__})", 1)
            params = b"user\\0postgres\\0database\\0postgres\\0\\0"
            s.sendall(struct.pack("!ii", 8 + len(params), 196608) + params)
            head = s.recv(9)
            s.close()
            if head[:1] == b"R" and len(head) == 9 and struct.unpack("!i", head[5:9])[0] == 0:
                report(f"{path}: connected, logged in as postgres without a password", 0)
            report(f"{path}: connected, server answered {head[:1]!r}", 0)
    """,
    "network_probe.py": """
        import json, os, sys
        def read(path):
            try:
                with open(path) as f:
                    return f.read().splitlines()
            except OSError as exc:
                return f"denied ({exc.strerror})"
        dev = read("/proc/net/dev")
        route = read("/proc/net/route")
        route6 = read("/proc/net/ipv6_route")
        try:
            sysnet = sorted(os.listdir("/sys/class/net"))
        except OSError as exc:
            sysnet = f"denied ({exc.strerror})"
        view = {
            "dev": sorted(l.split(":")[0].strip() for l in dev[2:]) if isinstance(dev, list) else dev,
            "routes": sorted(" ".join(l.split()[:3]) for l in route[1:] if l.strip())
                      if isinstance(route, list) else route,
            "routes6": sorted(l.split()[-1] + " " + l.split()[0] for l in route6
                              if l.strip() and l.split()[-1] != "lo") if isinstance(route6, list) else route6,
            "sys_class_net": sysnet,
        }
        print(json.dumps(view, sort_keys=True))
        ifaces = set(view["dev"] if isinstance(view["dev"], list) else [])
        ifaces |= set(sysnet if isinstance(sysnet, list) else [])
        off = sorted(ifaces - {"lo"})
        routes = [r for r in (view["routes"] if isinstance(view["routes"], list) else []) if r.split()[0] != "lo"]
        if off or routes or (isinstance(view["routes6"], list) and view["routes6"]):
            print(f"found a way off the machine: interfaces {off}, routes {routes}", file=sys.stderr)
            sys.exit(0)
        print("denied: no interface but lo, no route off the machine", file=sys.stderr)
        sys.exit(1)
    """,
    "setsid_daemon.py": """
        import json, os, sys
        p = json.load(open(sys.argv[1]))
        r, w = os.pipe()
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:  # the grandchild: a daemon in its own session, stdio detached
                os.close(r)
                os.write(w, str(os.getpid()).encode())
                os.close(w)
                null = os.open("/dev/null", os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(null, fd)
                os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(600)", p["marker"]])
            os._exit(0)
        os.close(w)
        pid = os.read(r, 32).decode()
        os.wait()
        print(f"daemon {pid} started in its own session")
    """,
}


@dataclass(frozen=True)
class Job:
    kind: str
    payload: dict[str, object] = field(default_factory=dict)
    timeout: float | None = None  # the job's own timeout (else the drain's)
    priority: int = 50


@dataclass(frozen=True)
class Pill:
    name: str
    jobs: tuple[Job, ...]
    via_cli: bool = False  # run by a ``fleetless drain`` process (its environment holds secrets)
    ttl: float | None = None  # the drain's TTL (process/bwrap drains)


def pills(*, workdir: str, usr_file: str, secret: str, marker: str, sibling_wait: float) -> dict[str, Pill]:
    """Every pill, with the payloads of this run."""
    out = [
        Pill("memory_bomb", (Job("memory_bomb"),)),
        Pill("fork_bomb", (Job("fork_bomb", timeout=2),)),
        Pill("busy_loop", (Job("busy_loop", timeout=2),)),
        Pill("sleep_past_ttl", (Job("sleep_past_ttl", timeout=600, priority=90),), ttl=2),
        Pill("segfault", (Job("segfault"),)),
        Pill("stdout_1gib", (Job("stdout_1gib", priority=80),)),
        Pill("workspace_1gib", (Job("workspace_1gib"),)),
        Pill("workspace_1gib_files", (Job("workspace_1gib_files"),)),
        Pill("write_system", (Job("write_system", {"usr_file": usr_file}),)),
        Pill("read_secrets", (Job("read_secrets"),)),
        Pill("read_environment", (Job("read_environment"),), via_cli=True),
        Pill("sibling_workspace", (
            Job("sibling_writer", {"secret": secret, "wait": sibling_wait}, priority=100),
            Job("sibling_reader", {"workdir": workdir, "wait": sibling_wait}, priority=100),
        )),
        Pill("connect_postgres", (Job("connect_postgres"),)),
        Pill("connect_postgres_socket", (Job("connect_postgres_socket"),)),
        Pill("network_probe", (Job("network_probe"),)),
        Pill("setsid_daemon", (Job("setsid_daemon", {"marker": marker}),)),
    ]
    return {p.name: p for p in out}
