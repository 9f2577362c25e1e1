"""The benchmark's PostgreSQL: its own throwaway server (fsync on) unless BENCH_DATABASE_URL.

Three databases are (re)created on that server: ``pgjobs_bench`` (emptied before every run),
``pgjobs_bench_history`` (holds the done rows of the scale section) and
``pgjobs_bench_scrape`` (the finished rows of the scrape section).
"""

from __future__ import annotations

import re
import shutil
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg import sql as pgsql

BENCH_DB = "pgjobs_bench"
HISTORY_DB = "pgjobs_bench_history"
SCRAPE_DB = "pgjobs_bench_scrape"
TASK = "testproject.testjobs.noop"
CRUNCH = "benchmarks.jobs.crunch"  # the cores section's CPU-bound job


class BenchAbort(RuntimeError):
    """A benchmark result that cannot be trusted (lost or repeated jobs, a failed process)."""


def with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("postgres", "postgresql"):
        raise BenchAbort(f"BENCH_DATABASE_URL must be a postgres:// URL, not {parts.scheme!r}")
    return urlunsplit(parts._replace(path="/" + name))


def masked(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.replace(parts.password, "***", 1)))


def recreate(server_url: str, name: str) -> str:
    """Drop and create database ``name``; return its URL."""
    admin_url = server_url
    if urlsplit(server_url).path.lstrip("/") in (BENCH_DB, HISTORY_DB, SCRAPE_DB):
        admin_url = with_database(server_url, "postgres")
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(
            pgsql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(pgsql.Identifier(name))
        )
        conn.execute(pgsql.SQL("CREATE DATABASE {}").format(pgsql.Identifier(name)))
    return with_database(server_url, name)


def find_pgbench(bindir: Path | None) -> Path | None:
    if bindir is not None and (bindir / "pgbench").exists():
        return bindir / "pgbench"
    found = shutil.which("pgbench")
    if found:
        return Path(found)
    try:
        from scripts.pgserver import find_bindir

        candidate = find_bindir() / "pgbench"
    except RuntimeError:
        return None
    return candidate if candidate.exists() else None


class Admin:
    """A plain autocommit psycopg connection to one database, for set-up and checks."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.conn = psycopg.connect(url, autocommit=True)
        self.can_checkpoint = True

    def close(self) -> None:
        self.conn.close()

    def one(self, query: Any, params: Any = None) -> Any:
        row = self.conn.execute(query, params).fetchone()
        return row[0] if row else None

    def run(self, query: Any, params: Any = None) -> None:
        self.conn.execute(query, params)

    def backend_pid(self) -> int:
        return int(self.one("SELECT pg_backend_pid()"))

    def checkpoint(self) -> None:
        """Flush dirty pages before a timed piece, so no run inherits another's checkpoint."""
        if not self.can_checkpoint:
            return
        try:
            self.run("CHECKPOINT")
        except psycopg.errors.InsufficientPrivilege:
            self.can_checkpoint = False

    def truncate(self) -> None:
        self.run("TRUNCATE pgjobs_job")

    def fill(self, count: int, *, status: str = "queued") -> None:
        """Insert ``count`` no-op jobs with one statement (queued, or done history rows)."""
        if status == "queued":
            self.run(
                "INSERT INTO pgjobs_job (queue, task, payload, run_at) "
                "SELECT 'default', %s, jsonb_build_object('n', g), now() "
                "FROM generate_series(1, %s) g",
                (TASK, count),
            )
            return
        # Done rows as the worker leaves them, finished over the last day.
        self.run(
            "INSERT INTO pgjobs_job (queue, task, payload, status, run_at, attempts, "
            "  created_at, started_at, attempted_at, finished_at, worker_ids) "
            "SELECT 'default', %s, jsonb_build_object('n', g), 'done', t, 1, t, t, t, "
            "       t + interval '1 ms', '[\"history:1\"]' "
            "FROM generate_series(1, %s) g, "
            "     LATERAL (SELECT now() - interval '1 day' "
            "                     + g * (interval '1 day' / %s)) AS x(t)",
            (TASK, count, count),
        )

    def check_all_done(self, expected: int, floor: int, what: str) -> None:
        """Abort unless exactly ``expected`` jobs above id ``floor`` exist, each done once."""
        total, done_once = self.conn.execute(
            "SELECT count(*), count(*) FILTER (WHERE status = 'done' AND attempts = 1) "
            "FROM pgjobs_job WHERE id > %s",
            (floor,),
        ).fetchone() or (0, 0)
        if total != expected or done_once != expected:
            states = self.conn.execute(
                "SELECT status, attempts, count(*) FROM pgjobs_job WHERE id > %s "
                "GROUP BY 1, 2 ORDER BY 1, 2",
                (floor,),
            ).fetchall()
            raise BenchAbort(
                f"{what}: expected {expected} jobs done with attempts 1, found {done_once} "
                f"of {total} (status, attempts, count: {states}). A benchmark that loses or "
                "repeats jobs is invalid."
            )

    def span(self, floor: int) -> float:
        """Seconds from the first claim to the last completion (database clock)."""
        value = self.one(
            "SELECT extract(epoch FROM max(finished_at) - min(attempted_at))::float8 "
            "FROM pgjobs_job WHERE id > %s",
            (floor,),
        )
        return float(value or 0.0)

    def settings(self) -> dict[str, str]:
        names = (
            "server_version",
            "fsync",
            "synchronous_commit",
            "shared_buffers",
            "max_wal_size",
            "wal_sync_method",
            "max_connections",
        )
        return {
            name: str(self.one(pgsql.SQL("SHOW {}").format(pgsql.Identifier(name))))
            for name in names
        }


class Server(AbstractContextManager["Server"]):
    """Where the benchmark runs: a throwaway server of its own, or BENCH_DATABASE_URL."""

    def __init__(self, url: str | None) -> None:
        self.given_url = url
        self.pg: Any = None
        self.url = ""
        self.bindir: Path | None = None

    def __enter__(self) -> Server:
        if self.given_url:
            self.url = self.given_url
            return self
        from scripts.pgserver import ThrowawayPostgres

        self.pg = ThrowawayPostgres(fsync=True).start()
        self.url = self.pg.url
        self.bindir = self.pg.bindir
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pg is not None:
            self.pg.destroy()

    def describe(self) -> str:
        if self.pg is not None:
            return f"throwaway PostgreSQL (fsync=on) at {self.url}, data in {self.pg.root}"
        return f"BENCH_DATABASE_URL {masked(self.url)}"


def pgbench_params(statement: str) -> list[str]:
    return re.findall(r"%\((\w+)\)s", statement)


def pgbench_figures(stdout: str) -> dict[str, Any]:
    """The transactions of a pgbench run and their seconds, from pgbench's own report: the
    time its clients took to connect is not counted."""
    processed = re.search(r"number of transactions actually processed: (\d+)", stdout)
    tps = re.search(r"tps = ([\d.]+) \(without initial connection time\)", stdout)
    if not processed or not tps:
        raise BenchAbort(f"could not read pgbench's output:\n{stdout[-2000:]}")
    transactions = int(processed.group(1))
    return {
        "transactions": transactions,
        "tps": float(tps.group(1)),
        "seconds": transactions / float(tps.group(1)),
    }
