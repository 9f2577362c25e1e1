"""The django.tasks backend, in this process: configuration, enqueue, get_result, the
transaction and claim-order contracts, signals (with an in-process burst worker), and check().

The framework is imported from ``django.tasks`` on Django 6 and from the ``django-tasks``
backport before that, like the backend itself.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.conf import settings
from django.core.checks import run_checks
from django.db import connection, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_pgjobs import Snooze, current_job
from django_pgjobs.backends import InvalidTaskArguments, PgJobsBackend
from django_pgjobs.core import claim, registry
from django_pgjobs.exceptions import InvalidPayload
from django_pgjobs.models import Job
from django_pgjobs.worker import Worker
from testproject.shop.models import Order
from testproject.shop.tasks import double, order_total, returns_a_set, which_attempt
from testproject.testjobs import noop
from tests.helpers import (
    PATIENCE,
    DbThread,
    db_now,
    job_row,
    listening,
    nested,
    query,
    raw_connect,
    scalar,
    wait_until,
)

try:  # Django 6.0+
    from django.tasks import TaskResult, TaskResultStatus, task, task_backends
    from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist, TaskResultMismatch
    from django.tasks.signals import task_enqueued, task_finished, task_started
except ImportError:  # the django-tasks backport
    from django_tasks import TaskResult, TaskResultStatus, task, task_backends
    from django_tasks.exceptions import TaskResultDoesNotExist, TaskResultMismatch
    from django_tasks.signals import task_enqueued, task_finished, task_started

    try:  # the backport after 0.12 uses Django's name
        from django_tasks.exceptions import InvalidTask
    except ImportError:
        from django_tasks.exceptions import InvalidTaskError as InvalidTask

pytestmark = [pytest.mark.tasks]

ORDER_TOTAL = "testproject.shop.tasks.order_total"
READY, RUNNING = TaskResultStatus.READY, TaskResultStatus.RUNNING
SUCCESSFUL, FAILED = TaskResultStatus.SUCCESSFUL, TaskResultStatus.FAILED


@pytest.fixture
def received() -> Iterator[Callable[[Any], list[tuple[type, TaskResult[Any, Any]]]]]:
    """``received(signal)`` connects a receiver for the test; it returns what it got so far."""
    seen: dict[Any, list[tuple[type, TaskResult[Any, Any]]]] = {}
    receivers: list[tuple[Any, Callable[..., None]]] = []
    lock = threading.Lock()

    def connect(signal: Any) -> list[tuple[type, TaskResult[Any, Any]]]:
        if signal not in seen:
            seen[signal] = []

            def receiver(sender: type, task_result: TaskResult[Any, Any], **kwargs: Any) -> None:
                with lock:
                    seen[signal].append((sender, task_result))

            signal.connect(receiver, weak=False)
            receivers.append((signal, receiver))
        return seen[signal]

    yield connect
    for signal, receiver in receivers:
        signal.disconnect(receiver)


def last_line(traceback: str) -> str:
    return traceback.strip().splitlines()[-1]


def row_count() -> int:
    return int(scalar("SELECT count(*) FROM pgjobs_job"))


def other_sees(job_id: int | str) -> bool:
    """Whether a second connection, outside this process's transaction, sees the row."""
    with raw_connect() as other:
        row = other.execute("SELECT count(*) FROM pgjobs_job WHERE id = %s", [int(job_id)])
        return bool(row.fetchone()[0])  # type: ignore[index]


# -- configuration -------------------------------------------------------------------------


def test_the_default_backend_is_pgjobs_and_supports_what_the_framework_allows() -> None:
    backend = task_backends["default"]
    assert type(backend) is PgJobsBackend
    assert backend.supports_defer is True
    assert backend.supports_priority is True
    assert backend.supports_get_result is True
    assert backend.supports_async_task is True
    # testproject's TASKS: its queues and OPTIONS, not the PGJOBS defaults (5, 10 s, 3600 s).
    assert backend.queues == {"default", "emails", "reports"}
    assert (backend.database, backend.max_attempts, backend.backoff) == ("default", 3, (1.0, 60.0))
    assert order_total.get_backend() is backend


# -- enqueue -------------------------------------------------------------------------------


