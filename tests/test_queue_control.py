"""Queue control against real workers: pause and resume, per-queue slots in one worker, global
concurrency and rate limits, lock keys, claims of registered tasks only, and the registry of
live workers.

Overlaps are computed from what the jobs record (``tests.workers.span``): the start and end of
each job's own run, on the monotonic clock every process of the machine shares. A job's run
lies inside the time its row is ``running``, so the overlap of runs is a lower bound of the
overlap the claim allowed: "never more than N" is shown by the runs, "reaches N" by jobs that
wait until N are running (``tests.workers.until_running``).
"""

from __future__ import annotations

import json
import signal
import socket
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.db import connection, transaction

import django_pgjobs
from django_pgjobs.core import claim, conf, finish, upkeep
from django_pgjobs.exceptions import InvalidJobOptions
from django_pgjobs.models import Job, QueueState
from django_pgjobs.notify import notifier
from django_pgjobs.ops import dashboard
from django_pgjobs.worker import Worker
from testproject.shop.models import Order
from tests.helpers import (
    NOOP,
    PATIENCE,
    job_row,
    listening,
    make_job,
    make_jobs,
    raw_connect,
    wait_until,
    worker_record,
)
from tests.workers import (
    SLEEP,
    Process,
    Workers,
    listener_statements,
    query,
    scalar,
    stuck_until_order_started,
)

pytestmark = pytest.mark.django_db(transaction=True)

SPAN = "tests.workers.span"
UNTIL_RUNNING = "tests.workers.until_running"


@pytest.fixture
def spans() -> Iterator[None]:
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE TABLE IF NOT EXISTS test_span (job_id bigint, queue text, lock_key text, "
            "started float8, ended float8)"
        )
        cursor.execute("TRUNCATE test_span")
    yield
    with connection.cursor() as cursor:
        cursor.execute("DROP TABLE test_span")


def recorded(where: str = "TRUE", params: list[object] | None = None) -> list[tuple[float, float]]:
    rows = query(f"SELECT started, ended FROM test_span WHERE {where}", params or [])
    return [(float(a), float(b)) for a, b in rows]


def most_at_once(runs: list[tuple[float, float]]) -> int:
    """The largest number of runs that overlap at one moment (an end before a start at the
    same instant: touching runs do not overlap)."""
    events = sorted([(a, 1) for a, _ in runs] + [(b, -1) for _, b in runs], key=lambda e: e)
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def all_done(
    ids: list[int], *, message: str, timeout: float = PATIENCE, interval: float = 0.01
) -> None:
    """Wait until every one of ``ids`` is done."""
    wait_until(
        lambda: Job.objects.filter(id__in=ids, status="done").count() == len(ids),
        timeout=timeout,
        interval=interval,
        message=message,
    )


def test_most_at_once_counts_overlaps() -> None:
    assert most_at_once([]) == 0
    assert most_at_once([(0, 1), (1, 2), (2, 3)]) == 1
    assert most_at_once([(0, 3), (1, 2), (1.5, 4), (3.5, 5)]) == 3


# -- pause and resume --------------------------------------------------------------------------


