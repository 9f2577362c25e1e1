"""Every migration of django_pgjobs after the one that creates the table is safe on a live,
busy jobs table (seed 003's online-DDL checklist), judged from the SQL ``sqlmigrate`` prints:

- a ``lock_timeout`` is in force for every statement that locks pgjobs_job or
  pgjobs_job_archive (ALTER TABLE, CREATE/DROP INDEX, ...): a DDL statement queued behind a
  long transaction must fail fast, not stall every worker queued behind *it*;
- indexes are created and dropped ``CONCURRENTLY``, which only a non-atomic migration can do;
- constraints are added ``NOT VALID`` and validated later, in another transaction;
- no ``ALTER COLUMN ... TYPE`` (int to bigint rewrites the whole table under ACCESS EXCLUSIVE);
- an atomic migration changes one table (no deadlock between two tables' locks);
- a data repair (UPDATE or DELETE of a jobs table) has a WHERE, so it writes only the rows it
  repairs, not a new version of every row, and runs under a lock_timeout too: it waits for
  row locks that transaction-mode workers hold, while holding the rows it already changed.

The migrations are found on disk, so a migration added later is checked without touching this
file; the checker is shown to fail on bad SQL.
"""

from __future__ import annotations

import importlib
import io
import re
from dataclasses import dataclass, field
from pathlib import Path

import django
import pytest
from django.core.management import call_command
from django.db import connection, models

import django_pgjobs.migrations
from django_pgjobs.models import Job

APP = "django_pgjobs"
TABLES = {"pgjobs_job", "pgjobs_job_archive"}
# The migration that creates the table: nothing waits on a table that does not exist yet.
CREATES_THE_TABLE = "0001_initial"
MIGRATIONS = sorted(
    path.stem
    for path in Path(django_pgjobs.migrations.__file__).parent.glob("[0-9][0-9][0-9][0-9]_*.py")
)


# -- the checker ------------------------------------------------------------------------------


def statements(text: str) -> list[str]:
    """Split SQL on top-level semicolons; drop comments; collapse whitespace."""
    found: list[str] = []
    current: list[str] = []
    i = 0
    while i < len(text):
        char = text[i]
        if text.startswith("--", i):
            i = text.find("\n", i)
            i = len(text) if i < 0 else i
            continue
        if text.startswith("/*", i):
            end = text.find("*/", i + 2)
            i = len(text) if end < 0 else end + 2
            current.append(" ")
            continue
        dollar = re.match(r"\$[A-Za-z_]*\$", text[i:])
        if char == "'" or dollar is not None:
            quote = dollar.group(0) if dollar is not None else "'"
            end = text.find(quote, i + len(quote))
            while quote == "'" and end >= 0 and text.startswith("''", end):
                end = text.find("'", end + 2)
            end = len(text) if end < 0 else end + len(quote)
            current.append(text[i:end])
            i = end
            continue
        if char == ";":
            found.append(" ".join("".join(current).split()))
            current = []
        else:
            current.append(char)
        i += 1
    found.append(" ".join("".join(current).split()))
    return [statement for statement in found if statement]


NAME = r'(?:"?\w+"?\.)?"?(\w+)"?'
ALTER_TABLE = re.compile(rf"ALTER TABLE (?:IF EXISTS )?(?:ONLY )?{NAME}", re.I)
CREATE_INDEX = re.compile(
    rf"CREATE (?:UNIQUE )?INDEX (CONCURRENTLY )?(?:IF NOT EXISTS )?(?:{NAME} )?ON (?:ONLY )?{NAME}",
    re.I,
)
DROP_INDEX = re.compile(r"DROP INDEX (CONCURRENTLY )?", re.I)
REINDEX = re.compile(r"REINDEX (?:\(.*?\) )?(?:TABLE|INDEX) (CONCURRENTLY )?", re.I)
OTHER_LOCKS = re.compile(
    rf"(?:CREATE (?:OR REPLACE )?(?:CONSTRAINT )?TRIGGER .*? ON|DROP TRIGGER (?:IF EXISTS )?\w+ ON|"
    rf"LOCK (?:TABLE )?|CLUSTER|"
    rf"VACUUM (?:\(.*?FULL.*?\)|FULL)|TRUNCATE (?:TABLE )?|DROP TABLE (?:IF EXISTS )?) *{NAME}",
    re.I,
)
SET_TIMEOUT = re.compile(
    r"SET (SESSION |LOCAL )?lock_timeout (?:=|TO) *'?([^';]*)'?$"
    r"|SELECT set_config\('lock_timeout', *'([^']*)', *(true|false)\)",
    re.I,
)
RESET_TIMEOUT = re.compile(r"RESET (?:lock_timeout|ALL)$", re.I)
ADD_CONSTRAINT = re.compile(
    r"ADD (?:CONSTRAINT \"?(\w+)\"? )?(CHECK|FOREIGN KEY|UNIQUE|PRIMARY KEY|EXCLUDE)\b", re.I
)
VALIDATE = re.compile(r"VALIDATE CONSTRAINT \"?(\w+)\"?", re.I)
COLUMN_TYPE = re.compile(r"ALTER (?:COLUMN )?\"?\w+\"? (?:SET DATA )?TYPE\b", re.I)
STORED = re.compile(r"ADD (?:COLUMN )?[^,]*GENERATED ALWAYS AS .* STORED", re.I)
ROWS_WRITTEN = re.compile(rf"(?:UPDATE|DELETE FROM) (?:ONLY )?{NAME}", re.I)
WHERE = re.compile(r"\bWHERE\b", re.I)


