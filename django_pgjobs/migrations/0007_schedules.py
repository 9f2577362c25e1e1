"""Periodic jobs: the ``pgjobs_schedule`` table, and the tick each periodic job serves.

``schedule`` and ``scheduled_at`` are nullable columns without a default: adding them changes
only the catalog (no row is read or written), under a lock_timeout so the brief ACCESS
EXCLUSIVE lock gives up after 5 s instead of queueing every worker behind a long
transaction. The archive gets them in a statement of its own (one table's lock at a time).
The new table is created empty. Non-atomic: each statement commits on its own.
"""

from django.db import migrations, models

FORWARD = [
    "SET lock_timeout = '5s'",
    """
ALTER TABLE pgjobs_job
  ADD COLUMN IF NOT EXISTS schedule text,
  ADD COLUMN IF NOT EXISTS scheduled_at timestamptz
""",
    """
ALTER TABLE pgjobs_job_archive
  ADD COLUMN IF NOT EXISTS schedule text,
  ADD COLUMN IF NOT EXISTS scheduled_at timestamptz
""",
    """
CREATE TABLE IF NOT EXISTS pgjobs_schedule (
  name        text        PRIMARY KEY,
  spec        text,
  last_tick   timestamptz,
  last_job_id bigint,
  last_error  text,
  failures    integer     NOT NULL DEFAULT 0,
  failed_at   timestamptz,
  updated_at  timestamptz NOT NULL DEFAULT now()
)
""",
    "RESET lock_timeout",
]

BACKWARD = [
    "SET lock_timeout = '5s'",
    "DROP TABLE IF EXISTS pgjobs_schedule",
    "ALTER TABLE pgjobs_job_archive DROP COLUMN IF EXISTS schedule, "
    "DROP COLUMN IF EXISTS scheduled_at",
    "ALTER TABLE pgjobs_job DROP COLUMN IF EXISTS schedule, DROP COLUMN IF EXISTS scheduled_at",
    "RESET lock_timeout",
]


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("django_pgjobs", "0006_job_constraints_outage_releases")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunSQL(FORWARD, BACKWARD)],
            state_operations=[
                migrations.AddField("job", "schedule", models.TextField(blank=True, null=True)),
                migrations.AddField(
                    "job", "scheduled_at", models.DateTimeField(blank=True, null=True)
                ),
                migrations.AddField(
                    "archivedjob", "schedule", models.TextField(blank=True, null=True)
                ),
                migrations.AddField(
                    "archivedjob", "scheduled_at", models.DateTimeField(blank=True, null=True)
                ),
                migrations.CreateModel(
                    name="ScheduleState",
                    fields=[
                        ("name", models.TextField(primary_key=True, serialize=False)),
                        ("spec", models.TextField(blank=True, null=True)),
                        ("last_tick", models.DateTimeField(blank=True, null=True)),
                        ("last_job_id", models.BigIntegerField(blank=True, null=True)),
                        ("last_error", models.TextField(blank=True, null=True)),
                        ("failures", models.IntegerField(default=0)),
                        ("failed_at", models.DateTimeField(blank=True, null=True)),
                        ("updated_at", models.DateTimeField(auto_now=True)),
                    ],
                    options={
                        "db_table": "pgjobs_schedule",
                        "verbose_name": "schedule",
                        "verbose_name_plural": "schedules",
                    },
                ),
            ],
        ),
    ]
