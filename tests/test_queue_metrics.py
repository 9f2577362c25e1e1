"""``django_pgjobs.views.metrics``: the queue-level gauges, scraped over real HTTP from the
live server and checked against the table the test set up."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import http_get, make_job, query, register_worker, session_cookie
from tests.workers import REPO

pytestmark = pytest.mark.django_db(transaction=True)

TOKEN = "metrics-token-of-the-tests-0123"
GAUGES = {
    "pgjobs_queue_ready_jobs": "ready",
    "pgjobs_queue_scheduled_jobs": "scheduled",
    "pgjobs_queue_running_jobs": "running",
    "pgjobs_queue_expired_leases": "expired",
    "pgjobs_queue_failed_jobs": "failed",
}

# What each gauge counts, per queue, as a plain scan of the whole table: not the partial-index
# statements the view runs.
TABLE_COUNTS = """
SELECT queue,
       count(*) FILTER (WHERE status = 'queued' AND run_at <= now()) AS ready,
       count(*) FILTER (WHERE status = 'queued' AND run_at > now()) AS scheduled,
       count(*) FILTER (WHERE status = 'running') AS running,
       count(*) FILTER (WHERE status = 'running' AND locked_until < now()) AS expired,
       count(*) FILTER (WHERE status = 'failed') AS failed