# Where the next clause of an ALTER TABLE starts (a comma inside a CHECK's list is followed by
# a value, not by one of these).
NEXT_CLAUSE = re.compile(r",\s*(?:ADD|DROP|ALTER|VALIDATE|SET|RESET|RENAME|OWNER)\b", re.I)


def constraint_clauses(statement: str) -> list[tuple[str, str, str]]:
    """(name, kind, its own clause) of each ADD CONSTRAINT in one statement: NOT VALID must be
    in that constraint's clause, not merely somewhere in the statement."""
    found = []
    for match in ADD_CONSTRAINT.finditer(statement):
        end = NEXT_CLAUSE.search(statement, match.end())
        clause = statement[match.start() : end.start() if end else len(statement)]
        found.append((match.group(1) or "", match.group(2), clause))
    return found


@dataclass
class Findings:
    problems: list[str] = field(default_factory=list)
    # Constraints added NOT VALID and not validated in this migration: a later one must.
    unvalidated: set[str] = field(default_factory=set)
    validated: set[str] = field(default_factory=set)


def _zero(value: str) -> bool:
    return value.strip().upper() in ("", "DEFAULT") or bool(
        re.fullmatch(r"0+(?:\.0*)?\s*(?:us|ms|s|min|h|d)?", value.strip())
    )


def _table_locked(statement: str) -> str | None:
    """The jobs table this statement locks, or "an index" for DROP INDEX (names no table)."""
    for pattern in (ALTER_TABLE, OTHER_LOCKS):
        found = pattern.match(statement)
        if found and found.group(1) in TABLES:
            return found.group(1)
    found = CREATE_INDEX.match(statement)
    if found and found.group(3) in TABLES:
        return found.group(3)
    if DROP_INDEX.match(statement) or REINDEX.match(statement):
        return "an index"
    return None


def _check_repair(statement: str, timeout: bool, result: Findings) -> None:
    short = statement[:90]
    if not WHERE.search(statement):
        result.problems.append(
            f"{short!r} writes every row of the table (a new version of each, and a lock on "
            "each until it commits): repair only the bad rows, with a WHERE"
        )
    if not timeout:
        result.problems.append(
            f"{short!r} runs with no lock_timeout: it waits for rows that workers hold while "
            "holding the rows it changed already; set one first"
        )


