"""A worker's stuck jobs: those that ran past their timeout and would not stop.

Python cannot kill a thread, so an executor whose job runs past its timeout is abandoned to it
(a new one takes its slot), and an async job whose task caught its timeout's cancel keeps its
slot of the event loop. Past ``PGJOBS["MAX_STUCK_EXECUTORS"]`` of them, or once a job blocks
the event loop itself, the process is leaking threads or loop slots (and maybe connections
and locks), and only a restart frees them: the worker stops, and runjobs exits with
``EXIT_STUCK``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence

from django_pgjobs.worker.executor import Executor
from django_pgjobs.worker.loop import EventLoop

logger = logging.getLogger("django_pgjobs.worker")

# runjobs's exit status once more than PGJOBS["MAX_STUCK_EXECUTORS"] executor threads are
# stuck in jobs past their timeout (EX_TEMPFAIL: start a fresh process).
EXIT_STUCK = 75
# Seconds the event loop may leave unanswered the ping sent after an async job's timeout
# cancelled its task, before the worker takes the loop for blocked and exits with EXIT_STUCK.
LOOP_STUCK_AFTER = 10.0


class StuckJobs:
    """Counts the stuck jobs of the worker ``worker_id`` (its ``executors``, and the async
    jobs it marks ``cancelled()``), and calls ``stop`` once too many are stuck or the event
    loop is blocked. The marks are kept under ``lock``, the worker's."""

    def __init__(
        self,
        worker_id: str,
        max_stuck: int,
        executors: Sequence[Executor],
        lock: threading.Lock,
        stop: Callable[[], None],
    ) -> None:
        self.worker_id = worker_id
        self.max_stuck = max_stuck
        self._executors = executors
        self._lock = lock
        self._stop = stop
        # Set once too many executors are stuck in jobs past their timeout: runjobs then
        # exits with EXIT_STUCK so that its supervisor starts a clean process.
        self.stuck = False
        # The async jobs on the loop past their timeout, by (id, attempt): -> when it was
        # seen (monotonic). One still running LOOP_STUCK_AFTER later caught the cancel and
        # went on, holding its slot of the loop: stuck, like an abandoned thread.
        self.timed_out: dict[tuple[int, int], float] = {}

    def cancelled(self, attempt: tuple[int, int], on_loop: Collection[tuple[int, int]]) -> None:
        """An async job's timeout cancelled its task: mark it, if its task still runs (one of
        ``on_loop``, read under the lock)."""
        with self._lock:
            # Only while its task runs: the cancel went out before this call, and a task
            # that heeded it may have ended already.
            if attempt in on_loop:
                self.timed_out[attempt] = time.monotonic()

    def ended(self, attempt: tuple[int, int]) -> None:
        """An async job's task ended: it is stuck no more."""
        with self._lock:
            self.timed_out.pop(attempt, None)

    def count(self) -> int:
        return sum(self.parts())

    def parts(self) -> tuple[int, int]:
        """Abandoned executor threads still alive (stuck in a job past its timeout), and
        async jobs still running ``LOOP_STUCK_AFTER`` after their timeout cancelled them."""
        late = time.monotonic() - LOOP_STUCK_AFTER
        with self._lock:
            cancelled = list(self.timed_out.values())
        threads = sum(e.abandoned and e.is_alive() for e in self._executors)
        return threads, sum(at < late for at in cancelled)

    def look(self, loop: EventLoop) -> None:
        """The producer's tick: is the event loop blocked, or an async job past its cancel?"""
        if loop.unanswered() > LOOP_STUCK_AFTER:
            self.loop_stuck(loop)
        elif self.timed_out:
            self.check()

    def check(self) -> None:
        """Past ``max_stuck`` jobs stuck beyond their timeout (``parts()``), stop: the
        process is leaking threads or loop slots (and maybe connections and locks), and only
        a restart frees them."""
        threads, tasks = self.parts()
        if threads + tasks > self.max_stuck and not self.stuck:
            self.stuck = True
            logger.error(
                "worker %s has %s stuck in jobs that ran past their timeout "
                "(PGJOBS['MAX_STUCK_EXECUTORS'] is %s): stopping claims and exiting with "
                "status %s so that a fresh process replaces this one",
                self.worker_id,
                " and ".join(
                    f"{count} {what}"
                    for count, what in (
                        (threads, "executor threads"),
                        (tasks, "async jobs' tasks (they caught their cancel)"),
                    )
                    if count
                ),
                self.max_stuck,
                EXIT_STUCK,
                extra={"action": "shutdown", "worker_id": self.worker_id},
            )
            self._stop()

    def loop_stuck(self, loop: EventLoop) -> None:
        """The event loop left the ping after a timeout's cancel unanswered too long: a job
        blocks it, and every async job of this worker is frozen behind it (their heartbeats
        go on, from the completer). A loop cannot be replaced like an executor, as its other
        tasks live on it: stop, as past ``max_stuck`` stuck executors, so that a fresh
        process takes over. The frozen jobs' leases are ended on the way out."""
        if self.stuck:
            return
        self.stuck = True
        logger.error(
            "worker %s: its event loop has not run for %.0f s after an async job's timeout "
            "cancelled its task (an async job blocks it: it computes, or calls blocking code); "
            "stopping claims and exiting with status %s so that a fresh process replaces this "
            "one",
            self.worker_id,
            loop.unanswered(),
            EXIT_STUCK,
            extra={"action": "shutdown", "worker_id": self.worker_id},
        )
        self._stop()