def test_pause_stops_new_starts_within_one_claim_and_resume_wakes_the_workers_at_once(
    workers: Workers,
) -> None:
    ids = make_jobs(5000, task=SLEEP, queue="bulk")
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE pgjobs_job SET payload = '{\"seconds\": 0.005}' WHERE queue = 'bulk'"
        )
    # The poll is ten minutes away: only a NOTIFY can wake them after the pause.
    started = [
        workers.start(
            "--queue",
            "bulk",
            "--queue",
            "other",
            "--concurrency",
            "4",
            "--poll-interval",
            "600",
            "--reap-interval",
            "0",
        )
        for _ in range(2)
    ]
    wait_until(
        lambda: scalar("SELECT count(*) FROM pgjobs_job WHERE status = 'done'") >= 300,
        message="the workers to be draining",
    )

    Job.objects.pause("bulk")
    paused_at = scalar("SELECT clock_timestamp()")
    # Enqueue still works while paused.
    late = Job.objects.enqueue(SLEEP, {"seconds": 0.005}, queue="bulk").id
    # The running ones finish; then every start came from a claim that began before the pause
    # committed (its now() is earlier than this clock reading).
    wait_until(
        lambda: (
            scalar("SELECT count(*) FROM pgjobs_job WHERE queue = 'bulk' AND status = 'running'")
            == 0
        ),
        message="the running jobs of the paused queue to finish",
    )
    assert scalar("SELECT max(attempted_at) FROM pgjobs_job WHERE queue = 'bulk'") < paused_at
    # Both workers claim again (a job of another queue runs on each wake) and still start none.
    waiting = scalar("SELECT count(*) FROM pgjobs_job WHERE queue = 'bulk' AND status = 'queued'")
    assert waiting > 0
    other = Job.objects.enqueue_many(SLEEP, [{"seconds": 0.005}] * 8, queue="other")
    wait_until(
        lambda: Job.objects.filter(id__in=other, status="done").count() == 8,
        message="the other queue's jobs",
    )
    assert scalar("SELECT count(*) FROM pgjobs_job WHERE queue = 'bulk' AND status = 'queued'") == (
        waiting
    )
    assert QueueState.objects.get(name="bulk").paused

    Job.objects.resume("bulk")
    # At once: the poll is ten minutes away, so only resume's NOTIFY can have woken them.
    wait_until(
        lambda: Job.objects.filter(queue="bulk", status="done").count() == len(ids) + 1,
        message="the resumed queue to drain",
    )
    assert job_row(late)["status"] == "done"
    assert all(worker.alive for worker in started)


def test_pause_and_limits_refuse_bad_input_and_write_nothing() -> None:
    with pytest.raises(InvalidJobOptions, match="queue name"):
        Job.objects.pause("no spaces")
    with pytest.raises(InvalidJobOptions, match="concurrency"):
        Job.objects.set_limits("q", concurrency=0)
    with pytest.raises(InvalidJobOptions, match="rate"):
        Job.objects.set_limits("q", rate=50)  # type: ignore[arg-type]
    with pytest.raises(InvalidJobOptions, match="rate period"):
        Job.objects.set_limits("q", rate=(50, 0))
    with pytest.raises(InvalidJobOptions, match="rate count"):
        Job.objects.set_limits("q", rate=(0, 1))
    # Each start in the window is kept, and every guarded claim rewrites them: capped.
    with pytest.raises(InvalidJobOptions, match=r"rate count .* at most 10000"):
        Job.objects.set_limits("q", rate=(10**9, 1))
    assert not QueueState.objects.exists()
    Job.objects.set_limits("q", concurrency=2, rate=(5, timedelta(seconds=2)))
    state = QueueState.objects.get(name="q")
    assert (state.concurrency, state.rate_count, state.rate_period) == (2, 5, timedelta(seconds=2))
    Job.objects.set_limits("q")
    state.refresh_from_db()
    assert (state.concurrency, state.rate_count, state.rate_period) == (None, None, None)


def test_the_plain_claim_skips_paused_and_limited_queues_and_keyed_jobs() -> None:
    # The keyless job comes first in the claim's order.
    plain = make_job(queue="steered", priority=1)
    keyed = Job.objects.enqueue("testproject.testjobs.noop", queue="steered", lock_key="k").id
    Job.objects.pause("steered")
    assert Job.objects.claim("steered", limit=5) == []
    assert Job.objects.claim("steered", limit=5, guarded=True) == []
    Job.objects.resume("steered")
    Job.objects.set_limits("steered", concurrency=1)
    assert Job.objects.claim("steered", limit=5) == []
    # The guarded claim honours the limit: one of the two, then none while it runs.
    first = Job.objects.claim("steered", limit=5, guarded=True)
    assert [job.id for job in first] == [plain]
    assert Job.objects.claim("steered", limit=5, guarded=True) == []
    Job.objects.complete(first[0])
    Job.objects.set_limits("steered")
    # No limit now: the plain claim never takes the keyed job; the guarded one does.
    assert Job.objects.claim("steered", limit=5) == []
    assert [job.id for job in Job.objects.claim("steered", limit=5, guarded=True)] == [keyed]
    with pytest.raises(InvalidJobOptions, match="lease mode"), transaction.atomic():
        Job.objects.claim("steered", mode="transaction", guarded=True)


