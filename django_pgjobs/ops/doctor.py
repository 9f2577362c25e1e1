"""``manage.py jobsdoctor``'s diagnosis: ``diagnose()`` adds to the dashboard's live picture
(``ops.dashboard``) what bites later: expired leases, sessions idle in transaction, invalid
indexes, and vacuum.

Vacuum is judged by what stops it, not by the count of dead rows: a queue table always has
many between two autovacuum runs (each claim and each outcome leaves one). What matters is
dead rows autovacuum cannot remove (a session, a prepared transaction or a replication slot
holding the xmin horizon), autovacuum not coming although the table is past its threshold,
and settings that turn it off. The dead-to-live ratio is shown, never judged.

It also reports the ready jobs no live worker can run (``dashboard.UNRUNNABLE``): a job whose
queue no live worker serves, or whose task none of them has registered, waits for good.

``diagnose()`` gathers the facts into a ``Report`` and then runs each function of
``CHECKS`` on it; each returns its problems as sentences that say what to do. A new check is
one more function in that list. Each problem is also kept as a ``Finding`` that names its check
and says whether it is an outage (``SERVING_CHECKS``: ready jobs are not being run), which is
what the health endpoint answers 503 for and ``Watch`` (``jobsdoctor --watch``) alarms on; the
other findings (vacuum, failures, schedules) are warnings there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.db import connections

from django_pgjobs import conf, schedules
from django_pgjobs.core.execute import records, run
from django_pgjobs.ops.dashboard import (
    QueueHealth,
    live_workers,
    overview,
    queue_control,
    unrunnable,
)

if TYPE_CHECKING:
    from typing_extensions import LiteralString

# -- the doctor's reads of PostgreSQL's own statistics and catalogs. Ages are float8 seconds:
# extract() gives numeric, which `jobsdoctor --json` would print as a string. Ages in
# transactions (`age(xid)`) are integers.

EXPIRED_LEASES: LiteralString = """
SELECT id, task, queue, attempts,
       extract(epoch FROM now() - locked_until)::float8 AS expired_for
FROM pgjobs_job
WHERE status = 'running' AND locked_until < now()
ORDER BY locked_until
LIMIT %(limit)s
"""


FAILURES_SINCE: LiteralString = """
SELECT count(*) FROM pgjobs_job
WHERE status = 'failed' AND finished_at >= now() - %(window)s::interval
"""


# Jobs failed within the window because their workers kept dying (quarantined by the reap),
# told apart from other failures by the class of their latest error. `total` counts them all,
# the LIMIT aside (a window is computed before the LIMIT applies).
QUARANTINED: LiteralString = """
SELECT id, task, queue, attempts, crashes, finished_at, count(*) OVER () AS total
FROM pgjobs_job
WHERE status = 'failed' AND finished_at >= now() - %(window)s::interval
  AND errors -> -1 ->> 'exception_class_path' = 'django_pgjobs.exceptions.WorkerCrashed'
ORDER BY finished_at DESC
LIMIT %(limit)s
"""


# Live jobs whose latest attempt ended with its worker dead: each runs alone when next claimed.
# Two equalities, not IN: a BitmapOr over the partial indexes of queued and running jobs.
SUSPECTS: LiteralString = """
SELECT count(*) FROM pgjobs_job
WHERE (status = 'queued' OR status = 'running') AND crashes > 0
"""


# The table's vacuum statistics and the numbers autovacuum decides with: it vacuums once
# n_dead_tup exceeds threshold + scale_factor * reltuples (reltuples < 0, never counted, as 0;
# PostgreSQL 18 caps that at max_threshold), each taken from the table's own storage options
# when set there, else from the server's settings. `unvacuumed_for` counts from the last
# vacuum of either kind, or from the server's start for a table never vacuumed: autovacuum
# cannot have been failing before the server ran.
TABLE_HEALTH: LiteralString = """
SELECT s.n_live_tup, s.n_dead_tup, s.last_autovacuum, s.last_vacuum, s.autovacuum_count,
       c.reloptions, c.reltuples::float8 AS reltuples,
       o.enabled AS autovacuum_enabled,
       coalesce(o.threshold, current_setting('autovacuum_vacuum_threshold')::float8)
           AS vacuum_base_threshold,
       coalesce(o.scale_factor, current_setting('autovacuum_vacuum_scale_factor')::float8)
           AS vacuum_scale_factor,
       coalesce(o.max_threshold,
                current_setting('autovacuum_vacuum_max_threshold', true)::float8)
           AS vacuum_max_threshold,
       extract(epoch FROM now() - coalesce(greatest(s.last_autovacuum, s.last_vacuum),
                                           pg_postmaster_start_time()))::float8
           AS unvacuumed_for,
       EXISTS (SELECT FROM pg_stat_progress_vacuum p WHERE p.relid = c.oid) AS vacuum_running
