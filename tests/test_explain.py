"""Why isn't this job running? Each reason, set up for real in the database, then explained.

Situations are made the way the queue makes them: ``Job.objects.pause`` and ``set_limits``,
jobs claimed by the real claim (``Job.objects.claim``, the guarded one where limits and keys
apply), registry rows written with the worker's own statement (``upkeep.WORKER_BEAT``), and a real
worker process for a job that is running. Where a reason says the claim will not take a job,
the test asks the claim too, and after the cause is lifted checks that the explanation and the
claim agree again.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test import TestCase
from django.urls import reverse

from django_pgjobs.core import upkeep
from django_pgjobs.models import Job
from django_pgjobs.ops import explain as explaining
from django_pgjobs.ops.explain import AHEAD_LIMIT, Reason, explain
from tests.helpers import job_row, make_job, make_jobs, query, scalar, wait_until, worker_record
from tests.test_admin import assert_no_table_scan, client_for, make_user, text
from tests.workers import Workers

NOOP = "testproject.testjobs.noop"
UNTIL_ORDER = "tests.workers.until_order"


def codes(reasons: list[Reason]) -> list[str]:
    return [reason.code for reason in reasons]


def reason(job_id: int, code: str) -> Reason:
    found = [r for r in explain(job_id) if r.code == code]
    assert found, f"no {code!r} reason for job {job_id}: {explain(job_id)}"
    return found[0]


def beat(
    worker_id: str,
    queues: dict[str, int | None],
    tasks: list[str] | None = None,
    mode: str = "lease",
) -> None:
    """A live worker's registry row, as the worker writes it on its tick."""
    record = {**worker_record(worker_id, queues, tasks), "mode": mode}
    with connection.cursor() as cursor:
        cursor.execute(upkeep.WORKER_BEAT, record)


def set_columns(job_id: int, **values: Any) -> None:
    """Columns make_job() does not write (lock_key, crashes, worker_ids as JSON text)."""
    for name, value in values.items():
        assert name in ("lock_key", "crashes", "worker_ids", "attempted_at"), name
        cast = "::jsonb" if name == "worker_ids" else ""
        query(
            f"UPDATE pgjobs_job SET {name} = %s{cast} WHERE id = %s RETURNING id",
            [value, job_id],
        )


def utc(moment: Any) -> str:
    return f"{moment:%Y-%m-%d %H:%M:%S} UTC"


# -- a queued job, inside the test's transaction ----------------------------------------------


