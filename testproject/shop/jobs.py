"""The shop's jobs: found by the app registry's autodiscovery of ``jobs`` modules."""

from django.utils import timezone

from django_pgjobs import job
from testproject.shop.models import Order


@job(queue="emails", max_attempts=5)
def send_confirmation(order_id: int) -> None:
    """Pretend to e-mail the customer, and record that we did."""
    Order.objects.filter(pk=order_id, confirmation_sent_at__isnull=True).update(
        confirmation_sent_at=timezone.now()
    )
