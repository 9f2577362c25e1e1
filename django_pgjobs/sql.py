"""Every statement django-pgjobs sends, each once, named for the verb it does.

Parameters are ``%(name)s``; nothing here is ever assembled with string formatting (the
statements are joined from literal fragments only). Every write after the claim ends with
one shared fence (``_FENCE``): a worker can only change a job it still owns. Times are always
the database's ``now()``.

The batch forms (``unnest`` over parallel arrays, or one JSON array) serve one job as well as
many, so the manager's single-job methods and the worker's batched writes share one statement.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeAlias

import psycopg
from django.core.exceptions import ImproperlyConfigured
from psycopg.errors import (
    DuplicatePreparedStatement,
    InvalidSqlStatementName,
    ProtocolViolation,
)
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

# One job: enqueue() is the hot path. A VALUES row costs the server less than a SELECT with
# the InitPlan above, so its NOTIFY rides in the RETURNING list instead (one row: one call;
# a NULL channel is folded away). The times come back as fixed-width ISO 8601 text in UTC
# (whatever the DateStyle or TimeZone): cheaper to read than timestamptz through Django's
# loader, and exact to the microsecond.
ENQUEUE_ONE: LiteralString = """
INSERT INTO pgjobs_job (queue, task, payload, priority, max_attempts, run_at)
VALUES (%(queue)s, %(task)s, %(payload)s::jsonb, %(priority)s, %(max_attempts)s,
        coalesce(%(run_at)s::timestamptz, now() + coalesce(%(delay)s::interval, interval '0')))
