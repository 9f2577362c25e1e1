"""Queue control on the admin dashboard: pause, resume and global limits, the live workers and
the ready jobs no live worker can run.

Pages are fetched and forms posted through Django's test client, as real users with real
``Permission`` rows; each button acts through ``Job.objects.pause``/``resume``/``set_limits``
and the test reads the ``pgjobs_queue`` row those write. Registry rows are written with
``upkeep.WORKER_BEAT``, the worker's own statement.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.contrib.auth.models import User
from django.db import connection
from django.test import Client, TestCase
from django.urls import reverse

from django_pgjobs.core import upkeep
from django_pgjobs.models import Job
from tests.helpers import make_job, query, worker_record
from tests.test_admin import client_for, make_user, messages_of, table, text

NOOP = "testproject.testjobs.noop"
BOOM = "testproject.testjobs.boom"
DASHBOARD = reverse("admin:django_pgjobs_queuedashboard_changelist")
CONTROL = reverse("admin:django_pgjobs_queuedashboard_control")


def queue_row(name: str) -> tuple[Any, ...] | None:
    rows = query(
        "SELECT paused, concurrency, rate_count, extract(epoch FROM rate_period)::float8 "
        "FROM pgjobs_queue WHERE name = %s",
        [name],
    )
    return rows[0] if rows else None


def beat(worker_id: str, queues: dict[str, int | None], tasks: list[str] | None) -> None:
    """A live worker's registry row, as the worker writes it on its tick."""
    with connection.cursor() as cursor:
        cursor.execute(upkeep.WORKER_BEAT, worker_record(worker_id, queues, tasks))


def control_rows(page: str) -> dict[str, list[str]]:
    return {text(row[0]): row for row in table(page, "pgjobs-control")}


