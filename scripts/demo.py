"""The django-pgjobs demo: the naive claim's double-claim bug, its fix, a real site draining
jobs, a periodic job ticking under two workers, and job control (unique keys, cancel, snooze,
timeouts, the quarantine of a job that kills its worker).

Run it with ``make demo`` (which starts a throwaway PostgreSQL unless ``DATABASE_URL`` is set),
or directly::

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres .venv/bin/python scripts/demo.py

It creates (and leaves behind, for inspection) its own database ``pgjobs_demo`` on the server in
``DATABASE_URL``; any earlier ``pgjobs_demo`` database is dropped first. Exit status 0 means
every check passed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg import sql as pgsql

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DEMO_DB = "pgjobs_demo"
JOBS = 10_000
THREADS = 8
PER_THREAD = JOBS // THREADS  # 1,250 claims each, as in the article's pgbench -c 8 -t 1250
WORKER_TIMEOUT = 600.0  # seconds; a burst worker that runs longer than this is stuck
WORKER_LINES_HEAD = 25  # worker output lines shown as they come; the rest are counted
WORKER_LINES_TAIL = 10  # and the last few shown at the end
PERIODIC_TICKS = 6  # ticks of the every-2-seconds schedule the periodic demo watches
PERIODIC_EVERY = 2

# A worker process with one periodic job, declared only in it: `python -c` runs this, then
# manage.py's command line.
PERIODIC_WORKER = f"""
import sys
from datetime import timedelta

import django

django.setup()
from django_pgjobs import current_job, job, periodic


@periodic(every=timedelta(seconds={PERIODIC_EVERY}), name="demo-heartbeat")
@job(name="demo.heartbeat")
def heartbeat():
    ctx = current_job()
    print(f"ran job {{ctx.id}} for tick {{ctx.scheduled_at:%H:%M:%S}}", flush=True)


from django.core.management import execute_from_command_line

execute_from_command_line(["manage.py", *sys.argv[1:]])
"""

# The source article's naive claim, on our table: the subquery picks an id without locking it.
NAIVE_CLAIM = """
UPDATE pgjobs_job SET status = 'done', attempts = attempts + 1
WHERE id = (SELECT id FROM pgjobs_job WHERE status = 'queued' ORDER BY run_at LIMIT 1)
RETURNING id, attempts
"""
STATUS_TABLE = (
    "SELECT status, count(*), max(attempts) AS max_attempts "
    "FROM pgjobs_job GROUP BY status ORDER BY status"
)


class DemoFailure(Exception):
    """Something the demo checks did not hold; the message says what."""


@dataclass
class RunResult:
    name: str
    seconds: float
    rows: list[tuple[Any, ...]]

    def count(self, status: str) -> int:
        return sum(int(r[1]) for r in self.rows if r[0] == status)

    def max_attempts(self, status: str) -> int:
        return max((int(r[2]) for r in self.rows if r[0] == status), default=0)


# -- output ------------------------------------------------------------------------------


def section(title: str) -> None:
    print()
    print("=" * 100)
    print(title)
    print("=" * 100)


def say(text: str, indent: str = "") -> None:
    """Print one paragraph, wrapped at 100 columns."""
    print(textwrap.fill(text, width=100, initial_indent=indent, subsequent_indent=indent))


def psql_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Format rows as psql's aligned output does: text left, numbers right, headers centred."""
    cells = [["" if v is None else str(v) for v in row] for row in rows]
    numeric = [
        bool(rows) and all(isinstance(row[i], int | float) or row[i] is None for row in rows)
        for i in range(len(headers))
    ]
    widths = [max([len(h), *(len(row[i]) for row in cells)]) for i, h in enumerate(headers)]

    def centred(text: str, width: int) -> str:
        left = (width - len(text)) // 2
        return " " * left + text + " " * (width - len(text) - left)

    lines = [
        "|".join(f" {centred(h, w)} " for h, w in zip(headers, widths, strict=True)).rstrip(),
        "+".join("-" * (w + 2) for w in widths),
    ]
    for row in cells:
        parts = [
            f" {v.rjust(w) if num else v.ljust(w)} "
            for v, w, num in zip(row, widths, numeric, strict=True)
        ]
        lines.append("|".join(parts).rstrip())
    return "\n".join(lines)


def print_status_table(rows: list[tuple[Any, ...]]) -> None:
    print()
    print(psql_table(["status", "count", "max_attempts"], rows))
    print()


