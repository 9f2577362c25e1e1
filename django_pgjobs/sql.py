"""Every statement django-pgjobs sends, each once, named for the verb it does.

Parameters are ``%(name)s``; nothing here is ever assembled with string formatting (the
statements are joined from literal fragments only), with one exception: the plain claims'
``LIMIT``, an integer written in by ``limited()``. Every write after the claim ends with
one shared fence (``_FENCE``): a worker can only change a job it still owns. Times are always
the database's ``now()``.

The batch forms (``unnest`` over parallel arrays, or one JSON array) serve one job as well as
many, so the manager's single-job methods and the worker's batched writes share one statement.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeAlias

import psycopg
from django.core.exceptions import ImproperlyConfigured
from psycopg.errors import (
    DuplicatePreparedStatement,
    InvalidSqlStatementName,
    ProtocolViolation,
)
from psycopg.pq import ExecStatus
from psycopg.sql import SQL, Composed, Identifier

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper
    from typing_extensions import LiteralString


# In autocommit the enqueue's own statement sends the NOTIFY (PGJOBS["NOTIFY"] "auto"):
# one statement and one commit, and PostgreSQL delivers it only once the row is committed.
# With a NULL channel the planner folds the condition away and nothing is sent. The
# subquery is an InitPlan, so it runs once per statement, not once per row.
_NOTIFY_HERE: LiteralString = """
WHERE %(notify_channel)s::text IS NULL
   OR (SELECT pg_notify(%(notify_channel)s, %(queue)s)) IS NOT NULL"""

# The columns every enqueue writes; a job without a key writes NULL for both unique ones, a
# job without a lock key NULL for lock_key.
_ENQUEUE_INTO: LiteralString = """
INSERT INTO pgjobs_job (queue, task, payload, priority, max_attempts, run_at, timeout,
                        lock_key, unique_key, unique_while)"""

# A unique key another job holds inserts nothing and returns no row: the partial unique index
# decides, never a read before the write, so it holds across processes and transactions (a
# holder not yet committed makes the INSERT wait for its outcome). The column and predicate
# name the index so PostgreSQL can infer it. The index holds only queued and running rows,
# so a finished row never keeps a key (not even one a worker from before unique keys
# completed without giving it up). Only the *_UNIQUE statements carry it: every
# row of an INSERT with ON CONFLICT takes the conflict-checked path, which costs a keyless
# row WAL and time for nothing.
_SKIP_HELD_KEY: LiteralString = """
ON CONFLICT (unique_key) WHERE unique_key IS NOT NULL AND status IN ('queued', 'running')
DO NOTHING"""

# One job: enqueue() is the hot path. A VALUES row costs the server less than a SELECT with
# the InitPlan above, so its NOTIFY rides in the RETURNING list instead (one row: one call;
# a NULL channel is folded away; no row, a key held elsewhere: no NOTIFY). The times come
# back as fixed-width ISO 8601 text in UTC (whatever the DateStyle or TimeZone): cheaper to
# read than timestamptz through Django's loader, and exact to the microsecond.
_ENQUEUE_ONE_ROW: LiteralString = """
VALUES (%(queue)s, %(task)s, %(payload)s::jsonb, %(priority)s, %(max_attempts)s,
        coalesce(%(run_at)s::timestamptz, now() + coalesce(%(delay)s::interval, interval '0')),
        %(timeout)s::interval, %(lock_key)s, %(unique_key)s, %(unique_while)s)"""
_ENQUEUE_ONE_RETURNING: LiteralString = """
RETURNING id,
  to_char(run_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"'),
  to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"'),
  CASE WHEN %(notify_channel)s::text IS NOT NULL THEN pg_notify(%(notify_channel)s, queue) END
"""

# One job without a unique key.
ENQUEUE_ONE: LiteralString = _ENQUEUE_INTO + _ENQUEUE_ONE_ROW + _ENQUEUE_ONE_RETURNING

# One job with a unique key: no row when another job holds it.
ENQUEUE_ONE_UNIQUE: LiteralString = (
    _ENQUEUE_INTO + _ENQUEUE_ONE_ROW + _SKIP_HELD_KEY + _ENQUEUE_ONE_RETURNING
)

# The columns of one row of a bulk INSERT, for the payload p at position n, with its lock key
# (NULL, an array of none, for a call without them); the unique key's two follow.
_ENQUEUE_MANY_ROW: LiteralString = """
SELECT %(queue)s, %(task)s, p, %(priority)s, %(max_attempts)s,
       coalesce(%(run_at)s::timestamptz, now() + coalesce(%(delay)s::interval, interval '0')),
       %(timeout)s::interval, (%(lock_keys)s::text[])[n]"""

# One INSERT for any number of jobs without keys. The payloads arrive as one JSON array (one
# parameter, parsed once by the server) rather than a jsonb[] whose every element the client
# escapes; ids come back in the payloads' order.
ENQUEUE: LiteralString = (
    _ENQUEUE_INTO
    + _ENQUEUE_MANY_ROW
    + """, NULL, NULL
FROM jsonb_array_elements(%(payloads)s::jsonb) WITH ORDINALITY AS t(p, n)"""
    + _NOTIFY_HERE
    + """
ORDER BY n
RETURNING id
"""
)

# One INSERT for jobs of which some have a unique key (NULL: none), zipped with the payloads
# by ROWS FROM, in the order sent. The caller sends each key once and the keyed rows sorted by
# key, so two calls with overlapping keys take them in one order and cannot deadlock; a row is
# skipped only for a key another job holds, and keyed rows are matched back by the key they
# return, keyless ones by their order. Its NOTIFY is an InitPlan over the rows inserted, so
# a call whose every key is held sends none.
ENQUEUE_UNIQUE: LiteralString = (
    """
WITH inserted AS ("""
    + _ENQUEUE_INTO
    + _ENQUEUE_MANY_ROW
    + """, k, CASE WHEN k IS NOT NULL THEN %(unique_while)s END
FROM ROWS FROM (jsonb_array_elements(%(payloads)s::jsonb), unnest(%(unique_keys)s::text[]))
     WITH ORDINALITY AS t(p, k, n)
ORDER BY n"""
    + _SKIP_HELD_KEY
    + """
RETURNING id, unique_key
)
SELECT id, unique_key FROM inserted
WHERE %(notify_channel)s::text IS NULL
   OR (SELECT pg_notify(%(notify_channel)s, %(queue)s) FROM inserted LIMIT 1) IS NOT NULL
"""
)

# The job that holds this unique key, its whole row (loaded as a Job): what enqueue() returns
# when its key was taken. No row: the holder left its window in between.
UNIQUE_HOLDER: LiteralString = """
SELECT * FROM pgjobs_job
WHERE unique_key = %(unique_key)s AND status IN ('queued', 'running')
"""

# The ids of the jobs that hold these unique keys: all enqueue_many() returns for them.
UNIQUE_HOLDER_IDS: LiteralString = """
SELECT unique_key, id FROM pgjobs_job
WHERE unique_key = ANY(%(unique_keys)s::text[]) AND status IN ('queued', 'running')
"""

# A hint, never the job: listeners re-run the claim. Sent after the enqueue's commit, once per
# queue, in one statement for every queue that has news. Its own transaction need not wait
# for the WAL flush (a crash drops every listener anyway), so it never adds an fsync.
NOTIFY: LiteralString = """
SELECT pg_notify(%(channel)s, q)
FROM unnest(%(queues)s::text[]) AS q, set_config('synchronous_commit', 'off', true)
"""

# The worker's own writes may commit without waiting for the WAL flush
# (PGJOBS["WORKER_SYNCHRONOUS_COMMIT"]). The setting is changed by a local set_config inside
# the statement itself, an InitPlan the planner runs once, so it lasts for this one
# transaction and never reaches another client of a transaction-mode pooler. NULL keeps the
# session's own setting. Appended to the WHERE of the claim and of each fenced write.
_COMMIT: LiteralString = """
  AND (SELECT set_config('synchronous_commit',
                         coalesce(%(synchronous_commit)s::text,
                                  current_setting('synchronous_commit')), true)) IS NOT NULL"""

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
    "UPDATE pgjobs_job j" + _CLAIM_SET + "now()" + _CLAIM_SET_REST + _COMMIT + _CLAIM_RETURNING
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

# The plain claims take nothing from a queue that is paused or has a limit: the uncorrelated
# NOT EXISTS is an InitPlan (one primary-key probe of pgjobs_queue per statement, a One-Time
# Filter); those jobs are CLAIM_GUARDED's.
_UNGUARDED: LiteralString = """
    AND NOT EXISTS (SELECT FROM pgjobs_queue q
                    WHERE q.name = %(queue)s
                      AND (q.paused OR q.concurrency IS NOT NULL OR q.rate_count IS NOT NULL))"""

# The hot path: one statement per batch. Lock the chosen rows in the CTE (SKIP LOCKED: never
# wait behind another worker), then update through it. Never `WHERE id = (SELECT ... LIMIT
# 1)`: without the lock two workers take the same row. The CTE form, not `IN (SELECT ... FOR
# UPDATE)`, which some plans let lock more rows than the LIMIT (PostgreSQL bug #15715). The
# ORDER BY matches the partial index pgjobs_job_ready_idx, so the plan is Limit -> LockRows
# -> Index Scan; the filters above are filters on that scan. It takes no job with a lock key
# (those are CLAIM_GUARDED's) and nothing from a paused or limited queue (_UNGUARDED).
_CLAIM_NEXT: LiteralString = (
    """next AS (
  SELECT id FROM pgjobs_job
  WHERE queue = %(queue)s AND status = 'queued' AND run_at <= now() AND lock_key IS NULL"""
    + _CLAIMABLE
    + _UNGUARDED
    + """
  ORDER BY priority DESC, run_at
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
  WHERE queue = %(queue)s AND status = 'queued' AND run_at <= now() AND lock_key IS NULL"""
    + _CLAIMABLE_TASKS
    + _UNGUARDED
    + """
  ORDER BY priority DESC, run_at
  LIMIT 1
  FOR UPDATE SKIP LOCKED
), rest AS MATERIALIZED (
  SELECT id FROM pgjobs_job
  WHERE queue = %(queue)s AND status = 'queued' AND run_at <= now() AND lock_key IS NULL
    AND crashes = 0"""
    + _CLAIMABLE_TASKS
    + _UNGUARDED
    + """
    AND NOT EXISTS (SELECT FROM head WHERE head.crashes > 0)
    AND id <> ALL (ARRAY(SELECT id FROM head))
  ORDER BY priority DESC, run_at
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
    (SELECT q.concurrency - (SELECT count(*) FROM pgjobs_job
                             WHERE queue = %(queue)s AND status = 'running') FROM q),
    (SELECT q.rate_count - (SELECT count(*) FROM unnest(q.starts) AS s
                            WHERE s > statement_timestamp() - q.rate_period) FROM q)
  ), 0) AS n
  WHERE NOT coalesce((SELECT paused FROM q), false)
), ready AS MATERIALIZED (
  (SELECT id, priority, run_at FROM pgjobs_job
   WHERE queue = %(queue)s AND status = 'queued' AND run_at <= now() AND lock_key IS NULL"""
    + _CLAIMABLE
    + """
   ORDER BY priority DESC, run_at
   LIMIT %(limit)s)
  UNION ALL
  (SELECT DISTINCT ON (lock_key) id, priority, run_at FROM pgjobs_job j
   WHERE queue = %(queue)s AND status = 'queued' AND run_at <= now() AND lock_key IS NOT NULL"""
    + _CLAIMABLE
    + """
     AND NOT EXISTS (SELECT FROM pgjobs_job r
                     WHERE r.lock_key = j.lock_key AND r.status = 'running')
   ORDER BY lock_key, priority DESC, run_at, id)
), next AS (
  SELECT id FROM pgjobs_job
  WHERE id IN (SELECT id FROM ready ORDER BY priority DESC, run_at, id
               LIMIT coalesce((SELECT n FROM room), 0))
    AND status = 'queued' AND run_at <= now()
  FOR UPDATE SKIP LOCKED
), claimed AS (
  UPDATE pgjobs_job j"""
    + _CLAIM_SET
    + "statement_timestamp()"
    + _CLAIM_SET_REST
    + _COMMIT
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

# The fence, the heart of the design: a write after the claim changes a row only while it is
# still this claim's, `running` with the attempt number and the claim time (attempted_at)
# the claim returned. Attempts alone could match a later claim (a release gives the attempt
# back, an operator's retry resets them); no two claims share a claim time. A NULL claim time
# (a caller who kept only the id and attempts) fences on the attempts alone. Every fenced
# statement joins its claims as `mine` (id, attempts, claimed_at, ...) and ends with this.
_FENCE: LiteralString = (
    """
WHERE j.id = mine.id AND j.status = 'running' AND j.attempts = mine.attempts
  AND (mine.claimed_at IS NULL OR j.attempted_at = mine.claimed_at)"""
    + _COMMIT
)

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
    + _FENCE
    + """
RETURNING j.id
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
SET status       = CASE WHEN j.attempts >= j.max_attempts OR mine.final
                        THEN 'failed' ELSE 'queued' END,
    run_at       = now() + coalesce(mine.delay * interval '1 second',
                                    least(mine.cap * interval '1 second',
                                          mine.base * interval '1 second'
                                          * 2 ^ least(j.attempts, 30)))
                         * CASE WHEN mine.jitter THEN 0.75 + 0.25 * random() ELSE 1 END,
    locked_until = NULL,
    last_error   = mine.error,
    errors       = j.errors || jsonb_build_array(jsonb_build_object(
                     'exception_class_path', mine.error_class, 'traceback', mine.error)),
    finished_at  = CASE WHEN j.attempts >= j.max_attempts OR mine.final THEN now() END,
    unique_key   = CASE WHEN j.attempts >= j.max_attempts OR mine.final THEN NULL
                        ELSE j.unique_key END,
    crashes      = 0
FROM unnest(%(ids)s::bigint[], %(attempts)s::int[], %(claimed_at)s::timestamptz[],
            %(errors)s::text[], %(error_classes)s::text[], %(bases)s::float8[],
            %(caps)s::float8[], %(finals)s::bool[], %(delays)s::float8[], %(jitters)s::bool[])
     AS mine(id, attempts, claimed_at, error, error_class, base, cap, final, delay, jitter)"""
    + _FENCE
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
FROM unnest(%(ids)s::bigint[], %(attempts)s::int[], %(claimed_at)s::timestamptz[],
            %(delays)s::float8[])
     AS mine(id, attempts, claimed_at, delay)"""
    + _FENCE
    + """
RETURNING j.id
"""
)

