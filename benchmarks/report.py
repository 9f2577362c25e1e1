"""From raw runs to the printed tables: medians and min-max per row, then our targets.

Every ratio is taken between medians measured in the same invocation.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

Runs = dict[str, list[dict[str, Any]]]
MIB = 1024 * 1024


@dataclass
class Row:
    key: str
    label: str
    unit: str
    values: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    def as_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "label": self.label,
            "unit": self.unit,
            "values": self.values,
            "median": self.median,
            "min": min(self.values),
            "max": max(self.values),
        }


@dataclass
class Target:
    name: str
    measured: str
    goal: str
    passed: bool | None  # None: not measured in this invocation

    @property
    def verdict(self) -> str:
        return {True: "PASS", False: "MISS", None: "n/a"}[self.passed]


def fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit in ("jobs/s", "jobs", "rows", "count"):
        return f"{value:,.0f}"
    if unit == "MiB":
        return f"{value:,.1f}"
    if unit == "s":
        return f"{value:,.2f}"
    if unit in ("ms", "ms/job"):
        return f"{value:,.3f}"
    return f"{value:,.2f}"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool]) -> str:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]

    def line(cells: Sequence[str]) -> str:
        return " | ".join(
            c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right, strict=True)
        ).rstrip()

    return "\n".join([line(headers), "-+-".join("-" * w for w in widths), *(line(r) for r in rows)])


def rows_table(rows: Sequence[Row]) -> str:
    body = [
        [
            row.label,
            fmt(row.median, row.unit),
            f"{fmt(min(row.values), row.unit)} - {fmt(max(row.values), row.unit)}",
            row.unit,
            str(len(row.values)),
        ]
        for row in rows
    ]
    return table(
        ["workload", "median", "min - max", "unit", "runs"], body, [False, True, True, False, True]
    )


def targets_table(targets: Sequence[Target]) -> str:
    body = [[t.name, t.measured, t.goal, t.verdict] for t in targets]
    return table(
        ["target", "measured (medians, this run)", "goal", "verdict"],
        body,
        [False, False, False, False],
    )


def peer_names(runs: Runs) -> list[str]:
    """The peers measured in this invocation (their runs are keyed ``peer.<name>.<w>``)."""
    return sorted({key.split(".")[1] for key in runs if key.startswith("peer.")})


# The async section's runs: time.sleep on threads, await asyncio.sleep on the event loop at
# the threads' width, and at --async-concurrency's.
ASYNC_ROWS = (
    ("sleep_threads", "threads, --concurrency"),
    ("sleep_loop_same", "event loop, --async-concurrency"),
    ("sleep_loop", "event loop, --async-concurrency"),
)


def build_rows(
    runs: Runs, rss: dict[str, Any] | None, history_rows: int, scrape_rows: int = 0
) -> list[Row]:
    rows: list[Row] = []

    def add(
        key: str,
        label: str,
        unit: str,
        source: str,
        value: Callable[[dict[str, Any]], float | None],
    ) -> None:
        values = [v for v in (value(r) for r in runs.get(source, [])) if v is not None]
        if values:
            rows.append(Row(key, label, unit, values))

    startup_cpu = (
        statistics.median(r["worker_cpu_s"] for r in runs["startup"])
        if runs.get("startup")
        else None
    )

    def net_cpu(r: dict[str, Any]) -> float | None:
        if startup_cpu is None:
            return None
        return (r["worker_cpu_s"] - r["processes"] * startup_cpu) / r["jobs"] * 1000

    def pg_cpu(r: dict[str, Any]) -> float | None:
        return None if r["pg_cpu_s"] is None else r["pg_cpu_s"] / r["jobs"] * 1000

    def total_cpu(r: dict[str, Any]) -> float | None:
        worker, server = net_cpu(r), pg_cpu(r)
        return None if worker is None or server is None else worker + server

    for source, name in (
        ("w1_1x8", "1 process x 8"),
        ("w1_2x4", "2 processes x 4"),
        ("w1_1x8_ride", "1 process x 8, completions with the claim"),
        ("w1_2x4_ride", "2 processes x 4, completions with the claim"),
    ):
        add(
            f"{source}.jobs_per_s",
            f"W1 execute, {name}",
            "jobs/s",
            source,
            lambda r: r["jobs_per_s"],
        )
    add(
        "w1_1x8.wall_jobs_per_s",
        "W1 1x8, process wall clock incl. start-up",
        "jobs/s",
        "w1_1x8",
        lambda r: r["jobs"] / r["wall_s"],
    )
    for source, name in (
        ("w1_1x8", "1x8"),
        ("w1_2x4", "2x4"),
        ("w1_1x8_ride", "1x8 with the claim"),
        ("w1_2x4_ride", "2x4 with the claim"),
    ):
        add(
            f"{source}.worker_cpu",
            f"W1 {name} worker CPU (net of start-up)",
            "ms/job",
            source,
            net_cpu,
        )
        add(f"{source}.pg_cpu", f"W1 {name} PostgreSQL CPU", "ms/job", source, pg_cpu)
        add(
            f"{source}.total_cpu", f"W1 {name} worker + PostgreSQL CPU", "ms/job", source, total_cpu
        )
    add(
        "startup.wall_s",
        "worker start-up: empty burst, wall",
        "s",
        "startup",
        lambda r: r["wall_s"],
    )
    add(
        "startup.cpu_s",
        "worker start-up: empty burst, CPU",
        "s",
        "startup",
        lambda r: r["worker_cpu_s"],
    )
    add(
        "w2_single.jobs_per_s",
        "W2 enqueue(), one transaction each",
        "jobs/s",
        "w2_single",
        lambda r: r["jobs_per_s"],
    )
    add(
        "w2_single_prepared.jobs_per_s",
        "W2 enqueue(), server-side binding, prepared",
        "jobs/s",
        "w2_single_prepared",
        lambda r: r["jobs_per_s"],
    )
    add(
        "w2_bare.jobs_per_s",
        "W2 bare INSERT loop, same connection",
        "jobs/s",
        "w2_bare",
        lambda r: r["jobs_per_s"],
    )
    add(
        "w2_returning.jobs_per_s",
        "W2 bare INSERT ... RETURNING id, a cursor each",
        "jobs/s",
        "w2_returning",
        lambda r: r["jobs_per_s"],
    )
    add(
        "w2_bulk.jobs_per_s",
        "W2 enqueue_many(), one call",
        "jobs/s",
        "w2_bulk",
        lambda r: r["jobs_per_s"],
    )
    for q in ("p50", "p95", "p99"):
        add(f"w3.{q}_ms", f"W3 wake-up latency {q}", "ms", "w3", lambda r, q=q: r[f"{q}_ms"])
    for q in ("p50", "p95", "p99"):
        add(
            f"w3_atomic.{q}_ms",
            f"W3 enqueued in atomic(), latency {q}",
            "ms",
            "w3_atomic",
            lambda r, q=q: r[f"{q}_ms"],
        )
    history = f"{history_rows:,} done rows"
    for source, name in (("claim_empty", "0 done rows"), ("claim_history", history)):
        add(
            f"{source}.claim_ms",
            f"Scale: claim(limit=10), {name}",
            "ms",
            source,
            lambda r: r["claim_ms"],
        )
        add(
            f"{source}.claim_complete_ms",
            f"Scale: claim + complete_many, {name}",
            "ms",
            source,
            lambda r: r["claim_complete_ms"],
        )
    add(
        "w1_1x8_history.jobs_per_s",
        f"Scale: W1 1x8, {history}",
        "jobs/s",
        "w1_1x8_history",
        lambda r: r["jobs_per_s"],
    )
    add(
        "w1_1x8_history.total_cpu",
        f"Scale: W1 1x8, {history}, worker + PG CPU",
        "ms/job",
        "w1_1x8_history",
        total_cpu,
    )
    for source, label in (
        ("w1_4x2_nokeys", "Keys: W1 4x2, no lock keys"),
        ("w1_4x2_keys10", "Keys: W1 4x2, 10 lock keys"),
    ):
        add(f"{source}.jobs_per_s", label, "jobs/s", source, lambda r: r["jobs_per_s"])
    for source, name in (
        ("scrape_empty", "0 finished rows"),
        ("scrape_full", f"{scrape_rows:,} finished rows"),
    ):
        add(
            f"{source}.scrape_ms",
            f"Scrape: views.metrics queries, {name}",
            "ms",
            source,
            lambda r: r["scrape_ms"],
        )
    for source in sorted(
        (key for key in runs if key.startswith("claimers_")), key=lambda k: int(k.split("_")[1])
    ):
        name = f"Claimers: {source.split('_')[1]} on one queue"
        add(f"{source}.jobs_per_s", name, "jobs/s", source, lambda r: r["jobs_per_s"])
        for q in ("p50", "p99"):
            add(
                f"{source}.claim_{q}_ms",
                f"{name}, claim {q}",
                "ms",
                source,
                lambda r, q=q: r[f"claim_{q}_ms"],
            )
        add(
            f"{source}.cpu",
            f"{name}, driver + PostgreSQL CPU",
            "ms/job",
            source,
            lambda r: (
                None
                if r.get("pg_cpu_s") is None
                else (r["driver_cpu_s"] + r["pg_cpu_s"]) / r["jobs"] * 1000
            ),
        )
        add(
            f"{source}.short_pct",
            f"{name}, claims short or empty",
            "%",
            source,
            lambda r: r["short_pct"],
        )
    for source in sorted(
        (key for key in runs if key.startswith("pgbench_claimers_")),
        key=lambda k: int(k.rsplit("_", 1)[1]),
    ):
        clients = source.rsplit("_", 1)[1]
        add(
            f"{source}.jobs_per_s",
            f"Claimers: pgbench CLAIM 10 + COMPLETE, {clients} clients",
            "jobs/s",
            source,
            lambda r: r["jobs_per_s"],
        )
    for kind, what in (("cpu", "CPU-bound job (~5 ms)"), ("noop", "no-op W1")):
        for source, name in ((f"cores_{kind}_1x8", "1 x 8"), (f"cores_{kind}_2x4", "2 x 4")):
            add(
                f"{source}.jobs_per_s",
                f"Cores: {what}, --processes {name}",
                "jobs/s",
                source,
                lambda r: r["jobs_per_s"],
            )
    for source, name in (("cores_cpu_1x8", "1 x 8"), ("cores_cpu_2x4", "2 x 4")):
        # More than 1 only if the children ran at once, each on a core of its own.
        add(
            f"{source}.cores_used",
            f"Cores: CPU-bound, --processes {name}, cores busy (worker CPU / wall)",
            "cores",
            source,
            lambda r: r["worker_cpu_s"] / r["wall_s"],
        )
    add(
        "ceiling.jobs_per_s",
        "SQL ceiling: pgbench CLAIM 10 + COMPLETE, 8 clients",
        "jobs/s",
        "ceiling",
        lambda r: r["jobs_per_s"],
    )
    add(
        "naive.done",
        "the article's naive claim under pgbench: jobs done",
        "jobs",
        "naive",
        lambda r: r["done"],
    )
    add(
        "naive.max_attempts",
        "the article's naive claim: most claims of one job",
        "count",
        "naive",
        lambda r: r["max_attempts"],
    )
    for name in peer_names(runs):
        source = f"peer.{name}."
        add(
            f"{source}w1.jobs_per_s",
            f"peer {name}: W1 execute, concurrency 8",
            "jobs/s",
            source + "w1",
            lambda r: r["jobs_per_s"],
        )
        add(
            f"{source}w1.worker_cpu",
            f"peer {name}: W1 worker CPU (net of start-up)",
            "ms/job",
            source + "w1",
            lambda r: r.get("worker_cpu_net_ms_per_job"),
        )
        add(
            f"{source}w2_single.jobs_per_s",
            f"peer {name}: W2 single enqueue",
            "jobs/s",
            source + "w2_single",
            lambda r: r["jobs_per_s"],
        )
        add(
            f"{source}w2_bulk.jobs_per_s",
            f"peer {name}: W2 bulk enqueue",
            "jobs/s",
            source + "w2_bulk",
            lambda r: r["jobs_per_s"],
        )
        for q in ("p50", "p95", "p99"):
            add(
                f"{source}w3.{q}_ms",
                f"peer {name}: W3 wake-up latency {q}",
                "ms",
                source + "w3",
                lambda r, q=q: r[f"{q}_ms"],
            )
    for source, name in ASYNC_ROWS:
        for runs_of in runs.get(source, [])[:1]:
            label = f"Async: {runs_of['jobs']:,} waits, {name} {runs_of['width']}"
            add(f"{source}.span_s", label, "s", source, lambda r: r["span_s"])
            add(f"{source}.ideal_s", f"{label}: ideal", "s", source, lambda r: r["ideal_s"])
    if rss is not None:
        for part in ("start", "peak", "end"):
            rows.append(
                Row(
                    f"rss.{part}",
                    f"worker RSS over {rss['jobs']:,} jobs: {part}",
                    "MiB",
                    [rss[f"{part}_bytes"] / MIB],
                )
            )
        if rss.get("jobs_per_s"):
            rows.append(
                Row(
                    "rss.jobs_per_s",
                    f"long run ({rss['jobs']:,} jobs), 1x8",
                    "jobs/s",
                    [rss["jobs_per_s"]],
                )
            )
    return rows


def build_targets(
    rows: Sequence[Row], rss: dict[str, Any] | None, history_rows: int
) -> list[Target]:
    med = {row.key: row.median for row in rows}

    def get(key: str) -> float | None:
        return med.get(key)

    targets: list[Target] = []
    w1, ceiling = get("w1_1x8.jobs_per_s"), get("ceiling.jobs_per_s")
    if w1 is not None and ceiling is not None:
        share = w1 / ceiling
        targets.append(
            Target(
                "W1 1x8 vs the SQL ceiling of this run",
                f"{share:.1%} ({w1:,.0f} of {ceiling:,.0f} jobs/s)",
                ">= 50%",
                share >= 0.5,
            )
        )
    else:
        targets.append(Target("W1 1x8 vs the SQL ceiling of this run", "-", ">= 50%", None))
    targets.append(versus_pgqueuer("W1 1x8", w1, get("peer.pgqueuer.w1.jobs_per_s"), 6000))
    theirs = get("peer.pgqueuer.w1.jobs_per_s")
    targets.append(
        Target(
            "W1 1x8 vs pgqueuer at its defaults, side by side: the nearer goal",
            "-" if w1 is None or theirs is None else f"{w1 / theirs:.2f}x",
            ">= 1.5x",
            None if w1 is None or theirs is None else w1 >= 1.5 * theirs,
        )
    )
    cpu = get("w1_1x8.total_cpu")
    targets.append(
        Target(
            "W1 1x8 worker + PostgreSQL CPU per job",
            "-"
            if cpu is None
            else f"{cpu:.3f} ms (worker {get('w1_1x8.worker_cpu'):.3f} + "
            f"PG {get('w1_1x8.pg_cpu'):.3f})",
            "<= 0.2 ms",
            None if cpu is None else cpu <= 0.2,
        )
    )
    single = get("w2_single.jobs_per_s")
    targets.append(enqueue_time_vs("the bare INSERT loop", single, get("w2_bare.jobs_per_s"), 1.10))
    targets.append(
        enqueue_time_vs(
            "the bare INSERT ... RETURNING id", single, get("w2_returning.jobs_per_s"), 1.25
        )
    )
    theirs = get("peer.pgqueuer.w2_single.jobs_per_s")
    targets.append(
        ahead_of_pgqueuer("W2 enqueue()", single, theirs, bound=get("w2_returning.jobs_per_s"))
    )
    targets.append(
        ahead_of_pgqueuer(
            "W2 enqueue() with server-side binding, prepared",
            get("w2_single_prepared.jobs_per_s"),
            theirs,
        )
    )
    targets.append(
        versus_pgqueuer(
            "W2 enqueue_many()",
            get("w2_bulk.jobs_per_s"),
            get("peer.pgqueuer.w2_bulk.jobs_per_s"),
            150_000,
        )
    )
    for q, goal in (("p50", 1.0), ("p99", 3.0)):
        value = get(f"w3.{q}_ms")
        targets.append(
            Target(
                f"W3 wake-up latency {q}",
                "-" if value is None else f"{value:.3f} ms",
                f"<= {goal:g} ms",
                None if value is None else value <= goal,
            )
        )
    empty, full = get("claim_empty.claim_ms"), get("claim_history.claim_ms")
    claim_ratio = None if empty is None or full is None else full / empty
    targets.append(
        Target(
            f"claim latency, {history_rows:,} done rows vs none",
            "-" if claim_ratio is None else f"{claim_ratio:.2f}x ({full:.3f} vs {empty:.3f} ms)",
            "<= 1.2x",
            None if claim_ratio is None else claim_ratio <= 1.2,
        )
    )
    one, two = get("cores_cpu_1x8.jobs_per_s"), get("cores_cpu_2x4.jobs_per_s")
    scaled = None if one is None or two is None else two / one
    targets.append(
        Target(
            "Cores: CPU-bound jobs, --processes 2 / 1",
            "-" if scaled is None else f"{scaled:.2f}x ({two:,.0f} vs {one:,.0f} jobs/s)",
            ">= 1.7x",
            None if scaled is None else scaled >= 1.7,
        )
    )
    if rss is not None:
        growth = (rss["end_bytes"] - rss["quarter_bytes"]) / rss["quarter_bytes"]
        targets.append(
            Target(
                f"worker RSS flat over {rss['jobs']:,} jobs",
                f"{rss['start_bytes'] / MIB:.1f} -> peak {rss['peak_bytes'] / MIB:.1f} -> end "
                f"{rss['end_bytes'] / MIB:.1f} MiB ({growth:+.1%} after the first quarter)",
                "end within 5% of the RSS a quarter in",
                growth <= 0.05,
            )
        )
    else:
        targets.append(Target("worker RSS flat", "-", "end within 5% of a quarter in", None))
    loop, ideal = get("sleep_loop.span_s"), get("sleep_loop.ideal_s")
    targets.append(
        Target(
            "Async: event loop's span vs the ideal (jobs x wait / --async-concurrency)",
            "-"
            if loop is None or ideal is None
            else f"{loop / ideal:.2f}x ({loop:.2f} vs {ideal:.2f} s)",
            "<= 2x",
            None if loop is None or ideal is None else loop <= 2 * ideal,
        )
    )
    return targets


def ahead_of_pgqueuer(
    what: str, single: float | None, theirs: float | None, *, bound: float | None = None
) -> Target:
    """One enqueue's rate against pgqueuer's single enqueue, side by side. ``bound``, the
    bare ``INSERT ... RETURNING id`` through the same cursor, is shown beside it: an enqueue
    writes that row and more through that cursor, so beyond one run's noise it cannot pass
    that ratio."""
    measured = "-"
    if single is not None and theirs is not None:
        measured = f"{single / theirs:.2f}x ({single:,.0f} vs {theirs:,.0f} jobs/s)"
        if bound is not None:
            measured += f"; its bound, the bare INSERT ... RETURNING id: {bound / theirs:.2f}x"
    return Target(
        f"{what} vs pgqueuer's single enqueue, side by side",
        measured,
        ">= 1x",
        None if single is None or theirs is None else single >= theirs,
    )


def enqueue_time_vs(
    yardstick: str, single: float | None, floor: float | None, goal: float
) -> Target:
    """How many times a yardstick INSERT's time one ``enqueue()`` takes (the rates' ratio)."""
    ratio = None if single is None or floor is None else floor / single
    return Target(
        f"W2 enqueue() time vs {yardstick}",
        "-" if ratio is None else f"{ratio:.2f}x ({single:,.0f} vs {floor:,.0f} jobs/s)",
        f"<= {goal:.2f}x",
        None if ratio is None else ratio <= goal,
    )


def versus_pgqueuer(
    what: str, ours: float | None, theirs: float | None, issue_figure: float
) -> Target:
    """3x pgqueuer: side by side when BENCH_PEERS=1 measured it, else a fixed floor."""
    if theirs is None:
        return Target(
            f"{what} floor: 3x pgqueuer (fixed floor, not side by side)",
            "-" if ours is None else f"{ours:,.0f} jobs/s",
            f">= {issue_figure:,.0f} jobs/s",
            None if ours is None else ours >= issue_figure,
        )
    measured = (
        "-" if ours is None else (f"{ours / theirs:.2f}x ({ours:,.0f} vs {theirs:,.0f} jobs/s)")
    )
    return Target(
        f"{what} vs pgqueuer, side by side",
        measured,
        ">= 3x",
        None if ours is None else ours >= 3 * theirs,
    )


def info_ratios(rows: Sequence[Row]) -> list[tuple[str, str]]:
    med = {row.key: row.median for row in rows}
    out = []
    pairs = (
        ("W1 1x8 with the history / without", "w1_1x8_history.jobs_per_s", "w1_1x8.jobs_per_s"),
        ("W1 2x4 / 1x8", "w1_2x4.jobs_per_s", "w1_1x8.jobs_per_s"),
        (
            "W1 1x8 completions with the claim / apart",
            "w1_1x8_ride.jobs_per_s",
            "w1_1x8.jobs_per_s",
        ),
        (
            "W1 2x4 completions with the claim / apart",
            "w1_2x4_ride.jobs_per_s",
            "w1_2x4.jobs_per_s",
        ),
        (
            "W1 1x8 CPU per job, with the claim / apart",
            "w1_1x8_ride.total_cpu",
            "w1_1x8.total_cpu",
        ),
        (
            "W1 2x4 CPU per job, with the claim / apart",
            "w1_2x4_ride.total_cpu",
            "w1_2x4.total_cpu",
        ),
        (
            "claim + complete, history / none",
            "claim_history.claim_complete_ms",
            "claim_empty.claim_complete_ms",
        ),
        ("W2 enqueue_many() / enqueue()", "w2_bulk.jobs_per_s", "w2_single.jobs_per_s"),
        (
            "W2 enqueue(), prepared / Django's defaults",
            "w2_single_prepared.jobs_per_s",
            "w2_single.jobs_per_s",
        ),
        ("W1 4x2 with 10 lock keys / none", "w1_4x2_keys10.jobs_per_s", "w1_4x2_nokeys.jobs_per_s"),
        ("scrape, finished rows / none", "scrape_full.scrape_ms", "scrape_empty.scrape_ms"),
        ("claimers 16 / 1, jobs/s", "claimers_16.jobs_per_s", "claimers_1.jobs_per_s"),
        ("claimers 64 / 16, jobs/s", "claimers_64.jobs_per_s", "claimers_16.jobs_per_s"),
        ("claimers 64 / 16, claim p99", "claimers_64.claim_p99_ms", "claimers_16.claim_p99_ms"),
        (
            "pgbench claimers 64 / 16, jobs/s",
            "pgbench_claimers_64.jobs_per_s",
            "pgbench_claimers_16.jobs_per_s",
        ),
        (
            "Cores: no-op, --processes 2 / 1",
            "cores_noop_2x4.jobs_per_s",
            "cores_noop_1x8.jobs_per_s",
        ),
        (
            "async: threads / event loop, same width",
            "sleep_threads.span_s",
            "sleep_loop_same.span_s",
        ),
        (
            "async: threads / event loop at its own width",
            "sleep_threads.span_s",
            "sleep_loop.span_s",
        ),
    )
    for peer in sorted({key.split(".")[1] for key in med if key.startswith("peer.")}):
        pairs += (
            (f"W1 1x8 / {peer}", "w1_1x8.jobs_per_s", f"peer.{peer}.w1.jobs_per_s"),
            (f"W2 enqueue() / {peer}", "w2_single.jobs_per_s", f"peer.{peer}.w2_single.jobs_per_s"),
            (
                f"W2 enqueue(), prepared / {peer}",
                "w2_single_prepared.jobs_per_s",
                f"peer.{peer}.w2_single.jobs_per_s",
            ),
            (f"W2 bulk / {peer}", "w2_bulk.jobs_per_s", f"peer.{peer}.w2_bulk.jobs_per_s"),
            (f"W3 p50, {peer} / ours", f"peer.{peer}.w3.p50_ms", "w3.p50_ms"),
        )
    for name, top, bottom in pairs:
        if top in med and bottom in med and med[bottom]:
            out.append((name, f"{med[top] / med[bottom]:.2f}x"))
    return out
