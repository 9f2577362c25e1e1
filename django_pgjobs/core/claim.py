"""The claim: the plain one (one statement), the idle worker's, the guarded one (limits and lock
keys, after a fleet-wide advisory lock), and the outlook a worker takes after a short claim.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from datetime import timezone as dt_timezone
from typing import TYPE_CHECKING, Any

import psycopg
from django.db import OperationalError, transaction
from psycopg.errors import LockNotAvailable as PsycopgLockNotAvailable

from django_pgjobs.core.fragments import (
    CLAIM_ORDER,
    COMMIT,
    KEY_HOLDERS,
    LIMITED,
    RATE_WINDOW,
    READY,
    UNGUARDED,
    running_in,
)

if TYPE_CHECKING:
    from typing_extensions import LiteralString
from django_pgjobs.core.execute import Connection, TextArray, run
from django_pgjobs.core.finish import COMPLETE, _completions, _refused
from django_pgjobs.core.types import Claim, ClaimedJob, fences

logger = logging.getLogger("django_pgjobs.managers")


# What every claim sets on the rows it takes (the claim time, attempted_at, between the two
# parts), and returns of them. A job unique only while queued gives its key up as it starts,
# so the next enqueue of the key goes in.
_CLAIM_SET: LiteralString = """
SET status       = 'running',
    attempts     = j.attempts + 1,
    locked_until = now() + %(lease)s::interval,
    started_at   = coalesce(j.started_at, now()),
    attempted_at = """


_CLAIM_SET_REST: LiteralString = """,
    worker_ids   = j.worker_ids || to_jsonb(%(worker_id)s::text),
    unique_key   = CASE WHEN j.unique_while = 'active' THEN j.unique_key END
FROM next
WHERE j.id = next.id"""


_CLAIM_RETURNING: LiteralString = """
RETURNING j.id, j.queue, j.task, j.payload::text, j.attempts, j.max_attempts, j.attempted_at,
          j.outage_releases, j.schedule, j.scheduled_at, j.crashes,
          extract(epoch FROM j.timeout)::float8"""


# The plain claims' UPDATE through their `next`, stamped with the transaction's time.
_CLAIM_UPDATE_NOW: LiteralString = (
    "UPDATE pgjobs_job j" + _CLAIM_SET + "now()" + _CLAIM_SET_REST + COMMIT + _CLAIM_RETURNING
)


# Which ready jobs a claim may take besides the queue and the time: a busy worker passes
# `suspects` false (a job whose last attempt ended with its worker dead runs only on an idle
# one, alone); `tasks` is the worker's registry (NULL: any task), so during a rolling deploy
# an old worker leaves a new task's jobs queued for the new workers. The names are read in an
# InitPlan: the planner then does not estimate the selectivity of every name against the
# column's statistics whenever it plans a claim.
_CLAIMABLE_TASKS: LiteralString = """
    AND task = ANY(coalesce((SELECT %(tasks)s::text[]), ARRAY[task]))"""


_CLAIMABLE: LiteralString = (
    """
    AND (crashes = 0 OR %(suspects)s::bool)"""
    + _CLAIMABLE_TASKS
)


# The hot path: one statement per batch. Lock the chosen rows in the CTE (SKIP LOCKED: never
# wait behind another worker), then update through it. Never `WHERE id = (SELECT ... LIMIT
# 1)`: without the lock two workers take the same row. The CTE form, not `IN (SELECT ... FOR
# UPDATE)`, which some plans let lock more rows than the LIMIT (PostgreSQL bug #15715). The
# ORDER BY matches the partial index pgjobs_job_ready_idx, so the plan is Limit -> LockRows
# -> Index Scan; the filters above are filters on that scan. It takes no job with a lock key
# (those are CLAIM_GUARDED's) and nothing from a paused or limited queue (UNGUARDED).
_CLAIM_NEXT: LiteralString = (
    """next AS (
  SELECT id FROM pgjobs_job
  WHERE queue = %(queue)s AND """
    + READY
    + " AND lock_key IS NULL"
    + _CLAIMABLE
    + UNGUARDED
    + """
  ORDER BY """
    + CLAIM_ORDER
    + """
  LIMIT %(limit)s
  FOR UPDATE SKIP LOCKED
)"""
)


CLAIM: LiteralString = "\nWITH " + _CLAIM_NEXT + "\n" + _CLAIM_UPDATE_NOW


# An idle worker's claim (worker/lease.py): the first ready job may be a suspect, which then
# runs alone; otherwise the rest of the batch, without suspects, comes in the same statement.
# Each part is its own Limit -> LockRows -> Index Scan on pgjobs_job_ready_idx, as CLAIM's;
# `rest` skips the row `head` locked (this transaction's own lock would not make SKIP LOCKED
# pass it over), and when `head` took a suspect a One-Time Filter keeps `rest` from scanning
# at all, so it locks no row it would not take.
CLAIM_IDLE: LiteralString = (
    """
