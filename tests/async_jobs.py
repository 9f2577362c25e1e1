"""``async def`` jobs for tests.test_async_jobs, imported by the workers those tests start
(``PGJOBS_IMPORTS=tests.async_jobs``): the other test workers have no async job and no event
loop. Each records what it did in the table ``test_async_span`` (the test module creates it)
through the ORM on Django's sync_to_async thread: the loop's own thread must not block (but
one job here blocks it on purpose). With ``PGJOBS_TEST_ASYNC_STARTED`` set, a ``job_started``
receiver records each start through the sync ORM."""

from __future__ import annotations

import asyncio
import functools
import os
import time
from collections.abc import Callable, Coroutine
from datetime import timedelta
from typing import Any

from asgiref.sync import sync_to_async
from django.db import connections, transaction

from django_pgjobs import current_job, job
from django_pgjobs.signals import job_started

SPANS = "test_async_span"
# The end a job records when its task was cancelled.
CANCELLED = -1.0
# The end the job_started receiver records.
STARTED = -2.0
# The end writes_then_fails records before it fails.
WRITTEN = -3.0
# The end of the row the test writes to tell waits_for_word to finish.
WORD = -4.0


def _record(job_id: int, attempts: int, started: float, ended: float | None) -> None:
    with connections["default"].cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {SPANS} (job_id, attempts, started, ended) VALUES (%s, %s, %s, %s)",
            [job_id, attempts, started, ended],
        )


record = sync_to_async(_record)


def _record_atomically(job_id: int, attempts: int, started: float, ended: float | None) -> None:
    """``_record`` inside ``atomic()``, as ``aget_or_create()`` and most code wrapped in
    ``sync_to_async`` write: on a broken connection Django drops it at the block's end and
    opens another."""
    with transaction.atomic():
        _record(job_id, attempts, started, ended)


record_atomically = sync_to_async(_record_atomically)


def _started(sender: Any, job: Any, **named: Any) -> None:
    """A sync receiver that queries: it must not run on the event loop's thread."""
    _record(job.id, job.attempts, 0.0, STARTED)


if os.environ.get("PGJOBS_TEST_ASYNC_STARTED"):
    job_started.connect(_started)


@job
async def nap(seconds: float, again: float | None = None, atomically: bool = False) -> None:
    """Await ``seconds`` (``again`` on later attempts, if given); record the start at once
    and the whole span at the end (the machine's monotonic clock; ``atomically``: each
    inside ``atomic()``)."""
    ctx = current_job()
    assert ctx is not None
    pause = seconds if again is None or ctx.attempts == 1 else again
    write = record_atomically if atomically else record
    started = time.monotonic()
    await write(ctx.id, ctx.attempts, started, None)
    await asyncio.sleep(pause)
    await write(ctx.id, ctx.attempts, started, time.monotonic())


def _returns_its_coroutine(
    func: Callable[..., Coroutine[Any, Any, None]],
) -> Callable[..., Coroutine[Any, Any, None]]:
    """A plain decorator: what it returns is a sync function that returns the coroutine."""

    @functools.wraps(func)
    def wrapper(**kwargs: Any) -> Coroutine[Any, Any, None]:
        return func(**kwargs)

    return wrapper


@job
@_returns_its_coroutine
async def nap_behind_a_decorator(seconds: float) -> None:
    """``nap`` behind a decorator that hides its ``async def``."""
    ctx = current_job()
    assert ctx is not None
    started = time.monotonic()
    await asyncio.sleep(seconds)
    await record(ctx.id, ctx.attempts, started, time.monotonic())


@job(max_attempts=1)
async def fails(message: str) -> None:
    raise RuntimeError(message)


@job(max_attempts=3, backoff=(60, 60))
async def fails_to_retry(message: str) -> None:
    raise RuntimeError(message)


@job(max_attempts=1)
async def raises_cancelled() -> None:
    """Raises CancelledError itself: its failure, not a cancel by the worker."""
    await asyncio.sleep(0)
    raise asyncio.CancelledError("the job's own")


@job(max_attempts=1, timeout=timedelta(seconds=1))
async def hangs() -> None:
    """Awaits past its one-second timeout; records that its task was cancelled."""
    ctx = current_job()
    assert ctx is not None
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        await record(ctx.id, ctx.attempts, 0.0, CANCELLED)
        raise


@job
async def waits_for_cancel() -> None:
    """Awaits until its task is cancelled (Job.objects.cancel()); records it."""
    ctx = current_job()
    assert ctx is not None
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        await record(ctx.id, ctx.attempts, 0.0, CANCELLED)
        raise


@job(max_attempts=1, timeout=timedelta(seconds=1))
async def blocks_the_loop() -> None:
    """Blocks the event loop's thread (a sync sleep in an async job) far past its timeout."""
    time.sleep(3600)


@job(max_attempts=1, timeout=timedelta(seconds=1))
async def ignores_its_cancel() -> None:
    """Catches the cancel its timeout sends and waits on: the loop runs, but the job keeps
    its slot."""
    ctx = current_job()
    assert ctx is not None
    await record(ctx.id, ctx.attempts, time.monotonic(), None)
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        await record(ctx.id, ctx.attempts, 0.0, CANCELLED)
        await asyncio.sleep(3600)


def _told(job_id: int) -> bool:
    with connections["default"].cursor() as cursor:
        cursor.execute(
            f"SELECT EXISTS (SELECT FROM {SPANS} WHERE job_id = %s AND ended = %s)",
            [job_id, WORD],
        )
        row = cursor.fetchone()
        return bool(row and row[0])


told = sync_to_async(_told)


@job
async def waits_for_word() -> None:
    """Awaits until the test writes its word (a row of its id ending at ``WORD``), looking
    every 0.1 s: it runs as long as the test wants, however slow the machine; records the
    whole span."""
    ctx = current_job()
    assert ctx is not None
    started = time.monotonic()
    while not await told(ctx.id):
        await asyncio.sleep(0.1)
    await record(ctx.id, ctx.attempts, started, time.monotonic())


def _slow_backoff(attempt: int, exc: BaseException) -> float:
    """A retry policy that takes its time: the completer asks it before it tells the worker
    of the timeout, so the job's task has heeded the cancel and ended by then."""
    time.sleep(1.0)
    return 3600.0


@job(max_attempts=2, timeout=timedelta(seconds=1), backoff=_slow_backoff)
async def heeds_its_cancel() -> None:
    """Waits for good; the cancel of its timeout ends it at once."""
    await asyncio.sleep(3600)


@job(max_attempts=1)
async def writes_then_fails() -> None:
    """Writes through the async ORM, then fails: in transaction mode the write is undone."""
    ctx = current_job()
    assert ctx is not None
    await record(ctx.id, ctx.attempts, 0.0, WRITTEN)
    raise RuntimeError("fails after its write")
