"""Database trouble that is not the job's fault: telling it apart, backing off, reconnecting."""

from __future__ import annotations

import logging
import threading
import weakref
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

import psycopg
from django.db import DatabaseError, InterfaceError, connections
from django.db.backends.signals import connection_created
from django.dispatch import receiver

from django_pgjobs.core.connections import connection_params
from django_pgjobs.core.types import reason

if TYPE_CHECKING:
    from typing_extensions import LiteralString

# Whether this server cannot take writes now: a standby (after a failover the old primary's
# address may lead to one), or a session forced read-only.
READ_ONLY: LiteralString = (
    "SELECT pg_is_in_recovery() OR current_setting('transaction_read_only')::bool"
)


logger = logging.getLogger("django_pgjobs.worker")

# SQLSTATEs that mean "the database is away", not "this statement or job is wrong": a
# connection exception (class 08), the server shutting down or starting (57P01-57P03),
# out of connections or resources (class 53), a read-only standby after a failover (25006).
UNAVAILABLE_STATES = ("08", "53", "57P01", "57P02", "57P03", "25006")


def unavailable(exc: BaseException | None) -> bool:
    """Whether ``exc``, or an error it was raised from, says a database is unavailable.

    Follows ``__cause__`` (Django's errors wrap psycopg's with ``raise ... from``), never
    ``__context__``: an error raised while handling an outage is not the outage. A lost
    connection carries no SQLSTATE (psycopg raises a bare OperationalError); statement
    timeouts, serialization failures and bad SQL do, and are not outages.
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
        exc = exc.__cause__
    return False


_opened = threading.local()


@receiver(connection_created)
def _count_opened(sender: Any, connection: Any, **kwargs: Any) -> None:
    counts: Counter[str] = getattr(_opened, "counts", None) or Counter()
    counts[connection.alias] += 1
    _opened.counts = counts
    # The connections this thread has opened and not yet seen closed, for tidy_opened(): by
    # identity, since one alias may have several (the one in `connections`, a job's copy()),
    # and weakly, so that one a job dropped without closing is still collected (and closed).
    wrappers: weakref.WeakValueDictionary[int, Any] | None = getattr(_opened, "wrappers", None)
    if wrappers is None:
        wrappers = _opened.wrappers = weakref.WeakValueDictionary()
    wrappers[id(connection)] = connection
    dropped: set[str] = getattr(_opened, "dropped", set())
    if connection.alias in dropped:
        # The one reset() dropped, opened again: its drop was counted there.
        dropped.discard(connection.alias)
    elif counts[connection.alias] > 1 and getattr(_opened, "async_jobs", False):
        # The async jobs' thread opened a connection again: Django dropped the one before
        # (an atomic() block that ended on a broken connection does).
        _async_replaced[connection.alias] += 1


def mark_async_jobs_thread() -> None:
    """Called on asgiref's ``sync_to_async`` thread (by the event loop, before any job runs
    there): from then on a connection opened again on it counts in ``async_replaced()``."""
    _opened.async_jobs = True


class QueueConnection(NamedTuple):
    """This thread's connection to the queue's alias at one moment, and how many it opened."""

    connection: Any
    opened: int


def count_from_start() -> None:
    """Called first thing on an executor thread: every connection it opens is counted (the
    counting receiver is registered before any executor starts), so ``queue_connection()``
    may take "never opened" for "not open" there."""
    _opened.from_start = True


def queue_connection(alias: str) -> QueueConnection:
    """This thread's connection to the queue's alias as a job starts, and how many it opened.

    On an executor thread that never connected to the alias, the connection is None without
    a look-up on asgiref's ``Local`` (2 to 3 µs, before every job that leaves the database
    alone). One connection escapes the count: one whose set-up failed after it was opened
    (Django sends ``connection_created`` last), in a job that swallowed the error. A later
    job's outage is then still told by the connection found broken after the error
    (``queue_database_away()`` looks it up), but a replacement of it is not counted as one."""
    counts: Counter[str] | None = getattr(_opened, "counts", None)
    if not (counts and counts[alias]) and getattr(_opened, "from_start", False):
        return QueueConnection(None, 0)
    return _queue_connection_now(alias)


def _queue_connection_now(alias: str) -> QueueConnection:
    """``queue_connection()`` with the look-up: what the connection is after an error."""
    counts: Counter[str] | None = getattr(_opened, "counts", None)
    return QueueConnection(connections[alias].connection, counts[alias] if counts else 0)


def queue_database_away(exc: BaseException, alias: str, before: QueueConnection) -> bool:
    """Whether a job's error ``exc`` came from an outage of the queue's own database.

    Only then is the attempt given back. The error must say "unavailable" (``unavailable()``),
    and the queue's database must be found away from this thread: the connection the job
    started with or opened (``before``, from ``queue_connection()``) broke, or was replaced
    (Django reconnects when an ``atomic()`` block ends on a dead connection), or a fresh
    connection cannot be opened or finds a server that cannot write (a standby after a
    failover). A connection error from any other database or service the job talks to, while
    the queue's database answers, is the job's own failure and follows its retry policy.
    """
    if not unavailable(exc):
        return False
    now = _queue_connection_now(alias)
    # A connection the job started with, or opened, was lost and replaced meanwhile.
    replaced = now.opened - before.opened >= (1 if before.connection is not None else 2)
    if replaced or (now.connection is not None and now.connection.broken):
        return True
    return probe_away(alias)


# How many times a connection of the async jobs' thread (asgiref's ``sync_to_async`` thread,
# ``mark_async_jobs_thread()``) to each alias was dropped and opened again: by
# ``async_database_away()`` dropping a broken one, or by Django, which drops a connection whose
# atomic() block ended in a broken state and opens another for the next query. Only that
# thread writes; any thread may read.
_async_replaced: Counter[str] = Counter()


def async_replaced(alias: str) -> int:
    """How many times the async jobs' thread has had its connection to ``alias`` dropped or
    replaced so far (read as an async job starts, for ``async_database_away()``)."""
    return _async_replaced[alias]


def async_database_away(alias: str, replaced: int) -> bool:
    """``queue_database_away()`` for an async job whose error says a database is unavailable,
    called on asgiref's ``sync_to_async`` thread, where the async ORM calls of every async job
    of the process run, on one connection per alias that outlives them all. ``replaced``:
    ``async_replaced()`` as the job started.

    Nothing tidies that thread between jobs, so what broke is mended here: a broken
    connection is dropped (the next query opens a fresh one), and a broken connection to the
    queue's database is the outage; so is one dropped or replaced since the job started (the
    jobs that met the same broken connection learn it from the first one to look, and a job
    whose query broke inside ``atomic()`` finds the fresh connection Django opened in its
    place). Otherwise a fresh connection decides, as for a sync job."""
    connection = connections[alias].connection
    if connection is not None and connection.broken:
        reset(alias)
        _async_replaced[alias] += 1
    tidy()
    return _async_replaced[alias] != replaced or probe_away(alias)


def probe_away(alias: str) -> bool:
    """Whether a fresh connection to ``alias`` cannot be opened in 5 s, or finds a server
    that cannot write (a standby after a failover)."""
    try:
        with psycopg.connect(
            **connection_params(alias, "pgjobs-probe"), autocommit=True, connect_timeout=5
        ) as probe:
            row = probe.execute(READ_ONLY).fetchone()
    except psycopg.Error:
        return True
    return bool(row and row[0])


def reset(alias: str) -> None:
    """Drop this thread's connection to ``alias`` so the next query opens a fresh one."""
    try:
        connections[alias].close()
    except DatabaseError:
        logger.debug("closing a broken connection to %s failed", alias, exc_info=True)
    _opened.dropped = getattr(_opened, "dropped", set()) | {alias}


