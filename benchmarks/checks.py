"""What the table's checks cost each write of a job: the queue name and the payload, each in
the form 0006 added and in today's (0010's, 0011's).

Not part of ``benchmarks.run``: a probe to run by hand against a scratch database that has
the schema (``manage.py migrate``). It makes scratch tables shaped like ``pgjobs_job``
(``LIKE ... INCLUDING ALL``, so with its other constraints), one per form, and drops them at
the end::

    DATABASE_URL=postgres://... DJANGO_SETTINGS_MODULE=benchmarks.settings \\
        python -m benchmarks.checks [--rows N] [--payload-rows N] [--rounds 7]

Taking turns round by round, it times, per row:

- the queue name: the condition alone over ``--rows`` x 100 names; an ``INSERT ... SELECT``
  of ``--rows`` jobs into each table (as ``enqueue_many()`` writes them); and an ``UPDATE``
  of them all to ``running`` (as a claim writes each row; a completion pays the same). It
  first prints the names each form refuses, and stops if they differ;
- the payload: an ``UPDATE`` to ``running`` of ``--payload-rows`` jobs whose payloads are
  96 kB (compressed and moved out of line, as large payloads are), against the table with
  0006's ``CHECK`` and the one with 0011's trigger.

It prints the medians over the rounds, in microseconds per row, the old form's against the
new one's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import django

django.setup()

from django.db import connection  # noqa: E402

OLD = "queue ~ '^[A-Za-z0-9_.:-]{1,100}$'"
NEW = "queue ~ '^[A-Za-z0-9_.:-]+$' AND length(queue) <= 100"
FORMS = {"0006 ({1,100})": OLD, "0010 (+, length)": NEW}
NAMES = ["default", "a", "x" * 100, "x" * 101, "", "two words", "line\n", "café", "a.b:c-d_e"]
# The payload: 0006's CHECK, or 0011's trigger (its function comes with the migration).
PAYLOAD_FORMS = {
    "0006 (CHECK)": "ALTER TABLE {table} ADD CONSTRAINT {table}_p "
    "CHECK (jsonb_typeof(payload) = 'object')",
    "0011 (trigger)": "CREATE TRIGGER {table}_p AFTER INSERT OR UPDATE OF payload ON {table} "
    "FOR EACH ROW WHEN (jsonb_typeof(NEW.payload) <> 'object') "
    "EXECUTE FUNCTION pgjobs_job_refuse_payload()",
}
# 3,000 md5 digests: 96 kB of text that compresses to about half, stored out of line.
BIG_PAYLOAD = (
    "jsonb_build_object('blob', (SELECT string_agg(md5(g::text || i::text), '') "
    "FROM generate_series(1, 3000) i))"
)
Figures = dict[tuple[str, str], list[float]]


def _timed(cursor: Any, statement: str, rows: int) -> float:
    started = time.perf_counter()
    cursor.execute(statement)
    return (time.perf_counter() - started) / rows * 1e6


def _scratch(cursor: Any, table: str, *changes: str) -> None:
    cursor.execute(f"DROP TABLE IF EXISTS {table}")
    cursor.execute(f"CREATE TABLE {table} (LIKE pgjobs_job INCLUDING ALL)")
    for change in changes:
        cursor.execute(change.replace("{table}", table))


def _queue_round(
    cursor: Any, form: str, condition: str, table: str, rows: int, out: Figures
) -> None:
    alone = _timed(
        cursor,
        f"SELECT count(*) FROM (SELECT 'default' || (g % 7)::text AS queue "
        f"FROM generate_series(1, {rows * 100}) g) s WHERE {condition}",
        rows * 100,
    )
    cursor.execute(f"TRUNCATE {table}")
    insert = _timed(
        cursor,
        f"INSERT INTO {table} (queue, task, payload, priority, max_attempts, run_at) "
        f"SELECT 'default', 'x.y', jsonb_build_object('n', g), 0, 5, now() "
        f"FROM generate_series(1, {rows}) g",
        rows,
    )
    cursor.execute(f"VACUUM {table}")
    update = _timed(cursor, f"UPDATE {table} SET status = 'running', attempts = attempts + 1", rows)
    for part, value in (("alone", alone), ("INSERT", insert), ("UPDATE", update)):
        out.setdefault((form, part), []).append(value)


def _print(title: str, forms: list[str], parts: list[tuple[str, str]], out: Figures) -> None:
    old, new = forms
    print(f"\n{title}\n{'part':40} {old:>16} {new:>16}  ratio")
    for part, label in parts:
        a = statistics.median(out[(old, part)])
        b = statistics.median(out[(new, part)])
        print(f"{label:40} {a:16.2f} {b:16.2f}  {a / b:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000, help="jobs per round (20,000)")
    parser.add_argument(
        "--payload-rows", type=int, default=1_000, help="jobs with 96 kB payloads (1,000)"
    )
    parser.add_argument("--rounds", type=int, default=7, help="rounds (7)")
    args = parser.parse_args()
    rows, big = args.rows, args.payload_rows
    tables = {form: f"pgjobs_check_probe_{i}" for i, form in enumerate([*FORMS, *PAYLOAD_FORMS])}
    out: Figures = {}
    with connection.cursor() as cursor:
        refusals = []
        for form, condition in FORMS.items():
            refused = []
            for name in NAMES:
                cursor.execute(f"SELECT NOT ({condition}) FROM (SELECT %s AS queue) q", [name])
                if cursor.fetchone()[0]:
                    refused.append(name)
            print(f"{form:18} refuses {refused!r}")
            refusals.append(refused)
        if refusals[0] != refusals[1]:
            raise SystemExit("the two forms of the queue-name check refuse different names")
        for form, condition in FORMS.items():
            _scratch(
                cursor,
                tables[form],
                "ALTER TABLE {table} DROP CONSTRAINT IF EXISTS pgjobs_job_queue_check",
                f"ALTER TABLE {{table}} ADD CONSTRAINT {{table}}_q CHECK ({condition})",
            )
        for form, change in PAYLOAD_FORMS.items():
            _scratch(cursor, tables[form], change)
            cursor.execute(
                f"INSERT INTO {tables[form]} (task, payload, run_at) "
                f"SELECT 'x.y', {BIG_PAYLOAD}, now() FROM generate_series(1, {big}) g"
            )
            cursor.execute(f"VACUUM {tables[form]}")
        try:
            for _ in range(args.rounds):
                for form, condition in FORMS.items():
                    _queue_round(cursor, form, condition, tables[form], rows, out)
                for form in PAYLOAD_FORMS:
                    flip = (
                        f"UPDATE {tables[form]} SET status = CASE status WHEN 'queued' "
                        "THEN 'running' ELSE 'queued' END"
                    )
                    out.setdefault((form, "big"), []).append(_timed(cursor, flip, big))
        finally:
            for table in tables.values():
                cursor.execute(f"DROP TABLE IF EXISTS {table}")
    _print(
        f"the queue name: us per row, median of {args.rounds} rounds ({rows:,} rows; the "
        f"condition alone over {rows * 100:,} names)",
        list(FORMS),
        [
            ("alone", "the condition alone"),
            ("INSERT", "INSERT ... SELECT, whole row"),
            ("UPDATE", "UPDATE to running, whole row"),
        ],
        out,
    )
    _print(
        f"the payload: us per row, median of {args.rounds} rounds ({big:,} rows of 96 kB)",
        list(PAYLOAD_FORMS),
        [("big", "UPDATE of the status, whole row")],
        out,
    )


if __name__ == "__main__":
    main()
