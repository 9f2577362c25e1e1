"""When an idle worker speaks: its periodic work (fallback claim, reap, LISTEN probe) shares one
tick, so the silences in between are whole intervals, also after it ran a job; a deferred job
or a retry wakes it when it comes due; with LISTEN dead its poll still finds the work."""

from __future__ import annotations

import itertools
import signal
import time
from datetime import datetime, timedelta

import pytest

from django_pgjobs.models import Job
from testproject.testjobs import noop
from tests.helpers import job_row, wait_until
from tests.workers import Process, Workers, fails_first, listener_backends, scalar, wait_done

pytestmark = pytest.mark.django_db(transaction=True)


def up(worker: Process) -> None:
    """Wait until the worker has run a job (so it is past start-up) and LISTENs."""
    wait_done(Job.objects.enqueue(noop, {"warm": "up"}).id)
    wait_until(listener_backends, message="the LISTEN connection")


def stop(worker: Process) -> None:
    worker.send(signal.SIGTERM)
    assert worker.wait() == 0, worker.tail()


# -- silence between ticks -----------------------------------------------------------------


class Activity:
    """Every moment a worker's connections began a statement or changed state, as the server
    recorded it (``query_start``, ``state_change``), sampled every 0.2 s."""

    def __init__(self, worker: Process) -> None:
        self.worker = worker
        self.moments: set[datetime] = set()

    def sample(self) -> None:
        for _state, changed, started in self.worker.activity().values():
            self.moments.update(t for t in (changed, started) if t is not None)

    def watch(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.sample()
            assert self.worker.alive, self.worker.tail()
            time.sleep(0.2)

    def bursts(self, since: datetime, apart: float) -> list[tuple[datetime, datetime]]:
        """(first, last) moment of each burst after ``since``: moments ``apart`` s apart or
        less belong to one burst."""
        found: list[list[datetime]] = []
        for moment in sorted(t for t in self.moments if t > since):
            if found and (moment - found[-1][-1]).total_seconds() <= apart:
                found[-1].append(moment)
            else:
                found.append([moment])
        return [(burst[0], burst[-1]) for burst in found]


def db_now() -> datetime:
    return scalar("SELECT clock_timestamp()")


@pytest.mark.slow
def test_after_a_job_the_ticks_stay_a_whole_interval_apart(workers: Workers) -> None:
    interval = 8.0
    # One tick's statements and the LISTEN probe that follows them (within a second, later
    # on a busy machine) are one burst; the rhythm this test guards against put bursts half
    # an interval apart. A quarter interval between the two leaves room for a slow machine
    # on both sides.
    apart = interval / 4
    reach = timedelta(seconds=apart)
    worker = workers.start("--poll-interval", str(interval), "--reap-interval", str(interval))
    worker.wait_until_idle()
    activity = Activity(worker)
    activity.sample()
    # The start-up burst was the first tick. Half an interval later, a job: whatever the
    # job makes the worker do must not set a second rhythm of its own (the LISTEN probe
    # counted its silence from the last NOTIFY, the poll from the last claim: bursts came
    # half an interval apart).
    ticked = max(activity.moments)
    wait_until(
        lambda: (db_now() - ticked).total_seconds() >= interval / 2,
        interval=0.1,
        message="half an interval after the first tick",
    )
    job_id = Job.objects.enqueue(noop, {}).id
    wait_done(job_id)
    activity.watch(3 * interval + 2)
    finished = job_row(job_id)["finished_at"]
    # Each connection shows only its latest statement, and by the first sample every one
    # the job touched may have moved past the job's finished_at (the outlook after the short
    # claim, the completer's commit): the job's burst is the one that starts within a
    # burst's reach of it. The next tick is half an interval away.
    job_burst = [b for b in activity.bursts(ticked, apart) if b[0] <= finished + reach]
    assert len(job_burst) == 1, (finished, activity.bursts(ticked, apart))
    ticks = activity.bursts(job_burst[0][1], apart)
    starts = [first for first, _last in ticks]
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(starts)]
    assert len(ticks) >= 3, ticks
    assert all(gap >= interval - apart for gap in gaps), (gaps, ticks)
    # A burst is one tick: the claim, the reap, the probe; not seconds of chatter.
    assert all((last - first).total_seconds() <= apart for first, last in ticks), ticks
    stop(worker)


@pytest.mark.slow
def test_after_a_job_a_long_poll_worker_is_silent(workers: Workers) -> None:
    worker = workers.start("--poll-interval", "600", "--reap-interval", "600")
    up(worker)
    wait_done(Job.objects.enqueue(noop, {}).id)
    worker.wait_until_idle()
    quiet = worker.activity()

    window = 12.0
    end = time.monotonic() + window
    while time.monotonic() < end:
        assert worker.activity() == quiet, "the idle worker sent a query"
        assert worker.alive, worker.tail()
        time.sleep(0.2)
    stop(worker)


# -- deferred jobs and retries ---------------------------------------------------------------


def test_a_deferred_job_runs_when_it_comes_due(workers: Workers) -> None:
    worker = workers.start("--poll-interval", "3600", "--reap-interval", "3600")
    up(worker)

    # Its NOTIFY comes at once, when it is not due yet; then nothing but the hour-long poll
    # would look at the table again, unless the worker wakes itself when the job comes due.
    job_id = Job.objects.enqueue(noop, {"deferred": True}, delay=2).id
    row = wait_done(job_id)
    # Run once, and not before it was due (both times from the database's clock).
    assert row["attempts"] == 1
    assert scalar("SELECT attempted_at >= run_at FROM pgjobs_job WHERE id = %s", [job_id])
    stop(worker)


@pytest.mark.parametrize("mode", ["lease", "transaction"])
def test_a_retry_runs_when_it_comes_due(workers: Workers, mode: str) -> None:
    worker = workers.start(
        "--mode", mode, "--poll-interval", "3600", "--reap-interval", "3600", test_jobs=True
    )
    up(worker)

    job_id = fails_first.enqueue(times=1).id
    row = wait_done(job_id)
    assert row["attempts"] == 2
    assert row["last_error"].strip().endswith("RuntimeError: attempt 1 fails on purpose")
    # Its backoff is 1 s after the first attempt (started_at), and the second attempt came
    # once it was due, not an hour later with the poll (attempted_at: the latest claim).
    assert scalar(
        "SELECT run_at >= started_at + interval '1 second' AND attempted_at >= run_at "
        "FROM pgjobs_job WHERE id = %s",
        [job_id],
    )
    worker.wait_for_log("attempt 1/3 retry")
    stop(worker)


# -- LISTEN dead -------------------------------------------------------------------------------


def test_with_listen_dead_the_poll_still_finds_a_notified_job(workers: Workers) -> None:
    # The listen alias points at a port where no server runs: the NOTIFY reaches nobody.
    worker = workers.start(
        "--listen-database",
        "listen",
        "--poll-interval",
        "2",
        "--reap-interval",
        "3600",
        env={"LISTEN_DATABASE_URL": "postgres://postgres@127.0.0.1:1/x"},
    )
    log = worker.wait_for_log("LISTEN connection to listen lost")
    assert "reconnecting in" in log
    wait_until(worker.backends, message="the worker's connection")

    # Only the 2 s poll can find it (the listener is the one thing that would be quicker).
    wait_done(Job.objects.enqueue(noop, {}).id)
    assert not listener_backends()
    assert "LISTEN connection re-established" not in worker.log()
    stop(worker)