class ReconnectBackoff:
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
            reason(exc),
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
    _tidy(connections.all(initialized_only=True))


def tidy_opened() -> None:
    """``tidy()`` of the connections this thread opened, after a lease-mode job that ended
    without an error (completed or snoozed).

    ``tidy()`` looks up every alias in ``DATABASES`` on asgiref's ``Local`` behind
    ``connections``, which costs 2 to 3 µs per alias, most for the aliases this thread never
    used: with three aliases, a tenth of a no-op job's time in the worker. The connections a
    job can leave broken, mid-transaction or too old are ones this thread opened (Django sends
    ``connection_created`` for each), so only those are looked at, and each is forgotten once
    it is closed (opened again, it is recorded again).

    One is missed: a connection whose set-up failed after it was opened (an error in
    Django's session set-up or in a ``connection_created`` receiver before ours), in a job
    that swallowed that error. A job that raised it gets ``tidy()``. Otherwise it is not
    closed for its age until a job on this thread raises, and the next job to query it here
    meets it broken: an error it did not earn, counted as its failure, or as an outage
    release when the alias is the queue's; that job gets ``tidy()``.
    """
    wrappers: weakref.WeakValueDictionary[int, Any] | None = getattr(_opened, "wrappers", None)
    if not wrappers:
        return
    opened = list(wrappers.items())
    _tidy(connection for _, connection in opened)
    for key, connection in opened:
        if connection.connection is None:
            del wrappers[key]


def _tidy(wrappers: Iterable[Any]) -> None:
    for connection in wrappers:
        if connection.settings_dict.get("CONN_MAX_AGE") == 0:
            connection.close_at = None
        connection.close_if_unusable_or_obsolete()
