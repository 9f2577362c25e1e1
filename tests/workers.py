"""Real worker processes for the tests: ``manage.py runjobs`` / ``reapjobs`` as subprocesses.

A test starts workers through ``Workers`` (a context manager; the worker test modules wrap it
in a ``workers`` fixture), which kills whatever is still running when the test ends, pass or
fail. Each process runs against pytest's test database (``PGJOBS_TEST_DATABASE_NAME``) unless
given another ``DATABASE_URL``, writes its stdout and its log (stderr) to files the test can
read, and tags its database connections with its own ``application_name`` (libpq's
``PGAPPNAME``) so a test can find them in ``pg_stat_activity``; the LISTEN connection names
itself ``pgjobs-listener``.

The module also defines jobs the testproject lacks (one that writes through the ORM and can
then raise, one that leaves a transaction open and one that breaks its own connection, both
returning as if all went well, one that queries on a copy of its connection, one that reads
through the ORM, one that calls ``sys.exit``, one whose error text cannot be encoded, one
retried after a second, two that end on the test's signal rather than a clock's, one that runs
until it is cancelled, one that records when it ran, one that waits until its queue has N
running, and one that records which process ran it); a worker started with
``test_jobs=True`` imports this module so it can run them, and ``tests.periodic_jobs`` (whose
schedules are declared only when a test asks for them).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

from django.conf import settings
from django.db import DatabaseError, connection, connections, transaction

import tests.retry_jobs  # noqa: F401 - a worker with test_jobs=True runs these jobs too
from django_pgjobs import current_job, job, notify
from testproject import ride_audit
from tests import signal_receivers  # noqa: F401 - and has these receivers, when its env asks
from tests.helpers import PATIENCE, job_row, wait_until

REPO = Path(__file__).resolve().parent.parent
LISTENER_APP = "pgjobs-listener"
SLEEP = "testproject.testjobs.sleep"
# Starts Django, registers this module's jobs, then runs the command like manage.py would.
WITH_TEST_JOBS = (
    "import sys, django; django.setup(); import tests.workers, tests.periodic_jobs; "
    "from django.core.management import execute_from_command_line; "
    "execute_from_command_line(['manage.py', *sys.argv[1:]])"
)
_serial = itertools.count(1)


@job
def write_order(email: str, fail: bool = False, pause: float = 0.0) -> None:
    """Create an Order through the ORM, take ``pause`` seconds, then raise if asked to."""
    from testproject.shop.models import Order

    Order.objects.create(email=email, total_cents=100)
    time.sleep(pause)
    if fail:
        raise RuntimeError(f"failed after writing order {email}")


@job
def leave_a_transaction_open(email: str) -> None:
    """Turn autocommit off, write an Order and return without committing: a job's bug that
    must not reach the next job on the same executor thread."""
    from testproject.shop.models import Order

    transaction.set_autocommit(False)
    Order.objects.create(email=email, total_cents=100)


@job
def break_own_connection_quietly() -> None:
    """End this job's own database session and swallow the error: it returns as if all went
    well, leaving its thread a broken connection."""
    with contextlib.suppress(DatabaseError), connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")


@job
def query_on_a_copy_too() -> None:
    """Query on this thread's connection, then on a copy of it (one more connection to the
    same alias, as a job writing outside its own transaction opens), closed at the end."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    other = connection.copy()
    try:
        with other.cursor() as cursor:
            cursor.execute("SELECT 1")
    finally:
        other.close()


@job
def count_orders(pause: float = 0.02, **kwargs: object) -> None:
    """Read through the ORM, then take a moment: a job that meets a database outage."""
    from testproject.shop.models import Order

    Order.objects.count()
    time.sleep(pause)


@job(max_attempts=1)
def exit_with(code: int = 2) -> None:
    """Call sys.exit(): the job's failure, not the worker's end."""
    sys.exit(code)


