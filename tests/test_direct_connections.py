"""A lease-mode worker's own psycopg connections (``connections.DirectConnections``): the claim
and the fenced writes run there, prepared when ``PGJOBS["PREPARE"]``, one connection per
thread, replaced when broken, and a pooler that loses prepared statements gets a clear error."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connection
from psycopg import sql as pgsql

from django_pgjobs.core import execute
from django_pgjobs.core.connections import DirectConnections
from django_pgjobs.core.types import ClaimedJob
from django_pgjobs.models import Job
from django_pgjobs.worker.store import Store
from testproject.testjobs import noop
from tests.helpers import job_row, scalar

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def direct() -> Iterator[DirectConnections]:
    conns = DirectConnections("default", prepare=True)
    yield conns
    conns.close()


def prepared(conns: DirectConnections) -> list[str]:
    rows = conns.get().execute("SELECT statement FROM pg_prepared_statements").fetchall()
    return [row[0] for row in rows]


def store(conns: DirectConnections) -> Store:
    """A lease-mode worker's store whose direct connections are ``conns``."""
    hot = Store("default", direct=True, synchronous_commit=None, prepare=False)
    hot.direct = conns
    return hot


def claim(conns: DirectConnections) -> list[ClaimedJob]:
    return store(conns).claim("default", 5, timedelta(seconds=60), "test:1")


def test_claim_and_complete_run_prepared_on_the_direct_connection(
    direct: DirectConnections,
) -> None:
    created = noop.enqueue(n=1)
    jobs = claim(direct)
    assert [job.id for job in jobs] == [created.id]
    assert store(direct).complete(jobs, {}) == {created.id}
    assert job_row(created.id)["status"] == "done"
    statements = prepared(direct)
    assert any("FOR UPDATE SKIP LOCKED" in text for text in statements), statements
    assert any("SET status = 'done'" in text for text in statements), statements
    # Not on Django's connection: that one prepared nothing.
    assert scalar("SELECT count(*) FROM pg_prepared_statements") == 0
    assert direct.get().info.backend_pid != scalar("SELECT pg_backend_pid()")


def test_without_prepare_nothing_is_prepared() -> None:
    conns = DirectConnections("default", prepare=False)
    try:
        noop.enqueue(n=1)
        jobs = claim(conns)
        store(conns).complete(jobs, {})
        claim(conns)
        assert len(jobs) == 1
        assert prepared(conns) == []
    finally:
        conns.close()


def test_each_thread_has_its_own_connection(direct: DirectConnections) -> None:
    pids: list[int] = []

    def other() -> None:
        pids.append(direct.get().info.backend_pid)
        direct.close()

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    mine = direct.get().info.backend_pid
    assert pids and pids[0] != mine
    assert direct.get().info.backend_pid == mine  # kept between calls


def test_a_broken_connection_is_replaced_on_the_next_get(direct: DirectConnections) -> None:
    noop.enqueue(n=1)
    first = direct.get()
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s)", [first.info.backend_pid])
    with pytest.raises(psycopg.OperationalError):
        claim(direct)
    assert first.broken or first.closed
    jobs = claim(direct)
    assert len(jobs) == 1
    assert direct.get() is not first


def test_a_threads_statements_share_one_cursor_that_an_error_does_not_spoil(
    direct: DirectConnections,
) -> None:
    keyed = Job.objects.enqueue(noop, {"n": 1}, lock_key="k")
    plain = noop.enqueue(n=2)
    cursor = direct.cursor()
    jobs = claim(direct)
    assert [job.id for job in jobs] == [plain.id]
    with pytest.raises(psycopg.errors.DivisionByZero):
        execute.run(direct.cursor(), "SELECT 1 / 0", {})
    # The guarded claim runs its transaction on the cursor's connection.
    guarded = store(direct).claim("default", 5, timedelta(seconds=60), "test:1", guarded=True)
    assert [job.id for job in guarded] == [keyed.id]
    assert store(direct).complete(jobs + guarded, {}) == {plain.id, keyed.id}
    assert direct.cursor() is cursor
    assert {job_row(job.id)["status"] for job in (keyed, plain)} == {"done"}
    direct.close()
    assert direct.cursor() is not cursor


def test_a_lost_prepared_statement_names_the_setting(direct: DirectConnections) -> None:
    # What a transaction-mode pooler without prepared-statement support does: the next
    # execution lands on a session that never saw the PREPARE.
    noop.enqueue(n=1)
    assert len(claim(direct)) == 1
    # Behind psycopg's back (it notices a DEALLOCATE ALL, not one by name).
    conn = direct.get()
    names = [row[0] for row in conn.execute("SELECT name FROM pg_prepared_statements")]
    assert names
    for name in names:
        conn.execute(pgsql.SQL("DEALLOCATE {}").format(pgsql.Identifier(name)), prepare=False)
    noop.enqueue(n=2)
    with pytest.raises(ImproperlyConfigured, match=r"PGJOBS\['PREPARE'\] = False"):
        claim(direct)
    assert Job.objects.filter(status="queued").count() == 1


def test_the_aliases_own_prepare_threshold_is_kept(settings: Any) -> None:
    options = settings.DATABASES["default"].get("OPTIONS", {})
    settings.DATABASES["default"]["OPTIONS"] = {**options, "prepare_threshold": None}
    kept = DirectConnections("default", prepare=True)
    refused = DirectConnections("default", prepare=False)
    try:
        assert kept.get().prepare_threshold is None
        assert refused.get().prepare_threshold is None
    finally:
        kept.close()
        refused.close()
        settings.DATABASES["default"]["OPTIONS"] = options
    plain = DirectConnections("default", prepare=True)
    try:
        assert plain.get().prepare_threshold == 0
    finally:
        plain.close()


def test_an_alias_that_disables_server_side_cursors_prepares_nothing(settings: Any) -> None:
    # Django asks this of an alias behind a transaction-mode pooler.
    settings.DATABASES["default"]["DISABLE_SERVER_SIDE_CURSORS"] = True
    conns = DirectConnections("default", prepare=True)
    try:
        noop.enqueue(n=1)
        assert len(claim(conns)) == 1
        assert prepared(conns) == []
    finally:
        conns.close()
        del settings.DATABASES["default"]["DISABLE_SERVER_SIDE_CURSORS"]


def test_another_statement_under_our_name_names_the_setting(direct: DirectConnections) -> None:
    # A pooler's session where another client prepared a statement of the same name.
    noop.enqueue(n=1)
    assert len(claim(direct)) == 1
    conn = direct.get()
    for (name,) in conn.execute("SELECT name FROM pg_prepared_statements").fetchall():
        conn.execute(pgsql.SQL("DEALLOCATE {}").format(pgsql.Identifier(name)), prepare=False)
        conn.execute(
            pgsql.SQL("PREPARE {} AS SELECT 1").format(pgsql.Identifier(name)), prepare=False
        )
    with pytest.raises(ImproperlyConfigured, match=r"PGJOBS\['PREPARE'\] = False"):
        claim(direct)
