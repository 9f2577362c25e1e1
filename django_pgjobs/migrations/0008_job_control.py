"""Job control: the ``cancelled`` status, unique keys, snoozes, timeouts and worker crashes.

- ``status`` may be ``cancelled``, a new terminal status. The old CHECK is dropped and the new
  one added ``NOT VALID`` in the same ALTER TABLE (a catalog change under a brief ACCESS
  EXCLUSIVE lock, bounded by lock_timeout), then validated in a statement of its own, which
  reads the table under SHARE UPDATE EXCLUSIVE and blocks no reads or writes.
- ``unique_key`` is the key a job holds while it is in its de-duplication window
  (``unique_while``: ``queued``, or ``active`` for queued or running); it is cleared when the
  job leaves the window, and the unique index holds only queued and running rows, so it only
  ever holds the jobs that block a second enqueue. The index is built ``CONCURRENTLY`` (a failed earlier run's INVALID index is
  dropped first).
- ``snoozes`` counts the times a job put itself off (no attempt spent), ``crashes`` the
  attempts in a row that ended because the worker running it died, ``timeout`` how long one
  attempt may run.

The new columns are nullable or have a constant default: adding them writes no row. The
archive gets them in a statement of its own (one table's lock at a time). Non-atomic: each
statement commits on its own, so no lock is held from one step into the next.
"""

import django
from django.db import migrations, models

STATUSES = ("queued", "running", "done", "failed", "cancelled")

FORWARD = [
    "SET lock_timeout = '5s'",
    """
ALTER TABLE pgjobs_job
  DROP CONSTRAINT IF EXISTS pgjobs_job_status_check,
  ADD CONSTRAINT pgjobs_job_status_check
    CHECK (status IN ('queued', 'running', 'done', 'failed', 'cancelled')) NOT VALID,
  ADD COLUMN IF NOT EXISTS unique_key text,
  ADD COLUMN IF NOT EXISTS unique_while text,
  ADD COLUMN IF NOT EXISTS snoozes int NOT NULL DEFAULT 0,
  ADD COLUMN IF NOT EXISTS crashes int NOT NULL DEFAULT 0,
  ADD COLUMN IF NOT EXISTS timeout interval,
  DROP CONSTRAINT IF EXISTS pgjobs_job_unique_while_check,
  ADD CONSTRAINT pgjobs_job_unique_while_check
    CHECK (unique_while IN ('queued', 'active')) NOT VALID
""",
    "ALTER TABLE pgjobs_job VALIDATE CONSTRAINT pgjobs_job_status_check",
    "ALTER TABLE pgjobs_job VALIDATE CONSTRAINT pgjobs_job_unique_while_check",
    """
ALTER TABLE pgjobs_job_archive
  ADD COLUMN IF NOT EXISTS unique_key text,
  ADD COLUMN IF NOT EXISTS unique_while text,
  ADD COLUMN IF NOT EXISTS snoozes int NOT NULL DEFAULT 0,
  ADD COLUMN IF NOT EXISTS crashes int NOT NULL DEFAULT 0,
  ADD COLUMN IF NOT EXISTS timeout interval
""",
    "DROP INDEX CONCURRENTLY IF EXISTS pgjobs_job_unique_idx",
    "CREATE UNIQUE INDEX CONCURRENTLY pgjobs_job_unique_idx ON pgjobs_job (unique_key)"
    " WHERE status IN ('queued', 'running') AND unique_key IS NOT NULL",
    "RESET lock_timeout",
]

# Going back refuses nothing the old code can read: a cancelled job becomes a failed one.
BACKWARD = [
    "SET lock_timeout = '5s'",
    "DROP INDEX CONCURRENTLY IF EXISTS pgjobs_job_unique_idx",
    "UPDATE pgjobs_job SET status = 'failed' WHERE status = 'cancelled'",
    """
ALTER TABLE pgjobs_job
  DROP CONSTRAINT IF EXISTS pgjobs_job_unique_while_check,
  DROP CONSTRAINT IF EXISTS pgjobs_job_status_check,
  ADD CONSTRAINT pgjobs_job_status_check
    CHECK (status IN ('queued', 'running', 'done', 'failed')) NOT VALID,
  DROP COLUMN IF EXISTS unique_key,
  DROP COLUMN IF EXISTS unique_while,
  DROP COLUMN IF EXISTS snoozes,
  DROP COLUMN IF EXISTS crashes,
  DROP COLUMN IF EXISTS timeout
""",
    "ALTER TABLE pgjobs_job VALIDATE CONSTRAINT pgjobs_job_status_check",
    """
ALTER TABLE pgjobs_job_archive
  DROP COLUMN IF EXISTS unique_key,
  DROP COLUMN IF EXISTS unique_while,
  DROP COLUMN IF EXISTS snoozes,
  DROP COLUMN IF EXISTS crashes,
  DROP COLUMN IF EXISTS timeout
""",
    "RESET lock_timeout",
]


def check(condition: models.Q, name: str) -> models.CheckConstraint:
    if django.VERSION >= (5, 1):
        return models.CheckConstraint(condition=condition, name=name)
    return models.CheckConstraint(check=condition, name=name)


def columns(model: str) -> list[migrations.AddField]:
    return [
        migrations.AddField(model, "unique_key", models.TextField(blank=True, null=True)),
        migrations.AddField(
            model,
            "unique_while",
            models.TextField(
                blank=True, null=True, choices=[("queued", "Queued"), ("active", "Active")]
            ),
        ),
        migrations.AddField(model, "snoozes", models.IntegerField(default=0)),
        migrations.AddField(model, "crashes", models.IntegerField(default=0)),
        migrations.AddField(model, "timeout", models.DurationField(blank=True, null=True)),
    ]


CHOICES = [(status, status.capitalize()) for status in STATUSES]


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("django_pgjobs", "0007_schedules")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunSQL(FORWARD, BACKWARD)],
            state_operations=[
                migrations.RemoveConstraint("job", "pgjobs_job_status_check"),
                migrations.AlterField(
                    "job",
                    "status",
                    models.TextField(choices=CHOICES, default="queued"),
                ),
                migrations.AlterField("archivedjob", "status", models.TextField(choices=CHOICES)),
                migrations.AddConstraint(
                    # Lists, as the model's Status.values: Django 4.2 tells a tuple from a list.
                    "job",
                    check(models.Q(status__in=list(STATUSES)), "pgjobs_job_status_check"),
                ),
                *columns("job"),
                *columns("archivedjob"),
                migrations.AddConstraint(
                    "job",
                    check(
                        models.Q(unique_while__in=["queued", "active"]),
                        "pgjobs_job_unique_while_check",
                    ),
                ),
                migrations.AddConstraint(
                    "job",
                    models.UniqueConstraint(
                        fields=["unique_key"],
                        condition=models.Q(
                            unique_key__isnull=False, status__in=("queued", "running")
                        ),
                        name="pgjobs_job_unique_idx",
                    ),
                ),
            ],
        ),
    ]
