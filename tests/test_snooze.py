"""Snooze: ``raise Snooze(delay)`` (or ``current_job().snooze(delay)``) puts a job back to
``queued`` ``delay`` later without spending an attempt, counted in ``snoozes``; fenced like
every write after the claim. Through real workers in lease and transaction mode, and through
``Job.objects.snooze()``.
"""

from __future__ import annotations

import signal
from datetime import timedelta

import pytest

from django_pgjobs import Snooze, current_job
from django_pgjobs.core.context import JobContext, reset_current_job, set_current_job
from django_pgjobs.exceptions import InvalidJobOptions
from django_pgjobs.models import Job
from testproject.shop.models import Order
from tests.helpers import db_now, make_jobs, query
from tests.retry_jobs import order_then_snooze, snooze_once, snooze_times
from tests.workers import Workers, wait_done

pytestmark = pytest.mark.django_db(transaction=True)

COLUMNS = ("status", "attempts", "max_attempts", "snoozes", "run_at", "locked_until", "started_at")


def row(job_id: int) -> dict[str, object]:
    (values,) = query(
        f"SELECT {', '.join(COLUMNS)}, attempted_at, jsonb_array_length(worker_ids) "
        "FROM pgjobs_job WHERE id = %s",
        [job_id],
    )
    return dict(zip((*COLUMNS, "attempted_at", "workers"), values, strict=True))


def make_due(job_id: int) -> None:
    query("UPDATE pgjobs_job SET run_at = now() WHERE id = %s RETURNING id", [job_id])


def test_snooze_validates_its_delay() -> None:
    assert Snooze(30).seconds == 30.0
    assert Snooze(timedelta(minutes=2)).seconds == 120.0
    for bad in (-1, "30", None, True, float("inf"), timedelta(days=36_501)):
        with pytest.raises(InvalidJobOptions, match="snooze"):
            Snooze(bad)  # type: ignore[arg-type]


def test_the_context_method_raises_snooze() -> None:
    ctx = JobContext(id=1, task="t", queue="default", attempts=1, max_attempts=5, payload={})
    token = set_current_job(ctx)
    try:
        job = current_job()
        assert job is not None
        with pytest.raises(Snooze) as raised:
            job.snooze(timedelta(seconds=45))
    finally:
        reset_current_job(token)
    assert raised.value.seconds == 45.0


def test_a_job_snoozes_once_then_completes_without_spending_an_attempt(workers: Workers) -> None:
    job_id = Job.objects.enqueue(snooze_once, {"seconds": 3600}).id

    first = workers.burst(test_jobs=True)
    after = db_now()

    # Between the runs: queued an hour after the snooze (db clock), the attempt given back.
    between = row(job_id)
    assert (between["status"], between["attempts"], between["snoozes"]) == ("queued", 0, 1)
    assert (between["locked_until"], between["attempted_at"]) == (None, None)
    assert between["started_at"] is not None  # it did run
    delay = timedelta(hours=1)
    assert between["started_at"] + delay <= between["run_at"] <= after + delay
    assert (
        "ran 1 jobs: 0 done, 0 to retry, 0 failed, 0 lost, 0 cancelled, 1 snoozed" in first.output()
    )
    assert f"job {job_id} tests.retry_jobs.snooze_once attempt 1/5 snoozed" in first.log()

    make_due(job_id)
    workers.burst(test_jobs=True)

    done = row(job_id)
    assert (done["status"], done["attempts"], done["max_attempts"], done["snoozes"]) == (
        "done",
        1,
        5,
        1,
    )
    assert done["started_at"] == between["started_at"]  # the first run's start is kept
    assert done["workers"] == 2  # both runs, each on a worker


def test_a_job_snoozing_more_often_than_its_max_attempts_is_never_failed(
    workers: Workers,
) -> None:
    # max_attempts=2; it snoozes 5 times (at once each time), then completes.
    job_id = Job.objects.enqueue(snooze_times, {"times": 5}).id
    worker = workers.start(test_jobs=True)
    values = wait_done(job_id)
    worker.send(signal.SIGTERM)
    assert worker.wait() == 0, worker.tail()
    assert "0 failed, 0 lost, 0 cancelled, 5 snoozed" in worker.output()
    final = row(job_id)
    assert (final["attempts"], final["max_attempts"], final["snoozes"]) == (1, 2, 5)
    assert values["last_error"] is None


def test_transaction_mode_snooze_rolls_back_the_jobs_writes(workers: Workers) -> None:
    job_id = Job.objects.enqueue(order_then_snooze, {"email": "later@example.com"}).id

    first = workers.burst("--mode", "transaction", test_jobs=True)

    between = row(job_id)
    assert (between["status"], between["attempts"], between["snoozes"]) == ("queued", 0, 1)
    assert not Order.objects.filter(email="later@example.com").exists()
    assert "1 snoozed" in first.output()

    make_due(job_id)
    workers.burst("--mode", "transaction", test_jobs=True)

    assert (row(job_id)["status"], row(job_id)["attempts"], row(job_id)["snoozes"]) == (
        "done",
        1,
        1,
    )
    assert Order.objects.filter(email="later@example.com").count() == 1


def test_manager_snooze_is_fenced_on_the_claim() -> None:
    (job_id,) = make_jobs(1)
    (claimed,) = Job.objects.claim()
    before = db_now()
    assert Job.objects.snooze(claimed, timedelta(seconds=90)) is True
    after = db_now()
    values = row(job_id)
    assert (values["status"], values["attempts"], values["snoozes"]) == ("queued", 0, 1)
    assert before + timedelta(seconds=90) <= values["run_at"] <= after + timedelta(seconds=90)

    # The same claim again: it is no longer ours, nothing changes.
    assert Job.objects.snooze(claimed, 1) is False
    assert row(job_id) == values


def test_a_snooze_for_a_claim_that_is_no_longer_ours_changes_nothing() -> None:
    (job_id,) = make_jobs(1)
    (stale,) = Job.objects.claim()
    # The reaper took it back and another worker claimed it again (attempt 2).
    query(
        "UPDATE pgjobs_job SET status = 'queued', locked_until = NULL WHERE id = %s RETURNING id",
        [job_id],
    )
    (fresh,) = Job.objects.claim()
    assert fresh.attempts == 2
    before = row(job_id)

    assert Job.objects.snooze(stale, 60) is False
    assert Job.objects.snooze(job_id, 60, 1) is False  # the id form, stale attempts
    assert row(job_id) == before

    assert Job.objects.snooze(fresh, 60) is True
    assert row(job_id)["snoozes"] == 1


def test_manager_snooze_refuses_a_bad_delay_before_writing() -> None:
    (job_id,) = make_jobs(1)
    (claimed,) = Job.objects.claim()
    for bad in (-5, "soon", None):
        with pytest.raises(InvalidJobOptions, match="snooze delay"):
            Job.objects.snooze(claimed, bad)  # type: ignore[arg-type]
    assert row(job_id)["status"] == "running"