def test_a_guarded_claim_behind_a_held_queue_row_gives_up_and_takes_nothing() -> None:
    # An operator's transaction holds the queue's row (a pause inside atomic()): the claim
    # that would stamp a rate-limited start gives up after the guard's lock_timeout instead
    # of holding every other guarded claim behind it.
    Job.objects.set_limits("held", rate=(10, 1))
    job_id = make_job(queue="held")
    with raw_connect() as holder:
        holder.execute("BEGIN")
        holder.execute("UPDATE pgjobs_queue SET paused = false WHERE name = 'held'")
        assert Job.objects.claim("held", guarded=True) == []
        holder.execute("ROLLBACK")
    assert [job.id for job in Job.objects.claim("held", guarded=True)] == [job_id]


# -- per-queue slots in one worker -------------------------------------------------------------


def test_a_queue_with_its_own_slots_runs_that_many_at_once(workers: Workers, spans: None) -> None:
    # 16 jobs that each wait for 8 running at once: they finish only if 8 run at once.
    Job.objects.enqueue_many(
        UNTIL_RUNNING, [{"queue": "thumbnails", "count": 8}] * 16, queue="thumbnails"
    )
    reports = Job.objects.enqueue_many(SPAN, [{"pause": 0.05}] * 20, queue="reports")
    workers.burst(
        "--queue",
        "thumbnails=8",
        "--queue",
        "reports=1",
        "--batch-size",
        "10",
        test_jobs=True,
        timeout=PATIENCE * 2,
    )
    assert Job.objects.filter(queue="thumbnails", status="done").count() == 16
    runs = recorded("queue = 'reports'")
    assert len(runs) == len(reports)
    assert most_at_once(runs) == 1


def test_a_full_pool_claims_again_as_soon_as_a_slot_frees(workers: Workers) -> None:
    # The other queue is empty: only the freed slot can make the worker claim again, the poll
    # being ten minutes away.
    ids = Job.objects.enqueue_many(SLEEP, [{"seconds": 0.05}] * 12, queue="thumbnails")
    workers.start("--queue", "thumbnails=2", "--queue", "default", "--poll-interval", "600")
    all_done(
        ids,
        message="the queue with its own slots to drain",
    )


def test_bad_queue_specs_are_refused_with_their_reason() -> None:
    with pytest.raises(InvalidJobOptions, match="NAME=N"):
        Worker(["thumbnails=0x"])
    with pytest.raises(InvalidJobOptions, match="limit of queue thumbnails"):
        Worker(["thumbnails=0"])
    with pytest.raises(InvalidJobOptions, match="given twice"):
        Worker(["a", "a=2"])
    worker = Worker(["thumbnails=8", "reports=1", "default"], concurrency=3)
    assert worker.limits == {"thumbnails": 8, "reports": 1, "default": None}


# -- global limits -----------------------------------------------------------------------------


@pytest.mark.slow
def test_global_concurrency_holds_across_processes_and_threads(
    workers: Workers, spans: None
) -> None:
    Job.objects.set_limits("payments", concurrency=3)
    ids = Job.objects.enqueue_many(SPAN, [{"pause": 0.03}] * 2000, queue="payments")
    for _ in range(6):
        workers.start(
            "--queue", "payments", "--concurrency", "4", "--poll-interval", "1", test_jobs=True
        )
    all_done(
        ids,
        timeout=PATIENCE * 5,
        interval=0.5,
        message="2,000 limited jobs",
    )
    runs = recorded("queue = 'payments'")
    assert len(runs) == len(ids)
    assert most_at_once(runs) == 3


