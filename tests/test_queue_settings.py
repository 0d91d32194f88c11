"""Operating queues (issue 28): a paused queue is never claimed (per-job, batch, limited kinds,
watch mode) until it is resumed, and its running jobs finish; a queue's concurrency caps its
running jobs across racing drainers. Every assertion reads the table, never a drainer's memory."""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import pytest
from test_kind_limits import most_at_once, race, settings_file

from fleetless import Queue
from fleetless.drainer import DrainConfig, Drainer
from fleetless.kinds import load
from fleetless.queue import QueueSettings

from proctools import wait_for

pytestmark = pytest.mark.usefixtures("private_workdir")

LISTENING = "SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'LISTEN%%' AND datname = current_database()"


def test_a_paused_queue_is_never_claimed_until_it_is_resumed(queue: Queue, sql) -> None:
    assert queue.pause_queue("held") == QueueSettings("held", paused=True, concurrency=None)  # no job yet
    held = [queue.enqueue("k", {"i": i}, queue="held", priority=5) for i in range(3)]
    free = queue.enqueue("k", {}, queue="free")
    assert [j.id for j in queue.claim(10)] == [free]  # priority 5 or not
    assert queue.claim(10, queues=["held"]) == []
    assert queue.claim(10, one_kind=True) == []
    assert queue.next_due(["held"]) is None and queue.next_due() is None  # a watcher sleeps, never spins
    assert sql("SELECT count(*) FROM fleetless.jobs WHERE queue = 'held' AND status = 'pending'") == [(3,)]
    assert queue.resume_queue("held") == QueueSettings("held", paused=False, concurrency=None)
    assert queue.next_due() is not None
    assert sorted(j.id for j in queue.claim(10, queues=["held"])) == held


def test_a_paused_queue_is_skipped_by_batches_and_limited_kinds_too(queue: Queue, handlers) -> None:
    h = settings_file(handlers(**{"lim.py": "", "plain.py": ""}), "[kinds.lim]\nconcurrency = 5\n")
    kinds = load(h)
    queue.pause_queue("p")
    for kind in ("lim", "plain"):
        queue.enqueue(kind, {}, queue="p")
    assert queue.claim(10, kinds=kinds) == []
    assert queue.claim(10, kinds=kinds, one_kind=True) == []
    queue.resume_queue("p")
    assert sorted(j.kind for j in queue.claim(10, kinds=kinds)) == ["lim", "plain"]


def test_running_jobs_of_a_queue_paused_under_them_finish(queue: Queue, sql) -> None:
    queue.enqueue("k", {}, queue="p")
    (job,) = queue.claim(1)
    queue.pause_queue("p")
    assert queue.complete(job, "ok")
    assert sql("SELECT status FROM fleetless.jobs") == [("done",)]


def test_queue_names_and_concurrency_are_checked(queue: Queue) -> None:
    with pytest.raises(ValueError, match="invalid queue name"):
        queue.pause_queue("no spaces")
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="invalid concurrency"):
            queue.set_queue_concurrency("q", bad)  # type: ignore[arg-type]


def test_a_watcher_stops_claiming_a_paused_queue_and_is_woken_by_its_resume(queue: Queue, sql, handlers,
                                                                          dsn: str) -> None:
    h = handlers(**{"k.py": "print('ran')"})
    drainer = Drainer(queue, DrainConfig(handlers_dir=h, watch=True, idle_exit=300, queues=("w", "x")))
    t = threading.Thread(target=drainer.run)
    t.start()
    try:
        wait_for(lambda: sql(LISTENING) == [(1,)], what="the watcher to listen")
        app = Queue(dsn)
        try:
            app.pause_queue("w")
            paused = app.enqueue("k", {}, queue="w")
            other = app.enqueue("k", {}, queue="x")  # committed after the paused one: claimed after it
            wait_for(lambda: sql("SELECT status FROM fleetless.jobs WHERE id = %s", other) == [("done",)],
                     what="the other queue's job to be done")
            assert sql("SELECT status, attempts FROM fleetless.jobs WHERE id = %s", paused) == [("pending", 0)]
            heard = len(drainer._watcher.heard) if drainer._watcher else 0
            app.resume_queue("w")
        finally:
            app.close()
        wait_for(lambda: sql("SELECT status FROM fleetless.jobs WHERE id = %s", paused) == [("done",)],
                 what="the resumed queue's job to be done")
        assert drainer._watcher is not None and "w" in drainer._watcher.heard[heard:]  # woken by the resume
    finally:
        drainer.stop(grace=0)
        t.join(60)
    assert not t.is_alive()


