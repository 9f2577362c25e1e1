"""Whatever a row holds and whatever a job raises, the worker lives on and each job gets the
outcome it earned: a payload that is not an object fails that job alone; a job's own
connection errors are its failures, not outages; an outage of the queue's database gives the
attempt back, a bounded number of times; a database that comes back after an outage longer
than the lease fails nothing that ran; the single-job verbs fence on the claim."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import signal
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest
from django.db import connection

from django_pgjobs.core.types import Action, Outcome
from django_pgjobs.core.upkeep import REAP_SETTLE
from django_pgjobs.exceptions import InvalidJobOptions
from django_pgjobs.models import Job
from django_pgjobs.notify import Listener
from django_pgjobs.worker.completer import Completer
from django_pgjobs.worker.executor import MAX_OUTAGE_RELEASES
from django_pgjobs.worker.outcomes import WorkerStats
from django_pgjobs.worker.store import Store
from scripts.pgserver import ThrowawayPostgres
from testproject.testjobs import (
    connect_elsewhere,
    drop_own_connection,
    drop_own_connection_in_atomic,
    fails_while_handling_a_connection_error,
    noop,
    query_then_connect_elsewhere,
    sleep,
)
from tests.helpers import job_row, query, wait_until
from tests.workers import (
    Workers,
    break_own_connection_quietly,
    counts,
    leave_a_transaction_open,
    query_on_a_copy_too,
    stuck_until_order,
    stuck_until_order_started,
    write_order,
)

pytestmark = pytest.mark.django_db(transaction=True)


@contextlib.contextmanager
def without_payload_check() -> Iterator[None]:
    """A table from before the payload check: rows whose payload is not an object exist."""
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE pgjobs_job DISABLE TRIGGER pgjobs_job_payload_check")
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DELETE FROM pgjobs_job WHERE jsonb_typeof(payload) <> 'object'")
            cursor.execute("ALTER TABLE pgjobs_job ENABLE ALWAYS TRIGGER pgjobs_job_payload_check")


def test_a_payload_that_is_not_an_object_fails_that_job_and_no_other(workers: Workers) -> None:
    good = Job.objects.enqueue_many(noop, [{"n": 1}, {"n": 2}, {"n": 3}])
    with without_payload_check():
        bad = [
            row[0]
            for row in query(
                "INSERT INTO pgjobs_job (task, payload, run_at) "
                "SELECT %s, p, now() FROM unnest(%s::jsonb[]) AS p RETURNING id",
                [
                    noop.name,
                    ['"just text"', '"{\\"n\\": 4}"', "[1, 2]", "null", "7"],
                ],
            )
        ]
        worker = workers.burst("--concurrency", "2", "--batch-size", "10")
        # One burst ran everything: no worker died, and the bad rows did not come back.
        assert worker.popen.returncode == 0
        assert counts() == {"done": len(good), "failed": len(bad)}
        for job_id in bad:
            row = job_row(job_id)
            assert row["attempts"] == 1
            assert "InvalidPayload" in row["last_error"]
            assert "not an object" in row["last_error"]
        # A JSON string holding JSON is not decoded a second time into arguments.
        assert "a JSON str" in job_row(bad[1])["last_error"]


def test_an_object_payload_python_cannot_read_back_fails_that_job_alone(workers: Workers) -> None:
    """jsonb holds integers past Python's conversion limit (4,300 digits), and nesting deeper
    than some Pythons read back (3.11 stops short of 3,000 levels, 3.13 does not); such a row
    used to crash every worker that claimed it."""
    good = Job.objects.enqueue_many(noop, [{"n": 1}, {"n": 2}])
    ((long_int,), (deep,)) = query(
        "INSERT INTO pgjobs_job (task, payload) VALUES "
        "(%(task)s, ('{\"n\": ' || repeat('9', 5000) || '}')::jsonb), "
        "(%(task)s, (repeat('{\"a\": ', 3000) || '1' || repeat('}', 3000))::jsonb) "
        "RETURNING id",
        {"task": noop.name},
    )
    worker = workers.burst("--concurrency", "2")
    assert worker.popen.returncode == 0

    def outcome(job_id: int) -> tuple[str, int, str | None]:
        ((status, attempts, error),) = query(
            "SELECT status, attempts, last_error FROM pgjobs_job WHERE id = %s", [job_id]
        )
        return status, attempts, error

    assert [outcome(job_id)[0] for job_id in good] == ["done", "done"]
    status, attempts, error = outcome(long_int)
    assert (status, attempts) == ("failed", 1)
    assert error is not None and "InvalidPayload" in error and "cannot be read back" in error
    # Run, where this Python reads it back; else failed like the long integer.
    status, attempts, error = outcome(deep)
    assert status == "done" or (
        (status, attempts) == ("failed", 1) and error is not None and "cannot be read back" in error
    ), (status, attempts, error)


def test_a_jobs_own_connection_error_is_its_failure(workers: Workers) -> None:
    elsewhere = connect_elsewhere.enqueue()
    in_handler = fails_while_handling_a_connection_error.enqueue()
    after_a_query = query_then_connect_elsewhere.enqueue()
    worker = workers.start("--concurrency", "2", "--poll-interval", "0.2")
    wait_until(
        lambda: (
            {job_row(j.id)["status"] for j in (elsewhere, in_handler, after_a_query)} == {"failed"}
        ),
        timeout=60,
        message="the three jobs to fail for good",
    )
    worker.send(signal.SIGTERM)
    assert worker.wait(30) == 0
    for job in (elsewhere, in_handler, after_a_query):
        row = job_row(job.id)
        # Both attempts counted, then failed for good: never released and claimed again.
        assert (row["status"], row["attempts"]) == ("failed", 2), row
        assert scalar_outages(job.id) == 0
    assert "ValueError: gave up" in job_row(in_handler.id)["last_error"]


def test_a_job_that_returns_with_its_connection_mid_transaction_or_broken_spoils_no_next_job(
    workers: Workers,
) -> None:
    # Each pair runs on one executor thread, the spoiler first: the spoiler raises nothing,
    # so the worker tidies only the connections the thread opened (db.tidy_opened()). The job
    # after it must find a connection in autocommit that works: its write commits, the first
    # attempt, no outage counted.
    left_open = Job.objects.enqueue(
        leave_a_transaction_open, {"email": "never-committed@example.com"}, priority=2
    )
    after_open = Job.objects.enqueue(write_order, {"email": "after-open@example.com"}, priority=1)
    broken = Job.objects.enqueue(break_own_connection_quietly, priority=0)
    after_broken = Job.objects.enqueue(
        write_order, {"email": "after-broken@example.com"}, priority=-1
    )
    workers.burst("--concurrency", "1", test_jobs=True)
    for job in (left_open, after_open, broken, after_broken):
        row = job_row(job.id)
        assert (row["status"], row["attempts"], scalar_outages(job.id)) == ("done", 1, 0), row
    emails = {email for (email,) in query("SELECT email FROM shop_order")}
    assert emails == {"after-open@example.com", "after-broken@example.com"}


def test_a_second_connection_to_the_same_alias_does_not_hide_the_first_from_tidying(
    workers: Workers,
) -> None:
    # The thread's connection is opened first, then a copy of it: both are the thread's, and
    # the one left mid-transaction by the next job must still be closed after it.
    on_a_copy = Job.objects.enqueue(query_on_a_copy_too, priority=2)
    left_open = Job.objects.enqueue(
        leave_a_transaction_open, {"email": "never-committed@example.com"}, priority=1
    )
    after_open = Job.objects.enqueue(write_order, {"email": "after-open@example.com"}, priority=0)
    workers.burst("--concurrency", "1", test_jobs=True)
    for job in (on_a_copy, left_open, after_open):
        assert job_row(job.id)["status"] == "done"
    assert [email for (email,) in query("SELECT email FROM shop_order")] == [
        "after-open@example.com"
    ]


def test_a_job_claimed_again_before_its_old_outcome_is_forgotten_stays_held() -> None:
    # A release (or a retry without backoff) is written, and the producer claims the job
    # again at once, before the completer forgets the old claim: it used to forget the new
    # one (by id), so its executor skipped it as not ours and the job waited out its lease
    # `running` (both outage tests above hung so, now and then, on a loaded machine).
    store = Store("default", direct=True, synchronous_commit=None, prepare=False)
    stats = WorkerStats()
    completer = Completer(store, timedelta(minutes=5), stats, "test")
    try:
        job_id = drop_own_connection.enqueue().id
        (old,) = Job.objects.claim(limit=1)
        again = dataclasses.replace(old, claimed_at=old.claimed_at + timedelta(seconds=1))
        completer.hold([old])
        completer.hold([again])  # as the producer's next claim of the same job would
        completer.start()
        completer.record(Outcome(old, Action.RELEASE))
        # The old claim's outcome is counted once the completer has forgotten that claim.
        wait_until(lambda: stats.released == 1, message="the release to be written")
        assert job_row(job_id)["status"] == "queued"
        assert completer.holds(again)
        assert not completer.holds(old)
    finally:
        completer.close(timeout=5)
        store.close()


def scalar_outages(job_id: int) -> int:
    return int(query("SELECT outage_releases FROM pgjobs_job WHERE id = %s", [job_id])[0][0])


def test_an_outage_of_the_queue_database_is_released_a_bounded_number_of_times(
    workers: Workers,
) -> None:
    released = drop_own_connection.enqueue()
    capped = drop_own_connection.enqueue()
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE pgjobs_job SET outage_releases = %s WHERE id = %s",
            [MAX_OUTAGE_RELEASES, capped.id],
        )
    worker = workers.start("--concurrency", "1", "--poll-interval", "0.2")
    # The first job's connection to the queue's database broke: given back, attempt not
    # counted, once more each time, until the cap; the capped one fails on its attempts.
    wait_until(lambda: job_row(capped.id)["status"] == "failed", timeout=60, message="capped job")
    wait_until(
        lambda: job_row(released.id)["status"] == "failed", timeout=120, message="released job"
    )
    worker.send(signal.SIGTERM)
    assert worker.wait(30) == 0
    row = job_row(released.id)
    assert scalar_outages(released.id) == MAX_OUTAGE_RELEASES
    assert row["attempts"] == 2
    assert scalar_outages(capped.id) == MAX_OUTAGE_RELEASES
    assert job_row(capped.id)["attempts"] == 2
    assert "released" in worker.log() and "met a database outage; releasing it" in worker.log()


def test_a_connection_lost_inside_the_jobs_atomic_block_is_an_outage(workers: Workers) -> None:
    # Django reconnects as the atomic() block ends on the dead connection: the job's
    # connection was replaced, though the database itself answers again.
    job = drop_own_connection_in_atomic.enqueue()
    worker = workers.start("--concurrency", "1", "--poll-interval", "0.2")
    wait_until(lambda: scalar_outages(job.id) >= 2, message="the job to be released twice")
    worker.send(signal.SIGTERM)
    assert worker.wait(30) == 0
    assert job_row(job.id)["attempts"] <= 1  # every release gave its attempt back


def test_the_single_job_verbs_fence_on_the_claim_time() -> None:
    Job.objects.enqueue(noop, {})
    (first,) = Job.objects.claim("default", limit=1)
    assert Job.objects.release(first)
    (second,) = Job.objects.claim("default", limit=1)
    assert (second.id, second.attempts) == (first.id, first.attempts)
    # The first claim's id and attempts match the second claim; its claim time does not.
    assert not Job.objects.complete(first)
    assert not Job.objects.release(first)
    assert Job.objects.fail(first, error="late") is None
    assert not Job.objects.extend_lease(first)
    assert job_row(second.id)["status"] == "running"
    # The plain form cannot tell the claims apart: its documented limit.
    assert Job.objects.extend_lease(first.id, first.attempts)
    assert Job.objects.complete(second, result={"ok": True})
    assert job_row(second.id)["status"] == "done"


def test_the_single_job_verbs_refuse_a_claim_they_cannot_fence() -> None:
    job = Job.objects.enqueue(noop, {})
    (claimed,) = Job.objects.claim("default", limit=1)
    with pytest.raises(InvalidJobOptions, match="ClaimedJob alone"):
        Job.objects.complete(claimed, 1)
    with pytest.raises(InvalidJobOptions, match="job id and its attempts"):
        Job.objects.complete(job.id)
    assert job_row(job.id)["status"] == "running"


@pytest.mark.slow
@pytest.mark.django_db(transaction=False)
@pytest.mark.parametrize("outage", ["restart", "refused"])
def test_an_outage_longer_than_the_lease_fails_nothing_that_ran(
    workers: Workers, outage: str
) -> None:
    """Three workers hold jobs through an outage three times the lease; when the database is
    back, what ran is done and what was to be given back is queued: nothing is failed as
    expired, not even jobs with a single attempt. Either the server restarts (nothing is
    reaped in its first minute), or it stays up, past its first minute, but refuses and
    drops every connection (each worker reaps nothing for a minute after it saw that)."""
    total = 300
    with ThrowawayPostgres() as pg:
        server = psycopg.connect(pg.url, autocommit=True)

        def status() -> dict[str, int]:
            rows = server.execute("SELECT status, count(*) FROM pgjobs_job GROUP BY 1").fetchall()
            return dict(rows)

        def age() -> float:
            row = server.execute(
                "SELECT extract(epoch FROM now() - pg_postmaster_start_time())::float8"
            ).fetchone()
            return float(row[0]) if row else 0.0

        try:
            workers.run("migrate", "--verbosity", "0", database_url=pg.url, timeout=120)
            if outage == "refused":
                wait_until(
                    lambda: age() > REAP_SETTLE.total_seconds() + 1,
                    timeout=120,
                    message="the server's first minute to pass",
                )
            server.execute(
                "INSERT INTO pgjobs_job (task, payload, max_attempts) "
                "SELECT %s, jsonb_build_object('seconds', 0.5), 1 FROM generate_series(1, %s)",
                [sleep.name, total],
            )
            started = [
                workers.start(
                    "--concurrency",
                    "4",
                    "--lease",
                    "2",
                    "--reap-interval",
                    "1",
                    "--poll-interval",
                    "1",
                    database_url=pg.url,
                )
                for _ in range(3)
            ]
            wait_until(lambda: status().get("done", 0) >= 20, timeout=60, message="a start")
            if outage == "restart":
                server.close()
                pg.stop()
                time.sleep(6)  # the outage itself: three leases long
                pg.start()
                server = psycopg.connect(pg.url, autocommit=True)
            else:
                server.close()
                # From another database: one cannot refuse connections to one's own.
                with psycopg.connect(
                    pg.url.rsplit("/", 1)[0] + "/template1", autocommit=True
                ) as admin:
                    admin.execute("ALTER DATABASE postgres ALLOW_CONNECTIONS false")
                    admin.execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE datname = 'postgres' AND backend_type = 'client backend'"
                    )
                    time.sleep(6)  # the outage itself: three leases long
                    admin.execute("ALTER DATABASE postgres ALLOW_CONNECTIONS true")
                server = psycopg.connect(pg.url, autocommit=True)
            wait_until(lambda: status().get("done", 0) == total, timeout=180, message="all done")
            assert status() == {"done": total}
            expired = server.execute(
                "SELECT count(*) FROM pgjobs_job WHERE errors::text LIKE '%LeaseExpired%'"
            ).fetchone()
            assert expired == (0,)
            for worker in started:
                worker.send(signal.SIGTERM)
            for worker in started:
                assert worker.wait(30) == 0
        finally:
            server.close()


def test_a_second_signal_ends_the_leases_it_holds(workers: Workers) -> None:
    # Jobs that run until told and a ten-minute shutdown timeout: only the second signal can
    # end this worker. Two attempts each (the job's own default is one), so that the reap
    # can requeue them.
    jobs = Job.objects.enqueue_many(
        stuck_until_order, [{"email": "a"}, {"email": "b"}], max_attempts=2
    )
    worker = workers.start(
        "--concurrency", "2", "--lease", "300", "--shutdown-timeout", "600", test_jobs=True
    )
    # Both functions run, not only their claims: a stop while a claim is on its way to the
    # executors gives its jobs back unstarted, and the worker exits on the first signal.
    wait_until(lambda: stuck_until_order_started("a", "b"), message="both jobs to start")
    worker.send(signal.SIGINT)
    worker.wait_for_log("SIGINT: stopping")
    worker.send(signal.SIGINT)
    assert worker.wait(30) == 1
    assert "the leases of 2 jobs it held end now" in worker.log()
    # Expired now, not in 300 s: the next reap requeues them, each with its attempt kept and
    # no crash counted (the worker ended the leases; it did not die holding them).
    for job_id in jobs:
        assert query("SELECT locked_until <= now() FROM pgjobs_job WHERE id = %s", [job_id]) == [
            (True,)
        ]
    reaped = Job.objects.reap()
    assert sorted(reaped) == [(job_id, "queued", 1) for job_id in sorted(jobs)]
    assert query("SELECT crashes FROM pgjobs_job WHERE id = ANY(%s)", [jobs]) == [(0,), (0,)]


def wakeups(thread: threading.Thread) -> int:
    """How often the kernel woke ``thread`` from a wait (its voluntary context switches)."""
    status = Path(f"/proc/self/task/{thread.native_id}/status").read_text()
    return int(re.search(r"voluntary_ctxt_switches:\s+(\d+)", status)[1])  # type: ignore[index]


def test_an_idle_listener_sleeps_until_stopped() -> None:
    """An idle listener waits on its socket and its pipe alone: it does not wake to look for
    a stop (a worker used to take up to a second to exit), and stop() ends it at once."""
    connected = threading.Event()
    listener = Listener("default", ["default"], connected.set)
    listener.start()
    try:
        assert connected.wait(30)
        # Asleep in its wait for the socket or the pipe, past the catch-up wake-up.
        wchan = Path(f"/proc/self/task/{listener.native_id}/wchan")
        wait_until(lambda: "poll" in wchan.read_text(), message="the listener to wait")
        before = wakeups(listener)
        time.sleep(2.5)  # two and a half polls of the old one-second timeout
        assert wakeups(listener) == before
    finally:
        listener.stop()
        listener.join(60)
    assert not listener.is_alive()


def test_a_thread_connected_before_counting_began_still_has_its_connection_noted() -> None:
    """``queue_connection()`` takes "never opened" for "not open" only on an executor thread,
    whose every connection is counted. Elsewhere (``testing.run_jobs`` on a thread that
    connected before the worker's modules were imported) it looks the connection up, so an
    outage that breaks it is still told by it."""
    from django.db import connections
    from django.db.backends.signals import connection_created

    from django_pgjobs.worker import db

    seen: dict[str, object] = {}

    def uncounted_then_counted() -> None:
        connection_created.disconnect(db._count_opened)
        try:
            connections["default"].ensure_connection()
        finally:
            connection_created.connect(db._count_opened)
        try:
            seen["before"] = db.queue_connection("default").connection
            seen["actual"] = connections["default"].connection
            connections["default"].close()
            # From here on, as on an executor thread: no look-up while nothing is open...
            db.count_from_start()
            seen["closed"] = db.queue_connection("default").connection
            # ...and the connection opened next is counted, then found.
            connections["default"].ensure_connection()
            seen["counted"] = db.queue_connection("default").connection
            seen["reopened"] = connections["default"].connection
        finally:
            connections.close_all()

    thread = threading.Thread(target=uncounted_then_counted)
    thread.start()
    thread.join()
    assert seen["actual"] is not None
    assert seen["before"] is seen["actual"]
    assert seen["closed"] is None
    assert seen["reopened"] is not None
    assert seen["counted"] is seen["reopened"]


def test_a_second_signal_ends_the_leases_while_the_producer_holds_the_completers_lock() -> None:
    """A second SIGTERM's handler runs on the producer's thread, which may be inside one of
    its calls to the completer, holding its lock; the handler reads the held jobs all the
    same and ends their leases (a lock that is not reentrant would hang it for ever)."""
    from django_pgjobs.worker.worker import Worker

    created = noop.enqueue(n=1)
    (claimed,) = Job.objects.claim(limit=1, lease=timedelta(minutes=5))
    store = Store("default", direct=False, synchronous_commit=None, prepare=False)
    completer = Completer(store, timedelta(minutes=5), WorkerStats(), "test:1")
    completer.hold([claimed])
    worker = Worker(["default"], concurrency=1, burst=True)
    worker._completer = completer
    ended: list[int] = []

    def interrupted_producer() -> None:
        with completer._lock:
            ended.append(worker._expire_held())

    thread = threading.Thread(target=interrupted_producer, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "the handler hung on the completer's lock"
    assert ended == [1]
    assert job_row(created.id)["locked_until"] <= query("SELECT now()")[0][0]