class TestQueued:
    @pytest.fixture(autouse=True)
    def _a_worker(self, db: None) -> None:
        beat("web-1:1:a", {"default": None, "emails": None}, None)

    def test_a_job_first_in_its_queue_with_a_worker_is_next(self) -> None:
        job = make_job(queue="emails")
        assert codes(explain(job)) == ["next"]
        assert codes(explain(Job.objects.get(pk=job))) == ["next"]

    def test_scheduled_for_later_says_when(self) -> None:
        job = make_job(run_at=timedelta(hours=2))
        (scheduled,) = explain(job)
        run_at = job_row(job)["run_at"]
        assert scheduled.code == "scheduled"
        assert scheduled.data == {"run_at": run_at}
        # One transaction: its now() is the same in both statements.
        assert utc(run_at) in scheduled.message and "(in 2 h)" in scheduled.message

    def test_waiting_for_its_retry_says_when_and_after_which_error(self) -> None:
        error = 'Traceback (most recent call last):\n  File "x.py"\nConnectionError: smtp down'
        job = make_job(attempts=2, last_error=error, run_at=timedelta(seconds=80))
        (retry,) = explain(job)
        assert retry.code == "retry"
        assert retry.data["last_error"] == "ConnectionError: smtp down"
        assert "attempt 3 of 5" in retry.message and "ConnectionError: smtp down" in retry.message
        assert utc(job_row(job)["run_at"]) in retry.message

    def test_a_paused_queue(self) -> None:
        job = make_job(queue="emails")
        Job.objects.pause("emails")
        assert codes(explain(job)) == ["paused", "ahead"]
        assert "emails is paused" in reason(job, "paused").message
        # A deferred job of a paused queue: both reasons.
        later = make_job(queue="emails", run_at=timedelta(minutes=5))
        assert codes(explain(later)) == ["scheduled", "paused"]
        Job.objects.resume("emails")
        assert codes(explain(job)) == ["next"]

    def test_a_queue_at_its_concurrency_limit(self) -> None:
        Job.objects.set_limits("emails", concurrency=2)
        job = make_job(queue="emails")
        make_job(queue="emails", status="running", attempts=1, locked_until=timedelta(minutes=5))
        assert codes(explain(job)) == ["next"]
        make_job(queue="emails", status="running", attempts=1, locked_until=timedelta(minutes=5))
        limit = reason(job, "concurrency")
        assert limit.data == {"queue": "emails", "running": 2, "concurrency": 2}
        assert "2 running of 2" in limit.message
        # Running jobs of another queue do not count.
        assert reason(make_job(queue="default"), "next")

    def test_a_job_behind_another_of_its_lock_key(self) -> None:
        first = make_job(queue="emails", priority=3)
        second = make_job(queue="emails")
        set_columns(first, lock_key="customer:7")
        set_columns(second, lock_key="customer:7")
        turn = reason(second, "lock_key_turn")
        assert turn.data == {"lock_key": "customer:7", "first": first}
        assert codes(explain(first)) == ["next"]

    def test_a_job_whose_worker_died_waits_for_an_idle_worker(self) -> None:
        job = make_job(queue="emails", attempts=1)
        set_columns(job, crashes=1)
        assert codes(explain(job)) == ["suspect", "ahead"]
        assert reason(job, "suspect").data == {"crashes": 1}

    def test_no_live_worker_serves_the_queue(self) -> None:
        job = make_job(queue="reports")
        no_worker = reason(job, "no_worker")
        assert no_worker.data == {"queue": "reports", "live": 1}
        assert "runjobs --queue reports" in no_worker.message
        # An expired row is no live worker.
        beat("gone:2", {"reports": None}, None)
        query("UPDATE pgjobs_worker SET expires_at = now() - interval '1 s' RETURNING id")
        assert reason(job, "no_worker").data == {"queue": "reports", "live": 0}

    def test_no_live_worker_knows_its_task(self) -> None:
        beat("web-2:2:b", {"reports": 4}, ["app.other"])
        job = make_job(queue="reports")
        unknown = reason(job, "unknown_task")
        assert unknown.data == {"queue": "reports", "task": NOOP, "serving": 1}
        beat("web-3:3:c", {"reports": None}, [NOOP])
        assert codes(explain(job)) == ["next"]

    def test_a_transaction_mode_fleet_leaves_keyed_and_limited_jobs(self) -> None:
        beat("tx:4:d", {"ledger": None}, None, mode="transaction")
        keyless = make_job(queue="ledger")
        keyed = make_job(queue="ledger")
        set_columns(keyed, lock_key="account:1")
        assert codes(explain(keyless)) == ["next"]
        assert reason(keyed, "transaction_mode").data == {"queue": "ledger", "knowing": 1}
        Job.objects.set_limits("ledger", rate=(100, 1))
        assert "ledger has a limit" in reason(keyless, "transaction_mode").message
        beat("lease:5:e", {"ledger": None}, None)
        assert "transaction_mode" not in codes(explain(keyless))

    def test_jobs_ahead_by_priority_and_age(self) -> None:
        job = make_job(queue="emails", priority=1, run_at=timedelta(seconds=-10))
        make_jobs(3, queue="emails", priority=5)  # higher priority
        make_job(queue="emails", priority=1, run_at=timedelta(seconds=-20))  # older
        make_job(queue="emails", priority=1, run_at=timedelta(seconds=-5))  # younger
        make_job(queue="emails", priority=9, run_at=timedelta(hours=1))  # not due
        make_job(queue="default", priority=9)  # another queue
        ahead = reason(job, "ahead")
        assert ahead.data == {"ahead": 4, "queue": "emails"}
        assert ahead.message.startswith("4 ready job(s) of queue emails come before it")

    def test_the_count_ahead_is_bounded(self) -> None:
        job = make_job(queue="emails", priority=-1)
        make_jobs(AHEAD_LIMIT + 5, queue="emails")
        ahead = reason(job, "ahead")
        assert ahead.data["ahead"] == AHEAD_LIMIT + 1
        assert ahead.message.startswith(f"more than {AHEAD_LIMIT} ready job(s)")


