"""Shutdown by signal, on a real worker process: the first SIGTERM/SIGINT stops claiming and
lets running jobs finish; a second one exits at once and leaves them for the reaper."""

from __future__ import annotations

import signal

import pytest

from django_pgjobs.models import Job
from testproject.shop.models import Order
from tests.helpers import wait_until
from tests.workers import Workers, counts, query, write_order

pytestmark = pytest.mark.django_db(transaction=True)


def ids_with(status: str) -> set[int]:
    return {row[0] for row in query("SELECT id FROM pgjobs_job WHERE status = %s", [status])}


def orders(count: int, pause: float) -> None:
    """``count`` jobs that each write an order as they start, then take ``pause`` seconds."""
    Job.objects.enqueue_many(
        write_order, [{"email": f"{n}@example.com", "pause": pause} for n in range(count)]
    )


def wait_until_two_run() -> set[int]:
    """Wait until two jobs are running, really: their orders are written. A job the table
    shows running may not have reached an executor yet, and a claim that returns after the
    stop gives its jobs back (on a busy machine the signal did land in between)."""
    wait_until(lambda: Order.objects.count() == 2, message="two jobs to be running")
    return ids_with("running")


def test_sigterm_stops_claiming_and_lets_running_jobs_finish(workers: Workers) -> None:
    orders(22, pause=3)
    worker = workers.start("--concurrency", "2", "--poll-interval", "600", test_jobs=True)
    started = wait_until_two_run()
    # It claims only what it has free slots for: two, not a batch.
    assert counts() == {"running": 2, "queued": 20}

    worker.send(signal.SIGTERM)
    assert worker.wait() == 0

    # It waited for the two jobs rather than abandoning them: each ran its whole 3 s (from
    # its claim to its completion on the database clock; how long after the claim the signal
    # came depends on the machine), and they are done, each on its first attempt.
    assert ids_with("done") == started
    shortest = query(
        "SELECT min(extract(epoch FROM finished_at - attempted_at)) FROM pgjobs_job "
        "WHERE status = 'done'"
    )[0][0]
    assert shortest >= 3.0, shortest
    assert counts() == {"done": 2, "queued": 20}
    assert query(
        "SELECT attempts, count(*) FROM pgjobs_job WHERE status = 'done' GROUP BY attempts"
    ) == [(1, 2)]
    # Nothing else was claimed, and nothing claimed-but-not-started kept an attempt: every job
    # that is not done is queued exactly as it was enqueued.
    assert query(
        "SELECT count(*) FROM pgjobs_job WHERE status <> 'done' AND (status <> 'queued' "
        "OR attempts <> 0 OR locked_until IS NOT NULL OR started_at IS NOT NULL)"
    ) == [(0,)]
    assert "SIGTERM: stopping" in worker.log()
    assert (
        worker.output()
        .strip()
        .splitlines()[-1]
        .startswith("ran 2 jobs: 2 done, 0 to retry, 0 failed, 0 lost")
    )


def test_a_second_signal_exits_at_once_leaving_running_jobs_for_the_reaper(
    workers: Workers,
) -> None:
    # Ten-minute jobs and shutdown timeout: a worker that waited for either would outlast
    # the test's patience.
    orders(3, pause=600)
    worker = workers.start(
        "--concurrency",
        "2",
        "--lease",
        "2",
        "--poll-interval",
        "600",
        "--shutdown-timeout",
        "600",
        test_jobs=True,
    )
    started = wait_until_two_run()

    worker.send(signal.SIGTERM)
    worker.wait_for_log("SIGTERM: stopping")
    worker.send(signal.SIGINT)

    assert worker.wait() == 1, "the second signal must not wait for the jobs"
    assert "SIGINT again: exiting now" in worker.log()
    # Left as they were: running, first attempt, until their lease runs out.
    assert ids_with("running") == started
    assert ids_with("queued") and not ids_with("done")
    assert query("SELECT DISTINCT attempts FROM pgjobs_job WHERE status = 'running'") == [(1,)]

    # After the 2 s lease the reaper brings them back, the crashed attempt counted.
    wait_until(
        lambda: (
            query("SELECT bool_and(locked_until < now()) FROM pgjobs_job WHERE status = 'running'")
            == [(True,)]
        ),
        message="the leases to expire",
    )
    reaper = workers.run("reapjobs")
    assert "reaped 2 jobs: 2 requeued, 0 failed" in reaper.output()
    assert counts() == {"queued": 3}
    assert query("SELECT id, attempts FROM pgjobs_job WHERE attempts > 0 ORDER BY id") == [
        (job_id, 1) for job_id in sorted(started)
    ]