# An undecodable file name as Python shows it: a lone surrogate, which PostgreSQL text cannot
# hold.
UNDECODABLE = os.fsdecode(b"caf\xe9.txt")


@job
def undecodable_error() -> None:
    raise RuntimeError(f"cannot open {UNDECODABLE}")


# Retried 0.5 * 2^attempts s (at most 1 s) later, not the 20 s of the default BACKOFF_BASE.
@job(max_attempts=3, backoff=(0.5, 1.0))
def fails_first(times: int = 1) -> None:
    """Fail the first ``times`` attempts."""
    ctx = current_job()
    assert ctx is not None
    if ctx.attempts <= times:
        raise RuntimeError(f"attempt {ctx.attempts} fails on purpose")


@job
def until_claimed(count: int = 2) -> None:
    """Return once ``count`` jobs were claimed (running or done), this one included: run until
    another job was claimed beside it. Fails if none is while it waits."""
    from django_pgjobs.models import Job

    wait_until(
        lambda: Job.objects.filter(status__in=["running", "done"]).count() >= count,
        interval=0.05,
        message=f"{count} jobs to be claimed",
    )


@job
def until_order(email: str) -> None:
    """Run until the test creates an Order for ``email`` (so the test, not a clock, decides
    how long the job outlives its lease); return early if the lease is lost."""
    from testproject.shop.models import Order

    def go_ahead() -> bool:
        ctx = current_job()
        return (ctx is not None and ctx.lost) or Order.objects.filter(email=email).exists()

    wait_until(go_ahead, interval=0.05, message=f"an order for {email}")


# Where span() records when each job ran (tests.test_queue_control creates it): what the
# tests of limits and lock keys compute overlaps from.
SPANS = "test_span"


@job
def span(pause: float = 0.02, **kwargs: object) -> None:
    """Take ``pause`` seconds; record the job's start and end (the machine's monotonic clock,
    which every process on it shares) in SPANS."""
    ctx = current_job()
    assert ctx is not None
    started = time.monotonic()
    time.sleep(pause)
    ended = time.monotonic()
    with connections["default"].cursor() as cursor:
        cursor.execute(
            "INSERT INTO test_span (job_id, queue, lock_key, started, ended) "
            "SELECT id, queue, lock_key, %s, %s FROM pgjobs_job WHERE id = %s",
            [started, ended, ctx.id],
        )


@job
def until_running(queue: str, count: int) -> None:
    """Return once ``count`` jobs of ``queue`` are running at once, this one included (or
    done since: the first to see it may finish before the others look)."""
    from django_pgjobs.models import Job

    wait_until(
        lambda: Job.objects.filter(queue=queue, status__in=["running", "done"]).count() >= count,
        interval=0.02,
        message=f"{count} jobs of {queue} running at once",
    )


