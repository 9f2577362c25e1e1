"""Lease mode: the claim commits at once, the job runs outside any transaction, and its
outcome is written afterwards by the completer, fenced on the claim.

The producer claims a batch and hands each job to an executor; an executor runs it while the
completer keeps its lease alive, then passes the outcome to the completer.
"""

from __future__ import annotations

import logging

from django_pgjobs.lifecycle import ClaimedJob
from django_pgjobs.worker.completer import Completer
from django_pgjobs.worker.db import reset_all, tidy
from django_pgjobs.worker.executor import Shared, call, context
from django_pgjobs.worker.outcomes import RELEASE, Outcome

logger = logging.getLogger("django_pgjobs.worker")


class LeaseMode:
    def __init__(self, shared: Shared, completer: Completer) -> None:
        self.store, self.lease, self.worker_id = shared.store, shared.lease, shared.worker_id
        self.stats, self.stopping, self.hand_out = shared.stats, shared.stopping, shared.hand_out
        self.completer = completer

    def dispatch(self, queue_name: str, wanted: int) -> int:
        """Claim up to ``wanted`` jobs of ``queue_name`` and hand them out; return how many.

        Jobs of a claim that returns after stop was requested are given back instead, not
        started and their attempt not counted. The decision is taken here, as the claim
        returns, not when an executor picks a job up: a job handed out before the stop runs
        however late its executor thread gets to it.
        """
        jobs = self.store.claim(queue_name, wanted, self.lease, self.worker_id)
        self.completer.hold(jobs)
        if self.stopping.is_set():
            for job in jobs:
                self.completer.record(Outcome(job, RELEASE))
        else:
            self.hand_out(*jobs)
        return len(jobs)

    def execute(self, job: ClaimedJob) -> None:
        ctx = context(job)
        self.completer.track(job, ctx)
        try:
            # No tidy() first: the previous job's tidy() (or reset_all()) left this thread's
            # connections usable, and a new thread has none yet.
            outcome = call(job, ctx, self.store.alias)
        finally:
            self.completer.untrack(job)
        if outcome.outage:
            reset_all()
        else:
            tidy()
        if ctx.lost:
            self.stats.add("lost")
            logger.warning(
                "job %s %s attempt %s lost its lease while running; outcome not recorded",
                job.id,
                job.task,
                job.attempts,
                extra={"action": "extend_lease", "job_id": job.id, "attempts": job.attempts},
            )
            return
        self.completer.record(outcome)
