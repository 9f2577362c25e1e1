"""The benchmark's workloads, one method each; every method is one run and returns raw figures.

Imported after ``django.setup()`` (``benchmarks.run`` does that). Each run starts from a known
table: emptied (or, in the history database, cut back to the done rows), refilled outside the
timing, then ``ANALYZE`` and ``CHECKPOINT`` so no run pays for the previous one's dirty pages.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from django.db import connections, transaction

from benchmarks.db import TASK, Admin, BenchAbort, pgbench_figures, pgbench_params
from benchmarks.jobs import doze, nap, stamp
from benchmarks.proc import ServerCpu, rss_bytes
from benchmarks.sizes import Sizes
from django_pgjobs.core import claim, conf, execute, finish, registry
from django_pgjobs.models import Job
from django_pgjobs.ops import dashboard

ROOT = Path(__file__).resolve().parent.parent
WORKER_TIMEOUT = 900.0  # seconds; a worker running longer than this is stuck: abort

# The source article's naive claim, as scripts/demo.py runs it: the subquery picks an id without a
# lock, so concurrent sessions take the same row (and the statement marks it done at once).
NAIVE_CLAIM = """
UPDATE pgjobs_job SET status = 'done', attempts = attempts + 1
WHERE id = (SELECT id FROM pgjobs_job WHERE status = 'queued' ORDER BY run_at LIMIT 1)
RETURNING id, attempts;
"""

# The scrape's live jobs, the same over both tables: 4 queues, each with 100 ready, 20
# scheduled, 10 running (2 of them with expired leases) and 5 failed jobs.
SCRAPE_READY = 400
SCRAPE_LIVE = """
INSERT INTO pgjobs_job (queue, task, payload, status, run_at, attempts, locked_until,
                        finished_at)
SELECT 'q' || q, %s, '{}', s.status, now() + s.run_in, s.attempts, now() + s.lease,
       CASE WHEN s.status = 'failed' THEN now() END
FROM generate_series(1, 4) q,
     (VALUES ('queued', interval '-1 minute', 0, NULL::interval, 100),
             ('queued', interval '1 hour', 0, NULL, 20),
             ('running', interval '-1 minute', 1, interval '5 minutes', 8),
             ('running', interval '-10 minutes', 1, interval '-1 minute', 2),
             ('failed', interval '-1 hour', 5, NULL, 5)) AS s(status, run_in, attempts, lease, n),
     generate_series(1, s.n)
