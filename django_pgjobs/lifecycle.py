"""The lifecycle statements run on a given connection: shared by ``Job.objects`` and the worker.

``Job.objects`` runs them on its alias's Django connection; a lease-mode worker on its own
direct psycopg connections, with its own commit setting (``worker.store``). Either way each
verb is one statement from ``sql.py``. Arguments are validated by the callers; what is here
only shapes parameters and reads rows back.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import traceback
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from typing import Any, NamedTuple

import psycopg
from django.db import OperationalError, transaction
from psycopg.errors import LockNotAvailable as PsycopgLockNotAvailable

from django_pgjobs import sql, validation
from django_pgjobs.exceptions import InvalidJobOptions

# The verbs log under the manager's name, the logger the docs point users to.
logger = logging.getLogger("django_pgjobs.managers")

# last_error keeps the end of very long errors (tracebacks end with what matters).
ERROR_LIMIT = 8000
REAP_BATCH = 1000
# Nothing is reaped this long after the server started (sql.REAP): longer than the slowest
# reconnect of a worker's writer (worker.db.Backoff's ceiling, 30 s), twice over.
REAP_SETTLE = timedelta(seconds=60)
# How long a guarded claim waits for a lock (the guard, or a queue row it stamps) before it
# gives up and takes nothing this time.
GUARD_TIMEOUT = "5s"


@dataclass(frozen=True)
class ClaimedJob:
    """A job this worker now owns: pass it back to ``complete``/``fail``/``release``.

    ``payload`` holds the keyword arguments; a row whose payload is not a JSON object (only
    possible in a table older than its payload check, or written while its trigger was off)
    keeps ``payload`` empty and says what it found in ``invalid_payload``: the worker fails
    that job, and only that one.
    """

    id: int
    queue: str
    task: str
    payload: dict[str, Any]
    attempts: int
    max_attempts: int
    # When this claim was made (the row's attempted_at): every fenced write checks it too, so
    # a write retried after a lost acknowledgement cannot touch a later claim of the job.
    claimed_at: datetime | None = None
    # How often this job was given back because the queue's database was away.
    outage_releases: int = 0
    invalid_payload: str | None = None
    # A periodic job's schedule and the tick it serves (None for any other job).
    schedule: str | None = None
    scheduled_at: datetime | None = None
    # Attempts in a row before this one that ended with their worker dead.
    crashes: int = 0
    # Seconds this attempt may run (None: no limit).
    timeout: float | None = None
    # Claimed by the guarded claim (its queue has a limit, or ready jobs with lock keys): once
    # it no longer runs, a worker waiting on that limit or key may start the next
    # (``wake_freed``).
    guarded: bool = False


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

    @property
    def summary(self) -> str:
        """The traceback's last line: the exception and its message."""
        return last_line(self.traceback)


def last_line(error: str) -> str:
    """The last non-blank line of an error text (a traceback ends with what went wrong)."""
    text = error.strip()
    return text.splitlines()[-1] if text else "error"


