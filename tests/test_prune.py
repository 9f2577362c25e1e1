"""``prunejobs`` and ``Job.objects.prune()``: finished jobs deleted (or moved to the archive) in
short batches, by age on the database clock; live jobs never touched.

Every test commits for real (``transaction=True``): a batch is its own statement, so its own
transaction, and what a test sees afterwards is what another session would see.
"""

from __future__ import annotations

import io
import re
from datetime import timedelta

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext

from django_pgjobs.exceptions import InvalidJobOptions
from django_pgjobs.models import Job
from tests.helpers import db_now, make_job, make_jobs, query, scalar

pytestmark = pytest.mark.django_db(transaction=True)

DAY = timedelta(days=1)


def prunejobs(*args: str) -> list[str]:
    out = io.StringIO()
    call_command("prunejobs", *args, stdout=out)
    return out.getvalue().splitlines()


def fingerprints() -> dict[int, str]:
    """id -> md5 of the whole row, for every job: any change to a kept row shows."""
    return dict(query("SELECT id, md5(j::text) FROM pgjobs_job j"))


def ids(where: str = "true", table: str = "pgjobs_job") -> set[int]:
    assert table in ("pgjobs_job", "pgjobs_job_archive")
    return {row[0] for row in query(f"SELECT id FROM {table} WHERE {where}")}


def finished(
    count: int, status: str = "done", ago: timedelta = 8 * DAY, **fields: object
) -> list[int]:
    """``count`` jobs that finished ``ago`` (measured from the database's now())."""
    return make_jobs(
        count,
        status=status,
        attempts=1,
        created_at=-ago - timedelta(hours=1),
        started_at=-ago - timedelta(minutes=1),
        finished_at=-ago,
        **fields,
    )


def test_prunejobs_deletes_25000_old_done_jobs_in_batches_and_touches_nothing_else() -> None:
    # 25,000 done more than 7 days ago: most by finished_at, a few with no finish time
    # recorded, whose age is their created_at.
    old = finished(24_990)
    old += make_jobs(10, status="done", attempts=1, created_at=-30 * DAY)
    # Everything else must survive, however old.
    live = {
        "queued": make_jobs(40, created_at=-30 * DAY, run_at=-30 * DAY) + make_jobs(10),
        "scheduled": make_jobs(10, run_at=DAY),
        "running": make_jobs(
            20,
            status="running",
            attempts=1,
            created_at=-30 * DAY,
            started_at=-30 * DAY,
            locked_until=timedelta(minutes=5),
        ),
        "failed": (
            finished(30, status="failed", ago=30 * DAY) + finished(5, status="failed", ago=DAY)
        ),
        # Newer than the cutoff: finished 6 days 23 hours ago; finished yesterday though
        # created a month ago (age counts from the finish); no finish time, created yesterday.
        "recent done": (
            finished(100, ago=7 * DAY - timedelta(hours=1))
            + make_jobs(5, status="done", attempts=1, created_at=-30 * DAY, finished_at=-DAY)
            + make_jobs(5, status="done", attempts=1, created_at=-DAY)
        ),
    }
    kept = {job_id for group in live.values() for job_id in group}
    before = fingerprints()
    assert len(before) == 25_000 + len(kept) == 25_225

    lines = prunejobs("--older-than", "7d")

    assert lines == [
        "  deleted 10000 so far",
        "  deleted 20000 so far",
        "  deleted 25000 so far",
        "deleted 25000 done jobs finished more than 7d ago",
    ]
    after = fingerprints()
    assert set(after) == kept
    assert not set(after) & set(old)
    # Not one column of a kept row changed.
    assert after == {job_id: before[job_id] for job_id in kept}
    for status, group in live.items():
        assert set(group) <= set(after), status
    # Deleted, not archived.
    assert scalar("SELECT count(*) FROM pgjobs_job_archive") == 0

    # Nothing left to prune: no progress lines, a total of 0.
    assert prunejobs("--older-than", "7d") == ["deleted 0 done jobs finished more than 7d ago"]
    assert fingerprints() == after


def test_status_failed_and_all_choose_which_finished_jobs_go() -> None:
    old_done = finished(30)
    old_failed = finished(20, status="failed")
    recent = finished(5, status="failed", ago=DAY) + finished(5, ago=DAY)
    queued = make_jobs(5, created_at=-30 * DAY, run_at=-30 * DAY)

    assert prunejobs("--older-than", "7d", "--status", "failed", "--batch-size", "8") == [
        "  deleted 8 so far",
        "  deleted 16 so far",
        "  deleted 20 so far",
        "deleted 20 failed jobs finished more than 7d ago",
    ]
    assert ids() == set(old_done + recent + queued)
    assert not ids() & set(old_failed)

    finished(7, status="failed")
    assert prunejobs("--older-than", "2d", "--status", "all")[-1] == (
        "deleted 37 done, failed and cancelled jobs finished more than 2d ago"
    )
    assert ids() == set(recent + queued)

    # Units other than days, on the database clock: the recent ones finished a day ago.
    assert prunejobs("--older-than", "25h", "--status", "all")[-1].startswith("deleted 0 ")
    assert prunejobs("--older-than", "23h", "--status", "all")[-1].startswith("deleted 10 ")
    assert ids() == set(queued)


