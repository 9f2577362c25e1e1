"""An idle worker: woken by NOTIFY, rescued by its poll or its LISTEN reconnect when a
notification is lost, and otherwise silent (serverless Postgres may suspend meanwhile)."""

from __future__ import annotations

import json
import signal
import threading
import time
from datetime import datetime
from datetime import timezone as dt_timezone

import pytest

from django_pgjobs import notify
from django_pgjobs.models import Job
from django_pgjobs.worker import Worker
from testproject.testjobs import noop
from tests.helpers import PATIENCE, make_job, wait_until
from tests.workers import (
    Process,
    Workers,
    listener_backends,
    listener_statements,
    query,
    terminate,
    until_claimed,
    wait_done,
)

pytestmark = pytest.mark.django_db(transaction=True)


def up(worker: Process) -> None:
    """Wait until the worker has run a job (so it is past start-up) and LISTENs."""
    wait_done(Job.objects.enqueue(noop, {"warm": "up"}).id)
    wait_until(listener_backends, message="the LISTEN connection")


def test_notify_wakes_an_idle_worker_at_once(workers: Workers) -> None:
    worker = workers.start("--poll-interval", "3600", "--reap-interval", "3600")
    up(worker)

    # The poll is an hour away: only the NOTIFY sent when this commits can wake the worker
    # (within the minute a test waits at most, however busy the machine).
    wait_done(Job.objects.enqueue(noop, {}).id)
    worker.send(signal.SIGTERM)
    assert worker.wait() == 0


def test_a_job_inserted_without_notify_is_found_by_the_poll(workers: Workers) -> None:
    worker = workers.start("--poll-interval", "2", "--reap-interval", "3600")
    up(worker)

    # Plain SQL, no NOTIFY: as if the notification were lost. Only the poll can find it.
    wait_done(make_job())
    worker.send(signal.SIGTERM)
    assert worker.wait() == 0


def test_listener_reconnects_catches_up_and_is_woken_again(workers: Workers) -> None:
    worker = workers.start("--poll-interval", "3600", "--reap-interval", "3600")
    up(worker)
    [before] = listener_backends()

    # Kill only the LISTEN connection, and add a job nobody will announce: the catch-up
    # claim after the LISTEN reconnect is the only thing that can find it (no poll for an hour).
    assert terminate([before]) == 1
    wait_done(make_job())
    log = worker.wait_for_log("LISTEN connection re-established on listen")
    assert "LISTEN connection to listen lost" in log
    [after] = wait_until(listener_backends, message="the new LISTEN connection")
    assert after != before

    # Listening again: a NOTIFY wakes it (the poll is still an hour away).
    wait_done(Job.objects.enqueue(noop, {}).id)
    worker.send(signal.SIGTERM)
    assert worker.wait() == 0


@pytest.mark.parametrize("schedule", [False, True], ids=["no-schedule", "hourly-schedule"])
def test_an_idle_worker_sends_no_query(workers: Workers, schedule: bool) -> None:
    # With a periodic schedule declared whose next tick is not in the window, too: hourly, at
    # half an hour from now (an `every: 3600` ticks on the hour, which a run just before it
    # would see).
    minute = (datetime.now(dt_timezone.utc).minute + 30) % 60
    hourly = {"hourly": {"task": "tick", "cron": f"{minute} * * * *", "timezone": "UTC"}}
    worker = workers.start(
        "--poll-interval",
        "600",
        "--reap-interval",
        "600",
        test_jobs=schedule,
        env={"PGJOBS_TEST_SCHEDULES": json.dumps(hourly)} if schedule else None,
    )
    if schedule:
        worker.wait_for_log("schedules: hourly")

    # Start-up: the reap, the first claim, LISTEN, its catch-up claim and the LISTEN probe.
    worker.wait_until_idle()
    assert worker.backends() and listener_backends()
    quiet = worker.activity()

    # The observation window: not one statement from any of its connections, and no new
    # connection either (checked every 0.25 s so a poll shows up as soon as it happens).
    window = 9.0
    end = time.monotonic() + window
    while time.monotonic() < end:
        assert worker.activity() == quiet, "the idle worker sent a query"
        assert worker.alive, worker.tail()
        time.sleep(0.25)

    # The instrument works: a job makes the worker's connections move.
    wait_done(Job.objects.enqueue(noop, {}).id)
    assert worker.activity() != quiet
    worker.send(signal.SIGTERM)
    assert worker.wait() == 0


def test_a_notify_that_comes_while_the_producer_looks_up_due_times_is_not_lost() -> None:
    armed = threading.Event()
    second: list[int] = []

    class NotifiedMidRound(Worker):
        def _look(self, since: float) -> float | None:
            due = super()._look(since)
            if armed.is_set() and not second:
                # The claim found fewer jobs than free slots, so the producer asks when the
                # next deferred job is due (the outlook); meanwhile a job arrives (inserted
                # without a NOTIFY) and its notification reaches the worker.
                second.append(make_job())
                self._on_notify()
            return due

    # Its poll is ten minutes away and nothing else announces the second job: only that
    # wake-up can make the producer claim it before the first job ends and frees a slot.
    worker = NotifiedMidRound(
        ["default"], concurrency=2, poll_interval=600, reap_interval=0, max_jobs=2
    )
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        # Past start-up: the LISTEN, its catch-up claim, and the probe that follows them.
        wait_until(lambda: listener_statements() == [notify.PROBE], message="the LISTEN probe")
        # A job that runs until a second job is claimed beside it, announced to this worker
        # alone, with a free slot beside it. Were the wake-up lost, the second job would wait
        # for the first to end, and the first would wait for it in vain (and fail).
        first = make_job(task=until_claimed.name, payload={"count": 2})
        armed.set()
        worker._on_notify()
        thread.join(timeout=2 * PATIENCE)
        assert not thread.is_alive(), "the worker did not finish its two jobs"
    finally:
        worker.stop()
        thread.join(timeout=PATIENCE)
    rows = query(
        "SELECT id, status, attempts, attempted_at, finished_at FROM pgjobs_job "
        "WHERE id = ANY(%s) ORDER BY id",
        [[first, *second]],
    )
    assert [tuple(row[:3]) for row in rows] == [(first, "done", 1), (second[0], "done", 1)]
    (*_, first_finished), (*_, second_claimed, _) = rows
    # Claimed into the free slot, not when the first job's end woke the producer.
    assert second_claimed < first_finished
