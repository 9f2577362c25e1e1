"""The claimers section: N threads, each on its own connection, draining one queue.

Each thread claims with the worker's own ``Store`` (direct psycopg connection, the worker's
``PREPARE``, ``WORKER_SYNCHRONOUS_COMMIT``, lease and registry filter) the way a busy worker
claims an unguarded queue (``claim.CLAIM``, suspects left out), then completes what it got with
the fenced ``finish.COMPLETE``, until every job of the queue has been claimed. Python's GIL is
released while a thread waits for the server, so the threads wait on the database side by
side; what they cost in Python is the same per claim for every count.

A claim is *short* when it returned fewer rows than it asked for while every claimer could
have a whole batch in flight and as many rows would still be left (at least claimers x batch
not yet claimed by any claim that had returned): the rows it missed were locked by claims in
flight (``SKIP LOCKED`` passed them over). Near the end of the drain, fewer rows remain than
the claims in flight hold, and a claim that comes back short or empty there says nothing
about contention: those are not counted. An *empty* claim is a short one with no row at all.
While the claimers run, a sampler reads ``pg_stat_activity`` and ``pg_locks`` every
``SAMPLE_GAP`` seconds: what the claimers' backends were waiting on.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import psycopg

from benchmarks.db import BenchAbort
from django_pgjobs.core import conf, registry
from django_pgjobs.core.connections import connection_params
from django_pgjobs.core.types import default_worker_id
from django_pgjobs.worker.store import Store

SAMPLE_GAP = 0.05  # seconds between two samples of the backends' wait events

# What every other backend of the bench database is doing: which of the two statements it
# runs, its wait event (none while it runs on a CPU), and how many lock requests of the
# server are waiting.
WAITS = """
SELECT CASE WHEN query LIKE '%SKIP LOCKED%' THEN 'claim'
            WHEN query LIKE '%jsonb_to_recordset%' THEN 'complete'
            ELSE 'other' END
       || ' ' || coalesce(wait_event_type || ':' || wait_event, 'on CPU'),
       count(*),
       (SELECT count(*) FROM pg_locks WHERE NOT granted)
FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid() AND state = 'active'
  AND backend_type = 'client backend'
GROUP BY 1
"""


@dataclass
class Tally:
    """What the claimers share: how many rows have been claimed, by claims that returned."""

    jobs: int
    claimed: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def unclaimed(self) -> int:
        with self.lock:
            return self.jobs - self.claimed

    def add(self, count: int) -> None:
        with self.lock:
            self.claimed += count


@dataclass
class Claimer:
    """One thread's claims: their latencies (ms) and how many came back short or empty."""

    number: int
    latencies: list[float] = field(default_factory=list)
    short: int = 0
    empty: int = 0
    completed: int = 0
    error: BaseException | None = None


class Sampler(threading.Thread):
    """Samples the claimers' wait events on a connection of its own until stopped."""

    def __init__(self, alias: str) -> None:
        super().__init__(daemon=True)
        self.alias = alias
        self.stop = threading.Event()
        self.events: Counter[str] = Counter()
        self.samples = 0
        self.waiting_locks = 0

    def run(self) -> None:
        with psycopg.connect(**connection_params(self.alias), autocommit=True) as conn:
            while not self.stop.wait(SAMPLE_GAP):
                rows = conn.execute(WAITS).fetchall()
                self.samples += 1
                for event, count, _waiting in rows:
                    self.events[event] += count
                if rows:
                    self.waiting_locks += rows[0][2]