# The heartbeat. A row missing from RETURNING was taken from us: stop treating it as ours.
EXTEND_LEASE: LiteralString = (
    """
UPDATE pgjobs_job j
SET locked_until = now() + %(lease)s::interval
FROM unnest(%(ids)s::bigint[], %(attempts)s::int[], %(claimed_at)s::timestamptz[])
     AS mine(id, attempts, claimed_at)"""
    + _FENCE
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
FROM unnest(%(ids)s::bigint[], %(attempts)s::int[], %(claimed_at)s::timestamptz[])
     AS mine(id, attempts, claimed_at)"""
    + _FENCE
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
FROM unnest(%(ids)s::bigint[], %(attempts)s::int[], %(claimed_at)s::timestamptz[],
            %(outages)s::bool[])
     AS mine(id, attempts, claimed_at, outage)"""
    + _FENCE
    + """
RETURNING j.id
"""
)

# An operator's cancel: a waiting or running job ends `cancelled` and gives its unique key up.
# The UPDATE re-checks the status after taking each row's lock, so a cancel and a completion
# serialize and exactly one of them changes the row; a running job's worker is fenced out
# from then on. CANCEL takes only rows it can lock at once (SKIP LOCKED): it never waits while
# holding other rows, so the worker's batched writes of those rows never wait behind it.
# CANCEL_WAITING then takes the rows that were locked, one id per statement, waiting for the
# transaction that holds each (a worker's write of a few milliseconds, or a transaction-mode
# job's whole run).
_CANCEL_ROWS: LiteralString = """
WITH doomed AS (
  SELECT id, status FROM pgjobs_job
  WHERE id = ANY(%(ids)s::bigint[]) AND status IN ('queued', 'running')
  ORDER BY id
  FOR UPDATE"""
