"""Where PostgreSQL's time per W1 job goes, statement by statement: W1 (1 x 8 and 2 x 4) on a
throwaway server with ``pg_stat_statements`` loaded, then the worker's statements, with their
calls, rows per call, and execution and planning time per job.

Not part of ``benchmarks.run``: a diagnostic to run by hand (it starts its own server, so it
needs the PostgreSQL binaries and the ``pg_stat_statements`` module of the machine)::

    python -m benchmarks.statements [--jobs N]

Execution time is the backend's wall time inside the executor: on two cores shared with the
worker it includes time the backend waited for a core, so read it as an upper bound of the
statements' CPU, beside the run's own "PG CPU per job".
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import psycopg

from scripts.pgserver import ThrowawayPostgres

ROOT = Path(__file__).resolve().parent.parent

# The sections of benchmarks.run left out: W1 alone, both shapes, completions apart.
SKIP = "w2,w3,scale,keys,ceiling,rss,scrape,claimers,cores,async,ride"

# The worker's statements, by how their text begins and a part only they have
# (pg_stat_statements writes constants and parameters as $n).
KINDS = (
    ("claim", "WITH next AS", "WITH next AS"),
    ("idle claim", "WITH head AS MATERIALIZED", "WITH head AS MATERIALIZED"),
    ("complete", "UPDATE pgjobs_job j SET status = $", "result = mine.result"),
    ("outlook", "SELECT (SELECT extract(", "AS rate_free"),
)

READ = """
SELECT regexp_replace(query, '\\s+', ' ', 'g'), calls, rows, total_exec_time, total_plan_time
FROM pg_stat_statements
"""


def measure(jobs: int) -> list[tuple[str, int, int, float, float]]:
    """Run W1 on a fresh server; return (kind, calls, rows, exec ms, plan ms) per kind."""
    with ThrowawayPostgres(fsync=True) as server:
        with psycopg.connect(server.url, autocommit=True) as admin:
            admin.execute("ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'")
        server.restart()
        with psycopg.connect(server.url, autocommit=True) as admin:
            admin.execute("CREATE EXTENSION pg_stat_statements")
            admin.execute("ALTER SYSTEM SET pg_stat_statements.track_planning = on")
            admin.execute("SELECT pg_reload_conf()")
            admin.execute("SELECT pg_stat_statements_reset()")
        # The suite's defaults: no peers, and no PGJOBS_* of the caller's (with
        # COMPLETE_WITH_CLAIM the completions would hide in the claims' statements).
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("DATABASE_URL", "DJANGO_SETTINGS_MODULE", "BENCH_PEERS")
            and not k.startswith("PGJOBS_")
        }
        env["BENCH_DATABASE_URL"] = server.url
        command = [sys.executable, "-m", "benchmarks.run", "--runs", "1", "--jobs", str(jobs)]
        subprocess.run([*command, "--skip", SKIP], cwd=ROOT, env=env, check=True)
        with psycopg.connect(server.url, autocommit=True) as admin:
            rows = admin.execute(READ).fetchall()
    totals = []
    for kind, start, part in KINDS:
        mine = [row for row in rows if row[0].lstrip().startswith(start) and part in row[0]]
        totals.append(
            (
                kind,
                sum(row[1] for row in mine),
                sum(row[2] for row in mine),
                sum(row[3] for row in mine),
                sum(row[4] for row in mine),
            )
        )
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=10_000, help="jobs per W1 run (two runs)")
    args = parser.parse_args()
    totals = measure(args.jobs)
    jobs = 2 * args.jobs  # W1 1 x 8 and 2 x 4
    rows = {kind: taken for kind, _, taken, _, _ in totals}
    if rows["claim"] + rows["idle claim"] != jobs or rows["complete"] != jobs:
        raise SystemExit(f"the statements found do not account for {jobs:,} jobs: {rows}")
    print(f"\nW1 1 x 8 and 2 x 4, {jobs:,} jobs in all: the worker's statements")
    print(
        f"{'statement':<12} {'calls':>7} {'rows/call':>9} {'exec µs/job':>11} {'plan µs/job':>11}"
    )
    for kind, calls, rows, exec_ms, plan_ms in totals:
        per_call = rows / calls if calls else 0.0
        print(
            f"{kind:<12} {calls:>7,} {per_call:>9.1f} "
            f"{exec_ms * 1000 / jobs:>11.1f} {plan_ms * 1000 / jobs:>11.1f}"
        )
    exec_all = sum(t[3] for t in totals) * 1000 / jobs
    plan_all = sum(t[4] for t in totals) * 1000 / jobs
    print(f"{'all':<12} {'':>7} {'':>9} {exec_all:>11.1f} {plan_all:>11.1f}")


if __name__ == "__main__":
    main()
