"""``async def`` jobs: they run on the worker's one event-loop thread, many at once beside a
single executor thread, with the same fences, timeouts, cancels, shutdown and crash recovery
as sync jobs. Real workers (``PGJOBS_IMPORTS=tests.async_jobs`` gives them the async jobs),
real PostgreSQL; every wait is for a state of the table."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection

from django_pgjobs import job
from django_pgjobs.core import registry
from django_pgjobs.models import Job
from django_pgjobs.worker.worker import Worker
from testproject.shop.tasks import double
from testproject.testjobs import noop
from tests import async_jobs
from tests.helpers import job_row, wait_until
from tests.workers import (
    SLEEP,
    Process,
    Workers,
    assert_nobody_was_blamed,
    counts,
    listener_backends,
    query,
    scalar,
    terminate,
    wait_until_it_outlives_its_lease,
)

pytestmark = pytest.mark.django_db(transaction=True)

ASYNC = {"PGJOBS_IMPORTS": "tests.async_jobs"}


@pytest.fixture
def spans() -> Iterator[None]:
    with connection.cursor() as cursor:
        cursor.execute(
            f"CREATE TABLE IF NOT EXISTS {async_jobs.SPANS} "
            "(job_id bigint, attempts int, started float8, ended float8)"
        )
        cursor.execute(f"TRUNCATE {async_jobs.SPANS}")
    yield
    with connection.cursor() as cursor:
        cursor.execute(f"DROP TABLE {async_jobs.SPANS}")


def ended() -> list[tuple[int, int, float, float]]:
    """The finished spans: (job id, attempt, start, end)."""
    rows = query(
        f"SELECT job_id, attempts, started, ended FROM {async_jobs.SPANS} "
        "WHERE ended IS NOT NULL AND ended >= 0"
    )
    return [(int(i), int(a), float(s), float(e)) for i, a, s, e in rows]


def started() -> int:
    return int(scalar(f"SELECT count(*) FROM {async_jobs.SPANS} WHERE ended IS NULL"))


def cancelled_tasks() -> set[int]:
    rows = query(f"SELECT job_id FROM {async_jobs.SPANS} WHERE ended = %s", [async_jobs.CANCELLED])
    return {int(r[0]) for r in rows}


def most_at_once(runs: list[tuple[float, float]]) -> int:
    """The largest number of runs that overlap at one moment (an end before a start at the
    same instant: touching runs do not overlap)."""
    events = sorted([(a, 1) for a, _ in runs] + [(b, -1) for _, b in runs])
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def status(job_id: int) -> str:
    return str(job_row(job_id)["status"])


def naps(count: int, seconds: float, **extra: Any) -> list[int]:
    return list(
        Job.objects.enqueue_many(
            async_jobs.nap, [{"seconds": seconds, **extra} for _ in range(count)]
        )
    )


def start(workers: Workers, *args: str) -> Process:
    return workers.start("--concurrency", "1", *args, env=ASYNC)


# -- registration -----------------------------------------------------------------------------


def test_an_async_def_job_is_registered_as_one() -> None:
    async def fetch(url: str) -> None:
        """An I/O-bound job."""

    registered = job(name="tests.async_fetch")(fetch)
    try:
        assert registered.is_async and registry.runs_async("tests.async_fetch")
        assert not registry.get(noop.name).is_async
        assert not registry.runs_async("tests.not_registered")
    finally:
        del registry._registry["tests.async_fetch"]


# -- running ----------------------------------------------------------------------------------


def test_an_async_function_behind_a_plain_decorator_is_awaited(
    workers: Workers, spans: None
) -> None:
    """``@job`` sees a sync function; the coroutine it returns runs to its end all the same
    (on an executor thread), not marked done unawaited."""
    ids = list(Job.objects.enqueue_many(async_jobs.nap_behind_a_decorator, [{"seconds": 0.1}] * 3))
    worker = start(workers)
    wait_until(lambda: counts().get("done", 0) == 3, message="the 3 jobs to finish")
    assert sorted(i for i, *_ in ended()) == sorted(ids)
    worker.send(signal.SIGTERM)
    assert worker.wait() == 0, worker.tail()


def test_fifty_async_jobs_wait_at_once_beside_one_executor_thread(
    workers: Workers, spans: None
) -> None:
    ids = naps(50, 1.0)
    worker = start(workers, "--async-concurrency", "50")
    wait_until(lambda: counts().get("done", 0) == 50, message="the 50 jobs to finish")
    runs = ended()
    assert sorted(i for i, *_ in runs) == sorted(ids)
    # One executor thread could run one at a time; the loop ran many at once.
    assert most_at_once([(s, e) for *_, s, e in runs]) > 1
    assert "runs async jobs on an event loop, 50 at once" in worker.log()
    worker.send(signal.SIGTERM)
    assert worker.wait() == 0, worker.tail()
    assert "ran 50 jobs: 50 done" in worker.output()


def test_the_async_concurrency_caps_how_many_run_at_once(workers: Workers, spans: None) -> None:
    naps(12, 0.3)
    start(workers, "--async-concurrency", "3", "--batch-size", "10")
    wait_until(lambda: counts().get("done", 0) == 12, message="the 12 jobs to finish")
    assert 1 < most_at_once([(s, e) for *_, s, e in ended()]) <= 3


def test_no_async_job_is_claimed_beyond_the_loops_room(workers: Workers, spans: None) -> None:
    """A claim cannot choose its mix of sync and async jobs, so it takes no more than both
    the executors and the loop have free: with the loop full, only sync jobs are claimed,
    and the async ones stay queued for this worker's next room, or another worker's."""
    blocked = [Job.objects.enqueue(async_jobs.waits_for_cancel, {}).id for _ in range(20)]
    worker = start(workers, "--concurrency", "4", "--async-concurrency", "3", "--lease", "3")
    wait_until(lambda: counts().get("running") == 3, message="three async jobs to fill the loop")
    # A sync job runs while the loop is full: the claims that came after it filled took
    # only what the executors could run.
    after = Job.objects.enqueue(noop, {}).id
    wait_until(lambda: status(after) == "done", message="the sync job to run")
    assert counts() == {"running": 3, "queued": 17, "done": 1}, counts()
    # A freed slot of the loop takes one more async job, and no more.
    running = [i for i in blocked if status(i) == "running"]
    assert Job.objects.cancel(running[:1]) == 1
    wait_until(lambda: counts().get("queued") == 16, message="the next async job to start")
    second = Job.objects.enqueue(noop, {}).id
    wait_until(lambda: status(second) == "done", message="the second sync job to run")
    assert counts() == {"running": 3, "queued": 16, "done": 2, "cancelled": 1}, counts()
    worker.kill()


def test_sync_jobs_are_not_claimed_beyond_the_free_executors(workers: Workers, spans: None) -> None:
    """With async jobs about (the loop has room), a claim still takes no more jobs than the
    executors have free: sync jobs behind a busy thread stay queued, not leased unheartbeated."""
    Job.objects.enqueue(async_jobs.nap, {"seconds": 0})
    first = Job.objects.enqueue(async_jobs.waits_for_cancel, {}).id
    gate = [Job.objects.enqueue(SLEEP, {"seconds": 600}).id for _ in range(6)]
    worker = start(workers, "--concurrency", "1", "--async-concurrency", "10", "--lease", "3")
    wait_until(lambda: status(first) == "running", message="the async job to start")
    wait_until(
        lambda: sum(status(i) == "running" for i in gate) == 1, message="one sync job to start"
    )
    # An async job enqueued now still finds room: the claims go on, sync-free.
    late = Job.objects.enqueue(async_jobs.nap, {"seconds": 0}).id
    wait_until(lambda: status(late) == "done", message="the late async job to run")
    assert sum(status(i) == "running" for i in gate) == 1
    assert sum(status(i) == "queued" for i in gate) == 5
    worker.kill()


def test_sync_and_async_jobs_of_one_queue_each_run_where_they_belong(
    workers: Workers, spans: None
) -> None:
    async_ids = naps(5, 0.2)
    sync_ids = [Job.objects.enqueue(noop, {}).id for _ in range(5)]
    start(workers)
    wait_until(lambda: counts().get("done", 0) == 10, message="the 10 jobs to finish")
    assert sorted(i for i, *_ in ended()) == sorted(async_ids)
    assert all(status(i) == "done" for i in sync_ids)


def test_outcomes_are_recorded_done_failed_and_retried(workers: Workers, spans: None) -> None:
    done = Job.objects.enqueue(async_jobs.nap, {"seconds": 0}).id
    failed = Job.objects.enqueue(async_jobs.fails, {"message": "async failure"}).id
    retried = Job.objects.enqueue(async_jobs.fails_to_retry, {"message": "once more"}).id
    own = Job.objects.enqueue(async_jobs.raises_cancelled, {}).id
    worker = start(workers)
    wait_until(lambda: status(done) == "done", message="the async job to be done")
    wait_until(lambda: status(failed) == "failed", message="the async job to fail")
    wait_until(lambda: job_row(retried)["last_error"], message="the async job to be retried")
    wait_until(lambda: status(own) == "failed", message="the CancelledError job to fail")
    assert "RuntimeError: async failure" in job_row(failed)["last_error"]
    row = job_row(retried)
    assert (row["status"], row["attempts"]) == ("queued", 1)
    assert "RuntimeError: once more" in row["last_error"]
    # A CancelledError the job raised itself is its failure, not a cancel: recorded, not
    # left running.
    assert "CancelledError" in job_row(own)["last_error"]
    worker.send(signal.SIGTERM)
    assert worker.wait() == 0, worker.tail()
    assert "ran 4 jobs: 1 done, 1 to retry, 2 failed, 0 lost, 0 cancelled" in worker.output()


# -- timeouts, cancels, leases ----------------------------------------------------------------


def test_a_timeout_cancels_the_task_and_fails_the_job_with_job_timeout(
    workers: Workers, spans: None
) -> None:
    job_id = Job.objects.enqueue(async_jobs.hangs, {}).id
    worker = start(workers)
    wait_until(lambda: status(job_id) == "failed", message="the job to time out")
    assert "JobTimeout" in job_row(job_id)["last_error"]
    wait_until(lambda: job_id in cancelled_tasks(), message="its task to be cancelled")
    worker.wait_for_log("returned after its timeout; outcome not recorded")
    # Its slot is free again: the next async job runs.
    after = Job.objects.enqueue(async_jobs.nap, {"seconds": 0}).id
    wait_until(lambda: status(after) == "done", message="the next job to run")


def test_a_cancel_of_a_running_async_job_cancels_its_task(workers: Workers, spans: None) -> None:
    job_id = Job.objects.enqueue(async_jobs.waits_for_cancel, {}).id
    # A 3 s lease: the heartbeat that notices the cancel comes about every second.
    worker = start(workers, "--lease", "3")
    wait_until(lambda: status(job_id) == "running", message="the job to start")
    assert Job.objects.cancel([job_id]) == 1
    wait_until(lambda: job_id in cancelled_tasks(), message="its task to be cancelled")
    worker.wait_for_log("was cancelled while running; outcome not recorded")
    assert status(job_id) == "cancelled"
    after = Job.objects.enqueue(async_jobs.nap, {"seconds": 0}).id
    wait_until(lambda: status(after) == "done", message="the next job to run")
    worker.send(signal.SIGTERM)
    assert worker.wait() == 0, worker.tail()
    assert "1 cancelled" in worker.output()


def test_heartbeats_keep_an_async_jobs_lease_past_its_length(workers: Workers, spans: None) -> None:
    job_id = Job.objects.enqueue(async_jobs.waits_for_word, {}).id
    # The reaper runs every 0.5 s: were the 6 s lease not extended, it would take the job
    # back (the heartbeat, every lease/3, leaves 4 s for a busy machine to be late).
    worker = start(workers, "--lease", "6", "--reap-interval", "0.5")
    wait_until(lambda: status(job_id) == "running", message="the job to start")
    wait_until_it_outlives_its_lease(job_id, lease=6)
    query(
        f"INSERT INTO {async_jobs.SPANS} (job_id, attempts, started, ended) VALUES (%s, 1, 0, %s)",
        [job_id, async_jobs.WORD],
    )
    wait_until(lambda: status(job_id) == "done", message="the job to finish")
    row = job_row(job_id)
    assert (row["attempts"], row["last_error"], row["locked_until"]) == (1, None, None)
    # It ran once, to its end, on its first attempt.
    assert [(i, a) for i, a, *_ in ended()] == [(job_id, 1)]
    worker.send(signal.SIGTERM)
    assert worker.wait() == 0, worker.tail()
    assert "no longer ours" not in worker.log() and "reaped job" not in worker.log()
    assert "ran 1 jobs: 1 done" in worker.output()


def test_a_lost_lease_cancels_the_task_and_records_nothing(workers: Workers, spans: None) -> None:
    job_id = Job.objects.enqueue(async_jobs.waits_for_cancel, {}).id
    worker = start(workers, "--lease", "3")
    wait_until(lambda: status(job_id) == "running", message="the job to start")
    # Another claimant takes it (as the reaper would after an expired lease).
    query("UPDATE pgjobs_job SET attempts = attempts + 1 WHERE id = %s", [job_id])
    wait_until(lambda: job_id in cancelled_tasks(), message="its task to be cancelled")
    worker.wait_for_log("lost its lease while running; outcome not recorded")
    assert status(job_id) == "running"


# -- shutdown and crashes ---------------------------------------------------------------------


def test_sigterm_waits_for_the_running_async_jobs(workers: Workers, spans: None) -> None:
    ids = naps(20, 2.0)
    worker = start(workers, "--shutdown-timeout", "60")
    wait_until(lambda: started() == 20, message="the 20 jobs to start")
    worker.send(signal.SIGTERM)
    assert worker.wait() == 0, worker.tail()
    assert all(status(i) == "done" for i in ids)
    assert sorted(i for i, *_ in ended()) == sorted(ids)
    assert "ran 20 jobs: 20 done" in worker.output()


def test_async_jobs_still_running_after_the_shutdown_timeout_have_their_leases_ended(
    workers: Workers, spans: None
) -> None:
    ids = naps(3, 3600)
    worker = start(workers, "--shutdown-timeout", "1", "--poll-interval", "600")
    wait_until(lambda: started() == 3, message="the 3 jobs to start")
    worker.send(signal.SIGTERM)
    assert worker.wait() == 0, worker.tail()
    assert "3 jobs still running after the 1 s shutdown timeout" in worker.log()
    # Not done, not given back: running on their first attempt, their leases ended with the
    # worker, so the next reap takes them back at once and counts no crash.
    assert query(
        "SELECT status, attempts, finished_at, locked_until < now(), count(*) FROM pgjobs_job "
        "GROUP BY 1, 2, 3, 4"
    ) == [("running", 1, None, True, 3)]
    assert "0 lost, 0 cancelled; 0 released" in worker.output()
    assert sorted(job_id for job_id, *_ in Job.objects.reap()) == sorted(ids)
    assert query("SELECT DISTINCT status, crashes FROM pgjobs_job") == [("queued", 0)]


def test_after_sigkill_the_jobs_come_back_through_their_leases_none_lost_or_doubled(
    workers: Workers, spans: None
) -> None:
    # The first attempt awaits an hour; the next ones finish at once.
    ids = naps(10, 3600, again=0.0)
    first = start(workers, "--lease", "2")
    wait_until(lambda: started() == 10, message="the 10 jobs to start")
    first.send(signal.SIGKILL)
    first.wait()
    second = start(workers, "--lease", "2", "--reap-interval", "1", "--poll-interval", "1")
    wait_until(lambda: counts().get("done", 0) == 10, message="the jobs to come back and finish")
    runs = ended()
    # Each job finished exactly once, by its second attempt.
    assert sorted(i for i, *_ in runs) == sorted(ids)
    assert {a for _, a, *_ in runs} == {2}
    second.send(signal.SIGTERM)
    assert second.wait() == 0, second.tail()


def test_a_second_sigterm_stops_at_once_and_the_jobs_come_back_without_a_crash(
    workers: Workers, spans: None
) -> None:
    ids = naps(5, 3600, again=0.0)
    first = start(workers, "--shutdown-timeout", "3600")
    wait_until(lambda: started() == 5, message="the 5 jobs to start")
    first.send(signal.SIGTERM)
    first.wait_for_log("signal again to exit now")
    first.send(signal.SIGTERM)
    assert first.wait() == 1, first.tail()
    # Their leases were ended on the way out: running, but already expired.
    rows = [job_row(i) for i in ids]
    assert {r["status"] for r in rows} == {"running"}
    assert scalar("SELECT count(*) FROM pgjobs_job WHERE locked_until <= now()") == 5
    second = start(workers, "--reap-interval", "1", "--poll-interval", "1")
    wait_until(lambda: counts().get("done", 0) == 5, message="the jobs to come back and finish")
    # Each ran to its end once, by its second attempt, and no crash was counted: a hard stop
    # is no worker death.
    assert sorted(i for i, *_ in ended()) == sorted(ids)
    assert query("SELECT DISTINCT attempts, crashes FROM pgjobs_job") == [(2, 0)]
    second.send(signal.SIGTERM)
    assert second.wait() == 0, second.tail()


def test_async_jobs_that_catch_their_timeouts_cancel_count_as_stuck_and_the_worker_exits_75(
    workers: Workers, spans: None
) -> None:
    """A job that catches the cancel its timeout sent leaves the loop running but keeps its
    slot for good: past MAX_STUCK_EXECUTORS of them, the worker stops as it does for stuck
    threads, instead of running on with ever fewer slots."""
    ids = list(Job.objects.enqueue_many(async_jobs.ignores_its_cancel, [{}] * 2))
    worker = start(
        workers,
        "--async-concurrency",
        "4",
        "--max-stuck-executors",
        "1",
        "--poll-interval",
        "1",
        "--shutdown-timeout",
        "1",
    )
    assert worker.wait() == 75, worker.tail()
    assert "2 async jobs' tasks (they caught their cancel)" in worker.log(), worker.log()
    # Both caught the cancel of their timeout, which failed them.
    assert cancelled_tasks() == set(ids)
    for job_id in ids:
        row = job_row(job_id)
        assert row["status"] == "failed" and "JobTimeout" in str(row["last_error"]), row


def test_async_jobs_whose_task_ends_at_their_timeouts_cancel_are_not_counted_stuck() -> None:
    """The completer sends a timeout's cancel, asks the job's retry policy, then tells the
    worker of the timeout: a task that heeded the cancel has ended by then, and must not be
    left counted as one that caught it (stale ones made a healthy worker exit 75, 10 s
    later). The policy here takes a second, so the task always ends first."""
    ids = list(Job.objects.enqueue_many(async_jobs.heeds_its_cancel, [{}] * 3))
    worker = Worker(
        ["default"],
        burst=True,
        concurrency=1,
        async_concurrency=3,
        reap_interval=0,
        max_stuck_executors=1,
    )
    stats = worker.run()
    assert stats.retried == 3
    assert {status(i) for i in ids} == {"queued"}
    assert worker._stuck_jobs.timed_out == {}
    assert worker._stuck_jobs.count() == 0 and not worker.stuck


@pytest.mark.parametrize("atomically", [False, True], ids=["plain", "in-atomic"])
def test_async_jobs_whose_queries_meet_an_outage_are_released_and_run_again(
    workers: Workers, spans: None, atomically: bool
) -> None:
    """Every async job's ORM query runs on asgiref's one sync_to_async thread, on one
    connection that outlives them all: once it is dropped, the jobs that meet it are released
    (not blamed), and the connection is mended for the next ones. A query inside atomic()
    finds at the block's end a fresh connection Django opened: that too is the outage."""
    worker = start(workers, "--poll-interval", "1")
    # Its LISTEN connection up too (one of the connections the outage drops): on a busy
    # machine the jobs of the first claim could start before it.
    wait_until(listener_backends, message="the worker to listen")
    ids = naps(10, 2.0, atomically=atomically)
    wait_until(lambda: started() == 10, message="the 10 jobs to start")
    # Every connection of the worker, the async jobs' one included: each job's closing record
    # runs into it.
    assert terminate(worker.backends() + listener_backends()) >= 3
    later = naps(5, 0.0, atomically=atomically)
    wait_until(
        lambda: (
            all(status(i) == "done" or job_row(i)["last_error"] for i in ids + later)
            or not worker.alive
        ),
        message="every job to be done, or blamed",
    )
    assert worker.alive, worker.tail()
    assert_nobody_was_blamed(15)
    assert "met a database outage; releasing it (attempt not counted)" in worker.log()
    # Each finished once: the released attempts' records never landed.
    assert sorted(i for i, *_ in ended()) == sorted(ids + later)
    worker.send(signal.SIGTERM)
    assert worker.wait() == 0, worker.tail()


