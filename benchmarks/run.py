"""Run the benchmark suite and print its tables; ``make bench`` calls this.

    python -m benchmarks.run              # the defaults: 5 interleaved runs, about 10 minutes
    python -m benchmarks.run --quick      # small sizes, 2 runs: a smoke run
    python -m benchmarks.run --help

By default it starts its own throwaway PostgreSQL with fsync on; ``BENCH_DATABASE_URL`` points
it at another server instead (it drops and creates the databases ``pgjobs_bench`` and
``pgjobs_bench_history`` there). Raw figures go to ``benchmarks/results/<timestamp>.json``,
worker output to ``benchmarks/results/<timestamp>-workers.log``. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import db, report  # noqa: E402
from benchmarks.sizes import Sizes  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
# The workers' setting for the W1 runs whose completions ride with their claims.
RIDE = {"PGJOBS_COMPLETE_WITH_CLAIM": "true"}
SECTIONS = (
    "w1",
    "w2",
    "w3",
    "scale",
    "keys",
    "ceiling",
    "rss",
    "scrape",
    "claimers",
    "cores",
    "async",
    "ride",
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick", action="store_true", help="small sizes and 2 runs: a smoke run of every workload"
    )
    parser.add_argument("--runs", type=int, help="interleaved runs of every workload (default 5)")
    parser.add_argument("--jobs", type=int, help="jobs per W1 and W2 run (default 10,000)")
    parser.add_argument(
        "--history-rows", type=int, help="done rows of the scale section (default 1,000,000)"
    )
    parser.add_argument(
        "--scrape-rows",
        type=int,
        help="finished rows under the metrics scrape (default 10,000,000; --quick 1,000,000)",
    )
    parser.add_argument(
        "--rss-jobs", type=int, help="jobs of the long RSS run (default 1,000,000; --quick 20,000)"
    )
    parser.add_argument(
        "--ceiling-jobs",
        type=int,
        help="pre-enqueued jobs of the pgbench ceiling run (default 100,000)",
    )
    parser.add_argument(
        "--claimers-jobs",
        type=int,
        help="jobs each run of the claimers section drains (default 20,000; --quick 2,000)",
    )
    parser.add_argument(
        "--cpu-jobs",
        type=int,
        help="CPU-bound jobs per run of the cores section (default 2,000; --quick 500)",
    )
    chosen = parser.add_mutually_exclusive_group()
    chosen.add_argument(
        "--skip", default="", help=f"comma-separated sections to leave out: {', '.join(SECTIONS)}"
    )
    chosen.add_argument(
        "--only", default="", help="comma-separated sections to run, the others left out"
    )
    parser.add_argument(
        "--worker-log-level",
        default="WARNING",
        help="PGJOBS_LOG_LEVEL of the workers (default WARNING: INFO logs "
        "one line per job, which the benchmark would then measure)",
    )
    parser.add_argument("--json", type=Path, help="where to write the raw figures")
    args = parser.parse_args(argv)
    skip, only = (
        {s.strip() for s in text.split(",") if s.strip()} for text in (args.skip, args.only)
    )
    if (skip | only) - set(SECTIONS):
        parser.error(f"unknown sections {sorted((skip | only) - set(SECTIONS))}; use {SECTIONS}")
    args.skip = set(SECTIONS) - only if only else skip
    return args


def sizes_from(args: argparse.Namespace) -> Sizes:
    sizes = Sizes.quick() if args.quick else Sizes()
    for name in (
        "runs",
        "jobs",
        "history_rows",
        "rss_jobs",
        "ceiling_jobs",
        "scrape_rows",
        "claimers_jobs",
        "cpu_jobs",
    ):
        value = getattr(args, name)
        if value is not None:
            if value < 1:
                raise SystemExit(f"--{name.replace('_', '-')} must be 1 or more")
            setattr(sizes, name, value)
    return sizes


def git_state() -> dict[str, Any]:
    def git(*args: str) -> str:
        result = subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, check=False
        )
        return result.stdout.strip()

    diff = git("diff", "HEAD", "--", "django_pgjobs")
    return {
        "commit": git("rev-parse", "HEAD"),
        "django_pgjobs_dirty": git("status", "--porcelain", "--", "django_pgjobs").splitlines(),
        "django_pgjobs_diff_sha256": hashlib.sha256(diff.encode()).hexdigest() if diff else None,
    }


def machine() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        model = "?"
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def setup_django(bench_url: str, history_url: str, scrape_url: str) -> None:
    os.environ.update(
        {
            "DATABASE_URL": bench_url,
            "BENCH_HISTORY_DATABASE_URL": history_url,
            "BENCH_SCRAPE_DATABASE_URL": scrape_url,
            "DJANGO_SETTINGS_MODULE": "benchmarks.settings",
            "PGJOBS_LOG_LEVEL": "WARNING",
        }
    )
    for name in ("LISTEN_DATABASE_URL", "PGJOBS_TEST_DATABASE_NAME"):
        os.environ.pop(name, None)
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0, interactive=False)
    call_command("migrate", database="history", verbosity=0, interactive=False)
    call_command("migrate", database="scrape", verbosity=0, interactive=False)


def headline(key: str, result: dict[str, Any]) -> str:
    """One short line per finished run of a workload, printed as the suite goes."""
    if key.startswith("peer."):
        key = key.rsplit(".", 1)[1]
    if key.startswith(("w1", "cores", "pgbench_claimers")) or key == "ceiling":
        return f"{result['jobs_per_s']:,.0f} jobs/s"
    if key.startswith("w2"):
        return f"{result['jobs_per_s']:,.0f} jobs/s"
    if key == "startup":
        return f"{result['wall_s']:.2f} s wall, {result['worker_cpu_s']:.2f} s CPU"
    if key.startswith("w3"):
        return (
            f"p50 {result['p50_ms']:.2f} ms, p95 {result['p95_ms']:.2f}, p99 {result['p99_ms']:.2f}"
        )
    if key.startswith("scrape"):
        return f"scrape {result['scrape_ms']:.3f} ms (median of {result['scrapes']})"
    if key.startswith("claimers"):
        return (
            f"{result['jobs_per_s']:,.0f} jobs/s, claim p50 {result['claim_p50_ms']:.2f} ms, "
            f"p99 {result['claim_p99_ms']:.2f}, short {result['short_pct']:.1f}%"
        )
    if key.startswith("claim"):
        return f"claim {result['claim_ms']:.3f} ms, + complete {result['claim_complete_ms']:.3f}"
    if key.startswith("sleep_"):
        return (
            f"{result['span_s']:.2f} s at width {result['width']} (ideal {result['ideal_s']:.2f})"
        )
    if key == "naive":
        return (
            f"{result['done']:,} of {result['jobs']:,} done, max attempts {result['max_attempts']}"
        )
    return ""


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    sizes = sizes_from(args)
    began = time.monotonic()
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    RESULTS.mkdir(parents=True, exist_ok=True)
    json_path = args.json or RESULTS / f"{stamp}.json"
    log_path = RESULTS / f"{stamp}-workers.log"
    out: dict[str, Any] = {
        "started": stamp,
        "sizes": vars(sizes),
        "skipped": sorted(args.skip),
        "worker_log_level": args.worker_log_level,
        "machine": machine(),
        "git": git_state(),
        "runs": {},
        "rss": None,
    }
    peer_names = requested_peers(os.environ.get("BENCH_PEERS", ""))
    peers_requested = peer_names != []
    out["peers"] = {} if peers_requested else "not requested (BENCH_PEERS=1 adds them)"

    print(
        f"django-pgjobs benchmark ({'quick' if args.quick else 'default'} sizes): "
        f"{sizes.runs} interleaved runs, {sizes.jobs:,} jobs per W1/W2 run"
    )
    print(
        f"machine: {out['machine']['cpus']} CPUs, {out['machine']['cpu_model']}, "
        f"Python {out['machine']['python']}"
    )
    git = out["git"]
    print(
        f"code: {git['commit'][:12]}"
        + (
            f" + uncommitted changes in django_pgjobs ({len(git['django_pgjobs_dirty'])} files)"
            if git["django_pgjobs_dirty"]
            else ""
        )
    )
    bench = None
    peers = None
    code = 0
    with db.Server(os.environ.get("BENCH_DATABASE_URL")) as server, open(log_path, "w") as log:
        try:
            print(f"server: {server.describe()}")
            bench_url = db.recreate(server.url, db.BENCH_DB)
            history_url = db.recreate(server.url, db.HISTORY_DB)
            scrape_url = db.recreate(server.url, db.SCRAPE_DB)
            setup_django(bench_url, history_url, scrape_url)
            from benchmarks.workloads import Bench

            bench = Bench(
                sizes=sizes,
                bench_url=bench_url,
                history_url=history_url,
                scrape_url=scrape_url,
                pgbench=db.find_pgbench(server.bindir),
                log=log,
                worker_log_level=args.worker_log_level,
            )
            out["server"] = bench.admin.settings()
            out["server"]["pg_cpu_measured"] = bench.cpu is not None
            print("server settings: " + ", ".join(f"{k}={v}" for k, v in out["server"].items()))
            if bench.cpu is None:
                print("PostgreSQL's processes are not on this machine: no PostgreSQL CPU figures")
            if peers_requested:
                from benchmarks.peers import Peers

                print(
                    f"\nBENCH_PEERS={os.environ['BENCH_PEERS']}: "
                    "preparing the peers' virtualenvs ...",
                    flush=True,
                )
                peers = Peers(server.url, sizes, log)
                for name in peers.prepare(peer_names):
                    out["peers"][name] = peers.versions(name)
                    print(f"  {name} {peers.version(name)}")
            code = run_suite(bench, sizes, args, out, peers)
        except db.BenchAbort as exc:
            print(f"\nABORTED: {exc}", file=sys.stderr)
            out["aborted"] = str(exc)
            code = 1
        except BaseException as exc:
            out["aborted"] = "".join(traceback.format_exception(exc))
            raise
        finally:
            if peers is not None:
                peers.close()
            if bench is not None:
                bench.close()
            out["elapsed_s"] = time.monotonic() - began
            json_path.write_text(json.dumps(out, indent=1, default=str))
    shown = json_path.relative_to(ROOT) if json_path.is_relative_to(ROOT) else json_path
    print(f"\nraw figures: {shown}")
    print(f"worker output: {log_path.relative_to(ROOT)}")
    print(f"elapsed: {out['elapsed_s'] / 60:.1f} min")
    return code


def requested_peers(value: str) -> list[str] | None:
    """The peers ``BENCH_PEERS`` asks for: ``1`` every one (``None``), a comma-separated list
    of names those, nothing none (``[]``). An unknown name is an error, not a quiet skip."""
    from benchmarks.peers import NAMES

    value = value.strip()
    if value in ("", "0"):
        return []
    if value == "1":
        return None
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = sorted(set(names) - set(NAMES))
    if unknown:
        raise SystemExit(
            f"BENCH_PEERS: unknown peer(s) {', '.join(unknown)}; "
            f"use 1 for all, or some of: {', '.join(NAMES)}"
        )
    return names


def peer_steps(peers: Any, names: list[str]) -> list[tuple[str, str, Callable[[], Any]]]:
    """Each ready peer's W1, W2 and W3, run in the same interleaved rounds as ours."""
    steps: list[tuple[str, str, Callable[[], Any]]] = []
    for name in names:
        for workload in ("w1", "w2_single", "w2_bulk", "w3"):
            steps.append(
                (
                    workload[:2],
                    f"peer.{name}.{workload}",
                    lambda n=name, w=workload: getattr(peers, w)(n),
                )
            )
    return steps


