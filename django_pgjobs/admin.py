"""Jobs in the Django admin: a read-mostly list, failed jobs to retry or delete, a dashboard.

Every action goes through the manager's verbs (``retry``), never around them, and every
query the pages make stays cheap on a table with millions of done rows: filters list their
choices without scanning the table, the unfiltered count is PostgreSQL's estimate, and the
dashboard reads partial indexes only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied, ValidationError
from django.core.paginator import Paginator
from django.db import connections
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path
from django.utils.functional import cached_property
from django.utils.html import format_html
from django.utils.safestring import SafeString

from django_pgjobs import doctor, registry, sql, validation
from django_pgjobs.exceptions import InvalidJobOptions
from django_pgjobs.lifecycle import last_line
from django_pgjobs.models import FailedJob, Job, QueueDashboard, ScheduleState, Status

if TYPE_CHECKING:
    _JobModelAdmin = admin.ModelAdmin[Job]
    _DashboardModelAdmin = admin.ModelAdmin[QueueDashboard]
else:
    # Generic only for type checkers (django-stubs): subscripting it at run time works only
    # where something has called django_stubs_ext.monkeypatch() (the django-tasks backport
    # does; Django 6 without it does not).
    _JobModelAdmin = _DashboardModelAdmin = admin.ModelAdmin

STATUS_COLOURS = {
    Status.QUEUED: "#2563eb",
    Status.RUNNING: "#b45309",
    Status.DONE: "#15803d",
    Status.FAILED: "#b91c1c",
}
# Fields a person may change, and only while the job is still queued.
EDITABLE_WHILE_QUEUED = ("queue", "priority", "run_at", "max_attempts")
# Their names in a POST (run_at is a date and a time input).
EDITABLE_INPUTS = ("queue", "priority", "run_at_0", "run_at_1", "max_attempts")
ERROR_PREVIEW = 80


class EstimatedCountPaginator(Paginator):  # type: ignore[type-arg]
    """The unfiltered list's count from PostgreSQL's statistics, not a full-table count."""

    @cached_property
    def count(self) -> int:
        queryset = self.object_list
        if isinstance(queryset, QuerySet) and not queryset.query.where:
            rows = sql.run(connections[queryset.db], sql.ESTIMATED_ROWS, {})
            if rows and rows[0][0] is not None and rows[0][0] >= 10_000:
                return int(rows[0][0])
        return super().count


class TaskFilter(admin.SimpleListFilter):
    """Tasks from the registry: listing them needs no DISTINCT over the whole table."""

    title = "task"
    parameter_name = "task"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(name, name) for name in registry.names()]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        return queryset.filter(task=self.value()) if self.value() else queryset


class QueueFilter(admin.SimpleListFilter):
    """Queues that have live (queued, running or failed) jobs, read from partial indexes."""

    title = "queue"
    parameter_name = "queue"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        names = set(doctor.live_queues())
        if self.value():
            names.add(str(self.value()))
        return [(name, name) for name in sorted(names)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        return queryset.filter(queue=self.value()) if self.value() else queryset


class JobForm(forms.ModelForm):  # type: ignore[type-arg]
    """The editable fields hold what enqueue() would accept (priority: the CHECK constraint)."""

    def clean_queue(self) -> str:
        return _valid(validation.queue_name, self.cleaned_data["queue"])

    def clean_max_attempts(self) -> int:
        value = _valid(validation.max_attempts, self.cleaned_data["max_attempts"])
        # A queued job must have an attempt left (the table's CHECK constraint says so too).
        if self.instance.pk is not None and value <= self.instance.attempts:
            raise ValidationError(
                f"This job has made {self.instance.attempts} attempts: max_attempts must be "
                f"more than that to leave it one."
            )
        return value


T = TypeVar("T")


def _valid(check: Callable[[object], T], value: object) -> T:
    try:
        return check(value)
    except InvalidJobOptions as exc:
        raise ValidationError(str(exc)) from exc


@admin.register(Job)
class JobAdmin(_JobModelAdmin):
    list_display: Any = (
        "id",
        "task",
        "queue",
        "status_badge",
        "attempts_of",
        "run_at",
        "created_at",
        "short_error",
    )
    list_filter: ClassVar[Any] = ("status", QueueFilter, TaskFilter)
    search_fields = ("task", "last_error")
    search_help_text = "A job id, or words from its task or error."
    form = JobForm
    paginator = EstimatedCountPaginator
    show_full_result_count = False
    list_per_page = 50
    ordering: ClassVar[Any] = ("-id",)
    fields = (
        "id",
        "task",
        "queue",
        "status_badge",
        "priority",
        "run_at",
        "attempts",
        "max_attempts",
        "outage_releases",
        "locked_until",
        "created_at",
        "started_at",
        "attempted_at",
        "finished_at",
        "worker_ids",
        # A periodic job's schedule and the tick it serves (empty for any other job).
        "schedule",
        "scheduled_at",
        "payload_pretty",
        "result_pretty",
        "error_full",
        "error_history",
    )

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def get_readonly_fields(self, request: HttpRequest, obj: Job | None = None) -> list[str]:
        editable = EDITABLE_WHILE_QUEUED if obj is not None and obj.status == "queued" else ()
        return [name for name in self.fields if name not in editable]

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Job], search_term: str
    ) -> tuple[QuerySet[Job], bool]:
        if re.fullmatch(r"[0-9]{1,18}", search_term.strip()):
            return queryset.filter(pk=int(search_term)), False
        return super().get_search_results(request, queryset, search_term)

    def changeform_view(
        self,
        request: HttpRequest,
        object_id: str | None = None,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        # An edit posted from a page opened while the job was queued, after a worker took
        # it: the form built now has no editable field, so Django would save nothing and
        # call it a success. Say what happened instead.
        if request.method == "POST" and object_id is not None:
            obj = self.get_object(request, unquote(object_id))
            if (
                obj is not None
                and obj.status != Status.QUEUED
                and any(name in request.POST for name in EDITABLE_INPUTS)
                and self.has_change_permission(request, obj)
            ):
                return self._not_changed(request, obj)
        return super().changeform_view(request, object_id, form_url, extra_context)

    def save_model(self, request: HttpRequest, obj: Job, form: Any, change: bool) -> None:
        # Only the changed editable fields, and only if the job is still queued: a plain
        # save() would write every column over what a worker just did.
        changes = {
            name: getattr(obj, name) for name in form.changed_data if name in EDITABLE_WHILE_QUEUED
        }
        if not changes:
            return
        still = Job.objects.filter(pk=obj.pk, status="queued")
        if "max_attempts" in changes:
            # An attempt made since the form was read must still leave one.
            still = still.filter(attempts__lt=changes["max_attempts"])
        updated = still.update(**changes)
        if not updated:
            request._pgjobs_not_changed = True  # type: ignore[attr-defined]

    def log_change(self, request: HttpRequest, obj: Job, message: Any) -> Any:
        if getattr(request, "_pgjobs_not_changed", False):
            return None
        return super().log_change(request, obj, message)

    def response_change(self, request: HttpRequest, obj: Job) -> HttpResponse:
        if getattr(request, "_pgjobs_not_changed", False):
            return self._not_changed(request, obj)
        return super().response_change(request, obj)

    def _not_changed(self, request: HttpRequest, obj: Job) -> HttpResponse:
        self.message_user(
            request, f"Job {obj.pk} is no longer queued: nothing was changed.", messages.WARNING
        )
        return HttpResponseRedirect(request.path)

    @admin.display(description="status", ordering="status")
    def status_badge(self, obj: Job) -> SafeString:
        colour = STATUS_COLOURS.get(Status(obj.status), "#444")
        return format_html(
            '<span class="pgjobs-status" style="color:#fff;background:{};padding:1px 6px;'
            'border-radius:8px">{}</span>',
            colour,
            obj.status,
        )

    @admin.display(description="attempts")
    def attempts_of(self, obj: Job) -> str:
        return f"{obj.attempts}/{obj.max_attempts}"

    @admin.display(description="last error")
    def short_error(self, obj: Job) -> str:
        if not obj.last_error:
            return ""
        line = last_line(obj.last_error)
        return line if len(line) <= ERROR_PREVIEW else line[: ERROR_PREVIEW - 1] + "…"

    @admin.display(description="payload")
    def payload_pretty(self, obj: Job) -> SafeString:
        return _pre(json.dumps(obj.payload, indent=2, ensure_ascii=False, sort_keys=True))

    @admin.display(description="result")
    def result_pretty(self, obj: Job) -> SafeString:
        return _pre("" if obj.result is None else json.dumps(obj.result, indent=2))

    @admin.display(description="last error")
    def error_full(self, obj: Job) -> SafeString:
        return _pre(obj.last_error or "")

    @admin.display(description="failed attempts")
    def error_history(self, obj: Job) -> SafeString:
        lines = []
        for number, error in enumerate(obj.errors or [], start=1):
            text = str(error.get("traceback", ""))
            summary = last_line(text) if text.strip() else error.get("exception_class_path")
            lines.append(f"{number}. {summary}")
        return _pre("\n".join(lines))


@admin.register(FailedJob)
class FailedJobAdmin(JobAdmin):
    """Failed jobs, newest failure first, with the two things a person does to them."""

    list_display: Any = (
        "id",
        "task",
        "queue",
        "attempts_of",
        "finished_at",
        "short_error",
    )
    list_filter = (QueueFilter, TaskFilter)
    ordering = ("-finished_at", "-id")
    actions = ("retry_selected", "delete_selected")

    def get_queryset(self, request: HttpRequest) -> QuerySet[Job]:
        return super().get_queryset(request).filter(status="failed")

    def get_readonly_fields(self, request: HttpRequest, obj: Job | None = None) -> list[str]:
        return list(self.fields)

    @admin.action(description="Retry selected failed jobs", permissions=["change"])
    def retry_selected(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        chosen = {int(pk) for pk in request.POST.getlist(ACTION_CHECKBOX_NAME)}
        retried = Job.objects.retry(queryset.values_list("pk", flat=True))
        if retried:
            self.message_user(
                request, f"Queued {len(retried)} job(s) again: {_ids(retried)}.", messages.SUCCESS
            )
        left = sorted(chosen - set(retried))
        if left:
            self.message_user(
                request,
                f"{len(left)} job(s) were no longer failed and were left alone: {_ids(left)}.",
                messages.WARNING,
            )


@admin.register(QueueDashboard)
class QueueDashboardAdmin(_DashboardModelAdmin):
    """Per-queue depth, lag and throughput, and the last failures: one page, no list."""

    def get_urls(self) -> list[URLPattern]:
        # Only the dashboard itself: the model's other pages (change, history) would show
        # single jobs to users who may only see the dashboard.
        return [
            path(
                "",
                self.admin_site.admin_view(self.changelist_view),
                name=f"{self.opts.app_label}_{self.opts.model_name}_changelist",
            )
        ]

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        if obj is not None:
            return False
        return bool(request.user.is_active and request.user.is_staff) and (
            request.user.has_perm("django_pgjobs.view_job")
            or request.user.has_perm("django_pgjobs.view_queuedashboard")
        )

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        overview = doctor.overview()
        context = {
            **self.admin_site.each_context(request),
            "title": "Queue dashboard",
            "opts": self.model._meta,
            "overview": overview,
            "chart": _chart(overview),
            "can_see_failures": request.user.has_perm("django_pgjobs.view_job"),
        }
        return TemplateResponse(request, "admin/django_pgjobs/dashboard.html", context)


@admin.register(ScheduleState)
class SchedulesAdmin(QueueDashboardAdmin):
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


def _pre(text: str) -> SafeString:
    return format_html('<pre style="white-space:pre-wrap;margin:0">{}</pre>', text)


def _ids(ids: list[int]) -> str:
    shown = ", ".join(str(i) for i in ids[:20])
    return shown + (f" and {len(ids) - 20} more" if len(ids) > 20 else "")


CHART_WIDTH, CHART_HEIGHT, CHART_TOP = 720, 180, 12


def _chart(overview: doctor.Overview) -> dict[str, Any]:
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
