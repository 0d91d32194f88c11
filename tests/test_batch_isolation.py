"""Issue 25 item 6: one hostile job of a batch against the jobs after it, through real drains on the
process and bwrap tiers, for a root drainer and for an unprivileged one with a subordinate range.

The first job of the batch attacks: it looks for the later jobs' payloads (in every file it can
read, and in its own memory), writes forged result lines for them on every pipe it can open (its
own fds and its runner's, through ``/proc``), and leaves a ``setsid`` daemon that rewrites every
``payload.json`` it finds. The jobs after it must each end with their own payload, untouched, see
no other job's secret, and find no daemon alive.
"""

from __future__ import annotations

import json
import os
import pwd
from pathlib import Path

import pytest
from security.drains import drain, handlers_dir, need_tier, need_user, shared, work_dir

__all__ = ["shared"]  # the fixture

USER = os.environ.get("FLEETLESS_TEST_SUBUID_USER", "fleetless-ci")

COMMON = """
import gc, json, os, subprocess, sys, time

DAEMON = '''
import glob, os, sys, time
sys.argv[0] = "fleetless-daemon"
end = time.monotonic() + 30
while time.monotonic() < end:
    for root in ("/workspace", os.environ.get("WS", ".")):
        for path in glob.glob(root + "/**/payload.json", recursive=True):
            try:
                open(path, "w").write('{"secret": "secret-daemon00", "n": -1}')
            except OSError:
                pass
    time.sleep(0.005)
'''

FORGED = ['{"i":%d,"ok":true,"result":"forged"}' % i for i in range(6)]
FORGED += ['{"i":%d,"exit":0,"stdout":"forged","stderr":"","killed":null,"duration":0}' % i for i in range(6)]


def peek(mine):
    # every secret that is not this job's own: in readable files of the sandbox, and in memory
    found = set()
    for root in (os.path.dirname(os.getcwd()), os.getcwd(), "/tmp"):
        for dirpath, _, files in os.walk(root):
            for name in files:
                try:
                    with open(os.path.join(dirpath, name), "rb") as f:
                        data = f.read(1 << 20)
                except OSError:
                    continue
                found.update(s[:8].decode("ascii", "replace") for s in data.split(b"secret-")[1:])
    for o in gc.get_objects():
        if isinstance(o, dict):
            for v in list(o.values()):
                if isinstance(v, (str, bytes)):
                    t = v if isinstance(v, bytes) else v.encode("utf-8", "replace")
                    found.update(s[:8].decode("ascii", "replace") for s in t.split(b"secret-")[1:])
    hexdigits = set("0123456789abcdef")
    return sorted(f for f in found - {mine[len("secret-"):], "daemon00"} if len(f) == 8 and set(f) <= hexdigits)


def forge():
    opened = []
    for where in ("/proc/self/fd", "/proc/%d/fd" % os.getppid()):
        try:
            names = os.listdir(where)
        except OSError:
            continue
        for fd in names:
            try:
                f = os.open(where + "/" + fd, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                continue
            try:
                for line in FORGED:
                    os.write(f, (line + "\\n").encode())
                opened.append(where + "/" + fd)
            except OSError:
                pass
            finally:
                os.close(f)
    return opened


def daemon_alive():
    for pid in os.listdir("/proc"):
        try:
            if b"fleetless-daemon" in open("/proc/%s/cmdline" % pid, "rb").read():
                return True
        except OSError:
            continue
    return False


def attack():
    env = dict(os.environ, WS=os.path.dirname(os.getcwd()))
    subprocess.Popen([sys.executable, "-c", DAEMON], start_new_session=True, env=env,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
"""

MODULE = COMMON + """

def handle(payload):
    if payload["n"] == 0:
        attack()
        time.sleep(0.3)
        found = "PEEK=" + json.dumps(peek(payload["secret"]))
        print(found)
        print(found, file=sys.stderr, flush=True)
        forge()  # on its own report pipe too: then its own job fails, alone
        return found
    time.sleep(0.3)  # the daemon, if it lived, had time to act
    return {"secret": payload["secret"], "peek": peek(payload["secret"]), "daemon": daemon_alive()}
"""

SCRIPT = COMMON + """

time.sleep(0.3)
payload = json.load(open(sys.argv[1]))
if payload["n"] == 0:
    attack()
    time.sleep(0.3)
    found = "PEEK=" + json.dumps(peek(payload["secret"]))
    forge()  # its own stdout too: it fails, and says what it found on stderr
    print(found, file=sys.stderr, flush=True)
    sys.exit(1)
print(json.dumps({"secret": payload["secret"], "peek": peek(payload["secret"]), "daemon": daemon_alive()}))
"""


def _uid(user: str | None) -> int | None:
    if user is None:
        return None
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        pytest.skip(f"no user {user}")