@pytest.mark.django_db
def test_enqueue_returns_a_ready_result_whose_id_is_the_row() -> None:
    result = order_total.enqueue(7)

    assert isinstance(result, TaskResult)
    assert result.status == READY
    row = Job.objects.get(pk=int(result.id))
    assert result.id == str(row.pk)
    assert result.enqueued_at is not None and result.enqueued_at == row.created_at
    assert (result.started_at, result.finished_at, result.last_attempted_at) == (None, None, None)
    assert (result.args, result.kwargs) == ([7], {})
    assert result.backend == "default"
    assert (result.errors, result.worker_ids, result.attempts) == ([], [], 0)
    assert result.task is order_total
    with pytest.raises(ValueError, match="not finished"):
        result.return_value  # noqa: B018 - the property raises
    # The row: the function's module path, the task's queue and priority, the arguments.
    assert row.task == ORDER_TOTAL
    assert (row.queue, row.priority, row.status, row.attempts) == ("default", 10, "queued", 0)
    assert row.max_attempts == 3  # OPTIONS["MAX_ATTEMPTS"], not PGJOBS' 5
    assert row.payload == {"args": [7], "kwargs": {}, "backend": "default"}


@pytest.mark.django_db
def test_enqueue_keeps_keyword_and_nested_arguments() -> None:
    result = which_attempt.enqueue(fail_until=2)
    assert (result.args, result.kwargs) == ([], {"fail_until": 2})
    assert job_row(int(result.id))["payload"] == {
        "args": [],
        "kwargs": {"fail_until": 2},
        "backend": "default",
    }

    nested = double.enqueue({"a": [1, 2.5, None, True]}, note="é")
    assert job_row(int(nested.id))["payload"]["args"] == [{"a": [1, 2.5, None, True]}]
    assert double.get_result(nested.id).kwargs == {"note": "é"}


@pytest.mark.django_db
def test_using_sets_the_rows_priority_and_queue() -> None:
    result = order_total.using(priority=-5, queue_name="reports").enqueue(1)

    row = job_row(int(result.id))
    assert (row["queue"], row["priority"]) == ("reports", -5)
    assert (result.task.queue_name, result.task.priority) == ("reports", -5)
    fetched = order_total.get_result(result.id)
    assert (fetched.task.queue_name, fetched.task.priority) == ("reports", -5)
    # The decorated task itself is unchanged.
    assert (order_total.queue_name, order_total.priority) == ("default", 10)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        pytest.param({"queue_name": "nope"}, "Queue 'nope'", id="queue-not-in-QUEUES"),
        pytest.param({"run_after": datetime(2030, 1, 1, 12)}, "aware", id="naive-run_after"),
        pytest.param({"priority": 101}, "priority", id="priority-above-100"),
        pytest.param({"priority": -101}, "priority", id="priority-below-minus-100"),
    ],
)
@pytest.mark.django_db
def test_invalid_task_options_are_refused_before_anything_is_written(
    options: dict[str, Any], message: str, received: Callable[[Any], list[Any]]
) -> None:
    enqueued = received(task_enqueued)
    with pytest.raises(InvalidTask, match=message):
        order_total.using(**options).enqueue(1)
    assert row_count() == 0
    assert enqueued == []


@pytest.mark.django_db
def test_the_priority_range_ends_are_accepted() -> None:
    low = double.using(priority=-100).enqueue(1)
    high = double.using(priority=100).enqueue(1)
    assert (job_row(int(low.id))["priority"], job_row(int(high.id))["priority"]) == (-100, 100)
    # The framework accepts any whole number, 5.0 included.
    whole = double.using(priority=5.0).enqueue(1)
    assert job_row(int(whole.id))["priority"] == 5


@pytest.mark.parametrize(
    ("args", "kwargs", "where"),
    [
        pytest.param(({1, 2},), {}, r"payload\['args'\]\[0\] is a set", id="set"),
        pytest.param((object(),), {}, r"payload\['args'\]\[0\] is a object", id="object"),
        pytest.param((Decimal("1.5"),), {}, r"payload\['args'\]\[0\] is a Decimal", id="decimal"),
        pytest.param((b"raw",), {}, r"payload\['args'\]\[0\] is a bytes", id="bytes"),
        pytest.param((float("nan"),), {}, r"payload\['args'\]\[0\] is nan", id="nan"),
        pytest.param(
            (),
            {"when": timezone.now()},
            r"payload\['kwargs'\]\['when'\] is a datetime",
            id="datetime-kwarg",
        ),
        pytest.param(({1: "int key"},), {}, r"has a key 1 that is not a string", id="int-key"),
    ],
)
@pytest.mark.django_db
def test_arguments_that_are_not_json_values_raise_type_error_and_write_nothing(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    where: str,
    received: Callable[[Any], list[Any]],
) -> None:
    enqueued = received(task_enqueued)
    with pytest.raises(TypeError, match=where):
        double.enqueue(*args, **kwargs)
    assert row_count() == 0
    assert enqueued == []