RETURNING id,
  to_char(run_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"'),
  to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"'),
  CASE WHEN %(notify_channel)s::text IS NOT NULL THEN pg_notify(%(notify_channel)s, queue) END
"""

# One INSERT for any number of jobs. The payloads arrive as one JSON array (one parameter,
# parsed once by the server) rather than a jsonb[] whose every element the client escapes;
# ids come back in the payloads' order.
ENQUEUE: LiteralString = (
    """
INSERT INTO pgjobs_job (queue, task, payload, priority, max_attempts, run_at)
SELECT %(queue)s, %(task)s, p, %(priority)s, %(max_attempts)s,
       coalesce(%(run_at)s::timestamptz, now() + coalesce(%(delay)s::interval, interval '0'))
FROM jsonb_array_elements(%(payloads)s::jsonb) WITH ORDINALITY AS t(p, n)
"""
    + _NOTIFY_HERE
    + """
ORDER BY n
RETURNING id
"""
)

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

# Lock the chosen rows in the CTE (SKIP LOCKED: never wait behind another worker), then
# update through it. Never `WHERE id = (SELECT ... LIMIT 1)`: without the lock two workers
# take the same row. The CTE form, not `IN (SELECT ... FOR UPDATE)`, which some plans let
# lock more rows than the LIMIT (PostgreSQL bug #15715). The ORDER BY matches the partial
# index pgjobs_job_ready_idx, so the plan is Limit -> LockRows -> Index Scan.
CLAIM: LiteralString = (
    """
WITH next AS (
  SELECT id FROM pgjobs_job
  WHERE queue = %(queue)s AND status = 'queued' AND run_at <= now()
  ORDER BY priority DESC, run_at
  LIMIT %(limit)s
  FOR UPDATE SKIP LOCKED
)
UPDATE pgjobs_job j
SET status       = 'running',
    attempts     = j.attempts + 1,
    locked_until = now() + %(lease)s::interval,
    started_at   = coalesce(j.started_at, now()),
    attempted_at = now(),
    worker_ids   = j.worker_ids || to_jsonb(%(worker_id)s::text)
FROM next
WHERE j.id = next.id"""
    + _COMMIT
    + """
RETURNING j.id, j.queue, j.task, j.payload::text, j.attempts, j.max_attempts, j.attempted_at,
          j.outage_releases, j.schedule, j.scheduled_at
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
# arrays that psycopg dumps element by element in Python.
COMPLETE: LiteralString = (
    """
UPDATE pgjobs_job j
SET status = 'done', locked_until = NULL, finished_at = now(), result = mine.result
FROM jsonb_to_recordset(%(claims)s::jsonb)
     AS mine(id bigint, attempts int, claimed_at timestamptz, result jsonb)"""
    + _FENCE
    + """
RETURNING j.id
"""
)

# Back to queued after base * 2^attempts seconds (20 s, 40 s, 80 s, 160 s with base 10 s),
# at most `cap` seconds (an hour by default), or failed for good once the attempts are used
# up, or at once when the failure is `final` (a payload that can never run). The exponent is
# capped so a huge max_attempts cannot overflow the interval (the checks keep base * 2^30
# within range). Every failed attempt is kept in `errors` (class path and traceback:
# django.tasks' TaskError), the latest in last_error.
FAIL: LiteralString = (
    """
UPDATE pgjobs_job j
SET status       = CASE WHEN j.attempts >= j.max_attempts OR mine.final
                        THEN 'failed' ELSE 'queued' END,
    run_at       = now() + least(mine.cap * interval '1 second',
                                 mine.base * interval '1 second' * 2 ^ least(j.attempts, 30)),
    locked_until = NULL,
    last_error   = mine.error,
    errors       = j.errors || jsonb_build_array(jsonb_build_object(
                     'exception_class_path', mine.error_class, 'traceback', mine.error)),
    finished_at  = CASE WHEN j.attempts >= j.max_attempts OR mine.final THEN now() END
FROM unnest(%(ids)s::bigint[], %(attempts)s::int[], %(claimed_at)s::timestamptz[],
            %(errors)s::text[], %(error_classes)s::text[], %(bases)s::float8[],
            %(caps)s::float8[], %(finals)s::bool[])
     AS mine(id, attempts, claimed_at, error, error_class, base, cap, final)"""
    + _FENCE
    + """
RETURNING j.id, j.status, j.run_at
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

# A worker that must exit at once (a second Ctrl-C) ends the leases of the jobs it holds, so
# the next reap requeues them instead of waiting out the lease. Each keeps its attempt: the
# job may have run part way, as after a crash.
EXPIRE_LEASE: LiteralString = (
    """
UPDATE pgjobs_job j
SET locked_until = now()
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

# Expired leases back to queued (or failed once the attempts are used up: a job that kills
# every worker must not loop forever). The UPDATE re-checks status and lease itself, so a
# job completed since the CTE read it is never sent back; rows are taken in id order with
# SKIP LOCKED, so concurrent reapers neither deadlock nor requeue a job twice; the caller
# repeats the batch until it comes back short. Nothing is reaped in the first `settle` after
# the server started: when it comes back from an outage longer than the lease, every worker
# that held jobs through it must first write what it holds (its writes retry with a backoff
# shorter than the settle), or jobs that ran to the end would be failed as expired.
REAP: LiteralString = """
WITH expired AS (
  SELECT id FROM pgjobs_job
  WHERE status = 'running' AND locked_until < now()
    AND pg_postmaster_start_time() < now() - %(settle)s::interval
  ORDER BY id
  LIMIT %(limit)s
  FOR UPDATE SKIP LOCKED
)
UPDATE pgjobs_job j
SET status       = CASE WHEN j.attempts >= j.max_attempts THEN 'failed' ELSE 'queued' END,
    locked_until = NULL,
    last_error   = coalesce(j.last_error, 'lease expired'),
    errors       = j.errors || jsonb_build_array(jsonb_build_object(
                     'exception_class_path', 'django_pgjobs.exceptions.LeaseExpired',
                     'traceback', 'lease expired')),
    finished_at  = CASE WHEN j.attempts >= j.max_attempts THEN now() END
FROM expired
WHERE j.id = expired.id AND j.status = 'running' AND j.locked_until < now()
RETURNING j.id, j.status, j.attempts
"""

# One batch of finished jobs, oldest first. Only 'done' and 'failed' can match.
PRUNE: LiteralString = """
WITH doomed AS (
  SELECT id FROM pgjobs_job
  WHERE status = ANY(%(statuses)s::text[]) AND status IN ('done', 'failed')
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
  WHERE status = ANY(%(statuses)s::text[]) AND status IN ('done', 'failed')
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
            j.schedule, j.scheduled_at
)
INSERT INTO pgjobs_job_archive (id, queue, task, payload, status, priority, run_at, attempts,
                                max_attempts, locked_until, last_error, created_at,
                                started_at, finished_at, attempted_at, result, errors,
                                worker_ids, outage_releases, schedule, scheduled_at)
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
                        scheduled_at)
OVERRIDING SYSTEM VALUE
SELECT tick.last_job_id, %(queue)s, %(task)s, %(payload)s::jsonb, %(priority)s,
       %(max_attempts)s, now(), %(name)s, %(tick)s
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


# A Django connection, or one of a worker's own psycopg connections (worker.db.Direct).
Connection: TypeAlias = "BaseDatabaseWrapper | psycopg.Connection[Any]"


def run(
    connection: Connection, statement: LiteralString, params: Mapping[str, Any]
) -> list[tuple[Any, ...]]:
    """Execute one statement; return its rows (none for a statement without a result)."""
    if isinstance(connection, psycopg.Connection):
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
        return result.fetchall() if result.description else []
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        return list(cursor.fetchall()) if cursor.description else []


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


def listen(channel: str) -> Composed:
    """``LISTEN "channel"``: a channel is an identifier, so it is quoted, not bound."""
    return SQL("LISTEN {}").format(Identifier(channel))


# An operator's retry of failed jobs: queued again at once with a fresh set of attempts (and
# of releases after outages).
# Only rows still failed change (a job retried twice, or running again, is left alone); the
# history (last_error, errors, worker_ids) is kept.
RETRY: LiteralString = """
UPDATE pgjobs_job
SET status = 'queued', run_at = now(), attempts = 0, outage_releases = 0, locked_until = NULL,
    finished_at = NULL
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

# When the earliest deferred job (or retry) of these queues comes due: they send no NOTIFY
# then, so an idle worker sleeps until this. Rows already due are someone else's (locked).
NEXT_DUE: LiteralString = """
SELECT extract(epoch FROM min(run_at) - now())
FROM pgjobs_job
WHERE queue = ANY(%(queues)s::text[]) AND status = 'queued' AND run_at > now()
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

INVALID_INDEXES: LiteralString = """
SELECT i.indexrelid::regclass::text
FROM pg_index i
WHERE i.indrelid = 'pgjobs_job'::regclass AND NOT i.indisvalid
ORDER BY 1
"""
