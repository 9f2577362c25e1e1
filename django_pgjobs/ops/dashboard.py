"""The live picture of the queues, for the admin dashboard, the metrics and ``jobsdoctor``: depth
and lag, throughput, recent failures, queue control and the live workers. Every query reads a
partial index or a short range of the finished index, so it stays cheap with millions of done
rows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db import connections

from django_pgjobs.core import conf
from django_pgjobs.core.fragments import READY
from django_pgjobs.models import QueueState

if TYPE_CHECKING:
    from typing_extensions import LiteralString
from django_pgjobs.core.execute import records, run
from django_pgjobs.core.types import last_line

# -- health and dashboard reads. Each reads one partial index (ready, lease, failed) or a
# range of the finished index, so their cost follows the live rows, not the done history.

# Per queue: ready and scheduled jobs, and the age of the oldest ready one (the lag).
QUEUE_DEPTH: LiteralString = """
SELECT queue,
       count(*) FILTER (WHERE run_at <= now()) AS ready,
       count(*) FILTER (WHERE run_at > now()) AS scheduled,
       coalesce(extract(epoch FROM now() - min(run_at) FILTER (WHERE run_at <= now())), 0)
         AS lag_seconds
FROM pgjobs_job
WHERE status = 'queued'
GROUP BY queue
"""


RUNNING_BY_QUEUE: LiteralString = """
SELECT queue, count(*) AS running, count(*) FILTER (WHERE locked_until < now()) AS expired
FROM pgjobs_job
WHERE status = 'running'
GROUP BY queue
"""


FAILED_BY_QUEUE: LiteralString = """
SELECT queue, count(*) AS failed
FROM pgjobs_job
WHERE status = 'failed'
GROUP BY queue
"""


# Jobs finished in each of the last %(minutes)s minutes (this one included), per queue and
# outcome; a minute with none comes back once, with a NULL queue. One short range scan of
# the finished index per minute.
THROUGHPUT: LiteralString = """
WITH minutes AS (
  SELECT generate_series(date_trunc('minute', now()) - (%(minutes)s - 1) * interval '1 minute',
                         date_trunc('minute', now()), interval '1 minute') AS minute
)
SELECT m.minute, j.queue,
       count(j.id) FILTER (WHERE j.status = 'done') AS done,
       count(j.id) FILTER (WHERE j.status = 'failed') AS failed
FROM minutes m
LEFT JOIN pgjobs_job j
  ON j.finished_at >= m.minute AND j.finished_at < m.minute + interval '1 minute'
GROUP BY 1, 2
ORDER BY 1, 2
"""


RECENT_FAILURES: LiteralString = """
SELECT id, task, queue, attempts, finished_at, last_error
FROM pgjobs_job
WHERE status = 'failed' AND finished_at IS NOT NULL
ORDER BY finished_at DESC
LIMIT %(limit)s
"""


LIVE_WORKERS: LiteralString = """
SELECT id, host, pid, mode, queues, tasks, version, started_at, heartbeat_at
FROM pgjobs_worker
WHERE expires_at >= now()
ORDER BY started_at, id
"""


# Ready jobs that no live worker can run, per queue and task: no live worker serves the queue
# (`served` false), or none that does has the task registered. A worker that claims any task
# (tasks NULL) can run them all. Grouped first, so the workers are checked once per queue and
# task, not once per ready job (a backlog of 200,000 with 50 live workers: 1.2 s the other way).
UNRUNNABLE: LiteralString = (
    """
WITH ready AS (
  SELECT queue, task, count(*) AS ready FROM pgjobs_job
  WHERE """
    + READY
    + """
  GROUP BY queue, task
)
SELECT r.queue, r.task, r.ready,
       EXISTS (SELECT FROM pgjobs_worker w
               WHERE w.expires_at >= now() AND w.queues ? r.queue) AS served
FROM ready r
WHERE NOT EXISTS (SELECT FROM pgjobs_worker w
                  WHERE w.expires_at >= now() AND w.queues ? r.queue
                    AND (w.tasks IS NULL OR r.task = ANY(w.tasks)))
