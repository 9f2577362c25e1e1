"""A busy worker's completions ride with its next claim (``claim.CLAIM_COMPLETING``): one
statement, one transaction, each completion still fenced, and nothing written when it fails.

The worker's own parts run in this process: a lease-mode producer side (``LeaseMode``), a
completer started only when the test says, and executors that run only when the test hands
them a job."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import pytest
from django.db import connection

from django_pgjobs.core import conf, finish
from django_pgjobs.core.types import Action, ClaimedJob
from django_pgjobs.models import Job
from django_pgjobs.worker import completer as completer_module
from django_pgjobs.worker.completer import Completer
from django_pgjobs.worker.db import unavailable
from django_pgjobs.worker.executor import Shared
from django_pgjobs.worker.lease import LeaseMode
from django_pgjobs.worker.outcomes import WorkerStats
from django_pgjobs.worker.store import Store
from testproject.testjobs import noop, sleep
from tests.helpers import listening, wait_until
from tests.workers import Workers, counts, done, query, ride_audit_installed, rides, scalar

pytestmark = pytest.mark.django_db(transaction=True)


@dataclass
class Parts:
    store: Store
    stats: WorkerStats
    completer: Completer
    mode: LeaseMode
    handed: list[ClaimedJob]

    def run(self, job: ClaimedJob) -> None:
        """Run ``job`` on this thread as an executor would: its outcome goes to the completer."""
        self.mode.execute(job)


@pytest.fixture
def parts() -> Iterator[Parts]:
    lease = timedelta(minutes=5)
    store = Store("default", direct=True, synchronous_commit=None, prepare=False)
    stats = WorkerStats()
    handed: list[ClaimedJob] = []
    completer = Completer(store, lease, stats, "test", with_claims=True)
    shared = Shared(
        store, lease, "test", stats, threading.Event(), lambda *items: handed.extend(items)
    )
    try:
        yield Parts(store, stats, completer, LeaseMode(shared, completer), handed)
    finally:
        if completer.is_alive():
            completer.close(timeout=5)
        store.close()


def enqueue(count: int) -> list[int]:
    return [Job.objects.enqueue(noop, {"n": n}).id for n in range(count)]


def row(job_id: int) -> tuple[str, int, str]:
    """A job's status, attempts, and the id of the transaction that last wrote it."""
    ((status, attempts, xmin),) = query(
        "SELECT status, attempts, xmin::text FROM pgjobs_job WHERE id = %s", [job_id]
    )
    return status, attempts, xmin


def test_a_completion_rides_with_the_next_busy_claim_in_its_transaction(parts: Parts) -> None:
    first, second, third = enqueue(3)
    assert parts.mode.dispatch("default", 1) == 1
    parts.run(parts.handed[0])
    assert row(first)[:2] == ("running", 1)  # recorded, not written: the completer is not started

    # Busy (the first job is still held until its outcome is written): the plain claim, which
    # takes the waiting completion along.
    assert parts.mode.dispatch("default", 2) == 2
    assert [job.id for job in parts.handed] == [first, second, third]
    done, claimed = row(first), [row(second), row(third)]
    assert done[:2] == ("done", 1)
    assert [r[:2] for r in claimed] == [("running", 1), ("running", 1)]
    # One transaction wrote all three rows.
    assert {r[2] for r in claimed} == {done[2]}
    assert parts.completer.take_completions() == []

    # The completer counts and forgets what the claim wrote, as it does its own writes.
    parts.completer.start()
    wait_until(lambda: parts.stats.done == 1, message="the ridden completion to be counted")
    assert {job.id for job in parts.completer.held()} == {second, third}


def test_a_ridden_completion_is_fenced(parts: Parts, caplog: pytest.LogCaptureFixture) -> None:
    first, second = enqueue(2)
    assert parts.mode.dispatch("default", 1) == 1
    parts.run(parts.handed[0])
    # Cancelled after its function returned, before the outcome reached the table.
    Job.objects.cancel([first])
    cancelled = row(first)

    with caplog.at_level(logging.WARNING, logger="django_pgjobs"):
        assert parts.mode.dispatch("default", 1) == 1

    # The fence refused the completion; the claim in the same statement went through.
    assert row(first) == cancelled
    assert row(second)[:2] == ("running", 1)
    assert f"complete of job {first} (attempt 1) changed nothing" in caplog.text
    parts.completer.start()
    wait_until(lambda: parts.stats.cancelled == 1, message="the refused completion counted")
    assert (parts.stats.done, parts.stats.lost) == (0, 0)