def test_status_cancelled_prunes_cancelled_jobs_and_all_includes_them() -> None:
    # Cancelled while queued (no attempt, never started), or while running (its attempt kept);
    # cancelled yesterday: too recent.
    old_cancelled = make_jobs(6, status="cancelled", created_at=-9 * DAY, finished_at=-8 * DAY)
    old_cancelled += finished(2, status="cancelled")
    recent = finished(3, status="cancelled", ago=DAY)
    others = finished(4) + finished(4, status="failed")
    live = make_jobs(3, created_at=-30 * DAY, run_at=-30 * DAY) + make_jobs(
        2, status="running", attempts=1, created_at=-30 * DAY, locked_until=timedelta(minutes=5)
    )
    before = fingerprints()

    assert prunejobs("--status", "cancelled", "--archive", "--batch-size", "5") == [
        "  archived 5 so far",
        "  archived 8 so far",
        "archived 8 cancelled jobs finished more than 7d ago",
    ]
    assert ids(table="pgjobs_job_archive") == set(old_cancelled)
    assert ids("status = 'cancelled'", table="pgjobs_job_archive") == set(old_cancelled)
    assert fingerprints() == {i: before[i] for i in recent + others + live}

    # "all" is done, failed and cancelled; queued and running stay whatever their age.
    assert Job.objects.prune(older_than=timedelta(hours=1), status="all") == 11
    assert ids() == set(live)
    assert Job.objects.prune(older_than=timedelta(0), status=["cancelled"]) == 0


ROW = (
    "id, queue, task, payload, status, priority, run_at, attempts, max_attempts, locked_until, "
    "last_error, created_at, started_at, finished_at, attempted_at, result, errors, worker_ids"
)


def rows(table: str, where: str = "true") -> dict[int, tuple[object, ...]]:
    assert table in ("pgjobs_job", "pgjobs_job_archive")
    return {row[0]: row for row in query(f"SELECT {ROW} FROM {table} WHERE {where}")}


def test_archive_moves_rows_with_every_column_one_statement_per_batch() -> None:
    done = finished(6, queue="emails", priority=5, max_attempts=3)
    failed = finished(4, status="failed", last_error="RuntimeError: gave up")
    moving = done + failed
    # What a real run leaves behind: results, the attempt history and the claiming workers.
    query(
        "UPDATE pgjobs_job SET result = jsonb_build_object('n', id), "
        'errors = \'[{"exception_class_path": "builtins.RuntimeError", "traceback": "t"}]\','
        " worker_ids = '[\"host:1:abc\"]', attempted_at = started_at, "
        "payload = jsonb_build_object('k', id) WHERE id = ANY(%s) RETURNING id",
        [moving],
    )
    # Queued and running jobs are never moved, even with old times (a retried job keeps its
    # old created_at; a stale finished_at must not count either).
    never = [
        make_job(created_at=-30 * DAY, run_at=-30 * DAY, finished_at=-30 * DAY),
        make_job(
            status="running",
            attempts=2,
            created_at=-30 * DAY,
            started_at=-30 * DAY,
            finished_at=-30 * DAY,
            locked_until=timedelta(minutes=5),
        ),
        make_job(
            status="running", attempts=1, created_at=-30 * DAY, locked_until=-30 * DAY
        ),  # even a lease long expired: that is reap's job
    ]
    recent = finished(3, ago=DAY)
    before = rows("pgjobs_job")
    untouched = {job_id: before[job_id] for job_id in never + recent}

    started = db_now()
    with CaptureQueriesContext(connection) as captured:
        lines = prunejobs("--archive", "--status", "all", "--batch-size", "4")
    ended = db_now()

    assert lines == [
        "  archived 4 so far",
        "  archived 8 so far",
        "  archived 10 so far",
        "archived 10 done, failed and cancelled jobs finished more than 7d ago",
    ]
    # One statement per batch (4 + 4 + 2), and each one both deletes and inserts: there is
    # no moment when a job is in neither table, or in both.
    statements = [q["sql"] for q in captured.captured_queries]
    assert len(statements) == 3, statements
    for statement in statements:
        assert "DELETE FROM pgjobs_job" in statement
        assert "INSERT INTO pgjobs_job_archive" in statement

    archived = rows("pgjobs_job_archive")
    assert set(archived) == set(moving)
    assert archived == {job_id: before[job_id] for job_id in moving}
    assert rows("pgjobs_job") == untouched
    # archived_at is the database's time of the move.
    assert scalar(
        "SELECT bool_and(archived_at BETWEEN %s AND %s) FROM pgjobs_job_archive", [started, ended]
    )

    # Archive and delete are the same cut: done jobs finished since, on a second run.
    more = finished(2)
    assert prunejobs("--archive")[-1] == "archived 2 done jobs finished more than 7d ago"
    assert set(rows("pgjobs_job_archive")) == set(moving + more)
    assert rows("pgjobs_job") == untouched


