"""Periodic jobs: ``@periodic``, ``PGJOBS["SCHEDULE"]``, and when each schedule ticks.

A schedule is declared in code (the decorator, or the setting for a task that cannot be
decorated). Every worker runs every declared schedule; the database decides which worker's
tick becomes the job (``TICK``): the row of ``pgjobs_schedule`` keeps the last tick
enqueued, and a tick becomes a job only in the statement that moves that row forward. So a
tick is enqueued exactly once however many workers run, and nothing but the code declares a
schedule: a row whose schedule was removed is never read again.

``ticks()`` is pure (the time is passed in): the latest tick at or before ``now`` and the
next one after it. A cron schedule is evaluated by cronsim in the schedule's time zone; an
``every`` schedule ticks on whole multiples of its interval since the Unix epoch, so every
worker agrees on the ticks without talking to the others.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from typing import TYPE_CHECKING, Any, TypeVar
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError
from django.conf import settings
from django.utils.module_loading import import_string

from django_pgjobs.core import conf, execute, registry, validation
from django_pgjobs.core.options import JobOptions
from django_pgjobs.core.registry import JobFunction
from django_pgjobs.exceptions import InvalidJobOptions, InvalidPayload, UnknownTask

if TYPE_CHECKING:
    from typing_extensions import LiteralString

# -- periodic jobs (schedules.py). A tick becomes a job if and only if this statement moves
# the schedule's row forward to it: the upsert takes the row's lock, so schedulers of every
# worker serialize on it, and the one that comes second finds the tick already there (its
# WHERE is false: no row, so no job). The job's id is drawn only by the update that wins,
# and the job is inserted in the same statement, so a crash can leave neither a tick
# without its job nor a job without its tick; no leader, and no lock outlives the statement.
# A new row (or one a failed step made) is only set to the tick: a schedule's first job is
# its first tick after it was deployed, never the deploy. The tick only ever moves forward,
# whichever spec a worker runs: while old and new code run side by side (a rolling deploy),
# each version's later ticks are enqueued, and neither undoes the other's.
TICK: LiteralString = """
WITH tick AS (
  INSERT INTO pgjobs_schedule AS s (name, spec, last_tick, updated_at)
  VALUES (%(name)s, %(spec)s, %(tick)s, now())
  ON CONFLICT (name) DO UPDATE
  SET spec        = EXCLUDED.spec,
      last_tick   = EXCLUDED.last_tick,
      last_job_id = CASE WHEN s.spec IS NOT NULL
                         THEN nextval(pg_get_serial_sequence('pgjobs_job', 'id')) END,
      last_error  = NULL,
      failures    = 0,
      updated_at  = now()
  WHERE s.last_tick IS NULL OR s.last_tick < EXCLUDED.last_tick
  RETURNING s.last_job_id
)
INSERT INTO pgjobs_job (id, queue, task, payload, priority, max_attempts, run_at, schedule,
                        scheduled_at, timeout)
OVERRIDING SYSTEM VALUE
SELECT tick.last_job_id, %(queue)s, %(task)s, %(payload)s::jsonb, %(priority)s,
       %(max_attempts)s, now(), %(name)s, %(tick)s, %(timeout)s::interval
FROM tick
WHERE tick.last_job_id IS NOT NULL
RETURNING id,
  CASE WHEN %(notify_channel)s::text IS NOT NULL THEN pg_notify(%(notify_channel)s, queue) END
"""


# A scheduler step that failed: its error on the row (a new row gets no spec, so the first
# successful step only sets its tick). The next success clears it.
TICK_FAILED: LiteralString = """
INSERT INTO pgjobs_schedule AS s (name, last_error, failures, failed_at, updated_at)
VALUES (%(name)s, %(error)s, 1, now(), now())
ON CONFLICT (name) DO UPDATE
SET last_error = EXCLUDED.last_error, failures = s.failures + 1, failed_at = now(),
    updated_at = now()
