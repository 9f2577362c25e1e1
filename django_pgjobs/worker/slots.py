"""A worker's slots: how many jobs it runs at once, and so how many its next claim may take.

Each queue given as ``NAME=N`` runs in N executor slots of its own; the other queues share the
worker's ``concurrency`` (the pool ``SHARED``). ``async def`` jobs run on one event-loop
thread, up to ``async_concurrency`` at once, apart from the executor threads' slots (a queue
with a limit of its own still counts them). A job takes its slot when it is handed out and
gives it back when it ends.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from django_pgjobs.core import execute

# The slots of the queues that share the worker's --concurrency.
SHARED = ""


class Slots:
    """The slots of one worker's pools and of its event loop (if it has one), and how many of
    each its running jobs take. Every count is kept under ``lock``, the worker's."""

    def __init__(
        self,
        limits: Mapping[str, int | None],
        concurrency: int,
        async_concurrency: int,
        lock: threading.Lock,
    ) -> None:
        # Slots per pool: one per queue with its own limit, one shared by the others.
        self._size = {q: n for q, n in limits.items() if n is not None}
        if None in limits.values():
            self._size[SHARED] = concurrency
        self._busy = dict.fromkeys(self._size, 0)
        self._async_concurrency = async_concurrency
        self._lock = lock
        self._has_loop = False
        # Whether the latest claim that found jobs found async ones: only then (or while the
        # loop runs some) does a worker whose executors are all busy claim async jobs alone,
        # so a worker whose queues hold only sync jobs claims as if it had no loop.
        self._async_seen = False
        self._sync_tasks: execute.TextArray | None = None
        self._async_tasks: execute.TextArray | None = None
        # The jobs handed out and not yet ended.
        self.inflight = 0
        # The async jobs handed to the loop whose task has not ended, by (id, attempt): how
        # many, the loop's slots taken (counted at hand-out).
        self.on_loop: set[tuple[int, int]] = set()
        # Set when the next claim may find what the last one could not: a slot freed in a
        # pool that was full (its queues were not asked), or an outcome written while some
        # queue is guarded (the finished job's place under a limit, or its key, is free).
        self.freed = False

    @property
    def executors(self) -> int:
        """How many executor threads the pools take, one a slot."""
        return sum(self._size.values())

    def use_loop(self, sync_tasks: execute.TextArray, async_tasks: execute.TextArray) -> None:
        """Count the event loop's slots from now on. The tasks of each side are for a claim
        when only the executors or only the loop have room."""
        self._sync_tasks = sync_tasks
        self._async_tasks = async_tasks
        self._has_loop = True

    def pool(self, queue_name: str) -> str:
        """The slots a queue's jobs run in: its own, or the shared ones."""
        return queue_name if queue_name in self._size else SHARED

    def free(self) -> int:
        """How many jobs the next round may claim, over every pool (``room()``)."""
        return sum(self.room(pool)[0] for pool in self._size)

    def room(self, pool: str) -> tuple[int, execute.TextArray | None]:
        """How many jobs a claim for a queue of ``pool`` may take, and of which tasks (None:
        any the worker claims).

        A claim cannot choose how many of its jobs are sync and how many async, so with an
        event loop it takes no more than both the pool's executor slots and the loop have
        free: whatever the mix, no job waits for room, leased but not running. When only
        one side has room, the claim takes only that side's tasks (the loop's only while
        the latest claims found async jobs, or the loop runs some: a worker whose queues
        hold sync jobs only claims as it would without a loop). An async job under a
        queue's own slots takes one of them as well as one of the loop's."""
        with self._lock:
            threads = self._size[pool] - self._busy[pool]
            if not self._has_loop:
                return threads, None
            loop = self._async_concurrency - len(self.on_loop)
            async_likely = self._async_seen or bool(self.on_loop)
        if threads > 0 and loop > 0:
            return min(threads, loop), None
        if threads > 0:
            return threads, self._sync_tasks
        if loop > 0 and async_likely and pool == SHARED:
            return loop, self._async_tasks
        return 0, None

    def take(self, on_threads: Sequence[Any], on_loop: Sequence[Any]) -> None:
        """Count the slots of the jobs handed out: those for the executors, and those for
        the loop."""
        with self._lock:
            self.inflight += len(on_threads) + len(on_loop)
            for item in on_threads:
                self._busy[self.pool(item.queue)] += 1
            if on_threads or on_loop:
                self._async_seen = bool(on_loop)
            self.on_loop.update((item.id, item.attempts) for item in on_loop)
            for item in on_loop:
                # Under a queue's own limit an async job takes one of its slots too.
                pool = self.pool(item.queue)
                if pool != SHARED:
                    self._busy[pool] += 1

    def thread_done(self, item: Any) -> None:
        """An executor's job ended: give back its slot."""
        pool = self.pool(item.queue)
        with self._lock:
            self.inflight -= 1
            if self._busy[pool] == self._size[pool]:
                # Its queues were passed over while the pool was full.
                self.freed = True
            self._busy[pool] -= 1

    def loop_done(self, job: Any) -> None:
        """An async job's task ended: give back its slot of the loop, and of its queue's own
        slots if it has them."""
        pool = self.pool(job.queue)
        with self._lock:
            self.inflight -= 1
            if len(self.on_loop) == self._async_concurrency:
                # The loop was full: its slot freed, its queues may be claimed again.
                self.freed = True
            self.on_loop.discard((job.id, job.attempts))
            if pool != SHARED:
                if self._busy[pool] == self._size[pool]:
                    self.freed = True
                self._busy[pool] -= 1
