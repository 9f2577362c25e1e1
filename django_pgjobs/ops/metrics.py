"""Queue-level gauges for Prometheus, served by ``views.metrics``.

The numbers are the dashboard's: ``dashboard.live_queues()`` runs ``dashboard.QUEUE_DEPTH``,
``dashboard.RUNNING_BY_QUEUE`` and ``dashboard.FAILED_BY_QUEUE``, each over one partial index
(ready, lease, failed rows), so a scrape reads the live jobs and never the done history: it costs
the same on an empty table and on one with ten million finished rows (the benchmark's ``scrape``
section measures both). The queues the live workers serve are listed too, with zeros when they are
empty, so a queue's series do not vanish the moment it drains.

A custom collector on a registry of its own: the values are read from the database at scrape
time, never kept in the process (every web process answers with the same numbers), and
nothing here mixes with the process's default registry.

Needs the ``prometheus`` extra (``pip install 'django-pgjobs[prometheus]'``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from django.core.exceptions import ImproperlyConfigured

from django_pgjobs.ops import dashboard

try:
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import GaugeMetricFamily
    from prometheus_client.exposition import choose_encoder
except ImportError as exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImproperlyConfigured(
        "django_pgjobs.views.metrics needs prometheus_client: install the prometheus extra, "
        "pip install 'django-pgjobs[prometheus]'."
    ) from exc

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

# Each gauge: its name, its help text, and the QueueHealth attribute it shows.
GAUGES = (
    ("pgjobs_queue_ready_jobs", "Jobs queued and due (run_at reached).", "ready"),
    ("pgjobs_queue_scheduled_jobs", "Jobs queued for later (run_at in the future).", "scheduled"),
    ("pgjobs_queue_running_jobs", "Jobs claimed by a worker and not finished.", "running"),
    (
        "pgjobs_queue_expired_leases",
        "Running jobs whose lease has expired (their worker died or hangs) and not yet reaped.",
        "expired",
    ),
    ("pgjobs_queue_failed_jobs", "Jobs failed for good (kept until pruned).", "failed"),
    (
        "pgjobs_queue_oldest_ready_age_seconds",
        "How long the oldest ready job has waited since its run_at (0 with none ready).",
        "lag_seconds",
    ),
)


class QueueCollector:
    """Reads the gauges of every queue from the database at each ``collect()``."""

    def __init__(self, alias: str | None = None) -> None:
        self.alias = alias

    def collect(self) -> Iterator[Metric]:
        queues = dashboard.live_queues(self.alias)
        for worker in dashboard.live_workers(self.alias):
            for name in worker["queues"]:
                queues.setdefault(name, dashboard.QueueHealth(name))
        for name, documentation, attribute in GAUGES:
            family = GaugeMetricFamily(name, documentation, labels=["queue"])
            for queue in sorted(queues):
                family.add_metric([queue], float(getattr(queues[queue], attribute)))
            yield family


def registry(alias: str | None = None) -> CollectorRegistry:
    """A registry holding only the queue collector (nothing is read until a scrape)."""
    found = CollectorRegistry(auto_describe=False)
    found.register(QueueCollector(alias))
    return found


def scrape(alias: str | None = None, accept: str = "") -> tuple[bytes, str]:
    """The gauges, encoded as the ``Accept`` header asks (Prometheus text format by default,
    OpenMetrics when the scraper prefers it), with their content type."""
    encoder, content_type = choose_encoder(accept)
    return encoder(registry(alias)), content_type
