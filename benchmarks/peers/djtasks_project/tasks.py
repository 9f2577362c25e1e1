"""The tasks of the django-tasks-db peer: ``noop`` (W1, W2) and ``stamp`` (W3)."""

from __future__ import annotations

import os
import time

try:
    from django.tasks import task  # Django >= 6.0
except ImportError:  # Django 5.2 with the django-tasks backport
    from django_tasks import task  # type: ignore[no-redef]


@task
def noop(n: int) -> None:
    return None


@task
def stamp(seq: int, out: str) -> None:
    """Note when this task's function started, first thing, as ``seq time.time()``."""
    started = time.time()
    fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{seq} {started!r}\n".encode())
    finally:
        os.close(fd)