_CANCEL_SET: LiteralString = """
)
UPDATE pgjobs_job j
SET status = 'cancelled', locked_until = NULL, finished_at = now(), unique_key = NULL
FROM doomed
WHERE j.id = doomed.id AND j.status IN ('queued', 'running')
RETURNING j.id, j.task, j.queue, j.attempts, doomed.status
"""
CANCEL: LiteralString = _CANCEL_ROWS + " SKIP LOCKED" + _CANCEL_SET
CANCEL_WAITING: LiteralString = _CANCEL_ROWS + _CANCEL_SET

# The ids among these of jobs still waiting or running: after CANCEL, the ones it skipped
# because another transaction held them.
UNFINISHED: LiteralString = """
SELECT id FROM pgjobs_job
WHERE id = ANY(%(ids)s::bigint[]) AND status IN ('queued', 'running')
ORDER BY id
"""

# Which of a worker's refused claims were cancelled (rather than reaped): read only after a
# fenced write changed nothing, so the normal path never sends it. Matched on the claim (id,
# attempts, claim time), so a cancel of a later claim of the job is not taken for ours.
CANCELLED_AMONG: LiteralString = """
SELECT j.id
FROM pgjobs_job j
JOIN unnest(%(ids)s::bigint[], %(attempts)s::int[], %(claimed_at)s::timestamptz[])
     AS mine(id, attempts, claimed_at)
  ON j.id = mine.id AND j.status = 'cancelled' AND j.attempts = mine.attempts
     AND (mine.claimed_at IS NULL OR j.attempted_at = mine.claimed_at)
"""

# Expired leases back to queued (or failed once the attempts are used up: a job that kills
# every worker must not loop forever). The UPDATE re-checks status and lease itself, so a
# job completed since the CTE read it is never sent back; rows are taken in id order with
# SKIP LOCKED, so concurrent reapers neither deadlock nor requeue a job twice; the caller
# repeats the batch until it comes back short. Nothing is reaped in the first `settle` after
# the server started: when it comes back from an outage longer than the lease, every worker
# that held jobs through it must first write what it holds (its writes retry with a backoff
# shorter than the settle), or jobs that ran to the end would be failed as expired.
# An expired lease is a worker that died: it is counted in `crashes` (an attempt that ends
# otherwise resets it), and `max_crashes` of them in a row fail the job as WorkerCrashed
# (quarantine), so a job that kills its worker does not take one down per attempt left. A
# lease its worker ended on purpose (EXPIRE_LEASE: locked_until = attempted_at) is no crash.
REAP: LiteralString = """
WITH expired AS (
  SELECT id, locked_until IS DISTINCT FROM attempted_at AS crashed,
         locked_until IS DISTINCT FROM attempted_at AND crashes + 1 >= %(max_crashes)s
           AS quarantined,
         format('the worker died while running this job %%s times in a row (out of memory? '
                'os._exit()? a segfault in a C extension?)', crashes + 1) AS crash_error
  FROM pgjobs_job
  WHERE status = 'running' AND locked_until < now()
    AND pg_postmaster_start_time() < now() - %(settle)s::interval
  ORDER BY id
  LIMIT %(limit)s
  FOR UPDATE SKIP LOCKED
)
UPDATE pgjobs_job j
SET status       = CASE WHEN j.attempts >= j.max_attempts OR expired.quarantined
                        THEN 'failed' ELSE 'queued' END,
    locked_until = NULL,
    crashes      = j.crashes + expired.crashed::int,
    last_error   = CASE WHEN expired.quarantined THEN expired.crash_error
                        ELSE coalesce(j.last_error, 'lease expired') END,
    errors       = j.errors || jsonb_build_array(CASE WHEN expired.quarantined
                     THEN jsonb_build_object(
                       'exception_class_path', 'django_pgjobs.exceptions.WorkerCrashed',
                       'traceback', expired.crash_error)
                     ELSE jsonb_build_object(
                       'exception_class_path', 'django_pgjobs.exceptions.LeaseExpired',
                       'traceback', 'lease expired') END),
    finished_at  = CASE WHEN j.attempts >= j.max_attempts OR expired.quarantined THEN now() END,
    unique_key   = CASE WHEN j.attempts >= j.max_attempts OR expired.quarantined
                        THEN NULL ELSE j.unique_key END
FROM expired
WHERE j.id = expired.id AND j.status = 'running' AND j.locked_until < now()
RETURNING j.id, j.status, j.attempts
"""