"""

BARE_INSERT = (
    "INSERT INTO pgjobs_job (queue, task, payload, priority, max_attempts, run_at) "
    "VALUES (%s, %s, %s::jsonb, %s, %s, now())"
)
BARE_INSERT_RETURNING = BARE_INSERT + " RETURNING id"


class Bench:
    """What every workload needs: the databases, the server's CPU meter, where logs go."""

    def __init__(
        self,
        *,
        sizes: Sizes,
        bench_url: str,
        history_url: str,
        scrape_url: str,
        pgbench: Path | None,
        log: IO[str],
        worker_log_level: str,
    ) -> None:
        self.sizes = sizes
        self.bench_url = bench_url
        self.history_url = history_url
        self.pgbench = pgbench
        self.log = log
        self.worker_log_level = worker_log_level
        self.admin = Admin(bench_url)
        self.history = Admin(history_url)
        self.scrape_table = Admin(scrape_url)
        self.scrape_floor = 0
        self.cpu = ServerCpu.of_backend(self.admin.backend_pid())
        self.history_floor = 0
        self.scratch = Path(tempfile.mkdtemp(prefix="pgjobs-bench-"))

    def close(self) -> None:
        self.admin.close()
        self.history.close()
        self.scrape_table.close()
        for path in self.scratch.iterdir():
            path.unlink()
        self.scratch.rmdir()

    # -- processes --------------------------------------------------------------------------

    def spawn(
        self, url: str, *args: str, settings: Mapping[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """``manage.py runjobs *args`` on ``url``; ``settings``: ``PGJOBS_*`` variables the test
        project's settings read (testproject/settings.py), for a lever's comparison."""
        env = {
            **os.environ,
            "DATABASE_URL": url,
            "DJANGO_SETTINGS_MODULE": "benchmarks.settings",
            "PGJOBS_LOG_LEVEL": self.worker_log_level,
            **(settings or {}),
        }
        for name in ("LISTEN_DATABASE_URL", "PGJOBS_TEST_DATABASE_NAME"):
            env.pop(name, None)
        command = [sys.executable, "manage.py", "runjobs", *args]
        self.log.write(f"\n$ {' '.join(command)}\n")
        self.log.flush()
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=self.log, stderr=self.log)

    @staticmethod
    def reap(
        procs: list[subprocess.Popen[bytes]], timeout: float = WORKER_TIMEOUT
    ) -> list[tuple[int, float]]:
        """Wait for each process; return (exit code, user+system CPU seconds) of each.

        ``os.wait4`` gives the child's own rusage (all its threads), read as it is reaped.
        """
        results: dict[int, tuple[int, float]] = {}

        def wait(proc: subprocess.Popen[bytes]) -> None:
            _pid, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            results[proc.pid] = (proc.returncode, usage.ru_utime + usage.ru_stime)

        threads = [threading.Thread(target=wait, args=(p,), daemon=True) for p in procs]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if any(thread.is_alive() for thread in threads):
            for proc in procs:
                if proc.pid not in results:
                    proc.kill()
            raise BenchAbort(f"a worker ran longer than {timeout:.0f} s: killed")
        return [results[p.pid] for p in procs]

    def server_cpu(self) -> float | None:
        return self.cpu.seconds() if self.cpu is not None else None

    # -- W1 ---------------------------------------------------------------------------------

    def execute(
        self,
        *,
        processes: int,
        concurrency: int,
        history: bool = False,
        keys: int = 0,
        supervised: bool = False,
        task: str = TASK,
        jobs: int | None = None,
        settings: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """W1: N pre-enqueued no-op jobs, ``runjobs --burst`` in ``processes`` processes.
        ``keys``: the jobs spread round-robin over that many lock keys (none: no lock key).
        ``supervised``: one ``runjobs --burst --processes N`` instead of N commands (the cores
        section); ``task`` and ``jobs`` replace the no-op and ``--jobs``; ``settings``: the
        workers' ``PGJOBS_*`` variables (``spawn()``)."""
        n = self.sizes.jobs if jobs is None else jobs
        admin, alias, url = self._target(history)
        floor = self._reset(history)
        Job.objects.db_manager(alias).enqueue_many(
            task,
            [{"n": i} for i in range(n)],
            lock_key=(lambda payload: f"key-{payload['n'] % keys}") if keys else None,
        )
        admin.run("ANALYZE pgjobs_job")
        admin.checkpoint()
        children = self.cpu.count() if self.cpu else 0
        pg_before = self.server_cpu()
        started = time.monotonic()
        burst = ("--burst", "--concurrency", str(concurrency))
        procs = (
            [self.spawn(url, *burst, "--processes", str(processes), settings=settings)]
            if supervised
            else [self.spawn(url, *burst, settings=settings) for _ in range(processes)]
        )
        results = self.reap(procs)
        wall = time.monotonic() - started
        if self.cpu is not None:
            self.cpu.settle(children)
        pg_after = self.server_cpu()
        codes = [code for code, _cpu in results]
        if any(codes):
            raise BenchAbort(f"W1: a worker exited with {codes}; see the worker log")
        admin.check_all_done(n, floor, "W1")
        span = admin.span(floor)
        self._reset(history)
        return {
            "jobs": n,
            "processes": processes,
            "concurrency": concurrency,
            "keys": keys,
            "supervised": supervised,
            "task": task,
            "span_s": span,
            "jobs_per_s": n / span if span else None,
            "wall_s": wall,
            "worker_cpu_s": sum(cpu for _code, cpu in results),
            "pg_cpu_s": None if pg_before is None or pg_after is None else pg_after - pg_before,
        }

    def startup(self) -> dict[str, Any]:
        """An empty ``runjobs --burst``: the start-up (and shut-down) cost W1 subtracts."""
        self._reset(False)
        started = time.monotonic()
        [(code, cpu)] = self.reap(
            [self.spawn(self.bench_url, "--burst", "--concurrency", str(self.sizes.concurrency))]
        )
        wall = time.monotonic() - started
        if code:
            raise BenchAbort(f"empty burst worker exited with {code}; see the worker log")
        return {"wall_s": wall, "worker_cpu_s": cpu}

    # -- W2 ---------------------------------------------------------------------------------

    def enqueue_single(self, alias: str = "default") -> dict[str, Any]:
        """W2: ``enqueue()`` N times in autocommit: one transaction (and NOTIFY) each, on
        ``alias`` (``prepared``: the same database, statements bound and prepared on the
        server)."""
        n = self.sizes.jobs
        self._reset(False)
        self.admin.checkpoint()
        manager = Job.objects.db_manager(alias)
        started = time.perf_counter()
        for i in range(n):
            manager.enqueue(TASK, {"n": i})
        seconds = time.perf_counter() - started
        self._check_queued(n, "W2 enqueue()")
        return {"jobs": n, "seconds": seconds, "jobs_per_s": n / seconds}

    def insert_bare(self) -> dict[str, Any]:
        """W2's yardstick: a plain INSERT of the same columns, autocommit, same connection."""
        n = self.sizes.jobs
        self._reset(False)
        self.admin.checkpoint()
        connection = connections["default"]
        with connection.cursor() as cursor:
            started = time.perf_counter()
            for i in range(n):
                cursor.execute(BARE_INSERT, ["default", TASK, json.dumps({"n": i}), 0, 5])
            seconds = time.perf_counter() - started
        self._check_queued(n, "W2 bare INSERT")
        return {"jobs": n, "seconds": seconds, "jobs_per_s": n / seconds}

    def insert_returning(self) -> dict[str, Any]:
        """W2's yardstick as issue 16 states it: the same INSERT with ``RETURNING id`` read
        back, through a Django cursor per call as the ORM's ``create()`` opens one, autocommit,
        same connection: what any Django code pays to add one row and learn its id."""
        n = self.sizes.jobs
        self._reset(False)
        self.admin.checkpoint()
        connection = connections["default"]
        started = time.perf_counter()
        for i in range(n):
            with connection.cursor() as cursor:
                cursor.execute(BARE_INSERT_RETURNING, ["default", TASK, json.dumps({"n": i}), 0, 5])
                cursor.fetchone()
        seconds = time.perf_counter() - started
        self._check_queued(n, "W2 bare INSERT ... RETURNING id")
        return {"jobs": n, "seconds": seconds, "jobs_per_s": n / seconds}

    def enqueue_bulk(self) -> dict[str, Any]:
        """W2: one ``enqueue_many()`` of N jobs."""
        n = self.sizes.jobs
        self._reset(False)
        self.admin.checkpoint()
        payloads = [{"n": i} for i in range(n)]
        started = time.perf_counter()
        ids = Job.objects.enqueue_many(TASK, payloads)
        seconds = time.perf_counter() - started
        if len(ids) != n:
            raise BenchAbort(f"enqueue_many returned {len(ids)} ids, expected {n}")
        self._check_queued(n, "W2 enqueue_many()")
        return {"jobs": n, "seconds": seconds, "jobs_per_s": n / seconds}

    def _check_queued(self, n: int, what: str) -> None:
        found = self.admin.one("SELECT count(*) FROM pgjobs_job WHERE status = 'queued'")
        if found != n:
            raise BenchAbort(f"{what}: {found} queued jobs in the table, expected {n}")

    # -- W3 ---------------------------------------------------------------------------------

    def wakeup(self, *, atomic: bool = False) -> dict[str, Any]:
        """W3: an idle worker; jobs enqueued ``gap`` apart; commit -> job function start.

        By default each ``enqueue()`` runs in autocommit (its INSERT carries the NOTIFY) and
        the clock starts when it returns, just after its commit: as the peers are measured.
        With ``atomic`` it runs in ``atomic()`` and the clock starts in an ``on_commit`` hook
        that runs before the one handing the NOTIFY to the background thread.
        """
        sizes = self.sizes
        self._reset(False)
        self.admin.checkpoint()
        out = self.scratch / "stamps.txt"
        out.unlink(missing_ok=True)
        proc = self.spawn(self.bench_url, "--concurrency", str(sizes.concurrency))
        try:
            self._wait_for_listener(proc)
            total = sizes.latency_warmup + sizes.latency_jobs
            committed: dict[int, float] = {}
            begin = time.monotonic()
            for seq in range(total):
                delay = begin + seq * sizes.latency_gap - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                if atomic:
                    self._enqueue_stamped(seq, str(out), committed)
                else:
                    stamp.enqueue(seq=seq, out=str(out))
                    committed[seq] = time.time()
            started = self._read_stamps(out, total)
        finally:
            proc.send_signal(signal.SIGTERM)
            [(code, _cpu)] = self.reap([proc], timeout=120)
        if code:
            raise BenchAbort(f"W3 worker exited with {code}; see the worker log")
        self.admin.check_all_done(total, 0, "W3")
        latencies = sorted(
            (started[seq] - committed[seq]) * 1000 for seq in range(sizes.latency_warmup, total)
        )
        self._reset(False)
        cuts = statistics.quantiles(latencies, n=100, method="inclusive")
        return {
            "jobs": len(latencies),
            "gap_s": sizes.latency_gap,
            "p50_ms": cuts[49],
            "p95_ms": cuts[94],
            "p99_ms": cuts[98],
            "max_ms": latencies[-1],
            "min_ms": latencies[0],
            "latencies_ms": latencies,
        }

    @staticmethod
    def _enqueue_stamped(seq: int, out: str, committed: dict[int, float]) -> None:
        # The hook is registered before enqueue() registers its NOTIFY hook, and hooks run in
        # order: the time is taken right after COMMIT returns, before the NOTIFY is sent.
        with transaction.atomic():
            transaction.on_commit(lambda: committed.__setitem__(seq, time.time()))
            stamp.enqueue(seq=seq, out=out)

    def _wait_for_listener(self, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise BenchAbort(f"W3 worker exited with {proc.returncode} before listening")
            # The listener's first statement is its LISTEN; the only other it sends is the
            # producer's probe (SELECT 1), which may follow at once: either one means it listens.
            listening = self.admin.one(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND application_name = 'pgjobs-listener' "
                "AND (query ILIKE 'LISTEN%%' OR query = 'SELECT 1')"
            )
            if listening:
                time.sleep(0.5)  # the worker's catch-up claim after LISTEN, then idle
                return
            time.sleep(0.05)
        raise BenchAbort("W3: the worker did not LISTEN within a minute")

    @staticmethod
    def _read_stamps(out: Path, total: int, timeout: float = 30.0) -> dict[int, float]:
        deadline = time.monotonic() + timeout
        while True:
            lines = out.read_text().splitlines() if out.exists() else []
            if len(lines) >= total or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        started = {int(seq): float(at) for seq, at in (line.split() for line in lines)}
        if len(started) != total:
            raise BenchAbort(f"W3: {len(started)} of {total} jobs started within {timeout:.0f} s")
        return started

    # -- scale ------------------------------------------------------------------------------

    def build_history(self) -> dict[str, Any]:
        """The done rows of the history database: one INSERT ... SELECT, then VACUUM ANALYZE."""
        started = time.monotonic()
        self.history.truncate()
        self.history.fill(self.sizes.history_rows, status="done")
        self.history.run("VACUUM (ANALYZE) pgjobs_job")
        self.history.checkpoint()
        self.history_floor = int(self.history.one("SELECT max(id) FROM pgjobs_job") or 0)
        size = self.history.one("SELECT pg_total_relation_size('pgjobs_job')")
        return {
            "rows": self.sizes.history_rows,
            "seconds": time.monotonic() - started,
            "table_bytes": size,
        }

    def claim_latency(self, *, history: bool) -> dict[str, Any]:
        """``claim(limit=batch)`` then ``complete_many()`` of what it got, ``claims`` times."""
        sizes = self.sizes
        admin, alias, _url = self._target(history)
        floor = self._reset(history)
        manager = Job.objects.db_manager(alias)
        n = sizes.claims * sizes.claim_batch
        manager.enqueue_many(TASK, [{"n": i} for i in range(n)])
        admin.run("ANALYZE pgjobs_job")
        admin.checkpoint()
        claim_ms, complete_ms = [], []
        for _ in range(sizes.claims):
            t0 = time.perf_counter()
            jobs = manager.claim(limit=sizes.claim_batch)
            t1 = time.perf_counter()
            manager.complete_many(jobs)
            t2 = time.perf_counter()
            if len(jobs) != sizes.claim_batch:
                raise BenchAbort(f"claim returned {len(jobs)} jobs, expected {sizes.claim_batch}")
            claim_ms.append((t1 - t0) * 1000)
            complete_ms.append((t2 - t1) * 1000)
        admin.check_all_done(n, floor, "claim latency")
        self._reset(history)
        return {
            "claims": sizes.claims,
            "batch": sizes.claim_batch,
            "claim_ms": statistics.median(claim_ms),
            "complete_ms": statistics.median(complete_ms),
            "claim_complete_ms": statistics.median(
                a + b for a, b in zip(claim_ms, complete_ms, strict=True)
            ),
        }

    def rss(self) -> dict[str, Any]:
        """One long ``runjobs --burst``: VmRSS of the worker every second."""
        n = self.sizes.rss_jobs
        self._reset(False)
        self.admin.fill(n)
        self.admin.run("ANALYZE pgjobs_job")
        self.admin.checkpoint()
        proc = self.spawn(self.bench_url, "--burst", "--concurrency", str(self.sizes.concurrency))
        samples: list[tuple[float, int]] = []
        result: list[tuple[int, float]] = []
        waiter = threading.Thread(target=lambda: result.extend(self.reap([proc])), daemon=True)
        started = time.monotonic()
        waiter.start()
        waiter.join(1.0)  # the first sample once Python and Django are up and jobs run
        while waiter.is_alive():
            value = rss_bytes(proc.pid)
            if value is not None and proc.returncode is None:
                samples.append((time.monotonic() - started, value))
            waiter.join(1.0)
        if not result or result[0][0]:
            raise BenchAbort(f"RSS run: the worker failed ({result}); see the worker log")
        self.admin.check_all_done(n, 0, "RSS run")
        span = self.admin.span(0)
        self._reset(False)
        if len(samples) < 4:
            raise BenchAbort(f"RSS run: only {len(samples)} samples; use more --rss-jobs")
        values = [v for _t, v in samples]
        return {
            "jobs": n,
            "span_s": span,
            "jobs_per_s": n / span if span else None,
            "worker_cpu_s": result[0][1],
            "start_bytes": values[0],
            "quarter_bytes": values[len(values) // 4],
            "peak_bytes": max(values),
            "end_bytes": values[-1],
            "samples": [[round(t, 2), v] for t, v in samples],
        }

    # -- claimers ---------------------------------------------------------------------------

    def claimers(self, count: int) -> dict[str, Any]:
        """``count`` threads claiming from one queue as a busy worker does, each batch then
        completed, until ``claimers_jobs`` jobs (enqueued with ``enqueue_many()``) are drained;
        every job must end done with attempts 1 (``benchmarks/claimers.py``)."""
        from benchmarks.claimers import drain

        n = self.sizes.claimers_jobs
        self._reset(False)
        Job.objects.enqueue_many(TASK, [{"n": i} for i in range(n)])
        self.admin.run("ANALYZE pgjobs_job")
        self.admin.checkpoint()
        children = self.cpu.count() if self.cpu else 0
        pg_before = self.server_cpu()
        result = drain(
            alias="default",
            queue=conf.default_queue(),
            jobs=n,
            claimers=count,
            batch=self.sizes.claim_batch,
        )
        if self.cpu is not None:
            self.cpu.settle(children)  # the claimers' backends exited: reaped, counted
        pg_after = self.server_cpu()
        result["pg_cpu_s"] = None if pg_before is None or pg_after is None else pg_after - pg_before
        self.admin.check_all_done(n, 0, f"claimers x{count}")
        self._reset(False)
        return result

    # -- the SQL ceiling --------------------------------------------------------------------

    def ceiling(self, clients: int | None = None, jobs: int | None = None) -> dict[str, Any]:
        """pgbench with claim.CLAIM and finish.COMPLETE: claim ``batch`` in one transaction,
        complete them in a second one, ``clients`` clients (default ``sizes.clients``) over
        ``jobs`` jobs (default ``sizes.ceiling_jobs``), ``pgbench_threads`` threads."""
        sizes = self.sizes
        clients = clients or sizes.clients
        if self.pgbench is None:
            raise BenchAbort("pgbench not found")
        script = self.scratch / "claim_complete.sql"
        script.write_text(ceiling_script(sizes.claim_batch))
        n = jobs or sizes.ceiling_jobs
        per_client = -(-n // (clients * sizes.claim_batch))
        self._reset(False)
        self.admin.fill(n)
        self.admin.run("ANALYZE pgjobs_job")
        self.admin.checkpoint()
        out = self._pgbench(
            "-M",
            "prepared",
            "-t",
            str(per_client),
            "-f",
            str(script),
            "-D",
            "queue=default",
            "-D",
            "lease=300 seconds",
            "-D",
            "worker_id=pgbench",
            # A busy worker's claim: no suspects, and its registry's names (pgbench has no
            # NULL to pass for "any task").
            "-D",
            "suspects=false",
            "-D",
            f"tasks={execute.TextArray.of(registry.names())}",
            # The worker's own commit setting, so the ceiling is of the same transactions.
            "-D",
            "synchronous_commit="
            + (conf.worker_synchronous_commit() or self.admin.one("SHOW synchronous_commit")),
            clients=clients,
        )
        done, bad = self.admin.conn.execute(
            "SELECT count(*) FILTER (WHERE status = 'done' AND attempts = 1), "
            "count(*) FILTER (WHERE status = 'running' OR attempts > 1) FROM pgjobs_job"
        ).fetchone() or (0, 0)
        if bad:
            raise BenchAbort(
                f"pgbench ceiling: {bad} jobs running or claimed twice: the "
                "script's COMPLETE did not match its CLAIM"
            )
        self._reset(False)
        return {
            "jobs": n,
            "clients": clients,
            "done": done,
            "jobs_per_s": done / out["seconds"],
            **out,
        }

    def naive(self) -> dict[str, Any]:
        """The source article's naive claim under pgbench: how many of N jobs end up done."""
        sizes = self.sizes
        if self.pgbench is None:
            raise BenchAbort("pgbench not found")
        script = self.scratch / "naive.sql"
        script.write_text(NAIVE_CLAIM)
        n = sizes.naive_jobs
        self._reset(False)
        self.admin.fill(n)
        # The naive claim takes one row many times over, and the table refuses attempts beyond
        # max_attempts: room for every claim of the run, as scripts/demo.py gives its jobs.
        self.admin.run("UPDATE pgjobs_job SET max_attempts = %s", (n,))
        self.admin.run("ANALYZE pgjobs_job")
        self.admin.checkpoint()
        out = self._pgbench("-t", str(n // sizes.clients), "-f", str(script))
        done, top = self.admin.conn.execute(
            "SELECT count(*) FILTER (WHERE status = 'done'), max(attempts) FROM pgjobs_job"
        ).fetchone() or (0, 0)
        self._reset(False)
        return {
            "jobs": n,
            "statements": out["transactions"],
            "done": done,
            "max_attempts": top,
            "seconds": out["seconds"],
        }

    def _pgbench(self, *args: str, clients: int | None = None) -> dict[str, Any]:
        command = [
            str(self.pgbench),
            "-n",
            "-c",
            str(clients or self.sizes.clients),
            "-j",
            str(self.sizes.pgbench_threads),
            *args,
            self.bench_url,
        ]
        self.log.write(f"\n$ {' '.join(command)}\n")
        result = subprocess.run(
            command, capture_output=True, text=True, check=False, timeout=WORKER_TIMEOUT
        )
        self.log.write(result.stdout + result.stderr)
        self.log.flush()
        if result.returncode != 0:
            raise BenchAbort(f"pgbench exited with {result.returncode}: {result.stderr[-2000:]}")
        return pgbench_figures(result.stdout)

    # -- scrape -----------------------------------------------------------------------------

    def build_scrape(self) -> dict[str, Any]:
        """The scrape database's finished rows (done, as the worker leaves them), then
        ``VACUUM (ANALYZE)``; the plans of the scrape's statements over them go in the JSON."""
        started = time.monotonic()
        admin = self.scrape_table
        admin.truncate()
        admin.fill(self.sizes.scrape_rows, status="done")
        admin.run("VACUUM (ANALYZE) pgjobs_job")
        admin.checkpoint()
        seconds = time.monotonic() - started
        self.scrape_floor = int(admin.one("SELECT max(id) FROM pgjobs_job") or 0)
        plans = {}
        for name in ("QUEUE_DEPTH", "RUNNING_BY_QUEUE", "FAILED_BY_QUEUE", "LIVE_WORKERS"):
            rows = admin.conn.execute("EXPLAIN (COSTS OFF) " + getattr(dashboard, name)).fetchall()
            plans[name] = "\n".join(row[0] for row in rows)
        return {
            "rows": self.sizes.scrape_rows,
            "seconds": seconds,
            "table_bytes": admin.one("SELECT pg_total_relation_size('pgjobs_job')"),
            "plans": plans,
        }

    def scrape(self, *, finished: bool) -> dict[str, Any]:
        """``metrics.scrape()`` (the metrics view's queries and its encoding) ``scrapes``
        times, over the same live jobs (``SCRAPE_LIVE``) on an empty table or on the finished
        rows; each scrape's ready count is checked against what was inserted."""
        from prometheus_client.parser import text_string_to_metric_families

        from django_pgjobs.ops import metrics

        admin, alias = (self.scrape_table, "scrape") if finished else (self.admin, "default")
        floor = self.scrape_floor if finished else 0
        self._cut_back(admin, floor)
        admin.run(SCRAPE_LIVE, (TASK,))
        admin.run("ANALYZE pgjobs_job")
        admin.checkpoint()
        timings = []
        for _ in range(self.sizes.scrapes):
            t0 = time.perf_counter()
            body, _content_type = metrics.scrape(alias)
            timings.append((time.perf_counter() - t0) * 1000)
            ready = sum(
                sample.value
                for family in text_string_to_metric_families(body.decode())
                if family.name == "pgjobs_queue_ready_jobs"
                for sample in family.samples
            )
            if ready != SCRAPE_READY:
                raise BenchAbort(f"scrape: {ready} ready jobs reported, {SCRAPE_READY} inserted")
        self._cut_back(admin, floor)
        return {
            "scrapes": self.sizes.scrapes,
            "finished_rows": self.sizes.scrape_rows if finished else 0,
            "scrape_ms": statistics.median(timings),
            "bytes": len(body),
        }

    @staticmethod
    def _cut_back(admin: Admin, floor: int) -> None:
        if floor == 0:
            admin.truncate()
            return
        admin.run("DELETE FROM pgjobs_job WHERE id > %s", (floor,))
        admin.run("VACUUM pgjobs_job")

    # -- helpers ----------------------------------------------------------------------------

    def _target(self, history: bool) -> tuple[Admin, str, str]:
        if history:
            return self.history, "history", self.history_url
        return self.admin, "default", self.bench_url

    # -- async ------------------------------------------------------------------------------

    def sleepers(self, *, on_loop: bool, async_concurrency: int | None = None) -> dict[str, Any]:
        """The async section: ``sleep_jobs`` jobs that each wait ``sleep_s`` seconds, run by
        one ``runjobs --burst --concurrency C``: ``time.sleep`` on the C executor threads, or
        ``await asyncio.sleep`` on the event loop at ``--async-concurrency A``. ``ideal_s``
        is the wait alone at that width: jobs x seconds / (C or A)."""
        sizes = self.sizes
        n, width = sizes.sleep_jobs, sizes.concurrency
        args = ["--burst", "--concurrency", str(width)]
        if on_loop:
            width = async_concurrency or sizes.async_concurrency
            args += ["--async-concurrency", str(width)]
        self._reset(False)
        Job.objects.enqueue_many(nap if on_loop else doze, [{"seconds": sizes.sleep_s}] * n)
        started = time.monotonic()
        [(code, cpu)] = self.reap([self.spawn(self.bench_url, *args)])
        wall = time.monotonic() - started
        if code:
            raise BenchAbort(f"async section: a worker exited with {code}; see the worker log")
        self.admin.check_all_done(n, 0, "async section")
        span = self.admin.span(0)
        self._reset(False)
        ideal = n * sizes.sleep_s / width
        return {
            "jobs": n,
            "on_loop": on_loop,
            "width": width,
            "span_s": span,
            "wall_s": wall,
            "ideal_s": ideal,
            "worker_cpu_s": cpu,
        }

    def _reset(self, history: bool) -> int:
        """Empty the bench table, or cut the history table back to its done rows."""
        if not history:
            self.admin.truncate()
            return 0
        self.history.run("DELETE FROM pgjobs_job WHERE id > %s", (self.history_floor,))
        self.history.run("VACUUM pgjobs_job")
        return self.history_floor


def ceiling_script(batch: int) -> str:
    """A pgbench script of the project's own CLAIM and COMPLETE, read at run time: the claim
    of ``batch`` as the worker sends it (``claim.limited``: the LIMIT written in).

    The claim runs inside a CTE that returns the claimed ids, attempts and claim times as
    one JSON array (``\\gset`` takes one row); the complete takes it back as its ``claims``.
    A no-op job has no result: the objects carry none.
    """
    claim_params = set(pgbench_params(claim.CLAIM))
    complete_params = set(pgbench_params(finish.COMPLETE))
    known_claim = {
        "queue",
        "limit",
        "lease",
        "worker_id",
        "synchronous_commit",
        "suspects",
        "tasks",
    }
    known_complete = {"claims", "synchronous_commit"}
    if not claim_params <= known_claim or not complete_params <= known_complete:
        raise BenchAbort(
            "core.claim.CLAIM and core.finish.COMPLETE take parameters this script does not know: "
            f"{sorted((claim_params - known_claim) | (complete_params - known_complete))}"
        )
    claim_sql = re.sub(
        r"%\((\w+)\)s", r":\1", claim.limited(claim.CLAIM, batch).strip().rstrip(";")
    )
    complete = re.sub(r"%\((\w+)\)s", r":\1", finish.COMPLETE.strip().rstrip(";"))
    return (
        f"WITH claimed AS (\n{claim_sql}\n)\n"
        "SELECT coalesce(jsonb_agg(jsonb_build_object(\n"
        "         'id', id, 'attempts', attempts, 'claimed_at', attempted_at)), '[]') AS claims\n"
        "FROM claimed \\gset\n"
        f"{complete};\n"
    )
