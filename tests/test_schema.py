"""The table as migration 0001 builds it: the seed's shape, its plan, and drift guards.

The migration's SQL is frozen by hand, so nothing but these tests keeps it, the model and
``Status`` saying the same thing.
"""

from __future__ import annotations

import io
import itertools
import json
import re
from datetime import timedelta

import psycopg
import pytest
from django.core.management import call_command
from django.db import DatabaseError, IntegrityError, connection, models, transaction
from django.test import TestCase, TransactionTestCase

from django_pgjobs.core import claim, finish
from django_pgjobs.models import ArchivedJob, Job, Status
from tests.helpers import job_row, make_jobs, query, raw_connect, scalar


class ClaimPlanTests(TransactionTestCase):
    def test_claim_plan_is_limit_lockrows_ready_index_scan(self) -> None:
        # Seed 000: on a table of a few thousand rows, mostly finished, the claim touches
        # only ready rows and stops after its LIMIT.
        make_jobs(5000, status="done", attempts=1)
        make_jobs(50)
        make_jobs(20, queue="emails")
        # A busy worker claims without suspects, Job.objects with them, an idle worker its
        # head (suspects allowed) and the rest (none) in one statement: every claim, each of
        # its parts, the same plan.
        # Each as the worker sends it (claim.limited: the LIMIT written in), planned for its
        # parameters and generically, as PostgreSQL plans it from the sixth claim on.
        claims = [
            ("busy", claim.CLAIM, {"suspects": False}, ["next"]),
            ("any", claim.CLAIM, {"suspects": True}, ["next"]),
            ("idle", claim.CLAIM_IDLE, {}, ["head", "rest"]),
            # A busy claim that completes jobs in the same statement (COMPLETE_WITH_CLAIM).
            ("completing", claim.CLAIM_COMPLETING, {"suspects": False, "claims": "[]"}, ["next"]),
        ]
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE pgjobs_job")
        for (name, statement, extra, ctes), generic in itertools.product(claims, (False, True)):
            with self.subTest(claim=name, generic=generic):
                params = {
                    "queue": "default",
                    "lease": "5 minutes",
                    "worker_id": "explain",
                    "synchronous_commit": "off",
                    "tasks": None,
                    "suspects": True,
                    **extra,
                }
                limited = claim.limited(statement, 10)
                plan = generic_plan(limited, params) if generic else custom_plan(limited, params)
                text = "\n".join(plan)
                assert "Seq Scan on pgjobs_job" not in text, text
                # The claim's UPDATE finds its rows by primary key (in the claim that completes,
                # the second UPDATE: the first, `done`, is COMPLETE's own).
                alias = "j_1" if name == "completing" else "j"
                assert re.search(
                    rf"Index Scan using pgjobs_job_pkey on pgjobs_job {alias}\b", text
                ), text
                for cte in ctes:
                    part = cte_of(plan, cte)
                    shown = "\n".join(part)
                    limit = line_of(part, r"->\s+Limit$")
                    lock = line_of(part, r"->\s+LockRows$")
                    scan = line_of(
                        part, r"->\s+Index (Only )?Scan using pgjobs_job_ready_idx on pgjobs_job\b"
                    )
                    assert 0 < limit < lock < scan, shown
                    assert depth(part[0]) < depth(part[limit]) < depth(part[lock]), shown
                    assert depth(part[lock]) < depth(part[scan]), shown


# The types of the claims' parameters, for a PREPARE of their own.
CLAIM_TYPES = {
    "queue": "text",
    "lease": "interval",
    "worker_id": "text",
    "synchronous_commit": "text",
    "tasks": "text",
    "suspects": "bool",
    "claims": "text",
}


def custom_plan(statement: str, params: dict[str, object]) -> list[str]:
    """The plan of ``statement`` for these parameters' values."""
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN (COSTS OFF) " + statement, params)
        return [row[0] for row in cursor.fetchall()]


