"""Health reads of the queue: per-queue depth and lag, throughput, recent failures.

Used by the admin dashboard. Every query reads a partial index (ready, lease or failed rows)
or a one-hour range of the finished index, so it stays cheap with millions of done rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
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


def overview(alias: str | None = None, *, minutes: int = 60, failures: int = 10) -> Overview:
    """Per-queue numbers, throughput per minute over ``minutes`` and the last failures."""
    connection = connections[alias or conf.database()]
    queues: dict[str, QueueHealth] = {}

    def health(name: str) -> QueueHealth:
        return queues.setdefault(name, QueueHealth(name))

    for name, ready, scheduled, lag in sql.run(connection, sql.QUEUE_DEPTH, {}):
        row = health(name)
        row.ready, row.scheduled, row.lag_seconds = ready, scheduled, float(lag)
    for name, running, expired in sql.run(connection, sql.RUNNING_BY_QUEUE, {}):
        health(name).running, health(name).expired = running, expired
    for name, failed in sql.run(connection, sql.FAILED_BY_QUEUE, {}):
        health(name).failed = failed
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
    return Overview(
        queues=sorted(queues.values(), key=lambda q: q.queue),
        minutes=sorted(by_minute.values(), key=lambda m: m.minute),
        failures=recent,
    )
