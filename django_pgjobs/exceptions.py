"""The error family. Each message says what is wrong, with which item, and how to fix it."""

from __future__ import annotations

from datetime import timedelta

__all__ = [
    "InvalidJobOptions",
    "InvalidPayload",
    "InvalidResult",
    "JobTimeout",
    "LeaseExpired",
    "MetricsUnavailable",
    "NotPostgreSQL",
    "PgJobsError",
    "Snooze",
    "UniqueKeyBusy",
    "UnknownTask",
    "WorkerCrashed",
]


class PgJobsError(Exception):
    """Base class of every error django-pgjobs raises."""


class InvalidPayload(PgJobsError, TypeError):
    """A payload holds something JSON (or PostgreSQL's jsonb) cannot store."""


class InvalidJobOptions(PgJobsError, ValueError):
    """An enqueue or claim option is out of range or contradicts another."""


class UnknownTask(PgJobsError, ValueError):
    """A task name that no ``@job`` function registered."""


class NotPostgreSQL(PgJobsError, RuntimeError):
    """The database alias is not a PostgreSQL database."""


class UniqueKeyBusy(PgJobsError, RuntimeError):
    """An enqueue found its unique key held on every try, yet no job held it when read back."""


class InvalidResult(PgJobsError, TypeError):
    """A task returned a value that JSON cannot hold, so it cannot be stored as its result."""


class LeaseExpired(PgJobsError):
    """Recorded (never raised) when the reaper takes back a job whose lease ran out."""


class WorkerCrashed(PgJobsError):
    """Recorded (never raised) when a job is failed because the workers running it kept dying:
    ``PGJOBS["MAX_CRASHES"]`` attempts in a row ended with their worker gone (out of memory,
    ``os._exit``, a segfault in a C extension) rather than with an exception."""


class MetricsUnavailable(PgJobsError, RuntimeError):
    """``runjobs --metrics-port`` cannot serve: ``prometheus_client`` (the ``prometheus``
    extra) is not installed, or the address cannot be bound."""


class JobTimeout(PgJobsError):
    """Recorded as the error of an attempt that ran past its ``timeout``."""


class Snooze(Exception):
    """Raise inside a job to run it again later without spending an attempt.

    ``raise Snooze(30)`` (seconds) or ``raise Snooze(timedelta(minutes=1))``: the job goes back
    to ``queued`` with ``run_at`` that much later, its attempt not counted, and its ``snoozes``
    counter one higher.
    """

    def __init__(self, delay: float | timedelta) -> None:
        seconds = delay.total_seconds() if isinstance(delay, timedelta) else delay
        if (
            isinstance(seconds, bool)
            or not isinstance(seconds, (int, float))
            or not (0 <= seconds <= MAX_SNOOZE_SECONDS)
        ):
            raise InvalidJobOptions(
                f"Invalid snooze {delay!r}: use seconds (or a timedelta) from 0 to "
                f"{MAX_SNOOZE_SECONDS:.0f}."
            )
        super().__init__(f"snoozed for {seconds:g} s")
        self.seconds = float(seconds)


# A snooze may put a job off by up to 100 years (validation.MAX_DURATION).
MAX_SNOOZE_SECONDS = 36_500 * 86_400.0
