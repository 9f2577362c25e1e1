"""The django-tasks-db driver of the peer benchmark, run with that peer's own virtualenv.

    python djtasks_driver.py {setup,version,w1,w2-single,w2-bulk,w3} --dsn postgres://... \
        [--jobs N] [--concurrency 8] [--latency-jobs 200] [--gap 0.05] [--warmup 5]

Prints one JSON object on stdout; exits 2 when the run is invalid (a job lost, repeated or
failed). Django's task framework with the ``django_tasks_db.DatabaseBackend`` backend; the
project is ``djtasks_project/``; the worker is the backend's own ``manage.py db_worker``
(``python -m django db_worker``). See README.md beside this file.
"""

from __future__ import annotations

import os
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from _common import (
    Reaper,
    RunInvalid,
    empty_run_cpu,
    main_guard,
    parser,
    rate,
    run_workers,
    spawn,
    w1_result,
    w3_run,
    worker_env,
)

SETTINGS = "djtasks_project.settings"
POLL_INTERVAL = 1.0  # db_worker's default --interval (it has no LISTEN/NOTIFY)


def django_setup(dsn: str) -> None:
    os.environ["PEERS_DSN"] = dsn
    os.environ["DJANGO_SETTINGS_MODULE"] = SETTINGS
    import django

    django.setup()


def worker_command(*extra: str) -> list[str]:
    # -v 0: no log line per task (the django-pgjobs workers of the suite log at WARNING);
    # --no-reload: DEBUG is off anyway, said for clarity.
    return [
        sys.executable,
        "-m",
        "django",
        "db_worker",
        "--settings",
        SETTINGS,
        "--no-reload",
        "-v",
        "0",
        *extra,
    ]


class Db:
    """Set-up and checks through the ORM (the driver's Django connection, autocommit)."""

    def __init__(self) -> None:
        from django.db import connection
        from django_tasks_db.models import DBTaskResult

        self.connection = connection
        self.model = DBTaskResult
        self.table = DBTaskResult._meta.db_table

    def run(self, query: str) -> None:
        with self.connection.cursor() as cursor:
            cursor.execute(query)

    def reset(self) -> None:
        self.run(f'TRUNCATE "{self.table}"')
        self.checkpoint()

    def checkpoint(self) -> None:
        from django.db import DatabaseError

        try:
            self.run("CHECKPOINT")
        except DatabaseError:
            pass

    def check_done(self, n: int, what: str) -> None:
        """Every task successful, run by exactly one worker (one claim)."""
        rows = list(self.model.objects.values_list("status", "worker_ids"))
        ok = sum(1 for status, workers in rows if status == "SUCCESSFUL" and len(workers) == 1)
        if len(rows) != n or ok != n:
            states: dict[tuple[str, int], int] = {}
            for status, workers in rows:
                key = (status, len(workers))
                states[key] = states.get(key, 0) + 1
            raise RunInvalid(
                f"{what}: expected {n} tasks successful after one claim, found "
                f"{ok} of {len(rows)} ((status, claims): count {states})"
            )

    def check_queued(self, n: int, what: str) -> None:
        found = self.model.objects.filter(status="READY").count()
        if found != n:
            raise RunInvalid(f"{what}: {found} ready tasks in the table, expected {n}")

    def span(self) -> tuple[float, float]:
        from django.db.models import Max, Min

        got = self.model.objects.aggregate(first=Min("started_at"), last=Max("finished_at"))
        return got["first"].timestamp(), got["last"].timestamp()


def w1(args: Any) -> dict[str, Any]:
    from django.db import transaction
    from djtasks_project.tasks import noop

    n = args.jobs
    processes = args.concurrency  # db_worker runs one task at a time: concurrency = processes
    db = Db()
    db.reset()
    with transaction.atomic():  # no bulk API: N enqueue() calls in one transaction
        for i in range(n):
            noop.enqueue(n=i)
    db.run(f'ANALYZE "{db.table}"')
    db.checkpoint()
    command = worker_command("--batch", "--no-startup-delay")
    spawned, exited, cpu = run_workers([command] * processes, worker_env(args.dsn))
    db.check_done(n, "W1")
    first, last = db.span()
    db.reset()
    empty_cpu = empty_run_cpu([command] * processes, worker_env(args.dsn))
    return w1_result(
        jobs=n,
        concurrency=processes,
        processes=processes,
        spawned=spawned,
        first_start=first,
        last_done=last,
        exited=exited,
        cpu_s=cpu,
        empty_cpu_s=empty_cpu,
        mode="db_worker --batch, one process per unit of concurrency",
    )


def w2_single(args: Any) -> dict[str, Any]:
    from djtasks_project.tasks import noop

    n = args.jobs
    db = Db()
    db.reset()
    started = time.perf_counter()
    for i in range(n):
        noop.enqueue(n=i)
    seconds = time.perf_counter() - started
    db.check_queued(n, "W2 single")
    db.reset()
    return rate(n, seconds, api="task.enqueue(**kwargs), autocommit")


def w3(args: Any) -> dict[str, Any]:
    from djtasks_project.tasks import stamp

    db = Db()

    def start() -> Reaper:
        return Reaper(
            spawn(
                worker_command("--interval", str(POLL_INTERVAL)),
                worker_env(args.dsn, DJANGO_SETTINGS_MODULE=SETTINGS),
            )
        )

    def enqueue(seq: int, out: str) -> float:
        stamp.enqueue(seq=seq, out=out)
        return time.time()  # autocommit: the INSERT has committed

    db.reset()
    result = w3_run(args, start, enqueue, listen_notify=False, poll_interval_s=POLL_INTERVAL)
    db.check_done(args.warmup + args.latency_jobs, "W3")
    db.reset()
    return result


def setup(args: Any) -> dict[str, Any]:
    from django.core.management import call_command

    call_command("migrate", verbosity=0, interactive=False)
    return {"installed": True}


def versions() -> dict[str, Any]:
    import django

    out = {
        "version": version("django-tasks-db"),
        "django": django.get_version(),
        "psycopg": version("psycopg"),
        "python": sys.version.split()[0],
    }
    try:
        out["django-tasks"] = version("django-tasks")
    except PackageNotFoundError:
        pass
    return out


def main() -> None:
    args = parser("django-tasks-db driver of the django-pgjobs peer benchmark").parse_args()
    django_setup(args.dsn or "postgres://postgres@127.0.0.1:5432/postgres")
    commands = {
        "setup": lambda: setup(args),
        "version": versions,
        "w1": lambda: w1(args),
        "w2-single": lambda: w2_single(args),
        "w2-bulk": lambda: None,  # no bulk API: see README.md
        "w3": lambda: w3(args),
    }
    main_guard(commands[args.command])


if __name__ == "__main__":
    main()
