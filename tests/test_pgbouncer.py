"""Workers behind a real PgBouncer in transaction pooling mode.

The main alias goes through PgBouncer, where consecutive transactions of one client may run on
different server connections; the listen alias goes straight to PostgreSQL, because LISTEN is
session state that a transaction pool cannot keep. 5,000 jobs go in through PgBouncer and run
exactly once; a NOTIFY sent through PgBouncer still wakes a worker listening directly.

Nothing in the settings had to change for this: Django's PostgreSQL backend does not prepare
statements (psycopg's ``prepare_threshold`` is None unless OPTIONS sets it) and binds
parameters client-side, and the worker never opens a server-side cursor (no ``.iterator()``).

PgBouncer is Debian's ``pgbouncer`` package (``.ci/run`` installs it); without it, or if it
will not start, the test is skipped and ``-ra`` prints why. It refuses to run as root, so as
root it runs as the ``postgres`` user.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.conf import settings
from django.db import connections

from django_pgjobs import notify
from django_pgjobs.core import conf
from tests.helpers import PATIENCE, raw_connect, wait_until
from tests.workers import LISTENER_APP, Process, Workers, listener_backends, query, ran, scalar

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

JOBS = 5_000
# Small on purpose: a dozen worker connections share these few server connections, so
# consecutive transactions of one client really do land on different server sessions.
POOL_SIZE = 2


class PgBouncer:
    """One PgBouncer process in front of the test database's server."""

    def __init__(self, folder: Path, run_as: pwd.struct_passwd | None) -> None:
        db = connections["default"].settings_dict
        self.user = db.get("USER") or "postgres"
        self.password = db.get("PASSWORD") or ""
        self.dbname = db["NAME"]
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.folder = folder
        self.log_path = folder / "pgbouncer.log"
        ini = folder / "pgbouncer.ini"
        users = folder / "userlist.txt"
        users.write_text(f'"{self.user}" "{self.password}"\n')
        ini.write_text(
            "[databases]\n"
            # Any database name passes through to the server, pytest's test database included.
            f"* = host={db.get('HOST') or '127.0.0.1'} port={db.get('PORT') or 5432}\n"
            "[pgbouncer]\n"
            "pool_mode = transaction\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {self.port}\nunix_socket_dir =\n"
            f"auth_type = trust\nauth_file = {users}\n"
            f"admin_users = {self.user}\n"
            f"default_pool_size = {POOL_SIZE}\nmin_pool_size = 0\nreserve_pool_size = 0\n"
            "max_client_conn = 200\n"
            f"logfile = {self.log_path}\npidfile = {folder / 'pgbouncer.pid'}\n"
        )
        if run_as is not None:
            for path in (folder, ini, users):
                os.chown(path, run_as.pw_uid, run_as.pw_gid)
        binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
        with open(folder / "pgbouncer.out", "wb") as out:
            self.popen = subprocess.Popen(
                [binary, str(ini)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                user=run_as.pw_uid if run_as else None,
                group=run_as.pw_gid if run_as else None,
                extra_groups=[] if run_as else None,
            )

    @property
    def url(self) -> str:
        return f"postgres://{self.user}@127.0.0.1:{self.port}/{self.dbname}"

    def output(self) -> str:
        text = (self.folder / "pgbouncer.out").read_text(errors="replace")
        if self.log_path.exists():
            text += self.log_path.read_text(errors="replace")
        return text

    def admin(self, command: str) -> list[dict[str, Any]]:
        """A SHOW command on PgBouncer's admin console (simple query protocol only)."""
        with (
            psycopg.connect(
                host="127.0.0.1",
                port=self.port,
                dbname="pgbouncer",
                user=self.user,
                password=self.password or None,
                autocommit=True,
                cursor_factory=psycopg.ClientCursor,
            ) as conn,
            conn.cursor() as cursor,
        ):
            cursor.execute(command)
            names = [column.name for column in cursor.description or []]
            return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]

    def up(self) -> bool:
        if self.popen.poll() is not None:
            raise RuntimeError(f"pgbouncer exited ({self.popen.returncode}):\n{self.output()}")
        try:
            self.admin("SHOW VERSION")
        except psycopg.OperationalError:
            return False
        return True

    def clients(self) -> list[dict[str, Any]]:
        return [c for c in self.admin("SHOW CLIENTS") if c["database"] == self.dbname]

    def servers(self) -> list[dict[str, Any]]:
        return [s for s in self.admin("SHOW SERVERS") if s["database"] == self.dbname]

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGINT)  # shut down once clients are gone
            try:
                self.popen.wait(5)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)


def _run_as() -> pwd.struct_passwd | None:
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam("postgres")
    except KeyError:
        pytest.skip("pgbouncer refuses to run as root and there is no postgres user to run it as")