FROM pgjobs_job GROUP BY queue
"""
OLDEST_READY = """
SELECT extract(epoch FROM now() - min(run_at))::float8 FROM pgjobs_job
WHERE status = 'queued' AND run_at <= now() AND queue = %s
"""


@pytest.fixture
def token(settings: Any) -> str:
    settings.PGJOBS = {**settings.PGJOBS, "MONITORING_TOKEN": TOKEN}
    return TOKEN


def scrape(url: str, headers: dict[str, str]) -> dict[tuple[str, str], float]:
    status, response_headers, body = http_get(url + "/pgjobs/metrics", headers)
    assert status == 200, body
    assert response_headers["Content-Type"].startswith("text/plain; version=")
    return {
        (sample.name, sample.labels["queue"]): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
    }


def test_the_gauges_match_the_table_per_queue(live_server: Any, token: str) -> None:
    for _ in range(3):
        make_job(queue="alpha", run_at=timedelta(minutes=-2))
    make_job(queue="alpha", run_at=timedelta(seconds=-5))
    for _ in range(2):
        make_job(queue="alpha", run_at=timedelta(hours=1))
    make_job(queue="alpha", status="running", attempts=1, locked_until=timedelta(minutes=5))
    for _ in range(2):
        make_job(queue="alpha", status="running", attempts=1, locked_until=timedelta(minutes=-1))
    make_job(queue="alpha", status="failed", attempts=5, finished_at=timedelta(minutes=-1))
    for _ in range(5):
        make_job(queue="alpha", status="done", attempts=1, finished_at=timedelta(minutes=-1))
    make_job(queue="beta", run_at=timedelta(seconds=-30))
    for _ in range(4):
        make_job(queue="beta", status="failed", attempts=5, finished_at=timedelta(hours=-1))
    # An empty queue a live worker serves is shown with zeros.
    register_worker("web-1:4242", {"gamma": None, "alpha": 2})

    lag_before = {q: query(OLDEST_READY, [q])[0][0] for q in ("alpha", "beta")}
    samples = scrape(live_server.url, {"Authorization": f"Bearer {token}"})
    lag_after = {q: query(OLDEST_READY, [q])[0][0] for q in ("alpha", "beta")}

    rows = query(TABLE_COUNTS)
    table = {row[0]: dict(zip(GAUGES.values(), row[1:], strict=True)) for row in rows}
    assert table["alpha"] == {"ready": 4, "scheduled": 2, "running": 3, "expired": 2, "failed": 1}
    assert table["beta"] == {"ready": 1, "scheduled": 0, "running": 0, "expired": 0, "failed": 4}
    for queue in ("alpha", "beta"):
        for gauge, column in GAUGES.items():
            assert samples[(gauge, queue)] == table[queue][column], (gauge, queue)
        age = samples[("pgjobs_queue_oldest_ready_age_seconds", queue)]
        assert lag_before[queue] <= age <= lag_after[queue]
    assert lag_before["alpha"] >= 120
    for gauge in [*GAUGES, "pgjobs_queue_oldest_ready_age_seconds"]:
        assert samples[(gauge, "gamma")] == 0
    assert {queue for _name, queue in samples} == {"alpha", "beta", "gamma"}


def test_a_scraper_that_asks_for_openmetrics_gets_it(live_server: Any, token: str) -> None:
    make_job(queue="alpha")
    status, headers, body = http_get(
        live_server.url + "/pgjobs/metrics",
        {"Authorization": f"Bearer {token}", "Accept": "application/openmetrics-text"},
    )
    assert status == 200
    assert headers["Content-Type"].startswith("application/openmetrics-text")
    assert 'pgjobs_queue_ready_jobs{queue="alpha"} 1.0' in body.decode()
    assert body.decode().rstrip().endswith("# EOF")


def test_a_staff_session_may_scrape_and_other_users_may_not(live_server: Any) -> None:
    make_job(queue="alpha")
    staff = User.objects.create_user("ops", password="x", is_staff=True)
    member = User.objects.create_user("member", password="x")

    samples = scrape(live_server.url, {"Cookie": session_cookie(staff)})
    assert samples[("pgjobs_queue_ready_jobs", "alpha")] == 1

    status, _headers, body = http_get(
        live_server.url + "/pgjobs/metrics", {"Cookie": session_cookie(member)}
    )
    assert status == 403
    assert b"pgjobs_queue" not in body


def test_without_a_token_configured_anonymous_requests_are_refused(live_server: Any) -> None:
    make_job(queue="alpha")
    status, _headers, body = http_get(live_server.url + "/pgjobs/metrics")
    assert status == 403
    # Refused without a word on how the views are configured.
    assert b"authentication required" in body and b"MONITORING_TOKEN" not in body
    status, _headers, _body = http_get(
        live_server.url + "/pgjobs/metrics", {"Authorization": "Bearer anything-at-all-here"}
    )
    assert status == 403


def test_a_missing_or_wrong_token_gets_a_bearer_challenge(live_server: Any, token: str) -> None:
    status, headers, body = http_get(live_server.url + "/pgjobs/metrics")
    assert status == 401
    assert headers["WWW-Authenticate"] == 'Bearer realm="django-pgjobs"'
    assert b"pgjobs_queue" not in body
    status, headers, _body = http_get(
        live_server.url + "/pgjobs/metrics", {"Authorization": f"Bearer {token}x"}
    )
    assert status == 401
    assert headers["WWW-Authenticate"] == 'Bearer realm="django-pgjobs", error="invalid_token"'
    status, _headers, _body = http_get(
        live_server.url + "/pgjobs/metrics", {"Authorization": f"Basic {token}"}
    )
    assert status == 401


def test_only_safe_methods_are_served(live_server: Any, token: str) -> None:
    request = {"Authorization": f"Bearer {token}"}
    status, _headers, body = http_get(live_server.url + "/pgjobs/metrics", request, "HEAD")
    assert (status, body) == (200, b"")
    status, _headers, _body = http_get(live_server.url + "/pgjobs/metrics", request, "POST")
    assert status == 405


def test_without_prometheus_client_the_error_names_the_extra() -> None:
    code = (
        "import sys; sys.modules['prometheus_client'] = None; import django; django.setup(); "
        "import django_pgjobs.ops.metrics"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "testproject.settings"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 1
    assert "ImproperlyConfigured" in result.stderr
    assert "pip install 'django-pgjobs[prometheus]'" in result.stderr