def test_queue_commands_pause_resume_set_and_list(fleetless, queue: Queue, dsn: str) -> None:
    first = queue.enqueue("k", {}, queue="mail")
    queue.enqueue("k", {}, queue="mail")
    queue.enqueue("k", {}, queue="mail", after=[first])  # a workflow's child: waiting
    out = fleetless("queue", "pause", "mail", dsn=dsn)
    assert out.returncode == 0 and out.stdout.strip() == "queue mail paused", out
    out = fleetless("queue", "set", "mail", "--concurrency", "3", "--json", dsn=dsn)
    assert json.loads(out.stdout) == {"queue": "mail", "paused": True, "concurrency": 3}
    listed = fleetless("queue", "list", dsn=dsn)
    assert listed.stdout.split("\n")[1].split() == ["mail", "paused", "3", "2", "0", "0", "0", "0", "1"], listed.stdout
    rows: list[dict[str, Any]] = json.loads(fleetless("queue", "list", "--json", dsn=dsn).stdout)
    assert rows == [{"queue": "mail", "paused": True, "concurrency": 3, "pending": 2, "running": 0, "done": 0,
                     "dead": 0, "cancelled": 0, "waiting": 1}]
    out = fleetless("queue", "resume", "mail", dsn=dsn)
    assert out.stdout.strip() == "queue mail resumed"
    out = fleetless("queue", "set", "mail", "--concurrency", "none", "--json", dsn=dsn)
    assert json.loads(out.stdout)["concurrency"] is None
    bad = fleetless("queue", "set", "mail", "--concurrency", "0", dsn=dsn)
    assert bad.returncode == 2 and "'0' is not a positive integer or 'none'" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    bad = fleetless("queue", "pause", "bad name", dsn=dsn)
    assert bad.returncode == 1 and "invalid queue name 'bad name'" in bad.stderr


def test_a_misspelt_queue_is_set_with_a_warning_and_queue_remove_forgets_it(fleetless, queue: Queue, dsn: str,
                                                                            sql) -> None:
    """`queue pause medai` (a typo of media) paused a queue nothing uses, silently, and it stayed in
    `queue list` and status for good (newcomer review): it warns, and `queue remove` forgets it."""
    queue.enqueue("k", {}, queue="media")
    out = fleetless("queue", "pause", "medai", dsn=dsn)
    assert out.returncode == 0 and out.stdout.strip() == "queue medai paused", out
    assert out.stderr.strip() == ("fleetless: warning: queue medai has no jobs yet (did you mean media?); set anyway: "
                                  "'fleetless queue remove medai' forgets it"), out.stderr
    assert fleetless("queue", "pause", "media", dsn=dsn).stderr == ""  # a queue with jobs: no warning
    assert sorted(r["queue"] for r in queue.queues()) == ["medai", "media"]
    out = fleetless("queue", "remove", "medai", dsn=dsn)
    assert out.returncode == 0 and out.stdout.strip() == "queue medai: settings removed", out
    assert [r["queue"] for r in queue.queues()] == ["media"]
    again = fleetless("queue", "remove", "medai", dsn=dsn)
    assert again.returncode == 1 and again.stderr.strip() == "fleetless: error: queue medai has no settings to remove"
    removed = fleetless("queue", "remove", "media", "--json", dsn=dsn)
    assert json.loads(removed.stdout) == {"queue": "media", "removed": True}
    assert sql("SELECT count(*) FROM fleetless.queue_settings") == [(0,)]
    assert sql("SELECT queue, status FROM fleetless.jobs") == [("media", "pending")]  # its job untouched


