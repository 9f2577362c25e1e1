"""Executors: threads that each run one job at a time, and ``call()``, which runs one job.

An executor takes the next item from the hand-off queue and gives it to the worker's mode
(``worker/lease.py`` or ``worker/transaction.py``), which knows what the item is and how its
outcome is written. What a job is, whatever the mode, is ``call()``: the registered function
called with the payload as keyword arguments, and the outcome that follows.
"""

from __future__ import annotations

import inspect
import logging
import queue
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

import psycopg
from asgiref.sync import async_to_sync, sync_to_async
from django.db import connections, transaction

from django_pgjobs import signals
from django_pgjobs.core import registry, validation
from django_pgjobs.core.context import JobContext, reset_current_job, set_current_job
from django_pgjobs.core.registry import JobFunction
from django_pgjobs.core.types import Action, ClaimedJob, Failure, Outcome
from django_pgjobs.exceptions import InvalidPayload, JobTimeout, Snooze, UnknownTask
from django_pgjobs.worker.db import (
    async_database_away,
    async_replaced,
    count_from_start,
    queue_connection,
    queue_database_away,
    unavailable,
)
from django_pgjobs.worker.outcomes import WorkerStats
from django_pgjobs.worker.store import Store

if TYPE_CHECKING:
    from django_pgjobs.worker.metrics import WorkerMetrics

logger = logging.getLogger("django_pgjobs.worker")

# A job released this many times because the queue's database was away is failed instead,
# with the attempt counted: however an error is misjudged as an outage, no job loops.
MAX_OUTAGE_RELEASES = 10


@dataclass(frozen=True)
class Shared:
    """What both modes need from their worker: where statements run, the lease, the worker's
    id and counters, its stop flag, how to hand items to the executors, and its metrics
    (None: ``runjobs`` serves none)."""

    store: Store
    lease: timedelta
    worker_id: str
    stats: WorkerStats
    stopping: threading.Event
    hand_out: Callable[..., None]
    metrics: WorkerMetrics | None = None


class Mode(Protocol):
    """How a worker claims and finishes jobs: lease mode or transaction mode."""

    def execute(self, item: Any) -> None:
        """Run one hand-off item to its end (outcome recorded or handed on)."""


def call(job: ClaimedJob, ctx: JobContext, alias: str) -> Outcome:
    """Run the registered function with the payload as keyword arguments.

    ``job_started`` is sent just before the function is called (for ``@job`` functions: a
    ``django.tasks`` task sends Django's ``task_started`` itself).

    A task whose result is kept must return a JSON value: anything else fails the attempt
    with ``InvalidResult`` rather than crash the worker later, when it is written. A job that
    raises ``Snooze`` is snoozed. Whatever else it raises (``SystemExit`` included) is its
    failure, retried or not as ``decide()`` says, with one exception: a job that failed
    because the queue's own database (``alias``) went away is released, its attempt not
    counted, up to ``MAX_OUTAGE_RELEASES`` times. A payload that is not a JSON object fails
    the job for good, at once. An ``async def`` job met here (transaction mode, which runs
    every job on its executor thread) runs to its end through ``async_to_sync``: its async ORM
    calls come back to this thread, so they run in the job's transaction like its sync ones.
    So does the coroutine a job registered as sync returns (an ``async def`` function behind
    a plain decorator, which ``@job`` cannot see through).
    """
    refused = invalid(job)
    if refused is not None:
        return refused
    token = set_current_job(ctx)
    func = None
    before = queue_connection(alias)
    started = time.perf_counter()
    try:
        func = begin(job, alias)
        if func.async_func is None:
            value = func.func(**job.payload)
            if inspect.iscoroutine(value):
                # A coroutine function behind a plain (sync) decorator: it is awaited here.
                value = async_to_sync(_awaited)(value)
        else:
            value = async_to_sync(func.async_func)(**job.payload)
        return returned(job, func, value, started)
    except BaseException as exc:
        return raised(job, func, exc, queue_database_away(exc, alias, before), started)
    finally:
        reset_current_job(token)


async def _awaited(coroutine: Coroutine[Any, Any, Any]) -> Any:
    return await coroutine


