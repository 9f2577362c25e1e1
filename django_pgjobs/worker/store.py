"""Where a worker's claims and fenced writes run, and how durably they commit.

A lease-mode worker runs its hot statements on its own direct psycopg connections, one per
thread (``connections.DirectConnections``), optionally prepared, with
``PGJOBS["WORKER_SYNCHRONOUS_COMMIT"]`` applied per statement. In transaction mode they run on
the thread's Django connection, inside the job's transaction, with the server's durability.
``Job.objects`` knows nothing of this: both run the same statements (``core``).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from django.db import connections

from django_pgjobs.core import claim, conf, execute, finish, schedules, upkeep
from django_pgjobs.core.claim import Outlook
from django_pgjobs.core.connections import DirectConnections
from django_pgjobs.core.types import Claim, ClaimedJob, FailedAttempt, Reaped


class Store:
    """The worker's statements on ``alias``: on direct connections when ``direct``."""

    def __init__(
        self,
        alias: str,
        *,
        direct: bool,
        synchronous_commit: str | None,
        prepare: bool,
        tasks: Sequence[str] | None = None,
    ) -> None:
        self.alias = alias
        # The tasks the claims may take (the worker's registry), or None for any; as the
        # claims send them.
        self.tasks = tasks
        self._tasks = None if tasks is None else execute.TextArray.of(tasks)
        self.synchronous_commit = synchronous_commit
        self.direct = DirectConnections(alias, prepare=prepare) if direct else None

    def _connection(self) -> tuple[execute.Connection, str | None]:
        """This thread's connection, and the commit setting its statements may use."""
        if self.direct is not None:
            return self.direct.cursor(), self.synchronous_commit
        connection = connections[self.alias]
        # Inside atomic() (transaction mode) the caller's transaction keeps its durability.
        mine = connection.get_autocommit() and not connection.in_atomic_block
        return connection, self.synchronous_commit if mine else None

    def close(self) -> None:
        """Close this thread's direct connection (a fresh one is opened when next needed)."""
        if self.direct is not None:
            self.direct.close()

    def claim(
        self,
        queue: str,
        limit: int,
        lease: timedelta,
        worker_id: str,
        *,
        suspects: bool = True,
        guarded: bool = False,
        idle: bool = False,
        tasks: execute.TextArray | None = None,
    ) -> list[ClaimedJob]:
        """Claim through ``claim.claim``; ``tasks``, when given, narrows the claim to
        those tasks instead of the store's own (the worker's registry, or any)."""
        connection, commit = self._connection()
        return claim.claim(
            connection,
            queue=queue,
            limit=limit,
            lease=lease,
            worker_id=worker_id,
            synchronous_commit=commit,
            suspects=suspects,
            tasks=self._tasks if tasks is None else tasks,
            guarded=guarded,
            idle=idle,
        )

    def claim_completing(
        self,
        queue: str,
        limit: int,
        lease: timedelta,
        worker_id: str,
        jobs: Iterable[Claim],
        results: dict[int, Any],
        *,
        tasks: execute.TextArray | None = None,
    ) -> tuple[list[ClaimedJob], set[int]]:
        """A busy claim that completes ``jobs`` in the same statement
        (``claim.claim_completing``): the jobs claimed, the ids completed."""
        connection, commit = self._connection()
        return claim.claim_completing(
            connection,
            queue=queue,
            limit=limit,
            lease=lease,
            worker_id=worker_id,
            synchronous_commit=commit,
            tasks=self._tasks if tasks is None else tasks,
            jobs=jobs,
            results=results,
        )

    def complete(self, jobs: Iterable[Claim], results: dict[int, Any]) -> set[int]:
        connection, commit = self._connection()
        return finish.complete(connection, jobs, results, synchronous_commit=commit)

    def fail(self, attempts: Sequence[FailedAttempt]) -> dict[int, str]:
        connection, commit = self._connection()
        return finish.fail(connection, attempts, synchronous_commit=commit)

    def snooze(self, snoozes: Sequence[tuple[Claim, float]]) -> set[int]:
        connection, commit = self._connection()
        return finish.snooze(connection, snoozes, synchronous_commit=commit)

    def release(self, jobs: Iterable[Claim], *, outage: bool = False) -> set[int]:
        connection, commit = self._connection()
        return finish.release(connection, jobs, outage=outage, synchronous_commit=commit)

    def extend_lease(self, jobs: Collection[Claim], lease: timedelta) -> set[int]:
        connection, commit = self._connection()
        return finish.extend_lease(connection, jobs, lease, synchronous_commit=commit)

    def cancelled_among(self, jobs: Collection[Claim]) -> set[int]:
        return finish.cancelled_among(self._connection()[0], jobs)

    def reap(self) -> list[Reaped]:
        return upkeep.reap(self._connection()[0], max_crashes=conf.max_crashes())

    def wake_freed(self, job_ids: Collection[int]) -> None:
        finish.wake_freed(self._connection()[0], job_ids, channel=conf.channel())

    def outlook(self, queues: Sequence[str], since: float) -> Outlook:
        return claim.outlook(self._connection()[0], queues, since)

    def beat(self, record: Mapping[str, Any]) -> None:
        """Write this worker's registry row (``upkeep.WORKER_BEAT``), or refresh it."""
        execute.run(self._connection()[0], upkeep.WORKER_BEAT, record)

    def gone(self, worker_id: str) -> None:
        """Delete this worker's registry row (a clean exit)."""
        execute.run(self._connection()[0], upkeep.WORKER_GONE, {"worker_id": worker_id})

    def database_now(self) -> datetime:
        return schedules.database_now(self._connection()[0])

    def enqueue_tick(self, schedule: schedules.Schedule, tick: datetime) -> int | None:
        return schedules.enqueue_tick(self._connection()[0], schedule, tick)

    def record_tick_failure(self, schedule: schedules.Schedule, error: str) -> None:
        schedules.record_failure(self._connection()[0], schedule, error)
