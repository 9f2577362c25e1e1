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

from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.db import connections

from django_pgjobs.core import conf, schedules
from django_pgjobs.core.execute import records, run
from django_pgjobs.ops.dashboard import (
    live_workers,
    overview,
    queue_control,
    unrunnable,
)

if TYPE_CHECKING:
    from typing_extensions import LiteralString
from django_pgjobs.ops.findings import (
    CHECKS,
    SERVING_CHECKS,
    Finding,
    Holder,
    Report,
    Thresholds,
    one_line,
    who,
)

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
                detail=f"{oldest['state']}; {who(oldest)}",
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


def _literal(text: str) -> str:
    """``text`` as an SQL string literal, for a statement the reader can paste."""
    return "'" + text.replace("'", "''") + "'"