def reason(exc: BaseException) -> str:
    """The first line of an exception's message (a connection error's is the one that
    matters), or its class name when it has none."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class Reaped(NamedTuple):
    id: int
    status: str
    attempts: int


# A claim to fence on: a ClaimedJob, or (id, attempts[, claimed_at]).
Claim = ClaimedJob | tuple[int, int] | tuple[int, int, datetime | None]


def default_worker_id() -> str:
    """``host:pid``, recorded in ``worker_ids`` for each attempt this process claims."""
    return f"{socket.gethostname()}:{os.getpid()}"


def clean_error(error: str) -> str:
    """Error text PostgreSQL can store, at most ``ERROR_LIMIT`` characters (the tail)."""
    # PostgreSQL text holds neither NUL nor lone surrogates (an undecodable file name in a
    # message); keep the tail, where a traceback says what went wrong.
    error = str(error).replace("\x00", "\\x00")
    error = error.encode("utf-8", "backslashreplace").decode("utf-8")
    return error if len(error) <= ERROR_LIMIT else "..." + error[-ERROR_LIMIT:]


def fence_of(job: Claim) -> tuple[int, int, datetime | None]:
    """``(id, attempts, claimed_at)`` of a claim."""
    if isinstance(job, ClaimedJob):
        return job.id, job.attempts, job.claimed_at
    if not isinstance(job, tuple) or len(job) not in (2, 3):
        raise InvalidJobOptions(
            f"Invalid claim {job!r}: pass a ClaimedJob (from claim()) or (id, attempts[, "
            "claimed_at])."
        )
    return int(job[0]), int(job[1]), job[2] if len(job) > 2 else None


def fences(jobs: Iterable[Claim]) -> dict[str, list[Any]]:
    """Parallel arrays for the fenced statements, in id order (a stable lock order)."""
    ordered = sorted((fence_of(job) for job in jobs), key=lambda claim: claim[0])
    return {
        "ids": [claim[0] for claim in ordered],
        "attempts": [claim[1] for claim in ordered],
        "claimed_at": [claim[2] for claim in ordered],
    }


# The payload's decoder: jsonb's text is one JSON value with no whitespace around it, so the
# scan alone reads it (json.loads() adds two Python calls and two regex matches around it).
_read_json = json.JSONDecoder().raw_decode


def _payload(text: str) -> tuple[dict[str, Any], str | None]:
    """The claimed row's payload, decoded once; a non-object is reported, never raised."""
    try:
        value, _ = _read_json(text)
    except (ValueError, RecursionError) as exc:
        # jsonb holds what Python will not read back: an integer past Python's digit limit
        # for conversions, or nesting deeper than its recursion limit.
        return {}, f"the payload cannot be read back ({type(exc).__name__}: {exc!s:.120})"
    if isinstance(value, dict):
        return value, None
    kind = "null" if value is None else type(value).__name__
    return {}, f"the payload is a JSON {kind} ({text:.80}), not an object of keyword arguments"


def claim(
    connection: sql.Connection,
    *,
    queue: str,
    limit: int,
    lease: timedelta,
    worker_id: str,
    synchronous_commit: str | None,
    suspects: bool = True,
    tasks: sql.TextArray | None = None,
    guarded: bool = False,
    idle: bool = False,
) -> list[ClaimedJob]:
    """Claim up to ``limit`` ready jobs; without ``suspects``, only jobs whose last attempt
    did not end with its worker dead (``crashes`` = 0); with ``tasks``, only jobs of those
    tasks. ``idle`` (an idle worker's plain claim, ``sql.CLAIM_IDLE``): the first job may be
    a suspect, and is then the only one; the others may not.

    The plain claim (one statement) takes nothing from a paused or limited queue and no job
    with a lock key. ``guarded`` claims those, within the queue's limits and one job per free
    lock key: in a transaction of its own after ``sql.GUARD`` (a lock every guarded claim of
    the fleet takes), so ``connection`` must be in autocommit (a worker's direct connection).
    """
    params = _claim_params(queue, limit, lease, worker_id, synchronous_commit, suspects, tasks)
    if guarded:
        if isinstance(connection, psycopg.Cursor):
            connection = connection.connection
        block = (
            connection.transaction()
            if isinstance(connection, psycopg.Connection)
            else transaction.atomic(using=connection.alias)
        )
        try:
            with block:
                sql.run(connection, sql.GUARD, {"lock_timeout": GUARD_TIMEOUT})
                rows = sql.run(connection, sql.CLAIM_GUARDED, params)
        except (PsycopgLockNotAvailable, OperationalError) as exc:
            if not isinstance(exc.__cause__ or exc, PsycopgLockNotAvailable):
                raise
            logger.warning(
                "the guarded claim of queue %s waited %s for a lock and gave up; claiming again "
                "later (is a session holding the queue's row, or the guard, in a long "
                "transaction?)",
                queue,
                GUARD_TIMEOUT,
                extra={"action": "claim", "queue": queue, "worker_id": worker_id},
            )
            return []
        return _claimed(rows, guarded=True)
    statement = sql.limited(sql.CLAIM_IDLE if idle else sql.CLAIM, limit)
    return _claimed(sql.run(connection, statement, params))