@pytest.mark.parametrize(
    ("args", "where"),
    [
        pytest.param(
            ("caf\udce9",), r"payload\['args'\]\[0\] contains a lone surrogate", id="surrogate"
        ),
        pytest.param(
            ({"caf\ud800": 1},),
            r"payload\['args'\]\[0\] has a key .* surrogate",
            id="surrogate-key",
        ),
        pytest.param(
            (10**5000,), r"payload\['args'\]\[0\] is an integer of 5001 digits", id="long-int"
        ),
        pytest.param((nested(5000),), r"payload\['args'\]\[0\].* more than 100 levels", id="deep"),
    ],
)
@pytest.mark.django_db
def test_arguments_jsonb_cannot_store_raise_invalid_task_before_anything_is_sent(
    args: tuple[Any, ...], where: str, received: Callable[[Any], list[Any]]
) -> None:
    enqueued = received(task_enqueued)
    with transaction.atomic():
        with (
            CaptureQueriesContext(connection) as sent,
            pytest.raises(InvalidTask, match=where) as info,
        ):
            double.enqueue(*args)
        assert sent.captured_queries == []
        # The caller's transaction is still usable.
        Order.objects.create(email="a@example.com", total_cents=1)
    # Also a TypeError, as the framework's own backends raise for such arguments.
    assert isinstance(info.value, InvalidTaskArguments)
    assert isinstance(info.value, InvalidPayload) and isinstance(info.value, TypeError)
    assert row_count() == 0
    assert enqueued == []


@pytest.mark.parametrize(
    ("backend", "options", "match"),
    [
        pytest.param(
            {"OPTIONS": {"MAX_ATTEMPTS": 2**31}}, {}, "max_attempts", id="max_attempts-2**31"
        ),
        pytest.param(
            {},
            {"run_after": datetime.max.replace(tzinfo=dt_timezone(-timedelta(hours=14)))},
            "run_at",
            id="run_after-past-year-9999-in-utc",
        ),
    ],
)
@pytest.mark.django_db
def test_options_out_of_range_raise_invalid_task_before_anything_is_sent(
    backend: dict[str, Any],
    options: dict[str, Any],
    match: str,
    received: Callable[[Any], list[Any]],
) -> None:
    enqueued = received(task_enqueued)
    pgjobs = PgJobsBackend("x", backend)
    task = order_total.using(**options)
    with transaction.atomic():
        with CaptureQueriesContext(connection) as sent, pytest.raises(InvalidTask, match=match):
            pgjobs.enqueue(task, [1], {})
        assert sent.captured_queries == []
        Order.objects.create(email="a@example.com", total_cents=1)
    assert row_count() == 0
    assert enqueued == []


@pytest.mark.django_db
def test_task_enqueued_is_sent_with_the_result(
    received: Callable[[Any], list[tuple[type, TaskResult[Any, Any]]]],
) -> None:
    enqueued = received(task_enqueued)

    result = order_total.enqueue(3)

    assert len(enqueued) == 1
    sender, sent = enqueued[0]
    assert sender is PgJobsBackend
    assert sent is result
    assert (sent.status, sent.args) == (READY, [3])


# -- get_result ----------------------------------------------------------------------------


@pytest.mark.parametrize("result_id", [str(10**15), "not-a-number", "", "1.5"])
@pytest.mark.django_db
def test_get_result_of_an_unknown_id_raises_does_not_exist(result_id: str) -> None:
    order_total.enqueue(1)  # a row exists; just not this one
    with pytest.raises(TaskResultDoesNotExist):
        task_backends["default"].get_result(result_id)
    with pytest.raises(TaskResultDoesNotExist):
        order_total.get_result(result_id)


@pytest.mark.django_db
def test_get_result_of_a_job_row_raises_does_not_exist() -> None:
    job = Job.objects.enqueue(noop, {"n": 1})
    with pytest.raises(TaskResultDoesNotExist, match="@job"):
        task_backends["default"].get_result(str(job.id))


@pytest.mark.django_db
def test_get_result_of_another_tasks_row_is_a_mismatch() -> None:
    other = double.enqueue(1)
    with pytest.raises(TaskResultMismatch):
        order_total.get_result(other.id)


