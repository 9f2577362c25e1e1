"""What a job meets is told apart from what the job did: a job whose queries hit a lost
connection or a read-only failover is released (its attempt not counted), never failed, and the
worker rides the outage out; an error text PostgreSQL cannot store and a job calling
``sys.exit()`` are ordinary failures that strand nothing behind them."""

from __future__ import annotations

import contextlib
import re
import signal
from collections.abc import Iterator

import pytest
from django.db import connections
from psycopg import sql as pgsql

from django_pgjobs.models import Job
from testproject.testjobs import noop
from tests.helpers import job_row, raw_connect, wait_until
from tests.workers import (
    OUTAGE_OPTIONS,
    Process,
    Workers,
    count_orders,
    counts,
    done,
    exit_with,
    finished_after_an_outage,
    listener_backends,
    query,
    ran,
    ride_audit_installed,
    ride_out_an_outage,
    rides,
    scalar,
    terminate,
    undecodable_error,
    write_order,
)

pytestmark = pytest.mark.django_db(transaction=True)


def worker_connections(worker: Process) -> list[int]:
    return worker.backends() + listener_backends()


@pytest.mark.parametrize("with_claims", [False, True], ids=["apart", "completions-with-claims"])
def test_a_job_that_meets_a_lost_connection_is_released_not_failed(
    workers: Workers, with_claims: bool
) -> None:
    total = 600
    Job.objects.enqueue_many(count_orders, [{"pause": 0.02}] * total)
    with ride_audit_installed():
        worker = workers.start(
            "--concurrency",
            "4",
            *OUTAGE_OPTIONS,
            test_jobs=True,
            env={"PGJOBS_COMPLETE_WITH_CLAIM": str(with_claims).lower()},
        )
        ride_out_an_outage(worker, total, after=100, victims=6)
        worker.send(signal.SIGTERM)
        assert worker.wait() == 0
        # The mode was really in use: completions rode with claims, or, told not to, none did.
        assert (rides()[0] > 0) is with_claims
    # Released, not retried or failed: the summary counts them apart.
    assert re.search(
        r"jobs: \d+ done, 0 to retry, 0 failed, \d+ lost, 0 cancelled; [1-9]\d* released",
        worker.output(),
    ), worker.output()


@contextlib.contextmanager
def read_only_database() -> Iterator[None]:
    """New sessions of the test database are read-only (as after a failover to a standby);
    sessions already open are not. Always undone, from a session that is not read-only."""
    name = connections["default"].settings_dict["NAME"]
    with raw_connect() as admin:
        admin.execute(
            pgsql.SQL("ALTER DATABASE {} SET default_transaction_read_only = on").format(
                pgsql.Identifier(name)
            )
        )
        try:
            yield
        finally:
            admin.execute("SET default_transaction_read_only = off")
            admin.execute(
                pgsql.SQL("ALTER DATABASE {} RESET default_transaction_read_only").format(
                    pgsql.Identifier(name)
                )
            )
    with raw_connect() as fresh:
        assert fresh.execute("SHOW default_transaction_read_only").fetchone() == ("off",)


def test_a_read_only_failover_is_ridden_out(workers: Workers) -> None:
    total = 400
    Job.objects.enqueue_many(
        write_order, [{"email": f"ro{i}@example.com", "pause": 0.02} for i in range(total)]
    )
    worker = workers.start(
        "--concurrency",
        "4",
        "--lease",
        "5",
        "--reap-interval",
        "2",
        "--poll-interval",
        "1",
        test_jobs=True,
    )
    wait_until(lambda: done() >= 50, message="the run to get going")

    with read_only_database():
        # Its new sessions are read-only: every claim and outcome write fails with 25006.
        assert terminate(worker_connections(worker)) >= 2
        assert done() < total, "the run ended before the failover"
        # A couple of seconds read-only: the producer and the completer each retry twice
        # (0.5 s, then 1 s of backoff), and the worker lives on.
        wait_until(
            lambda: worker.log().count("read-only transaction") >= 4 or not worker.alive,
            interval=0.05,
            message="the worker to retry against the read-only database",
        )
        assert worker.alive, worker.tail()
    # Writable again; sessions opened meanwhile are still read-only: drop them too.
    terminate(worker_connections(worker))

    log = finished_after_an_outage(worker, total)
    assert "unavailable (cannot execute UPDATE in a read-only transaction)" in log, log
    assert "reconnected to database default" in log, log
    worker.send(signal.SIGTERM)
    assert worker.wait() == 0


def test_an_error_text_postgres_cannot_hold_is_recorded_escaped(workers: Workers) -> None:
    # A lone surrogate (an undecodable file name) in the message: text PostgreSQL refuses.
    final = Job.objects.enqueue(undecodable_error, max_attempts=1, priority=10).id
    retried = Job.objects.enqueue(undecodable_error, max_attempts=3, priority=10).id
    behind = Job.objects.enqueue_many(noop, [{"n": n} for n in range(20)])

    # 22 claims at most: the retried job must not run twice, however slow the run.
    worker = workers.burst("--concurrency", "4", "--max-jobs", "22", test_jobs=True)

    expected = "RuntimeError: cannot open caf\\udce9.txt"
    for job_id, status in ((final, "failed"), (retried, "queued")):
        row = job_row(job_id)
        assert (row["status"], row["attempts"], row["locked_until"]) == (status, 1, None)
        assert row["last_error"].strip().endswith(expected), row["last_error"]
        assert (
            scalar("SELECT errors -> -1 ->> 'traceback' FROM pgjobs_job WHERE id = %s", [job_id])
            .strip()
            .endswith(expected)
        )
    # Nothing behind it was stranded: every other job is done, none is left running.
    assert query("SELECT id FROM pgjobs_job WHERE status = 'done' ORDER BY id") == [
        (job_id,) for job_id in behind
    ]
    assert counts() == {"done": 20, "failed": 1, "queued": 1}
    assert ran(worker) == 22
    assert "20 done, 1 to retry, 1 failed, 0 lost" in worker.output()


def test_a_job_calling_sys_exit_is_its_failure(workers: Workers) -> None:
    exits = Job.objects.enqueue(exit_with, {"code": 2}, priority=10).id
    after = Job.objects.enqueue_many(noop, [{"n": n} for n in range(5)])

    # One executor: the jobs after it run only if that executor lives on.
    worker = workers.burst("--concurrency", "1", test_jobs=True)

    row = job_row(exits)
    assert (row["status"], row["attempts"], row["locked_until"]) == ("failed", 1, None)
    assert row["last_error"].strip().endswith("SystemExit: 2"), row["last_error"]
    assert (
        scalar(
            "SELECT errors -> -1 ->> 'exception_class_path' FROM pgjobs_job WHERE id = %s", [exits]
        )
        == "builtins.SystemExit"
    )
    assert [job_row(job_id)["status"] for job_id in after] == ["done"] * 5
    assert "ran 6 jobs: 5 done, 0 to retry, 1 failed, 0 lost" in worker.output()
    assert f"job {exits} tests.workers.exit_with attempt 1/1 failed" in worker.log()
