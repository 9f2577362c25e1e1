"""The lifecycle verbs: enqueue, claim, complete, fail, snooze, extend_lease, release, reap,
cancel, prune.

A thin facade over ``core``: each verb checks what the caller passed, picks the database alias,
and runs one statement of ``core`` through the function of that room that shapes its
parameters. The writes after a claim are fenced on the
claim (id, ``status = 'running'``, attempts and claim time): they return ``False`` (or
``None``) when the job is no longer ours, and log that at WARNING; they never raise for it.
The ``*_many`` forms do the same for a batch in one statement.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db import DatabaseError, connections, models, transaction
from django.db.transaction import TransactionManagementError

from django_pgjobs.core import (
    claim,
    conf,
    control,
    enqueue,
    execute,
    finish,
    types,
    upkeep,
    validation,
)
from django_pgjobs.core.enqueue import Enqueued
from django_pgjobs.core.types import (
    Claim,
    ClaimedJob,
    FailedAttempt,
    Failure,
    Reaped,
    default_worker_id,
)
from django_pgjobs.core.upkeep import REAP_BATCH
from django_pgjobs.exceptions import InvalidJobOptions, NotPostgreSQL
from django_pgjobs.notify import notify_on_commit

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper

    from django_pgjobs.models import Job

__all__ = [
    "ClaimedJob",
    "Enqueued",
    "Failure",
    "JobManager",
    "Reaped",
    "default_worker_id",
]

logger = logging.getLogger(__name__)

# The largest job id (a bigint).
MAX_BIGINT = 2**63 - 1

PRUNABLE = ("done", "failed", "cancelled")


def _fence(job: ClaimedJob | int, attempts: int | None, claimed_at: datetime | None) -> Claim:
    """The claim a single-job verb fences on: a ``ClaimedJob``, or an id with its attempts."""
    if isinstance(job, ClaimedJob):
        if attempts is not None or claimed_at is not None:
            raise InvalidJobOptions(
                f"Job {job.id}: pass the ClaimedJob alone; it carries its attempts and claim time."
            )
        return job
    if isinstance(job, bool) or not isinstance(job, int) or not isinstance(attempts, int):
        raise InvalidJobOptions(
            f"Invalid job {job!r} with attempts {attempts!r}: pass the ClaimedJob that claim() "
            "returned, or a job id and its attempts."
        )
    return (job, attempts, claimed_at)


# How many times an enqueue inserts when its unique key keeps being held at the insert and
# free by the read that follows (a holder finishing in between); more means a key that jobs
# take and give up continuously.
class JobManager(models.Manager["Job"]):
    """``Job.objects``: the queue's verbs, as raw SQL on this manager's database alias."""

    @property
    def db_alias(self) -> str:
        """The alias the verbs run on: ``db_manager(alias)``, else ``PGJOBS["DATABASE"]``."""
        return self._db or conf.database()

    def connection(self) -> BaseDatabaseWrapper:
        connection = connections[self.db_alias]
        if connection.vendor != "postgresql":
            raise NotPostgreSQL(
                f"Database alias {self.db_alias!r} uses {connection.vendor}; django-pgjobs needs "
                "PostgreSQL (ENGINE 'django.db.backends.postgresql')."
            )
        return connection

    # -- enqueue -------------------------------------------------------------------------

    def enqueue(
        self,
        task: str | Callable[..., Any],
        payload: dict[str, Any] | None = None,
        *,
        queue: str | None = None,
        run_at: Any = None,
        delay: Any = None,
        priority: int | None = None,
        max_attempts: int | None = None,
        timeout: Any = None,
        unique_key: str | None = None,
        unique_while: str | None = None,
        lock_key: str | None = None,
    ) -> Job:
        """Add one job in the caller's transaction; workers are notified when it commits.

        ``task`` is a ``@job`` function or its registered name; ``payload`` the keyword
        arguments it will be called with (JSON values only). ``run_at`` (an aware datetime)
        or ``delay`` (a timedelta or seconds, measured on the database clock) defer it.
        ``timeout`` (a timedelta or seconds) is how long one attempt may run.
        ``unique_key`` (default: the ``@job``'s ``unique_key(payload)``) de-duplicates: while
        a job holding the key is queued (``unique_while="queued"``, the default) or queued or
        running (``"active"``), no row is inserted and that job is returned instead.
        ``lock_key`` (default: the ``@job``'s ``lock_key(payload)``): at most one job holding
        the key runs at a time, across every worker and queue.
        Options left out take the ``@job`` defaults, then the ``PGJOBS`` settings.
        Returns the ``Job``; its ``created`` is ``False`` when it is the existing holder.
        """
        payload = {} if payload is None else payload
        plan = enqueue.plan(
            self,
            task,
            [payload],
            queue=queue,
            run_at=run_at,
            delay=delay,
            priority=priority,
            max_attempts=max_attempts,
            timeout=timeout,
            unique_key=unique_key,
            unique_while=unique_while,
            lock_key=lock_key,
        )
        return enqueue.one(plan, payload)

    def enqueue_many(
        self,
        task: str | Callable[..., Any],
        payloads: Iterable[dict[str, Any]],
        *,
        queue: str | None = None,
        run_at: Any = None,
        delay: Any = None,
        priority: int | None = None,
        max_attempts: int | None = None,
        timeout: Any = None,
        unique_key: Callable[[dict[str, Any]], str | None] | None = None,
        unique_while: str | None = None,
        lock_key: Callable[[dict[str, Any]], str | None] | None = None,
    ) -> Enqueued:
        """Add many jobs of one task with one INSERT and one NOTIFY; return their ids in order.

        Every payload is validated before anything is written: one bad payload writes none.
        ``unique_key`` (default: the ``@job``'s) gives each payload's key, or ``None``: of the
        payloads that share a key the first is enqueued and the others get its id, and a key
        another job holds gets that job's id. The returned list's ``created`` says, payload
        by payload, whether its id is a new job. ``lock_key`` (default: the ``@job``'s) gives
        each payload's lock key, or ``None``.
        """
        for option, source in (("unique_key", unique_key), ("lock_key", lock_key)):
            if source is not None and not callable(source):
                raise InvalidJobOptions(
                    f"Invalid {option} {validation.show(source)} for enqueue_many(): use a "
                    "callable that takes a payload and returns its key (a str, or None for no "
                    "key)."
                )
        plan = enqueue.plan(
            self,
            task,
            list(payloads),
            queue=queue,
            run_at=run_at,
            delay=delay,
            priority=priority,
            max_attempts=max_attempts,
            timeout=timeout,
            unique_key=unique_key,
            unique_while=unique_while,
            lock_key=lock_key,
        )
        return enqueue.many(plan)

    # -- claim -------------------------------------------------------------------------

    def claim(
        self,
        queue: str = "default",
        limit: int = 10,
        lease: timedelta | float | None = None,
        *,
        mode: str = "lease",
        worker_id: str | None = None,
        guarded: bool = False,
    ) -> list[ClaimedJob]:
        """Take up to ``limit`` ready jobs of ``queue``, skipping rows other workers hold.

        Each claimed job is ``running`` with one more attempt and a lease of ``lease``
        (default ``PGJOBS["LEASE"]``) on the database clock. In ``lease`` mode the claim
        commits at once and must not run inside ``atomic()`` (that would hold its locks and
        freeze ``now()``); in ``transaction`` mode it must, and the caller completes the job
        before committing. ``worker_id`` (default ``host:pid``) is added to ``worker_ids``.

        Nothing is taken from a paused queue or one with a limit, and no job with a lock key,
        unless ``guarded`` (lease mode): then the claim takes its turn under the lock every
        guarded claim takes, and starts what the queue's limits and the free lock keys allow.
        """
        validation.queue_name(queue)
        validation.choice("guarded", guarded, (True, False))
        validation.positive_int("limit", limit)
        lease_td = validation.positive_duration("lease", conf.lease() if lease is None else lease)
        validation.mode(mode)
        connection = self.connection()
        if mode == "lease" and connection.in_atomic_block:
            raise TransactionManagementError(
                "claim() in lease mode commits at once and cannot run inside atomic(); "
                "call it outside the transaction, or pass mode='transaction'."
            )
        if mode == "transaction" and not connection.in_atomic_block:
            raise TransactionManagementError(
                "claim(mode='transaction') must run inside transaction.atomic(): the claim, "
                "the job and its completion share that transaction."
            )
        if guarded and mode == "transaction":
            raise InvalidJobOptions(
                "claim(guarded=True) is for lease mode: in transaction mode a claimed job is "
                "running to no other session, so limits and lock keys cannot count it."
            )
        return claim.claim(
            connection,
            queue=queue,
            limit=limit,
            lease=lease_td,
            worker_id=worker_id or default_worker_id(),
            synchronous_commit=None,
            guarded=guarded,
        )

    # -- fenced outcomes ---------------------------------------------------------------
    #
    # Each single-job verb takes the ClaimedJob that claim() returned: it carries the claim
    # time, so the write can only ever touch that claim. The plain form (a job id and its
    # attempts) is kept for callers that stored only those; it cannot tell this claim from a
    # later one with the same attempt number (after a release gave the attempt back), so
    # pass claimed_at= with it when you have it.

    def complete(
        self,
        job: ClaimedJob | int,
        attempts: int | None = None,
        result: Any = None,
        *,
        claimed_at: datetime | None = None,
    ) -> bool:
        """Mark a claimed job done. ``False``: the job is no longer ours; nothing changed.

        ``result`` (JSON values only) is stored as the job's return value.
        """
        claim = _fence(job, attempts, claimed_at)
        job_id = types.fence_of(claim)[0]
        return job_id in self.complete_many([claim], {job_id: result})

    def complete_many(
        self, jobs: Iterable[Claim], results: Mapping[int, Any] | None = None
    ) -> set[int]:
        """Complete claims in one statement; return the ids that changed.

        Each claim is a ``ClaimedJob`` or ``(id, attempts[, claimed_at])``. ``results`` maps
        a job id to its return value; every value is validated first.
        """
        return finish.complete(self.connection(), jobs, results or {}, synchronous_commit=None)

    def fail(
        self,
        job: ClaimedJob | int,
        attempts: int | None = None,
        error: str | BaseException | Failure | None = None,
        *,
        backoff: tuple[float, float] | None = None,
        delay: timedelta | float | None = None,
        claimed_at: datetime | None = None,
    ) -> str | None:
        """Record a failed attempt: back to ``queued`` with backoff, or ``failed`` for good.

        ``fail(claimed_job, error=exc)``, or ``fail(job_id, attempts, error)``. ``error`` is a
        message, an exception (its class and traceback are kept) or a ``Failure``.
        ``backoff`` is ``(base, cap)`` in seconds (default the ``PGJOBS`` settings);
        ``delay`` (a timedelta or seconds) retries after exactly that long instead. Returns
        the new status, or ``None`` when the job is no longer ours.
        """
        claim = _fence(job, attempts, claimed_at)
        job_id = types.fence_of(claim)[0]
        if delay is not None:
            failure = Failure.of("" if error is None else error)
            seconds = validation.seconds("delay", delay)
            attempt = FailedAttempt(claim, failure, conf.backoff(), delay=seconds)
            statuses = finish.fail(self.connection(), [attempt], synchronous_commit=None)
            return statuses.get(job_id)
        backoffs = {job_id: backoff} if backoff is not None else None
        return self.fail_many([(claim, "" if error is None else error)], backoffs).get(job_id)

    def fail_many(
        self,
        jobs: Iterable[
            tuple[int, int, str | BaseException | Failure]
            | tuple[Claim, str | BaseException | Failure]
        ],
        backoff: Mapping[int, tuple[float, float]] | None = None,
    ) -> dict[int, str]:
        """Fail jobs in one statement; return id -> new status.

        Each item is ``(claim, error)`` (a ``ClaimedJob`` or ``(id, attempts[, claimed_at])``
        and its error) or ``(id, attempts, error)``. ``backoff`` maps a job id to its ``(base,
        cap)``; others use the settings.
        """
        default = conf.backoff()
        attempts = []
        for item in jobs:
            claim: Claim = item[0] if len(item) == 2 else (item[0], item[1])
            job_id = types.fence_of(claim)[0]
            failure = Failure.of(item[-1])
            delay = (
                validation.backoff(*backoff[job_id]) if backoff and job_id in backoff else default
            )
            attempts.append(FailedAttempt(claim, failure, delay))
        return finish.fail(self.connection(), attempts, synchronous_commit=None)

    def snooze(
        self,
        job: ClaimedJob | int,
        delay: timedelta | float,
        attempts: int | None = None,
        *,
        claimed_at: datetime | None = None,
    ) -> bool:
        """Put a claimed job off: ``queued`` again ``delay`` (a timedelta or seconds) later,
        its attempt given back and its ``snoozes`` one higher. ``False``: the job is no longer
        ours; nothing changed. ``snooze(claimed_job, 30)``, or ``snooze(job_id, 30, attempts)``.
        """
        seconds = validation.seconds("snooze delay", delay)
        claim = _fence(job, attempts, claimed_at)
        snoozed = finish.snooze(self.connection(), [(claim, seconds)], synchronous_commit=None)
        return types.fence_of(claim)[0] in snoozed

    def extend_lease(
        self,
        job: ClaimedJob | int,
        attempts: int | None = None,
        lease: timedelta | float | None = None,
        *,
        claimed_at: datetime | None = None,
    ) -> bool:
        """Push a running job's lease to ``now() + lease``. ``False``: stop, it is not ours."""
        claim = _fence(job, attempts, claimed_at)
        return types.fence_of(claim)[0] in self.extend_lease_many([claim], lease)

    def extend_lease_many(
        self, jobs: Iterable[Claim], lease: timedelta | float | None = None
    ) -> set[int]:
        lease_td = validation.positive_duration("lease", conf.lease() if lease is None else lease)
        return finish.extend_lease(self.connection(), jobs, lease_td, synchronous_commit=None)

    def release(
        self,
        job: ClaimedJob | int,
        attempts: int | None = None,
        claimed_at: datetime | None = None,
    ) -> bool:
        """Give back a claimed job that never started: ``queued`` again, attempt not counted.

        Pass the ``ClaimedJob``: giving the attempt back makes ``(id, attempts)`` repeat for
        the next claim, and only the claim time tells the two claims apart.
        """
        claim = _fence(job, attempts, claimed_at)
        return types.fence_of(claim)[0] in self.release_many([claim])

    def release_many(self, jobs: Iterable[Claim]) -> set[int]:
        """Release claims (``ClaimedJob`` or ``(id, attempts[, claimed_at])``) at once."""
        return finish.release(self.connection(), jobs, synchronous_commit=None)

    # -- maintenance -------------------------------------------------------------------

    def retry(self, job_ids: Iterable[int]) -> list[int]:
        """Queue failed jobs again now, with their attempts reset; one NOTIFY per queue.

        Jobs that are no longer ``failed`` are left alone. Returns the ids retried.
        """
        rows = execute.run(
            self.connection(), control.RETRY, {"ids": sorted({int(i) for i in job_ids})}
        )
        for queue in sorted({queue for _id, queue in rows}):
            notify_on_commit(self.db_alias, queue)
        for job_id, queue in rows:
            logger.info(
                "retry of job %s: queued again",
                job_id,
                extra={"action": "retry", "job_id": job_id, "queue": queue},
            )
        return sorted(job_id for job_id, _queue in rows)

    # -- queue control -------------------------------------------------------------------

    def pause(self, queue: str) -> None:
        """Pause ``queue``: no worker starts another of its jobs (each claim reads the pause
        itself); running ones finish, and enqueue goes on. Undone by ``resume()``."""
        name = validation.queue_name(queue)
        execute.run(self.connection(), control.PAUSE, {"queue": name})
        logger.info("queue %s paused", name, extra={"action": "pause", "queue": name})

    def resume(self, queue: str) -> None:
        """Let workers claim ``queue``'s jobs again; a NOTIFY wakes them as it commits."""
        name = validation.queue_name(queue)
        execute.run(self.connection(), control.RESUME, {"queue": name, "channel": conf.channel()})
        logger.info("queue %s resumed", name, extra={"action": "resume", "queue": name})

    def set_limits(
        self,
        queue: str,
        *,
        concurrency: int | None = None,
        rate: tuple[int, timedelta | float] | None = None,
    ) -> None:
        """Set ``queue``'s limits across every worker, replacing the ones it had.

        ``concurrency``: at most this many of its jobs ``running`` at once. ``rate``:
        ``(count, period)``, at most ``count`` of its jobs started in any ``period`` (a
        timedelta or seconds). ``None`` (the default) is no limit, so ``set_limits(queue)``
        lifts both. A new limit applies from the next claim of each worker on.
        """
        name = validation.queue_name(queue)
        limit = None if concurrency is None else validation.positive_int("concurrency", concurrency)
        count, period = validation.rate(rate) or (None, None)
        params = {
            "queue": name,
            "concurrency": limit,
            "rate_count": count,
            "rate_period": period,
            "channel": conf.channel(),
        }
        execute.run(self.connection(), control.SET_LIMITS, params)
        logger.info(
            "queue %s limits: concurrency %s, rate %s",
            name,
            limit or "unlimited",
            f"{count} per {period}" if count else "unlimited",
            extra={"action": "limits", "queue": name},
        )

    def cancel(self, job_ids: int | Iterable[int]) -> int:
        """Cancel jobs that have not finished; return how many were cancelled.

        ``job_ids`` is one id or an iterable of ids, of ``@job`` and django.tasks jobs alike.
        A ``queued`` job ends ``cancelled`` at once and never runs. A ``running`` one ends
        ``cancelled`` too: its worker's later complete or fail changes nothing (the fence),
        and its next heartbeat sets ``current_job().cancelled`` so the function can return
        early; its slot under a concurrency limit, or its lock key, is free at once, and
        workers waiting on them are woken when the cancel commits. Finished jobs (``done``,
        ``failed``, ``cancelled``) are left alone. A job running in transaction mode holds its
        row locked: the cancel waits for that transaction (holding no other job's row
        meanwhile), then finds the job finished (or, if it rolled back, queued again, and
        cancels it).
        """
        ids = [job_ids] if isinstance(job_ids, int) and not isinstance(job_ids, bool) else job_ids
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
            raise InvalidJobOptions(f"Invalid job ids {job_ids!r}: pass a job id or ids.")
        ids = list(ids)
        bad = [
            i
            for i in ids
            if isinstance(i, bool) or not isinstance(i, int) or not 1 <= i <= MAX_BIGINT
        ]
        if bad:
            shown = ", ".join(validation.show(i) for i in bad[:5]) + (", ..." if bad[5:] else "")
            raise InvalidJobOptions(
                f"Invalid job ids {shown}: cancel() takes job ids (positive integers), such as "
                "job.id."
            )
        if not ids:
            return 0
        connection = self.connection()
        wanted = sorted(set(ids))
        rows = execute.run(connection, control.CANCEL, {"ids": wanted})
        # The jobs CANCEL skipped because a transaction held them: one at a time, waiting.
        done = {row[0] for row in rows}
        rest = [i for i in wanted if i not in done]
        for (job_id,) in execute.run(connection, control.UNFINISHED, {"ids": rest}) if rest else []:
            rows += execute.run(connection, control.CANCEL_WAITING, {"ids": [job_id]})
        for job_id, task, queue, attempts, was in rows:
            logger.info(
                "cancel of job %s %s: %s, now cancelled",
                job_id,
                task,
                was,
                extra={
                    "action": "cancel",
                    "job_id": job_id,
                    "task": task,
                    "queue": queue,
                    "attempts": attempts,
                },
            )
        # A running job cancelled frees its slot under its queue's limit, or its lock key:
        # word to workers waiting on them, as for a new job, once the cancel commits.
        running = [row[0] for row in rows if row[4] == "running"]
        if running:
            self._wake_freed(running)
        return len(rows)

    def _wake_freed(self, job_ids: list[int]) -> None:
        """Word, on commit, to the queues where these cancelled jobs freed what a waiting
        worker may claim. A hint, never a reason to fail the cancel: looked up in a
        savepoint of its own inside the caller's transaction, and a failure is logged."""
        try:
            with transaction.atomic(using=self.db_alias):
                queues = finish.freed_queues(self.connection(), job_ids)
        except DatabaseError:
            finish.word_not_sent(len(job_ids), "cancel")
            return
        for queue in queues:
            notify_on_commit(self.db_alias, queue)

    def reap(self, batch_size: int = REAP_BATCH) -> list[Reaped]:
        """Send jobs whose lease expired back to ``queued`` (``failed`` once out of attempts).

        Works in batches of ``batch_size`` until one comes back short; returns every row it
        changed as ``(id, status, attempts)``. Nothing is reaped in the first minute after
        the server started (``upkeep.REAP_SETTLE``): workers that held jobs through an
        outage write what they hold first. Each expired lease counts a worker crash; the
        ``PGJOBS["MAX_CRASHES"]``-th in a row fails the job (``WorkerCrashed``).
        """
        validation.positive_int("batch_size", batch_size)
        return upkeep.reap(self.connection(), batch_size, max_crashes=conf.max_crashes())

    def prune(
        self,
        older_than: timedelta = timedelta(days=7),
        status: str | Iterable[str] = "done",
        batch_size: int = 10_000,
        archive: bool = False,
        progress: Callable[[int], None] | None = None,
    ) -> int:
        """Delete (or, with ``archive``, move to the archive table) finished jobs.

        ``status`` is ``"done"``, ``"failed"``, ``"cancelled"``, ``"all"`` (the three) or a
        list of those; queued and running jobs are never touched. Age is measured from
        ``finished_at`` (or ``created_at`` where no finish time was recorded) on the database
        clock. Each batch of ``batch_size`` is its own short statement; ``progress`` is
        called with the running total after each. Returns the number of jobs removed.
        """
        statuses = (
            list(PRUNABLE)
            if status == "all"
            else ([status] if isinstance(status, str) else list(status))
        )
        bad = [s for s in statuses if s not in PRUNABLE]
        if bad or not statuses:
            raise InvalidJobOptions(
                f"Cannot prune status {bad or statuses!r}: use 'done', 'failed', 'cancelled' or "
                "'all'; queued and running jobs are never pruned."
            )
        if not isinstance(older_than, timedelta):
            raise InvalidJobOptions(
                f"Invalid older_than {older_than!r}: use a timedelta of zero or more."
            )
        validation.duration("older_than", older_than)
        validation.positive_int("batch_size", batch_size)
        connection = self.connection()
        statement = upkeep.PRUNE_ARCHIVE if archive else upkeep.PRUNE
        total = 0
        params = {"statuses": statuses, "older_than": older_than, "limit": batch_size}
        while True:
            count = execute.count(connection, statement, params)
            total += count
            if progress is not None and count:
                progress(total)
            if count < batch_size:
                return total