@pytest.mark.slow
def test_a_rate_limit_holds_in_every_window(workers: Workers) -> None:
    Job.objects.set_limits("rated", rate=(50, timedelta(seconds=1)))
    ids = Job.objects.enqueue_many("testproject.testjobs.noop", [{}] * 200, queue="rated")
    for _ in range(2):
        workers.start("--queue", "rated", "--concurrency", "8", "--poll-interval", "600")
    all_done(
        ids,
        timeout=PATIENCE * 2,
        message="the rate-limited jobs",
    )
    # The claim's own start times (each job ran once).
    starts = sorted(
        row[0].timestamp()
        for row in query("SELECT attempted_at FROM pgjobs_job WHERE queue = 'rated'")
    )
    assert len(starts) == 200
    windows = [sum(1 for t in starts[i:] if t < start + 1.0) for i, start in enumerate(starts)]
    assert max(windows) <= 50
    # 200 starts at 50 per second: the 151st is 3 s after the first at the earliest.
    assert starts[150] - starts[0] >= 3.0


def set_starts(queue: str, *ages: int) -> None:
    """The queue's rate window holds starts this many seconds old."""
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE pgjobs_queue SET starts = ARRAY(SELECT now() - age * interval '1 second'"
            " FROM unnest(%s::int[]) AS age) WHERE name = %s",
            [list(ages), queue],
        )


def test_a_short_claim_whose_rate_window_moved_on_before_the_outlook_still_wakes_the_worker() -> (
    None
):
    """The claim comes back short because the window is full; by the outlook that follows it
    (``since`` seconds later), the window's oldest start has left (a busy machine, a slow round
    trip). The outlook judges the window as the claim saw it: there is room, claim now. It used
    to judge it as it is at the look, no longer full, and gave no time: the worker slept until
    its next tick with ready jobs queued (the rate test timed out once on a loaded machine)."""
    Job.objects.set_limits("moved", rate=(3, timedelta(seconds=60)))
    make_jobs(2, queue="moved")
    set_starts("moved", 65, 50, 20)  # three in the window 10 s ago; two now
    assert claim.outlook(connection, ["moved"], since=10.0).rate_free == 0.0
    # A window still full: the worker wakes when its oldest start leaves, 10 s from now.
    set_starts("moved", 50, 40, 20)
    rate_free = claim.outlook(connection, ["moved"], since=0.0).rate_free
    assert rate_free is not None
    assert 5.0 <= rate_free <= 10.0
    # A window that was not full did not cut the claim: nothing to wake for.
    set_starts("moved", 50, 20)
    assert claim.outlook(connection, ["moved"], since=0.0).rate_free is None
    # Nor is there with the queue paused (resume() sends a NOTIFY), or with no ready job.
    set_starts("moved", 50, 40, 20)
    Job.objects.pause("moved")
    assert claim.outlook(connection, ["moved"], since=0.0).rate_free is None
    Job.objects.resume("moved")
    Job.objects.filter(queue="moved").update(status="cancelled")
    assert claim.outlook(connection, ["moved"], since=0.0).rate_free is None


# -- lock keys ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_jobs_with_one_lock_key_never_overlap_and_all_finish(workers: Workers, spans: None) -> None:
    ids = Job.objects.enqueue_many(
        SPAN,
        [{"pause": 0.01, "n": n} for n in range(500)],
        queue="keyed",
        lock_key=lambda payload: f"customer:{payload['n'] % 10}",
    )
    for _ in range(4):
        workers.start(
            "--queue", "keyed", "--concurrency", "4", "--poll-interval", "1", test_jobs=True
        )
    all_done(
        ids,
        timeout=PATIENCE * 3,
        interval=0.5,
        message="500 keyed jobs",
    )
    for key in range(10):
        runs = sorted(recorded("lock_key = %s", [f"customer:{key}"]))
        assert len(runs) == 50
        assert most_at_once(runs) == 1, f"customer:{key}"
    # Several keys ran side by side: one busy key does not hold the others back.
    assert most_at_once(recorded()) > 1


def test_the_next_job_of_a_key_or_a_limit_starts_as_the_last_outcome_is_written(
    workers: Workers,
) -> None:
    # One key's chain, and a queue of one at a time: each next job can start only once the
    # previous one's outcome is committed; the poll is ten minutes away.
    chain = Job.objects.enqueue_many(
        "testproject.testjobs.noop", [{}] * 15, queue="chain", lock_key=lambda p: "one"
    )
    Job.objects.set_limits("single", concurrency=1)
    single = Job.objects.enqueue_many("testproject.testjobs.noop", [{}] * 15, queue="single")
    workers.start("--queue", "chain", "--queue", "single", "--poll-interval", "600")
    wait_until(
        lambda: Job.objects.filter(id__in=[*chain, *single], status="done").count() == 30,
        message="the chain and the queue of one to drain",
    )


