"""What a worker is given: each option of ``Worker(...)`` (and so of ``runjobs``), else its
``PGJOBS`` setting, checked by the same validator as that setting, and what it sizes (the
slots, the store, the metrics server). ``Configured`` is the ``Worker``'s base; ``__init__``
calls these steps in order.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from datetime import timedelta

from django_pgjobs.core import conf, registry, validation
from django_pgjobs.exceptions import InvalidJobOptions
from django_pgjobs.worker import metrics
from django_pgjobs.worker.loop import EventLoop
from django_pgjobs.worker.metrics import WorkerMetrics
from django_pgjobs.worker.slots import Slots
from django_pgjobs.worker.store import Store


class Configured:
    """The worker's options, resolved and checked."""

    _lock: threading.Lock

    def _size_slots(
        self,
        queues: Sequence[str] | Mapping[str, int | None] | None,
        concurrency: int | None,
        async_concurrency: int | None,
    ) -> None:
        # Each queue's own slot limit in this process (None: it shares `concurrency`).
        self.limits = validation.queue_limits(queues or [conf.default_queue()])
        self.queues = list(self.limits)
        self.concurrency = validation.positive_int(
            "concurrency", conf.concurrency() if concurrency is None else concurrency
        )
        # async def jobs run on one event-loop thread, up to this many at once, apart from
        # the executor threads' slots (a queue with a limit of its own still counts them).
        self.async_concurrency = validation.positive_int(
            "async_concurrency",
            conf.async_concurrency() if async_concurrency is None else async_concurrency,
        )
        self._slots = Slots(self.limits, self.concurrency, self.async_concurrency, self._lock)
        # Started by run() only when async def jobs are registered (in lease mode).
        self._loop: EventLoop | None = None

    def _claim_options(
        self,
        registered_only: bool | None,
        batch_size: int | None,
        lease: float | timedelta | None,
        poll_interval: float | None,
        reap_interval: float | None,
        mode: str | None,
        max_jobs: int | None,
    ) -> None:
        self.registered_only = (
            conf.claim_registered_only()
            if registered_only is None
            else validation.choice("registered_only", registered_only, (True, False))
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
        self.max_jobs = None if max_jobs is None else validation.positive_int("max_jobs", max_jobs)

    def _databases(
        self, database: str | None, listen_database: str | None, shutdown_timeout: float | None
    ) -> None:
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
            tasks=registry.names() if self.registered_only else None,
        )

    def _serve_on(self, metrics_port: int | None, metrics_addr: str | None) -> None:
        # Only a worker asked to serve metrics keeps any (MetricsUnavailable without the
        # prometheus extra).
        if metrics_addr is not None and metrics_port is None:
            raise InvalidJobOptions(
                f"metrics_addr {validation.show(metrics_addr)} is the address of the metrics "
                "server, which only metrics_port starts (runjobs --metrics-port PORT)."
            )
        self.metrics_port = None if metrics_port is None else metrics.port(metrics_port)
        self.metrics_addr = metrics.address("127.0.0.1" if metrics_addr is None else metrics_addr)
        self.metrics = WorkerMetrics() if self.metrics_port is not None else None
