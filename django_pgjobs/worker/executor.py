"""Executors: threads that each run one job at a time, and ``call()``, which runs one job.

An executor takes the next item from the hand-off queue and gives it to the worker's mode
(``worker/lease.py`` or ``worker/transaction.py``), which knows what the item is and how its
outcome is written. What a job is, whatever the mode, is ``call()``: the registered function
called with the payload as keyword arguments, and the outcome that follows.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

from django.db import connections

from django_pgjobs import registry, validation
from django_pgjobs.context import JobContext, reset_current_job, set_current_job
from django_pgjobs.exceptions import InvalidPayload
from django_pgjobs.lifecycle import ClaimedJob, Failure
from django_pgjobs.worker.db import queue_connection, queue_database_away
from django_pgjobs.worker.outcomes import COMPLETE, FAIL, RELEASE, Outcome, WorkerStats
from django_pgjobs.worker.store import Store

logger = logging.getLogger("django_pgjobs.worker")

# A job released this many times because the queue's database was away is failed instead,
# with the attempt counted: however an error is misjudged as an outage, no job loops.
MAX_OUTAGE_RELEASES = 10


@dataclass(frozen=True)
class Shared:
    """What both modes need from their worker: where statements run, the lease, the worker's
    id and counters, its stop flag, and how to hand items to the executors."""

    store: Store
    lease: timedelta
    worker_id: str
    stats: WorkerStats
    stopping: threading.Event
    hand_out: Callable[..., None]


class Mode(Protocol):
    """How a worker claims and finishes jobs: lease mode or transaction mode."""

    def execute(self, item: Any) -> None:
        """Run one hand-off item to its end (outcome recorded or handed on)."""


def call(job: ClaimedJob, ctx: JobContext, alias: str) -> Outcome:
    """Run the registered function with the payload as keyword arguments.

    A task whose result is kept must return a JSON value: anything else fails the attempt
    with ``InvalidResult`` rather than crash the worker later, when it is written. Whatever
    the job raises (``SystemExit`` included) is its failure, with one exception: a job that
    failed because the queue's own database (``alias``) went away is released, its attempt
    not counted, up to ``MAX_OUTAGE_RELEASES`` times. A payload that is not a JSON object
    fails the job for good, at once.
    """
    if job.invalid_payload is not None:
        failure = Failure.from_exception(
            InvalidPayload(f"Job {job.id} ({job.task}, queue {job.queue}): {job.invalid_payload}.")
        )
        return Outcome(job, FAIL, failure=failure, final=True)
    token = set_current_job(ctx)
    backoff = None
    before = queue_connection(alias)
    started = time.perf_counter()
    try:
        func = registry.get(job.task)
        backoff = func.backoff
        value = func.func(**job.payload)
        if func.stores_result:
            validation.result(value)
        else:
            value = None
    except BaseException as exc:
        duration = time.perf_counter() - started
        failure = Failure.from_exception(exc)
        if queue_database_away(exc, alias, before):
            if job.outage_releases < MAX_OUTAGE_RELEASES:
                logger.warning(
                    "job %s %s attempt %s met a database outage; releasing it (attempt not "
                    "counted)",
                    job.id,
                    job.task,
                    job.attempts,
                    extra={"action": "release", "job_id": job.id, "attempts": job.attempts},
                )
                return Outcome(job, RELEASE, duration, failure, outage=True)
            logger.warning(
                "job %s %s was released %s times after database outages; counting this attempt",
                job.id,
                job.task,
                job.outage_releases,
                extra={"action": "fail", "job_id": job.id, "attempts": job.attempts},
            )
        return Outcome(job, FAIL, duration, failure, backoff=backoff)
    finally:
        reset_current_job(token)
    return Outcome(job, COMPLETE, time.perf_counter() - started, result=value)


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
    )


class Executor(threading.Thread):
    def __init__(
        self,
        index: int,
        handoff: queue.SimpleQueue[Any],
        mode: Mode,
        on_done: Callable[[], None],
    ) -> None:
        super().__init__(name=f"pgjobs-executor-{index}", daemon=True)
        self.handoff = handoff
        self.mode = mode
        self.on_done = on_done

    def run(self) -> None:
        try:
            while (item := self.handoff.get()) is not None:
                try:
                    self.mode.execute(item)
                except Exception:
                    # Our own bug or an unexpected database error: the job's lease and the
                    # reaper recover it; the executor must live on.
                    logger.exception("executor error on %r", item, extra={"action": "execute"})
                finally:
                    self.on_done()
        finally:
            connections.close_all()