def claim_completing(
    connection: sql.Connection,
    *,
    queue: str,
    limit: int,
    lease: timedelta,
    worker_id: str,
    synchronous_commit: str | None,
    tasks: sql.TextArray | None,
    jobs: Iterable[Claim],
    results: Mapping[int, Any],
) -> tuple[list[ClaimedJob], set[int]]:
    """A busy worker's plain claim (no suspects) that completes ``jobs`` in the same
    statement (``sql.CLAIM_COMPLETING``): the jobs claimed, and the ids of those completed.
    Each completion is fenced as ``complete()``'s, and one the fence refused is logged the
    same way; the statement is one transaction, so a failure writes neither part."""
    claims = fences(jobs)
    params = _claim_params(queue, limit, lease, worker_id, synchronous_commit, False, tasks)
    params["claims"] = _completions(claims, results)
    rows = sql.run(connection, sql.limited(sql.CLAIM_COMPLETING, limit), params)
    done = set(rows[0][-1] or ()) if rows else set()
    _refused("complete", claims, done)
    return _claimed([row[:-1] for row in rows if row[0] is not None]), done


def _claim_params(
    queue: str,
    limit: int,
    lease: timedelta,
    worker_id: str,
    synchronous_commit: str | None,
    suspects: bool,
    tasks: sql.TextArray | None,
) -> dict[str, Any]:
    """The parameters every claim statement takes."""
    return {
        "queue": queue,
        "limit": limit,
        "lease": lease,
        "worker_id": worker_id,
        "synchronous_commit": synchronous_commit,
        "suspects": suspects,
        "tasks": tasks,
    }


def _claimed(rows: list[tuple[Any, ...]], *, guarded: bool = False) -> list[ClaimedJob]:
    """The jobs of a claim's rows (``sql._CLAIM_RETURNING``'s columns), ``guarded`` if the
    guarded claim took them."""
    jobs = []
    for row in rows:
        job_id, job_queue, task, text, attempts, max_attempts, claimed_at, outages = row[:8]
        payload, invalid = _payload(text)
        jobs.append(
            ClaimedJob(
                job_id,
                job_queue,
                task,
                payload,
                attempts,
                max_attempts,
                claimed_at,
                outages,
                invalid,
                schedule=row[8],
                scheduled_at=None if row[9] is None else row[9].astimezone(dt_timezone.utc),
                crashes=row[10],
                timeout=row[11],
                guarded=guarded,
            )
        )
    return jobs


def complete(
    connection: sql.Connection,
    jobs: Iterable[Claim],
    results: Mapping[int, Any],
    *,
    synchronous_commit: str | None,
) -> set[int]:
    claims = fences(jobs)
    params = {"claims": _completions(claims, results), "synchronous_commit": synchronous_commit}
    return {row[0] for row in fenced(connection, "complete", sql.COMPLETE, claims, params)}


def _completions(claims: dict[str, list[Any]], results: Mapping[int, Any]) -> str:
    """``sql.COMPLETE``'s one JSON parameter: each claim's fence and its job's result."""
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
    return f"[{','.join(items)}]"


@dataclass(frozen=True)
class FailedAttempt:
    """One claim to fail: its error, its ``(base, cap)`` backoff, and whether it is final.

    ``delay`` (seconds), when given, replaces the backoff formula (a job's backoff callable);
    ``jitter`` draws the delay from [75 %, 100 %) of itself.
    """

    claim: Claim
    failure: Failure
    backoff: tuple[float, float]
    final: bool = False
    delay: float | None = None
    jitter: bool = False


