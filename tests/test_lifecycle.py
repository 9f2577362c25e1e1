"""claim, complete, fail, extend_lease, release, reap and prune on a real table.

A lease-mode claim refuses to run inside ``atomic()``, and lease expiry needs ``now()`` to
move, so most cases here are ``TransactionTestCase`` (autocommit, like a worker).
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import transaction
from django.db.transaction import TransactionManagementError
from django.test import TestCase, TransactionTestCase, override_settings

from django_pgjobs.core.types import ERROR_LIMIT
from django_pgjobs.exceptions import InvalidJobOptions
from django_pgjobs.managers import ClaimedJob, Reaped
from django_pgjobs.models import ArchivedJob, Job
from tests.helpers import (
    PATIENCE,
    DbThread,
    db_now,
    job_row,
    make_job,
    make_jobs,
    query,
    scalar,
    statement_timeout,
    status_counts,
    wait_until,
)

PAST = timedelta(minutes=-1)
MANAGERS_LOG = "django_pgjobs.managers"


def make_ready() -> None:
    """Make every queued job due now (a plain UPDATE, as between backoff steps)."""
    query("UPDATE pgjobs_job SET run_at = now() WHERE status = 'queued' RETURNING id")


class ClaimTests(TransactionTestCase):
    def test_claim_takes_ready_jobs_and_sets_the_lease(self) -> None:
        ids = make_jobs(5)
        claimed = Job.objects.claim(limit=3, lease=timedelta(seconds=90))
        assert len(claimed) == 3
        assert {c.id for c in claimed} == set(ids[:3])  # oldest run_at first
        for c in claimed:
            assert isinstance(c, ClaimedJob)
            assert (c.queue, c.task, c.attempts, c.max_attempts) == (
                "default",
                "testproject.testjobs.noop",
                1,
                5,
            )
            assert c.payload == {"n": ids.index(c.id) + 1}
            row = job_row(c.id)
            assert row["status"] == "running"
            assert row["attempts"] == 1
            # The lease runs from the claim's now(), which started_at also records.
            assert row["started_at"] is not None
            assert row["locked_until"] - row["started_at"] == timedelta(seconds=90)
        assert status_counts() == {"running": 3, "queued": 2}

    def test_claim_only_takes_its_queue_due_and_queued_jobs(self) -> None:
        mine = make_job(queue="emails")
        make_job(queue="default")
        make_job(queue="emails", run_at=timedelta(minutes=5))
        for status in ("running", "done", "failed"):
            make_job(queue="emails", status=status, run_at=PAST)
        assert [c.id for c in Job.objects.claim(queue="emails", limit=10)] == [mine]

    def test_default_lease_comes_from_settings(self) -> None:
        make_job()
        with override_settings(PGJOBS={"LEASE": 120}):
            (c,) = Job.objects.claim()
        row = job_row(c.id)
        assert row["locked_until"] - row["started_at"] == timedelta(seconds=120)

    def test_nothing_ready_returns_empty(self) -> None:
        make_job(status="done")
        assert Job.objects.claim() == []

    def test_lease_mode_refuses_an_open_transaction(self) -> None:
        make_job()
        with pytest.raises(TransactionManagementError, match="lease mode"), transaction.atomic():
            Job.objects.claim()
        assert status_counts() == {"queued": 1}

    def test_transaction_mode_requires_one(self) -> None:
        make_job()
        with pytest.raises(TransactionManagementError, match="atomic"):
            Job.objects.claim(mode="transaction")
        with pytest.raises(InvalidJobOptions, match="mode"):
            Job.objects.claim(mode="batch")
        assert status_counts() == {"queued": 1}

    def test_transaction_mode_rolls_back_with_the_job(self) -> None:
        # A crash in transaction mode leaves the job as it was: not claimed, no attempt.
        job_id = make_job()

        class Crash(Exception):
            pass

        with pytest.raises(Crash), transaction.atomic():
            (c,) = Job.objects.claim(mode="transaction")
            assert c.id == job_id
            raise Crash
        assert job_row(job_id)["status"] == "queued"
        assert job_row(job_id)["attempts"] == 0

    def test_transaction_mode_commits_claim_and_completion_together(self) -> None:
        job_id = make_job()
        with transaction.atomic():
            (c,) = Job.objects.claim(mode="transaction")
            assert Job.objects.complete(c.id, c.attempts)
        row = job_row(job_id)
        assert (row["status"], row["attempts"]) == ("done", 1)


class OutcomeTests(TransactionTestCase):
    def claim_one(self, lease: timedelta = timedelta(minutes=5)) -> ClaimedJob:
        (c,) = Job.objects.claim(limit=1, lease=lease)
        return c

    def test_complete(self) -> None:
        make_job()
        c = self.claim_one()
        assert Job.objects.complete(c.id, c.attempts) is True
        row = job_row(c.id)
        assert row["status"] == "done"
        assert row["locked_until"] is None
        assert row["finished_at"] is not None
        # Done is final: a second completion or a late failure changes nothing.
        with self.assertLogs(MANAGERS_LOG, "WARNING"):
            assert Job.objects.complete(c.id, c.attempts) is False
        with self.assertLogs(MANAGERS_LOG, "WARNING"):
            assert Job.objects.fail(c.id, c.attempts, "late") is None
        assert job_row(c.id) == row

    def test_fail_requeues_then_fails_for_good_keeping_the_error(self) -> None:
        make_job(max_attempts=2)
        c = self.claim_one()
        assert Job.objects.fail(c.id, c.attempts, "first") == "queued"
        row = job_row(c.id)
        assert (row["status"], row["last_error"], row["locked_until"]) == ("queued", "first", None)
        assert row["finished_at"] is None
        make_ready()
        c = self.claim_one()
        assert Job.objects.fail(c.id, c.attempts, "second") == "failed"
        row = job_row(c.id)
        assert (row["status"], row["attempts"], row["last_error"]) == ("failed", 2, "second")
        assert row["finished_at"] is not None
        make_ready()
        assert Job.objects.claim() == []

    def test_fail_stores_any_error_text(self) -> None:
        make_job()
        c = self.claim_one()
        error = "Traceback\x00" + "x" * (ERROR_LIMIT * 2) + "ValueError: the end"
        assert Job.objects.fail(c.id, c.attempts, error) == "queued"
        stored = job_row(c.id)["last_error"]
        assert stored.endswith("ValueError: the end")
        assert len(stored) <= ERROR_LIMIT + 3

    def test_extend_lease(self) -> None:
        make_job()
        c = self.claim_one(lease=timedelta(seconds=30))
        # An extension runs from its own now(), between the database times read around it.
        hour, default = timedelta(hours=1), timedelta(seconds=300)  # PGJOBS LEASE
        before = db_now()
        assert Job.objects.extend_lease(c.id, c.attempts, lease=hour) is True
        after = db_now()
        assert before + hour <= job_row(c.id)["locked_until"] <= after + hour
        before = db_now()
        assert Job.objects.extend_lease(c.id, c.attempts) is True
        after = db_now()
        assert before + default <= job_row(c.id)["locked_until"] <= after + default
        assert job_row(c.id)["status"] == "running"

    def test_release_gives_the_attempt_back(self) -> None:
        job_id = make_job()
        c = self.claim_one()
        assert Job.objects.release(c.id, c.attempts) is True
        row = job_row(job_id)
        assert (row["status"], row["attempts"], row["locked_until"], row["started_at"]) == (
            "queued",
            0,
            None,
            None,
        )
        assert self.claim_one().attempts == 1

    def test_many_forms_change_only_the_jobs_still_ours(self) -> None:
        make_jobs(4)
        a, b, c, d = sorted(Job.objects.claim(limit=4), key=lambda j: j.id)
        assert Job.objects.complete_many([(a.id, 1), (b.id, 2)]) == {a.id}
        assert Job.objects.fail_many([(b.id, 1, "x"), (c.id, 9, "y")]) == {b.id: "queued"}
        assert Job.objects.extend_lease_many([(c.id, 1), (d.id, 0)]) == {c.id}
        assert Job.objects.release_many([(c.id, 1), (a.id, 1)]) == {c.id}
        assert Job.objects.complete_many([]) == set()
        assert Job.objects.fail_many([]) == {}


class SlowWorkerTests(TransactionTestCase):
    """Seed 000's slow worker: its lease ran out, the job was reaped and claimed again."""

    def test_a_stale_attempt_is_fenced_out(self) -> None:
        job_id = Job.objects.enqueue("testproject.testjobs.noop").id
        (first,) = Job.objects.claim(lease=timedelta(milliseconds=50))
        assert (first.id, first.attempts) == (job_id, 1)
        wait_until(
            lambda: scalar("SELECT locked_until < now() FROM pgjobs_job WHERE id = %s", [job_id]),
            message="the lease to expire",
        )
        assert Job.objects.reap() == [Reaped(job_id, "queued", 1)]
        (second,) = Job.objects.claim()
        assert (second.id, second.attempts) == (job_id, 2)

        owned = job_row(job_id)
        with self.assertLogs(MANAGERS_LOG, "WARNING") as logs:
            assert Job.objects.complete(job_id, 1) is False
            assert Job.objects.fail(job_id, 1, "slow worker's error") is None
            assert Job.objects.extend_lease(job_id, 1, lease=timedelta(hours=1)) is False
            assert Job.objects.release(job_id, 1) is False
        assert len(logs.records) == 4
        assert all("no longer ours" in r.getMessage() for r in logs.records)
        assert job_row(job_id) == owned

        assert Job.objects.complete(job_id, 2) is True
        row = job_row(job_id)
        assert (row["status"], row["attempts"], row["locked_until"]) == ("done", 2, None)


