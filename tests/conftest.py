"""Suite-wide guards. The database is PostgreSQL from DATABASE_URL (see testproject.settings);
pytest-django creates the test database from the app's migrations.

The suite runs in several processes (pytest-xdist, ``-n`` in the Makefile and tox.ini), each
with a test database of its own on the one server (pytest-django's ``_gw0``, ``_gw1``, ...
suffixes), which the worker processes a test starts are pointed at too (tests/workers.py). A
test that cannot share the server with the others is marked ``serial`` (see ``_alone``)."""

from __future__ import annotations

import fcntl
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import SyncToAsync
from django.conf import settings
from django.db import connection

from django_pgjobs.core.upkeep import REAP_SETTLE
from django_pgjobs.notify import notifier
from tests.helpers import wait_until
from tests.workers import Workers


def pytest_report_header(config: pytest.Config) -> str:
    db = settings.DATABASES["default"]
    return f"database: {db['ENGINE']} {db.get('HOST') or 'socket'}:{db.get('PORT') or 5432}"


@pytest.fixture(autouse=True)
def _threads_finish() -> Iterator[None]:
    """A test must not leave a thread behind: it could hold a lock or a connection into the
    next test (and TransactionTestCase's flush would wait on it)."""
    before = set(threading.enumerate())
    yield
    # The enqueues' NOTIFY thread is the process's, not the test's: send what it holds and
    # stop it, so its connection does not outlive the test (nor block dropping the database).
    notifier.shutdown()
    wait_until(
        lambda: (
            not [
                t
                for t in threading.enumerate()
                if t not in before and t.is_alive() and t not in process_wide()
            ]
        ),
        message="the test's threads to finish",
    )


@pytest.fixture(autouse=True)
def _alone(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test marked ``serial`` runs while no other test runs on the same server: it counts
    something the whole server shares (its WAL syncs). Every test holds a shared lock on a file
    named after the server while it runs, whichever pytest process it is in (pytest-xdist's,
    or another run's, such as a tox env's); a serial one holds it exclusively. A second lock,
    taken by each before the first and released at once, is the queue: a serial test waiting
    for the others to finish holds it, so that no new test starts in the meantime."""
    db = settings.DATABASES["default"]
    server = f"{db.get('HOST') or 'socket'}-{db.get('PORT') or 5432}"
    mode = fcntl.LOCK_EX if request.node.get_closest_marker("serial") else fcntl.LOCK_SH
    folder = Path(tempfile.gettempdir())
    with (
        open(folder / f"pgjobs-tests-{server}.queue", "a") as queue,
        open(folder / f"pgjobs-tests-{server}.lock", "a") as lock,
    ):
        fcntl.flock(queue, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, mode)
        finally:
            fcntl.flock(queue, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Workers]:
    """Starts real runjobs/reapjobs processes; kills any still running when the test ends."""
    with Workers(tmp_path) as started:
        yield started


@pytest.fixture(scope="session", autouse=True)
def _server_past_its_first_minute(django_db_setup: None, django_db_blocker: Any) -> None:
    """Nothing is reaped in a server's first minute (upkeep.REAP_SETTLE): on a server the
    suite has just started, wait that minute out once, rather than in every test that reaps."""
    with django_db_blocker.unblock(), connection.cursor() as cursor:
        cursor.execute("SELECT extract(epoch FROM now() - pg_postmaster_start_time())::float8")
        (age,) = cursor.fetchone()
    wait = REAP_SETTLE.total_seconds() + 1 - age
    if wait > 0:
        time.sleep(wait)


def process_wide() -> set[threading.Thread]:
    """Threads that live as long as the process, not a test: asgiref's one sync_to_async
    thread, where async jobs' ORM calls run (the worker closes its connections there)."""
    executor = SyncToAsync.single_thread_executor
    return set(getattr(executor, "_threads", ()))
