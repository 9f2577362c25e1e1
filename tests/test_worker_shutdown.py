"""Stopping cleanly: jobs claimed but never started go back to the queue untouched, jobs still
running when the shutdown timeout ends are left to their lease, and a looping reaper rides out
a database restart until its own SIGTERM."""

from __future__ import annotations

import signal

import psycopg
import pytest

from django_pgjobs.managers import ClaimedJob
from django_pgjobs.models import Job
from django_pgjobs.worker import Worker
from django_pgjobs.worker.transaction import Ticket
from scripts.pgserver import ThrowawayPostgres
from testproject.shop.models import Order
from testproject.testjobs import sleep
from tests.helpers import NOOP, make_jobs, raw_connect, wait_until
from tests.workers import Workers, counts, query, write_order

pytestmark = pytest.mark.django_db(transaction=True)


def test_jobs_claimed_after_sigterm_are_released_not_run(workers: Workers) -> None:
    worker = workers.start(
        "--concurrency", "2", "--poll-interval", "3600", "--reap-interval", "3600"
    )
    worker.wait_until_idle()
    # Due jobs nobody announced: the idle worker does not know of them.
    ids = make_jobs(4)

    with raw_connect() as locker, locker.transaction():
        locker.execute("LOCK TABLE pgjobs_job IN EXCLUSIVE MODE")
        # Now announce them: the worker's claim (for its 2 free slots) waits on our lock...
        query("SELECT pg_notify('pgjobs', 'default')")
        wait_until(
            lambda: "Lock" in worker.waits(),
            message="the worker's claim to wait on the lock",
        )
        # ... while it is asked to stop.
        worker.send(signal.SIGTERM)
        worker.wait_for_log("SIGTERM: stopping")
        assert worker.alive
    # The lock is gone: the claim returns two jobs (one per free slot) to a worker that is
    # stopping.

    assert worker.wait() == 0, worker.tail()
    summary = "ran 0 jobs: 0 done, 0 to retry, 0 failed, 0 lost, 0 cancelled; 2 released, 0 reaped"
    assert worker.output().strip().splitlines()[-1] == summary, worker.tail()
    assert summary in worker.log()
    # All four as they were enqueued: the claimed ones were given back, attempt and all, and
    # no claim started after the stop.
    assert query(
        "SELECT id, status, attempts, locked_until, started_at, attempted_at, worker_ids::text "
        "FROM pgjobs_job ORDER BY id"
    ) == [(job_id, "queued", 0, None, None, None, "[]") for job_id in ids]


def test_jobs_handed_out_before_the_stop_run_however_late_an_executor_takes_them() -> None:
    ids = Job.objects.enqueue_many(sleep, [{"seconds": 0.2}] * 3)

    class StopAtHandOut(Worker):
        def _hand_out(self, *items: ClaimedJob | Ticket) -> None:
            # The claim has returned and was found to precede any stop; the stop comes now,
            # before a single executor has taken a job off the hand-off queue.
            self.stop()
            super()._hand_out(*items)

    stats = StopAtHandOut(["default"], concurrency=2, poll_interval=600, reap_interval=0).run()

    # The two its first claim took (one per slot) ran on their first attempt; the third was
    # never claimed: no claim starts after the stop.
    assert (stats.claimed, stats.done, stats.released) == (2, 2, 0)
    assert query(
        "SELECT status, attempts, count(*) FROM pgjobs_job WHERE id = ANY(%s) "
        "GROUP BY status, attempts ORDER BY status",
        [ids],
    ) == [("done", 1, 2), ("queued", 0, 1)]


def test_jobs_still_running_after_the_shutdown_timeout_have_their_leases_ended(
    workers: Workers,
) -> None:
    # Its order is written as it starts; then it takes ten minutes: were the worker to wait
    # for it rather than for its 1 s shutdown timeout, it would still be running when the
    # test gives up waiting for it.
    job_id = write_order.enqueue(email="slow@example.com", pause=600).id
    worker = workers.start(
        "--shutdown-timeout",
        "1",
        "--concurrency",
        "1",
        "--poll-interval",
        "600",
        test_jobs=True,
    )
    wait_until(Order.objects.exists, message="the job to be running")

    worker.send(signal.SIGTERM)
    assert worker.wait() == 0, worker.tail()

    assert "1 jobs still running after the 1 s shutdown timeout" in worker.log()
    # Not done, not given back: still running on its first attempt, but its lease ended with
    # the worker, so the next reap takes it back at once, and counts no crash.
    assert query(
        "SELECT status, attempts, finished_at, locked_until < now() FROM pgjobs_job WHERE id = %s",
        [job_id],
    ) == [("running", 1, None, True)]
    assert counts() == {"running": 1}
    assert "0 lost, 0 cancelled; 0 released" in worker.output()
    assert Job.objects.reap() == [(job_id, "queued", 1)]
    assert query("SELECT crashes FROM pgjobs_job WHERE id = %s", [job_id]) == [(0,)]


@pytest.mark.slow
@pytest.mark.django_db(transaction=False)
def test_a_looping_reaper_rides_out_a_database_restart(workers: Workers) -> None:
    with ThrowawayPostgres() as pg:
        workers.run("migrate", "--verbosity", "0", database_url=pg.url, timeout=120)
        reaper = workers.command("reapjobs", "--loop", "--interval", "0.5", database_url=pg.url)
        wait_until(
            lambda: "reaped 0 jobs" in reaper.output(),
            message="the reaper's first round",
        )

        pg.restart(down_for=2)
        log = reaper.wait_for_log("reapjobs: database default unavailable")
        assert "reconnecting in" in log
        assert reaper.alive

        # A job whose worker vanished, written after the restart: the reaper must find it.
        with psycopg.connect(pg.url, autocommit=True) as conn:
            row = conn.execute(
                "INSERT INTO pgjobs_job (task, status, attempts, locked_until, started_at, "
                "attempted_at) VALUES (%s, 'running', 1, now() - interval '1 minute', "
                "now() - interval '2 minutes', now() - interval '2 minutes') RETURNING id",
                [NOOP],
            ).fetchone()
            assert row is not None
            job_id = row[0]
            wait_until(
                lambda: (
                    f"job {job_id}: queued after 1 attempts" in reaper.output() or not reaper.alive
                ),
                # Nothing is reaped in the server's first minute (upkeep.REAP_SETTLE).
                timeout=150,
                message="the reaper to reap the job",
            )
            assert reaper.alive, reaper.tail()
            assert conn.execute(
                "SELECT status, attempts, last_error FROM pgjobs_job WHERE id = %s", [job_id]
            ).fetchall() == [("queued", 1, "lease expired")]
        assert "reapjobs: reconnected to database default" in reaper.log()
        assert "reaped 1 jobs: 1 requeued, 0 failed" in reaper.output()

        reaper.send(signal.SIGTERM)
        assert reaper.wait() == 0, reaper.tail()