def generic_plan(statement: str, params: dict[str, object]) -> list[str]:
    """The generic plan of ``statement`` (planned without its parameters' values), as a
    prepared statement gets once PostgreSQL judges it no worse than the custom ones."""
    names = list(dict.fromkeys(re.findall(r"%\((\w+)\)s", statement)))
    numbered = re.sub(r"%\((\w+)\)s", lambda m: f"${names.index(m[1]) + 1}", statement)
    types = ", ".join(CLAIM_TYPES[name] for name in names)
    # Bound on the client (the simple protocol): in the extended one the server would read
    # the PREPARE's $n as parameters of the PREPARE itself.
    with raw_connect() as conn, conn.transaction(), psycopg.ClientCursor(conn) as cursor:
        cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        cursor.execute(f"PREPARE claim ({types}) AS {numbered}")
        placeholders = ", ".join(["%s"] * len(names))
        cursor.execute(
            f"EXPLAIN (COSTS OFF) EXECUTE claim ({placeholders})", [params[name] for name in names]
        )
        rows = cursor.fetchall()
        cursor.execute("DEALLOCATE claim")
    return [row[0] for row in rows]


class ClaimPlanCacheTests(TransactionTestCase):
    def test_a_workers_repeated_claims_are_planned_once_per_batch_size(self) -> None:
        # A bound LIMIT kept every claim on a custom plan, planned afresh each time; with
        # the number written in (claim.limited), PostgreSQL switches to the generic plan after
        # five custom ones, for each size and kind of claim.
        # Thousands of ready rows: a generic plan guessing at a tenth of them is costly.
        make_jobs(5000)
        with raw_connect() as conn:
            conn.prepare_threshold = 0
            conn.execute("ANALYZE pgjobs_job")
            for idle, limit in itertools.product((False, True), (3, 4)):
                for _ in range(7):
                    jobs = claim.claim(
                        conn,
                        queue="default",
                        limit=limit,
                        lease=timedelta(minutes=5),
                        worker_id="plans",
                        synchronous_commit="off",
                        suspects=False,
                        idle=idle,
                    )
                    assert len(jobs) == limit
            plans = conn.execute(
                "SELECT generic_plans, custom_plans FROM pg_prepared_statements "
                "WHERE statement LIKE %s ORDER BY statement",
                ["%FOR UPDATE SKIP LOCKED%"],
            ).fetchall()
        assert plans == [(2, 5)] * 4, plans

    def test_claims_that_complete_jobs_are_planned_once_per_batch_size(self) -> None:
        make_jobs(5000)
        with raw_connect() as conn:
            conn.prepare_threshold = 0
            conn.execute("ANALYZE pgjobs_job")
            params = {
                "queue": "default",
                "lease": timedelta(minutes=5),
                "worker_id": "plans",
                "synchronous_commit": "off",
            }
            jobs = claim.claim(conn, limit=3, suspects=False, **params)  # type: ignore[arg-type]
            for _ in range(7):
                previous = jobs
                jobs, done = claim.claim_completing(
                    conn, limit=3, tasks=None, jobs=previous, results={}, **params
                )  # type: ignore[arg-type]
                assert len(jobs) == 3
                assert done == {job.id for job in previous}
            plans = conn.execute(
                "SELECT generic_plans, custom_plans FROM pg_prepared_statements "
                "WHERE statement LIKE %s",
                ["%WITH done AS%"],
            ).fetchall()
        assert plans == [(2, 5)], plans

    def test_limited_writes_in_only_a_positive_integer(self) -> None:
        assert "LIMIT 7\n" in claim.limited(claim.CLAIM, 7)
        assert "LIMIT 7 - 1\n" in claim.limited(claim.CLAIM_IDLE, 7)
        # Past the sizes that fit psycopg's prepared statements, the LIMIT stays bound.
        assert f"LIMIT {claim.WRITTEN_LIMITS}\n" in claim.limited(claim.CLAIM, claim.WRITTEN_LIMITS)
        assert claim.limited(claim.CLAIM, claim.WRITTEN_LIMITS + 1) == claim.CLAIM
        # A claim that completes jobs is one kind more on the producer's connection.
        completing = claim.limited(claim.CLAIM_COMPLETING, claim.COMPLETING_LIMITS)
        assert f"LIMIT {claim.COMPLETING_LIMITS}\n" in completing
        limit = claim.COMPLETING_LIMITS + 1
        assert claim.limited(claim.CLAIM_COMPLETING, limit) == claim.CLAIM_COMPLETING
        claim.limited(claim.CLAIM, 1)  # cached: True, equal to 1, must not find it there
        for bad in (0, -1, True, 2.0, "3"):
            with self.subTest(limit=bad), pytest.raises(ValueError, match="positive integer"):
                claim.limited(claim.CLAIM, bad)  # type: ignore[arg-type]
        for size in (3, claim.WRITTEN_LIMITS + 1):
            with pytest.raises(ValueError, match="one LIMIT"):
                claim.limited(finish.COMPLETE, size)