@pytest.fixture
def bouncer() -> Iterator[PgBouncer]:
    if not (shutil.which("pgbouncer") or os.access("/usr/sbin/pgbouncer", os.X_OK)):
        pytest.skip("pgbouncer is not installed (Debian: apt-get install pgbouncer)")
    run_as = _run_as()
    folder = Path(tempfile.mkdtemp(prefix="pgjobs-pgbouncer-"))
    started: PgBouncer | None = None
    try:
        started = PgBouncer(folder, run_as)
        try:
            wait_until(started.up, interval=0.05, message="pgbouncer to accept")
        except RuntimeError as exc:  # it exited: the reason is in its output
            pytest.skip(f"pgbouncer did not start: {exc}")
        except AssertionError as exc:
            pytest.skip(f"pgbouncer did not start: {exc}\n{started.output()[-2000:]}")
        yield started
    finally:
        if started is not None:
            started.stop()
        shutil.rmtree(folder, ignore_errors=True)


def enqueue(workers: Workers, env: dict[str, str], first: int, count: int) -> Process:
    """Enqueue ``count`` noop jobs from a process whose database is PgBouncer, in chunks of
    1,000 (one INSERT and one NOTIFY each)."""
    code = (
        "from django_pgjobs.models import Job\n"
        "from testproject.testjobs import noop\n"
        f"for start in range({first}, {first + count}, 1000):\n"
        f"    Job.objects.enqueue_many(noop, [{{'n': n}} for n in "
        f"range(start, min(start + 1000, {first + count}))])\n"
    )
    return workers.run("shell", "-c", code, env=env)


def backends_named(app_name: str) -> set[int]:
    return {
        row[0]
        for row in query(
            "SELECT pid FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name = %s",
            [app_name],
        )
    }


def test_5000_jobs_through_pgbouncer_run_once_and_notify_still_wakes_a_listener(
    bouncer: PgBouncer, workers: Workers
) -> None:
    # PgBouncer 1.18 (Debian 12's) keeps no prepared statements in transaction mode.
    env = {
        "DATABASE_URL": bouncer.url,
        "LISTEN_DATABASE_URL": settings.DATABASE_URL,
        "PGJOBS_PREPARE": "false",
    }
    # -- in through PgBouncer --------------------------------------------------------------
    enqueuer = enqueue(workers, env, 0, JOBS)
    assert scalar("SELECT count(*) FROM pgjobs_job WHERE status = 'queued'") == JOBS
    # Its connection was a PgBouncer client: the server session it used is one of PgBouncer's
    # (still open in the pool, still carrying its application_name); a direct connection
    # would have ended with the process.
    servers = {s["remote_pid"] for s in bouncer.servers()}
    assert backends_named(enqueuer.app_name), bouncer.output()
    assert backends_named(enqueuer.app_name) <= servers
    assert len(servers) <= POOL_SIZE
    pools = [p for p in bouncer.admin("SHOW POOLS") if p["database"] == bouncer.dbname]
    assert [p["pool_mode"] for p in pools] == ["transaction"]

    # -- run by two workers at once, through PgBouncer ---------------------------------------
    running = [
        workers.start("--burst", "--concurrency", "4", "--batch-size", "20", env=env)
        for _ in range(2)
    ]
    names = {w.app_name for w in running}
    most_clients = most_servers = 0

    def finished() -> bool:
        nonlocal most_clients, most_servers
        mine = [c for c in bouncer.clients() if c["application_name"] in names]
        most_clients = max(most_clients, len(mine))
        # Sessions open at once (PgBouncer may replace one over the run, so not distinct pids).
        most_servers = max(most_servers, len(bouncer.servers()))
        return not any(w.alive for w in running)

    wait_until(finished, timeout=3 * PATIENCE, interval=0.05, message="both workers to finish")
    for worker in running:
        assert worker.wait() == 0, worker.tail()
    assert sum(ran(w) for w in running) == JOBS

    # Exactly once: every job done, on its first attempt, claimed by one worker.
    assert query(
        "SELECT status, attempts, jsonb_array_length(worker_ids), count(*) FROM pgjobs_job "
        "GROUP BY 1, 2, 3"
    ) == [("done", 1, 1, JOBS)]
    # Many worker connections, few server sessions: transaction pooling really happened.
    assert most_clients > POOL_SIZE, (most_clients, bouncer.output())
    assert 0 < most_servers <= POOL_SIZE
    for worker in running:
        log = worker.log()
        assert "prepared statement" not in log and "Traceback" not in log, worker.tail()

    # -- a long-running worker: claims through PgBouncer, LISTENs directly ------------------
    worker = workers.start(
        "--listen-database",
        "listen",
        "--poll-interval",
        "3600",
        "--reap-interval",
        "3600",
        env=env,
    )

    def listening() -> bool:
        rows = query(
            "SELECT state, query FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name = %s",
            [LISTENER_APP],
        )
        assert worker.alive, worker.tail()
        # Its LISTEN done (the health probe, SELECT 1, may already have followed it).
        return len(rows) == 1 and rows[0] in {
            ("idle", f'LISTEN "{conf.channel()}"'),
            ("idle", notify.PROBE),
        }

    wait_until(listening, interval=0.05, message="the worker to LISTEN")
    # A first job wakes it (NOTIFY, or the catch-up claim after LISTEN); after that an idle
    # worker with an hour's poll interval only wakes for a NOTIFY.
    enqueue(workers, env, JOBS, 1)
    wait_until(
        lambda: ran_so_far() == JOBS + 1, interval=0.05, message="the first job after the burst"
    )

    # Against a poll interval of 3600 s, only the NOTIFY can have woken it.
    enqueue(workers, env, JOBS + 1, 1)
    wait_until(
        lambda: ran_so_far() == JOBS + 2,
        interval=0.02,
        message="the NOTIFY sent through PgBouncer to wake the worker",
    )

    # The worker is PgBouncer's client; its LISTEN connection is not, and its backend is none
    # of PgBouncer's server sessions.
    assert worker.app_name in {c["application_name"] for c in bouncer.clients()}
    assert LISTENER_APP not in {c["application_name"] for c in bouncer.admin("SHOW CLIENTS")}
    (listener,) = listener_backends()
    assert listener not in {s["remote_pid"] for s in bouncer.servers()}

    worker.send(signal.SIGTERM)
    assert worker.wait() == 0, worker.tail()
    assert ran(worker) == 2
    assert query("SELECT status, attempts, count(*) FROM pgjobs_job GROUP BY 1, 2") == [
        ("done", 1, JOBS + 2)
    ]


