"""The dashboard over HTTP (Starlette's test client) and /metrics, against a real table."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from fleetless import Queue
from fleetless.web import create_app
from fleetless.web.app import COOKIE

TOKEN = "s3cret-token"


def _dead_job(queue: Queue, error: str = "exit code 1: ValueError: invoice 42 has no lines\nTraceback …") -> int:
    job_id = queue.enqueue("render-invoice", {"invoice": 42}, max_attempts=1)
    (job,) = queue.claim(1)
    queue.fail(job, error, delay=0)
    return job_id


def _status(sql: Any, job_id: int) -> str:
    return str(sql("SELECT status FROM fleetless.jobs WHERE id = %s", job_id)[0][0])


def test_overview_jobs_and_job_pages_show_the_table(queue: Queue) -> None:
    dead = _dead_job(queue)
    queue.enqueue_many([("thumbnail", {})] * 3)
    client = TestClient(create_app(queue))
    page = client.get("/")
    assert page.status_code == 200
    assert re.search(r'id="count-pending"><b>3</b>', page.text) and re.search(r'id="count-dead"><b>1</b>', page.text)
    assert '<svg id="per-minute"' in page.text
    listed = client.get("/jobs?status=dead")
    assert "exit code 1: ValueError: invoice 42 has no lines" in listed.text and "Traceback" not in listed.text
    shown = client.get(f"/jobs/{dead}")
    assert "invoice" in shown.text and "Traceback" in shown.text and 'id="retry"' in shown.text
    assert client.get("/jobs/999999").status_code == 404
    assert client.get("/jobs?status=bogus").status_code == 400


def test_job_output_cannot_inject_markup(queue: Queue) -> None:
    job_id = _dead_job(queue, "exit code 1: <script>alert(1)</script>\n<img src=x onerror=alert(2)>")
    text = TestClient(create_app(queue)).get(f"/jobs/{job_id}").text
    assert "<script>alert" not in text and "<img src=x" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    done_id = queue.enqueue("render", {"title": "</pre><b>payload</b>"})
    (job,) = queue.claim(1)
    queue.complete(job, "<iframe src=//evil>\x1b[2J")
    page = TestClient(create_app(queue)).get(f"/jobs/{done_id}").text
    assert "<iframe" not in page and "<b>payload" not in page and "\x1b" not in page
    assert '<pre id=result>&lt;iframe src=//evil&gt;\\x1b[2J</pre>' in page
    assert "&lt;/pre&gt;&lt;b&gt;payload&lt;/b&gt;" in page


def test_jobs_are_paged(queue: Queue) -> None:
    ids = queue.enqueue_many([("a", {})] * 7)
    client = TestClient(create_app(queue))
    first = client.get("/jobs?limit=5").text
    assert all(f"/jobs/{i}\"" in first for i in ids[2:]) and f"/jobs/{ids[1]}\"" not in first
    nxt = re.search(r'id="next-page" href="([^"]+)"', first)
    assert nxt is not None
    second = client.get(nxt.group(1).replace("&amp;", "&")).text
    assert f"/jobs/{ids[0]}\"" in second and f"/jobs/{ids[1]}\"" in second and f"/jobs/{ids[2]}\"" not in second


def test_without_a_token_actions_are_refused_and_change_nothing(queue: Queue, sql: Any) -> None:
    dead = _dead_job(queue)
    client = TestClient(create_app(queue, token=None))
    for path in (f"/jobs/{dead}/retry", f"/jobs/{dead}/cancel", f"/jobs/{dead}/run-now"):
        assert client.post(path).status_code == 403
        assert client.post(path, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 403
    assert client.post("/login", data={"token": TOKEN}).status_code == 403
    assert _status(sql, dead) == "dead"


def test_with_a_token_actions_need_credentials(queue: Queue, sql: Any) -> None:
    dead = _dead_job(queue)
    client = TestClient(create_app(queue, token=TOKEN))
    assert client.post(f"/jobs/{dead}/retry").status_code == 401
    assert client.post(f"/jobs/{dead}/retry", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert _status(sql, dead) == "dead"
    r = client.post(f"/jobs/{dead}/retry", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200 and r.json() == {"id": dead, "action": "retry", "status": "pending"}
    assert _status(sql, dead) == "pending"
    conflict = client.post(f"/jobs/{dead}/retry", headers={"Authorization": f"Bearer {TOKEN}"})
    assert conflict.status_code == 409 and "only dead or cancelled" in conflict.json()["error"]
    later = queue.enqueue("a", {}, delay=3600)
    assert client.post(f"/jobs/{later}/run-now", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    assert sql("SELECT run_after <= now() FROM fleetless.jobs WHERE id = %s", later) == [(True,)]
    assert client.post(f"/jobs/{later}/cancel", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    assert _status(sql, later) == "cancelled"


def test_the_sign_in_form_sets_a_cookie_and_forms_need_its_csrf_token(queue: Queue, sql: Any) -> None:
    dead = _dead_job(queue)
    client = TestClient(create_app(queue, token=TOKEN))
    assert client.post("/login", data={"token": "wrong"}).status_code == 401
    signed_in = client.post("/login", data={"token": TOKEN}, follow_redirects=False)
    assert signed_in.status_code == 303
    cookie = signed_in.headers["set-cookie"]
    assert cookie.startswith(f"{COOKIE}=") and "httponly" in cookie.lower() and "samesite=strict" in cookie.lower()
    # A cross-site form carries the cookie (in old browsers) but cannot know the CSRF token.
    assert client.post(f"/jobs/{dead}/retry", data={"csrf": "guess"}).status_code == 403
    assert client.post(f"/jobs/{dead}/retry").status_code == 403
    assert _status(sql, dead) == "dead"
    page = client.get(f"/jobs/{dead}").text
    csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', page)
    assert csrf is not None
    done = client.post(f"/jobs/{dead}/retry", data={"csrf": csrf.group(1)}, follow_redirects=False)
    assert done.status_code == 303 and _status(sql, dead) == "pending"
    client.cookies.set(COOKIE, "0" * 32 + "." + "0" * 64)  # forged session
    assert client.post(f"/jobs/{dead}/cancel", data={"csrf": csrf.group(1)}).status_code == 401


def test_metrics_are_read_from_the_table(queue: Queue, sql: Any, fleetless: Any, dsn: str) -> None:
    _dead_job(queue)
    queue.enqueue_many([("thumbnail", {})] * 2 + [{"kind": "mail", "payload": {}, "queue": "urgent"}])
    done = queue.enqueue("thumbnail", {})
    sql("UPDATE fleetless.jobs SET run_after = now() - interval '5 minutes' WHERE kind = 'mail'")
    (job,) = queue.claim(1, queues=["default"])
    sql("UPDATE fleetless.jobs SET started_at = now() - interval '3 seconds' WHERE id = %s", job.id)
    queue.complete(job)
    running = queue.claim(1, queues=["default"])
    text = TestClient(create_app(queue)).get("/metrics")
    assert text.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(text.text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert samples[("fleetless_jobs", (("kind", "mail"), ("queue", "urgent"), ("status", "pending")))] == 1
    assert samples[("fleetless_running_jobs", (("kind", "thumbnail"),))] == len(running) == 1
    assert samples[("fleetless_finished_jobs", (("kind", "thumbnail"), ("status", "done")))] == 1
    assert samples[("fleetless_oldest_due_job_age_seconds", (("queue", "urgent"),))] >= 299
    assert samples[("fleetless_attempts_finished_total", (("kind", "render-invoice"), ("outcome", "dead")))] == 1
    thumbnail_done = (("kind", "thumbnail"), ("outcome", "done"))
    bucket = "fleetless_attempt_duration_seconds_bucket"
    assert samples[(bucket, (("kind", "thumbnail"), ("le", "2.5"), ("outcome", "done")))] == 0
    assert samples[(bucket, (("kind", "thumbnail"), ("le", "5.0"), ("outcome", "done")))] == 1
    assert samples[("fleetless_attempt_duration_seconds_count", thumbnail_done)] == 1
    printed = fleetless("metrics", dsn=dsn)
    assert printed.returncode == 0 and "fleetless_jobs{" in printed.stdout
    assert done


@pytest.mark.parametrize("path", ["/", "/metrics"])
def test_an_unreachable_database_is_one_line_503(path: str) -> None:
    queue = Queue("postgresql://postgres@127.0.0.1:1/nope?connect_timeout=2")
    r = TestClient(create_app(queue), raise_server_exceptions=False).get(path)
    assert r.status_code == 503 and "cannot connect to the database" in r.text


def test_schedules_page_lists_each_schedule_with_its_next_occurrence(queue: Queue) -> None:
    from fleetless.periodic import Schedule

    client = TestClient(create_app(queue))
    assert "no schedules" in client.get("/schedules").text
    queue.add_schedule(Schedule(name="nightly-report", cron="0 3 * * *", kind="render-report",
                                payload={"q": "<b>"}, timezone="Europe/Paris"))
    page = client.get("/schedules").text
    assert "nightly-report" in page and "<code>0 3 * * *</code>" in page and "Europe/Paris" in page
    assert "&lt;b&gt;" in page and "<b>\"" not in page
    assert re.search(r"\d{4}-\d\d-\d\d 02:00:00 UTC", page)  # 03:00 in Paris, winter


def test_a_running_job_can_be_cancelled_from_the_dashboard(queue: Queue, sql: Any) -> None:
    job_id = queue.enqueue("slow", {})
    queue.claim(1)
    client = TestClient(create_app(queue, token=TOKEN))
    assert 'id="cancel"' in client.get(f"/jobs/{job_id}").text
    r = client.post(f"/jobs/{job_id}/cancel", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200 and r.json()["status"] == "running"  # marked: its drainer kills it
    assert sql("SELECT cancel_requested_at IS NOT NULL FROM fleetless.jobs WHERE id = %s", job_id) == [(True,)]


def _links(page: str, ident: str) -> str | None:
    found = re.search(rf'id="{ident}" href="([^"]+)"', page)
    return found.group(1).replace("&amp;", "&") if found else None


def _first_cells(page: str, table_id: str) -> list[str]:
    table = re.search(rf'<table id="{table_id}">.*?</table>', page, re.S)
    assert table is not None, table_id
    return re.findall(r"<tr[^>]*><td[^>]*>(?:<a [^>]*>)?([^<]*)", table.group(0))


def test_every_long_list_on_the_overview_is_paged(queue: Queue) -> None:
    queue.enqueue_many([{"kind": f"kind-{i:03}", "payload": {}, "queue": f"queue-{i:03}"} for i in range(120)])
    client = TestClient(create_app(queue))  # the default page size: 50
    first = client.get("/").text
    assert _first_cells(first, "by-kind") == [f"kind-{i:03}" for i in range(50)]
    assert _first_cells(first, "by-queue") == [f"queue-{i:03}" for i in range(50)]
    assert _links(first, "by-kind-prev") is None
    second_href = _links(first, "by-kind-next")
    assert second_href is not None
    second = client.get(second_href).text
    assert _first_cells(second, "by-kind") == [f"kind-{i:03}" for i in range(50, 100)]
    assert _first_cells(second, "by-queue") == [f"queue-{i:03}" for i in range(50)]  # its own page parameter
    third_href = _links(second, "by-kind-next")
    assert third_href is not None
    third = client.get(third_href).text
    assert _first_cells(third, "by-kind") == [f"kind-{i:03}" for i in range(100, 120)]
    assert _links(third, "by-kind-next") is None and _links(third, "by-kind-prev") is not None
    last_queues = client.get("/?queues_page=3").text
    assert _first_cells(last_queues, "by-queue") == [f"queue-{i:03}" for i in range(100, 120)]

    running = queue.claim(7)
    small = TestClient(create_app(queue, page_size=3))
    pages = [small.get(f"/?running_page={n}").text for n in (1, 2, 3)]
    shown = [int(i) for p in pages for i in _first_cells(p, "running")]
    assert shown == [j.id for j in running]
    assert _links(pages[0], "running-next") == "/?running_page=2" and _links(pages[2], "running-next") is None
    for bad in ("x", "0"):
        assert client.get(f"/?running_page={bad}").status_code == 400


def test_a_jobs_attempts_are_paged(queue: Queue, sql: Any) -> None:
    job_id = queue.enqueue("flaky", {}, max_attempts=100)
    for _ in range(7):
        (job,) = queue.claim(1)
        queue.fail(job, f"exit code 1: failure of attempt {job.attempts}", delay=0)
    client = TestClient(create_app(queue, page_size=3))
    first = client.get(f"/jobs/{job_id}").text
    assert _first_cells(first, "attempts") == ["1", "2", "3"]
    assert "failure of attempt 1" in first and "failure of attempt 4" not in first
    nxt = _links(first, "attempts-next")
    assert nxt == f"/jobs/{job_id}?attempts_page=2"
    assert _first_cells(client.get(nxt).text, "attempts") == ["4", "5", "6"]
    last = client.get(f"/jobs/{job_id}?attempts_page=3").text
    assert _first_cells(last, "attempts") == ["7"] and _links(last, "attempts-next") is None
    assert client.get(f"/jobs/{job_id}?attempts_page=nope").status_code == 400
    # The overview's chart counts attempts: seven failures of one job, not one row.
    assert re.search(r"id=attempts-failed>7<", client.get("/").text)


def test_schedules_are_paged(queue: Queue, sql: Any) -> None:
    from fleetless.periodic import Schedule

    sql("DELETE FROM fleetless.schedules")
    try:
        for i in range(5):
            queue.add_schedule(Schedule(name=f"every-{i}", cron="*/5 * * * *", kind="tick", payload={}))
        client = TestClient(create_app(queue, page_size=2))
        first = client.get("/schedules").text
        assert _first_cells(first, "schedules") == ["every-0", "every-1"]
        assert _links(first, "schedules-next") == "/schedules?page=2"
        last = client.get("/schedules?page=3").text
        assert _first_cells(last, "schedules") == ["every-4"] and _links(last, "schedules-next") is None
    finally:
        sql("DELETE FROM fleetless.schedules")


@pytest.mark.parametrize("path", ["/", "/jobs", "/jobs/1", "/schedules", "/metrics"])
def test_a_schema_not_initialised_is_a_503_page_naming_init(dsn: str, path: str) -> None:
    queue = Queue(dsn, schema="never_initialised")
    try:
        r = TestClient(create_app(queue), raise_server_exceptions=False).get(path)
    finally:
        queue.close()
    assert r.status_code == 503
    assert "Schema not initialised" in r.text
    assert "schema never_initialised is not initialised: run &#x27;fleetless init&#x27;" in r.text


def test_a_lost_database_connection_is_a_503_page_then_the_next_request_reconnects(queue: Queue, sql: Any) -> None:
    client = TestClient(create_app(queue), raise_server_exceptions=False)
    assert client.get("/").status_code == 200
    sql("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
        "WHERE datname = current_database() AND pid <> pg_backend_pid()")
    lost = client.get("/")
    assert lost.status_code == 503 and "Database unavailable" in lost.text and "database unavailable: " in lost.text
    assert client.get("/").status_code == 200


def test_fleetless_serve_answers_on_loopback_only_by_default_on_a_fresh_install(dsn: str, fleetless: Any) -> None:
    import os
    import signal
    import socket
    import subprocess
    import sys
    import urllib.request

    from proctools import wait_for

    fresh = "fresh_install"
    assert fleetless("--schema", fresh, "init", dsn=dsn).returncode == 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**{k: v for k, v in os.environ.items() if k != "FLEETLESS_DASHBOARD_TOKEN"}, "DATABASE_URL": dsn,
           "FLEETLESS_SCHEMA": fresh}
    proc = subprocess.Popen([sys.executable, "-m", "fleetless.cli", "--log-format", "json", "serve", "--port",
                             str(port), "--root-path", "/ops/fleetless"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        def listening() -> list[str]:  # local addresses listening on the port, from /proc/net/tcp{,6}
            found = []
            for table in ("/proc/net/tcp", "/proc/net/tcp6"):
                with open(table) as f:
                    for line in f.readlines()[1:]:
                        local, state = line.split()[1], line.split()[3]
                        address, hexport = local.split(":")
                        if state == "0A" and int(hexport, 16) == port:
                            found.append(address)
            return found

        wait_for(lambda: bool(listening()) or proc.poll() is not None, timeout=60, what="fleetless serve to listen")
        assert proc.poll() is None
        assert listening() == ["0100007F"]  # 127.0.0.1 only
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30) as r:
            page = r.read().decode()
        assert r.status == 200 and 'id="count-pending"><b>0</b>' in page
        assert 'href="/ops/fleetless/jobs?status=dead"' in page  # links made for the proxy's sub-path
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
            text = r.read().decode()
        assert r.status == 200 and "# TYPE fleetless_jobs gauge" in text
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    assert proc.stderr is not None
    logged = [json.loads(line) for line in proc.stderr.read().decode().splitlines()]  # --log-format json: all JSON
    assert logged[0]["event"] == "serve_started" and logged[0]["url"] == f"http://127.0.0.1:{port}/ops/fleetless/"
    assert logged[0]["read_only"] is True


def test_the_flash_box_shows_only_what_the_dashboard_itself_said(queue: Queue, sql: Any) -> None:
    # A link made elsewhere must not put its own words on a real job page ("contact support at…").
    done = queue.enqueue("report", {})
    (job,) = queue.claim(1)
    queue.complete(job, "ok")
    client = TestClient(create_app(queue, token=TOKEN))
    forged = client.get(f"/jobs/{done}?problem=Call+support+at+555-0100&done=Your+account+is+locked").text
    assert "555-0100" not in forged and "locked" not in forged
    signed_in = client.post("/login", data={"token": TOKEN}, follow_redirects=False)
    assert signed_in.status_code == 303
    page = client.get(f"/jobs/{done}").text
    csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', page)
    assert csrf is not None
    # Retrying a done job is refused; the dashboard's own, signed, message is shown.
    refused = client.post(f"/jobs/{done}/retry", data={"csrf": csrf.group(1)})
    assert refused.status_code == 200 and "sig=" in str(refused.url)
    assert "only dead or cancelled jobs can be retried" in refused.text and 'id="flash"' in refused.text
    tampered = str(refused.url).replace("problem=", "problem=Call+555-0100+")
    assert "555-0100" not in client.get(tampered).text
    ok = client.post(f"/jobs/{_dead_job(queue)}/retry", data={"csrf": csrf.group(1)})
    assert "retry: ok" in ok.text


def test_signing_out_needs_the_sessions_csrf_token(queue: Queue) -> None:
    client = TestClient(create_app(queue, token=TOKEN))
    client.post("/login", data={"token": TOKEN}, follow_redirects=False)
    assert client.post("/logout", follow_redirects=False).status_code == 403
    assert client.post("/logout", data={"csrf": "guess"}, follow_redirects=False).status_code == 403
    assert "sign out" in client.get("/").text  # still signed in
    csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', client.get("/").text)
    assert csrf is not None
    out = client.post("/logout", data={"csrf": csrf.group(1)}, follow_redirects=False)
    assert out.status_code == 303 and f"{COOKIE}=" in out.headers["set-cookie"]


def _snoozed_job(queue: Queue, snoozes: int, *, fail_first: bool = True, name: str = "upstream") -> int:
    """A job (alone in queue ``name``) that failed once (if ``fail_first``), then snoozed ``snoozes`` times."""
    from fleetless.job import Outcome, Run

    job_id = queue.enqueue("poll-upstream", {}, max_attempts=5, queue=name)
    if fail_first:
        (job,) = queue.claim(1, queues=[name])
        queue.fail(job, "exit code 1: ConnectionError: upstream refused", delay=0)
    for _ in range(snoozes):
        (job,) = queue.claim(1, queues=[name])
        queue.finish_many([(job, Outcome("snooze", error="snoozed for 30 s: upstream not ready", delay=0.0,
                                         decided="snooze", run=Run(tier="process")))])
    return job_id


def test_a_snooze_is_shown_as_a_snooze_not_as_an_error(queue: Queue) -> None:
    """Issue 28: a snooze's note was red in the error columns and under "Error", as a failure."""
    dead = _dead_job(queue)  # an error stays one
    job_id = _snoozed_job(queue, 1, fail_first=False)
    client = TestClient(create_app(queue))
    page = client.get(f"/jobs/{job_id}").text
    assert 'id="error-head"' not in page and "<h2>Error</h2>" not in page
    assert '<p class="snoozed" id="snooze-note">snoozed for 30 s: upstream not ready</p>' in page
    assert '<span class="snoozed">snoozed for 30 s: upstream not ready</span>' in page  # its history row
    assert '<span class="err">snoozed' not in page
    listed = client.get("/jobs").text
    assert '<span class="snoozed">snoozed for 30 s: upstream not ready</span>' in listed
    assert '<span class="err">snoozed' not in listed
    assert '<p class="err" id="error-head">exit code 1' in client.get(f"/jobs/{dead}").text


