"""What became of each job: the outcome to write, the counters a worker keeps, the one log
line per job, and the ``job_finished`` signal and metrics that follow it.

Every attempt a worker ran ends in :func:`finished` (its outcome written, or fenced out) or,
in lease mode, in :func:`announce` alone (cancelled or lost while it ran, nothing written):
those two are where ``job_finished`` is sent and the worker's metrics are fed, once per
attempt, whatever the mode.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from django_pgjobs import signals
from django_pgjobs.core import registry
from django_pgjobs.core.types import Action, Outcome, last_line
from django_pgjobs.exceptions import UnknownTask

if TYPE_CHECKING:
    from django_pgjobs.worker.metrics import WorkerMetrics

logger = logging.getLogger("django_pgjobs.worker")


@dataclass
class WorkerStats:
    """Counters for one worker run; ``ran`` is every job whose function was called."""

    claimed: int = 0
    done: int = 0
    retried: int = 0
    failed: int = 0
    snoozed: int = 0
    released: int = 0
    lost: int = 0
    # Jobs cancelled (Job.objects.cancel) while this worker ran them: nothing recorded.
    cancelled: int = 0
    reaped: int = 0
    # Executor threads given up on because their job ran past its timeout.
    abandoned: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def ran(self) -> int:
        return self.done + self.retried + self.failed + self.snoozed + self.lost + self.cancelled

    def add(self, name: str, count: int = 1) -> None:
        if name not in _COUNTER_NAMES:
            raise ValueError(f"no counter {name!r}")
        with self._lock:
            setattr(self, name, getattr(self, name) + count)

    def summary(self) -> str:
        # Snoozes and abandoned executors are named only when there were some.
        snoozed = f", {self.snoozed} snoozed" if self.snoozed else ""
        abandoned = f"; {self.abandoned} executors abandoned" if self.abandoned else ""
        return (
            f"ran {self.ran} jobs: {self.done} done, {self.retried} to retry, "
            f"{self.failed} failed, {self.lost} lost, {self.cancelled} cancelled{snoozed}; "
            f"{self.released} released, {self.reaped} reaped{abandoned}"
        )


# The status a fenced write left the job in -> what became of it; None: the fence refused us
# ("cancelled": it refused us because the job was cancelled while it ran).
OUTCOME_OF_STATUS = {
    "done": "done",
    "queued": "retry",
    "failed": "failed",
    "cancelled": "cancelled",
}
COUNTERS = {
    "done": "done",
    "retry": "retried",
    "failed": "failed",
    "snoozed": "snoozed",
    "lost": "lost",
    "cancelled": "cancelled",
    "claimed": "claimed",
    "released": "released",
    "reaped": "reaped",
    "abandoned": "abandoned",
}
_COUNTER_NAMES = frozenset(COUNTERS.values())


def result_of(outcome: Outcome, status: str | None) -> str:
    """What became of a job whose outcome was written and left it in ``status``: done, retry,
    failed, snoozed, cancelled, or lost (``status`` None: fenced out)."""
    if outcome.action == Action.SNOOZE and status == "queued":
        return "snoozed"
    return OUTCOME_OF_STATUS.get(status or "", "lost")


def finished(
    outcome: Outcome,
    status: str | None,
    *,
    stats: WorkerStats,
    worker_id: str,
    metrics: WorkerMetrics | None = None,
) -> None:
    """Count, log and announce a job whose outcome was written (``status`` None: fenced out)."""
    result = result_of(outcome, status)
    stats.add(COUNTERS[result])
    log_outcome(outcome, result, worker_id)
    announce(outcome, result, metrics)


def announce(outcome: Outcome, result: str, metrics: WorkerMetrics | None) -> None:
    """Feed the worker's metrics and send ``job_finished`` for an attempt that ended as
    ``result`` (one of ``signals.OUTCOMES``). Rows of ``django.tasks`` tasks get Django's own
    ``task_finished`` (from ``backends.TaskRunner``) instead."""
    job = outcome.job
    if metrics is not None:
        metrics.finished(job.task, result, outcome.duration)
    if not signals.job_finished.receivers:
        return  # nobody listens (the common case): nothing more per job
    # The sender; imported here, as the worker's modules load before the apps are ready.
    from django_pgjobs.models import Job

    if signals.listening(signals.job_finished, Job) and is_plain_job(job.task):
        signals.send(
            signals.job_finished,
            Job,
            job=job,
            outcome=result,
            duration=outcome.duration,
            attempt=job.attempts,
            error=outcome.error,
        )


def is_plain_job(task: str) -> bool:
    """Whether ``task`` is a ``@job`` function (or not registered here), not a ``django.tasks``
    task: the ``job_*`` signals are sent for the former only."""
    try:
        return not registry.get(task).stores_result
    except UnknownTask:
        return True


def log_outcome(outcome: Outcome, result: str, worker_id: str) -> None:
    """The one line per finished job: id, task, attempt, outcome, duration.

    An attempt that raised is logged with the exception (``exc_info``), so an error reporter
    fed by logging (Sentry's integration) gets the traceback with the job's id, task and
    attempt in ``extra``: at ERROR when the job failed for good (or was lost), at WARNING when
    it will be retried or was cancelled.
    """
    job, duration = outcome.job, outcome.duration
    error = outcome.failure.traceback if outcome.failure else None
    level = (
        logging.INFO
        if error is None
        else (logging.ERROR if result in ("failed", "lost") else logging.WARNING)
    )
    if not logger.isEnabledFor(level):
        return  # the common case under load at WARNING: build nothing
    extra = {
        "action": result,
        "job_id": job.id,
        "task": job.task,
        "queue": job.queue,
        "attempts": job.attempts,
        "worker_id": worker_id,
        "duration": duration,
    }
    message = "job %s %s attempt %s/%s %s in %.1f ms"
    args = (job.id, job.task, job.attempts, job.max_attempts, result, duration * 1000)
    if error is None:
        logger.info(message, *args, extra=extra)
        return
    exc = outcome.error
    logger.log(
        level,
        message + ": %s",
        *args,
        last_line(error),
        exc_info=(type(exc), exc, exc.__traceback__) if exc is not None else None,
        extra=extra,
    )
