"""The event loop: one thread per worker process that runs its ``async def`` jobs.

A lease-mode worker that has async jobs registered starts one thread running an asyncio
event loop. The producer hands it each claimed job whose task is an ``async def`` one (the
others go to the executor threads); the loop runs each as a task of its own, at most
``concurrency`` at once, so thousands of jobs waiting on I/O need no thread each. A job is
counted from the moment it is submitted, not when its task starts: a shutdown that waits for
the loop's jobs waits for those not yet started too.

The job's heartbeat, timeout, cancel and outcome are the lease mode's (``LeaseMode.aexecute``):
the completer extends the lease and writes the fenced outcome exactly as for a sync job, and
what stops an attempt cancels the job's task.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

from asgiref.sync import sync_to_async

from django_pgjobs.core.types import ClaimedJob
from django_pgjobs.worker.db import mark_async_jobs_thread, reset_all
from django_pgjobs.worker.lease import LeaseMode

logger = logging.getLogger("django_pgjobs.worker")


class EventLoop(threading.Thread):
    """Runs submitted async jobs as tasks until ``close()``; ``on_done`` is called (on this
    thread) with each job once its task has ended."""

    def __init__(
        self, mode: LeaseMode, concurrency: int, on_done: Callable[[ClaimedJob], None]
    ) -> None:
        super().__init__(name="pgjobs-event-loop", daemon=True)
        self.mode = mode
        self.on_done = on_done
        self.loop = asyncio.new_event_loop()
        self._slots = asyncio.Semaphore(concurrency)
        # The tasks running or waiting for a slot (the loop keeps only weak references).
        self._tasks: set[asyncio.Task[None]] = set()
        # When the oldest ping() not yet answered by the loop was sent (None: all answered).
        self._pinged: float | None = None

    def run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            # Before any job: the async jobs' ORM calls run on that thread, and a connection
            # it opens again is how an outage met inside atomic() shows (worker.db).
            self.loop.run_until_complete(sync_to_async(mark_async_jobs_thread)())
            self.loop.run_forever()
        finally:
            self.loop.close()

    def submit(self, job: ClaimedJob) -> None:
        """Run ``job`` on the loop (called from the producer's thread)."""
        self.loop.call_soon_threadsafe(self._start, job)

    def ping(self) -> None:
        """Ask the loop to answer as soon as it runs (called after a cancel was sent to one of
        its tasks: the answer comes after the cancel was delivered)."""
        if self._pinged is None:
            self._pinged = time.monotonic()
            self.loop.call_soon_threadsafe(self._answer)

    def unanswered(self) -> float:
        """For how many seconds the loop has left a ping unanswered (0: none waits). A loop
        that does not answer is blocked: a job of its own computes, or calls blocking code,
        and no other async job moves meanwhile."""
        pinged = self._pinged
        return 0.0 if pinged is None else time.monotonic() - pinged

    def _answer(self) -> None:
        self._pinged = None

    def close(self) -> None:
        """Stop the loop once its jobs have ended (the worker waited for them, or gave up
        waiting: their leases are ended and the process exits)."""
        if self.is_alive():
            # The async jobs' ORM calls ran on asgiref's sync_to_async thread, one per
            # process, which outlives the worker: close the connections they opened there.
            closing = asyncio.run_coroutine_threadsafe(sync_to_async(reset_all)(), self.loop)
            try:
                closing.result(timeout=5.0)
            except Exception:
                logger.warning(
                    "could not close the async jobs' database connections",
                    exc_info=True,
                    extra={"action": "shutdown"},
                )
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.join(timeout=5.0)

    def _start(self, job: ClaimedJob) -> None:
        task = self.loop.create_task(self._run(job), name=f"pgjobs-job-{job.id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, job: ClaimedJob) -> None:
        try:
            await self.mode.aexecute(job, self._slots)
        except BaseException:
            # Our own bug or an unexpected database error (the job's own errors are its
            # outcome): the job's lease and the reaper recover it; the loop must live on.
            logger.exception("event loop error on job %s", job.id, extra={"action": "execute"})
        finally:
            self.on_done(job)
