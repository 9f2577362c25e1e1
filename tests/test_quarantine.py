"""Quarantine: a job whose attempts end with its worker dead is failed after
``PGJOBS["MAX_CRASHES"]`` such attempts in a row, not after ``max_attempts`` dead workers; the
jobs that ran beside it do not pay for it."""

from __future__ import annotations

import signal
import threading
from datetime import timedelta

import pytest
from django.core import checks
from django.db import transaction
from django.test import override_settings

from django_pgjobs.core.types import ClaimedJob
from django_pgjobs.models import Job
from django_pgjobs.worker.completer import Completer
from django_pgjobs.worker.executor import Shared
from django_pgjobs.worker.lease import LeaseMode
from django_pgjobs.worker.outcomes import WorkerStats
from django_pgjobs.worker.store import Store
from testproject.shop.models import Order
from testproject.testjobs import sleep
from tests.helpers import make_job, wait_until
from tests.workers import Process, Workers, kill_worker, query, scalar, until_order, write_order

pytestmark = pytest.mark.django_db(transaction=True)

EXPIRED = timedelta(minutes=-1)
WORKER_DIED = "django_pgjobs.exceptions.WorkerCrashed"


def crashed(job_id: int, crashes: int) -> int:
    """The job, its last ``crashes`` attempts ended with the worker dead (make_job does not
    know the column)."""
    query("UPDATE pgjobs_job SET crashes = %s WHERE id = %s", [crashes, job_id])
    return job_id


def query_errors(ids: list[int]) -> list[tuple[int, str]]:
    return [
        (row[0], row[1])
        for row in query("SELECT id, last_error FROM pgjobs_job WHERE id = ANY(%s)", [ids])
    ]


def crash_state(job_id: int) -> tuple[str, int, int, str | None, str | None]:
    """status, attempts, crashes, last_error and the class of the latest recorded error."""
    (row,) = query(
        "SELECT status, attempts, crashes, last_error, errors -> -1 ->> 'exception_class_path' "
        "FROM pgjobs_job WHERE id = %s",
        [job_id],
    )
    return row


def test_the_reaper_counts_crashes_and_fails_a_job_after_max_crashes_in_a_row() -> None:
    first = make_job(status="running", attempts=1, locked_until=EXPIRED)
    second = crashed(make_job(status="running", attempts=2, locked_until=EXPIRED), 1)

    assert sorted(Job.objects.reap()) == [(first, "queued", 1), (second, "failed", 2)]

    # One death: back to the queue, the crash counted, the old wording kept.
    assert crash_state(first) == (
        "queued",
        1,
        1,
        "lease expired",
        "django_pgjobs.exceptions.LeaseExpired",
    )
    # The second in a row (MAX_CRASHES is 2): failed with 3 of its 5 attempts left, and said so.
    status, attempts, crashes, last_error, kind = crash_state(second)
    assert (status, attempts, crashes, kind) == ("failed", 2, 2, WORKER_DIED)
    assert last_error is not None
    assert last_error.startswith("the worker died while running this job 2 times in a row")
    assert "os._exit()" in last_error
    assert scalar("SELECT finished_at IS NOT NULL FROM pgjobs_job WHERE id = %s", [second])


def test_an_attempt_that_raised_ends_a_run_of_crashes() -> None:
    job_id = make_job(status="running", attempts=1, locked_until=EXPIRED)
    Job.objects.reap()
    (claimed,) = Job.objects.claim()
    assert (claimed.id, claimed.crashes) == (job_id, 1)
    assert Job.objects.fail(claimed, error="RuntimeError: raised") == "queued"
    assert crash_state(job_id)[:3] == ("queued", 2, 0)

    # So the next death is the first of a new run, not the second of the old one.
    query(
        "UPDATE pgjobs_job SET status = 'running', attempts = 3, "
        "locked_until = now() - interval '1 minute' WHERE id = %s",
        [job_id],
    )
    Job.objects.reap()
    assert crash_state(job_id)[:3] == ("queued", 3, 1)


def test_max_crashes_is_a_setting_and_attempts_still_bound_crashes() -> None:
    tolerant = crashed(make_job(status="running", attempts=1, locked_until=EXPIRED), 1)
    last_attempt = make_job(status="running", attempts=5, locked_until=EXPIRED)
    with override_settings(PGJOBS={"MAX_CRASHES": 3}):
        Job.objects.reap()
    assert crash_state(tolerant)[:3] == ("queued", 1, 2)
    # Out of attempts before out of crashes: an ordinary final reap.
    assert crash_state(last_attempt) == (
        "failed",
        5,
        1,
        "lease expired",
        "django_pgjobs.exceptions.LeaseExpired",
    )


@pytest.mark.parametrize("value", [0, 1.5, "2", True])
def test_a_bad_max_crashes_is_a_system_check_error(value: object) -> None:
    with override_settings(PGJOBS={"MAX_CRASHES": value}):
        errors = [e for e in checks.run_checks() if e.id == "pgjobs.E002"]
    assert len(errors) == 1
    assert "MAX_CRASHES" in errors[0].msg