def line_of(plan: list[str], pattern: str) -> int:
    matches = [i for i, line in enumerate(plan) if re.search(pattern, line)]
    assert matches, f"{pattern!r} not in plan:\n" + "\n".join(plan)
    return matches[0]


def depth(line: str) -> int:
    return len(line) - len(line.lstrip(" -"))


def cte_of(plan: list[str], name: str) -> list[str]:
    """The lines of the plan's ``CTE name`` node: the node and all it holds."""
    start = line_of(plan, rf"^\s*CTE {name}$")
    inside = itertools.takewhile(lambda line: depth(line) > depth(plan[start]), plan[start + 1 :])
    return [plan[start], *inside]


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
            "run_at = now(), created_at = now(), locked_until, last_error, outage_releases"
        )[0]
        assert row[1:] == ("default", "queued", 0, 5, 0, True, True, None, None, 0)
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


CHECKS = [c for c in Job._meta.constraints if isinstance(c, models.CheckConstraint)]


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

    def test_the_unique_index_matches_the_model(self) -> None:
        # The partial unique index that enqueue's ON CONFLICT infers is a UniqueConstraint.
        (unique,) = [c for c in Job._meta.constraints if isinstance(c, models.UniqueConstraint)]
        twin = unique.clone()
        twin.name = "twin_" + unique.name
        with connection.schema_editor() as editor:
            editor.add_constraint(Job, twin)
        expected = self._index_def(twin.name).replace(twin.name, unique.name)
        assert self._index_def(unique.name) == expected
        assert "UNIQUE" in expected and "AND (unique_key IS NOT NULL))" in expected
        assert "status = ANY (ARRAY['queued'::text, 'running'::text])" in expected

    def test_every_constraint_is_validated(self) -> None:
        # A constraint left NOT VALID (a migration that stopped before its VALIDATE) still
        # checks new rows but promises nothing about old ones.
        constraints = dict(
            query(
                "SELECT conname, convalidated FROM pg_constraint "
                "WHERE conrelid = 'pgjobs_job'::regclass AND contype = 'c'"
            )
        )
        assert set(constraints) == {c.name for c in CHECKS}
        assert all(constraints.values()), constraints

    def test_check_constraints_match_the_models(self) -> None:
        for constraint in CHECKS:
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


BEFORE_CONSTRAINTS = "0005_admin_proxies"
# 0006 itself: a later migration (0011) turns its payload CHECK into a trigger.
CONSTRAINTS = "0006_job_constraints_outage_releases"
NEW_CONSTRAINTS = {
    "pgjobs_job_payload_check",
    "pgjobs_job_queue_check",
    "pgjobs_job_max_attempts_check",
    "pgjobs_job_attempts_check",
    "pgjobs_job_queued_attempts_check",
}
FINISHED = "2030-01-02T03:04:05+00:00"
INVALID = (
    "InvalidPayload: the payload was {}, not an object; the original is kept under invalid_payload"
)


def migrate(target: str | None = None) -> None:
    """Migrate django_pgjobs to ``target`` (its latest migration when None)."""
    call_command("migrate", "django_pgjobs", *([target] if target else []), verbosity=0)


