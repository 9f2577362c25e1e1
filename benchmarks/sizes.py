"""How big each workload is: the defaults (about 10 minutes here) and ``--quick``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Sizes:
    runs: int = 5
    jobs: int = 10_000  # W1 and W2
    concurrency: int = 8
    latency_jobs: int = 200
    latency_gap: float = 0.050
    latency_warmup: int = 5
    claims: int = 200
    claim_batch: int = 10
    history_rows: int = 1_000_000
    rss_jobs: int = 1_000_000  # the long RSS run
    ceiling_jobs: int = 100_000
    naive_jobs: int = 10_000
    clients: int = 8
    pgbench_threads: int = 2
    scrape_rows: int = 10_000_000  # finished rows under the metrics scrape
    scrapes: int = 100  # timed scrapes per run and table
    claimers_jobs: int = 20_000  # jobs drained per run of the claimers section
    claimer_counts: tuple[int, ...] = (1, 4, 16, 64)  # its threads, one connection each
    cpu_jobs: int = 2_000  # the cores section's CPU-bound jobs (about 5 ms each)
    sleep_jobs: int = 2_000  # the async section: jobs that each wait sleep_s
    sleep_s: float = 0.2
    async_concurrency: int = 100

    @classmethod
    def quick(cls) -> Sizes:
        return cls(
            runs=2,
            jobs=2_000,
            latency_jobs=50,
            claims=50,
            history_rows=100_000,
            rss_jobs=20_000,
            ceiling_jobs=20_000,
            naive_jobs=2_000,
            scrape_rows=1_000_000,
            scrapes=50,
            claimers_jobs=2_000,
            cpu_jobs=500,
            sleep_jobs=400,
        )