@pytest.mark.django_db
def test_get_result_reads_the_row_back() -> None:
    enqueued = which_attempt.enqueue(fail_until=1)

    fetched = which_attempt.get_result(enqueued.id)

    assert fetched is not enqueued
    for name in (
        "id",
        "status",
        "enqueued_at",
        "started_at",
        "finished_at",
        "last_attempted_at",
        "args",
        "kwargs",
        "backend",
        "errors",
        "worker_ids",
    ):
        assert getattr(fetched, name) == getattr(enqueued, name), name
    assert fetched.task.func is which_attempt.func
    assert fetched.task.takes_context is True


ERROR = {"exception_class_path": "builtins.KeyError", "traceback": "KeyError: 'x'"}


@pytest.mark.parametrize(
    ("status", "expected"),
    [("queued", READY), ("running", RUNNING), ("done", SUCCESSFUL), ("failed", FAILED)],
)
@pytest.mark.django_db
def test_get_result_maps_each_row_state(status: str, expected: TaskResultStatus) -> None:
    result = order_total.enqueue(1)
    query(
        "UPDATE pgjobs_job SET status = %s, attempts = 2, started_at = now() - interval '1 m', "
        "attempted_at = now(), finished_at = CASE WHEN %s IN ('done', 'failed') THEN now() END, "
        "result = CASE WHEN %s = 'done' THEN '{\"total_cents\": 5}'::jsonb END, "
        'errors = jsonb_build_array(%s::jsonb), worker_ids = \'["w1", "w2"]\' WHERE id = %s '
        "RETURNING id",
        [status, status, status, json.dumps(ERROR), int(result.id)],
    )

    fetched = order_total.get_result(result.id)

    assert fetched.status == expected
    assert fetched.worker_ids == ["w1", "w2"] and fetched.attempts == 2
    assert [(e.exception_class_path, e.traceback) for e in fetched.errors] == [
        ("builtins.KeyError", "KeyError: 'x'")
    ]
    assert fetched.errors[0].exception_class is KeyError
    assert fetched.started_at is not None and fetched.last_attempted_at is not None
    assert fetched.is_finished == (status in ("done", "failed"))
    assert (fetched.finished_at is not None) == fetched.is_finished
    if status == "done":
        assert fetched.return_value == {"total_cents": 5}
    else:
        with pytest.raises(ValueError, match="failed" if status == "failed" else "not finished"):
            fetched.return_value  # noqa: B018 - the property raises
    # refresh() goes through get_result too.
    result.refresh()
    assert (result.status, result.worker_ids) == (expected, ["w1", "w2"])


# -- transactions --------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_enqueue_inside_atomic_is_visible_to_others_and_notified_only_on_commit() -> None:
    with listening() as listener:
        with transaction.atomic():
            result = order_total.enqueue(1)
            assert not other_sees(result.id)
            assert listener.quiet() == []
            # This connection sees its own row.
            assert order_total.get_result(result.id).status == READY
        assert other_sees(result.id)
        assert listener.receive(1) == ["default"]


@pytest.mark.django_db(transaction=True)
def test_a_rolled_back_enqueue_leaves_no_row_and_sends_nothing() -> None:
    with listening() as listener:
        with pytest.raises(RuntimeError, match="changed my mind"), transaction.atomic():
            result = order_total.enqueue(1)
            raise RuntimeError("changed my mind")
        assert listener.quiet() == []
    assert row_count() == 0
    assert not other_sees(result.id)
    with pytest.raises(TaskResultDoesNotExist):
        order_total.get_result(result.id)


# -- run_after and priority, through the real claim --------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_run_after_is_honoured_by_the_claim() -> None:
    when = timezone.now() + timedelta(seconds=1)
    result = double.using(run_after=when).enqueue(2)
    assert result.task.run_after == when
    assert job_row(int(result.id))["run_at"] == when

    assert Job.objects.claim("default", limit=10) == []

    claimed = wait_until(
        lambda: Job.objects.claim("default", limit=10),
        timeout=10,
        message="the deferred task to become claimable",
    )
    assert [job.id for job in claimed] == [int(result.id)]
    assert db_now() >= when


