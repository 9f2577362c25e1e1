"""The archive partitioned by month, as docs/scaling.md sets it up: its SQL is read from the
page and run on the test database (inside the test's transaction, which rolls all of it back
at the end, so the page's own BEGIN and COMMIT are left out). ``prunejobs --archive`` and
``ArchivedJob`` work on it unchanged, a month without its partition keeps its jobs where they
were, and the page's function creates and drops the months it should."""

from __future__ import annotations

import io
import re
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.db import DatabaseError, connection, transaction

from django_pgjobs.models import ArchivedJob, Job
from scripts.docs_sql import ROOT
from tests.helpers import make_jobs, query, scalar

pytestmark = pytest.mark.django_db

PAGE = ROOT / "docs" / "scaling.md"
DAY = timedelta(days=1)
WEEK = 7 * DAY


def recipe() -> str:
    """The page's SQL, without its first and last lines (BEGIN and COMMIT)."""
    blocks = re.findall(r"```sql\n(.*?)```", PAGE.read_text(), re.S)
    found = [b for b in blocks if "RENAME TO pgjobs_job_archive_before" in b]
    assert len(found) == 1, f"the partitioned archive's SQL is not in {PAGE} once"
    lines = found[0].strip().splitlines()
    assert (lines[0], lines[-1]) == ("BEGIN;", "COMMIT;")
    return "\n".join(lines[1:-1])


def finished(count: int) -> list[int]:
    """``count`` jobs done eight days ago: a week's ``prunejobs --archive`` takes them."""
    return make_jobs(
        count,
        status="done",
        attempts=1,
        created_at=-8 * DAY - timedelta(hours=1),
        started_at=-8 * DAY - timedelta(minutes=1),
        finished_at=-8 * DAY,
    )


def run(statement: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute(statement)


def partitions() -> dict[str, list[int]]:
    """Each partition of the archive, with the ids of the jobs it holds."""
    rows = query(
        "SELECT c.relname, coalesce(array_agg(a.id ORDER BY a.id) FILTER (WHERE a.id IS NOT "
        "NULL), '{}') FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
        "LEFT JOIN pgjobs_job_archive a ON a.tableoid = c.oid "
        "WHERE i.inhparent = 'pgjobs_job_archive'::regclass GROUP BY c.relname"
    )
    return {name: list(ids) for name, ids in rows}


def month(ahead: int) -> str:
    """The partition of the month ``ahead`` months from this one (UTC)."""
    return str(
        scalar(
            "SELECT 'pgjobs_job_archive_' || to_char(date_trunc('month', now() AT TIME ZONE "
            "'UTC') + make_interval(months => %s), 'YYYY_MM')",
            [ahead],
        )
    )


def partition(ids: list[int]) -> None:
    """Archive ``ids`` the plain way, then turn the archive into the page's months."""
    assert Job.objects.prune(older_than=WEEK, archive=True) == len(ids)
    run(recipe())


def test_prunejobs_archives_into_the_partitioned_archive_and_archivedjob_reads_it_all() -> None:
    before = finished(3)
    partition(before)
    # What was archived is in the partition that holds everything to the end of this month,
    # and the two months after this one are ready.
    assert partitions() == {"pgjobs_job_archive_before": before, month(1): [], month(2): []}

    later = finished(2)
    out = io.StringIO()
    call_command("prunejobs", "--archive", stdout=out)
    assert out.getvalue().splitlines()[-1] == "archived 2 done jobs finished more than 7d ago"
    assert not Job.objects.filter(id__in=before + later).exists()
    assert partitions()["pgjobs_job_archive_before"] == before + later
    # Read through the parent, as the admin reads it.
    assert sorted(ArchivedJob.objects.values_list("id", flat=True)) == before + later
    assert ArchivedJob.objects.get(id=later[0]).status == "done"


def test_a_month_without_its_partition_keeps_its_jobs_until_the_function_makes_it() -> None:
    partition([])
    # As if the change had been made last month and no job had made this month's partition.
    run("ALTER TABLE pgjobs_job_archive DETACH PARTITION pgjobs_job_archive_before")
    waiting = finished(4)
    with pytest.raises(DatabaseError, match="no partition"), transaction.atomic():
        Job.objects.prune(older_than=WEEK, archive=True)
    # The failed statement moved nothing: the jobs are where they were, as they were.
    assert list(Job.objects.filter(id__in=waiting).values_list("status", flat=True)) == ["done"] * 4
    assert ArchivedJob.objects.count() == 0

    run("SELECT pgjobs_archive_months(12)")
    assert partitions() == {month(0): [], month(1): [], month(2): []}
    assert Job.objects.prune(older_than=WEEK, archive=True) == 4
    assert partitions()[month(0)] == waiting


def test_the_function_drops_the_months_past_the_retention_and_keeps_the_rest() -> None:
    partition([])
    run("ALTER TABLE pgjobs_job_archive DETACH PARTITION pgjobs_job_archive_before")
    # Two months of the past, as a year of daily calls would have left them, one job in each.
    for ago in (13, 12):
        run(
            f"CREATE TABLE {month(-ago)} PARTITION OF pgjobs_job_archive FOR VALUES FROM "
            f"((date_trunc('month', now() AT TIME ZONE 'UTC') - interval '{ago} months') "
            "AT TIME ZONE 'UTC') TO ((date_trunc('month', now() AT TIME ZONE 'UTC') - "
            f"interval '{ago - 1} months') AT TIME ZONE 'UTC')"
        )
    # A retention longer than that makes this month's partition and drops nothing.
    run("SELECT pgjobs_archive_months(24)")
    assert set(partitions()) == {month(-13), month(-12), month(0), month(1), month(2)}
    [old, kept] = finished(2)
    assert Job.objects.prune(older_than=WEEK, archive=True) == 2
    query(
        "UPDATE pgjobs_job_archive SET archived_at = archived_at - make_interval(months => %s) "
        "WHERE id = %s RETURNING id",
        [13, old],
    )
    query(
        "UPDATE pgjobs_job_archive SET archived_at = archived_at - make_interval(months => %s) "
        "WHERE id = %s RETURNING id",
        [12, kept],
    )
    assert partitions()[month(-13)] == [old] and partitions()[month(-12)] == [kept]

    # Keeping 12 months drops the 13th month back, with its job, and nothing later; called
    # again, it makes and drops nothing more.
    run("SELECT pgjobs_archive_months(12)")
    run("SELECT pgjobs_archive_months(12)")
    assert partitions() == {month(-12): [kept], month(0): [], month(1): [], month(2): []}
    assert list(ArchivedJob.objects.values_list("id", flat=True)) == [kept]


def test_the_function_leaves_the_partition_of_what_was_archived_before() -> None:
    before = finished(2)
    partition(before)
    # A retention that ends next month drops every month before it, but not this one.
    run("SELECT pgjobs_archive_months(-1)")
    assert partitions() == {"pgjobs_job_archive_before": before, month(1): [], month(2): []}
