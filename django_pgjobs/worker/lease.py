"""Lease mode: the claim commits at once, the job runs outside any transaction, and its
outcome is written afterwards by the completer, fenced on the claim.

The producer claims a batch and hands each job to an executor; an executor runs it while the
completer keeps its lease alive, then passes the outcome to the completer.

A job claimed with ``crashes`` > 0 (its last attempt ended with its worker dead) is a
suspect: it may be what killed that worker. It runs alone: only an idle worker (nothing of
its own claimed and not yet written) claims suspects at all, one job at a time, and once it has
one it claims nothing more until the suspect's outcome is written. So if it kills this worker
too, the crash is counted against it alone, and the jobs that merely ran beside it the first
time clear their own count with their next attempt. A suspect never shares a claim, so nothing
is given back for it (a release would lose the unique key the claim gave up). The price: under
constant load a suspect waits ``queued`` until some worker drains.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import psycopg
from django.db import DatabaseError

from django_pgjobs.core import execute
from django_pgjobs.core.context import JobContext
from django_pgjobs.core.types import Action, ClaimedJob, Outcome
from django_pgjobs.exceptions import InvalidResult
from django_pgjobs.worker.completer import Completer
from django_pgjobs.worker.db import reset_all, tidy, tidy_opened, unavailable
from django_pgjobs.worker.executor import Shared, acall, call, context
from django_pgjobs.worker.outcomes import announce

logger = logging.getLogger("django_pgjobs.worker")


class LeaseMode:
    def __init__(self, shared: Shared, completer: Completer) -> None:
        self.store, self.lease, self.worker_id = shared.store, shared.lease, shared.worker_id
        self.stats, self.stopping, self.hand_out = shared.stats, shared.stopping, shared.hand_out
        self.metrics = shared.metrics
        self.completer = completer
        # The suspect running alone, until its outcome is written.
        self.solo: ClaimedJob | None = None
        # The queues whose latest claim, made while busy, left suspects out.
        self.skipped: set[str] = set()

    def dispatch(
        self,
        queue_name: str,
        wanted: int,
        guarded: bool = False,
        tasks: execute.TextArray | None = None,
    ) -> int:
        """Claim up to ``wanted`` jobs of ``queue_name`` and hand them out; return how many.
        ``guarded``: through the guarded claim (the queue has a limit, or jobs with lock keys).
        ``tasks``: only jobs of these tasks (the worker's sync or async ones, when only the
        executors or only the event loop have room).

        Jobs of a claim that returns after stop was requested are given back instead, not
        started and their attempt not counted. The decision is taken here, as the claim
        returns, not when an executor picks a job up: a job handed out before the stop runs
        however late its executor thread gets to it. An idle worker's claim may take a
        suspect first, which then runs alone; otherwise the rest of its batch, without
        suspects, comes in the same statement (``claim.CLAIM_IDLE``). The guarded claim does
        the same in two statements: one job first, then the rest.
        """
        if self.completer.holds_any():
            return self._claim(queue_name, wanted, suspects=False, guarded=guarded, tasks=tasks)
        self.skipped.discard(queue_name)
        if not guarded and wanted > 1:
            return self._claim(queue_name, wanted, suspects=True, idle=True, tasks=tasks)
        first = self._claim(queue_name, 1, suspects=True, guarded=guarded, tasks=tasks)
        if not first or self.solo is not None or wanted == 1 or self.stopping.is_set():
            return first
        return first + self._claim(
            queue_name, wanted - 1, suspects=False, guarded=guarded, tasks=tasks
        )

    def _claim(
        self,
        queue_name: str,
        wanted: int,
        *,
        suspects: bool,
        guarded: bool = False,
        idle: bool = False,
        tasks: execute.TextArray | None = None,
    ) -> int:
        riding = [] if suspects or guarded else self.completer.take_completions()
        if riding:
            jobs = self._claim_completing(queue_name, wanted, riding, tasks)
        else:
            jobs = self.store.claim(
                queue_name,
                wanted,
                self.lease,
                self.worker_id,
                suspects=suspects,
                guarded=guarded,
                idle=idle,
                tasks=tasks,
            )
        if not suspects or (idle and jobs and not any(job.crashes for job in jobs)):
            # Suspects were (or may have been) left out of this claim.
            self.skipped.add(queue_name)
        self.completer.hold(jobs)
        if self.stopping.is_set():
            for job in jobs:
                self.completer.record(Outcome(job, Action.RELEASE))
            return len(jobs)
        for job in jobs:
            if job.crashes > 0:
                logger.info(
                    "job %s %s attempt %s: its last attempt ended with its worker dead (%s "
                    "time(s) in a row); running it alone",
                    job.id,
                    job.task,
                    job.attempts,
                    job.crashes,
                    extra={"action": "claim", "job_id": job.id, "worker_id": self.worker_id},
                )
                self.solo = job
        self.hand_out(*jobs)
        return len(jobs)

    def _claim_completing(
        self, queue_name: str, wanted: int, riding: list[Outcome], tasks: execute.TextArray | None
    ) -> list[ClaimedJob]:
        """The busy claim, with the completer's waiting completions written in its statement
        (``claim.CLAIM_COMPLETING``). If the statement fails they go back to the completer,
        unwritten (it is one transaction); a failure that is not an outage may be theirs (a
        result the database refuses), so the claim is made again without them, and the
        completer writes them, one by one if need be, never with a claim again."""
        try:
            jobs, done = self.store.claim_completing(
                queue_name,
                wanted,
                self.lease,
                self.worker_id,
                [o.job for o in riding],
                {o.job.id: o.result for o in riding},
                tasks=tasks,
            )
        except BaseException as exc:
            # The statement failed (or was never sent): nothing of it was written. Only a
            # database's error that is not an outage is ours to get past, with a plain claim.
            refused = isinstance(exc, (DatabaseError, psycopg.Error, InvalidResult))
            outage = refused and unavailable(exc)
            self.completer.give_back(riding, rides=outage)
            if outage or not refused:
                raise
            logger.warning(
                "claiming with %s completions failed (%s); claiming without them",
                len(riding),
                exc,
                extra={"action": "claim", "queue": queue_name, "worker_id": self.worker_id},
            )
            return self.store.claim(
                queue_name, wanted, self.lease, self.worker_id, suspects=False, tasks=tasks
            )
        self.completer.completed(riding, done)
        return jobs

    def passed_over(self) -> bool:
        """Whether a claim made while busy left suspects out, and the worker is idle now: the
        next claim may take them (a burst must make it before it ends)."""
        return bool(self.skipped) and not self.completer.holds_any()

    def isolating(self) -> bool:
        """Whether a suspect runs alone (the producer claims nothing then): until its outcome
        is in the table, or its lease was lost."""
        if self.solo is not None and not self.completer.holds(self.solo):
            self.solo = None
        return self.solo is not None

    def execute(self, job: ClaimedJob) -> None:
        if not self.completer.holds(job):
            # Cancelled (or its lease lost) before an executor got to it: it is not ours.
            return
        ctx = context(job)
        self.completer.track(job, ctx)
        try:
            # No tidy() first: the previous job's tidy(), tidy_opened() or reset_all() left
            # this thread's connections usable (but for the one case tidy_opened() names),
            # and a new thread has none yet.
            outcome = call(job, ctx, self.store.alias)
        finally:
            self.completer.untrack(job)
        if outcome.outage:
            reset_all()
        elif outcome.error is None:
            tidy_opened()
        else:
            tidy()
        self._finish(job, ctx, outcome)

    async def aexecute(self, job: ClaimedJob, slots: asyncio.Semaphore) -> None:
        """``execute()`` for an ``async def`` job, on the worker's event loop, once one of
        its ``slots`` is free: the same heartbeat, timeout and fence; what stops a sync job's
        attempt (a timeout, a cancel, a lost lease) also cancels this job's task.

        A claim takes no more async jobs than the loop has free slots, but a slot may free
        later than its job was counted done (a task finishing its cancel): a job waiting for
        one is heartbeated already, so its lease holds, and a cancel meanwhile means it never
        starts."""
        if not self.completer.holds(job):
            return
        ctx = context(job)
        self.completer.track(job, ctx, timed=False)
        try:
            async with slots:
                if not self.completer.holds(job):
                    return
                ctx.on_stop = _canceller()
                if ctx.should_stop:
                    # Cancelled (or its lease lost) after the look above, before the
                    # canceller was in place: that stop cancelled nothing, so heed it here.
                    return
                # Its timeout starts now.
                self.completer.track(job, ctx)
                outcome = await acall(job, ctx, self.store.alias)
        finally:
            self.completer.untrack(job)
        self._finish(job, ctx, outcome)

    def _finish(self, job: ClaimedJob, ctx: JobContext, outcome: Outcome) -> None:
        """Hand the outcome to the completer, unless the attempt was taken from us."""
        if ctx.timed_out:
            # Its JobTimeout failure is already written, its slot already given to another
            # executor: what it did now is too late to count.
            self._not_recorded(job, logging.WARNING, "returned after its timeout", "fail")
            return
        # Taken from us while it ran: nothing is written, so the attempt ends here.
        if ctx.cancelled:
            self.stats.add("cancelled")
            self._not_recorded(job, logging.INFO, "was cancelled while running", "cancel")
            announce(outcome, "cancelled", self.metrics)
            return
        if ctx.lost:
            self.stats.add("lost")
            self._not_recorded(job, logging.WARNING, "lost its lease while running", "extend_lease")
            announce(outcome, "lost", self.metrics)
            return
        self.completer.record(outcome)

    def _not_recorded(self, job: ClaimedJob, level: int, what: str, action: str) -> None:
        """The log line of a job whose function returned but whose outcome is not written."""
        logger.log(
            level,
            "job %s %s attempt %s %s; outcome not recorded",
            job.id,
            job.task,
            job.attempts,
            what,
            extra={
                "action": action,
                "job_id": job.id,
                "task": job.task,
                "queue": job.queue,
                "attempts": job.attempts,
                "worker_id": self.worker_id,
            },
        )


def _canceller() -> Callable[[], None]:
    """What cancels the running asyncio task, from any thread (the completer's)."""
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    if task is None:
        raise RuntimeError("an async job runs in an asyncio task")
    cancel = task.cancel

    def stop() -> None:
        loop.call_soon_threadsafe(cancel)

    return stop
