"""CHECK constraints that hold plain-SQL rows to what enqueue() accepts, and outage_releases.

The constraints: the payload is a JSON object (a string there once crashed every worker that
claimed it), the queue name is what the Python validation accepts, max_attempts is 1 or more,
attempts is from 0 to max_attempts, and a queued job has an attempt left (the claim adds one,
and must not step outside the previous constraint). ``outage_releases`` counts how often a job
was given back because the queue's own database was away, so the worker can cap it.

Safe on a live, large table, and safe to run again after it stopped half-way:

1. A read-only check of the queue names, before anything changes. A bad name cannot be
   repaired without guessing what the user meant, so the migration stops and says what to run.
2. One ALTER TABLE drops any constraint an earlier, interrupted run left, adds each one
   NOT VALID and adds the column. It needs the ACCESS EXCLUSIVE lock only for a catalog change
   (no row is read, the column's constant default is not written into rows), and lock_timeout
   makes it give up after 5 s instead of queueing every worker behind a long transaction.
   From then on every INSERT and UPDATE is checked.
3. One UPDATE repairs the rows that break a constraint, and only those (its WHERE). A NOT
   VALID constraint still checks every update of an old row, so a bad row left as it is would
   make the next claim or reap of it raise. The UPDATE locks the bad rows only, under the
   table lock every write takes (which blocks no other write); lock_timeout also bounds its
   wait for a row that a transaction-mode worker holds. Every column is computed from the
   row's own values, so a row a worker changes meanwhile is repaired from its latest version.
4. VALIDATE CONSTRAINT reads the table under SHARE UPDATE EXCLUSIVE, which blocks no reads or
   writes. The migration is non-atomic: each statement commits on its own, so no lock is held
   from one step into the next.
5. The archive gets the column in a statement of its own (one table's lock at a time).
"""

import django
from django.db import migrations, models

# Stop before changing anything if a queue name breaks the constraint: the bad names (the
# first 20, with their job counts) and the statements that fix them go into the error. A bad
# name written between this check and the ADD below makes the VALIDATE fail instead; running
# the migration again then names it here.
CHECK_QUEUES = r"""
DO $check$
DECLARE
  names text;
  how_many bigint;
BEGIN
  SELECT string_agg('  ' || quote_literal(left(queue, 120))
                      || CASE WHEN char_length(queue) > 120 THEN '...' ELSE '' END
                      || ' (' || jobs || CASE WHEN jobs = 1 THEN ' job)' ELSE ' jobs)' END,
                    E'\n' ORDER BY queue),
         max(bad_names)
    INTO names, how_many
  FROM (
    SELECT queue, count(*) AS jobs, count(*) OVER () AS bad_names
    FROM pgjobs_job
    WHERE queue !~ '^[A-Za-z0-9_.:-]{1,100}$'
    GROUP BY queue
    ORDER BY queue
    LIMIT 20
  ) bad;
  IF names IS NOT NULL THEN
    RAISE EXCEPTION USING
      ERRCODE = 'check_violation',
      MESSAGE = 'django_pgjobs 0006 stopped before changing anything: pgjobs_job has jobs in '
        || how_many || ' queue(s) whose name is not 1-100 letters, digits, ''_'', ''-'', '
        || '''.'' or '':'', which the new constraint pgjobs_job_queue_check refuses:'
        || E'\n' || names
        || CASE WHEN how_many > 20 THEN E'\n  ...' ELSE '' END
        || E'\nRename each to a valid name, for example:'
        || E'\n  UPDATE pgjobs_job SET queue = ''new-name'' WHERE queue = ''old name'';'
        || E'\nor move them all to one queue:'
        || E'\n  UPDATE pgjobs_job SET queue = ''default'' '
        || 'WHERE queue !~ ''^[A-Za-z0-9_.:-]{1,100}$'';'
        || E'\nthen run migrate again.';
  END IF;
END
$check$
"""

ADD = """
ALTER TABLE pgjobs_job
  DROP CONSTRAINT IF EXISTS pgjobs_job_payload_check,
  DROP CONSTRAINT IF EXISTS pgjobs_job_queue_check,
  DROP CONSTRAINT IF EXISTS pgjobs_job_max_attempts_check,
  DROP CONSTRAINT IF EXISTS pgjobs_job_attempts_check,
  DROP CONSTRAINT IF EXISTS pgjobs_job_queued_attempts_check,
  ADD CONSTRAINT pgjobs_job_payload_check
    CHECK (jsonb_typeof(payload) = 'object') NOT VALID,
  ADD CONSTRAINT pgjobs_job_queue_check
    CHECK (queue ~ '^[A-Za-z0-9_.:-]{1,100}$') NOT VALID,
  ADD CONSTRAINT pgjobs_job_max_attempts_check
    CHECK (max_attempts >= 1) NOT VALID,
  ADD CONSTRAINT pgjobs_job_attempts_check
    CHECK (attempts >= 0 AND attempts <= max_attempts) NOT VALID,
  ADD CONSTRAINT pgjobs_job_queued_attempts_check
    CHECK (NOT (status = 'queued') OR attempts < max_attempts) NOT VALID,
  ADD COLUMN IF NOT EXISTS outage_releases int NOT NULL DEFAULT 0
"""