class Process:
    """One ``manage.py`` command running as a child process."""

    def __init__(
        self,
        command: str,
        args: tuple[str, ...],
        *,
        folder: Path,
        database_url: str | None = None,
        test_jobs: bool = False,
        env: dict[str, str] | None = None,
    ) -> None:
        serial = next(_serial)
        self.name = f"{command}-{serial}"
        self.app_name = f"pgjobs-test-{os.getpid()}-{serial}"
        self.out_path = folder / f"{self.name}.out"
        self.log_path = folder / f"{self.name}.log"
        environ = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "testproject.settings",
            "DATABASE_URL": database_url or settings.DATABASE_URL,
            "PGAPPNAME": self.app_name,
            "PYTHONUNBUFFERED": "1",
            "PGJOBS_LOG_LEVEL": "INFO",
            **(env or {}),
        }
        environ.pop("PGJOBS_TEST_DATABASE_NAME", None)
        if database_url is None:
            environ["PGJOBS_TEST_DATABASE_NAME"] = connections["default"].settings_dict["NAME"]
        head = ["-c", WITH_TEST_JOBS] if test_jobs else ["manage.py"]
        with open(self.out_path, "wb") as out, open(self.log_path, "wb") as log:
            self.popen = subprocess.Popen(
                [sys.executable, *head, command, *args],
                cwd=REPO,
                env=environ,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=log,
            )

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def send(self, sig: signal.Signals) -> None:
        self.popen.send_signal(sig)

    def wait(self, timeout: float = PATIENCE) -> int:
        """Wait for the process to exit; return its exit status."""
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{self.name} still running after {timeout} s; its log ends:\n{self.tail()}"
            ) from None

    def kill(self) -> None:
        if self.alive:
            self.popen.kill()
        self.popen.wait(30)

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-lines:]) + "\n--- stdout:\n" + self.output()

    def wait_for_log(self, text: str, timeout: float = PATIENCE) -> str:
        """Wait until ``text`` appears in the log; fail early if the process exits first."""

        def seen() -> bool:
            if text in self.log():
                return True
            if not self.alive and text not in self.log():
                raise AssertionError(
                    f"{self.name} exited ({self.popen.returncode}) before logging {text!r}:\n"
                    f"{self.tail()}"
                )
            return False

        wait_until(seen, timeout=timeout, interval=0.05, message=f"{self.name} to log {text!r}")
        return self.log()

    def backends(self) -> list[int]:
        """pids of this process's (non-LISTEN) connections to the test database."""
        return [
            row[0]
            for row in query(
                "SELECT pid FROM pg_stat_activity "
                "WHERE datname = current_database() AND application_name = %s",
                [self.app_name],
            )
        ]

    def activity(self) -> dict[int, tuple[Any, ...]]:
        """pid -> (state, state_change, query_start) for each of this process's connections,
        the LISTEN one included (one worker per test): what moves when a connection sends a
        statement. The wait event is left out: an idle backend also wakes up without one
        from its client (to take in a notification or a cache invalidation), and for that
        instant shows no wait."""
        rows = query(
            "SELECT pid, state, state_change, query_start "
            "FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name IN (%s, %s)",
            [self.app_name, LISTENER_APP],
        )
        return {row[0]: tuple(row[1:]) for row in rows}

    def waits(self) -> set[str | None]:
        """The wait event types its connections are in now."""
        rows = query(
            "SELECT wait_event_type FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name IN (%s, %s)",
            [self.app_name, LISTENER_APP],
        )
        return {wait for (wait,) in rows}

    def sent(self, statement: str, *, waiting: bool = False) -> bool:
        """Whether the latest statement of one of its connections is ``statement`` (compared
        on its first line: the driver may have bound the parameters into the text); with
        ``waiting``, one that is still waiting for a lock."""
        head = statement.strip().splitlines()[0]
        return any(
            str(text).strip().startswith(head) and (wait == "Lock" or not waiting)
            for text, wait in query(
                "SELECT query, wait_event_type FROM pg_stat_activity "
                "WHERE datname = current_database() AND application_name = %s",
                [self.app_name],
            )
        )

    def wait_until_idle(self, quiet: float = 1.0, timeout: float = PATIENCE) -> None:
        """Wait until start-up is over and its connections (its own and the LISTEN one) are
        idle and have not moved for ``quiet`` s.

        Start-up is the first tick (reap, claim, due-time lookup), the LISTEN, the catch-up
        claim it triggers, and the probe of the LISTEN connection that the first tick asked
        for: the probe runs only after the LISTEN, on the listener's next turn (up to a second
        later), so stillness alone could be mistaken for the end of start-up just before it.
        The listener's latest statement being the probe is what says that it is over."""
        last: list[dict[int, tuple[Any, ...]]] = [{}]
        since = [time.monotonic()]

        def idle() -> bool:
            now = self.activity()
            if now != last[0]:
                last[0], since[0] = now, time.monotonic()
                return False
            assert self.alive, self.tail()
            return (
                len(now) >= 2
                and {state for state, *_ in now.values()} == {"idle"}
                and listener_statements() == [notify.PROBE]
                and time.monotonic() - since[0] >= quiet
            )

        wait_until(idle, timeout=timeout, interval=0.1, message=f"{self.name} to be idle")


