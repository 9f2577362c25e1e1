"""Jobs the test-suite and the demo run (imported through PGJOBS["IMPORTS"])."""

from __future__ import annotations

import os
import time

import psycopg
from django.db import connection, transaction

from django_pgjobs import Snooze, current_job, job


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


@job(max_attempts=2)
def connect_elsewhere(url: str = "postgresql://postgres@127.0.0.1:1/nowhere") -> None:
    """Fails on a connection of its own (another server): the job's failure, not an outage."""
    psycopg.connect(url, connect_timeout=2).close()


@job(max_attempts=2)
def fails_while_handling_a_connection_error() -> None:
    """Its own error's __context__ is a connection error; the error itself is a ValueError."""
    try:
        psycopg.connect("postgresql://postgres@127.0.0.1:1/nowhere", connect_timeout=2)
    except psycopg.OperationalError:
        raise ValueError("gave up on the other service") from None


@job(max_attempts=2)
def drop_own_connection() -> None:
    """Its queries on the queue's database lose their connection: an outage of that database."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")


# Retried at once: the tests wait for the second attempt, not for a backoff.
connect_elsewhere.backoff = fails_while_handling_a_connection_error.backoff = (0.0, 0.0)
drop_own_connection.backoff = (0.0, 0.0)


@job(max_attempts=2)
def drop_own_connection_in_atomic() -> None:
    """As drop_own_connection, inside atomic(): Django reconnects as the block ends."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")


@job(max_attempts=2)
def query_then_connect_elsewhere() -> None:
    """Uses the queue's database, then fails on another server: the job's own failure."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    psycopg.connect("postgresql://postgres@127.0.0.1:1/nowhere", connect_timeout=2).close()


drop_own_connection_in_atomic.backoff = query_then_connect_elsewhere.backoff = (0.0, 0.0)


# -- job control (the demo's section 4) ------------------------------------------------------


@job(name="demo.until_stopped")
def until_stopped(seconds: float = 120.0) -> str:
    """Works in small steps until told to stop (cancelled, lease lost or timed out)."""
    deadline = time.monotonic() + seconds
    ctx = current_job()
    while time.monotonic() < deadline:
        if ctx is not None and ctx.should_stop:
            return "cancelled" if ctx.cancelled else "stopped"
        time.sleep(0.05)
    return "ran to the end"


@job(name="demo.rate_limited")
def rate_limited() -> None:
    """Puts itself off once ("the upstream API says: try again in 1 s"), then runs."""
    from django_pgjobs.models import Job

    ctx = current_job()
    assert ctx is not None
    if Job.objects.filter(id=ctx.id, snoozes=0).exists():
        raise Snooze(1)


@job(name="demo.hangs", max_attempts=1, timeout=1)
def hangs(seconds: float = 4.0) -> None:
    """Ignores every request to stop and runs past its 1 s timeout."""
    time.sleep(seconds)


@job(name="demo.kills_its_worker", max_attempts=25)
def kills_its_worker() -> None:
    """Takes its whole worker process down, as the OOM killer or a segfault would."""
    os._exit(1)
