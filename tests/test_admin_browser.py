"""The admin in a real browser: log in, retry a failed job, look at the dashboard and the
periodic schedules, and read why a queued job is not running.

The testproject runs for real (``manage.py runserver`` in a child process, on pytest's test
database) and headless Chromium, driven by Playwright, uses it as a person would. Debian's
``chromium`` is the browser (Playwright downloads none); without it, or without the
``playwright`` package, the test is skipped and says why. The dashboard's screenshot is kept
in ``artifacts/dashboard.png``.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.db import connection, connections

from django_pgjobs.core import schedules
from tests.helpers import db_now, job_row, make_job, make_jobs, wait_until

REPO = Path(__file__).resolve().parent.parent
ARTIFACT = REPO / "artifacts" / "dashboard.png"
CHROMIUM = Path(os.environ.get("PGJOBS_CHROMIUM", "/usr/bin/chromium"))
# The machine may have no network: nothing in the browser may try to reach one.
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PASSWORD = "a-browser-test-password"
NOOP = "testproject.testjobs.noop"
# Declared in the runserver process (PGJOBS["SCHEDULE"] from its environment).
SCHEDULE = {
    "nightly-report": {"task": NOOP, "cron": "0 2 * * *", "timezone": "Europe/Paris"},
    "every-minute": {"task": NOOP, "every": 60},
}

pytestmark = pytest.mark.django_db(transaction=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    """``manage.py runserver`` on a free port, serving pytest's test database."""

    def __init__(self, folder: Path) -> None:
        self.port = port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = folder / "runserver.log"
        environ = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "testproject.settings",
            "DATABASE_URL": settings.DATABASE_URL,
            "PGJOBS_TEST_DATABASE_NAME": connections["default"].settings_dict["NAME"],
            "PYTHONUNBUFFERED": "1",
            "PGJOBS_SCHEDULE": json.dumps(SCHEDULE),
        }
        environ.pop("DEBUG", None)
        with open(self.log_path, "wb") as log:
            # --insecure: serve the admin's CSS and JS with DEBUG off, as runserver can.
            self.popen = subprocess.Popen(
                [
                    sys.executable,
                    "manage.py",
                    "runserver",
                    "--noreload",
                    "--insecure",
                    f"127.0.0.1:{port}",
                ],
                cwd=REPO,
                env=environ,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def wait(self) -> None:
        wait_until(self.answers, interval=0.1, message="runserver to answer")

    def answers(self) -> bool:
        if self.popen.poll() is not None:
            raise AssertionError(f"runserver exited ({self.popen.returncode}):\n{self.log()}")
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
        try:
            connection.request("GET", "/admin/login/")
            return connection.getresponse().status == 200
        except OSError:
            return False
        finally:
            connection.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)


@pytest.fixture
def playwright() -> Any:
    """Playwright's ``sync_playwright``; skipped (with the reason) without it or Chromium."""
    if not CHROMIUM.exists():
        pytest.skip(
            f"no Chromium at {CHROMIUM}: install Debian's package (apt-get install chromium) "
            "or point PGJOBS_CHROMIUM at one"
        )
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as exc:
        pytest.skip(f"the playwright package is not installed ({exc}): pip install playwright")
    return sync_playwright


@pytest.fixture
def server(transactional_db: None, tmp_path: Path) -> Iterator[Server]:
    started = Server(tmp_path)
    try:
        started.wait()
        yield started
    finally:
        started.stop()


def fill_the_dashboard() -> None:
    """An hour of work on three queues, so the screenshot shows every part of the page."""
    for minutes, count in ((2, 12), (5, 20), (9, 7), (14, 25), (20, 16), (31, 30), (44, 9)):
        make_jobs(
            count,
            queue="emails",
            status="done",
            attempts=1,
            finished_at=timedelta(minutes=-minutes),
        )
        make_jobs(
            count // 2,
            queue="reports",
            status="done",
            attempts=1,
            finished_at=timedelta(minutes=-minutes - 1),
        )
    make_jobs(6, queue="emails", run_at=timedelta(seconds=-95))
    make_jobs(3, queue="reports", run_at=timedelta(hours=2))
    make_jobs(2, queue="default", status="running", attempts=1, locked_until=timedelta(minutes=5))
    make_job(
        queue="reports",
        status="failed",
        attempts=2,
        max_attempts=2,
        task="testproject.testjobs.boom",
        last_error="RuntimeError: report 7 <b>timed out</b>",
        finished_at=timedelta(minutes=-7),
    )


def tick_a_schedule() -> int:
    """The every-minute schedule's last tick, enqueued as a worker would; its job's id."""
    every = schedules.Schedule("every-minute", NOOP, "test", every=60)
    latest, _ = schedules.ticks(every, db_now())
    schedules.enqueue_tick(connection, every, latest - timedelta(minutes=1))
    job_id = schedules.enqueue_tick(connection, every, latest)
    assert job_id is not None
    return job_id


