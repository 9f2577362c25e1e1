"""The lifecycle verbs: enqueue, claim, complete, fail, extend_lease, release, reap, prune.

Each verb runs one statement from ``sql.py`` on the manager's database alias (the shared
helpers in ``lifecycle.py`` shape its parameters). The writes after a claim are fenced on the
claim (id, ``status = 'running'``, attempts and claim time): they return ``False`` (or
``None``) when the job is no longer ours, and log that at WARNING; they never raise for it.
The ``*_many`` forms do the same for a batch in one statement.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from typing import TYPE_CHECKING, Any

from django.conf import settings as django_settings
from django.db import connections, models
from django.db.transaction import TransactionManagementError
from django.utils import timezone

from django_pgjobs import conf, lifecycle, registry, sql, validation
from django_pgjobs.exceptions import InvalidJobOptions, NotPostgreSQL
from django_pgjobs.lifecycle import (
    ERROR_LIMIT,
    REAP_BATCH,
    Claim,
    ClaimedJob,
    FailedAttempt,
    Failure,
    Reaped,
    default_worker_id,
)
from django_pgjobs.notify import notify_on_commit

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper

    from django_pgjobs.models import Job

__all__ = [
    "ERROR_LIMIT",
    "ClaimedJob",
    "Failure",
    "JobManager",
    "Reaped",
    "default_worker_id",
]

logger = logging.getLogger(__name__)

PRUNABLE = ("done", "failed")


def _timestamp(text: str) -> datetime:
    """A timestamp the enqueue returned as ISO 8601 text in UTC, as Django would load it."""
    value = datetime.fromisoformat(text)
    if not django_settings.USE_TZ:
        return timezone.make_naive(value)
    return value.astimezone(dt_timezone.utc)


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
    ) -> Job:
        """Add one job in the caller's transaction; workers are notified when it commits.

        ``task`` is a ``@job`` function or its registered name; ``payload`` the keyword
        arguments it will be called with (JSON values only). ``run_at`` (an aware datetime)
        or ``delay`` (a timedelta or seconds, measured on the database clock) defer it.
        Options left out take the ``@job`` defaults, then the ``PGJOBS`` settings.
        Returns the new ``Job``.
        """
        payload = {} if payload is None else payload
        rows, fields = self._insert(
            task,
            [payload],
            queue=queue,
            run_at=run_at,
            delay=delay,
            priority=priority,
            max_attempts=max_attempts,
        )
        job_id, job_run_at, created_at, _notified = rows[0]
        known = {
            "id": job_id,
            "payload": payload,
            "run_at": _timestamp(job_run_at),
            "created_at": _timestamp(created_at),
            "attempts": 0,
            "status": "queued",
            **fields,
        }
        # Every column in order, as a row read back (from_db): Django's positional fast path.
        # The columns enqueue() does not set hold their defaults (NULL, or an empty list).
        columns = self.model._meta.concrete_fields
        values = [
            known[field.attname] if field.attname in known else field.get_default()
            for field in columns
        ]
        return self.model.from_db(self.db_alias, [field.attname for field in columns], values)

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
    ) -> list[int]:
        """Add many jobs of one task with one INSERT and one NOTIFY; return their ids in order.

        Every payload is validated before anything is written: one bad payload writes none.
        """
        rows, _fields = self._insert(
            task,
            list(payloads),
            queue=queue,
            run_at=run_at,
            delay=delay,
            priority=priority,
            max_attempts=max_attempts,
        )
        return [row[0] for row in rows]

    def _insert(
        self,
        task: str | Callable[..., Any],
        payloads: Sequence[Any],
        *,
        queue: str | None,
        run_at: Any,
        delay: Any,
        priority: int | None,
        max_attempts: int | None,
    ) -> tuple[list[tuple[Any, ...]], dict[str, Any]]:
        func = registry.resolve(task)
        if max_attempts is None:
            max_attempts = func.max_attempts or conf.max_attempts()
        fields: dict[str, Any] = {
            "task": func.name,
            # `is None`, not `or`: an empty (or otherwise bad) queue name is an error, not a
            # request for the default queue.
            "queue": validation.queue_name(
                queue if queue is not None else func.queue or conf.default_queue()
            ),
            "priority": validation.priority(func.priority if priority is None else priority),
            "max_attempts": validation.max_attempts(max_attempts),
        }
        when, wait = validation.schedule(run_at, delay)
        texts = [validation.payload(p) for p in payloads]
        if not texts:
            return [], fields
        connection = self.connection()
        # Outside atomic() the INSERT sends its own NOTIFY: in autocommit it is the whole
        # transaction ("auto"); under manual transaction management (set_autocommit(False))
        # Django has no on_commit, and PostgreSQL delivers it when the caller commits.
        here = not connection.in_atomic_block and (
            conf.notify() == "auto" or not connection.get_autocommit()
        )
        params = {
            **fields,
            "run_at": when,
            "delay": wait,
            "notify_channel": conf.channel() if here else None,
        }
        if len(texts) == 1:
            rows = sql.run(connection, sql.ENQUEUE_ONE, params | {"payload": texts[0]})
        else:
            payloads = "[" + ",".join(texts) + "]"
            rows = sql.run(connection, sql.ENQUEUE, params | {"payloads": payloads})
        if not here:
            notify_on_commit(self.db_alias, fields["queue"])
        return rows, fields

    # -- claim -------------------------------------------------------------------------

    def claim(
        self,
        queue: str = "default",
        limit: int = 10,
        lease: timedelta | float | None = None,
        *,
        mode: str = "lease",
        worker_id: str | None = None,
    ) -> list[ClaimedJob]:
        """Take up to ``limit`` ready jobs of ``queue``, skipping rows other workers hold.

        Each claimed job is ``running`` with one more attempt and a lease of ``lease``
        (default ``PGJOBS["LEASE"]``) on the database clock. In ``lease`` mode the claim
        commits at once and must not run inside ``atomic()`` (that would hold its locks and
        freeze ``now()``); in ``transaction`` mode it must, and the caller completes the job
        before committing. ``worker_id`` (default ``host:pid``) is added to ``worker_ids``.
        """
        validation.queue_name(queue)
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
        return lifecycle.claim(
            connection,
            queue=queue,
            limit=limit,
            lease=lease_td,
            worker_id=worker_id or default_worker_id(),
            synchronous_commit=None,
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
        job_id = lifecycle.fence_of(claim)[0]
        return job_id in self.complete_many([claim], {job_id: result})

    def complete_many(
        self, jobs: Iterable[Claim], results: Mapping[int, Any] | None = None
    ) -> set[int]:
        """Complete claims in one statement; return the ids that changed.

        Each claim is a ``ClaimedJob`` or ``(id, attempts[, claimed_at])``. ``results`` maps
        a job id to its return value; every value is validated first.
        """
        return lifecycle.complete(self.connection(), jobs, results or {}, synchronous_commit=None)

    def fail(
        self,
        job: ClaimedJob | int,
        attempts: int | None = None,
        error: str | BaseException | Failure | None = None,
        *,
        backoff: tuple[float, float] | None = None,
        claimed_at: datetime | None = None,
    ) -> str | None:
        """Record a failed attempt: back to ``queued`` with backoff, or ``failed`` for good.

        ``fail(claimed_job, error=exc)``, or ``fail(job_id, attempts, error)``. ``error`` is a
        message, an exception (its class and traceback are kept) or a ``Failure``.
        ``backoff`` is ``(base, cap)`` in seconds (default the ``PGJOBS`` settings). Returns
        the new status, or ``None`` when the job is no longer ours.
        """
        claim = _fence(job, attempts, claimed_at)
        job_id = lifecycle.fence_of(claim)[0]
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
            job_id = lifecycle.fence_of(claim)[0]
            failure = Failure.of(item[-1])
            delay = (
                validation.backoff(*backoff[job_id]) if backoff and job_id in backoff else default
            )
            attempts.append(FailedAttempt(claim, failure, delay))
        return lifecycle.fail(self.connection(), attempts, synchronous_commit=None)

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
        return lifecycle.fence_of(claim)[0] in self.extend_lease_many([claim], lease)

    def extend_lease_many(
        self, jobs: Iterable[Claim], lease: timedelta | float | None = None
    ) -> set[int]:
        lease_td = validation.positive_duration("lease", conf.lease() if lease is None else lease)
        return lifecycle.extend_lease(self.connection(), jobs, lease_td, synchronous_commit=None)

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
        return lifecycle.fence_of(claim)[0] in self.release_many([claim])

    def release_many(self, jobs: Iterable[Claim]) -> set[int]:
        """Release claims (``ClaimedJob`` or ``(id, attempts[, claimed_at])``) at once."""
        return lifecycle.release(self.connection(), jobs, synchronous_commit=None)

    # -- maintenance -------------------------------------------------------------------

    def retry(self, job_ids: Iterable[int]) -> list[int]:
        """Queue failed jobs again now, with their attempts reset; one NOTIFY per queue.

        Jobs that are no longer ``failed`` are left alone. Returns the ids retried.
        """
        rows = sql.run(self.connection(), sql.RETRY, {"ids": sorted({int(i) for i in job_ids})})
        for queue in sorted({queue for _id, queue in rows}):
            notify_on_commit(self.db_alias, queue)
        for job_id, queue in rows:
            logger.info(
                "retry of job %s: queued again",
                job_id,
                extra={"action": "retry", "job_id": job_id, "queue": queue},
            )
        return sorted(job_id for job_id, _queue in rows)

    def reap(self, batch_size: int = REAP_BATCH) -> list[Reaped]:
        """Send jobs whose lease expired back to ``queued`` (``failed`` once out of attempts).

        Works in batches of ``batch_size`` until one comes back short; returns every row it
        changed as ``(id, status, attempts)``. Nothing is reaped in the first minute after
        the server started (``lifecycle.REAP_SETTLE``): workers that held jobs through an
        outage write what they hold first.
        """
        validation.positive_int("batch_size", batch_size)
        return lifecycle.reap(self.connection(), batch_size)

    def prune(
        self,
        older_than: timedelta = timedelta(days=7),
        status: str | Iterable[str] = "done",
        batch_size: int = 10_000,
        archive: bool = False,
        progress: Callable[[int], None] | None = None,
    ) -> int:
        """Delete (or, with ``archive``, move to the archive table) finished jobs.

        ``status`` is ``"done"``, ``"failed"``, ``"all"`` (both) or a list of those; queued and
        running jobs are never touched. Age is measured from ``finished_at`` (or
        ``created_at`` where no finish time was recorded) on the database clock. Each batch
        of ``batch_size`` is its own short statement; ``progress`` is called with the running
        total after each. Returns the number of jobs removed.
        """
        statuses = (
            list(PRUNABLE)
            if status == "all"
            else ([status] if isinstance(status, str) else list(status))
        )
        bad = [s for s in statuses if s not in PRUNABLE]
        if bad or not statuses:
            raise InvalidJobOptions(
                f"Cannot prune status {bad or statuses!r}: use 'done', 'failed' or 'all'; "
                "queued and running jobs are never pruned."
            )
        if not isinstance(older_than, timedelta):
            raise InvalidJobOptions(
                f"Invalid older_than {older_than!r}: use a timedelta of zero or more."
            )
        validation.duration("older_than", older_than)
        validation.positive_int("batch_size", batch_size)
        connection = self.connection()
        statement = sql.PRUNE_ARCHIVE if archive else sql.PRUNE
        total = 0
        params = {"statuses": statuses, "older_than": older_than, "limit": batch_size}
        while True:
            count = sql.count(connection, statement, params)
            total += count
            if progress is not None and count:
                progress(total)
            if count < batch_size:
                return total
