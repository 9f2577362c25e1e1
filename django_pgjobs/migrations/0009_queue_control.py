"""Queue control: per-queue state (pause, limits), lock keys, and the registry of live workers.

- ``pgjobs_queue`` holds one row per queue an operator steered: paused, its global
  concurrency and rate limits, and the start times the rate limit counts. A queue without a
  row is unpaused and unlimited.
- ``pgjobs_worker`` holds one row per live worker, refreshed on its tick; a row past its
  ``expires_at`` is a worker that stopped heartbeating.
- ``lock_key`` is a nullable column without a default on both job tables: adding it changes
  only the catalog. Two partial indexes serve it, built ``CONCURRENTLY`` (a failed earlier
  run's INVALID index is dropped first): the ready jobs that carry a key, in the claim's
  order, and the running jobs by key (is this key taken?). Both are empty until a job
  carries a key.

Non-atomic: each statement commits on its own, under a lock_timeout, one table at a time.
"""

from django.db import migrations, models

from django_pgjobs.fields import PgArray

FORWARD = [
    "SET lock_timeout = '5s'",
    "ALTER TABLE pgjobs_job ADD COLUMN IF NOT EXISTS lock_key text",
    "ALTER TABLE pgjobs_job_archive ADD COLUMN IF NOT EXISTS lock_key text",
    """
CREATE TABLE IF NOT EXISTS pgjobs_queue (
  name        text          PRIMARY KEY,
  paused      boolean       NOT NULL DEFAULT false,
  concurrency integer       CHECK (concurrency >= 1),
  rate_count  integer       CHECK (rate_count >= 1),
  rate_period interval      CHECK (rate_period > interval '0'),
  starts      timestamptz[] NOT NULL DEFAULT '{}',
  updated_at  timestamptz   NOT NULL DEFAULT now(),
  CONSTRAINT pgjobs_queue_rate_check CHECK ((rate_count IS NULL) = (rate_period IS NULL))
)
""",
    """
CREATE TABLE IF NOT EXISTS pgjobs_worker (
  id           text        PRIMARY KEY,
  host         text        NOT NULL,
  pid          integer     NOT NULL,
  mode         text        NOT NULL,
  queues       jsonb       NOT NULL,
  tasks        text[],
  version      text        NOT NULL,
  started_at   timestamptz NOT NULL DEFAULT now(),
  heartbeat_at timestamptz NOT NULL DEFAULT now(),
  expires_at   timestamptz NOT NULL
)
""",
    "DROP INDEX CONCURRENTLY IF EXISTS pgjobs_job_keyed_idx",
    "CREATE INDEX CONCURRENTLY pgjobs_job_keyed_idx ON pgjobs_job (queue, priority DESC, run_at)"
    " WHERE lock_key IS NOT NULL AND status = 'queued'",
    "DROP INDEX CONCURRENTLY IF EXISTS pgjobs_job_lock_idx",
    "CREATE INDEX CONCURRENTLY pgjobs_job_lock_idx ON pgjobs_job (lock_key)"
    " WHERE lock_key IS NOT NULL AND status = 'running'",
    "RESET lock_timeout",
]

BACKWARD = [
    "SET lock_timeout = '5s'",
    "DROP INDEX CONCURRENTLY IF EXISTS pgjobs_job_lock_idx",
    "DROP INDEX CONCURRENTLY IF EXISTS pgjobs_job_keyed_idx",
    "DROP TABLE IF EXISTS pgjobs_worker",
    "DROP TABLE IF EXISTS pgjobs_queue",
    "ALTER TABLE pgjobs_job_archive DROP COLUMN IF EXISTS lock_key",
    "ALTER TABLE pgjobs_job DROP COLUMN IF EXISTS lock_key",
    "RESET lock_timeout",
]


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("django_pgjobs", "0008_job_control")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunSQL(FORWARD, BACKWARD)],
            state_operations=[
                migrations.AddField("job", "lock_key", models.TextField(blank=True, null=True)),
                migrations.AddField(
                    "archivedjob", "lock_key", models.TextField(blank=True, null=True)
                ),
                migrations.AddIndex(
                    "job",
                    models.Index(
                        fields=["queue", "-priority", "run_at"],
                        name="pgjobs_job_keyed_idx",
                        condition=models.Q(status="queued", lock_key__isnull=False),
                    ),
                ),
                migrations.AddIndex(
                    "job",
                    models.Index(
                        fields=["lock_key"],
                        name="pgjobs_job_lock_idx",
                        condition=models.Q(status="running", lock_key__isnull=False),
                    ),
                ),
                migrations.CreateModel(
                    name="QueueState",
                    fields=[
                        ("name", models.TextField(primary_key=True, serialize=False)),
                        ("paused", models.BooleanField(default=False)),
                        ("concurrency", models.IntegerField(blank=True, null=True)),
                        ("rate_count", models.IntegerField(blank=True, null=True)),
                        ("rate_period", models.DurationField(blank=True, null=True)),
                        ("starts", PgArray("timestamptz", blank=True, default=list)),
                        ("updated_at", models.DateTimeField(auto_now=True)),
                    ],
                    options={
                        "db_table": "pgjobs_queue",
                        "verbose_name": "queue",
                        "verbose_name_plural": "queues",
                    },
                ),
                migrations.CreateModel(
                    name="WorkerRecord",
                    fields=[
                        ("id", models.TextField(primary_key=True, serialize=False)),
                        ("host", models.TextField()),
                        ("pid", models.IntegerField()),
                        ("mode", models.TextField()),
                        ("queues", models.JSONField()),
                        ("tasks", PgArray("text", blank=True, null=True)),
                        ("version", models.TextField()),
                        ("started_at", models.DateTimeField()),
                        ("heartbeat_at", models.DateTimeField()),
                        ("expires_at", models.DateTimeField()),
                    ],
                    options={
                        "db_table": "pgjobs_worker",
                        "verbose_name": "worker",
                        "verbose_name_plural": "workers",
                    },
                ),
            ],
        ),
    ]
