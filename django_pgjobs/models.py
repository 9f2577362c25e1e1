"""The jobs table, and the archive that ``prune(archive=True)`` moves finished jobs to.

The schema is the seed's (``queue``, ``payload``, ``status``, ``run_at``, ``attempts``,
``max_attempts``, ``locked_until``, ``last_error``, ``created_at``) plus what the lifecycle
needs, each for a reason:

- ``task``: which registered function runs the payload;
- ``priority``: claim order, -100..100 (django.tasks' range);
- ``started_at`` / ``attempted_at``: when the first and the latest attempt were claimed
  (durations, stuck jobs, django.tasks' ``started_at`` and ``last_attempted_at``);
- ``finished_at``: when it reached done/failed (pruning by age of completion);
- ``result``: the JSON return value of a django.tasks task;
- ``errors``: every failed attempt (exception class path and traceback);
- ``worker_ids``: the worker that claimed each attempt;
- ``outage_releases``: how many times the job was given back because the queue's own database
  was away (such a release does not count an attempt; the worker caps it so nothing loops);
- ``unique_key`` / ``unique_while``: the de-duplication key a job holds while it is waiting
  (``queued``) or waiting or running (``active``); cleared when the job leaves that window, so
  the partial unique index holds exactly the jobs that keep a second enqueue out;
- ``snoozes``: how many times the job put itself off (``Snooze``), no attempt spent;
- ``crashes``: attempts in a row that ended because the worker running them died (the
  reaper counts them; ``PGJOBS["MAX_CRASHES"]`` of them fail the job);
- ``timeout``: how long one attempt may run before it is failed with ``JobTimeout``.

CHECK constraints keep a row written with plain SQL to what ``enqueue()`` accepts: a status of
``Status``, a priority of -100..100, a payload that is a JSON object (the function's keyword
arguments), a valid queue name, ``max_attempts`` of 1 or more, ``attempts`` from 0 to
``max_attempts``, and a queued job with an attempt left (the claim adds one, and must not
step outside the previous constraint).

The SQL that creates it is frozen in the migrations; the fields mirror it for the ORM.
"""

from __future__ import annotations

from typing import ClassVar

import django
from django.db import models
from django.db.models import F, Q
from django.db.models.functions import Length
from django.db.models.lookups import LessThanOrEqual

from django_pgjobs.core.validation import QUEUE_NAME_CHAR, QUEUE_NAME_MAX
from django_pgjobs.fields import PgArray
from django_pgjobs.managers import JobManager

__all__ = [
    "ArchivedJob",
    "FailedJob",
    "Job",
    "QueueDashboard",
    "QueueState",
    "ScheduleState",
    "Status",
    "UniqueWhile",
    "WorkerRecord",
]


