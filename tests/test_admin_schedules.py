"""The admin's Schedules page: every declared schedule with its expression raw and in words,
its next and last tick and the status of that tick's job (a link for those who may see jobs);
read-only, and shown only to staff allowed to see jobs or schedules."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.db import connection
from django.test import Client
from django.urls import reverse

from django_pgjobs.core import schedules
from django_pgjobs.core.schedules import Schedule
from tests.helpers import db_now
from tests.test_admin import APP_INDEX, LOGIN, client_for, job_url, make_user, table, text

pytestmark = pytest.mark.django_db

SCHEDULES = reverse("admin:django_pgjobs_schedulestate_changelist")
NOOP = "testproject.testjobs.noop"


@pytest.fixture
def declared() -> Iterator[list[Schedule]]:
    saved = list(schedules._declared)
    schedules._declared[:] = [
        Schedule("nightly", NOOP, "test", cron="0 2 * * *", timezone="Europe/Paris"),
        Schedule("quick", NOOP, "test", every=timedelta(seconds=30), kwargs={"kind": "quick"}),
    ]
    yield schedules._declared
    schedules._declared[:] = saved


def test_the_page_lists_each_schedule_with_its_last_tick_and_job(
    declared: list[Schedule],
) -> None:
    quick = declared[1]
    latest, following = schedules.ticks(quick, db_now())
    schedules.enqueue_tick(connection, quick, latest - timedelta(seconds=30))
    job_id = schedules.enqueue_tick(connection, quick, latest)
    viewer = client_for(make_user("viewer", "view_job"))
    page = viewer.get(SCHEDULES).content.decode()
    rows = {text(row[0]): row for row in table(page, "pgjobs-schedules")}
    assert set(rows) == {"nightly", "quick"}
    nightly = [text(cell) for cell in rows["nightly"]]
    assert nightly[2] == "0 2 * * * At 02:00 every day (Europe/Paris)"
    assert nightly[4:] == ["never", "—"]
    quick_row = rows["quick"]
    assert text(quick_row[2]) == "every 30s every 30 seconds"
    # (text() puts a space where the link ends.)
    assert text(quick_row[5]).replace(" :", ":") == f"job {job_id}: queued"
    assert f'href="{job_url(job_id)}"' in quick_row[5]
    assert viewer.get(job_url(job_id)).status_code == 200
    assert text(quick_row[3]).startswith(f"{following:%Y-%m-%d}")
    # Linked from the app's admin index, next to the dashboard.
    assert f'href="{SCHEDULES}"' in viewer.get(APP_INDEX).content.decode()


def test_a_failing_schedule_shows_its_error(declared: list[Schedule]) -> None:
    schedules.record_failure(connection, declared[0], "psycopg.errors.CheckViolation: refused")
    page = client_for(make_user("viewer", "view_job")).get(SCHEDULES).content.decode()
    row = {text(r[0]): r for r in table(page, "pgjobs-schedules")}["nightly"]
    assert "1 failed step(s): psycopg.errors.CheckViolation: refused" in text(row[5])


def test_the_schedules_permission_shows_the_page_without_links_to_jobs(
    declared: list[Schedule],
) -> None:
    quick = declared[1]
    latest, _ = schedules.ticks(quick, db_now())
    schedules.enqueue_tick(connection, quick, latest - timedelta(seconds=30))
    job_id = schedules.enqueue_tick(connection, quick, latest)
    watcher = client_for(make_user("watcher", "view_schedulestate"))
    page = watcher.get(SCHEDULES).content.decode()
    assert f"job {job_id}" in page and job_url(job_id) not in page
    assert watcher.get(job_url(job_id)).status_code == 403
    assert client_for(make_user("nobody")).get(SCHEDULES).status_code == 403
    response = Client().get(SCHEDULES)
    assert response.status_code == 302 and response["Location"].startswith(LOGIN)
    # Read-only: no page for a single row, no add.
    for page_url in (f"{SCHEDULES}quick/change/", f"{SCHEDULES}add/"):
        assert watcher.get(page_url).status_code in (403, 404)
