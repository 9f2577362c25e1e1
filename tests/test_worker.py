"""The worker as a real process: throughput, burst mode, failures, unknown tasks, the heartbeat
and ``current_job()``, and in-worker reaping."""

from __future__ import annotations

import signal
from datetime import timedelta
from pathlib import Path

import pytest

from django_pgjobs.core import claim
from django_pgjobs.models import Job
from testproject.shop.models import Order
from testproject.testjobs import boom, long_running, noop
from tests.helpers import db_now, job_row, make_job, raw_connect, wait_until
from tests.workers import (
    Workers,
    counts,
    query,
    ran,
    scalar,
    until_order,
    wait_until_it_outlives_its_lease,
)

pytestmark = pytest.mark.django_db(transaction=True)


def status(job_id: int) -> str:
    return str(job_row(job_id)["status"])


@pytest.mark.slow
def test_two_workers_drain_ten_thousand_jobs_each_run_once(workers: Workers) -> None:
    Job.objects.enqueue_many(noop, [{"n": i} for i in range(10_000)])

    # Both workers' first claims wait behind this lock, so they start on the jobs together
    # however long either took to start (no reap goes first: the claim is what waits).
    with raw_connect() as locker, locker.transaction():
        locker.execute("LOCK TABLE pgjobs_job IN EXCLUSIVE MODE")
        first, second = (
            workers.start("--concurrency", "4", "--burst", "--reap-interval", "0") for _ in range(2)
        )
        wait_until(
            lambda: (
                first.sent(claim.CLAIM_IDLE, waiting=True)
                and second.sent(claim.CLAIM_IDLE, waiting=True)
            ),
            message="both workers' first claim to wait on the lock",
        )

    assert first.wait(180) == 0, first.tail()
    assert second.wait(180) == 0, second.tail()
    assert counts() == {"done": 10_000}
    assert query("SELECT attempts, count(*) FROM pgjobs_job GROUP BY attempts") == [(1, 10_000)]
    assert scalar("SELECT count(*) FROM pgjobs_job WHERE locked_until IS NOT NULL") == 0
    # Both processes took part (each claimed a share when the lock went), and between them
    # ran each job exactly once.
    assert ran(first) > 0 and ran(second) > 0
    assert ran(first) + ran(second) == 10_000


def test_burst_runs_the_ready_jobs_then_exits_and_says_how_many(workers: Workers) -> None:
    ready = Job.objects.enqueue_many(noop, [{"n": i} for i in range(5)])
    later = Job.objects.enqueue(noop, {}, delay=timedelta(hours=1)).id
    elsewhere = Job.objects.enqueue(noop, {}, queue="elsewhere").id

    worker = workers.burst()

    assert worker.output().splitlines()[-1] == (
        "ran 5 jobs: 5 done, 0 to retry, 0 failed, 0 lost, 0 cancelled; 0 released, 0 reaped"
    )
    assert [status(job_id) for job_id in ready] == ["done"] * 5
    # Not ready (the future) or not its queue: left alone.
    assert status(later) == "queued" and status(elsewhere) == "queued"


def test_a_busy_burst_ends_once_drained_not_at_its_next_poll(workers: Workers) -> None:
    # Its last claims come back empty while outcomes are still being written (a busy claim,
    # which leaves suspects out, so the burst must claim once more when idle). That claim
    # used to wait for the next poll: 600 s here, far past the burst's patience.
    ids = Job.objects.enqueue_many(noop, [{"n": i} for i in range(10_000)])

    # Logging one line per job slows the executors enough to hide it: log as a busy
    # production worker does.
    worker = workers.burst(
        "--concurrency",
        "8",
        "--poll-interval",
        "600",
        "--reap-interval",
        "600",
        env={"PGJOBS_LOG_LEVEL": "WARNING"},
    )

    assert worker.output().splitlines()[-1].startswith("ran 10000 jobs: 10000 done"), worker.tail()
    assert counts() == {"done": len(ids)}


def test_failing_job_backs_off_twenty_seconds_then_fails_for_good(workers: Workers) -> None:
    job_id = Job.objects.enqueue(boom, {"message": "kaboom 1"}).id
    assert job_row(job_id)["max_attempts"] == 2

    first = workers.burst("--max-jobs", "1")
    burst_ended = db_now()

    row = job_row(job_id)
    assert (row["status"], row["attempts"], row["locked_until"]) == ("queued", 1, None)
    assert row["last_error"].startswith("Traceback (most recent call last):")
    assert row["last_error"].strip().splitlines()[-1] == "RuntimeError: kaboom 1"
    # The seed's backoff after the first failure, 10 s * 2^1, on the database clock: the
    # retry is due 20 s after the failure, which came after the attempt started and before
    # the burst ended (a 40 s backoff would put it later; 10 s, earlier).
    backoff = timedelta(seconds=20)
    assert row["started_at"] + backoff <= row["run_at"] <= burst_ended + backoff
    assert "ran 1 jobs: 0 done, 1 to retry, 0 failed" in first.output()
    assert "RuntimeError: kaboom 1" in first.log()

    # Do not wait the 20 s: make it due now.
    query("UPDATE pgjobs_job SET run_at = now() WHERE id = %s", [job_id])
    second = workers.burst()

    row = job_row(job_id)
    assert (row["status"], row["attempts"], row["locked_until"]) == ("failed", 2, None)
    assert row["finished_at"] is not None
    assert row["last_error"].strip().splitlines()[-1] == "RuntimeError: kaboom 1"
    assert "ran 1 jobs: 0 done, 0 to retry, 1 failed" in second.output()
    assert " ERROR " in second.log()

    # Failed for good: a further burst does not touch it.
    workers.burst()
    assert job_row(job_id)["attempts"] == 2