# One batch of finished jobs, oldest first. Only 'done', 'failed' and 'cancelled' can match.
PRUNE: LiteralString = """
WITH doomed AS (
  SELECT id FROM pgjobs_job
  WHERE status = ANY(%(statuses)s::text[]) AND status IN ('done', 'failed', 'cancelled')
    AND coalesce(finished_at, created_at) < now() - %(older_than)s::interval
  ORDER BY id
  LIMIT %(limit)s
  FOR UPDATE SKIP LOCKED
)
DELETE FROM pgjobs_job j
USING doomed
WHERE j.id = doomed.id
"""

# The same batch moved, not copied: delete and insert are one statement, so a crash between
# them cannot lose a row or keep it twice.
PRUNE_ARCHIVE: LiteralString = """
WITH doomed AS (
  SELECT id FROM pgjobs_job
  WHERE status = ANY(%(statuses)s::text[]) AND status IN ('done', 'failed', 'cancelled')
    AND coalesce(finished_at, created_at) < now() - %(older_than)s::interval
  ORDER BY id
  LIMIT %(limit)s
  FOR UPDATE SKIP LOCKED
), moved AS (
  DELETE FROM pgjobs_job j
  USING doomed
  WHERE j.id = doomed.id
  RETURNING j.id, j.queue, j.task, j.payload, j.status, j.priority, j.run_at, j.attempts,
            j.max_attempts, j.locked_until, j.last_error, j.created_at, j.started_at,
            j.finished_at, j.attempted_at, j.result, j.errors, j.worker_ids, j.outage_releases,
            j.schedule, j.scheduled_at, j.unique_key, j.unique_while, j.snoozes, j.crashes,
            j.timeout, j.lock_key
)
INSERT INTO pgjobs_job_archive (id, queue, task, payload, status, priority, run_at, attempts,
                                max_attempts, locked_until, last_error, created_at,
                                started_at, finished_at, attempted_at, result, errors,
                                worker_ids, outage_releases, schedule, scheduled_at,
                                unique_key, unique_while, snoozes, crashes, timeout,
                                lock_key)
SELECT * FROM moved
"""

# -- periodic jobs (schedules.py). A tick becomes a job if and only if this statement moves
# the schedule's row forward to it: the upsert takes the row's lock, so schedulers of every
# worker serialize on it, and the one that comes second finds the tick already there (its
# WHERE is false: no row, so no job). The job's id is drawn only by the update that wins,
# and the job is inserted in the same statement, so a crash can leave neither a tick
# without its job nor a job without its tick; no leader, and no lock outlives the statement.
# A new row (or one a failed step made) is only set to the tick: a schedule's first job is
# its first tick after it was deployed, never the deploy. The tick only ever moves forward,
# whichever spec a worker runs: while old and new code run side by side (a rolling deploy),
# each version's later ticks are enqueued, and neither undoes the other's.
TICK: LiteralString = """
WITH tick AS (
  INSERT INTO pgjobs_schedule AS s (name, spec, last_tick, updated_at)
  VALUES (%(name)s, %(spec)s, %(tick)s, now())
  ON CONFLICT (name) DO UPDATE
  SET spec        = EXCLUDED.spec,
      last_tick   = EXCLUDED.last_tick,
      last_job_id = CASE WHEN s.spec IS NOT NULL
                         THEN nextval(pg_get_serial_sequence('pgjobs_job', 'id')) END,
      last_error  = NULL,
      failures    = 0,
      updated_at  = now()
  WHERE s.last_tick IS NULL OR s.last_tick < EXCLUDED.last_tick
  RETURNING s.last_job_id
)
INSERT INTO pgjobs_job (id, queue, task, payload, priority, max_attempts, run_at, schedule,
                        scheduled_at, timeout)
OVERRIDING SYSTEM VALUE
SELECT tick.last_job_id, %(queue)s, %(task)s, %(payload)s::jsonb, %(priority)s,
       %(max_attempts)s, now(), %(name)s, %(tick)s, %(timeout)s::interval
FROM tick
WHERE tick.last_job_id IS NOT NULL
RETURNING id,
  CASE WHEN %(notify_channel)s::text IS NOT NULL THEN pg_notify(%(notify_channel)s, queue) END
"""

# A scheduler step that failed: its error on the row (a new row gets no spec, so the first
# successful step only sets its tick). The next success clears it.
TICK_FAILED: LiteralString = """
INSERT INTO pgjobs_schedule AS s (name, last_error, failures, failed_at, updated_at)
VALUES (%(name)s, %(error)s, 1, now(), now())
ON CONFLICT (name) DO UPDATE
SET last_error = EXCLUDED.last_error, failures = s.failures + 1, failed_at = now(),
    updated_at = now()
"""

# The rows of the declared schedules (rows of removed schedules are never read), with the
# status of each last tick's job (NULL once it was pruned).
SCHEDULE_STATES: LiteralString = """
SELECT s.name, s.spec, s.last_tick, s.last_job_id, s.last_error, s.failures, s.failed_at,
       j.status
FROM pgjobs_schedule s
LEFT JOIN pgjobs_job j ON j.id = s.last_job_id
WHERE s.name = ANY(%(names)s::text[])
"""

# The database's clock, which decides the ticks.
NOW: LiteralString = "SELECT now()"


# -- the test clock (django_pgjobs.testing). Inside a test's transaction now() is frozen at
# the test's start; a worker's statements each run in a short transaction of their own, so
# for them now() is the wall clock. run_jobs() runs the same statements as the worker with
# the clock these give them: the time the test set (a transaction-local setting, gone with the
# test's rollback), or else the statement's own start, which moves as the wall clock does.
_TEST_CLOCK: LiteralString = """
coalesce(nullif(pg_catalog.current_setting('pgjobs.test_clock', true), '')::timestamptz,
         pg_catalog.statement_timestamp())"""

# The functions that stand in for pg_catalog's clocks while run_jobs() runs: in a schema of
# their own, put before pg_catalog in the transaction's search_path (TEST_CLOCK_ON), so the
# unchanged statement text calls them. Created inside the test's transaction, dropped again
# when run_jobs() returns (TEST_CLOCK_DROP), and rolled back with the test in any case.
TEST_CLOCK_CREATE: LiteralString = (
    """
CREATE SCHEMA IF NOT EXISTS pgjobs_test_clock;
CREATE OR REPLACE FUNCTION pgjobs_test_clock.now() RETURNS timestamptz
  LANGUAGE sql STABLE AS $$ SELECT"""
    + _TEST_CLOCK
    + """ $$;
CREATE OR REPLACE FUNCTION pgjobs_test_clock.statement_timestamp() RETURNS timestamptz
  LANGUAGE sql STABLE AS $$ SELECT"""
    + _TEST_CLOCK
    + """ $$;
CREATE OR REPLACE FUNCTION pgjobs_test_clock.transaction_timestamp() RETURNS timestamptz
  LANGUAGE sql STABLE AS $$ SELECT"""
    + _TEST_CLOCK
    + """ $$
"""
)