def old_job(**columns: object) -> int:
    """INSERT a job with SQL as the schema before 0006 allowed it (text values cast)."""
    columns = {"task": "x.y", **columns}
    casts = {"payload": "jsonb", "errors": "jsonb", "finished_at": "timestamptz"}
    slots = ", ".join(f"%s::{casts[name]}" if name in casts else "%s" for name in columns)
    return int(
        scalar(
            f"INSERT INTO pgjobs_job ({', '.join(columns)}) VALUES ({slots}) RETURNING id",
            list(columns.values()),
        )
    )


def columns_of(job_id: int) -> dict[str, object]:
    names = (
        "queue, payload, status, attempts, max_attempts, locked_until, last_error, errors, "
        "finished_at, xmin::text AS version"
    )
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {names} FROM pgjobs_job WHERE id = %s", [job_id])
        row = dict(zip([c.name for c in cursor.description], cursor.fetchone(), strict=True))
    # Django's psycopg setup hands jsonb back as text.
    for name in ("payload", "errors"):
        if isinstance(row[name], str):
            row[name] = json.loads(row[name])
    return row


def constraint_names() -> set[str]:
    return {
        name
        for (name,) in query(
            "SELECT conname FROM pg_constraint WHERE conrelid = 'pgjobs_job'::regclass"
        )
    }


def has_outage_releases(table: str) -> bool:
    return bool(
        scalar(
            "SELECT count(*) FROM information_schema.columns "
            "WHERE table_name = %s AND column_name = 'outage_releases'",
            [table],
        )
    )