def fail(
    connection: sql.Connection,
    attempts: Sequence[FailedAttempt],
    *,
    synchronous_commit: str | None,
) -> dict[int, str]:
    """Fail claims in one statement; return id -> new status (``queued`` or ``failed``)."""
    by_id = {fence_of(a.claim)[0]: a for a in attempts}
    claims = fences(a.claim for a in attempts)
    ordered = [by_id[job_id] for job_id in claims["ids"]]
    params = claims | {
        "errors": [clean_error(a.failure.traceback) for a in ordered],
        "error_classes": [a.failure.exception_class_path for a in ordered],
        "bases": [float(a.backoff[0]) for a in ordered],
        "caps": [float(a.backoff[1]) for a in ordered],
        "finals": [a.final for a in ordered],
        "delays": [a.delay for a in ordered],
        "jitters": [a.jitter for a in ordered],
        "synchronous_commit": synchronous_commit,
    }
    return {row[0]: row[1] for row in fenced(connection, "fail", sql.FAIL, claims, params)}


def snooze(
    connection: sql.Connection,
    snoozes: Sequence[tuple[Claim, float]],
    *,
    synchronous_commit: str | None,
) -> set[int]:
    """Snooze claims (each with its delay in seconds) in one statement; return the ids."""
    delays = {fence_of(claim)[0]: float(delay) for claim, delay in snoozes}
    claims = fences(claim for claim, _delay in snoozes)
    params = claims | {
        "delays": [delays[job_id] for job_id in claims["ids"]],
        "synchronous_commit": synchronous_commit,
    }
    return {row[0] for row in fenced(connection, "snooze", sql.SNOOZE, claims, params)}


def extend_lease(
    connection: sql.Connection,
    jobs: Iterable[Claim],
    lease: timedelta,
    *,
    synchronous_commit: str | None,
) -> set[int]:
    claims = fences(jobs)
    params = claims | {"lease": lease, "synchronous_commit": synchronous_commit}
    return {row[0] for row in fenced(connection, "extend_lease", sql.EXTEND_LEASE, claims, params)}


def cancelled_among(connection: sql.Connection, jobs: Iterable[Claim]) -> set[int]:
    """Which of these claims were cancelled (``Job.objects.cancel``), not taken otherwise."""
    claims = fences(jobs)
    if not claims["ids"]:
        return set()
    return {row[0] for row in sql.run(connection, sql.CANCELLED_AMONG, claims)}


def expire_lease(
    connection: sql.Connection, jobs: Iterable[Claim], *, synchronous_commit: str | None
) -> set[int]:
    claims = fences(jobs)
    params = claims | {"synchronous_commit": synchronous_commit}
    return {row[0] for row in fenced(connection, "expire_lease", sql.EXPIRE_LEASE, claims, params)}


def release(
    connection: sql.Connection,
    jobs: Iterable[Claim],
    *,
    outage: bool = False,
    synchronous_commit: str | None,
) -> set[int]:
    """Release claims; with ``outage`` each release also counts in ``outage_releases``."""
    claims = fences(jobs)
    params = claims | {
        "outages": [outage] * len(claims["ids"]),
        "synchronous_commit": synchronous_commit,
    }
    return {row[0] for row in fenced(connection, "release", sql.RELEASE, claims, params)}


def fenced(
    connection: sql.Connection,
    action: str,
    statement: Any,
    claims: dict[str, list[Any]],
    params: dict[str, Any],
) -> list[tuple[Any, ...]]:
    """Run one fenced write of ``claims``; return its rows (id first).

    Each claim the statement did not change is logged at WARNING: the job is no longer ours.
    """
    if not claims["ids"]:
        return []
    rows = sql.run(connection, statement, params)
    _refused(action, claims, {row[0] for row in rows})
    return rows


