"""The archive gets the columns 0002 gave the jobs table, so prune(archive=True) keeps them.

Safe on a live, large table: every column is nullable or has a constant default, so the
ALTER only changes the catalog (no rewrite), and lock_timeout bounds how long it may queue
for its ACCESS EXCLUSIVE lock behind a long transaction: it fails fast instead of stalling
every worker behind it; rerun it later. One table per migration (no cross-table deadlock).
"""

from django.db import migrations, models

FORWARD = """
SET LOCAL lock_timeout = '5s';
ALTER TABLE pgjobs_job_archive
  ADD COLUMN attempted_at timestamptz,
  ADD COLUMN result       jsonb,
  ADD COLUMN errors       jsonb  NOT NULL DEFAULT '[]',
  ADD COLUMN worker_ids   jsonb  NOT NULL DEFAULT '[]';
"""

BACKWARD = """
SET LOCAL lock_timeout = '5s';
ALTER TABLE pgjobs_job_archive
  DROP COLUMN attempted_at, DROP COLUMN result, DROP COLUMN errors, DROP COLUMN worker_ids;
"""


class Migration(migrations.Migration):
    dependencies = [("django_pgjobs", "0002_job_results")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunSQL(FORWARD, BACKWARD)],
            state_operations=[
                migrations.AddField(
                    "archivedjob", "attempted_at", models.DateTimeField(blank=True, null=True)
                ),
                migrations.AddField(
                    "archivedjob", "result", models.JSONField(blank=True, null=True)
                ),
                migrations.AddField("archivedjob", "errors", models.JSONField(default=list)),
                migrations.AddField("archivedjob", "worker_ids", models.JSONField(default=list)),
            ],
        ),
    ]