def test_a_queues_concurrency_holds_across_racing_drainers(dsn: str, queue: Queue, sql, handlers) -> None:
    h = handlers(**{"slow.py": "import time; time.sleep(0.4)", "lim.py": "import time; time.sleep(0.2)"})
    h = settings_file(h, "[kinds.lim]\nconcurrency = 5\n")  # a limited kind inside a limited queue too
    queue.set_queue_concurrency("capped", 2)
    for i in range(8):
        queue.enqueue("slow", {"i": i}, queue="capped")
    for i in range(4):
        queue.enqueue("lim", {"i": i}, queue="capped")
    for i in range(6):
        queue.enqueue("slow", {"i": i}, queue="free")
    race(dsn, h, drainers=3, concurrency=3)  # up to 9 slots between them
    assert sql("SELECT queue, status, count(*) FROM fleetless.jobs GROUP BY 1, 2 ORDER BY 1") == [
        ("capped", "done", 12), ("free", "done", 6)]
    capped = sql("SELECT a.started_at, a.finished_at FROM fleetless.job_attempts a JOIN fleetless.jobs j"
                 " ON j.id = a.job_id WHERE j.queue = 'capped'")
    assert most_at_once(capped) == 2, capped  # never more than the limit, and the limit was reached
    free = sql("SELECT a.started_at, a.finished_at FROM fleetless.job_attempts a JOIN fleetless.jobs j"
               " ON j.id = a.job_id WHERE j.queue = 'free'")
    assert most_at_once(free) > 2, free  # the other queue is not held to it
    assert sql("SELECT count(DISTINCT pid) >= 2 FROM fleetless.job_attempts") == [(True,)]


def test_a_queues_concurrency_caps_its_batches_in_batch_mode(dsn: str, queue: Queue, sql, handlers) -> None:
    slow = "import time\n\ndef handle(payload):\n    time.sleep(0.2)\n    return 'ok'\n"
    h = handlers(**{"batched.py": slow, "other.py": slow})
    queue.set_queue_concurrency("capped", 3)
    for i in range(12):
        queue.enqueue("batched" if i % 2 else "other", {"i": i}, queue="capped")
    summary = Drainer(queue, DrainConfig(handlers_dir=h, concurrency=3, per_sandbox=5)).run()
    assert summary.done == 12
    spans = sql("SELECT started_at, finished_at FROM fleetless.job_attempts")
    assert len(spans) == 12 and most_at_once(spans) <= 3, spans  # claimed counts as running


def test_a_concurrency_set_while_drains_run_is_never_exceeded(queue: Queue, sql) -> None:
    for i in range(5):
        queue.enqueue("k", {"i": i}, queue="q")
    other = Queue(queue.conninfo)
    try:
        assert other.limited_queues() == []  # read now: none
        queue.set_queue_concurrency("q", 2)
        assert other.claim(10) == []  # its read is not a second old: the plain claim leaves q out anyway
        other._limits_read_at = -1e9  # a second later
        assert len(other.claim(10)) == 2
        assert queue.claim(10) == []
        queue.set_queue_concurrency("q", None)
        assert len(queue.claim(10)) == 3
    finally:
        other.close()


def test_the_dashboard_shows_paused_queues_and_toggles_them_behind_the_token(queue: Queue) -> None:
    from starlette.testclient import TestClient

    from fleetless.web import create_app

    token = "s3cret-token"
    queue.enqueue("k", {}, queue="mail")
    queue.pause_queue("mail")
    queue.set_queue_concurrency("mail", 4)
    read_only = TestClient(create_app(queue, token=None))
    page = read_only.get("/queues").text
    row = re.search(r"<tr><td><a [^>]*>mail</a></td>(.*?)</tr>", page)
    assert row is not None and re.findall(r"<td[^>]*>([^<]*)</td>", row.group(1))[:3] == ["4", "1", "0"], page
    assert '<span class="err">paused</span>' in row.group(1) and 'id="resume-mail"' in row.group(1)
    assert read_only.post("/queues/mail/resume").status_code == 403
    client = TestClient(create_app(queue, token=token))
    assert client.post("/queues/mail/resume").status_code == 401
    assert client.post("/queues/mail/resume", headers={"Authorization": "Bearer wrong"}).status_code == 401
    client.post("/login", data={"token": token})
    assert client.post("/queues/mail/resume", data={"csrf": "guess"}).status_code == 403
    assert queue.queues()[0]["paused"] is True  # nothing changed by any of them
    csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', client.get("/queues").text)
    assert csrf is not None
    done = client.post("/queues/mail/resume", data={"csrf": csrf.group(1)}, follow_redirects=False)
    assert done.status_code == 303 and queue.queues()[0]["paused"] is False
    assert 'id="pause-mail"' in client.get("/queues").text
    r = TestClient(create_app(queue, token=token)).post("/queues/mail/pause",
                                                        headers={"Authorization": f"Bearer {token}"})
    assert r.json() == {"queue": "mail", "action": "pause", "paused": True, "concurrency": 4}
    bad = client.post("/queues/no%20such/pause", data={"csrf": csrf.group(1)})
    assert bad.status_code == 400 and "invalid queue name" in bad.text


