"""The admin: the jobs list and detail page, failed jobs to retry or delete, the dashboard.

Every page is fetched through Django's test client from real rows (``make_job`` puts a job in
any state), as a real user with real ``Permission`` rows. Retrying sends NOTIFY after commit,
so those cases are ``TransactionTestCase`` with a second connection listening. The cost test
builds 200,000 done rows and asks PostgreSQL for its plans (``EXPLAIN``): the dashboard and
the failed-jobs list must read partial indexes, never the whole table.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.test import Client, TestCase, TransactionTestCase
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from django_pgjobs._admin_pages import CHART_HEIGHT, CHART_TOP
from django_pgjobs.admin import STATUS_COLOURS
from django_pgjobs.models import Job, Status
from django_pgjobs.ops import dashboard, doctor
from tests.helpers import (
    DbThread,
    db_now,
    job_row,
    listening,
    make_job,
    query,
    raw_connect,
    scalar,
    wait_until,
)

NOOP = "testproject.testjobs.noop"
BOOM = "testproject.testjobs.boom"
SLEEP = "testproject.testjobs.sleep"

JOBS = reverse("admin:django_pgjobs_job_changelist")
FAILED = reverse("admin:django_pgjobs_failedjob_changelist")
DASHBOARD = reverse("admin:django_pgjobs_queuedashboard_changelist")
APP_INDEX = reverse("admin:app_list", kwargs={"app_label": "django_pgjobs"})
LOGIN = reverse("admin:login")
EDITABLE = {"queue", "priority", "run_at", "max_attempts"}
NOT_EDITABLE = (
    "id",
    "task",
    "status_badge",
    "attempts",
    "locked_until",
    "created_at",
    "started_at",
    "attempted_at",
    "finished_at",
    "worker_ids",
    "outage_releases",
    "crashes",
    "schedule",
    "scheduled_at",
    "unique_key",
    "unique_while",
    "payload_pretty",
    "result_pretty",
    "error_full",
    "error_history",
)
SCRIPT = "<script>alert(1)</script>"
BOLD = "<b>x</b>"


def job_url(job_id: int) -> str:
    return reverse("admin:django_pgjobs_job_change", args=[job_id])


def failed_url(job_id: int) -> str:
    return reverse("admin:django_pgjobs_failedjob_change", args=[job_id])


# -- reading pages -------------------------------------------------------------------------


def text(fragment: str) -> str:
    """What a person reads in an HTML fragment: tags dropped, entities decoded, spaces joined."""
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", fragment)).split())


def table(page: str, table_id: str) -> list[list[str]]:
    """The body rows of ``<table id=table_id>``, each a list of its cells' inner HTML."""
    found = re.search(rf'<table id="{table_id}"[^>]*>(.*?)</table>', page, re.S)
    assert found, f"no table {table_id!r} on the page"
    body = found.group(1).split("<tbody>", 1)[-1]
    return [
        [cell for _tag, cell in re.findall(r"<(td|th)\b[^>]*>(.*?)</\1>", row, re.S)]
        for row in re.findall(r"<tr\b[^>]*>(.*?)</tr>", body, re.S)
    ]


def result_row(page: str, job_id: int) -> list[str]:
    """The changelist row of one job (found by its action checkbox)."""
    for row in table(page, "result_list"):
        if f'value="{job_id}"' in row[0]:
            return row
    raise AssertionError(f"job {job_id} is not in the list")


def listed(response: Any) -> list[int]:
    """The ids a changelist response shows, in its order."""
    assert response.status_code == 200, response.status_code
    return [job.pk for job in response.context["cl"].result_list]


def messages_of(response: Any) -> list[tuple[str, str]]:
    return [(message.level_tag, str(message)) for message in response.context["messages"]]


def make_user(username: str, *codenames: str, is_staff: bool = True) -> User:
    user = User.objects.create_user(username, password="pw", is_staff=is_staff)
    for codename in codenames:
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label="django_pgjobs", codename=codename)
        )
    return user


