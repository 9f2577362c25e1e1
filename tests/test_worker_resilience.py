"""A worker that is killed, or whose database goes away, loses nothing: SIGKILL mid-run, its
connections terminated by the server, and a full database restart."""

from __future__ import annotations

import contextlib
import re
import signal
from typing import Any

import psycopg
import pytest

from django_pgjobs.models import Job
from scripts.pgserver import ThrowawayPostgres
from testproject.testjobs import sleep
from tests.helpers import PATIENCE, wait_until
from tests.workers import (
    SLEEP,
    Process,
    Workers,
    counts,
    done,
    listener_backends,
    query,
    ride_audit_installed,
    rides,
    running,
    terminate,
)

pytestmark = pytest.mark.django_db(transaction=True)

# Rows that mean "the database's absence was blamed on a job". A job whose claim was lost with
# a dropped connection is recovered by the reaper, which notes 'lease expired': that is not
# a failure of the job.
BLAMED = (
    "SELECT count(*) FROM pgjobs_job WHERE status = 'failed' "
    "OR (last_error IS NOT NULL AND last_error <> 'lease expired')"
)


def assert_reconnected(worker: Process) -> None:
    log = worker.log()
    assert "unavailable" in log and "reconnecting in" in log, log
    assert "reconnected to database default" in log, log
    # One line per record: the reason is the error's first line, then the backoff.
    lost = r"LISTEN connection to listen lost \(.*\); reconnecting in [\d.]+ s\n"
    assert re.search(lost, log), log
    assert "LISTEN connection re-established on listen" in log, log


@pytest.mark.slow
@pytest.mark.parametrize("with_claims", [False, True], ids=["apart", "completions-with-claims"])
def test_sigkill_mid_run_then_reap_and_a_fresh_worker_finish_everything(
    workers: Workers, with_claims: bool
) -> None:
    with ride_audit_installed():
        sigkill_mid_run_then_reap_and_finish(workers, with_claims)
        # The mode was really in use: completions rode with claims, or, told not to, none did.
        both, _rode, _written = rides()
        assert (both > 0) is with_claims


def sigkill_mid_run_then_reap_and_finish(workers: Workers, with_claims: bool) -> None:
    total = 2000
    ride = {"PGJOBS_COMPLETE_WITH_CLAIM": str(with_claims).lower()}
    Job.objects.enqueue_many(sleep, [{"seconds": 0.01 + (i % 11) / 1000} for i in range(total)])
    worker = workers.start("--concurrency", "8", "--lease", "2", env=ride)
    # And some running: on a busy machine the worker can be caught between its completions
    # and its next claim, with none running.
    wait_until(
        lambda: done() >= 300 and running() > 0,
        message="a few hundred jobs to be done, and some running",
    )

    worker.send(signal.SIGKILL)
    assert worker.wait() == -signal.SIGKILL
    # A statement the worker sent just before it died still runs to its end on the server
    # (a claim among them): look once its sessions are gone.
    wait_until(lambda: not worker.backends(), message="the killed worker's sessions to end")
    at_kill = {
        row[0]: row[1]
        for row in query("SELECT id, attempts FROM pgjobs_job WHERE status = 'running'")
    }
    # The killed worker was in the middle of things, and left those jobs running.
    assert at_kill and set(at_kill.values()) == {1}
    assert 300 <= done() < total

    wait_until(
        lambda: (
            query(
                "SELECT count(*) FROM pgjobs_job WHERE status = 'running' AND locked_until >= now()"
            )
            == [(0,)]
        ),
        message="the killed worker's leases to expire",
    )
    reaper = workers.run("reapjobs")
    assert f"reaped {len(at_kill)} jobs: {len(at_kill)} requeued, 0 failed" in reaper.output()
    workers.burst("--concurrency", "8", timeout=3 * PATIENCE, env=ride)

    assert counts() == {"done": total}
    # The crash counted as an attempt for exactly the jobs it interrupted; none ran more often.
    assert dict(query("SELECT id, attempts FROM pgjobs_job WHERE attempts <> 1")) == {
        job_id: 2 for job_id in at_kill
    }


def test_worker_reconnects_when_its_connections_are_terminated(workers: Workers) -> None:
    total = 1000
    Job.objects.enqueue_many(sleep, [{"seconds": 0.01}] * total)
    worker = workers.start(
        "--concurrency", "4", "--lease", "5", "--reap-interval", "2", "--poll-interval", "1"
    )
    wait_until(lambda: done() >= 100, message="the run to get going")

    # Every connection of the worker (producer, completer, LISTEN), never the test's own.
    victims = worker.backends() + listener_backends()
    assert terminate(victims) >= 2
    assert done() < total, "the run ended before the outage"

    wait_until(lambda: done() == total, timeout=3 * PATIENCE, message="the queue to be finished")
    assert query(BLAMED) == [(0,)]
    assert counts() == {"done": total}
    assert_reconnected(worker)
    worker.send(signal.SIGTERM)
    assert worker.wait() == 0


class _Server:
    """Queries against a ThrowawayPostgres, reconnecting after it restarts."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.conn: psycopg.Connection[Any] | None = None

    def query(self, statement: str) -> list[tuple[Any, ...]]:
        for _ in range(2):
            try:
                if self.conn is None or self.conn.closed:
                    self.conn = psycopg.connect(self.url, autocommit=True)
                cursor = self.conn.execute(statement)
                return cursor.fetchall() if cursor.description else []
            except psycopg.OperationalError:
                self.close()
        raise AssertionError(f"cannot query {self.url}")

    def done(self) -> int:
        return int(self.query("SELECT count(*) FROM pgjobs_job WHERE status = 'done'")[0][0])

    def close(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(psycopg.Error):
                self.conn.close()
            self.conn = None


@pytest.mark.slow
@pytest.mark.django_db(transaction=False)
def test_worker_rides_out_a_database_restart(workers: Workers) -> None:
    total = 1500
    with ThrowawayPostgres() as pg:
        server = _Server(pg.url)
        try:
            workers.run("migrate", "--verbosity", "0", database_url=pg.url, timeout=2 * PATIENCE)
            server.query(
                "INSERT INTO pgjobs_job (task, payload) SELECT "
                f"'{SLEEP}', jsonb_build_object('seconds', 0.01) "
                f"FROM generate_series(1, {total})"
            )
            worker = workers.start(
                "--concurrency",
                "4",
                "--lease",
                "5",
                "--reap-interval",
                "2",
                "--poll-interval",
                "1",
                database_url=pg.url,
            )
            wait_until(lambda: server.done() >= 100, message="the run to get going")
            server.close()
            pg.restart(down_for=2)
            assert server.done() < total, "the run ended before the restart"

            wait_until(
                lambda: server.done() == total,
                timeout=3 * PATIENCE,
                message="the queue to be finished",
            )
            assert server.query(BLAMED) == [(0,)]
            assert server.query("SELECT status, count(*) FROM pgjobs_job GROUP BY status") == [
                ("done", total)
            ]
            assert_reconnected(worker)
            worker.send(signal.SIGTERM)
            assert worker.wait() == 0
        finally:
            server.close()
