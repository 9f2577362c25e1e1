"""``PGJOBS["WORKER_SYNCHRONOUS_COMMIT"]``: the worker's claims and fenced writes may commit
without waiting for the WAL flush. The setting is a local ``set_config`` inside the statement
itself, so it lasts one transaction, never reaches the session, and is left alone inside the
caller's own ``atomic()``."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.db import connection, transaction
from django.test import override_settings

from django_pgjobs.core import claim, finish
from django_pgjobs.core.types import FailedAttempt, Failure
from django_pgjobs.exceptions import InvalidJobOptions
from django_pgjobs.models import Job
from django_pgjobs.worker.store import Store
from django_pgjobs.worker.worker import Worker
from testproject.testjobs import noop
from tests.helpers import job_row, make_job, raw_connect, scalar, wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def server_default() -> str:
    """The server's own synchronous_commit, as a fresh session sees it."""
    with raw_connect() as conn:
        row = conn.execute("SHOW synchronous_commit").fetchone()
    assert row is not None
    return str(row[0])


def show() -> str:
    """synchronous_commit as Django's own connection sees it now."""
    return str(scalar("SHOW synchronous_commit"))


@contextlib.contextmanager
def commit_params() -> Iterator[list[Any]]:
    """The ``synchronous_commit`` parameter of every statement that carries one, in order.

    An observer: each statement still executes as it would without it.
    """
    seen: list[Any] = []

    def observe(
        execute: Callable[..., Any], statement: str, params: Any, many: bool, context: Any
    ) -> Any:
        if isinstance(params, dict) and "synchronous_commit" in params:
            seen.append(params["synchronous_commit"])
        return execute(statement, params, many, context)

    with connection.execute_wrapper(observe):
        yield seen


def running_job() -> int:
    """A job claimed by a worker (attempt 1, lease still good), for the fenced writes."""
    return make_job(status="running", attempts=1, locked_until=timedelta(minutes=5))


def complete_params(job_id: int, synchronous_commit: str | None) -> dict[str, Any]:
    return {
        "claims": json.dumps([{"id": job_id, "attempts": 1}]),
        "synchronous_commit": synchronous_commit,
    }


def claim_params(synchronous_commit: str | None) -> dict[str, Any]:
    return {
        "queue": "default",
        "limit": 1,
        "lease": timedelta(minutes=5),
        "worker_id": "commit-test",
        "suspects": True,
        "synchronous_commit": synchronous_commit,
        "tasks": None,
    }


# -- the SQL fragment, on a raw connection ----------------------------------------------


def test_off_lasts_the_statements_transaction_and_never_reaches_the_session() -> None:
    default = server_default()
    assert default != "off"
    job_id = running_job()
    with raw_connect() as conn:
        with conn.transaction():
            assert conn.execute("SHOW synchronous_commit").fetchone() == (default,)
            rows = conn.execute(finish.COMPLETE, complete_params(job_id, "off")).fetchall()
            assert rows == [(job_id,)]
            assert conn.execute("SHOW synchronous_commit").fetchone() == ("off",)
        assert conn.execute("SHOW synchronous_commit").fetchone() == (default,)
    assert job_row(job_id)["status"] == "done"


def test_the_claim_sets_it_the_same_way() -> None:
    job_id = noop.enqueue(n=1).id
    default = server_default()
    with raw_connect() as conn:
        with conn.transaction():
            rows = conn.execute(claim.CLAIM, claim_params("off")).fetchall()
            assert [row[0] for row in rows] == [job_id]
            assert conn.execute("SHOW synchronous_commit").fetchone() == ("off",)
        assert conn.execute("SHOW synchronous_commit").fetchone() == (default,)
    assert job_row(job_id)["status"] == "running"


def test_none_keeps_the_sessions_own_value() -> None:
    claimed = noop.enqueue(n=1).id
    completed = running_job()
    with raw_connect() as conn:
        conn.execute("SET synchronous_commit = 'local'")
        with conn.transaction():
            assert len(conn.execute(claim.CLAIM, claim_params(None)).fetchall()) == 1
            assert conn.execute("SHOW synchronous_commit").fetchone() == ("local",)
            conn.execute(finish.COMPLETE, complete_params(completed, None))
            assert conn.execute("SHOW synchronous_commit").fetchone() == ("local",)
        assert conn.execute("SHOW synchronous_commit").fetchone() == ("local",)
    assert job_row(claimed)["status"] == "running"
    assert job_row(completed)["status"] == "done"


# -- through the worker's store and the manager ----------------------------------------


def off_store() -> Store:
    """A worker's store on Django's connections, committing its own writes with "off"."""
    return Store("default", direct=False, synchronous_commit="off", prepare=False)


def test_outside_atomic_the_store_commits_with_off_and_the_session_keeps_its_value() -> None:
    default = server_default()
    job_id = noop.enqueue(n=1).id
    store = off_store()
    with commit_params() as seen:
        (claimed,) = store.claim("default", 1, timedelta(seconds=60), "test:1")
        assert store.complete([claimed], {}) == {claimed.id}
    assert seen == ["off", "off"]
    assert claimed.id == job_id
    assert job_row(job_id)["status"] == "done"
    # Each statement was its own transaction: nothing was left on the session.
    assert show() == default


def test_every_fenced_write_passes_it_outside_atomic() -> None:
    store = off_store()
    extended, failed, released = running_job(), running_job(), running_job()
    with commit_params() as seen:
        assert store.extend_lease([(extended, 1)], timedelta(seconds=60)) == {extended}
        attempt = FailedAttempt((failed, 1), Failure.of("boom"), (0, 0))
        assert store.fail([attempt]) == {failed: "queued"}
        assert store.release([(released, 1)]) == {released}
    assert seen == ["off", "off", "off"]
    assert show() == server_default()
    assert job_row(released)["status"] == "queued"