class Workers:
    """Starts worker (and reaper) processes; on exit kills every one still running."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.started: list[Process] = []

    def start(
        self,
        *args: str,
        database_url: str | None = None,
        test_jobs: bool = False,
        env: dict[str, str] | None = None,
    ) -> Process:
        """``manage.py runjobs *args``; ``env`` adds to (or overrides) its environment."""
        return self.command(
            "runjobs", *args, database_url=database_url, test_jobs=test_jobs, env=env
        )

    def command(
        self,
        command: str,
        *args: str,
        database_url: str | None = None,
        test_jobs: bool = False,
        env: dict[str, str] | None = None,
    ) -> Process:
        process = Process(
            command,
            args,
            folder=self.folder,
            database_url=database_url,
            test_jobs=test_jobs,
            env=env,
        )
        self.started.append(process)
        return process

    def run(self, command: str, *args: str, timeout: float = PATIENCE, **kwargs: Any) -> Process:
        """Run a command to completion; it must exit 0."""
        process = self.command(command, *args, **kwargs)
        status = process.wait(timeout)
        assert status == 0, f"{command} {args} exited {status}:\n{process.tail()}"
        return process

    def burst(self, *args: str, timeout: float = PATIENCE, **kwargs: Any) -> Process:
        """``runjobs --burst *args`` to completion (exit 0)."""
        return self.run("runjobs", "--burst", *args, timeout=timeout, **kwargs)

    def __enter__(self) -> Workers:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for process in self.started:
            with contextlib.suppress(ProcessLookupError):
                process.kill()


# -- the database, as the test process sees it ------------------------------------------------


def query(statement: str, params: Any = None) -> list[tuple[Any, ...]]:
    with connections["default"].cursor() as cursor:
        cursor.execute(statement, params)
        return list(cursor.fetchall()) if cursor.description else []


def scalar(statement: str, params: Any = None) -> Any:
    rows = query(statement, params)
    assert len(rows) == 1 and len(rows[0]) == 1, rows
    return rows[0][0]


def counts() -> dict[str, int]:
    """Jobs per status."""
    return dict(query("SELECT status, count(*) FROM pgjobs_job GROUP BY status"))


def done() -> int:
    return int(scalar("SELECT count(*) FROM pgjobs_job WHERE status = 'done'"))


def running() -> int:
    return int(scalar("SELECT count(*) FROM pgjobs_job WHERE status = 'running'"))


def ran(process: Process) -> int:
    """The job count of the ``ran N jobs`` summary runjobs prints on stdout."""
    for line in process.output().splitlines():
        if line.startswith("ran "):
            return int(line.split()[1])
    raise AssertionError(f"{process.name} printed no 'ran N jobs' summary:\n{process.tail()}")


def listener_backends() -> list[int]:
    return [
        row[0]
        for row in query(
            "SELECT pid FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name = %s",
            [LISTENER_APP],
        )
    ]


# What a job blamed for the database's absence would carry in last_error or errors.
OUTAGE_TEXTS = [
    "%OperationalError%",
    "%InterfaceError%",
    "%server closed%",
    "%terminating connection%",
    "%connection is closed%",
    "%read-only transaction%",
    "%ReadOnlySqlTransaction%",
]


def assert_nobody_was_blamed(total: int) -> None:
    """Every job done; none failed or saddled with the outage; attempts counted only for a
    job whose claim was lost with a dropped connection (the reaper notes 'lease expired')."""
    assert counts() == {"done": total}
    assert (
        scalar(
            "SELECT count(*) FROM pgjobs_job WHERE last_error ILIKE ANY(%s) "
            "OR errors::text ILIKE ANY(%s)",
            [OUTAGE_TEXTS, OUTAGE_TEXTS],
        )
        == 0
    )
    assert (
        query(
            "SELECT id, attempts, last_error FROM pgjobs_job "
            "WHERE attempts <> 1 AND last_error IS DISTINCT FROM 'lease expired'"
        )
        == []
    )


# A worker that is to meet an outage mid-run: a short lease and reap interval, so that what
# the outage strands comes back within the test, and a fallback poll beside LISTEN.
OUTAGE_OPTIONS = ("--lease", "5", "--reap-interval", "2", "--poll-interval", "1")


def finished_after_an_outage(process: Process, total: int) -> str:
    """Wait for ``process`` to finish the ``total`` jobs it met an outage among: it lives on
    and nobody is blamed. Returns its log."""
    wait_until(
        lambda: done() == total or not process.alive,
        timeout=3 * PATIENCE,
        message="the queue to be finished",
    )
    assert process.alive, process.tail()
    assert_nobody_was_blamed(total)
    return process.log()


def ride_out_an_outage(process: Process, total: int, *, after: int, victims: int) -> str:
    """Once ``after`` of the ``total`` jobs are done, terminate every connection of
    ``process`` (at least ``victims``: its producer's, completer's and each executor's, whose
    next query, inside a job, runs into its dead connection; and the LISTEN one); then the
    queue is finished by the same process, nobody blamed, a job released and the connection
    made again. Returns the process's log."""
    wait_until(lambda: done() >= after, message="the run to get going")
    assert terminate(process.backends() + listener_backends()) >= victims
    assert done() < total, "the run ended before the outage"
    log = finished_after_an_outage(process, total)
    assert "met a database outage; releasing it (attempt not counted)" in log, log
    assert "reconnected to database default" in log, log
    return log


