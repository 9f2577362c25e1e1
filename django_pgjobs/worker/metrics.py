"""The worker's own Prometheus metrics, served by ``runjobs --metrics-port``.

They describe this process, not the queue: what it finished (by task and outcome), how long
its jobs ran, how many jobs its claims took, how many of its executors are busy and how long
ago its producer last claimed. The queue's own state (ready, running, failed rows) is the
same for every worker and is served by the project's metrics view instead.

Each ``WorkerMetrics`` has a ``CollectorRegistry`` of its own, not ``prometheus_client``'s
global one, so that several workers in one process (tests, a worker started from Python) do
not clash, and a project's own metrics are not served by the worker by accident. A worker
creates one only when asked to serve metrics: without it the hot path pays one ``None`` check.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

from django_pgjobs.core.validation import show
from django_pgjobs.exceptions import InvalidJobOptions, MetricsUnavailable

logger = logging.getLogger("django_pgjobs.worker")

PREFIX = "pgjobs_worker_"
# Run times from a few milliseconds to an hour: jobs are longer than requests.
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)
# Jobs per claim: 0 (the claim found nothing) up to a large --batch-size.
CLAIM_BUCKETS = (0, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
MISSING = (
    "runjobs --metrics-port needs prometheus_client, which the prometheus extra installs: "
    "pip install 'django-pgjobs[prometheus]'."
)


def client() -> ModuleType:
    """``prometheus_client``, or ``MetricsUnavailable`` naming the extra that installs it."""
    try:
        return importlib.import_module("prometheus_client")
    except ImportError as exc:
        raise MetricsUnavailable(MISSING) from exc


def port(value: object) -> int:
    """A TCP port to listen on: 0 (any free one) to 65535."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise InvalidJobOptions(
            f"Invalid metrics port {show(value)}: use a whole number from 0 to 65535 "
            "(0: any free port, logged once bound)."
        )
    return value


def address(value: object) -> str:
    """An address to listen on (an IP address or a host name)."""
    if not isinstance(value, str) or not value.strip():
        raise InvalidJobOptions(
            f"Invalid metrics address {show(value)}: use an IP address or host name to listen "
            "on, such as 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)."
        )
    return value.strip()


class WorkerMetrics:
    """One worker's counters, histograms and gauges, and the HTTP server that serves them.

    The worker feeds it: :meth:`finished` from the moment an attempt's outcome is known (the
    same moment ``job_finished`` is sent), :meth:`claimed` from the producer's claims. The
    gauges are read from the worker when scraped (:meth:`watch`), so they cost nothing between
    scrapes.
    """

    def __init__(self) -> None:
        prometheus = client()
        self.registry = prometheus.CollectorRegistry()
        self.jobs_finished = prometheus.Counter(
            PREFIX + "jobs_finished",
            "Attempts this worker finished, by task and outcome (done, retry, failed, "
            "cancelled, lost, snoozed).",
            ["task", "outcome"],
            registry=self.registry,
        )
        self.job_duration = prometheus.Histogram(
            PREFIX + "job_duration_seconds",
            "Run time of this worker's attempts, by task.",
            ["task"],
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        self.claim_size = prometheus.Histogram(
            PREFIX + "claim_size",
            "Jobs taken by each of this worker's claims of a queue (0: it found none).",
            buckets=CLAIM_BUCKETS,
            registry=self.registry,
        )
        self.executors = prometheus.Gauge(
            PREFIX + "executors", "Executor slots of this worker.", registry=self.registry
        )
        self.executors_busy = prometheus.Gauge(
            PREFIX + "executors_busy",
            "Executor slots running (or about to run) a job.",
            registry=self.registry,
        )
        self.since_claim = prometheus.Gauge(
            PREFIX + "seconds_since_last_claim",
            "Seconds since this worker's latest claim that reached the database (found jobs "
            "or not); since its start before the first.",
            registry=self.registry,
        )
        self._last_claim = time.monotonic()
        self.since_claim.set_function(lambda: time.monotonic() - self._last_claim)
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def watch(self, busy: Callable[[], int], slots: Callable[[], int]) -> None:
        """Read the executor gauges from the worker at each scrape."""
        self.executors_busy.set_function(busy)
        self.executors.set_function(slots)

    def finished(self, task: str, outcome: str, duration: float) -> None:
        """An attempt of ``task`` ended as ``outcome`` after ``duration`` seconds."""
        self.jobs_finished.labels(task, outcome).inc()
        self.job_duration.labels(task).observe(duration)

    def claimed(self, count: int) -> None:
        """A claim of one queue returned ``count`` jobs."""
        self.claim_size.observe(count)
        self._last_claim = time.monotonic()

    def serve(self, addr: str, port_number: int) -> int:
        """Serve ``/metrics`` on ``addr``:``port_number`` from a daemon thread; return the
        bound port (the one chosen when ``port_number`` is 0)."""
        try:
            self._server, self._thread = client().start_http_server(
                port_number, addr, registry=self.registry
            )
        except OSError as exc:
            raise MetricsUnavailable(
                f"Cannot serve metrics on {addr}:{port_number}: {exc.strerror or exc}. Pick "
                "another --metrics-port (0: any free port) or --metrics-addr."
            ) from exc
        return int(self._server.server_port)

    def close(self) -> None:
        """Stop serving (a stopped worker has no metrics to give)."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self._server = self._thread = None
