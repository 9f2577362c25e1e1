"""``manage.py jobsdoctor`` as a real process, against problems made for real.

Each problem is created the way production creates it (a session left idle in transaction
holding a claim while a worker runs 2,000 jobs, a prepared transaction nobody finished, a hot
standby whose long query holds its replication slot's xmin, a lock that keeps autovacuum out
round after round, autovacuum settings turned off, a CREATE INDEX CONCURRENTLY that failed, a
worker that died holding leases, a queue nobody works, a queue no live worker serves, a job
whose task no live worker knows) and the doctor must name it on a ``PROBLEM:`` line and exit 1;
a healthy database, however many dead rows a burst of work has just left, exits 0. Where the
doctor says VACUUM cannot (or can) remove the dead rows, a VACUUM checks it.

The doctor judges the server as well as the table, and some problems need settings a shared
development server lacks, so this module runs on a throwaway PostgreSQL of its own (one for
the module, the tables emptied before each test, and one live worker registered that serves
the queues the tests use with any task, as production has: without one every ready job would
be a problem): ``wal_level = logical`` and
``max_prepared_transactions`` for the horizon holders, and ``autovacuum_naptime = 1h`` so that
autovacuum, on as on any production server, does not clean up behind a test's back while it
counts dead rows. Whatever a test changes on that server it puts back in a ``finally``.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import subprocess
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql as pgsql

from django_pgjobs.core import claim, control, upkeep
from django_pgjobs.ops.findings import Thresholds
from scripts.pgserver import ThrowawayPostgres
from tests.helpers import NOOP, PLAIN_COLUMNS, TIME_COLUMNS, wait_until, worker_record
from tests.workers import Workers, ran

# In one pytest-xdist process (--dist loadgroup): the module's server is started once.
pytestmark = pytest.mark.xdist_group("doctor")

SCALE_FACTOR = "autovacuum_vacuum_scale_factor=0.01"
DEAD_ROWS = "SELECT n_dead_tup FROM pg_stat_user_tables WHERE relid = 'pgjobs_job'::regclass"
# How long the doctor counts the table as unvacuumed (the same expression as its TABLE_HEALTH).
UNVACUUMED_FOR = (
    "SELECT extract(epoch FROM now() - coalesce(greatest(last_autovacuum, last_vacuum), "
    "pg_postmaster_start_time())) FROM pg_stat_user_tables WHERE relid = 'pgjobs_job'::regclass"
)


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

    def dead_rows(self) -> int:
        return int(self.scalar(DEAD_ROWS) or 0)

    def leave_dead_rows(self, count: int) -> None:
        """Insert ``count`` jobs and finish them all: ``count`` dead row versions, counted."""
        before = self.dead_rows()
        self.insert(count)
        self.query("UPDATE pgjobs_job SET status = 'done', finished_at = now()")
        # A session's counts reach the statistics when it ends, a moment after it closed.
        wait_until(
            lambda: self.dead_rows() >= before + count,
            timeout=30,
            interval=0.1,
            message=f"the statistics to count {count} more dead rows",
        )

    @contextlib.contextmanager
    def setting(self, **values: str) -> Iterator[None]:
        """Server settings (ALTER SYSTEM, reloaded) for the block; the old values after it."""
        before = {
            name: self.scalar(pgsql.SQL("SHOW {}").format(pgsql.Identifier(name)))
            for name in values
        }
        self._set(values)
        try:
            yield
        finally:
            self._set(before)

    def _set(self, values: dict[str, str]) -> None:
        for name, value in values.items():
            self.query(
                pgsql.SQL("ALTER SYSTEM SET {} = {}").format(
                    pgsql.Identifier(name), pgsql.Literal(value)
                )
            )
        self.query("SELECT pg_reload_conf()")
        show = pgsql.SQL(", ").join(
            pgsql.SQL("current_setting({})").format(pgsql.Literal(name)) for name in values
        )
        wait_until(
            lambda: self.query(pgsql.SQL("SELECT {}").format(show))[0] == tuple(values.values()),
            timeout=30,
            interval=0.05,
            message=f"the server to reload {values}",
        )

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


# The registry row of a worker that serves every queue the tests use and claims any task.
STANDING = "standing-worker"
SERVED = {"default": None, "emails": None, "reports": None}


def register(
    server: Server, worker_id: str, queues: dict[str, int | None], tasks: list[str] | None
) -> None:
    """A live worker's registry row, written with the worker's own statement."""
    server.query(
        upkeep.WORKER_BEAT,
        worker_record(worker_id, queues, tasks, ttl=timedelta(hours=1), host="doctor-host"),
    )


@pytest.fixture(autouse=True)
def _empty_table(server: Server) -> None:
    server.query("TRUNCATE pgjobs_job, pgjobs_worker, pgjobs_queue")
    register(server, STANDING, SERVED, None)


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


@pytest.mark.slow
def test_a_busy_queue_right_after_a_burst_is_healthy_however_many_dead_rows(
    server: Server, workers: Workers, doctor: Doctor
) -> None:
    # A queue autovacuum keeps up with: vacuumed a moment ago, then a burst of work. Each job
    # leaves two dead row versions (its claim and its completion) until the next autovacuum,
    # so a burst leaves more dead rows than live ones: that alone is no problem.
    server.query("VACUUM pgjobs_job")
    server.insert(8000)
    worker = workers.burst("--concurrency", "4", database_url=server.url, timeout=300)
    assert ran(worker) == 8000
    wait_until(
        lambda: (server.scalar(DEAD_ROWS) or 0) > 10_000,
        timeout=30,
        interval=0.2,
        message="the statistics to count the burst's dead rows",
    )

    text = doctor.healthy()
    as_json = doctor("--json").json()

    assert (as_json["healthy"], as_json["problems"]) == (True, [])
    table = as_json["table"]
    # The doctor saw what the issue reported: more dead rows than live ones, over 10,000.
    assert table["n_dead_tup"] > max(table["n_live_tup"], 10_000), as_json
    assert "Table pgjobs_job: 8000 live rows, " in text.output


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
            claim.CLAIM,
            {
                "queue": "default",
                "limit": 1,
                "lease": timedelta(minutes=5),
                "worker_id": "doctor-test",
                "suspects": True,
                "synchronous_commit": None,
                "tasks": None,
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
            assert len(report.problems) == 2, report
            idle, horizon = report.problems
            assert idle.startswith(
                f"session pid {pid} (postgres, no application_name) has been idle in "
                "transaction for "
            ), report
            assert "s: it holds back VACUUM for every table in this database" in idle
            # ... and what it last ran: the claim.
            assert "last query: WITH next AS ( SELECT id FROM pgjobs_job" in idle
            # The horizon it holds, now that the 2,000 jobs left their dead rows behind it.
            found = re.fullmatch(
                rf"session pid {pid} \(idle in transaction; postgres, no application_name\) "
                r"has held back the xmin horizon for (\d+) s, (\d+) transactions: VACUUM "
                r"cannot remove the rows of pgjobs_job that died since \((\d+) dead, "
                r"autovacuum's threshold is (\d+)\); last query: WITH next AS .*; commit it "
                r"or end it where it started, or, if it is abandoned, "
                rf"SELECT pg_terminate_backend\({pid}\);",
                horizon,
            )
            assert found, horizon
            open_for, transactions, dead, threshold = map(int, found.groups())
            assert open_for >= 5 and transactions > 1
            # Two dead versions per job (its claim and its completion), less what pruning of
            # full pages has already reclaimed: far past the threshold (50 + 1% of the rows).
            assert dead > 2000 and threshold < 100
            assert f"  session pid {pid} (idle in transaction; " in report.output
            assert "Sessions idle in transaction: 1" in report.output

            as_json = doctor("--json", "--transaction-threshold", "1").json()
            assert as_json["healthy"] is False
            assert [s["pid"] for s in as_json["idle_in_transaction"]] == [pid]
            assert as_json["idle_in_transaction"][0]["holds_horizon"] is True
            assert as_json["oldest_transaction"]["pid"] == pid
            # Ages are numbers of seconds (not strings) for whatever reads the JSON.
            assert isinstance(as_json["oldest_transaction"]["age"], float)
            assert as_json["oldest_transaction"]["age"] > 5
            assert as_json["idle_in_transaction"][0]["idle_for"] > 5
            (session,) = as_json["horizon"]
            assert (session["kind"], session["name"]) == ("session", f"pid {pid}")
            assert session["xmin_age"] > 1 and session["holds_table"] is True
            assert len(as_json["problems"]) == 2
            assert as_json["problems"][0].startswith(f"session pid {pid} (postgres, ")
            assert as_json["problems"][1].startswith(f"session pid {pid} (idle in transaction; ")

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


def test_a_payload_trigger_switched_off_or_not_always_or_missing_is_named(
    server: Server, doctor: Doctor
) -> None:
    """The payload check is a trigger (migration 0011), which a restore with
    --disable-triggers, DISABLE TRIGGER or a table built without migrations leaves off."""
    enable = "ALTER TABLE pgjobs_job ENABLE ALWAYS TRIGGER pgjobs_job_payload_check"
    trigger = server.query(
        "SELECT pg_get_triggerdef(oid) FROM pg_trigger WHERE tgname = 'pgjobs_job_payload_check'"
    )[0][0]
    try:
        server.query("ALTER TABLE pgjobs_job DISABLE TRIGGER pgjobs_job_payload_check")
        report = doctor()
        assert report.status == 1, report
        assert report.problems == [
            "the trigger pgjobs_job_payload_check is disabled: a row whose payload is not a "
            f"JSON object can be written, and its job can never run; {enable};"
        ], report

        server.query("ALTER TABLE pgjobs_job ENABLE TRIGGER pgjobs_job_payload_check")
        (problem,) = doctor("--json").json()["problems"]
        assert "is not enabled ALWAYS: sessions in session_replication_role = replica" in problem

        server.query("DROP TRIGGER pgjobs_job_payload_check ON pgjobs_job")
        (problem,) = doctor().problems
        assert problem.startswith("the trigger pgjobs_job_payload_check is missing"), problem

        # A table not migrated to 0011 yet holds payloads with 0006's CHECK: nothing missing.
        server.query(
            "ALTER TABLE pgjobs_job ADD CONSTRAINT pgjobs_job_payload_check "
            "CHECK (jsonb_typeof(payload) = 'object')"
        )
        doctor.healthy()
    finally:
        server.query("ALTER TABLE pgjobs_job DROP CONSTRAINT IF EXISTS pgjobs_job_payload_check")
        server.query("DROP TRIGGER IF EXISTS pgjobs_job_payload_check ON pgjobs_job")
        server.query(trigger)
        server.query(enable)
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
    table = as_json["table"]
    # The threshold autovacuum works to, from the table's own scale factor (0.01) and the
    # server's base threshold (50); reltuples is -1 (never counted, taken as 0) or a count.
    assert table["vacuum_threshold"] == int(50 + 0.01 * max(table["reltuples"], 0))
    table_line = next(line for line in text.output.splitlines() if line.startswith("Table "))
    assert table_line == (
        f"Table pgjobs_job: {table['n_live_tup']} live rows, {dead} dead "
        f"({round(dead / table['n_live_tup'], 2)} per live row; autovacuum vacuums past "
        f"{table['vacuum_threshold']}), last autovacuum {last_autovacuum or 'never'}, "
        f"last vacuum {table['last_vacuum'] or 'never'}, "
        f"options {SCALE_FACTOR}, autovacuum_enabled=false"
    )
    assert "Autovacuum: on (naptime 3600 s), track_counts on" in text.output
    # 12,000 dead rows for a dozen live ones are information; what is wrong is that
    # autovacuum may never remove them.
    assert text.status == 1, text
    assert text.problems == [
        "pgjobs_job has autovacuum_enabled = false: autovacuum never vacuums it; "
        "ALTER TABLE pgjobs_job RESET (autovacuum_enabled);"
    ], text

    assert table["n_dead_tup"] == dead
    assert table["dead_per_live_row"] == round(dead / table["n_live_tup"], 2)
    assert table["autovacuum_enabled"] is False
    assert table["last_autovacuum"] == (None if last_autovacuum is None else str(last_autovacuum))
    assert table["reloptions"] == [SCALE_FACTOR, "autovacuum_enabled=false"]
    assert as_json["settings"] == {
        "autovacuum": True,
        "track_counts": True,
        "autovacuum_naptime": 3600.0,
    }
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


def test_a_forgotten_prepared_transaction_is_named_once_dead_rows_pile_up_behind_it(
    server: Server, doctor: Doctor
) -> None:
    assert int(server.scalar("SHOW max_prepared_transactions")) > 0
    server.insert(10)
    with server.connect() as conn:
        conn.execute("BEGIN")
        conn.execute("SELECT pg_current_xact_id()")  # a transaction id, as any write has
        conn.execute("PREPARE TRANSACTION 'invoice''s 42'")
    # The session is gone; the prepared transaction stays until someone finishes it.
    try:
        wait_until(
            lambda: server.scalar(
                "SELECT now() - prepared > interval '1.5 s' FROM pg_prepared_xacts"
            ),
            timeout=30,
            interval=0.1,
            message="the prepared transaction to be older than 1 s",
        )
        # Old enough, but the table has nothing for vacuum to do: shown, not judged.
        quiet = doctor.healthy("--transaction-threshold", "1")
        listed = re.search(
            r"\n  prepared transaction 'invoice''s 42' \(owner postgres, prepared at "
            r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\+0000\): \d+ s, \d+ transactions\n",
            quiet.output,
        )
        assert listed, quiet

        server.leave_dead_rows(500)
        report = doctor("--transaction-threshold", "1")

        assert report.status == 1, report
        (problem,) = report.problems
        found = re.fullmatch(
            r"prepared transaction 'invoice''s 42' \(owner postgres, prepared at [^)]+\) has "
            r"held back the xmin horizon for \d+ s, (\d+) transactions: VACUUM cannot remove "
            r"the rows of pgjobs_job that died since \((\d+) dead, autovacuum's threshold is "
            r"(\d+)\); it outlives the session that prepared it, so only its transaction "
            r"manager or you can end it: COMMIT PREPARED 'invoice''s 42'; or ROLLBACK PREPARED "
            r"'invoice''s 42';",
            problem,
        )
        assert found, problem
        transactions, dead, threshold = map(int, found.groups())
        assert transactions >= 2 and dead >= 500 and threshold < dead
        # And it is true: a VACUUM now keeps every one of those rows.
        server.query("VACUUM pgjobs_job")
        assert server.dead_rows() >= 500
        (holder,) = doctor("--json").json()["horizon"]
        assert (holder["kind"], holder["name"]) == ("prepared transaction", "'invoice''s 42'")
        assert holder["age"] > 1 and holder["holds_table"] is True
        # Under the default --transaction-threshold (300 s) it is young enough to wait for.
        doctor.healthy()
    finally:
        server.query("ROLLBACK PREPARED 'invoice''s 42'")
    server.query("VACUUM pgjobs_job")
    assert server.dead_rows() == 0
    assert "Xmin horizon held by: nothing" in doctor.healthy("--transaction-threshold", "0").output


class Standby:
    """A hot standby of the module's server, made the way an operator makes one
    (``pg_basebackup -R`` with a physical slot) and run with ``hot_standby_feedback``: its
    queries hold back the primary's vacuum through the slot's ``xmin``."""

    def __init__(self, server: Server, slot: str) -> None:
        self.primary = server
        self.slot = slot
        self.pg = ThrowawayPostgres()

    def __enter__(self) -> Standby:
        data = self.pg.data
        data.mkdir(mode=0o700)
        if self.pg.user:
            owner = pwd.getpwnam(self.pg.user)
            for path in (self.pg.root, data):
                os.chown(path, owner.pw_uid, owner.pw_gid)
        try:
            subprocess.run(
                [
                    str(self.pg.bindir / "pg_basebackup"),
                    *("-h", "127.0.0.1", "-p", str(self.primary.pg.port), "-U", "postgres"),
                    *("-D", str(data), "-R", "-C", "-S", self.slot, "-c", "fast", "--no-sync"),
                ],
                user=self.pg.user,
                check=True,
                capture_output=True,
                text=True,
            )
            with open(data / "postgresql.auto.conf", "a") as conf:
                conf.write("hot_standby_feedback = on\nwal_receiver_status_interval = 1\n")
            self.pg.start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(f"postgres://postgres@127.0.0.1:{self.pg.port}/doctor")

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.pg.destroy()
        finally:
            self.primary.query(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
                "WHERE slot_name = %s",
                [self.slot],
            )


@pytest.mark.slow
def test_a_slot_held_by_a_standby_query_is_named_and_still_holds_once_the_standby_is_gone(
    server: Server, doctor: Doctor
) -> None:
    if not (server.pg.bindir / "pg_basebackup").exists():
        pytest.skip(f"no pg_basebackup in {server.pg.bindir} to make a standby with")
    slot_xmin = "SELECT xmin FROM pg_replication_slots WHERE slot_name = 'doctor_standby'"
    with Standby(server, "doctor_standby") as standby:
        with standby.connect() as report_query:
            # A long report on the standby: its snapshot is what the standby reports back.
            report_query.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            report_query.execute("SELECT count(*) FROM pgjobs_job")
            wait_until(
                lambda: server.scalar(slot_xmin) is not None,
                timeout=30,
                interval=0.1,
                message="the standby's feedback to set the slot's xmin",
            )
            server.leave_dead_rows(500)
            server.query("VACUUM pgjobs_job")
            assert server.dead_rows() >= 500, "the slot did not hold the dead rows back"

            # A few transactions old: listed, but under the default --slot-age-threshold.
            quiet = doctor.healthy()
            assert re.search(
                r"\n  physical replication slot 'doctor_standby' \(active: walsender pid \d+ "
                r"for walreceiver\): \d+ transactions\n",
                quiet.output,
            ), quiet

            active = doctor("--slot-age-threshold", "1")
            assert active.status == 1, active
            (problem,) = active.problems
            assert re.fullmatch(
                r"physical replication slot 'doctor_standby' \(active: walsender pid \d+ for "
                r"walreceiver\) has held back the xmin horizon for \d+ transactions: VACUUM "
                r"cannot remove the rows of pgjobs_job that died since \(\d+ dead, "
                r"autovacuum's threshold is \d+\); its standby sends the xmin of its oldest "
                r"query \(hot_standby_feedback\): end the long queries there, or turn "
                r"hot_standby_feedback off on the standby\.",
                problem,
            ), problem

        # The standby goes away for good; the slot keeps its xmin, and nothing will move it.
        standby.pg.stop()
        assert server.scalar(slot_xmin) is not None
        # The standby's last feedback may have come after the report ended, moving the xmin
        # up to the newest transaction: two more make it older than the threshold either way.
        server.query("SELECT txid_current()")
        server.query("SELECT txid_current()")
        gone = doctor("--slot-age-threshold", "1")
        assert gone.status == 1, gone
        (problem,) = gone.problems
        assert problem.startswith(
            "physical replication slot 'doctor_standby' (inactive) has held back the xmin "
            "horizon for "
        ), problem
        assert problem.endswith(
            "no standby is connected, so nothing will move it: if the standby is gone for "
            "good, SELECT pg_drop_replication_slot('doctor_standby');"
        ), problem
        (holder,) = doctor("--json").json()["horizon"]
        assert holder["kind"] == "physical replication slot"
        assert holder["age"] is None and holder["xmin_age"] >= 2
    # The slot dropped, VACUUM removes the rows it held.
    server.query("VACUUM pgjobs_job")
    assert server.dead_rows() == 0
    doctor.healthy("--slot-age-threshold", "0")


def test_a_logical_slot_holds_back_only_the_catalogs_and_is_not_blamed_for_the_table(
    server: Server, doctor: Doctor
) -> None:
    assert server.scalar("SHOW wal_level") == "logical"
    server.query("SELECT pg_create_logical_replication_slot('doctor_logical', 'pgoutput')")
    try:
        server.leave_dead_rows(500)
        report = doctor.healthy("--slot-age-threshold", "0")
        assert re.search(
            r"\n  logical replication slot 'doctor_logical' \(inactive; catalog_xmin only\): "
            r"\d+ transactions \(not pgjobs_job\)\n",
            report.output,
        ), report
        (holder,) = doctor("--json").json()["horizon"]
        assert holder["holds_table"] is False and holder["xmin_age"] >= 1
        # And it is true: VACUUM removes the table's dead rows while the slot stays.
        server.query("VACUUM pgjobs_job")
        assert server.dead_rows() == 0
    finally:
        server.query("SELECT pg_drop_replication_slot('doctor_logical')")


@pytest.mark.slow
def test_autovacuum_kept_off_the_table_for_many_rounds_is_named_with_the_lock_in_its_way(
    server: Server, doctor: Doctor
) -> None:
    with server.setting(autovacuum_naptime="1s"), server.connect() as migration:
        # What a long CREATE INDEX CONCURRENTLY or VALIDATE CONSTRAINT holds: autovacuum skips
        # a table it cannot lock at once, round after round.
        migration.execute("BEGIN")
        migration.execute("LOCK TABLE pgjobs_job IN SHARE UPDATE EXCLUSIVE MODE")
        try:
            server.leave_dead_rows(500)
            wait_until(
                lambda: server.scalar(UNVACUUMED_FOR) > 10.5,
                timeout=60,
                interval=0.2,
                message="ten autovacuum rounds (of 1 s) without a vacuum of pgjobs_job",
            )

            report = doctor("--idle-threshold", "3600")

            assert report.status == 1, report
            (problem,) = report.problems
            found = re.fullmatch(
                r"autovacuum has not vacuumed pgjobs_job (since \S+ \S+|since the server "
                r"started) \((\d+) s, more than 10 rounds of autovacuum_naptime = 1 s\) although "
                r"its (\d+) dead rows are past its threshold of (\d+): "
                rf"pid {migration.info.backend_pid} \(postgres, no application_name, idle in "
                r"transaction\) has held ShareUpdateExclusiveLock on it for \d+ s, which "
                r"autovacuum cannot get past; query: LOCK TABLE pgjobs_job IN SHARE UPDATE "
                r"EXCLUSIVE MODE\.",
                problem,
            )
            assert found, problem
            assert int(found.group(2)) >= 10 and int(found.group(3)) >= 500
            assert (
                f"Locks that keep autovacuum off pgjobs_job: pid {migration.info.backend_pid} "
                "ShareUpdateExclusiveLock"
            ) in report.output
        finally:
            migration.execute("ROLLBACK")
        # The lock gone, autovacuum comes within a round or two.
        wait_until(
            lambda: server.dead_rows() < 500,
            timeout=60,
            interval=0.2,
            message="autovacuum to vacuum pgjobs_job",
        )
        assert server.scalar(
            "SELECT last_autovacuum IS NOT NULL FROM pg_stat_user_tables "
            "WHERE relid = 'pgjobs_job'::regclass"
        )
        doctor.healthy()


@pytest.mark.slow
def test_settings_that_keep_autovacuum_away_are_each_named(server: Server, doctor: Doctor) -> None:
    server.leave_dead_rows(500)
    with server.setting(autovacuum="off", autovacuum_naptime="1s"):
        # Long enough without a vacuum for the lateness check, which must stay silent: the
        # setting is the cause, and it is named once.
        wait_until(
            lambda: server.scalar(UNVACUUMED_FOR) > 10.5,
            timeout=60,
            interval=0.2,
            message="ten rounds of autovacuum_naptime without a vacuum",
        )
        off = doctor()
        assert off.status == 1, off
        assert off.problems == [
            "autovacuum is off on this server: nothing removes the dead rows every claim and "
            "every outcome leave in pgjobs_job; set autovacuum = on in postgresql.conf (the "
            "default) and reload."
        ], off
        assert "Autovacuum: off (naptime 1 s), track_counts on" in off.output

    server.query("ALTER DATABASE doctor SET track_counts = off")
    try:
        uncounted = doctor()
    finally:
        server.query("ALTER DATABASE doctor RESET track_counts")
    assert uncounted.status == 1, uncounted
    assert uncounted.problems == [
        "track_counts is off: PostgreSQL does not count dead rows, so autovacuum never sees "
        "that pgjobs_job needs a vacuum (and this report's row counts stand still); set "
        "track_counts = on (the default) for the server and this database."
    ], uncounted
    doctor.healthy()


def test_a_negative_threshold_is_refused_with_the_option_named(doctor: Doctor) -> None:
    for option in ("--idle-threshold", "--lag-threshold", "--slot-age-threshold"):
        report = doctor(option, "-1")
        assert report.status == 1, report
        assert f"CommandError: {option} must be 0 or more (got -1" in report.log, report
        assert report.output == ""
    # The same from Python, where a NaN would otherwise silence a check for good.
    with pytest.raises(ValueError, match=r"Thresholds\.transaction must be a number, 0 or more"):
        Thresholds(transaction=float("nan"))
    with pytest.raises(ValueError, match=r"Thresholds\.slot_age must be a number, 0 or more"):
        Thresholds(slot_age=-1)


def test_jobs_quarantined_for_killing_their_worker_are_named_apart_from_other_failures(
    server: Server, doctor: Doctor
) -> None:
    (quarantined,) = server.insert(status="failed", attempts=2, finished_at=timedelta(minutes=-1))
    (raised,) = server.insert(status="failed", attempts=5, finished_at=timedelta(minutes=-1))
    (suspect,) = server.insert(status="queued", attempts=1)
    # What the reap and a raising attempt leave behind (a fresh server reaps nothing for a
    # minute, so the rows are written as the reap would).
    server.query(
        "UPDATE pgjobs_job SET crashes = 2, last_error = 'the worker died while running this "
        "job 2 times in a row', errors = jsonb_build_array(jsonb_build_object("
        "'exception_class_path', 'django_pgjobs.exceptions.WorkerCrashed', 'traceback', 'x')) "
        "WHERE id = %s",
        [quarantined],
    )
    server.query(
        "UPDATE pgjobs_job SET last_error = 'RuntimeError: boom', errors = jsonb_build_array("
        "jsonb_build_object('exception_class_path', 'builtins.RuntimeError', 'traceback', 'x')) "
        "WHERE id = %s",
        [raised],
    )
    server.query("UPDATE pgjobs_job SET crashes = 1 WHERE id = %s", [suspect])

    text = doctor()
    assert text.status == 1, text
    (problem,) = text.problems
    assert problem.startswith(
        f"job {quarantined} {NOOP} (queue default) was failed after its worker died 2 times"
    )
    assert "Failures in the last hour: 2" in text.output
    assert "row): 1\n" in text.output
    assert f"  job {quarantined} {NOOP}: 2 worker deaths in a row" in text.output
    assert "Live jobs whose last attempt ended with a dead worker: 1" in text.output

    as_json = doctor("--json").json()
    assert [row["id"] for row in as_json["quarantined"]] == [quarantined]
    assert as_json["suspects"] == 1


def test_the_quarantined_count_is_not_capped_by_the_listing(server: Server, doctor: Doctor) -> None:
    ids = server.insert(25, status="failed", attempts=2, finished_at=timedelta(minutes=-1))
    server.query(
        "UPDATE pgjobs_job SET crashes = 2, last_error = 'the worker died', "
        "errors = jsonb_build_array(jsonb_build_object('exception_class_path', "
        "'django_pgjobs.exceptions.WorkerCrashed', 'traceback', 'x')) WHERE id = ANY(%s)",
        [ids],
    )
    text = doctor()
    # 25 quarantined, though the report lists (and names as problems) only the latest 20.
    assert "row): 25\n" in text.output
    as_json = doctor("--json").json()
    assert (len(as_json["quarantined"]), as_json["quarantined_count"]) == (20, 25)
    assert "total" not in as_json["quarantined"][0]


def test_a_queue_no_live_worker_serves_is_named_per_task(server: Server, doctor: Doctor) -> None:
    server.query("DELETE FROM pgjobs_worker")
    server.insert(2, queue="emails")
    server.insert(queue="emails", run_at=timedelta(hours=1))  # not ready yet: not counted
    server.query(
        "INSERT INTO pgjobs_job (task, queue, payload) VALUES ('app.reports.build', 'reports', "
        "'{}')"
    )

    text = doctor()

    assert text.status == 1, text
    assert text.problems == [
        "queue emails: 2 ready job(s) of testproject.testjobs.noop and no live worker serves "
        "the queue: start a worker with `manage.py runjobs --queue emails`.",
        "queue reports: 1 ready job(s) of app.reports.build and no live worker serves the "
        "queue: start a worker with `manage.py runjobs --queue reports`.",
    ], text
    assert "Live workers: 0\n" in text.output
    assert (
        "Ready jobs no live worker can run:\n"
        f"  emails: 2 of {NOOP} (no live worker serves this queue)\n"
        "  reports: 1 of app.reports.build (no live worker serves this queue)\n"
    ) in text.output

    as_json = doctor("--json").json()
    assert as_json["workers"] == []
    assert as_json["unrunnable"] == [
        {"queue": "emails", "task": NOOP, "ready": 2, "served": False},
        {"queue": "reports", "task": "app.reports.build", "ready": 1, "served": False},
    ]
    assert as_json["problems"] == text.problems

    # A worker serving the queues (any task) makes them runnable again.
    register(server, STANDING, SERVED, None)
    doctor.healthy()


def test_a_task_no_live_worker_serving_its_queue_knows_is_named(
    server: Server, workers: Workers, doctor: Doctor
) -> None:
    server.query("DELETE FROM pgjobs_worker")
    # A real worker of the emails queue: it registers itself, with the tasks it can run, and
    # claims only those (PGJOBS["CLAIM_REGISTERED_ONLY"]).
    worker = workers.start("--queue", "emails=4", database_url=server.url)
    wait_until(
        lambda: server.scalar("SELECT count(*) FROM pgjobs_worker") == 1,
        message="the worker to register itself",
    )
    server.query(
        "INSERT INTO pgjobs_job (task, queue, payload) VALUES ('app.retired', 'emails', '{}')"
    )
    (known,) = server.insert(queue="emails")
    wait_until(
        lambda: server.scalar("SELECT status FROM pgjobs_job WHERE id = %s", [known]) == "done",
        message="the worker to run the job whose task it knows",
    )

    text = doctor()

    assert text.status == 1, text
    assert text.problems == [
        "queue emails: 1 ready job(s) of app.retired, a task none of the live workers serving "
        "the queue has registered (old code, or a module they do not import): deploy workers "
        "that know it; they claim only the tasks they have registered "
        "(PGJOBS['CLAIM_REGISTERED_ONLY'])."
    ], text
    assert "  emails: 1 of app.retired\n" in text.output
    (line,) = [row for row in text.output.splitlines() if row.startswith("  ") and "(pid " in row]
    assert f"(pid {worker.pid}, lease mode, version " in line
    assert "): queues emails=4; tasks " in line and "tasks any" not in line

    as_json = doctor("--json").json()
    (registered,) = as_json["workers"]
    assert (registered["pid"], registered["queues"]) == (worker.pid, {"emails": 4})
    assert NOOP in registered["tasks"] and "app.retired" not in registered["tasks"]
    assert as_json["unrunnable"] == [
        {"queue": "emails", "task": "app.retired", "ready": 1, "served": True}
    ]
    # The job's task no longer matters once it is gone: healthy again.
    server.query("UPDATE pgjobs_job SET status = 'cancelled', finished_at = now()")
    register(server, STANDING, SERVED, None)
    healthy = doctor.healthy()
    assert "Live workers: 2" in healthy.output


def test_paused_queues_are_listed_and_are_no_problem(server: Server, doctor: Doctor) -> None:
    server.insert(3, queue="emails")
    for queue in ("emails", "reports"):
        server.query(control.PAUSE, {"queue": queue})
    server.query(
        control.SET_LIMITS,
        {
            "queue": "default",
            "concurrency": 2,
            "rate_count": None,
            "rate_period": None,
            "channel": "pgjobs",
        },
    )

    text = doctor.healthy()
    assert "Paused queues: emails, reports\n" in text.output
    assert doctor("--json").json()["paused"] == ["emails", "reports"]

    server.query(control.RESUME, {"queue": "emails", "channel": "pgjobs"})
    assert "Paused queues: reports\n" in doctor.healthy().output
