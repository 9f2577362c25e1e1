"""Periodic jobs with real worker processes: one job per tick across five workers, two of them
SIGKILLed; only the latest tick after a pause; a failing step logged, retried and reported by
jobsdoctor; an idle worker silent until the tick; a removed schedule gone at restart.

Each test declares its schedules in the workers it starts (``tests.periodic_jobs``) and waits
on database states, never on a fixed sleep."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest

from tests.helpers import db_now, wait_until
from tests.workers import Process, Workers, counts, query, scalar

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def schedules_env(**schedules: dict[str, Any]) -> dict[str, str]:
    return {"PGJOBS_TEST_SCHEDULES": json.dumps(schedules)}


def start(workers: Workers, env: dict[str, str], *args: str) -> Process:
    return workers.start("--reap-interval", "1", *args, test_jobs=True, env=env)


def stop(*processes: Process) -> None:
    for process in processes:
        process.send(signal.SIGTERM)
    for process in processes:
        assert process.wait(30) == 0, process.tail()


def ticks_of(name: str) -> list[tuple[datetime, int, str]]:
    """(tick, jobs for it, a status) for each tick of the schedule, oldest first."""
    return [
        (row[0], row[1], row[2])
        for row in query(
            "SELECT scheduled_at, count(*), max(status) FROM pgjobs_job WHERE schedule = %s "
            "GROUP BY scheduled_at ORDER BY scheduled_at",
            [name],
        )
    ]


def latest_tick(name: str) -> datetime | None:
    value = scalar("SELECT max(scheduled_at) FROM pgjobs_job WHERE schedule = %s", [name])
    return value if isinstance(value, datetime) else None


def wait_for_tick(name: str, after: datetime | None, timeout: float = 30) -> datetime:
    def newer() -> datetime | None:
        tick = latest_tick(name)
        return tick if tick is not None and (after is None or tick > after) else None

    return wait_until(newer, timeout=timeout, interval=0.05, message=f"a tick of {name}")


def test_five_workers_enqueue_one_job_per_tick_even_when_two_are_killed(
    workers: Workers,
) -> None:
    env = schedules_env(every_second={"task": "tick", "every": 1})
    pool = [start(workers, env, "--lease", "2", "--concurrency", "2") for _ in range(5)]
    for process in pool:
        process.wait_for_log("worker", timeout=60)
        process.wait_for_log("schedules: every_second", timeout=60)
    # Count from a tick every worker was up for.
    first = wait_for_tick("every_second", db_now())
    middle = wait_until(
        lambda: (t := latest_tick("every_second")) and t >= first + timedelta(seconds=10) and t,
        timeout=60,
        interval=0.05,
        message="ten seconds of ticks",
    )
    for process in pool[:2]:
        process.popen.kill()
        process.popen.wait(30)
    assert middle is not None
    last = wait_until(
        lambda: (t := latest_tick("every_second")) and t >= middle + timedelta(seconds=10) and t,
        timeout=60,
        interval=0.05,
        message="ten more seconds of ticks",
    )
    # Every tick counted is run (the killed workers' jobs come back after their lease).
    wait_until(
        lambda: (
            not scalar(
                "SELECT count(*) FROM pgjobs_job WHERE schedule = 'every_second' "
                "AND scheduled_at <= %s AND status <> 'done'",
                [last],
            )
        ),
        timeout=60,
        interval=0.1,
        message="every counted tick's job to be done",
    )
    stop(*pool[2:])
    counted = [row for row in ticks_of("every_second") if first <= row[0] <= last]
    expected = int((last - first).total_seconds()) + 1
    run = sum(1 for _tick, _jobs, status in counted if status == "done")
    print(
        f"\nperiodic, 5 workers (2 SIGKILLed at {middle:%H:%M:%S}): ticks expected {expected}, "
        f"enqueued {sum(jobs for _tick, jobs, _status in counted)}, run {run}"
    )
    assert [tick for tick, _jobs, _status in counted] == [
        first + timedelta(seconds=n) for n in range(expected)
    ], "a tick is missing"
    assert all(jobs == 1 for _tick, jobs, _status in counted), "a tick was enqueued twice"
    assert run == expected


def test_after_a_pause_only_the_latest_tick_is_enqueued_and_jobsdoctor_saw_the_gap(
    workers: Workers,
) -> None:
    env = schedules_env(every_two={"task": "tick", "every": 2})
    worker = start(workers, env)
    before = wait_for_tick("every_two", None)
    stop(worker)
    last = latest_tick("every_two")
    assert last is not None
    # Nobody runs the scheduler for more than two ticks: jobsdoctor says so.
    wait_until(
        lambda: db_now() > last + timedelta(seconds=7), timeout=30, interval=0.1, message="3 ticks"
    )
    doctor = workers.command("jobsdoctor", test_jobs=True, env=env)
    assert doctor.wait(60) == 1, doctor.tail()
    assert "PROBLEM: schedule every_two" in doctor.output()
    assert "overdue" in doctor.output()

    restarted_at = db_now()
    worker = start(workers, env)
    after = wait_for_tick("every_two", last)
    stop(worker)
    missed = [tick for tick, _jobs, _status in ticks_of("every_two") if last < tick]
    # The first tick after the restart is the latest one due then, not the three it missed
    # (ticks every 2 s: the latest due at the restart is at most 2 s before it).
    assert missed[0] >= restarted_at - timedelta(seconds=2)
    assert missed[0] - last >= timedelta(seconds=6)
    assert after >= missed[0]
    assert before <= last


def test_a_failing_step_is_logged_retried_recorded_and_reported(workers: Workers) -> None:
    env = schedules_env(broken={"task": "tick", "every": 1})
    # A real refusal by the database: the job row of this schedule breaks a constraint, so
    # the whole tick statement fails (and moves nothing).
    query(
        "ALTER TABLE pgjobs_job ADD CONSTRAINT test_refuses_broken "
        "CHECK (schedule IS DISTINCT FROM 'broken') NOT VALID"
    )
    try:
        worker = start(workers, env)
        log = worker.wait_for_log("(failure 3 in a row)", timeout=60)
        assert "ERROR django_pgjobs.scheduler: schedule broken: could not enqueue" in log
        assert "Traceback" in log and "test_refuses_broken" in log
        # The log line comes just before the failure is recorded on the schedule's row.
        wait_until(
            lambda: query("SELECT failures FROM pgjobs_schedule WHERE name = 'broken'")[0][0] >= 3,
            message="the third failure to be recorded",
        )
        row = query("SELECT last_error, failures FROM pgjobs_schedule WHERE name = 'broken'")
        assert "test_refuses_broken" in row[0][0] and row[0][1] >= 3
        assert latest_tick("broken") is None
        doctor = workers.command("jobsdoctor", test_jobs=True, env=env)
        assert doctor.wait(60) == 1, doctor.tail()
        assert "PROBLEM: schedule broken: its last " in doctor.output()
        assert "test_refuses_broken" in doctor.output()
    finally:
        query("ALTER TABLE pgjobs_job DROP CONSTRAINT IF EXISTS test_refuses_broken")
    # Retried with backoff: the next try succeeds and clears the error.
    wait_for_tick("broken", None, timeout=90)
    wait_until(
        lambda: scalar("SELECT last_error IS NULL FROM pgjobs_schedule WHERE name = 'broken'"),
        timeout=10,
        message="the error to be cleared",
    )
    stop(worker)


def test_an_idle_worker_wakes_only_for_the_tick(workers: Workers) -> None:
    env = schedules_env(every_ten={"task": "tick", "every": 10})
    worker = start(workers, env, "--poll-interval", "600", "--reap-interval", "600")
    worker.wait_for_log("schedules: every_ten", timeout=60)
    # Watch one whole interval: from just after one tick's job to the next tick.
    first = wait_for_tick("every_ten", None)
    wait_until(lambda: counts().get("done", 0) >= 1, message="the first tick's job")
    worker.wait_until_idle(quiet=1.0, timeout=60)
    quiet_from = db_now()
    due = first + timedelta(seconds=10)
    while due <= quiet_from:
        due += timedelta(seconds=10)
    moments: set[datetime] = set()

    def sample() -> datetime | None:
        for _state, changed, started in worker.activity().values():
            moments.update(t for t in (changed, started) if t is not None)
        tick = latest_tick("every_ten")
        return tick if tick is not None and tick >= due else None

    assert wait_until(sample, timeout=30, interval=0.2, message="the tick") == due
    early = sorted(t for t in moments if quiet_from < t < due - timedelta(seconds=0.05))
    assert early == [], f"queries before the tick at {due}: {early}"
    stop(worker)


def test_a_removed_schedule_is_gone_at_restart(workers: Workers) -> None:
    both = schedules_env(
        kept={"task": "tick", "every": 1}, removed={"task": "flaky_tick", "every": 1}
    )
    worker = start(workers, both)
    wait_for_tick("kept", None)
    removed_last = wait_for_tick("removed", None)
    # One of its jobs has failed once and then run again (for current_job() below).
    wait_until(
        lambda: scalar(
            "SELECT count(*) FROM pgjobs_job WHERE schedule = 'removed' AND status = 'done' "
            "AND attempts = 2"
        ),
        message="a retried job of the removed schedule",
    )
    stop(worker)
    removed_last = latest_tick("removed") or removed_last

    kept_only = schedules_env(kept={"task": "tick", "every": 1})
    worker = start(workers, kept_only)
    restarted = latest_tick("kept")
    wait_for_tick("kept", wait_for_tick("kept", restarted))  # two ticks after the restart
    stop(worker)
    assert latest_tick("removed") == removed_last
    # Its row stays, inert; jobsdoctor does not report it.
    assert scalar("SELECT count(*) FROM pgjobs_schedule WHERE name = 'removed'") == 1
    doctor = workers.command("jobsdoctor", test_jobs=True, env=kept_only)
    doctor.wait(60)
    assert "removed" not in doctor.output()
    # The retried periodic job served its tick on both attempts (current_job()).
    seen = query("SELECT email, total_cents FROM shop_order ORDER BY id")
    done = query(
        "SELECT scheduled_at FROM pgjobs_job WHERE schedule = 'removed' AND status = 'done' "
        "AND attempts = 2"
    )
    assert done
    for (tick,) in done:
        assert (f"removed|{tick.isoformat()}", 1) in seen
        assert (f"removed|{tick.isoformat()}", 2) in seen


@pytest.fixture(autouse=True)
def _no_leftover_constraint() -> Iterator[None]:
    yield
    query("ALTER TABLE pgjobs_job DROP CONSTRAINT IF EXISTS test_refuses_broken")
