"""Test helpers: run what a test enqueued, inside the test's own transaction, and assert on it.

``run_jobs()`` is a worker that lives in the test's thread and transaction: it claims with the
worker's claim statements, runs each job with the worker's own ``call()`` in a savepoint, and
writes the outcome through the same fenced complete / fail / snooze statements, so a test
exercises retries, backoff, leases, priorities, queue limits and our SQL, not a stand-in. A
plain ``django.test.TestCase`` (or pytest-django's ``db`` fixture) is all it needs: nothing
is committed, and no worker process is started.

The test clock: inside a test's transaction PostgreSQL's ``now()`` is frozen at the test's
start, while a worker's statements each see the wall clock. ``run_jobs()`` installs, for
its own duration, transaction-local stand-ins for ``now()``, ``statement_timestamp()`` and
``transaction_timestamp()`` (``TEST_CLOCK_CREATE``) that return the time the test set
with ``set_clock()`` / ``advance()`` / ``run_jobs(now=...)``, or else the wall clock; so the
worker's unchanged statements run deferred jobs and retries once the test moves the clock
past their ``run_at``, without sleeping. The clock is a transaction-local setting: it ends
with the test.

Python's own clock (``timezone.now()``) is not moved: use freezegun or time-machine for code
that reads it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db import connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper

from django_pgjobs.core import claim, conf, execute, registry, validation
from django_pgjobs.core.types import Action, ClaimedJob, Failure, Outcome
from django_pgjobs.exceptions import InvalidJobOptions, UnknownTask
from django_pgjobs.models import Job
from django_pgjobs.ops import dashboard
from django_pgjobs.worker.outcomes import WorkerStats, finished, result_of
from django_pgjobs.worker.store import Store
from django_pgjobs.worker.transaction import record, run_claimed

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper
    from typing_extensions import LiteralString

# -- the test clock (django_pgjobs.testing). Inside a test's transaction now() is frozen at
# the test's start; a worker's statements each run in a short transaction of their own, so
# for them now() is the wall clock. run_jobs() runs the same statements as the worker with
# the clock these give them: the time the test set (a transaction-local setting, gone with the
# test's rollback), or else the statement's own start, which moves as the wall clock does.
_TEST_CLOCK: LiteralString = """
coalesce(nullif(pg_catalog.current_setting('pgjobs.test_clock', true), '')::timestamptz,
         pg_catalog.statement_timestamp())"""


# The functions that stand in for pg_catalog's clocks while run_jobs() runs: in a schema of
# their own, put before pg_catalog in the transaction's search_path (TEST_CLOCK_ON), so the
# unchanged statement text calls them. Created inside the test's transaction, dropped again
# when run_jobs() returns (TEST_CLOCK_DROP), and rolled back with the test in any case.
TEST_CLOCK_CREATE: LiteralString = (
    """
CREATE SCHEMA IF NOT EXISTS pgjobs_test_clock;
CREATE OR REPLACE FUNCTION pgjobs_test_clock.now() RETURNS timestamptz
  LANGUAGE sql STABLE AS $$ SELECT"""
    + _TEST_CLOCK
    + """ $$;
CREATE OR REPLACE FUNCTION pgjobs_test_clock.statement_timestamp() RETURNS timestamptz
  LANGUAGE sql STABLE AS $$ SELECT"""
    + _TEST_CLOCK
    + """ $$;
CREATE OR REPLACE FUNCTION pgjobs_test_clock.transaction_timestamp() RETURNS timestamptz
  LANGUAGE sql STABLE AS $$ SELECT"""
    + _TEST_CLOCK
    + """ $$
"""
)


# Put the clock's schema first for the rest of the transaction; returns the path it replaced,
# which TEST_CLOCK_OFF puts back.
# Also returns lock_timeout, which the guarded claim's GUARD sets for the rest of the
# transaction: TEST_CLOCK_OFF puts both back, so run_jobs() leaves the test's settings as
# they were.
TEST_CLOCK_ON: LiteralString = """
SELECT current_setting('search_path'),
       set_config('search_path',
                  'pgjobs_test_clock, pg_catalog, ' || current_setting('search_path'), true),
       current_setting('lock_timeout')
