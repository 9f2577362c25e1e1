"""django_pgjobs.testing and its pytest plugin: jobs run inside a plain TestCase's transaction
through the worker's own claim and fenced writes, on a test clock, and the assertions on what
was enqueued (with the messages they fail with)."""

from __future__ import annotations

import importlib.metadata
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.test import TestCase, TransactionTestCase

from django_pgjobs import testing
from django_pgjobs.core import conf
from django_pgjobs.exceptions import InvalidJobOptions, UnknownTask
from django_pgjobs.models import Job
from django_pgjobs.pytest_plugin import pgjobs  # noqa: F401 - the plugin's fixture, loaded or not
from django_pgjobs.testing import (
    PgJobs,
    advance,
    assert_enqueued,
    assert_not_enqueued,
    enqueued,
    run_jobs,
    set_clock,
)
from testproject.shop.models import Order
from testproject.testjobs import noop
from tests.helpers import listening, scalar
from tests.testing_jobs import (
    always_snoozes,
    broken,
    cancels_itself,
    confirm_order,
    flaky,
    flaky_task,
    later,
    place_order,
    snoozes_once,
    total_task,
)

CONFIRM = "tests.testing_jobs.confirm_order"


def outcomes_of(results: list[testing.JobOutcome]) -> list[tuple[str, str]]:
    return [(r.task, r.outcome) for r in results]


class AssertionsTests(TestCase):
    def test_assert_enqueued_passes_on_a_subset_of_the_payload(self) -> None:
        job = Job.objects.enqueue(confirm_order, {"order_id": 7})
        found = assert_enqueued(confirm_order, order_id=7)
        assert [e.id for e in found] == [job.id]
        assert [e.id for e in assert_enqueued(CONFIRM)] == [job.id]

    def test_a_failing_assert_enqueued_shows_what_was_enqueued_instead(self) -> None:
        first = confirm_order.enqueue(order_id=1)
        other = noop.enqueue(note="x")
        with pytest.raises(AssertionError) as failure:
            assert_enqueued(confirm_order, order_id=2)
        assert str(failure.value) == (
            f'Expected a job {CONFIRM} with {{"order_id": 2}}; enqueued instead:\n'
            f'  job {first.id} {CONFIRM} (queue emails, queued, attempts 0) {{"order_id": 1}}\n'
            f"  job {other.id} testproject.testjobs.noop (queue default, queued, attempts 0) "
            '{"note": "x"}'
        )

    def test_a_failing_assert_enqueued_on_an_empty_table_says_so(self) -> None:
        with pytest.raises(AssertionError) as failure:
            assert_enqueued(confirm_order)
        assert str(failure.value) == f"Expected a job {CONFIRM}; no job was enqueued"

    def test_a_failing_assert_not_enqueued_lists_the_matching_jobs(self) -> None:
        job = confirm_order.enqueue(order_id=3)
        assert_not_enqueued(confirm_order, order_id=4)
        assert_not_enqueued(noop)
        with pytest.raises(AssertionError) as failure:
            assert_not_enqueued(order_id=3)
        assert str(failure.value) == (
            'Expected no job with {"order_id": 3}; found:\n'
            f'  job {job.id} {CONFIRM} (queue emails, queued, attempts 0) {{"order_id": 3}}'
        )

    def test_enqueued_filters_by_task_and_queue(self) -> None:
        confirm_order.enqueue(order_id=1)
        noop.enqueue()
        assert [e.task for e in enqueued(queue="emails")] == [CONFIRM]
        assert [e.queue for e in enqueued(noop)] == ["default"]
        assert len(enqueued()) == 2

    def test_a_task_is_matched_on_its_keyword_arguments(self) -> None:
        order = Order.objects.create(email="a@example.com", total_cents=5)
        total_task.enqueue(order_id=order.pk)
        (found,) = assert_enqueued(total_task, order_id=order.pk)
        assert found.payload["kwargs"] == {"order_id": order.pk}
        with pytest.raises(AssertionError, match="enqueued instead"):
            assert_enqueued(total_task, order_id=order.pk + 1)


