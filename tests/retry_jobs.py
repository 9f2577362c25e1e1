"""Jobs for the snooze and retry-policy tests, run by real workers (``tests.workers`` imports
this module, so a worker started with ``test_jobs=True`` knows them).

A job that must behave differently on a later run reads its own row: its ``snoozes`` count
is the database's, not a clock's or a process's.
"""

from __future__ import annotations

from datetime import timedelta

from django_pgjobs import Snooze, current_job, job


def _snoozes() -> int:
    from django_pgjobs.models import Job

    ctx = current_job()
    assert ctx is not None
    return Job.objects.values_list("snoozes", flat=True).get(pk=ctx.id)


@job
def snooze_once(seconds: float) -> None:
    """Snooze for ``seconds`` on the first run (``raise Snooze``); complete on the next."""
    if _snoozes() == 0:
        raise Snooze(seconds)


@job(max_attempts=2)
def snooze_times(times: int) -> None:
    """Snooze at once (``current_job().snooze``) until snoozed ``times`` times, then complete."""
    if _snoozes() < times:
        ctx = current_job()
        assert ctx is not None
        ctx.snooze(timedelta(0))


@job
def order_then_snooze(email: str) -> None:
    """Write an Order, then snooze for an hour on the first run; complete on the next."""
    from testproject.shop.models import Order

    Order.objects.create(email=email, total_cents=100)
    if _snoozes() == 0:
        raise Snooze(timedelta(hours=1))


@job(discard_on=(ValueError,))
def discards_value_errors(kind: str) -> None:
    """Raise ``kind`` ("value" or "runtime"): a ValueError is discarded, others retried."""
    raise ValueError("no such order") if kind == "value" else RuntimeError("try again")


@job(retry_on=(ConnectionError,), backoff=(30, 3600))
def retries_connection_errors(kind: str) -> None:
    """Raise ``kind`` ("connection" or "key"): only a ConnectionError is retried."""
    raise ConnectionError("upstream away") if kind == "connection" else KeyError("missing")


def _delay_for(attempt: int, exc: BaseException) -> timedelta:
    return timedelta(seconds=1000 + attempt)


def _broken_delay(attempt: int, exc: BaseException) -> timedelta:
    raise ZeroDivisionError("the backoff itself is broken")


@job(backoff=_delay_for)
def fails_with_callable_backoff() -> None:
    raise RuntimeError("fails with a computed delay")


@job(backoff=_broken_delay)
def fails_with_broken_backoff() -> None:
    raise RuntimeError("fails; its backoff fails too")


@job(backoff=(10, 3600), backoff_jitter=True)
def fails_with_jitter() -> None:
    raise RuntimeError("fails with a spread delay")