async def acall(job: ClaimedJob, ctx: JobContext, alias: str) -> Outcome:
    """``call()`` for an ``async def`` job, awaited on the worker's event loop.

    What blocks runs on asgiref's ``sync_to_async`` thread, never on the loop's: the
    ``job_started`` receivers (sync code, which may query), and after an error that says the
    database is unavailable, the look at the queue's database (``async_database_away()``).

    A ``CancelledError`` is the job's failure like any other error: when the worker cancelled
    the job's task (a timeout, a cancel, a lost lease), its context says so and the outcome
    is not recorded; when the job raised it itself, it fails like a sync job would."""
    refused = invalid(job)
    if refused is not None:
        return refused
    token = set_current_job(ctx)
    func = None
    replaced = async_replaced(alias)
    started = time.perf_counter()
    try:
        func = registry.get(job.task)
        if func.async_func is None:
            raise TypeError(f"{job.task} is not an async job")
        if signals.job_started.receivers and not func.stores_result:
            await sync_to_async(started_signal)(job, alias)
        value = await func.async_func(**job.payload)
        return returned(job, func, value, started)
    except BaseException as exc:
        away = unavailable(exc) and await sync_to_async(async_database_away)(alias, replaced)
        return raised(job, func, exc, away, started)
    finally:
        reset_current_job(token)


def invalid(job: ClaimedJob) -> Outcome | None:
    """The outcome of a job whose payload is not a JSON object: failed for good, at once."""
    if job.invalid_payload is None:
        return None
    error = InvalidPayload(f"Job {job.id} ({job.task}, queue {job.queue}): {job.invalid_payload}.")
    return Outcome(job, Action.FAIL, failure=Failure.from_exception(error), final=True, error=error)


def begin(job: ClaimedJob, alias: str) -> JobFunction[..., Any]:
    """The job's registered function, once ``job_started`` is sent."""
    func = registry.get(job.task)
    if signals.job_started.receivers and not func.stores_result:
        started_signal(job, alias)
    return func


def returned(job: ClaimedJob, func: JobFunction[..., Any], value: Any, started: float) -> Outcome:
    """The outcome of a job that returned ``value``: its result kept only for tasks."""
    if func.stores_result:
        validation.result(value)
    else:
        value = None
    return Outcome(job, Action.COMPLETE, time.perf_counter() - started, result=value)


def raised(
    job: ClaimedJob,
    func: JobFunction[..., Any] | None,
    exc: BaseException,
    away: bool,
    started: float,
) -> Outcome:
    """The outcome of a job that raised ``exc``: snoozed, released after an outage of the
    queue's database (``away``: the error came from one), or failed."""
    duration = time.perf_counter() - started
    if isinstance(exc, Snooze):
        return Outcome(job, Action.SNOOZE, duration, delay=exc.seconds)
    failure = Failure.from_exception(exc)
    if away:
        if job.outage_releases < MAX_OUTAGE_RELEASES:
            logger.warning(
                "job %s %s attempt %s met a database outage; releasing it (attempt not counted)",
                job.id,
                job.task,
                job.attempts,
                extra={"action": "release", "job_id": job.id, "attempts": job.attempts},
            )
            return Outcome(job, Action.RELEASE, duration, failure, outage=True, error=exc)
        logger.warning(
            "job %s %s was released %s times after database outages; counting this attempt",
            job.id,
            job.task,
            job.outage_releases,
            extra={"action": "fail", "job_id": job.id, "attempts": job.attempts},
        )
    return failed(job, func, exc, failure, duration)


def started_signal(job: ClaimedJob, alias: str) -> None:
    """``job_started``, when someone listens (the sender: the ``Job`` model, imported here as
    the worker's modules load before the apps are ready).

    In transaction mode the job's own transaction is open on the thread's connection: a
    receiver's failed query would leave it aborted, and the job's first query would then fail
    the job. A savepoint keeps a receiver's trouble its own: rolled back to when the
    transaction is in error afterwards."""
    from django_pgjobs.models import Job

    connection = connections[alias]
    if not connection.in_atomic_block:
        signals.send(signals.job_started, Job, job=job)
        return
    point = transaction.savepoint(using=alias)
    signals.send(signals.job_started, Job, job=job)
    status = connection.connection.info.transaction_status
    if status == psycopg.pq.TransactionStatus.INERROR:
        transaction.savepoint_rollback(point, using=alias)
        transaction.set_rollback(False, using=alias)
    else:
        transaction.savepoint_commit(point, using=alias)


