"""Periodic jobs in one process: when a schedule ticks (a fixed clock, DST nights included),
what the checks say of bad declarations, and what one tick statement does in the database
(a tick becomes one job however many sessions race for it; only the latest tick; a changed
schedule starts afresh). The worker-process behaviour is in test_periodic_workers.py."""

from __future__ import annotations

import itertools
import re
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from django_pgjobs import current_job, job, periodic
from django_pgjobs.core import checks, schedules
from django_pgjobs.core.connections import connection_params
from django_pgjobs.core.schedules import Schedule, ticks
from django_pgjobs.models import ArchivedJob, Job
from django_pgjobs.worker import Worker
from tests.helpers import db_now
from tests.workers import query, scalar

UTC = timezone.utc
NOOP = "testproject.testjobs.noop"


@pytest.fixture
def declared() -> Iterator[list[Schedule]]:
    """The module-level declarations, emptied for the test and restored after it."""
    saved = list(schedules._declared)
    schedules._declared.clear()
    yield schedules._declared
    schedules._declared[:] = saved


def at(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)  # type: ignore[misc]


# -- when a schedule ticks ------------------------------------------------------------------


def test_every_ticks_on_whole_multiples_since_the_epoch() -> None:
    every = Schedule("s", NOOP, "test", every=timedelta(seconds=30))
    assert ticks(every, at(2024, 5, 1, 12, 0, 45)) == (
        at(2024, 5, 1, 12, 0, 30),
        at(2024, 5, 1, 12, 1),
    )
    # A tick at exactly now is the latest, not the next.
    assert ticks(every, at(2024, 5, 1, 12, 1)) == (at(2024, 5, 1, 12, 1), at(2024, 5, 1, 12, 1, 30))


def test_cron_ticks_in_its_time_zone_and_are_stored_in_utc() -> None:
    nightly = Schedule("s", NOOP, "test", cron="0 2 * * *", timezone="Europe/Paris")
    latest, following = ticks(nightly, at(2024, 6, 1, 12))
    assert (latest, following) == (at(2024, 6, 1, 0), at(2024, 6, 2, 0))  # 02:00 CEST
    assert latest.tzinfo == UTC


def night(schedule: Schedule, start: datetime, hours: int = 48) -> list[datetime]:
    """Every distinct latest tick seen by a scheduler stepping each minute from ``start``,
    checking at each step that latest <= now < next and that ticks only move forward."""
    seen: list[datetime] = []
    now = start
    while now < start + timedelta(hours=hours):
        latest, following = ticks(schedule, now)
        assert latest <= now < following, (now, latest, following)
        if not seen or latest != seen[-1]:
            assert not seen or latest > seen[-1], f"tick {latest} after {seen[-1]} at {now}"
            seen.append(latest)
        now += timedelta(minutes=1)
    return seen


@pytest.mark.parametrize(
    ("zone", "cron", "day", "expected"),
    [
        # Spring forward: 02:30 does not exist that night; it runs once, at 03:00 CEST.
        (
            "Europe/Paris",
            "30 2 * * *",
            (2024, 3, 30),
            [at(2024, 3, 30, 1, 30), at(2024, 3, 31, 1, 0), at(2024, 4, 1, 0, 30)],
        ),
        # Fall back: 02:30 comes twice that night; it runs once, on its first pass (CEST).
        (
            "Europe/Paris",
            "30 2 * * *",
            (2024, 10, 26),
            [at(2024, 10, 26, 0, 30), at(2024, 10, 27, 0, 30), at(2024, 10, 28, 1, 30)],
        ),
        (
            "America/New_York",
            "30 1 * * *",
            (2024, 11, 2),
            [at(2024, 11, 2, 5, 30), at(2024, 11, 3, 5, 30), at(2024, 11, 4, 6, 30)],
        ),
    ],
    ids=["spring-forward-paris", "fall-back-paris", "fall-back-new-york"],
)
def test_a_dst_night_ticks_once_never_twice_never_raises(
    zone: str, cron: str, day: tuple[int, int, int], expected: list[datetime]
) -> None:
    schedule = Schedule("s", NOOP, "test", cron=cron, timezone=zone)
    assert night(schedule, at(*day, 12)) == expected


def test_an_interval_cron_keeps_real_time_through_the_repeated_hour() -> None:
    every20 = Schedule("s", NOOP, "test", cron="*/20 * * * *", timezone="Europe/Paris")
    seen = night(every20, at(2024, 10, 26, 12))
    gaps = {b - a for a, b in itertools.pairwise(seen)}
    assert gaps == {timedelta(minutes=20)}


def test_schedules_describe_themselves_in_words() -> None:
    nightly = Schedule("s", NOOP, "test", cron="0 2 * * *", timezone="Europe/Paris")
    assert nightly.describe() == "At 02:00 every day (Europe/Paris)"
    assert Schedule("s", NOOP, "t", every=timedelta(seconds=30)).describe() == "every 30 seconds"
    assert Schedule("s", NOOP, "t", every=3600).describe() == "every 1 hour"


# -- declaring, and the checks --------------------------------------------------------------