class ConstraintMigrationTests(TransactionTestCase):
    """Migration 0006 on a table that already holds rows its constraints refuse."""

    def setUp(self) -> None:
        self.addCleanup(self._back_to_latest)
        migrate(BEFORE_CONSTRAINTS)
        assert not constraint_names() & NEW_CONSTRAINTS
        assert not has_outage_releases("pgjobs_job")
        assert not has_outage_releases("pgjobs_job_archive")

    def _back_to_latest(self) -> None:
        query("DELETE FROM pgjobs_job WHERE queue !~ '^[A-Za-z0-9_.:-]{1,100}$' RETURNING id")
        migrate()

    def assert_migrated(self) -> None:
        assert constraint_names() >= NEW_CONSTRAINTS
        assert has_outage_releases("pgjobs_job")
        assert has_outage_releases("pgjobs_job_archive")
        validated = dict(
            query(
                "SELECT conname, convalidated FROM pg_constraint "
                "WHERE conrelid = 'pgjobs_job'::regclass AND conname = ANY(%s)",
                [list(NEW_CONSTRAINTS)],
            )
        )
        assert validated == dict.fromkeys(NEW_CONSTRAINTS, True)
        assert scalar("SELECT count(*) FROM pgjobs_job WHERE outage_releases <> 0") == 0

    def test_each_kind_of_bad_row_is_repaired_and_keeps_what_it_held(self) -> None:
        ids = {
            "string": old_job(payload=json.dumps('{"a": 1}')),
            "array": old_job(
                status="running", payload="[1, 2]", attempts=1, locked_until="2030-01-01Z"
            ),
            "number": old_job(status="done", payload="7", attempts=1, finished_at=FINISHED),
            "null": old_job(
                status="failed",
                payload="null",
                attempts=5,
                last_error="boom",
                errors='[{"exception_class_path": "x.Boom", "traceback": "boom"}]',
                finished_at=FINISHED,
            ),
            "zero_max": old_job(max_attempts=0),
            "over_max": old_job(status="running", attempts=7, max_attempts=3),
            "negative": old_job(attempts=-2),
            "used_up": old_job(queue="used-up", attempts=3, max_attempts=3),
            "string_over_max": old_job(payload='"x"', attempts=4, max_attempts=2),
            "good": old_job(payload='{"a": 1}', attempts=1),
        }
        before = {name: columns_of(job_id) for name, job_id in ids.items()}

        migrate(CONSTRAINTS)

        self.assert_migrated()
        after = {name: columns_of(job_id) for name, job_id in ids.items()}

        def changes(name: str) -> dict[str, object]:
            changed = {k: v for k, v in after[name].items() if before[name][k] != v}
            changed.pop("version", None)
            return changed

        def failed(found: str, *, old_errors: list[object]) -> dict[str, object]:
            return {
                "status": "failed",
                "last_error": INVALID.format(found),
                "errors": [
                    *old_errors,
                    {
                        "exception_class_path": "django_pgjobs.exceptions.InvalidPayload",
                        "traceback": INVALID.format(found),
                    },
                ],
            }

        # Jobs still to run: failed with the reason, the payload kept, the lease cleared.
        string = changes("string")
        assert string.pop("finished_at") is not None
        assert string == {
            "payload": {"invalid_payload": '{"a": 1}'},
            **failed("a JSON string", old_errors=[]),
        }
        array = changes("array")
        assert array.pop("finished_at") is not None
        assert array == {
            "payload": {"invalid_payload": [1, 2]},
            "locked_until": None,
            **failed("a JSON array", old_errors=[]),
        }
        # Finished jobs: only the payload is wrapped; their outcome and history stay.
        assert changes("number") == {"payload": {"invalid_payload": 7}}
        assert changes("null") == {"payload": {"invalid_payload": None}}
        # Attempts: max_attempts covers what was spent (and one more for a queued job).
        assert changes("zero_max") == {"max_attempts": 1}
        assert changes("over_max") == {"max_attempts": 7}
        assert changes("negative") == {"attempts": 0}
        assert changes("used_up") == {"max_attempts": 4}
        string_over_max = changes("string_over_max")
        assert string_over_max.pop("finished_at") is not None
        assert string_over_max == {
            "payload": {"invalid_payload": "x"},
            "max_attempts": 4,
            **failed("a JSON string", old_errors=[]),
        }
        # Only bad rows are written: the good one is the very same row version.
        assert after["good"] == before["good"]

        # The queued job that had no attempt left runs once more, as it would have before
        # (claimed with the schema of the latest migration).
        migrate()
        claimed = Job.objects.claim(queue="used-up")
        assert [(job.id, job.attempts) for job in claimed] == [(ids["used_up"], 4)]

    def test_a_bad_queue_name_stops_the_migration_before_anything_changes(self) -> None:
        bad_payload = old_job(payload='"x"')
        old_job(queue="bad queue")
        old_job(queue="bad queue")
        old_job(queue="")
        long_name = old_job(queue="q" * 130)
        before = columns_of(bad_payload)

        with pytest.raises(IntegrityError) as stopped:
            migrate(CONSTRAINTS)

        message = str(stopped.value)
        assert "0006 stopped before changing anything" in message, message
        assert "jobs in 3 queue(s)" in message, message
        assert "\n  '' (1 job)\n" in message, message
        assert "\n  'bad queue' (2 jobs)\n" in message, message
        assert f"\n  '{'q' * 120}'... (1 job)\n" in message, message
        assert "UPDATE pgjobs_job SET queue = 'new-name' WHERE queue = 'old name';" in message
        assert "\nthen run migrate again." in message, message
        # Nothing changed: no constraint, no column, the bad payload as it was, not recorded.
        assert not constraint_names() & NEW_CONSTRAINTS
        assert not has_outage_releases("pgjobs_job")
        assert not has_outage_releases("pgjobs_job_archive")
        assert columns_of(bad_payload) == before
        assert not scalar(
            "SELECT count(*) FROM django_migrations WHERE app = 'django_pgjobs' "
            "AND name LIKE '0006%%'"
        )

        # The user runs the suggested UPDATE, then migrate again: it goes through.
        query(
            "UPDATE pgjobs_job SET queue = 'default' "
            "WHERE queue !~ '^[A-Za-z0-9_.:-]{1,100}$' RETURNING id"
        )
        migrate(CONSTRAINTS)

        self.assert_migrated()
        assert columns_of(bad_payload)["payload"] == {"invalid_payload": "x"}
        assert columns_of(long_name)["queue"] == "default"

    def test_a_run_that_stopped_half_way_can_be_run_again(self) -> None:
        # What a run stopped after its ALTER (say, by lock_timeout at a VALIDATE) leaves:
        # constraints NOT VALID, the column there, the bad rows not yet repaired.
        bad = old_job(status="running", attempts=9, max_attempts=2)
        with connection.cursor() as cursor:
            cursor.execute(
                "ALTER TABLE pgjobs_job "
                "ADD CONSTRAINT pgjobs_job_attempts_check "
                "CHECK (attempts >= 0 AND attempts <= max_attempts) NOT VALID, "
                "ADD CONSTRAINT pgjobs_job_payload_check "
                "CHECK (jsonb_typeof(payload) = 'object') NOT VALID, "
                "ADD COLUMN outage_releases int NOT NULL DEFAULT 0"
            )

        migrate(CONSTRAINTS)

        self.assert_migrated()
        assert columns_of(bad)["max_attempts"] == 9


