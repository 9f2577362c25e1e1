"""Where one ``enqueue()`` spends its time: each part timed alone, in microseconds per enqueue.

Not part of ``benchmarks.run``: a diagnostic to run by hand against any database that has the
schema (``manage.py migrate``)::

    DATABASE_URL=postgres://... DJANGO_SETTINGS_MODULE=benchmarks.settings \\
        python -m benchmarks.breakdown [--jobs N]

The session runs with ``synchronous_commit = off`` (``--sync``: the server's setting) so
that the WAL flush of each commit (the same for every row here, and the noisiest part on a
shared disk) does not hide the rest.
Each row is the fastest of 5 rounds of N calls, the parts taking turns: the wall time, and
the CPU time of this process (the client's own work: Python, Django, psycopg), which a busy
neighbour on a shared machine disturbs far less than the wall time.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import django

django.setup()

from django.db import connections  # noqa: E402

from django_pgjobs import validation  # noqa: E402
from django_pgjobs.core import enqueue, execute  # noqa: E402
from django_pgjobs.models import Job  # noqa: E402

TASK = "testproject.testjobs.noop"
BARE = (
    "INSERT INTO pgjobs_job (queue, task, payload, priority, max_attempts, run_at) "
    "VALUES (%s, %s, %s::jsonb, %s, %s, now()) RETURNING id"
)
ROUNDS = 5


def _time(n: int, parts: list[tuple[str, Callable[[int], Any]]]) -> list[tuple[str, float, float]]:
    """Microseconds per call of each part, wall and this process's CPU: the parts take turns,
    ``n`` calls each, for ``ROUNDS`` rounds (so a busy neighbour slows all alike); the fastest
    round of each."""
    walls: dict[str, list[float]] = {name: [] for name, _ in parts}
    cpus: dict[str, list[float]] = {name: [] for name, _ in parts}
    for _ in range(ROUNDS):
        for name, step in parts:
            started, cpu = time.perf_counter(), time.process_time()
            for i in range(n):
                step(i)
            walls[name].append((time.perf_counter() - started) / n * 1e6)
            cpus[name].append((time.process_time() - cpu) / n * 1e6)
    return [(name, min(walls[name]), min(cpus[name])) for name, _ in parts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2000, help="calls per round (default 2,000)")
    parser.add_argument(
        "--sync", action="store_true", help="keep the server's synchronous_commit (WAL flush)"
    )
    args = parser.parse_args()
    n = args.jobs
    connection = connections["default"]
    # The same database with server-side binding and prepared statements (docs/enqueue.md).
    prepared = connections["prepared"]
    for each in (connection, prepared):
        each.ensure_connection()
        if not args.sync:
            with each.cursor() as cursor:
                cursor.execute("SET synchronous_commit = off")
    manager = Job.objects
    on_prepared = Job.objects.db_manager("prepared")

    def planned(i: int) -> Any:
        """The client's part of one enqueue: the task's look-up, the checks, the encoding."""
        return manager._plan(
            TASK,
            [{"n": i}],
            queue=None,
            run_at=None,
            delay=None,
            priority=None,
            max_attempts=None,
            timeout=None,
            unique_key=None,
            unique_while=None,
            lock_key=None,
        )

    plan = planned(0)
    params = plan.params | {
        "payload": validation.encode(plan.payloads[0]),
        "lock_key": None,
        "unique_key": None,
    }
    quiet = params | {"notify_channel": None}

    def bare(i: int) -> None:
        with connection.cursor() as cursor:
            cursor.execute(BARE, ["default", TASK, json.dumps({"n": i}), 0, 5])
            cursor.fetchall()

    rows = _time(
        n,
        [
            ("bare INSERT ... RETURNING id (Django cursor)", bare),
            ("enqueue()", lambda i: manager.enqueue(TASK, {"n": i})),
            (
                "enqueue(), server-side binding, prepared",
                lambda i: on_prepared.enqueue(TASK, {"n": i}),
            ),
            (
                "  ENQUEUE_ONE alone (execute.run)",
                lambda i: execute.run(connection, enqueue.ENQUEUE_ONE, params),
            ),
            (
                "  ENQUEUE_ONE alone, prepared",
                lambda i: execute.run(prepared, enqueue.ENQUEUE_ONE, params),
            ),
            (
                "  ENQUEUE_ONE without its NOTIFY",
                lambda i: execute.run(connection, enqueue.ENQUEUE_ONE, quiet),
            ),
            ("  client: _plan() (resolve, validate, encode)", planned),
            ("  client: validation.payload()", lambda i: validation.payload({"n": i})),
        ],
    )
    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE pgjobs_job")
    width = max(len(name) for name, _, _ in rows)
    print(f"{'part':<{width}}  wall us  client CPU us  (per enqueue, fastest of {ROUNDS} x {n})")
    for name, wall, cpu in rows:
        print(f"{name:<{width}}  {wall:7.1f}  {cpu:13.1f}")


if __name__ == "__main__":
    main()
