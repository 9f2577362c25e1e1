"""How many instructions the worker executes per no-op job: W1 in one process, counted by
valgrind, which a busy neighbour on a shared machine disturbs far less than the timings.

Not part of ``benchmarks.run``: a diagnostic to run by hand, in each tree to compare, against
a scratch database that has the schema (``manage.py migrate``; its jobs table is emptied)::

    DATABASE_URL=postgres://... DJANGO_SETTINGS_MODULE=benchmarks.settings \\
        python -m benchmarks.instructions [--jobs N] [--rounds R]

Each round runs this module twice under ``valgrind --tool=cachegrind --cache-sim=no``: once
enqueueing N no-op jobs and draining them with an in-process ``Worker(burst=True,
concurrency=8)``, once enqueueing them only. The difference over N is the worker's
instructions per job, its start-up and shut-down spread over the N jobs (compare counts of
the same N). Timings are CPU seconds that another process on the same cores stretches by a
third from one run to the next; repeated counts of one tree agree within about 1.5% on a
quiet machine, and within 5% with the test suite running beside them (how the jobs fall into
claims still depends on timing). It counts instructions, not cycles: a change that saves
instructions but stalls more (locks, cache misses, waits) is for the timed W1 to judge.
Valgrind runs the threads one at a time, so the claims' batch sizes differ from a real run.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile


def drain(jobs: int, run: bool) -> None:
    """Enqueue ``jobs`` no-op jobs on an emptied table; drain them when ``run``."""
    import logging

    import django

    django.setup()
    # As benchmarks.run's workers log: the per-job line off.
    logging.getLogger("django_pgjobs").setLevel(logging.WARNING)
    from django.db import connection

    from django_pgjobs.models import Job
    from django_pgjobs.worker.worker import Worker

    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE pgjobs_job")
    Job.objects.enqueue_many("testproject.testjobs.noop", [{"n": i} for i in range(jobs)])
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE pgjobs_job")
    connection.close()
    worker = Worker(["default"], concurrency=8, burst=True)
    if run:
        stats = worker.run()
        if stats.done != jobs:
            sys.exit(f"INVALID RUN: {stats.summary()}, {jobs} enqueued")


def counted(jobs: int, run: bool) -> int:
    """Instructions of one child process under cachegrind."""
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "cachegrind.out")
        command = [
            "valgrind",
            "--tool=cachegrind",
            "--cache-sim=no",
            f"--cachegrind-out-file={out}",
            sys.executable,
            "-m",
            "benchmarks.instructions",
            "--child",
            "run" if run else "enqueue",
            "--jobs",
            str(jobs),
        ]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode:
            sys.exit(f"the child failed ({done.returncode}):\n{done.stderr[-2000:]}")
        found = re.search(r"I\s+refs:\s+([\d,]+)", done.stderr)
        if found is None:
            sys.exit(f"valgrind printed no instruction count:\n{done.stderr[-2000:]}")
        return int(found.group(1).replace(",", ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=3000, help="jobs per round (default 3,000)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds (default 2)")
    parser.add_argument("--child", choices=("run", "enqueue"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.jobs < 1 or args.rounds < 1:
        parser.error("--jobs and --rounds must be at least 1")
    if args.child is not None:
        drain(args.jobs, args.child == "run")
        return
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not installed (Debian: apt-get install valgrind)")
    per_job = []
    for round_ in range(1, args.rounds + 1):
        work = counted(args.jobs, True) - counted(args.jobs, False)
        per_job.append(work / args.jobs)
        print(f"round {round_}: {per_job[-1]:,.0f} instructions per job", flush=True)
    print(
        f"W1 in-process, {args.jobs:,} no-op jobs, concurrency 8: median "
        f"{statistics.median(per_job):,.0f} instructions per job "
        f"({min(per_job):,.0f} - {max(per_job):,.0f}, {args.rounds} rounds)"
    )


if __name__ == "__main__":
    main()