FROM pg_class c
LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
CROSS JOIN LATERAL (
    SELECT bool_and(option_value::bool) FILTER (WHERE option_name = 'autovacuum_enabled')
               AS enabled,
           max(option_value::float8) FILTER (WHERE option_name = 'autovacuum_vacuum_threshold')
               AS threshold,
           max(option_value::float8)
               FILTER (WHERE option_name = 'autovacuum_vacuum_scale_factor') AS scale_factor,
           max(option_value::float8)
               FILTER (WHERE option_name = 'autovacuum_vacuum_max_threshold') AS max_threshold
    FROM pg_options_to_table(c.reloptions)
) o
WHERE c.oid = 'pgjobs_job'::regclass
"""


# The server settings autovacuum depends on, as this session sees them (track_counts can be
# set per database: sessions that do not count leave autovacuum nothing to act on).
VACUUM_SETTINGS: LiteralString = """
SELECT current_setting('autovacuum')::bool AS autovacuum,
       current_setting('track_counts')::bool AS track_counts,
       extract(epoch FROM current_setting('autovacuum_naptime')::interval)::float8
           AS autovacuum_naptime
"""


# Sessions of this database (vacuum of an ordinary table only waits for those) that sit in an
# open transaction doing nothing, longest first. Only those with a snapshot or a transaction
# id hold VACUUM back; the others still hold their locks and a connection.
IDLE_IN_TRANSACTION: LiteralString = """
SELECT pid, usename, application_name,
       extract(epoch FROM now() - state_change)::float8 AS idle_for,
       extract(epoch FROM now() - xact_start)::float8 AS open_for, left(query, 200) AS query,
       backend_xmin IS NOT NULL OR backend_xid IS NOT NULL AS holds_horizon
FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid()
  AND state IN ('idle in transaction', 'idle in transaction (aborted)')
  AND now() - state_change > %(threshold)s::interval
ORDER BY state_change
"""


# The oldest transaction that holds VACUUM back: one with a snapshot (backend_xmin), or one
# that has written (backend_xid: between statements a READ COMMITTED writer has no snapshot,
# but its own transaction id still keeps the horizon).
OLDEST_TRANSACTION: LiteralString = """
SELECT pid, usename, application_name, state,
       extract(epoch FROM now() - xact_start)::float8 AS age,
       greatest(age(backend_xmin), age(backend_xid)) AS xmin_age,
       left(query, 200) AS query
FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid()
  AND xact_start IS NOT NULL AND (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL)
  AND backend_type = 'client backend'
ORDER BY xact_start
LIMIT 1
"""


# Prepared transactions (two-phase commit) of this database: each keeps its transaction id,
# and so the horizon, until someone runs COMMIT PREPARED or ROLLBACK PREPARED, whatever
# happened to the session or the coordinator that prepared it.
PREPARED_TRANSACTIONS: LiteralString = """
SELECT gid, owner, prepared,
       extract(epoch FROM now() - prepared)::float8 AS age,
       age(transaction) AS xmin_age
FROM pg_prepared_xacts
WHERE database = current_database()
ORDER BY prepared
"""


# Replication slots that keep a horizon. `xmin` (a physical slot fed by a standby's
# hot_standby_feedback) holds back every table of every database, and stays when the standby
# goes away; `catalog_xmin` (a logical slot) holds back only the system catalogs. A slot has
# no start time: its age is in transactions. The walsender, when one is connected, says who.
REPLICATION_SLOTS: LiteralString = """
SELECT s.slot_name, s.slot_type, s.database, s.active, s.active_pid,
       age(s.xmin) AS xmin_age, age(s.catalog_xmin) AS catalog_xmin_age,
       r.application_name, r.client_addr::text AS client_addr
FROM pg_replication_slots s
LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid
WHERE s.xmin IS NOT NULL OR s.catalog_xmin IS NOT NULL
ORDER BY greatest(age(s.xmin), age(s.catalog_xmin)) DESC, s.slot_name
"""


# Sessions holding a lock on the table that autovacuum's SHARE UPDATE EXCLUSIVE conflicts
# with (a CREATE INDEX, even CONCURRENTLY, a VALIDATE CONSTRAINT, a LOCK TABLE): autovacuum
# skips a table it cannot lock at once, so while one is held the table is never vacuumed.
# Autovacuum's own lock is not one of them.
VACUUM_LOCKS: LiteralString = """
SELECT a.pid, a.usename, a.application_name, a.state, l.mode,
       extract(epoch FROM now() - coalesce(a.xact_start, a.query_start))::float8 AS held_for,
       left(a.query, 200) AS query
