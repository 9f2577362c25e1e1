"""The lifecycle verbs: enqueue, claim, complete, fail, extend_lease, release, reap, prune.

Each verb runs one statement from ``sql.py`` on the manager's database alias. The writes
after a claim are fenced on ``(id, status = 'running', attempts)``: they return ``False`` (or
``None``) when the job is no longer ours, and log that at WARNING; they never raise for it.
The ``*_many`` forms do the same for a batch in one statement; the worker uses them.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import socket
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from typing import TYPE_CHECKING, Any, NamedTuple

from django.conf import settings as django_settings
from django.db import connections, models
from django.db.transaction import TransactionManagementError
from django.utils import timezone

from django_pgjobs import conf, registry, sql, validation
from django_pgjobs.exceptions import InvalidJobOptions, NotPostgreSQL
from django_pgjobs.notify import notify_on_commit

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper

    from django_pgjobs.models import Job
    from django_pgjobs.worker.db import DirectConnections

logger = logging.getLogger(__name__)

PRUNABLE = ("done", "failed")
REAP_BATCH = 1000
# last_error keeps the end of very long errors (tracebacks end with what matters).
ERROR_LIMIT = 8000


@dataclass(frozen=True)
class ClaimedJob:
    """A job this worker now owns: pass ``id`` and ``attempts`` back to finish it."""

    id: int
    queue: str
    task: str
    payload: dict[str, Any]
    attempts: int
    max_attempts: int
    # When this claim was made (the row's attempted_at): release() fences on it too, so a
    # release retried after a lost acknowledgement cannot undo a later claim.
    claimed_at: datetime | None = None


@dataclass(frozen=True)
class Failure:
    """One failed attempt, as django.tasks' ``TaskError`` holds it."""

    exception_class_path: str
    traceback: str

    @classmethod
    def from_exception(cls, exc: BaseException) -> Failure:
        kind = type(exc)
        return cls(
            f"{kind.__module__}.{kind.__qualname__}", "".join(traceback.format_exception(exc))
        )

    @classmethod
    def of(cls, error: str | BaseException | Failure) -> Failure:
        if isinstance(error, Failure):
            return error
        if isinstance(error, BaseException):
            return cls.from_exception(error)
        return cls("builtins.Exception", str(error))


def default_worker_id() -> str:
    """``host:pid``, recorded in ``worker_ids`` for each attempt this process claims."""
    return f"{socket.gethostname()}:{os.getpid()}"


class Reaped(NamedTuple):
    id: int
    status: str
    attempts: int


def _clean_error(error: str) -> str:
    # PostgreSQL text holds neither NUL nor lone surrogates (an undecodable file name in a
    # message); keep the tail, where a traceback says what went wrong.
    error = str(error).replace("\x00", "\\x00")
    error = error.encode("utf-8", "backslashreplace").decode("utf-8")
    return error if len(error) <= ERROR_LIMIT else "..." + error[-ERROR_LIMIT:]


# A claim to fence on: a ClaimedJob, or (id, attempts[, claimed_at]).
Claim = ClaimedJob | tuple[int, int] | tuple[int, int, datetime | None]


def _timestamp(text: str) -> datetime:
    """A timestamp the enqueue returned as ISO 8601 text in UTC, as Django would load it."""
    value = datetime.fromisoformat(text)
    if not django_settings.USE_TZ:
        return timezone.make_naive(value)
    return value.astimezone(dt_timezone.utc)


def _claim(job: Claim) -> tuple[int, int, datetime | None]:
    if isinstance(job, ClaimedJob):
        return job.id, job.attempts, job.claimed_at
    return int(job[0]), int(job[1]), job[2] if len(job) > 2 else None


def _claims(jobs: Iterable[Claim]) -> dict[str, list[Any]]:
    """Parallel arrays for the fenced statements, in id order (a stable lock order)."""
    ordered = sorted((_claim(job) for job in jobs), key=lambda claim: claim[0])
    return {
        "ids": [claim[0] for claim in ordered],
        "attempts": [claim[1] for claim in ordered],
        "claimed_at": [claim[2] for claim in ordered],
    }