def test_a_slot_freed_by_another_workers_job_wakes_a_worker_waiting_on_the_limit(
    workers: Workers,
) -> None:
    # One job at a time in `single`. The first runs on a worker that is stopping, so it will
    # not claim the second; the other worker's claim came back short (the limit) and its poll
    # is ten minutes away: only word of the freed slot can start the second job.
    Job.objects.set_limits("single", concurrency=1)
    first = Job.objects.enqueue(
        "tests.workers.stuck_until_order", {"email": "first@example.com"}, queue="single"
    ).id
    quiet = ("--poll-interval", "600", "--reap-interval", "600")
    stopping = workers.start("--queue", "single", *quiet, test_jobs=True)
    # Its function runs, not only its claim: a stop that met the claim on its way back would
    # give the job back, for the waiting worker to run.
    wait_until(
        lambda: stuck_until_order_started("first@example.com"), message="the first job to start"
    )
    second = Job.objects.enqueue("testproject.testjobs.noop", {}, queue="single").id
    waiting = workers.start("--queue", "single", *quiet, test_jobs=True)
    asleep_after_a_short_claim(waiting, listeners=2)
    assert job_row(second)["status"] == "queued"
    stopping.send(signal.SIGTERM)
    stopping.wait_for_log("signal again to exit now")
    Order.objects.create(email="first@example.com", total_cents=1)
    assert stopping.wait() == 0
    all_done([first, second], message="the second job, on the waiting worker")
    assert worker_of(second) != worker_of(first)


def test_cancelling_a_running_job_of_a_limited_queue_starts_the_next_at_once(
    workers: Workers,
) -> None:
    # The cancelled job's function goes on (a sleep that does not look at its context), and
    # a heartbeat would tell it only minutes later, with a ten-minute lease; its slot under the
    # limit is free at the cancel, and the next job starts then, not at the end of the sleep,
    # the heartbeat or the poll.
    Job.objects.set_limits("single", concurrency=1)
    first = Job.objects.enqueue(SLEEP, {"seconds": 600}, queue="single").id
    second = Job.objects.enqueue("testproject.testjobs.noop", {}, queue="single").id
    worker = workers.start(
        "--queue",
        "single",
        "--concurrency",
        "2",
        "--lease",
        "600",
        "--poll-interval",
        "600",
        "--reap-interval",
        "600",
        test_jobs=True,
    )
    wait_until(lambda: job_row(first)["status"] == "running", message="the first job to start")
    asleep_after_a_short_claim(worker, listeners=1)
    assert job_row(second)["status"] == "queued"
    assert Job.objects.cancel(first) == 1
    all_done([second], message="the next job of the queue after the cancel")
    assert job_row(first)["status"] == "cancelled"


def test_word_of_a_freed_slot_goes_only_to_queues_that_can_use_it() -> None:
    # Each queue has a job that finished (cancelled here: any end will do) and, but for
    # `idle`, a ready one behind it. Only `limited` and `keyed` have room for it: `idle` has
    # no ready job, `stopped` is paused, `refilled` already runs as many as its limit allows,
    # in `rekeyed` another job of the finished one's key runs already, `rated` and `plain`
    # have no concurrency limit, and their jobs no key.
    for queue in ("limited", "idle", "stopped", "refilled"):
        Job.objects.set_limits(queue, concurrency=1)
    Job.objects.set_limits("rated", rate=(1, 60))
    Job.objects.pause("stopped")
    queues = ("limited", "idle", "stopped", "refilled", "rekeyed", "rated", "keyed", "plain")
    keys = {"keyed": "k", "rekeyed": "r"}
    finished = [
        Job.objects.enqueue(NOOP, queue=queue, lock_key=keys.get(queue)).id for queue in queues
    ]
    assert Job.objects.cancel(finished) == len(finished)
    for queue in queues:
        if queue != "idle":
            Job.objects.enqueue(NOOP, queue=queue)
    Job.objects.enqueue(NOOP, queue="idle", delay=timedelta(hours=1))
    make_job(queue="refilled", status="running", attempts=1)
    again = Job.objects.enqueue(NOOP, queue="rekeyed", lock_key="r").id
    Job.objects.filter(id=again).update(status="running", attempts=1)
    with listening(conf.channel()) as listener:
        finish.wake_freed(connection, finished, channel=conf.channel())
        assert sorted(listener.heard()) == ["keyed", "limited"]


