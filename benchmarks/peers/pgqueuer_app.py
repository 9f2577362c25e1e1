"""The pgqueuer worker of the peer benchmark: ``python pgqueuer_app.py {drain,continuous}``.

The factory ``main`` connects to PEERS_DSN (asyncpg) and registers two entrypoints: ``noop``
(W1) and ``stamp`` (W3: writes ``seq time.time()`` to the file named in its payload, first
thing). Run with pgqueuer's own virtualenv.

The worker is started through ``pgqueuer.run(factory, ...)``, the library's documented way to
run what ``pgq run`` runs, on uvloop as ``pgq run`` does: the ``pgq run`` command of pgqueuer
1.6.0 fails before starting with the typer release pip installs beside it (its ``--log-level``
option reaches ``setup_fancy_logger`` as a str). Nothing configures logging, so pgqueuer logs
at Python's default WARNING, as the django-pgjobs workers of the suite do.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta

import asyncpg
import pgqueuer
from pgqueuer import PgQueuer
from pgqueuer.models import Job
from pgqueuer.types import QueueExecutionMode

BATCH_SIZE = 10  # pgqueuer's default (``pgq run --batch-size``)


@asynccontextmanager
async def main() -> AsyncIterator[PgQueuer]:
    connection = await asyncpg.connect(os.environ["PEERS_DSN"])
    pgq = PgQueuer.from_asyncpg_connection(connection)

    @pgq.entrypoint("noop")
    async def noop(job: Job) -> None:
        return None

    @pgq.entrypoint("stamp")
    async def stamp(job: Job) -> None:
        started = time.time()
        seq, out = json.loads(job.payload or b"{}").values()
        fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{seq} {started!r}\n".encode())
        finally:
            os.close(fd)

    try:
        yield pgq
    finally:
        await connection.close()


def run(mode: str) -> None:
    worker = pgqueuer.run(
        main,
        mode=QueueExecutionMode[mode],
        batch_size=BATCH_SIZE,
        dequeue_timeout=timedelta(seconds=30),
    )
    try:
        import uvloop
    except ImportError:
        asyncio.run(worker)
    else:
        uvloop.run(worker)


if __name__ == "__main__":
    run(sys.argv[1] if len(sys.argv) > 1 else "continuous")
