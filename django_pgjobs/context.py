"""What a running job can learn about itself: ``current_job()``."""

from __future__ import annotations

import threading
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

_current: ContextVar[JobContext | None] = ContextVar("pgjobs_current_job", default=None)


@dataclass
class JobContext:
    """The job an executor is running.

    ``lost`` becomes true when a lease extension updated no row: the job was reaped and may
    already run elsewhere. A long job should check it between steps and stop early; whatever
    it returns afterwards is not recorded (the fence would refuse it anyway).
    """

    id: int
    task: str
    queue: str
    attempts: int
    max_attempts: int
    payload: dict[str, Any]
    # A periodic job's schedule name and the tick it serves: the time it was due, not the
    # time it started (None for a job that no schedule enqueued).
    schedule: str | None = None
    scheduled_at: datetime | None = None
    _lost: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def lost(self) -> bool:
        return self._lost.is_set()

    def mark_lost(self) -> None:
        self._lost.set()


def current_job() -> JobContext | None:
    """The job running in this thread, or ``None`` outside a job."""
    return _current.get()


def set_current_job(ctx: JobContext | None) -> Any:
    return _current.set(ctx)


def reset_current_job(token: Any) -> None:
    _current.reset(token)