FROM pg_locks l
JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'relation' AND l.relation = 'pgjobs_job'::regclass AND l.granted
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND l.mode IN ('ShareUpdateExclusiveLock', 'ShareLock', 'ShareRowExclusiveLock',
                 'ExclusiveLock', 'AccessExclusiveLock')
  AND a.backend_type <> 'autovacuum worker' AND a.pid <> pg_backend_pid()
ORDER BY a.xact_start NULLS LAST, a.pid
"""


# What holds payloads to JSON objects: 'CHECK' while the table has 0006's constraint (before
# migration 0011), else the trigger's pg_trigger.tgenabled ('A' always, 'O' origin and local
# sessions, 'R' replica sessions only, 'D' disabled), NULL when neither is there.
PAYLOAD_RULE: LiteralString = """
SELECT coalesce(
  (SELECT 'CHECK' FROM pg_constraint
   WHERE conrelid = 'pgjobs_job'::regclass AND conname = 'pgjobs_job_payload_check'),
  (SELECT tgenabled::text FROM pg_trigger
   WHERE tgrelid = 'pgjobs_job'::regclass AND tgname = 'pgjobs_job_payload_check'))
"""


INVALID_INDEXES: LiteralString = """
SELECT i.indexrelid::regclass::text
FROM pg_index i
WHERE i.indrelid = 'pgjobs_job'::regclass AND NOT i.indisvalid
ORDER BY 1
"""


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


# What stands for another session's SQL where the report must not quote it.
HIDDEN_QUERY = "(not shown here: see jobsdoctor)"


def diagnose(
    alias: str | None = None, thresholds: Thresholds | None = None, *, queries: bool = True
) -> Report:
    """Read the queue's health and name each problem with what to do about it. Without
    ``queries``, the text of other sessions' SQL (which may hold any literal: an email, a
    token) is left out of the report, for readers who are not the database's operators."""
    limits = thresholds or Thresholds()
    connection = connections[alias or conf.database()]
    live = overview(alias, minutes=60, failures=10)
    expired = records(connection, EXPIRED_LEASES, {"limit": 20})
    failures = run(connection, FAILURES_SINCE, {"window": timedelta(hours=1)})[0][0]
    (table,) = records(connection, TABLE_HEALTH, {})
    table["vacuum_threshold"] = vacuum_threshold(table)
    live_rows, dead_rows = table["n_live_tup"] or 0, table["n_dead_tup"] or 0
    table["dead_per_live_row"] = round(dead_rows / max(live_rows, 1), 2)
    (settings,) = records(connection, VACUUM_SETTINGS, {})
    idle = records(connection, IDLE_IN_TRANSACTION, {"threshold": timedelta(seconds=limits.idle)})
    oldest = next(iter(records(connection, OLDEST_TRANSACTION, {})), None)
    horizon = _horizon(
        oldest,
        records(connection, PREPARED_TRANSACTIONS, {}),
        records(connection, REPLICATION_SLOTS, {}),
    )
    quarantined = records(connection, QUARANTINED, {"window": timedelta(hours=1), "limit": 20})
    vacuum_locks = records(connection, VACUUM_LOCKS, {})
    if not queries:
        for session in (*idle, *vacuum_locks, *([oldest] if oldest else [])):
            session["query"] = HIDDEN_QUERY
        for holder in horizon:
            holder.query = HIDDEN_QUERY if holder.query else None
    report = Report(
        queues=live.queues,
        expired_leases=expired,
        failures_last_hour=int(failures),
        recent_failures=live.failures,
        table=table,
        settings=settings,
        idle_in_transaction=idle,
        oldest_transaction=oldest,
        horizon=horizon,
        vacuum_locks=vacuum_locks,
        invalid_indexes=[row[0] for row in run(connection, INVALID_INDEXES, {})],
        payload_rule=run(connection, PAYLOAD_RULE, {})[0][0],
        schedules=schedule_health(alias),
        quarantined=[{k: v for k, v in row.items() if k != "total"} for row in quarantined],
        quarantined_count=int(quarantined[0]["total"]) if quarantined else 0,
        suspects=int(run(connection, SUSPECTS, {})[0][0]),
        workers=live_workers(alias),
        unrunnable=unrunnable(alias),
        paused=[name for name, state in queue_control(alias).items() if state.paused],
    )
    report.findings = [
        Finding(check.__name__.removeprefix("check_"), problem, check in SERVING_CHECKS)
        for check in CHECKS
        for problem in check(report, limits)
    ]
    report.problems = [finding.problem for finding in report.findings]
    return report


