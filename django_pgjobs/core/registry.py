"""``@job`` and the table of registered job functions.

The worker runs only what is registered here. A row naming any other dotted path is refused
with a clear error; its path is never imported (a row is data, and data must not choose code).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, TypeAlias, TypeVar, overload

from django_pgjobs.core import validation
from django_pgjobs.exceptions import InvalidJobOptions, UnknownTask

if TYPE_CHECKING:
    from django_pgjobs.models import Job

P = ParamSpec("P")
R = TypeVar("R")

# A retry delay: (base, cap) seconds (base * 2^attempts, at most cap), or a callable given the
# attempt number and the exception that returns the delay.
Backoff: TypeAlias = "tuple[float, float] | Callable[[int, BaseException], timedelta]"
# The key that de-duplicates a job, from its payload (None: this payload is not unique).
UniqueKey: TypeAlias = "Callable[[dict[str, Any]], str | None]"
ExceptionTypes: TypeAlias = "tuple[type[BaseException], ...]"


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
        backoff: Backoff | None = None,
        stores_result: bool = False,
        backoff_jitter: bool = False,
        retry_on: ExceptionTypes | None = None,
        discard_on: ExceptionTypes = (),
        timeout: timedelta | None = None,
        unique_key: UniqueKey | None = None,
        unique_while: str = "queued",
        lock_key: UniqueKey | None = None,
    ) -> None:
        self.func = func
        self.name = name
        self.queue = queue
        self.max_attempts = max_attempts
        self.priority = priority
        # The retry delay (see Backoff); None: the PGJOBS settings.
        self.backoff = backoff
        # Whether each retry delay is spread at random (see docs/retries.md).
        self.backoff_jitter = backoff_jitter
        # Errors that are retried (None: all but discard_on), and errors that fail at once.
        self.retry_on = retry_on
        self.discard_on = discard_on
        # How long one attempt may run (None: no limit), unless the enqueue says otherwise.
        self.timeout = timeout
        # The de-duplication key of a payload, and how long it keeps a second enqueue out.
        self.unique_key = unique_key
        self.unique_while = unique_while
        # The lock key of a payload: at most one job holding a key runs at a time.
        self.lock_key = lock_key
        # Whether the return value is recorded (django.tasks results); @job ignores it.
        self.stores_result = stores_result
        # What the worker's event loop awaits for an async def job (or a django.tasks async
        # task's runner); None: the job runs on an executor thread.
        self.async_func: Callable[..., Awaitable[Any]] | None = (
            func if inspect.iscoroutinefunction(func) else getattr(func, "acall", None)
        )
        functools.update_wrapper(self, func)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return self.func(*args, **kwargs)

    def enqueue(self, **kwargs: Any) -> Job:
        """Enqueue this job in the current transaction; the keyword arguments are the payload."""
        from django_pgjobs.models import Job

        return Job.objects.enqueue(self, kwargs)

    def gives_up_on(self, exc: BaseException) -> bool:
        """Whether ``exc`` fails the job at once: a ``discard_on`` error, or, when
        ``retry_on`` is given, any error it does not name."""
        return isinstance(exc, self.discard_on) or (
            self.retry_on is not None and not isinstance(exc, self.retry_on)
        )

    @property
    def is_async(self) -> bool:
        """Whether the job runs on the worker's event loop."""
        return self.async_func is not None

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
    retry_on: type[BaseException] | ExceptionTypes | None = None,
    discard_on: type[BaseException] | ExceptionTypes = (),
    backoff: Backoff | None = None,
    backoff_jitter: bool = False,
    timeout: timedelta | float | None = None,
    unique_key: UniqueKey | None = None,
    unique_while: str = "queued",
    lock_key: UniqueKey | None = None,
) -> Callable[[Callable[P, R]], JobFunction[P, R]]: ...


def job(
    func: Callable[P, R] | None = None,
    /,
    *,
    name: str | None = None,
    queue: str | None = None,
    max_attempts: int | None = None,
    priority: int = 0,
    retry_on: type[BaseException] | ExceptionTypes | None = None,
    discard_on: type[BaseException] | ExceptionTypes = (),
    backoff: Backoff | None = None,
    backoff_jitter: bool = False,
    timeout: timedelta | float | None = None,
    unique_key: UniqueKey | None = None,
    unique_while: str = "queued",
    lock_key: UniqueKey | None = None,
) -> JobFunction[P, R] | Callable[[Callable[P, R]], JobFunction[P, R]]:
    """Register a function as a job, under ``module.qualname`` unless ``name`` is given.

    ``queue``, ``max_attempts`` and ``priority`` are the defaults used when the job is
    enqueued without them (``queue`` falls back to ``PGJOBS["QUEUE"]``, ``max_attempts`` to
    ``PGJOBS["MAX_ATTEMPTS"]``). The function is called with its payload as keyword arguments.

    The retry policy: ``discard_on`` errors fail the job at once; when ``retry_on`` is given,
    every other error fails it at once too. ``backoff`` is ``(base, cap)`` seconds (base *
    2^attempts, at most cap) or a callable ``(attempt, exception) -> timedelta``;
    ``backoff_jitter`` spreads each delay at random. ``timeout`` (a timedelta or seconds) is
    how long one attempt may run. ``unique_key`` is a callable ``payload -> str | None``: while
    a job with that key is waiting (``unique_while="queued"``) or waiting or running
    (``"active"``), enqueueing the key again returns the existing job. ``lock_key`` is a
    callable ``payload -> str | None``: at most one job with a given key runs at a time.
    """
    if name is not None:
        validation.task_name(name)
    if queue is not None:
        validation.queue_name(queue)
    if max_attempts is not None:
        validation.max_attempts(max_attempts)
    validation.priority(priority)
    retry_types = None if retry_on is None else validation.exception_types(retry_on, "retry_on")
    discard_types = () if discard_on == () else validation.exception_types(discard_on, "discard_on")
    delay = None if backoff is None else validation.retry_backoff(backoff)
    validation.choice("backoff_jitter", backoff_jitter, (True, False))
    limit = validation.timeout(timeout)
    for option, source in (("unique_key", unique_key), ("lock_key", lock_key)):
        if source is not None and not callable(source):
            raise InvalidJobOptions(
                f"Invalid {option} {validation.show(source)} for @job: use a callable that "
                "takes the payload and returns the key (a str), or None for no key."
            )
    validation.unique_while(unique_while)

    def add(fn: Callable[P, R]) -> JobFunction[P, R]:
        task_name = name or f"{fn.__module__}.{fn.__qualname__}"
        if "<locals>" in task_name:
            raise ValueError(
                f"Cannot register {task_name}: a job must be a module-level function, "
                "or be given a name= that the worker can find."
            )
        wrapper = JobFunction(
            fn,
            name=task_name,
            queue=queue,
            max_attempts=max_attempts,
            priority=priority,
            backoff=delay,
            backoff_jitter=backoff_jitter,
            retry_on=retry_types,
            discard_on=discard_types,
            timeout=limit,
            unique_key=unique_key,
            unique_while=unique_while,
            lock_key=lock_key,
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


def runs_async(name: str) -> bool:
    """Whether the job registered under ``name`` is an ``async def`` one (False for a name
    that is not registered: its failure is an executor's)."""
    registered = _registry.get(name)
    return registered is not None and registered.is_async


def names() -> list[str]:
    """Every registered task name, sorted."""
    return sorted(_registry)