class BackoffTests(TransactionTestCase):
    def fail_once(self, job_id: int, attempts: int) -> tuple[str, timedelta, timedelta]:
        """Claim and fail the job; return its new status and the bounds of its backoff:
        run_at minus the database times read just after and just before the fail (whose own
        now() lies between them)."""
        make_ready()
        (c,) = Job.objects.claim()
        assert (c.id, c.attempts) == (job_id, attempts)
        before = db_now()
        status = Job.objects.fail(job_id, attempts, f"failure {attempts}")
        after = db_now()
        assert status is not None
        run_at = job_row(job_id)["run_at"]
        return status, run_at - after, run_at - before

    def test_backoff_doubles_from_20_seconds_then_fails(self) -> None:
        job_id = make_job(max_attempts=5)
        for attempts, expected in enumerate([20, 40, 80, 160], start=1):
            status, low, high = self.fail_once(job_id, attempts)
            assert status == "queued"
            assert low <= timedelta(seconds=expected) <= high, (attempts, low, high)
        status, *_bounds = self.fail_once(job_id, 5)
        assert status == "failed"
        row = job_row(job_id)
        assert (row["status"], row["attempts"], row["last_error"]) == ("failed", 5, "failure 5")

    def test_backoff_stops_growing_at_one_hour(self) -> None:
        job_id = make_job(max_attempts=20)
        bounds = []
        for attempts in range(1, 20):
            status, low, high = self.fail_once(job_id, attempts)
            assert status == "queued"
            bounds.append((low, high))
        expected = [min(3600, 10 * 2**a) for a in range(1, 20)]
        assert expected[:9] == [20, 40, 80, 160, 320, 640, 1280, 2560, 3600]
        for attempts, ((low, high), want) in enumerate(zip(bounds, expected, strict=True), 1):
            assert low <= timedelta(seconds=want) <= high, (attempts, low, high, want)
        assert self.fail_once(job_id, 20)[0] == "failed"


