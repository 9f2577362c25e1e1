"""django-pgjobs: a reliable background-job queue on one PostgreSQL table.

The public surface: ``job`` registers a function, ``periodic`` enqueues it on a schedule,
``current_job`` tells a running job who it is (and which tick it serves) and whether it still
owns its lease, and ``Snooze``, raised inside a job, runs it again later without spending an
attempt. Models live in ``django_pgjobs.models`` (import them
only once Django is set up).
"""

from django_pgjobs.core.context import JobContext, current_job
from django_pgjobs.core.registry import JobFunction, job
from django_pgjobs.core.schedules import periodic
from django_pgjobs.exceptions import Snooze

__version__ = "0.1.0"

__all__ = [
    "JobContext",
    "JobFunction",
    "Snooze",
    "__version__",
    "current_job",
    "job",
    "periodic",
]
