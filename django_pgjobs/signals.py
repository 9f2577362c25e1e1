"""Django signals for ``@job`` jobs and for the queue's health.

``django.tasks`` tasks have Django's own ``task_enqueued``, ``task_started`` and
``task_finished``; these are the same moments for ``@job`` functions, sent by the worker (and by
``enqueue()`` once its transaction commits). A receiver that raises is logged and never changes
a job's outcome or stops the worker: :func:`send` is how the app sends every one of them.

- ``job_enqueued(sender=Job, job=Job)``: after the enqueue's transaction committed.
- ``job_started(sender=Job, job=ClaimedJob)``: in the executor, just before the function runs.
- ``job_finished(sender=Job, job=ClaimedJob, outcome=str, duration=float, attempt=int,
  error=BaseException | None)``: once the attempt's outcome is decided; ``outcome`` is one of
  :data:`OUTCOMES`.
- ``queue_unhealthy(sender=Watch, findings=list[Finding])``: once per breach of the health
  thresholds (``jobsdoctor --watch``).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from django.dispatch import Signal

__all__ = ["OUTCOMES", "job_enqueued", "job_finished", "job_started", "queue_unhealthy"]

logger = logging.getLogger("django_pgjobs.signals")

# How an attempt ended, as ``job_finished`` says it: "snoozed" is an attempt that raised
# ``Snooze`` (queued again for later, its attempt not a failure).
OUTCOMES = ("done", "retry", "failed", "cancelled", "lost", "snoozed")

job_enqueued = Signal()
job_started = Signal()
job_finished = Signal()
queue_unhealthy = Signal()


def listening(signal: Signal, sender: Any) -> bool:
    """Whether ``signal`` has a receiver for ``sender``. With no receiver connected at all (the
    common case, once per job on the worker's hot path) this is one attribute read: Django's
    own ``has_listeners()`` costs microseconds even then."""
    return bool(signal.receivers) and signal.has_listeners(sender)


def send(signal: Signal, sender: Any, **named: Any) -> None:
    """Send ``signal`` to every receiver; log (with the traceback) each receiver that raises,
    and go on. Nothing a receiver does reaches the caller.

    On the worker's threads even ``SystemExit`` (or ``KeyboardInterrupt``) from a receiver is
    only logged, as the receivers after it are skipped: it is the receiver's own bug, since
    signals land on the main thread, and letting it out would end the thread that runs or
    records jobs. On the main thread (an enqueue in a web process or a script) it goes on up,
    as the caller's own code would let it."""
    if not listening(signal, sender):
        return
    try:
        responses = signal.send_robust(sender, **named)
    except BaseException as exc:
        if threading.current_thread() is threading.main_thread():
            raise
        logger.error(
            "a receiver of %s raised %s; the receivers after it were skipped",
            _name(signal),
            type(exc).__name__,
            exc_info=(type(exc), exc, exc.__traceback__),
            extra={"action": "signal", "receiver": ""},
        )
        return
    for receiver, result in responses:
        if isinstance(result, BaseException):
            logger.error(
                "a receiver of %s raised: %s",
                _name(signal),
                getattr(receiver, "__qualname__", receiver),
                exc_info=(type(result), result, result.__traceback__),
                extra={"action": "signal", "receiver": getattr(receiver, "__qualname__", "")},
            )


def _name(signal: Signal) -> str:
    for name in ("job_enqueued", "job_started", "job_finished", "queue_unhealthy"):
        if globals()[name] is signal:
            return name
    return repr(signal)
