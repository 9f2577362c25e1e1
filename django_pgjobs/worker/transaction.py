"""Transaction mode: claim, run and complete one job in a single transaction.

The producer hands out tickets ("claim one job of this queue and run it"); an executor opens
a transaction on its own connection, claims one job in it, runs the job in a savepoint
(rolled back if the job fails or snoozes) and writes the outcome before committing. A crash
rolls the claim back with everything else, so no lease is needed to recover it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from django.db import DatabaseError, transaction

from django_pgjobs.core import finish
from django_pgjobs.core.types import Action, ClaimedJob, Outcome
from django_pgjobs.worker.db import reset, tidy, unavailable
from django_pgjobs.worker.executor import Shared, call, context, timed_out
from django_pgjobs.worker.outcomes import finished
from django_pgjobs.worker.store import Store


def past_timeout(outcome: Outcome) -> bool:
    """Whether the job returned after its timeout (nothing could stop it sooner here)."""
    timeout = outcome.job.timeout
    return timeout is not None and outcome.duration > timeout


def run_claimed(job: ClaimedJob, alias: str) -> Outcome:
    """Run a claimed job in a savepoint of the open transaction on ``alias``; its outcome.

    What the job wrote is rolled back when it fails or snoozes, and a job that returned after
    its timeout failed (nothing could stop it while it ran: it holds its row's lock in this
    transaction). Shared with ``django_pgjobs.testing.run_jobs``, which runs jobs the same way
    inside a test's transaction."""
    with transaction.atomic(using=alias):
        outcome = call(job, context(job), alias)
        if outcome.action != Action.RELEASE and past_timeout(outcome):
            outcome = timed_out(outcome.job, outcome.duration)
        # A snooze is "not now": the job's writes go, as a failure's do.
        if outcome.failure or outcome.action == Action.SNOOZE:
            transaction.set_rollback(True, using=alias)
    return outcome


def record(store: Store, outcome: Outcome) -> str | None:
    """Write a completed, failed or snoozed job's outcome through the fenced statements; the
    job's new status, or None when the fence refused the write (the job is no longer ours)."""
    return finish.write(store, outcome.action, [outcome]).get(outcome.job.id)


@dataclass
class Ticket:
    """ "Claim one job of ``queue`` and run it"; ``claimed`` says how the claim went."""

    queue: str
    claimed: threading.Event = field(default_factory=threading.Event)
    found: bool = False
    unavailable: BaseException | None = None


class TransactionMode:
    def __init__(self, shared: Shared, on_retry: Callable[[], None] | None = None) -> None:
        self.store, self.lease, self.worker_id = shared.store, shared.lease, shared.worker_id
        self.stats, self.stopping, self.hand_out = shared.stats, shared.stopping, shared.hand_out
        self.metrics = shared.metrics
        # Called when a failed job is queued again: its retry sends no NOTIFY.
        self.on_retry = on_retry

    def dispatch(self, queue_name: str, wanted: int, guarded: bool = False) -> int:
        """Hand out ``wanted`` tickets and wait until each has claimed (or found nothing).

        Always the plain claim, whatever ``guarded`` says: a job running in its claim's
        transaction is ``running`` to no one else, so no other claim could count it against a
        limit or a lock key. Jobs with a lock key and the jobs of a limited queue are left to
        lease-mode workers."""
        tickets = [Ticket(queue_name) for _ in range(wanted)]
        self.hand_out(*tickets)
        for ticket in tickets:
            ticket.claimed.wait()
        for ticket in tickets:
            if ticket.unavailable is not None:
                raise ticket.unavailable
        return sum(ticket.found for ticket in tickets)

    def execute(self, ticket: Ticket) -> None:
        if self.stopping.is_set():
            ticket.claimed.set()
            return
        alias = self.store.alias
        tidy()
        try:
            with transaction.atomic(using=alias):
                jobs = self.store.claim(ticket.queue, 1, self.lease, self.worker_id)
                ticket.found = bool(jobs)
                ticket.claimed.set()
                if not jobs:
                    return
                outcome = run_claimed(jobs[0], alias)
                if outcome.action == Action.RELEASE:
                    # Roll the claim back with the rest: the attempt is not counted.
                    transaction.set_rollback(True, using=alias)
                    return
                status = record(self.store, outcome)
        except DatabaseError as exc:
            if not unavailable(exc):
                raise
            ticket.unavailable = exc
            ticket.claimed.set()
            reset(alias)
            return
        finally:
            ticket.claimed.set()
        finished(outcome, status, stats=self.stats, worker_id=self.worker_id, metrics=self.metrics)
        if status == "queued" and self.on_retry is not None:
            self.on_retry()
