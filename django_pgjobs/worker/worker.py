"""The worker process: its producer loop, and how it starts and stops.

The producer (the thread that calls ``run()``) waits for a reason to look at the table (a
NOTIFY, the fallback poll, a freed executor slot while the queue may hold more) and claims a
batch no larger than its free slots, so no claimed job waits behind another. It reaps
expired leases every ``reap_interval``. An idle worker sends no query more often than the
shorter of its poll and reap intervals: serverless Postgres may suspend in between.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import queue
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from typing import Any

import psycopg
from django.db import DatabaseError

import django_pgjobs
from django_pgjobs.core import conf, execute, registry, schedules, upkeep, validation
from django_pgjobs.core.types import default_worker_id
from django_pgjobs.notify import Listener
from django_pgjobs.worker.completer import Completer
from django_pgjobs.worker.db import ReconnectBackoff, unavailable
from django_pgjobs.worker.executor import Executor, Shared
from django_pgjobs.worker.lease import LeaseMode
from django_pgjobs.worker.loop import EventLoop
from django_pgjobs.worker.metrics import WorkerMetrics
from django_pgjobs.worker.options import Configured
from django_pgjobs.worker.outcomes import WorkerStats
from django_pgjobs.worker.scheduler import Scheduler
from django_pgjobs.worker.shutdown import Stopping
from django_pgjobs.worker.stuck import StuckJobs
from django_pgjobs.worker.transaction import TransactionMode

logger = logging.getLogger("django_pgjobs.worker")

__all__ = ["Worker", "WorkerStats"]

# A worker's registry row outlives its latest beat by this many of its ticks (a busy machine
# may run a tick late), then the reaper clears it.
BEATS_TO_EXPIRY = 3


class Worker(Configured, Stopping):
    """Run jobs from ``queues`` until stopped (or, with ``burst``, until none is ready).

    ``queues`` is a list of names, each optionally ``NAME=N`` (this worker runs at most N of
    that queue's jobs at once, in slots of its own), or a mapping of names to N (``None``:
    the shared ``concurrency``). Every option defaults to its ``PGJOBS`` setting. With
    ``registered_only`` (``PGJOBS["CLAIM_REGISTERED_ONLY"]``) the claims take only jobs whose
    task this process has registered. ``run()`` returns the run's ``WorkerStats``;
    ``stop()`` (or SIGTERM/SIGINT once ``install_signal_handlers()`` was called) begins a
    graceful shutdown, a second signal exits the process at once. With ``schedule`` (the
    default) it also enqueues the ticks of the periodic schedules. With ``metrics_port`` (0:
    any free port) it serves its Prometheus metrics on ``metrics_addr`` (default 127.0.0.1)
    while it runs (``worker/metrics.py``; needs the ``prometheus`` extra).
    """

    def __init__(
        self,
        queues: Sequence[str] | Mapping[str, int | None] | None = None,
        *,
        concurrency: int | None = None,
        async_concurrency: int | None = None,
        batch_size: int | None = None,
        lease: float | timedelta | None = None,
        poll_interval: float | None = None,
        reap_interval: float | None = None,
        mode: str | None = None,
        burst: bool = False,
        max_jobs: int | None = None,
        database: str | None = None,
        listen_database: str | None = None,
        shutdown_timeout: float | None = None,
        schedule: bool = True,
        max_stuck_executors: int | None = None,
        registered_only: bool | None = None,
        metrics_port: int | None = None,
        metrics_addr: str | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._size_slots(queues, concurrency, async_concurrency)
        self._claim_options(
            registered_only, batch_size, lease, poll_interval, reap_interval, mode, max_jobs
        )
        self.burst = burst
        self._databases(database, listen_database, shutdown_timeout)
        self.worker_id = default_worker_id()
        # Invalid schedules stop the start (ImproperlyConfigured), as `manage.py check` would.
        self.schedules = schedules.valid() if schedule else []
        self.stats = WorkerStats()
        self.stopping = threading.Event()
        self._wake = threading.Event()
        self._notified = 0
        self._handoff: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._completer: Completer | None = None
        self._signals = 0
        self._next_queue = 0
        self.max_stuck = (
            conf.max_stuck_executors()
            if max_stuck_executors is None
            else validation.positive_int("max_stuck_executors", max_stuck_executors)
        )
        self._executors: list[Executor] = []
        self._stuck_jobs = StuckJobs(
            self.worker_id, self.max_stuck, self._executors, self._lock, self.stop
        )
        # Numbers for the replacements of abandoned executors (the first are 0 .. N-1).
        self._serial = itertools.count(self._slots.executors)
        # The queues to claim through the guarded claim (a limit, or jobs with lock keys), as
        # the latest outlook saw them.
        self._guarded: frozenset[str] = frozenset()
        self._started_at = datetime.now(dt_timezone.utc)
        # When the producer last reaped (monotonic).
        self._last_reap = -math.inf
        self._lease_mode: LeaseMode | None = None
        self._serve_on(metrics_port, metrics_addr)

    @property
    def stuck(self) -> bool:
        """Whether too many jobs got stuck past their timeout, or a job blocked the event loop
        (logged at ERROR): runjobs then exits with ``EXIT_STUCK``."""
        return self._stuck_jobs.stuck

    # -- control -------------------------------------------------------------------------

    def _on_notify(self) -> None:
        self._notified += 1
        self._wake.set()

    def _on_written(self) -> None:
        # Outcomes reached the table: the suspect running alone may have finished. (Suspects
        # a busy claim left queued wait for the next tick, as reaped jobs always do, or, in a
        # burst, for the claim it makes once idle before it ends: now, if this write left it
        # idle.) Under a guarded queue's limit, or for a lock key, the finished job counts
        # until its outcome is committed: claim again now.
        lease_mode = self._lease_mode
        if self._guarded:
            self._slots.freed = True
            self._wake.set()
        elif lease_mode is not None and (
            lease_mode.solo is not None or (self.burst and lease_mode.passed_over())
        ):
            self._wake.set()

    def _on_retry(self) -> None:
        # A failed job was queued again, for later: like a NOTIFY, it makes the producer claim
        # (nothing yet), after which it learns when the retry comes due and wakes then.
        self._on_notify()

    # -- the run -------------------------------------------------------------------------

    def run(self) -> WorkerStats:
        if self.metrics is not None and self.metrics_port is not None:
            self._serve_metrics(self.metrics, self.metrics_port)
        self._log_start()
        started = time.monotonic()
        completer = Completer(
            self.store,
            self.lease,
            self.stats,
            self.worker_id,
            on_retry=self._on_retry,
            on_timeout=self._on_timeout,
            on_written=self._on_written,
            metrics=self.metrics,
            with_claims=conf.complete_with_claim(),
        )
        self._completer = completer
        self._mode = self._make_mode(completer)
        if self._lease_mode is not None and any(
            registry.runs_async(name) for name in registry.names()
        ):
            self._start_loop(self._lease_mode)
        executors = self._executors
        executors.extend(
            Executor(i, self._handoff, self._mode, on_done=self._job_done)
            for i in range(self._slots.executors)
        )
        listener = None
        if not self.burst:
            listener = Listener(self.listen_database, self.queues, self._on_notify)
            listener.start()
        scheduler = self._scheduler()
        completer.start()
        for executor in executors:
            executor.start()
        try:
            self._produce(completer, listener, scheduler)
        finally:
            # Completions from here on are the completer's to write at once.
            completer.ride(False)
            self._shut_down(executors, completer, listener)
        stuck = self._stuck_jobs.count()
        logger.info(
            "worker %s stopped after %.1f s: %s%s",
            self.worker_id,
            time.monotonic() - started,
            self.stats.summary(),
            f" ({stuck} still stuck)" if stuck else "",
            extra={"action": "stop", "worker_id": self.worker_id},
        )
        return self.stats

    def _log_start(self) -> None:
        logger.info(
            "worker %s starting: queues %s, %s mode, concurrency %s, batch %s, lease %.0f s, "
            "poll %.0f s, reap %s",
            self.worker_id,
            ",".join(q if n is None else f"{q}={n}" for q, n in self.limits.items()),
            self.mode,
            self.concurrency,
            self.batch_size,
            self.lease.total_seconds(),
            self.poll_interval,
            f"{self.reap_interval:.0f} s" if self.reap_interval else "off",
            extra={"action": "start", "worker_id": self.worker_id},
        )

    def _start_loop(self, lease_mode: LeaseMode) -> None:
        """Start the event loop that runs the async jobs, and count its slots."""
        # The tasks of each side, for a claim when only the executors or only the loop
        # have room (the registry's: a job of an unregistered task waits for both).
        self._slots.use_loop(
            execute.TextArray.of(
                name for name in registry.names() if not registry.runs_async(name)
            ),
            execute.TextArray.of(name for name in registry.names() if registry.runs_async(name)),
        )
        self._loop = EventLoop(lease_mode, self.async_concurrency, on_done=self._async_done)
        self._loop.start()
        logger.info(
            "worker %s runs async jobs on an event loop, %s at once",
            self.worker_id,
            self.async_concurrency,
            extra={"action": "start", "worker_id": self.worker_id},
        )

    def _scheduler(self) -> Scheduler | None:
        """The scheduler of the periodic schedules, if any (the schedules are logged)."""
        if not self.schedules:
            return None
        scheduler = Scheduler(self.store, self.schedules, self.worker_id)
        logger.info(
            "worker %s schedules: %s",
            self.worker_id,
            "; ".join(f"{s.name} ({s.describe()})" for s in self.schedules),
            extra={"action": "start", "worker_id": self.worker_id},
        )
        return scheduler

    def _serve_metrics(self, worker_metrics: WorkerMetrics, port: int) -> None:
        """Start serving the metrics (before anything else: a port that cannot be bound stops
        the start) and log where, the bound port included (``--metrics-port 0``)."""
        worker_metrics.watch(lambda: self._slots.inflight, lambda: self._slots.executors)
        bound = worker_metrics.serve(self.metrics_addr, port)
        logger.info(
            "worker %s serves its metrics on http://%s:%s/metrics",
            self.worker_id,
            self.metrics_addr,
            bound,
            extra={"action": "start", "worker_id": self.worker_id, "metrics_port": bound},
        )

    def _produce(
        self, completer: Completer, listener: Listener | None, scheduler: Scheduler | None
    ) -> None:
        """Claim until stopped. All periodic work happens on one tick (the shorter of the
        poll and reap intervals): the fallback claim, the reap when due, the LISTEN probe.
        Between ticks only a NOTIFY, a freed slot while the queue may hold more, a
        deferred job coming due, or a schedule's tick wakes the producer, so an idle worker
        is silent."""
        backoff = ReconnectBackoff("producer")
        failed_at = -math.inf  # the producer's latest failed statement
        tick = min(self.poll_interval, self.reap_interval or self.poll_interval)
        next_tick = time.monotonic()  # at once: reap a crashed predecessor's jobs, then claim
        next_due: float | None = None
        maybe_more = True
        look = True  # the outlook is due after the next claim
        notified = self._notified
        while True:
            # Clear before looking at the stop flag: stop() sets the flag, then the wake-up,
            # so a stop that lands while this round runs still cuts its wait short.
            self._wake.clear()
            if self.stopping.is_set():
                return
            # Any NOTIFY (or retry) since the last look, whenever it came (during a claim or
            # the due-time query included): there may be more to claim.
            if self._notified != notified:
                maybe_more, notified = True, self._notified
            if not completer.is_alive():
                raise RuntimeError("the completer thread stopped: not claiming more jobs")
            now = time.monotonic()
            timed = now >= next_tick
            if timed:
                next_tick = now + tick
                maybe_more = look = True
                self._on_tick(listener)
            if self._slots.freed:
                maybe_more, self._slots.freed = True, False
            if next_due is not None and now >= next_due:
                maybe_more, next_due = True, None
            try:
                reap = self._reap_due(now, tick, max(failed_at, completer.last_failure))
                if timed:
                    self._upkeep(now, tick, reap)
                if scheduler is not None and (scheduler.next_step or 0.0) <= now:
                    scheduler.step()
                free, maybe_more = self._claimable(maybe_more)
                got = 0
                if (maybe_more or self.burst) and free > 0:
                    wanted = min(free, self.batch_size)
                    sent = time.monotonic()
                    got, maybe_more = self._dispatch(wanted)
                    if got < wanted or look:
                        # Deferred jobs and retries send no NOTIFY when they come due; jobs
                        # with lock keys and limited queues are not the plain claim's (a busy
                        # worker looks after its first claim of each tick, so keyed jobs do
                        # not wait for a lull).
                        look = False
                        next_due, newly_guarded = self._look(time.monotonic() - sent)
                        if newly_guarded:
                            maybe_more = True
                            continue
                    backoff.succeeded(self.database)
                    if got:
                        continue
            except (DatabaseError, psycopg.Error) as exc:
                if not unavailable(exc):
                    raise
                maybe_more = True
                failed_at = self._outage(exc, completer, backoff)
                continue
            if self._done(got, free):
                return
            ticks_at = scheduler.next_step if scheduler is not None else None
            self._wait(completer, maybe_more, next_tick, next_due, ticks_at)

    def _reap_due(self, now: float, tick: float, failed_at: float) -> bool:
        """Whether the reap is due on a tick at ``now``, given the latest failed statement
        of the producer or the completer (``failed_at``)."""
        reap = self.reap_interval and now - self._last_reap >= self.reap_interval - tick / 2
        # Never reap within a settle after an outage this worker saw (a failed claim or
        # write): its own and every other worker's outcomes and lease extensions go first,
        # or jobs that ran to the end would be failed as expired.
        settled = now - failed_at >= upkeep.REAP_SETTLE.total_seconds()
        return bool(reap and settled)

    def _upkeep(self, now: float, tick: float, reap: bool) -> None:
        """The tick's writes: this worker's beat, and the reap if it is due."""
        self.store.beat(self._record(tick))
        if reap:
            self._last_reap = now
            # A requeued job sends no NOTIFY: the claim below looks for it now.
            self.stats.add("reaped", len(self.store.reap()))

    def _wait(self, completer: Completer, maybe_more: bool, *times: float | None) -> None:
        """Wait for a reason to look at the table, or the earliest of ``times``."""
        wake_at = min(t for t in times if t is not None)
        # Completions recorded while this waits ride with the claim that their freed slots
        # wake it to make, if it is to make one.
        completer.ride(self._claims_next(maybe_more), self._guarded)
        self._wake.wait(max(0.0, wake_at - time.monotonic()))

    def _on_tick(self, listener: Listener | None) -> None:
        """The tick's looks: is the LISTEN connection alive, is a job stuck?"""
        if listener is not None:
            listener.probe()
        if self._loop is not None:
            self._stuck_jobs.look(self._loop)

    def _claimable(self, maybe_more: bool) -> tuple[int, bool]:
        """How many jobs this round may claim (its free slots, none while a suspect runs
        alone, no more than ``max_jobs`` leaves), and whether the queues may hold more."""
        free = self._slots.free()
        if self.burst and self._lease_mode is not None and self._lease_mode.passed_over():
            maybe_more = True
        if self._lease_mode is not None and self._lease_mode.isolating():
            # A suspect runs alone. Look again once it has finished.
            free, maybe_more = 0, True
        if self.max_jobs is not None:
            free = min(free, self.max_jobs - self.stats.claimed)
        return free, maybe_more

    def _outage(self, exc: Exception, completer: Completer, backoff: ReconnectBackoff) -> float:
        """The database is unavailable to the producer: wait to reconnect. Returns when the
        statement failed (monotonic)."""
        failed_at = time.monotonic()
        # The completer retries its writes itself, on its own connection.
        completer.ride(False)
        self.store.close()
        backoff.failed(self.database, exc, self.stopping)
        return failed_at

    def _done(self, got: int, free: int) -> bool:
        """Whether the run is over: nothing running, and a burst's claim found nothing or
        ``max_jobs`` were claimed."""
        # A burst ends on an empty claim, unless it was a busy one that left suspects out.
        lease_mode = self._lease_mode
        passed_over = lease_mode is not None and bool(lease_mode.skipped)
        return self._slots.inflight == 0 and (
            (self.burst and got == 0 and free > 0 and not passed_over)
            or self.max_jobs == self.stats.claimed
        )

    def _claims_next(self, maybe_more: bool) -> bool:
        """Whether the producer will make a plain claim when a slot frees (only a plain claim
        takes completions along): a lease-mode worker with a queue that is not guarded, whose
        queues may hold more, not stopping, with claims left and no suspect running alone."""
        lease_mode = self._lease_mode
        return (
            lease_mode is not None
            and maybe_more
            and any(queue not in self._guarded for queue in self.queues)
            and not self.stopping.is_set()
            and (self.max_jobs is None or self.stats.claimed < self.max_jobs)
            and lease_mode.solo is None
        )

    def _look(self, since: float) -> tuple[float | None, bool]:
        """Learn which of our queues need the guarded claim; return the monotonic time when
        a claim may find more (a deferred job comes due, a rate window the claim sent
        ``since`` seconds ago found full has room), if any, and whether a queue needs the
        guarded claim that did not before."""
        guarded = self._guarded
        outlook = self.store.outlook(self.queues, since)
        self._guarded = outlook.guarded
        times = [t for t in (outlook.due, outlook.rate_free) if t is not None]
        return (time.monotonic() + min(times) if times else None), bool(self._guarded - guarded)

    def _record(self, tick: float) -> dict[str, Any]:
        """This worker's registry row (``upkeep.WORKER_BEAT``)."""
        return {
            "worker_id": self.worker_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "mode": self.mode,
            "queues": json.dumps(self.limits),
            "tasks": self.store.tasks,
            "version": django_pgjobs.__version__,
            "started_at": self._started_at,
            "ttl": timedelta(seconds=BEATS_TO_EXPIRY * tick + self.lease.total_seconds()),
        }

    def _on_timeout(self, job: Any) -> None:
        """A job ran past its timeout (its failure is on its way): replace its executor.

        Called on the completer's thread. The stuck thread keeps running (Python cannot kill
        it) but will record nothing and exit if the job ever returns; a new executor takes its
        slot so throughput goes on. Past ``max_stuck`` live stuck threads, stop: the process
        is leaking threads (and maybe connections and locks), and only a restart frees them.
        """
        if self._loop is not None and registry.runs_async(job.task):
            # Its task is being cancelled: the loop answers once that cancel is delivered,
            # unless a job blocks it (the producer's tick looks, ``StuckJobs.look()``), and the
            # task ends, unless the job catches the cancel (the tick counts it as stuck).
            self._stuck_jobs.cancelled((job.id, job.attempts), self._slots.on_loop)
            self._loop.ping()
            return
        executor = next((e for e in self._executors if e.abandon(job)), None)
        if executor is None:
            return  # it returned just in time; it frees its own slot
        self.stats.add("abandoned")
        # Under the lock _shut_down takes to send the executors their sentinels: once it
        # has, no replacement starts (it would wait for an item forever).
        with self._lock:
            # Forget the abandoned threads that have ended since: a long-lived worker with many
            # timeouts must not keep (and scan) every one it ever had.
            self._executors[:] = [e for e in self._executors if e.is_alive() or not e.abandoned]
            replaced = not self.stopping.is_set()
            if replaced:
                replacement = Executor(
                    next(self._serial), self._handoff, self._mode, on_done=self._job_done
                )
                self._executors.append(replacement)
                replacement.start()
        logger.warning(
            "job %s %s attempt %s: its executor thread %s is abandoned (a thread cannot be "
            "killed)%s",
            job.id,
            job.task,
            job.attempts,
            executor.name,
            "; a new one takes its slot" if replaced else "",
            extra={"action": "fail", "job_id": job.id, "worker_id": self.worker_id},
        )
        self._job_done(job)
        self._stuck_jobs.check()

    def _job_done(self, item: Any) -> None:
        self._slots.thread_done(item)
        self._slot_freed()

    def _slot_freed(self) -> None:
        """Wake the producer for a freed slot. Event.set() is Python and takes the Event's
        lock; a batch's jobs finish together, and the first of them wakes the producer. Left
        set, the flag needs no setting again: the producer clears it before it looks at the
        slots, so a flag seen set here is cleared after this slot was freed, and that look
        sees the slot."""
        if not self._wake.is_set():
            self._wake.set()

    def _async_done(self, job: Any) -> None:
        """An async job's task ended (called on the loop's thread)."""
        self._slots.loop_done(job)
        # After its slot: a timeout marks a job only while it holds one, so no mark is left.
        self._stuck_jobs.ended((job.id, job.attempts))
        self._slot_freed()

    def _hand_out(self, *items: Any) -> None:
        loop = self._loop
        on_loop: list[Any] = []
        on_threads: Sequence[Any] = items
        if loop is not None:
            on_threads = []
            for item in items:
                (on_loop if registry.runs_async(item.task) else on_threads).append(item)
        self._slots.take(on_threads, on_loop)
        for item in on_threads:
            self._handoff.put(item)
        if loop is not None:
            for item in on_loop:
                loop.submit(item)

    def _make_mode(self, completer: Completer) -> LeaseMode | TransactionMode:
        shared = Shared(
            self.store,
            self.lease,
            self.worker_id,
            self.stats,
            self.stopping,
            self._hand_out,
            self.metrics,
        )
        if self.mode == "lease":
            self._lease_mode = LeaseMode(shared, completer)
            return self._lease_mode
        return TransactionMode(shared, on_retry=self._on_retry)

    def _dispatch(self, budget: int) -> tuple[int, bool]:
        """Claim up to ``budget`` jobs across our queues (round robin), each queue no more
        than its slots have free; hand them out. Returns how many were claimed, and whether
        a queue gave all that was asked of it (it may hold more).

        No claim starts once stop was requested (the mode gives back what a claim already
        under way returns)."""
        got = 0
        more = False
        for offset in range(len(self.queues)):
            if self.stopping.is_set():
                break
            queue_name = self.queues[(self._next_queue + offset) % len(self.queues)]
            room, tasks = self._slots.room(self._slots.pool(queue_name))
            asked = min(room, budget - got)
            if asked <= 0:
                continue
            guarded = queue_name in self._guarded
            if tasks is None:
                found = self._mode.dispatch(queue_name, asked, guarded)
            else:
                # Only a lease-mode worker has an event loop.
                assert self._lease_mode is not None
                found = self._lease_mode.dispatch(queue_name, asked, guarded, tasks)
            self.stats.add("claimed", found)
            if self.metrics is not None:
                self.metrics.claimed(found)
            got += found
            more = more or found == asked
            # A suspect runs alone: no other queue's jobs beside it either.
            if got >= budget or (self._lease_mode is not None and self._lease_mode.solo):
                break
        self._next_queue = (self._next_queue + 1) % len(self.queues)
        return got, more
