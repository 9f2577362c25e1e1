"""The worker process: its producer loop, and how it starts and stops.

The producer (the thread that calls ``run()``) waits for a reason to look at the table (a
NOTIFY, the fallback poll, a freed executor slot while the queue may hold more) and claims a
batch no larger than its free slots, so no claimed job waits behind another. It reaps
expired leases every ``reap_interval``. An idle worker sends no query more often than the
shorter of its poll and reap intervals: serverless Postgres may suspend in between.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import queue
import signal
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from types import FrameType
from typing import Any

import psycopg
from django.db import DatabaseError, connections

from django_pgjobs import conf, lifecycle, schedules, validation
from django_pgjobs.connections import connection_params
from django_pgjobs.lifecycle import default_worker_id
from django_pgjobs.notify import Listener
from django_pgjobs.worker.completer import Completer
from django_pgjobs.worker.db import Backoff, unavailable
from django_pgjobs.worker.executor import Executor, Shared
from django_pgjobs.worker.lease import LeaseMode
from django_pgjobs.worker.outcomes import WorkerStats
from django_pgjobs.worker.scheduler import Scheduler
from django_pgjobs.worker.store import Store
from django_pgjobs.worker.transaction import TransactionMode

logger = logging.getLogger("django_pgjobs.worker")

__all__ = ["Worker", "WorkerStats"]

# Seconds a worker exiting at once (a second signal) may spend ending its jobs' leases.
EXIT_TIMEOUT = 3


class Worker:
    """Run jobs from ``queues`` until stopped (or, with ``burst``, until none is ready).

    Every option defaults to its ``PGJOBS`` setting. ``run()`` returns the run's
    ``WorkerStats``; ``stop()`` (or SIGTERM/SIGINT once ``install_signal_handlers()`` was
    called) begins a graceful shutdown, a second signal exits the process at once. With
    ``schedule`` (the default) it also enqueues the ticks of the periodic schedules.
    """

    def __init__(
        self,
        queues: Sequence[str] | None = None,
        *,
        concurrency: int | None = None,
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
    ) -> None:
        self.queues = [validation.queue_name(q) for q in (queues or [conf.default_queue()])]
        self.concurrency = validation.positive_int(
            "concurrency", conf.concurrency() if concurrency is None else concurrency
        )
        self.batch_size = validation.positive_int(
            "batch_size", conf.batch_size() if batch_size is None else batch_size
        )
        # Each option is checked by the same validator as its PGJOBS setting.
        self.lease = (
            conf.lease() if lease is None else validation.duration("lease", lease, minimum=1)
        )
        self.poll_interval = (
            conf.poll_interval()
            if poll_interval is None
            else validation.seconds("poll_interval", poll_interval, minimum=0.01)
        )
        self.reap_interval = (
            conf.reap_interval()
            if reap_interval is None
            else validation.seconds("reap_interval", reap_interval, minimum=0)
        )
        self.mode = conf.mode() if mode is None else validation.mode(mode)
        self.burst = burst
        self.max_jobs = None if max_jobs is None else validation.positive_int("max_jobs", max_jobs)
        self.database = (
            conf.database() if database is None else str(validation.alias(database, "database"))
        )
        self.listen_database = (
            str(validation.alias(listen_database, "listen_database"))
            if listen_database is not None
            else conf.listen_database() or self.database
        )
        self.shutdown_timeout = (
            conf.shutdown_timeout()
            if shutdown_timeout is None
            else validation.seconds("shutdown_timeout", shutdown_timeout, minimum=0)
        )
        # Lease mode's claims and outcomes are the worker's own transactions, on connections
        # of its own; in transaction mode they share the job's transaction, which keeps the
        # server's durability.
        lease_mode = self.mode == "lease"
        self.store = Store(
            self.database,
            direct=lease_mode,
            synchronous_commit=conf.worker_synchronous_commit() if lease_mode else None,
            prepare=conf.prepare(),
        )
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
        self._lock = threading.Lock()
        self._inflight = 0

    # -- control -------------------------------------------------------------------------

    def stop(self) -> None:
        """Begin a graceful shutdown: claim nothing more, finish or release what we hold."""
        self.stopping.set()
        self._wake.set()

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT: the first stops gracefully, the second exits at once."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signals += 1
        name = signal.Signals(signum).name
        if self._signals > 1:
            try:
                expired = self._expire_held()
                logger.warning(
                    "%s again: exiting now; the leases of %s jobs it held end now, and the "
                    "next reap requeues them",
                    name,
                    expired,
                    extra={"action": "shutdown", "worker_id": self.worker_id},
                )
            finally:
                os._exit(1)
        logger.info(
            "%s: stopping (running jobs may take %.0f s to finish; signal again to exit now)",
            name,
            self.shutdown_timeout,
            extra={"action": "shutdown", "worker_id": self.worker_id},
        )
        # Not stop() here: the handler runs in the producer's thread, which may hold the lock
        # of the very Event that stop() sets (inside wait() or clear()), and that lock is not
        # reentrant. A thread of its own sets them; a daemon one, whose start takes no lock
        # the interrupted thread could hold. (During interpreter shutdown no thread can
        # start, and nothing is left to stop.)
        with contextlib.suppress(RuntimeError):
            threading.Thread(target=self.stop, name="pgjobs-stop", daemon=True).start()

    def _expire_held(self) -> int:
        """End the leases of every job this worker holds, so the next reap requeues them.

        One fenced statement on a fresh connection (the producer's may be mid-statement under
        this signal handler), bounded to a few seconds: an exit at once must not hang on an
        unreachable database. Returns how many leases ended; on any error, none (they expire
        on their own)."""
        held = self._completer.held() if self._completer is not None else []
        if not held:
            return 0
        try:
            params = connection_params(self.database, "pgjobs-exit")
            # The alias's own timeouts and options are kept, within the exit's bound.
            timeout = min(int(params.get("connect_timeout", EXIT_TIMEOUT)), EXIT_TIMEOUT)
            params["connect_timeout"] = timeout
            params["options"] = f"{params.get('options', '')} -c statement_timeout={timeout}s"
            with psycopg.connect(**params, autocommit=True) as conn:
                return len(lifecycle.expire_lease(conn, held, synchronous_commit=None))
        except Exception:
            logger.exception(
                "could not end the leases of %s jobs; they come back after their lease",
                len(held),
                extra={"action": "shutdown", "worker_id": self.worker_id},
            )
            return 0

    def _on_notify(self) -> None:
        self._notified += 1
        self._wake.set()

    def _on_retry(self) -> None:
        # A failed job was queued again, for later: like a NOTIFY, it makes the producer claim
        # (nothing yet), after which it learns when the retry comes due and wakes then.
        self._on_notify()

    # -- the run -------------------------------------------------------------------------

    def run(self) -> WorkerStats:
        logger.info(
            "worker %s starting: queues %s, %s mode, concurrency %s, batch %s, lease %.0f s, "
            "poll %.0f s, reap %s",
            self.worker_id,
            ",".join(self.queues),
            self.mode,
            self.concurrency,
            self.batch_size,
            self.lease.total_seconds(),
            self.poll_interval,
            f"{self.reap_interval:.0f} s" if self.reap_interval else "off",
            extra={"action": "start", "worker_id": self.worker_id},
        )
        started = time.monotonic()
        completer = Completer(
            self.store, self.lease, self.stats, self.worker_id, on_retry=self._on_retry
        )
        self._completer = completer
        self._mode = self._make_mode(completer)
        executors = [
            Executor(i, self._handoff, self._mode, on_done=self._job_done)
            for i in range(self.concurrency)
        ]
        listener = None
        if not self.burst:
            listener = Listener(self.listen_database, self.queues, self._on_notify)
            listener.start()
        scheduler = None
        if self.schedules:
            scheduler = Scheduler(self.store, self.schedules, self.worker_id)
            logger.info(
                "worker %s schedules: %s",
                self.worker_id,
                "; ".join(f"{s.name} ({s.describe()})" for s in self.schedules),
                extra={"action": "start", "worker_id": self.worker_id},
            )
        completer.start()
        for executor in executors:
            executor.start()
        try:
            self._produce(completer, listener, scheduler)
        finally:
            self._shut_down(executors, completer, listener)
        logger.info(
            "worker %s stopped after %.1f s: %s",
            self.worker_id,
            time.monotonic() - started,
            self.stats.summary(),
            extra={"action": "stop", "worker_id": self.worker_id},
        )
        return self.stats

    def _produce(
        self, completer: Completer, listener: Listener | None, scheduler: Scheduler | None
    ) -> None:
        """Claim until stopped. All periodic work happens on one tick (the shorter of the
        poll and reap intervals): the fallback claim, the reap when due, the LISTEN probe.
        Between ticks only a NOTIFY, a freed slot while the queue may hold more, a
        deferred job coming due, or a schedule's tick wakes the producer, so an idle worker
        is silent."""
        backoff = Backoff("producer")
        settle = lifecycle.REAP_SETTLE.total_seconds()
        failed_at = -math.inf  # the producer's latest failed statement
        tick = min(self.poll_interval, self.reap_interval or self.poll_interval)
        next_tick = time.monotonic()  # at once: reap a crashed predecessor's jobs, then claim
        last_reap = -math.inf
        next_due: float | None = None
        maybe_more = True
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
                maybe_more = True
                if listener is not None:
                    listener.probe()
            if next_due is not None and now >= next_due:
                maybe_more, next_due = True, None
            try:
                reap = self.reap_interval and now - last_reap >= self.reap_interval - tick / 2
                # Never reap within a settle after an outage this worker saw (a failed claim
                # or write): its own and every other worker's outcomes and lease extensions
                # go first, or jobs that ran to the end would be failed as expired.
                settled = now - max(failed_at, completer.last_failure) >= settle
                if timed and reap and settled:
                    last_reap = now
                    reaped = self.store.reap()
                    self.stats.add("reaped", len(reaped))
                    # A requeued job sends no NOTIFY: the claim below looks for it now.
                if scheduler is not None and (scheduler.next_step or 0.0) <= now:
                    scheduler.step()
                free = self.concurrency - self._inflight
                if self.max_jobs is not None:
                    free = min(free, self.max_jobs - self.stats.claimed)
                got = 0
                if (maybe_more or self.burst) and free > 0:
                    wanted = min(free, self.batch_size)
                    got = self._dispatch(wanted)
                    maybe_more = got == wanted
                    if got < wanted and not self.burst:
                        # Deferred jobs and retries send no NOTIFY when they come due.
                        next_due = self._next_due()
                    backoff.succeeded(self.database)
                    if got:
                        continue
            except (DatabaseError, psycopg.Error) as exc:
                if not unavailable(exc):
                    raise
                maybe_more = True
                failed_at = time.monotonic()
                self.store.close()
                backoff.failed(self.database, exc, self.stopping)
                continue
            if self._inflight == 0 and (
                (self.burst and got == 0 and free > 0) or self.max_jobs == self.stats.claimed
            ):
                return
            ticks_at = scheduler.next_step if scheduler is not None else None
            wake_at = min(t for t in (next_tick, next_due, ticks_at) if t is not None)
            self._wake.wait(max(0.0, wake_at - time.monotonic()))

    def _next_due(self) -> float | None:
        """Monotonic time when the earliest deferred job of our queues comes due, if any."""
        seconds = self.store.seconds_until_due(self.queues)
        return None if seconds is None else time.monotonic() + seconds

    def _job_done(self) -> None:
        with self._lock:
            self._inflight -= 1
        self._wake.set()

    def _hand_out(self, *items: Any) -> None:
        with self._lock:
            self._inflight += len(items)
        for item in items:
            self._handoff.put(item)

    def _make_mode(self, completer: Completer) -> LeaseMode | TransactionMode:
        shared = Shared(
            self.store, self.lease, self.worker_id, self.stats, self.stopping, self._hand_out
        )
        if self.mode == "lease":
            return LeaseMode(shared, completer)
        return TransactionMode(shared, on_retry=self._on_retry)

    def _dispatch(self, wanted: int) -> int:
        """Claim up to ``wanted`` jobs across our queues (round robin); hand them out.

        No claim starts once stop was requested (the mode gives back what a claim already
        under way returns)."""
        got = 0
        for offset in range(len(self.queues)):
            if self.stopping.is_set():
                break
            queue_name = self.queues[(self._next_queue + offset) % len(self.queues)]
            found = self._mode.dispatch(queue_name, wanted - got)
            self.stats.add("claimed", found)
            got += found
            if got >= wanted:
                break
        self._next_queue = (self._next_queue + 1) % len(self.queues)
        return got

    def _shut_down(
        self, executors: list[Executor], completer: Completer, listener: Listener | None
    ) -> None:
        self.stopping.set()
        if listener is not None:
            listener.stop()
        for _ in executors:
            self._handoff.put(None)
        deadline = time.monotonic() + self.shutdown_timeout
        for executor in executors:
            executor.join(max(0.0, deadline - time.monotonic()))
        still = [e.name for e in executors if e.is_alive()]
        if still:
            logger.warning(
                "%s jobs still running after the %.0f s shutdown timeout; their leases will "
                "expire and the reaper will requeue them",
                len(still),
                self.shutdown_timeout,
                extra={"action": "shutdown", "worker_id": self.worker_id},
            )
        completer.close(timeout=max(self.shutdown_timeout, 5.0))
        if listener is not None:
            listener.join(timeout=5.0)
        self.store.close()
        connections.close_all()