def decide(
    func: JobFunction[..., Any], exc: BaseException, attempt: int
) -> tuple[bool, float | None]:
    """The job's retry policy for ``exc``, raised by attempt number ``attempt``.

    Returns ``(final, delay)``: ``final`` when the job must not be retried (a ``discard_on``
    error, or, when ``retry_on`` is given, any error it does not name); ``delay`` the seconds
    the job's backoff callable asks for, or None for the ``(base, cap)`` formula. A callable
    that raises or returns anything but a timedelta or seconds from 0 to 100 years is logged
    at ERROR and the default schedule is used (whatever it raised, ``SystemExit`` included):
    the failure itself is still recorded.
    """
    if func.gives_up_on(exc):
        return True, None
    if func.backoff is None or isinstance(func.backoff, tuple):
        return False, None
    try:
        return False, validation.seconds("backoff delay", func.backoff(attempt, exc))
    except BaseException:
        # SystemExit and KeyboardInterrupt too: this runs on an executor or the completer,
        # never on the main thread where a signal's KeyboardInterrupt lands (runjobs handles
        # SIGINT itself), so what the callable raised is its own bug, and letting it out would
        # kill the thread that records outcomes.
        logger.exception(
            "backoff of %s failed for attempt %s; retrying on the default schedule",
            func.name,
            attempt,
            extra={"action": "fail", "task": func.name, "attempts": attempt},
        )
        return False, None


def failed(
    job: ClaimedJob,
    func: JobFunction[..., Any] | None,
    exc: BaseException,
    failure: Failure,
    duration: float,
) -> Outcome:
    """A failed attempt, retried or not as the job's policy says (``decide()``); a task that
    is not registered is retried on the default schedule."""
    if func is None:
        return Outcome(job, Action.FAIL, duration, failure, error=exc)
    final, delay = decide(func, exc, job.attempts)
    return Outcome(
        job,
        Action.FAIL,
        duration,
        failure,
        backoff=func.backoff if isinstance(func.backoff, tuple) else None,
        final=final,
        delay=delay,
        jitter=func.backoff_jitter,
        error=exc,
    )


def timed_out(job: ClaimedJob, duration: float = 0.0) -> Outcome:
    """The failed attempt of a job that ran past its timeout: a ``JobTimeout``, retried or
    not by the job's policy like any failure (``discard_on=(JobTimeout,)`` gives up at once)."""
    error = JobTimeout(
        f"job {job.id} ({job.task}) ran past its timeout of {job.timeout:g} s"
        if job.timeout is not None
        else f"job {job.id} ({job.task}) ran past its timeout"
    )
    try:
        func: JobFunction[..., Any] | None = registry.get(job.task)
    except UnknownTask:
        func = None
    return failed(job, func, error, Failure.from_exception(error), duration)


def context(job: ClaimedJob) -> JobContext:
    return JobContext(
        id=job.id,
        task=job.task,
        queue=job.queue,
        attempts=job.attempts,
        max_attempts=job.max_attempts,
        payload=job.payload,
        schedule=job.schedule,
        scheduled_at=job.scheduled_at,
        timeout=job.timeout,
    )


class Executor(threading.Thread):
    """Runs hand-off items one at a time until it takes ``None``, or until it is abandoned:
    its job ran past its timeout and a replacement took its slot, so when (if ever) the job
    returns, the thread exits without freeing the slot again."""

    def __init__(
        self,
        index: int,
        handoff: queue.SimpleQueue[Any],
        mode: Mode,
        on_done: Callable[[Any], None],
    ) -> None:
        super().__init__(name=f"pgjobs-executor-{index}", daemon=True)
        self.handoff = handoff
        self.mode = mode
        self.on_done = on_done
        # The item being run, and whether the worker gave up on it; one lock for both, so a
        # job that returns just as it is abandoned frees its slot exactly once.
        self._lock = threading.Lock()
        self._current: Any = None
        self._abandoned = False

    def abandon(self, item: Any) -> bool:
        """Give up on this thread if it is still running ``item``; True if it was."""
        with self._lock:
            if self._current is not item or item is None:
                return False
            self._abandoned = True
            return True

    @property
    def abandoned(self) -> bool:
        return self._abandoned

    def run(self) -> None:
        count_from_start()
        try:
            while (item := self.handoff.get()) is not None:
                with self._lock:
                    self._current = item
                try:
                    self.mode.execute(item)
                except Exception:
                    # Our own bug or an unexpected database error: the job's lease and the
                    # reaper recover it; the executor must live on.
                    logger.exception("executor error on %r", item, extra={"action": "execute"})
                finally:
                    with self._lock:
                        self._current = None
                        abandoned = self._abandoned
                    if not abandoned:
                        self.on_done(item)
                if abandoned:
                    return
        finally:
            connections.close_all()