def schedule_health(alias: str | None = None) -> list[dict[str, Any]]:
    """Each valid declared schedule, by name, with what its row says, judged by the database
    clock: ``overdue`` when the tick before the latest one was never enqueued (no worker ran
    the scheduler for a whole tick). Only declared schedules: a removed one's row is inert."""
    valid = [s for s in schedules.declared() if not s.problems()]
    if not valid:
        return []
    connection = connections[alias or conf.database()]
    now = schedules.database_now(connection)
    states = schedules.states(connection, [s.name for s in valid])
    found = []
    for schedule in sorted(valid, key=lambda s: s.name):
        latest, following = schedules.ticks(schedule, now)
        previous, _ = schedules.ticks(schedule, latest - timedelta(microseconds=1))
        state = states.get(schedule.name, {})
        last_tick = state.get("last_tick")
        found.append(
            {
                "name": schedule.name,
                "task": schedule.task,
                "expression": schedule.cron or schedule.spec,
                "description": schedule.describe(),
                "kwargs": schedule.kwargs or {},
                "last_tick": last_tick,
                "next_tick": following,
                "last_job_id": state.get("last_job_id"),
                "job_status": state.get("job_status"),
                "last_error": state.get("last_error"),
                "failures": state.get("failures") or 0,
                "failed_at": state.get("failed_at"),
                "overdue": last_tick is not None and last_tick < previous,
                "due": latest,
            }
        )
    return found


def vacuum_threshold(table: dict[str, Any]) -> int:
    """The number of dead rows past which autovacuum vacuums the table, computed as
    PostgreSQL does (a table never counted has ``reltuples`` -1, taken as 0)."""
    threshold = table["vacuum_base_threshold"] + table["vacuum_scale_factor"] * max(
        table["reltuples"], 0.0
    )
    cap = table["vacuum_max_threshold"]
    if cap is not None and cap >= 0:
        threshold = min(threshold, cap)
    return int(threshold)


def _horizon(
    oldest: dict[str, Any] | None,
    prepared: list[dict[str, Any]],
    slots: list[dict[str, Any]],
) -> list[Holder]:
    holders = []
    if oldest:
        holders.append(
            Holder(
                kind="session",
                name=f"pid {oldest['pid']}",
                detail=f"{oldest['state']}; {_who(oldest)}",
                age=oldest["age"],
                xmin_age=oldest["xmin_age"],
                fix=(
                    "commit it or end it where it started, or, if it is abandoned, "
                    f"SELECT pg_terminate_backend({oldest['pid']});"
                ),
                query=one_line(oldest["query"]),
            )
        )
    for xact in prepared:
        gid = _literal(xact["gid"])
        holders.append(
            Holder(
                kind="prepared transaction",
                name=gid,
                detail=f"owner {xact['owner']}, prepared at {xact['prepared']:%Y-%m-%d %H:%M:%S%z}",
                age=xact["age"],
                xmin_age=xact["xmin_age"],
                fix=(
                    "it outlives the session that prepared it, so only its transaction manager "
                    f"or you can end it: COMMIT PREPARED {gid}; or ROLLBACK PREPARED {gid};"
                ),
            )
        )
    for slot in slots:
        name = _literal(slot["slot_name"])
        if slot["active"]:
            client = slot["application_name"] or slot["client_addr"] or "unknown client"
            state = f"active: walsender pid {slot['active_pid']} for {client}"
        else:
            state = "inactive"
        holds_table = slot["xmin_age"] is not None
        if holds_table and slot["active"]:
            fix = (
                "its standby sends the xmin of its oldest query (hot_standby_feedback): end the "
                "long queries there, or turn hot_standby_feedback off on the standby."
            )
        elif holds_table:
            fix = (
                "no standby is connected, so nothing will move it: if the standby is gone for "
                f"good, SELECT pg_drop_replication_slot({name});"
            )
        else:
            fix = "it holds back only the system catalogs' vacuum, not pgjobs_job's."
        holders.append(
            Holder(
                kind=f"{slot['slot_type']} replication slot",
                name=name,
                detail=state if holds_table else f"{state}; catalog_xmin only",
                age=None,
                xmin_age=slot["xmin_age"] if holds_table else slot["catalog_xmin_age"],
                fix=fix,
                holds_table=holds_table,
            )
        )
    return holders


def _who(session: dict[str, Any]) -> str:
    return f"{session['usename']}, {session['application_name'] or 'no application_name'}"


def _literal(text: str) -> str:
    """``text`` as an SQL string literal, for a statement the reader can paste."""
    return "'" + text.replace("'", "''") + "'"


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
            f"session pid {session['pid']} ({_who(session)}) has been idle in transaction for "
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
            f"pid {lock['pid']} ({_who(lock)}, {lock['state']}) has held {lock['mode']} on it "
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