def test_status_names_what_a_pause_or_a_limit_holds_back(fleetless, queue: Queue, dsn: str, handlers) -> None:
    h = settings_file(handlers(**{"slow.py": "", "tick.py": "", "free.py": ""}),
                      '[kinds.slow]\nconcurrency = 1\n[kinds.tick]\nrate = "1/1h"\n')
    kinds = load(h)
    queue.pause_queue("mail")
    queue.enqueue("free", {}, queue="mail")
    queue.set_queue_concurrency("capped", 1)
    for _ in range(2):
        queue.enqueue("free", {}, queue="capped")
        queue.enqueue("slow", {})
        queue.enqueue("tick", {})
    assert sorted(j.kind for j in queue.claim(10, kinds=kinds)) == ["free", "slow", "tick"]  # one of each
    queue.set_queue_concurrency("idle", 5)  # limited, nothing due: not held back
    out = fleetless("status", "--handlers", str(h), dsn=dsn)
    assert out.returncode == 0, out.stderr
    said = ("held back: queue capped (concurrency 1 reached), queue mail paused,"
            " kind slow (concurrency 1 reached), kind tick (rate 1/3600s reached)")
    assert said in out.stdout.splitlines(), out.stdout
    assert json.loads(fleetless("status", "--json", dsn=dsn).stdout)["held_back"] == [  # no fleetless.toml: queues
        {"what": "queue", "name": "capped", "why": "concurrency", "limit": "1"},
        {"what": "queue", "name": "mail", "why": "paused", "limit": None}]
    queue.resume_queue("mail")
    queue.set_queue_concurrency("capped", None)
    assert "held back" not in fleetless("status", dsn=dsn).stdout


def test_a_drain_that_claims_nothing_says_what_holds_the_due_jobs_back(fleetless, queue: Queue, dsn: str,
                                                                         handlers, sql) -> None:
    """"drained: claimed 0" beside due jobs of a paused queue looked like a broken queue (newcomer
    review): with -v (or on a terminal) the drain says what holds them back; a cron tick's drain,
    neither, pays no extra query."""
    h = settings_file(handlers(**{"slow.py": "", "free.py": ""}), "[kinds.slow]\nconcurrency = 1\n")
    queue.pause_queue("media")
    queue.enqueue("free", {}, queue="media")
    r = fleetless("drain", "-v", "--handlers", str(h), "--sandbox", "process", dsn=dsn)
    assert r.returncode == 0 and "drained: claimed 0" in r.stdout, r.stderr
    assert "fleetless: nothing claimed; held back: queue media paused" in r.stderr.splitlines(), r.stderr
    quiet = fleetless("drain", "--handlers", str(h), "--sandbox", "process", dsn=dsn)
    assert quiet.returncode == 0 and "held back" not in quiet.stderr, quiet.stderr
    other = fleetless("drain", "-v", "--handlers", str(h), "--sandbox", "process", "--queue", "default", dsn=dsn)
    assert other.returncode == 0 and "held back" not in other.stderr, other.stderr  # not its queue
    queue.resume_queue("media")
    queue.enqueue("slow", {})
    queue.enqueue("slow", {})
    queue.claim(1, kinds=load(h), queues=("default",))  # another drain runs one: the kind's limit is reached
    r = fleetless("drain", "-v", "--handlers", str(h), "--sandbox", "process", "--queue", "default", dsn=dsn)
    assert "drained: claimed 0" in r.stdout, r.stdout
    assert "fleetless: nothing claimed; held back: kind slow (concurrency 1 reached)" in r.stderr.splitlines(), r.stderr
    assert sql("SELECT status, count(*) FROM fleetless.jobs WHERE kind = 'slow' GROUP BY 1 ORDER BY 1") == [
        ("pending", 1), ("running", 1)]