def check_sql(text: str, *, atomic: bool) -> Findings:
    """What is unsafe in one migration's SQL on the live jobs tables (empty when safe)."""
    result = Findings()
    timeout = False
    added: set[str] = set()
    tables: set[str] = set()
    for statement in statements(text):
        head = statement.upper()
        if head in ("BEGIN", "COMMIT"):
            continue
        setting = SET_TIMEOUT.match(statement)
        if setting:
            scope, value = setting.group(1) or "", setting.group(2)
            if value is None:
                value, scope = setting.group(3), "LOCAL" if setting.group(4) == "true" else ""
            # SET LOCAL outside a transaction block does nothing (PostgreSQL only warns).
            timeout = not _zero(value) and (atomic or scope.strip().upper() != "LOCAL")
            continue
        if RESET_TIMEOUT.match(statement):
            timeout = False
            continue
        written = ROWS_WRITTEN.match(statement)
        if written and written.group(1) in TABLES:
            _check_repair(statement, timeout, result)
            continue
        table = _table_locked(statement)
        if table is None:
            continue
        if table in TABLES:
            tables.add(table)
        short = statement[:90]
        if not timeout:
            result.problems.append(
                f"{short!r} runs with no lock_timeout: set one first (SET lock_timeout = '5s', "
                "or SET LOCAL in an atomic migration) so it cannot queue behind a long "
                "transaction and stall every worker"
            )
        index = CREATE_INDEX.match(statement) or DROP_INDEX.match(statement)
        index = index or REINDEX.match(statement)
        if index:
            if not index.group(1):
                result.problems.append(
                    f"{short!r} without CONCURRENTLY blocks writes to the table for the whole "
                    "build: use CONCURRENTLY"
                )
            elif atomic:
                result.problems.append(
                    f"{short!r}: CONCURRENTLY cannot run in a transaction: the migration must "
                    "be non-atomic (atomic = False)"
                )
        if COLUMN_TYPE.search(statement):
            result.problems.append(
                f"{short!r} changes a column's type, which rewrites the table under ACCESS "
                "EXCLUSIVE: add a new column, backfill it in batches, then switch"
            )
        if STORED.search(statement):
            result.problems.append(
                f"{short!r} adds a stored generated column, which rewrites the table"
            )
        for name, kind, clause in constraint_clauses(statement):
            kind = kind.upper()
            label = name or "an unnamed constraint"
            if kind in ("UNIQUE", "PRIMARY KEY"):
                if "USING INDEX" not in head:
                    result.problems.append(
                        f"{short!r}: {kind} {label} builds its index under the table lock: "
                        "CREATE UNIQUE INDEX CONCURRENTLY, then ADD CONSTRAINT ... USING INDEX"
                    )
            elif kind == "EXCLUDE" or "NOT VALID" not in clause.upper():
                result.problems.append(
                    f"{short!r}: {kind} {label} checks every row under ACCESS EXCLUSIVE: add it "
                    "NOT VALID, then VALIDATE CONSTRAINT in a later transaction"
                )
            elif not name:
                result.problems.append(
                    f"{short!r}: name the NOT VALID constraint so it can be validated"
                )
            else:
                added.add(name)
        for name in VALIDATE.findall(statement):
            if name in added and atomic:
                result.problems.append(
                    f"VALIDATE CONSTRAINT {name} in the same transaction as its ADD CONSTRAINT "
                    "keeps the ACCESS EXCLUSIVE lock for the whole scan: validate it in a later "
                    "migration (or make this one non-atomic)"
                )
            added.discard(name)
            result.validated.add(name)
    if atomic and len(tables) > 1:
        result.problems.append(
            f"one atomic migration locks {sorted(tables)}: change one table per transaction"
        )
    result.unvalidated = added
    return result


def check_migrations(migrations: list[tuple[str, str, bool]]) -> list[str]:
    """Problems across (name, forward SQL, atomic) in order: each migration's own, and
    constraints added NOT VALID that no later migration validates."""
    problems: list[str] = []
    pending: dict[str, str] = {}
    for name, text, atomic in migrations:
        found = check_sql(text, atomic=atomic)
        problems.extend(f"{name}: {problem}" for problem in found.problems)
        for constraint in found.validated:
            pending.pop(constraint, None)
        pending.update(dict.fromkeys(found.unvalidated, name))
    problems.extend(
        f"{name}: constraint {constraint} is added NOT VALID and never validated"
        for constraint, name in pending.items()
    )
    return problems


# -- the real migrations ----------------------------------------------------------------------


def sqlmigrate(name: str, *, backwards: bool = False) -> str:
    out = io.StringIO()
    call_command("sqlmigrate", APP, name, backwards=backwards, stdout=out, no_color=True)
    return out.getvalue()


def is_atomic(name: str) -> bool:
    module = importlib.import_module(f"{APP}.migrations.{name}")
    return bool(module.Migration.atomic)


def test_the_migrations_found_on_disk_are_the_apps_migrations() -> None:
    # The list the tests below iterate over is the files; make sure it is not empty or stale.
    assert MIGRATIONS[0] == CREATES_THE_TABLE
    assert len(MIGRATIONS) >= 6
    assert (
        "CREATE TABLE pgjobs_job ("
        in importlib.import_module(f"{APP}.migrations.{CREATES_THE_TABLE}").CREATE
    )