WITH head AS MATERIALIZED (
  SELECT id, crashes FROM pgjobs_job
  WHERE queue = %(queue)s AND """
    + READY
    + " AND lock_key IS NULL"
    + _CLAIMABLE_TASKS
    + UNGUARDED
    + """
  ORDER BY """
    + CLAIM_ORDER
    + """
  LIMIT 1
  FOR UPDATE SKIP LOCKED
), rest AS MATERIALIZED (
  SELECT id FROM pgjobs_job
  WHERE queue = %(queue)s AND """
    + READY
    + """ AND lock_key IS NULL
    AND crashes = 0"""
    + _CLAIMABLE_TASKS
    + UNGUARDED
    + """
    AND NOT EXISTS (SELECT FROM head WHERE head.crashes > 0)
    AND id <> ALL (ARRAY(SELECT id FROM head))
  ORDER BY """
    + CLAIM_ORDER
    + """
  LIMIT %(limit)s - 1
  FOR UPDATE SKIP LOCKED
), next AS MATERIALIZED (
  SELECT id FROM head UNION ALL SELECT id FROM rest
)
"""
    + _CLAIM_UPDATE_NOW
)


# The guarded claims of the whole fleet take turns: the claim of a queue with a limit, or of
# jobs with lock keys, runs in a READ COMMITTED transaction that first takes this lock (held
# until that transaction commits, a few milliseconds), then claims in a statement of its own,
# whose snapshot therefore sees every guarded claim committed before it. Counting in the
# claim statement itself would not do: its snapshot is taken before it could wait for the
# lock. The number is the lock's name, arbitrary and fixed. The transaction's lock_timeout
# (set first, in the FROM) bounds every wait in it, this lock's and the queue row's that the
# claim stamps (an operator's open transaction may hold it): the claim then gives up, takes
# nothing, and the worker claims again later, instead of every guarded claim of the fleet
# queueing behind one stuck session.
GUARD: LiteralString = """
SELECT pg_advisory_xact_lock(5047114946260779307)
FROM (SELECT set_config('lock_timeout', %(lock_timeout)s, true)) AS bounded"""


# The claim of a queue with a limit (or with jobs that carry a lock key), after GUARD. `room`
# is how many it may start: its batch, less the queue's running jobs under `concurrency`,
# less its starts within the last `rate_period` under `rate_count` (LEAST ignores the NULL of
# a limit not set); none while paused. Ready jobs come in two parts, each on its own partial
# index: those without a key, and, of those with one, the first of each key that no running
# job holds (DISTINCT ON). They are computed once (MATERIALIZED: the LIMIT below must not be
# re-run per row), then locked by id, their status and time checked again (a row cancelled
# since this snapshot is skipped). Its starts are stamped with
# statement_timestamp(), which moves forward from one guarded claim to the next, as the
# claims do; the queue keeps the newest rate_count of them within the window.
CLAIM_GUARDED: LiteralString = (
    """