class RunJobsTests(TestCase):
    def test_a_job_that_enqueues_another_runs_both(self) -> None:
        place_order.enqueue(email="b@example.com")
        results = run_jobs()
        assert outcomes_of(results) == [
            ("tests.testing_jobs.place_order", "done"),
            (CONFIRM, "done"),
        ]
        order = Order.objects.get(email="b@example.com")
        assert order.confirmation_sent_at is not None
        assert {j.status for j in Job.objects.all()} == {"done"}

    def test_until_empty_false_leaves_what_the_jobs_enqueued(self) -> None:
        place_order.enqueue(email="c@example.com")
        assert outcomes_of(run_jobs(until_empty=False)) == [
            ("tests.testing_jobs.place_order", "done")
        ]
        assert [e.status for e in enqueued(confirm_order)] == ["queued"]
        assert outcomes_of(run_jobs(until_empty=False)) == [(CONFIRM, "done")]

    def test_a_retry_runs_once_the_clock_is_moved_past_its_backoff(self) -> None:
        order = Order.objects.create(email="d@example.com", total_cents=100)
        flaky.enqueue(order_id=order.pk, fail_until=1)
        start = set_clock(scalar("SELECT now()") + timedelta(minutes=1))
        (first,) = run_jobs()
        assert first.outcome == "retry"
        assert first.error == "RuntimeError: attempt 1 fails on purpose"
        # The failed attempt's write was rolled back with its savepoint.
        order.refresh_from_db()
        assert order.total_cents == 100
        row = Job.objects.get(pk=first.id)
        base, _cap = conf.backoff()
        assert (row.status, row.attempts) == ("queued", 1)
        assert row.run_at == start + timedelta(seconds=base * 2)
        assert run_jobs() == []  # not due yet: the clock stands still
        advance(base * 2 - 0.001)
        assert run_jobs() == []
        advance(0.001)
        (second,) = run_jobs()
        assert (second.outcome, second.attempts, second.error) == ("done", 2, None)
        order.refresh_from_db()
        assert order.total_cents == 2
        assert order.confirmation_sent_at is not None

    def test_a_deferred_job_waits_for_the_clock(self) -> None:
        order = Order.objects.create(email="e@example.com", total_cents=1)
        Job.objects.enqueue(confirm_order, {"order_id": order.pk}, delay=timedelta(hours=1))
        assert run_jobs() == []
        advance(timedelta(minutes=59))
        assert run_jobs() == []
        advance(timedelta(minutes=1))
        assert outcomes_of(run_jobs()) == [(CONFIRM, "done")]

    def test_jobs_enqueued_by_jobs_see_the_test_clock(self) -> None:
        order = Order.objects.create(email="f@example.com", total_cents=1)
        later.enqueue(order_id=order.pk)
        start = set_clock(scalar("SELECT now()") + timedelta(days=1))
        assert outcomes_of(run_jobs()) == [("tests.testing_jobs.later", "done")]
        (child,) = enqueued(confirm_order)
        assert child.run_at == start + timedelta(hours=1)
        assert outcomes_of(run_jobs(now=child.run_at)) == [(CONFIRM, "done")]

    def test_a_snoozed_job_runs_once_its_snooze_is_over(self) -> None:
        snoozes_once.enqueue(seconds=30)
        set_clock(scalar("SELECT now()"))
        assert outcomes_of(run_jobs()) == [("tests.testing_jobs.snoozes_once", "snoozed")]
        advance(29)
        assert run_jobs() == []
        advance(1)
        (done,) = run_jobs()
        assert (done.outcome, done.attempts) == ("done", 1)

    def test_a_failure_is_reported_with_its_error(self) -> None:
        broken.enqueue(message="no such customer")
        (result,) = run_jobs()
        assert result.outcome == "failed"
        assert result.failure is not None
        assert result.failure.exception_class_path == "builtins.ValueError"
        assert result.error == "ValueError: no such customer"
        row = Job.objects.get(pk=result.id)
        assert row.status == "failed"
        assert row.last_error is not None and "no such customer" in row.last_error

    def test_queue_filters_what_runs(self) -> None:
        confirm_order.enqueue(order_id=1)
        noop.enqueue()
        assert outcomes_of(run_jobs(queue="emails")) == [(CONFIRM, "done")]
        assert [e.status for e in enqueued(noop)] == ["queued"]
        assert outcomes_of(run_jobs(queue="default")) == [("testproject.testjobs.noop", "done")]

    def test_a_job_cancelled_while_it_runs_is_reported_cancelled(self) -> None:
        cancels_itself.enqueue()
        (result,) = run_jobs()
        assert result.outcome == "cancelled"
        assert Job.objects.get(pk=result.id).status == "cancelled"

    def test_a_run_that_never_empties_stops_with_an_error(self) -> None:
        always_snoozes.enqueue()
        with pytest.raises(RuntimeError, match="ran 5 jobs and more are due"):
            run_jobs(max_jobs=5)
        with pytest.raises(InvalidJobOptions, match="max_jobs"):
            run_jobs(max_jobs=0)
        # The run's savepoint rolled back with the error: the job is as it was.
        assert Job.objects.get().snoozes == 0
        assert [r.outcome for r in run_jobs(until_empty=False)] == ["snoozed"]

    def test_a_paused_queue_is_not_run_until_resumed(self) -> None:
        Job.objects.pause("emails")
        confirm_order.enqueue(order_id=1)
        noop.enqueue()
        assert outcomes_of(run_jobs()) == [("testproject.testjobs.noop", "done")]
        Job.objects.resume("emails")
        assert outcomes_of(run_jobs()) == [(CONFIRM, "done")]

    def test_jobs_with_lock_keys_run_through_the_guarded_claim(self) -> None:
        ids = [
            Job.objects.enqueue(confirm_order, {"order_id": n}, lock_key="customer:7").id
            for n in (1, 2)
        ]
        Job.objects.set_limits("emails", concurrency=1, rate=(5, timedelta(minutes=1)))
        start = set_clock(scalar("SELECT now()") + timedelta(seconds=5))
        results = run_jobs()
        assert [(r.id, r.outcome) for r in results] == [(ids[0], "done"), (ids[1], "done")]
        # The guarded claim stamped each start in the queue's rate window, on the test clock.
        assert scalar("SELECT starts FROM pgjobs_queue WHERE name = 'emails'") == [start, start]
        # And left the test's transaction as it found it: its GUARD's lock_timeout undone.
        assert scalar("SELECT current_setting('lock_timeout')") == "0"

    def test_a_rolled_back_enqueue_is_not_run(self) -> None:
        with pytest.raises(RuntimeError), transaction.atomic():
            confirm_order.enqueue(order_id=1)
            raise RuntimeError("the view failed")
        assert run_jobs() == []
        assert_not_enqueued(confirm_order)

    def test_the_notify_is_captured_as_an_on_commit_callback(self) -> None:
        with self.captureOnCommitCallbacks() as callbacks:
            confirm_order.enqueue(order_id=1)
            confirm_order.enqueue(order_id=2)
        # One NOTIFY per queue per transaction, sent on commit: here, never, unless run.
        assert len(callbacks) == 1
        with listening() as listener:
            callbacks[0]()
            assert listener.receive(1) == ["emails"]

    def test_tasks_run_and_keep_their_results(self) -> None:
        order = Order.objects.create(email="g@example.com", total_cents=42)
        result = total_task.enqueue(order_id=order.pk)
        (ran,) = run_jobs()
        assert (ran.outcome, ran.result) == ("done", 42)
        result.refresh()
        assert result.return_value == 42

    def test_a_task_is_retried_on_the_test_clock(self) -> None:
        result = flaky_task.enqueue(fail_until=1)
        (first,) = run_jobs()
        assert (first.outcome, first.error) == (
            "retry",
            "RuntimeError: task attempt 1 fails on purpose",
        )
        run_at = Job.objects.get(pk=first.id).run_at
        assert run_jobs() == []
        (second,) = run_jobs(now=run_at)
        assert (second.outcome, second.result) == ("done", 2)
        result.refresh()
        assert result.return_value == 2

    def test_expired_leases_are_reaped_first(self) -> None:
        job = confirm_order.enqueue(order_id=1)
        Job.objects.filter(pk=job.id).update(
            status="running", attempts=1, locked_until=scalar("SELECT now()")
        )
        advance(1)
        (ran,) = run_jobs()
        assert (ran.id, ran.outcome, ran.attempts) == (job.id, "done", 2)
        assert Job.objects.get(pk=job.id).last_error == "lease expired"

    def test_the_clock_is_undone_when_run_jobs_returns(self) -> None:
        path = scalar("SHOW search_path")
        noop.enqueue()
        set_clock(scalar("SELECT now()") + timedelta(days=3))
        run_jobs()
        assert scalar("SHOW search_path") == path
        assert scalar("SELECT to_regnamespace('pgjobs_test_clock')") is None
        # Outside run_jobs() now() is PostgreSQL's again: the test's frozen start.
        assert scalar("SELECT now()") < testing.now()

    def test_the_clock_only_moves_forward_and_takes_time_values(self) -> None:
        with pytest.raises(InvalidJobOptions, match="advance"):
            advance(-1)
        with pytest.raises(InvalidJobOptions, match="advance"):
            advance("soon")

    def test_set_clock_none_gives_the_wall_clock_back(self) -> None:
        far = scalar("SELECT now()") + timedelta(days=30)
        assert set_clock(far) == far
        back = set_clock(None)
        assert scalar("SELECT now()") <= back < far

    def test_a_job_of_an_unregistered_task_fails_naming_it(self) -> None:
        job_id = scalar(
            "INSERT INTO pgjobs_job (task, payload) VALUES ('gone.task', '{\"a\": 1}') RETURNING id"
        )
        (found,) = assert_enqueued("gone.task", a=1)
        assert found.kwargs == {"a": 1}
        (result,) = run_jobs()
        assert (result.id, result.outcome) == (job_id, "retry")
        assert result.error is not None and "Unknown task 'gone.task'" in result.error

    def test_a_plain_function_names_its_job(self) -> None:
        confirm_order.enqueue(order_id=1)
        assert [e.task for e in enqueued(confirm_order.func)] == [CONFIRM]

    def test_the_task_argument_must_be_a_task(self) -> None:
        with pytest.raises(UnknownTask, match="is not a task"):
            enqueued(42)

    def test_set_clock_refuses_a_naive_time(self) -> None:
        with pytest.raises(InvalidJobOptions, match="naive"):
            set_clock(scalar("SELECT now()").replace(tzinfo=None))