def test_a_row_naming_an_unregistered_path_is_refused_never_imported(
    workers: Workers, tmp_path: Path
) -> None:
    # Were these paths imported and called with their payload, each would create its marker.
    call_marker = tmp_path / "subprocess-call-ran"
    system_marker = tmp_path / "os-system-ran"
    refused = {
        "subprocess.call": make_job(
            task="subprocess.call", payload={"args": ["touch", str(call_marker)]}, max_attempts=1
        ),
        "os.system": make_job(
            task="os.system", payload={"command": f"touch {system_marker}"}, max_attempts=1
        ),
        "testproject.not_a_job.run": make_job(task="testproject.not_a_job.run", max_attempts=1),
        # Importing the stdlib's `this` prints the Zen of Python: an import would show.
        "this.s": make_job(task="this.s", max_attempts=1),
    }

    # By default a worker does not even claim them (tests/test_queue_control.py): a newer
    # worker may know them. With the switch off it claims them, and refuses to run them.
    worker = workers.burst("--claim-unregistered")

    assert not call_marker.exists() and not system_marker.exists()
    assert "Beautiful is better than ugly" not in worker.output() + worker.log()
    for task, job_id in refused.items():
        row = job_row(job_id)
        assert (row["status"], row["attempts"]) == ("failed", 1), task
        last_line = row["last_error"].strip().splitlines()[-1]
        assert f"Unknown task {task!r}" in last_line, last_line
        for wrong in ("ImportError", "ModuleNotFoundError", "TypeError", "AttributeError"):
            assert wrong not in row["last_error"], row["last_error"]
    assert "ran 4 jobs: 0 done, 0 to retry, 4 failed" in worker.output()
    assert "Unknown task 'subprocess.call'" in worker.log()


def test_heartbeat_keeps_a_job_longer_than_its_lease_owned(workers: Workers) -> None:
    # The job runs until the test creates its order: past its lease however slow the machine.
    job_id = until_order.enqueue(email="heartbeat@example.com").id
    # The reaper runs every 0.5 s: were the 3 s lease not extended, it would take the job
    # back (the heartbeat, every lease/3, leaves 2 s for a busy machine to be late).
    worker = workers.start("--lease", "3", "--reap-interval", "0.5", test_jobs=True)

    wait_until(lambda: status(job_id) == "running", message="the job to start")
    wait_until_it_outlives_its_lease(job_id, lease=3)

    Order.objects.create(email="heartbeat@example.com", total_cents=1)
    wait_until(lambda: status(job_id) == "done", message="the job to finish")
    row = job_row(job_id)
    assert (row["attempts"], row["last_error"], row["locked_until"]) == (1, None, None)
    worker.send(signal.SIGTERM)
    assert worker.wait() == 0
    assert "no longer ours" not in worker.log() and "reaped job" not in worker.log()
    assert "ran 1 jobs: 1 done" in worker.output()


def test_a_job_whose_lease_is_taken_sees_lost_and_its_outcome_is_not_recorded(
    workers: Workers,
) -> None:
    job_id = Job.objects.enqueue(long_running, {"seconds": 60}).id
    worker = workers.start("--lease", "1.5", "--reap-interval", "0")
    wait_until(lambda: status(job_id) == "running", message="the job to start")

    # Someone else reaped and reclaimed it: the attempt the worker holds is no longer current.
    query(
        "UPDATE pgjobs_job SET attempts = attempts + 1 WHERE id = %s AND status = 'running'",
        [job_id],
    )

    # The next heartbeat (every lease/3 = 0.5 s) finds the fence closed; the job sees
    # current_job().lost and returns long before its 60 s.
    log = worker.wait_for_log("lost its lease while running; outcome not recorded")
    assert f"extend_lease of job {job_id} (attempt 1) changed nothing" in log
    worker.send(signal.SIGTERM)
    assert worker.wait() == 0
    row = job_row(job_id)
    # Nothing was written over the thief's attempt: no complete, no fail, no release.
    assert (row["status"], row["attempts"], row["finished_at"]) == ("running", 2, None)
    assert "ran 1 jobs: 0 done, 0 to retry, 0 failed, 1 lost, 0 cancelled; 0 released" in (
        worker.output()
    )


def test_worker_reaps_expired_leases_every_reap_interval_and_runs_them(
    workers: Workers,
) -> None:
    worker = workers.start("--reap-interval", "1", "--poll-interval", "3600")
    # Its first tick is over (reap, claim, then the due-time lookup): the start-up reap has
    # come and gone.
    wait_until(lambda: worker.sent(claim.OUTLOOK), message="the worker's first tick")
    # A job whose worker vanished a minute ago, written after the start-up reap. make_job
    # sends no NOTIFY and the poll is an hour away: only a periodic reap can bring it back.
    job_id = make_job(
        task="testproject.testjobs.noop",
        status="running",
        attempts=1,
        locked_until=timedelta(minutes=-1),
    )
    wait_until(lambda: status(job_id) == "done", message="the job to be reaped and run")

    row = job_row(job_id)
    # The crashed attempt counted; the rerun was the second.
    assert (row["attempts"], row["last_error"]) == (2, "lease expired")
    assert f"reaped job {job_id} (attempt 1): lease expired, now queued" in worker.log()
    worker.send(signal.SIGTERM)
    assert worker.wait() == 0
    assert "1 reaped" in worker.output()