@pytest.mark.parametrize("user", [None, USER], ids=["root-drainer", "subuid-drainer"])
@pytest.mark.parametrize("tier", ["process", "bwrap", "forkserver", "microvm"])
@pytest.mark.parametrize("kind", ["mod", "script"])
def test_a_hostile_job_of_a_batch_cannot_read_change_or_forge_the_later_jobs(
        kind: str, tier: str, user: str | None, dsn: str, shared: Path, sql) -> None:
    """Also on the microVM tier, where the guest's python has no ctypes and the batch runner is no
    child subreaper: a job's setsid daemon outlived it and rewrote the next job's payload (red team,
    5th pass); its leftovers are now found by uid, the guest being the batch's own machine."""
    need_tier(tier)
    if tier in ("forkserver", "microvm") and user is not None:
        pytest.skip(f"the {tier} tier is run here by a root drainer")
    uid = _uid(user)
    need_user(uid)
    h = handlers_dir(shared, **{"mod.py": MODULE, "script.py": SCRIPT})
    work = work_dir(shared, uid)
    from fleetless import Queue

    q = Queue(dsn)
    q.init()
    secrets = [f"secret-{os.urandom(4).hex()}" for _ in range(4)]
    ids = [q.enqueue(kind, {"n": n, "secret": s}, max_attempts=1) for n, s in enumerate(secrets)]
    r = drain(dsn, h, work, "--per-sandbox", "10", "--concurrency", "1", "--pids", "64", "--memory", "256M",
              tier=tier, user=uid)
    assert r.returncode == 0, r.stderr
    rows = dict(sql("SELECT id, coalesce(result_json::text, result) FROM fleetless.jobs WHERE status = 'done'"))
    (attacker,) = sql("SELECT concat(result_json::text, result, last_error) FROM fleetless.jobs WHERE id = %s",
                      ids[0])[0]
    assert "PEEK=[]" in str(attacker)  # no later payload anywhere it can look
    results = [json.loads(rows[i].splitlines()[-1]) if i in rows else None for i in ids]
    for n in (1, 2, 3):  # each later job: its own payload, untouched; nothing of the others; no daemon
        assert results[n] == {"secret": secrets[n], "peek": [], "daemon": False}, (n, results[n])


@pytest.mark.parametrize("user", [None, USER], ids=["root-drainer", "subuid-drainer"])
@pytest.mark.parametrize("tier", ["process", "bwrap"])
def test_a_batch_is_sent_job_by_job_over_the_runners_channel_also_by_a_subordinate_range_drainer(
        tier: str, user: str | None, dsn: str, shared: Path, sql) -> None:
    """The runner gets each job over its two named pipes, one job at a time (channel mode), not all
    of them in a file up front (file mode): also where the drainer may not make pipes in its jobs'
    workspaces (a subordinate-range drainer's: its holder makes them, ``Holder.pipes``). Each job,
    a fork of the runner, reads the runner's argv as its own ``/proc/self/cmdline``. Before, a
    subordinate-range drainer's runner read ``batch.json``."""
    from fleetless import Queue
    from fleetless.batch import CHANNEL_IN, CHANNEL_OUT

    need_tier(tier)
    uid = _uid(user)
    need_user(uid)
    h = handlers_dir(shared, **{"argv.py": "def handle(payload):\n    return open('/proc/self/cmdline').read()"
                                           ".split('\\0')[-3:-1]\n"})
    work = work_dir(shared, uid)
    q = Queue(dsn)
    q.init()
    ids = [q.enqueue("argv", {"n": n}, max_attempts=1) for n in range(3)]
    r = drain(dsn, h, work, "--per-sandbox", "10", "--concurrency", "1", tier=tier, user=uid)
    assert r.returncode == 0, r.stderr
    rows = dict(sql("SELECT id, result_json FROM fleetless.jobs WHERE status = 'done'"))
    for i in ids:
        assert [os.path.basename(a) for a in rows[i]] == [CHANNEL_IN, CHANNEL_OUT], (rows.get(i), r.stderr)


