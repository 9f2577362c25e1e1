"""The enqueues' NOTIFY, as a real LISTEN on a second connection receives it.

``PGJOBS["NOTIFY"] = "background"`` (and the default "auto" after an ``atomic()`` block): the
process's ``Notifier`` thread sends it on a connection of its own (``application_name``
``pgjobs-notifier``), coalescing what was requested while it was busy, closing that
connection when idle, flushing at exit and starting afresh in a forked child. ``"inline"``:
the caller's connection sends it right after commit.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import subprocess
import sys
import threading
from pathlib import Path

import psycopg
import pytest
from django.conf import settings
from django.db import connections, transaction
from django.test import override_settings

from django_pgjobs.models import Job
from django_pgjobs.notify import Notifier, notifier
from testproject.testjobs import noop
from tests.helpers import (
    PATIENCE,
    DbThread,
    Listener,
    job_row,
    listening,
    query,
    raw_connect,
    wait_until,
)

pytestmark = pytest.mark.django_db(transaction=True)

REPO = Path(__file__).resolve().parent.parent
NOTIFIER_APP = "pgjobs-notifier"
# Explicit, so these tests keep testing the thread whatever the default becomes.
BACKGROUND = {**settings.PGJOBS, "NOTIFY": "background"}
INLINE = {**settings.PGJOBS, "NOTIFY": "inline"}


def receive(listener: Listener, expected: int, timeout: float = PATIENCE) -> list[psycopg.Notify]:
    """Up to ``expected`` notifications (payload and the sender's backend pid), as soon as
    they are in; ``timeout`` is only how long a failing test waits for them."""
    return list(listener.conn.notifies(timeout=timeout, stop_after=expected))


def notifier_pids() -> set[int]:
    """Backends of this test database named ``pgjobs-notifier``."""
    return {
        row[0]
        for row in query(
            "SELECT pid FROM pg_stat_activity "
            "WHERE application_name = %s AND datname = current_database()",
            [NOTIFIER_APP],
        )
    }


def backend_alive(pid: int) -> bool:
    return bool(query("SELECT 1 FROM pg_stat_activity WHERE pid = %s", [pid]))


def my_pid() -> int:
    """The backend of Django's own connection in this thread."""
    return int(query("SELECT pg_backend_pid()")[0][0])


def notifier_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == NOTIFIER_APP and t.is_alive()]


# -- background mode ------------------------------------------------------------------


@override_settings(PGJOBS=BACKGROUND)
def test_an_autocommit_enqueue_is_sent_from_the_notifiers_own_connection() -> None:
    assert notifier_pids() == set()
    with listening() as listener:
        created = noop.enqueue(n=1)
        (note,) = receive(listener, 1)
        assert note.payload == "default"
        # Not the enqueuer's connection: the notifier's, named, and open while it lives.
        assert note.pid != my_pid()
        assert notifier_pids() == {note.pid}
        assert len(notifier_threads()) == 1
    assert job_row(created.id)["status"] == "queued"
    notifier.shutdown()
    wait_until(lambda: not notifier_pids(), message="the notifier's connection to close")
    assert notifier_threads() == []


def test_an_idle_notifier_closes_its_connection_ends_its_thread_and_starts_again() -> None:
    own = Notifier(idle=0.2)
    with listening() as listener:
        own.request("default", "pgjobs", "first")
        first_thread = own._thread
        assert first_thread is not None
        (note,) = receive(listener, 1)
        assert note.payload == "first"
        wait_until(
            lambda: not backend_alive(note.pid) and not first_thread.is_alive(),
            message="the idle notifier to close its connection and end its thread",
        )
        assert notifier_pids() == set()
        assert own._thread is None
        # The next request starts a new thread, on a new connection, and is delivered.
        own.request("default", "pgjobs", "second")
        assert own._thread is not None and own._thread is not first_thread
        (again,) = receive(listener, 1)
        assert again.payload == "second"
        assert again.pid != note.pid
        assert own.flush()
        wait_until(lambda: own._thread is None, message="the notifier to go idle again")
    own.shutdown()
    assert not first_thread.is_alive()


