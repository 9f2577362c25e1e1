"""The fenced writes after a claim: complete, fail, snooze, extend or expire a lease, release;
and the word a finished job of a limited queue sends to the workers waiting on the limit.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

from django_pgjobs.core import conf, validation
from django_pgjobs.core.fragments import (
    FENCE,
    KEY_HOLDERS,
    READY,
    THE_CLAIM,
    claims,
    failed_for_good,
    running_in,
)

if TYPE_CHECKING:
    from typing_extensions import LiteralString
from django_pgjobs.core.execute import Connection, run
from django_pgjobs.core.types import (
    Action,
    Claim,
    FailedAttempt,
    Failure,
    Outcome,
    clean_error,
    fence_of,
    fences,
)

logger = logging.getLogger("django_pgjobs.managers")


# The worker's most frequent write. The claims arrive as one JSON array of objects (id,
# attempts, claimed_at, result): one text parameter the server parses once, instead of four
# arrays that psycopg dumps element by element in Python. A finished job holds no unique key.
COMPLETE: LiteralString = (
    """
UPDATE pgjobs_job j
SET status = 'done', locked_until = NULL, finished_at = now(), result = mine.result,
    unique_key = NULL, crashes = 0
FROM jsonb_to_recordset(%(claims)s::jsonb)
     AS mine(id bigint, attempts int, claimed_at timestamptz, result jsonb)"""
    + FENCE
    + """
RETURNING j.id
"""
)


# Back to queued after base * 2^attempts seconds (20 s, 40 s, 80 s, 160 s with base 10 s),
# at most `cap` seconds (an hour by default), or failed for good once the attempts are used
# up, or at once when the failure is `final` (a payload that can never run). The exponent is
# capped so a huge max_attempts cannot overflow the interval (the checks keep base * 2^30
# within range). Every failed attempt is kept in `errors` (class path and traceback:
# django.tasks' TaskError), the latest in last_error. An attempt that raised ends a run of
# crashes; a job failed for good gives its unique key up. A job's own backoff callable
# gives its `delay` (seconds) instead of the formula. With `jitter` the delay is drawn from
# [75 %, 100 %) of itself here, where the formula's value is known (it depends on the row's
# attempts): random() per row, never beyond the cap.
FAIL: LiteralString = (
    """
UPDATE pgjobs_job j
SET """
    + failed_for_good("mine.final")
    + """,
    run_at       = now() + coalesce(mine.delay * interval '1 second',
                                    least(mine.cap * interval '1 second',
                                          mine.base * interval '1 second'
                                          * 2 ^ least(j.attempts, 30)))
                         * CASE WHEN mine.jitter THEN 0.75 + 0.25 * random() ELSE 1 END,
    locked_until = NULL,
    last_error   = mine.error,
    errors       = j.errors || jsonb_build_array(jsonb_build_object(
                     'exception_class_path', mine.error_class, 'traceback', mine.error)),
    crashes      = 0
FROM """
    + claims(
        """,
            %(errors)s::text[], %(error_classes)s::text[], %(bases)s::float8[],
            %(caps)s::float8[], %(finals)s::bool[], %(delays)s::float8[], %(jitters)s::bool[]""",
        ", error, error_class, base, cap, final, delay, jitter",
    )
    + FENCE
    + """
RETURNING j.id, j.status, j.run_at
"""
)


# A job that said "not now" (raise Snooze): queued again `delay` seconds later, the claim's
# attempt given back as by a release (so snoozing never fails a job), counted in `snoozes`.
# The run did happen: started_at and worker_ids keep it. A key given up at the claim
# (unique while queued) stays given up: another job may hold it by now. The delay counts from
# this statement (statement_timestamp()), not from its transaction's start: in transaction
# mode that is the claim, and a job that ran longer than its snooze would be due at once.
SNOOZE: LiteralString = (
    """
UPDATE pgjobs_job j
SET status       = 'queued',
    run_at       = statement_timestamp() + mine.delay * interval '1 second',
    attempts     = j.attempts - 1,
    snoozes      = j.snoozes + 1,
    locked_until = NULL,
    attempted_at = NULL,
    crashes      = 0
FROM """
    + claims(", %(delays)s::float8[]", ", delay")
    + FENCE
    + """
RETURNING j.id
"""
)


# The heartbeat. A row missing from RETURNING was taken from us: stop treating it as ours.
EXTEND_LEASE: LiteralString = (
    """