def test_a_job_that_kills_its_worker_is_failed_after_two_deaths_and_its_neighbours_finish(
    workers: Workers,
) -> None:
    # Jobs that take a moment, so that some run beside the killer when it strikes.
    before = Job.objects.enqueue_many(sleep, [{"seconds": 0.2}] * 10)
    killer_id = Job.objects.enqueue(kill_worker, {}, max_attempts=25).id
    after = Job.objects.enqueue_many(sleep, [{"seconds": 0.2}] * 10)
    others = [*before, *after]

    def finished() -> bool:
        states = dict(query("SELECT id, status FROM pgjobs_job"))
        innocent = [i for i in others if states[i] == "failed"]
        assert not innocent, f"bystanders failed: {query_errors(innocent)}"
        return states[killer_id] == "failed" and all(states[i] == "done" for i in others)

    deaths = 0
    worker: Process | None = None
    # A supervisor's loop: whenever the worker dies, start another. The short reap interval
    # lets each new worker take back what the dead one held once its lease ran out; the lease
    # is long enough that a heartbeat late on a busy machine does not let a worker's own
    # reaper count a crash on a bystander.
    while not finished():
        if worker is None or not worker.alive:
            if worker is not None:
                assert worker.popen.returncode == 1, worker.tail()
                deaths += 1
                assert deaths <= 2, f"the killer took down a third worker:\n{worker.tail()}"
            worker = workers.start(
                "--concurrency",
                "4",
                "--lease",
                "5",
                "--reap-interval",
                "0.5",
                "--poll-interval",
                "0.5",
                test_jobs=True,
            )
        wait_until(
            lambda current=worker: finished() or not current.alive,
            message="the queue to be finished or the worker to die",
        )
    assert worker is not None and worker.alive

    assert deaths == 2
    status, attempts, crashes, last_error, kind = crash_state(killer_id)
    assert (status, attempts, crashes, kind) == ("failed", 2, 2, WORKER_DIED)
    assert last_error is not None and "the worker died" in last_error
    # Every bystander ended done, with no crash left on its record.
    assert query(
        "SELECT status, crashes, count(*) FROM pgjobs_job WHERE id = ANY(%s) "
        "GROUP BY status, crashes",
        [others],
    ) == [("done", 0, 20)]


def test_a_second_signal_ends_leases_without_counting_a_crash(workers: Workers) -> None:
    # It writes an order as it starts, then sleeps longer than the test's patience.
    job_id = Job.objects.enqueue(write_order, {"email": "interrupted", "pause": 600}).id
    worker = workers.start("--lease", "60", "--shutdown-timeout", "600", test_jobs=True)
    wait_until(
        lambda: Order.objects.filter(email="interrupted").exists(), message="the job to start"
    )
    # As if an earlier attempt had ended with its worker dead (set now, not before the claim:
    # a suspect claimed would wait for its turn, and the first signal would release it).
    crashed(job_id, 1)

    worker.send(signal.SIGTERM)
    worker.wait_for_log("SIGTERM: stopping")
    worker.send(signal.SIGINT)
    assert worker.wait() == 1, worker.tail()

    # Its 60 s lease ended at once; the reap requeues it with its crash count as it was (one
    # more would have quarantined it: MAX_CRASHES is 2).
    assert Job.objects.reap() == [(job_id, "queued", 1)]
    assert crash_state(job_id) == (
        "queued",
        1,
        1,
        "lease expired",
        "django_pgjobs.exceptions.LeaseExpired",
    )


def suspect(email: str) -> int:
    """A queued write_order job whose last attempt ended with its worker dead. Inserted and
    marked in one transaction: committed apart, a running worker could claim it in between
    as a plain job (crashes still 0)."""
    with transaction.atomic():
        return crashed(make_job(task="tests.workers.write_order", payload={"email": email}), 1)


def polling(email: str) -> bool:
    """Whether until_order(email) runs: some other session's latest query looks for the order."""
    return bool(
        scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid() AND query LIKE %s",
            [f"%shop_order%{email}%"],
        )
    )


def test_deploys_past_the_shutdown_timeout_do_not_quarantine_a_long_job(workers: Workers) -> None:
    # A healthy job longer than the shutdown timeout, with attempts to spare: each deploy
    # (SIGTERM, then the timeout runs out) gives it back without calling it a crash. Counted
    # as crashes, the second would fail it as WorkerCrashed (MAX_CRASHES is 2).
    job_id = Job.objects.enqueue(until_order, {"email": "long"}, max_attempts=25).id
    for deploy in (1, 2):
        worker = workers.start(
            "--lease", "5", "--shutdown-timeout", "0.5", "--reap-interval", "0", test_jobs=True
        )
        # Running in an executor, not only claimed: a stop that lands as the claim returns
        # gives the job back unstarted (a release), and this test is about a job that runs.
        wait_until(
            lambda n=deploy: crash_state(job_id)[:2] == ("running", n) and polling("long"),
            message=f"attempt {deploy} to start",
        )
        worker.send(signal.SIGTERM)
        assert worker.wait() == 0, worker.tail()
        assert "their leases end now (1 ended)" in worker.log()
        # Its lease ended with the worker, not 5 s later: the reap takes it back at once.
        assert Job.objects.reap() == [(job_id, "queued", deploy)]
        assert crash_state(job_id)[:3] == ("queued", deploy, 0)


