"""The claimers section of the benchmark (benchmarks/claimers.py), small: its figures are only
worth reading if it drains the queue with the worker's statements, each job once, and if it
says so loudly when it cannot."""

from __future__ import annotations

import pytest
from django.test import TransactionTestCase

from benchmarks.claimers import drain
from benchmarks.db import BenchAbort
from django_pgjobs.models import Job
from testproject.testjobs import noop
from tests.helpers import status_counts

JOBS = 300


class ClaimersTests(TransactionTestCase):
    def test_claimers_drain_the_queue_each_job_once(self) -> None:
        Job.objects.enqueue_many(noop, ({"n": i} for i in range(JOBS)))

        result = drain(alias="default", queue="default", jobs=JOBS, claimers=4, batch=10)

        assert status_counts() == {"done": JOBS}
        assert set(Job.objects.values_list("attempts", flat=True)) == {1}
        assert result["jobs"] == JOBS
        assert result["claims"] >= JOBS // 10
        assert 0 <= result["short"] <= result["claims"]
        assert result["claim_p50_ms"] <= result["claim_p99_ms"]

    def test_a_queue_that_does_not_drain_aborts_the_run(self) -> None:
        Job.objects.enqueue_many(noop, ({"n": i} for i in range(20)))

        with pytest.raises(BenchAbort, match="5 jobs still unclaimed"):
            drain(alias="default", queue="default", jobs=25, claimers=2, batch=10, timeout=1.0)

        assert status_counts() == {"done": 20}