UPDATE pgjobs_job j
SET locked_until = now() + %(lease)s::interval
FROM """
    + claims()
    + FENCE
    + """
RETURNING j.id
"""
)


# A worker that exits with jobs still running (a second Ctrl-C, a shutdown past its timeout,
# too many stuck executors) ends their leases, so the next reap requeues them instead of
# waiting out the lease. Each keeps its attempt: the job may have run part way, as after a
# crash. It was no crash, though: the lease ends at the claim time itself, a value no claim or
# heartbeat ever sets (leases are >= 1 s), which tells the reap not to count one. Idempotent.
EXPIRE_LEASE: LiteralString = (
    """
UPDATE pgjobs_job j
SET locked_until = j.attempted_at
FROM """
    + claims()
    + FENCE
    + """
RETURNING j.id
"""
)


# Give back a job that was claimed but never started, or whose run met an outage of the
# queue's own database: the claim's attempt is not counted. An outage's release is counted
# in outage_releases instead, which the worker caps so that no misjudged error can loop.
RELEASE: LiteralString = (
    """
UPDATE pgjobs_job j
SET status          = 'queued',
    attempts        = j.attempts - 1,
    locked_until    = NULL,
    started_at      = CASE WHEN j.attempts > 1 THEN j.started_at END,
    attempted_at    = NULL,
    worker_ids      = j.worker_ids - (jsonb_array_length(j.worker_ids) - 1),
    outage_releases = j.outage_releases + mine.outage::int
FROM """
    + claims(", %(outages)s::bool[]", ", outage")
    + FENCE
    + """
RETURNING j.id
"""
)


# Which of a worker's refused claims were cancelled (rather than reaped): read only after a
# fenced write changed nothing, so the normal path never sends it. Matched on the claim (id,
# attempts, claim time), so a cancel of a later claim of the job is not taken for ours.
CANCELLED_AMONG: LiteralString = (
    """
SELECT j.id
FROM pgjobs_job j
JOIN """
    + claims()
    + "\n  ON "
    + THE_CLAIM
    + """ AND j.status = 'cancelled'
"""
)


# Jobs that held a slot under their queue's concurrency limit, or a lock key, no longer run
# (their outcome was written, or they were cancelled): the next job of the queue may start
# now. The worker to claim it may be another one, waiting since its claim came back short (a
# worker's own finished jobs wake it, another's do not), which without word would wait for its
# next tick. Their queues that want word: not paused, with a ready job, and with room under
# the concurrency limit (counted as the guarded claim counts), or, without one, a lock key of
# these jobs that no running job took again. Grouped by queue first, so each queue's room is
# counted once. (The next job of a key in another queue still waits for that queue's workers'
# next claim: finding it would read every ready keyed job.)
FREED_QUEUES: LiteralString = (
    """
SELECT f.queue
FROM (SELECT j.queue,
             bool_or(j.lock_key IS NOT NULL AND NOT EXISTS (SELECT """
    + KEY_HOLDERS
    + """))
               AS key_free
      FROM pgjobs_job j WHERE j.id = ANY(%(ids)s::bigint[]) GROUP BY j.queue) AS f
