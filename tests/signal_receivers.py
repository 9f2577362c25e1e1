"""Receivers of the ``job_*`` signals, and a log recorder, for the worker processes the tests
start (``tests.workers`` imports this module, so a worker started with ``test_jobs=True``
has them).

Nothing is connected unless the worker's environment asks:

- ``PGJOBS_TEST_SIGNALS=<file>``: each ``job_started`` and ``job_finished`` is appended to the
  file as one JSON line (what the tests read back);
- ``PGJOBS_TEST_SIGNALS_RAISE=error``: a receiver that raises a ``RuntimeError`` is connected
  first, before the recording one (which must still be called); ``=exit``: one that calls
  ``sys.exit()`` (connected last, after the recording one); ``=query``: a ``job_started``
  receiver whose query fails (``SELECT 1 / 0``);
- ``PGJOBS_TEST_LOG_RECORDS=<file>``: each WARNING-or-worse record of the ``django_pgjobs``
  loggers is appended as one JSON line with its ``extra`` fields and exception type
  (``testproject/settings.py`` adds :class:`RecordHandler` to ``LOGGING``: a handler added
  here would be dropped when ``manage.py`` configures logging again).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from typing import Any

from django_pgjobs.signals import job_finished, job_started

SIGNALS = "PGJOBS_TEST_SIGNALS"
RAISE = "PGJOBS_TEST_SIGNALS_RAISE"
LOG_RECORDS = "PGJOBS_TEST_LOG_RECORDS"
_lock = threading.Lock()


def _append(path: str, line: dict[str, Any]) -> None:
    with _lock, open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps(line) + "\n")


def read(path: Any) -> list[dict[str, Any]]:
    """The JSON lines written so far (none if the file is not there yet)."""
    try:
        with open(path, encoding="utf-8") as lines:
            return [json.loads(line) for line in lines if line.endswith("\n")]
    except FileNotFoundError:
        return []


def raising(sender: Any, **named: Any) -> None:
    raise RuntimeError("this receiver fails on purpose")


def querying(sender: Any, **named: Any) -> None:
    """A receiver whose query fails: on the job's own connection, in transaction mode."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT 1 / 0")


def exiting(sender: Any, **named: Any) -> None:
    sys.exit("this receiver exits on purpose")


def record_started(sender: Any, job: Any, **named: Any) -> None:
    _append(
        os.environ[SIGNALS],
        {
            "signal": "job_started",
            "sender": sender.__name__,
            "job_id": job.id,
            "task": job.task,
            "attempt": job.attempts,
        },
    )


def record_finished(
    sender: Any,
    job: Any,
    outcome: str,
    duration: float,
    attempt: int,
    error: BaseException | None,
    **named: Any,
) -> None:
    _append(
        os.environ[SIGNALS],
        {
            "signal": "job_finished",
            "sender": sender.__name__,
            "job_id": job.id,
            "task": job.task,
            "outcome": outcome,
            "duration": duration,
            "attempt": attempt,
            "error": None if error is None else type(error).__name__,
            "message": None if error is None else str(error),
        },
    )


class RecordHandler(logging.Handler):
    """Writes each record with the fields an error reporter would read from it."""

    def __init__(self, path: str) -> None:
        super().__init__(logging.WARNING)
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        exc = record.exc_info[1] if record.exc_info else None
        _append(
            self.path,
            {
                "level": record.levelname,
                "message": record.getMessage(),
                "job_id": getattr(record, "job_id", None),
                "task": getattr(record, "task", None),
                "attempts": getattr(record, "attempts", None),
                "action": getattr(record, "action", None),
                "exc_type": None if exc is None else type(exc).__name__,
                "traceback": bool(exc is not None and exc.__traceback__ is not None),
            },
        )


if os.environ.get(SIGNALS):
    if os.environ.get(RAISE) == "error":
        job_started.connect(raising)
        job_finished.connect(raising)
    if os.environ.get(RAISE) == "query":
        job_started.connect(querying)
    job_started.connect(record_started)
    job_finished.connect(record_finished)
    if os.environ.get(RAISE) == "exit":
        job_started.connect(exiting)
        job_finished.connect(exiting)