@pytest.mark.django_db
@pytest.mark.parametrize("name", [m for m in MIGRATIONS if m != CREATES_THE_TABLE])
@pytest.mark.parametrize("direction", ["forwards", "backwards"])
def test_each_migration_after_the_first_is_safe_on_a_live_table(name: str, direction: str) -> None:
    text = sqlmigrate(name, backwards=direction == "backwards")
    atomic = is_atomic(name)
    # sqlmigrate wraps exactly the atomic migrations in BEGIN/COMMIT: the flag is real.
    assert text.lstrip().startswith("BEGIN;") == atomic, text
    found = check_sql(text, atomic=atomic)
    assert found.problems == [], "\n".join([text, *found.problems])


@pytest.mark.django_db
def test_constraints_added_not_valid_are_validated_by_a_later_migration() -> None:
    later = [m for m in MIGRATIONS if m != CREATES_THE_TABLE]
    assert check_migrations([(m, sqlmigrate(m), is_atomic(m)) for m in later]) == []


@pytest.mark.django_db
def test_the_checker_reads_the_real_sqlmigrate_output_not_just_its_own_examples() -> None:
    # The real migrations pass because of their lock_timeout and CONCURRENTLY: take either
    # away from sqlmigrate's own text and the checker objects.
    columns = sqlmigrate("0002_job_results")
    assert "SET LOCAL lock_timeout = '5s';" in columns
    problems = check_sql(columns.replace("SET LOCAL lock_timeout = '5s';", ""), atomic=True)
    assert [p[:30] for p in problems.problems] == ["'ALTER TABLE pgjobs_job ADD CO"]

    indexes = sqlmigrate("0004_job_finished_indexes")
    assert indexes.count("CREATE INDEX CONCURRENTLY") == 2
    problems = check_sql(indexes.replace("CONCURRENTLY ", ""), atomic=False)
    assert len(problems.problems) == 4  # two DROP INDEX, two CREATE INDEX
    assert all("without CONCURRENTLY" in p for p in problems.problems)
    assert len(check_sql(indexes, atomic=True).problems) == 4  # CONCURRENTLY needs atomic=False
    late = indexes.replace("SET lock_timeout = '5s';", "").replace(
        "RESET lock_timeout;", "SET lock_timeout = '5s';"
    )
    assert len(check_sql(late, atomic=False).problems) == 4


@pytest.mark.django_db
def test_the_schedules_migration_adds_instant_columns_under_its_lock_timeout() -> None:
    """0007 adds nullable columns without a default: a catalog change, no row rewritten. Its
    ALTERs on the jobs tables are refused by the checker once the lock_timeout is gone."""
    name = next(m for m in MIGRATIONS if m.startswith("0007_"))
    text = sqlmigrate(name)
    alters = [s for s in statements(text) if s.upper().startswith("ALTER TABLE PGJOBS_JOB")]
    assert len(alters) == 2
    for alter in alters:
        assert "DEFAULT" not in alter.upper() and "NOT NULL" not in alter.upper(), alter
    unguarded = check_sql(text.replace("SET lock_timeout = '5s';", ""), atomic=False)
    assert len(unguarded.problems) == 2, unguarded.problems


@pytest.mark.django_db
def test_the_checker_objects_to_the_constraint_migration_without_its_safeguards() -> None:
    name = next(m for m in MIGRATIONS if m.startswith("0006_"))
    text = sqlmigrate(name)
    assert not is_atomic(name)
    assert check_sql(text, atomic=False).problems == []
    assert text.count("NOT VALID") == 5 and text.count("VALIDATE CONSTRAINT") == 5

    # Constraints checked under the table lock instead of NOT VALID then VALIDATE.
    problems = check_sql(text.replace(" NOT VALID", ""), atomic=False).problems
    assert len(problems) == 5 and all("NOT VALID" in p for p in problems), problems
    # Added NOT VALID and never validated.
    unvalidated = "\n".join(line for line in text.splitlines() if "VALIDATE" not in line)
    assert check_sql(unvalidated, atomic=False).unvalidated == {
        "pgjobs_job_payload_check",
        "pgjobs_job_queue_check",
        "pgjobs_job_max_attempts_check",
        "pgjobs_job_attempts_check",
        "pgjobs_job_queued_attempts_check",
    }
    # No lock_timeout: the ALTER, the repair, the five VALIDATEs and the archive's ALTER.
    problems = check_sql(text.replace("SET lock_timeout = '5s';", ""), atomic=False).problems
    assert len(problems) == 8 and all("no lock_timeout" in p for p in problems), problems
    assert sum("UPDATE pgjobs_job" in p for p in problems) == 1
    # The repair without its WHERE rewrites the whole table.
    repair = text[text.index("UPDATE pgjobs_job\nSET") :]
    everything = repair[: repair.index("WHERE jsonb_typeof")] + ";"
    problems = check_sql(everything, atomic=False).problems
    assert [p[1:18] for p in problems] == ["UPDATE pgjobs_job", "UPDATE pgjobs_job"]
    assert "with a WHERE" in problems[0] and "no lock_timeout" in problems[1]