class ReapTests(TransactionTestCase):
    def test_reap_requeues_or_fails_expired_jobs_only(self) -> None:
        expired = make_job(status="running", attempts=1, locked_until=PAST)
        expired_error = make_job(
            status="running", attempts=2, locked_until=PAST, last_error="earlier failure"
        )
        used_up = make_job(status="running", attempts=5, max_attempts=5, locked_until=PAST)
        valid = make_job(status="running", attempts=1, locked_until=timedelta(minutes=5))
        # Not running: a stale locked_until on them means nothing.
        others = [
            make_job(status=s, attempts=1, locked_until=PAST) for s in ("queued", "done", "failed")
        ]
        untouched = {i: job_row(i) for i in [valid, *others]}

        reaped = Job.objects.reap()

        assert sorted(reaped) == [
            Reaped(expired, "queued", 1),
            Reaped(expired_error, "queued", 2),
            Reaped(used_up, "failed", 5),
        ]
        row = job_row(expired)
        assert (row["status"], row["attempts"], row["last_error"], row["locked_until"]) == (
            "queued",
            1,
            "lease expired",
            None,
        )
        assert job_row(expired_error)["last_error"] == "earlier failure"
        row = job_row(used_up)
        assert (row["status"], row["last_error"]) == ("failed", "lease expired")
        assert row["finished_at"] is not None
        for job_id, before in untouched.items():
            assert job_row(job_id) == before
        assert Job.objects.reap() == []

    def test_reap_works_through_more_rows_than_its_batch(self) -> None:
        ids = make_jobs(10, status="running", attempts=1, locked_until=PAST)
        reaped = Job.objects.reap(batch_size=3)
        assert sorted(r.id for r in reaped) == ids
        assert status_counts() == {"queued": 10}

    def test_rows_locked_by_someone_else_do_not_strand_the_rest(self) -> None:
        ids = make_jobs(10, status="running", attempts=1, locked_until=PAST)
        locked = threading.Event()
        done = threading.Event()

        def hold_first_three() -> None:
            with transaction.atomic():
                query("SELECT id FROM pgjobs_job WHERE id = ANY(%s) FOR UPDATE", [ids[:3]])
                locked.set()
                assert done.wait(PATIENCE)

        holder = DbThread(hold_first_three)
        holder.start()
        try:
            assert locked.wait(PATIENCE)
            with statement_timeout(PATIENCE):
                reaped = Job.objects.reap(batch_size=3)
        finally:
            done.set()
            holder.result()
        assert sorted(r.id for r in reaped) == ids[3:]
        assert sorted(r.id for r in Job.objects.reap()) == ids[:3]

    def test_reap_refuses_a_bad_batch_size(self) -> None:
        with pytest.raises(InvalidJobOptions, match="batch_size"):
            Job.objects.reap(batch_size=0)


