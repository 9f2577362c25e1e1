"""Database trouble that is not the job's fault: telling it apart, backing off, reconnecting."""

from __future__ import annotations

import logging
import threading

from django.db import DatabaseError, InterfaceError, OperationalError, connections

logger = logging.getLogger("django_pgjobs.worker")

# The server went away, restarted, refused us or is read-only (a failover): retry later.
UNAVAILABLE = (OperationalError, InterfaceError)


def reset(alias: str) -> None:
    """Drop this thread's connection to ``alias`` so the next query opens a fresh one."""
    try:
        connections[alias].close()
    except DatabaseError:
        logger.debug("closing a broken connection to %s failed", alias, exc_info=True)


class Backoff:
    """Exponential wait between reconnects: 0.5 s doubling to ``ceiling``, reset on success."""

    def __init__(self, what: str, ceiling: float = 30.0) -> None:
        self.what = what
        self.ceiling = ceiling
        self.delay = 0.0

    def failed(self, alias: str, exc: BaseException, stop: threading.Event) -> None:
        """Log the outage, reset the connection, then wait (returns early on ``stop``)."""
        self.delay = min(max(self.delay * 2, 0.5), self.ceiling)
        logger.warning(
            "%s: database %s unavailable (%s); reconnecting in %.1f s",
            self.what, alias, str(exc).strip().splitlines()[0] if str(exc).strip() else
            type(exc).__name__, self.delay,
            extra={"action": "reconnect"},
        )
        reset(alias)
        stop.wait(self.delay)

    def succeeded(self, alias: str) -> None:
        if self.delay:
            logger.warning(
                "%s: reconnected to database %s", self.what, alias, extra={"action": "reconnect"}
            )
            self.delay = 0.0


def tidy() -> None:
    """Between jobs: close this thread's connections that broke or were left mid-transaction.

    Django closes a request's connections when ``CONN_MAX_AGE`` is 0, but an executor thread
    is not a request: reconnecting for every job costs more than most jobs. Healthy
    connections stay open; a positive ``CONN_MAX_AGE`` is still honoured as a maximum age.
    """
    for connection in connections.all(initialized_only=True):
        if connection.settings_dict.get("CONN_MAX_AGE") == 0:
            connection.close_at = None
        connection.close_if_unusable_or_obsolete()
