import json

from django.db import transaction
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from testproject.shop.jobs import send_confirmation
from testproject.shop.models import Order


@csrf_exempt
@require_POST
def place_order(request: HttpRequest) -> JsonResponse:
    """Save an order and enqueue its confirmation in one transaction: both or neither."""
    data = json.loads(request.body or b"{}")
    with transaction.atomic():
        order = Order.objects.create(email=data["email"], total_cents=int(data["total_cents"]))
        job = send_confirmation.enqueue(order_id=order.pk)
    return JsonResponse({"order": order.pk, "job": job.pk}, status=201)
