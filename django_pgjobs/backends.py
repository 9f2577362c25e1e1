"""A backend for Django's tasks framework, on the same table, claim and worker as ``@job``.

Use it with ``TASKS = {"default": {"BACKEND": "django_pgjobs.backends.PgJobsBackend"}}``:
on Django 6.0+ it implements ``django.tasks``; on older Django it implements the
``django-tasks`` backport (``pip install django-pgjobs[tasks]``). A ``@task`` becomes a row
whose ``task`` is the function's module path and whose payload holds its ``args`` and
``kwargs``; ``runjobs`` runs it with the same lease, fences, retries and reaper as a job.

``OPTIONS``: ``DATABASE`` (alias, default ``PGJOBS["DATABASE"]``), ``MAX_ATTEMPTS``,
``BACKOFF_BASE`` and ``BACKOFF_MAX`` (defaults: the ``PGJOBS`` settings of the same names),
and what ``@job`` says that ``django.tasks`` has no words for: ``RETRY_ON`` and
``DISCARD_ON`` (lists of dotted paths of exception classes), ``BACKOFF_JITTER`` (bool) and
``TIMEOUT`` (seconds one attempt may run).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from asgiref.sync import sync_to_async
from django.apps import apps
from django.conf import settings
from django.core import checks as django_checks
from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone
from django.utils.module_loading import import_string

from django_pgjobs.core import conf, registry, validation
from django_pgjobs.core.context import JobContext, current_job
from django_pgjobs.core.registry import JobFunction
from django_pgjobs.exceptions import InvalidJobOptions, InvalidPayload, Snooze, UnknownTask
from django_pgjobs.managers import Failure

try:  # Django 6.0+
    from django.tasks import TaskContext, TaskResult, TaskResultStatus, task_backends
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import Task, TaskError
    from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
    from django.tasks.signals import task_enqueued, task_finished, task_started
except ImportError:  # the django-tasks backport
    from django_tasks import (  # type: ignore[assignment, no-redef, unused-ignore]
        TaskContext,
        TaskResult,
        TaskResultStatus,
        task_backends,
    )
    from django_tasks.backends.base import BaseTaskBackend  # type: ignore[assignment, no-redef, unused-ignore]
    from django_tasks.base import Task, TaskError  # type: ignore[assignment, no-redef, unused-ignore]
    from django_tasks.exceptions import TaskResultDoesNotExist  # type: ignore[assignment, no-redef, unused-ignore]
    from django_tasks.signals import (  # type: ignore[assignment, no-redef, unused-ignore]
        task_enqueued,
        task_finished,
        task_started,
    )

    try:  # the backport after 0.12 uses Django's name
        from django_tasks.exceptions import (  # type: ignore[attr-defined, no-redef, unused-ignore]
            InvalidTask,
        )
    except ImportError:  # the backport up to 0.12
        from django_tasks.exceptions import (  # type: ignore[assignment, no-redef, unused-ignore]
            InvalidTaskError as InvalidTask,
        )

if TYPE_CHECKING:
    from django_pgjobs.models import Job

__all__ = ["InvalidTaskArguments", "PgJobsBackend"]

STATUSES = {
    "queued": TaskResultStatus.READY,
    "running": TaskResultStatus.RUNNING,
    "done": TaskResultStatus.SUCCESSFUL,
    "failed": TaskResultStatus.FAILED,
    # django.tasks has no cancelled status (neither Django 6.0 nor the backport): a cancelled
    # task finished without succeeding and has no return value, so it reads as FAILED (its
    # errors are those of the attempts it made, if any). A version that adds CANCELLED gets it.
    "cancelled": getattr(TaskResultStatus, "CANCELLED", TaskResultStatus.FAILED),
}
OPTIONS = (
    "DATABASE",
    "MAX_ATTEMPTS",
    "BACKOFF_BASE",
    "BACKOFF_MAX",
    "RETRY_ON",
    "DISCARD_ON",
    "BACKOFF_JITTER",
    "TIMEOUT",
)
# The check id of each problem with an exception list: a path that does not import, and a
# value that is not a list of paths of exception classes.
UNIMPORTABLE, NOT_EXCEPTIONS = "pgjobs.E026", "pgjobs.E027"
NOT_INSTALLED = (
    "add 'django_pgjobs' to INSTALLED_APPS: the backend keeps tasks in its jobs table, "
    "which that app's migrations create, and runjobs (the worker) is its command."
)


class InvalidTaskArguments(InvalidTask, InvalidPayload):
    """A task's arguments hold a value that cannot be stored as JSON.

    An ``InvalidTask``, as the framework's contract says of a task it cannot enqueue, and a
    ``TypeError`` (through ``InvalidPayload``), as Django's own backends raise for such
    arguments: code that catches either keeps working.
    """


def _job_model() -> type[Job]:
    """The jobs table, or a clear error when the app that owns it is not installed."""
    if not apps.is_installed("django_pgjobs"):
        raise ImproperlyConfigured(f"The django.tasks backend of django-pgjobs: {NOT_INSTALLED}")
    from django_pgjobs.models import Job

    return Job


class BadExceptionList(InvalidJobOptions):
    """``RETRY_ON`` / ``DISCARD_ON`` is not a list of importable exception classes."""

    def __init__(self, message: str, check_id: str) -> None:
        super().__init__(message)
        self.check_id = check_id


def exception_classes(paths: object, name: str) -> tuple[type[BaseException], ...]:
    """The exception classes a list of dotted paths names (``RETRY_ON``, ``DISCARD_ON``)."""
    if isinstance(paths, str) or not isinstance(paths, (list, tuple)):
        raise BadExceptionList(
            f"{name} is {validation.show(paths)}: use a list of dotted paths of exception "
            "classes, e.g. ['requests.ConnectionError'].",
            NOT_EXCEPTIONS,
        )
    classes = []
    for path in paths:
        if not isinstance(path, str):
            raise BadExceptionList(
                f"{name} holds {validation.show(path)}: use the dotted path (a str) of an "
                "exception class.",
                NOT_EXCEPTIONS,
            )
        try:
            value = import_string(path)
        except Exception as exc:  # a missing module or name, or a module that fails to load
            raise BadExceptionList(
                f"{name} names {path!r}, which cannot be imported ({exc}).", UNIMPORTABLE
            ) from exc
        if not (isinstance(value, type) and issubclass(value, BaseException)):
            raise BadExceptionList(
                f"{name} names {path!r}, which is {validation.show(value)}, not an exception "
                "class.",
                NOT_EXCEPTIONS,
            )
        classes.append(value)
    return tuple(classes)


class TaskRunner:
    """What the worker calls for a task row: rebuilds the ``TaskResult`` and runs the task.

    It sends ``task_started`` and ``task_finished`` (after every attempt; the status is
    ``READY`` when a retry or a snooze will follow), and passes a ``TaskContext`` to tasks
    that take one. Called on an executor thread, it runs an async task to its end there
    (``Task.call``); ``AsyncTaskRunner`` awaits one on the worker's event loop instead.
    """

    def __init__(self, task: Task[..., Any]) -> None:
        self.task = task

    def __call__(self, *, args: list[Any], kwargs: dict[str, Any], backend: str) -> Any:
        ctx, owner, running = self._start(backend)
        try:
            if running.task.takes_context:
                value = running.task.call(TaskContext(task_result=running), *args, **kwargs)
            else:
                value = running.task.call(*args, **kwargs)
            validation.result(value)
        except BaseException as exc:
            self._ended(owner, running, ctx, exc)
            raise
        return self._returned(owner, running, ctx, value)

    def _start(self, backend: str) -> tuple[JobContext, BaseTaskBackend, TaskResult[Any, Any]]:
        """The running job, its backend and its ``TaskResult``, once ``task_started`` is sent."""
        ctx = current_job()
        if ctx is None:
            raise RuntimeError("A task row runs only inside the pgjobs worker.")
        owner = task_backends[backend]
        running = owner.get_result(str(ctx.id))
        task_started.send(type(owner), task_result=running)
        return ctx, owner, running

    def _ended(
        self,
        owner: BaseTaskBackend,
        running: TaskResult[Any, Any],
        ctx: JobContext,
        exc: BaseException,
    ) -> None:
        """``task_finished`` for an attempt that raised ``exc``."""
        if isinstance(exc, Snooze):
            # Not a failure: the task is READY again later, with no error listed.
            snoozed = dataclasses.replace(running, status=TaskResultStatus.READY)
            _send_finished(owner, snoozed, ctx)
            return
        retry = ctx.attempts < ctx.max_attempts and not registry.get(
            self.task.module_path
        ).gives_up_on(exc)
        # As the framework's own backends do: the result lists this attempt's error, and
        # a finished (not retried) task has finished_at.
        failure = Failure.from_exception(exc)
        error = TaskError(
            exception_class_path=failure.exception_class_path, traceback=failure.traceback
        )
        failed = dataclasses.replace(
            running,
            status=TaskResultStatus.READY if retry else TaskResultStatus.FAILED,
            finished_at=None if retry else timezone.now(),
            errors=[*running.errors, error],
        )
        _send_finished(owner, failed, ctx)

    def _returned(
        self, owner: BaseTaskBackend, running: TaskResult[Any, Any], ctx: JobContext, value: Any
    ) -> Any:
        """``task_finished`` for an attempt that returned ``value``; returns it."""
        done = dataclasses.replace(
            running, status=TaskResultStatus.SUCCESSFUL, finished_at=timezone.now()
        )
        object.__setattr__(done, "_return_value", value)
        _send_finished(owner, done, ctx)
        return value


class AsyncTaskRunner(TaskRunner):
    """The runner of an ``async def`` task: ``acall`` awaits it on the worker's event loop.

    The result's reads and the signals are sync (the ORM, and receivers that may use it):
    they run on Django's sync_to_async thread, never blocking the loop."""

    async def acall(self, *, args: list[Any], kwargs: dict[str, Any], backend: str) -> Any:
        ctx, owner, running = await sync_to_async(self._start)(backend)
        try:
            if running.task.takes_context:
                value = await running.task.acall(TaskContext(task_result=running), *args, **kwargs)
            else:
                value = await running.task.acall(*args, **kwargs)
            validation.result(value)
        except BaseException as exc:
            await sync_to_async(self._ended)(owner, running, ctx, exc)
            raise
        return await sync_to_async(self._returned)(owner, running, ctx, value)


