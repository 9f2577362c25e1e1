"""What the doctor makes of what it read: the ``Report`` that ``diagnose()`` fills, the
``Thresholds`` it judges by, and ``CHECKS``, the independent checks that each read the report
and return its problems as sentences that say what to do. A new check is one more function in
that list. ``SERVING_CHECKS`` are the checks whose findings are outages (ready jobs are not
being run): what the health endpoint answers 503 for and ``Watch`` alarms on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from django_pgjobs.core import conf
from django_pgjobs.ops.dashboard import (
    QueueHealth,
)

if TYPE_CHECKING:
    pass


@dataclass
class Thresholds:
    """When the doctor calls something a problem.

    ``idle``, ``transaction`` and ``lag`` are seconds. ``slot_age`` is in transactions: a
    replication slot records no time, only the oldest transaction it still needs.
    ``naptimes`` is how many autovacuum rounds (``autovacuum_naptime`` each) may pass
    without a vacuum of a table past its threshold before that is a problem.
    """

    idle: float = 5.0
    transaction: float = 300.0
    lag: float = 300.0
    slot_age: int = 100_000
    naptimes: float = 10.0

    @classmethod
    def from_settings(cls) -> Thresholds:
        """The defaults, with the ones ``PGJOBS["HEALTH_THRESHOLDS"]`` sets."""
        return cls(**conf.health_thresholds())

    def __post_init__(self) -> None:
        for name in ("idle", "transaction", "lag", "slot_age", "naptimes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
                raise ValueError(f"Thresholds.{name} must be a number, 0 or more (got {value!r}).")


@dataclass
class Holder:
    """Something that holds back the xmin horizon: VACUUM keeps every row version that died
    after it began. ``age`` is in seconds where PostgreSQL records a start (sessions,
    prepared transactions), ``xmin_age`` in transactions; ``holds_table`` is False for a
    logical slot, whose ``catalog_xmin`` holds back only the system catalogs."""

    kind: str
    name: str
    detail: str
    age: float | None
    xmin_age: int | None
    fix: str
    query: str | None = None
    holds_table: bool = True

    def held_for(self) -> str:
        ages = [f"{self.age:.0f} s"] if self.age is not None else []
        if self.xmin_age is not None:
            ages.append(f"{self.xmin_age} transactions")
        return ", ".join(ages) or "an unknown time"

    def __str__(self) -> str:
        return f"{self.kind} {self.name} ({self.detail})"


@dataclass(frozen=True)
class Finding:
    """One problem of a report: the check that found it (``queue_lag``, ``expired_leases``,
    ...), its sentence, and whether it is an outage (ready jobs are not being run)."""

    check: str
    problem: str
    outage: bool


@dataclass
class Report:
    """Everything ``jobsdoctor`` shows; ``problems`` is empty when the queue is healthy."""

    queues: list[QueueHealth]
    expired_leases: list[dict[str, Any]]
    failures_last_hour: int
    recent_failures: list[dict[str, Any]]
    table: dict[str, Any]
    settings: dict[str, Any]
    idle_in_transaction: list[dict[str, Any]]
    oldest_transaction: dict[str, Any] | None
    horizon: list[Holder]
    vacuum_locks: list[dict[str, Any]]
    invalid_indexes: list[str]
    # What holds payloads to JSON objects: "CHECK" (before migration 0011), else how the
    # trigger is enabled (pg_trigger.tgenabled: "A" always), None when neither is there.
    payload_rule: str | None
    # Each declared periodic schedule: its last and next tick, its last job, its errors.
    schedules: list[dict[str, Any]] = field(default_factory=list)
    # Jobs failed in the last hour because their workers kept dying (WorkerCrashed), and the
    # live jobs whose latest attempt ended with a dead worker.
    quarantined: list[dict[str, Any]] = field(default_factory=list)
    # How many were quarantined in the last hour (``quarantined`` lists the latest 20).
    quarantined_count: int = 0
    suspects: int = 0
    # The registry's live workers, and the ready jobs none of them can run (per queue and
    # task; ``served`` false: no live worker serves the queue at all).
    workers: list[dict[str, Any]] = field(default_factory=list)
    unrunnable: list[dict[str, Any]] = field(default_factory=list)
    # Queues an operator paused: information, not a problem (their jobs wait on purpose).
    paused: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        return not self.problems

    @property
    def dead_rows(self) -> int:
        return int(self.table.get("n_dead_tup") or 0)

    @property
    def past_vacuum_threshold(self) -> bool:
        """Whether autovacuum would vacuum the table now: more dead rows than its threshold."""
        return self.dead_rows > int(self.table["vacuum_threshold"])

    @property
    def autovacuum_on(self) -> bool:
        """Whether autovacuum vacuums this table at all (server, statistics and table)."""
        return bool(
            self.settings["autovacuum"]
            and self.settings["track_counts"]
            and self.table.get("autovacuum_enabled") is not False
        )


def who(session: dict[str, Any]) -> str:
    return f"{session['usename']}, {session['application_name'] or 'no application_name'}"


# -- the checks: each reads the report and returns its problems, most urgent first.

Check = Callable[[Report, Thresholds], list[str]]


def check_queue_lag(report: Report, limits: Thresholds) -> list[str]:
    """A paused queue's jobs wait on purpose: the report lists it as paused, not as late."""
    return [
        f"queue {queue.queue}: the oldest ready job has waited {queue.lag_seconds:.0f} s "
        f"({queue.ready} ready): workers are not keeping up or not running."
        for queue in report.queues
        if queue.lag_seconds > limits.lag and queue.queue not in report.paused
    ]


