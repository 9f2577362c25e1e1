"""The worker's scheduler: turns each schedule's due tick into a job, on the producer's thread.

Every worker runs it (``runjobs --no-schedule`` turns it off). A step reads the database's
clock, and for each schedule whose latest tick it has not yet handled runs ``schedules.TICK``,
which enqueues the tick unless another worker already did. Then it sleeps until the
earliest next tick: an idle worker sends nothing in between. Only the most recent tick is
ever enqueued, so a worker starting after an outage enqueues one job per schedule, not one
per missed tick.

A step that fails is never silent: it is logged at ERROR with its traceback, kept on the
schedule's row for ``jobsdoctor`` and the admin, and retried after a backoff (1 s doubling
to a minute) until it succeeds. An unavailable database is the producer's business: it
reconnects, then the step runs again.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import datetime

import psycopg
from django.db import DatabaseError

from django_pgjobs.core import schedules
from django_pgjobs.core.schedules import Schedule
from django_pgjobs.core.types import clean_error
from django_pgjobs.worker.db import unavailable
from django_pgjobs.worker.store import Store

logger = logging.getLogger("django_pgjobs.scheduler")

RETRY_FIRST = 1.0
RETRY_MAX = 60.0


@dataclass
class _State:
    schedule: Schedule
    # The latest tick this worker saw recorded (by itself or another worker).
    handled: datetime | None = None
    # Monotonic time of this schedule's next step.
    due: float = 0.0
    failures: int = 0


class Scheduler:
    """The declared schedules, stepped by the worker's producer loop."""

    def __init__(self, store: Store, schedules_: list[Schedule], worker_id: str) -> None:
        self.store = store
        self.worker_id = worker_id
        self._states = [_State(schedule) for schedule in schedules_]

    @property
    def next_step(self) -> float | None:
        """Monotonic time of the next step; None without schedules (then it is silent)."""
        return min((state.due for state in self._states), default=None)

    def step(self) -> None:
        """Enqueue each due schedule's latest tick. Raises only when the database is away."""
        started = time.monotonic()
        try:
            now = self.store.database_now()
        except Exception as exc:
            if _outage(exc):
                raise
            for state in self._states:
                if state.due <= started:
                    state.due = started + self._failed(state, exc)
            return
        for state in self._states:
            if state.due > started:
                continue
            try:
                latest, following = schedules.ticks(state.schedule, now)
                job_id = (
                    None
                    if state.handled == latest
                    else self.store.enqueue_tick(state.schedule, latest)
                )
            except Exception as exc:
                # Whatever fails (the statement, or our own computation of the tick) is
                # logged, recorded and retried with backoff; the worker runs on.
                if _outage(exc):
                    raise
                state.due = started + self._failed(state, exc)
                continue
            if state.handled != latest:
                state.handled, state.failures = latest, 0
                if job_id is not None:
                    logger.info(
                        "schedule %s: tick %s enqueued as job %s",
                        state.schedule.name,
                        latest.isoformat(),
                        job_id,
                        extra={
                            "action": "tick",
                            "job_id": job_id,
                            "task": state.schedule.task,
                            "worker_id": self.worker_id,
                        },
                    )
            state.due = started + max(0.0, (following - now).total_seconds())

    def _failed(self, state: _State, exc: BaseException) -> float:
        """Log and record a failed step; return the seconds until it is tried again."""
        state.failures += 1
        delay = min(RETRY_FIRST * 2.0 ** (state.failures - 1), RETRY_MAX)
        name = state.schedule.name
        logger.error(
            "schedule %s: could not enqueue its tick (failure %s in a row); retrying in %.0f s",
            name,
            state.failures,
            delay,
            exc_info=exc,
            extra={"action": "tick", "task": state.schedule.task, "worker_id": self.worker_id},
        )
        text = clean_error(f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}".strip())
        try:
            self.store.record_tick_failure(state.schedule, text)
        except Exception as record_exc:
            if isinstance(record_exc, (DatabaseError, psycopg.Error)) and unavailable(record_exc):
                raise
            logger.warning(
                "schedule %s: could not record the failure either (%s)",
                name,
                record_exc,
                extra={"action": "tick", "worker_id": self.worker_id},
            )
        return delay


def _outage(exc: BaseException) -> bool:
    """An unavailable database: the producer's business (it reconnects, then steps again)."""
    return isinstance(exc, (DatabaseError, psycopg.Error)) and unavailable(exc)