@pytest.mark.django_db(transaction=True)
def test_the_claim_takes_higher_priority_first_then_the_oldest() -> None:
    low = double.using(priority=-100).enqueue(1)
    first_default = double.enqueue(2)
    high = double.using(priority=100).enqueue(3)
    decorated = order_total.enqueue(4)  # @task(priority=10)
    second_default = double.enqueue(5)
    elsewhere = double.using(priority=100, queue_name="emails").enqueue(6)

    order = []
    while claimed := Job.objects.claim("default", limit=1):
        order.append(str(claimed[0].id))

    assert order == [high.id, decorated.id, first_default.id, second_default.id, low.id]
    assert job_row(int(elsewhere.id))["status"] == "queued"


@pytest.mark.django_db(transaction=True)
def test_the_claim_with_task_priorities_still_scans_the_ready_index() -> None:

    for n in range(60):
        double.using(priority=(n * 37) % 201 - 100).enqueue(n)
    for n in range(20):
        double.using(queue_name="emails").enqueue(n)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE pgjobs_job")
        cursor.execute(
            "EXPLAIN (COSTS OFF) " + claim.CLAIM,
            {
                "queue": "default",
                "limit": 10,
                "lease": "5 minutes",
                "worker_id": "explain",
                "suspects": True,
                "synchronous_commit": None,
                "tasks": None,
            },
        )
        lines = [row[0] for row in cursor.fetchall()]
    plan = "\n".join(lines)
    # The CTE that picks the rows: everything indented under "CTE next".
    start = next(i for i, line in enumerate(lines) if line.strip() == "CTE next")
    indent = len(lines[start]) - len(lines[start].lstrip())
    cte = [start]
    for i in range(start + 1, len(lines)):
        if len(lines[i]) - len(lines[i].lstrip()) <= indent:
            break
        cte.append(i)
    picking = "\n".join(lines[i] for i in cte)
    assert "Index Scan using pgjobs_job_ready_idx on pgjobs_job" in picking, plan
    # The index hands rows over in the claim's order: nothing sorts or scans the table.
    assert "Sort" not in picking and "Seq Scan" not in picking, plan


# -- async API -----------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_aenqueue_and_aget_result_use_the_callers_connection() -> None:
    with transaction.atomic():
        result = async_to_sync(order_total.aenqueue)(5)
        # Same transaction as the caller: others see it only after the commit.
        assert not other_sees(result.id)
    assert other_sees(result.id)
    assert (result.status, result.args, result.backend) == (READY, [5], "default")

    fetched = async_to_sync(order_total.aget_result)(result.id)
    assert (fetched.id, fetched.status, fetched.args) == (result.id, READY, [5])
    async_to_sync(result.arefresh)()
    assert result.status == READY
    with pytest.raises(TaskResultDoesNotExist):
        async_to_sync(task_backends["default"].aget_result)("nope")
    # async_to_sync runs each call's event loop in a thread pool of its own, which is not shut
    # down: its thread ends once the pool is garbage-collected (the conftest waits for that).
    gc.collect()


# -- the worker, in this process: task_started and task_finished ----------------------------


@pytest.mark.django_db(transaction=True)
def test_the_worker_sends_task_started_and_task_finished(
    received: Callable[[Any], list[tuple[type, TaskResult[Any, Any]]]],
) -> None:
    started, finished = received(task_started), received(task_finished)
    order = Order.objects.create(email="signals@example.com", total_cents=1234)
    succeeds = order_total.enqueue(order.pk)
    retries = which_attempt.enqueue(fail_until=1)
    gives_up = which_attempt.enqueue(fail_until=5)
    # Two attempts already spent: this run is its last.
    query(
        'UPDATE pgjobs_job SET attempts = 2, worker_ids = \'["a", "b"]\' WHERE id = %s '
        "RETURNING id",
        [int(gives_up.id)],
    )

    # max_jobs: the retry comes due 2 s later, and a slow run must not claim it too.
    worker = Worker(["default"], burst=True, concurrency=2, reap_interval=0, max_jobs=3)
    stats = worker.run()

    assert (stats.done, stats.retried, stats.failed) == (1, 1, 1)
    assert {sender for sender, _ in started + finished} == {PgJobsBackend}
    by_id = {result.id: result for _, result in started}
    assert sorted(by_id) == sorted([succeeds.id, retries.id, gives_up.id])
    assert len(started) == 3
    for result in by_id.values():
        assert result.status == RUNNING
        assert result.worker_ids[-1] == worker.worker_id
        assert result.started_at is not None and result.last_attempted_at is not None
    assert by_id[gives_up.id].attempts == 3

    outcome = {result.id: result for _, result in finished}
    assert len(finished) == 3
    assert outcome[succeeds.id].status == SUCCESSFUL
    assert outcome[succeeds.id].return_value == {"order": order.pk, "total_cents": 1234}
    assert outcome[succeeds.id].finished_at is not None
    assert outcome[succeeds.id].errors == []
    # A retry follows: READY, not finished. Out of attempts: FAILED. Either way the result
    # lists the error of the attempt that just failed, as the framework's own backends do.
    assert outcome[retries.id].status == READY
    assert outcome[retries.id].finished_at is None
    assert [last_line(e.traceback) for e in outcome[retries.id].errors] == [
        "RuntimeError: attempt 1 fails on purpose"
    ]
    assert outcome[gives_up.id].status == FAILED
    assert outcome[gives_up.id].finished_at is not None
    assert outcome[gives_up.id].errors[-1].exception_class_path == "builtins.RuntimeError"
    assert last_line(outcome[gives_up.id].errors[-1].traceback) == (
        "RuntimeError: attempt 3 fails on purpose"
    )
    with pytest.raises(ValueError, match="failed"):
        outcome[gives_up.id].return_value  # noqa: B018 - the property raises

    # What the signals said is what the table now says.
    assert order_total.get_result(succeeds.id).return_value == {
        "order": order.pk,
        "total_cents": 1234,
    }
    assert which_attempt.get_result(retries.id).status == READY
    assert which_attempt.get_result(gives_up.id).status == FAILED