# -- running and finished ----------------------------------------------------------------------


@pytest.mark.django_db
def test_a_running_job_whose_lease_expired_will_be_reaped() -> None:
    job = make_job(
        status="running", attempts=1, locked_until=timedelta(minutes=-2), started_at=timedelta(0)
    )
    set_columns(job, worker_ids='["web-9:99"]')
    query(
        "UPDATE pgjobs_job SET attempted_at = now() - interval '7 min' WHERE id = %s RETURNING id",
        [job],
    )
    running, lease = explain(job)
    assert running.code == "running" and running.data["worker_id"] == "web-9:99"
    assert "not in the registry of live workers" in running.message
    assert lease.code == "lease_expired"
    assert "next reap takes it back" in lease.message and "ago)" in lease.message


@pytest.mark.django_db
def test_a_lease_its_worker_ended_on_stopping() -> None:
    job = make_job(status="running", attempts=1, locked_until=timedelta(minutes=-1))
    query("UPDATE pgjobs_job SET attempted_at = locked_until WHERE id = %s RETURNING id", [job])
    assert "gave it up as it stopped" in explain(job)[1].message


@pytest.mark.django_db
def test_finished_jobs_say_how_they_ended() -> None:
    done = make_job(status="done", attempts=1, finished_at=timedelta(minutes=-3))
    failed = make_job(
        status="failed",
        attempts=2,
        max_attempts=2,
        last_error="Traceback\nValueError: bad invoice 42",
        finished_at=timedelta(minutes=-1),
    )
    cancelled = make_job(status="cancelled", finished_at=timedelta(seconds=-30))
    ((done_code, done_message),) = [(r.code, r.message) for r in explain(done)]
    assert done_code == "done" and "(3 min ago)" in done_message
    (fail,) = explain(failed)
    assert fail.code == "failed" and fail.data["last_error"] == "ValueError: bad invoice 42"
    assert "after 2 of 2 attempt(s): ValueError: bad invoice 42" in fail.message
    assert codes(explain(cancelled)) == ["cancelled"]


@pytest.mark.django_db
def test_a_missing_job_and_bad_input() -> None:
    assert codes(explain(987654321)) == ["gone"]
    with pytest.raises(TypeError, match="a Job or a job id"):
        explain("12")  # type: ignore[arg-type]


# -- the explanation and the real claim agree --------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_held_lock_key_holds_the_job_until_its_holder_ends() -> None:
    beat("web-1:1:a", {"keys": None}, None)
    first = Job.objects.enqueue(NOOP, queue="keys", lock_key="customer:7", priority=1).id
    second = Job.objects.enqueue(NOOP, queue="keys", lock_key="customer:7").id
    (holder,) = Job.objects.claim("keys", limit=1, guarded=True)
    assert holder.id == first
    held = reason(second, "lock_key")
    assert held.data == {"lock_key": "customer:7", "holder": first}
    assert f"job {first} holds it" in held.message
    assert Job.objects.claim("keys", limit=10, guarded=True) == []
    Job.objects.complete(holder)
    assert codes(explain(second)) == ["next"]
    assert [job.id for job in Job.objects.claim("keys", limit=10, guarded=True)] == [second]