def run_suite(
    bench: Any, sizes: Sizes, args: argparse.Namespace, out: dict[str, Any], peers: Any = None
) -> int:
    skip = args.skip
    if "scale" not in skip:
        print(f"\nbuilding the history: {sizes.history_rows:,} done rows ...", flush=True)
        built = bench.build_history()
        out["history"] = built
        print(
            f"  {built['seconds']:.1f} s, table and indexes "
            f"{built['table_bytes'] / 1024 / 1024:,.0f} MiB"
        )
    if "scrape" not in skip:
        print(f"\nbuilding the scrape table: {sizes.scrape_rows:,} finished rows ...", flush=True)
        built = bench.build_scrape()
        out["scrape_table"] = built
        print(
            f"  {built['seconds']:.1f} s, table and indexes "
            f"{built['table_bytes'] / 1024 / 1024:,.0f} MiB"
        )
    plan: list[tuple[str, str, Callable[[], dict[str, Any]]]] = [
        ("w1", "w1_1x8", lambda: bench.execute(processes=1, concurrency=sizes.concurrency)),
        ("w1", "w1_2x4", lambda: bench.execute(processes=2, concurrency=sizes.concurrency // 2)),
        ("w1", "startup", bench.startup),
        # The same W1 with a busy worker's completions written in the statement of its next
        # claim (PGJOBS["COMPLETE_WITH_CLAIM"]): the lever's before and after, side by side.
        (
            "ride",
            "w1_1x8_ride",
            lambda: bench.execute(processes=1, concurrency=sizes.concurrency, settings=RIDE),
        ),
        (
            "ride",
            "w1_2x4_ride",
            lambda: bench.execute(processes=2, concurrency=sizes.concurrency // 2, settings=RIDE),
        ),
        ("w2", "w2_single", bench.enqueue_single),
        # The same on an alias with Django's server_side_binding and psycopg's
        # prepare_threshold (docs/enqueue.md, "The fastest single enqueue").
        ("w2", "w2_single_prepared", lambda: bench.enqueue_single("prepared")),
        ("w2", "w2_bare", bench.insert_bare),
        ("w2", "w2_returning", bench.insert_returning),
        ("w2", "w2_bulk", bench.enqueue_bulk),
        ("w3", "w3", bench.wakeup),
        ("w3", "w3_atomic", lambda: bench.wakeup(atomic=True)),
        ("scale", "claim_empty", lambda: bench.claim_latency(history=False)),
        ("scale", "claim_history", lambda: bench.claim_latency(history=True)),
        (
            "scale",
            "w1_1x8_history",
            lambda: bench.execute(processes=1, concurrency=sizes.concurrency, history=True),
        ),
        # Lock keys (docs/queues.md): the same W1 over 4 processes, its jobs spread over 10
        # keys (at most 10 run at once, each claim guarded), against none.
        ("keys", "w1_4x2_nokeys", lambda: bench.execute(processes=4, concurrency=2)),
        ("keys", "w1_4x2_keys10", lambda: bench.execute(processes=4, concurrency=2, keys=10)),
        ("ceiling", "ceiling", bench.ceiling),
        ("ceiling", "naive", bench.naive),
        # The metrics view's queries (docs/monitoring.md): the same live jobs over an empty
        # table and over --scrape-rows finished rows.
        ("scrape", "scrape_empty", lambda: bench.scrape(finished=False)),
        ("scrape", "scrape_full", lambda: bench.scrape(finished=True)),
        # Many claimers on one queue (benchmarks/claimers.py): threads with a connection each,
        # and the same claim and complete from pgbench's C clients (no Python beside them).
        *(
            ("claimers", f"claimers_{count}", lambda count=count: bench.claimers(count))
            for count in sizes.claimer_counts
        ),
        *(
            (
                "claimers",
                f"pgbench_claimers_{count}",
                lambda count=count: bench.ceiling(clients=count, jobs=sizes.claimers_jobs),
            )
            for count in sizes.claimer_counts
        ),
        # runjobs --processes N (docs/worker.md): a CPU-bound job and the no-op, one command
        # at --processes 1 and 2, as many executor threads in all.
        *(
            (
                "cores",
                f"cores_{kind}_{n}x{sizes.concurrency // n}",
                lambda n=n, task=task, jobs=jobs: bench.execute(
                    processes=n,
                    concurrency=sizes.concurrency // n,
                    supervised=True,
                    task=task,
                    jobs=jobs,
                ),
            )
            for kind, task, jobs in (
                ("cpu", db.CRUNCH, sizes.cpu_jobs),
                ("noop", db.TASK, sizes.jobs),
            )
            for n in (1, 2)
        ),
        # async def jobs (docs/async.md): the same 0.2 s waits on threads and on the event loop.
        ("async", "sleep_threads", lambda: bench.sleepers(on_loop=False)),
        (
            "async",
            "sleep_loop_same",
            lambda: bench.sleepers(on_loop=True, async_concurrency=sizes.concurrency),
        ),
        ("async", "sleep_loop", lambda: bench.sleepers(on_loop=True)),
    ]
    if bench.pgbench is None and "ceiling" not in skip:
        print("pgbench not found: the SQL ceiling is not measured")
        skip = skip | {"ceiling"}
    if bench.pgbench is None:
        plan = [step for step in plan if not step[1].startswith("pgbench_")]
    if peers is not None:
        plan += peer_steps(peers, list(out["peers"]))
    plan = [step for step in plan if step[0] not in skip]
    if "ceiling" not in skip:
        from benchmarks.workloads import ceiling_script

        out["ceiling_script"] = ceiling_script(sizes.claim_batch)
    runs: dict[str, list[dict[str, Any]]] = out["runs"]
    for number in range(1, sizes.runs + 1):
        print(f"\nrun {number}/{sizes.runs}", flush=True)
        for _section, key, step in plan:
            started = time.monotonic()
            result = step()
            if result is None:  # a peer without that workload (no bulk enqueue)
                continue
            runs.setdefault(key, []).append(result)
            print(
                f"  {key:<30} {headline(key, result):<55} ({time.monotonic() - started:.1f} s)",
                flush=True,
            )
    if "rss" not in skip:
        print(f"\nlong run: {sizes.rss_jobs:,} jobs, worker RSS every second ...", flush=True)
        out["rss"] = bench.rss()
        print(f"  {out['rss']['jobs_per_s']:,.0f} jobs/s", flush=True)

    rows = report.build_rows(runs, out["rss"], sizes.history_rows, sizes.scrape_rows)
    targets = report.build_targets(rows, out["rss"], sizes.history_rows)
    out["summary"] = [row.as_json() for row in rows]
    out["targets"] = [vars(t) | {"verdict": t.verdict} for t in targets]
    out["ratios"] = dict(report.info_ratios(rows))
    print(
        f"\n== results: median and min-max of {sizes.runs} interleaved runs "
        f"(RSS: one long run) ==\n"
    )
    print(report.rows_table(rows))
    print("\n== our targets (ratios of medians from this invocation) ==\n")
    print(report.targets_table(targets))
    if out["ratios"]:
        print("\nother ratios: " + "; ".join(f"{k} {v}" for k, v in out["ratios"].items()))
    if args.worker_log_level != "WARNING":
        print(f"\nworkers logged at {args.worker_log_level}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
