"""How much does a completion riding with the next claim save, statement against statement?

Not part of ``benchmarks.run``: a probe to run by hand against a scratch database that has
the schema (``manage.py migrate``), on this machine (the server's CPU is read from ``/proc``).
It empties ``pgjobs_job`` (``TRUNCATE``) before each round and at the end::

    DATABASE_URL=postgres://... DJANGO_SETTINGS_MODULE=benchmarks.settings \\
        python -m benchmarks.combined [--jobs N] [--batch 8] [--rounds 7]

One connection, prepared statements and the worker's commit setting, as the worker's own
connections run them, drains ``--jobs`` queued no-op jobs ``--batch`` at a time in two ways,
taking turns round by round:

- *two statements*: the fenced ``finish.COMPLETE`` of the previous batch, then ``claim.CLAIM``
  of the next, each its own transaction (the worker's completer and producer, one after the
  other);
- *one statement*: ``claim.CLAIM_COMPLETING``, the same ``COMPLETE`` as a data-modifying CTE
  of the same claim, as a busy worker's completions ride with its next claim.

It prints, per job, the median over the rounds of the wall time and of the server backend's
CPU time (user + system, from ``/proc/<pid>/stat``, in clock ticks of 10 ms: hence the
thousands of jobs), and checks that every job ended done after one attempt.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import django

django.setup()

import psycopg  # noqa: E402

from django_pgjobs.core import claim, finish  # noqa: E402
from django_pgjobs.core.connections import connection_params  # noqa: E402

TASK = "testproject.testjobs.noop"
TICK = os.sysconf("SC_CLK_TCK")

# The claim's and the completion's parameters but the claims: a busy worker's, on the default
# queue, committing as the worker does by default.
BASE: dict[str, Any] = {
    "queue": "default",
    "lease": "5 minutes",
    "worker_id": "combined-probe",
    "suspects": False,
    "tasks": None,
    "synchronous_commit": "off",
}

FILL = """
INSERT INTO pgjobs_job (queue, task, payload, priority, max_attempts, run_at)
SELECT 'default', %(task)s, '{}'::jsonb, 0, 5, now() FROM generate_series(1, %(jobs)s)
"""


def server_cpu(pid: int) -> float:
    """CPU seconds (user + system) the backend ``pid`` has used."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def claims_of(rows: list[tuple[Any, ...]]) -> str:
    """The fenced completions of claimed rows, as ``COMPLETE`` takes them."""
    return json.dumps(
        [
            {"id": row[0], "attempts": row[4], "claimed_at": row[6].isoformat(), "result": None}
            for row in rows
        ]
    )


def drain(conn: psycopg.Connection[Any], batch: int, together: bool, base: dict[str, Any]) -> int:
    """Claim and complete until the queue is empty; return how many jobs were claimed."""
    claim_only = claim.limited(claim.CLAIM, batch)
    both = claim.limited(claim.CLAIM_COMPLETING, batch)
    done = 0
    previous: list[tuple[Any, ...]] = []
    while True:
        if together and previous:
            rows = conn.execute(both, base | {"claims": claims_of(previous)}, prepare=True)
            # Each row ends with the ids completed; with nothing claimed, one row of NULLs.
            previous = [row[:-1] for row in rows.fetchall() if row[0] is not None]
        else:
            if previous:
                conn.execute(finish.COMPLETE, base | {"claims": claims_of(previous)}, prepare=True)
            previous = conn.execute(claim_only, base, prepare=True).fetchall()
        if not previous:
            return done
        done += len(previous)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=4000, help="jobs per drain (default 4,000)")
    parser.add_argument("--batch", type=int, default=8, help="jobs per claim (default 8)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds of both ways (default 7)")
    args = parser.parse_args()
    conn = psycopg.connect(**connection_params("default", "pgjobs-combined"), autocommit=True)
    pid = conn.execute("SELECT pg_backend_pid()").fetchone()[0]  # type: ignore[index]
    ways: list[tuple[str, bool]] = [("two statements", False), ("one statement", True)]
    walls: dict[str, list[float]] = {name: [] for name, _ in ways}
    cpus: dict[str, list[float]] = {name: [] for name, _ in ways}
    for _ in range(args.rounds):
        for name, together in ways:
            conn.execute("TRUNCATE pgjobs_job")
            conn.execute(FILL, {"task": TASK, "jobs": args.jobs})
            conn.execute("VACUUM ANALYZE pgjobs_job")
            started, cpu = time.perf_counter(), server_cpu(pid)
            claimed = drain(conn, args.batch, together, BASE)
            walls[name].append((time.perf_counter() - started) / args.jobs * 1e6)
            cpus[name].append((server_cpu(pid) - cpu) / args.jobs * 1e6)
            outcome = conn.execute(
                "SELECT count(*) FILTER (WHERE status = 'done' AND attempts = 1), count(*) "
                "FROM pgjobs_job"
            ).fetchone()
            if claimed != args.jobs or outcome != (args.jobs, args.jobs):
                raise SystemExit(f"{name}: claimed {claimed}, (done once, all) {outcome}")
    conn.execute("TRUNCATE pgjobs_job")
    print(f"per job, median of {args.rounds} rounds of {args.jobs:,} jobs, batch {args.batch}:")
    for name, _ in ways:
        print(
            f"  {name:<15} wall {statistics.median(walls[name]):6.1f} us   "
            f"server CPU {statistics.median(cpus[name]):6.1f} us"
        )


if __name__ == "__main__":
    main()