# Every repair keeps what the row held:
# - a payload that is not an object is wrapped as {"invalid_payload": <the old value>}; a job
#   still to run (queued or running) is failed with an InvalidPayload error saying what was
#   found, as the worker fails such a row;
# - attempts below 0 become 0; max_attempts rises to cover the attempts already made (and is
#   at least 1), and for a queued job to one more than those: the claim before this migration
#   would have run it once more, and still does.
REPAIR = """
UPDATE pgjobs_job
SET payload      = CASE WHEN jsonb_typeof(payload) = 'object' THEN payload
                        ELSE jsonb_build_object('invalid_payload', payload) END,
    status       = CASE WHEN jsonb_typeof(payload) <> 'object'
                             AND status IN ('queued', 'running') THEN 'failed'
                        ELSE status END,
    locked_until = CASE WHEN jsonb_typeof(payload) <> 'object'
                             AND status IN ('queued', 'running') THEN NULL
                        ELSE locked_until END,
    finished_at  = CASE WHEN jsonb_typeof(payload) <> 'object'
                             AND status IN ('queued', 'running') THEN now()
                        ELSE finished_at END,
    last_error   = CASE WHEN jsonb_typeof(payload) <> 'object'
                             AND status IN ('queued', 'running')
                        THEN 'InvalidPayload: the payload was '
                             || CASE jsonb_typeof(payload) WHEN 'null' THEN 'JSON null'
                                     ELSE 'a JSON ' || jsonb_typeof(payload) END
                             || ', not an object; the original is kept under invalid_payload'
                        ELSE last_error END,
    errors       = CASE WHEN jsonb_typeof(payload) <> 'object'
                             AND status IN ('queued', 'running')
                        THEN errors || jsonb_build_array(jsonb_build_object(
                               'exception_class_path', 'django_pgjobs.exceptions.InvalidPayload',
                               'traceback', 'InvalidPayload: the payload was '
                                 || CASE jsonb_typeof(payload) WHEN 'null' THEN 'JSON null'
                                         ELSE 'a JSON ' || jsonb_typeof(payload) END
                                 || ', not an object; the original is kept under '
                                 || 'invalid_payload'))
                        ELSE errors END,
    attempts     = greatest(attempts, 0),
    max_attempts = greatest(max_attempts, attempts, 1,
                            CASE WHEN status = 'queued' AND jsonb_typeof(payload) = 'object'
                                 THEN least(greatest(attempts, 0)::bigint + 1, 2147483647)::int
                            END)
WHERE jsonb_typeof(payload) <> 'object'
   OR max_attempts < 1
   OR attempts < 0
   OR attempts > max_attempts
   OR (status = 'queued' AND attempts >= max_attempts)
"""

FORWARD = [
    CHECK_QUEUES,
    "SET lock_timeout = '5s'",
    ADD,
    REPAIR,
    "ALTER TABLE pgjobs_job VALIDATE CONSTRAINT pgjobs_job_payload_check",
    "ALTER TABLE pgjobs_job VALIDATE CONSTRAINT pgjobs_job_queue_check",
    "ALTER TABLE pgjobs_job VALIDATE CONSTRAINT pgjobs_job_max_attempts_check",
    "ALTER TABLE pgjobs_job VALIDATE CONSTRAINT pgjobs_job_attempts_check",
    "ALTER TABLE pgjobs_job VALIDATE CONSTRAINT pgjobs_job_queued_attempts_check",
    "ALTER TABLE pgjobs_job_archive ADD COLUMN IF NOT EXISTS outage_releases int NOT NULL DEFAULT 0",
    "RESET lock_timeout",
]

# The repairs stay: each repaired row is a valid job under the old schema too.
BACKWARD = [
    "SET lock_timeout = '5s'",
    "ALTER TABLE pgjobs_job_archive DROP COLUMN IF EXISTS outage_releases",
    """
ALTER TABLE pgjobs_job
  DROP CONSTRAINT IF EXISTS pgjobs_job_payload_check,
  DROP CONSTRAINT IF EXISTS pgjobs_job_queue_check,
  DROP CONSTRAINT IF EXISTS pgjobs_job_max_attempts_check,
  DROP CONSTRAINT IF EXISTS pgjobs_job_attempts_check,
  DROP CONSTRAINT IF EXISTS pgjobs_job_queued_attempts_check,
  DROP COLUMN IF EXISTS outage_releases
""",
    "RESET lock_timeout",
]


def check(condition: models.Q, name: str) -> models.CheckConstraint:
    if django.VERSION >= (5, 1):
        return models.CheckConstraint(condition=condition, name=name)
    return models.CheckConstraint(check=condition, name=name)


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("django_pgjobs", "0005_admin_proxies")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunSQL(FORWARD, BACKWARD)],
            state_operations=[
                migrations.AddField("job", "outage_releases", models.IntegerField(default=0)),
                migrations.AddField(
                    "archivedjob", "outage_releases", models.IntegerField(default=0)
                ),
                migrations.AddConstraint(
                    "job",
                    check(
                        models.Q(
                            models.lookups.Exact(
                                models.Func(
                                    "payload",
                                    function="jsonb_typeof",
                                    output_field=models.TextField(),
                                ),
                                models.Value("object"),
                            )
                        ),
                        "pgjobs_job_payload_check",
                    ),
                ),
                migrations.AddConstraint(
                    "job",
                    check(
                        models.Q(queue__regex="^[A-Za-z0-9_.:-]{1,100}$"),
                        "pgjobs_job_queue_check",
                    ),
                ),
                migrations.AddConstraint(
                    "job", check(models.Q(max_attempts__gte=1), "pgjobs_job_max_attempts_check")
                ),
                migrations.AddConstraint(
                    "job",
                    check(
                        models.Q(attempts__gte=0, attempts__lte=models.F("max_attempts")),
                        "pgjobs_job_attempts_check",
                    ),
                ),
                migrations.AddConstraint(
                    "job",
                    check(
                        ~models.Q(status="queued")
                        | models.Q(attempts__lt=models.F("max_attempts")),
                        "pgjobs_job_queued_attempts_check",
                    ),
                ),
            ],
        ),
    ]
