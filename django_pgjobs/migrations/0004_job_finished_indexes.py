"""Indexes for the dashboard, the doctor and the failed-jobs list, built without blocking.

CREATE INDEX CONCURRENTLY takes only a SHARE UPDATE EXCLUSIVE lock (reads and writes go on)
but cannot run in a transaction, so this migration is not atomic. lock_timeout bounds the
brief waits it still has. A failed earlier run can leave an INVALID index behind: it is
dropped first (an invalid index is never used but still slows every write).
"""

from django.db import migrations, models

FORWARD = [
    "SET lock_timeout = '5s'",
    "DROP INDEX CONCURRENTLY IF EXISTS pgjobs_job_finished_idx",
    "CREATE INDEX CONCURRENTLY pgjobs_job_finished_idx ON pgjobs_job (finished_at)"
    " WHERE finished_at IS NOT NULL",
    "DROP INDEX CONCURRENTLY IF EXISTS pgjobs_job_failed_idx",
    "CREATE INDEX CONCURRENTLY pgjobs_job_failed_idx ON pgjobs_job (finished_at)"
    " WHERE status = 'failed'",
    "RESET lock_timeout",
]
BACKWARD = [
    "SET lock_timeout = '5s'",
    "DROP INDEX CONCURRENTLY IF EXISTS pgjobs_job_failed_idx",
    "DROP INDEX CONCURRENTLY IF EXISTS pgjobs_job_finished_idx",
    "RESET lock_timeout",
]


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("django_pgjobs", "0003_archive_results")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunSQL(FORWARD, BACKWARD)],
            state_operations=[
                migrations.AddIndex(
                    "job",
                    models.Index(
                        fields=["finished_at"],
                        name="pgjobs_job_finished_idx",
                        condition=models.Q(finished_at__isnull=False),
                    ),
                ),
                migrations.AddIndex(
                    "job",
                    models.Index(
                        fields=["finished_at"],
                        name="pgjobs_job_failed_idx",
                        condition=models.Q(status="failed"),
                    ),
                ),
            ],
        ),
    ]