@pytest.mark.django_db(transaction=True)
def test_a_pause_and_a_concurrency_limit_hold_the_job_as_the_claim_does() -> None:
    beat("web-1:1:a", {"steered": None}, None)
    Job.objects.set_limits("steered", concurrency=1)
    ids = [Job.objects.enqueue(NOOP, queue="steered").id for _ in range(2)]
    assert Job.objects.claim("steered", limit=10) == []  # the plain claim leaves a limited queue
    (started,) = Job.objects.claim("steered", limit=10, guarded=True)
    (waiting,) = set(ids) - {started.id}
    assert codes(explain(waiting)) == ["concurrency", "ahead"]
    assert Job.objects.claim("steered", limit=10, guarded=True) == []
    Job.objects.pause("steered")
    Job.objects.complete(started)
    assert codes(explain(waiting)) == ["paused", "ahead"]
    assert Job.objects.claim("steered", limit=10, guarded=True) == []
    Job.objects.resume("steered")
    assert codes(explain(waiting)) == ["next"]
    assert [job.id for job in Job.objects.claim("steered", limit=10, guarded=True)] == [waiting]


@pytest.mark.django_db(transaction=True)
def test_a_full_rate_window_says_when_room_comes() -> None:
    beat("web-1:1:a", {"rated": None}, None)
    Job.objects.set_limits("rated", rate=(2, timedelta(hours=1)))
    ids = [Job.objects.enqueue(NOOP, queue="rated").id for _ in range(3)]
    claimed = Job.objects.claim("rated", limit=10, guarded=True)
    assert len(claimed) == 2
    (waiting,) = set(ids) - {job.id for job in claimed}
    rate = reason(waiting, "rate")
    first_start = min(scalar("SELECT starts FROM pgjobs_queue WHERE name = 'rated'"))
    assert rate.data == {
        "queue": "rated",
        "started": 2,
        "rate_count": 2,
        "rate_period": 3600.0,
        "free_at": first_start + timedelta(hours=1),
    }
    assert "2 started in the last 3600 s, of 2 allowed" in rate.message
    assert Job.objects.claim("rated", limit=10, guarded=True) == []
    Job.objects.set_limits("rated")
    assert codes(explain(waiting)) == ["next"]
    assert [job.id for job in Job.objects.claim("rated", limit=10, guarded=True)] == [waiting]


@pytest.mark.django_db(transaction=True)
def test_a_job_running_on_a_real_worker(workers: Workers) -> None:
    from testproject.shop.models import Order

    worker = workers.start("--queue", "slow", "--concurrency", "1", test_jobs=True)
    job = Job.objects.enqueue(UNTIL_ORDER, {"email": "explain@example.com"}, queue="slow").id
    wait_until(lambda: job_row(job)["status"] == "running", message="the job to start")
    running, lease = explain(job)
    assert running.code == "running" and lease.code == "lease"
    assert running.data["worker_id"] == f"{socket.gethostname()}:{worker.pid}"
    assert (running.data["host"], running.data["pid"]) == (socket.gethostname(), worker.pid)
    assert running.data["heartbeat_at"] is not None
    assert f"pid {worker.pid}" in running.message and "its latest beat at" in running.message
    assert utc(job_row(job)["locked_until"]) in lease.message
    Order.objects.create(email="explain@example.com", total_cents=1)
    wait_until(lambda: job_row(job)["status"] == "done", message="the job to finish")
    assert codes(explain(job)) == ["done"]


# -- the admin's job page ----------------------------------------------------------------------


def change_url(job_id: int) -> str:
    return reverse("admin:django_pgjobs_job_change", args=[job_id])


def box(page: str) -> str:
    start = page.index('id="pgjobs-explanation"')
    return page[start : page.index("</fieldset>", start)]