@pytest.mark.django_db
def test_the_job_control_migration_changes_the_status_check_online() -> None:
    """0008 lets status be 'cancelled' on a live table: the old CHECK goes and the new one
    comes NOT VALID in one brief ALTER under lock_timeout, and a statement of its own (its own
    transaction: the migration is non-atomic) validates it without blocking writes."""
    name = next(m for m in MIGRATIONS if m.startswith("0008_"))
    text = sqlmigrate(name)
    assert not is_atomic(name)
    found = check_sql(text, atomic=False)
    assert found.problems == [] and found.unvalidated == set()
    assert "pgjobs_job_status_check" in found.validated
    parts = statements(text)
    (add,) = [s for s in parts if "ADD CONSTRAINT pgjobs_job_status_check" in s]
    assert "'cancelled'" in add and "NOT VALID" in add
    assert "DROP CONSTRAINT IF EXISTS pgjobs_job_status_check" in add
    validate = parts.index("ALTER TABLE pgjobs_job VALIDATE CONSTRAINT pgjobs_job_status_check")
    assert parts.index(add) < validate
    timeouts = [i for i, s in enumerate(parts) if SET_TIMEOUT.match(s)]
    assert timeouts and timeouts[0] < parts.index(add)

    # Each safeguard is what the checker sees: without NOT VALID the CHECK scans every row
    # under ACCESS EXCLUSIVE; without the VALIDATE it is never enforced on old rows; without
    # the lock_timeout the ALTER can queue behind a long transaction and stall the workers.
    checked_at_once = check_sql(TIMEOUT + add.replace(" NOT VALID", "", 1) + ";", atomic=False)
    assert any("NOT VALID" in p for p in checked_at_once.problems), checked_at_once.problems
    never_validated = text.replace(
        "ALTER TABLE pgjobs_job VALIDATE CONSTRAINT pgjobs_job_status_check;", ""
    )
    assert check_migrations([(name, never_validated, False)]) == [
        f"{name}: constraint pgjobs_job_status_check is added NOT VALID and never validated"
    ]
    unguarded = check_sql(text.replace("SET lock_timeout = '5s';", ""), atomic=False)
    assert any(p.startswith("'ALTER TABLE pgjobs_job DROP CONSTRAINT") for p in unguarded.problems)
    # And the constraint the database holds now is the validated one that allows 'cancelled'.
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT convalidated, pg_get_constraintdef(oid) FROM pg_constraint "
            "WHERE conrelid = 'pgjobs_job'::regclass AND conname = 'pgjobs_job_status_check'"
        )
        ((validated, definition),) = cursor.fetchall()
    assert validated is True and "'cancelled'" in definition


@pytest.mark.django_db
def test_the_queue_check_migration_swaps_the_check_online() -> None:
    """0010 replaces the queue-name CHECK as 0008 replaced the status one: dropped and added
    NOT VALID in one brief ALTER under lock_timeout, validated by a statement of its own."""
    name = next(m for m in MIGRATIONS if m.startswith("0010_"))
    for backwards in (False, True):
        text = sqlmigrate(name, backwards=backwards)
        assert not is_atomic(name)
        found = check_sql(text, atomic=False)
        assert found.problems == [] and found.unvalidated == set()
        assert found.validated == {"pgjobs_job_queue_check"}
        parts = statements(text)
        (add,) = [s for s in parts if "ADD CONSTRAINT pgjobs_job_queue_check" in s]
        assert "DROP CONSTRAINT IF EXISTS pgjobs_job_queue_check" in add and "NOT VALID" in add
        assert ("{1,100}" in add) == backwards
        validate = parts.index("ALTER TABLE pgjobs_job VALIDATE CONSTRAINT pgjobs_job_queue_check")
        timeouts = [i for i, s in enumerate(parts) if SET_TIMEOUT.match(s)]
        assert timeouts and timeouts[0] < parts.index(add) < validate
        checked_at_once = check_sql(TIMEOUT + add.replace(" NOT VALID", "", 1) + ";", atomic=False)
        assert any("NOT VALID" in p for p in checked_at_once.problems), checked_at_once.problems


