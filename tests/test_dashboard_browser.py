"""The dashboard end to end in a real headless Chromium (Debian's ``chromium``, driven by Playwright).

``fleetless serve`` runs as a user would start it; the browser loads the overview, opens a dead
job, retries it with the token and sees it pending, and sees the action refused without the token.
Screenshots of the overview and a job page are saved under the folder the test prints
(``FLEETLESS_SCREENSHOTS``, default a fresh directory under the test's tmp path).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fleetless import Queue

from proctools import wait_for

playwright = pytest.importorskip("playwright.sync_api", reason="the test extra installs playwright")

TOKEN = "browser-test-token"
CHROMIUM = os.environ.get("FLEETLESS_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


@pytest.fixture
def serve(dsn: str) -> Iterator[Callable[..., str]]:
    """``serve(token=...)`` starts ``fleetless serve`` on a free loopback port; returns its URL."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(token: str | None) -> str:
        port = _free_port()
        env = {k: v for k, v in os.environ.items() if k != "FLEETLESS_DASHBOARD_TOKEN"}
        env["DATABASE_URL"] = dsn
        if token:
            env["FLEETLESS_DASHBOARD_TOKEN"] = token
        proc = subprocess.Popen([sys.executable, "-m", "fleetless.cli", "serve", "--port", str(port)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        procs.append(proc)
        wait_for(lambda: _answers(port) or proc.poll() is not None, timeout=60, what="fleetless serve to listen")
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        return f"http://127.0.0.1:{port}"

    yield start
    for proc in procs:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


@pytest.fixture
def browser() -> Iterator[Any]:
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("Debian's chromium is required in CI (.ci/run installs it)")
        pytest.skip("no chromium on PATH (apt-get install chromium)")
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


@pytest.fixture
def screenshots(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("FLEETLESS_SCREENSHOTS") or tmp_path / "screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    print(f"\nscreenshots: {folder}")
    return folder


def _fill(queue: Queue, sql: Any) -> int:
    """A table with something in every status; returns a dead job's id."""
    queue.enqueue_many([("render-invoice", {"invoice": i}) for i in range(5)]
                       + [{"kind": "thumbnail", "payload": {"image": i}, "queue": "media"} for i in range(3)])
    for job in queue.claim(3):
        queue.complete(job, '{"pages": 2}')
    (running,) = queue.claim(1, claimed_by="drain-host-1:4242", tier="bwrap")
    dead_id = queue.enqueue("send-email", {"to": "ops@example.com"}, max_attempts=1)
    sql("UPDATE fleetless.jobs SET priority = 10 WHERE id = %s", dead_id)
    (dead,) = queue.claim(1)
    queue.fail(dead, "exit code 1: ValueError: invoice 42 has no lines\nTraceback (most recent call last):\n"
               '  File "send-email.py", line 3, in <module>\nValueError: invoice 42 has no lines', delay=0)
    sql("UPDATE fleetless.jobs SET started_at = now() - interval '42 seconds' WHERE id = %s", running.id)
    archived = queue.enqueue("rotate-logs", {}, queue="archive", priority=20)  # a queue with nothing pending
    (rotate,) = queue.claim(1)
    assert rotate.id == archived
    queue.complete(rotate, "rotated")
    return dead_id


def test_retry_a_dead_job_from_the_browser_with_the_token(queue: Queue, sql: Any, serve: Callable[..., str],
                                                          browser: Any, screenshots: Path) -> None:
    dead = _fill(queue, sql)
    url = serve(TOKEN)
    page = browser.new_page(viewport={"width": 1100, "height": 900})
    page.goto(url + "/")
    assert page.inner_text("#count-dead b") == "1"
    assert page.inner_text("#count-pending b") == "4"
    assert page.inner_text("#count-running b") == "1"
    assert page.inner_text("#count-done b") == "4"
    assert "drain-host-1:4242" in page.inner_text("#running") and "bwrap" in page.inner_text("#running")
    assert page.locator("#per-minute").count() == 1
    assert (page.inner_text("#attempts-done"), page.inner_text("#attempts-failed")) == ("4", "1")
    # "By queue" counts every status (finished ones too), also of a queue with nothing pending.
    table = page.evaluate("""() => [...document.querySelectorAll('#by-queue tr')].map(
        r => [...r.cells].map(c => c.innerText))""")
    header, rows = table[0], {r[0]: dict(zip(table[0][1:], map(int, r[1:]), strict=True)) for r in table[1:]}
    assert header[0] == "queue" and set(rows) == {"default", "media", "archive"}
    assert rows["archive"]["done"] == 1 and rows["archive"]["pending"] == 0, rows["archive"]
    assert sum(r["done"] for r in rows.values()) == 4 and sum(r["dead"] for r in rows.values()) == 1
    assert sum(r["pending"] for r in rows.values()) == 4 and sum(r["running"] for r in rows.values()) == 1
    # The chart does not squeeze a few minutes' activity into a sliver at its right edge: each bar
    # is at least 1/30 of its width (the quiet minutes before the first activity are left out).
    bars = page.evaluate("() => [...document.querySelectorAll('#per-minute rect[fill=\"#43a047\"]')]"
                         ".map(r => r.getBBox().width)")
    chart = page.locator("#per-minute").bounding_box()
    assert chart is not None and bars and min(bars) >= chart["width"] / 30 - 1, (bars, chart)
    page.screenshot(path=str(screenshots / "overview.png"), full_page=True)

    page.click("#count-dead")
    assert "ValueError: invoice 42 has no lines" in page.inner_text("#jobs")
    page.click(f"#jobs a[href$='/jobs/{dead}']")
    assert page.inner_text("#error-head") == "exit code 1: ValueError: invoice 42 has no lines"

    # not signed in: the button is greyed (it led to a "Refused" page: issue 28), the hint signs in
    assert page.is_disabled("#retry") and page.get_attribute("#retry", "title") == "sign in for actions"
    assert page.is_visible("#sign-in-hint")
    page.screenshot(path=str(screenshots / "job-signed-out.png"), full_page=True)
    page.goto(url + "/queues")
    assert all(page.is_disabled(f"#{b.get_attribute('id')}") for b in page.query_selector_all("#queues button"))
    page.go_back()
    assert sql("SELECT status FROM fleetless.jobs WHERE id = %s", dead) == [("dead",)]

    page.click("#sign-in-hint")
    page.fill("#token", TOKEN)
    page.click("#sign-in")
    page.goto(f"{url}/jobs/{dead}")
    page.screenshot(path=str(screenshots / "job.png"), full_page=True)
    page.click("#retry")
    assert page.inner_text("#flash") == "retry: ok"
    assert page.inner_text("#field-status") == "pending"
    assert sql("SELECT status FROM fleetless.jobs WHERE id = %s", dead) == [("pending",)]
    page.goto(url + "/jobs?status=pending")
    assert f"/jobs/{dead}" in page.inner_html("#jobs")
    with urllib.request.urlopen(url + "/metrics", timeout=60) as answer:  # the same server's /metrics
        assert answer.status == 200 and b'fleetless_jobs{kind="send-email",queue="default",status="pending"} 1.0' in \
            answer.read()


def test_the_schedules_page_keeps_a_cron_expression_on_one_line(queue: Queue, serve: Callable[..., str],
                                                                 browser: Any) -> None:
    from fleetless.periodic import Schedule

    queue.add_schedule(Schedule(name="every-minute", cron="* * * * *", kind="ping",
                                payload={"a": "long payload " * 8}))
    page = browser.new_page(viewport={"width": 700, "height": 600})
    page.goto(serve(None) + "/schedules")
    cron = page.locator("#schedules td:nth-child(2) code")
    assert cron.inner_text() == "* * * * *"
    line = page.evaluate("() => parseFloat(getComputedStyle(document.querySelector('#schedules td code')).lineHeight)"
                         " || 20")
    box = cron.bounding_box()
    assert box is not None and box["height"] < 1.5 * line, (box, line)


def test_without_a_token_the_browser_cannot_act(queue: Queue, sql: Any, serve: Callable[..., str],
                                                browser: Any) -> None:
    dead = _fill(queue, sql)
    url = serve(None)
    page = browser.new_page()
    page.goto(f"{url}/jobs/{dead}")
    assert "read-only" in page.inner_text("header")
    # its buttons are greyed, their title says why (they led to a refusal page: newcomer review)
    assert page.is_disabled("#retry")
    assert "FLEETLESS_DASHBOARD_TOKEN is not set" in (page.get_attribute("#retry", "title") or "")
    answer = page.request.post(f"{url}/jobs/{dead}/retry", headers={"Accept": "text/html"})  # sent anyway
    assert answer.status == 403 and "FLEETLESS_DASHBOARD_TOKEN" in answer.text()
    page.goto(f"{url}/queues")
    assert all(page.is_disabled(f"#{b.get_attribute('id')}") for b in page.query_selector_all("#queues button"))
    assert sql("SELECT status FROM fleetless.jobs WHERE id = %s", dead) == [("dead",)]


def test_snoozes_read_as_snoozes_folded_and_the_chart_says_its_span(queue: Queue, sql: Any, serve: Callable[..., str],
                                                                   browser: Any, screenshots: Path) -> None:
    """Issue 28: snoozes were red like failures, a job at the snooze cap listed every one of them,
    an empty stdout showed an empty "Result" box, and the chart said "last 3 h" over 30 minutes."""
    from fleetless.job import Outcome, Run

    job_id = queue.enqueue("poll-upstream", {}, max_attempts=5)
    (job,) = queue.claim(1)
    queue.fail(job, "exit code 1: ConnectionError: upstream refused", delay=0)
    for _ in range(12):
        (job,) = queue.claim(1)
        queue.finish_many([(job, Outcome("snooze", error="snoozed for 30 s: upstream not ready", delay=0.0,
                                         decided="snooze", run=Run(tier="process")))])
    (job,) = queue.claim(1)
    queue.finish_many([(job, Outcome("snooze", error="snoozed for 60 s: upstream not ready", delay=60.0,
                                     decided="snooze", run=Run(tier="process")))])
    quiet = queue.enqueue("quiet", {})
    (job,) = queue.claim(1)
    queue.complete(job, "")
    url = serve(None)
    page = browser.new_page(viewport={"width": 1100, "height": 900})

    page.goto(f"{url}/jobs/{job_id}")
    red = "rgb(198, 40, 40)"
    assert page.locator("#error-head").count() == 0 and "Error" not in page.locator("h2").all_inner_texts()
    assert page.inner_text("#snooze-note") == "snoozed for 60 s: upstream not ready"
    assert page.evaluate("() => getComputedStyle(document.querySelector('#snooze-note')).color") != red
    rows = page.locator("#attempts > tbody > tr")
    assert rows.count() == 2, page.inner_text("#attempts")  # the failure, then the 13 snoozes as one row
    assert rows.nth(0).inner_text().startswith("1\tfailed")
    summary = page.locator("#attempts tr.snoozes summary")
    assert summary.inner_text().startswith("snoozed 13 times between ")
    assert page.locator("#attempts tr.snoozes li").first.is_visible() is False
    summary.click()  # it opens to each snooze, none red
    snoozes = page.locator("#attempts tr.snoozes li")
    assert snoozes.count() == 13 and snoozes.first.is_visible()
    colours = page.evaluate("() => [...document.querySelectorAll('#attempts .snoozed')]"
                            ".map(x => getComputedStyle(x).color)")
    assert colours and red not in colours, colours
    page.screenshot(path=str(screenshots / "snoozed-job.png"), full_page=True)

    page.goto(f"{url}/jobs/{quiet}")  # an empty stdout: no "Result" box
    assert page.locator("#result").count() == 0 and "Result" not in page.locator("h2").all_inner_texts()

    page.goto(url + "/")
    title = page.inner_text("#chart-title")
    labels = page.evaluate("() => [...document.querySelectorAll('#per-minute > text')].map(t => t.textContent)")
    first, last = (int(t[:2]) * 60 + int(t[3:5]) for t in labels[:2])
    assert "last 30 min" in title and (last - first) % 1440 == 29, (title, labels)
    assert "last 3 h" not in title.replace("nothing earlier in the last 3 h", "")
    page.screenshot(path=str(screenshots / "overview-chart.png"), full_page=True)
