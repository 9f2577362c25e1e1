"""Jobs the test-suite and the demo run (imported through PGJOBS["IMPORTS"])."""

from __future__ import annotations

import time

import psycopg
from django.db import connection, transaction

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