@pytest.mark.django_db
def test_the_payload_trigger_migration_never_leaves_a_write_unchecked() -> None:
    """0011: the trigger comes before the CHECK goes, both under lock_timeout; going back,
    the CHECK comes NOT VALID and is validated before the trigger goes."""
    name = next(m for m in MIGRATIONS if m.startswith("0011_"))
    assert not is_atomic(name)
    forward = sqlmigrate(name)
    found = check_sql(forward, atomic=False)
    assert found.problems == [] and found.unvalidated == set()
    parts = statements(forward)
    (create,) = [p for p in parts if p.startswith("CREATE TRIGGER pgjobs_job_payload_check")]
    assert "AFTER INSERT OR UPDATE OF payload ON pgjobs_job" in create
    drop_check = parts.index(
        "ALTER TABLE pgjobs_job DROP CONSTRAINT IF EXISTS pgjobs_job_payload_check"
    )
    drop_trigger = parts.index("DROP TRIGGER IF EXISTS pgjobs_job_payload_check ON pgjobs_job")
    enable = parts.index("ALTER TABLE pgjobs_job ENABLE ALWAYS TRIGGER pgjobs_job_payload_check")
    timeouts = [i for i, p in enumerate(parts) if SET_TIMEOUT.match(p)]
    assert timeouts and timeouts[0] < drop_trigger < parts.index(create) < enable < drop_check
    # One query string from the old trigger's drop to the CHECK's, so one transaction: stopped
    # anywhere, the CHECK stays, and no write finds the table without the rule or with the
    # trigger not ALWAYS (StoppedSwapTests in test_schema stops it).
    module = importlib.import_module(f"{APP}.migrations.{name}")
    (swap,) = [sql for sql in module.FORWARD if "CREATE TRIGGER" in sql]
    assert [p for p in statements(swap)] == parts[drop_trigger : drop_check + 1]
    unguarded = check_sql(forward.replace("SET lock_timeout = '5s';", ""), atomic=False)
    flagged = [p[1:13] for p in unguarded.problems]
    assert flagged == ["DROP TRIGGER", "CREATE TRIGG", "ALTER TABLE ", "ALTER TABLE "], flagged

    backward = sqlmigrate(name, backwards=True)
    found = check_sql(backward, atomic=False)
    assert found.problems == [] and found.validated == {"pgjobs_job_payload_check"}
    parts = statements(backward)
    validate = parts.index("ALTER TABLE pgjobs_job VALIDATE CONSTRAINT pgjobs_job_payload_check")
    assert validate < parts.index("DROP TRIGGER IF EXISTS pgjobs_job_payload_check ON pgjobs_job")


# -- the checker fails on bad SQL --------------------------------------------------------------

TIMEOUT = "SET lock_timeout = '5s';\n"
LOCAL = "SET LOCAL lock_timeout = '5s';\n"


@pytest.mark.django_db
def test_the_checker_catches_what_makemigrations_would_write() -> None:
    # The operations a model change turns into (AddIndex, AddConstraint, AlterField), as
    # Django's schema editor writes them for this table: quoted names, no lock_timeout.
    with connection.schema_editor(collect_sql=True, atomic=False) as editor:
        editor.add_index(Job, models.Index(fields=["task"], name="pgjobs_job_task_idx"))
    index = "\n".join(editor.collected_sql)
    assert 'ON "pgjobs_job"' in index
    problems = check_sql(index, atomic=True).problems
    assert len(problems) == 2
    assert "no lock_timeout" in problems[0] and "without CONCURRENTLY" in problems[1]

    constraint = models.CheckConstraint(
        **{"condition" if django.VERSION >= (5, 1) else "check": models.Q(attempts__gte=0)},
        name="pgjobs_job_attempts_check",
    )
    with connection.schema_editor(collect_sql=True, atomic=False) as editor:
        editor.add_constraint(Job, constraint)
    problems = check_sql(LOCAL + "\n".join(editor.collected_sql), atomic=True).problems
    assert len(problems) == 1 and "NOT VALID" in problems[0], problems

    old = Job._meta.get_field("attempts")
    new = models.BigIntegerField(default=0)
    new.set_attributes_from_name("attempts")
    with connection.schema_editor(collect_sql=True, atomic=False) as editor:
        editor.alter_field(Job, old, new)
    problems = check_sql(LOCAL + "\n".join(editor.collected_sql), atomic=True).problems
    assert problems and all("rewrites the table" in p for p in problems), problems