def test_a_claim_that_meets_an_outage_gives_its_completions_back(parts: Parts) -> None:
    first, second = enqueue(2)
    assert parts.mode.dispatch("default", 1) == 1
    parts.run(parts.handed[0])
    # The producer's own connection is cut before its next claim.
    pid = parts.store.direct.get().info.backend_pid  # type: ignore[union-attr]
    assert scalar("SELECT pg_terminate_backend(%s)", [pid]) is True

    with pytest.raises(Exception) as raised:
        parts.mode.dispatch("default", 1)

    assert unavailable(raised.value)
    # Neither part was written; the completion is the completer's again.
    assert row(first)[:2] == ("running", 1)
    assert row(second)[:2] == ("queued", 0)
    assert [(o.job.id, o.action) for o in parts.completer._pending] == [(first, Action.COMPLETE)]
    parts.store.close()
    parts.completer.start()
    wait_until(lambda: parts.stats.done == 1, message="the completer to write and count it")
    assert row(first)[:2] == ("done", 1)
    assert parts.mode.dispatch("default", 1) == 1
    assert row(second)[:2] == ("running", 1)


def refuse_done(job_id: int) -> list[str]:
    """A rule of the user's, in the database: this one job may not be marked done."""
    return [
        """
        CREATE FUNCTION refuse_done() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN RAISE EXCEPTION 'this job may not be done'; END $$
        """,
        "CREATE TRIGGER refuse_done BEFORE UPDATE ON pgjobs_job FOR EACH ROW "
        f"WHEN (NEW.status = 'done' AND NEW.id = {job_id:d}) EXECUTE FUNCTION refuse_done()",
    ]


def test_a_completion_the_database_refuses_does_not_stop_the_claim(
    parts: Parts, caplog: pytest.LogCaptureFixture
) -> None:
    first, second = enqueue(2)
    with connection.cursor() as cursor:
        for statement in refuse_done(first):
            cursor.execute(statement)
    try:
        assert parts.mode.dispatch("default", 1) == 1
        parts.run(parts.handed[0])

        with caplog.at_level(logging.WARNING, logger="django_pgjobs"):
            assert parts.mode.dispatch("default", 1) == 1

        # The claim was made again without the completion, which went back to the completer.
        assert "claiming with 1 completions failed" in caplog.text
        assert row(second)[:2] == ("running", 1)
        assert [o.job.id for o in parts.completer._pending] == [first]
        # The completer writes it on its own, fails alone, and drops it (its lease will expire
        # and the reaper will take it back).
        parts.completer.start()
        wait_until(lambda: not parts.completer._pending, message="the completer to try it")
        wait_until(
            lambda: f"could not record the outcome of job {first}" in caplog.text,
            message="the completer to give up on it",
        )
        assert row(first)[:2] == ("running", 1)
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DROP TRIGGER refuse_done ON pgjobs_job")
            cursor.execute("DROP FUNCTION refuse_done()")


