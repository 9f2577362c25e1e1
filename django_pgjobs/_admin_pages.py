"""The admin's two pages with no list: the queue dashboard and the Schedules page.

The dashboard also steers queues (pause, resume, global limits) for users with the change
permission on queues (``django_pgjobs.change_queuestate``), through the manager's
``pause``, ``resume`` and ``set_limits``.

``admin.py`` registers these classes (Django discovers that module only).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse

from django_pgjobs.exceptions import InvalidJobOptions
from django_pgjobs.models import Job, QueueDashboard
from django_pgjobs.ops import dashboard, doctor

if TYPE_CHECKING:
    _DashboardModelAdmin = admin.ModelAdmin[QueueDashboard]
else:
    # Generic only for type checkers, as in admin.py.
    _DashboardModelAdmin = admin.ModelAdmin

# Who may pause, resume and limit queues from the dashboard.
QUEUE_CONTROL_PERMISSION = "django_pgjobs.change_queuestate"


class QueueLimitsForm(forms.Form):
    """The dashboard's limits of one queue; an empty field is no limit. Only the form's own
    rule (a rate needs both halves) is checked here: the values themselves are checked by
    ``set_limits``, as from Python."""

    concurrency = forms.IntegerField(required=False)
    rate_count = forms.IntegerField(required=False)
    rate_period = forms.FloatField(required=False, label="rate period (seconds)")

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        count, period = cleaned.get("rate_count"), cleaned.get("rate_period")
        if (count is None) != (period is None) and not self.errors:
            raise ValidationError(
                "A rate limit needs both a count and a period in seconds (or neither, for no "
                "rate limit)."
            )
        return cleaned


class OnePageAdmin(_DashboardModelAdmin):
    """A model admin that is one read-only page (its changelist URL), with no list."""

    def get_urls(self) -> list[URLPattern]:
        # Only the page itself: the model's other pages (change, history) would show single
        # jobs to users who may only see the page.
        return [
            path(
                "",
                self.admin_site.admin_view(self.changelist_view),
                name=f"{self.opts.app_label}_{self.opts.model_name}_changelist",
            )
        ]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class QueueDashboardAdmin(OnePageAdmin):
    """Per-queue depth, lag and throughput, the last failures, queue control (pause, resume,
    global limits) and the live workers: one page, no list."""

    def get_urls(self) -> list[URLPattern]:
        # The target of the queue-control forms: a POST, never a page of its own.
        control = path(
            "control/",
            self.admin_site.admin_view(self.control_view),
            name=f"{self.opts.app_label}_{self.opts.model_name}_control",
        )
        return [*super().get_urls(), control]

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        if obj is not None:
            return False
        return bool(request.user.is_active and request.user.is_staff) and (
            request.user.has_perm("django_pgjobs.view_job")
            or request.user.has_perm("django_pgjobs.view_queuedashboard")
        )

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        overview = dashboard.overview()
        states = dashboard.queue_control()
        names = sorted({q.queue for q in overview.queues} | set(states))
        workers = dashboard.live_workers()
        for worker in workers:
            worker["queue_list"] = dashboard.worker_queues(worker)
        context = {
            **self.admin_site.each_context(request),
            "title": "Queue dashboard",
            "opts": self.model._meta,
            "overview": overview,
            "chart": _chart(overview),
            "can_see_failures": request.user.has_perm("django_pgjobs.view_job"),
            "can_control": request.user.has_perm(QUEUE_CONTROL_PERMISSION),
            "control": [
                _control_row(states.get(name) or dashboard.QueueControl(name)) for name in names
            ],
            "workers": workers,
            "unrunnable": dashboard.unrunnable(),
        }
        return TemplateResponse(request, "admin/django_pgjobs/dashboard.html", context)

    def control_view(self, request: HttpRequest) -> HttpResponse:
        """The dashboard's Pause, Resume and limits buttons: a POST, then back to it."""
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        if not (
            self.has_view_permission(request) and request.user.has_perm(QUEUE_CONTROL_PERMISSION)
        ):
            raise PermissionDenied
        queue, action = request.POST.get("queue", ""), request.POST.get("action", "")
        try:
            if action == "pause":
                Job.objects.pause(queue)
                done = f"Paused queue {queue}: its jobs stay queued until it is resumed."
            elif action == "resume":
                Job.objects.resume(queue)
                done = f"Resumed queue {queue}."
            elif action == "limits":
                done = self._set_limits(request, queue)
            else:
                raise InvalidJobOptions(
                    f"Unknown queue action {action!r}: use pause, resume or limits."
                )
        except InvalidJobOptions as exc:
            self.message_user(request, f"Nothing was changed: {exc}", messages.ERROR)
        else:
            self.message_user(request, done, messages.SUCCESS)
        return HttpResponseRedirect(
            reverse(f"admin:{self.opts.app_label}_{self.opts.model_name}_changelist")
        )

    def _set_limits(self, request: HttpRequest, queue: str) -> str:
        form = QueueLimitsForm(request.POST)
        if not form.is_valid():
            problems = [
                f"{form.fields[name].label or name.replace('_', ' ')}: {error}"
                if name in form.fields
                else str(error)
                for name, errors in form.errors.items()
                for error in errors
            ]
            raise InvalidJobOptions(f"Invalid limits for queue {queue}: {' '.join(problems)}")
        concurrency = form.cleaned_data["concurrency"]
        count, period = form.cleaned_data["rate_count"], form.cleaned_data["rate_period"]
        rate = None if count is None else (count, period)
        Job.objects.set_limits(queue, concurrency=concurrency, rate=rate)
        running = "no limit" if concurrency is None else f"at most {concurrency}"
        started = "no limit" if rate is None else f"at most {count} per {period:g} s"
        return f"Limits of queue {queue}: running {running}; started {started}."