def check_unrunnable(report: Report, limits: Thresholds) -> list[str]:
    """Ready jobs no live worker can run wait until one that can starts: a problem at once,
    as the lag check would call it only later (and not per task). Not in a paused queue,
    whose jobs wait on purpose."""
    problems = []
    for row in report.unrunnable:
        if row["queue"] in report.paused:
            continue  # nothing runs there until it is resumed, by design
        what = f"queue {row['queue']}: {row['ready']} ready job(s) of {row['task']}"
        if not row["served"]:
            problems.append(
                f"{what} and no live worker serves the queue: start a worker with "
                f"`manage.py runjobs --queue {row['queue']}`."
            )
        else:
            problems.append(
                f"{what}, a task none of the live workers serving the queue has registered "
                "(old code, or a module they do not import): deploy workers that know it; "
                "they claim only the tasks they have registered "
                "(PGJOBS['CLAIM_REGISTERED_ONLY'])."
            )
    return problems


def check_expired_leases(report: Report, limits: Thresholds) -> list[str]:
    expired = sum(queue.expired for queue in report.queues)
    if not expired:
        return []
    ids = ", ".join(str(row["id"]) for row in report.expired_leases[:5])
    return [
        f"{expired} running job(s) have expired leases (e.g. {ids}): their worker died or "
        "hangs; run `manage.py reapjobs` or check that workers reap (--reap-interval)."
    ]


def check_quarantined(report: Report, limits: Thresholds) -> list[str]:
    return [
        f"job {job['id']} {job['task']} (queue {job['queue']}) was failed after its worker died "
        f"{job['crashes']} times in a row while running it: it kills its worker (out of "
        "memory? os._exit()? a segfault in a C extension?); fix it, then retry it from the "
        "admin or with Job.objects.retry()."
        for job in report.quarantined
    ]


def check_idle_in_transaction(report: Report, limits: Thresholds) -> list[str]:
    problems = []
    for session in report.idle_in_transaction:
        harm = (
            "it holds back VACUUM for every table in this database"
            if session["holds_horizon"]
            else "it holds its locks and a connection"
        )
        problems.append(
            f"session pid {session['pid']} ({who(session)}) has been idle in transaction for "
            f"{session['idle_for']:.0f} s: {harm}; last query: {one_line(session['query'])}"
        )
    return problems


def check_horizon(report: Report, limits: Thresholds) -> list[str]:
    """Each holder old enough to matter, once the table has more dead rows than autovacuum
    lets pass: below that, vacuum has nothing to do yet and the holder costs nothing here."""
    if not report.past_vacuum_threshold:
        return []
    problems = []
    for holder in report.horizon:
        if not holder.holds_table:
            continue
        if holder.age is not None:
            old = holder.age > limits.transaction
        else:
            old = (holder.xmin_age or 0) > limits.slot_age
        if old:
            query = f"last query: {holder.query}; " if holder.query else ""
            problems.append(
                f"{holder} has held back the xmin horizon for {holder.held_for()}: VACUUM "
                f"cannot remove the rows of pgjobs_job that died since ({report.dead_rows} "
                f"dead, autovacuum's threshold is {report.table['vacuum_threshold']}); "
                f"{query}{holder.fix}"
            )
    return problems


def check_invalid_indexes(report: Report, limits: Thresholds) -> list[str]:
    return [
        f"index {index} is INVALID (a failed CREATE INDEX CONCURRENTLY): it slows every "
        f"write and is never used; DROP INDEX CONCURRENTLY {index}; then build it again."
        for index in report.invalid_indexes
    ]


def check_payload_trigger(report: Report, limits: Thresholds) -> list[str]:
    enable = "ALTER TABLE pgjobs_job ENABLE ALWAYS TRIGGER pgjobs_job_payload_check;"
    if report.payload_rule in ("A", "CHECK"):
        return []
    if report.payload_rule is None:
        return [
            "the trigger pgjobs_job_payload_check is missing: a row whose payload is not a "
            "JSON object can be written, and its job can never run; run manage.py migrate "
            "django_pgjobs, or, if migration 0011 is applied already, run the SQL that "
            "python manage.py sqlmigrate django_pgjobs 0011 prints (it creates the function "
            "and the trigger and reads no row)."
        ]
    if report.payload_rule == "D":
        return [
            "the trigger pgjobs_job_payload_check is disabled: a row whose payload is not a "
            f"JSON object can be written, and its job can never run; {enable}"
        ]
    return [
        "the trigger pgjobs_job_payload_check is not enabled ALWAYS: sessions in "
        f"session_replication_role = replica skip it (or only they run it); {enable}"
    ]


