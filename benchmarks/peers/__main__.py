"""Run the peers alone: ``python -m benchmarks.peers --server postgres://... --jobs 2000``.

Creates (or reuses) the peers' virtualenvs, creates one database per peer on the server
(``pgjobs_peer_<name>``, dropped and created), runs W1, W2 and W3 for each peer, interleaved
over ``--runs``, and prints a table of medians. The drivers' and workers' output goes to
``benchmarks/results/peers-<timestamp>.log``; ``--json PATH`` keeps every raw figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from benchmarks.db import BenchAbort
from benchmarks.peers import NAMES, NO_BULK_REASON, Peers
from benchmarks.sizes import Sizes

ROOT = Path(__file__).resolve().parent.parent.parent
RESULTS = ROOT / "benchmarks" / "results"
WORKLOADS = ("w1", "w2_single", "w2_bulk", "w3")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.peers", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--server",
        default=os.environ.get("BENCH_DATABASE_URL"),
        help="a PostgreSQL server URL (postgres://user@host:port/dbname); "
        "default BENCH_DATABASE_URL",
    )
    parser.add_argument("--jobs", type=int, default=Sizes.jobs, help="jobs per W1 and W2 run")
    parser.add_argument("--runs", type=int, default=1, help="interleaved runs (default 1)")
    parser.add_argument(
        "--latency-jobs",
        type=int,
        default=Sizes.latency_jobs,
        help="W3's measured jobs (default 200)",
    )
    parser.add_argument(
        "--peers",
        default=",".join(NAMES),
        help=f"comma-separated peers (default all: {','.join(NAMES)})",
    )
    parser.add_argument("--skip", default="", help="workloads to leave out: w1,w2,w3")
    parser.add_argument("--json", type=Path, help="where to write the raw figures")
    args = parser.parse_args(argv)
    if not args.server:
        parser.error("--server (or BENCH_DATABASE_URL) is required")
    args.peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    if set(args.peers) - set(NAMES):
        parser.error(f"unknown peers {sorted(set(args.peers) - set(NAMES))}; use {NAMES}")
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    return args


def median(runs: list[dict[str, Any] | None], key: str) -> float | None:
    values = [r[key] for r in runs if r is not None and r.get(key) is not None]
    return statistics.median(values) if values else None


def fmt(value: float | None, spec: str = ",.0f") -> str:
    return "n/a" if value is None else format(value, spec)


def table(peers: Peers, names: list[str], runs: dict[str, dict[str, list[Any]]]) -> str:
    head = (
        "peer",
        "version",
        "W1 jobs/s",
        "W1 incl. start-up",
        "W1 CPU ms/job (net)",
        "W2 single jobs/s",
        "W2 bulk jobs/s",
        "W3 p50 / p95 / p99 ms",
    )
    rows = [head]
    for name in names:
        got = runs[name]
        w1, w3 = got.get("w1", []), got.get("w3", [])
        bulk = got.get("w2_bulk", [])
        rows.append(
            (
                name,
                peers.version(name),
                fmt(median(w1, "jobs_per_s")),
                fmt(median(w1, "jobs_per_s_incl_startup")),
                f"{fmt(median(w1, 'worker_cpu_ms_per_job'), '.3f')} "
                f"({fmt(median(w1, 'worker_cpu_net_ms_per_job'), '.3f')})",
                fmt(median(got.get("w2_single", []), "jobs_per_s")),
                "null (no bulk API)"
                if bulk and all(r is None for r in bulk)
                else fmt(median(bulk, "jobs_per_s")),
                " / ".join(fmt(median(w3, k), ".2f") for k in ("p50_ms", "p95_ms", "p99_ms"))
                if w3
                else "n/a",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = [
        "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def headline(key: str, result: dict[str, Any] | None) -> str:
    if result is None:
        return "null (no bulk API)"
    if key == "w3":
        return (
            f"p50 {result['p50_ms']:.2f} ms, p95 {result['p95_ms']:.2f}, p99 {result['p99_ms']:.2f}"
        )
    text = f"{result['jobs_per_s']:,.0f} jobs/s"
    if key == "w1":
        text += (
            f" ({result['jobs_per_s_incl_startup']:,.0f} incl. start-up, "
            f"{result['worker_cpu_ms_per_job']:.3f} ms CPU/job, "
            f"{result['worker_cpu_net_ms_per_job']:.3f} net of start-up)"
        )
    return text


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    sizes = Sizes(runs=args.runs, jobs=args.jobs, latency_jobs=args.latency_jobs)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    RESULTS.mkdir(parents=True, exist_ok=True)
    log_path = RESULTS / f"peers-{stamp}.log"
    out: dict[str, Any] = {"started": stamp, "sizes": vars(sizes), "versions": {}, "runs": {}}
    code = 0
    with open(log_path, "w") as log:
        peers = Peers(args.server, sizes, log)
        try:
            names = peers.prepare(args.peers)
            out["versions"] = {name: peers.versions(name) for name in names}
            plan: list[tuple[str, Callable[[str], dict[str, Any] | None]]] = [
                (key, getattr(peers, key))
                for key in WORKLOADS
                if key.split("_")[0] not in args.skip
            ]
            runs: dict[str, dict[str, list[Any]]] = {name: {} for name in names}
            out["runs"] = runs
            for number in range(1, sizes.runs + 1):
                print(f"\nrun {number}/{sizes.runs}", flush=True)
                for name in names:
                    for key, step in plan:
                        started = time.monotonic()
                        result = step(name)
                        runs[name].setdefault(key, []).append(result)
                        print(
                            f"  {name:<16} {key:<10} {headline(key, result):<62} "
                            f"({time.monotonic() - started:.1f} s)",
                            flush=True,
                        )
            print(
                f"\n== peers: median of {sizes.runs} run(s), {sizes.jobs:,} jobs per W1/W2 "
                f"run, W3 {sizes.latency_jobs} jobs {sizes.latency_gap * 1000:.0f} ms apart "
                "==\n"
            )
            print(table(peers, names, runs))
            for name in names:
                if name in NO_BULK_REASON and "w2" not in args.skip:
                    print(f"\n{name}: W2 bulk is null: {NO_BULK_REASON[name]}")
        except BenchAbort as exc:
            print(f"\nABORTED: {exc}", file=sys.stderr)
            out["aborted"] = str(exc)
            code = 1
        finally:
            peers.close()
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=str))
        print(f"\nraw figures: {args.json}")
    print(f"driver and worker output: {log_path.relative_to(ROOT)}")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
