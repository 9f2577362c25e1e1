"""Jobs in the Django admin: a read-mostly list, failed jobs to retry or delete, a dashboard.

This module builds the two lists and registers every admin class; the dashboard (which also
steers queues) and the Schedules page, one page each with no list, are built in
``_admin_pages``.

Every action goes through the manager's verbs (``retry``, ``cancel``), never around them, and every
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
from django.db.models import Q, QuerySet
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.functional import cached_property
from django.utils.html import format_html
from django.utils.safestring import SafeString

from django_pgjobs._admin_pages import QueueDashboardAdmin, SchedulesAdmin
from django_pgjobs.core import execute, registry, validation
from django_pgjobs.core.types import last_line
from django_pgjobs.exceptions import InvalidJobOptions, WorkerCrashed
from django_pgjobs.models import FailedJob, Job, QueueDashboard, ScheduleState, Status
from django_pgjobs.ops import dashboard
from django_pgjobs.ops.explain import explain

if TYPE_CHECKING:
    _JobModelAdmin = admin.ModelAdmin[Job]
else:
    # Generic only for type checkers (django-stubs): subscripting it at run time works only
    # where something has called django_stubs_ext.monkeypatch() (the django-tasks backport
    # does; Django 6 without it does not).
    _JobModelAdmin = admin.ModelAdmin

STATUS_COLOURS = {
    Status.QUEUED: "#2563eb",
    Status.RUNNING: "#b45309",
    Status.DONE: "#15803d",
    Status.FAILED: "#b91c1c",
    Status.CANCELLED: "#6b7280",
}
# How the reap's last_error begins for a job failed because its workers kept dying.
WORKER_CRASHED = f"{WorkerCrashed.__module__}.{WorkerCrashed.__qualname__}"
# Fields a person may change, and only while the job is still queued.
EDITABLE_WHILE_QUEUED = ("queue", "priority", "run_at", "max_attempts")
# Their names in a POST (run_at is a date and a time input).
EDITABLE_INPUTS = ("queue", "priority", "run_at_0", "run_at_1", "max_attempts")
ERROR_PREVIEW = 80
# The statuses a cancel changes; the confirmation page lists at most this many of them.
CANCELLABLE = (Status.QUEUED, Status.RUNNING)
CONFIRM_LIMIT = 100
# The heading of a job page's explanation, by its first reason (a queued job's otherwise).
EXPLANATION_TITLES = {
    "running": "What is this job doing?",
    "done": "How this job ended",
    "failed": "How this job ended",
    "cancelled": "How this job ended",
    "gone": "Where is this job?",
}


class EstimatedCountPaginator(Paginator):  # type: ignore[type-arg]
    """The unfiltered list's count from PostgreSQL's statistics, not a full-table count."""

    @cached_property
    def count(self) -> int:
        queryset = self.object_list
        if isinstance(queryset, QuerySet) and not queryset.query.where:
            rows = execute.run(connections[queryset.db], dashboard.ESTIMATED_ROWS, {})
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
        names = set(dashboard.live_queues())
        if self.value():
            names.add(str(self.value()))
        return [(name, name) for name in sorted(names)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        return queryset.filter(queue=self.value()) if self.value() else queryset


class CrashFilter(admin.SimpleListFilter):
    """Failed jobs quarantined because their workers kept dying, or failed otherwise."""

    title = "how it failed"
    parameter_name = "ended"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("crashed", "its worker died (quarantined)"), ("other", "otherwise")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        # As jobsdoctor tells them (doctor.QUARANTINED): the latest error is WorkerCrashed.
        crashed = Q(**{"errors__-1__exception_class_path": WORKER_CRASHED})
        if self.value() == "crashed":
            return queryset.filter(crashed)
        if self.value() == "other":
            # Not exclude(crashed): a job with no error at all has no class to compare, and
            # SQL's NULL would leave it out of both lists.
            return queryset.exclude(pk__in=queryset.filter(crashed).values("pk"))
        return queryset


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
    actions: Any = ("cancel_selected",)
    search_fields = ("task", "last_error")
    search_help_text = "A job id, or words from its task or error."
    form = JobForm
    paginator = EstimatedCountPaginator
    show_full_result_count = False
    list_per_page = 50
    ordering: ClassVar[Any] = ("-id",)
    # Also the failed jobs' page (a proxy would look for a template of its own).
    change_form_template = "admin/django_pgjobs/job/change_form.html"
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
        # Attempts in a row that ended with the worker dead (reaped); MAX_CRASHES fail the job.
        "crashes",
        "locked_until",
        "created_at",
        "started_at",
        "attempted_at",
        "finished_at",
        "worker_ids",
        # A periodic job's schedule and the tick it serves (empty for any other job).
        "schedule",
        "scheduled_at",
        # The de-duplication key while the job holds it, and how long it holds it.
        "unique_key",
        "unique_while",
        "payload_pretty",
        "result_pretty",
        "error_full",
        "error_history",
    )

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def get_urls(self) -> list[URLPattern]:
        cancel = path(
            "<path:object_id>/cancel/",
            self.admin_site.admin_view(self.cancel_view),
            name=f"{self.opts.app_label}_{self.opts.model_name}_cancel",
        )
        return [cancel, *super().get_urls()]

    # -- cancel: the list's action and the job page's button, both confirmed first ----------

    @admin.action(description="Cancel selected jobs", permissions=["change"])
    def cancel_selected(self, request: HttpRequest, queryset: QuerySet[Job]) -> HttpResponse | None:
        if request.POST.get("post") == "yes":
            across = request.POST.get("select_across") == "1"
            chosen = 0 if across else len(request.POST.getlist(ACTION_CHECKBOX_NAME))
            self._cancel(request, queryset, chosen)
            return None
        return self._confirm_cancel(request, queryset, action="cancel_selected")

    def cancel_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """The Cancel button of a job's page: a confirmation (GET), then the cancel (POST)."""
        obj = self.get_object(request, unquote(object_id))
        if obj is None:
            raise Http404(f"No job with id {object_id!r}.")
        if not self.has_change_permission(request, obj):
            raise PermissionDenied
        if request.method == "POST" and request.POST.get("post") == "yes":
            self._cancel(request, Job.objects.filter(pk=obj.pk), 1)
            return HttpResponseRedirect(
                reverse(f"admin:{self.opts.app_label}_{self.opts.model_name}_change", args=[obj.pk])
            )
        return self._confirm_cancel(request, Job.objects.filter(pk=obj.pk), action=None)

    def _confirm_cancel(
        self, request: HttpRequest, queryset: QuerySet[Job], action: str | None
    ) -> HttpResponse:
        # Only the jobs that can still be cancelled: the partial indexes of queued and running
        # rows find them, whatever the selection.
        cancellable = queryset.filter(status__in=CANCELLABLE).order_by("id")
        shown = list(cancellable[:CONFIRM_LIMIT])
        context = {
            **self.admin_site.each_context(request),
            "title": "Cancel jobs? Are you sure?",
            "opts": self.opts,
            "jobs": shown,
            "more": cancellable.count() - len(shown) if len(shown) == CONFIRM_LIMIT else 0,
            "action": action,
            "selected": request.POST.getlist(ACTION_CHECKBOX_NAME),
            "select_across": request.POST.get("select_across", "0"),
            "action_checkbox_name": ACTION_CHECKBOX_NAME,
        }
        return TemplateResponse(request, "admin/django_pgjobs/cancel_confirmation.html", context)

    def _cancel(self, request: HttpRequest, queryset: QuerySet[Job], chosen: int) -> None:
        """Cancel the selection's unfinished jobs; ``chosen`` is how many were selected."""
        # Only the ids of jobs still queued or running (their partial indexes find them), so
        # "select all" over a long history sends no list of finished ids.
        count = Job.objects.cancel(
            queryset.filter(status__in=CANCELLABLE).values_list("pk", flat=True)
        )
        if count:
            self.message_user(request, f"Cancelled {count} job(s).", messages.SUCCESS)
        if count < chosen:
            self.message_user(
                request,
                f"{chosen - count} job(s) had already finished and were left alone.",
                messages.WARNING,
            )

    def render_change_form(
        self,
        request: HttpRequest,
        context: dict[str, Any],
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: Job | None = None,
    ) -> HttpResponse:
        # "Why isn't this job running?": read when the page is, never stored. The heading
        # follows the status the explanation read, which may be newer than the form's.
        if obj is not None:
            reasons = explain(obj, alias=obj._state.db)
            context["pgjobs_explanation"] = reasons
            context["pgjobs_explanation_title"] = EXPLANATION_TITLES.get(
                reasons[0].code, "Why isn't this job running?"
            )
        return super().render_change_form(request, context, add, change, form_url, obj)

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
        "crashes",
        "finished_at",
        "short_error",
    )
    list_filter = (QueueFilter, TaskFilter, CrashFilter)
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


# The two one-page admins live in _admin_pages; they are registered here, where Django looks.
admin.register(QueueDashboard)(QueueDashboardAdmin)
admin.register(ScheduleState)(SchedulesAdmin)


def _pre(text: str) -> SafeString:
    return format_html('<pre style="white-space:pre-wrap;margin:0">{}</pre>', text)


def _ids(ids: list[int]) -> str:
    shown = ", ".join(str(i) for i in ids[:20])
    return shown + (f" and {len(ids) - 20} more" if len(ids) > 20 else "")