@pytest.mark.django_db(transaction=True)
def test_an_in_process_worker_runs_async_context_and_bad_result_tasks() -> None:
    doubled = double.enqueue(21)
    context = which_attempt.enqueue()
    bad = returns_a_set.enqueue()

    stats = Worker(["default"], burst=True, concurrency=1, reap_interval=0, max_jobs=3).run()

    assert (stats.done, stats.retried) == (2, 1)
    assert double.get_result(doubled.id).return_value == 42
    assert which_attempt.get_result(context.id).return_value == 1
    failed = returns_a_set.get_result(bad.id)
    assert failed.status == READY
    assert [e.exception_class_path for e in failed.errors] == [
        "django_pgjobs.exceptions.InvalidResult"
    ]


# -- check() -------------------------------------------------------------------------------


def test_the_configured_backend_and_a_bare_one_have_no_problems() -> None:
    assert list(task_backends["default"].check()) == []
    assert PgJobsBackend("x", {}).check() == []
    assert [m for m in run_checks() if m.id and m.id.startswith("pgjobs.")] == []


@pytest.mark.parametrize(
    ("params", "check_id", "names"),
    [
        pytest.param({"OPTIONS": {"RETRIES": 3}}, "pgjobs.E020", "'RETRIES'", id="unknown-key"),
        pytest.param(
            {"OPTIONS": {"DATABASE": "nowhere"}}, "pgjobs.E021", "'nowhere'", id="unknown-alias"
        ),
        pytest.param(
            {"QUEUES": ["default", "bad queue"]}, "pgjobs.E022", "'bad queue'", id="bad-queue"
        ),
        pytest.param(
            {"OPTIONS": {"MAX_ATTEMPTS": 0}}, "pgjobs.E023", "['MAX_ATTEMPTS'] 0:", id="no-attempts"
        ),
        pytest.param(
            {"OPTIONS": {"MAX_ATTEMPTS": 2**31}},
            "pgjobs.E023",
            "2147483648",
            id="too-many-attempts",
        ),
        pytest.param(
            {"OPTIONS": {"BACKOFF_MAX": 1e300}}, "pgjobs.E024", "'BACKOFF_MAX'", id="huge-max"
        ),
        pytest.param(
            {"OPTIONS": {"BACKOFF_BASE": -1}}, "pgjobs.E024", "'BACKOFF_BASE'", id="negative-base"
        ),
        pytest.param(
            {"OPTIONS": {"RETRY_ON": ["nowhere.at_all.Error"]}},
            "pgjobs.E026",
            "'nowhere.at_all.Error'",
            id="retry-on-unimportable",
        ),
        pytest.param(
            {"OPTIONS": {"DISCARD_ON": ["builtins.len"]}},
            "pgjobs.E027",
            "'builtins.len'",
            id="discard-on-not-an-exception",
        ),
        pytest.param(
            {"OPTIONS": {"DISCARD_ON": "builtins.ValueError"}},
            "pgjobs.E027",
            "['DISCARD_ON'] is 'builtins.ValueError'",
            id="discard-on-not-a-list",
        ),
        pytest.param(
            {"OPTIONS": {"RETRY_ON": []}}, "pgjobs.E027", "['RETRY_ON']", id="retry-on-nothing"
        ),
        pytest.param(
            {"OPTIONS": {"BACKOFF_JITTER": 1}}, "pgjobs.E028", "'BACKOFF_JITTER'", id="jitter-int"
        ),
        pytest.param({"OPTIONS": {"TIMEOUT": 0}}, "pgjobs.E029", "'TIMEOUT'", id="timeout-zero"),
        pytest.param(
            {"OPTIONS": {"BACKOFF_BASE": 120, "BACKOFF_MAX": 60}},
            "pgjobs.E009",
            "BACKOFF_BASE=120, BACKOFF_MAX=60",
            id="base-above-max",
        ),
        pytest.param(
            # Against the PGJOBS default base of 10 s.
            {"OPTIONS": {"BACKOFF_MAX": 5}},
            "pgjobs.E009",
            "BACKOFF_MAX=5",
            id="max-below-default",
        ),
    ],
)
def test_check_names_the_problem_in_the_backends_settings(
    params: dict[str, Any], check_id: str, names: str
) -> None:
    problems = PgJobsBackend("x", params).check()

    assert [m.id for m in problems] == [check_id]
    assert problems[0].is_serious()
    assert "TASKS['x']" in problems[0].msg and names in problems[0].msg, problems[0].msg


