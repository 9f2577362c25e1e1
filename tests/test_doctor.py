"""``manage.py jobsdoctor`` as a real process, against problems made for real.

Each problem is created the way production creates it (a session left idle in transaction
holding a claim while a worker runs 2,000 jobs, a CREATE INDEX CONCURRENTLY that failed, a
worker that died holding leases, a queue nobody works, a table whose autovacuum setting was
reset) and the doctor must name it on a ``PROBLEM:`` line and exit 1; a healthy database
exits 0.

The doctor judges the server as well as the table, and some problems need settings a shared
development server lacks, so this module runs on a throwaway PostgreSQL of its own (one for
the module, the table emptied before each test): ``wal_level = logical`` and
``max_prepared_transactions`` for the horizon holders, and ``autovacuum_naptime = 1h`` so that
autovacuum, on as on any production server, does not clean up behind a test's back while it
counts dead rows. Whatever a test changes on that server it puts back in a ``finally``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql as pgsql

from django_pgjobs import sql
from scripts.pgserver import ThrowawayPostgres
from tests.helpers import NOOP, PLAIN_COLUMNS, TIME_COLUMNS, wait_until
from tests.workers import Workers, ran

SCALE_FACTOR = "autovacuum_vacuum_scale_factor=0.01"


class Server:
    """The module's throwaway PostgreSQL and its migrated ``doctor`` database."""

    def __init__(self, pg: ThrowawayPostgres) -> None:
        self.pg = pg
        self.url = pg.url.rsplit("/", 1)[0] + "/doctor"

    def connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.url, autocommit=True)

    def query(self, statement: str, params: Any = None) -> list[tuple[Any, ...]]:
        with self.connect() as conn:
            cursor = conn.execute(statement, params)
            return cursor.fetchall() if cursor.description else []

    def scalar(self, statement: str, params: Any = None) -> Any:
        rows = self.query(statement, params)
        assert len(rows) == 1 and len(rows[0]) == 1, rows
        return rows[0][0]

    def reloptions(self) -> list[str]:
        return list(
            self.scalar("SELECT reloptions FROM pg_class WHERE oid = 'pgjobs_job'::regclass") or []
        )

    def insert(self, count: int = 1, **columns: Any) -> list[int]:
        """``count`` jobs alike but for their payload (``{"n": i}``), in any state; a
        ``timedelta`` is measured from the database's ``now()``. Returns their ids in order."""
        unknown = set(columns) - set(TIME_COLUMNS) - set(PLAIN_COLUMNS)
        assert not unknown, f"unknown columns {sorted(unknown)}"
        names, slots, params = ["task"], ["%s"], [NOOP]
        for name, value in columns.items():
            names.append(name)
            slots.append("now() + %s::interval" if isinstance(value, timedelta) else "%s")
            params.append(value)
        statement = pgsql.SQL(
            "INSERT INTO pgjobs_job ({names}, payload) SELECT {slots}, jsonb_build_object('n', n) "
            "FROM generate_series(1, %s) AS n ORDER BY n RETURNING id"
        ).format(
            names=pgsql.SQL(", ").join(map(pgsql.Identifier, names)),
            slots=pgsql.SQL(", ").join(map(pgsql.SQL, slots)),
        )
        with self.connect() as conn:
            rows = conn.execute(statement, [*params, count]).fetchall()
        return sorted(row[0] for row in rows)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with ThrowawayPostgres() as pg:
        with psycopg.connect(pg.url, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET wal_level = logical")
            conn.execute("ALTER SYSTEM SET max_prepared_transactions = 10")
            conn.execute("ALTER SYSTEM SET autovacuum_naptime = '1h'")
            conn.execute("CREATE DATABASE doctor")
        pg.restart()
        started = Server(pg)
        with Workers(tmp_path_factory.mktemp("doctor-migrate")) as setup:
            setup.run("migrate", "--verbosity", "0", database_url=started.url, timeout=180)
        yield started


@pytest.fixture(autouse=True)
def _empty_table(server: Server) -> None:
    server.query("TRUNCATE pgjobs_job")


class Diagnosis:
    """One run of ``jobsdoctor``: its exit status, its output and its PROBLEM lines."""

    def __init__(self, server: Server, workers: Workers, *args: str) -> None:
        process = workers.command("jobsdoctor", *args, database_url=server.url)
        self.status = process.wait(60)
        self.output = process.output()
        self.log = process.log()
        self.problems = [
            line.removeprefix("PROBLEM: ")
            for line in self.output.splitlines()
            if line.startswith("PROBLEM: ")
        ]

    def __repr__(self) -> str:
        return f"exit {self.status}:\n{self.output}\n{self.log}"

    def json(self) -> dict[str, Any]:
        return dict(json.loads(self.output))

    def about(self, text: str) -> list[str]:
        return [problem for problem in self.problems if text in problem]


@pytest.fixture
def doctor(server: Server, workers: Workers) -> Doctor:
    return Doctor(server, workers)


class Doctor:
    """Runs ``jobsdoctor`` against the module's server."""

    def __init__(self, server: Server, workers: Workers) -> None:
        self.server = server
        self.workers = workers

    def __call__(self, *args: str) -> Diagnosis:
        return Diagnosis(self.server, self.workers, *args)

    def healthy(self, *args: str) -> Diagnosis:
        report = self(*args)
        assert report.status == 0, report
        assert not report.problems, report
        assert report.output.splitlines()[-1] == "Healthy.", report
        return report


def seconds_idle(server: Server, pid: int) -> float:
    return float(
        server.scalar(
            "SELECT coalesce(max(extract(epoch FROM now() - state_change)), 0) "
            "FROM pg_stat_activity WHERE pid = %s AND state = 'idle in transaction'",
            [pid],
        )
    )


def test_a_healthy_queue_exits_0_in_text_and_json(server: Server, doctor: Doctor) -> None:
    server.insert(3)
    server.insert(2, status="running", attempts=1, locked_until=timedelta(minutes=5))
    server.insert(4, status="done", attempts=1, finished_at=timedelta(minutes=-1))
    server.insert(status="failed", attempts=5, finished_at=timedelta(hours=-3), last_error="old")

    text = doctor.healthy()
    assert "Invalid indexes: none" in text.output
    assert "Sessions idle in transaction: 0" in text.output

    report = doctor("--json").json()
    assert (report["healthy"], report["problems"]) == (True, [])
    assert report["invalid_indexes"] == []
    assert report["idle_in_transaction"] == []
    assert report["expired_leases"] == []
    assert report["table"]["reloptions"] == [SCALE_FACTOR]


@pytest.mark.slow
def test_a_session_idle_in_transaction_holding_a_claim_is_named_until_it_commits(
    server: Server, workers: Workers, doctor: Doctor
) -> None:
    server.insert(2001)
    with server.connect() as holder:
        pid = holder.info.backend_pid
        holder.execute("BEGIN")
        held = holder.execute(
            sql.CLAIM,
            {
                "queue": "default",
                "limit": 1,
                "lease": timedelta(minutes=5),
                "worker_id": "doctor-test",
                "synchronous_commit": None,
            },
        ).fetchall()
        assert len(held) == 1
        try:
            # The claim's lock does not stop a worker (SKIP LOCKED), so the harm is silent:
            # 2,000 jobs run while this transaction holds back VACUUM.
            worker = workers.burst("--concurrency", "4", database_url=server.url, timeout=120)
            assert ran(worker) == 2000
            # The default --idle-threshold is 5 s.
            wait_until(
                lambda: seconds_idle(server, pid) > 5.5,
                timeout=15,
                interval=0.2,
                message="the holder to be idle in transaction for 5 s",
            )

            report = doctor("--transaction-threshold", "1")

            assert report.status == 1, report
            idle = report.about(f"session pid {pid} ")
            assert len(idle) == 1, report
            assert " has been idle in transaction for " in idle[0]
            assert "holds back VACUUM" in idle[0]
            # ... and what it last ran: the claim.
            assert "last query: WITH next AS ( SELECT id FROM pgjobs_job" in idle[0]
            oldest = report.about(f"transaction of pid {pid} has been open for ")
            assert len(oldest) == 1, report
            assert f"Oldest open transaction: pid {pid}, " in report.output
            assert "Sessions idle in transaction: 1" in report.output
            # Only these two: the 2,000 jobs left no other trace the doctor objects to.
            assert len(report.problems) == 2, report

            as_json = doctor("--json", "--transaction-threshold", "1").json()
            assert as_json["healthy"] is False
            assert [s["pid"] for s in as_json["idle_in_transaction"]] == [pid]
            assert as_json["oldest_transaction"]["pid"] == pid
            # Ages are numbers of seconds (not strings) for whatever reads the JSON.
            assert isinstance(as_json["oldest_transaction"]["age"], float)
            assert as_json["oldest_transaction"]["age"] > 5
            assert as_json["idle_in_transaction"][0]["idle_for"] > 5
            assert len(as_json["problems"]) == 2
            assert as_json["problems"][0].startswith(f"session pid {pid} ")
            assert as_json["problems"][1].startswith(f"transaction of pid {pid} ")

            # Below the default --transaction-threshold (300 s) only the idle session counts.
            assert len(doctor().problems) == 1
        finally:
            holder.execute("COMMIT")

    after = doctor.healthy("--idle-threshold", "0", "--transaction-threshold", "1")
    assert str(pid) not in after.output
    # The held job is still running under its 5-minute lease: nothing for the doctor.
    assert server.scalar("SELECT count(*) FROM pgjobs_job WHERE status = 'running'") == 1


def test_an_invalid_index_from_a_failed_create_index_concurrently_is_named(
    server: Server, doctor: Doctor
) -> None:
    server.query("""INSERT INTO pgjobs_job (task, payload) VALUES (%s, '{"k": "same"}')""", [NOOP])
    server.query("""INSERT INTO pgjobs_job (task, payload) VALUES (%s, '{"k": "same"}')""", [NOOP])
    with server.connect() as conn:  # autocommit: CONCURRENTLY cannot run in a transaction
        try:
            with pytest.raises(psycopg.errors.UniqueViolation):
                conn.execute(
                    "CREATE UNIQUE INDEX CONCURRENTLY pgjobs_job_dupe_idx "
                    "ON pgjobs_job ((payload->>'k'))"
                )
            # The failed build left the index behind, invalid.
            assert (
                server.scalar(
                    "SELECT indisvalid FROM pg_index "
                    "WHERE indexrelid = 'pgjobs_job_dupe_idx'::regclass"
                )
                is False
            )

            report = doctor()

            assert report.status == 1, report
            assert report.problems == [
                "index pgjobs_job_dupe_idx is INVALID (a failed CREATE INDEX CONCURRENTLY): it "
                "slows every write and is never used; DROP INDEX CONCURRENTLY "
                "pgjobs_job_dupe_idx; then build it again."
            ], report
            assert "Invalid indexes: pgjobs_job_dupe_idx" in report.output
            assert doctor("--json").json()["invalid_indexes"] == ["pgjobs_job_dupe_idx"]
        finally:
            conn.execute("DROP INDEX CONCURRENTLY IF EXISTS pgjobs_job_dupe_idx")
    doctor.healthy()


def test_expired_leases_lag_and_a_reset_autovacuum_setting_in_text_and_json(
    server: Server, doctor: Doctor
) -> None:
    expired = [
        *server.insert(status="running", attempts=1, locked_until=timedelta(minutes=-3)),
        *server.insert(status="running", attempts=2, locked_until=timedelta(minutes=-1)),
    ]
    (leased,) = server.insert(status="running", attempts=1, locked_until=timedelta(minutes=5))
    server.insert(queue="emails", run_at=timedelta(minutes=-10))
    server.insert(queue="emails", run_at=timedelta(minutes=-1))
    server.insert(queue="reports", run_at=timedelta(seconds=-30))
    assert server.reloptions() == [SCALE_FACTOR]
    with server.connect() as conn:
        conn.execute("ALTER TABLE pgjobs_job RESET (autovacuum_vacuum_scale_factor)")
        try:
            text = doctor("--lag-threshold", "120")
            as_json = doctor("--json", "--lag-threshold", "120").json()
        finally:
            conn.execute("ALTER TABLE pgjobs_job SET (autovacuum_vacuum_scale_factor = 0.01)")
    assert server.reloptions() == [SCALE_FACTOR]

    assert text.status == 1, text
    assert len(text.problems) == 3, text
    lag, leases, autovacuum = text.problems
    # Only the queue past --lag-threshold: emails waited 10 minutes, reports 30 s.
    found = re.fullmatch(
        r"queue emails: the oldest ready job has waited (\d+) s \(2 ready\): workers are not "
        r"keeping up or not running\.",
        lag,
    )
    assert found, lag
    assert 600 <= int(found.group(1)) < 660
    # The expired leases by id, oldest first; the live lease is not among them.
    assert leases == (
        f"2 running job(s) have expired leases (e.g. {expired[0]}, {expired[1]}): their worker "
        "died or hangs; run `manage.py reapjobs` or check that workers reap (--reap-interval)."
    )
    assert str(leased) not in leases
    assert autovacuum.startswith("pgjobs_job has no autovacuum_vacuum_scale_factor of its own")
    assert "Table pgjobs_job: " in text.output and "options none" in text.output

    # --json: the same problems (the lag a second or two older), and the data behind them.
    assert as_json["healthy"] is False
    waited = re.compile(r"waited \d+ s")
    assert [waited.sub("waited N s", p) for p in as_json["problems"]] == [
        waited.sub("waited N s", p) for p in text.problems
    ]
    assert [row["id"] for row in as_json["expired_leases"]] == expired
    first, second = (row["expired_for"] for row in as_json["expired_leases"])
    assert 180 <= first < 240 and 60 <= second < 120
    assert as_json["table"]["reloptions"] is None
    queues = {q["queue"]: q for q in as_json["queues"]}
    assert (queues["emails"]["ready"], queues["emails"]["running"]) == (2, 0)
    assert queues["default"]["expired"] == 2 and queues["default"]["running"] == 3
    assert 30 <= queues["reports"]["lag_seconds"] < 90

    # Each problem goes away with its cause.
    server.query(
        "UPDATE pgjobs_job SET status = 'done', finished_at = now(), locked_until = NULL "
        "WHERE status = 'running' OR queue = 'emails'"
    )
    doctor.healthy("--lag-threshold", "120")


def test_the_report_shows_queue_depth_and_lag_dead_rows_autovacuum_and_reloptions(
    server: Server, workers: Workers, doctor: Doctor
) -> None:
    server.insert(queue="emails", run_at=timedelta(minutes=-2))
    server.insert(2, queue="emails", run_at=timedelta(seconds=-5))
    server.insert(3, queue="emails", run_at=timedelta(hours=1))
    server.insert(queue="emails", status="running", attempts=1, locked_until=timedelta(minutes=5))
    server.query(
        "INSERT INTO pgjobs_job (task, queue, status, attempts, finished_at, last_error) "
        "VALUES (%s, 'emails', 'failed', 5, now() - interval '5 minutes', %s)",
        [NOOP, "Traceback ...\nRuntimeError: smtp down"],
    )
    server.insert(4, queue="emails", status="done", attempts=1, finished_at=timedelta(minutes=-5))
    server.insert(12_000, status="done", attempts=1, finished_at=timedelta(days=-30))

    with server.connect() as conn:
        # Autovacuum must not clean up behind the test's back while it counts dead rows.
        conn.execute("ALTER TABLE pgjobs_job SET (autovacuum_enabled = false)")
        try:
            pruned = workers.run("prunejobs", "--older-than", "7d", database_url=server.url)
            assert "12000" in pruned.output(), pruned.tail()
            stats = (
                "SELECT n_dead_tup, last_autovacuum FROM pg_stat_user_tables "
                "WHERE relid = 'pgjobs_job'::regclass"
            )
            wait_until(
                lambda: server.query(stats)[0][0] >= 12_000,
                timeout=20,
                interval=0.2,
                message="the statistics to count the pruned rows as dead",
            )
            dead, last_autovacuum = server.query(stats)[0]

            text = doctor()
            as_json = doctor("--json").json()
        finally:
            conn.execute("ALTER TABLE pgjobs_job RESET (autovacuum_enabled)")
    assert server.reloptions() == [SCALE_FACTOR]

    queue_line = next(line for line in text.output.splitlines() if line.startswith("  emails:"))
    found = re.fullmatch(
        r"  emails: 3 ready \(oldest waited (\d+\.\d) s\), 3 scheduled, 1 running "
        r"\(0 expired leases\), 1 failed, 4 done in the last hour",
        queue_line,
    )
    assert found, queue_line
    assert 120 <= float(found.group(1)) < 180
    assert "Failures in the last hour: 1" in text.output
    assert "RuntimeError: smtp down" in text.output
    table_line = next(line for line in text.output.splitlines() if line.startswith("Table "))
    assert table_line == (
        f"Table pgjobs_job: {as_json['table']['n_live_tup']} live rows, {dead} dead, "
        f"last autovacuum {last_autovacuum or 'never'}, "
        f"options {SCALE_FACTOR}, autovacuum_enabled=false"
    )
    # 12,000 dead rows for a dozen live ones: vacuum is behind, and the doctor says so.
    assert text.status == 1, text
    assert text.problems == [
        f"pgjobs_job has {dead} dead rows for {as_json['table']['n_live_tup']} live ones: "
        "vacuum is not keeping up (an old transaction holding it back, or autovacuum too "
        "slow for this table)."
    ], text

    table = as_json["table"]
    assert table["n_dead_tup"] == dead
    assert table["last_autovacuum"] == (None if last_autovacuum is None else str(last_autovacuum))
    assert table["reloptions"] == [SCALE_FACTOR, "autovacuum_enabled=false"]
    (emails,) = [q for q in as_json["queues"] if q["queue"] == "emails"]
    assert {k: emails[k] for k in ("ready", "scheduled", "running", "expired", "failed")} == {
        "ready": 3,
        "scheduled": 3,
        "running": 1,
        "expired": 0,
        "failed": 1,
    }
    assert emails["done_last_hour"] == 4
    assert 120 <= emails["lag_seconds"] < 180
    assert as_json["failures_last_hour"] == 1