@pytest.mark.parametrize(
    ("text", "atomic", "complaint"),
    [
        pytest.param(
            TIMEOUT + "CREATE INDEX pgjobs_job_x_idx ON pgjobs_job (task);",
            False,
            "without CONCURRENTLY",
            id="plain-create-index",
        ),
        pytest.param(
            TIMEOUT + "DROP INDEX pgjobs_job_x_idx;",
            False,
            "without CONCURRENTLY",
            id="plain-drop-index",
        ),
        pytest.param(
            LOCAL + "CREATE INDEX CONCURRENTLY x ON public.pgjobs_job (task);",
            True,
            "must be non-atomic",
            id="concurrently-in-an-atomic-migration",
        ),
        pytest.param(
            "ALTER TABLE pgjobs_job ADD COLUMN tenant text;",
            True,
            "no lock_timeout",
            id="alter-without-lock-timeout",
        ),
        pytest.param(
            "-- SET lock_timeout = '5s';\nALTER TABLE pgjobs_job ADD COLUMN tenant text;",
            True,
            "no lock_timeout",
            id="lock-timeout-only-in-a-comment",
        ),
        pytest.param(
            'ALTER TABLE "pgjobs_job_archive" DROP COLUMN result;\n' + LOCAL,
            True,
            "no lock_timeout",
            id="lock-timeout-set-too-late",
        ),
        pytest.param(
            LOCAL + "ALTER TABLE pgjobs_job ADD COLUMN tenant text;",
            False,
            "no lock_timeout",
            id="set-local-outside-a-transaction-does-nothing",
        ),
        pytest.param(
            TIMEOUT + "RESET lock_timeout;\nDROP INDEX CONCURRENTLY pgjobs_job_x_idx;",
            False,
            "no lock_timeout",
            id="lock-timeout-reset-before-the-ddl",
        ),
        pytest.param(
            "SET lock_timeout = 0;\nALTER TABLE pgjobs_job ADD COLUMN tenant text;",
            True,
            "no lock_timeout",
            id="lock-timeout-zero",
        ),
        pytest.param(
            LOCAL + "ALTER TABLE pgjobs_job ADD CONSTRAINT pgjobs_job_task_check "
            "CHECK (task <> '');",
            True,
            "NOT VALID",
            id="check-without-not-valid",
        ),
        pytest.param(
            LOCAL + "ALTER TABLE pgjobs_job ADD CONSTRAINT a CHECK (attempts >= 0) NOT VALID, "
            "ADD CONSTRAINT b CHECK (status IN ('queued', 'done'));",
            True,
            "CHECK b checks every row",
            id="second-check-of-one-alter-without-not-valid",
        ),
        pytest.param(
            LOCAL + "ALTER TABLE pgjobs_job ADD CONSTRAINT pgjobs_job_fk "
            "FOREIGN KEY (queue) REFERENCES queues (name);",
            True,
            "NOT VALID",
            id="foreign-key-without-not-valid",
        ),
        pytest.param(
            LOCAL + "ALTER TABLE pgjobs_job ADD CONSTRAINT c CHECK (attempts >= 0) NOT VALID;\n"
            "ALTER TABLE pgjobs_job VALIDATE CONSTRAINT c;",
            True,
            "same transaction",
            id="validate-in-the-same-transaction",
        ),
        pytest.param(
            LOCAL + "ALTER TABLE pgjobs_job ADD CONSTRAINT u UNIQUE (task);",
            True,
            "USING INDEX",
            id="unique-constraint-building-its-index",
        ),
        pytest.param(
            LOCAL + "ALTER TABLE pgjobs_job ALTER COLUMN attempts TYPE bigint;",
            True,
            "rewrites the table",
            id="int-to-bigint",
        ),
        pytest.param(
            LOCAL + "ALTER TABLE pgjobs_job ALTER attempts SET DATA TYPE bigint "
            "USING attempts::bigint;",
            True,
            "rewrites the table",
            id="set-data-type",
        ),
        pytest.param(
            LOCAL + "ALTER TABLE pgjobs_job ADD COLUMN n int GENERATED ALWAYS AS (attempts + 1)"
            " STORED;",
            True,
            "rewrites the table",
            id="stored-generated-column",
        ),
        pytest.param(
            LOCAL + "ALTER TABLE pgjobs_job ADD COLUMN a text;\n"
            "ALTER TABLE pgjobs_job_archive ADD COLUMN a text;",
            True,
            "one table per",
            id="two-tables-in-one-transaction",
        ),
        pytest.param(
            TIMEOUT + "UPDATE pgjobs_job SET max_attempts = greatest(max_attempts, 1);",
            False,
            "with a WHERE",
            id="repair-of-every-row",
        ),
        pytest.param(
            TIMEOUT + "DELETE FROM public.pgjobs_job_archive;",
            False,
            "with a WHERE",
            id="delete-of-every-row",
        ),
        pytest.param(
            "UPDATE pgjobs_job SET max_attempts = 1 WHERE max_attempts < 1;",
            False,
            "no lock_timeout",
            id="repair-without-lock-timeout",
        ),
    ],
)
def test_the_checker_finds_unsafe_sql(text: str, atomic: bool, complaint: str) -> None:
    problems = check_sql(text, atomic=atomic).problems
    assert problems, text
    assert any(complaint in problem for problem in problems), problems


