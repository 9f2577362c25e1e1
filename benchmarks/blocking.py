"""Who waits on whom while N claimers drain one queue: the claimers section, looked into.

Not part of ``benchmarks.run``: a diagnostic to run by hand against a database of your own
that has the schema (``manage.py migrate``); it empties ``pgjobs_job`` first::

    DATABASE_URL=postgres://... DJANGO_SETTINGS_MODULE=benchmarks.settings \\
        python -m benchmarks.blocking [--claimers 64] [--jobs 20000]

While ``benchmarks.claimers.drain`` runs, a second connection samples, every 50 ms, each
backend waiting on a heavyweight lock with the statement that blocks it
(``pg_blocking_pids``), and every 200 ms the row locks on the table (the ``pgrowlocks``
extension, created if it is missing: that needs the right to create it) with the status of
the locked row and the statement its holder runs. Twice during the run it ``EXPLAIN
ANALYZE``s the real ``claim.CLAIM`` in a transaction it rolls back, so its rows stay queued.
"""

from __future__ import annotations

import argparse
import os
import threading
from collections import Counter
from typing import Any

import django

django.setup()

import psycopg  # noqa: E402

from benchmarks.claimers import drain  # noqa: E402
from benchmarks.db import TASK, Admin  # noqa: E402
from django_pgjobs import registry  # noqa: E402
from django_pgjobs.core import claim, conf, execute  # noqa: E402
from django_pgjobs.models import Job  # noqa: E402

STATEMENT = """CASE WHEN {0}.query LIKE '%jsonb_to_recordset%' THEN 'complete'
                    WHEN {0}.query LIKE '%SKIP LOCKED%' THEN 'claim' ELSE 'other' END"""

# Each backend waiting on a lock, its statement, and the statement and state of its blocker.
BLOCKED = f"""
SELECT {STATEMENT.format("w")}, w.wait_event, {STATEMENT.format("b")},
       coalesce(b.wait_event_type || ':' || b.wait_event, 'on CPU')
FROM pg_stat_activity w
CROSS JOIN LATERAL unnest(pg_blocking_pids(w.pid)) AS blocker(pid)
JOIN pg_stat_activity b ON b.pid = blocker.pid
WHERE w.datname = current_database() AND w.wait_event_type = 'Lock'
"""

# The row locks on the table: the locked row's status, the lock's modes, the holder's statement.
ROW_LOCKS = f"""
SELECT j.status, r.modes::text, {STATEMENT.format("a")}, count(*)
FROM pgrowlocks('pgjobs_job') r
JOIN pgjobs_job j ON j.ctid = r.locked_row
LEFT JOIN pg_stat_activity a ON a.pid = ANY(r.pids)
GROUP BY 1, 2, 3
"""


class Watcher(threading.Thread):
    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.stop = threading.Event()
        self.blocked: Counter[str] = Counter()
        self.row_locks: Counter[str] = Counter()
        self.plans: list[str] = []

    def run(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            tick = 0
            while not self.stop.wait(0.05):
                tick += 1
                for row in conn.execute(BLOCKED).fetchall():
                    self.blocked[" | ".join(map(str, row))] += 1
                if tick % 4 == 0:
                    for *key, count in conn.execute(ROW_LOCKS).fetchall():
                        self.row_locks[" | ".join(map(str, key))] += count
                if tick in (10, 30):
                    self.plans.append(explain_claim(conn))


def explain_claim(conn: psycopg.Connection[Any]) -> str:
    """EXPLAIN ANALYZE of a busy worker's claim of 10, rolled back."""
    params = {
        "queue": conf.default_queue(),
        "limit": 10,
        "lease": conf.lease(),
        "worker_id": "blocking",
        "synchronous_commit": None,
        "suspects": False,
        "tasks": execute.TextArray.of(registry.names()) if conf.claim_registered_only() else None,
    }
    with conn.transaction(force_rollback=True):
        rows = conn.execute(
            "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF, TIMING OFF) " + claim.CLAIM, params
        ).fetchall()
    return "\n".join(row[0] for row in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--claimers", type=int, default=64, help="claimer threads (default 64)")
    parser.add_argument("--jobs", type=int, default=20_000, help="jobs to drain (default 20,000)")
    args = parser.parse_args()
    url = os.environ["DATABASE_URL"]  # the testproject settings' default alias, as a URL
    admin = Admin(url)
    admin.run("CREATE EXTENSION IF NOT EXISTS pgrowlocks")
    admin.truncate()
    Job.objects.enqueue_many(TASK, [{"n": i} for i in range(args.jobs)])
    admin.run("ANALYZE pgjobs_job")
    watcher = Watcher(url)
    watcher.start()
    result = drain(
        alias="default",
        queue=conf.default_queue(),
        jobs=args.jobs,
        claimers=args.claimers,
        batch=10,
    )
    watcher.stop.set()
    watcher.join()
    admin.check_all_done(args.jobs, 0, "blocking")
    admin.truncate()
    print(
        f"{args.claimers} claimers: {result['jobs_per_s']:,.0f} jobs/s, claim p50 "
        f"{result['claim_p50_ms']:.1f} ms, p99 {result['claim_p99_ms']:.1f} ms, "
        f"{result['short_pct']:.1f}% short"
    )
    print("\nwaiting statement | its lock | blocking statement | the blocker's wait: samples")
    for key, count in watcher.blocked.most_common():
        print(f"  {key}: {count}")
    print("\nrow status | lock modes | holder's statement: rows, summed over the samples")
    for key, count in watcher.row_locks.most_common():
        print(f"  {key}: {count}")
    for plan in watcher.plans:
        print("\n" + plan)


if __name__ == "__main__":
    main()
