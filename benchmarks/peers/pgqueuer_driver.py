"""The pgqueuer driver of the peer benchmark, run with pgqueuer's own virtualenv's Python.

    python pgqueuer_driver.py {setup,version,w1,w2-single,w2-bulk,w3} --dsn postgres://... \
        [--jobs N] [--concurrency 8] [--latency-jobs 200] [--gap 0.05] [--warmup 5]

Prints one JSON object on stdout; exits 2 when the run is invalid (a job lost, repeated or
failed). The worker is ``python pgqueuer_app.py drain|continuous``: ``pgqueuer.run()`` with
the factory in ``pgqueuer_app.py`` and the asyncpg driver. See README.md beside this file.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from importlib.metadata import version
from typing import Any

import asyncpg
from _common import (
    Reaper,
    RunInvalid,
    empty_run_cpu,
    install,
    main_guard,
    parser,
    rate,
    run_workers,
    spawn,
    w1_result,
    w3_run,
    worker_env,
)
from pgqueuer.db import AsyncpgDriver
from pgqueuer.queries import Queries
from pgqueuer_app import BATCH_SIZE


def worker_command(args: Any, mode: str) -> list[str]:
    return [sys.executable, "pgqueuer_app.py", mode]


async def connect(dsn: str) -> asyncpg.Connection:
    return await asyncpg.connect(dsn)


async def reset(conn: asyncpg.Connection) -> None:
    await conn.execute("TRUNCATE pgqueuer, pgqueuer_log, pgqueuer_statistics")
    await checkpoint(conn)


async def checkpoint(conn: asyncpg.Connection) -> None:
    try:
        await conn.execute("CHECKPOINT")
    except asyncpg.InsufficientPrivilegeError:
        pass


async def check_done(conn: asyncpg.Connection, ids: list[int], what: str) -> None:
    """Every job ran once and succeeded: one 'picked' and one 'successful' log row each."""
    left = await conn.fetchval("SELECT count(*) FROM pgqueuer")
    rows = await conn.fetch(
        "SELECT status::text, count(*) AS n, count(DISTINCT job_id) AS jobs FROM pgqueuer_log "
        "WHERE job_id = ANY($1::bigint[]) GROUP BY 1",
        ids,
    )
    by = {r["status"]: (r["n"], r["jobs"]) for r in rows}
    n = len(ids)
    ok = (
        left == 0
        and by.get("successful") == (n, n)
        and by.get("picked") == (n, n)
        and set(by) <= {"queued", "picked", "successful"}
    )
    if not ok:
        raise RunInvalid(
            f"{what}: expected {n} jobs picked once and successful, found "
            f"{left} left in the queue and log (rows, jobs) {by}"
        )


async def check_queued(conn: asyncpg.Connection, n: int, what: str) -> None:
    found = await conn.fetchval("SELECT count(*) FROM pgqueuer WHERE status = 'queued'")
    if found != n:
        raise RunInvalid(f"{what}: {found} queued jobs in the table, expected {n}")


def payload(i: int) -> bytes:
    return json.dumps({"n": i}).encode()


async def w1(args: Any) -> dict[str, Any]:
    n = args.jobs
    conn = await connect(args.dsn)
    try:
        await reset(conn)
        queries = Queries(AsyncpgDriver(conn))
        ids = await queries.enqueue(["noop"] * n, [payload(i) for i in range(n)], [0] * n)
        await conn.execute("ANALYZE pgqueuer")
        await checkpoint(conn)
        commands, env = [worker_command(args, "drain")], worker_env(args.dsn)
        spawned, exited, cpu = await asyncio.to_thread(run_workers, commands, env)
        await check_done(conn, list(ids), "W1")
        first, last = await conn.fetchrow(
            "SELECT extract(epoch FROM min(created) FILTER (WHERE status = 'picked'))::float8, "
            "extract(epoch FROM max(created) FILTER (WHERE status = 'successful'))::float8 "
            "FROM pgqueuer_log"
        )
        await reset(conn)
        empty_cpu = await asyncio.to_thread(empty_run_cpu, commands, env)
    finally:
        await conn.close()
    return w1_result(
        jobs=n,
        concurrency=None,
        processes=1,
        spawned=spawned,
        first_start=first,
        last_done=last,
        exited=exited,
        cpu_s=cpu,
        empty_cpu_s=empty_cpu,
        batch_size=BATCH_SIZE,
        mode="drain",
    )


async def w2_single(args: Any) -> dict[str, Any]:
    n = args.jobs
    conn = await connect(args.dsn)
    try:
        await reset(conn)
        queries = Queries(AsyncpgDriver(conn))
        started = time.perf_counter()
        for i in range(n):
            await queries.enqueue("noop", payload(i))
        seconds = time.perf_counter() - started
        await check_queued(conn, n, "W2 single")
        await reset(conn)
    finally:
        await conn.close()
    return rate(n, seconds, api="await Queries.enqueue(entrypoint, payload)")


async def w2_bulk(args: Any) -> dict[str, Any]:
    n = args.jobs
    conn = await connect(args.dsn)
    try:
        await reset(conn)
        queries = Queries(AsyncpgDriver(conn))
        entrypoints, payloads, priorities = ["noop"] * n, [payload(i) for i in range(n)], [0] * n
        started = time.perf_counter()
        ids = await queries.enqueue(entrypoints, payloads, priorities)
        seconds = time.perf_counter() - started
        if len(ids) != n:
            raise RunInvalid(f"W2 bulk: enqueue returned {len(ids)} ids, expected {n}")
        await check_queued(conn, n, "W2 bulk")
        await reset(conn)
    finally:
        await conn.close()
    return rate(n, seconds, api="await Queries.enqueue([entrypoints], [payloads], [priorities])")


def w3(args: Any) -> dict[str, Any]:
    loop = asyncio.new_event_loop()
    conn = loop.run_until_complete(connect(args.dsn))
    queries = Queries(AsyncpgDriver(conn))
    ids: list[int] = []

    async def enqueue(seq: int, out: str) -> float:
        [job_id] = await queries.enqueue("stamp", json.dumps({"seq": seq, "out": out}).encode())
        committed = time.time()  # asyncpg autocommits: the INSERT (and NOTIFY) has committed
        ids.append(job_id)
        return committed

    def start() -> Reaper:
        return Reaper(spawn(worker_command(args, "continuous"), worker_env(args.dsn)))

    try:
        loop.run_until_complete(reset(conn))
        result = w3_run(
            args,
            start,
            lambda seq, out: loop.run_until_complete(enqueue(seq, out)),
            listen_notify=True,
        )
        loop.run_until_complete(check_done(conn, ids, "W3"))
        loop.run_until_complete(reset(conn))
    finally:
        loop.run_until_complete(conn.close())
        loop.close()
    return result


def setup(args: Any) -> dict[str, Any]:
    command = [sys.executable, "-m", "pgqueuer", "--pg-dsn", args.dsn, "install"]
    return install(command, dict(os.environ), "pgqueuer install")


def main() -> None:
    args = parser("pgqueuer driver of the django-pgjobs peer benchmark").parse_args()
    commands = {
        "setup": lambda: setup(args),
        "version": lambda: {
            "version": version("pgqueuer"),
            "asyncpg": version("asyncpg"),
            "python": sys.version.split()[0],
        },
        "w1": lambda: asyncio.run(w1(args)),
        "w2-single": lambda: asyncio.run(w2_single(args)),
        "w2-bulk": lambda: asyncio.run(w2_bulk(args)),
        "w3": lambda: w3(args),
    }
    main_guard(commands[args.command])


if __name__ == "__main__":
    main()