class ConcurrentReapTests(TransactionTestCase):
    def test_two_reapers_reap_each_row_exactly_once(self) -> None:
        ids = make_jobs(2000, status="running", attempts=1, locked_until=PAST)
        start = threading.Barrier(2)

        def reaper() -> list[Reaped]:
            start.wait(PATIENCE)
            return Job.objects.reap(batch_size=50)

        threads = [DbThread(reaper) for _ in range(2)]
        for t in threads:
            t.start()
        first, second = (t.result(timeout=60) for t in threads)
        first_ids = {r.id for r in first}
        second_ids = {r.id for r in second}
        assert len(first) == len(first_ids) and len(second) == len(second_ids)
        assert not first_ids & second_ids
        assert sorted(first_ids | second_ids) == ids
        assert status_counts() == {"queued": 2000}
        assert (
            scalar(
                "SELECT count(*) FROM pgjobs_job WHERE attempts = 1 "
                "AND last_error = 'lease expired'"
            )
            == 2000
        )


class PruneTests(TestCase):
    def setUp(self) -> None:
        hour_ago = timedelta(hours=-1)
        self.done = make_jobs(3, status="done", attempts=1, finished_at=hour_ago)
        self.failed = make_jobs(
            2, status="failed", attempts=5, finished_at=hour_ago, last_error="boom"
        )
        old = timedelta(days=-30)
        self.queued = make_job(status="queued", created_at=old, run_at=old)
        self.running = make_job(status="running", attempts=1, created_at=old, locked_until=hour_ago)

    def statuses(self) -> dict[str, int]:
        return status_counts()

    def test_prune_removes_done_jobs_by_default(self) -> None:
        assert Job.objects.prune(older_than=timedelta(0)) == 3
        assert self.statuses() == {"failed": 2, "queued": 1, "running": 1}

    def test_prune_failed_or_all(self) -> None:
        assert Job.objects.prune(older_than=timedelta(0), status=["failed"]) == 2
        assert Job.objects.prune(older_than=timedelta(0), status="all") == 3
        assert self.statuses() == {"queued": 1, "running": 1}

    def test_prune_keeps_recent_jobs_and_measures_from_the_finish(self) -> None:
        recent = make_job(
            status="done", created_at=timedelta(days=-30), finished_at=timedelta(days=-1)
        )
        old = make_job(status="done", created_at=timedelta(days=-8), finished_at=None)
        assert Job.objects.prune() == 1  # older_than 7 days
        assert not Job.objects.filter(id=old).exists()
        assert Job.objects.filter(id__in=[recent, *self.done]).count() == 4

    def test_prune_archive_moves_every_column(self) -> None:
        before = {row["id"]: row for row in Job.objects.filter(status="failed").values()}
        assert Job.objects.prune(older_than=timedelta(0), status="failed", archive=True) == 2
        assert not Job.objects.filter(id__in=before).exists()
        archived = {row["id"]: row for row in ArchivedJob.objects.values()}
        assert set(archived) == set(before)
        for job_id, row in archived.items():
            assert row.pop("archived_at") is not None
            assert row == before[job_id]

    def test_prune_in_batches_reports_progress(self) -> None:
        make_jobs(22, status="done", finished_at=timedelta(hours=-1))
        totals: list[int] = []
        assert (
            Job.objects.prune(older_than=timedelta(0), batch_size=7, progress=totals.append) == 25
        )
        assert totals == [7, 14, 21, 25]
        make_jobs(14, status="done", finished_at=timedelta(hours=-1))
        totals.clear()
        assert (
            Job.objects.prune(
                older_than=timedelta(0), batch_size=7, progress=totals.append, archive=True
            )
            == 14
        )
        assert totals == [7, 14]
        assert ArchivedJob.objects.count() == 14

    def test_prune_never_takes_queued_or_running_jobs(self) -> None:
        for status in ("queued", "running", ["done", "queued"], [], "everything"):
            with self.subTest(status=status), pytest.raises(InvalidJobOptions, match="prune"):
                Job.objects.prune(older_than=timedelta(0), status=status)
        with pytest.raises(InvalidJobOptions, match="older_than"):
            Job.objects.prune(older_than=timedelta(seconds=-1))
        with pytest.raises(InvalidJobOptions, match="batch_size"):
            Job.objects.prune(batch_size=0)
        assert Job.objects.count() == 7
