"""``manage.py reapjobs`` as a real process: once (for cron), or in a loop until SIGTERM."""

from __future__ import annotations

import signal
from datetime import timedelta

import pytest

from tests.helpers import job_row, make_job, wait_until
from tests.workers import Workers

pytestmark = pytest.mark.django_db(transaction=True)

EXPIRED = timedelta(minutes=-1)


def state(job_id: int) -> tuple[str, int, object]:
    row = job_row(job_id)
    return row["status"], row["attempts"], row["last_error"]


def test_reapjobs_once_requeues_or_fails_expired_leases_and_says_what_it_did(
    workers: Workers,
) -> None:
    expired = make_job(status="running", attempts=1, locked_until=EXPIRED)
    out_of_attempts = make_job(status="running", attempts=3, max_attempts=3, locked_until=EXPIRED)
    failed_before = make_job(
        status="running", attempts=2, locked_until=EXPIRED, last_error="RuntimeError: earlier"
    )
    leased = make_job(status="running", attempts=1, locked_until=timedelta(minutes=5))
    finished = make_job(status="done", attempts=1, locked_until=EXPIRED)

    reaper = workers.run("reapjobs")

    summary, *lines = reaper.output().splitlines()
    assert summary == "reaped 3 jobs: 2 requeued, 1 failed"
    assert sorted(lines) == sorted(
        [
            f"  job {expired}: queued after 1 attempts",
            f"  job {out_of_attempts}: failed after 3 attempts",
            f"  job {failed_before}: queued after 2 attempts",
        ]
    )
    # The attempt the crash cost stays counted; an earlier error is kept.
    assert state(expired) == ("queued", 1, "lease expired")
    assert state(out_of_attempts) == ("failed", 3, "lease expired")
    assert job_row(out_of_attempts)["finished_at"] is not None
    assert state(failed_before) == ("queued", 2, "RuntimeError: earlier")
    assert job_row(expired)["locked_until"] is None
    # A lease still running, and a finished job, are not the reaper's business.
    assert state(leased) == ("running", 1, None)
    assert state(finished) == ("done", 1, None)

    assert workers.run("reapjobs").output().splitlines() == ["reaped 0 jobs: 0 requeued, 0 failed"]


def test_reapjobs_loop_keeps_reaping_until_sigterm(workers: Workers) -> None:
    reaper = workers.command("reapjobs", "--loop", "--interval", "0.5")
    wait_until(lambda: reaper.output().count("reaped 0 jobs") >= 2, message="two empty rounds")

    first = make_job(status="running", attempts=1, locked_until=EXPIRED)
    wait_until(
        lambda: job_row(first)["status"] == "queued",
        message="the loop to reap the first job",
    )
    second = make_job(status="running", attempts=1, locked_until=EXPIRED)
    wait_until(
        lambda: job_row(second)["status"] == "queued",
        message="the loop to reap the second job",
    )
    assert reaper.alive

    reaper.send(signal.SIGTERM)
    assert reaper.wait() == 0
    output = reaper.output()
    assert f"  job {first}: queued after 1 attempts" in output
    assert f"  job {second}: queued after 1 attempts" in output
    assert output.count("reaped 1 jobs: 1 requeued, 0 failed") == 2


def test_reapjobs_refuses_a_non_positive_interval(workers: Workers) -> None:
    reaper = workers.command("reapjobs", "--loop", "--interval", "0")
    assert reaper.wait() != 0
    assert "--interval must be a positive number of seconds" in reaper.log()
