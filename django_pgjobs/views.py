"""Monitoring views for the project's urls: ``metrics`` (Prometheus) and ``health`` (JSON).

Neither is public: the queue's depth, its errors and its workers' hosts are an operator's
business. A request is let in with a staff user's session (``request.user.is_staff``, which
needs Django's ``AuthenticationMiddleware``) or with ``Authorization: Bearer <token>`` matching
``PGJOBS["MONITORING_TOKEN"]`` (compared in constant time), which is how a scraper or a probe
gets in. Anything else gets 401 with a ``WWW-Authenticate: Bearer`` challenge when a token is
configured, and 403 when it is not (a staff session is then the only way in) or when a
signed-in user is not staff.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils import timezone
from django.utils.crypto import constant_time_compare
from django.views.decorators.cache import never_cache
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_safe

from django_pgjobs.core import conf

__all__ = ["health", "metrics"]

REALM = "django-pgjobs"


def _bearer(request: HttpRequest) -> str | None:
    scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
    return credentials.strip() if scheme.lower() == "bearer" else None


def refusal(request: HttpRequest) -> HttpResponse | None:
    """None if the request may read the monitoring views; else the 401 or 403 to send."""
    token = conf.monitoring_token()
    given = _bearer(request)
    if token is not None and given is not None and constant_time_compare(given, token):
        return None
    user = getattr(request, "user", None)
    if user is not None and user.is_active and user.is_staff:
        return None
    if user is not None and user.is_authenticated:
        return JsonResponse({"error": "staff users only"}, status=403)
    if token is None:
        # Nothing about the configuration: how the views are protected is the docs' business.
        return JsonResponse({"error": "authentication required"}, status=403)
    response = JsonResponse({"error": "a valid bearer token is required"}, status=401)
    challenge = f'Bearer realm="{REALM}"'
    if given is not None:
        challenge += ', error="invalid_token"'
    response["WWW-Authenticate"] = challenge
    return response


@csrf_exempt  # nothing here changes state, and require_safe answers other methods 405
@never_cache
@require_safe
def metrics(request: HttpRequest) -> HttpResponse:
    """The queue-level gauges (``django_pgjobs.ops.metrics``) in Prometheus' text format, or in
    OpenMetrics when the scraper's ``Accept`` asks for it."""
    refused = refusal(request)
    if refused is not None:
        return refused
    from django_pgjobs.ops import metrics as queue_metrics  # the optional prometheus extra

    body, content_type = queue_metrics.scrape(accept=request.headers.get("Accept", ""))
    return HttpResponse(body, content_type=content_type)


@csrf_exempt
@never_cache
@require_safe
def health(request: HttpRequest) -> HttpResponse:
    """The doctor's findings as JSON: 200 while ready jobs are being served, 503 when not.

    ``problems`` are the outages (the lag over ``PGJOBS["HEALTH_THRESHOLDS"]["lag"]``, expired
    leases, ready jobs no live worker can run, a database that cannot be read); ``warnings``
    are the doctor's other findings (vacuum, failures, schedules), which do not fail the check.
    """
    refused = refusal(request)
    if refused is not None:
        return refused
    # Imported here: a project's urls import this module, which must not need the models
    # (their app may not be installed: its system check says so, and must get to run).
    from django_pgjobs.ops import watch
    from django_pgjobs.ops.findings import Thresholds

    report, findings = watch.examine(thresholds=Thresholds.from_settings(), queries=False)
    problems = [finding for finding in findings if finding.outage]
    body: dict[str, Any] = {
        "healthy": not problems,
        "checked_at": timezone.now(),
        "problems": [finding.problem for finding in problems],
        "warnings": [finding.problem for finding in findings if not finding.outage],
        "findings": [asdict(finding) for finding in findings],
    }
    if report is not None:
        body["queues"] = [asdict(queue) for queue in report.queues]
        body["paused"] = report.paused
        body["workers"] = [
            {key: worker[key] for key in ("id", "host", "pid", "queues", "heartbeat_at")}
            for worker in report.workers
        ]
    return HttpResponse(
        json.dumps(body, cls=DjangoJSONEncoder),
        status=503 if problems else 200,
        content_type="application/json",
    )
