"""Jobs and tasks for the tests of ``django_pgjobs.testing`` (imported by those tests, which
registers them). Each leaves a trace in the database that the tests read back: an order's
confirmation time, or the jobs it enqueued."""

from __future__ import annotations

from datetime import timedelta

from django.utils import timezone

from django_pgjobs import Snooze, current_job, job
from testproject.shop.models import Order

try:  # Django 6.0+
    from django.tasks import task
except ImportError:  # the django-tasks backport
    from django_tasks import task  # type: ignore[no-redef, assignment]


@job(queue="emails")
def confirm_order(order_id: int) -> None:
    """Marks the order confirmed."""
    Order.objects.filter(pk=order_id).update(confirmation_sent_at=timezone.now())


@job
def place_order(email: str) -> None:
    """Creates an order and enqueues its confirmation: a job that enqueues another."""
    order = Order.objects.create(email=email, total_cents=100)
    confirm_order.enqueue(order_id=order.pk)


@job(max_attempts=3)
def flaky(order_id: int, fail_until: int) -> None:
    """Fails its first ``fail_until`` attempts; writes before failing, so a rollback shows."""
    ctx = current_job()
    assert ctx is not None
    Order.objects.filter(pk=order_id).update(total_cents=ctx.attempts)
    if ctx.attempts <= fail_until:
        raise RuntimeError(f"attempt {ctx.attempts} fails on purpose")
    Order.objects.filter(pk=order_id).update(confirmation_sent_at=timezone.now())


@job(max_attempts=1)
def broken(message: str) -> None:
    raise ValueError(message)


@job
def snoozes_once(seconds: float) -> None:
    """Says "not now" on its first run."""
    ctx = current_job()
    assert ctx is not None
    from django_pgjobs.models import Job

    if Job.objects.values_list("snoozes", flat=True).get(pk=ctx.id) == 0:
        raise Snooze(seconds)


@job
def later(order_id: int) -> None:
    """Enqueues a confirmation an hour from now (in the database's time)."""
    from django_pgjobs.models import Job

    Job.objects.enqueue(confirm_order, {"order_id": order_id}, delay=timedelta(hours=1))


@task
def total_task(order_id: int) -> int:
    """A django.tasks task whose result is kept."""
    return Order.objects.get(pk=order_id).total_cents


@task(takes_context=True)
def flaky_task(context: object, fail_until: int) -> int:
    attempt: int = context.attempt  # type: ignore[attr-defined]
    if attempt <= fail_until:
        raise RuntimeError(f"task attempt {attempt} fails on purpose")
    return attempt


@job
def cancels_itself() -> None:
    """Cancelled (by an operator, say) while it runs: its completion is fenced out."""
    from django_pgjobs.models import Job

    ctx = current_job()
    assert ctx is not None
    Job.objects.cancel(ctx.id)


@job
def always_snoozes() -> None:
    """Never ready to finish: "not now", again and again, at once."""
    raise Snooze(0)