#: A handle() that scans its own memory (every private, writable mapping that is anonymous, the
#: heap or the stack, as /proc/self/maps lists them) for every secret (``SECRET-<16 hex>-TERCES``),
#: its own or not. It reads through /proc/self/mem (a read of an unmapped page is an error there,
#: not a crash), or, where that cannot be opened, by writing each piece to a pipe from ctypes
#: (EFAULT, not a crash). The closing ``-TERCES``: without it the scan found, now and then, its own
#: secret with the last digit turned to ``0`` (``SECRET-…b507`` seen as ``SECRET-…b500``): glibc's
#: free() writes a freed chunk's size (0xa30 here: bytes ``30 0a 00 00 00 00 00 00``) as the next
#: chunk's prev_size, over the last bytes of a freed buffer that held the job's own payload, and the
#: scan's own reads then copy that around. Malloc's sizes and pointers end in zero bytes
#: (little-endian), so they cannot leave a whole ``-TERCES`` after the digits they change.
MEMORY_SCAN = r"""
import ctypes, os, re

PATTERN = re.compile(rb"SECRET-[0-9a-f]{16}-TERCES")
CHUNK = 1 << 15  # and 64 bytes more: within a pipe's 64 KiB


def _reader():
    try:
        mem = os.open("/proc/self/mem", os.O_RDONLY)
        return lambda addr, n: os.pread(mem, n, addr)
    except OSError:
        pass
    libc = ctypes.CDLL(None, use_errno=True)
    r, w = os.pipe()
    os.set_blocking(w, False)

    def probe(addr, n):
        done = libc.write(w, ctypes.c_void_p(addr), ctypes.c_size_t(n))
        if done <= 0:
            raise OSError(ctypes.get_errno(), "unreadable")
        return os.read(r, done)
    return probe


def scan():
    read = _reader()
    found, scanned = set(), 0
    with open("/proc/self/maps") as f:
        maps = f.read().splitlines()
    for line in maps:
        fields = line.split()
        perms, path = fields[1], (fields[5] if len(fields) > 5 else "")
        if not perms.startswith("rw") or perms[3] != "p" or path not in ("", "[heap]", "[stack]"):
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        pos = start
        while pos < end:
            n = min(CHUNK, end - pos)
            try:
                data = read(pos, n + 64 if pos + n < end else n)  # overlapping: no secret cut in two
            except OSError:
                pos += n
                continue
            scanned += len(data)
            found.update(m.decode() for m in PATTERN.findall(data))
            pos += n
    return found, scanned


def handle(payload):
    found, scanned = scan()
    mine = payload["secret"]
    return {"n": payload["n"], "own": mine in found, "others": sorted(found - {mine}), "scanned": scanned > 0}
"""


@pytest.mark.parametrize("per_sandbox", ["10", "1"], ids=["batch", "per-job"])
@pytest.mark.parametrize("user", [None, USER], ids=["root-drainer", "subuid-drainer"])
@pytest.mark.parametrize("tier", ["process", "bwrap", "forkserver"])
def test_no_job_of_a_batch_finds_another_jobs_payload_in_its_own_memory(
        tier: str, user: str | None, per_sandbox: str, dsn: str, shared: Path, sql) -> None:
    """Issue 25: each job of a batch starts from a process that never held another job's line or
    result (a fork of the runner's template, not of the runner, which reads them all). Before, a
    job's fork of the runner held the earlier jobs' payloads and results in freed heap pages. A job
    finds no secret but its own in its memory at all: none of its batch, none of the drains run
    before in this module's database (the other cases, root's and subordinate-range drainers'
    alike), also one job per sandbox."""
    need_tier(tier)
    if tier == "forkserver" and user is not None:
        pytest.skip("the fork server needs a root drainer")
    uid = _uid(user)
    need_user(uid)
    h = handlers_dir(shared, **{"memscan.py": MEMORY_SCAN})
    work = work_dir(shared, uid)
    from fleetless import Queue

    q = Queue(dsn)
    q.init()
    secrets = [f"SECRET-{os.urandom(8).hex()}-TERCES" for _ in range(5)]
    ids = [q.enqueue("memscan", {"n": n, "secret": s, "pad": "x" * (700 * n + 600)}, max_attempts=1)
           for n, s in enumerate(secrets)]
    r = drain(dsn, h, work, "--per-sandbox", per_sandbox, "--concurrency", "1", "--memory", "256M",
              tier=tier, user=uid)
    assert r.returncode == 0, r.stderr
    rows = dict(sql("SELECT id, result_json FROM fleetless.jobs WHERE status = 'done' AND id = ANY(%s)", ids))
    for n, i in enumerate(ids):  # its own payload is found (the scan works); no other secret at all
        result = rows.get(i)
        assert result is not None and result["own"] and result["scanned"], (n, result, r.stderr)
        assert result["others"] == [], (n, result)