QUEUE_CHECK = (
    "SELECT convalidated, pg_get_constraintdef(oid) FROM pg_constraint "
    "WHERE conrelid = 'pgjobs_job'::regclass AND conname = 'pgjobs_job_queue_check'"
)


class QueueCheckMigrationTests(TransactionTestCase):
    """Migration 0010 swaps the queue-name CHECK for a cheaper one that refuses the same
    names, on a table that holds jobs, both ways."""

    def setUp(self) -> None:
        self.addCleanup(migrate)

    def test_the_cheaper_check_comes_validated_and_the_old_one_comes_back(self) -> None:
        jobs = [old_job(queue=name) for name in ("default", "x" * 100, "a.b:c-d_e")]
        ((validated, definition),) = query(QUEUE_CHECK)
        # No bounded repeat: PostgreSQL's regex engine spends ten times as long on one, on
        # every INSERT and UPDATE of a job (claims and completions included).
        assert validated is True and "{" not in definition
        assert "'^[A-Za-z0-9_.:-]+$'" in definition and "length(queue) <= 100" in definition

        migrate("0009_queue_control")
        ((validated, definition),) = query(QUEUE_CHECK)
        assert validated is True and "{1,100}" in definition
        with pytest.raises(IntegrityError, match="pgjobs_job_queue_check"):
            with transaction.atomic():
                old_job(queue="x" * 101)

        migrate()
        ((validated, definition),) = query(QUEUE_CHECK)
        assert validated is True and "{" not in definition
        assert [columns_of(job)["queue"] for job in jobs] == ["default", "x" * 100, "a.b:c-d_e"]
        for name in ("x" * 101, "", "line\n"):
            with pytest.raises(IntegrityError, match="pgjobs_job_queue_check"):
                with transaction.atomic():
                    old_job(queue=name)


PAYLOAD_TRIGGER = (
    "SELECT tgenabled, pg_get_triggerdef(oid) FROM pg_trigger "
    "WHERE tgrelid = 'pgjobs_job'::regclass AND tgname = 'pgjobs_job_payload_check'"
)
PAYLOAD_CHECK = (
    "SELECT convalidated FROM pg_constraint "
    "WHERE conrelid = 'pgjobs_job'::regclass AND conname = 'pgjobs_job_payload_check'"
)


def refused_payload() -> object:
    return pytest.raises(IntegrityError, match="pgjobs_job_payload_check")