@override_settings(PGJOBS=BACKGROUND)
def test_a_killed_connection_costs_at_most_one_notify_and_the_next_is_delivered(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with listening() as listener:
        Job.objects.enqueue(noop, queue="before")
        (note,) = receive(listener, 1)
        assert note.payload == "before"
        assert query("SELECT pg_terminate_backend(%s)", [note.pid]) == [(True,)]
        wait_until(lambda: not backend_alive(note.pid), message="the backend to end")

        with caplog.at_level(logging.WARNING, logger="django_pgjobs.notify"):
            during = Job.objects.enqueue(noop, queue="during")  # nothing raised here
            assert notifier.flush()
        warned = [r for r in caplog.records if r.name == "django_pgjobs.notify"]
        # Either the send on the dead connection failed and said so, or it reconnected and
        # sent it (flush() has returned: what was sent is on its way).
        assert len(warned) <= 1, warned
        if warned:
            assert warned[0].levelno == logging.WARNING
            assert "NOTIFY for queue during failed" in warned[0].getMessage()
            assert listener.quiet() == []
        else:
            assert [n.payload for n in receive(listener, 1)] == ["during"]
        assert job_row(during.id)["status"] == "queued"

        after = Job.objects.enqueue(noop, queue="after")
        (next_note,) = receive(listener, 1)
        assert next_note.payload == "after"
        assert next_note.pid != note.pid
        assert notifier_pids() == {next_note.pid}
    assert job_row(after.id)["status"] == "queued"


@override_settings(PGJOBS=BACKGROUND)
def test_many_enqueuers_every_queue_is_notified_after_its_last_commit() -> None:
    threads, per_thread = 4, 30
    queues = ["q0", "q1", "q2"]

    def enqueue_all(t: int) -> None:
        for j in range(per_thread):
            Job.objects.enqueue(noop, {"t": t, "j": j}, queue=queues[(t + j) % len(queues)])

    # For each notification, how many jobs of its queue were committed when it arrived: one
    # that saw them all woke a worker who can claim every job.
    seen: list[tuple[str, int]] = []
    with listening() as listener, raw_connect() as counter:

        def collect(timeout: float) -> int:
            got = 0
            for note in listener.conn.notifies(timeout=timeout):
                row = counter.execute(
                    "SELECT count(*) FROM pgjobs_job WHERE queue = %s", [note.payload]
                ).fetchone()
                assert row is not None
                seen.append((note.payload, row[0]))
                got += 1
            return got

        started = [DbThread(enqueue_all, t) for t in range(threads)]
        for thread in started:
            thread.start()
        while any(thread.is_alive() for thread in started):
            collect(0.05)
        for thread in started:
            thread.result()
        assert notifier.flush()

        # Everything is committed and sent: wait until each queue's last notification is in.
        def last_ones_in() -> bool:
            collect(0.05)
            totals = dict(counter.execute("SELECT queue, count(*) FROM pgjobs_job GROUP BY 1"))
            return all((queue, count) in seen for queue, count in totals.items())

        wait_until(last_ones_in, message="a notification after each queue's last commit")
        collect(0.3)  # and any stragglers, for the count below

    totals = dict(query("SELECT queue, count(*) FROM pgjobs_job GROUP BY queue"))
    assert sum(totals.values()) == threads * per_thread
    assert set(totals) == set(queues)
    for queue in queues:
        counts = [count for name, count in seen if name == queue]
        assert counts, f"no notification for {queue}"
        assert max(counts) == totals[queue], (queue, counts, totals[queue])
    assert {name for name, _count in seen} == set(queues)
    # Coalescing may merge them; never more than one per enqueue.
    assert len(seen) <= threads * per_thread


def test_requests_made_while_it_is_busy_are_each_delivered() -> None:
    # The first request starts the thread, which still has to connect: the next ones land
    # in its pending set, and are sent together (or apart: timing decides, not the test).
    own = Notifier(idle=5.0)
    queues = ["a", "b", "c", "d", "b", "a"]
    with listening() as listener:
        for queue in queues:
            own.request("default", "pgjobs", queue)
        assert own.flush()
        notes: list[psycopg.Notify] = []

        def each_queue_in() -> bool:
            notes.extend(receive(listener, len(queues), timeout=0.1))
            return {n.payload for n in notes} == set(queues)

        wait_until(each_queue_in, message="a notification for each queue")
        notes.extend(receive(listener, len(queues), timeout=0.3))  # and any stragglers
        assert sorted(set(n.payload for n in notes)) == ["a", "b", "c", "d"]
        assert len(notes) <= len(queues)
        assert len({n.pid for n in notes}) == 1
    own.shutdown()
    assert own._thread is None


SCRIPT = """
import django
django.setup()
from django.conf import settings
settings.PGJOBS["NOTIFY"] = "background"  # the thread's atexit flush is what is tested
from django_pgjobs.models import Job
from testproject.testjobs import noop
print(Job.objects.enqueue(noop, {"from": "script"}, queue="from-script").id)
"""


def test_a_script_that_enqueues_and_exits_at_once_still_notifies() -> None:
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "testproject.settings",
        "DATABASE_URL": settings.DATABASE_URL,
        "PGJOBS_TEST_DATABASE_NAME": connections["default"].settings_dict["NAME"],
        "PYTHONUNBUFFERED": "1",
    }
    with listening() as listener:
        done = subprocess.run(
            [sys.executable, "-c", SCRIPT],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert "failed" not in done.stderr, done.stderr
        job_id = int(done.stdout.strip())
        (note,) = receive(listener, 1)
        assert note.payload == "from-script"
        assert note.pid != my_pid()
    row = job_row(job_id)
    assert (row["queue"], row["payload"], row["status"]) == (
        "from-script",
        {"from": "script"},
        "queued",
    )
    # The script's notifier connection went away with it.
    wait_until(lambda: not backend_alive(note.pid), message="the script's connection to end")


def _child_enqueues(queue: str) -> None:
    # The parent closed its Django connections before forking, so this closes nothing of
    # the parent's (closing an inherited open one would end the parent's session too).
    connections.close_all()
    try:
        # Returns at once: the thread is still connecting. multiprocessing ends the child
        # with os._exit() (no atexit); the notifier's own finalizer must send it first.
        Job.objects.enqueue(noop, {"from": "child"}, queue=queue)
    finally:
        connections.close_all()


@override_settings(PGJOBS=BACKGROUND)
@pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning")
def test_a_forked_child_notifies_with_its_own_thread_and_the_parent_still_does() -> None:
    with listening() as listener:
        Job.objects.enqueue(noop, queue="parent-before")
        (before,) = receive(listener, 1)
        assert before.payload == "parent-before"
        parent_thread = notifier._thread
        assert parent_thread is not None and parent_thread.is_alive()

        connections.close_all()  # the child must not inherit an open Django connection
        child = multiprocessing.get_context("fork").Process(target=_child_enqueues, args=("child",))
        child.start()
        child.join(30)
        assert child.exitcode == 0

        (from_child,) = receive(listener, 1)
        assert from_child.payload == "child"
        assert from_child.pid != before.pid

        # The parent's thread and connection carry on untouched by the child.
        assert parent_thread.is_alive()
        Job.objects.enqueue(noop, queue="parent-after")
        (after,) = receive(listener, 1)
        assert after.payload == "parent-after"
        assert after.pid == before.pid
        assert notifier._thread is parent_thread
    assert Job.objects.filter(queue="child", payload={"from": "child"}).count() == 1


@override_settings(PGJOBS=BACKGROUND)
def test_rollback_sends_nothing_and_starts_no_thread() -> None:
    with listening() as listener:
        with contextlib.suppress(RuntimeError), transaction.atomic():
            noop.enqueue(n=1)
            Job.objects.enqueue_many(noop, [{"n": 2}, {"n": 3}], queue="other")
            raise RuntimeError
        assert notifier.flush()
        assert listener.quiet() == []
    assert notifier._thread is None
    assert notifier_threads() == []
    assert notifier_pids() == set()
    assert Job.objects.count() == 0


@override_settings(PGJOBS=BACKGROUND)
def test_a_savepoint_rollback_still_notifies_what_committed() -> None:
    with listening() as listener:
        with transaction.atomic():
            Job.objects.enqueue(noop, queue="kept")
            with contextlib.suppress(RuntimeError), transaction.atomic():
                Job.objects.enqueue(noop, queue="dropped")
                Job.objects.enqueue(noop, queue="kept")
                Job.objects.enqueue(noop, queue="again")
                raise RuntimeError
            # Its hook went with the savepoint; enqueued again, it must be registered again.
            Job.objects.enqueue(noop, queue="again")
            assert listener.quiet() == []
        assert sorted(n.payload for n in receive(listener, 2)) == ["again", "kept"]
        assert notifier.flush()
        assert listener.quiet() == []
    assert sorted(Job.objects.values_list("queue", flat=True)) == ["again", "kept"]


# -- inline mode ----------------------------------------------------------------------


@override_settings(PGJOBS=INLINE)
def test_inline_sends_on_the_callers_connection_before_enqueue_returns() -> None:
    caller = my_pid()
    with listening() as listener:
        noop.enqueue(n=1)
        (note,) = receive(listener, 1)
        assert (note.payload, note.pid) == ("default", caller)

        with transaction.atomic():
            Job.objects.enqueue(noop, queue="in-atomic")
            Job.objects.enqueue(noop, queue="in-atomic")
            assert listener.quiet(0.1) == []
        notes = receive(listener, 1)
        assert [(n.payload, n.pid) for n in notes] == [("in-atomic", caller)]
        assert listener.quiet() == []
    assert notifier._thread is None
    assert notifier_threads() == []
    assert notifier_pids() == set()


@override_settings(PGJOBS=INLINE)
def test_inline_a_failed_notify_is_logged_at_once(caplog: pytest.LogCaptureFixture) -> None:
    with (
        override_settings(PGJOBS={**INLINE, "CHANNEL": "x" * 64}),
        caplog.at_level(logging.WARNING, logger="django_pgjobs.notify"),
    ):
        created = noop.enqueue(n=1)
        # No flush: the caller's connection sent (and failed) it before enqueue returned.
        warned = [r for r in caplog.records if r.name == "django_pgjobs.notify"]
    assert len(warned) == 1
    assert "NOTIFY for queue default failed" in warned[0].getMessage()
    assert job_row(created.id)["status"] == "queued"
    assert notifier._thread is None
    # The connection is usable: the failed NOTIFY's transaction did not stay open.
    assert not connections["default"].in_atomic_block
    assert query("SELECT 1") == [(1,)]