"""


TEST_CLOCK_OFF: LiteralString = """
SELECT set_config('search_path', %(search_path)s, true),
       set_config('lock_timeout', %(lock_timeout)s, true)
"""


TEST_CLOCK_DROP: LiteralString = "DROP SCHEMA pgjobs_test_clock CASCADE"


# The test clock's time now.
TEST_CLOCK_NOW: LiteralString = "SELECT" + _TEST_CLOCK


# Set the test clock (NULL: back to the wall clock) or move it forward by an interval, until
# the test's transaction ends.
TEST_CLOCK_SET: LiteralString = """
SELECT set_config('pgjobs.test_clock', %(now)s::timestamptz::text, true)
"""


TEST_CLOCK_ADVANCE: LiteralString = (
    """
SELECT set_config('pgjobs.test_clock', ("""
    + _TEST_CLOCK
    + """ + %(by)s::interval)::text, true)
"""
)


__all__ = [
    "EnqueuedJob",
    "JobOutcome",
    "PgJobs",
    "advance",
    "assert_enqueued",
    "assert_not_enqueued",
    "enqueued",
    "now",
    "run_jobs",
    "set_clock",
]

# The worker id recorded in worker_ids for the attempts run_jobs() makes.
WORKER_ID = "django_pgjobs.testing"
# run_jobs()'s default max_jobs: a run that has run this many jobs and still finds more stops
# with an error, as a job that enqueues itself, or snoozes with no delay, would otherwise keep
# it running for ever.
MAX_JOBS = 1000


@dataclass(frozen=True)
class JobOutcome:
    """One job ``run_jobs()`` ran: what became of it, as the worker would log it.

    ``outcome`` is ``done``, ``retry`` (failed, queued again for later), ``failed`` (for
    good), ``snoozed``, ``cancelled`` (while it ran), ``lost`` (another writer took it) or
    ``released`` (the queue's database went away while it ran: the attempt is not counted);
    ``failure`` holds the error of a failed attempt, ``result`` a task's return value.
    """

    id: int
    task: str
    queue: str
    attempts: int
    outcome: str
    failure: Failure | None = None
    result: Any = None

    @property
    def error(self) -> str | None:
        """The failed attempt's exception and message (the traceback's last line), or None."""
        return None if self.failure is None else self.failure.summary


@dataclass(frozen=True)
class EnqueuedJob:
    """One job in the table, as the test sees it: ``kwargs`` are the keyword arguments it is
    called with (a ``django.tasks`` task's ``kwargs``, else the payload itself)."""

    id: int
    task: str
    queue: str
    payload: dict[str, Any]
    status: str
    run_at: datetime
    priority: int
    attempts: int

    @property
    def kwargs(self) -> dict[str, Any]:
        if _is_task(self.task):
            kwargs: dict[str, Any] = self.payload.get("kwargs", {})
            return kwargs
        return self.payload

    def __str__(self) -> str:
        payload = json.dumps(self.kwargs, sort_keys=True, default=str)
        return (
            f"job {self.id} {self.task} (queue {self.queue}, {self.status}, "
            f"attempts {self.attempts}) {payload}"
        )


def _is_task(name: str) -> bool:
    """Whether ``name`` is a ``django.tasks`` task run through our backend."""
    try:
        from django_pgjobs.backends import TaskRunner
    except ImportError:  # no django.tasks here: no task rows either
        return False
    try:
        return isinstance(registry.get(name).func, TaskRunner)
    except UnknownTask:
        return False


def _connection() -> BaseDatabaseWrapper:
    return connections[conf.database()]


def _in_test_transaction(helper: str) -> BaseDatabaseWrapper:
    """The queue's connection, which must be inside the test's transaction."""
    connection = _connection()
    if not connection.in_atomic_block:
        raise InvalidJobOptions(
            f"{helper} runs inside the test's transaction, and there is none open on database "
            f"{connection.alias!r}: use django.test.TestCase (or pytest-django's db fixture), "
            "not TransactionTestCase or transactional_db, where its writes would be committed "
            "(test real workers there, with runjobs)."
        )
    return connection


def _task_name(task: object) -> str:
    """The registered name of a @job function, a django.tasks task, or a name."""
    if isinstance(task, str):
        return task
    if isinstance(task, registry.JobFunction):
        return task.name
    module_path = getattr(task, "module_path", None)  # a django.tasks Task
    if isinstance(module_path, str):
        return module_path
    if not callable(task):
        raise UnknownTask(f"{validation.show(task)} is not a task: pass a @job, a task or a name.")
    return registry.resolve(task).name


# -- the clock


def now() -> datetime:
    """The test clock's time: what ``now()`` shows to the statements ``run_jobs()`` runs."""
    connection = _in_test_transaction("now()")
    value: datetime = execute.run(connection, TEST_CLOCK_NOW, {})[0][0]
    return value


def set_clock(when: datetime | None) -> datetime:
    """Set the test clock to ``when`` (aware) until the test ends; None: the wall clock again.

    The clock then stands still at ``when`` (it does not tick) until set or advanced again."""
    connection = _in_test_transaction("set_clock()")
    if when is not None:
        validation.schedule(when, None)  # an aware datetime, or a clear error
    execute.run(connection, TEST_CLOCK_SET, {"now": when})
    return now()


def advance(by: float | timedelta) -> datetime:
    """Move the test clock forward by ``by`` (seconds or a timedelta); the new time."""
    connection = _in_test_transaction("advance()")
    step = validation.duration("advance()", by)
    execute.run(connection, TEST_CLOCK_ADVANCE, {"by": step})
    return now()


@contextmanager
def _clock(connection: BaseDatabaseWrapper) -> Iterator[None]:
    """The test clock for the statements run inside: its functions first on the path (and
    the transaction's ``lock_timeout``, which a guarded claim sets, restored afterwards)."""
    execute.run(connection, TEST_CLOCK_CREATE, {})
    path, _, lock_timeout = execute.run(connection, TEST_CLOCK_ON, {})[0]
    yield
    execute.run(connection, TEST_CLOCK_OFF, {"search_path": path, "lock_timeout": lock_timeout})
    execute.run(connection, TEST_CLOCK_DROP, {})


# -- running jobs


def run_jobs(
    queue: str | None = None,
    *,
    until_empty: bool = True,
    now: datetime | None = None,
    max_jobs: int = MAX_JOBS,
) -> list[JobOutcome]:
    """Run the jobs that are due, as a worker would, inside the test's transaction.

    Claims with the worker's statements (the guarded claim for a queue with limits or jobs
    with lock keys), runs each job in a savepoint (rolled back when it fails or snoozes) and
    writes its outcome fenced on the claim. Expired leases are reaped first. ``queue``: only
    that queue's jobs. ``until_empty``: go on with the jobs the jobs enqueue and the retries
    that come due, until nothing is due; False: the jobs due when called, once each. ``now``:
    set the test clock to that time first (it stays there, as ``set_clock()``). ``max_jobs``:
    a run that has run that many jobs and finds more due stops with an error (and its writes
    are rolled back).

    Returns what became of each job run, in the order they ran.
    """
    connection = _in_test_transaction("run_jobs()")
    if queue is not None:
        validation.queue_name(queue)
    validation.positive_int("max_jobs", max_jobs)
    if now is not None:
        set_clock(now)
    store = Store(connection.alias, direct=False, synchronous_commit=None, prepare=False)
    outcomes: list[JobOutcome] = []
    # Everything in one savepoint: an error of ours rolls back the clock's functions too.
    with transaction.atomic(using=connection.alias), _clock(connection):
        store.reap()
        while True:
            ready = _ready(connection, queue)
            if not ready:
                break
            guarded = claim.outlook(connection, list(ready)).guarded
            ran = 0
            for name, count in ready.items():
                limit = 1 if until_empty else count
                jobs = store.claim(name, limit, conf.lease(), WORKER_ID, guarded=name in guarded)
                if jobs and len(outcomes) >= max_jobs:
                    raise RuntimeError(
                        f"run_jobs() ran {len(outcomes)} jobs and more are due: does a job "
                        "enqueue itself, or snooze with no delay? Pass a larger max_jobs, or "
                        "until_empty=False to run one round at a time."
                    )
                outcomes.extend(_run(store, job) for job in jobs)
                ran += len(jobs)
            if not ran or not until_empty:
                break
    return outcomes


def _ready(connection: BaseDatabaseWrapper, queue: str | None) -> dict[str, int]:
    """Queues with due jobs (the dashboard's depth query, on the test clock), and how many."""
    return {
        row["queue"]: row["ready"]
        for row in execute.records(connection, dashboard.QUEUE_DEPTH, {})
        if row["ready"] and (queue is None or row["queue"] == queue)
    }


def _run(store: Store, job: ClaimedJob) -> JobOutcome:
    """One claimed job, as transaction mode runs it: call, then the fenced write."""
    outcome: Outcome = run_claimed(job, store.alias)
    if outcome.action == Action.RELEASE:
        # Only after an outage of the queue's database: give the claim back, uncounted.
        store.release([job], outage=outcome.outage)
        name = "released"
    else:
        status = record(store, outcome)
        if status is None and store.cancelled_among([job]):
            status = "cancelled"
        finished(outcome, status, stats=WorkerStats(), worker_id=WORKER_ID)
        name = result_of(outcome, status)
    return JobOutcome(
        job.id, job.task, job.queue, job.attempts, name, outcome.failure, outcome.result
    )


# -- what was enqueued


def enqueued(task: object = None, queue: str | None = None) -> list[EnqueuedJob]:
    """The jobs in the table (in a TestCase: those the test enqueued), oldest first, of any
    status; only those of ``task`` (a @job function, a task, or a name) and ``queue``."""
    jobs = Job.objects.using(conf.database()).order_by("id")
    if task is not None:
        jobs = jobs.filter(task=_task_name(task))
    if queue is not None:
        jobs = jobs.filter(queue=validation.queue_name(queue))
    return [
        EnqueuedJob(j.id, j.task, j.queue, j.payload, j.status, j.run_at, j.priority, j.attempts)
        for j in jobs
    ]


def _matching(task: object, payload: dict[str, Any]) -> tuple[list[EnqueuedJob], list[EnqueuedJob]]:
    """The jobs of ``task`` (any, for None) whose arguments include ``payload``; and all."""
    everything = enqueued()
    name = None if task is None else _task_name(task)
    found = [
        e
        for e in everything
        if (name is None or e.task == name)
        and all(k in e.kwargs and e.kwargs[k] == v for k, v in payload.items())
    ]
    return found, everything


def _listing(jobs: Sequence[EnqueuedJob]) -> str:
    if not jobs:
        return "no job was enqueued"
    return "enqueued instead:\n" + "\n".join(f"  {job}" for job in jobs)


def _wanted(task: object, payload: dict[str, Any]) -> str:
    what = "a job" if task is None else f"a job {_task_name(task)}"
    return what + (f" with {json.dumps(payload, sort_keys=True, default=str)}" if payload else "")


def assert_enqueued(task: object, **payload: Any) -> list[EnqueuedJob]:
    """Fail unless a job of ``task`` was enqueued whose arguments include ``payload`` (keys
    not given are not compared); returns the matching jobs. The failure lists every job
    enqueued instead."""
    found, everything = _matching(task, payload)
    if not found:
        raise AssertionError(f"Expected {_wanted(task, payload)}; {_listing(everything)}")
    return found


def assert_not_enqueued(task: object = None, **payload: Any) -> None:
    """Fail if a job of ``task`` (any task, for None) was enqueued whose arguments include
    ``payload``; the failure lists the jobs that match."""
    found, _everything = _matching(task, payload)
    if found:
        listing = "\n".join(f"  {job}" for job in found)
        raise AssertionError(f"Expected no {_wanted(task, payload)[2:]}; found:\n{listing}")


class PgJobs:
    """The helpers as one object: the pytest plugin's ``pgjobs`` fixture."""

    run_jobs = staticmethod(run_jobs)
    enqueued = staticmethod(enqueued)
    assert_enqueued = staticmethod(assert_enqueued)
    assert_not_enqueued = staticmethod(assert_not_enqueued)
    advance = staticmethod(advance)
    set_clock = staticmethod(set_clock)
    now = staticmethod(now)