ORDER BY r.queue, r.task
"""
)


# The planner's row estimate (refreshed by ANALYZE/autovacuum): counting millions of done
# rows for an admin page would read the whole table.
ESTIMATED_ROWS: LiteralString = "SELECT reltuples FROM pg_class WHERE oid = 'pgjobs_job'::regclass"


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
    for name, ready, scheduled, lag in run(connection, QUEUE_DEPTH, {}):
        row = queues.setdefault(name, QueueHealth(name))
        row.ready, row.scheduled, row.lag_seconds = ready, scheduled, float(lag)
    for name, running, expired in run(connection, RUNNING_BY_QUEUE, {}):
        row = queues.setdefault(name, QueueHealth(name))
        row.running, row.expired = running, expired
    for name, failed in run(connection, FAILED_BY_QUEUE, {}):
        queues.setdefault(name, QueueHealth(name)).failed = failed
    return queues


def overview(alias: str | None = None, *, minutes: int = 60, failures: int = 10) -> Overview:
    """Per-queue numbers, throughput per minute over ``minutes`` and the last failures."""
    connection = connections[alias or conf.database()]
    queues = live_queues(alias)

    def health(name: str) -> QueueHealth:
        return queues.setdefault(name, QueueHealth(name))

    by_minute: dict[datetime, Minute] = {}
    for minute, name, done, failed in run(connection, THROUGHPUT, {"minutes": minutes}):
        slot = by_minute.setdefault(minute, Minute(minute))
        if name is None:
            continue
        health(name).done_last_hour += done
        slot.done += done
        slot.failed += failed
    columns = ("id", "task", "queue", "attempts", "finished_at", "last_error")
    recent = [
        dict(zip(columns, row, strict=True))
        for row in run(connection, RECENT_FAILURES, {"limit": failures})
    ]
    for failure in recent:
        error = failure["last_error"] or ""
        failure["error_line"] = last_line(error) if error.strip() else ""
    return Overview(
        queues=sorted(queues.values(), key=lambda q: q.queue),
        minutes=sorted(by_minute.values(), key=lambda m: m.minute),
        failures=recent,
    )


@dataclass
class QueueControl:
    """An operator's steering of one queue (its ``pgjobs_queue`` row; none: the defaults)."""

    queue: str
    paused: bool = False
    concurrency: int | None = None
    rate_count: int | None = None
    rate_period: timedelta | None = None


def queue_control(alias: str | None = None) -> dict[str, QueueControl]:
    """Every queue with a ``pgjobs_queue`` row (one per queue ever paused or limited)."""
    rows = QueueState.objects.using(alias or conf.database()).order_by("name")
    return {
        row.name: QueueControl(
            row.name, row.paused, row.concurrency, row.rate_count, row.rate_period
        )
        for row in rows
    }


def live_workers(alias: str | None = None) -> list[dict[str, Any]]:
    """The registry's live workers, oldest first: ``queues`` maps each queue to the worker's
    own limit for it (``None``: its shared concurrency), ``tasks`` is ``None`` for a worker
    that claims any task."""
    connection = connections[alias or conf.database()]
    found = records(connection, LIVE_WORKERS, {})
    for worker in found:
        # Django's psycopg setup hands jsonb back as text.
        if isinstance(worker["queues"], str):
            worker["queues"] = json.loads(worker["queues"])
    return found


def worker_queues(worker: dict[str, Any]) -> str:
    """A live worker's queues as ``runjobs --queue`` takes them: NAME=N, or NAME alone."""
    limits = worker["queues"]
    return ", ".join(name if n is None else f"{name}={n}" for name, n in limits.items())


def unrunnable(alias: str | None = None) -> list[dict[str, Any]]:
    """Ready jobs that no live worker can run, per queue and task (``UNRUNNABLE``)."""
    return records(connections[alias or conf.database()], UNRUNNABLE, {})