@pytest.mark.parametrize("tier", ["process", "bwrap", "forkserver"])
def test_a_job_that_kills_its_template_ends_its_batch_and_the_rest_run_in_a_fresh_one(
        tier: str, dsn: str, shared: Path, sql) -> None:
    """The job's parent is the runner's template: a job may kill it (same uid). The job still gets
    its own outcome (the runner, its subreaper, reaps it and kills what it left) and the jobs after
    it run in a fresh sandbox, with a template of their own, uncharged."""
    need_tier(tier)
    need_user(None)
    h = handlers_dir(shared, **{"killer.py": """
        import os, signal, subprocess, sys, time
        def handle(payload):
            if payload.get("kill"):
                subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
                os.kill(os.getppid(), signal.SIGKILL)
                time.sleep(0.2)
            return {"n": payload["n"], "parent": os.getppid() != 1}
    """})
    work = work_dir(shared, None)
    from fleetless import Queue

    q = Queue(dsn)
    q.init()
    ids = [q.enqueue("killer", {"n": n, "kill": n == 1}, max_attempts=1) for n in range(4)]
    r = drain(dsn, h, work, "--per-sandbox", "10", "--concurrency", "1", tier=tier)
    assert r.returncode == 0, r.stderr
    rows = dict(sql("SELECT id, result_json FROM fleetless.jobs WHERE status = 'done' AND id = ANY(%s)", ids))
    assert [rows.get(i) for i in ids] == [{"n": n, "parent": True} for n in range(4)], r.stderr
    assert sql("SELECT max(attempts) FROM fleetless.jobs WHERE id = ANY(%s)", ids) == [(1,)]


@pytest.mark.parametrize("tier", ["process", "bwrap", "forkserver"])
def test_a_job_that_leaves_its_process_group_is_still_killed_at_its_timeout_alone(
        tier: str, dsn: str, shared: Path, sql) -> None:
    """A job of a batch moves itself into the group of a child it made, then outlives its
    timeout: the runner's kill of the job's group found no group (ProcessLookupError ended the
    runner: the job read 'exit code 1: ProcessLookupError'). Now the job is killed through its
    pidfd as well and ends 'killed: timeout'; the job after it runs."""
    need_tier(tier)
    need_user(None)
    h = handlers_dir(shared, **{"escape.py": """
        import os, time
        def handle(payload):
            if payload.get("escape"):
                r, w = os.pipe()
                child = os.fork()
                if child == 0:
                    os.setpgid(0, 0)
                    os.write(w, b"x")
                    time.sleep(99)
                    os._exit(0)
                os.read(r, 1)
                os.setpgid(0, child)
                time.sleep(99)
            return payload["n"]
    """})
    work = work_dir(shared, None)
    from fleetless import Queue

    q = Queue(dsn)
    q.init()
    ids = [q.enqueue("escape", {"n": n, "escape": n == 0}, max_attempts=1) for n in range(2)]
    r = drain(dsn, h, work, "--per-sandbox", "10", "--concurrency", "1", "--timeout", "3", tier=tier)
    assert r.returncode == 0, r.stderr
    rows = sql("SELECT status, last_error, result_json FROM fleetless.jobs WHERE id = ANY(%s) ORDER BY id", ids)
    assert rows[0][0] == "dead" and rows[0][1].startswith("killed: timeout after 3 s"), rows
    assert rows[1][:1] == ("done",) and rows[1][2] == 1, rows


SPOOF = """
import os


def handle(payload):
    if payload["n"] == 0:  # the batch's runner file, beside its own workspace: its text forged
        runner = os.path.join(os.path.dirname(os.getcwd()), "_fleetless_batch.py")
        try:
            with open(runner, "w") as f:
                f.write("\\n".join(f"FORGED-BY-AN-EARLIER-JOB line {i}" for i in range(1, 3000)))
        except OSError:
            pass
        return "forged"
    raise ValueError("genuine")
"""


@pytest.mark.parametrize("user", [None, USER], ids=["root-drainer", "subuid-drainer"])
@pytest.mark.parametrize("tier", ["process", "bwrap", "forkserver"])
def test_a_job_of_a_batch_cannot_write_the_error_text_of_a_later_job(
        tier: str, user: str | None, dsn: str, shared: Path, sql) -> None:
    """Red team, 4th pass: a later job's traceback began with the runner's own frame, whose source
    line Python reads from the runner's file in the batch's workspace, which an earlier job of the
    batch could rewrite: the later job's last_error showed the earlier job's text. Now a job's error
    holds its own frames only (the runner's are cut, as runpy's are)."""
    need_tier(tier)
    if tier == "forkserver" and user is not None:
        pytest.skip("the fork server needs a root drainer")
    uid = _uid(user)
    need_user(uid)
    h = handlers_dir(shared, **{"spoof.py": SPOOF})
    work = work_dir(shared, uid)
    from fleetless import Queue

    q = Queue(dsn)
    q.init()
    ids = [q.enqueue("spoof", {"n": n}, max_attempts=1) for n in range(3)]
    r = drain(dsn, h, work, "--per-sandbox", "10", "--concurrency", "1", tier=tier, user=uid)
    assert r.returncode == 0, r.stderr
    for later in ids[1:]:
        ((status, error),) = sql("SELECT status, last_error FROM fleetless.jobs WHERE id = %s", later)
        assert status == "dead" and error.startswith("ValueError: genuine"), (status, error)
        assert "FORGED" not in error and "_fleetless_batch.py" not in error, error
        assert 'spoof.py", line' in error, error  # the job's own frame is kept
