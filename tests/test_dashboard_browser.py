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

    page.click("#retry")  # not signed in: refused, nothing changes
    assert "sign in" in page.inner_text("#message")
    assert sql("SELECT status FROM fleetless.jobs WHERE id = %s", dead) == [("dead",)]

    page.goto(url + "/login")
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