def test_a_run_of_snoozes_is_one_row_that_opens(queue: Queue) -> None:
    """Issue 28: a job at the snooze cap listed 100+ history rows, none collapsed."""
    job_id = _snoozed_job(queue, 7)
    (job,) = queue.claim(1, queues=["upstream"])
    queue.fail(job, "exit code 1: ConnectionError: still refused", delay=0)
    client = TestClient(create_app(queue, page_size=3))
    page = client.get(f"/jobs/{job_id}").text
    assert _first_cells(page, "attempts") == ["1", "2 (snoozes 1-7)", "2"]
    assert page.count('<tr class="snoozes">') == 1 and "<details><summary>snoozed 7 times between " in page
    assert page.count("<li>") == 7 and "upstream refused" in page and "still refused" in page
    assert _links(page, "attempts-next") is None  # three rows: one page
    one = _snoozed_job(queue, 1, name="other")  # a lone snooze is its own row, not a run
    assert _first_cells(client.get(f"/jobs/{one}").text, "attempts") == ["1", "2 (snooze 1)"]


def test_signed_out_with_a_token_the_actions_are_greyed_with_a_way_to_sign_in(queue: Queue) -> None:
    """Issue 28: signed out, retry and pause were active buttons that led to a "Refused" page."""
    dead = _dead_job(queue)
    client = TestClient(create_app(queue, token=TOKEN))
    page = client.get(f"/jobs/{dead}").text
    assert re.search(r'<button id="retry" title="sign in for actions" disabled>', page), page
    assert '<a class="sign-in-hint" id="sign-in-hint" href="/login">' in page
    queues = client.get("/queues").text
    assert re.search(r'<button id="pause-default" title="sign in for actions" disabled>', queues)
    client.post("/login", data={"token": TOKEN})
    signed_in = client.get(f"/jobs/{dead}").text
    assert re.search(r'<button id="retry">', signed_in) and "sign-in-hint" not in signed_in


