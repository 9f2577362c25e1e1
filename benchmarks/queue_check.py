"""What the queue-name CHECK costs each write of a job, in the form 0006 added and 0010's.

Not part of ``benchmarks.run``: a probe to run by hand against a scratch database that has
the schema (``manage.py migrate``). It makes two scratch tables shaped like ``pgjobs_job``
(``LIKE ... INCLUDING ALL``), one with each form of the CHECK and the other constraints as
they are, and drops them at the end::

    DATABASE_URL=postgres://... DJANGO_SETTINGS_MODULE=benchmarks.settings \\
        python -m benchmarks.queue_check [--rows N] [--rounds 7]

Taking turns round by round, it times, per row: the condition alone over ``--rows`` x 100
names; an ``INSERT ... SELECT`` of ``--rows`` jobs into each table (as ``enqueue_many()``
writes them); and an ``UPDATE`` of them all to ``running`` (as a claim writes each row; a
completion pays the same). It prints the medians over the rounds, in microseconds per row,
the old form's against the new one's, and checks that both forms refuse the same names.
"""

from __future__ import annotations

import argparse
import statistics
import time

import django

django.setup()

from django.db import connection  # noqa: E402

OLD = "queue ~ '^[A-Za-z0-9_.:-]{1,100}$'"
NEW = "queue ~ '^[A-Za-z0-9_.:-]+$' AND length(queue) <= 100"
FORMS = {"0006 ({1,100})": OLD, "0010 (+, length)": NEW}
NAMES = ["default", "a", "x" * 100, "x" * 101, "", "two words", "line\n", "café", "a.b:c-d_e"]


def _timed(cursor: object, statement: str, rows: int) -> float:
    started = time.perf_counter()
    cursor.execute(statement)  # type: ignore[attr-defined]
    return (time.perf_counter() - started) / rows * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000, help="jobs per round (20,000)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds (7)")
    args = parser.parse_args()
    rows = args.rows
    tables = {form: f"pgjobs_check_probe_{i}" for i, form in enumerate(FORMS)}
    figures: dict[tuple[str, str], list[float]] = {}
    with connection.cursor() as cursor:
        for form, condition in FORMS.items():
            refused = []
            for name in NAMES:
                cursor.execute(f"SELECT NOT ({condition}) FROM (SELECT %s AS queue) q", [name])
                if cursor.fetchone()[0]:
                    refused.append(name)
            print(f"{form:18} refuses {refused!r}")
            table = tables[form]
            cursor.execute(f"DROP TABLE IF EXISTS {table}")
            cursor.execute(f"CREATE TABLE {table} (LIKE pgjobs_job INCLUDING ALL)")
            cursor.execute(f"ALTER TABLE {table} DROP CONSTRAINT IF EXISTS pgjobs_job_queue_check")
            cursor.execute(f"ALTER TABLE {table} ADD CONSTRAINT {table}_q CHECK ({condition})")
        try:
            for _ in range(args.rounds):
                for form, condition in FORMS.items():
                    table = tables[form]
                    alone = _timed(
                        cursor,
                        f"SELECT count(*) FROM (SELECT 'default' || (g % 7)::text AS queue "
                        f"FROM generate_series(1, {rows * 100}) g) s WHERE {condition}",
                        rows * 100,
                    )
                    cursor.execute(f"TRUNCATE {table}")
                    insert = _timed(
                        cursor,
                        f"INSERT INTO {table} (queue, task, payload, priority, max_attempts, "
                        f"run_at) SELECT 'default', 'x.y', jsonb_build_object('n', g), 0, 5, now() "
                        f"FROM generate_series(1, {rows}) g",
                        rows,
                    )
                    cursor.execute(f"VACUUM {table}")
                    update = _timed(
                        cursor,
                        f"UPDATE {table} SET status = 'running', attempts = attempts + 1",
                        rows,
                    )
                    for part, value in (("alone", alone), ("INSERT", insert), ("UPDATE", update)):
                        figures.setdefault((form, part), []).append(value)
        finally:
            for table in tables.values():
                cursor.execute(f"DROP TABLE IF EXISTS {table}")
    old, new = FORMS
    print(f"\nus per row, median of {args.rounds} rounds ({rows:,} rows; the condition alone")
    print(f"over {rows * 100:,} names)\n")
    print(f"{'part':32} {old:>16} {new:>16}  ratio")
    for part, label in (
        ("alone", "the condition alone"),
        ("INSERT", "INSERT ... SELECT, whole row"),
        ("UPDATE", "UPDATE to running, whole row"),
    ):
        a = statistics.median(figures[(old, part)])
        b = statistics.median(figures[(new, part)])
        print(f"{label:32} {a:16.2f} {b:16.2f}  {a / b:.2f}x")


if __name__ == "__main__":
    main()