class JobManager(models.Manager["Job"]):
    """``Job.objects``: the queue's verbs, as raw SQL on this manager's database alias."""

    # synchronous_commit for the claim and the fenced writes; None keeps the session's.
    _synchronous_commit: str | None = None
    # Where a lease-mode claim and the fenced writes run: a worker's own psycopg connections
    # (worker.db.Direct), or None for this alias's Django connection.
    _direct: DirectConnections | None = None

    def with_direct_connections(self, direct: DirectConnections) -> JobManager:
        """A copy whose lease-mode claims and fenced writes run on ``direct.get()``.

        The worker's hot path: a plain psycopg connection per thread (autocommit, optionally
        with prepared statements) skips Django's cursor wrappers and the server's re-planning
        of the same statements. Errors are then psycopg's own, not ``django.db``'s.
        """
        manager = copy.copy(self)
        manager._direct = direct
        return manager

    def close_direct_connection(self) -> None:
        """Close the calling thread's direct connection, if this manager has any."""
        if self._direct is not None:
            self._direct.close()

    def _hot(self) -> tuple[sql.Connection, str | None]:
        """The connection for a lease-mode claim or a fenced write, and its commit setting."""
        if self._direct is not None:
            return self._direct.get(), self._synchronous_commit
        connection = self.connection()
        return connection, self._commit_mode(connection)

    def with_synchronous_commit(self, value: str | None) -> JobManager:
        """A copy whose claims and fenced writes commit with ``synchronous_commit = value``.

        The worker's ``PGJOBS["WORKER_SYNCHRONOUS_COMMIT"]``: with ``"off"`` those commits do
        not wait for the WAL flush. Applied per statement (``set_config(..., true)``), and
        only outside ``atomic()``: a caller's own transaction keeps its durability.
        """
        manager = copy.copy(self)
        manager._synchronous_commit = validation.synchronous_commit(value)
        return manager

    def _commit_mode(self, connection: BaseDatabaseWrapper) -> str | None:
        mine = connection.get_autocommit() and not connection.in_atomic_block
        return self._synchronous_commit if mine else None

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
            conf.get("NOTIFY") == "auto" or not connection.get_autocommit()
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
        if mode not in conf.MODES:
            raise InvalidJobOptions(f"Invalid mode {mode!r}: use 'lease' or 'transaction'.")
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
        target, commit = (
            self._hot() if mode == "lease" else (connection, self._commit_mode(connection))
        )
        params = {
            "queue": queue,
            "limit": limit,
            "lease": lease_td,
            "worker_id": worker_id or default_worker_id(),
            "synchronous_commit": commit,
        }
        rows = sql.run(target, sql.CLAIM, params)
        return [
            ClaimedJob(
                id=job_id,
                queue=job_queue,
                task=task,
                payload=json.loads(payload) if isinstance(payload, str) else payload,
                attempts=attempts,
                max_attempts=job_max_attempts,
                claimed_at=claimed_at,
            )
            for job_id, job_queue, task, payload, attempts, job_max_attempts, claimed_at in rows
        ]

    # -- fenced outcomes ---------------------------------------------------------------

    def complete(self, job_id: int, attempts: int, result: Any = None) -> bool:
        """Mark a claimed job done. ``False``: the job is no longer ours; nothing changed.

        ``result`` (JSON values only) is stored as the job's return value.
        """
        results = {job_id: result} if result is not None else None
        return job_id in self.complete_many([(job_id, attempts)], results)

    def complete_many(
        self, jobs: Iterable[Claim], results: Mapping[int, Any] | None = None
    ) -> set[int]:
        """Complete claims in one statement; return the ids that changed.

        Each claim is a ``ClaimedJob`` or ``(id, attempts[, claimed_at])``. ``results`` maps
        a job id to its return value; every value is validated first.
        """
        claims = _claims(jobs)
        results = results or {}
        items = []
        for job_id, attempts, claimed_at in zip(
            claims["ids"], claims["attempts"], claims["claimed_at"], strict=True
        ):
            text = validation.result(results.get(job_id))
            items.append(
                f'{{"id":{job_id},"attempts":{attempts}'
                + ("" if claimed_at is None else f',"claimed_at":"{claimed_at.isoformat()}"')
                + ("" if text is None else f',"result":{text}')
                + "}"
            )
        rows = self._fenced("complete", sql.COMPLETE, claims, {"claims": f"[{','.join(items)}]"})
        return {row[0] for row in rows}

    def fail(
        self,
        job_id: int,
        attempts: int,
        error: str | BaseException | Failure,
        *,
        backoff: tuple[float, float] | None = None,
    ) -> str | None:
        """Record a failed attempt: back to ``queued`` with backoff, or ``failed`` for good.

        ``error`` is a message, an exception (its class and traceback are kept) or a
        ``Failure``. ``backoff`` is ``(base, cap)`` in seconds (default the ``PGJOBS``
        settings). Returns the new status, or ``None`` when the job is no longer ours.
        """
        backoffs = {job_id: backoff} if backoff is not None else None
        return self.fail_many([(job_id, attempts, error)], backoffs).get(job_id)

    def fail_many(
        self,
        jobs: Iterable[
            tuple[int, int, str | BaseException | Failure]
            | tuple[ClaimedJob, str | BaseException | Failure]
        ],
        backoff: Mapping[int, tuple[float, float]] | None = None,
    ) -> dict[int, str]:
        """Fail jobs in one statement; return id -> new status.

        Each item is ``(id, attempts, error)`` or ``(claimed_job, error)``. ``backoff`` maps a
        job id to its ``(base, cap)``; others use the settings.
        """
        errors = {}
        claims: list[Claim] = []
        for item in jobs:
            claim: Claim = item[0] if isinstance(item[0], ClaimedJob) else (item[0], item[1])
            claims.append(claim)
            errors[_claim(claim)[0]] = Failure.of(item[-1])
        fenced = _claims(claims)
        failures = [errors[job_id] for job_id in fenced["ids"]]
        default = conf.backoff()
        delays = [(backoff or {}).get(job_id, default) for job_id in fenced["ids"]]
        rows = self._fenced(
            "fail",
            sql.FAIL,
            fenced,
            fenced
            | {
                "errors": [_clean_error(f.traceback) for f in failures],
                "error_classes": [f.exception_class_path for f in failures],
                "bases": [float(base) for base, _cap in delays],
                "caps": [float(cap) for _base, cap in delays],
            },
        )
        return {row[0]: row[1] for row in rows}

    def extend_lease(
        self, job_id: int, attempts: int, lease: timedelta | float | None = None
    ) -> bool:
        """Push a running job's lease to ``now() + lease``. ``False``: stop, it is not ours."""
        return job_id in self.extend_lease_many([(job_id, attempts)], lease)

    def extend_lease_many(
        self, jobs: Iterable[Claim], lease: timedelta | float | None = None
    ) -> set[int]:
        lease_td = validation.positive_duration("lease", conf.lease() if lease is None else lease)
        claims = _claims(jobs)
        rows = self._fenced("extend_lease", sql.EXTEND_LEASE, claims, claims | {"lease": lease_td})
        return {row[0] for row in rows}

    def release(self, job_id: int, attempts: int, claimed_at: datetime | None = None) -> bool:
        """Give back a claimed job that never started: ``queued`` again, attempt not counted.

        Pass the claim's ``claimed_at`` (``ClaimedJob.claimed_at``) to fence on that claim
        alone: giving the attempt back makes ``(id, attempts)`` repeat for the next claim.
        """
        return job_id in self.release_many([(job_id, attempts, claimed_at)])

    def release_many(self, jobs: Iterable[Claim]) -> set[int]:
        """Release claims (``ClaimedJob`` or ``(id, attempts[, claimed_at])``) at once."""
        claims = _claims(jobs)
        return {row[0] for row in self._fenced("release", sql.RELEASE, claims, claims)}

    def _fenced(
        self,
        action: str,
        statement: Any,
        claims: dict[str, list[Any]],
        params: dict[str, Any],
    ) -> list[tuple[Any, ...]]:
        """Run one fenced write of ``claims`` with ``params``; return its rows (id first).

        Each claim the statement did not change is logged: the job is no longer ours.
        """
        if not claims["ids"]:
            return []
        connection, commit = self._hot()
        rows = sql.run(connection, statement, params | {"synchronous_commit": commit})
        changed = {row[0] for row in rows}
        for job_id, attempt in zip(claims["ids"], claims["attempts"], strict=True):
            if job_id not in changed:
                logger.warning(
                    "%s of job %s (attempt %s) changed nothing: the job is no longer ours",
                    action,
                    job_id,
                    attempt,
                    extra={"action": action, "job_id": job_id, "attempts": attempt},
                )
        return rows

    def seconds_until_due(self, queues: Sequence[str]) -> float | None:
        """Seconds until the earliest job of ``queues`` that is not yet due becomes due."""
        rows = sql.run(self._hot()[0], sql.NEXT_DUE, {"queues": list(queues)})
        seconds = rows[0][0] if rows else None
        return None if seconds is None else max(0.0, float(seconds))

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
        changed as ``(id, status, attempts)``.
        """
        validation.positive_int("batch_size", batch_size)
        connection = self._hot()[0]
        reaped: list[Reaped] = []
        while True:
            rows = [Reaped(*row) for row in sql.run(connection, sql.REAP, {"limit": batch_size})]
            reaped.extend(rows)
            for row in rows:
                logger.warning(
                    "reaped job %s (attempt %s): lease expired, now %s",
                    row.id,
                    row.attempts,
                    row.status,
                    extra={"action": "reap", "job_id": row.id, "attempts": row.attempts},
                )
            if len(rows) < batch_size:
                return reaped

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
        if not isinstance(older_than, timedelta) or older_than < timedelta(0):
            raise InvalidJobOptions(
                f"Invalid older_than {older_than!r}: use a timedelta of zero or more."
            )
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