@job
def report(kind: str = "full") -> None:
    """A job the declarations below schedule."""


def check_ids() -> list[str]:
    return [message.id for message in checks.check_schedules()]


def test_periodic_stacks_on_job_and_declares_a_valid_schedule(declared: list[Schedule]) -> None:
    decorated = periodic("0 2 * * *", timezone="Europe/Paris", kwargs={"kind": "quick"})(report)
    assert decorated is report
    [schedule] = schedules.declared()
    assert (schedule.name, schedule.task) == (report.name, report.name)
    assert schedule.payload() == {"kind": "quick"}
    assert check_ids() == []


def test_periodic_below_job_is_refused_at_once() -> None:
    with pytest.raises(TypeError, match="put it above @job"):
        periodic(every=timedelta(minutes=1))(lambda: None)


@pytest.mark.parametrize(
    ("arguments", "check_id", "words"),
    [
        ({"cron": "61 * * * *"}, "pgjobs.E031", "'61 * * * *': Bad minute"),
        ({"cron": "* * * *"}, "pgjobs.E031", "4 fields, not 5"),
        ({"cron": "0 2 * * *", "every": timedelta(hours=1)}, "pgjobs.E030", "both"),
        ({}, "pgjobs.E030", "neither"),
        ({"every": timedelta(milliseconds=10)}, "pgjobs.E032", "1 second or more"),
        ({"cron": "0 2 * * *", "timezone": "Europe/Pariss"}, "pgjobs.E033", "Europe/Pariss"),
        ({"every": 60, "kwargs": {"when": datetime(2024, 1, 1)}}, "pgjobs.E034", "datetime"),
        ({"every": 60, "queue": "no spaces"}, "pgjobs.E037", "no spaces"),
        ({"every": 60, "name": ""}, "pgjobs.E039", "non-empty"),
    ],
)
def test_each_bad_declaration_is_a_check_with_its_id(
    declared: list[Schedule], arguments: dict[str, Any], check_id: str, words: str
) -> None:
    cron = arguments.pop("cron", None)
    periodic(cron, **arguments)(report)
    [message] = checks.check_schedules()
    assert message.id == check_id
    assert words in message.msg and message.hint
    with pytest.raises(ImproperlyConfigured, match=check_id):
        Worker(schedule=True)
    Worker(schedule=False)  # a worker that does not schedule starts anyway


def test_two_schedules_with_one_name_are_reported(declared: list[Schedule]) -> None:
    periodic(every=60, kwargs={"kind": "a"})(report)
    periodic(every=60, kwargs={"kind": "b"}, name=report.name)(report)
    assert check_ids() == ["pgjobs.E035"]
    declared.clear()
    periodic(every=60, kwargs={"kind": "a"}, name="report-a")(report)
    periodic(every=60, kwargs={"kind": "b"}, name="report-b")(report)
    assert check_ids() == []


def test_the_setting_declares_schedules_and_its_mistakes_are_reported(
    declared: list[Schedule],
) -> None:
    good = {"purge": {"task": NOOP, "cron": "*/5 * * * *", "kwargs": {"days": 7}}}
    with override_settings(PGJOBS={"SCHEDULE": good}):
        [schedule] = schedules.declared()
        assert (schedule.name, schedule.task, schedule.payload()) == ("purge", NOOP, {"days": 7})
        assert check_ids() == []
    bad: list[tuple[object, str]] = [
        ({"x": {"task": "app.tasks.missing", "every": 60}}, "pgjobs.E036"),
        ({"x": {"task": NOOP, "every": 60, "crn": "* * * * *"}}, "pgjobs.E038"),
        ({"x": "*/5 * * * *"}, "pgjobs.E038"),
        (["x"], "pgjobs.E038"),
    ]
    for setting, check_id in bad:
        with override_settings(PGJOBS={"SCHEDULE": setting}):
            assert check_id in check_ids(), setting


def test_every_schedule_check_id_is_tested() -> None:
    source = Path(schedules.__file__).read_text() + Path(checks.__file__).read_text()
    declared_ids = set(re.findall(r'"(pgjobs\.E03\d)"', source))
    tested = set(re.findall(r'"(pgjobs\.E03\d)"', Path(__file__).read_text()))
    assert len(declared_ids) == 10 and declared_ids <= tested


# -- the tick statement ---------------------------------------------------------------------

uses_db = pytest.mark.django_db(transaction=True)


def tick(schedule: Schedule, when: datetime, alias: str = "default") -> int | None:
    from django.db import connections

    return schedules.enqueue_tick(connections[alias], schedule, when)


@uses_db
def test_a_new_schedule_starts_at_its_next_tick_then_enqueues_each_tick_once() -> None:
    every = Schedule("every-minute", NOOP, "test", every=60, kwargs={"n": 1})
    assert tick(every, at(2024, 5, 1, 12, 0)) is None  # deployed: the row starts here
    job_id = tick(every, at(2024, 5, 1, 12, 1))
    assert job_id is not None
    assert tick(every, at(2024, 5, 1, 12, 1)) is None  # the same tick again: nothing
    assert tick(every, at(2024, 5, 1, 12, 0)) is None  # an older tick: nothing
    job = Job.objects.get(pk=job_id)
    assert (job.task, job.payload, job.schedule, job.scheduled_at) == (
        NOOP,
        {"n": 1},
        "every-minute",
        at(2024, 5, 1, 12, 1),
    )
    assert scalar("SELECT last_job_id FROM pgjobs_schedule WHERE name = 'every-minute'") == job_id


