"""The table as migration 0001 builds it: the seed's shape, its plan, and drift guards.

The migration's SQL is frozen by hand, so nothing but these tests keeps it, the model and
``Status`` saying the same thing.
"""

from __future__ import annotations

import io
import re

import pytest
from django.core.management import call_command
from django.db import DatabaseError, connection, models, transaction
from django.test import TestCase, TransactionTestCase

from django_pgjobs import sql
from django_pgjobs.models import ArchivedJob, Job, Status
from tests.helpers import job_row, make_jobs, query, scalar


class ClaimPlanTests(TransactionTestCase):
    def test_claim_plan_is_limit_lockrows_ready_index_scan(self) -> None:
        # Seed 000: on a table of a few thousand rows, mostly finished, the claim touches
        # only ready rows and stops after its LIMIT.
        make_jobs(5000, status="done", attempts=1)
        make_jobs(50)
        make_jobs(20, queue="emails")
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE pgjobs_job")
            cursor.execute(
                "EXPLAIN (COSTS OFF) " + sql.CLAIM,
                {
                    "queue": "default",
                    "limit": 10,
                    "lease": "5 minutes",
                    "worker_id": "explain",
                    "synchronous_commit": "off",
                },
            )
            plan = [row[0] for row in cursor.fetchall()]
        text = "\n".join(plan)

        def line_of(pattern: str) -> int:
            matches = [i for i, line in enumerate(plan) if re.search(pattern, line)]
            assert matches, f"{pattern!r} not in plan:\n{text}"
            return matches[0]

        def depth(i: int) -> int:
            return len(plan[i]) - len(plan[i].lstrip(" -"))

        cte = line_of(r"^\s*CTE next$")
        limit = line_of(r"->\s+Limit$")
        lock = line_of(r"->\s+LockRows$")
        scan = line_of(r"->\s+Index (Only )?Scan using pgjobs_job_ready_idx on pgjobs_job\b")
        assert cte < limit < lock < scan, text
        assert depth(cte) < depth(limit) < depth(lock) < depth(scan), text
        assert "Seq Scan on pgjobs_job" not in text, text


class TableTests(TestCase):
    def test_autovacuum_scale_factor_is_set_on_the_table(self) -> None:
        options = scalar("SELECT reloptions FROM pg_class WHERE oid = 'pgjobs_job'::regclass")
        assert "autovacuum_vacuum_scale_factor=0.01" in options

    def test_status_check_allows_exactly_the_status_enum(self) -> None:
        definition = scalar(
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint "
            "WHERE conname = 'pgjobs_job_status_check' AND conrelid = 'pgjobs_job'::regclass"
        )
        allowed = re.findall(r"'([^']*)'::text", definition)
        assert sorted(allowed) == sorted(Status.values)
        assert len(allowed) == len(Status.values)

    def test_plain_sql_insert_gets_the_seed_defaults(self) -> None:
        # In one transaction now() is fixed, so "defaults to now()" can be checked exactly.
        row = query(
            "INSERT INTO pgjobs_job (task, payload) VALUES ('x.y', '{\"a\": 1}') "
            "RETURNING id, queue, status, attempts, max_attempts, priority, "
            "run_at = now(), created_at = now(), locked_until, last_error"
        )[0]
        assert row[1:] == ("default", "queued", 0, 5, 0, True, True, None, None)
        assert isinstance(row[0], int)

    def test_id_is_an_identity_that_refuses_explicit_values(self) -> None:
        generation = scalar(
            "SELECT identity_generation FROM information_schema.columns "
            "WHERE table_name = 'pgjobs_job' AND column_name = 'id'"
        )
        assert generation == "ALWAYS"
        with pytest.raises(DatabaseError, match="GENERATED ALWAYS"), transaction.atomic():
            query("INSERT INTO pgjobs_job (id, task) VALUES (999, 'x.y') RETURNING id")

    def test_every_time_column_is_timestamptz(self) -> None:
        for table in ("pgjobs_job", "pgjobs_job_archive"):
            types = dict(
                query(
                    "SELECT column_name, data_type FROM information_schema.columns "
                    "WHERE table_name = %s",
                    [table],
                )
            )
            timestamps = {c for c, t in types.items() if t.startswith("timestamp")}
            assert timestamps >= {
                "run_at",
                "locked_until",
                "created_at",
                "started_at",
                "finished_at",
            }, (table, types)
            assert {types[c] for c in timestamps} == {"timestamp with time zone"}, (table, types)

    def test_rows_made_by_the_orm_read_back_alike(self) -> None:
        job_id = make_jobs(1, status="running", attempts=1)[0]
        job = Job.objects.get(id=job_id)
        row = job_row(job_id)
        for column, value in row.items():
            assert getattr(job, column) == value, column


class DriftTests(TestCase):
    """Model (and so the migration state) against the SQL migration 0001 really ran."""

    def test_makemigrations_sees_no_changes(self) -> None:
        out = io.StringIO()
        # Exits with SystemExit(1) when a model differs from the migration state.
        call_command("makemigrations", "--check", "--dry-run", stdout=out, stderr=out)
        assert "No changes detected" in out.getvalue()

    def test_columns_match_the_models(self) -> None:
        for model in (Job, ArchivedJob):
            table = model._meta.db_table
            actual = {
                name: (kind, nullable == "YES")
                for name, kind, nullable in query(
                    "SELECT a.attname, format_type(a.atttypid, a.atttypmod), "
                    "CASE WHEN a.attnotnull THEN 'NO' ELSE 'YES' END "
                    "FROM pg_attribute a WHERE a.attrelid = %s::regclass "
                    "AND a.attnum > 0 AND NOT a.attisdropped",
                    [table],
                )
            }
            expected = {
                f.column: (f.db_type(connection), f.null) for f in model._meta.concrete_fields
            }
            assert actual == expected, table

    def _index_def(self, name: str) -> str:
        return scalar("SELECT pg_get_indexdef(%s::regclass)", [name])

    def test_indexes_match_the_models(self) -> None:
        # Build each model index under another name and compare PostgreSQL's own rendering.
        for index in Job._meta.indexes:
            twin = index.clone()
            twin.name = "twin_" + index.name
            with connection.schema_editor() as editor:
                editor.add_index(Job, twin)
            expected = self._index_def(twin.name).replace(twin.name, index.name)
            assert self._index_def(index.name) == expected

    def test_check_constraints_match_the_models(self) -> None:
        for constraint in Job._meta.constraints:
            assert isinstance(constraint, models.CheckConstraint)
            twin = constraint.clone()
            twin.name = "twin_" + constraint.name
            with connection.schema_editor() as editor:
                editor.add_constraint(Job, twin)
            definitions = dict(
                query(
                    "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint "
                    "WHERE conrelid = 'pgjobs_job'::regclass AND conname IN (%s, %s)",
                    [constraint.name, twin.name],
                )
            )
            assert definitions[constraint.name] == definitions[twin.name], definitions
