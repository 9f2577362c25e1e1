"""NOTIFY after commit: a hint to listening workers that a queue has work.

The payload is the queue name, never the job. One notification per queue per transaction,
sent from an ``on_commit`` hook, so a rolled-back enqueue sends nothing and a worker is never
woken for a row it cannot see yet. A NOTIFY that fails after the commit is logged, not
raised: the job is already safe in the table and the worker's poll will find it.
"""

from __future__ import annotations

import logging

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