# Put the clock's schema first for the rest of the transaction; returns the path it replaced,
# which TEST_CLOCK_OFF puts back.
# Also returns lock_timeout, which the guarded claim's GUARD sets for the rest of the
# transaction: TEST_CLOCK_OFF puts both back, so run_jobs() leaves the test's settings as
# they were.
TEST_CLOCK_ON: LiteralString = """
SELECT current_setting('search_path'),
       set_config('search_path',
                  'pgjobs_test_clock, pg_catalog, ' || current_setting('search_path'), true),
       current_setting('lock_timeout')
"""

TEST_CLOCK_OFF: LiteralString = """
SELECT set_config('search_path', %(search_path)s, true),
       set_config('lock_timeout', %(lock_timeout)s, true)
"""

TEST_CLOCK_DROP: LiteralString = "DROP SCHEMA pgjobs_test_clock CASCADE"

# The test clock's time now.
TEST_CLOCK_NOW: LiteralString = "SELECT" + _TEST_CLOCK

# Set the test clock (NULL: back to the wall clock) or move it forward by an interval, until
# the test's transaction ends.
TEST_CLOCK_SET: LiteralString = """
SELECT set_config('pgjobs.test_clock', %(now)s::timestamptz::text, true)
"""

TEST_CLOCK_ADVANCE: LiteralString = (
    """
SELECT set_config('pgjobs.test_clock', ("""
    + _TEST_CLOCK
    + """ + %(by)s::interval)::text, true)
"""
)


# A Django connection, a psycopg connection, or the cursor a worker runs its statements on
# (connections.DirectConnections.cursor()).
Connection: TypeAlias = "BaseDatabaseWrapper | psycopg.Connection[Any] | psycopg.Cursor[Any]"


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


def run(
    connection: Connection, statement: LiteralString, params: Mapping[str, Any]
) -> list[tuple[Any, ...]]:
    """Execute one statement; return its rows (none for a statement without a result)."""
    if isinstance(connection, (psycopg.Connection, psycopg.Cursor)):
        try:
            result = connection.execute(statement, params)
        except (InvalidSqlStatementName, DuplicatePreparedStatement, ProtocolViolation) as exc:
            # The prepared statement is gone, or is another's ("bind message supplies N
            # parameters"): a transaction-mode pooler handed this client another session.
            if isinstance(exc, ProtocolViolation) and "bind message" not in str(exc):
                raise
            raise ImproperlyConfigured(
                f"Prepared statement error on the worker's connection ({exc}): the database "
                "is probably behind a transaction-mode pooler without prepared-statement "
                "support (PgBouncer before 1.21, or max_prepared_statements = 0). Set "
                "PGJOBS['PREPARE'] = False."
            ) from exc
        return result.fetchall() if _has_rows(result) else []
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        return cursor.fetchall() if _has_rows(cursor.cursor) else []


def _has_rows(cursor: psycopg.Cursor[Any]) -> bool:
    """Whether the statement returned rows (even none). Read from the result's status:
    ``cursor.description`` says the same but builds an object per column, a cost that showed
    in every enqueue."""
    result = cursor.pgresult
    return result is not None and result.status == ExecStatus.TUPLES_OK