LEFT JOIN pgjobs_queue q ON q.name = f.queue
WHERE NOT coalesce(q.paused, false)
  AND CASE WHEN q.concurrency IS NULL THEN f.key_free
           ELSE q.concurrency > """
    + running_in("f.queue")
    + """ END
  AND EXISTS (SELECT FROM pgjobs_job r WHERE r.queue = f.queue AND """
    + READY
    + ")"
)


# The worker's word to those queues, sent as a new job's is: a NOTIFY each, in a transaction
# of its own that does not wait for the WAL flush (as NOTIFY's).
WAKE_FREED: LiteralString = (
    """
SELECT pg_notify(%(channel)s, freed.queue)
FROM ("""
    + FREED_QUEUES
    + """) AS freed, set_config('synchronous_commit', 'off', true)
"""
)


def complete(
    connection: Connection,
    jobs: Iterable[Claim],
    results: Mapping[int, Any],
    *,
    synchronous_commit: str | None,
) -> set[int]:
    claims = fences(jobs)
    params = {"claims": _completions(claims, results), "synchronous_commit": synchronous_commit}
    return {row[0] for row in fenced(connection, "complete", COMPLETE, claims, params)}


def _completions(claims: dict[str, list[Any]], results: Mapping[int, Any]) -> str:
    """``COMPLETE``'s one JSON parameter: each claim's fence and its job's result."""
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


def fail(
    connection: Connection,
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
    return {row[0]: row[1] for row in fenced(connection, "fail", FAIL, claims, params)}


def snooze(
    connection: Connection,
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
    return {row[0] for row in fenced(connection, "snooze", SNOOZE, claims, params)}


def extend_lease(
    connection: Connection,
    jobs: Iterable[Claim],
    lease: timedelta,
    *,
    synchronous_commit: str | None,
) -> set[int]:
    claims = fences(jobs)
    params = claims | {"lease": lease, "synchronous_commit": synchronous_commit}
    return {row[0] for row in fenced(connection, "extend_lease", EXTEND_LEASE, claims, params)}


def cancelled_among(connection: Connection, jobs: Iterable[Claim]) -> set[int]:
    """Which of these claims were cancelled (``Job.objects.cancel``), not taken otherwise."""
    claims = fences(jobs)
    if not claims["ids"]:
        return set()
    return {row[0] for row in run(connection, CANCELLED_AMONG, claims)}


def expire_lease(
    connection: Connection, jobs: Iterable[Claim], *, synchronous_commit: str | None
) -> set[int]:
    claims = fences(jobs)
    params = claims | {"synchronous_commit": synchronous_commit}
    return {row[0] for row in fenced(connection, "expire_lease", EXPIRE_LEASE, claims, params)}


def release(
    connection: Connection,
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
    return {row[0] for row in fenced(connection, "release", RELEASE, claims, params)}


def fenced(
    connection: Connection,
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
    rows = run(connection, statement, params)
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


def freed_queues(connection: Connection, job_ids: Collection[int]) -> list[str]:
    """The queues where these jobs, no longer running, freed what a waiting worker may claim
    now: a slot under the queue's concurrency limit, or a lock key (``FREED_QUEUES``)."""
    if not job_ids:
        return []
    return [row[0] for row in run(connection, FREED_QUEUES, {"ids": list(job_ids)})]


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


def wake_freed(connection: Connection, job_ids: Collection[int], *, channel: str) -> None:
    """Send those queues' workers, on ``channel``, the word a new job sends
    (``WAKE_FREED``), in a transaction of its own: ``connection`` in autocommit."""
    if job_ids:
        run(connection, WAKE_FREED, {"ids": list(job_ids), "channel": channel})


class Writes(Protocol):
    """Where a worker's outcomes are written: its ``Store``, which knows the connection and
    how durably the writes commit."""

    def complete(self, jobs: Iterable[Claim], results: dict[int, Any]) -> set[int]: ...

    def fail(self, attempts: Sequence[FailedAttempt]) -> dict[int, str]: ...

    def snooze(self, snoozes: Sequence[tuple[Claim, float]]) -> set[int]: ...

    def release(self, jobs: Iterable[Claim], *, outage: bool = False) -> set[int]: ...


def write(writes: Writes, action: str, outcomes: Sequence[Outcome]) -> dict[int, str]:
    """Write ``outcomes``, all of kind ``action``, through their fenced statement: the one
    mapping from an outcome to its write, for both modes. Returns the new status of each job
    the fence let through (a released job is ``queued`` again); a job missing is no longer
    this claim's. A failure's retry delay follows the job's backoff, else the settings'."""
    if action == Action.COMPLETE:
        jobs = [o.job for o in outcomes]
        return dict.fromkeys(writes.complete(jobs, {o.job.id: o.result for o in outcomes}), "done")
    if action == Action.FAIL:
        default = conf.backoff()
        attempts = [
            FailedAttempt(
                o.job, o.failure or Failure.of(""), o.backoff or default, o.final, o.delay, o.jitter
            )
            for o in outcomes
        ]
        return writes.fail(attempts)
    if action == Action.SNOOZE:
        snoozed = writes.snooze([(o.job, o.delay or 0.0) for o in outcomes])
        return dict.fromkeys(snoozed, "queued")
    if action != Action.RELEASE:
        raise ValueError(f"no outcome {action!r}")
    released: set[int] = set()
    for outage in (False, True):
        jobs = [o.job for o in outcomes if o.outage == outage]
        if jobs:
            released |= writes.release(jobs, outage=outage)
    return dict.fromkeys(released, "queued")
