"""Housekeeping: the reap of expired leases, pruning and archiving finished jobs, and the
registry of live workers.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import TYPE_CHECKING

from django_pgjobs.core.fragments import failed_for_good

if TYPE_CHECKING:
    from typing_extensions import LiteralString
from django_pgjobs.core.execute import Connection, run
from django_pgjobs.core.types import Reaped

logger = logging.getLogger("django_pgjobs.managers")


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
REAP: LiteralString = (
    """
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
SET """
    + failed_for_good("expired.quarantined")
    + """,
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
                       'traceback', 'lease expired') END)
FROM expired
WHERE j.id = expired.id AND j.status = 'running' AND j.locked_until < now()
RETURNING j.id, j.status, j.attempts
"""
)


# One batch of finished jobs, oldest first, locked. Only 'done', 'failed' and 'cancelled' can
# match.
_DOOMED: LiteralString = """
WITH doomed AS (
  SELECT id FROM pgjobs_job
  WHERE status = ANY(%(statuses)s::text[]) AND status IN ('done', 'failed', 'cancelled')
    AND coalesce(finished_at, created_at) < now() - %(older_than)s::interval
  ORDER BY id
  LIMIT %(limit)s
  FOR UPDATE SKIP LOCKED
)"""

PRUNE: LiteralString = (
    _DOOMED
    + """
DELETE FROM pgjobs_job j
USING doomed
WHERE j.id = doomed.id
"""
)


# The same batch moved, not copied: delete and insert are one statement, so a crash between
# them cannot lose a row or keep it twice.
PRUNE_ARCHIVE: LiteralString = (
    _DOOMED
    + """, moved AS (
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
)


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


REAP_BATCH = 1000


# Nothing is reaped this long after the server started (REAP): longer than the slowest
# reconnect of a worker's writer (worker.db.Backoff's ceiling, 30 s), twice over.
REAP_SETTLE = timedelta(seconds=60)


def reap(
    connection: Connection,
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
        rows = [Reaped(*row) for row in run(connection, REAP, params)]
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
    for (worker_id,) in run(connection, FORGET_WORKERS, {}):
        logger.warning(
            "worker %s stopped heartbeating: its registry row is cleared",
            worker_id,
            extra={"action": "reap", "worker_id": worker_id},
        )
    return reaped
