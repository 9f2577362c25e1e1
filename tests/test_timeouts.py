"""Timeouts: a job past its timeout is failed with ``JobTimeout`` and no longer heartbeated,
its stuck executor is replaced (a thread cannot be killed), and a worker with too many stuck
executors exits non-zero for its supervisor to restart. In transaction mode the timeout is
checked when the job returns."""

from __future__ import annotations

import signal

import pytest

from django_pgjobs.models import Job
from django_pgjobs.worker.stuck import EXIT_STUCK
from testproject.shop.models import Order
from tests.helpers import job_row, wait_until
from tests.workers import (
    Workers,
    query,
    running,
    scalar,
    stuck_until_order,
    stuck_until_order_started,
    stuck_with_an_exiting_backoff,
    until_order,
    write_order,
)

pytestmark = pytest.mark.django_db(transaction=True)

TIMED_OUT = "django_pgjobs.exceptions.JobTimeout: job {} ({}) ran past its timeout of 1 s"


def ordered(email: str) -> bool:
    return Order.objects.filter(email=email).exists()


def latest_error(job_id: int) -> tuple[str, str]:
    """The class and the last line of the job's latest recorded error."""
    (row,) = query(
        "SELECT errors -> -1 ->> 'exception_class_path', last_error FROM pgjobs_job WHERE id = %s",
        [job_id],
    )
    return row[0], row[1].strip().splitlines()[-1]


def test_a_job_past_its_timeout_is_failed_and_the_jobs_behind_it_run(workers: Workers) -> None:
    task = "tests.workers.stuck_until_order"
    stuck = Job.objects.enqueue(stuck_until_order, {"email": "stuck"}, timeout=1).id
    # One executor: whatever runs next runs on the replacement. A 3 s lease (a heartbeat a
    # second): a busy machine's late heartbeat must not let the worker's own reaper win.
    worker = workers.start(
        "--concurrency", "1", "--lease", "3", "--reap-interval", "0.5", test_jobs=True
    )

    # The attempt is failed (max_attempts=1: for good) and the job saw current_job().timed_out.
    wait_until(lambda: job_row(stuck)["status"] == "failed", message="the timeout to fail it")
    assert latest_error(stuck) == (
        "django_pgjobs.exceptions.JobTimeout",
        TIMED_OUT.format(stuck, task),
    )
    assert job_row(stuck)["locked_until"] is None
    wait_until(lambda: ordered("timed-out:stuck"), message="the job to see timed_out")

    # A job with no timeout runs behind it while it is still stuck, and is heartbeated past
    # its lease as before.
    behind = until_order.enqueue(email="behind").id
    wait_until(
        lambda: scalar(
            "SELECT status = 'running' AND now() > started_at + interval '4 s' "
            "AND locked_until > now() FROM pgjobs_job WHERE id = %s",
            [behind],
        ),
        message="the job behind to outlive its first lease",
    )
    assert not ordered("stuck")
    Order.objects.create(email="behind", total_cents=1)
    wait_until(lambda: job_row(behind)["status"] == "done", message="the job behind to finish")

    # All that time the stuck job's lease was not extended: a heartbeat would have met the
    # fence its failure closed and said so.
    log = worker.log()
    assert f"extend_lease of job {stuck}" not in log
    assert "ran past its timeout of 1 s: failing it" in log

    # Released at last, the stuck function returns: nothing is recorded over its failure.
    Order.objects.create(email="stuck", total_cents=1)
    worker.wait_for_log("returned after its timeout; outcome not recorded")
    row = job_row(stuck)
    assert (row["status"], row["attempts"]) == ("failed", 1)
    worker.send(signal.SIGTERM)
    assert worker.wait() == 0, worker.tail()
    assert "ran 2 jobs: 1 done, 0 to retry, 1 failed" in worker.output()
    assert "1 executors abandoned" in worker.output()