def drain(
    *, alias: str, queue: str, jobs: int, claimers: int, batch: int, timeout: float = 600.0
) -> dict[str, Any]:
    """Drain ``jobs`` ready jobs of ``queue`` with ``claimers`` threads; return the figures.

    Raises BenchAbort when a claim or a complete fails, when a complete does not change every
    row it was given (a fence that did not match its own claim), or when the queue does not
    drain within the time limit.
    """
    store = Store(
        alias,
        direct=True,
        synchronous_commit=conf.worker_synchronous_commit(),
        prepare=conf.prepare(),
        tasks=registry.names() if conf.claim_registered_only() else None,
    )
    lease = conf.lease()
    tally = Tally(jobs)
    start = threading.Barrier(claimers + 1)
    deadline = time.monotonic() + timeout
    worker_id = default_worker_id()

    def claim_until_drained(me: Claimer) -> None:
        try:
            if store.direct is not None:
                store.direct.get()  # this thread's connection, opened before the clock
            start.wait()
            while (before := tally.unclaimed()) > 0:
                if time.monotonic() > deadline:
                    raise BenchAbort(
                        f"claimers: {before} jobs still unclaimed after {timeout:.0f} s"
                    )
                t0 = time.perf_counter()
                got = store.claim(queue, batch, lease, f"{worker_id}:c{me.number}", suspects=False)
                me.latencies.append((time.perf_counter() - t0) * 1000)
                tally.add(len(got))
                if before >= claimers * batch and len(got) < batch:
                    me.short += 1
                    me.empty += not got
                if not got:
                    continue
                done = store.complete(got, {})
                if len(done) != len(got):
                    raise BenchAbort(
                        f"claimers: complete changed {len(done)} of the {len(got)} rows its "
                        "claim took: the fence did not match the claim"
                    )
                me.completed += len(done)
        except BaseException as exc:  # reported by the main thread
            me.error = exc
            start.abort()
        finally:
            store.close()

    threads = [Claimer(number) for number in range(claimers)]
    runners = [
        threading.Thread(target=claim_until_drained, args=(me,), daemon=True) for me in threads
    ]
    sampler = Sampler(alias)
    for runner in runners:
        runner.start()
    try:
        start.wait()
    except threading.BrokenBarrierError:
        pass
    began, cpu_began = time.perf_counter(), time.process_time()
    sampler.start()
    for runner in runners:
        runner.join()
    seconds, driver_cpu = time.perf_counter() - began, time.process_time() - cpu_began
    sampler.stop.set()
    sampler.join()
    # A failed claimer breaks the start barrier: the others' BrokenBarrierError is not news.
    errors = sorted(
        (me.error for me in threads if me.error is not None),
        key=lambda exc: isinstance(exc, threading.BrokenBarrierError),
    )
    if errors:
        if isinstance(errors[0], BenchAbort):
            raise errors[0]
        raise BenchAbort(f"claimers: a claimer failed: {errors[0]!r}") from errors[0]
    latencies = sorted(ms for me in threads for ms in me.latencies)
    claims = len(latencies)
    short = sum(me.short for me in threads)
    empty = sum(me.empty for me in threads)
    completed = sum(me.completed for me in threads)
    if completed != jobs:
        raise BenchAbort(f"claimers: {completed} jobs completed, {jobs} enqueued")
    cuts = statistics.quantiles(latencies, n=100, method="inclusive")
    busy = sum(sampler.events.values())
    return {
        "jobs": jobs,
        "claimers": claimers,
        "batch": batch,
        "seconds": seconds,
        "jobs_per_s": jobs / seconds,
        "driver_cpu_s": driver_cpu,
        "claims": claims,
        "claim_p50_ms": cuts[49],
        "claim_p99_ms": cuts[98],
        "claim_max_ms": latencies[-1],
        "short": short,
        "empty": empty,
        "short_pct": 100.0 * short / claims,
        "empty_pct": 100.0 * empty / claims,
        "samples": sampler.samples,
        "waits": {
            event: round(100.0 * count / busy, 1) for event, count in sampler.events.most_common()
        },
        "active_per_sample": busy / sampler.samples if sampler.samples else None,
        "lock_waits_per_sample": (
            sampler.waiting_locks / sampler.samples if sampler.samples else None
        ),
    }
