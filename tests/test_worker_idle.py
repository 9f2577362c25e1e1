"""An idle worker: woken by NOTIFY, rescued by its poll or its LISTEN reconnect when a
notification is lost, and otherwise silent (serverless Postgres may suspend meanwhile)."""

from __future__ import annotations

import signal
import threading
import time
from datetime import datetime

import pytest

from django_pgjobs.models import Job
from django_pgjobs.worker import Worker
from testproject.testjobs import noop
from tests.helpers import make_job, wait_until
from tests.workers import Process, Workers, listener_backends, query, run_time, terminate

pytestmark = pytest.mark.django_db(transaction=True)


def up(worker: Process) -> None:
    """Wait until the worker has run a job (so it is past start-up) and LISTENs."""
    job_id = Job.objects.enqueue(noop, {"warm": "up"}).id
    run_time(job_id, timeout=20)
    wait_until(listener_backends, timeout=5, message="the LISTEN connection")


def test_notify_wakes_an_idle_worker_at_once(workers: Workers) -> None:
    worker = workers.start("--poll-interval", "3600", "--reap-interval", "3600")
    up(worker)

    # The poll is an hour away: only the NOTIFY sent when this commits can wake the worker.
    job_id = Job.objects.enqueue(noop, {}).id
    assert run_time(job_id, timeout=5) < 2.0
    worker.send(signal.SIGTERM)
    assert worker.wait(15) == 0


def test_a_job_inserted_without_notify_is_found_by_the_poll(workers: Workers) -> None:
    worker = workers.start("--poll-interval", "2", "--reap-interval", "3600")
    up(worker)

    # Plain SQL, no NOTIFY: as if the notification were lost. The 2 s poll must find it.
    job_id = make_job()
    assert run_time(job_id, timeout=6) < 3.5
    worker.send(signal.SIGTERM)
    assert worker.wait(15) == 0


def test_listener_reconnects_catches_up_and_is_woken_again(workers: Workers) -> None:
    worker = workers.start("--poll-interval", "3600", "--reap-interval", "3600")
    up(worker)
    [before] = listener_backends()

    # Kill only the LISTEN connection, and add a job nobody will announce: the catch-up
    # claim after the LISTEN reconnect is the only thing that can find it (no poll for an hour).
    assert terminate([before]) == 1
    unannounced = make_job()
    assert run_time(unannounced, timeout=5) < 3.0
    log = worker.wait_for_log("LISTEN connection re-established on listen")
    assert "LISTEN connection to listen lost" in log
    [after] = wait_until(listener_backends, timeout=5, message="the new LISTEN connection")
    assert after != before

    # Listening again: a NOTIFY wakes it at once.
    job_id = Job.objects.enqueue(noop, {}).id
    assert run_time(job_id, timeout=5) < 2.0
    worker.send(signal.SIGTERM)
    assert worker.wait(15) == 0


def test_an_idle_worker_sends_no_query(workers: Workers) -> None:
    worker = workers.start("--poll-interval", "600", "--reap-interval", "600")

    def activity() -> dict[int, tuple[str, datetime, datetime]]:
        """pid -> (state, state_change, query_start) for each of the worker's connections."""
        rows = query(
            "SELECT pid, state, state_change, query_start FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name IN (%s, %s)",
            [worker.app_name, "pgjobs-listener"],
        )
        return {pid: (state, changed, started) for pid, state, changed, started in rows}

    # Start-up: the reap, the first claim, LISTEN and its catch-up claim. Settled once its
    # main connection and the LISTEN connection exist, are idle, and stay unchanged for 1 s.
    last: list[dict[int, tuple[str, datetime, datetime]]] = [{}]
    since = [time.monotonic()]

    def settled() -> bool:
        now = activity()
        if now != last[0]:
            last[0], since[0] = now, time.monotonic()
            return False
        states = {state for state, _, _ in now.values()}
        return len(now) >= 2 and states == {"idle"} and time.monotonic() - since[0] >= 1.0

    wait_until(settled, timeout=20, interval=0.1, message="the worker to settle")
    assert worker.backends() and listener_backends()
    quiet = last[0]

    # The observation window: not one statement from any of its connections, and no new
    # connection either (checked every 0.25 s so a poll shows up as soon as it happens).
    window = 9.0
    end = time.monotonic() + window
    while time.monotonic() < end:
        assert activity() == quiet, "the idle worker sent a query"
        assert worker.alive, worker.tail()
        time.sleep(0.25)

    # The instrument works: a job makes the worker's connections move.
    run_time(Job.objects.enqueue(noop, {}).id, timeout=5)
    assert activity() != quiet
    worker.send(signal.SIGTERM)
    assert worker.wait(15) == 0


def test_a_notify_that_comes_while_the_producer_looks_up_due_times_is_not_lost() -> None:
    armed = threading.Event()
    second: list[int] = []

    class NotifiedMidRound(Worker):
        def _next_due(self) -> float | None:
            due = super()._next_due()
            if armed.is_set() and not second:
                # The claim found fewer jobs than free slots, so the producer asks when the
                # next deferred job is due; meanwhile a job arrives (inserted without a
                # NOTIFY) and its notification reaches the worker.
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
        # Past start-up: its LISTEN is up (the listener wakes the producer once it is).
        wait_until(listener_backends, timeout=10, message="the LISTEN connection")
        time.sleep(0.2)
        # A 3-second job, announced to this worker alone, with a free slot beside it.
        first = make_job(task="testproject.testjobs.sleep", payload={"seconds": 3})
        armed.set()
        worker._on_notify()
        thread.join(timeout=20)
        assert not thread.is_alive(), "the worker did not finish its two jobs"
    finally:
        worker.stop()
        thread.join(timeout=15)
    rows = query(
        "SELECT id, status, attempted_at, finished_at FROM pgjobs_job WHERE id = ANY(%s) "
        "ORDER BY id",
        [[first, *second]],
    )
    assert [(job_id, status) for job_id, status, *_ in rows] == [
        (first, "done"),
        (second[0], "done"),
    ]
    (_, _, first_claimed, first_finished), (_, _, second_claimed, _) = rows
    # Claimed at once, into the free slot, not when the first job's end woke the producer.
    assert second_claimed < first_finished
    assert (second_claimed - first_claimed).total_seconds() < 1.5