def test_more_stuck_executors_than_allowed_make_the_worker_exit_non_zero(
    workers: Workers,
) -> None:
    ids = Job.objects.enqueue_many(
        stuck_until_order, [{"email": "one"}, {"email": "two"}], timeout=1
    )
    worker = workers.start(
        "--concurrency", "1", "--lease", "1.5", "--max-stuck-executors", "1", test_jobs=True
    )

    assert worker.wait() == EXIT_STUCK, worker.tail()
    log = worker.log()
    assert "ERROR" in log
    assert "has 2 executor threads stuck in jobs that ran past their timeout" in log
    assert "(2 still stuck)" in log
    # Both attempts were failed before it left; nothing it held is left running.
    for job_id in ids:
        assert job_row(job_id)["status"] == "failed"
        assert latest_error(job_id)[0] == "django_pgjobs.exceptions.JobTimeout"
    assert running() == 0
    assert "2 executors abandoned" in worker.output()


def test_transaction_mode_fails_a_job_that_returns_past_its_timeout(workers: Workers) -> None:
    job_id = Job.objects.enqueue(
        write_order, {"email": "slow", "pause": 1.5}, timeout=1, max_attempts=1
    ).id
    workers.burst("--mode", "transaction", test_jobs=True)

    row = job_row(job_id)
    assert (row["status"], row["attempts"]) == ("failed", 1)
    assert latest_error(job_id) == (
        "django_pgjobs.exceptions.JobTimeout",
        TIMED_OUT.format(job_id, "tests.workers.write_order"),
    )
    # What it wrote before its late return was rolled back with its attempt.
    assert not ordered("slow")


def test_a_cancelled_job_that_hangs_past_its_timeout_still_frees_its_slot(
    workers: Workers,
) -> None:
    hung = Job.objects.enqueue(stuck_until_order, {"email": "hung"}, timeout=4).id
    worker = workers.start("--concurrency", "1", "--lease", "1.5", test_jobs=True)
    wait_until(lambda: job_row(hung)["status"] == "running", message="the job to start")
    assert Job.objects.cancel(hung) == 1
    # It ignores the cancel and hangs: past its timeout its executor is abandoned and
    # replaced all the same, so the job behind it runs on the one slot.
    behind = write_order.enqueue(email="behind").id
    wait_until(lambda: job_row(behind)["status"] == "done", message="the job behind to run")
    assert job_row(hung)["status"] == "cancelled"
    worker.send(signal.SIGTERM)
    assert worker.wait() == 0, worker.tail()
    assert "1 executors abandoned" in worker.output()


def test_a_shutdown_does_not_wait_for_a_job_that_times_out_during_it(workers: Workers) -> None:
    job_id = Job.objects.enqueue(stuck_until_order, {"email": "late"}, timeout=3).id
    worker = workers.start("--lease", "5", "--shutdown-timeout", "600", test_jobs=True)
    # The function itself runs, not only its claim: a stop while the claim is on its way
    # back gives the job back unstarted, with no timeout to fail it.
    wait_until(lambda: stuck_until_order_started("late"), message="the job to start")
    assert job_row(job_id)["status"] == "running"
    worker.send(signal.SIGTERM)
    worker.wait_for_log("SIGTERM: stopping")
    # Its timeout ends the wait, not the 600 s shutdown timeout; nothing is left running.
    assert worker.wait() == 0, worker.tail()
    assert latest_error(job_id)[0] == "django_pgjobs.exceptions.JobTimeout"
    assert "still running after" not in worker.log()
    assert "(1 still stuck)" in worker.log()


def state(job_id: int) -> tuple[str, int]:
    """The job's status and attempts, from one read of its row (a status read before a claim
    beside attempts read after it would look like a failed attempt already written)."""
    row = job_row(job_id)
    return row["status"], row["attempts"]


def test_a_backoff_that_raises_system_exit_does_not_stop_the_completer(workers: Workers) -> None:
    stuck = Job.objects.enqueue(stuck_with_an_exiting_backoff, {"email": "stuck"}, timeout=1).id
    worker = workers.start("--concurrency", "1", "--lease", "5", test_jobs=True)
    # The timeout's failure is written, retried on the default schedule (the callable's
    # SystemExit logged), and the worker goes on running jobs.
    wait_until(lambda: state(stuck) == ("queued", 1), message="the timeout to fail it")
    assert latest_error(stuck)[0] == "django_pgjobs.exceptions.JobTimeout"
    behind = write_order.enqueue(email="behind").id
    wait_until(lambda: job_row(behind)["status"] == "done", message="the job behind to run")
    assert "retrying on the default schedule" in worker.log()
    Order.objects.create(email="stuck", total_cents=1)
    worker.send(signal.SIGTERM)
    assert worker.wait() == 0, worker.tail()
