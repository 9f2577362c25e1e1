"""The shop's django.tasks tasks: run by the same worker and table as its @job functions."""

from __future__ import annotations

from typing import Any

try:
    from django.tasks import TaskContext, task
except ImportError:  # Django < 6.0: the django-tasks backport
    from django_tasks import TaskContext, task  # type: ignore[no-redef, assignment]

from testproject.shop.models import Order


@task(priority=10)
def order_total(order_id: int) -> dict[str, Any]:
    """Return the order's total: a task result the view can read back."""
    order = Order.objects.get(pk=order_id)
    return {"order": order.pk, "total_cents": order.total_cents}


@task(takes_context=True)
def which_attempt(context: TaskContext, fail_until: int = 0) -> int:
    """Fail until attempt ``fail_until``, then return the attempt number."""
    if context.attempt <= fail_until:
        raise RuntimeError(f"attempt {context.attempt} fails on purpose")
    return context.attempt


@task
async def double(value: int) -> int:
    return value * 2


@task
def returns_a_set() -> Any:
    return {1, 2, 3}
