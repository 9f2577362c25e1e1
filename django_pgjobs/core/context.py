"""What a running job can learn about itself: ``current_job()``."""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, NoReturn

from django_pgjobs.exceptions import Snooze

_current: ContextVar[JobContext | None] = ContextVar("pgjobs_current_job", default=None)


@dataclass
class JobContext:
    """The job an executor (or the event loop) is running.

    ``lost`` becomes true when a lease extension updated no row: the job was reaped and may
    already run elsewhere. ``cancelled`` when ``Job.objects.cancel()`` stopped it, and
    ``timed_out`` when it ran past its ``timeout`` (its attempt is already failed). A long job
    should check ``should_stop`` between steps and return early; whatever it returns
    afterwards is not recorded (the fence would refuse it anyway).
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
    # How long this attempt may run (None: no limit).
    timeout: float | None = None
    # Set by the completer's thread, read by the job's: plain flags (an attribute store is
    # atomic, and nothing waits on them), which a job checks often and every job creates.
    _lost: bool = field(default=False, repr=False)
    _cancelled: bool = field(default=False, repr=False)
    _timed_out: bool = field(default=False, repr=False)
    # Called (on the completer's thread) once the job should stop: the event loop cancels an
    # async job's task with it. None for a job on an executor thread, which cannot be
    # interrupted and checks ``should_stop`` itself.
    on_stop: Callable[[], None] | None = field(default=None, repr=False)

    @property
    def lost(self) -> bool:
        """The lease was lost (the reaper took the job back): it is no longer ours."""
        return self._lost

    @property
    def cancelled(self) -> bool:
        """``Job.objects.cancel()`` cancelled the job while it ran."""
        return self._cancelled

    @property
    def timed_out(self) -> bool:
        """The attempt ran past its timeout and was failed with ``JobTimeout``."""
        return self._timed_out

    @property
    def should_stop(self) -> bool:
        """Whether the job should stop now: lost, cancelled or timed out."""
        return self.lost or self.cancelled or self.timed_out

    def snooze(self, delay: float | timedelta) -> NoReturn:
        """Stop here and run the job again ``delay`` (seconds or a timedelta) later, without
        spending an attempt: raises ``Snooze``, which the worker records."""
        raise Snooze(delay)

    def mark_lost(self) -> None:
        self._lost = True
        self._stop()

    def mark_cancelled(self) -> None:
        self._cancelled = True
        self._stop()

    def mark_timed_out(self) -> None:
        self._timed_out = True
        self._stop()

    def _stop(self) -> None:
        if self.on_stop is not None:
            self.on_stop()


def current_job() -> JobContext | None:
    """The job running in this thread, or ``None`` outside a job."""
    return _current.get()


def set_current_job(ctx: JobContext | None) -> Any:
    return _current.set(ctx)


def reset_current_job(token: Any) -> None:
    _current.reset(token)
