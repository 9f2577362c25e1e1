"""The claim under contention, each session on its own connection (Django's per-thread one).

Seed 000 ran eight workers over 10,000 jobs: the naive claim finished about 2,100 of them,
some claimed by all eight; the SKIP LOCKED claim finished all 10,000, each exactly once.
"""

from __future__ import annotations

import queue
import threading
import time
from datetime import timedelta

import pytest
from django.db import transaction
from django.test import TransactionTestCase

from django_pgjobs.managers import ClaimedJob
from django_pgjobs.models import Job
from testproject.testjobs import noop
from tests.helpers import (
    PATIENCE,
    DbThread,
    job_row,
    make_job,
    query,
    scalar,
    statement_timeout,
    status_counts,
)

JOBS = 10_000
WORKERS = 8


class SeedExperimentTests(TransactionTestCase):
    @pytest.mark.slow
    def test_eight_workers_finish_ten_thousand_jobs_each_once(self) -> None:
        Job.objects.enqueue_many(noop, ({"n": i} for i in range(JOBS)))
        start = threading.Barrier(WORKERS)
        first_batches = threading.Barrier(WORKERS)

        def worker() -> tuple[list[int], int]:
            start.wait(PATIENCE)
            claimed: list[int] = []
            completed = 0
            jobs = Job.objects.claim(limit=10, lease=timedelta(minutes=5))
            # Each holds its first batch before any goes on: however the threads are
            # scheduled, all eight really claim side by side.
            first_batches.wait(PATIENCE)
            while jobs:
                for job in jobs:
                    claimed.append(job.id)
                    completed += Job.objects.complete(job.id, job.attempts)
                jobs = Job.objects.claim(limit=10, lease=timedelta(minutes=5))
            return claimed, completed

        threads = [DbThread(worker) for _ in range(WORKERS)]
        for t in threads:
            t.start()
        results = [t.result(timeout=4 * PATIENCE) for t in threads]

        claimed = [job_id for ids, _ in results for job_id in ids]
        assert len(claimed) == JOBS
        assert len(set(claimed)) == JOBS  # no job handed to two workers
        assert sum(completed for _, completed in results) == JOBS
        assert all(ids for ids, _ in results)  # every worker took part
        assert status_counts() == {"done": JOBS}
        assert query("SELECT min(attempts), max(attempts) FROM pgjobs_job") == [(1, 1)]


class SkipLockedTests(TransactionTestCase):
    def test_a_held_job_does_not_block_the_next_claim(self) -> None:
        # Seed 000's two sessions: A claims in transaction mode and keeps its transaction
        # open; B's claim skips A's locked row and returns the next job at once.
        first = make_job(run_at=timedelta(seconds=-20))
        second = make_job(run_at=timedelta(seconds=-10))
        held: queue.Queue[list[ClaimedJob]] = queue.Queue()
        release = threading.Event()

        def session_a() -> float:
            with transaction.atomic():
                jobs = Job.objects.claim(limit=1, mode="transaction")
                claimed_at = time.monotonic()
                held.put(jobs)
                assert release.wait(PATIENCE)
                assert Job.objects.complete(jobs[0].id, jobs[0].attempts)
            return time.monotonic() - claimed_at

        a = DbThread(session_a)
        a.start()
        try:
            (a_job,) = held.get(timeout=PATIENCE)
            assert a_job.id == first
            # A claim that waited on A's lock would wait for ever: make that an error.
            with statement_timeout(PATIENCE):
                began = time.monotonic()
                b_jobs = Job.objects.claim(limit=1)
                b_took = time.monotonic() - began
            # B is back while A still holds its transaction open: to others, A's job is
            # still queued, and A's session sits idle in transaction.
            assert a.is_alive()
            assert job_row(first)["status"] == "queued"
            assert (
                scalar(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND state = 'idle in transaction'"
                )
                == 1
            )
        finally:
            release.set()
        a_held = a.result()

        assert [j.id for j in b_jobs] == [second]
        assert b_jobs[0].attempts == 1
        assert b_took < a_held
        assert job_row(first)["status"] == "done"
        assert job_row(second)["status"] == "running"