WITH q AS (
  SELECT paused, concurrency, rate_count, rate_period, starts
  FROM pgjobs_queue WHERE name = %(queue)s
), room AS (
  SELECT greatest(least(
    %(limit)s,
    (SELECT q.concurrency - """
    + running_in("%(queue)s")
    + """ FROM q),
    (SELECT q.rate_count - (SELECT count(*) """
    + RATE_WINDOW
    + """) FROM q)
  ), 0) AS n
  WHERE NOT coalesce((SELECT paused FROM q), false)
), ready AS MATERIALIZED (
  (SELECT id, priority, run_at FROM pgjobs_job
   WHERE queue = %(queue)s AND """
    + READY
    + " AND lock_key IS NULL"
    + _CLAIMABLE
    + """
   ORDER BY """
    + CLAIM_ORDER
    + """
   LIMIT %(limit)s)
  UNION ALL
  (SELECT DISTINCT ON (lock_key) id, priority, run_at FROM pgjobs_job j
   WHERE queue = %(queue)s AND """
    + READY
    + " AND lock_key IS NOT NULL"
    + _CLAIMABLE
    + """
     AND NOT EXISTS (SELECT """
    + KEY_HOLDERS
    + """)
   ORDER BY lock_key, """
    + CLAIM_ORDER
    + """, id)
), next AS (
  SELECT id FROM pgjobs_job
  WHERE id IN (SELECT id FROM ready ORDER BY """
    + CLAIM_ORDER
    + """, id
               LIMIT coalesce((SELECT n FROM room), 0))
    AND """
    + READY
    + """
  FOR UPDATE SKIP LOCKED
), claimed AS (
  UPDATE pgjobs_job j"""
    + _CLAIM_SET
    + "statement_timestamp()"
    + _CLAIM_SET_REST
    + COMMIT
    + _CLAIM_RETURNING
    + """
), stamped AS (
  UPDATE pgjobs_queue
  SET starts = ARRAY(
    SELECT s FROM unnest(starts || array_fill(statement_timestamp(),
                                              ARRAY[(SELECT count(*) FROM claimed)::int])) AS s
    WHERE s > statement_timestamp() - rate_period
    ORDER BY s DESC
    LIMIT rate_count)
  WHERE name = %(queue)s AND rate_count IS NOT NULL AND EXISTS (SELECT FROM claimed)
)
SELECT * FROM claimed
"""
)


# A busy worker's completions ride with its next claim (worker/lease.py): COMPLETE as a
# data-modifying CTE of CLAIM, one statement and one commit where there were two, a tenth to a
# fifth less server CPU per job (docs/internals/performance.md). Both parts see the statement's one
# snapshot, and the rows `done` writes are `running` there, never the claim's `queued`: the two
# touch no row in common. So only the plain claim takes completions along; a guarded claim
# counts the running jobs of its queue, and would count the ones finished here. Every claimed
# row carries the ids `done` changed (NULL when none); with nothing claimed, one row of NULLs
# carries them.
CLAIM_COMPLETING: LiteralString = (
    "\nWITH done AS ("
    + COMPLETE
    + "),\n"
    + _CLAIM_NEXT
    + ",\nclaimed AS (\n"
    + _CLAIM_UPDATE_NOW
    + """
)
SELECT claimed.*, finished.ids
FROM (SELECT array_agg(id) AS ids FROM done) finished LEFT JOIN claimed ON true
"""
)


# The claim sizes limited() writes in: up to WRITTEN_LIMITS for CLAIM and CLAIM_IDLE, up to
# COMPLETING_LIMITS for CLAIM_COMPLETING (PGJOBS["COMPLETE_WITH_CLAIM"] only). The producer's
# claims of all sizes then stay, beside its other statements, within the 100 prepared
# statements psycopg keeps per connection (``prepared_max``): past it, psycopg would drop and
# prepare them again in turn, and no statement would live long enough for its generic plan.
WRITTEN_LIMITS = 32


COMPLETING_LIMITS = 16


def limited(statement: LiteralString, limit: int) -> LiteralString:
    """``statement`` (``CLAIM``, ``CLAIM_IDLE`` or ``CLAIM_COMPLETING``) with its ``LIMIT
    %(limit)s`` written in as the number ``limit``, so that PostgreSQL plans a worker's claims
    once per batch size instead of once per claim.

    A prepared statement gets a custom plan for each execution until its generic plan
    (planned without the parameters' values) looks as cheap. A bound LIMIT makes the generic
    plan guess that a tenth of the table is claimed (a hash join over a sequential scan), so
    that never happened: every claim was planned afresh (a claim and its complete cost the
    server about a fifth less CPU without it: docs/internals/performance.md). With
    the number in the text the generic plan is the custom one, and PostgreSQL keeps it from
    the sixth claim of each size on (psycopg prepares one statement per size). A claim of
    more than ``WRITTEN_LIMITS`` (``COMPLETING_LIMITS``) jobs keeps its bound LIMIT, planned
    afresh each time. The number is an ``int``: nothing but digits is ever written in.
    """
    # Checked before the cache, which would take True for 1 (equal, and of equal hash).
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise ValueError(f"a claim's limit must be a positive integer, not {limit!r}")
    return _written_in(statement, limit)


@functools.cache
def _written_in(statement: LiteralString, limit: int) -> LiteralString:
    if statement.count("LIMIT %(limit)s") != 1:
        raise ValueError("limited() writes in the one LIMIT %(limit)s of a claim statement")
    if limit > (COMPLETING_LIMITS if statement == CLAIM_COMPLETING else WRITTEN_LIMITS):
        return statement
    return statement.replace("%(limit)s", str(limit))


# A worker's look at its queues after a claim that came back short (instead of waiting for
# a NOTIFY that may never come): when the earliest deferred job comes due (deferred jobs and
# retries send none then); which queues claim through CLAIM_GUARDED (a limit set, or ready
# jobs with a lock key: each an index probe); and, for a rate-limited queue with ready jobs
# whose window was full when the short claim ran (`since` seconds ago), when the earliest start
# of that window leaves it, so that the queue's next claim can succeed. Judged as the claim saw
# it: a start may have left in between, and then the answer is a moment already past (claim
# now), where the window as it is now, no longer full, would give none, and the worker would
# sleep until its next tick with ready jobs queued. A window that was not full did not cut the
# claim: no wake-up for it.
OUTLOOK: LiteralString = (
    """
SELECT
  (SELECT extract(epoch FROM min(run_at) - now())::float8 FROM pgjobs_job
   WHERE queue = ANY(%(queues)s::text[]) AND status = 'queued' AND run_at > now()) AS due,
  ARRAY(SELECT q.name FROM pgjobs_queue q
        WHERE q.name = ANY(%(queues)s::text[])
          AND """
    + LIMITED
    + """
        UNION
        SELECT q FROM unnest(%(queues)s::text[]) AS q
        WHERE EXISTS (SELECT FROM pgjobs_job
                      WHERE queue = q AND status = 'queued' AND lock_key IS NOT NULL)) AS guarded,
  (SELECT extract(epoch FROM min(w.first + q.rate_period - statement_timestamp()))::float8
   FROM pgjobs_queue q,
        LATERAL (SELECT min(s) AS first, count(*) AS n FROM unnest(q.starts) AS s
                 WHERE s > statement_timestamp() - %(since)s * interval '1 second'
                                                 - q.rate_period) AS w
   WHERE q.name = ANY(%(queues)s::text[]) AND w.n >= q.rate_count AND NOT q.paused
     AND EXISTS (SELECT FROM pgjobs_job
                 WHERE queue = q.name AND """
    + READY
    + """)) AS rate_free
"""
)


# How long a guarded claim waits for a lock (the guard, or a queue row it stamps) before it
# gives up and takes nothing this time.
GUARD_TIMEOUT = "5s"


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
    connection: Connection,
    *,
    queue: str,
    limit: int,
    lease: timedelta,
    worker_id: str,
    synchronous_commit: str | None,
    suspects: bool = True,
    tasks: TextArray | None = None,
    guarded: bool = False,
    idle: bool = False,
) -> list[ClaimedJob]:
    """Claim up to ``limit`` ready jobs; without ``suspects``, only jobs whose last attempt
    did not end with its worker dead (``crashes`` = 0); with ``tasks``, only jobs of those
    tasks. ``idle`` (an idle worker's plain claim, ``CLAIM_IDLE``): the first job may be
    a suspect, and is then the only one; the others may not.

    The plain claim (one statement) takes nothing from a paused or limited queue and no job
    with a lock key. ``guarded`` claims those, within the queue's limits and one job per free
    lock key: in a transaction of its own after ``GUARD`` (a lock every guarded claim of
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
                run(connection, GUARD, {"lock_timeout": GUARD_TIMEOUT})
                rows = run(connection, CLAIM_GUARDED, params)
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
    statement = limited(CLAIM_IDLE if idle else CLAIM, limit)
    return _claimed(run(connection, statement, params))


def claim_completing(
    connection: Connection,
    *,
    queue: str,
    limit: int,
    lease: timedelta,
    worker_id: str,
    synchronous_commit: str | None,
    tasks: TextArray | None,
    jobs: Iterable[Claim],
    results: Mapping[int, Any],
) -> tuple[list[ClaimedJob], set[int]]:
    """A busy worker's plain claim (no suspects) that completes ``jobs`` in the same
    statement (``CLAIM_COMPLETING``): the jobs claimed, and the ids of those completed.
    Each completion is fenced as ``complete()``'s, and one the fence refused is logged the
    same way; the statement is one transaction, so a failure writes neither part."""
    claims = fences(jobs)
    params = _claim_params(queue, limit, lease, worker_id, synchronous_commit, False, tasks)
    params["claims"] = _completions(claims, results)
    rows = run(connection, limited(CLAIM_COMPLETING, limit), params)
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
    tasks: TextArray | None,
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
    """The jobs of a claim's rows (``_CLAIM_RETURNING``'s columns), ``guarded`` if the
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


@dataclass(frozen=True)
class Outlook:
    """What a worker learns of its queues after a short claim (``OUTLOOK``)."""

    # Seconds until the earliest deferred job comes due, if any.
    due: float | None
    # The queues to claim through the guarded claim (a limit, or jobs with lock keys).
    guarded: frozenset[str]
    # Seconds until a rate window that was full at the short claim has room (0: it has now),
    # for a queue with ready jobs, if any.
    rate_free: float | None


def outlook(connection: Connection, queues: Sequence[str], since: float = 0.0) -> Outlook:
    """When to look again, and which of ``queues`` need the guarded claim; ``since``: the
    seconds since the claim that came back short was sent."""
    params = {"queues": list(queues), "since": since}
    due, guarded, rate_free = run(connection, OUTLOOK, params)[0]
    return Outlook(
        None if due is None else max(0.0, float(due)),
        frozenset(guarded),
        None if rate_free is None else max(0.0, float(rate_free)),
    )
