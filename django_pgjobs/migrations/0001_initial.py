"""Create the jobs table and its archive.

The SQL is frozen here, not generated: the seed's schema (identity key, defaults that make a
plain-SQL INSERT a valid job, the status CHECK), the partial indexes, and the table's own
autovacuum scale factor (a queue table churns through updates; vacuum it after 1% of its rows
are dead, not the default 20%). The state operations mirror it for the ORM.

This migration creates the table, so it is exempt from the online-DDL rules that every later
migration on it follows (lock_timeout, CREATE INDEX CONCURRENTLY, NOT VALID then VALIDATE).
"""

import django
from django.db import migrations, models

STATUSES = ["queued", "running", "done", "failed"]
STATUS_CHOICES = [(s, s.capitalize()) for s in STATUSES]


def check(condition: models.Q, name: str) -> models.CheckConstraint:
    if django.VERSION >= (5, 1):
        return models.CheckConstraint(condition=condition, name=name)
    return models.CheckConstraint(check=condition, name=name)


CREATE = """
CREATE TABLE pgjobs_job (
  id           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  queue        text        NOT NULL DEFAULT 'default',
  task         text        NOT NULL,
  payload      jsonb       NOT NULL DEFAULT '{}',
  status       text        NOT NULL DEFAULT 'queued'
               CONSTRAINT pgjobs_job_status_check
               CHECK (status IN ('queued', 'running', 'done', 'failed')),
  priority     smallint    NOT NULL DEFAULT 0
               CONSTRAINT pgjobs_job_priority_check CHECK (priority BETWEEN -100 AND 100),
  run_at       timestamptz NOT NULL DEFAULT now(),
  attempts     int         NOT NULL DEFAULT 0,
  max_attempts int         NOT NULL DEFAULT 5,
  locked_until timestamptz,
  last_error   text,
  created_at   timestamptz NOT NULL DEFAULT now(),
  started_at   timestamptz,
  finished_at  timestamptz
) WITH (autovacuum_vacuum_scale_factor = 0.01);

CREATE INDEX pgjobs_job_ready_idx ON pgjobs_job (queue, priority DESC, run_at)
  WHERE status = 'queued';
CREATE INDEX pgjobs_job_lease_idx ON pgjobs_job (locked_until)
  WHERE status = 'running';

CREATE TABLE pgjobs_job_archive (
  id           bigint      PRIMARY KEY,
  queue        text        NOT NULL,
  task         text        NOT NULL,
  payload      jsonb       NOT NULL,
  status       text        NOT NULL,
  priority     smallint    NOT NULL,
  run_at       timestamptz NOT NULL,
  attempts     int         NOT NULL,
  max_attempts int         NOT NULL,
  locked_until timestamptz,
  last_error   text,
  created_at   timestamptz NOT NULL,
  started_at   timestamptz,
  finished_at  timestamptz,
  archived_at  timestamptz NOT NULL DEFAULT now()
);
"""

DROP = "DROP TABLE pgjobs_job_archive; DROP TABLE pgjobs_job;"


class Migration(migrations.Migration):
    initial = True

    dependencies: list[tuple[str, str]] = []

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunSQL(CREATE, DROP)],
            state_operations=[
                migrations.CreateModel(
                    name="Job",
                    fields=[
                        ("id", models.BigAutoField(primary_key=True, serialize=False)),
                        ("queue", models.TextField(default="default")),
                        ("task", models.TextField()),
                        ("payload", models.JSONField(default=dict)),
                        (
                            "status",
                            models.TextField(choices=STATUS_CHOICES, default="queued"),
                        ),
                        ("priority", models.SmallIntegerField(default=0)),
                        ("run_at", models.DateTimeField()),
                        ("attempts", models.IntegerField(default=0)),
                        ("max_attempts", models.IntegerField(default=5)),
                        ("locked_until", models.DateTimeField(blank=True, null=True)),
                        ("last_error", models.TextField(blank=True, null=True)),
                        ("created_at", models.DateTimeField(auto_now_add=True)),
                        ("started_at", models.DateTimeField(blank=True, null=True)),
                        ("finished_at", models.DateTimeField(blank=True, null=True)),
                    ],
                    options={
                        "db_table": "pgjobs_job",
                        "ordering": ("-id",),
                        "indexes": [
                            models.Index(
                                fields=["queue", "-priority", "run_at"],
                                name="pgjobs_job_ready_idx",
                                condition=models.Q(status="queued"),
                            ),
                            models.Index(
                                fields=["locked_until"],
                                name="pgjobs_job_lease_idx",
                                condition=models.Q(status="running"),
                            ),
                        ],
                        "constraints": [
                            check(
                                models.Q(status__in=STATUSES),
                                "pgjobs_job_status_check",
                            ),
                            check(
                                models.Q(priority__gte=-100, priority__lte=100),
                                "pgjobs_job_priority_check",
                            ),
                        ],
                    },
                ),
                migrations.CreateModel(
                    name="ArchivedJob",
                    fields=[
                        ("id", models.BigIntegerField(primary_key=True, serialize=False)),
                        ("queue", models.TextField()),
                        ("task", models.TextField()),
                        ("payload", models.JSONField()),
                        ("status", models.TextField(choices=STATUS_CHOICES)),
                        ("priority", models.SmallIntegerField()),
                        ("run_at", models.DateTimeField()),
                        ("attempts", models.IntegerField()),
                        ("max_attempts", models.IntegerField()),
                        ("locked_until", models.DateTimeField(blank=True, null=True)),
                        ("last_error", models.TextField(blank=True, null=True)),
                        ("created_at", models.DateTimeField()),
                        ("started_at", models.DateTimeField(blank=True, null=True)),
                        ("finished_at", models.DateTimeField(blank=True, null=True)),
                        ("archived_at", models.DateTimeField(auto_now_add=True)),
                    ],
                    options={"db_table": "pgjobs_job_archive", "ordering": ("-id",)},
                ),
            ],
        ),
    ]