def test_a_busy_worker_leaves_a_suspect_queued_and_keeps_claiming_others(
    workers: Workers,
) -> None:
    long_id = until_order.enqueue(email="long").id
    worker = workers.start(
        "--concurrency", "2", "--lease", "5", "--poll-interval", "0.2", test_jobs=True
    )
    wait_until(lambda: crash_state(long_id)[0] == "running", message="the long job to start")
    suspect_id = suspect("suspect")
    others = Job.objects.enqueue_many(write_order, [{"email": f"other-{n}"} for n in range(3)])
    # The others run one after another beside the long job; the suspect is never claimed.
    wait_until(
        lambda: all(crash_state(i)[0] == "done" for i in others), message="the others to run"
    )
    assert crash_state(suspect_id)[:3] == ("queued", 0, 1)

    # Once the worker is idle, it runs the suspect (alone), and its clean run clears its count.
    Order.objects.create(email="long", total_cents=1)
    wait_until(lambda: crash_state(suspect_id)[0] == "done", message="the suspect to run")
    assert crash_state(suspect_id)[:3] == ("done", 1, 0)
    assert f"job {suspect_id} tests.workers.write_order attempt 1: its last attempt" in (
        worker.log()
    )


def test_a_burst_runs_each_suspect_of_one_claim_alone(workers: Workers) -> None:
    suspects = [suspect("first"), suspect("second")]
    plain = Job.objects.enqueue_many(write_order, [{"email": "plain-1"}, {"email": "plain-2"}])
    process = workers.burst("--concurrency", "4", test_jobs=True)

    # An idle worker's claim takes a suspect only as its first job, and then alone: each
    # suspect was claimed alone and ran alone, and nothing had to be given back for it.
    for job_id in [*suspects, *plain]:
        assert crash_state(job_id)[:3] == ("done", 1, 0)
    log = process.log()
    for job_id in suspects:
        assert f"job {job_id} tests.workers.write_order attempt 1: its last attempt" in log
    assert "4 done" in process.output() and "0 released" in process.output(), process.output()


def test_max_jobs_counts_a_suspect_run_alone(workers: Workers) -> None:
    suspect_id = suspect("only")
    plain = write_order.enqueue(email="plain").id
    worker = workers.start("--concurrency", "4", "--max-jobs", "1", test_jobs=True)
    assert worker.wait() == 0, worker.tail()
    # The one job it took was the suspect (the older), run alone; the other was left queued.
    assert crash_state(suspect_id)[:3] == ("done", 1, 0)
    assert crash_state(plain)[:2] == ("queued", 0)


def test_an_idle_worker_claims_a_suspect_alone_and_gives_nothing_back() -> None:
    # The worker's own parts, in this process, with the completer started only when the test
    # says, and executors that run only when the test hands them a job.
    lease = timedelta(seconds=3)
    store = Store("default", direct=True, synchronous_commit=None, prepare=False)
    stats = WorkerStats()
    handed: list[ClaimedJob] = []
    completer = Completer(store, lease, stats, "test")
    shared = Shared(
        store, lease, "test", stats, threading.Event(), lambda *items: handed.extend(items)
    )
    mode = LeaseMode(shared, completer)
    try:
        alone = suspect("alone")
        unique = Job.objects.enqueue(write_order, {"email": "unique"}, unique_key="invoice:42")
        # An idle worker claims one job: the suspect (the older), alone. The job beside it
        # is not claimed, so it is not given back either, and keeps its key (a claim gives up
        # the key of a job unique while queued; a release could not take it back).
        assert mode.dispatch("default", 4) == 1
        assert [job.id for job in handed] == [alone]
        assert mode.isolating()
        assert query("SELECT status, unique_key FROM pgjobs_job WHERE id = %s", [unique.id]) == [
            ("queued", "invoice:42")
        ]
        assert not Job.objects.enqueue(write_order, {"email": "u"}, unique_key="invoice:42").created

        # It runs alone; once its outcome is in the table the worker claims again, and the
        # job beside it comes next.
        completer.start()
        mode.execute(handed[0])
        wait_until(lambda: not completer.held(), message="the suspect's outcome to be written")
        assert not mode.isolating()
        assert crash_state(alone)[:3] == ("done", 1, 0)
        assert mode.dispatch("default", 4) == 1
        assert [job.id for job in handed] == [alone, unique.id]
    finally:
        if completer.is_alive():
            completer.close(timeout=5)
        store.close()
