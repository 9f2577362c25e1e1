"""explain() and the claim agree: over a table of generated job, queue and worker states, a job
is claimed exactly when explain() says nothing holds it back.

Each state is written in a savepoint that is rolled back after it, so the states share one
test transaction (and its frozen ``now()``). The claim is the fleet's as the state has it:
each live worker that serves the queue claims for its registered tasks as a busy worker does
(suspects wait for an idle one, as explain() says): first the plain claim, then its outlook,
and, in lease mode, the guarded claim when the outlook names the queue guarded. A reason other
than "next" or "ahead" (jobs before it, which a claim of ten takes along) is a hold.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.db import connection, transaction
from django.test import TestCase

from django_pgjobs.core import claim, execute, upkeep
from django_pgjobs.core.execute import TextArray
from django_pgjobs.ops.explain import explain
from tests.helpers import make_job, worker_record

QUEUE = "agree"
TASK = "testproject.testjobs.noop"
OTHER_TASK = "testproject.testjobs.sleep"
NOT_HOLDS = {"next", "ahead"}


@dataclass(frozen=True)
class State:
    due: bool
    lock_key: bool
    key_held: bool
    suspect: bool
    queue: str  # "none", "paused", "full", "room", "rate_full", "rate_room"
    worker: str  # "none", "lease", "lease_other_task", "transaction", "other_queue"
    earlier: bool  # another ready job of the queue comes before it
    sibling: bool  # a ready job with the same lock key comes before it (only with a key)


def states() -> list[State]:
    every = itertools.product(
        (True, False),
        (True, False),
        (True, False),
        (True, False),
        ("none", "paused", "full", "room", "rate_full", "rate_room"),
        ("none", "lease", "lease_other_task", "transaction", "other_queue"),
        (True, False),
        (True, False),
    )
    # A key can only be held, or shared with a sibling, when the job has one.
    return [State(*values) for values in every if values[1] or not (values[2] or values[7])]


def write(state: State) -> int:
    if state.queue != "none":
        concurrency = {"full": 1, "room": 5}.get(state.queue)
        rate = {"rate_full": 1, "rate_room": 5}.get(state.queue)
        with connection.cursor() as cursor:
            cursor.execute(
                "INSERT INTO pgjobs_queue (name, paused, concurrency, rate_count, rate_period, "
                "starts, updated_at) VALUES (%s, %s, %s, %s, %s, "
                "ARRAY[statement_timestamp() - interval '1 second']::timestamptz[], now())",
                [
                    QUEUE,
                    state.queue == "paused",
                    concurrency,
                    rate,
                    timedelta(minutes=1) if rate else None,
                ],
            )
    if state.queue in ("full", "room"):
        make_job(queue=QUEUE, status="running", attempts=1, locked_until=timedelta(minutes=5))
    if state.key_held:
        keyed(
            make_job(
                queue="elsewhere", status="running", attempts=1, locked_until=timedelta(minutes=5)
            )
        )
    if state.earlier:
        make_job(queue=QUEUE, priority=5)
    if state.sibling:
        keyed(make_job(queue=QUEUE, priority=3))
    if state.worker != "none":
        served = "elsewhere" if state.worker == "other_queue" else QUEUE
        tasks = [OTHER_TASK] if state.worker == "lease_other_task" else [TASK]
        record = worker_record(state.worker, {served: None}, tasks)
        if state.worker == "transaction":
            record["mode"] = "transaction"
        execute.run(connection, upkeep.WORKER_BEAT, record)
    job = make_job(queue=QUEUE, run_at=timedelta(0) if state.due else timedelta(hours=1))
    if state.lock_key:
        keyed(job)
    if state.suspect:
        with connection.cursor() as cursor:
            cursor.execute("UPDATE pgjobs_job SET crashes = 1 WHERE id = %s", [job])
    return job


def keyed(job: int) -> None:
    with connection.cursor() as cursor:
        cursor.execute("UPDATE pgjobs_job SET lock_key = 'k' WHERE id = %s", [job])


def claimed(state: State) -> set[int]:
    """The ids the state's live workers claim, as each would."""
    if state.worker in ("none", "other_queue"):
        return set()
    tasks = [OTHER_TASK] if state.worker == "lease_other_task" else [TASK]
    common: dict[str, Any] = {
        "queue": QUEUE,
        "limit": 10,
        "lease": timedelta(minutes=5),
        "worker_id": state.worker,
        "synchronous_commit": None,
        "suspects": False,
        "tasks": TextArray.of(tasks),
    }
    jobs = claim.claim(connection, **common)
    guarded = QUEUE in claim.outlook(connection, [QUEUE]).guarded
    if guarded and state.worker != "transaction":
        jobs += claim.claim(connection, guarded=True, **common)
    return {job.id for job in jobs}


class ExplainAgreesWithTheClaim(TestCase):
    def test_a_job_is_claimed_exactly_when_nothing_holds_it(self) -> None:
        checked = {True: 0, False: 0}
        for state in states():
            with self.subTest(state=state), transaction.atomic():
                job = write(state)
                codes = {reason.code for reason in explain(job)}
                free = codes <= NOT_HOLDS
                taken = job in claimed(state)
                self.assertEqual(
                    taken, free, f"explain() says {sorted(codes)}; the claim took it: {taken}"
                )
                checked[free] += 1
                transaction.set_rollback(True)
        # The table has states of both kinds, so the agreement was tested both ways.
        self.assertGreater(checked[True], 10)
        self.assertGreater(checked[False], 100)