def test_a_cancel_sends_word_of_a_freed_slot_only_when_it_commits() -> None:
    Job.objects.set_limits("single", concurrency=1)
    running = make_job(queue="single", status="running", attempts=1)
    Job.objects.enqueue(NOOP, queue="single")
    with listening(conf.channel()) as listener:
        assert listener.heard() == []
        with pytest.raises(RuntimeError, match="rolled back"), transaction.atomic():
            assert Job.objects.cancel(running) == 1
            raise RuntimeError("rolled back")
        assert job_row(running)["status"] == "running"
        notifier.flush()
        assert listener.heard() == []
        with transaction.atomic():
            assert Job.objects.cancel(running) == 1
            notifier.flush()
            assert listener.heard() == []  # not before the commit
        notifier.flush()  # sent from the notifier's thread, after the commit
        assert listener.heard() == ["single"]


# The outlook's opening, which pg_stat_activity keeps (it cuts a statement's text short).
OUTLOOK_HEAD = "extract(epoch FROM min(run_at) - now())"


def asleep_after_a_short_claim(process: Process, *, listeners: int, quiet: float = 1.0) -> None:
    """Wait until the worker's connections (not its LISTEN one) are idle, the latest
    statement of one of them the outlook that follows a short claim, and none has moved for
    ``quiet`` s: it is waiting for a NOTIFY or its next tick. Its LISTEN is in place too
    (``listeners``: how many LISTEN connections the test's workers have), or the claim that
    follows it could still take a job."""
    assert OUTLOOK_HEAD in claim.OUTLOOK[:200]
    last: list[list[tuple[object, ...]]] = [[]]
    since = [time.monotonic()]

    def asleep() -> bool:
        now = query(
            "SELECT pid, state, state_change, query FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name = %s ORDER BY pid",
            [process.app_name],
        )
        if now != last[0]:
            last[0], since[0] = now, time.monotonic()
            return False
        assert process.alive, process.tail()
        return (
            all(state == "idle" for _, state, _, _ in now)
            and any(OUTLOOK_HEAD in str(text) for *_, text in now)
            and sum(1 for text in listener_statements() if text) == listeners
            and time.monotonic() - since[0] >= quiet
        )

    wait_until(asleep, interval=0.1, message=f"{process.name} to wait after a short claim")


def worker_of(job_id: int) -> str:
    """The worker that ran the job's (one) attempt."""
    (worker_id,) = Job.objects.get(id=job_id).worker_ids
    return str(worker_id)


def test_a_running_key_holds_back_only_its_own_jobs() -> None:
    # Key A's jobs come first in the claim's order; A's first is running.
    busy = Job.objects.enqueue_many(
        "testproject.testjobs.noop", [{}] * 20, queue="k", priority=5, lock_key=lambda p: "A"
    )
    other = Job.objects.enqueue("testproject.testjobs.noop", queue="k", lock_key="B").id
    free = Job.objects.enqueue("testproject.testjobs.noop", queue="k").id
    first = Job.objects.claim("k", limit=1, guarded=True)
    assert len(first) == 1 and first[0].id in busy
    # Next: one job per free key (B) and the keyless one; none of A's.
    claimed = Job.objects.claim("k", limit=10, guarded=True)
    assert sorted(job.id for job in claimed) == sorted([other, free])
    assert Job.objects.claim("k", limit=10, guarded=True) == []
    # A's job done: the next of A's starts, one.
    Job.objects.complete(first[0])
    after = Job.objects.claim("k", limit=10, guarded=True)
    assert len(after) == 1 and after[0].id in busy and after[0].id != first[0].id