def ran_so_far() -> int:
    return int(scalar("SELECT count(*) FROM pgjobs_job WHERE status = 'done'"))


def test_pgbouncer_keeps_each_clients_time_zone_across_server_connections(
    bouncer: PgBouncer,
) -> None:
    # Django sends SET TIME ZONE when the server's default differs from what it needs (this
    # server says Etc/UTC, Django wants UTC). PgBouncer tracks TimeZone per client (it is one
    # of the parameters the server reports) and puts it back on whichever server connection
    # the client gets next, so the setting neither leaks to other clients nor is lost.
    def connect() -> psycopg.Connection[Any]:
        return psycopg.connect(
            host="127.0.0.1",
            port=bouncer.port,
            dbname=bouncer.dbname,
            user=bouncer.user,
            password=bouncer.password or None,
            autocommit=True,
            prepare_threshold=None,
        )

    def ask(conn: psycopg.Connection[Any], setting: str) -> tuple[int, str]:
        row = conn.execute("SELECT pg_backend_pid(), current_setting(%s)", [setting]).fetchone()
        assert row is not None
        return int(row[0]), str(row[1])

    def seen_on_the_same_server(
        others: list[psycopg.Connection[Any]], pid: int, setting: str
    ) -> set[str]:
        """What the other clients see of ``setting`` once one of them ran on server ``pid``."""
        seen: list[tuple[int, str]] = []

        def shared() -> bool:
            seen.extend(ask(conn, setting) for conn in others)
            return any(server == pid for server, _ in seen)

        wait_until(shared, message=f"another client to run on server {pid}")
        return {value for server, value in seen if server == pid}

    with raw_connect() as direct:  # a session as the server starts it (Django's sets UTC)
        default = ask(direct, "TimeZone")[1]
    assert default != "America/New_York"
    with connect() as setter, connect() as other, connect() as third:
        setter.execute("SET TIME ZONE 'America/New_York'")
        pid, zone = ask(setter, "TimeZone")
        assert zone == "America/New_York"
        assert seen_on_the_same_server([other, third], pid, "TimeZone") == {default}
        # ... and the setter keeps its own, wherever it runs now.
        for _ in range(5):
            other.execute("SELECT 1")
            assert ask(setter, "TimeZone")[1] == "America/New_York"

        # A setting PgBouncer does not track does leak to the next client of that server
        # connection: why django-pgjobs sends no SET outside a transaction on the pooled alias.
        setter.execute("SET statement_timeout = '12345ms'")
        pid, timeout = ask(setter, "statement_timeout")
        assert timeout == "12345ms"
        try:
            assert "12345ms" in seen_on_the_same_server([other, third], pid, "statement_timeout")
        finally:
            setter.execute("RESET statement_timeout")