def test_completions_wait_for_a_claim_only_while_the_producer_will_make_one(
    parts: Parts, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second, third = enqueue(3)
    parts.completer.start()
    assert parts.mode.dispatch("default", 1) == 1
    parts.run(parts.handed[0])
    # Not riding (the producer will not claim): written at once.
    wait_until(lambda: parts.stats.done == 1, message="the completion written")
    assert row(first)[:2] == ("done", 1)

    # Riding, with no bound on the wait: the completion waits for the claim. The completer
    # computes its wait only once it found nothing to write: that it did so with the
    # completion pending shows the completion held.
    monkeypatch.setattr(completer_module, "RIDE_WAIT", 3600.0)
    holding = threading.Event()
    wait = Completer._wait

    def noting_wait(completer: Completer) -> float:
        if completer._pending:
            holding.set()
        return wait(completer)

    monkeypatch.setattr(Completer, "_wait", noting_wait)
    parts.completer.ride(True)
    assert parts.mode.dispatch("default", 1) == 1
    parts.run(parts.handed[1])
    assert holding.wait(60), "the completer never held the completion"
    assert [o.job.id for o in parts.completer._pending] == [second]
    assert row(second)[:2] == ("running", 1)
    # ...until the producer says it will make none.
    parts.completer.ride(False)
    wait_until(lambda: parts.stats.done == 2, message="the completion written once not riding")
    assert row(second)[:2] == ("done", 1)

    # The wait is bounded: riding, but no claim comes.
    monkeypatch.setattr(completer_module, "RIDE_WAIT", 0.02)
    parts.completer.ride(True)
    assert parts.mode.dispatch("default", 1) == 1
    parts.run(parts.handed[2])
    wait_until(lambda: parts.stats.done == 3, message="the completion written without a claim")
    assert row(third)[:2] == ("done", 1)


def test_a_guarded_queues_completions_never_wait_for_a_claim(
    parts: Parts, monkeypatch: pytest.MonkeyPatch
) -> None:
    limited = Job.objects.enqueue(noop, {}, queue="limited").id
    monkeypatch.setattr(completer_module, "RIDE_WAIT", 3600.0)
    parts.completer.start()
    # The producer claims "limited" through the guarded claim, which takes no completions:
    # under a limit the finished job counts until it is written.
    parts.completer.ride(True, frozenset({"limited"}))
    assert parts.mode.dispatch("limited", 1) == 1
    parts.run(parts.handed[0])
    wait_until(lambda: parts.stats.done == 1, message="the guarded queue's completion written")
    assert row(limited)[:2] == ("done", 1)


def test_a_job_of_the_guarded_claim_never_rides_and_its_end_wakes_its_queue(
    parts: Parts, monkeypatch: pytest.MonkeyPatch
) -> None:
    Job.objects.set_limits("limited", concurrency=1)
    first, second = (Job.objects.enqueue(noop, {}, queue="limited").id for _ in range(2))
    monkeypatch.setattr(completer_module, "RIDE_WAIT", 3600.0)
    with listening(conf.channel()) as listener:
        parts.completer.start()
        # The producer will make a plain claim, and does not (yet) know "limited" is guarded:
        # the completion would wait for that claim, which would write it without a word.
        parts.completer.ride(True)
        assert parts.mode.dispatch("limited", 1, True) == 1
        assert parts.handed[0].guarded
        parts.run(parts.handed[0])
        wait_until(lambda: parts.stats.done == 1, message="the guarded job's completion")
        assert parts.completer.take_completions() == []
        assert row(first)[:2] == ("done", 1)
        # Its slot is free and the second job ready: word to the queue's workers.
        wait_until(lambda: listener.heard() == ["limited"], message="word of the freed slot")
        # The plain claim's jobs give none.
        plain = Job.objects.enqueue(noop, {}).id
        assert listener.heard() == ["default"]  # the enqueue's own
        parts.completer.ride(False)
        assert parts.mode.dispatch("default", 1) == 1
        parts.run(parts.handed[1])
        wait_until(lambda: parts.stats.done == 2, message="the plain job's completion")
        assert row(plain)[:2] == ("done", 1)
        assert listener.heard() == []
        assert row(second)[0] == "queued"


def test_a_word_that_cannot_be_sent_loses_nothing_written(
    parts: Parts, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    Job.objects.set_limits("limited", concurrency=1)
    first, second = (Job.objects.enqueue(noop, {}, queue="limited").id for _ in range(2))
    # The server refuses the word: a channel name longer than it allows.
    monkeypatch.setattr(
        finish,
        "WAKE_FREED",
        "SELECT pg_notify(repeat('x', 100), 'limited') WHERE %(ids)s IS NOT NULL",
    )
    parts.completer.start()
    assert parts.mode.dispatch("limited", 1, True) == 1
    parts.run(parts.handed[0])
    wait_until(
        lambda: "could not tell other workers" in caplog.text, message="the lost word logged"
    )
    assert parts.stats.done == 1
    assert row(first)[:2] == ("done", 1)
    # The outcome is counted and its claim forgotten; the completer goes on writing.
    assert not parts.completer.holds_any()
    assert parts.mode.dispatch("limited", 1, True) == 1
    parts.run(parts.handed[1])
    wait_until(lambda: parts.stats.done == 2, message="the next outcome written")
    assert row(second)[:2] == ("done", 1)


def test_completions_a_claim_failed_on_are_written_apart_from_then_on(
    parts: Parts, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Completions wait for a claim however long the test takes to make one.
    monkeypatch.setattr(completer_module, "RIDE_WAIT", 3600.0)
    refused, good, *rest = enqueue(6)
    with connection.cursor() as cursor:
        for statement in refuse_done(refused):
            cursor.execute(statement)
    try:
        parts.completer.start()
        parts.completer.ride(True)
        assert parts.mode.dispatch("default", 2) == 2
        with caplog.at_level(logging.WARNING, logger="django_pgjobs"):
            for job in parts.handed[:2]:
                parts.run(job)
            # Busy claims, one after another, as a busy worker makes them: the first takes
            # both completions and fails on one; from then on they are the completer's.
            for _ in range(4):
                assert parts.mode.dispatch("default", 1) == 1
            wait_until(
                lambda: f"could not record the outcome of job {refused}" in caplog.text,
                message="the completer to give up on the refused completion",
            )
        assert caplog.text.count("claiming with 2 completions failed") == 1
        assert "claiming with 1 completions failed" not in caplog.text
        wait_until(lambda: parts.stats.done == 1, message="the good completion counted")
        assert row(good)[:2] == ("done", 1)
        assert row(refused)[:2] == ("running", 1)
        assert [row(job_id)[:2] for job_id in rest] == [("running", 1)] * 4
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DROP TRIGGER refuse_done ON pgjobs_job")
            cursor.execute("DROP FUNCTION refuse_done()")


@pytest.mark.parametrize("with_claims", [True, False], ids=["with-claims", "apart"])
def test_a_busy_worker_process_writes_completions_with_its_claims_unless_told_not_to(
    workers: Workers, with_claims: bool
) -> None:
    # Every transaction that updates jobs notes how many it finished and how many it claimed.
    with ride_audit_installed():
        Job.objects.enqueue_many(noop, [{"n": n} for n in range(400)])
        worker = workers.burst(
            "--concurrency",
            "4",
            "--reap-interval",
            "0",
            env={"PGJOBS_COMPLETE_WITH_CLAIM": str(with_claims).lower()},
        )

        assert counts() == {"done": 400}
        assert query("SELECT attempts, count(*) FROM pgjobs_job GROUP BY attempts") == [(1, 400)]
        assert "ran 400 jobs: 400 done" in worker.output()
        # Some transactions did both (the completions rode with the claims), or, told not
        # to, none did.
        both, _rode, finished = rides()
        assert (both > 0) is with_claims
        assert finished == 400


def test_a_worker_whose_completions_ride_with_its_claims_writes_them_all_on_sigterm(
    workers: Workers,
) -> None:
    # After the signal no claim comes: the completions held for one must be written apart.
    total = 2000
    with ride_audit_installed():
        Job.objects.enqueue_many(sleep, [{"seconds": 0.01 + (i % 7) / 1000} for i in range(total)])
        worker = workers.start(
            "--concurrency",
            "8",
            "--poll-interval",
            "600",
            env={"PGJOBS_COMPLETE_WITH_CLAIM": "true"},
        )
        wait_until(lambda: done() >= 300, message="a few hundred jobs to be done")
        worker.send(signal.SIGTERM)
        assert worker.wait() == 0, worker.tail()

        finished = counts()
        # Every job it claimed is done, once; the rest are queued as they were enqueued.
        assert set(finished) == {"done", "queued"} and finished["done"] < total
        assert query(
            "SELECT attempts, count(*) FROM pgjobs_job GROUP BY attempts ORDER BY attempts"
        ) == [
            (0, finished["queued"]),
            (1, finished["done"]),
        ]
        assert query(
            "SELECT count(*) FROM pgjobs_job WHERE status = 'queued' "
            "AND (locked_until IS NOT NULL OR started_at IS NOT NULL)"
        ) == [(0,)]
        assert (
            f"ran {finished['done']} jobs: {finished['done']} done, 0 to retry, 0 failed, "
            "0 lost" in worker.output()
        )
        both, rode, written = rides()
        assert both > 0 and 0 < rode <= written == finished["done"]
