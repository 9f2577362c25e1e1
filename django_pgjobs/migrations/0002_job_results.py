"""Columns for results and attempt history (what django.tasks' TaskResult reports).

Safe on a live, large table: every column is nullable or has a constant default, so the
ALTER only changes the catalog (no rewrite), and lock_timeout bounds how long it may queue
for its ACCESS EXCLUSIVE lock behind a long transaction: it fails fast instead of stalling
every worker behind it; rerun it later. One table per migration (no cross-table deadlock).
"""

from django.db import migrations, models

FORWARD = """
SET LOCAL lock_timeout = '5s';
ALTER TABLE pgjobs_job
  ADD COLUMN attempted_at timestamptz,
  ADD COLUMN result       jsonb,
  ADD COLUMN errors       jsonb  NOT NULL DEFAULT '[]',
  ADD COLUMN worker_ids   jsonb  NOT NULL DEFAULT '[]';
"""

BACKWARD = """
SET LOCAL lock_timeout = '5s';
ALTER TABLE pgjobs_job
  DROP COLUMN attempted_at, DROP COLUMN result, DROP COLUMN errors, DROP COLUMN worker_ids;
"""


class Migration(migrations.Migration):
    dependencies = [("django_pgjobs", "0001_initial")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunSQL(FORWARD, BACKWARD)],
            state_operations=[
                migrations.AddField(
                    "job", "attempted_at", models.DateTimeField(blank=True, null=True)
                ),
                migrations.AddField("job", "result", models.JSONField(blank=True, null=True)),
                migrations.AddField("job", "errors", models.JSONField(default=list)),
                migrations.AddField("job", "worker_ids", models.JSONField(default=list)),
            ],
        ),
    ]