def test_valid_policy_options_have_no_problems() -> None:
    options = {
        "RETRY_ON": ["builtins.ConnectionError", "builtins.TimeoutError"],
        "DISCARD_ON": ["builtins.ValueError"],
        "BACKOFF_JITTER": True,
        "TIMEOUT": 30,
    }
    assert PgJobsBackend("x", {"OPTIONS": options}).check() == []


def raises(kind: str) -> None:
    """A task body for the policy backend: raise the builtin exception named ``kind``."""
    if kind == "Snooze":
        raise Snooze(timedelta(hours=1))
    raise {"ValueError": ValueError, "ConnectionError": ConnectionError}[kind](kind)


POLICY_TASKS = {
    "default": settings.TASKS["default"],
    "policy": {
        "BACKEND": "django_pgjobs.backends.PgJobsBackend",
        "OPTIONS": {
            "MAX_ATTEMPTS": 5,
            "RETRY_ON": ["builtins.ConnectionError"],
            "DISCARD_ON": ["builtins.ValueError"],
            "BACKOFF_JITTER": True,
            "TIMEOUT": 45,
        },
    },
}


@pytest.mark.django_db(transaction=True)
def test_options_map_to_the_registration_and_the_worker_follows_them(
    received: Callable[[Any], list[tuple[type, TaskResult[Any, Any]]]],
) -> None:
    finished = received(task_finished)
    with override_settings(TASKS=POLICY_TASKS):
        policy_task = task(backend="policy")(raises)
        discarded = policy_task.enqueue("ValueError")
        retried = policy_task.enqueue("ConnectionError")
        snoozed = policy_task.enqueue("Snooze")

        registered = registry.get(policy_task.module_path)
        assert registered.retry_on == (ConnectionError,)
        assert registered.discard_on == (ValueError,)
        assert registered.backoff_jitter is True
        assert registered.timeout == timedelta(seconds=45)
        assert job_row(int(discarded.id))["max_attempts"] == 5

        stats = Worker(["default"], burst=True, concurrency=1, reap_interval=0, max_jobs=3).run()
        after = db_now()

        assert (stats.retried, stats.failed, stats.snoozed) == (1, 1, 1)
        signalled = {result.id: result for _, result in finished}
        assert signalled[discarded.id].status == FAILED
        assert (signalled[snoozed.id].status, signalled[snoozed.id].errors) == (READY, [])
        # DISCARD_ON: failed at its first attempt of five, and the result says so.
        gone = policy_task.get_result(discarded.id)
        assert (gone.status, gone.attempts) == (FAILED, 1)
        assert gone.finished_at is not None
        # RETRY_ON: queued again. This backend sets no BACKOFF_*, so PGJOBS's 10 s * 2^1,
        # drawn from 75 % to 100 % of itself.
        again = policy_task.get_result(retried.id)
        assert again.status == READY
        row = job_row(int(retried.id))
        assert (row["status"], row["attempts"]) == ("queued", 1)
        assert again.last_attempted_at is not None
        assert again.last_attempted_at + timedelta(seconds=15) <= row["run_at"]
        assert row["run_at"] <= after + timedelta(seconds=20)
        assert scalar("SELECT timeout FROM pgjobs_job WHERE id = %s", [int(retried.id)]) == (
            timedelta(seconds=45)
        )
        # A task that snoozes: READY again an hour later, no attempt spent, no error listed.
        later = policy_task.get_result(snoozed.id)
        assert (later.status, later.errors) == (READY, [])
        assert query(
            "SELECT status, attempts, snoozes FROM pgjobs_job WHERE id = %s", [int(snoozed.id)]
        ) == [("queued", 0, 1)]