def wait_until_it_outlives_its_lease(job_id: int, lease: int) -> None:
    """Wait until the running job's lease was extended three times, in order, and the job has
    run a second past its first ``lease`` seconds, still ours: failing at once if it was taken
    back."""
    seen = [job_row(job_id)["locked_until"]]

    def extended() -> bool:
        row = job_row(job_id)
        assert (row["status"], row["attempts"]) == ("running", 1), "the job was taken back"
        if row["locked_until"] > seen[-1]:
            seen.append(row["locked_until"])
        return len(seen) >= 4

    wait_until(extended, message="the lease to be extended three times")
    assert seen == sorted(seen)
    wait_until(
        lambda: scalar(
            "SELECT status = 'running' AND attempts = 1 AND now() > started_at + "
            "make_interval(secs => %s) AND locked_until > now() FROM pgjobs_job WHERE id = %s",
            [lease + 1, job_id],
        ),
        message="the job to outlive its first lease",
    )


@contextlib.contextmanager
def ride_audit_installed() -> Iterator[None]:
    """For the block, note each transaction that updates jobs, with how many it finished and
    claimed (``testproject.ride_audit``): ``rides()`` reads the sums."""
    with connection.cursor() as cursor:
        for statement in ride_audit.INSTALL:
            cursor.execute(statement)
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            for statement in ride_audit.REMOVE:
                cursor.execute(statement)


def rides() -> tuple[int, int, int]:
    """The transactions that both finished and claimed jobs, the completions they wrote, and
    every completion written, since ``ride_audit_installed()`` began."""
    ((both, rode, finished),) = query(ride_audit.COUNTS)
    return int(both), int(rode), int(finished)


def terminate(pids: list[int]) -> int:
    """pg_terminate_backend each pid; return how many were terminated."""
    if not pids:
        return 0
    return int(
        scalar(
            "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) AS gone "
            "FROM pg_stat_activity WHERE pid = ANY(%s) AND pid <> pg_backend_pid()) t "
            "WHERE gone",
            [pids],
        )
    )


def listener_statements() -> list[str]:
    """The latest statement of each LISTEN connection to the test database."""
    return [
        row[0]
        for row in query(
            "SELECT query FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name = %s",
            [LISTENER_APP],
        )
    ]


