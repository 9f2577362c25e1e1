"""Executors: threads that each run one job at a time.

In lease mode an executor takes a claimed job from the hand-off queue, calls the registered
function with the payload as keyword arguments, and passes the outcome to the completer. (A
claim that returns after shutdown began never reaches an executor: the producer releases it.)

In transaction mode it takes a ticket instead, and claims, runs and completes one job in a
single transaction on its own connection; the job's own writes share that transaction (a
savepoint, rolled back if the job fails), and a crash rolls the claim back.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

from django.db import DatabaseError, connections, transaction

from django_pgjobs import registry, validation
from django_pgjobs.context import JobContext, reset_current_job, set_current_job
from django_pgjobs.managers import ClaimedJob, Failure, JobManager
from django_pgjobs.worker.completer import COMPLETE, FAIL, RELEASE, Completer, Outcome
from django_pgjobs.worker.db import reset, reset_all, tidy, unavailable
from django_pgjobs.worker.outcomes import WorkerStats, finished

logger = logging.getLogger("django_pgjobs.worker")


@dataclass
class Ticket:
    """Transaction mode: "claim one job of ``queue`` and run it"; ``claimed`` says how it went."""

    queue: str
    claimed: threading.Event = field(default_factory=threading.Event)
    found: bool = False
    unavailable: BaseException | None = None


def call(job: ClaimedJob, ctx: JobContext) -> Outcome:
    """Run the registered function with the payload as keyword arguments.

    A task whose result is kept must return a JSON value: anything else fails the attempt
    with ``InvalidResult`` rather than crash the worker later, when it is written. Whatever
    the job raises (``SystemExit`` included) is its failure, except that a job which failed
    because the database went away is released, not failed: the outage is not its fault.
    """
    token = set_current_job(ctx)
    backoff = None
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
        if unavailable(exc):
            logger.warning(
                "job %s %s attempt %s met a database outage; releasing it (attempt not counted)",
                job.id,
                job.task,
                job.attempts,
                extra={"action": "release", "job_id": job.id, "attempts": job.attempts},
            )
            return Outcome(job, RELEASE, duration, failure)
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
    )


class Executor(threading.Thread):
    def __init__(
        self,
        index: int,
        handoff: queue.SimpleQueue[ClaimedJob | Ticket | None],
        *,
        manager: JobManager,
        completer: Completer,
        lease: timedelta,
        stopping: threading.Event,
        on_done: Callable[[], None],
        stats: WorkerStats,
        worker_id: str,
        on_retry: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(name=f"pgjobs-executor-{index}", daemon=True)
        self.handoff = handoff
        self.manager = manager
        self.completer = completer
        self.lease = lease
        self.stopping = stopping
        self.on_done = on_done
        self.stats = stats
        self.worker_id = worker_id
        # Called when a failed job is queued again (transaction mode): it sends no NOTIFY.
        self.on_retry = on_retry

    def run(self) -> None:
        try:
            while (item := self.handoff.get()) is not None:
                try:
                    if isinstance(item, Ticket):
                        self._run_ticket(item)
                    else:
                        self._run_claimed(item)
                except Exception:
                    # Our own bug or an unexpected database error: the job's lease and the
                    # reaper recover it; the executor must live on.
                    logger.exception("executor error on %r", item, extra={"action": "execute"})
                finally:
                    self.on_done()
        finally:
            connections.close_all()

    def _run_claimed(self, job: ClaimedJob) -> None:
        ctx = context(job)
        self.completer.track(job, ctx)
        try:
            # No tidy() first: the previous job's tidy() (or reset_all()) left this thread's
            # connections usable, and a new thread has none yet.
            outcome = call(job, ctx)
        finally:
            self.completer.untrack(job)
        if outcome.action == RELEASE:
            reset_all()
        else:
            tidy()
        if ctx.lost:
            self.stats.add("lost")
            logger.warning(
                "job %s %s attempt %s lost its lease while running; outcome not recorded",
                job.id,
                job.task,
                job.attempts,
                extra={"action": "extend_lease", "job_id": job.id, "attempts": job.attempts},
            )
            return
        self.completer.record(outcome)

    def _run_ticket(self, ticket: Ticket) -> None:
        if self.stopping.is_set():
            ticket.claimed.set()
            return
        alias = self.manager.db_alias
        tidy()
        try:
            with transaction.atomic(using=alias):
                jobs = self.manager.claim(
                    ticket.queue,
                    limit=1,
                    lease=self.lease,
                    mode="transaction",
                    worker_id=self.worker_id,
                )
                ticket.found = bool(jobs)
                ticket.claimed.set()
                if not jobs:
                    return
                with transaction.atomic(using=alias):
                    outcome = call(jobs[0], context(jobs[0]))
                    if outcome.failure:
                        transaction.set_rollback(True, using=alias)
                if outcome.action == RELEASE:
                    # Roll the claim back with the rest: the attempt is not counted.
                    transaction.set_rollback(True, using=alias)
                    return
                status = self._finish_in_transaction(outcome)
        except DatabaseError as exc:
            if not unavailable(exc):
                raise
            ticket.unavailable = exc
            ticket.claimed.set()
            reset(alias)
            return
        finally:
            ticket.claimed.set()
        finished(outcome, status, stats=self.stats, worker_id=self.worker_id)
        if status == "queued" and self.on_retry is not None:
            self.on_retry()

    def _finish_in_transaction(self, outcome: Outcome) -> str | None:
        job = outcome.job
        if outcome.failure:
            return self.manager.fail(job.id, job.attempts, outcome.failure, backoff=outcome.backoff)
        done = self.manager.complete(job.id, job.attempts, outcome.result)
        return "done" if done else None
