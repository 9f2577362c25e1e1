"""``runjobs --mode transaction``: claim, run and complete in one transaction; and why a long
open transaction is the mode's cost (VACUUM cannot remove what it still might see)."""

from __future__ import annotations

import re
import signal
from datetime import timedelta

import psycopg
import pytest

from django_pgjobs.core import claim
from django_pgjobs.models import Job
from testproject.shop.models import Order
from testproject.testjobs import noop, sleep
from tests.helpers import job_row, raw_connect, wait_until
from tests.workers import Workers, query, ran, write_order

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_jobs_writes_commit_with_its_completion_or_roll_back_with_its_failure(
    workers: Workers,
) -> None:
    ok = Job.objects.enqueue(write_order, {"email": "ok@example.com"}).id
    bad = Job.objects.enqueue(write_order, {"email": "bad@example.com", "fail": True}).id

    # Two claims at most: the retry is not due for 20 s, but a burst must not be able to
    # take it however slow the machine.
    worker = workers.burst("--mode", "transaction", "--max-jobs", "2", test_jobs=True)

    assert "ran 2 jobs: 1 done, 1 to retry, 0 failed" in worker.output()
    # Success: the job's row and its completion committed together.
    assert Order.objects.filter(email="ok@example.com").count() == 1
    row = job_row(ok)
    assert (row["status"], row["attempts"], row["locked_until"]) == ("done", 1, None)
    # One transaction, so one now(): claimed and finished at the same database instant.
    assert row["started_at"] == row["finished_at"]
    # Failure: the order it wrote before raising is gone, the claim and the failure stay.
    assert not Order.objects.filter(email="bad@example.com").exists()
    row = job_row(bad)
    assert (row["status"], row["attempts"], row["locked_until"]) == ("queued", 1, None)
    assert row["last_error"].strip().splitlines()[-1] == (
        "RuntimeError: failed after writing order bad@example.com"
    )


def test_a_crash_rolls_the_claim_back_no_reap_needed(workers: Workers) -> None:
    job_id = Job.objects.enqueue(sleep, {"seconds": 600}).id  # killed long before it ends
    worker = workers.start("--mode", "transaction", "--poll-interval", "600")

    def locked() -> bool:
        return not query("SELECT id FROM pgjobs_job WHERE id = %s FOR UPDATE SKIP LOCKED", [job_id])

    wait_until(locked, message="the worker to claim the job")

    # The row is locked while the claim statement still runs; once it has returned, the claim
    # is an open transaction of the worker's, the one that wrote, idle while the job sleeps.
    def claim_open() -> bool:
        return query(
            "SELECT state FROM pg_stat_activity WHERE application_name = %s "
            "AND backend_xid IS NOT NULL",
            [worker.app_name],
        ) == [("idle in transaction",)]

    wait_until(claim_open, message="the claim to return inside its open transaction")
    # Running, but uncommitted: everyone else still sees the job queued, attempt 0.
    row = job_row(job_id)
    assert (row["status"], row["attempts"]) == ("queued", 0)

    worker.send(signal.SIGKILL)
    assert worker.wait() == -signal.SIGKILL
    wait_until(lambda: not locked(), message="the server to roll the claim back")

    row = job_row(job_id)
    assert (row["status"], row["attempts"], row["locked_until"], row["started_at"]) == (
        "queued",
        0,
        None,
        None,
    )
    assert row["last_error"] is None


def _tuples_line(notices: list[str]) -> tuple[str, int]:
    """The VACUUM VERBOSE 'tuples:' line for pgjobs_job and its dead-not-removable count."""
    for message in notices:
        if message.startswith("finished vacuuming") and '.public.pgjobs_job"' in message:
            for line in message.splitlines():
                found = re.match(
                    r"tuples: \d+ removed, \d+ remain, (\d+) are dead but not yet removable",
                    line,
                )
                if found:
                    return line, int(found.group(1))
    raise AssertionError(f"no tuples line for pgjobs_job in {notices}")


def _vacuum(conn: psycopg.Connection[object], notices: list[str]) -> tuple[str, int]:
    notices.clear()
    conn.execute("VACUUM (VERBOSE) pgjobs_job")
    return _tuples_line(notices)


def test_an_open_transaction_holding_a_claim_keeps_vacuum_from_removing_dead_rows(
    workers: Workers,
) -> None:
    Job.objects.enqueue_many(noop, [{"n": i} for i in range(2001)])
    notices: list[str] = []
    with raw_connect() as holder, raw_connect() as vacuum:
        vacuum.add_notice_handler(lambda diag: notices.append(diag.message_primary or ""))
        with holder.transaction():
            # The seed's experiment: a transaction-mode claim left open (a slow job).
            held = holder.execute(
                claim.CLAIM,
                {
                    "queue": "default",
                    "limit": 1,
                    "lease": timedelta(minutes=5),
                    "worker_id": "t",
                    "suspects": True,
                    "synchronous_commit": None,
                    "tasks": None,
                },
            ).fetchall()
            assert len(held) == 1
            worker = workers.burst("--concurrency", "4")
            assert ran(worker) == 2000
            blocked_line, blocked = _vacuum(vacuum, notices)
        freed_line, freed = _vacuum(vacuum, notices)

    print(f"\nVACUUM while a claim's transaction is open: {blocked_line}")
    print(f"VACUUM after it committed:                 {freed_line}")
    # Every claim and completion of the 2,000 jobs left a dead row version that the open
    # transaction might still need; once it ends they all go.
    assert blocked >= 2000
    assert freed == 0