def wait_done(job_id: int, timeout: float = PATIENCE) -> dict[str, Any]:
    """Wait for the job to be done; return its row. How soon is not the point: a test that
    needs "soon" compares with a wait that would be far longer (an hour's poll interval)."""
    wait_until(
        lambda: job_row(job_id)["status"] == "done",
        timeout=timeout,
        interval=0.02,
        message=f"job {job_id} to be done",
    )
    return job_row(job_id)


@job
def until_cancelled(email: str) -> None:
    """Run until ``current_job()`` says the job must stop, then record why in an Order
    (``email`` + ``:cancelled`` or ``:lost``) and return: a long job that stops cooperatively."""
    from testproject.shop.models import Order

    ctx = current_job()
    assert ctx is not None
    wait_until(lambda: ctx.should_stop, interval=0.05, message="the job to be told to stop")
    Order.objects.create(email=f"{email}:{'cancelled' if ctx.cancelled else 'lost'}", total_cents=1)


@job(max_attempts=1)
def stuck_until_order(email: str) -> None:
    """Block until the test creates an Order for ``email``, whatever the timeout says (a
    thread cannot be killed); say that it runs with an Order for ``started:<email>``, and on
    seeing ``current_job().timed_out``, say so with an Order for ``timed-out:<email>``."""
    from testproject.shop.models import Order

    ctx = current_job()
    assert ctx is not None
    Order.objects.create(email=f"started:{email}", total_cents=1)
    reported = False

    def released() -> bool:
        nonlocal reported
        if ctx.timed_out and not reported:
            Order.objects.create(email=f"timed-out:{email}", total_cents=1)
            reported = True
        return Order.objects.filter(email=email).exists()

    wait_until(released, interval=0.05, message=f"an order for {email}")


def stuck_until_order_started(*emails: str) -> bool:
    """Whether ``stuck_until_order`` has started for every one of ``emails``."""
    from testproject.shop.models import Order

    started = [f"started:{email}" for email in emails]
    return Order.objects.filter(email__in=started).count() == len(started)


@job
def kill_worker() -> None:
    """End the worker process at once, as an out-of-memory kill or a segfault would."""
    os._exit(1)


def _exit_instead_of_a_delay(attempt: int, exc: BaseException) -> float:
    raise SystemExit(3)


@job(max_attempts=2, backoff=_exit_instead_of_a_delay)
def stuck_with_an_exiting_backoff(email: str) -> None:
    """``stuck_until_order``, with a backoff callable that raises SystemExit: when the job
    times out, that callable runs on the worker's completer thread."""
    stuck_until_order.func(email=email)


@job
def record_pid(together: int = 0, go: str = "") -> None:
    """Note that this job started (an Order ``started-<id>@example.com``); with ``together``,
    wait until that many jobs of the same ``together`` are running (or done), so that each
    of as many workers holds one; with ``go``, run until the test creates an Order for
    ``go`` (return early, recording nothing more, if the lease is lost); then record which
    process ran it, an Order ``ran-<id>-<pid>@example.com`` whose total is the attempt."""
    from django_pgjobs.models import Job
    from testproject.shop.models import Order

    ctx = current_job()
    assert ctx is not None
    Order.objects.create(email=f"started-{ctx.id}@example.com", total_cents=ctx.attempts)
    if together:
        wait_until(
            lambda: (
                Job.objects.filter(
                    payload__together=together, status__in=["running", "done"]
                ).count()
                >= together
            ),
            interval=0.05,
            message=f"{together} jobs running at once",
        )
    if go:
        wait_until(
            lambda: ctx.lost or Order.objects.filter(email=go).exists(),
            interval=0.05,
            message=f"an order for {go}",
        )
        if ctx.lost:
            return
    Order.objects.create(email=f"ran-{ctx.id}-{os.getpid()}@example.com", total_cents=ctx.attempts)
