"""NOTIFY after commit: a hint to listening workers that a queue has work.

The payload is the queue name, never the job. One notification per queue per transaction,
sent from an ``on_commit`` hook, so a rolled-back enqueue sends nothing and a worker is never
woken for a row it cannot see yet. A NOTIFY that fails after the commit is logged, not
raised: the job is already safe in the table and the worker's poll will find it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

import psycopg
from django.db import DatabaseError, connections, transaction

from django_pgjobs import conf, sql

logger = logging.getLogger(__name__)


class _Notify:
    """The on_commit callback for one queue on one alias; equal ones are registered once."""

    __slots__ = ("alias", "queue")

    def __init__(self, alias: str, queue: str) -> None:
        self.alias = alias
        self.queue = queue

    def __call__(self) -> None:
        try:
            sql.run(
                connections[self.alias],
                sql.NOTIFY,
                {"channel": conf.channel(), "queue": self.queue},
            )
        except DatabaseError:
            logger.warning(
                "NOTIFY for queue %s failed after commit; workers will find the job by polling",
                self.queue,
                exc_info=True,
                extra={"action": "notify", "queue": self.queue},
            )

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, _Notify) and (other.alias, other.queue) == (self.alias, self.queue)
        )

    def __hash__(self) -> int:
        return hash((self.alias, self.queue))


def notify_on_commit(alias: str, queue: str) -> None:
    """Wake workers of ``queue`` when the current transaction commits (at once in autocommit)."""
    callback = _Notify(alias, queue)
    connection = connections[alias]
    # Django keeps pending hooks as (savepoint ids, callable, robust); a hook registered in a
    # savepoint that rolls back is dropped with it, so this never suppresses a needed NOTIFY.
    if connection.in_atomic_block and any(
        entry[1] == callback for entry in connection.run_on_commit
    ):
        return
    transaction.on_commit(callback, using=alias)


# Options Django understands but libpq does not.
_DJANGO_ONLY_OPTIONS = {"isolation_level", "server_side_binding", "assume_role", "pool"}


def connection_params(alias: str) -> dict[str, Any]:
    """libpq parameters for a direct psycopg connection to the server behind ``alias``."""
    settings_dict = connections[alias].settings_dict
    params: dict[str, Any] = {
        "dbname": settings_dict["NAME"],
        "user": settings_dict.get("USER") or None,
        "password": settings_dict.get("PASSWORD") or None,
        "host": settings_dict.get("HOST") or None,
        "port": settings_dict.get("PORT") or None,
        # Notice a half-open socket without sending a query (which would keep serverless
        # compute awake): the kernel probes an idle connection and fails it if unanswered.
        "keepalives": 1,
        "keepalives_idle": 60,
        "keepalives_interval": 10,
        "keepalives_count": 3,
        "application_name": "pgjobs-listener",
    }
    params.update(
        (key, value)
        for key, value in settings_dict.get("OPTIONS", {}).items()
        if key not in _DJANGO_ONLY_OPTIONS
    )
    return {key: value for key, value in params.items() if value is not None}


class Listener(threading.Thread):
    """Holds ``LISTEN <channel>`` on its own direct connection and wakes the worker.

    ``on_wake`` is called for every notification naming one of ``queues``, and once after
    each (re)connect: notifications sent while we were not listening are lost, so the worker
    must look at the table at once (the catch-up claim). A notification is only a hint.

    The connection is probed with ``SELECT 1`` when the worker asks (``probe()``, on its
    periodic tick, so the probe never adds a wake-up of its own); a dead connection is
    replaced, with backoff, until ``stop()``.
    """

    def __init__(
        self,
        alias: str,
        queues: Iterable[str],
        on_wake: Callable[[], None],
    ) -> None:
        super().__init__(name="pgjobs-listener", daemon=True)
        self.alias = alias
        self.queues = frozenset(queues)
        self.on_wake = on_wake
        self._stopping = threading.Event()
        self._probe = threading.Event()

    def stop(self) -> None:
        self._stopping.set()

    def probe(self) -> None:
        """Check the connection at the next chance (within a second)."""
        self._probe.set()

    def run(self) -> None:
        delay = 0.0
        params = connection_params(self.alias)
        channel = conf.channel()
        while not self._stopping.is_set():
            try:
                with psycopg.connect(**params, autocommit=True) as conn:
                    conn.execute(sql.listen(channel))
                    if delay:
                        logger.warning(
                            "LISTEN connection re-established on %s", self.alias,
                            extra={"action": "listen"},
                        )
                    delay = 0.0
                    self.on_wake()
                    self._listen(conn)
            except psycopg.Error as exc:
                if self._stopping.is_set():
                    return
                delay = min(max(delay * 2, 0.5), 30.0)
                reason = str(exc).strip()
                logger.warning(
                    "LISTEN connection to %s lost (%s); reconnecting in %.1f s",
                    self.alias, reason.splitlines()[0] if reason else type(exc).__name__, delay,
                    extra={"action": "listen"},
                )
                self._stopping.wait(delay)

    def _listen(self, conn: psycopg.Connection[Any]) -> None:
        while not self._stopping.is_set():
            # Wake at least once a second to notice stop() and probe(); waiting sends nothing.
            for note in conn.notifies(timeout=1.0):
                if note.payload in self.queues:
                    self.on_wake()
            if self._probe.is_set():
                self._probe.clear()
                conn.execute(sql.PROBE)