@pytest.mark.parametrize(
    ("text", "atomic"),
    [
        pytest.param(
            "SET lock_timeout = '3s';\n"
            "CREATE INDEX CONCURRENTLY IF NOT EXISTS pgjobs_job_task_idx ON pgjobs_job (task);\n"
            "DROP INDEX CONCURRENTLY IF EXISTS pgjobs_job_old_idx;\nRESET lock_timeout;",
            False,
            id="concurrent-index",
        ),
        pytest.param(
            "BEGIN;\nSET LOCAL lock_timeout = '3s';\n"
            "ALTER TABLE pgjobs_job ADD COLUMN retry_count int DEFAULT 0;\nCOMMIT;",
            True,
            id="add-column-with-a-constant-default",
        ),
        pytest.param(
            "BEGIN;\nSELECT set_config('lock_timeout', '3s', true);\n"
            "ALTER TABLE pgjobs_job ADD CONSTRAINT pgjobs_job_attempts_check "
            "CHECK (attempts >= 0) NOT VALID;\nCOMMIT;",
            True,
            id="check-not-valid",
        ),
        pytest.param(
            "SET lock_timeout = '3s';\n"
            "CREATE UNIQUE INDEX CONCURRENTLY pgjobs_job_u ON pgjobs_job (id, task);\n"
            "ALTER TABLE pgjobs_job ADD CONSTRAINT pgjobs_job_u UNIQUE USING INDEX pgjobs_job_u;",
            False,
            id="unique-using-a-concurrent-index",
        ),
        pytest.param(
            "SET lock_timeout = '3s';\n"
            "UPDATE pgjobs_job SET attempts = 0 WHERE attempts < 0;\nRESET lock_timeout;",
            False,
            id="repair-of-the-bad-rows-only",
        ),
        pytest.param(
            # Statements about other tables, and text that only looks like DDL.
            "CREATE INDEX shop_order_idx ON shop_order (email);\n"
            "INSERT INTO notes VALUES ('ALTER TABLE pgjobs_job; CREATE INDEX x ON pgjobs_job');",
            True,
            id="other-tables-and-strings",
        ),
    ],
)
def test_the_checker_accepts_the_seeds_safe_forms(text: str, atomic: bool) -> None:
    assert check_sql(text, atomic=atomic).problems == []


def test_a_not_valid_constraint_must_be_validated_by_a_later_migration() -> None:
    add = (
        "BEGIN;\nSET LOCAL lock_timeout = '5s';\nALTER TABLE pgjobs_job ADD CONSTRAINT "
        "pgjobs_job_attempts_check CHECK (attempts >= 0) NOT VALID;\nCOMMIT;"
    )
    validate = (
        "SET lock_timeout = '5s';\n"
        "ALTER TABLE pgjobs_job VALIDATE CONSTRAINT pgjobs_job_attempts_check;"
    )
    assert check_migrations([("0006_add", add, True)]) == [
        "0006_add: constraint pgjobs_job_attempts_check is added NOT VALID and never validated"
    ]
    assert check_migrations([("0006_add", add, True), ("0007_validate", validate, True)]) == []
    # In a non-atomic migration ADD and VALIDATE are separate transactions: fine together.
    both = (
        "SET lock_timeout = '5s';\nALTER TABLE pgjobs_job ADD CONSTRAINT "
        "pgjobs_job_attempts_check CHECK (attempts >= 0) NOT VALID;\n" + validate
    )
    assert check_migrations([("0006_both", both, False)]) == []