def test_an_async_job_blocking_the_loop_past_its_timeout_makes_the_worker_exit_75(
    workers: Workers, spans: None
) -> None:
    ids = naps(3, 3600, again=0.0)
    blocker = Job.objects.enqueue(async_jobs.blocks_the_loop, {}).id
    worker = start(workers, "--poll-interval", "1", "--shutdown-timeout", "1")
    assert worker.wait() == 75, worker.tail()
    assert "its event loop has not run for" in worker.log()
    # The blocker's timeout failed it; the jobs frozen behind it were given back through their
    # ended leases, and run to their end elsewhere.
    row = job_row(blocker)
    assert row["status"] == "failed" and "JobTimeout" in str(row["last_error"]), row
    second = start(workers, "--reap-interval", "1", "--poll-interval", "1")
    wait_until(lambda: all(status(i) == "done" for i in ids), message="the naps to finish")
    assert query("SELECT DISTINCT crashes FROM pgjobs_job WHERE id = ANY(%s)", [ids]) == [(0,)]
    second.send(signal.SIGTERM)
    assert second.wait() == 0, second.tail()


def test_a_job_started_receiver_of_an_async_job_runs_off_the_loop_and_may_query(
    workers: Workers, spans: None
) -> None:
    job_id = Job.objects.enqueue(async_jobs.nap, {"seconds": 0}).id
    workers.burst("--concurrency", "1", env={**ASYNC, "PGJOBS_TEST_ASYNC_STARTED": "1"})
    assert status(job_id) == "done"
    # The receiver's sync query ran (on the loop's thread it would raise
    # SynchronousOnlyOperation, logged and lost).
    assert query(
        f"SELECT job_id, attempts FROM {async_jobs.SPANS} WHERE ended = %s", [async_jobs.STARTED]
    ) == [(job_id, 1)]


