"""How a worker stops: a graceful stop (claim nothing more, let the running jobs finish
within the shutdown timeout, write what they return), the signals that ask for it, and an
exit at once on a second signal, which ends the leases of the jobs still held so that the
next reap requeues them without counting a crash.

``Stopping`` is the ``Worker``'s base: what it needs of the worker is declared below, and set
by ``Worker.__init__`` and ``Worker.run()``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import threading
import time
from types import FrameType
from typing import Any

import psycopg
from django.db import DatabaseError, connections

from django_pgjobs.core import finish
from django_pgjobs.core.connections import connection_params
from django_pgjobs.notify import Listener
from django_pgjobs.worker.completer import Completer
from django_pgjobs.worker.executor import Executor
from django_pgjobs.worker.loop import EventLoop
from django_pgjobs.worker.metrics import WorkerMetrics
from django_pgjobs.worker.slots import Slots
from django_pgjobs.worker.store import Store

logger = logging.getLogger("django_pgjobs.worker")

# Seconds a worker exiting at once (a second signal) may spend ending its jobs' leases.
EXIT_TIMEOUT = 3
# Seconds between two looks at an executor the shutdown waits for (was it abandoned since?).
SHUTDOWN_STEP = 0.1


class Stopping:
    """The worker's stop, its signals and its shutdown."""

    stopping: threading.Event
    worker_id: str
    database: str
    shutdown_timeout: float
    store: Store
    metrics: WorkerMetrics | None
    _lock: threading.Lock
    _wake: threading.Event
    _signals: int
    _completer: Completer | None
    _handoff: queue.SimpleQueue[Any]
    _slots: Slots
    _loop: EventLoop | None

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
        if self._signals > 2:
            # A third signal interrupts the second's exit (in _expire_held): let it finish.
            return
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
        """End the leases of every job this worker holds, so the next reap requeues them
        (with no crash counted: finish.EXPIRE_LEASE).

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
                return len(finish.expire_lease(conn, held, synchronous_commit=None))
        except Exception:
            logger.exception(
                "could not end the leases of %s jobs; they come back after their lease",
                len(held),
                extra={"action": "shutdown", "worker_id": self.worker_id},
            )
            return 0

    def _shut_down(
        self, executors: list[Executor], completer: Completer, listener: Listener | None
    ) -> None:
        with self._lock:
            self.stopping.set()
            # Abandoned executors take no more items and are not waited for: their jobs, past
            # their timeout, are failed already.
            executors = [e for e in executors if not e.abandoned]
            for _ in executors:
                self._handoff.put(None)
        if listener is not None:
            listener.stop()
        deadline = time.monotonic() + self.shutdown_timeout
        for executor in executors:
            # In short steps: an executor abandoned meanwhile (its job timed out during the
            # shutdown) is not waited for either.
            while executor.is_alive() and not executor.abandoned:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                executor.join(min(left, SHUTDOWN_STEP))
        still = [e.name for e in executors if e.is_alive() and not e.abandoned]
        while self._slots.on_loop and time.monotonic() < deadline:
            time.sleep(SHUTDOWN_STEP)
        still.extend(["async job"] * len(self._slots.on_loop))
        completer.close(timeout=max(self.shutdown_timeout, 5.0))
        if still:
            # Their jobs (and any outcome the completer could not write) are still ours:
            # end their leases on purpose, so the next reap requeues them at once and counts
            # no crash (a deploy is no worker death).
            logger.warning(
                "%s jobs still running after the %.0f s shutdown timeout; their leases end "
                "now (%s ended) and the next reap requeues them",
                len(still),
                self.shutdown_timeout,
                self._expire_held(),
                extra={"action": "shutdown", "worker_id": self.worker_id},
            )
        if self._loop is not None and not self._slots.on_loop:
            # Jobs still running after the timeout keep the loop: their leases are ended,
            # and the process exits.
            self._loop.close()
        if listener is not None:
            listener.join(timeout=5.0)
        try:
            self.store.gone(self.worker_id)
        except (DatabaseError, psycopg.Error):
            # The row expires on its own; the reaper clears it.
            logger.warning(
                "worker %s could not delete its registry row; it expires on its own",
                self.worker_id,
                exc_info=True,
                extra={"action": "stop", "worker_id": self.worker_id},
            )
        self.store.close()
        if self.metrics is not None:
            self.metrics.close()
        connections.close_all()