def test_manage_py_check_reports_the_backends_problems() -> None:
    bad = {
        "default": {
            "BACKEND": "django_pgjobs.backends.PgJobsBackend",
            "QUEUES": ["default", "emails", "reports"],
            "OPTIONS": {"MAX_ATTEMPTS": 3, "BACKOFF_BASE": 1.0, "BACKOFF_MAX": 60.0, "NOPE": 1},
        }
    }
    with override_settings(TASKS=bad):
        ids = [m.id for m in run_checks()]
    assert "pgjobs.E020" in ids
    assert list(task_backends["default"].check()) == []


# -- the app left out of INSTALLED_APPS ------------------------------------------------------

# A project that names the backend in TASKS but forgot the app: what `manage.py check` and
# the first enqueue say. The task module is imported first, as a view that uses it would.
WITHOUT_THE_APP = """
import django
from django.core.management import call_command
from django.core.management.base import SystemCheckError

django.setup()
from testproject.shop.tasks import double

try:
    call_command("check")
    print("CHECK passed")
except SystemCheckError as exc:
    print("CHECK", exc)
try:
    double.enqueue(1)
    print("ENQUEUE passed")
except Exception as exc:
    print("ENQUEUE", type(exc).__name__, exc)
"""


def test_tasks_naming_the_backend_without_the_app_installed_is_reported(tmp_path: Path) -> None:
    (tmp_path / "without_pgjobs.py").write_text(
        "from testproject.settings import *  # noqa: F403\n"
        "INSTALLED_APPS = [a for a in INSTALLED_APPS if a != 'django_pgjobs']  # noqa: F405\n"
    )
    root = Path(__file__).resolve().parent.parent
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "without_pgjobs",
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(root)]),
    }
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_THE_APP],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    lines = done.stdout.splitlines()
    assert "CHECK passed" not in lines, done.stdout
    assert "pgjobs.E025" in done.stdout, done.stdout
    assert "'django_pgjobs' is not in INSTALLED_APPS" in done.stdout
    assert "HINT: Add 'django_pgjobs' to INSTALLED_APPS" in done.stdout
    (enqueue,) = [line for line in lines if line.startswith("ENQUEUE")]
    assert enqueue.startswith("ENQUEUE ImproperlyConfigured"), enqueue
    assert "add 'django_pgjobs' to INSTALLED_APPS" in enqueue


def runs_until_cancelled() -> str:
    """A task body that works until its heartbeat says it was cancelled, then returns."""
    ctx = current_job()
    assert ctx is not None
    wait_until(lambda: ctx.cancelled, interval=0.05, message="the task to be cancelled")
    return "stopped"


@pytest.mark.django_db(transaction=True)
def test_a_task_cancelled_while_it_ran_is_signalled_with_its_rows_status(
    received: Callable[[Any], list[tuple[type, TaskResult[Any, Any]]]],
) -> None:
    finished = received(task_finished)
    cancellable = task()(runs_until_cancelled)
    result = cancellable.enqueue()
    job_id = int(result.id)
    # A 1 s lease: the heartbeat that tells the job comes about every third of a second.
    worker = DbThread(Worker(["default"], burst=True, concurrency=1, lease=1, max_jobs=1).run)
    worker.start()
    wait_until(lambda: job_row(job_id)["status"] == "running", message="the task to start")
    assert Job.objects.cancel([job_id]) == 1
    stats = worker.result(PATIENCE)

    assert stats.cancelled == 1
    ((_, signalled),) = [(s, r) for s, r in finished if r.id == result.id]
    # The function returned normally, but the row says cancelled: the signal says the same.
    assert signalled.status == cancellable.get_result(result.id).status == FAILED
    assert signalled.finished_at is not None
