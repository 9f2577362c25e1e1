"""``@job`` and the table of registered job functions.

The worker runs only what is registered here. A row naming any other dotted path is refused
with a clear error; its path is never imported (a row is data, and data must not choose code).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, TypeVar, overload

from django_pgjobs import validation
from django_pgjobs.exceptions import UnknownTask

if TYPE_CHECKING:
    from django_pgjobs.models import Job

P = ParamSpec("P")
R = TypeVar("R")


class JobFunction(Generic[P, R]):
    """A registered job function: call it directly, or ``.enqueue(**kwargs)`` it."""

    def __init__(
        self,
        func: Callable[P, R],
        *,
        name: str,
        queue: str | None,
        max_attempts: int | None,
        priority: int,
        backoff: tuple[float, float] | None = None,
        stores_result: bool = False,
    ) -> None:
        self.func = func
        self.name = name
        self.queue = queue
        self.max_attempts = max_attempts
        self.priority = priority
        # (base, cap) seconds of the retry delay; None: the PGJOBS settings.
        self.backoff = backoff
        # Whether the return value is recorded (django.tasks results); @job ignores it.
        self.stores_result = stores_result
        functools.update_wrapper(self, func)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return self.func(*args, **kwargs)

    def enqueue(self, **kwargs: Any) -> Job:
        """Enqueue this job in the current transaction; the keyword arguments are the payload."""
        from django_pgjobs.models import Job

        return Job.objects.enqueue(self, kwargs)

    def __repr__(self) -> str:
        return f"<JobFunction {self.name}>"


_registry: dict[str, JobFunction[..., Any]] = {}


@overload
def job(func: Callable[P, R], /) -> JobFunction[P, R]: ...


@overload
def job(
    *,
    name: str | None = None,
    queue: str | None = None,
    max_attempts: int | None = None,
    priority: int = 0,
) -> Callable[[Callable[P, R]], JobFunction[P, R]]: ...


def job(
    func: Callable[P, R] | None = None,
    /,
    *,
    name: str | None = None,
    queue: str | None = None,
    max_attempts: int | None = None,
    priority: int = 0,
) -> JobFunction[P, R] | Callable[[Callable[P, R]], JobFunction[P, R]]:
    """Register a function as a job, under ``module.qualname`` unless ``name`` is given.

    ``queue``, ``max_attempts`` and ``priority`` are the defaults used when the job is
    enqueued without them (``queue`` falls back to ``PGJOBS["QUEUE"]``, ``max_attempts`` to
    ``PGJOBS["MAX_ATTEMPTS"]``). The function is called with its payload as keyword arguments.
    """
    if name is not None:
        validation.task_name(name)
    if queue is not None:
        validation.queue_name(queue)
    if max_attempts is not None:
        validation.max_attempts(max_attempts)
    validation.priority(priority)

    def add(fn: Callable[P, R]) -> JobFunction[P, R]:
        task_name = name or f"{fn.__module__}.{fn.__qualname__}"
        if "<locals>" in task_name:
            raise ValueError(
                f"Cannot register {task_name}: a job must be a module-level function, "
                "or be given a name= that the worker can find."
            )
        if inspect.iscoroutinefunction(fn):
            raise ValueError(
                f"Cannot register {task_name}: the worker calls jobs synchronously, so an "
                "async def job would never run. Use a django.tasks @task (async supported) or "
                "wrap it with asgiref.sync.async_to_sync."
            )
        wrapper = JobFunction(
            fn, name=task_name, queue=queue, max_attempts=max_attempts, priority=priority
        )
        register(wrapper)
        return wrapper

    if func is not None:
        return add(func)
    return add


def _origin(func: Callable[..., Any]) -> tuple[str, str]:
    """What a registration runs: its module and qualname (a task runner: its task's)."""
    inner = getattr(func, "task", None)
    target = getattr(inner, "func", func)
    return getattr(target, "__module__", ""), getattr(target, "__qualname__", repr(target))


def register(wrapper: JobFunction[..., Any]) -> None:
    """Add a registration under its name; re-registering the same function replaces it.

    Two different functions (a @job and a @task included) under one name are refused: the
    rows already in the table could not say which one they meant.
    """
    validation.task_name(wrapper.name)
    existing = _registry.get(wrapper.name)
    if existing is not None and _origin(existing.func) != _origin(wrapper.func):
        raise ValueError(
            f"Two job functions are registered as {wrapper.name!r} "
            f"({'.'.join(_origin(existing.func))} and {'.'.join(_origin(wrapper.func))}); "
            "give one of them another name."
        )
    _registry[wrapper.name] = wrapper


def get(name: str) -> JobFunction[..., Any]:
    """The job function registered under ``name``, or ``UnknownTask``."""
    try:
        return _registry[name]
    except KeyError:
        raise UnknownTask(
            f"Unknown task {name!r}: no @job function is registered under that name. "
            "Check the spelling, and that the module defining it is imported by the worker "
            "(an app's jobs.py or tasks.py, or PGJOBS['IMPORTS'])."
        ) from None


def resolve(task: str | Callable[..., Any]) -> JobFunction[..., Any]:
    """Map a registered name, a ``JobFunction`` or its plain function to the registration."""
    if isinstance(task, JobFunction):
        return get(task.name)
    if isinstance(task, str):
        return get(task)
    if not callable(task):
        raise UnknownTask(
            f"{validation.show(task)} is not a task: pass a @job function or its registered name."
        )
    for registered in _registry.values():
        if registered.func is task:
            return registered
    name = f"{getattr(task, '__module__', '?')}.{getattr(task, '__qualname__', task)!s}"
    raise UnknownTask(f"{name} is not a job: decorate it with @django_pgjobs.job first.")


def names() -> list[str]:
    """Every registered task name, sorted."""
    return sorted(_registry)
