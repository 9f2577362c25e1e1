"""django.tasks tasks run by real ``manage.py runjobs`` processes, on the same table, claim,
retries and reaper as ``@job`` functions; their results read back with ``get_result``."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from django_pgjobs.exceptions import InvalidResult, LeaseExpired
from django_pgjobs.models import Job
from testproject.shop.models import Order
from testproject.shop.tasks import double, order_total, returns_a_set, which_attempt
from tests.helpers import wait_until
from tests.workers import Process, Workers, query, scalar

try:  # Django 6.0+
    from django.tasks import TaskResult, TaskResultStatus
except ImportError:  # the django-tasks backport
    from django_tasks import TaskResult, TaskResultStatus

pytestmark = [pytest.mark.tasks, pytest.mark.django_db(transaction=True)]

READY, RUNNING = TaskResultStatus.READY, TaskResultStatus.RUNNING
SUCCESSFUL, FAILED = TaskResultStatus.SUCCESSFUL, TaskResultStatus.FAILED


def worker_id(process: Process) -> str:
    """What a worker process records in ``worker_ids``: ``host:pid``."""
    return f"{socket.gethostname()}:{process.pid}"


def last_line(traceback: str) -> str:
    return traceback.strip().splitlines()[-1]


def column(result: TaskResult[Any, Any], expression: str) -> Any:
    """One SQL expression over the task's row (e.g. how far run_at is from now())."""
    return scalar(f"SELECT {expression} FROM pgjobs_job WHERE id = %s", [int(result.id)])


def seconds(result: TaskResult[Any, Any], expression: str) -> float:
    return float(column(result, f"extract(epoch FROM {expression})"))


def burst(workers: Workers, jobs: int, *args: str) -> Process:
    """A burst run that claims ``jobs`` jobs at most. The backend's backoff is 2 s after a
    first failure: on a busy machine a plain burst can still be running then and claim the
    retry too (it did: "ran 3 jobs" instead of 2)."""
    return workers.burst("--max-jobs", str(jobs), *args)


def make_due(*results: TaskResult[Any, Any]) -> None:
    """Skip the backoff: the retry is due now."""
    query("UPDATE pgjobs_job SET run_at = now() WHERE id = ANY(%s)", [[int(r.id) for r in results]])


def test_a_task_runs_in_the_worker_and_its_result_is_read_back(workers: Workers) -> None:
    order = Order.objects.create(email="buyer@example.com", total_cents=4200)
    enqueued = order_total.enqueue(order.pk)
    elsewhere = order_total.using(queue_name="reports").enqueue(order.pk)

    worker = workers.burst()

    assert "ran 1 jobs: 1 done, 0 to retry, 0 failed" in worker.output()
    result = order_total.get_result(enqueued.id)
    assert result.status == SUCCESSFUL
    assert result.return_value == {"order": order.pk, "total_cents": 4200}
    assert result.started_at is not None and result.last_attempted_at is not None
    assert result.finished_at is not None and result.enqueued_at is not None
    assert result.enqueued_at <= result.started_at <= result.finished_at
    assert result.started_at == result.last_attempted_at  # one attempt
    assert result.worker_ids == [worker_id(worker)]
    assert (result.attempts, result.errors) == (1, [])
    assert column(enqueued, "attempts") == 1
    # The result the caller kept catches up with refresh().
    assert enqueued.status == READY
    enqueued.refresh()
    assert (enqueued.status, enqueued.return_value) == (SUCCESSFUL, result.return_value)
    # The worker serves its queues only (default): the reports task waits.
    assert order_total.get_result(elsewhere.id).status == READY


def test_a_failing_task_is_ready_between_attempts_then_succeeds_or_fails(
    workers: Workers,
) -> None:
    recovers = which_attempt.enqueue(fail_until=2)
    gives_up = which_attempt.enqueue(fail_until=5)

    first = burst(workers, 2)

    assert "ran 2 jobs: 0 done, 2 to retry, 0 failed" in first.output()
    for enqueued in (recovers, gives_up):
        result = which_attempt.get_result(enqueued.id)
        assert result.status == READY
        assert (result.attempts, result.worker_ids) == (1, [worker_id(first)])
        assert result.finished_at is None
        (error,) = result.errors
        assert error.exception_class_path == "builtins.RuntimeError"
        assert error.exception_class is RuntimeError
        assert error.traceback.startswith("Traceback (most recent call last):")
        assert last_line(error.traceback) == "RuntimeError: attempt 1 fails on purpose"
        with pytest.raises(ValueError, match="not finished"):
            result.return_value  # noqa: B018 - the property raises
        # OPTIONS["BACKOFF_BASE"] 1 s: due 1 * 2^1 s after the failure (PGJOBS' would be
        # 20 s), which came after the attempt began and before now.
        assert seconds(enqueued, "run_at - attempted_at") >= 2.0
        assert seconds(enqueued, "run_at - now()") <= 2.0

    make_due(recovers, gives_up)
    second = burst(workers, 2)

    assert "ran 2 jobs: 0 done, 2 to retry, 0 failed" in second.output()
    for enqueued in (recovers, gives_up):
        result = which_attempt.get_result(enqueued.id)
        assert result.status == READY
        assert result.worker_ids == [worker_id(first), worker_id(second)]
        assert [last_line(e.traceback) for e in result.errors] == [
            "RuntimeError: attempt 1 fails on purpose",
            "RuntimeError: attempt 2 fails on purpose",
        ]
        # 1 * 2^2 s after the second failure.
        assert seconds(enqueued, "run_at - attempted_at") >= 4.0
        assert seconds(enqueued, "run_at - now()") <= 4.0

    make_due(recovers, gives_up)
    third = workers.burst()

    assert "ran 2 jobs: 1 done, 0 to retry, 1 failed" in third.output()
    ids = [worker_id(first), worker_id(second), worker_id(third)]
    assert len(set(ids)) == 3

    succeeded = which_attempt.get_result(recovers.id)
    assert succeeded.status == SUCCESSFUL
    # takes_context: the TaskContext's attempt is the attempt number.
    assert succeeded.return_value == 3
    assert (succeeded.attempts, succeeded.worker_ids) == (3, ids)
    assert len(succeeded.errors) == 2
    assert succeeded.finished_at is not None

    failed = which_attempt.get_result(gives_up.id)
    assert failed.status == FAILED
    assert (failed.attempts, failed.worker_ids) == (3, ids)
    assert [last_line(e.traceback) for e in failed.errors] == [
        f"RuntimeError: attempt {n} fails on purpose" for n in (1, 2, 3)
    ]
    assert failed.finished_at is not None
    assert last_line(column(gives_up, "last_error")) == "RuntimeError: attempt 3 fails on purpose"
    with pytest.raises(ValueError, match="failed"):
        failed.return_value  # noqa: B018 - the property raises

    # Finished: nothing left to run.
    query("UPDATE pgjobs_job SET run_at = now()")
    assert "ran 0 jobs" in workers.burst().output()