class OutsideATransactionTests(TransactionTestCase):
    def test_run_jobs_needs_the_tests_transaction(self) -> None:
        assert not connection.in_atomic_block
        with pytest.raises(InvalidJobOptions, match=r"use django\.test\.TestCase"):
            run_jobs()


def test_the_fixture_runs_jobs_and_asserts(pgjobs: PgJobs) -> None:  # noqa: F811
    place_order.enqueue(email="h@example.com")
    pgjobs.assert_enqueued(place_order, email="h@example.com")
    pgjobs.assert_not_enqueued(confirm_order)
    assert [r.outcome for r in pgjobs.run_jobs()] == ["done", "done"]
    pgjobs.assert_enqueued(confirm_order)


def test_the_fixture_moves_the_clock(pgjobs: PgJobs) -> None:  # noqa: F811
    order = Order.objects.create(email="i@example.com", total_cents=1)
    flaky.enqueue(order_id=order.pk, fail_until=2)
    assert [r.outcome for r in pgjobs.run_jobs()] == ["retry"]
    pgjobs.advance(timedelta(hours=1))
    assert [r.outcome for r in pgjobs.run_jobs()] == ["retry"]
    pgjobs.advance(timedelta(hours=1))
    assert [(r.outcome, r.attempts) for r in pgjobs.run_jobs()] == [("done", 3)]
    assert pgjobs.now() > scalar("SELECT now()") + timedelta(hours=2)


def test_the_pytest_plugin_is_installed_as_an_entry_point(request: pytest.FixtureRequest) -> None:
    # This module imports the fixture itself, so that it runs without the package installed;
    # installed (pip install, as make test does), pytest loads the plugin on its own.
    plugins = importlib.metadata.entry_points(group="pytest11")
    assert [p.value for p in plugins if p.value == "django_pgjobs.pytest_plugin"] == [
        "django_pgjobs.pytest_plugin"
    ]
    assert request.config.pluginmanager.has_plugin("django_pgjobs.pytest_plugin")
