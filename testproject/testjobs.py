"""Jobs the test-suite and the demo run (imported through PGJOBS["IMPORTS"])."""

from __future__ import annotations

import time

from django_pgjobs import current_job, job


@job
def noop(**kwargs: object) -> None:
    """Does nothing: measures the queue, not the job."""


@job(max_attempts=3)
def sleep(seconds: float = 0.1, **kwargs: object) -> None:
    time.sleep(seconds)


@job(max_attempts=2)
def boom(message: str = "boom") -> None:
    raise RuntimeError(message)


@job
def long_running(seconds: float = 3.0) -> None:
    """Runs past its lease so the worker must extend it; stops early if the lease is lost."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        ctx = current_job()
        if ctx is not None and ctx.lost:
            return
        time.sleep(0.05)
