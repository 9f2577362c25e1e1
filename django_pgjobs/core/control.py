"""An operator's verbs: cancel, retry, pause, resume and the queue limits."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import LiteralString


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