def test_prune_from_python_with_the_cutoff_on_the_database_clock() -> None:
    hour = timedelta(hours=1)
    minute = timedelta(minutes=1)
    gone = [
        make_job(status="done", attempts=1, finished_at=-hour - minute),
        make_job(status="done", attempts=1, created_at=-hour - minute),  # no finish time
    ]
    failed_old = make_job(status="failed", attempts=5, finished_at=-2 * hour)
    kept = [
        make_job(status="done", attempts=1, finished_at=-hour + minute),
        make_job(status="done", attempts=1, created_at=-hour + minute),
        # Created long ago, finished recently: the finish counts.
        make_job(status="done", attempts=1, created_at=-DAY, finished_at=-30 * minute),
        make_job(created_at=-DAY, run_at=-DAY),
        make_job(status="running", attempts=1, created_at=-DAY, locked_until=-hour),
    ]
    totals: list[int] = []

    assert Job.objects.prune(older_than=hour, batch_size=1, progress=totals.append) == 2
    assert totals == [1, 2]
    assert ids() == {failed_old, *kept}
    assert not ids() & set(gone)

    # A list of statuses; the default age (7 days) keeps the 2-hour-old failure.
    assert Job.objects.prune(status=["failed"]) == 0
    assert Job.objects.prune(older_than=hour, status=["failed"], archive=True) == 1
    assert ids(table="pgjobs_job_archive") == {failed_old}
    assert ids() == set(kept)
    # An age of zero takes every finished job; then nothing is left: no progress call.
    totals.clear()
    assert Job.objects.prune(older_than=timedelta(0), progress=totals.append) == 3
    assert Job.objects.prune(older_than=timedelta(0), progress=totals.append) == 0
    assert totals == [3]
    assert ids() == set(kept[3:])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"status": "queued"}, "Cannot prune status ['queued']"),
        ({"status": ["done", "running"]}, "Cannot prune status ['running']"),
        ({"status": []}, "Cannot prune status []"),
        ({"older_than": timedelta(days=-1)}, "Invalid older_than"),
        ({"older_than": 7}, "Invalid older_than"),
        ({"batch_size": 0}, "Invalid batch_size 0"),
        ({"batch_size": True}, "Invalid batch_size True"),
    ],
)
def test_prune_refuses_bad_options_before_touching_anything(
    options: dict[str, object], message: str
) -> None:
    job_id = make_job(status="done", attempts=1, finished_at=-30 * DAY)
    with pytest.raises(InvalidJobOptions) as raised:
        Job.objects.prune(**options)
    assert str(raised.value).startswith(message)
    assert ids() == {job_id}


@pytest.mark.parametrize("value", ["7", "7 days", "7days", "-1d", "1y", "d", "", "7d12h"])
def test_a_bad_older_than_is_a_command_error_naming_the_format(value: str) -> None:
    job_id = make_job(status="done", attempts=1, finished_at=-30 * DAY)
    with pytest.raises(CommandError) as raised:
        prunejobs(f"--older-than={value}")
    assert str(raised.value) == (
        f"--older-than {value!r}: use a number and a unit, e.g. 7d, 12h, 30m, 90s or 2w."
    )
    assert ids() == {job_id}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--batch-size", "0"), "Invalid batch_size 0: use a whole number of 1 or more."),
        (("--batch-size", "-5"), "Invalid batch_size -5: use a whole number of 1 or more."),
        (("--batch-size", "ten"), "argument --batch-size: invalid int value: 'ten'"),
        (("--status", "queued"), "argument --status: invalid choice: 'queued'"),
    ],
)
def test_prunejobs_refuses_a_zero_batch_size_and_live_statuses(
    args: tuple[str, ...], message: str
) -> None:
    job_id = make_job(status="done", attempts=1, finished_at=-30 * DAY)
    with pytest.raises(CommandError, match=re.escape(message)):
        prunejobs(*args)
    assert ids() == {job_id}