def _send_finished(owner: BaseTaskBackend, result: TaskResult[Any, Any], ctx: JobContext) -> None:
    """``task_finished`` for this attempt; for a task cancelled while it ran (its heartbeat
    saw it), the status its row now has, whatever the function did."""
    if ctx.cancelled:
        result = dataclasses.replace(
            result, status=STATUSES["cancelled"], finished_at=timezone.now()
        )
    task_finished.send(type(owner), task_result=result)


class PgJobsBackend(BaseTaskBackend):
    """Tasks as rows of the django-pgjobs table, run by ``manage.py runjobs``."""

    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = True

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        # Read as given (OPTIONS, else PGJOBS), so that check() reports a bad value by name
        # rather than the backend failing to load; the enqueue validates what it uses.
        self.database: str = self.options.get("DATABASE") or conf.get("DATABASE")
        self.max_attempts: Any = self.options.get("MAX_ATTEMPTS", conf.get("MAX_ATTEMPTS"))
        self.backoff: tuple[Any, Any] = (
            self.options.get("BACKOFF_BASE", conf.get("BACKOFF_BASE")),
            self.options.get("BACKOFF_MAX", conf.get("BACKOFF_MAX")),
        )
        self.retry_on: Any = self.options.get("RETRY_ON")
        self.discard_on: Any = self.options.get("DISCARD_ON", [])
        self.backoff_jitter: Any = self.options.get("BACKOFF_JITTER", False)
        self.timeout: Any = self.options.get("TIMEOUT")

    def validate_task(self, task: Task[..., Any]) -> None:
        """The framework's checks, our queue-name rule; then register it for the worker."""
        super().validate_task(task)
        try:
            validation.queue_name(task.queue_name)
        except InvalidJobOptions as exc:
            raise InvalidTask(str(exc)) from exc
        # Register each function once, as the decorator made it: variants from .using() must
        # not change the defaults the registry holds for its name.
        try:
            known = registry.get(task.module_path).func
        except UnknownTask:
            known = None
        if isinstance(known, TaskRunner) and known.task.func is task.func:
            return
        registry.register(
            JobFunction(
                (AsyncTaskRunner if inspect.iscoroutinefunction(task.func) else TaskRunner)(task),
                name=task.module_path,
                queue=task.queue_name,
                max_attempts=self.max_attempts,
                priority=task.priority,
                backoff=self._usable_backoff(),
                stores_result=True,
                **self._usable_policy(),
            )
        )

    def _usable_policy(self) -> dict[str, Any]:
        """The ``@job`` options this backend's ``OPTIONS`` give, each left at its default when
        its value is not valid (check() reports it)."""
        where = f"TASKS[{self.alias!r}]['OPTIONS']"
        policy: dict[str, Any] = {}
        try:
            if self.retry_on is not None:
                policy["retry_on"] = validation.exception_types(
                    exception_classes(self.retry_on, f"{where}['RETRY_ON']"), "RETRY_ON"
                )
        except InvalidJobOptions:
            pass
        try:
            policy["discard_on"] = exception_classes(self.discard_on, f"{where}['DISCARD_ON']")
        except InvalidJobOptions:
            pass
        if isinstance(self.backoff_jitter, bool):
            policy["backoff_jitter"] = self.backoff_jitter
        try:
            policy["timeout"] = validation.timeout(self.timeout)
        except InvalidJobOptions:
            pass
        return policy

    def _usable_backoff(self) -> tuple[float, float] | None:
        """This backend's backoff if it is valid, else None: the PGJOBS settings' at the time
        of the failure (check() reports the bad one)."""
        try:
            return validation.backoff(*self.backoff)
        except InvalidJobOptions:
            return None

    def enqueue(
        self, task: Task[..., Any], args: Iterable[Any], kwargs: dict[str, Any]
    ) -> TaskResult[Any, Any]:
        """Insert the task's row in the caller's transaction (visible, and NOTIFYing, on commit).

        Arguments must be JSON values that jsonb can store: anything else raises
        ``InvalidTaskArguments`` (an ``InvalidTask`` and a ``TypeError``) naming it. Options
        out of range (``run_after``, ``OPTIONS``) raise ``InvalidTask``. Either is raised
        before anything is sent to the database.
        """
        job_model = _job_model()
        self.validate_task(task)
        payload = {"args": list(args), "kwargs": dict(kwargs), "backend": self.alias}
        try:
            job = job_model.objects.db_manager(self.database).enqueue(
                task.module_path,
                payload,
                queue=task.queue_name,
                # The framework accepts any whole number (5.0 too); the column is an integer.
                priority=int(task.priority),
                run_at=task.run_after,
                max_attempts=self.max_attempts,
            )
        except InvalidPayload as exc:
            raise InvalidTaskArguments(str(exc)) from exc
        except InvalidJobOptions as exc:
            raise InvalidTask(str(exc)) from exc
        result = self._result(task, job)
        task_enqueued.send(type(self), task_result=result)
        return result

    def get_result(self, result_id: str) -> TaskResult[Any, Any]:
        """The task's current state, read from its row; ``TaskResultDoesNotExist`` if none."""
        job_model = _job_model()
        try:
            job_id = int(result_id)
        except (TypeError, ValueError):
            raise TaskResultDoesNotExist(f"No task result {result_id!r}.") from None
        job = job_model.objects.using(self.database).filter(pk=job_id).first()
        if job is None:
            raise TaskResultDoesNotExist(f"No task result {result_id!r}.")
        try:
            runner = registry.get(job.task).func
        except UnknownTask:
            runner = None
        if not isinstance(runner, TaskRunner) or not {"args", "kwargs"} <= set(job.payload):
            raise TaskResultDoesNotExist(
                f"Job {job_id} ({job.task}) is not a task this process knows: it is a @job, "
                "or the module defining the task is not imported here."
            )
        # The row says where it ran; no re-validation (QUEUES may have changed since).
        task = _copy_task(runner.task)
        object.__setattr__(task, "queue_name", job.queue)
        object.__setattr__(task, "priority", job.priority)
        object.__setattr__(task, "backend", job.payload.get("backend", self.alias))
        return self._result(task, job)

    def _result(self, task: Task[..., Any], job: Job) -> TaskResult[Any, Any]:
        result = TaskResult(
            task=task,
            id=str(job.id),
            status=STATUSES[job.status],
            enqueued_at=job.created_at,
            started_at=job.started_at,
            finished_at=job.finished_at,
            last_attempted_at=job.attempted_at,
            args=job.payload["args"],
            kwargs=job.payload["kwargs"],
            backend=job.payload.get("backend", self.alias),
            errors=[
                TaskError(
                    exception_class_path=error["exception_class_path"],
                    traceback=error["traceback"],
                )
                for error in job.errors
            ],
            worker_ids=list(job.worker_ids),
        )
        if job.status == "done":
            object.__setattr__(result, "_return_value", job.result)
        return result

    def check(self, **kwargs: Any) -> list[Any]:
        """Name the problem in the backend's own settings (ids pgjobs.E020...)."""
        return list(self._problems())

    def _problems(self) -> Iterable[django_checks.CheckMessage]:
        where = f"TASKS[{self.alias!r}]"
        if not apps.is_installed("django_pgjobs"):
            yield django_checks.Error(
                f"{where} uses django_pgjobs.backends.PgJobsBackend, but 'django_pgjobs' is "
                "not in INSTALLED_APPS.",
                hint=NOT_INSTALLED[0].upper() + NOT_INSTALLED[1:],
                id="pgjobs.E025",
            )
        for key in self.options:
            if key not in OPTIONS:
                yield django_checks.Error(
                    f"{where}['OPTIONS'] has an unknown key {key!r}.",
                    hint=f"Known keys: {', '.join(OPTIONS)}.",
                    id="pgjobs.E020",
                )
        if self.database not in settings.DATABASES:
            yield django_checks.Error(
                f"{where} uses the database alias {self.database!r}, which is not in DATABASES.",
                hint="Set OPTIONS['DATABASE'] (or PGJOBS['DATABASE']) to a PostgreSQL alias.",
                id="pgjobs.E021",
            )
        for queue in sorted(self.queues):
            try:
                validation.queue_name(queue)
            except InvalidJobOptions as exc:
                yield django_checks.Error(
                    f"{where}['QUEUES']: {exc}",
                    hint="Each queue in QUEUES is a django-pgjobs queue of that name.",
                    id="pgjobs.E022",
                )
        # The PGJOBS values these default to are checked as settings (pgjobs.E002).
        if "MAX_ATTEMPTS" in self.options:
            try:
                validation.max_attempts(
                    self.options["MAX_ATTEMPTS"], f"{where}['OPTIONS']['MAX_ATTEMPTS']"
                )
            except InvalidJobOptions as exc:
                yield django_checks.Error(
                    str(exc), hint="The attempts a task gets before it fails.", id="pgjobs.E023"
                )
        for name, value in zip(("BACKOFF_BASE", "BACKOFF_MAX"), self.backoff, strict=True):
            try:
                validation.seconds(f"{where}['OPTIONS'][{name!r}]", value)
            except InvalidJobOptions as exc:
                if name in self.options:
                    yield django_checks.Error(
                        str(exc),
                        hint="The retry delay after attempt n is BACKOFF_BASE * 2^n seconds, "
                        "at most BACKOFF_MAX.",
                        id="pgjobs.E024",
                    )
        yield from validation.backoff_errors(*self.backoff, where)
        yield from self._policy_problems(f"{where}['OPTIONS']")

    def _policy_problems(self, where: str) -> Iterable[django_checks.CheckMessage]:
        for name, value in (("RETRY_ON", self.retry_on), ("DISCARD_ON", self.discard_on)):
            if name not in self.options:
                continue
            try:
                classes = exception_classes(value, f"{where}[{name!r}]")
                if name == "RETRY_ON":
                    validation.exception_types(classes, f"{where}[{name!r}]")
            except BadExceptionList as exc:
                yield django_checks.Error(
                    str(exc),
                    hint="Errors the task is retried on (RETRY_ON) or failed at once on "
                    "(DISCARD_ON), each named by its dotted path.",
                    id=exc.check_id,
                )
            except InvalidJobOptions as exc:
                yield django_checks.Error(
                    str(exc), hint="Leave RETRY_ON out to retry every error.", id=NOT_EXCEPTIONS
                )
        if not isinstance(self.backoff_jitter, bool):
            yield django_checks.Error(
                f"{where}['BACKOFF_JITTER'] is {validation.show(self.backoff_jitter)}: use True "
                "or False.",
                hint="True draws each retry delay from 75 % to 100 % of itself.",
                id="pgjobs.E028",
            )
        try:
            validation.timeout(self.timeout, f"{where}['TIMEOUT']")
        except InvalidJobOptions as exc:
            yield django_checks.Error(
                str(exc),
                hint="The seconds one attempt of a task may run (None: no limit).",
                id="pgjobs.E029",
            )


def _copy_task(task: Task[..., Any]) -> Task[..., Any]:
    """A shallow copy of ``task``, field by field. ``copy.copy()`` goes through the task's
    ``__reduce__``, which on Django 6.1 imports the task again by its dotted path, and refuses
    one whose module attribute is the bare function (a task made with ``task()(func)``)."""
    clone = object.__new__(type(task))
    for each in dataclasses.fields(task):
        object.__setattr__(clone, each.name, getattr(task, each.name))
    return clone