class Status(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


# The statuses a job never leaves (an operator's retry aside).
FINISHED = (Status.DONE, Status.FAILED, Status.CANCELLED)


class UniqueWhile(models.TextChoices):
    """How long a job's ``unique_key`` keeps a second enqueue of that key out."""

    QUEUED = "queued"
    ACTIVE = "active"


def _check(condition: Q, name: str) -> models.CheckConstraint:
    # Django 5.1 renamed CheckConstraint(check=) to condition=; 6.0 removed the old name.
    if django.VERSION >= (5, 1):
        return models.CheckConstraint(condition=condition, name=name)
    return models.CheckConstraint(check=condition, name=name)  # type: ignore[call-arg]


class Job(models.Model):
    id = models.BigAutoField(primary_key=True)
    queue = models.TextField(default="default")
    task = models.TextField()
    payload = models.JSONField(default=dict)
    status = models.TextField(choices=Status.choices, default=Status.QUEUED)
    priority = models.SmallIntegerField(default=0)
    run_at = models.DateTimeField()
    attempts = models.IntegerField(default=0)
    max_attempts = models.IntegerField(default=5)
    locked_until = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(null=True, blank=True)  # noqa: DJ001 - NULL means "no error yet"
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    attempted_at = models.DateTimeField(null=True, blank=True)
    result = models.JSONField(null=True, blank=True)
    errors = models.JSONField(default=list)
    worker_ids = models.JSONField(default=list)
    outage_releases = models.IntegerField(default=0)
    # A periodic job's schedule and the tick it serves (NULL for any other job).
    schedule = models.TextField(null=True, blank=True)  # noqa: DJ001 - NULL: not periodic
    scheduled_at = models.DateTimeField(null=True, blank=True)
    unique_key = models.TextField(null=True, blank=True)  # noqa: DJ001 - NULL: holds no key
    unique_while = models.TextField(  # noqa: DJ001 - NULL: not unique
        choices=UniqueWhile.choices, null=True, blank=True
    )
    snoozes = models.IntegerField(default=0)
    crashes = models.IntegerField(default=0)
    timeout = models.DurationField(null=True, blank=True)
    lock_key = models.TextField(null=True, blank=True)  # noqa: DJ001 - NULL: runs beside any

    objects: ClassVar[JobManager] = JobManager()

    # Set by enqueue() on the job it returns: False when a job already holding its unique
    # key was returned instead of a new one.
    created: bool

    class Meta:
        db_table = "pgjobs_job"
        ordering = ("-id",)
        indexes = (
            # The claim's index: only ready rows, in the claim's ORDER BY.
            models.Index(
                fields=["queue", "-priority", "run_at"],
                name="pgjobs_job_ready_idx",
                condition=Q(status="queued"),
            ),
            # The reaper's index: only running rows, by lease expiry.
            models.Index(
                fields=["locked_until"], name="pgjobs_job_lease_idx", condition=Q(status="running")
            ),
            # Throughput over a recent window, and pruning by finish time.
            models.Index(
                fields=["finished_at"],
                name="pgjobs_job_finished_idx",
                condition=Q(finished_at__isnull=False),
            ),
            # Failed jobs (the admin's list, the dashboard, the doctor) among millions of done.
            models.Index(
                fields=["finished_at"], name="pgjobs_job_failed_idx", condition=Q(status="failed")
            ),
            # The guarded claim's: ready jobs that carry a lock key, in the claim's order.
            models.Index(
                fields=["queue", "-priority", "run_at"],
                name="pgjobs_job_keyed_idx",
                condition=Q(status="queued", lock_key__isnull=False),
            ),
            # Whether a lock key is taken: the running jobs that carry one.
            models.Index(
                fields=["lock_key"],
                name="pgjobs_job_lock_idx",
                condition=Q(status="running", lock_key__isnull=False),
            ),
        )
        constraints = (
            _check(Q(status__in=Status.values), "pgjobs_job_status_check"),
            _check(Q(priority__gte=-100, priority__lte=100), "pgjobs_job_priority_check"),
            # The payload is a JSON object: not a CHECK, which every claim and completion would
            # run on the whole payload, but the trigger pgjobs_job_payload_check, which only
            # statements that write it fire (migration 0011).
            _check(
                Q(queue__regex=f"^{QUEUE_NAME_CHAR}+$")
                & Q(LessThanOrEqual(Length("queue"), QUEUE_NAME_MAX)),
                "pgjobs_job_queue_check",
            ),
            _check(Q(max_attempts__gte=1), "pgjobs_job_max_attempts_check"),
            _check(
                Q(attempts__gte=0, attempts__lte=F("max_attempts")), "pgjobs_job_attempts_check"
            ),
            _check(
                ~Q(status=Status.QUEUED) | Q(attempts__lt=F("max_attempts")),
                "pgjobs_job_queued_attempts_check",
            ),
            _check(Q(unique_while__in=UniqueWhile.values), "pgjobs_job_unique_while_check"),
            # One job per key in its de-duplication window: the database, not a read before
            # the write, keeps the second enqueue out (enqueue's ON CONFLICT infers it).
            models.UniqueConstraint(
                fields=["unique_key"],
                condition=Q(unique_key__isnull=False, status__in=(Status.QUEUED, Status.RUNNING)),
                name="pgjobs_job_unique_idx",
            ),
        )

    def __str__(self) -> str:
        return f"Job {self.id} {self.task} [{self.status}]"


class FailedJob(Job):
    """The failed jobs, for the admin list where a person retries or deletes them."""

    class Meta:
        proxy = True
        verbose_name = "failed job"
        verbose_name_plural = "failed jobs"


class QueueDashboard(Job):
    """The admin's queue dashboard (a proxy, so it has a place and permissions in the admin)."""

    class Meta:
        proxy = True
        verbose_name = "queue dashboard"
        verbose_name_plural = "queue dashboard"


class ArchivedJob(models.Model):
    """A finished job moved out of the hot table by ``prune(archive=True)``."""

    id = models.BigIntegerField(primary_key=True)
    queue = models.TextField()
    task = models.TextField()
    payload = models.JSONField()
    status = models.TextField(choices=Status.choices)
    priority = models.SmallIntegerField()
    run_at = models.DateTimeField()
    attempts = models.IntegerField()
    max_attempts = models.IntegerField()
    locked_until = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(null=True, blank=True)  # noqa: DJ001 - mirrors Job
    created_at = models.DateTimeField()
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    attempted_at = models.DateTimeField(null=True, blank=True)
    result = models.JSONField(null=True, blank=True)
    errors = models.JSONField(default=list)
    worker_ids = models.JSONField(default=list)
    outage_releases = models.IntegerField(default=0)
    schedule = models.TextField(null=True, blank=True)  # noqa: DJ001 - mirrors Job
    scheduled_at = models.DateTimeField(null=True, blank=True)
    unique_key = models.TextField(null=True, blank=True)  # noqa: DJ001 - mirrors Job
    unique_while = models.TextField(  # noqa: DJ001 - mirrors Job
        choices=UniqueWhile.choices, null=True, blank=True
    )
    snoozes = models.IntegerField(default=0)
    crashes = models.IntegerField(default=0)
    timeout = models.DurationField(null=True, blank=True)
    lock_key = models.TextField(null=True, blank=True)  # noqa: DJ001 - mirrors Job
    archived_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "pgjobs_job_archive"
        ordering = ("-id",)

    def __str__(self) -> str:
        return f"Archived job {self.id} {self.task} [{self.status}]"


class ScheduleState(models.Model):
    """What the database knows of one periodic schedule (``pgjobs_schedule``).

    The schedules themselves are declared in code (``@periodic``, ``PGJOBS["SCHEDULE"]``);
    this row only keeps the last tick enqueued, so that each tick becomes one job however
    many workers run the scheduler. A row whose schedule was removed from the code is inert.
    """

    name = models.TextField(primary_key=True)
    # What decided the ticks (cron expression and time zone, or interval).
    spec = models.TextField(null=True, blank=True)  # noqa: DJ001 - NULL: never ticked
    last_tick = models.DateTimeField(null=True, blank=True)
    last_job_id = models.BigIntegerField(null=True, blank=True)
    last_error = models.TextField(null=True, blank=True)  # noqa: DJ001 - NULL: no error
    failures = models.IntegerField(default=0)
    failed_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "pgjobs_schedule"
        verbose_name = "schedule"
        verbose_name_plural = "schedules"

    def __str__(self) -> str:
        return f"Schedule {self.name}"


class QueueState(models.Model):
    """An operator's steering of one queue (``pgjobs_queue``): paused, and its global limits.

    A queue without a row is unpaused and unlimited. Written by ``Job.objects.pause()``,
    ``resume()`` and ``set_limits()``; read by every claim (``claim.CLAIM`` skips a paused or
    limited queue, ``claim.CLAIM_GUARDED`` enforces the limits). ``starts`` keeps the start
    times the rate limit counts, the newest ``rate_count`` of them.
    """

    name = models.TextField(primary_key=True)
    paused = models.BooleanField(default=False)
    concurrency = models.IntegerField(null=True, blank=True)
    rate_count = models.IntegerField(null=True, blank=True)
    rate_period = models.DurationField(null=True, blank=True)
    starts = PgArray("timestamptz", default=list, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "pgjobs_queue"
        verbose_name = "queue"
        verbose_name_plural = "queues"

    def __str__(self) -> str:
        return f"Queue {self.name}"


class WorkerRecord(models.Model):
    """One live worker (``pgjobs_worker``): written at its start, refreshed on its tick,
    deleted on a clean exit, and cleared by the reaper once it stops heartbeating.

    ``queues`` maps each queue to the worker's own limit for it (``null``: the shared
    concurrency); ``tasks`` are the names it can run (``null``: it claims any task).
    """

    id = models.TextField(primary_key=True)
    host = models.TextField()
    pid = models.IntegerField()
    mode = models.TextField()
    queues = models.JSONField()
    tasks = PgArray("text", null=True, blank=True)
    version = models.TextField()
    started_at = models.DateTimeField()
    heartbeat_at = models.DateTimeField()
    # When the reaper may clear the row: a few of the worker's ticks after its latest beat.
    expires_at = models.DateTimeField()

    class Meta:
        db_table = "pgjobs_worker"
        verbose_name = "worker"
        verbose_name_plural = "workers"

    def __str__(self) -> str:
        return f"Worker {self.id}"