class SchedulesAdmin(OnePageAdmin):
    """The periodic schedules declared in code, with their last and next tick: one page,
    read-only (a schedule changes in code, and takes effect when the workers restart)."""

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        if obj is not None:
            return False
        return bool(request.user.is_active and request.user.is_staff) and (
            request.user.has_perm("django_pgjobs.view_job")
            or request.user.has_perm("django_pgjobs.view_schedulestate")
        )

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        context = {
            **self.admin_site.each_context(request),
            "title": "Schedules",
            "opts": self.model._meta,
            "schedules": doctor.schedule_health(),
            "can_see_jobs": request.user.has_perm("django_pgjobs.view_job"),
        }
        return TemplateResponse(request, "admin/django_pgjobs/schedules.html", context)


def _control_row(state: dashboard.QueueControl) -> dict[str, Any]:
    """One queue's line of the control table; the period in seconds, as the form takes it."""
    period = state.rate_period.total_seconds() if state.rate_period is not None else None
    return {
        "queue": state.queue,
        "paused": state.paused,
        "concurrency": state.concurrency,
        "rate_count": state.rate_count,
        "rate_period": None if period is None else f"{period:g}",
    }


CHART_WIDTH, CHART_HEIGHT, CHART_TOP = 720, 180, 12


def _chart(overview: dashboard.Overview) -> dict[str, Any]:
    """Bar geometry for the throughput chart, drawn as SVG by the template (no script)."""
    minutes = overview.minutes
    peak = max(overview.peak, 1)
    slot = CHART_WIDTH / max(len(minutes), 1)
    scale = (CHART_HEIGHT - CHART_TOP) / peak
    bars = []
    for index, minute in enumerate(minutes):
        done_h = minute.done * scale
        failed_h = minute.failed * scale
        bars.append(
            {
                "x": round(index * slot + 1, 1),
                "width": round(max(slot - 2, 1), 1),
                "done_y": round(CHART_HEIGHT - done_h, 1),
                "done_h": round(done_h, 1),
                "failed_y": round(CHART_HEIGHT - done_h - failed_h, 1),
                "failed_h": round(failed_h, 1),
                "label": f"{minute.minute:%H:%M} UTC: {minute.done} done, {minute.failed} failed",
            }
        )
    return {
        "width": CHART_WIDTH,
        "height": CHART_HEIGHT,
        "bars": bars,
        "peak": overview.peak,
        "first": f"{minutes[0].minute:%H:%M}" if minutes else "",
        "last": f"{minutes[-1].minute:%H:%M}" if minutes else "",
        "total_done": sum(m.done for m in minutes),
        "total_failed": sum(m.failed for m in minutes),
    }