class QueueControlTests(TestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.operator = make_user("operator", "view_job", "change_queuestate")
        cls.viewer = make_user("viewer", "view_job", "change_job")

    def setUp(self) -> None:
        make_job(queue="emails")
        self.client = client_for(self.operator)

    def post(self, client: Client, **data: str) -> Any:
        return client.post(CONTROL, data, follow=True)

    def test_queues_listed_are_those_with_jobs_and_those_with_a_row(self) -> None:
        Job.objects.set_limits("payments", concurrency=5)
        Job.objects.pause("idle")
        page = self.client.get(DASHBOARD).content.decode()
        rows = control_rows(page)
        assert list(rows) == ["emails", "idle", "payments"]
        assert [text(cell) for cell in rows["emails"][:4]] == [
            "emails",
            "active",
            "no limit",
            "no limit",
        ]
        assert [text(cell) for cell in rows["idle"][:4]] == [
            "idle",
            "paused",
            "no limit",
            "no limit",
        ]
        assert [text(cell) for cell in rows["payments"][:4]] == [
            "payments",
            "active",
            "5",
            "no limit",
        ]

    def test_pause_then_resume_change_the_row_and_say_so(self) -> None:
        page = self.client.get(DASHBOARD).content.decode()
        assert 'value="pause">Pause</button>' in control_rows(page)["emails"][4]
        assert "csrfmiddlewaretoken" in control_rows(page)["emails"][4]

        paused = self.post(self.client, queue="emails", action="pause")
        assert paused.redirect_chain == [(DASHBOARD, 302)]
        assert queue_row("emails") == (True, None, None, None)
        assert messages_of(paused) == [
            ("success", "Paused queue emails: its jobs stay queued until it is resumed.")
        ]
        row = control_rows(paused.content.decode())["emails"]
        assert text(row[1]) == "paused"
        assert 'value="resume">Resume</button>' in row[4]

        resumed = self.post(self.client, queue="emails", action="resume")
        assert queue_row("emails") == (False, None, None, None)
        assert messages_of(resumed) == [("success", "Resumed queue emails.")]
        assert text(control_rows(resumed.content.decode())["emails"][1]) == "active"

    def test_the_buttons_need_the_queue_change_permission(self) -> None:
        # The change permission on jobs is not enough: queue control is its own permission.
        viewer = client_for(self.viewer)
        page = viewer.get(DASHBOARD).content.decode()
        assert "emails" in control_rows(page)
        assert CONTROL not in page and "Save limits" not in page
        assert all(len(row) == 4 for row in control_rows(page).values())
        for data in (
            {"queue": "emails", "action": "pause"},
            {"queue": "emails", "action": "limits", "concurrency": "3"},
        ):
            assert viewer.post(CONTROL, data).status_code == 403
        watcher = client_for(make_user("watcher", "view_queuedashboard"))
        assert watcher.post(CONTROL, {"queue": "emails", "action": "pause"}).status_code == 403
        assert queue_row("emails") is None
        # Anonymous: the admin's login page, and nothing changed.
        anonymous = Client().post(CONTROL, {"queue": "emails", "action": "pause"})
        assert anonymous.status_code == 302
        assert queue_row("emails") is None
        # A superuser has every permission; a GET changes nothing.
        root = client_for(User.objects.create_superuser("root", password="pw"))
        assert root.get(CONTROL).status_code == 405
        self.post(root, queue="emails", action="pause")
        assert queue_row("emails") == (True, None, None, None)

    def test_the_limits_form_saves_and_an_empty_field_lifts_a_limit(self) -> None:
        saved = self.post(
            self.client,
            queue="emails",
            action="limits",
            concurrency="5",
            rate_count="10",
            rate_period="60",
        )
        assert queue_row("emails") == (False, 5, 10, 60.0)
        assert messages_of(saved) == [
            ("success", "Limits of queue emails: running at most 5; started at most 10 per 60 s.")
        ]
        row = control_rows(saved.content.decode())["emails"]
        assert [text(cell) for cell in row[1:4]] == ["active", "5", "10 per 60 s"]
        # The form shows the limits it holds, ready to edit.
        for name, value in (("concurrency", "5"), ("rate_count", "10"), ("rate_period", "60")):
            assert f'name="{name}" min="' in row[5] and f'value="{value}"' in row[5], name

        lifted = self.post(
            self.client,
            queue="emails",
            action="limits",
            concurrency="",
            rate_period="0.5",
            rate_count="2",
        )
        assert queue_row("emails") == (False, None, 2, 0.5)
        assert messages_of(lifted)[0][1].endswith("running no limit; started at most 2 per 0.5 s.")
        self.post(self.client, queue="emails", action="limits")
        assert queue_row("emails") == (False, None, None, None)

    def test_bad_limits_are_refused_with_a_message_and_change_nothing(self) -> None:
        Job.objects.set_limits("emails", concurrency=4, rate=(10, 60))
        half_a_rate = (
            "Nothing was changed: Invalid limits for queue emails: A rate limit needs both a "
            "count and a period in seconds (or neither, for no rate limit)."
        )
        cases: list[tuple[dict[str, str], str]] = [
            (
                {"concurrency": "0"},
                "Nothing was changed: Invalid concurrency 0: use a whole number of 1 or more.",
            ),
            ({"rate_count": "5"}, half_a_rate),
            ({"rate_period": "5"}, half_a_rate),
            (
                {"concurrency": "many"},
                "Nothing was changed: Invalid limits for queue emails: concurrency: Enter a "
                "whole number.",
            ),
            (
                {"rate_count": "-1", "rate_period": "60"},
                "Nothing was changed: Invalid rate count -1: use a whole number of 1 or more.",
            ),
        ]
        for data, expected in cases:
            response = self.post(self.client, queue="emails", action="limits", **data)
            assert messages_of(response) == [("error", expected)], data
            assert queue_row("emails") == (False, 4, 10, 60.0), data
        period = self.post(
            self.client, queue="emails", action="limits", rate_count="5", rate_period="0"
        )
        ((level, message),) = messages_of(period)
        assert level == "error" and message.startswith("Nothing was changed: Invalid rate period")
        # A bad queue name and an unknown action are refused the same way.
        for data in (
            {"queue": "no spaces", "action": "pause"},
            {"queue": "", "action": "resume"},
            {"queue": "emails", "action": "drop"},
        ):
            ((level, message),) = messages_of(self.post(self.client, **data))
            assert level == "error" and message.startswith("Nothing was changed: "), message
        assert queue_row("emails") == (False, 4, 10, 60.0)
        assert queue_row("no spaces") is None


class WorkersAndUnrunnableTests(TestCase):
    def setUp(self) -> None:
        self.client = client_for(make_user("viewer", "view_job"))

    def test_no_worker_and_no_ready_job(self) -> None:
        page = self.client.get(DASHBOARD).content.decode()
        assert [text(c) for c in table(page, "pgjobs-workers")[0]] == ["No live worker."]
        assert [text(c) for c in table(page, "pgjobs-unrunnable")[0]] == [
            "None: every ready job has a live worker that can run it."
        ]

    def test_live_workers_and_the_ready_jobs_none_of_them_can_run(self) -> None:
        beat("web-1:4242:a", {"thumbnails": 8, "default": None}, None)
        beat("web-1:4243:b", {"emails": None}, [NOOP, "app.other"])
        # An expired row is no live worker (the reaper has not cleared it yet).
        beat("gone", {"reports": None}, None)
        with connection.cursor() as cursor:
            cursor.execute(
                "UPDATE pgjobs_worker SET expires_at = now() - interval '1 s' WHERE id = 'gone'"
            )
        make_job(queue="default", task=BOOM)  # a worker claims any task: runnable
        make_job(queue="emails", task=NOOP)  # registered: runnable
        make_job(queue="emails", task=BOOM)  # emails' only worker lacks it
        make_job(queue="emails", task=BOOM)
        make_job(queue="reports")  # only the expired worker served it
        make_job(queue="reports", run_at=timedelta(hours=1))  # not ready: not listed

        page = self.client.get(DASHBOARD).content.decode()

        workers = [[text(c) for c in row] for row in table(page, "pgjobs-workers")]
        assert [row[:7] for row in workers] == [
            ["web-1:4242:a", "web-1", "4242", "lease", "default, thumbnails=8", "any", "9.9.9"],
            ["web-1:4243:b", "web-1", "4242", "lease", "emails", "2", "9.9.9"],
        ]
        assert all(len(row[7]) == len(row[8]) == len("2000-01-01 00:00:00") for row in workers)
        unrunnable = [[text(c) for c in row] for row in table(page, "pgjobs-unrunnable")]
        assert unrunnable == [
            [
                "emails",
                BOOM,
                "2",
                "no live worker serving this queue has the task registered",
            ],
            ["reports", NOOP, "1", "no live worker serves this queue"],
        ]
