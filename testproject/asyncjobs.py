"""The demo's jobs for ``runjobs --processes`` and the event loop, imported only by the workers
that run them (``PGJOBS_IMPORTS=testproject.asyncjobs``): a worker with an ``async def`` job
registered starts an event loop, which the test project's other workers do without."""

from __future__ import annotations

import asyncio

from django_pgjobs import job


@job(name="demo.computes")
def computes(rounds: int = 40_000) -> int:
    """A few milliseconds of pure Python: one core's work, which only more processes share."""
    return sum(i * i for i in range(rounds)) % 7


@job(name="demo.waits")
async def waits(seconds: float = 0.2) -> None:
    """Waits on I/O (here a sleep) without a thread: the loop runs many at once."""
    await asyncio.sleep(seconds)