def client_for(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


def edit_form(job_id: int, **changes: str) -> dict[str, str]:
    """The job's change form as the page shows it, with ``changes`` typed over it."""
    row = job_row(job_id)
    run_at = timezone.localtime(row["run_at"])
    data = {
        "queue": row["queue"],
        "priority": str(row["priority"]),
        "run_at_0": f"{run_at:%Y-%m-%d}",
        "run_at_1": f"{run_at:%H:%M:%S}",
        "max_attempts": str(row["max_attempts"]),
        "_save": "Save",
    }
    return {**data, **changes}


def plan_nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from plan_nodes(child)


def explain(statement: str, params: Any = None) -> list[dict[str, Any]]:
    """Every node of the plan PostgreSQL would use for ``statement``."""
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN (FORMAT JSON) " + statement, params)
        document = cursor.fetchone()[0]
    if isinstance(document, str):
        document = json.loads(document)
    return list(plan_nodes(document[0]["Plan"]))


def assert_no_table_scan(statement: str, params: Any = None) -> set[str]:
    """No sequential scan of pgjobs_job in the plan; return the indexes the plan reads."""
    nodes = explain(statement, params)
    scans = [
        node
        for node in nodes
        if node["Node Type"] == "Seq Scan" and node.get("Relation Name") == "pgjobs_job"
    ]
    assert not scans, f"full scan of pgjobs_job in the plan of:\n{statement}\n{nodes}"
    return {node["Index Name"] for node in nodes if "Index Name" in node}


# -- the jobs list ---------------------------------------------------------------------------


class JobListTests(TestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.admin = User.objects.create_superuser("root", password="pw")

    def setUp(self) -> None:
        self.client.force_login(self.admin)

    def test_columns_show_each_field_and_a_coloured_status(self) -> None:
        long_line = "RuntimeError: " + "the remote end hung up " * 8
        error = f'Traceback (most recent call last):\n  File "x.py", line 1\n{long_line}'
        times = {"run_at": "2031-02-03 04:05:00+00", "created_at": "2030-01-02 03:04:00+00"}
        jobs = {
            "queued": make_job(queue="emails", max_attempts=4, **times),
            "running": make_job(status="running", attempts=1, task=SLEEP, **times),
            "done": make_job(status="done", attempts=2, max_attempts=3, queue="reports", **times),
            "failed": make_job(
                status="failed", attempts=2, max_attempts=2, task=BOOM, last_error=error, **times
            ),
        }
        page = self.client.get(JOBS).content.decode()

        assert len(set(STATUS_COLOURS.values())) == len(Status)
        expected = {
            "queued": [NOOP, "emails", "0/4", ""],
            "running": [SLEEP, "default", "1/5", ""],
            "done": [NOOP, "reports", "2/3", ""],
            "failed": [BOOM, "default", "2/2", long_line[:79] + "…"],
        }
        for status, job_id in jobs.items():
            row = result_row(page, job_id)
            cells = [text(cell) for cell in row[1:]]
            # No error: an empty cell (Django 4.2) or the admin's empty-value dash (5.0 on).
            cells[-1] = "" if cells[-1] == "-" else cells[-1]
            assert cells == [
                str(job_id),
                expected[status][0],
                expected[status][1],
                status,
                expected[status][2],
                "Feb. 3, 2031, 4:05 a.m.",
                "Jan. 2, 2030, 3:04 a.m.",
                expected[status][3],
            ]
            assert f'href="{job_url(job_id)}"' in row[1]
            badge = row[4]
            assert 'class="pgjobs-status"' in badge
            assert f"background:{STATUS_COLOURS[Status(status)]}" in badge
        # The list shows the end of the error, cut short; the full text is for the detail page.
        assert long_line not in page
        assert "Traceback" not in page

    def test_filters_by_status_queue_and_task(self) -> None:
        queued = make_job(queue="emails")
        failed_email = make_job(queue="emails", status="failed", task=BOOM, last_error="boom")
        failed_default = make_job(status="failed", task=BOOM, last_error="boom")
        done = make_job(status="done", task=SLEEP, queue="reports")

        assert listed(self.client.get(JOBS)) == [done, failed_default, failed_email, queued]
        assert listed(self.client.get(JOBS, {"status__exact": "failed"})) == [
            failed_default,
            failed_email,
        ]
        assert listed(self.client.get(JOBS, {"status__exact": "done"})) == [done]
        assert listed(self.client.get(JOBS, {"queue": "emails"})) == [failed_email, queued]
        assert listed(self.client.get(JOBS, {"task": BOOM})) == [failed_default, failed_email]
        assert listed(self.client.get(JOBS, {"task": SLEEP, "queue": "reports"})) == [done]
        assert listed(self.client.get(JOBS, {"task": SLEEP, "queue": "emails"})) == []

        sidebar = self.client.get(JOBS).content.decode()
        # Queues with live jobs, and the registered tasks, are offered as choices.
        assert '?queue=emails"' in sidebar
        assert f'?task={BOOM}"' in sidebar
        assert '?status__exact=failed"' in sidebar

    def test_search_by_id_task_and_error_text(self) -> None:
        first = make_job(status="failed", task=BOOM, last_error="ConnectionError: smtp refused")
        second = make_job(status="failed", last_error="ValueError: bad address")
        third = make_job(task=SLEEP)

        assert listed(self.client.get(JOBS, {"q": str(second)})) == [second]
        assert listed(self.client.get(JOBS, {"q": f" {third} "})) == [third]
        assert listed(self.client.get(JOBS, {"q": "testjobs.boom"})) == [first]
        assert listed(self.client.get(JOBS, {"q": "SMTP REFUSED"})) == [first]
        assert listed(self.client.get(JOBS, {"q": "bad address"})) == [second]
        assert listed(self.client.get(JOBS, {"q": "no such words"})) == []


# -- the detail page ------------------------------------------------------------------------


class JobDetailTests(TestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.admin = User.objects.create_superuser("root", password="pw")

    def setUp(self) -> None:
        self.client.force_login(self.admin)

    def test_payload_is_pretty_json_and_the_error_is_shown_in_full(self) -> None:
        payload = {"user": {"id": 7, "tags": ["a", "b"]}, "amount": 12.5, "note": "café"}
        error = (
            "Traceback (most recent call last):\n"
            + "".join(f'  File "step{i}.py", line {i}, in step{i}\n' for i in range(30))
            + "RuntimeError: "
            + "x" * 300
        )
        job_id = make_job(
            status="failed",
            attempts=5,
            payload=payload,
            last_error=error,
            finished_at=timedelta(minutes=-1),
        )
        page = self.client.get(job_url(job_id)).content.decode()

        pretty = json.dumps(payload, indent=2, ensure_ascii=False, sort_keys=True)
        assert "\n  " in pretty
        assert html.escape(pretty) in page
        assert html.escape(error) in page

    def test_a_job_that_is_not_queued_is_read_only(self) -> None:
        for status in ("running", "done", "failed"):
            job_id = make_job(status=status, attempts=1)
            response = self.client.get(job_url(job_id))
            assert response.status_code == 200
            adminform = response.context["adminform"]
            assert dict(adminform.form.fields) == {}, status
            assert set(adminform.readonly_fields) == EDITABLE | set(NOT_EDITABLE), status
            page = response.content.decode()
            for name in ("queue", "priority", "run_at_0", "max_attempts", "status", "task"):
                assert f'name="{name}"' not in page, (status, name)

    def test_a_queued_job_offers_only_queue_priority_run_at_and_max_attempts(self) -> None:
        job_id = make_job(queue="emails")
        response = self.client.get(job_url(job_id))
        adminform = response.context["adminform"]
        assert set(adminform.form.fields) == EDITABLE
        assert set(adminform.readonly_fields) == set(NOT_EDITABLE)
        page = response.content.decode()
        for name in ("queue", "priority", "run_at_0", "run_at_1", "max_attempts"):
            assert f'name="{name}"' in page, name
        for name in ("status", "task", "attempts", "payload", "last_error"):
            assert f'name="{name}"' not in page, name

    def test_saving_a_queued_job_writes_only_the_changed_editable_fields(self) -> None:
        job_id = make_job(
            queue="emails", payload={"n": 1}, last_error="earlier", run_at=timedelta(minutes=5)
        )
        before = job_row(job_id)
        assert before["run_at"].microsecond  # the form shows whole seconds: it must not cut them
        self.client.get(job_url(job_id))

        # Fields that are not editable are posted too: the form must ignore them.
        response = self.client.post(
            job_url(job_id),
            edit_form(
                job_id,
                queue="reports",
                priority="7",
                status="done",
                attempts="4",
                task=BOOM,
                payload='{"n": 2}',
                last_error="",
                locked_until_0="2030-01-01",
            ),
            follow=True,
        )
        assert response.redirect_chain == [(JOBS, 302)], response.content.decode()
        assert [level for level, _text in messages_of(response)] == ["success"]
        after = job_row(job_id)
        assert (after["queue"], after["priority"]) == ("reports", 7)
        assert after == {**before, "queue": "reports", "priority": 7}

        response = self.client.post(
            job_url(job_id),
            edit_form(job_id, run_at_0="2031-05-06", run_at_1="07:08:09", max_attempts="9"),
            follow=True,
        )
        later = job_row(job_id)
        assert later["run_at"].isoformat() == "2031-05-06T07:08:09+00:00"
        assert later == {**after, "run_at": later["run_at"], "max_attempts": 9}
        assert [level for level, _text in messages_of(response)] == ["success"]

    def test_a_job_claimed_between_opening_and_saving_is_not_written(self) -> None:
        job_id = make_job(queue="emails")
        assert set(self.client.get(job_url(job_id)).context["adminform"].form.fields) == EDITABLE
        # A worker claims it while the page is open.
        query(
            "UPDATE pgjobs_job SET status = 'running', attempts = 1, "
            "locked_until = now() + interval '5 minutes' WHERE id = %s RETURNING id",
            [job_id],
        )
        before = job_row(job_id)

        response = self.client.post(
            job_url(job_id),
            edit_form(job_id, queue="reports", priority="9", max_attempts="2"),
            follow=True,
        )
        assert job_row(job_id) == before
        shown = messages_of(response)
        assert ("warning", f"Job {job_id} is no longer queued: nothing was changed.") in shown
        assert not [message for level, message in shown if level == "success"], shown

    def test_bad_values_are_refused_by_the_form(self) -> None:
        job_id = make_job()
        before = job_row(job_id)
        for changes in (
            {"priority": "101"},
            {"priority": "-101"},
            {"max_attempts": "0"},
            {"queue": "no spaces allowed"},
            {"queue": ""},
            {"run_at_0": "", "run_at_1": ""},
        ):
            response = self.client.post(job_url(job_id), edit_form(job_id, **changes))
            assert response.status_code == 200, changes
            assert response.context["adminform"].form.errors, changes
            assert job_row(job_id) == before, changes

    def test_max_attempts_must_leave_a_queued_job_an_attempt(self) -> None:
        # Was a server error (the CHECK constraint refused the UPDATE).
        job_id = make_job(attempts=2, max_attempts=5)
        before = job_row(job_id)
        for value in ("1", "2"):
            response = self.client.post(job_url(job_id), edit_form(job_id, max_attempts=value))
            assert response.status_code == 200, value
            errors = response.context["adminform"].form.errors
            assert "has made 2 attempts" in str(errors["max_attempts"]), errors
            assert job_row(job_id) == before
        response = self.client.post(job_url(job_id), edit_form(job_id, max_attempts="3"))
        assert response.status_code == 302
        assert job_row(job_id)["max_attempts"] == 3


class ConcurrentEditTests(TransactionTestCase):
    """A worker claims the job while the admin's UPDATE waits on its row lock."""

    def test_the_claim_wins_and_the_page_says_nothing_was_changed(self) -> None:
        client = Client()
        client.force_login(User.objects.create_superuser("root", password="pw"))
        job_id = make_job(queue="emails")
        data = edit_form(job_id, queue="reports")

        with raw_connect() as worker, worker.transaction():
            worker.execute("SELECT id FROM pgjobs_job WHERE id = %s FOR UPDATE", [job_id])
            saving = DbThread(client.post, job_url(job_id), data, follow=True)
            saving.start()
            # The page read the job while it was queued; its UPDATE now waits for our lock.
            wait_until(
                lambda: scalar(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock' AND query LIKE %s",
                    ['UPDATE "pgjobs_job" SET "queue"%'],
                ),
                message="the admin's UPDATE to wait for the worker's lock",
            )
            worker.execute(
                "UPDATE pgjobs_job SET status = 'running', attempts = 1 WHERE id = %s", [job_id]
            )
        response = saving.result()

        row = job_row(job_id)
        assert (row["queue"], row["status"]) == ("emails", "running")
        assert messages_of(response) == [
            ("warning", f"Job {job_id} is no longer queued: nothing was changed."),
        ]
        assert not LogEntry.objects.filter(object_id=str(job_id)).exists()


# -- escaping --------------------------------------------------------------------------------


class EscapingTests(TestCase):
    def test_payload_error_and_task_are_text_on_every_page(self) -> None:
        self.client.force_login(User.objects.create_superuser("root", password="pw"))
        job_id = make_job(
            status="failed",
            attempts=1,
            task="tests.<i>evil</i>",
            payload={"note": SCRIPT},
            last_error=BOLD,
            finished_at=timedelta(minutes=-1),
        )
        pages = {
            "list": self.client.get(JOBS).content.decode(),
            "failed list": self.client.get(FAILED).content.decode(),
            "detail": self.client.get(job_url(job_id)).content.decode(),
            "failed detail": self.client.get(failed_url(job_id)).content.decode(),
            "dashboard": self.client.get(DASHBOARD).content.decode(),
        }
        for name, page in pages.items():
            assert SCRIPT not in page, name
            assert BOLD not in page, name
            assert "<i>evil</i>" not in page, name
            assert "&lt;b&gt;x&lt;/b&gt;" in page, name
            assert "tests.&lt;i&gt;evil&lt;/i&gt;" in page, name
        for name in ("detail", "failed detail"):
            assert "&quot;&lt;script&gt;alert(1)&lt;/script&gt;&quot;" in pages[name], name


# -- failed jobs -------------------------------------------------------------------------


class FailedJobListTests(TestCase):
    def test_only_failed_jobs_newest_failure_first(self) -> None:
        self.client.force_login(User.objects.create_superuser("root", password="pw"))
        older = make_job(status="failed", attempts=5, finished_at=timedelta(hours=-2))
        newer = make_job(status="failed", attempts=5, finished_at=timedelta(minutes=-1))
        for status in ("queued", "running", "done"):
            make_job(status=status, finished_at=timedelta(minutes=-30))

        response = self.client.get(FAILED)
        assert listed(response) == [newer, older]
        actions = dict(response.context["action_form"].fields["action"].choices)
        assert {"retry_selected", "delete_selected"} <= set(actions)
        assert actions["retry_selected"] == "Retry selected failed jobs"


class RetryTests(TransactionTestCase):
    """retry_selected commits and sends NOTIFY: autocommit, with a second connection."""

    def setUp(self) -> None:
        self.client.force_login(User.objects.create_superuser("root", password="pw"))

    def act(self, action: str, ids: list[int], **extra: str) -> Any:
        data = {"action": action, "_selected_action": [str(i) for i in ids], "index": "0"}
        return self.client.post(FAILED, {**data, **extra}, follow=True)

    def test_retry_queues_them_now_with_fresh_attempts_and_one_notify_per_queue(self) -> None:
        failed = {
            "emails": [
                make_job(
                    queue="emails",
                    status="failed",
                    attempts=5,
                    last_error=f"err {n}",
                    run_at=timedelta(hours=-3),
                    finished_at=timedelta(hours=-2),
                    locked_until=timedelta(hours=-2),
                )
                for n in range(3)
            ],
            "reports": [
                make_job(
                    queue="reports",
                    status="failed",
                    attempts=2,
                    max_attempts=2,
                    last_error="err",
                    finished_at=timedelta(minutes=-1),
                )
            ],
        }
        chosen = failed["emails"] + failed["reports"]
        other = make_job(queue="other", status="failed", attempts=5, last_error="keep")
        other_before = job_row(other)

        with listening() as listener:
            before = db_now()
            response = self.act("retry_selected", chosen)
            after = db_now()
            notified = listener.receive(2)
            notified += listener.quiet()

        assert sorted(notified) == ["emails", "reports"]
        for job_id in chosen:
            row = job_row(job_id)
            assert (row["status"], row["attempts"], row["locked_until"]) == ("queued", 0, None)
            assert before <= row["run_at"] <= after
            assert row["finished_at"] is None
            assert row["last_error"] is not None  # the history stays
        assert job_row(other) == other_before
        ids = ", ".join(str(i) for i in sorted(chosen))
        assert messages_of(response) == [("success", f"Queued 4 job(s) again: {ids}.")]
        assert listed(response) == [other]

    def test_a_job_no_longer_failed_is_left_alone_and_the_page_says_so(self) -> None:
        failed = make_job(queue="emails", status="failed", attempts=5, last_error="err")
        finished = make_job(
            queue="reports",
            status="failed",
            attempts=5,
            last_error="err",
            finished_at=timedelta(minutes=-10),
        )
        self.client.get(FAILED)
        # Someone retried it and a worker finished it while the page was open.
        query(
            "UPDATE pgjobs_job SET status = 'done', attempts = 1, finished_at = now() "
            "WHERE id = %s RETURNING id",
            [finished],
        )
        finished_before = job_row(finished)

        with listening() as listener:
            response = self.act("retry_selected", [failed, finished])
            notified = listener.receive(1)
            notified += listener.quiet()

        assert job_row(finished) == finished_before
        assert job_row(failed)["status"] == "queued"
        assert notified == ["emails"]
        assert messages_of(response) == [
            ("success", f"Queued 1 job(s) again: {failed}."),
            ("warning", f"1 job(s) were no longer failed and were left alone: {finished}."),
        ]

    def test_retry_of_jobs_none_of_which_are_failed_changes_nothing(self) -> None:
        gone = make_job(status="failed", attempts=5)
        query(
            "UPDATE pgjobs_job SET status = 'queued', attempts = 0 WHERE id = %s RETURNING id",
            [gone],
        )
        before = job_row(gone)
        with listening() as listener:
            response = self.act("retry_selected", [gone])
            assert listener.quiet(timeout=0.5) == []
        assert job_row(gone) == before
        assert messages_of(response) == [
            ("warning", f"1 job(s) were no longer failed and were left alone: {gone}."),
        ]

    def test_delete_selected_deletes_only_the_selected_failed_jobs(self) -> None:
        doomed = [make_job(status="failed", attempts=5) for _ in range(2)]
        kept_failed = make_job(status="failed", attempts=5)
        # Ids of jobs that are not failed, slipped into the selection, are not deleted.
        queued = make_job()
        done = make_job(status="done", attempts=1)

        confirm = self.client.post(
            FAILED,
            {
                "action": "delete_selected",
                "index": "0",
                "_selected_action": [str(i) for i in [*doomed, queued, done]],
            },
        )
        assert confirm.status_code == 200
        assert "Are you sure" in confirm.content.decode()
        assert scalar("SELECT count(*) FROM pgjobs_job") == 5

        response = self.act("delete_selected", [*doomed, queued, done], post="yes")
        assert response.status_code == 200
        remaining = {row[0] for row in query("SELECT id FROM pgjobs_job")}
        assert remaining == {kept_failed, queued, done}
        assert messages_of(response) == [("success", "Successfully deleted 2 failed jobs.")]


# -- permissions ----------------------------------------------------------------------------


class PermissionTests(TestCase):
    def setUp(self) -> None:
        self.failed = make_job(status="failed", attempts=5, last_error="err")

    def actions(self, client: Client) -> set[str]:
        response = client.get(FAILED)
        assert response.status_code == 200
        form = response.context["action_form"]
        return {name for name, _label in form.fields["action"].choices if name} if form else set()

    def post_action(self, client: Client, action: str) -> None:
        client.post(
            FAILED,
            {
                "action": action,
                "index": "0",
                "_selected_action": [str(self.failed)],
                "post": "yes",
            },
        )

    def test_view_only_staff_see_no_action_and_cannot_run_one(self) -> None:
        client = client_for(make_user("viewer", "view_failedjob", "view_job"))
        assert self.actions(client) == set()
        before = job_row(self.failed)
        self.post_action(client, "retry_selected")
        self.post_action(client, "delete_selected")
        assert job_row(self.failed) == before
        # Nor through the change form: there is nothing to save.
        assert client.post(failed_url(self.failed), {"queue": "x"}).status_code == 403
        assert job_row(self.failed) == before

    def test_change_permission_gives_retry_but_not_delete(self) -> None:
        client = client_for(make_user("changer", "view_failedjob", "change_failedjob"))
        assert self.actions(client) == {"retry_selected"}
        self.post_action(client, "delete_selected")
        assert job_row(self.failed)["status"] == "failed"
        self.post_action(client, "retry_selected")
        assert job_row(self.failed)["status"] == "queued"

    def test_delete_permission_gives_delete_but_not_retry(self) -> None:
        client = client_for(make_user("deleter", "view_failedjob", "delete_failedjob"))
        assert self.actions(client) == {"delete_selected"}
        self.post_action(client, "retry_selected")
        assert job_row(self.failed)["status"] == "failed"
        self.post_action(client, "delete_selected")
        assert scalar("SELECT count(*) FROM pgjobs_job WHERE id = %s", [self.failed]) == 0

    def test_the_dashboard_needs_view_permission_on_jobs(self) -> None:
        nobody = client_for(make_user("nobody"))
        assert nobody.get(DASHBOARD).status_code == 403
        assert DASHBOARD not in nobody.get(reverse("admin:index")).content.decode()

        viewer = client_for(make_user("viewer", "view_job"))
        assert viewer.get(DASHBOARD).status_code == 200
        # Linked from the app's admin index.
        assert f'href="{DASHBOARD}"' in viewer.get(APP_INDEX).content.decode()

    def test_the_dashboard_permission_opens_the_dashboard_and_nothing_else(self) -> None:
        secret = make_job(payload={"token": "s3cr3t-token"})
        client = client_for(make_user("watcher", "view_queuedashboard"))
        assert client.get(DASHBOARD).status_code == 200
        for page in (
            f"{DASHBOARD}{secret}/change/",
            f"{DASHBOARD}{secret}/history/",
            job_url(secret),
        ):
            response = client.get(page, follow=True)
            assert "s3cr3t-token" not in response.content.decode(), page
            assert response.status_code in (403, 404), page

    def test_failure_links_on_the_dashboard_open_for_whoever_may_see_it(self) -> None:
        make_job(status="failed", attempts=5, finished_at=timedelta(minutes=-1), last_error="err")
        viewer = client_for(make_user("viewer", "view_job"))
        page = viewer.get(DASHBOARD).content.decode()
        links = re.findall(r'<a href="([^"]+)">\d+</a>', table(page, "pgjobs-failures")[0][0])
        assert len(links) == 1
        assert viewer.get(links[0]).status_code == 200

    def test_non_staff_and_anonymous_users_are_sent_to_the_login_page(self) -> None:
        member = client_for(make_user("member", "view_job", "change_failedjob", is_staff=False))
        for client in (member, Client()):
            for url in (JOBS, FAILED, DASHBOARD, job_url(self.failed)):
                response = client.get(url)
                assert response.status_code == 302, url
                assert response["Location"].startswith(f"{LOGIN}?next="), url
            self.post_action(client, "retry_selected")
        assert job_row(self.failed)["status"] == "failed"


# -- the dashboard --------------------------------------------------------------------------


class DashboardTests(TestCase):
    """One transaction: now() is the same for the rows made and for the page that reads them."""

    @classmethod
    def setUpTestData(cls) -> None:
        cls.admin = User.objects.create_superuser("root", password="pw")

    def setUp(self) -> None:
        self.client.force_login(self.admin)

    def minute(self, offset: timedelta) -> str:
        return str(scalar("SELECT to_char(date_trunc('minute', now() + %s), 'HH24:MI')", [offset]))

    def test_per_queue_numbers_lag_chart_and_last_failures(self) -> None:
        ago = {m: timedelta(minutes=-m) for m in (1, 2, 5, 10)}
        # emails: 2 ready (the oldest due 2 minutes ago), 1 scheduled, 2 running (1 lease
        # expired), 2 failed, 3 done in the last hour and 1 done before it.
        make_job(queue="emails", run_at=ago[2])
        make_job(queue="emails", run_at=timedelta(seconds=-30))
        make_job(queue="emails", run_at=timedelta(hours=1))
        make_job(queue="emails", status="running", attempts=1, locked_until=timedelta(minutes=5))
        make_job(queue="emails", status="running", attempts=1, locked_until=ago[1])
        # Two failures a second apart, inside one minute of the chart.
        five_ago = scalar("SELECT date_trunc('minute', now()) - interval '5 minutes'")
        recent_failures = [
            make_job(
                queue="emails",
                status="failed",
                attempts=3,
                task=BOOM,
                last_error=f"RuntimeError: smtp {n}",
                finished_at=five_ago + timedelta(seconds=n),
            )
            for n in range(2)
        ]
        for _ in range(3):
            make_job(queue="emails", status="done", attempts=1, finished_at=ago[10])
        make_job(queue="emails", status="done", attempts=1, finished_at=timedelta(hours=-2))
        # reports: 1 ready for 10 s, 1 failed two days ago, 2 done a minute ago.
        make_job(queue="reports", run_at=timedelta(seconds=-10))
        old_failure = make_job(
            queue="reports",
            status="failed",
            attempts=1,
            last_error="old",
            finished_at=timedelta(days=-2),
        )
        for _ in range(2):
            make_job(queue="reports", status="done", attempts=1, finished_at=ago[1])

        page = self.client.get(DASHBOARD).content.decode()

        queues = [[text(cell) for cell in row] for row in table(page, "pgjobs-queues")]
        assert queues == [
            ["emails", "2", "1", "2", "1", "2", "3", "120.0 s"],
            ["reports", "1", "0", "0", "0", "1", "2", "10.0 s"],
        ]

        assert page.count('<rect class="done"') == 60
        assert page.count('<rect class="failed"') == 60
        assert "5 done and 2 failed between" in page
        for offset, label in (
            (ago[10], "3 done, 0 failed"),
            (ago[5], "0 done, 2 failed"),
            (ago[1], "2 done, 0 failed"),
        ):
            assert f"<title>{self.minute(offset)} UTC: {label}</title>" in page, label
        assert page.count(" UTC: 0 done, 0 failed</title>") == 57
        heights = [float(h) for h in re.findall(r'<rect class="done"[^>]* height="([^"]+)"', page)]
        # The busiest minute (3 done) fills the chart; two done fill two thirds of it.
        assert sorted(h for h in heights if h) == [
            round((CHART_HEIGHT - CHART_TOP) * 2 / 3, 1),
            CHART_HEIGHT - CHART_TOP,
        ]
        assert f"{self.minute(timedelta(minutes=-59))}</text>" in page
        assert f"{self.minute(timedelta(0))}</text>" in page

        failures = table(page, "pgjobs-failures")
        newest_first = [*reversed(recent_failures), old_failure]
        assert [text(row[0]) for row in failures] == [str(i) for i in newest_first]
        for row, job_id in zip(failures, newest_first, strict=True):
            assert f'<a href="{job_url(job_id)}">{job_id}</a>' in row[0]
        assert [text(row[5]) for row in failures] == [
            "RuntimeError: smtp 1",
            "RuntimeError: smtp 0",
            "old",
        ]
        assert [text(row[1]) for row in failures[:2]] == [BOOM, BOOM]

    def test_an_empty_queue_table_still_draws_the_hour(self) -> None:
        page = self.client.get(DASHBOARD).content.decode()
        assert "No jobs queued, running, failed or finished in the last hour." in page
        assert "No failed jobs." in page
        assert page.count('<rect class="done"') == 60
        assert "0 done and 0 failed between" in page

    def test_only_the_ten_latest_failures_are_listed(self) -> None:
        ids = [
            make_job(status="failed", attempts=1, finished_at=timedelta(minutes=-n))
            for n in range(1, 13)
        ]
        failures = table(self.client.get(DASHBOARD).content.decode(), "pgjobs-failures")
        assert [text(row[0]) for row in failures] == [str(i) for i in ids[:10]]


# -- cost on a big table ---------------------------------------------------------------------


class CheapQueryTests(TransactionTestCase):
    """200,000 done rows (committed and analysed, as in production) and a few live ones."""

    DONE_ROWS = 200_000

    def setUp(self) -> None:
        self.client.force_login(User.objects.create_superuser("root", password="pw"))
        # finished_at spread evenly over the last two days, across three queues.
        with connection.cursor() as cursor:
            cursor.execute(
                "INSERT INTO pgjobs_job (queue, task, payload, status, run_at, attempts, "
                "created_at, started_at, attempted_at, finished_at) "
                "SELECT (ARRAY['default', 'emails', 'reports'])[n %% 3 + 1], %s, "
                "jsonb_build_object('n', n), 'done', t, 1, t, t, t, t "
                "FROM generate_series(1, %s) AS n, "
                "LATERAL (SELECT now() - n * interval '864 milliseconds') AS f(t)",
                [NOOP, self.DONE_ROWS],
            )
        for queue in ("default", "emails"):
            make_job(queue=queue)
            make_job(queue=queue, run_at=timedelta(hours=1))
            make_job(queue=queue, status="running", attempts=1, locked_until=timedelta(minutes=5))
            make_job(
                queue=queue,
                status="failed",
                attempts=5,
                task=BOOM,
                last_error="boom",
                finished_at=timedelta(minutes=-3),
            )
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE pgjobs_job")

    def pages_queries(self, url: str, params: dict[str, str] | None = None) -> list[str]:
        with CaptureQueriesContext(connection) as captured:
            response = self.client.get(url, params or {})
        assert response.status_code == 200
        return [q["sql"] for q in captured.captured_queries]

    def test_dashboard_and_failed_list_read_indexes_not_the_table(self) -> None:
        assert scalar("SELECT count(*) FROM pgjobs_job WHERE status = 'done'") == self.DONE_ROWS
        expected = {
            "QUEUE_DEPTH": (dashboard.QUEUE_DEPTH, {}, "pgjobs_job_ready_idx"),
            "RUNNING_BY_QUEUE": (dashboard.RUNNING_BY_QUEUE, {}, "pgjobs_job_lease_idx"),
            "FAILED_BY_QUEUE": (dashboard.FAILED_BY_QUEUE, {}, "pgjobs_job_failed_idx"),
            "THROUGHPUT": (dashboard.THROUGHPUT, {"minutes": 60}, "pgjobs_job_finished_idx"),
            "RECENT_FAILURES": (dashboard.RECENT_FAILURES, {"limit": 10}, "pgjobs_job_failed_idx"),
            # jobsdoctor's count: a BitmapOr over the queued and the running partial indexes.
            "SUSPECTS": (doctor.SUSPECTS, {}, "pgjobs_job_lease_idx"),
        }
        for name, (statement, params, index) in expected.items():
            assert index in assert_no_table_scan(statement, params), name

        # Everything the failed-jobs list and the dashboard send: the list's count and rows
        # (and the queue filter's choices) included.
        for url in (FAILED, DASHBOARD):
            sent = [s for s in self.pages_queries(url) if "pgjobs_job" in s]
            assert sent, url
            for statement in sent:
                assert_no_table_scan(statement)
        failed_list = self.pages_queries(FAILED)
        counts = [s for s in failed_list if s.upper().startswith("SELECT COUNT(*)")]
        assert counts and all("'failed'" in s for s in counts), counts

    def test_the_unfiltered_job_list_counts_nothing(self) -> None:
        def bare_counts(statements: list[str]) -> list[str]:
            return [
                s
                for s in statements
                if re.search(r'COUNT\(\*\).* FROM "pgjobs_job"', s, re.I)
                and " WHERE " not in s.upper()
            ]

        def counts(statements: list[str]) -> list[str]:
            return [s for s in statements if re.search(r"COUNT\(\*\)", s, re.I)]

        sent = self.pages_queries(JOBS)
        assert bare_counts(sent) == [], bare_counts(sent)
        page = self.client.get(JOBS)
        # The estimate stands in for the count (ANALYZE's, so close to the real number).
        assert abs(page.context["cl"].result_count - (self.DONE_ROWS + 8)) < 2_000
        assert len(listed(page)) == 50
        # The rows themselves come from the primary key, newest first.
        for statement in sent:
            if statement.startswith('SELECT "pgjobs_job"."id"'):
                assert_no_table_scan(statement)

        # The check sees counts where there are some: a filtered list counts its matches.
        filtered = self.pages_queries(JOBS, {"status__exact": "failed"})
        assert counts(filtered) and not bare_counts(filtered)


# -- cancel ---------------------------------------------------------------------------------


def cancel_url(job_id: int) -> str:
    return reverse("admin:django_pgjobs_job_cancel", args=[job_id])


class CancelTests(TestCase):
    """The list's "Cancel selected jobs" and the job page's Cancel: both confirm first, both
    need the change permission on jobs, both act through Job.objects.cancel()."""

    def setUp(self) -> None:
        self.queued = make_job()
        self.running = make_job(status="running", attempts=1, locked_until=timedelta(minutes=5))
        self.done = make_job(status="done", attempts=1, finished_at=timedelta(0))

    def act(self, client: Client, ids: list[int], **extra: str) -> Any:
        data = {"action": "cancel_selected", "_selected_action": [str(i) for i in ids]}
        return client.post(JOBS, {**data, "index": "0", **extra}, follow=True)

    def statuses(self) -> list[str]:
        return [job_row(i)["status"] for i in (self.queued, self.running, self.done)]

    def test_the_action_asks_first_then_cancels_only_the_unfinished_jobs(self) -> None:
        client = client_for(User.objects.create_superuser("root", password="pw"))
        chosen = [self.queued, self.running, self.done]
        before = [job_row(i) for i in chosen]

        confirm = self.act(client, chosen)
        page = confirm.content.decode()
        assert confirm.status_code == 200 and "Are you sure" in page
        listing = text(re.search(r'<ul id="pgjobs-cancel-list">(.*?)</ul>', page, re.S)[1])  # type: ignore[index]
        assert listing == (
            f"Job {self.queued}: {NOOP} on default, queued "
            f"Job {self.running}: {NOOP} on default, running"
        )
        # The form posts the same selection back, confirmed.
        for job_id in chosen:
            assert f'name="_selected_action" value="{job_id}"' in page
        assert 'name="post" value="yes"' in page and "csrfmiddlewaretoken" in page
        assert [job_row(i) for i in chosen] == before

        response = self.act(client, chosen, post="yes")
        assert self.statuses() == ["cancelled", "cancelled", "done"]
        assert job_row(self.done) == before[2]
        assert messages_of(response) == [
            ("success", "Cancelled 2 job(s)."),
            ("warning", "1 job(s) had already finished and were left alone."),
        ]

    def test_the_job_page_offers_cancel_while_the_job_is_queued_or_running(self) -> None:
        client = client_for(User.objects.create_superuser("root", password="pw"))
        for job_id, offered in ((self.queued, True), (self.running, True), (self.done, False)):
            page = client.get(job_url(job_id)).content.decode()
            assert (f'href="{cancel_url(job_id)}"' in page) is offered, job_id

        confirm = client.get(cancel_url(self.running))
        page = confirm.content.decode()
        assert confirm.status_code == 200 and "Are you sure" in page
        assert f"Job {self.running}: {NOOP} on default, running" in text(page)
        assert 'method="post"' in page and "csrfmiddlewaretoken" in page
        assert job_row(self.running)["status"] == "running"

        response = client.post(cancel_url(self.running), {"post": "yes"})
        assert response.status_code == 302 and response["Location"] == job_url(self.running)
        assert job_row(self.running)["status"] == "cancelled"
        page = client.get(job_url(self.running)).content.decode()
        assert "Cancelled 1 job(s)." in page
        assert f'href="{cancel_url(self.running)}"' not in page

        # A second cancel of the same job (a page left open) changes nothing and says so.
        before = job_row(self.running)
        client.post(cancel_url(self.running), {"post": "yes"})
        assert job_row(self.running) == before
        assert "1 job(s) had already finished and were left alone." in text(
            client.get(job_url(self.running)).content.decode()
        )
        assert client.get(cancel_url(10**12)).status_code == 404

    def test_the_cancel_post_needs_its_csrf_token(self) -> None:
        client = Client(enforce_csrf_checks=True)
        client.force_login(User.objects.create_superuser("root", password="pw"))
        assert client.post(cancel_url(self.queued), {"post": "yes"}).status_code == 403
        assert self.act(client, [self.queued], post="yes").status_code == 403
        assert self.statuses() == ["queued", "running", "done"]

    def test_without_the_change_permission_there_is_no_cancel(self) -> None:
        viewer = client_for(make_user("viewer", "view_job"))
        response = viewer.get(JOBS)
        form = response.context["action_form"]
        names = {n for n, _label in form.fields["action"].choices if n} if form else set()
        assert "cancel_selected" not in names
        self.act(viewer, [self.queued, self.running], post="yes")
        assert (
            f'href="{cancel_url(self.queued)}"'
            not in viewer.get(job_url(self.queued)).content.decode()
        )
        assert viewer.get(cancel_url(self.queued)).status_code == 403
        assert viewer.post(cancel_url(self.queued), {"post": "yes"}).status_code == 403
        assert self.statuses() == ["queued", "running", "done"]

        changer = client_for(make_user("changer", "view_job", "change_job"))
        form = changer.get(JOBS).context["action_form"]
        assert "cancel_selected" in {n for n, _label in form.fields["action"].choices}
        self.act(changer, [self.queued], post="yes")
        assert changer.post(cancel_url(self.running), {"post": "yes"}).status_code == 302
        assert self.statuses() == ["cancelled", "cancelled", "done"]

    def test_the_failed_jobs_list_has_no_cancel(self) -> None:
        client = client_for(User.objects.create_superuser("root", password="pw"))
        make_job(status="failed", attempts=5, last_error="err")
        form = client.get(FAILED).context["action_form"]
        assert "cancel_selected" not in {n for n, _label in form.fields["action"].choices}

    def test_the_status_filter_offers_cancelled(self) -> None:
        client = client_for(User.objects.create_superuser("root", password="pw"))
        Job.objects.cancel([self.queued])
        assert '?status__exact=cancelled"' in client.get(JOBS).content.decode()
        assert listed(client.get(JOBS, {"status__exact": "cancelled"})) == [self.queued]


class CrashTests(TestCase):
    """Jobs failed because their workers kept dying are shown, and filtered, apart."""

    def setUp(self) -> None:
        self.client.force_login(User.objects.create_superuser("root", password="pw"))
        expired = timedelta(minutes=-1)
        # Its worker died under it once already; dying again, the reaper quarantines it.
        self.quarantined = make_job(status="running", attempts=2, locked_until=expired)
        # Its lease expired on its last attempt, with no crash before: failed, not quarantined.
        self.expired = make_job(status="running", attempts=5, locked_until=expired)
        with connection.cursor() as cursor:
            cursor.execute("UPDATE pgjobs_job SET crashes = 1 WHERE id = %s", [self.quarantined])
        reaped = {row.id: row.status for row in Job.objects.reap()}
        assert reaped == {self.quarantined: "failed", self.expired: "failed"}
        self.raised = make_job(
            status="failed", attempts=5, task=BOOM, last_error="boom", finished_at=timedelta(0)
        )

    def test_the_failed_list_and_the_page_show_crashes_and_the_list_filters_on_them(self) -> None:
        page = self.client.get(FAILED).content.decode()
        assert "column-crashes" in page
        assert "2" in result_row(page, self.quarantined)
        assert "0" in result_row(page, self.raised)
        assert listed(self.client.get(FAILED, {"ended": "crashed"})) == [self.quarantined]
        assert sorted(listed(self.client.get(FAILED, {"ended": "other"}))) == sorted(
            [self.raised, self.expired]
        )
        assert sorted(listed(self.client.get(FAILED))) == sorted(
            [self.quarantined, self.raised, self.expired]
        )

        response = self.client.get(job_url(self.quarantined))
        assert "crashes" in response.context["adminform"].readonly_fields
