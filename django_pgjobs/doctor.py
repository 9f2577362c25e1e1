"""Health reads of the queue, for the admin dashboard and ``manage.py jobsdoctor``.

``overview()`` is the live picture: per-queue depth and lag, throughput, recent failures.
Every query reads a partial index (ready, lease or failed rows) or a one-hour range of the
finished index, so it stays cheap with millions of done rows. ``diagnose()`` adds what
bites later (seed 003): dead rows and autovacuum, sessions idle in transaction and old
transactions that hold VACUUM back, invalid indexes, expired leases.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import connections

from django_pgjobs import conf, sql


@dataclass
class QueueHealth:
    """One queue's live numbers."""

    queue: str
    ready: int = 0
    scheduled: int = 0
    running: int = 0
    expired: int = 0
    failed: int = 0
    done_last_hour: int = 0
    lag_seconds: float = 0.0


@dataclass
class Minute:
    minute: datetime
    done: int = 0
    failed: int = 0


@dataclass
class Overview:
    queues: list[QueueHealth]
    minutes: list[Minute]
    failures: list[dict[str, Any]] = field(default_factory=list)

    @property
    def peak(self) -> int:
        return max((m.done + m.failed for m in self.minutes), default=0)


def live_queues(alias: str | None = None) -> dict[str, QueueHealth]:
    """Queues with queued, running or failed jobs, from the three partial indexes only."""
    connection = connections[alias or conf.database()]
    queues: dict[str, QueueHealth] = {}
    for name, ready, scheduled, lag in sql.run(connection, sql.QUEUE_DEPTH, {}):
        row = queues.setdefault(name, QueueHealth(name))
        row.ready, row.scheduled, row.lag_seconds = ready, scheduled, float(lag)
    for name, running, expired in sql.run(connection, sql.RUNNING_BY_QUEUE, {}):
        row = queues.setdefault(name, QueueHealth(name))
        row.running, row.expired = running, expired
    for name, failed in sql.run(connection, sql.FAILED_BY_QUEUE, {}):
        queues.setdefault(name, QueueHealth(name)).failed = failed
    return queues


def overview(alias: str | None = None, *, minutes: int = 60, failures: int = 10) -> Overview:
    """Per-queue numbers, throughput per minute over ``minutes`` and the last failures."""
    connection = connections[alias or conf.database()]
    queues = live_queues(alias)

    def health(name: str) -> QueueHealth:
        return queues.setdefault(name, QueueHealth(name))

    by_minute: dict[datetime, Minute] = {}
    for minute, name, done, failed in sql.run(connection, sql.THROUGHPUT, {"minutes": minutes}):
        slot = by_minute.setdefault(minute, Minute(minute))
        if name is None:
            continue
        health(name).done_last_hour += done
        slot.done += done
        slot.failed += failed
    columns = ("id", "task", "queue", "attempts", "finished_at", "last_error")
    recent = [
        dict(zip(columns, row, strict=True))
        for row in sql.run(connection, sql.RECENT_FAILURES, {"limit": failures})
    ]
    for failure in recent:
        # A traceback says what went wrong on its last line.
        lines = (failure["last_error"] or "").strip().splitlines()
        failure["error_line"] = lines[-1] if lines else ""
    return Overview(
        queues=sorted(queues.values(), key=lambda q: q.queue),
        minutes=sorted(by_minute.values(), key=lambda m: m.minute),
        failures=recent,
    )


@dataclass
class Thresholds:
    """When the doctor calls something a problem (seconds, or a ratio for dead rows)."""

    idle: float = 5.0
    transaction: float = 300.0
    lag: float = 300.0
    dead_ratio: float = 0.2
    dead_rows: int = 10_000


@dataclass
class Report:
    """Everything ``jobsdoctor`` shows; ``problems`` is empty when the queue is healthy."""

    queues: list[QueueHealth]
    expired_leases: list[dict[str, Any]]
    failures_last_hour: int
    recent_failures: list[dict[str, Any]]
    table: dict[str, Any]
    idle_in_transaction: list[dict[str, Any]]
    oldest_transaction: dict[str, Any] | None
    invalid_indexes: list[str]
    problems: list[str] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        return not self.problems