def test_jobs_of_one_key_enqueued_together_run_in_id_order() -> None:
    # One enqueue_many gives them one run_at and one priority: the id breaks the tie, in the
    # claim as in explain(), which names the job the claim takes next.
    ids = list(
        Job.objects.enqueue_many(
            "testproject.testjobs.noop", [{"n": n} for n in range(5)], lock_key=lambda p: "k"
        )
    )
    taken = []
    for _ in ids:
        (job,) = Job.objects.claim("default", limit=5, guarded=True)
        taken.append(job.id)
        assert Job.objects.complete(job)
    assert taken == sorted(ids)


def test_lock_keys_are_validated() -> None:
    with pytest.raises(InvalidJobOptions, match="lock_key"):
        Job.objects.enqueue("testproject.testjobs.noop", lock_key="")
    with pytest.raises(InvalidJobOptions, match=r"lock_key .* only whitespace"):
        Job.objects.enqueue("testproject.testjobs.noop", lock_key="  ")
    with pytest.raises(InvalidJobOptions, match=r"unique_key .* only whitespace"):
        Job.objects.enqueue("testproject.testjobs.noop", unique_key="\t")
    with pytest.raises(InvalidJobOptions, match="lock_key"):
        Job.objects.enqueue_many("testproject.testjobs.noop", [{}], lock_key="A")  # type: ignore[arg-type]
    assert not Job.objects.exists()


# -- registered tasks only, and the registry -----------------------------------------------------


def test_a_worker_leaves_jobs_of_tasks_it_does_not_know_queued(workers: Workers) -> None:
    unknown = make_job(task="newcode.jobs.send_invoice")
    known = make_job()
    workers.burst()
    assert job_row(known)["status"] == "done"
    row = job_row(unknown)
    assert (row["status"], row["attempts"], row["last_error"]) == ("queued", 0, None)
    # With the switch off, today's behaviour: claimed, and failed as unknown.
    workers.burst("--claim-unregistered", "--max-jobs", "1")
    row = job_row(unknown)
    assert row["attempts"] == 1
    assert "Unknown task 'newcode.jobs.send_invoice'" in row["last_error"]


def test_the_registry_holds_live_workers_and_forgets_them(workers: Workers) -> None:
    worker = workers.start("--queue", "a=2", "--queue", "b", "--poll-interval", "1")
    rows = wait_until(lambda: query(dashboard.LIVE_WORKERS), message="the worker's registry row")
    worker_id, host, pid, mode, queues, tasks, version, _started_at, beat = rows[0]
    assert (pid, mode, json.loads(queues)) == (worker.pid, "lease", {"a": 2, "b": None})
    assert (host, version) == (socket.gethostname(), django_pgjobs.__version__)
    assert str(pid) in worker_id
    assert "testproject.testjobs.noop" in tasks
    # Refreshed on its tick (one second).
    wait_until(
        lambda: query(dashboard.LIVE_WORKERS)[0][8] > beat, message="the registry row's next beat"
    )
    # A job of a task no live worker knows is listed, per task; an unserved queue too.
    make_job(task="newcode.jobs.send_invoice", queue="a")
    make_job(queue="nobody")
    assert query(dashboard.UNRUNNABLE) == [
        ("a", "newcode.jobs.send_invoice", 1, True),
        ("nobody", "testproject.testjobs.noop", 1, False),
    ]
    # A clean exit deletes the row.
    worker.send(signal.SIGTERM)
    assert worker.wait() == 0
    assert query(dashboard.LIVE_WORKERS) == []
    # A row that stopped heartbeating is cleared by the reaper.
    with connection.cursor() as cursor:
        cursor.execute(upkeep.WORKER_BEAT, worker_record("gone:1", {}, None, timedelta(seconds=-1)))
    assert scalar("SELECT count(*) FROM pgjobs_worker") == 1
    Job.objects.reap()
    assert scalar("SELECT count(*) FROM pgjobs_worker") == 0