class AdminExplanationTests(TestCase):
    def setUp(self) -> None:
        self.client = client_for(make_user("viewer", "view_job", "view_failedjob"))

    def test_a_queued_jobs_page_explains_why_it_waits(self) -> None:
        job = make_job(queue="emails", last_error="<b>boom</b>", attempts=1, run_at=timedelta(1))
        Job.objects.pause("emails")
        page = self.client.get(change_url(job)).content.decode()
        explained = box(page)
        assert "Why isn't this job running?" in text(explained)
        assert 'data-code="retry"' in explained and 'data-code="paused"' in explained
        assert 'data-code="no_worker"' in explained
        assert "&lt;b&gt;boom&lt;/b&gt;" in explained and "<b>boom" not in explained
        assert "Its queue emails is paused" in text(explained)

    def test_everything_in_the_box_is_escaped(self) -> None:
        key = "<script>alert(1)</script>"
        holder = make_job(status="running", attempts=1, locked_until=timedelta(minutes=5))
        waiting = make_job(task="app.<i>tasks</i>.send")
        set_columns(holder, lock_key=key)
        set_columns(waiting, lock_key=key)
        beat("web-1:1:a", {"default": None}, [NOOP])
        explained = box(self.client.get(change_url(waiting)).content.decode())
        assert 'data-code="lock_key"' in explained and 'data-code="unknown_task"' in explained
        assert "<script>" not in explained and "<i>" not in explained
        assert f"Waiting for its lock key {key!r}: job {holder} holds it" in text(explained)
        assert "app.<i>tasks</i>.send registered" in text(explained)

    def test_the_box_reads_the_database_when_the_page_is_viewed(self) -> None:
        job = make_job(queue="emails")
        assert 'data-code="no_worker"' in box(self.client.get(change_url(job)).content.decode())
        beat("web-1:1:a", {"emails": None}, None)
        explained = box(self.client.get(change_url(job)).content.decode())
        assert 'data-code="next"' in explained and "no_worker" not in explained

    def test_running_and_failed_jobs_have_their_own_heading(self) -> None:
        running = make_job(status="running", attempts=1, locked_until=timedelta(minutes=5))
        page = self.client.get(change_url(running)).content.decode()
        assert "What is this job doing?" in text(box(page))
        failed = make_job(status="failed", attempts=5, last_error="x", finished_at=timedelta(0))
        failed_url = reverse("admin:django_pgjobs_failedjob_change", args=[failed])
        explained = box(self.client.get(failed_url).content.decode())
        assert "How this job ended" in text(explained) and 'data-code="failed"' in explained

    def test_a_superuser_sees_the_same(self) -> None:
        root = User.objects.create_superuser("root", password="pw")
        page = client_for(root).get(change_url(make_job(run_at=timedelta(hours=1))))
        assert 'data-code="scheduled"' in box(page.content.decode())


# -- cost: the statement reads indexes, not the history ----------------------------------------


@pytest.mark.django_db
def test_the_statement_reads_partial_indexes_on_a_big_table() -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO pgjobs_job (queue, task, payload, status, attempts, run_at, finished_at) "
            "SELECT 'emails', %s, '{}', 'done', 1, now() - n * interval '1 s', "
            "now() - n * interval '1 s' FROM generate_series(1, 100000) AS n",
            [NOOP],
        )
    beat("web-1:1:a", {"emails": None}, None)
    Job.objects.set_limits("emails", concurrency=5, rate=(10, 60))
    queued = make_job(queue="emails", priority=-3)
    set_columns(queued, lock_key="k")
    make_jobs(50, queue="emails")
    running = make_job(queue="emails", status="running", attempts=1, locked_until=timedelta(1))
    done = int(scalar("SELECT min(id) FROM pgjobs_job"))
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE pgjobs_job")
    for job in (queued, running, done):
        indexes = assert_no_table_scan(
            explaining.EXPLAIN_JOB, {"id": job, "ahead_limit": AHEAD_LIMIT + 1}
        )
        assert {"pgjobs_job_pkey", "pgjobs_job_ready_idx", "pgjobs_job_lock_idx"} <= indexes


@pytest.mark.django_db
def test_a_running_row_without_a_lease_is_never_reaped() -> None:
    job = make_job(status="running", attempts=1)
    assert codes(explain(job)) == ["running", "no_lease"]