def masked(url: str) -> str:
    """The URL without its password, for printing."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


# -- database set-up -----------------------------------------------------------------------


def with_database(url: str, name: str) -> str:
    """The same server URL, pointing at database ``name`` (query options kept)."""
    parts = urlsplit(url)
    if parts.scheme not in ("postgres", "postgresql", "pgsql", "postgis"):
        raise DemoFailure(
            f"DATABASE_URL must be a postgres:// URL, not {masked(url)!r}: the demo needs "
            "PostgreSQL."
        )
    return urlunsplit(parts._replace(path="/" + name))


def create_demo_database(server_url: str) -> str:
    """Drop and re-create ``pgjobs_demo`` on the server; return its URL."""
    admin_url = server_url
    if urlsplit(server_url).path.lstrip("/") == DEMO_DB:
        admin_url = with_database(server_url, "postgres")  # cannot drop the database we are on
    demo_url = with_database(server_url, DEMO_DB)
    try:
        with psycopg.connect(admin_url, autocommit=True, connect_timeout=10) as conn:
            version = conn.execute("SHOW server_version").fetchone()
            conn.execute(
                pgsql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                    pgsql.Identifier(DEMO_DB)
                )
            )
            conn.execute(pgsql.SQL("CREATE DATABASE {}").format(pgsql.Identifier(DEMO_DB)))
    except psycopg.Error as exc:
        raise DemoFailure(
            f"Could not (re)create database {DEMO_DB!r} on {masked(admin_url)}: {exc}".strip()
        ) from exc
    print(f"PostgreSQL {version[0] if version else '?'} at {masked(server_url)}")
    print(f"Created database {DEMO_DB!r}: {masked(demo_url)}")
    return demo_url


def setup_django(demo_url: str) -> None:
    os.environ["DATABASE_URL"] = demo_url
    os.environ["DJANGO_SETTINGS_MODULE"] = "testproject.settings"
    import django
    from django.core.management import call_command

    django.setup()
    started = time.perf_counter()
    call_command("migrate", verbosity=0, interactive=False)
    print(f"Ran migrate ({time.perf_counter() - started:.1f} s).")


def status_rows(demo_url: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(demo_url, autocommit=True) as conn:
        return conn.execute(STATUS_TABLE).fetchall()


def reset_jobs(demo_url: str) -> None:
    with psycopg.connect(demo_url, autocommit=True) as conn:
        conn.execute("TRUNCATE pgjobs_job")


def enqueue_noops() -> None:
    from django_pgjobs.models import Job

    started = time.perf_counter()
    # The naive claim adds an attempt per claim however often it takes one job: leave room
    # for every claim of the run (the table refuses attempts beyond max_attempts).
    ids = Job.objects.enqueue_many(
        "testproject.testjobs.noop", [{"n": i} for i in range(JOBS)], max_attempts=JOBS
    )
    if len(ids) != JOBS:
        raise DemoFailure(f"enqueue_many returned {len(ids)} ids, expected {JOBS}.")
    print(
        f"Enqueued {JOBS:,} jobs of testproject.testjobs.noop with one enqueue_many() "
        f"({time.perf_counter() - started:.2f} s)."
    )


# -- the two claim races -------------------------------------------------------------------


def race(
    worker: Callable[[], int], setup: Callable[[], None], teardown: Callable[[], None]
) -> tuple[float, int]:
    """Run ``worker`` PER_THREAD times in each of THREADS threads, started together.

    ``setup`` and ``teardown`` run in each thread around the timed loop (connect, close).
    Returns the seconds from the barrier to the last thread's end and the rows claimed.
    """
    start: list[float] = []
    barrier = threading.Barrier(THREADS, action=lambda: start.append(time.perf_counter()))
    errors: list[BaseException] = []
    claimed = [0] * THREADS

    def run(index: int) -> None:
        try:
            setup()
            barrier.wait()
            for _ in range(PER_THREAD):
                claimed[index] += worker()
        except threading.BrokenBarrierError:
            pass  # another thread failed before the start; its error is reported
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()
        finally:
            try:
                teardown()
            except BaseException as exc:
                errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), name=f"claimer-{i}") for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ended = time.perf_counter()
    if errors:
        raise DemoFailure(f"A claiming thread failed: {errors[0]!r}") from errors[0]
    return ended - start[0], sum(claimed)


def naive_run(demo_url: str) -> RunResult:
    local = threading.local()

    def setup() -> None:
        local.conn = psycopg.connect(demo_url, autocommit=True)

    def claim() -> int:
        return len(local.conn.execute(NAIVE_CLAIM).fetchall())

    def teardown() -> None:
        conn = getattr(local, "conn", None)
        if conn is not None:
            conn.close()

    seconds, claimed = race(claim, setup, teardown)
    rows = status_rows(demo_url)
    print(
        f"{THREADS} threads x {PER_THREAD:,} naive claims: {claimed:,} claims returned a row "
        f"in {seconds:.2f} s."
    )
    return RunResult("naive UPDATE ... WHERE id = (SELECT ... LIMIT 1)", seconds, rows)


def api_run(demo_url: str) -> RunResult:
    from django.db import connection

    from django_pgjobs.models import Job

    def claim() -> int:
        jobs = Job.objects.claim(limit=1)
        for job in jobs:
            if not Job.objects.complete(job.id, job.attempts):
                raise DemoFailure(f"complete() of job {job.id} was fenced out")
        return len(jobs)

    def setup() -> None:
        connection.ensure_connection()  # this thread's own connection (looked up per call)

    def teardown() -> None:
        connection.close()

    seconds, claimed = race(claim, setup, teardown)
    rows = status_rows(demo_url)
    print(
        f"{THREADS} threads x {PER_THREAD:,} x (Job.objects.claim(limit=1) + complete()): "
        f"{claimed:,} jobs claimed in {seconds:.2f} s."
    )
    return RunResult("Job.objects.claim() + complete()", seconds, rows)


# -- the real site -------------------------------------------------------------------------


@dataclass
class SiteResult:
    enqueue_seconds: float
    worker_seconds: float
    done: int
    failed: int
    other: int
    max_attempts: int
    unconfirmed: int
    returncode: int


def post_orders() -> float:
    from django.test import Client

    client = Client()
    started = time.perf_counter()
    for i in range(JOBS):
        response = client.post(
            "/orders/",
            {"email": f"customer{i}@example.com", "total_cents": 1000 + i},
            content_type="application/json",
        )
        if response.status_code != 201:
            raise DemoFailure(
                f"POST /orders/ #{i} answered {response.status_code}: {response.content[:500]!r}"
            )
        if (i + 1) % 2500 == 0:
            print(f"  {i + 1:>6,} orders placed ({time.perf_counter() - started:.1f} s)")
    return time.perf_counter() - started


def run_worker(demo_url: str) -> tuple[int, float]:
    """Run ``manage.py runjobs --burst`` as a real process; stream its output, prefixed."""
    command = [
        sys.executable,
        "manage.py",
        "runjobs",
        "--burst",
        "--concurrency",
        str(THREADS),
        "--queue",
        "emails",
    ]
    env = {**os.environ, "DATABASE_URL": demo_url, "PYTHONUNBUFFERED": "1"}
    # Per-job INFO lines would bury the demo; warnings and errors still show.
    env.setdefault("PGJOBS_LOG_LEVEL", "WARNING")
    print(f"$ DATABASE_URL={masked(demo_url)} {' '.join(['python', *command[1:]])}")
    started = time.perf_counter()
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    )
    tail: list[str] = []
    hidden = [0]

    def pump() -> None:
        assert proc.stdout is not None
        shown = 0
        for line in proc.stdout:
            if shown < WORKER_LINES_HEAD:
                print(f"  [worker] {line.rstrip()}", flush=True)
                shown += 1
            else:
                hidden[0] += 1
                tail.append(line.rstrip())
                del tail[:-WORKER_LINES_TAIL]

    reader = threading.Thread(target=pump, name="worker-output", daemon=True)
    reader.start()
    try:
        returncode = proc.wait(timeout=WORKER_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise DemoFailure(
            f"The worker was still running after {WORKER_TIMEOUT:.0f} s in --burst mode; killed it."
        ) from None
    seconds = time.perf_counter() - started
    reader.join(timeout=10)
    if hidden[0]:
        skipped = hidden[0] - len(tail)
        if skipped:
            print(f"  [worker] ... {skipped:,} more lines ...")
        for line in tail:
            print(f"  [worker] {line}")
    return returncode, seconds


def periodic_run(demo_url: str) -> list[tuple[Any, ...]]:
    """Two real workers run the scheduler; print each tick's enqueue as their logs say it."""
    reset_jobs(demo_url)
    say(
        "Both workers declare `@periodic(every=timedelta(seconds=2))` and both run the "
        "scheduler; the database decides which one's tick becomes the job. Each line below is "
        "a worker's log of a tick it enqueued: one line per tick, never two."
    )
    env = {**os.environ, "DATABASE_URL": demo_url, "PYTHONUNBUFFERED": "1"}
    env["PGJOBS_LOG_LEVEL"] = "INFO"
    env.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
    workers = []
    pumps = []
    for number in (1, 2):
        proc = subprocess.Popen(
            [sys.executable, "-c", PERIODIC_WORKER, "runjobs", "--concurrency", "1"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
        )
        workers.append(proc)

        def pump(proc: subprocess.Popen[str] = proc, number: int = number) -> None:
            assert proc.stderr is not None
            for line in proc.stderr:
                if "enqueued as job" in line or "Error" in line or " ERROR " in line:
                    message = line.rstrip().split("django_pgjobs.scheduler: ")[-1]
                    print(f"  [worker {number}] {message}", flush=True)

        thread = threading.Thread(target=pump, daemon=True)
        thread.start()
        pumps.append(thread)
    count = (
        "SELECT count(DISTINCT scheduled_at) FROM pgjobs_job "
        "WHERE schedule = 'demo-heartbeat' AND status = 'done'"
    )
    deadline = time.monotonic() + 60
    with psycopg.connect(demo_url, autocommit=True) as conn:
        while (conn.execute(count).fetchone() or [0])[0] < PERIODIC_TICKS:
            if time.monotonic() > deadline or any(w.poll() is not None for w in workers):
                break
            time.sleep(0.2)
        for proc in workers:
            proc.send_signal(signal.SIGTERM)
        for proc in workers:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        for thread in pumps:
            thread.join(timeout=5)
        rows = conn.execute(
            "SELECT scheduled_at, count(*) FROM pgjobs_job WHERE schedule = 'demo-heartbeat' "
            "GROUP BY scheduled_at ORDER BY scheduled_at"
        ).fetchall()
    print()
    print(psql_table(["tick", "jobs"], [(f"{row[0]:%H:%M:%S}", row[1]) for row in rows]))
    return [tuple(row) for row in rows]


def site_run(demo_url: str) -> SiteResult:
    from django.core.management import get_commands

    from testproject.shop.models import Order

    reset_jobs(demo_url)
    print(
        f"POST /orders/ {JOBS:,} times through Django's test Client: each request saves an "
        "Order and enqueues"
    )
    print("send_confirmation(order_id) on queue 'emails' in the same transaction.")
    enqueue_seconds = post_orders()
    print(
        f"Placed {JOBS:,} orders in {enqueue_seconds:.2f} s: "
        f"{JOBS / enqueue_seconds:,.0f} requests (and enqueues) per second."
    )
    print()

    if "runjobs" not in get_commands():
        raise DemoFailure(
            "manage.py has no 'runjobs' command: the worker (django_pgjobs/management/commands/"
            "runjobs.py) is missing from this checkout."
        )
    returncode, worker_seconds = run_worker(demo_url)
    with psycopg.connect(demo_url, autocommit=True) as conn:
        rows = conn.execute(STATUS_TABLE).fetchall()
        unconfirmed_row = conn.execute(
            "SELECT count(*) FROM shop_order WHERE confirmation_sent_at IS NULL"
        ).fetchone()
    unconfirmed = int(unconfirmed_row[0]) if unconfirmed_row else -1
    print(
        f"Worker exited with status {returncode} after {worker_seconds:.2f} s "
        "(wall time, including process start-up)."
    )
    print_status_table(rows)
    result = SiteResult(
        enqueue_seconds=enqueue_seconds,
        worker_seconds=worker_seconds,
        done=sum(int(r[1]) for r in rows if r[0] == "done"),
        failed=sum(int(r[1]) for r in rows if r[0] == "failed"),
        other=sum(int(r[1]) for r in rows if r[0] not in ("done", "failed")),
        max_attempts=max((int(r[2]) for r in rows), default=0),
        unconfirmed=unconfirmed,
        returncode=returncode,
    )
    orders = Order.objects.count()
    print(
        f"done {result.done:,}, failed {result.failed:,}, not finished {result.other:,}; "
        f"max attempts {result.max_attempts}."
    )
    print(
        f"{result.done / worker_seconds:,.0f} jobs per second "
        f"({THREADS} worker threads, one process)."
    )
    print(
        f"Orders: {orders:,}; confirmation_sent_at set on {orders - unconfirmed:,}, "
        f"missing on {unconfirmed:,}."
    )
    return result


# -- job control -------------------------------------------------------------------------

CONTROL_QUEUE = "control"
CRASH_QUEUE = "crashy"
BYSTANDERS = 12  # jobs queued beside the one that kills its worker
MAX_RESTARTS = 10  # worker restarts the quarantine demo allows before it calls it stuck


@dataclass
class ControlResult:
    problems: list[str]
    deaths: int


def job_row(demo_url: str, job_id: int) -> dict[str, Any]:
    with psycopg.connect(demo_url, autocommit=True) as conn:
        cursor = conn.execute(
            "SELECT id, task, status, attempts, snoozes, crashes, last_error FROM pgjobs_job "
            "WHERE id = %s",
            [job_id],
        )
        names = [column.name for column in cursor.description or []]
        row = cursor.fetchone()
    if row is None:
        raise DemoFailure(f"Job {job_id} is gone from the table.")
    return dict(zip(names, row, strict=True))


def wait_for(demo_url: str, job_id: int, statuses: tuple[str, ...], seconds: float = 60) -> str:
    """Wait (on the table) until the job reaches one of ``statuses``; return the one it has."""
    deadline = time.monotonic() + seconds
    while (status := job_row(demo_url, job_id)["status"]) not in statuses:
        if time.monotonic() > deadline:
            raise DemoFailure(f"Job {job_id} was still {status} after {seconds:.0f} s.")
        time.sleep(0.1)
    return status


def show_jobs(demo_url: str, ids: Sequence[int]) -> None:
    rows = [job_row(demo_url, job_id) for job_id in ids]
    print()
    print(
        psql_table(
            ["id", "task", "status", "attempts", "snoozes", "crashes", "last error"],
            [
                (
                    r["id"],
                    r["task"],
                    r["status"],
                    r["attempts"],
                    r["snoozes"],
                    r["crashes"],
                    (r["last_error"] or "").strip().splitlines()[-1:][0][:60]
                    if r["last_error"]
                    else "",
                )
                for r in rows
            ],
        )
    )
    print()


def worker_command(*args: str) -> list[str]:
    return [sys.executable, "manage.py", "runjobs", "--no-schedule", *args]


def burst(env: dict[str, str], *args: str) -> int:
    """Run ``runjobs --burst`` once, quietly; return its exit status."""
    return subprocess.run(
        worker_command("--burst", *args),
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=False,
    ).returncode


def control_run(demo_url: str) -> ControlResult:
    import logging

    from django_pgjobs.models import Job

    # The manager logs each cancel at INFO; the tables below say the same.
    logging.getLogger("django_pgjobs").setLevel(logging.WARNING)
    reset_jobs(demo_url)
    problems: list[str] = []
    env = {**os.environ, "DATABASE_URL": demo_url, "PYTHONUNBUFFERED": "1"}
    env["PGJOBS_LOG_LEVEL"] = "WARNING"

    say("Unique jobs: the same key enqueued three times while the first is still waiting.")
    first, *again = (
        Job.objects.enqueue(
            "testproject.testjobs.noop", {"invoice": 42}, queue=CRASH_QUEUE, unique_key="invoice:42"
        )
        for _ in range(3)
    )
    for job in (first, *again):
        print(f"  enqueue(noop, unique_key='invoice:42') -> job {job.id}, created={job.created}")
    if not first.created or any(j.created or j.id != first.id for j in again):
        problems.append("a unique key was enqueued twice")
    Job.objects.cancel([first.id])

    print()
    say(
        "Cancel, snooze and timeout under a real worker (`runjobs --queue control --lease 3`, "
        "so its heartbeat comes every second):"
    )
    doomed = Job.objects.enqueue("demo.until_stopped", queue=CONTROL_QUEUE, delay=3600)
    print(f"  job {doomed.id} queued for later; cancel([{doomed.id}]) -> ", end="")
    print(Job.objects.cancel([doomed.id]))
    running = Job.objects.enqueue("demo.until_stopped", queue=CONTROL_QUEUE)
    snoozer = Job.objects.enqueue("demo.rate_limited", queue=CONTROL_QUEUE)
    hung = Job.objects.enqueue("demo.hangs", queue=CONTROL_QUEUE)
    worker = subprocess.Popen(
        worker_command("--queue", CONTROL_QUEUE, "--lease", "3", "--concurrency", "3"),
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(demo_url, running.id, ("running",))
        print(f"  job {running.id} is running; cancel([{running.id}]) -> ", end="")
        print(Job.objects.cancel([running.id]))
        wait_for(demo_url, snoozer.id, ("done", "failed"))
        wait_for(demo_url, hung.id, ("failed",))
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(timeout=60)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
    show_jobs(demo_url, [doomed.id, running.id, snoozer.id, hung.id])
    expected = {
        doomed.id: ("cancelled", 0),
        running.id: ("cancelled", 1),
        snoozer.id: ("done", 1),
        hung.id: ("failed", 1),
    }
    for job_id, (status, attempts) in expected.items():
        row = job_row(demo_url, job_id)
        if (row["status"], row["attempts"]) != (status, attempts):
            problems.append(
                f"job {job_id} ({row['task']}) ended {row['status']} after {row['attempts']} "
                f"attempts, expected {status} after {attempts}"
            )
    if job_row(demo_url, snoozer.id)["snoozes"] != 1:
        problems.append("the rate-limited job did not snooze exactly once")
    if "JobTimeout" not in (job_row(demo_url, hung.id)["last_error"] or ""):
        problems.append("the hung job's error is not a JobTimeout")

    say(
        f"Quarantine: one job that takes its worker down (os._exit) among {BYSTANDERS} "
        "ordinary ones, max_attempts=25. A supervisor loop restarts `runjobs --burst --lease 2` "
        "each time a worker dies:"
    )
    killer = Job.objects.enqueue("demo.kills_its_worker", queue=CRASH_QUEUE)
    bystanders = Job.objects.enqueue_many(
        "testproject.testjobs.noop", [{"n": n} for n in range(BYSTANDERS)], queue=CRASH_QUEUE
    )
    deaths = 0
    for _ in range(MAX_RESTARTS):
        if job_row(demo_url, killer.id)["status"] == "failed":
            break
        code = burst(env, "--queue", CRASH_QUEUE, "--lease", "2", "--concurrency", "4")
        if code != 0:
            deaths += 1
            print(f"  worker died (exit status {code}); restarting it")
        # The dead worker's leases run out before the next one can reap them.
        time.sleep(2.5)
    drained = burst(env, "--queue", CRASH_QUEUE, "--lease", "2")
    show_jobs(demo_url, [killer.id])
    with psycopg.connect(demo_url, autocommit=True) as conn:
        done = conn.execute(
            "SELECT count(*) FROM pgjobs_job WHERE id = ANY(%s) AND status = 'done'",
            [list(bystanders)],
        ).fetchone()
    done_count = done[0] if done else 0
    print(f"  the {BYSTANDERS} jobs queued beside it: {done_count} done")
    killer_row = job_row(demo_url, killer.id)
    if killer_row["status"] != "failed" or killer_row["crashes"] != 2 or drained != 0:
        problems.append(
            f"the job that kills its worker ended {killer_row['status']} with "
            f"{killer_row['crashes']} crashes (expected failed after 2)"
        )
    if done_count != BYSTANDERS:
        problems.append(f"{BYSTANDERS - done_count} jobs queued beside the killer did not finish")
    return ControlResult(problems, deaths)


# -- queues and limits -------------------------------------------------------------------

STEERED_QUEUE = "steered"
KEYED_QUEUE = "keyed"


def most_running(demo_url: str, queue: str, until: Callable[[], bool]) -> int:
    """Watch ``queue``'s running count until ``until()``; return the largest seen."""
    most = 0
    with psycopg.connect(demo_url, autocommit=True) as conn:
        while not until():
            row = conn.execute(
                "SELECT count(*) FROM pgjobs_job WHERE queue = %s AND status = 'running'", [queue]
            ).fetchone()
            most = max(most, row[0] if row else 0)
            time.sleep(0.005)
    return most


def queues_run(demo_url: str) -> list[str]:
    import logging

    from django_pgjobs.models import Job
    from django_pgjobs.ops import dashboard

    logging.getLogger("django_pgjobs").setLevel(logging.WARNING)
    reset_jobs(demo_url)
    problems: list[str] = []
    env = {**os.environ, "DATABASE_URL": demo_url, "PGJOBS_LOG_LEVEL": "WARNING"}

    ids = Job.objects.enqueue_many(
        "testproject.testjobs.sleep", [{"seconds": 0.05}] * 24, queue=STEERED_QUEUE
    )
    Job.objects.pause(STEERED_QUEUE)
    burst(env, "--queue", STEERED_QUEUE)
    paused = Job.objects.filter(id__in=ids, status="queued").count()
    print(
        f"  pause('{STEERED_QUEUE}'), then `runjobs --burst`: {paused} of {len(ids)} still queued"
    )
    if paused != len(ids):
        problems.append("a paused queue's job ran")

    Job.objects.resume(STEERED_QUEUE)
    Job.objects.set_limits(STEERED_QUEUE, concurrency=2)
    print(
        f"  resume('{STEERED_QUEUE}'); set_limits('{STEERED_QUEUE}', concurrency=2); "
        "two workers of --concurrency 4 each:"
    )
    workers = [
        subprocess.Popen(
            worker_command("--queue", STEERED_QUEUE, "--concurrency", "4", "--poll-interval", "1"),
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(2)
    ]
    try:
        most = most_running(
            demo_url,
            STEERED_QUEUE,
            lambda: Job.objects.filter(id__in=ids, status="done").count() == len(ids),
        )
        with psycopg.connect(demo_url, autocommit=True) as conn:
            # (The workers killed in section 4 are listed until their rows expire.)
            live = [row for row in conn.execute(dashboard.LIVE_WORKERS) if STEERED_QUEUE in row[4]]
        print(f"  most '{STEERED_QUEUE}' jobs running at once: {most} (the limit is 2)")
        print(f"  live workers of '{STEERED_QUEUE}' in pgjobs_worker while they ran: {len(live)}")
        for row in live:
            print(f"    {row[0]} on {row[1]}, pid {row[2]}, {row[3]} mode, queues {row[4]}")
        if most > 2 or len(live) != 2:
            problems.append(f"{most} limited jobs ran at once, {len(live)} live workers")
    finally:
        for worker in workers:
            worker.send_signal(signal.SIGTERM)
        for worker in workers:
            worker.wait(timeout=60)

    keyed = Job.objects.enqueue_many(
        "testproject.testjobs.sleep",
        [{"seconds": 0.02, "n": n} for n in range(30)],
        queue=KEYED_QUEUE,
        lock_key=lambda payload: f"customer:{payload['n'] % 3}",
    )
    unknown = Job.objects.enqueue("testproject.testjobs.noop", queue=KEYED_QUEUE)
    with psycopg.connect(demo_url, autocommit=True) as conn:
        # As if enqueued by newer code, whose task this worker has not registered.
        conn.execute(
            "UPDATE pgjobs_job SET task = 'newcode.send_invoice' WHERE id = %s", [unknown.id]
        )
    burst(env, "--queue", KEYED_QUEUE, "--concurrency", "6")
    with psycopg.connect(demo_url, autocommit=True) as conn:
        overlaps = conn.execute(
            "SELECT count(*) FROM pgjobs_job a JOIN pgjobs_job b ON a.lock_key = b.lock_key "
            "AND a.id < b.id WHERE a.id = ANY(%(ids)s) AND b.id = ANY(%(ids)s) "
            "AND a.attempted_at < b.finished_at AND b.attempted_at < a.finished_at",
            {"ids": list(keyed)},
        ).fetchone()
        left = conn.execute("SELECT status FROM pgjobs_job WHERE id = %s", [unknown.id]).fetchone()
    done = Job.objects.filter(id__in=keyed, status="done").count()
    print(
        f"  30 jobs over 3 lock keys, one worker of --concurrency 6: {done} done, "
        f"{overlaps[0] if overlaps else '?'} pairs of one key overlapping"
    )
    print(f"  a job of a task this worker does not know: left {left[0] if left else '?'}")
    if done != len(keyed) or not overlaps or overlaps[0] != 0:
        problems.append("jobs of one lock key overlapped, or did not all finish")
    if not left or left[0] != "queued":
        problems.append("a job of an unregistered task was claimed")
    return problems


def spread_run(demo_url: str) -> list[str]:
    """``runjobs --processes 2`` on CPU-bound jobs, ``async def`` jobs on the event loop, and
    completions written with the claims: what ran them, how long they took, and that each ran
    once."""
    from django_pgjobs.models import Job
    from testproject import ride_audit
    from testproject.asyncjobs import computes, waits

    problems: list[str] = []
    env = {
        **os.environ,
        "DATABASE_URL": demo_url,
        "PGJOBS_LOG_LEVEL": "WARNING",
        "PGJOBS_IMPORTS": "testproject.asyncjobs",
    }

    def run_of(
        label: str, count: int, *args: str, settings: dict[str, str] | None = None
    ) -> tuple[float, int]:
        """Drain the queue with one ``runjobs --burst`` (``settings``: ``PGJOBS_*`` variables
        for it); (span in s, workers that ran jobs)."""
        started = time.perf_counter()
        code = burst({**env, **(settings or {})}, *args)
        wall = time.perf_counter() - started
        with psycopg.connect(demo_url, autocommit=True) as conn:
            done, once, workers, span = conn.execute(
                "SELECT count(*) FILTER (WHERE status = 'done'), "
                "count(*) FILTER (WHERE attempts = 1), "
                "count(DISTINCT worker_ids ->> -1), "
                "extract(epoch FROM max(finished_at) - min(started_at))::float8 "
                "FROM pgjobs_job"
            ).fetchone() or (0, 0, 0, 0.0)
        print(
            f"  {label}: {done:,} of {count:,} done in {wall:.2f} s (first start to last "
            f"finish {span:.2f} s), by {workers} worker process(es)"
        )
        if code != 0 or done != count or once != count:
            problems.append(f"{label}: exit {code}, {done} done, {once} after one attempt")
        reset_jobs(demo_url)
        return span, workers

    reset_jobs(demo_url)
    say("CPU-bound jobs (a few ms of pure Python each): one process, then two on the same cores.")
    Job.objects.enqueue_many(computes, [{}] * 600)
    one, _ = run_of("--processes 1 --concurrency 4", 600, "--processes", "1", "--concurrency", "4")
    Job.objects.enqueue_many(computes, [{}] * 600)
    two, workers = run_of(
        "--processes 2 --concurrency 2", 600, "--processes", "2", "--concurrency", "2"
    )
    say(
        f"Two processes ran them {one / two:.2f}x as fast as one: Python runs one thread at a "
        "time per process, so jobs that compute need processes, not threads (how much the "
        "second helps depends on the second core being free)."
    )
    if workers != 2:
        problems.append(f"--processes 2: {workers} worker process(es) ran jobs, expected 2")

    print()
    say("2,000 async def jobs that each await 0.2 s of I/O, on the event loop, 100 at once:")
    Job.objects.enqueue_many(waits, [{"seconds": 0.2}] * 2000)
    span, _ = run_of(
        "--async-concurrency 100", 2000, "--async-concurrency", "100", "--concurrency", "4"
    )
    say(
        f"Ideal: 2,000 x 0.2 s / 100 = 4.00 s; the loop took {span:.2f} s with one thread for "
        "all of them (8 threads of sync jobs would need 50 s)."
    )

    print()
    say(
        "2,000 no-op jobs, two processes, with PGJOBS['COMPLETE_WITH_CLAIM'] on: a busy worker "
        "writes its completions in the statement of its next claim (one commit where there "
        "were two)."
    )
    # Every transaction that updates jobs notes how many it finished and how many it claimed.
    with psycopg.connect(demo_url, autocommit=True) as conn:
        for statement in ride_audit.INSTALL:
            conn.execute(statement)
        try:
            Job.objects.enqueue_many("testproject.testjobs.noop", [{"n": n} for n in range(2000)])
            run_of(
                "COMPLETE_WITH_CLAIM",
                2000,
                "--processes",
                "2",
                "--concurrency",
                "4",
                settings={"PGJOBS_COMPLETE_WITH_CLAIM": "true"},
            )
            both, rode, finished = conn.execute(ride_audit.COUNTS).fetchone() or (0, 0, 0)
        finally:
            for statement in ride_audit.REMOVE:
                conn.execute(statement)
    say(
        f"{rode:,} of the {finished:,} completions were written by {both:,} transactions that "
        "also claimed the next jobs; each completion still fenced on its claim."
    )
    if both == 0 or finished != 2000:
        problems.append(f"COMPLETE_WITH_CLAIM: {both} transactions rode, {finished} completions")
    return problems


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def scraped(text: str, name: str, **labels: str) -> float:
    """The value of one sample of a Prometheus text exposition (0 when it is absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def monitoring_run(demo_url: str) -> list[str]:
    import json
    import secrets
    import urllib.request
    from datetime import timedelta

    from django.conf import settings
    from django.db import transaction
    from django.test import Client

    from django_pgjobs.models import Job
    from django_pgjobs.ops.explain import explain
    from django_pgjobs.testing import advance, assert_enqueued, run_jobs

    reset_jobs(demo_url)
    problems: list[str] = []

    # The testing helpers, as a TestCase uses them: inside a transaction that is rolled back.
    with transaction.atomic():
        Job.objects.enqueue("testproject.testjobs.noop", {"n": 1})
        Job.objects.enqueue("testproject.testjobs.boom", {"message": "card declined"})
        assert_enqueued("testproject.testjobs.noop", n=1)
        first = run_jobs()
        advance(timedelta(minutes=5))  # the test clock: the retry is due, no sleeping
        second = run_jobs()
        transaction.set_rollback(True)
    print("  run_jobs() inside a transaction, then advance(5 min) and run_jobs() again:")
    for outcome in (*first, *second):
        print(
            f"    {outcome.task} attempt {outcome.attempts}: {outcome.outcome}",
            outcome.error or "",
        )
    if [o.outcome for o in first] != ["done", "retry"] or [o.outcome for o in second] != ["failed"]:
        problems.append("run_jobs() outcomes were not done, retry, then failed")

    # Why isn't this job running? One job in a paused queue, one deferred.
    Job.objects.pause(STEERED_QUEUE)
    waiting = Job.objects.enqueue("testproject.testjobs.noop", {}, queue=STEERED_QUEUE)
    later = Job.objects.enqueue("testproject.testjobs.noop", {}, delay=timedelta(hours=1))
    for label, held in (("paused queue", waiting), ("deferred", later)):
        reasons = explain(held)
        print(f"  explain(job {held.id}, {label}):")
        for reason in reasons:
            print(f"    [{reason.code}] {reason.message}")
    if "paused" not in {r.code for r in explain(waiting)}:
        problems.append("explain() did not say the queue is paused")

    # A worker with its own metrics, and the queue's metrics and health views.
    port = free_port()
    env = {**os.environ, "DATABASE_URL": demo_url, "PGJOBS_LOG_LEVEL": "WARNING"}
    ids = Job.objects.enqueue_many("testproject.testjobs.noop", [{"n": n} for n in range(50)])
    worker = subprocess.Popen(
        worker_command("--metrics-port", str(port), "--poll-interval", "1"),
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while Job.objects.filter(id__in=ids, status="done").count() < len(ids):
            if time.monotonic() > deadline:
                raise DemoFailure("the metrics worker did not run its 50 jobs within 60 s")
            time.sleep(0.1)
        text = ""
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    text = r.read().decode()
            except OSError:
                time.sleep(0.1)
                continue
            if scraped(text, "pgjobs_worker_jobs_finished_total", outcome="done") >= len(ids):
                break
            time.sleep(0.1)
        done = scraped(
            text,
            "pgjobs_worker_jobs_finished_total",
            task="testproject.testjobs.noop",
            outcome="done",
        )
        print(
            f"  runjobs --metrics-port {port}: "
            f"pgjobs_worker_jobs_finished_total{{outcome=done}} {done:.0f}"
        )
        if done != len(ids):
            problems.append(f"the worker's metrics counted {done:.0f} done jobs, not {len(ids)}")

        token = secrets.token_urlsafe(24)
        settings.PGJOBS = {**settings.PGJOBS, "MONITORING_TOKEN": token}
        client = Client()
        refused = client.get("/pgjobs/health")
        metrics = client.get("/pgjobs/metrics", HTTP_AUTHORIZATION=f"Bearer {token}")
        ready = scraped(metrics.content.decode(), "pgjobs_queue_ready_jobs", queue=STEERED_QUEUE)
        print(f"  GET /pgjobs/health without the token: HTTP {refused.status_code}")
        print(
            f"  GET /pgjobs/metrics: pgjobs_queue_ready_jobs{{queue={STEERED_QUEUE}}} {ready:.0f}"
        )
        health = client.get("/pgjobs/health", HTTP_AUTHORIZATION=f"Bearer {token}")
        body = json.loads(health.content)
        print(
            f"  GET /pgjobs/health with it: HTTP {health.status_code} (a paused queue is not "
            f"an outage), paused {body['paused']}"
        )
        for problem in body["problems"]:
            print(f"    problem: {problem}")
        if refused.status_code not in (401, 403) or ready != 1 or health.status_code != 200:
            problems.append("the monitoring views refused nothing or miscounted the paused job")
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=60)
        Job.objects.resume(STEERED_QUEUE)
    return problems


# -- main ----------------------------------------------------------------------------------


def main() -> int:
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    server_url = os.environ.get("DATABASE_URL", "")
    if not server_url:
        raise DemoFailure(
            "DATABASE_URL is not set. Run `make demo` (it starts a throwaway PostgreSQL), or set "
            "DATABASE_URL=postgres://USER@HOST:PORT/DBNAME."
        )
    total_started = time.perf_counter()

    section("0. Set-up")
    demo_url = create_demo_database(server_url)
    setup_django(demo_url)

    section("1. The naive claim's race: 8 workers x 1,250 claims against 10,000 queued jobs")
    print("The naive claim (one statement, so it looks atomic):")
    print(textwrap.indent(NAIVE_CLAIM.strip(), "    "))
    print()
    enqueue_noops()
    naive = naive_run(demo_url)
    print_status_table(naive.rows)
    say(
        "Why: the subquery picks an id without locking it; the UPDATE waits for that row's lock, "
        "then under READ COMMITTED re-checks only `id = X`, which still matches, so several "
        "workers claim the same job while others stay queued."
    )

    print()
    print(
        "Now the same race with django-pgjobs (CTE ... FOR UPDATE SKIP LOCKED), after "
        "TRUNCATE pgjobs_job:"
    )
    reset_jobs(demo_url)
    enqueue_noops()
    api = api_run(demo_url)
    print_status_table(api.rows)
    say(
        "Why: the claim locks the rows it selects, and SKIP LOCKED makes other workers pass over "
        "locked rows instead of waiting for them: each worker gets a different job."
    )
    if naive.count("done") == JOBS and naive.max_attempts("done") <= 1:
        print()
        say(
            "(Note: this time the naive claim happened not to double-claim; the race depends on "
            "timing. Run the demo again to see it.)"
        )
    if api.count("done") != JOBS or api.max_attempts("done") != 1 or len(api.rows) != 1:
        raise DemoFailure(
            f"The API run should leave {JOBS:,} jobs done with max_attempts 1, and nothing "
            f"else; it left {api.rows!r}."
        )

    section("2. The real site: POST /orders/ enqueues, `manage.py runjobs --burst` drains")
    site = site_run(demo_url)
    problems = []
    if site.returncode != 0:
        problems.append(f"the worker exited with status {site.returncode}")
    if site.done != JOBS:
        problems.append(f"{site.done:,} jobs done, expected {JOBS:,}")
    if site.failed or site.other:
        problems.append(f"{site.failed:,} failed and {site.other:,} unfinished jobs")
    if site.max_attempts != 1:
        problems.append(f"max attempts {site.max_attempts}, expected 1")
    if site.unconfirmed != 0:
        problems.append(f"{site.unconfirmed:,} orders without confirmation_sent_at")

    section(f"3. Periodic jobs: two workers, one schedule every {PERIODIC_EVERY} s")
    ticks = periodic_run(demo_url)
    doubled = [row for row in ticks if row[1] != 1]
    if len(ticks) < PERIODIC_TICKS or doubled:
        problems.append(f"periodic ticks {ticks!r}: expected one job per tick")

    section("4. Job control: unique keys, cancel, snooze, timeout, quarantine")
    control = control_run(demo_url)
    problems.extend(control.problems)

    section("5. Queues and limits: pause, a global limit, lock keys, registered tasks only")
    queue_problems = queues_run(demo_url)
    problems.extend(queue_problems)

    section("6. Testing helpers, monitoring, and why a job is not running")
    monitoring_problems = monitoring_run(demo_url)
    problems.extend(monitoring_problems)

    section("7. More cores, more waits, fewer commits: --processes, async def, COMPLETE_WITH_CLAIM")
    spread_problems = spread_run(demo_url)
    problems.extend(spread_problems)

    total = time.perf_counter() - total_started
    section("Summary")
    print(
        f"  naive claim      : {naive.count('done'):>6,} of {JOBS:,} jobs done, "
        f"max attempts {naive.max_attempts('done')}, {naive.seconds:6.2f} s"
    )
    print(
        f"  Job.objects.claim: {api.count('done'):>6,} of {JOBS:,} jobs done, "
        f"max attempts {api.max_attempts('done')}, {api.seconds:6.2f} s "
        f"({JOBS / api.seconds:,.0f} claim+complete/s)"
    )
    print(
        f"  real site        : {JOBS:,} orders in {site.enqueue_seconds:.2f} s "
        f"({JOBS / site.enqueue_seconds:,.0f}/s); worker drained {site.done:,} in "
        f"{site.worker_seconds:.2f} s ({site.done / site.worker_seconds:,.0f} jobs/s)"
    )
    print(
        f"  periodic         : {len(ticks)} ticks under 2 workers, "
        f"{sum(row[1] for row in ticks)} jobs, {len(doubled)} ticks enqueued twice"
    )
    print(
        f"  job control      : {'all checks held' if not control.problems else 'see above'}; "
        f"the killer job took {control.deaths} workers down before it was failed"
    )
    print(f"  queues and limits: {'all checks held' if not queue_problems else 'see above'}")
    print(f"  monitoring       : {'all checks held' if not monitoring_problems else 'see above'}")
    print(
        f"  processes, async, completions with claims: "
        f"{'all checks held' if not spread_problems else 'see above'}"
    )
    print(f"  demo database    : {masked(demo_url)} (kept, unless on a throwaway server)")
    print(f"  total time       : {total:.1f} s")
    if problems:
        raise DemoFailure("The demo went wrong: " + "; ".join(problems) + ".")
    print()
    print(
        "OK: no job was claimed twice, none was lost, every order got its confirmation, "
        "each tick of the schedule became one job, and every job-control, queue, monitoring, "
        "processes and async check held."
    )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except DemoFailure as exc:
        print(f"\nDEMO FAILED: {exc}", file=sys.stderr)
        sys.exit(1)