def test_an_empty_stdout_shows_no_result_box(queue: Queue) -> None:
    job_id = queue.enqueue("quiet", {})
    (job,) = queue.claim(1)
    queue.complete(job, "")
    page = TestClient(create_app(queue)).get(f"/jobs/{job_id}").text
    assert "<h2>Result</h2>" not in page and "id=result" not in page


def test_the_charts_title_names_the_span_its_axis_shows(queue: Queue) -> None:
    """Issue 28: titled "last 3 h" over an axis of 30 minutes (the quiet minutes left out)."""
    queue.enqueue("k", {})
    (job,) = queue.claim(1)
    queue.complete(job, "ok")
    page = TestClient(create_app(queue, hours=3)).get("/").text
    title = re.search(r"<h2 id=chart-title>(.*?)</h2>", page)
    assert title and "Attempts per minute, last 30 min" in title.group(1), title
    assert "nothing earlier in the last 3 h" in title.group(1)
    first, last = re.findall(r">(\d\d):(\d\d) UTC</text>", page)
    span = (int(last[0]) * 60 + int(last[1]) - int(first[0]) * 60 - int(first[1])) % (24 * 60)
    assert span == 29, (first, last)


def test_a_job_at_the_snooze_cap_shows_its_runs_folded_and_the_charged_snooze_as_an_error(queue: Queue) -> None:
    """Issue 28's case: 100 snoozes then one past the cap (charged as a failed attempt): the
    history is the failure, one folded row of 100 snoozes, and the charged one, which is an error."""
    from fleetless.outcomes import MAX_SNOOZES

    job_id = _snoozed_job(queue, MAX_SNOOZES + 1)
    page = TestClient(create_app(queue)).get(f"/jobs/{job_id}").text
    assert _first_cells(page, "attempts") == ["1", f"2 (snoozes 1-{MAX_SNOOZES})", "2"]
    assert f"<summary>snoozed {MAX_SNOOZES} times between " in page
    assert re.search(rf'<span class="err">snoozed {MAX_SNOOZES} times already, the most a job may; charged', page)
    assert re.search(r'<p class="err" id="error-head">snoozed \d+ times already', page)