class PayloadTriggerTests(TransactionTestCase):
    """Migration 0011: the payload must be an object where it is written, and only there."""

    def setUp(self) -> None:
        self.addCleanup(migrate)

    def test_a_write_of_another_column_does_not_check_the_payload(self) -> None:
        # A row from before any check (the trigger off while it is written): the claim's
        # UPDATE and other writes that leave its payload alone go through; the CHECK before
        # 0011 refused them, because it read every payload at every update.
        with connection.cursor() as cursor:
            cursor.execute("ALTER TABLE pgjobs_job DISABLE TRIGGER pgjobs_job_payload_check")
            try:
                bad = old_job(payload='"not an object"', queue="payload-trigger")
            finally:
                cursor.execute(
                    "ALTER TABLE pgjobs_job ENABLE ALWAYS TRIGGER pgjobs_job_payload_check"
                )
        (claimed,) = Job.objects.claim(queue="payload-trigger")
        assert (claimed.id, claimed.attempts) == (bad, 1)
        query("UPDATE pgjobs_job SET priority = 5 WHERE id = %s RETURNING id", [bad])
        assert columns_of(bad)["payload"] == "not an object"
        with refused_payload(), transaction.atomic():
            query("UPDATE pgjobs_job SET payload = payload WHERE id = %s RETURNING id", [bad])
        query("DELETE FROM pgjobs_job WHERE id = %s RETURNING id", [bad])

    def test_the_trigger_holds_for_a_replica_session_too(self) -> None:
        ((enabled, definition),) = query(PAYLOAD_TRIGGER)
        assert enabled == "A", "ENABLE ALWAYS: a CHECK is never skipped either"
        assert "AFTER INSERT OR UPDATE OF payload" in definition
        with refused_payload(), transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL session_replication_role = replica")
            old_job(payload="[1, 2]")
        with pytest.raises(IntegrityError) as refused, transaction.atomic():
            old_job(payload="3")
        assert "The payload is a JSON number, not an object" in str(refused.value)

    def test_going_back_restores_the_validated_check_and_forward_the_trigger(self) -> None:
        good = old_job(payload='{"a": 1}')
        assert query(PAYLOAD_CHECK) == [] and len(query(PAYLOAD_TRIGGER)) == 1

        migrate("0010_cheaper_queue_check")
        assert query(PAYLOAD_CHECK) == [(True,)] and query(PAYLOAD_TRIGGER) == []
        assert (
            scalar("SELECT count(*) FROM pg_proc WHERE proname = 'pgjobs_job_refuse_payload'") == 0
        )
        with refused_payload(), transaction.atomic():
            old_job(payload='"text"')

        migrate()
        assert query(PAYLOAD_CHECK) == [] and len(query(PAYLOAD_TRIGGER)) == 1
        assert columns_of(good)["payload"] == {"a": 1}
        with refused_payload(), transaction.atomic():
            old_job(payload="null")


class StoppedSwapTests(TransactionTestCase):
    """0011's swap stopped by its lock_timeout: all of it or none, and the connection fine."""

    def setUp(self) -> None:
        self.addCleanup(migrate)
        migrate("0010_cheaper_queue_check")

    def test_a_swap_stopped_by_a_lock_leaves_the_check_and_a_rerun_finishes_it(self) -> None:
        holder = raw_connect()
        try:
            holder.execute("BEGIN")
            holder.execute("LOCK TABLE pgjobs_job IN ACCESS SHARE MODE")
            with pytest.raises(DatabaseError, match="lock timeout"):
                migrate()
        finally:
            holder.close()
        assert query(PAYLOAD_CHECK) == [(True,)] and query(PAYLOAD_TRIGGER) == []
        recorded = scalar(
            "SELECT count(*) FROM django_migrations "
            "WHERE app = 'django_pgjobs' AND name = '0011_payload_check_on_write'"
        )
        assert recorded == 0
        # The same connection goes on (no transaction left aborted), and a rerun finishes.
        assert scalar("SELECT 1") == 1
        migrate()
        assert query(PAYLOAD_CHECK) == [] and query(PAYLOAD_TRIGGER)[0][0] == "A"


class AfterTriggersTests(TransactionTestCase):
    def test_the_payload_is_checked_as_other_before_triggers_left_it(self) -> None:
        # A CHECK sees the row after every BEFORE trigger; the AFTER trigger does too.
        with connection.cursor() as cursor:
            cursor.execute(
                "CREATE FUNCTION pgjobs_test_listify() RETURNS trigger LANGUAGE plpgsql AS "
                "$$ BEGIN NEW.payload := '[]'::jsonb; RETURN NEW; END $$"
            )
            cursor.execute(
                "CREATE TRIGGER zz_listify BEFORE INSERT ON pgjobs_job "
                "FOR EACH ROW EXECUTE FUNCTION pgjobs_test_listify()"
            )
            try:
                with refused_payload(), transaction.atomic():
                    old_job(payload='{"a": 1}')
            finally:
                cursor.execute("DROP TRIGGER zz_listify ON pgjobs_job")
                cursor.execute("DROP FUNCTION pgjobs_test_listify()")
        assert scalar("SELECT count(*) FROM pgjobs_job") == 0