def records(
    connection: BaseDatabaseWrapper, statement: LiteralString, params: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """Execute one query; return its rows as dicts keyed by column name."""
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        names = [column.name for column in cursor.description]
        return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def count(
    connection: BaseDatabaseWrapper, statement: LiteralString, params: Mapping[str, Any]
) -> int:
    """Execute one statement that returns no rows; return how many rows it changed."""
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        return int(cursor.rowcount)


class TextArray(str):
    """A ``text[]`` parameter written out once as PostgreSQL's array literal: a worker sends
    its registry's names with every claim, and psycopg would adapt a list of them element by
    element each time, in the producer's thread. Sent as text and cast (``::text[]``)."""

    __slots__ = ()

    @classmethod
    def of(cls, values: Iterable[str]) -> TextArray:
        quoted = ('"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for v in values)
        return cls("{" + ",".join(quoted) + "}")


def listen(channel: str) -> Composed:
    """``LISTEN "channel"``: a channel is an identifier, so it is quoted, not bound."""
    return SQL("LISTEN {}").format(Identifier(channel))


# An operator's retry of failed jobs: queued again at once with a fresh set of attempts (and
# of releases after outages).
# Only rows still failed change (a job retried twice, or running again, is left alone); the
# history (last_error, errors, worker_ids) is kept. It comes back holding no unique key: taking
# one back could meet another job holding it now (the index would refuse the whole retry).
RETRY: LiteralString = """
UPDATE pgjobs_job
SET status = 'queued', run_at = now(), attempts = 0, outage_releases = 0, crashes = 0,
    locked_until = NULL, finished_at = NULL, unique_key = NULL
WHERE id = ANY(%(ids)s::bigint[]) AND status = 'failed'
RETURNING id, queue
"""

# -- health and dashboard reads. Each reads one partial index (ready, lease, failed) or a
# range of the finished index, so their cost follows the live rows, not the done history.

# Per queue: ready and scheduled jobs, and the age of the oldest ready one (the lag).
QUEUE_DEPTH: LiteralString = """
SELECT queue,
       count(*) FILTER (WHERE run_at <= now()) AS ready,
       count(*) FILTER (WHERE run_at > now()) AS scheduled,
       coalesce(extract(epoch FROM now() - min(run_at) FILTER (WHERE run_at <= now())), 0)
         AS lag_seconds
FROM pgjobs_job
WHERE status = 'queued'
GROUP BY queue
"""

RUNNING_BY_QUEUE: LiteralString = """
SELECT queue, count(*) AS running, count(*) FILTER (WHERE locked_until < now()) AS expired
FROM pgjobs_job
WHERE status = 'running'
GROUP BY queue
"""

FAILED_BY_QUEUE: LiteralString = """
SELECT queue, count(*) AS failed
FROM pgjobs_job
WHERE status = 'failed'
GROUP BY queue
"""

# Jobs finished in each of the last %(minutes)s minutes (this one included), per queue and
# outcome; a minute with none comes back once, with a NULL queue. One short range scan of
# the finished index per minute.
THROUGHPUT: LiteralString = """
WITH minutes AS (
  SELECT generate_series(date_trunc('minute', now()) - (%(minutes)s - 1) * interval '1 minute',
                         date_trunc('minute', now()), interval '1 minute') AS minute
)
SELECT m.minute, j.queue,
       count(j.id) FILTER (WHERE j.status = 'done') AS done,
       count(j.id) FILTER (WHERE j.status = 'failed') AS failed
FROM minutes m
LEFT JOIN pgjobs_job j
  ON j.finished_at >= m.minute AND j.finished_at < m.minute + interval '1 minute'
GROUP BY 1, 2
ORDER BY 1, 2
"""

RECENT_FAILURES: LiteralString = """
SELECT id, task, queue, attempts, finished_at, last_error
FROM pgjobs_job
WHERE status = 'failed' AND finished_at IS NOT NULL
ORDER BY finished_at DESC
LIMIT %(limit)s
"""

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
OUTLOOK: LiteralString = """
SELECT
  (SELECT extract(epoch FROM min(run_at) - now())::float8 FROM pgjobs_job
   WHERE queue = ANY(%(queues)s::text[]) AND status = 'queued' AND run_at > now()) AS due,
  ARRAY(SELECT name FROM pgjobs_queue
        WHERE name = ANY(%(queues)s::text[])
          AND (concurrency IS NOT NULL OR rate_count IS NOT NULL)
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
                 WHERE queue = q.name AND status = 'queued' AND run_at <= now())) AS rate_free
"""

# Jobs that held a slot under their queue's concurrency limit, or a lock key, no longer run
# (their outcome was written, or they were cancelled): the next job of the queue may start
# now. The worker to claim it may be another one, waiting since its claim came back short (a
# worker's own finished jobs wake it, another's do not), which without word would wait for its
# next tick. Their queues that want word: not paused, with a ready job, and with room under
# the concurrency limit (counted as the guarded claim counts), or, without one, a lock key of
# these jobs that no running job took again. Grouped by queue first, so each queue's room is
# counted once. (The next job of a key in another queue still waits for that queue's workers'
# next claim: finding it would read every ready keyed job.)
FREED_QUEUES: LiteralString = """
SELECT f.queue
FROM (SELECT j.queue,
             bool_or(j.lock_key IS NOT NULL
                     AND NOT EXISTS (SELECT FROM pgjobs_job r
                                     WHERE r.lock_key = j.lock_key AND r.status = 'running'))
               AS key_free
      FROM pgjobs_job j WHERE j.id = ANY(%(ids)s::bigint[]) GROUP BY j.queue) AS f
LEFT JOIN pgjobs_queue q ON q.name = f.queue
WHERE NOT coalesce(q.paused, false)
  AND CASE WHEN q.concurrency IS NULL THEN f.key_free
           ELSE q.concurrency > (SELECT count(*) FROM pgjobs_job r
                                 WHERE r.queue = f.queue AND r.status = 'running') END
  AND EXISTS (SELECT FROM pgjobs_job r
              WHERE r.queue = f.queue AND r.status = 'queued' AND r.run_at <= now())"""

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

# -- queue control: an operator's pause and limits, one row per queue in pgjobs_queue. Each
# write that may let workers claim more sends the NOTIFY a new job would (it is delivered on
# commit), so waiting workers claim at once rather than at their next poll.

PAUSE: LiteralString = """
INSERT INTO pgjobs_queue AS q (name, paused) VALUES (%(queue)s, true)
ON CONFLICT (name) DO UPDATE SET paused = true, updated_at = now()
"""

RESUME: LiteralString = """
UPDATE pgjobs_queue SET paused = false, updated_at = now()
WHERE name = %(queue)s
RETURNING pg_notify(%(channel)s, name)
"""

# A limit left out (NULL) is no limit. A queue that loses its rate limit forgets its starts.
SET_LIMITS: LiteralString = """
INSERT INTO pgjobs_queue AS q (name, concurrency, rate_count, rate_period)
VALUES (%(queue)s, %(concurrency)s, %(rate_count)s, %(rate_period)s::interval)
ON CONFLICT (name) DO UPDATE
SET concurrency = EXCLUDED.concurrency, rate_count = EXCLUDED.rate_count,
    rate_period = EXCLUDED.rate_period,
    starts = CASE WHEN EXCLUDED.rate_count IS NULL THEN '{}' ELSE q.starts END,
    updated_at = now()
RETURNING pg_notify(%(channel)s, name)
"""

# -- the registry of live workers (pgjobs_worker). A worker writes its row at its start and on
# its ticks (an upsert: a row the reaper cleared while the worker was cut off comes back, and
# a new process that reuses an old one's host:pid, such as a container restarted in place,
# overwrites its row), and deletes it on a clean exit; the reaper deletes the rows past their
# expiry.

WORKER_BEAT: LiteralString = """
INSERT INTO pgjobs_worker AS w (id, host, pid, mode, queues, tasks, version, started_at,
                                heartbeat_at, expires_at)
VALUES (%(worker_id)s, %(host)s, %(pid)s, %(mode)s, %(queues)s::jsonb, %(tasks)s::text[],
        %(version)s, %(started_at)s, now(), now() + %(ttl)s::interval)
ON CONFLICT (id) DO UPDATE
SET host = EXCLUDED.host, pid = EXCLUDED.pid, mode = EXCLUDED.mode, queues = EXCLUDED.queues,
    tasks = EXCLUDED.tasks, version = EXCLUDED.version, started_at = EXCLUDED.started_at,
    heartbeat_at = now(), expires_at = EXCLUDED.expires_at
"""

WORKER_GONE: LiteralString = "DELETE FROM pgjobs_worker WHERE id = %(worker_id)s"

FORGET_WORKERS: LiteralString = """
DELETE FROM pgjobs_worker WHERE expires_at < now() RETURNING id
"""

LIVE_WORKERS: LiteralString = """
SELECT id, host, pid, mode, queues, tasks, version, started_at, heartbeat_at
FROM pgjobs_worker
WHERE expires_at >= now()
ORDER BY started_at, id
"""

# Ready jobs that no live worker can run, per queue and task: no live worker serves the queue
# (`served` false), or none that does has the task registered. A worker that claims any task
# (tasks NULL) can run them all. Grouped first, so the workers are checked once per queue and
# task, not once per ready job (a backlog of 200,000 with 50 live workers: 1.2 s the other way).
UNRUNNABLE: LiteralString = """
WITH ready AS (
  SELECT queue, task, count(*) AS ready FROM pgjobs_job
  WHERE status = 'queued' AND run_at <= now()
  GROUP BY queue, task
)
SELECT r.queue, r.task, r.ready,
       EXISTS (SELECT FROM pgjobs_worker w
               WHERE w.expires_at >= now() AND w.queues ? r.queue) AS served
FROM ready r
WHERE NOT EXISTS (SELECT FROM pgjobs_worker w
                  WHERE w.expires_at >= now() AND w.queues ? r.queue
                    AND (w.tasks IS NULL OR r.task = ANY(w.tasks)))
ORDER BY r.queue, r.task
"""

# -- why isn't this job running? (explain.py). One statement reads everything the explanation
# needs, in one snapshot, so its reasons cannot contradict each other: the job, its queue's
# row, and what the claim would check about it. Each part reads a partial index or a primary
# key (the queue's running jobs, the running holder of its lock key, the ready jobs ahead of
# it in the claim's order, the live workers), and runs only for the status it concerns:
# PostgreSQL evaluates the subquery of a CASE branch only when the branch is taken.
# Each condition is the claim's own (sql.CLAIM, sql.CLAIM_GUARDED): the queue's running jobs
# against `concurrency`, its starts after statement_timestamp() - rate_period against
# `rate_count` (room when the earliest leaves the window), a running job holding the key,
# the first ready job of the key in the claim's order (a claim starts one per key). The
# count of jobs ahead is bounded by `ahead_limit` in each of its two parts: higher priority,
# then the same priority and an earlier run_at, each a range of the ready index.
EXPLAIN_JOB: LiteralString = """
WITH j AS (
  SELECT id, queue, task, status, priority, run_at, attempts, max_attempts, last_error,
         lock_key, crashes, locked_until, attempted_at, finished_at,
         worker_ids ->> -1 AS worker_id, run_at <= now() AS due
  FROM pgjobs_job WHERE id = %(id)s
)
SELECT j.id, j.queue, j.task, j.status, j.priority, j.run_at, j.attempts, j.max_attempts,
       j.last_error, j.lock_key, j.crashes, j.locked_until, j.attempted_at, j.finished_at,
       j.worker_id, j.due, now() AS now,
       coalesce(q.paused, false) AS paused, q.concurrency, q.rate_count,
       extract(epoch FROM q.rate_period)::float8 AS rate_period,
       CASE WHEN j.status = 'queued' AND q.concurrency IS NOT NULL THEN
         (SELECT count(*) FROM pgjobs_job r WHERE r.queue = j.queue AND r.status = 'running')
       END AS running,
       window_.started AS rate_started, window_.first + q.rate_period AS rate_free,
       CASE WHEN j.status = 'queued' AND j.lock_key IS NOT NULL THEN
         (SELECT r.id FROM pgjobs_job r
          WHERE r.lock_key = j.lock_key AND r.status = 'running'
          ORDER BY r.id LIMIT 1)
       END AS key_holder,
       CASE WHEN j.status = 'queued' AND j.due AND j.lock_key IS NOT NULL THEN
         (SELECT k.id FROM pgjobs_job k
          WHERE k.queue = j.queue AND k.status = 'queued' AND k.run_at <= now()
            AND k.lock_key = j.lock_key
          ORDER BY k.priority DESC, k.run_at, k.id LIMIT 1)
       END AS key_first,
       CASE WHEN j.status = 'queued' AND j.due THEN
         (SELECT count(*) FROM (SELECT FROM pgjobs_job a
                                WHERE a.queue = j.queue AND a.status = 'queued'
                                  AND a.priority > j.priority AND a.run_at <= now()
                                LIMIT %(ahead_limit)s) AS higher)
         + (SELECT count(*) FROM (SELECT FROM pgjobs_job a
                                  WHERE a.queue = j.queue AND a.status = 'queued'
                                    AND a.priority = j.priority AND a.run_at < j.run_at
                                  LIMIT %(ahead_limit)s) AS older)
       END AS ahead,
       fleet.live, fleet.serving, fleet.knowing, fleet.leasing,
       runner.host AS runner_host, runner.pid AS runner_pid,
       runner.heartbeat_at AS runner_beat, runner.expires_at >= now() AS runner_live
FROM j
LEFT JOIN pgjobs_queue q ON q.name = j.queue
LEFT JOIN LATERAL (
  SELECT count(*) AS started, min(s) AS first
  FROM unnest(q.starts) AS s
  WHERE s > statement_timestamp() - q.rate_period
) AS window_ ON j.status = 'queued' AND q.rate_count IS NOT NULL
LEFT JOIN LATERAL (
  SELECT count(*) AS live,
         count(*) FILTER (WHERE w.queues ? j.queue) AS serving,
         count(*) FILTER (WHERE w.queues ? j.queue
                            AND (w.tasks IS NULL OR j.task = ANY(w.tasks))) AS knowing,
         count(*) FILTER (WHERE w.queues ? j.queue AND w.mode = 'lease'
                            AND (w.tasks IS NULL OR j.task = ANY(w.tasks))) AS leasing
  FROM pgjobs_worker w
  WHERE w.expires_at >= now()
) AS fleet ON j.status = 'queued'
LEFT JOIN pgjobs_worker runner ON runner.id = j.worker_id AND j.status = 'running'
"""

# The planner's row estimate (refreshed by ANALYZE/autovacuum): counting millions of done
# rows for an admin page would read the whole table.
ESTIMATED_ROWS: LiteralString = "SELECT reltuples FROM pg_class WHERE oid = 'pgjobs_job'::regclass"

# Whether this server cannot take writes now: a standby (after a failover the old primary's
# address may lead to one), or a session forced read-only.
READ_ONLY: LiteralString = (
    "SELECT pg_is_in_recovery() OR current_setting('transaction_read_only')::bool"
)

# The LISTEN connection's health probe: the cheapest statement that needs a live server.
PROBE: LiteralString = "SELECT 1"


# -- the doctor's reads of PostgreSQL's own statistics and catalogs. Ages are float8 seconds:
# extract() gives numeric, which `jobsdoctor --json` would print as a string. Ages in
# transactions (`age(xid)`) are integers.

EXPIRED_LEASES: LiteralString = """
SELECT id, task, queue, attempts,
       extract(epoch FROM now() - locked_until)::float8 AS expired_for
FROM pgjobs_job
WHERE status = 'running' AND locked_until < now()
ORDER BY locked_until
LIMIT %(limit)s
"""

FAILURES_SINCE: LiteralString = """
SELECT count(*) FROM pgjobs_job
WHERE status = 'failed' AND finished_at >= now() - %(window)s::interval
"""

# Jobs failed within the window because their workers kept dying (quarantined by the reap),
# told apart from other failures by the class of their latest error. `total` counts them all,
# the LIMIT aside (a window is computed before the LIMIT applies).
QUARANTINED: LiteralString = """
SELECT id, task, queue, attempts, crashes, finished_at, count(*) OVER () AS total
FROM pgjobs_job
WHERE status = 'failed' AND finished_at >= now() - %(window)s::interval
  AND errors -> -1 ->> 'exception_class_path' = 'django_pgjobs.exceptions.WorkerCrashed'
ORDER BY finished_at DESC
LIMIT %(limit)s
"""

# Live jobs whose latest attempt ended with its worker dead: each runs alone when next claimed.
# Two equalities, not IN: a BitmapOr over the partial indexes of queued and running jobs.
SUSPECTS: LiteralString = """
SELECT count(*) FROM pgjobs_job
WHERE (status = 'queued' OR status = 'running') AND crashes > 0
"""

# The table's vacuum statistics and the numbers autovacuum decides with: it vacuums once
# n_dead_tup exceeds threshold + scale_factor * reltuples (reltuples < 0, never counted, as 0;
# PostgreSQL 18 caps that at max_threshold), each taken from the table's own storage options
# when set there, else from the server's settings. `unvacuumed_for` counts from the last
# vacuum of either kind, or from the server's start for a table never vacuumed: autovacuum
# cannot have been failing before the server ran.
TABLE_HEALTH: LiteralString = """
SELECT s.n_live_tup, s.n_dead_tup, s.last_autovacuum, s.last_vacuum, s.autovacuum_count,
       c.reloptions, c.reltuples::float8 AS reltuples,
       o.enabled AS autovacuum_enabled,
       coalesce(o.threshold, current_setting('autovacuum_vacuum_threshold')::float8)
           AS vacuum_base_threshold,
       coalesce(o.scale_factor, current_setting('autovacuum_vacuum_scale_factor')::float8)
           AS vacuum_scale_factor,
       coalesce(o.max_threshold,
                current_setting('autovacuum_vacuum_max_threshold', true)::float8)
           AS vacuum_max_threshold,
       extract(epoch FROM now() - coalesce(greatest(s.last_autovacuum, s.last_vacuum),
                                           pg_postmaster_start_time()))::float8
           AS unvacuumed_for,
       EXISTS (SELECT FROM pg_stat_progress_vacuum p WHERE p.relid = c.oid) AS vacuum_running
FROM pg_class c
LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
CROSS JOIN LATERAL (
    SELECT bool_and(option_value::bool) FILTER (WHERE option_name = 'autovacuum_enabled')
               AS enabled,
           max(option_value::float8) FILTER (WHERE option_name = 'autovacuum_vacuum_threshold')
               AS threshold,
           max(option_value::float8)
               FILTER (WHERE option_name = 'autovacuum_vacuum_scale_factor') AS scale_factor,
           max(option_value::float8)
               FILTER (WHERE option_name = 'autovacuum_vacuum_max_threshold') AS max_threshold
    FROM pg_options_to_table(c.reloptions)
) o
WHERE c.oid = 'pgjobs_job'::regclass
"""

# The server settings autovacuum depends on, as this session sees them (track_counts can be
# set per database: sessions that do not count leave autovacuum nothing to act on).
VACUUM_SETTINGS: LiteralString = """
SELECT current_setting('autovacuum')::bool AS autovacuum,
       current_setting('track_counts')::bool AS track_counts,
       extract(epoch FROM current_setting('autovacuum_naptime')::interval)::float8
           AS autovacuum_naptime
"""

# Sessions of this database (vacuum of an ordinary table only waits for those) that sit in an
# open transaction doing nothing, longest first. Only those with a snapshot or a transaction
# id hold VACUUM back; the others still hold their locks and a connection.
IDLE_IN_TRANSACTION: LiteralString = """
SELECT pid, usename, application_name,
       extract(epoch FROM now() - state_change)::float8 AS idle_for,
       extract(epoch FROM now() - xact_start)::float8 AS open_for, left(query, 200) AS query,
       backend_xmin IS NOT NULL OR backend_xid IS NOT NULL AS holds_horizon
FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid()
  AND state IN ('idle in transaction', 'idle in transaction (aborted)')
  AND now() - state_change > %(threshold)s::interval
ORDER BY state_change
"""

# The oldest transaction that holds VACUUM back: one with a snapshot (backend_xmin), or one
# that has written (backend_xid: between statements a READ COMMITTED writer has no snapshot,
# but its own transaction id still keeps the horizon).
OLDEST_TRANSACTION: LiteralString = """
SELECT pid, usename, application_name, state,
       extract(epoch FROM now() - xact_start)::float8 AS age,
       greatest(age(backend_xmin), age(backend_xid)) AS xmin_age,
       left(query, 200) AS query
FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid()
  AND xact_start IS NOT NULL AND (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL)
  AND backend_type = 'client backend'
ORDER BY xact_start
LIMIT 1
"""

# Prepared transactions (two-phase commit) of this database: each keeps its transaction id,
# and so the horizon, until someone runs COMMIT PREPARED or ROLLBACK PREPARED, whatever
# happened to the session or the coordinator that prepared it.
PREPARED_TRANSACTIONS: LiteralString = """
SELECT gid, owner, prepared,
       extract(epoch FROM now() - prepared)::float8 AS age,
       age(transaction) AS xmin_age
FROM pg_prepared_xacts
WHERE database = current_database()
ORDER BY prepared
"""

# Replication slots that keep a horizon. `xmin` (a physical slot fed by a standby's
# hot_standby_feedback) holds back every table of every database, and stays when the standby
# goes away; `catalog_xmin` (a logical slot) holds back only the system catalogs. A slot has
# no start time: its age is in transactions. The walsender, when one is connected, says who.
REPLICATION_SLOTS: LiteralString = """
SELECT s.slot_name, s.slot_type, s.database, s.active, s.active_pid,
       age(s.xmin) AS xmin_age, age(s.catalog_xmin) AS catalog_xmin_age,
       r.application_name, r.client_addr::text AS client_addr
FROM pg_replication_slots s
LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid
WHERE s.xmin IS NOT NULL OR s.catalog_xmin IS NOT NULL
ORDER BY greatest(age(s.xmin), age(s.catalog_xmin)) DESC, s.slot_name
"""

# Sessions holding a lock on the table that autovacuum's SHARE UPDATE EXCLUSIVE conflicts
# with (a CREATE INDEX, even CONCURRENTLY, a VALIDATE CONSTRAINT, a LOCK TABLE): autovacuum
# skips a table it cannot lock at once, so while one is held the table is never vacuumed.
# Autovacuum's own lock is not one of them.
VACUUM_LOCKS: LiteralString = """
SELECT a.pid, a.usename, a.application_name, a.state, l.mode,
       extract(epoch FROM now() - coalesce(a.xact_start, a.query_start))::float8 AS held_for,
       left(a.query, 200) AS query
FROM pg_locks l
JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'relation' AND l.relation = 'pgjobs_job'::regclass AND l.granted
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND l.mode IN ('ShareUpdateExclusiveLock', 'ShareLock', 'ShareRowExclusiveLock',
                 'ExclusiveLock', 'AccessExclusiveLock')
  AND a.backend_type <> 'autovacuum worker' AND a.pid <> pg_backend_pid()
ORDER BY a.xact_start NULLS LAST, a.pid
"""

# What holds payloads to JSON objects: 'CHECK' while the table has 0006's constraint (before
# migration 0011), else the trigger's pg_trigger.tgenabled ('A' always, 'O' origin and local
# sessions, 'R' replica sessions only, 'D' disabled), NULL when neither is there.
PAYLOAD_RULE: LiteralString = """
SELECT coalesce(
  (SELECT 'CHECK' FROM pg_constraint
   WHERE conrelid = 'pgjobs_job'::regclass AND conname = 'pgjobs_job_payload_check'),
  (SELECT tgenabled::text FROM pg_trigger
   WHERE tgrelid = 'pgjobs_job'::regclass AND tgname = 'pgjobs_job_payload_check'))
"""

INVALID_INDEXES: LiteralString = """
SELECT i.indexrelid::regclass::text
FROM pg_index i
WHERE i.indrelid = 'pgjobs_job'::regclass AND NOT i.indisvalid
ORDER BY 1
"""