def test_log_in_retry_a_failed_job_and_see_the_dashboard(playwright: Any, server: Server) -> None:
    User.objects.create_superuser("operator", "ops@example.com", PASSWORD)
    failed = make_job(
        queue="emails",
        status="failed",
        attempts=3,
        max_attempts=3,
        task="testproject.testjobs.boom",
        last_error="RuntimeError: smtp refused",
        finished_at=timedelta(minutes=-3),
    )
    other = make_job(
        queue="emails",
        status="failed",
        attempts=3,
        max_attempts=3,
        last_error="keep me",
        finished_at=timedelta(minutes=-4),
    )
    fill_the_dashboard()
    tick_job = tick_a_schedule()
    # Waiting for its retry, in a queue no worker serves: its page says both.
    waiting = make_job(
        queue="reports",
        attempts=1,
        last_error="RuntimeError: <b>quota</b> exceeded",
        run_at=timedelta(hours=3),
    )
    ARTIFACT.parent.mkdir(exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        ARTIFACT.unlink()

    # Playwright's sync API runs an event loop in this thread, where Django refuses to
    # query: the database is read before and after the browser, not during.
    with playwright() as driver:
        browser = driver.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_FLAGS
        )
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(f"{server.url}/admin/django_pgjobs/failedjob/")
            # Not logged in: the admin sends us to its login form.
            assert "/admin/login/" in page.url
            page.fill("#id_username", "operator")
            page.fill("#id_password", PASSWORD)
            page.click("input[type=submit]")
            page.wait_for_url("**/admin/django_pgjobs/failedjob/")
            assert page.locator("#result_list tbody tr").count() == 3

            page.check(f'input[name="_selected_action"][value="{failed}"]')
            page.select_option('select[name="action"]', label="Retry selected failed jobs")
            page.click('button[name="index"]')
            page.wait_for_selector(".messagelist")
            messages = page.inner_text(".messagelist")
            assert f"Queued 1 job(s) again: {failed}." in messages, messages
            # The list now holds the failed jobs left.
            assert page.locator("#result_list tbody tr").count() == 2
            assert page.locator(f'input[name="_selected_action"][value="{failed}"]').count() == 0

            # The dashboard, reached as a person would: from the app's index.
            page.click('a[href="/admin/django_pgjobs/"]')
            page.click('a[href="/admin/django_pgjobs/queuedashboard/"]')
            page.wait_for_selector("#pgjobs-throughput")
            assert page.locator("#pgjobs-throughput rect.done").count() == 60
            queues = page.inner_text("#pgjobs-queues")
            for name in ("default", "emails", "reports"):
                assert name in queues, queues
            failures = page.inner_text("#pgjobs-failures")
            assert "RuntimeError: report 7 <b>timed out</b>" in failures  # shown as text
            page.screenshot(path=str(ARTIFACT), full_page=True)

            # The Schedules page, next to it in the app's index.
            page.click('a[href="/admin/django_pgjobs/"]')
            page.click('a[href="/admin/django_pgjobs/schedulestate/"]')
            page.wait_for_selector("#pgjobs-schedules")
            schedules_text = page.inner_text("#pgjobs-schedules")
            assert "At 02:00 every day (Europe/Paris)" in schedules_text, schedules_text
            assert f"job {tick_job}: queued" in schedules_text, schedules_text
            page.click(f'#pgjobs-schedules a[href="/admin/django_pgjobs/job/{tick_job}/change/"]')
            page.wait_for_selector("#content")
            assert "every-minute" in page.inner_text("#content")

            # A queued job's page explains why it is not running.
            page.goto(f"{server.url}/admin/django_pgjobs/job/{waiting}/change/")
            page.wait_for_selector("#pgjobs-explanation")
            explained = page.inner_text("#pgjobs-explanation")
            assert "Why isn't this job running?" in explained, explained
            assert "Waiting for its retry: attempt 2 of 5" in explained, explained
            assert "RuntimeError: <b>quota</b> exceeded" in explained  # shown as text
            assert "No live worker serves its queue reports" in explained, explained
            assert page.locator("#pgjobs-explanation b").count() == 0
        finally:
            browser.close()

    row = job_row(failed)
    assert (row["status"], row["attempts"], row["locked_until"]) == ("queued", 0, None)
    assert row["finished_at"] is None
    assert job_row(other)["status"] == "failed"
    assert ARTIFACT.read_bytes().startswith(b"\x89PNG"), ARTIFACT
    assert "Traceback" not in server.log(), server.log()
