"""The procrastinate driver of the peer benchmark, run with procrastinate's own virtualenv.

    python procrastinate_driver.py {setup,version,w1,w2-single,w2-bulk,w3} --dsn postgres://... \
        [--jobs N] [--concurrency 8] [--latency-jobs 200] [--gap 0.05] [--warmup 5]

Prints one JSON object on stdout; exits 2 when the run is invalid (a job lost, repeated or
failed). The worker is procrastinate's CLI (``procrastinate_app.py`` holds the app and tasks);
enqueues go through the app opened synchronously (``task.defer()``, ``task.batch_defer()``),
as a Django or other sync caller would. See README.md beside this file.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from importlib.metadata import version
from typing import Any

import psycopg
from _common import (
    Reaper,
    RunInvalid,
    empty_run_cpu,
    install,
    main_guard,
    parser,
    rate,
    run_workers,
    spawn,
    w1_result,
    w3_run,
    worker_env,
)


def cli(*args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "procrastinate",
        "--app=procrastinate_app.app",
        "--log-level=warning",
        *args,
    ]


def app_for(dsn: str) -> Any:
    os.environ["PEERS_DSN"] = dsn
    from procrastinate_app import app

    return app


class Db:
    """An autocommit psycopg connection of the driver's own, for set-up and checks."""

    def __init__(self, dsn: str) -> None:
        self.conn = psycopg.connect(dsn, autocommit=True)

    def close(self) -> None:
        self.conn.close()

    def one(self, query: str, params: Any = None) -> Any:
        row = self.conn.execute(query, params).fetchone()  # type: ignore[arg-type]
        return row[0] if row else None

    def reset(self) -> None:
        self.conn.execute(
            "TRUNCATE procrastinate_jobs, procrastinate_events, "
            "procrastinate_workers, procrastinate_periodic_defers CASCADE"
        )
        self.checkpoint()

    def checkpoint(self) -> None:
        try:
            self.conn.execute("CHECKPOINT")
        except psycopg.errors.InsufficientPrivilege:
            pass

    def check_done(self, n: int, what: str) -> None:
        """Every job succeeded after exactly one start."""
        total, ok = self.conn.execute(
            "SELECT count(*), count(*) FILTER (WHERE status = 'succeeded' AND started = 1) "
            "FROM procrastinate_jobs j, LATERAL (SELECT count(*) AS started "
            "  FROM procrastinate_events e WHERE e.job_id = j.id AND e.type = 'started') s"
        ).fetchone() or (0, 0)
        if total != n or ok != n:
            states = self.conn.execute(
                "SELECT status::text, attempts, count(*) FROM procrastinate_jobs GROUP BY 1, 2"
            ).fetchall()
            raise RunInvalid(
                f"{what}: expected {n} jobs succeeded after one start, found {ok} "
                f"of {total} (status, attempts, count: {states})"
            )

    def check_queued(self, n: int, what: str) -> None:
        found = self.one("SELECT count(*) FROM procrastinate_jobs WHERE status = 'todo'")
        if found != n:
            raise RunInvalid(f"{what}: {found} queued jobs in the table, expected {n}")


def w1(args: Any) -> dict[str, Any]:
    n = args.jobs
    app = app_for(args.dsn)
    db = Db(args.dsn)
    try:
        db.reset()
        with app.open():
            app.tasks["noop"].batch_defer(*({"n": i} for i in range(n)))
        db.conn.execute("ANALYZE procrastinate_jobs")
        db.checkpoint()
        command = cli("worker", "--concurrency", str(args.concurrency), "--one-shot")
        spawned, exited, cpu = run_workers([command], worker_env(args.dsn))
        db.check_done(n, "W1")
        first, last = db.conn.execute(
            "SELECT extract(epoch FROM min(at) FILTER (WHERE type = 'started'))::float8, "
            "extract(epoch FROM max(at) FILTER (WHERE type = 'succeeded'))::float8 "
            "FROM procrastinate_events"
        ).fetchone() or (0.0, 0.0)
        db.reset()
        empty_cpu = empty_run_cpu([command], worker_env(args.dsn))
    finally:
        db.close()
    return w1_result(
        jobs=n,
        concurrency=args.concurrency,
        processes=1,
        spawned=spawned,
        first_start=first,
        last_done=last,
        exited=exited,
        cpu_s=cpu,
        empty_cpu_s=empty_cpu,
        mode="--one-shot",
    )


def _timed_enqueue(args: Any, what: str, enqueue: Callable[[Any, int], int]) -> float:
    """Seconds ``enqueue(noop task, n)`` takes to add ``n`` jobs (checked queued after)."""
    n = args.jobs
    app = app_for(args.dsn)
    db = Db(args.dsn)
    try:
        db.reset()
        with app.open():
            noop = app.tasks["noop"]
            noop.defer(n=-1)  # opens the pool's connection outside the timing
            db.reset()
            started = time.perf_counter()
            added = enqueue(noop, n)
            seconds = time.perf_counter() - started
        if added != n:
            raise RunInvalid(f"{what}: {added} jobs added, expected {n}")
        db.check_queued(n, what)
        db.reset()
    finally:
        db.close()
    return seconds


def w2_single(args: Any) -> dict[str, Any]:
    def each(noop: Any, n: int) -> int:
        for i in range(n):
            noop.defer(n=i)
        return n

    seconds = _timed_enqueue(args, "W2 single", each)
    return rate(args.jobs, seconds, api="task.defer(**kwargs), app opened synchronously")


def w2_bulk(args: Any) -> dict[str, Any]:
    kwargs = [{"n": i} for i in range(args.jobs)]
    seconds = _timed_enqueue(args, "W2 bulk", lambda noop, n: len(noop.batch_defer(*kwargs)))
    return rate(args.jobs, seconds, api="task.batch_defer(*kwargs), app opened synchronously")


def w3(args: Any) -> dict[str, Any]:
    app = app_for(args.dsn)
    db = Db(args.dsn)

    def start() -> Reaper:
        # LISTEN/NOTIFY is on by default (--listen-notify); the polling interval stays at
        # its default as the fallback.
        return Reaper(
            spawn(cli("worker", "--concurrency", str(args.concurrency)), worker_env(args.dsn))
        )

    def enqueue(seq: int, out: str) -> float:
        stamp.defer(seq=seq, out=out)
        return time.time()  # autocommit: the INSERT and its NOTIFY have committed

    try:
        db.reset()
        with app.open():
            stamp = app.tasks["stamp"]
            result = w3_run(args, start, enqueue, listen_notify=True)
        db.check_done(args.warmup + args.latency_jobs, "W3")
        db.reset()
    finally:
        db.close()
    return result


def setup(args: Any) -> dict[str, Any]:
    return install(cli("schema", "--apply"), worker_env(args.dsn), "procrastinate schema --apply")


def main() -> None:
    args = parser("procrastinate driver of the django-pgjobs peer benchmark").parse_args()
    commands = {
        "setup": lambda: setup(args),
        "version": lambda: {
            "version": version("procrastinate"),
            "psycopg": version("psycopg"),
            "python": sys.version.split()[0],
        },
        "w1": lambda: w1(args),
        "w2-single": lambda: w2_single(args),
        "w2-bulk": lambda: w2_bulk(args),
        "w3": lambda: w3(args),
    }
    main_guard(commands[args.command])


if __name__ == "__main__":
    main()