"""


# The rows of the declared schedules (rows of removed schedules are never read), with the
# status of each last tick's job (NULL once it was pruned).
SCHEDULE_STATES: LiteralString = """
SELECT s.name, s.spec, s.last_tick, s.last_job_id, s.last_error, s.failures, s.failed_at,
       j.status
FROM pgjobs_schedule s
LEFT JOIN pgjobs_job j ON j.id = s.last_job_id
WHERE s.name = ANY(%(names)s::text[])
"""


# The database's clock, which decides the ticks.
NOW: LiteralString = "SELECT now()"


T = TypeVar("T")

UTC = dt_timezone.utc

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# An `every` schedule ticks at most once a second: each tick is a statement per worker.
MIN_EVERY = timedelta(seconds=1)
_ONE_MICROSECOND = timedelta(microseconds=1)
# How far before now the cron walk starts: longer than any DST shift, so that the ticks of a
# changed wall clock are seen in the order they happen.
CRON_LOOKBACK = timedelta(hours=3)
# The keys of a PGJOBS["SCHEDULE"] entry.
SETTING_KEYS = ("task", "cron", "every", "kwargs", "timezone", "priority", "queue")


@dataclass(frozen=True)
class Schedule:
    """One declared schedule. Values are kept as written; ``problems()`` judges them."""

    name: Any
    task: Any
    origin: str
    cron: Any = None
    every: Any = None
    kwargs: Any = None
    timezone: Any = None
    priority: Any = None
    queue: Any = None
    # A django.tasks Task (its rows hold args, kwargs and backend), or None for a @job.
    target: Any = field(default=None, compare=False, repr=False)

    @property
    def zone(self) -> ZoneInfo:
        """The time zone its cron expression is read in (default: settings.TIME_ZONE)."""
        return ZoneInfo(self.timezone or settings.TIME_ZONE or "UTC")

    @property
    def interval(self) -> timedelta:
        every = self.every
        return every if isinstance(every, timedelta) else timedelta(seconds=every)

    @property
    def spec(self) -> str:
        """What decides its ticks. A row of another spec is a schedule changed in code: its
        first tick under the new spec only resets the row (no job for a tick of the old)."""
        if self.cron is not None:
            return f"cron {self.cron} {self.zone.key}"
        return f"every {self.interval.total_seconds():g}s"

    def describe(self) -> str:
        """In words: "At 02:00 every day (Europe/Paris)", "every 30 seconds"."""
        if self.cron is not None:
            words = CronSim(self.cron, datetime.now(self.zone)).explain()
            return f"{words} ({self.zone.key})"
        return f"every {_duration(self.interval)}"

    def payload(self) -> dict[str, Any]:
        """The job's payload: the kwargs (a django.tasks task's row also names its backend)."""
        kwargs = dict(self.kwargs or {})
        if self.target is not None:
            return {"args": [], "kwargs": kwargs, "backend": self.target.backend}
        return kwargs

    def problems(self) -> list[tuple[str, str, str]]:
        """(check id, what is wrong, how to fix it) for each bad value; empty when valid."""
        where = f"Schedule {self.name!r} ({self.origin})"
        checks = (
            self._name_problems,
            self._timing_problems,
            self._zone_problems,
            self._kwargs_problems,
            self._option_problems,
            self._task_problems,
        )
        return [problem for check in checks for problem in check(where)]

    def _name_problems(self, where: str) -> Iterator[tuple[str, str, str]]:
        if not isinstance(self.name, str) or not self.name.strip() or len(self.name) > 200:
            yield (
                "pgjobs.E039",
                f"{where}: the name must be a non-empty string of at most 200 characters.",
                "Pass name='...' to @periodic, or use another key in PGJOBS['SCHEDULE'].",
            )

    def _timing_problems(self, where: str) -> Iterator[tuple[str, str, str]]:
        """Exactly one of cron and every, and that one valid."""
        if (self.cron is None) == (self.every is None):
            yield (
                "pgjobs.E030",
                f"{where} has {'both' if self.cron is not None else 'neither'} cron and every.",
                "Give exactly one: a 5-field cron expression, or every=timedelta(...).",
            )
        if self.cron is not None:
            error = _cron_error(self.cron)
            if error:
                yield (
                    "pgjobs.E031",
                    f"{where}: invalid cron expression {self.cron!r}: {error}.",
                    "Use 5 fields: minute hour day-of-month month day-of-week, e.g. "
                    "'30 2 * * *' (02:30 every day) or '*/5 * * * *'.",
                )
        if self.every is not None:
            every = self.every
            if isinstance(every, bool) or not isinstance(every, (int, float, timedelta)):
                ok = False
            else:
                seconds = every.total_seconds() if isinstance(every, timedelta) else every
                ok = MIN_EVERY.total_seconds() <= seconds <= validation.MAX_DURATION.total_seconds()
            if not ok:
                yield (
                    "pgjobs.E032",
                    f"{where}: every={every!r} is not an interval of 1 second or more.",
                    "Pass a timedelta (or a number of seconds) of at least 1 second.",
                )

    def _zone_problems(self, where: str) -> Iterator[tuple[str, str, str]]:
        if self.timezone is not None or self.cron is not None:
            try:
                self.zone  # noqa: B018 - looking it up is the check
            except (ZoneInfoNotFoundError, ValueError, TypeError):
                yield (
                    "pgjobs.E033",
                    f"{where}: unknown time zone {self.timezone or settings.TIME_ZONE!r}.",
                    "Use an IANA name such as 'Europe/Paris' or 'UTC'.",
                )

    def _kwargs_problems(self, where: str) -> Iterator[tuple[str, str, str]]:
        if self.kwargs is not None:
            try:
                validation.payload(self.kwargs)
            except InvalidPayload as exc:
                yield (
                    "pgjobs.E034",
                    f"{where}: its kwargs cannot be a job's payload: {exc}",
                    "kwargs must be a dict of JSON values (str, int, float, bool, None, "
                    "list, dict).",
                )

    def _option_problems(self, where: str) -> Iterator[tuple[str, str, str]]:
        try:
            if self.queue is not None:
                validation.queue_name(self.queue)
            if self.priority is not None:
                validation.priority(self.priority)
        except InvalidJobOptions as exc:
            yield ("pgjobs.E037", f"{where}: {exc}", "Fix the queue or priority.")

    def _task_problems(self, where: str) -> Iterator[tuple[str, str, str]]:
        if not isinstance(self.task, str) or not self._registered():
            yield (
                "pgjobs.E036",
                f"{where} names the task {self.task!r}, which is not a registered job.",
                "Name a @job function (module.qualname, or its name=) or a django.tasks "
                "@task that uses django_pgjobs' backend, and make sure its module is "
                "imported (an app's jobs.py or tasks.py, or PGJOBS['IMPORTS']).",
            )

    def _registered(self) -> bool:
        try:
            registry.get(self.task)
        except UnknownTask:
            return False
        return True


def ticks(schedule: Schedule, now: datetime) -> tuple[datetime, datetime]:
    """The latest tick at or before ``now`` and the next one after it, both in UTC."""
    if schedule.cron is None:
        every = schedule.interval
        tick = EPOCH + ((now - EPOCH) // every) * every
        return tick, tick + every
    # Walk forward from a little before now, in the schedule's zone: a fall-back night makes
    # a wall-clock time come twice, and only its first pass is a tick (cronsim's, and cron's,
    # rule), so a candidate that is not later than the previous one is skipped.
    start = (now - CRON_LOOKBACK).astimezone(schedule.zone)
    latest: datetime | None = None
    previous: datetime | None = None
    for candidate in CronSim(schedule.cron, start):
        at = candidate.astimezone(UTC)
        if previous is not None and at <= previous:
            continue
        previous = at
        if at > now:
            break
        latest = at
    assert previous is not None and previous > now
    if latest is None:
        # No tick in the look-back: the latest is further back (a daily or rarer schedule).
        latest = next(CronSim(schedule.cron, start + _ONE_MICROSECOND, reverse=True))
        latest = latest.astimezone(UTC)
    return latest, previous


def _cron_error(expression: object) -> str | None:
    if not isinstance(expression, str):
        return f"a cron expression is a string, not {type(expression).__name__}"
    fields = expression.split()
    if len(fields) != 5:
        return f"it has {len(fields)} fields, not 5"
    try:
        ticks(Schedule("", "", "", cron=expression, timezone="UTC"), datetime.now(UTC))
    except CronSimError as exc:
        return str(exc)
    except StopIteration:
        return "it never matches a date"
    return None


def _duration(interval: timedelta) -> str:
    seconds = int(interval.total_seconds())
    if seconds != interval.total_seconds():
        return f"{interval.total_seconds():g} seconds"
    for size, unit in ((86400, "day"), (3600, "hour"), (60, "minute"), (1, "second")):
        if seconds % size == 0:
            count = seconds // size
            return f"{count} {unit}" if count == 1 else f"{count} {unit}s"
    return f"{seconds} seconds"


# -- declaring ------------------------------------------------------------------------------

_declared: list[Schedule] = []


def periodic(
    cron: str | None = None,
    *,
    every: timedelta | float | None = None,
    kwargs: Mapping[str, Any] | None = None,
    timezone: str | None = None,
    name: str | None = None,
    priority: int | None = None,
    queue: str | None = None,
) -> Callable[[T], T]:
    """Enqueue the decorated job at every tick of a schedule, once per tick across workers.

    Put it above ``@job`` (or above a ``django.tasks`` ``@task`` whose backend is
    django_pgjobs'). Give exactly one of ``cron`` (a 5-field expression, read in
    ``timezone``, default ``settings.TIME_ZONE``) or ``every`` (a ``timedelta``, at least a
    second; ticks fall on whole multiples of it since the Unix epoch, in UTC). ``kwargs`` is
    the payload of every job it enqueues; ``priority`` and ``queue`` default to the job's.
    ``name`` (default: the task's name) identifies the schedule in the database; two
    schedules of one task need two names. Bad values are reported by ``manage.py check``
    (ids pgjobs.E030-E039), and a worker refuses to start with them.
    """

    def declare(target: T) -> T:
        task_name, task_object = _task_of(target)
        _declared.append(
            Schedule(
                name=name if name is not None else task_name,
                task=task_name,
                origin=f"@periodic on {task_name}",
                cron=cron,
                every=every,
                kwargs=kwargs,
                timezone=timezone,
                priority=priority,
                queue=queue,
                target=task_object,
            )
        )
        return target

    return declare


def _task_of(target: object) -> tuple[str, Any]:
    """The registered name of a @job function or a django.tasks Task (and the Task)."""
    if isinstance(target, JobFunction):
        return target.name, None
    module_path = getattr(target, "module_path", None)
    if isinstance(module_path, str) and callable(getattr(target, "func", None)):
        return module_path, target
    raise TypeError(
        f"@periodic cannot schedule {target!r}: put it above @job (or above a django.tasks "
        "@task), so that it receives the registered job."
    )


def from_setting() -> Iterator[Schedule]:
    """The schedules of ``PGJOBS["SCHEDULE"]`` (shape errors are reported by the checks)."""
    value = conf.schedule()
    if not isinstance(value, Mapping):
        return
    for name, entry in value.items():
        if not isinstance(entry, Mapping):
            continue
        task = entry.get("task")
        target = _setting_task(task)
        if target is not None:
            task = target.module_path
        yield Schedule(
            name=name,
            task=task,
            origin=f"PGJOBS['SCHEDULE'][{name!r}]",
            cron=entry.get("cron"),
            every=entry.get("every"),
            kwargs=entry.get("kwargs"),
            timezone=entry.get("timezone"),
            priority=entry.get("priority"),
            queue=entry.get("queue"),
            target=target,
        )


def _setting_task(task: object) -> Any:
    """A django.tasks Task named by dotted path in the setting, registered for the worker.

    Only for a name no @job holds: settings are code, so importing their path is safe."""
    if not isinstance(task, str) or task in registry.names() or "." not in task:
        return None
    try:
        found = import_string(task)
    except ImportError:
        return None
    return found if _task_of_or_none(found) else None


def _task_of_or_none(target: object) -> bool:
    try:
        return _task_of(target)[1] is not None
    except TypeError:
        return False


def declared() -> list[Schedule]:
    """Every schedule declared in code and in the setting, django.tasks tasks registered."""
    schedules = [*_declared, *from_setting()]
    for schedule in schedules:
        if schedule.target is not None:
            _register_task(schedule.target)
    return schedules


def _register_task(task: Any) -> None:
    """Let the worker run a scheduled django.tasks task: our backend registers it when it
    validates it (another backend's tasks stay unregistered, which the checks report)."""
    from django_pgjobs.backends import PgJobsBackend

    try:
        backend = task.get_backend()
    except Exception:
        return  # a missing or broken backend: the checks report the task as unregistered
    if isinstance(backend, PgJobsBackend):
        backend.validate_task(task)


def problems(schedules: list[Schedule]) -> list[tuple[str, str, str]]:
    """Every problem of these schedules, duplicate names included."""
    found = [problem for schedule in schedules for problem in schedule.problems()]
    seen: dict[object, Schedule] = {}
    for schedule in schedules:
        key = schedule.name if isinstance(schedule.name, str) else repr(schedule.name)
        if key in seen:
            found.append(
                (
                    "pgjobs.E035",
                    f"Two schedules are named {schedule.name!r} ({seen[key].origin} and "
                    f"{schedule.origin}).",
                    "Give one of them another name= (two schedules of one task with different "
                    "kwargs need two names).",
                )
            )
        else:
            seen[key] = schedule
    return found


def valid() -> list[Schedule]:
    """The declared schedules, or ``ImproperlyConfigured`` naming every problem."""
    from django.core.exceptions import ImproperlyConfigured

    schedules = declared()
    found = problems(schedules)
    if found:
        raise ImproperlyConfigured(
            "Invalid schedules (run `manage.py check`):\n"
            + "\n".join(f"  {check}: {message} {hint}" for check, message, hint in found)
        )
    return schedules


# -- the database ---------------------------------------------------------------------------


def database_now(connection: execute.Connection) -> datetime:
    """The database's clock: every tick is judged by it, never by a worker's."""
    value = execute.run(connection, NOW, {})[0][0]
    assert isinstance(value, datetime)
    # In UTC whatever the session's TimeZone (a worker's own connections keep the server's).
    return value.astimezone(dt_timezone.utc)


def enqueue_tick(connection: execute.Connection, schedule: Schedule, tick: datetime) -> int | None:
    """Record ``tick`` as the schedule's latest and enqueue its job, in one statement.

    Returns the new job's id; None when the row already held this tick or a later one
    (another worker enqueued it) or the schedule's spec changed (the row is reset to it).
    """
    func = registry.get(schedule.task)
    options = JobOptions.resolve(func, queue=schedule.queue or None, priority=schedule.priority)
    params = {
        "name": schedule.name,
        "spec": schedule.spec,
        "tick": tick,
        **options.columns(),
        "payload": validation.payload(schedule.payload()),
        "notify_channel": conf.channel(),
    }
    rows = execute.run(connection, TICK, params)
    return int(rows[0][0]) if rows else None


def record_failure(connection: execute.Connection, schedule: Schedule, error: str) -> None:
    """Keep a failed step's error on the schedule's row, for jobsdoctor and the admin."""
    execute.run(connection, TICK_FAILED, {"name": schedule.name, "error": error})


def states(connection: execute.Connection, names: list[str]) -> dict[str, dict[str, Any]]:
    """The rows of these schedules, with the status of each last tick's job."""
    rows = execute.run(connection, SCHEDULE_STATES, {"names": names})
    columns = (
        "name",
        "spec",
        "last_tick",
        "last_job_id",
        "last_error",
        "failures",
        "failed_at",
        "job_status",
    )
    return {row[0]: dict(zip(columns, row, strict=True)) for row in rows}