def test_inside_atomic_the_callers_transaction_keeps_its_durability() -> None:
    default = server_default()
    job_id = noop.enqueue(n=1).id
    store = off_store()
    with commit_params() as seen, transaction.atomic():
        (claimed,) = store.claim("default", 1, timedelta(seconds=60), "test:1")
        assert store.complete([claimed], {}) == {claimed.id}
        # Same transaction, after both statements: still the server's value.
        assert show() == default
        assert show() != "off"
    assert seen == [None, None]
    assert job_row(job_id)["status"] == "done"
    assert show() == default


def test_the_manager_passes_none() -> None:
    job_id = noop.enqueue(n=1).id
    with commit_params() as seen:
        (claimed,) = Job.objects.claim(queue="default", limit=1)
        Job.objects.complete(claimed)
    assert seen == [None, None]
    assert job_row(job_id)["status"] == "done"


# -- the worker -----------------------------------------------------------------------


def worker_commit(**kwargs: Any) -> Any:
    """The synchronous_commit the worker's store gives its claims and fenced writes.

    Read from the store the worker built, without running a statement: in lease mode its
    statements go on connections of the worker's own rather than Django's.
    """
    return Worker(**kwargs).store.synchronous_commit


def test_a_lease_mode_worker_uses_the_setting_off_by_default() -> None:
    assert "WORKER_SYNCHRONOUS_COMMIT" not in settings.PGJOBS
    assert worker_commit(mode="lease") == "off"
    with override_settings(PGJOBS={**settings.PGJOBS, "WORKER_SYNCHRONOUS_COMMIT": None}):
        assert worker_commit(mode="lease") is None
    with override_settings(PGJOBS={**settings.PGJOBS, "WORKER_SYNCHRONOUS_COMMIT": "local"}):
        assert worker_commit(mode="lease") == "local"


def test_a_transaction_mode_worker_keeps_the_servers_setting() -> None:
    assert worker_commit(mode="transaction") is None
    for value in ("off", "local", None):
        with override_settings(PGJOBS={**settings.PGJOBS, "WORKER_SYNCHRONOUS_COMMIT": value}):
            assert worker_commit(mode="transaction") is None


def test_a_lease_mode_worker_refuses_a_bad_setting() -> None:
    with (
        override_settings(PGJOBS={**settings.PGJOBS, "WORKER_SYNCHRONOUS_COMMIT": "of"}),
        pytest.raises(InvalidJobOptions, match="'of'"),
    ):
        Worker(mode="lease")


@pytest.mark.serial  # the other tests' commits would count among the server's WAL syncs
def test_off_really_skips_the_flush_at_commit() -> None:
    # pg_stat_wal counts the server's WAL syncs (fdatasync): a synchronous commit waits for
    # one, an asynchronous one leaves the flush to the WAL writer (every 200 ms by default).
    if scalar("SHOW fsync") == "off":
        pytest.skip("this server runs with fsync off: no commit waits for a WAL sync")

    def syncs() -> int:
        # PostgreSQL 18 moved the count from pg_stat_wal to pg_stat_io's WAL rows.
        if int(scalar("SHOW server_version_num")) >= 180000:
            return int(scalar("SELECT sum(fsyncs) FROM pg_stat_io WHERE object = 'wal'"))
        return int(scalar("SELECT wal_sync FROM pg_stat_wal"))

    def completions(setting: str | None, count: int = 40) -> int:
        ids = [running_job() for _ in range(count)]
        before = syncs()
        with raw_connect() as conn:
            pid = conn.info.backend_pid
            for job_id in ids:
                params = {
                    "claims": json.dumps([{"id": job_id, "attempts": 1}]),
                    "synchronous_commit": setting,
                }
                assert conn.execute(finish.COMPLETE, params).fetchall() == [(job_id,)]
        # A backend hands its WAL counts to the shared statistics as it exits, before it
        # leaves pg_stat_activity: read them once it has gone.
        wait_until(
            lambda: not scalar("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [pid]),
            message="the completing session to end",
        )
        return syncs() - before

    with quiet_wal_writer():
        flushed = completions("on")
        skipped = completions("off")
    assert flushed >= 30, flushed
    assert skipped <= flushed // 4, (skipped, flushed)


@contextlib.contextmanager
def quiet_wal_writer() -> Iterator[None]:
    """The WAL writer flushes asynchronous commits every wal_writer_delay (200 ms by default):
    on a busy machine the asynchronous phase lasts long enough for those periodic flushes to
    outnumber what it measures (80 against 53 synchronous ones in a CI run). For the block the
    delay is its longest, 10 s, so the writer flushes only when an asynchronous commit wakes
    it from sleep or fills a page of WAL, however long the phase takes (ALTER SYSTEM, then a
    reload; the test is serial, so no other test runs on the server meanwhile). Without the
    right to change it, the server's own delay is kept."""
    if not scalar("SELECT rolsuper FROM pg_roles WHERE rolname = current_user"):
        yield
        return
    with raw_connect() as admin:
        admin.execute("ALTER SYSTEM SET wal_writer_delay = '10s'")
        admin.execute("SELECT pg_reload_conf()")
        try:
            yield
        finally:
            admin.execute("ALTER SYSTEM RESET wal_writer_delay")
            admin.execute("SELECT pg_reload_conf()")