# -- django.tasks ------------------------------------------------------------------------------


def test_an_async_django_task_is_awaited_on_the_event_loop(workers: Workers) -> None:
    assert registry.get("testproject.shop.tasks.double").is_async
    result = double.enqueue(21)
    worker = workers.start("--concurrency", "1")
    wait_until(lambda: status(int(result.id)) == "done", message="the task to run")
    assert double.get_result(result.id).return_value == 42
    assert "runs async jobs on an event loop" in worker.log()
    worker.send(signal.SIGTERM)
    assert worker.wait() == 0, worker.tail()


# -- a worker without async jobs --------------------------------------------------------------


def test_with_only_sync_jobs_queued_the_claims_take_only_the_threads_slots(
    workers: Workers,
) -> None:
    """The loop's 100 free slots do not size a claim until a claim has found an async job:
    sync jobs are never claimed ahead of the executor threads (they would wait, running)."""
    ids = [Job.objects.enqueue(SLEEP, {"seconds": 0.3}).id for _ in range(10)]
    worker = start(workers, "--concurrency", "2", "--batch-size", "10")
    most = 0
    while counts().get("done", 0) < 10:
        most = max(most, counts().get("running", 0))
        assert worker.alive, worker.tail()
        time.sleep(0.02)
    # Two on the threads, and at most the two that just finished while their outcomes are on
    # their way; a claim sized by the loop's slots would have taken all ten at once.
    assert 1 <= most <= 4
    assert all(status(i) == "done" for i in ids)


