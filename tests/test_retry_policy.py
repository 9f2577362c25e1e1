"""The per-job retry policy: ``discard_on``, ``retry_on``, ``backoff`` (a ``(base, cap)`` tuple
or a callable) and ``backoff_jitter``, through ``decide()`` and through real workers.

Delays are measured on the database clock: a failure's ``now()`` lies between the claim's
(``attempted_at``) and a read taken after the worker exited, so ``run_at`` minus the delay
must lie between those two times too. No bound depends on how fast the machine is.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection

from django_pgjobs import JobFunction
from django_pgjobs.core import finish
from django_pgjobs.core.types import FailedAttempt, Failure
from django_pgjobs.models import Job
from django_pgjobs.worker.executor import call, context, decide
from tests.helpers import db_now, make_jobs, query
from tests.retry_jobs import (
    discards_value_errors,
    fails_with_broken_backoff,
    fails_with_callable_backoff,
    fails_with_jitter,
    retries_connection_errors,
)
from tests.workers import Workers

pytestmark = pytest.mark.django_db(transaction=True)


def row(job_id: int) -> dict[str, object]:
    (values,) = query(
        "SELECT status, attempts, max_attempts, run_at, attempted_at, finished_at, last_error "
        "FROM pgjobs_job WHERE id = %s",
        [job_id],
    )
    names = ("status", "attempts", "max_attempts", "run_at", "attempted_at", "finished_at")
    return dict(zip((*names, "last_error"), values, strict=True))


# -- decide(): the policy alone -----------------------------------------------------------


def policy(**options: Any) -> JobFunction[..., None]:
    """A job function with these options, not registered (decide() needs no registry)."""
    return JobFunction(
        lambda: None, name="tests.policy", queue=None, max_attempts=None, priority=0, **options
    )


plain = policy()
both = policy(retry_on=(OSError,), discard_on=(FileNotFoundError,))


def test_decide_retries_every_error_on_the_formula_by_default() -> None:
    assert decide(plain, RuntimeError("x"), 1) == (False, None)
    assert decide(plain, SystemExit(2), 3) == (False, None)


def test_decide_discards_discard_on_errors_and_their_subclasses() -> None:
    assert decide(discards_value_errors, ValueError("x"), 1) == (True, None)
    assert decide(discards_value_errors, UnicodeDecodeError("utf-8", b"", 0, 1, "x"), 1) == (
        True,
        None,
    )
    assert decide(discards_value_errors, RuntimeError("x"), 1) == (False, None)


def test_decide_with_retry_on_gives_up_on_every_other_error() -> None:
    assert decide(retries_connection_errors, ConnectionResetError("x"), 1) == (False, None)
    assert decide(retries_connection_errors, KeyError("x"), 1) == (True, None)


def test_discard_on_wins_over_retry_on() -> None:
    assert decide(both, FileNotFoundError("x"), 1) == (True, None)
    assert decide(both, PermissionError("x"), 1) == (False, None)
    assert decide(both, ValueError("x"), 1) == (True, None)


def test_decide_asks_the_callable_with_the_attempt_and_the_exception() -> None:
    seen = []

    def backoff(attempt: int, exc: BaseException) -> timedelta:
        seen.append((attempt, exc))
        return timedelta(minutes=attempt)

    computed = policy(backoff=backoff)
    error = RuntimeError("x")
    assert decide(computed, error, 3) == (False, 180.0)
    assert seen == [(3, error)]


@pytest.mark.parametrize(
    "returned",
    [None, "10", timedelta(seconds=-1), float("nan"), timedelta(days=36_501), True],
    ids=["none", "text", "negative", "nan", "past-100-years", "bool"],
)
def test_a_callable_returning_garbage_falls_back_to_the_default_schedule(
    returned: object, caplog: pytest.LogCaptureFixture
) -> None:
    garbage = policy(backoff=lambda attempt, exc: returned)
    with caplog.at_level(logging.ERROR, logger="django_pgjobs.worker"):
        assert decide(garbage, RuntimeError("x"), 1) == (False, None)
    assert [r.levelno for r in caplog.records] == [logging.ERROR]
    assert "backoff of" in caplog.records[0].getMessage()


def test_a_callable_returning_seconds_is_taken_as_seconds() -> None:
    assert decide(policy(backoff=lambda attempt, exc: 7.5), RuntimeError("x"), 1) == (False, 7.5)


def test_call_carries_the_decision_and_the_jitter_into_the_outcome() -> None:
    ids = [
        Job.objects.enqueue(discards_value_errors, {"kind": "value"}).id,
        Job.objects.enqueue(fails_with_jitter, {}).id,
        Job.objects.enqueue(fails_with_callable_backoff, {}).id,
    ]
    claimed = {c.id: c for c in Job.objects.claim(limit=3)}
    discarded, jittered, computed = (call(claimed[i], context(claimed[i]), "default") for i in ids)
    assert (discarded.action, discarded.final, discarded.delay) == ("fail", True, None)
    assert (jittered.final, jittered.backoff, jittered.jitter) == (False, (10.0, 3600.0), True)
    assert (computed.final, computed.delay, computed.backoff) == (False, 1001.0, None)


# -- FAIL: the delay and the jitter in the statement ----------------------------------------


def test_jitter_spreads_200_delays_of_one_base_within_75_to_100_percent() -> None:
    make_jobs(400, max_attempts=5)
    claimed = Job.objects.claim(limit=400)
    every = [c.id for c in claimed]
    assert {c.attempts for c in claimed} == {1}
    failure = Failure.of("boom")
    jittered = [FailedAttempt(c, failure, (10.0, 3600.0), jitter=True) for c in claimed[:200]]
    steady = [FailedAttempt(c, failure, (10.0, 3600.0)) for c in claimed[200:]]

    for attempts, ids in ((jittered, every[:200]), (steady, every[200:])):
        before = db_now()
        statuses = finish.fail(connection, attempts, synchronous_commit=None)
        after = db_now()
        assert set(statuses.values()) == {"queued"}
        run_ats = [r[0] for r in query("SELECT run_at FROM pgjobs_job WHERE id = ANY(%s)", [ids])]
        # Attempt 1 of base 10 s: 20 s, drawn from [15 s, 20 s] when jittered.
        for run_at in run_ats:
            assert run_at - before >= timedelta(seconds=15 if attempts is jittered else 20)
            assert run_at - after <= timedelta(seconds=20)
        # One statement, one now(): only the jitter can make two delays differ.
        assert (len(set(run_ats)) > 1) is (attempts is jittered)


def test_a_given_delay_replaces_the_formula_but_not_the_attempt_count() -> None:
    (job_id,) = make_jobs(1, max_attempts=2)
    (claimed,) = Job.objects.claim()
    before = db_now()
    assert Job.objects.fail(claimed, error="later", delay=timedelta(minutes=10)) == "queued"
    after = db_now()
    values = row(job_id)
    assert before + timedelta(minutes=10) <= values["run_at"] <= after + timedelta(minutes=10)
    assert Job.objects.claim() == []  # not due for ten minutes
    query("UPDATE pgjobs_job SET run_at = now() WHERE id = %s RETURNING id", [job_id])
    (claimed,) = Job.objects.claim()
    assert Job.objects.fail(claimed, error="again", delay=5) == "failed"


def test_fail_refuses_a_bad_delay_before_writing() -> None:
    (job_id,) = make_jobs(1)
    (claimed,) = Job.objects.claim()
    with pytest.raises(ValueError, match="delay"):
        Job.objects.fail(claimed, error="x", delay=-1)
    assert row(job_id)["status"] == "running"


# -- through a real worker ------------------------------------------------------------------


def test_discard_on_fails_the_job_at_once(workers: Workers) -> None:
    job_id = Job.objects.enqueue(discards_value_errors, {"kind": "value"}).id
    worker = workers.burst(test_jobs=True)
    values = row(job_id)
    assert (values["status"], values["attempts"], values["max_attempts"]) == ("failed", 1, 5)
    assert values["finished_at"] is not None
    assert "ValueError: no such order" in str(values["last_error"])
    assert "ran 1 jobs: 0 done, 0 to retry, 1 failed" in worker.output()


def test_an_error_not_in_discard_on_is_retried(workers: Workers) -> None:
    job_id = Job.objects.enqueue(discards_value_errors, {"kind": "runtime"}).id
    workers.burst(test_jobs=True)
    values = row(job_id)
    assert (values["status"], values["attempts"]) == ("queued", 1)


def test_with_retry_on_another_error_fails_at_once(workers: Workers) -> None:
    job_id = Job.objects.enqueue(retries_connection_errors, {"kind": "key"}).id
    workers.burst(test_jobs=True)
    values = row(job_id)
    assert (values["status"], values["attempts"], values["max_attempts"]) == ("failed", 1, 5)
    assert "KeyError" in str(values["last_error"])


def test_a_retry_on_error_is_retried_with_the_jobs_backoff(workers: Workers) -> None:
    job_id = Job.objects.enqueue(retries_connection_errors, {"kind": "connection"}).id
    workers.burst(test_jobs=True)
    after = db_now()
    values = row(job_id)
    assert (values["status"], values["attempts"]) == ("queued", 1)
    # backoff=(30, 3600): 30 s * 2^1 after the first attempt.
    delay = timedelta(seconds=60)
    assert values["attempted_at"] + delay <= values["run_at"] <= after + delay


def test_a_callable_backoff_sets_run_at_to_its_delay(workers: Workers) -> None:
    job_id = Job.objects.enqueue(fails_with_callable_backoff, {}).id
    workers.burst(test_jobs=True)
    after = db_now()
    values = row(job_id)
    assert (values["status"], values["attempts"]) == ("queued", 1)
    delay = timedelta(seconds=1001)  # 1000 + the attempt number
    assert values["attempted_at"] + delay <= values["run_at"] <= after + delay


def test_a_broken_callable_backoff_logs_and_uses_the_default_schedule(workers: Workers) -> None:
    job_id = Job.objects.enqueue(fails_with_broken_backoff, {}).id
    worker = workers.burst(test_jobs=True)
    after = db_now()
    values = row(job_id)
    assert (values["status"], values["attempts"]) == ("queued", 1)
    assert "RuntimeError: fails; its backoff fails too" in str(values["last_error"])
    delay = timedelta(seconds=20)  # the default 10 s * 2^1
    assert values["attempted_at"] + delay <= values["run_at"] <= after + delay
    log = worker.log()
    assert "backoff of tests.retry_jobs.fails_with_broken_backoff failed" in log
    assert "ZeroDivisionError: the backoff itself is broken" in log
