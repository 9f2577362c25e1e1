"""Database trouble that is not the job's fault: telling it apart, backing off, reconnecting."""

from __future__ import annotations

import logging
import threading
from typing import Any

import psycopg
from django.db import DatabaseError, InterfaceError, connections

from django_pgjobs.notify import connection_params

logger = logging.getLogger("django_pgjobs.worker")

# SQLSTATEs that mean "the database is away", not "this statement or job is wrong": a
# connection exception (class 08), the server shutting down or starting (57P01-57P03),
# out of connections or resources (class 53), a read-only standby after a failover (25006).
UNAVAILABLE_STATES = ("08", "53", "57P01", "57P02", "57P03", "25006")


def unavailable(exc: BaseException | None) -> bool:
    """Whether ``exc``, or an error that caused it, means the database is unavailable.

    A lost connection carries no SQLSTATE (psycopg raises a bare OperationalError);
    statement timeouts, serialization failures and bad SQL do, and are not outages.
    """
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (InterfaceError, psycopg.InterfaceError)):
            return True
        if isinstance(exc, psycopg.Error):
            state = exc.sqlstate
            if state is None:
                return isinstance(exc, psycopg.OperationalError)
            return state.startswith(UNAVAILABLE_STATES)
        exc = exc.__cause__ or exc.__context__
    return False


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
            self.what,
            alias,
            str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__,
            self.delay,
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


def reset_all() -> None:
    """Drop every connection this thread has open (after a job met a database outage)."""
    for connection in connections.all(initialized_only=True):
        reset(connection.alias)


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


class DirectConnections:
    """A lease-mode worker's own psycopg connections for its hot statements, one per thread.

    The claim and the fenced writes are a handful of statements run thousands of times: on
    a plain autocommit connection they skip Django's cursor wrappers, and with ``prepare``
    (``PGJOBS["PREPARE"]``) the server plans each once per connection instead of on every
    call. Behind a transaction-mode pooler without prepared-statement support (PgBouncer
    before 1.21, or ``max_prepared_statements = 0``) set ``PREPARE`` to False, or the
    alias's ``DISABLE_SERVER_SIDE_CURSORS`` to True as Django asks of such an alias. A
    broken connection is replaced on the next ``get()``; the worker closes one after an
    outage, so a server that went read-only is not asked again on the same session.
    """

    def __init__(self, alias: str, *, prepare: bool) -> None:
        self.params = connection_params(alias)
        # The alias's own OPTIONS["prepare_threshold"] is kept (None there means "never");
        # otherwise prepare at the first execution.
        settings_dict = connections[alias].settings_dict
        options = settings_dict.get("OPTIONS", {})
        self.params.pop("prepare_threshold", None)
        threshold = options.get("prepare_threshold", 0)
        # DISABLE_SERVER_SIDE_CURSORS is what Django asks of an alias behind a transaction
        # pooler: such an alias gets no prepared statements either.
        if settings_dict.get("DISABLE_SERVER_SIDE_CURSORS"):
            prepare = False
        self.prepare_threshold = threshold if prepare else None
        self._local = threading.local()

    def get(self) -> psycopg.Connection[Any]:
        conn: psycopg.Connection[Any] | None = getattr(self._local, "conn", None)
        if conn is None or conn.closed or conn.broken:
            if conn is not None:
                conn.close()
            conn = psycopg.connect(
                **self.params, autocommit=True, prepare_threshold=self.prepare_threshold
            )
            self._local.conn = conn
        return conn

    def close(self) -> None:
        """Close the calling thread's connection."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            self._local.conn = None
            conn.close()
