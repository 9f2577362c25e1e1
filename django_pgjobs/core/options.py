"""A job's options, resolved once: the call's, else the ``@job``'s, else the ``PGJOBS`` settings'.

``Job.objects.enqueue()``, ``enqueue_many()``, the ``django.tasks`` backend (through the
manager) and a schedule's tick all write a job's row from a ``JobOptions``, so an option means
the same wherever a job is made. Each value is checked as it is resolved: a bad one raises
``InvalidJobOptions`` naming the option, before anything is written.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django_pgjobs.core import conf, validation
from django_pgjobs.core.registry import JobFunction
from django_pgjobs.exceptions import InvalidJobOptions

# A key given to an enqueue: one for every payload, or a callable that gives each payload's.
KeySource = str | Callable[[dict[str, Any]], str | None] | None


@dataclass(frozen=True, slots=True)
class JobOptions:
    """The columns a new job's row takes from its options. The keys (``unique_key`` with
    ``unique_while``, ``lock_key``) are each payload's: ``unique_keys()``, ``payload_keys()``
    and ``unique_while()`` below."""

    task: str
    queue: str
    priority: int
    max_attempts: int
    timeout: timedelta | None

    @classmethod
    def resolve(
        cls,
        func: JobFunction[..., Any],
        *,
        queue: str | None = None,
        priority: int | None = None,
        max_attempts: int | None = None,
        timeout: Any = None,
    ) -> JobOptions:
        """Each option given, else the ``@job``'s, else the settings'. ``is None``, never
        ``or``: an empty (or otherwise bad) queue name is an error, not a request for the
        default queue."""
        return cls(
            task=func.name,
            queue=validation.queue_name(
                queue if queue is not None else func.queue or conf.default_queue()
            ),
            priority=validation.priority(func.priority if priority is None else priority),
            max_attempts=validation.max_attempts(
                max_attempts
                if max_attempts is not None
                else func.max_attempts or conf.max_attempts()
            ),
            timeout=func.timeout if timeout is None else validation.timeout(timeout),
        )

    def columns(self) -> dict[str, Any]:
        """The row's columns these options fill."""
        return {
            "task": self.task,
            "queue": self.queue,
            "priority": self.priority,
            "max_attempts": self.max_attempts,
            "timeout": self.timeout,
        }


def unique_keys(
    func: JobFunction[..., Any],
    payloads: Sequence[Any],
    given: KeySource,
    unique_while: str | None,
) -> list[str | None] | None:
    """Each payload's unique key: the one given, else the ``@job``'s callable's; ``None`` when
    no payload has one. A ``unique_while`` without any key is a mistake, refused."""
    if given is None and func.unique_key is None and unique_while is not None:
        raise InvalidJobOptions(
            f"unique_while {validation.show(unique_while)} for task {func.name!r} without "
            "a unique key: pass unique_key= (or give @job a unique_key callable), or leave "
            "unique_while out."
        )
    return payload_keys(func, payloads, given, "unique_key")


def payload_keys(
    func: JobFunction[..., Any], payloads: Sequence[Any], given: KeySource, option: str
) -> list[str | None] | None:
    """Each payload's ``option`` key (``unique_key`` or ``lock_key``): the one given, else the
    ``@job``'s callable's; ``None`` when no payload has one."""
    source = given if given is not None else getattr(func, option)
    if source is None:
        return None
    if not callable(source):
        return [validation.unique_key(source, option)] * len(payloads)
    found = []
    for payload in payloads:
        key = source(payload)
        found.append(
            None if key is None else validation.unique_key(key, f"{option} of {func.name}")
        )
    return found if any(key is not None for key in found) else None


def unique_while(func: JobFunction[..., Any], given: str | None) -> str:
    """The window a unique key is held in: the one given, else the ``@job``'s. Checked after
    the keys, so that a ``unique_while`` without any key is reported as that."""
    return validation.unique_while(func.unique_while if given is None else given)
