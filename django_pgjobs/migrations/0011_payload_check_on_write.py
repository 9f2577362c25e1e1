"""The payload check, only where a payload is written.

0006's ``CHECK (jsonb_typeof(payload) = 'object')`` ran on every UPDATE of a job, whatever it
changed: PostgreSQL checks each CHECK of a row it updates. ``jsonb_typeof`` needs the whole
value, so every claim, completion and heartbeat of a job whose payload is large enough to be
compressed or moved out of line (about 2 kB) decompressed it, for nothing: updates of rows
with 96 kB payloads took 59 us each with the CHECK and 10 with the trigger (``python -m
benchmarks.checks``).

The same rule is now a row trigger, ``AFTER INSERT OR UPDATE OF payload``, which fires only
for statements that write the payload. Its ``WHEN`` condition is evaluated like a CHECK, on
the row as written (after every BEFORE trigger), and the function behind it runs only for a
row it refuses. It raises ``check_violation`` naming ``pgjobs_job_payload_check``, as the
CHECK did. ``ENABLE ALWAYS`` keeps it on for sessions in ``session_replication_role =
replica`` (a CHECK is never skipped).

Online: the swap (drop any trigger an earlier run left, create it, enable it always, drop the
CHECK) is one query string, so one transaction, under lock_timeout: it takes ACCESS EXCLUSIVE on the table for a
catalog change and reads no row (every row passed the validated CHECK). Stopped anywhere, it
leaves the CHECK in place. Going back adds the CHECK NOT VALID, then validates it in a
statement of its own (SHARE UPDATE EXCLUSIVE, which blocks no writes; it reads every payload),
before the trigger goes. Otherwise non-atomic: each statement commits on its own.
"""

from django.db import migrations

FUNCTION = """
CREATE OR REPLACE FUNCTION pgjobs_job_refuse_payload() RETURNS trigger
LANGUAGE plpgsql AS $refuse$
BEGIN
  RAISE EXCEPTION USING
    ERRCODE = 'check_violation',
    CONSTRAINT = 'pgjobs_job_payload_check',
    SCHEMA = TG_TABLE_SCHEMA,
    TABLE = TG_TABLE_NAME,
    MESSAGE = 'new row for relation "' || TG_TABLE_NAME
      || '" violates check constraint "pgjobs_job_payload_check"',
    DETAIL = 'The payload is a JSON ' || jsonb_typeof(NEW.payload)
      || ', not an object: the function is called with it as keyword arguments.';
END
$refuse$
"""

# The swap, as one query string: PostgreSQL runs its statements as one implicit transaction,
# all or none (an explicit BEGIN would leave Django's connection in an aborted transaction
# when a statement fails).
SWAP = """
DROP TRIGGER IF EXISTS pgjobs_job_payload_check ON pgjobs_job;
CREATE TRIGGER pgjobs_job_payload_check
AFTER INSERT OR UPDATE OF payload ON pgjobs_job
FOR EACH ROW WHEN (jsonb_typeof(NEW.payload) <> 'object')
EXECUTE FUNCTION pgjobs_job_refuse_payload();
ALTER TABLE pgjobs_job ENABLE ALWAYS TRIGGER pgjobs_job_payload_check;
ALTER TABLE pgjobs_job DROP CONSTRAINT IF EXISTS pgjobs_job_payload_check
"""

FORWARD = [FUNCTION, "SET lock_timeout = '5s'", SWAP, "RESET lock_timeout"]

BACKWARD = [
    "SET lock_timeout = '5s'",
    """
ALTER TABLE pgjobs_job
  DROP CONSTRAINT IF EXISTS pgjobs_job_payload_check,
  ADD CONSTRAINT pgjobs_job_payload_check CHECK (jsonb_typeof(payload) = 'object') NOT VALID
""",
    "ALTER TABLE pgjobs_job VALIDATE CONSTRAINT pgjobs_job_payload_check",
    "DROP TRIGGER IF EXISTS pgjobs_job_payload_check ON pgjobs_job",
    "RESET lock_timeout",
    "DROP FUNCTION IF EXISTS pgjobs_job_refuse_payload()",
]


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("django_pgjobs", "0010_cheaper_queue_check")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunSQL(FORWARD, BACKWARD)],
            state_operations=[migrations.RemoveConstraint("job", "pgjobs_job_payload_check")],
        ),
    ]