def test_an_async_job_in_transaction_mode_runs_on_its_executor_thread(
    workers: Workers, spans: None
) -> None:
    job_id = Job.objects.enqueue(async_jobs.nap, {"seconds": 0}).id
    workers.burst("--mode", "transaction", env=ASYNC)
    assert status(job_id) == "done"
    assert [i for i, *_ in ended()] == [job_id]


def test_in_transaction_mode_an_async_jobs_orm_writes_are_part_of_its_transaction(
    workers: Workers, spans: None
) -> None:
    failing = Job.objects.enqueue(async_jobs.writes_then_fails, {}).id
    passing = Job.objects.enqueue(async_jobs.nap, {"seconds": 0}).id
    workers.burst("--mode", "transaction", env=ASYNC)
    assert (status(failing), status(passing)) == ("failed", "done")
    # The failed job's write was rolled back with its savepoint; the done one's committed.
    written = query(f"SELECT job_id FROM {async_jobs.SPANS} WHERE ended = %s", [async_jobs.WRITTEN])
    assert written == []
    assert [i for i, *_ in ended()] == [passing]


def test_async_concurrency_must_be_a_positive_whole_number(workers: Workers) -> None:
    worker = workers.start("--async-concurrency", "0", env=ASYNC)
    assert worker.wait() != 0
    assert "async_concurrency" in worker.log()
