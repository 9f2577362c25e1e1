"""The enqueue statements and what they need: one job or many, with or without a unique key,
carrying their own ``pg_notify`` when they run in autocommit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
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