def test_a_non_json_result_fails_the_attempt_and_the_worker_runs_the_next_tasks(
    workers: Workers,
) -> None:
    bad = returns_a_set.enqueue()
    doubled = double.enqueue(21)
    context = which_attempt.enqueue()

    # One executor: the tasks after the bad one run on the same thread, after it.
    worker = burst(workers, 3, "--concurrency", "1")

    assert "ran 3 jobs: 2 done, 1 to retry, 0 failed" in worker.output()
    failed = returns_a_set.get_result(bad.id)
    assert failed.status == READY  # retried like any failure
    (error,) = failed.errors
    assert error.exception_class_path == "django_pgjobs.exceptions.InvalidResult"
    assert error.exception_class is InvalidResult
    assert last_line(error.traceback).startswith(
        "django_pgjobs.exceptions.InvalidResult: the return value is a set ({1, 2, 3})"
    )
    assert "JSON cannot hold" in column(bad, "last_error")
    assert column(bad, "result") is None

    # An async task, run by the same worker.
    assert double.get_result(doubled.id).return_value == 42
    # A takes_context task, on its first attempt.
    assert which_attempt.get_result(context.id).return_value == 1
    assert {
        r.worker_ids[0]
        for r in (failed, double.get_result(doubled.id), which_attempt.get_result(context.id))
    } == {worker_id(worker)}
    # The bad task ran first; the others after it.
    assert column(bad, "attempted_at") < min(
        column(doubled, "attempted_at"), column(context, "attempted_at")
    )


def test_transaction_mode_runs_tasks_and_records_their_failures(workers: Workers) -> None:
    doubled = double.enqueue(4)
    retries = which_attempt.enqueue(fail_until=1)

    worker = burst(workers, 2, "--mode", "transaction")

    assert "ran 2 jobs: 1 done, 1 to retry, 0 failed" in worker.output()
    result = double.get_result(doubled.id)
    assert (result.status, result.return_value, result.worker_ids) == (
        SUCCESSFUL,
        8,
        [worker_id(worker)],
    )
    retried = which_attempt.get_result(retries.id)
    assert retried.status == READY
    assert [e.exception_class_path for e in retried.errors] == ["builtins.RuntimeError"]
    assert retried.worker_ids == [worker_id(worker)]


def test_a_task_whose_lease_expired_lists_lease_expired_after_reapjobs(
    workers: Workers,
) -> None:
    enqueued = double.enqueue(21)
    # A worker claims it with a short lease, then vanishes without a word.
    (claimed,) = Job.objects.claim("default", limit=1, lease=0.2, worker_id="gone:1")
    assert claimed.id == int(enqueued.id)
    running = double.get_result(enqueued.id)
    assert (running.status, running.worker_ids, running.errors) == (RUNNING, ["gone:1"], [])
    wait_until(lambda: column(enqueued, "locked_until < now()"), message="the lease to expire")

    reaper = workers.run("reapjobs")

    assert f"  job {enqueued.id}: queued after 1 attempts" in reaper.output()
    reaped = double.get_result(enqueued.id)
    assert reaped.status == READY
    assert [(e.exception_class_path, e.traceback) for e in reaped.errors] == [
        ("django_pgjobs.exceptions.LeaseExpired", "lease expired")
    ]
    assert reaped.errors[0].exception_class is LeaseExpired
    assert reaped.attempts == 1

    # Its next attempt runs; the lost one stays on record.
    worker = workers.burst()

    done = double.get_result(enqueued.id)
    assert (done.status, done.return_value) == (SUCCESSFUL, 42)
    assert done.worker_ids == ["gone:1", worker_id(worker)]
    assert [e.exception_class_path for e in done.errors] == [
        "django_pgjobs.exceptions.LeaseExpired"
    ]