@uses_db
def test_a_changed_schedule_runs_its_later_ticks_and_never_goes_back() -> None:
    old = Schedule("report", NOOP, "test", cron="0 3 * * *", timezone="UTC")
    tick(old, at(2024, 5, 1, 3))
    assert tick(old, at(2024, 5, 2, 3)) is not None
    # Moved to 02:00: its ticks after the last one recorded run.
    new = Schedule("report", NOOP, "test", cron="0 2 * * *", timezone="UTC")
    assert tick(new, at(2024, 5, 3, 2)) is not None
    # A rolling deploy: old and new code take turns, and each version's later ticks run; an
    # older tick from either never moves the schedule back nor runs.
    assert tick(old, at(2024, 5, 3, 3)) is not None
    assert tick(new, at(2024, 5, 3, 2)) is None
    assert tick(new, at(2024, 5, 4, 2)) is not None
    assert scalar("SELECT last_tick FROM pgjobs_schedule WHERE name = 'report'") == at(
        2024, 5, 4, 2
    )


@uses_db
def test_sessions_racing_for_one_tick_enqueue_it_once() -> None:
    every = Schedule("raced", NOOP, "test", every=1)
    tick(every, at(2024, 5, 1, 12, 0, 0))
    sessions = 8
    start = threading.Barrier(sessions)
    results: list[int | None] = []
    lock = threading.Lock()

    def race() -> None:
        with psycopg.connect(**connection_params("default"), autocommit=True) as conn:
            start.wait()
            for n in range(1, 21):
                got = schedules.enqueue_tick(conn, every, at(2024, 5, 1, 12, 0, n))
                with lock:
                    results.append(got)

    threads = [threading.Thread(target=race) for _ in range(sessions)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == sessions * 20
    made = [r for r in results if r is not None]
    assert len(made) == 20
    rows = query(
        "SELECT scheduled_at, count(*) FROM pgjobs_job WHERE schedule = 'raced' "
        "GROUP BY 1 ORDER BY 1"
    )
    assert [(when.second, n) for when, n in rows] == [(s, 1) for s in range(1, 21)]


@uses_db
def test_an_archived_periodic_job_keeps_its_tick() -> None:
    every = Schedule("archived", NOOP, "test", every=60)
    tick(every, at(2024, 5, 1, 12, 0))
    job_id = tick(every, at(2024, 5, 1, 12, 1))
    query(
        "UPDATE pgjobs_job SET status = 'done', finished_at = now() - interval '30 days' "
        "WHERE id = %s",
        [job_id],
    )
    assert Job.objects.prune(older_than=timedelta(days=7), archive=True) == 1
    archived = ArchivedJob.objects.get(pk=job_id)
    assert (archived.schedule, archived.scheduled_at) == ("archived", at(2024, 5, 1, 12, 1))


@job(max_attempts=2)
def tick_seen(**kwargs: object) -> None:
    """Records the tick current_job() reports; fails its first attempt."""
    ctx = current_job()
    assert ctx is not None
    query(
        "INSERT INTO shop_order (email, total_cents, created_at) VALUES (%s, %s, now())",
        [
            f"{ctx.schedule}|{ctx.scheduled_at.isoformat() if ctx.scheduled_at else None}",
            ctx.attempts,
        ],
    )
    if ctx.attempts == 1:
        raise RuntimeError("the first attempt fails on purpose")


tick_seen.backoff = (0.0, 0.0)


@uses_db
def test_a_periodic_job_is_ordinary_retried_and_knows_its_tick(
    declared: list[Schedule],
) -> None:
    """A worker enqueues the tick due now (the row is set up one tick behind), runs it, its
    retry runs too, and current_job() gives each attempt the tick, not the start time."""
    periodic(every=timedelta(hours=1), name="hourly")(tick_seen)
    now = db_now()
    latest, _ = ticks(Schedule("hourly", "", "", every=3600), now)
    query(
        "INSERT INTO pgjobs_schedule (name, spec, last_tick) VALUES ('hourly', 'every 3600s', %s)",
        [latest - timedelta(hours=1)],
    )
    # A burst worker may exit before its failed attempt is written back: run until done.
    claimed = 0
    for _ in range(3):
        claimed += Worker(burst=True, reap_interval=0).run().claimed
        if Job.objects.filter(schedule="hourly", status="done").exists():
            break
    assert claimed == 2
    [job] = Job.objects.filter(schedule="hourly")
    assert (job.status, job.attempts, job.scheduled_at) == ("done", 2, latest)
    seen = query("SELECT email, total_cents FROM shop_order ORDER BY total_cents")
    assert seen == [(f"hourly|{latest.isoformat()}", 1), (f"hourly|{latest.isoformat()}", 2)]