def _refused(action: str, claims: dict[str, list[Any]], changed: set[int]) -> None:
    """Log each claim a fenced write did not change: the job is no longer ours."""
    for job_id, attempt in zip(claims["ids"], claims["attempts"], strict=True):
        if job_id not in changed:
            logger.warning(
                "%s of job %s (attempt %s) changed nothing: the job is no longer ours",
                action,
                job_id,
                attempt,
                extra={"action": action, "job_id": job_id, "attempts": attempt},
            )


def reap(
    connection: sql.Connection,
    batch_size: int = REAP_BATCH,
    settle: timedelta = REAP_SETTLE,
    *,
    max_crashes: int,
) -> list[Reaped]:
    """Requeue (or fail) expired leases in batches until one comes back short; then clear
    the registry rows of workers past their expiry.

    Each expired lease counts a crash; the ``max_crashes``-th in a row fails the job as
    ``WorkerCrashed`` whatever attempts it has left."""
    reaped: list[Reaped] = []
    params = {"limit": batch_size, "settle": settle, "max_crashes": max_crashes}
    while True:
        rows = [Reaped(*row) for row in sql.run(connection, sql.REAP, params)]
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
            break
    # The registry rows of workers that stopped heartbeating (their jobs' leases tell the
    # rest: a worker cut off from the database may still be running them).
    for (worker_id,) in sql.run(connection, sql.FORGET_WORKERS, {}):
        logger.warning(
            "worker %s stopped heartbeating: its registry row is cleared",
            worker_id,
            extra={"action": "reap", "worker_id": worker_id},
        )
    return reaped


@dataclass(frozen=True)
class Outlook:
    """What a worker learns of its queues after a short claim (``sql.OUTLOOK``)."""

    # Seconds until the earliest deferred job comes due, if any.
    due: float | None
    # The queues to claim through the guarded claim (a limit, or jobs with lock keys).
    guarded: frozenset[str]
    # Seconds until a rate window that was full at the short claim has room (0: it has now),
    # for a queue with ready jobs, if any.
    rate_free: float | None


def freed_queues(connection: sql.Connection, job_ids: Collection[int]) -> list[str]:
    """The queues where these jobs, no longer running, freed what a waiting worker may claim
    now: a slot under the queue's concurrency limit, or a lock key (``sql.FREED_QUEUES``)."""
    if not job_ids:
        return []
    return [row[0] for row in sql.run(connection, sql.FREED_QUEUES, {"ids": list(job_ids)})]


def word_not_sent(count: int, action: str, *, failed: bool = True) -> None:
    """Log that the word of ``count`` jobs' freed slots or keys did not go out (``failed``:
    its statement raised, and the exception is logged with it). A hint lost, never a job:
    waiting workers claim at their next tick."""
    logger.warning(
        "could not tell other workers that %s jobs no longer running freed their queues' limits "
        "or lock keys; they claim at their next tick",
        count,
        exc_info=failed,
        extra={"action": action},
    )


def wake_freed(connection: sql.Connection, job_ids: Collection[int], *, channel: str) -> None:
    """Send those queues' workers, on ``channel``, the word a new job sends
    (``sql.WAKE_FREED``), in a transaction of its own: ``connection`` in autocommit."""
    if job_ids:
        sql.run(connection, sql.WAKE_FREED, {"ids": list(job_ids), "channel": channel})


def outlook(connection: sql.Connection, queues: Sequence[str], since: float = 0.0) -> Outlook:
    """When to look again, and which of ``queues`` need the guarded claim; ``since``: the
    seconds since the claim that came back short was sent."""
    params = {"queues": list(queues), "since": since}
    due, guarded, rate_free = sql.run(connection, sql.OUTLOOK, params)[0]
    return Outlook(
        None if due is None else max(0.0, float(due)),
        frozenset(guarded),
        None if rate_free is None else max(0.0, float(rate_free)),
    )
