"""The ``job_*`` signals for ``@job`` functions, and the log line of a job's error.

``job_enqueued`` is sent in the enqueuing process (this one), once the enqueue commits.
``job_started`` and ``job_finished`` are sent by real worker processes: their receivers come
from ``tests.signal_receivers`` (every worker with ``test_jobs=True`` imports it), which write
what they received to a file the test reads back. Every outcome is provoked for real: a
failing job, a retry, a snooze, a timeout, a cancel while running, a lease taken away.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
from django.db import transaction

from django_pgjobs.models import Job
from django_pgjobs.signals import job_enqueued
from testproject.shop.tasks import order_total
from testproject.testjobs import boom, hangs, long_running, noop, rate_limited
from tests.helpers import job_row, wait_until
from tests.signal_receivers import LOG_RECORDS, RAISE, SIGNALS, read
from tests.workers import Process, Workers, fails_first, query, until_cancelled, write_order

pytestmark = pytest.mark.django_db(transaction=True)


def status(job_id: int) -> str:
    return str(job_row(job_id)["status"])


def received(path: Path, job_id: int, name: str = "job_finished") -> list[dict[str, Any]]:
    return [line for line in read(path) if line["signal"] == name and line["job_id"] == job_id]


def outcomes(path: Path, job_id: int) -> list[tuple[str, int, str | None]]:
    """(outcome, attempt, error class) of each ``job_finished`` of the job, in order."""
    return [(ln["outcome"], ln["attempt"], ln["error"]) for ln in received(path, job_id)]


def wait_for_outcome(path: Path, job_id: int, outcome: str) -> None:
    wait_until(
        lambda: outcome in [ln["outcome"] for ln in received(path, job_id)],
        message=f"job_finished({outcome}) for job {job_id}",
    )


def stop(worker: Process) -> None:
    worker.send(signal.SIGTERM)
    assert worker.wait() == 0, worker.tail()


# -- job_enqueued -----------------------------------------------------------------------------


def test_job_enqueued_is_sent_once_the_enqueue_commits_and_only_for_new_jobs() -> None:
    seen: list[tuple[Any, int, str, str]] = []

    def receiver(sender: Any, job: Job, **named: Any) -> None:
        seen.append((sender, job.id, job.task, job.status))

    job_enqueued.connect(receiver)
    try:
        with transaction.atomic():
            first = noop.enqueue(n=1)
            assert seen == []  # not before the commit: a worker could not see it yet
        assert seen == [(Job, first.id, first.task, "queued")]

        with pytest.raises(RuntimeError), transaction.atomic():
            Job.objects.enqueue(noop, {"rolled_back": True})
            raise RuntimeError("roll it back")
        # In autocommit the enqueue is its own transaction: sent at once.
        second = Job.objects.enqueue(noop, {"n": 3})
        held = Job.objects.enqueue(noop, {"n": 4}, unique_key="k")
        again = Job.objects.enqueue(noop, {"n": 5}, unique_key="k")
        assert again.created is False and again.id == held.id
        assert [job_id for _, job_id, _, _ in seen] == [first.id, second.id, held.id]

        # enqueue_many: once per job it created, a key another job holds creates none.
        del seen[:]
        many = Job.objects.enqueue_many(noop, [{"n": i} for i in range(3)])
        keyed = Job.objects.enqueue_many(
            noop,
            [{"n": 1}, {"n": 2}, {"n": 3}],
            unique_key=lambda payload: "k" if payload["n"] == 1 else f"m{payload['n']}",
        )
        assert keyed.created == [False, True, True]
        assert [job_id for _, job_id, _, _ in seen] == [*many, *keyed[1:]]
        assert {sender for sender, *_ in seen} == {Job}

        # A django.tasks task sends Django's task_enqueued, not job_enqueued.
        del seen[:]
        result = order_total.enqueue(1)
        assert Job.objects.filter(id=int(result.id)).exists()
        assert seen == []
    finally:
        job_enqueued.disconnect(receiver)
    assert query("SELECT count(*) FROM pgjobs_job WHERE payload ? 'rolled_back'") == [(0,)]


# -- job_started and job_finished, from real workers ------------------------------------------


def test_a_raising_job_enqueued_receiver_never_reaches_the_caller(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # After the commit the jobs are in the table: an error here must not make the caller
    # enqueue them again, nor stop Django's later on_commit hooks.
    def receiver(**named: Any) -> None:
        raise RuntimeError("the receiver's own bug")

    later: list[str] = []
    job_enqueued.connect(receiver)
    try:
        ids = Job.objects.enqueue_many(noop, [{"n": 1}, {"n": 2}])
        with transaction.atomic():
            single = Job.objects.enqueue(noop, {"n": 3}).id
            transaction.on_commit(lambda: later.append("ran"))
    finally:
        job_enqueued.disconnect(receiver)
    assert sorted(i for (i,) in query("SELECT id FROM pgjobs_job")) == [*ids, single]
    assert later == ["ran"]
    assert "the receiver's own bug" in caplog.text


@pytest.mark.parametrize("mode", ["lease", "transaction"])
def test_started_and_finished_for_done_retry_failed_and_snoozed_jobs(
    workers: Workers, tmp_path: Path, mode: str
) -> None:
    path = tmp_path / "signals.jsonl"
    done = Job.objects.enqueue(noop, {}).id
    retried = Job.objects.enqueue(fails_first, {"times": 1}).id
    failed = Job.objects.enqueue(boom, {"message": "it broke"}, max_attempts=1).id
    snoozed = Job.objects.enqueue(rate_limited, {}).id
    worker = workers.start("--mode", mode, test_jobs=True, env={SIGNALS: str(path)})
    for job_id in (done, retried, snoozed):
        wait_for_outcome(path, job_id, "done")
    wait_for_outcome(path, failed, "failed")
    stop(worker)

    assert [status(done), status(retried), status(failed), status(snoozed)] == [
        "done",
        "done",
        "failed",
        "done",
    ]
    assert outcomes(path, done) == [("done", 1, None)]
    assert outcomes(path, retried) == [("retry", 1, "RuntimeError"), ("done", 2, None)]
    assert outcomes(path, failed) == [("failed", 1, "RuntimeError")]
    assert received(path, failed)[0]["message"] == "it broke"
    assert outcomes(path, snoozed) == [
        ("snoozed", 1, None),
        ("done", job_row(snoozed)["attempts"], None),
    ]
    lines = read(path)
    for job_id in (done, retried, failed, snoozed):
        started = received(path, job_id, "job_started")
        finished = received(path, job_id)
        # One job_started before each job_finished, of the same attempt.
        assert [s["attempt"] for s in started] == [f["attempt"] for f in finished]
        for first, last in zip(started, finished, strict=True):
            assert lines.index(first) < lines.index(last)
        assert {ln["sender"] for ln in started + finished} == {"Job"}
        assert all(f["duration"] >= 0 for f in finished)
        assert {ln["task"] for ln in started + finished} == {job_row(job_id)["task"]}


@pytest.mark.parametrize("mode", ["lease", "transaction"])
def test_a_job_past_its_timeout_finishes_once_as_failed_with_job_timeout(
    workers: Workers, tmp_path: Path, mode: str
) -> None:
    path = tmp_path / "signals.jsonl"
    job_id = Job.objects.enqueue(hangs, {"seconds": 2.0}).id
    worker = workers.start("--mode", mode, test_jobs=True, env={SIGNALS: str(path)})
    wait_for_outcome(path, job_id, "failed")
    if mode == "lease":
        # The thread it ran on returns later: too late to count, and no second job_finished.
        worker.wait_for_log("returned after its timeout")
    stop(worker)
    assert status(job_id) == "failed"
    assert outcomes(path, job_id) == [("failed", 1, "JobTimeout")]
    assert len(received(path, job_id, "job_started")) == 1


def test_a_job_cancelled_while_running_finishes_as_cancelled(
    workers: Workers, tmp_path: Path
) -> None:
    path = tmp_path / "signals.jsonl"
    job_id = Job.objects.enqueue(until_cancelled, {"email": "stop@example.com"}).id
    worker = workers.start("--lease", "3", test_jobs=True, env={SIGNALS: str(path)})
    wait_until(lambda: status(job_id) == "running", message="the job to start")
    assert Job.objects.cancel([job_id]) == 1
    wait_for_outcome(path, job_id, "cancelled")
    stop(worker)
    assert status(job_id) == "cancelled"
    assert outcomes(path, job_id) == [("cancelled", job_row(job_id)["attempts"], None)]


def test_a_job_whose_lease_is_taken_finishes_as_lost(workers: Workers, tmp_path: Path) -> None:
    path = tmp_path / "signals.jsonl"
    job_id = Job.objects.enqueue(long_running, {"seconds": 60}).id
    worker = workers.start(
        "--lease", "1.5", "--reap-interval", "0", test_jobs=True, env={SIGNALS: str(path)}
    )
    wait_until(lambda: status(job_id) == "running", message="the job to start")
    # Someone else took it (as a reap and a new claim would): the worker's attempt is stale.
    query(
        "UPDATE pgjobs_job SET attempts = attempts + 1 WHERE id = %s AND status = 'running'",
        [job_id],
    )
    wait_for_outcome(path, job_id, "lost")
    stop(worker)
    assert outcomes(path, job_id) == [("lost", 1, None)]


@pytest.mark.parametrize("mode", ["lease", "transaction"])
def test_a_raising_receiver_is_logged_and_changes_nothing(
    workers: Workers, tmp_path: Path, mode: str
) -> None:
    path = tmp_path / "signals.jsonl"
    done = Job.objects.enqueue(noop, {}).id
    failed = Job.objects.enqueue(boom, {}, max_attempts=1).id
    worker = workers.burst("--mode", mode, test_jobs=True, env={SIGNALS: str(path), RAISE: "error"})

    assert (status(done), status(failed)) == ("done", "failed")
    assert "RuntimeError: boom" in job_row(failed)["last_error"]
    log = worker.log()
    assert "a receiver of job_started raised: raising" in log
    assert "a receiver of job_finished raised: raising" in log
    assert "RuntimeError: this receiver fails on purpose" in log
    # The receiver connected after the raising one was still called.
    assert outcomes(path, done) == [("done", 1, None)]
    assert outcomes(path, failed) == [("failed", 1, "RuntimeError")]
    assert "ran 2 jobs: 1 done, 0 to retry, 1 failed, 0 lost" in worker.output()


@pytest.mark.parametrize("mode", ["lease", "transaction"])
def test_a_receiver_whose_query_fails_leaves_the_jobs_transaction_usable(
    workers: Workers, tmp_path: Path, mode: str
) -> None:
    # In transaction mode job_started is sent inside the job's transaction: without a
    # savepoint of its own, the receiver's failed query would fail the job that runs next.
    path = tmp_path / "signals.jsonl"
    order = Job.objects.enqueue(write_order, {"email": "receiver@example.com"}).id
    worker = workers.burst("--mode", mode, test_jobs=True, env={SIGNALS: str(path), RAISE: "query"})
    assert status(order) == "done", job_row(order)["last_error"]
    assert query("SELECT count(*) FROM shop_order WHERE email = 'receiver@example.com'") == [(1,)]
    assert "a receiver of job_started raised: querying" in worker.log()
    assert outcomes(path, order) == [("done", 1, None)]


@pytest.mark.parametrize("mode", ["lease", "transaction"])
def test_a_receiver_that_exits_stops_neither_the_job_nor_the_worker(
    workers: Workers, tmp_path: Path, mode: str
) -> None:
    path = tmp_path / "signals.jsonl"
    first = Job.objects.enqueue(noop, {}).id
    worker = workers.start("--mode", mode, test_jobs=True, env={SIGNALS: str(path), RAISE: "exit"})
    wait_for_outcome(path, first, "done")
    # The threads that ran and recorded it are alive: the next job runs and is recorded too.
    second = Job.objects.enqueue(noop, {}).id
    wait_for_outcome(path, second, "done")
    stop(worker)
    assert (status(first), status(second)) == ("done", "done")
    assert "a receiver of job_finished raised SystemExit" in worker.log()
    assert "a receiver of job_started raised SystemExit" in worker.log()
    assert "ran 2 jobs: 2 done" in worker.output()


# -- the error's log line ---------------------------------------------------------------------


def test_a_jobs_error_is_logged_once_per_attempt_with_the_exception_and_the_job(
    workers: Workers, tmp_path: Path
) -> None:
    records = tmp_path / "records.jsonl"
    job_id = Job.objects.enqueue(fails_first, {"times": 3}).id
    worker = workers.start(test_jobs=True, env={LOG_RECORDS: str(records)})
    wait_until(lambda: status(job_id) == "failed", message="the job to fail for good")
    stop(worker)

    mine = [r for r in read(records) if r["job_id"] == job_id]
    task = job_row(job_id)["task"]
    # One line per attempt, no other: retries at WARNING, the final failure at ERROR, each
    # with the exception (and its traceback) and the job's id, task and attempt in `extra`.
    assert [(r["level"], r["action"], r["attempts"]) for r in mine] == [
        ("WARNING", "retry", 1),
        ("WARNING", "retry", 2),
        ("ERROR", "failed", 3),
    ]
    for attempt, record in enumerate(mine, start=1):
        assert (record["exc_type"], record["traceback"], record["task"]) == (
            "RuntimeError",
            True,
            task,
        )
        assert f"job {job_id} {task} attempt {attempt}/3" in record["message"]
        assert f"attempt {attempt} fails on purpose" in record["message"]
    assert f"job {job_id} {task} attempt 3/3 failed" in worker.log()
    assert "Traceback (most recent call last)" in worker.log()