def check_autovacuum_settings(report: Report, limits: Thresholds) -> list[str]:
    problems = []
    if not report.settings["autovacuum"]:
        problems.append(
            "autovacuum is off on this server: nothing removes the dead rows every claim and "
            "every outcome leave in pgjobs_job; set autovacuum = on in postgresql.conf (the "
            "default) and reload."
        )
    if not report.settings["track_counts"]:
        problems.append(
            "track_counts is off: PostgreSQL does not count dead rows, so autovacuum never "
            "sees that pgjobs_job needs a vacuum (and this report's row counts stand still); "
            "set track_counts = on (the default) for the server and this database."
        )
    if report.table.get("autovacuum_enabled") is False:
        problems.append(
            "pgjobs_job has autovacuum_enabled = false: autovacuum never vacuums it; "
            "ALTER TABLE pgjobs_job RESET (autovacuum_enabled);"
        )
    options = report.table.get("reloptions") or []
    if not any(option.startswith("autovacuum_vacuum_scale_factor=") for option in options):
        problems.append(
            "pgjobs_job has no autovacuum_vacuum_scale_factor of its own (the migration sets "
            "0.01): ALTER TABLE pgjobs_job SET (autovacuum_vacuum_scale_factor = 0.01);"
        )
    return problems


def check_autovacuum_behind(report: Report, limits: Thresholds) -> list[str]:
    """Autovacuum should come within a round or two of the table passing its threshold; many
    rounds without it mean it cannot (a lock keeps it out) or does not get to it (its workers
    busy elsewhere). Skipped while a vacuum runs, and when autovacuum is off (reported as a
    setting)."""
    table, naptime = report.table, report.settings["autovacuum_naptime"]
    if (
        not report.autovacuum_on
        or not report.past_vacuum_threshold
        or table["vacuum_running"]
        or table["unvacuumed_for"] <= limits.naptimes * naptime
    ):
        return []
    last = table["last_autovacuum"] or table["last_vacuum"]
    since = f"since {last:%Y-%m-%d %H:%M:%S%z}" if last else "since the server started"
    if report.vacuum_locks:
        cause = "; ".join(
            f"pid {lock['pid']} ({who(lock)}, {lock['state']}) has held {lock['mode']} on it "
            f"for {lock['held_for']:.0f} s, which autovacuum cannot get past; query: "
            f"{one_line(lock['query'])}"
            for lock in report.vacuum_locks
        )
    else:
        cause = (
            "its workers may all be busy on other tables (autovacuum_max_workers) or too slow "
            "(autovacuum_vacuum_cost_limit); log_autovacuum_min_duration = 0 makes the "
            "server log each of their runs"
        )
    return [
        f"autovacuum has not vacuumed pgjobs_job {since} ({table['unvacuumed_for']:.0f} s, "
        f"more than {limits.naptimes:g} rounds of autovacuum_naptime = {naptime:g} s) although "
        f"its {report.dead_rows} dead rows are past its threshold of "
        f"{table['vacuum_threshold']}: {cause}."
    ]


# Failed scheduler steps in a row that jobsdoctor reports as a problem.
SCHEDULER_FAILURES = 3


def check_schedule_health(report: Report, limits: Thresholds) -> list[str]:
    problems = []
    for schedule in report.schedules:
        # One failed step is retried at the next tick; a run of them is the problem.
        if schedule["last_error"] and schedule["failures"] >= SCHEDULER_FAILURES:
            problems.append(
                f"schedule {schedule['name']}: its last {schedule['failures']} scheduler "
                f"step(s) failed (the latest at {schedule['failed_at']:%Y-%m-%d %H:%M:%S%z}): "
                f"{one_line(schedule['last_error'].strip().splitlines()[0])}; the workers' logs "
                "have the traceback (logger django_pgjobs.scheduler)."
            )
        if schedule["overdue"]:
            problems.append(
                f"schedule {schedule['name']} ({schedule['description']}) is overdue: its last "
                f"tick enqueued is {schedule['last_tick']:%Y-%m-%d %H:%M:%S%z}, but the tick "
                f"due at {schedule['due']:%Y-%m-%d %H:%M:%S%z} and the one before it were "
                "not: no worker is running the scheduler (start runjobs without "
                "--no-schedule)."
            )
    return problems


CHECKS: list[Check] = [
    check_queue_lag,
    check_unrunnable,
    check_expired_leases,
    check_quarantined,
    check_idle_in_transaction,
    check_horizon,
    check_invalid_indexes,
    check_payload_trigger,
    check_autovacuum_settings,
    check_autovacuum_behind,
    check_schedule_health,
]


# The checks whose findings are outages: jobs that should run are not being run (they wait
# past the lag threshold, no live worker can run them, or their worker is gone).
SERVING_CHECKS: tuple[Check, ...] = (check_queue_lag, check_unrunnable, check_expired_leases)


def one_line(text: str | None) -> str:
    return " ".join((text or "").split())[:120]
