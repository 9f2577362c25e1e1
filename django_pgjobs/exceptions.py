"""The error family. Each message says what is wrong, with which item, and how to fix it."""

from __future__ import annotations


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


class InvalidResult(PgJobsError, TypeError):
    """A task returned a value that JSON cannot hold, so it cannot be stored as its result."""


class LeaseExpired(PgJobsError):
    """Recorded (never raised) when the reaper takes back a job whose lease ran out."""