def diagnose(alias: str | None = None, thresholds: Thresholds | None = None) -> Report:
    """Read the queue's health and name each problem with what to do about it."""
    limits = thresholds or Thresholds()
    connection = connections[alias or conf.database()]
    live = overview(alias, minutes=60, failures=10)
    expired = sql.records(connection, sql.EXPIRED_LEASES, {"limit": 20})
    failures = sql.run(connection, sql.FAILURES_SINCE, {"window": timedelta(hours=1)})[0][0]
    (table,) = sql.records(connection, sql.TABLE_HEALTH, {})
    idle = sql.records(
        connection, sql.IDLE_IN_TRANSACTION, {"threshold": timedelta(seconds=limits.idle)}
    )
    oldest = next(iter(sql.records(connection, sql.OLDEST_TRANSACTION, {})), None)
    invalid = [row[0] for row in sql.run(connection, sql.INVALID_INDEXES, {})]
    report = Report(
        queues=live.queues,
        expired_leases=expired,
        failures_last_hour=int(failures),
        recent_failures=live.failures,
        table=table,
        idle_in_transaction=idle,
        oldest_transaction=oldest,
        invalid_indexes=invalid,
    )
    report.problems = _problems(report, limits)
    return report


def _problems(report: Report, limits: Thresholds) -> list[str]:
    problems = []
    for queue in report.queues:
        if queue.lag_seconds > limits.lag:
            problems.append(
                f"queue {queue.queue}: the oldest ready job has waited {queue.lag_seconds:.0f} s "
                f"({queue.ready} ready): workers are not keeping up or not running."
            )
    expired = sum(queue.expired for queue in report.queues)
    if expired:
        ids = ", ".join(str(row["id"]) for row in report.expired_leases[:5])
        problems.append(
            f"{expired} running job(s) have expired leases (e.g. {ids}): their worker died or "
            "hangs; run `manage.py reapjobs` or check that workers reap (--reap-interval)."
        )
    for session in report.idle_in_transaction:
        problems.append(
            f"session pid {session['pid']} ({session['usename']}, "
            f"{session['application_name'] or 'no application_name'}) has been idle in "
            f"transaction for {session['idle_for']:.0f} s: it holds back VACUUM for every "
            f"table in this database; last query: {one_line(session['query'])}"
        )
    oldest = report.oldest_transaction
    if oldest and oldest["age"] > limits.transaction:
        problems.append(
            f"transaction of pid {oldest['pid']} has been open for {oldest['age']:.0f} s "
            f"({oldest['state']}): VACUUM cannot remove rows that died since it began; "
            f"query: {one_line(oldest['query'])}"
        )
    for index in report.invalid_indexes:
        problems.append(
            f"index {index} is INVALID (a failed CREATE INDEX CONCURRENTLY): it slows every "
            f"write and is never used; DROP INDEX CONCURRENTLY {index}; then build it again."
        )
    options = report.table.get("reloptions") or []
    if not any(option.startswith("autovacuum_vacuum_scale_factor=") for option in options):
        problems.append(
            "pgjobs_job has no autovacuum_vacuum_scale_factor of its own (the migration sets "
            "0.01): ALTER TABLE pgjobs_job SET (autovacuum_vacuum_scale_factor = 0.01);"
        )
    live, dead = report.table.get("n_live_tup") or 0, report.table.get("n_dead_tup") or 0
    if dead > limits.dead_rows and dead > limits.dead_ratio * max(live, 1):
        problems.append(
            f"pgjobs_job has {dead} dead rows for {live} live ones: vacuum is not keeping up "
            "(an old transaction holding it back, or autovacuum too slow for this table)."
        )
    return problems


def one_line(text: str | None) -> str:
    return " ".join((text or "").split())[:120]
