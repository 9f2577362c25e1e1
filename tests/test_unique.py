"""Unique jobs: a second enqueue of a key that a job holds inserts nothing and returns that job.

The partial unique index pgjobs_job_unique_idx decides, through the INSERT's ON CONFLICT, so
it holds across connections and transactions; these tests race real sessions against it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from django.db import OperationalError, connection, transaction
from django.test import TestCase, TransactionTestCase
from psycopg.errors import SerializationFailure

from django_pgjobs import job
from django_pgjobs.core import conf, finish
from django_pgjobs.core.enqueue import UNIQUE_TRIES
from django_pgjobs.core.types import FailedAttempt, Failure
from django_pgjobs.exceptions import UniqueKeyBusy
from django_pgjobs.managers import Enqueued
from django_pgjobs.models import Job
from testproject.testjobs import noop
from tests.helpers import (
    PATIENCE,
    DbThread,
    Listener,
    listening,
    query,
    raw_connect,
    scalar,
    wait_until,
)
from tests.retry_jobs import discards_value_errors, snooze_once
from tests.workers import Workers, fails_first, write_order


@job(name="tests.test_unique.invoice", unique_key=lambda payload: f"invoice:{payload['n']}")
def invoice(n: int) -> None: ...


@job(
    name="tests.test_unique.sync_account",
    unique_key=lambda payload: payload.get("account"),
    unique_while="active",
)
def sync_account(**kwargs: Any) -> None: ...


def holders() -> list[tuple[Any, ...]]:
    return query("SELECT unique_key, status FROM pgjobs_job WHERE unique_key IS NOT NULL")


class EnqueueTests(TestCase):
    def test_a_second_enqueue_of_a_held_key_returns_the_holder(self) -> None:
        first = Job.objects.enqueue(noop, {"n": 1}, unique_key="invoice:42")
        again = Job.objects.enqueue(noop, {"n": 2}, unique_key="invoice:42", priority=5)
        assert first.created is True
        assert again.created is False
        assert again.id == first.id
        # The holder's whole row, not the second call's options.
        assert again.payload == {"n": 1}
        assert again.priority == 0
        assert again.unique_key == "invoice:42"
        assert again.unique_while == "queued"
        assert again.created_at == first.created_at
        assert Job.objects.count() == 1

    def test_jobs_without_a_key_are_always_created(self) -> None:
        jobs = [Job.objects.enqueue(noop, {"n": 1}) for _ in range(2)]
        assert [j.created for j in jobs] == [True, True]
        assert jobs[0].id != jobs[1].id
        assert jobs[0].unique_key is None
        assert jobs[0].unique_while is None
        assert scalar("SELECT count(*) FROM pgjobs_job WHERE unique_while IS NULL") == 2

    def test_other_keys_do_not_collide(self) -> None:
        a = Job.objects.enqueue(noop, unique_key="a")
        b = Job.objects.enqueue(noop, unique_key="b")
        assert (a.created, b.created) == (True, True)
        assert a.id != b.id

    def test_the_job_callable_gives_the_key_and_the_sugar_uses_it(self) -> None:
        first = invoice.enqueue(n=7)
        again = Job.objects.enqueue(invoice, {"n": 7})
        other = invoice.enqueue(n=8)
        assert first.unique_key == "invoice:7"
        assert (first.created, again.created, other.created) == (True, False, True)
        assert again.id == first.id
        assert other.id != first.id

    def test_an_explicit_key_wins_over_the_callable(self) -> None:
        first = Job.objects.enqueue(invoice, {"n": 7}, unique_key="mine")
        assert first.unique_key == "mine"
        assert invoice.enqueue(n=7).created is True

    def test_a_callable_that_returns_none_means_no_key(self) -> None:
        jobs = [sync_account.enqueue() for _ in range(2)]
        assert [j.created for j in jobs] == [True, True]
        assert jobs[0].unique_while is None

    def test_unique_while_comes_from_the_job_unless_given(self) -> None:
        assert sync_account.enqueue(account="a").unique_while == "active"
        given = Job.objects.enqueue(sync_account, {"account": "b"}, unique_while="queued")
        assert given.unique_while == "queued"
        assert Job.objects.enqueue(noop, unique_key="c", unique_while="active").unique_while == (
            "active"
        )

    def test_a_deduplicated_enqueue_registers_no_notification(self) -> None:
        # The holder goes in by plain SQL: an enqueue would register the queue's hook itself.
        query(
            "INSERT INTO pgjobs_job (task, payload, unique_key, unique_while) "
            "VALUES (%s, '{}', 'k', 'queued') RETURNING id",
            [noop.name],
        )
        with self.captureOnCommitCallbacks() as hooks:
            with transaction.atomic():
                again = Job.objects.enqueue(noop, unique_key="k")
                many = Job.objects.enqueue_many(noop, [{}, {}], unique_key=lambda p: "k")
        assert again.created is False
        assert many.created == [False, False]
        assert hooks == []


class WindowTests(TestCase):
    """Which states hold the key: the table in docs/unique.md, transition by transition."""

    def claim(self) -> Any:
        (claimed,) = Job.objects.claim(limit=1, mode="transaction")
        return claimed

    def test_queued_mode_gives_the_key_up_when_the_job_starts(self) -> None:
        first = Job.objects.enqueue(noop, unique_key="report")
        self.claim()
        assert holders() == []
        second = Job.objects.enqueue(noop, unique_key="report")
        assert second.created is True
        assert second.id != first.id
        assert holders() == [("report", "queued")]

    def test_queued_mode_a_retry_waits_without_the_key(self) -> None:
        Job.objects.enqueue(noop, unique_key="report")
        assert Job.objects.fail(self.claim(), error="boom") == "queued"
        assert holders() == []
        assert Job.objects.enqueue(noop, unique_key="report").created is True

    def test_active_mode_holds_the_key_while_running_and_through_retries(self) -> None:
        first = Job.objects.enqueue(noop, unique_key="sync", unique_while="active")
        claimed = self.claim()
        assert holders() == [("sync", "running")]
        assert Job.objects.enqueue(noop, unique_key="sync").id == first.id
        assert Job.objects.fail(claimed, error="boom") == "queued"
        assert holders() == [("sync", "queued")]
        assert Job.objects.enqueue(noop, unique_key="sync").created is False

    def test_active_mode_frees_the_key_when_the_job_is_done(self) -> None:
        first = Job.objects.enqueue(noop, unique_key="sync", unique_while="active")
        assert Job.objects.complete(self.claim())
        assert holders() == []
        second = Job.objects.enqueue(noop, unique_key="sync", unique_while="active")
        assert second.created is True
        assert second.id != first.id

    def test_active_mode_frees_the_key_when_the_job_fails_for_good(self) -> None:
        Job.objects.enqueue(noop, unique_key="sync", unique_while="active", max_attempts=1)
        assert Job.objects.fail(self.claim(), error="boom") == "failed"
        assert holders() == []
        assert Job.objects.enqueue(noop, unique_key="sync").created is True

    def expire_and_reap(self) -> list[Any]:
        query("UPDATE pgjobs_job SET locked_until = now() - interval '1 second' RETURNING id")
        return Job.objects.reap()

    def test_active_mode_the_reaper_keeps_the_key_until_the_final_attempt(self) -> None:
        first = Job.objects.enqueue(noop, unique_key="sync", unique_while="active", max_attempts=2)
        self.claim()
        assert [r.status for r in self.expire_and_reap()] == ["queued"]
        assert holders() == [("sync", "queued")]
        assert Job.objects.enqueue(noop, unique_key="sync").id == first.id
        self.claim()
        assert [r.status for r in self.expire_and_reap()] == ["failed"]
        assert holders() == []
        assert Job.objects.enqueue(noop, unique_key="sync").created is True

    def test_queued_mode_a_reaped_job_waits_without_the_key(self) -> None:
        Job.objects.enqueue(noop, unique_key="report", max_attempts=2)
        self.claim()
        assert [r.status for r in self.expire_and_reap()] == ["queued"]
        assert holders() == []
        assert Job.objects.enqueue(noop, unique_key="report").created is True

    def test_active_mode_a_released_job_keeps_the_key(self) -> None:
        first = Job.objects.enqueue(noop, unique_key="sync", unique_while="active")
        assert Job.objects.release(self.claim())
        assert holders() == [("sync", "queued")]
        assert Job.objects.enqueue(noop, unique_key="sync").id == first.id

    def test_queued_mode_a_released_job_waits_without_the_key(self) -> None:
        first = Job.objects.enqueue(noop, unique_key="report")
        assert Job.objects.release(self.claim())
        assert holders() == []
        second = Job.objects.enqueue(noop, unique_key="report")
        assert second.created is True
        assert second.id != first.id

    def test_active_mode_a_final_failure_frees_the_key_with_attempts_left(self) -> None:
        Job.objects.enqueue(noop, unique_key="sync", unique_while="active", max_attempts=5)
        final = FailedAttempt(self.claim(), Failure.of("discarded"), (1.0, 1.0), final=True)
        assert finish.fail(connection, [final], synchronous_commit=None)
        assert query("SELECT status, unique_key FROM pgjobs_job") == [("failed", None)]
        assert Job.objects.enqueue(noop, unique_key="sync").created is True

    def test_a_finished_job_keeps_no_key_so_a_retry_of_it_cannot_collide(self) -> None:
        old = Job.objects.enqueue(noop, unique_key="sync", unique_while="active", max_attempts=1)
        Job.objects.fail(self.claim(), error="boom")
        new = Job.objects.enqueue(noop, unique_key="sync", unique_while="active")
        assert Job.objects.retry([old.id]) == [old.id]
        assert holders() == [("sync", "queued")]
        assert query("SELECT id FROM pgjobs_job WHERE unique_key = 'sync'") == [(new.id,)]


class EnqueueManyTests(TestCase):
    def test_duplicates_in_the_call_share_the_first_payloads_job(self) -> None:
        payloads = [{"n": 1}, {"n": 2}, {"n": 1}, {"n": 3}, {"n": 2}]
        ids = Job.objects.enqueue_many(invoice, payloads)
        assert isinstance(ids, Enqueued)
        assert ids[0] == ids[2] and ids[1] == ids[4]
        assert len(set(ids)) == 3
        assert ids.created == [True, True, False, True, False]
        rows = dict(query("SELECT id, payload->>'n' FROM pgjobs_job"))
        assert [rows[i] for i in ids] == ["1", "2", "1", "3", "2"]

    def test_keys_held_by_other_jobs_return_the_holders_ids(self) -> None:
        held = invoice.enqueue(n=2)
        ids = Job.objects.enqueue_many(invoice, [{"n": 1}, {"n": 2}, {"n": 3}])
        assert ids[1] == held.id
        assert ids.created == [True, False, True]
        assert Job.objects.count() == 3

    def test_every_key_held_inserts_nothing(self) -> None:
        held = [invoice.enqueue(n=n).id for n in range(3)]
        ids = Job.objects.enqueue_many(invoice, [{"n": n} for n in (2, 1, 0, 1)])
        assert ids == [held[2], held[1], held[0], held[1]]
        assert ids.created == [False] * 4
        assert Job.objects.count() == 3

    def test_keyless_payloads_keep_their_order_among_keyed_ones(self) -> None:
        sync_account.enqueue(account="held")
        payloads = [{"i": 0}, {"account": "held"}, {"i": 1}, {"account": "a"}, {"i": 2}]
        ids = Job.objects.enqueue_many(sync_account, payloads)
        assert ids.created == [True, False, True, True, True]
        rows = dict(query("SELECT id, payload::text FROM pgjobs_job"))
        assert [rows[i] for i in ids[2:]] == ['{"i": 1}', '{"account": "a"}', '{"i": 2}']
        assert rows[ids[0]] == '{"i": 0}'

    def test_an_explicit_callable_wins_over_the_job(self) -> None:
        ids = Job.objects.enqueue_many(invoice, [{"n": 1}, {"n": 2}], unique_key=lambda p: "one")
        assert ids.created == [True, False]
        assert holders() == [("one", "queued")]

    def test_without_keys_it_is_the_plain_list_of_new_ids(self) -> None:
        ids = Job.objects.enqueue_many(noop, [{"n": 1}, {"n": 2}])
        assert ids.created == [True, True]
        assert list(Job.objects.filter(id__in=ids).order_by("id").values_list("id", flat=True)) == (
            sorted(ids)
        )

    @pytest.mark.slow
    def test_ten_thousand_payloads_with_a_hundred_keys_write_a_hundred_rows(self) -> None:
        keys = 100
        payloads = [{"n": i % keys, "i": i} for i in range(10_000)]
        ids = Job.objects.enqueue_many(invoice, payloads)
        assert Job.objects.count() == keys
        assert len(ids) == len(payloads)
        assert ids.created == [i < keys for i in range(len(payloads))]
        assert ids == [ids[i % keys] for i in range(len(payloads))]
        # Each key's job is its first payload's.
        rows = {
            job_id: (key, i)
            for job_id, key, i in query(
                "SELECT id, unique_key, (payload->>'i')::int FROM pgjobs_job"
            )
        }
        assert [rows[ids[i]] for i in range(keys)] == [(f"invoice:{i}", i) for i in range(keys)]
        # Again: every key is held now, so nothing is written and every id is a holder's.
        again = Job.objects.enqueue_many(invoice, payloads)
        assert again == ids
        assert again.created == [False] * len(payloads)
        assert Job.objects.count() == keys


def insert_is_waiting() -> bool:
    """Whether another session's INSERT into the job table waits for a lock.

    Asked on a connection of its own: inside a transaction pg_stat_activity keeps showing
    what it showed at its first read.
    """
    with raw_connect() as observer:
        row = observer.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock' AND query LIKE '%INSERT INTO pgjobs_job%'"
        ).fetchone()
    return bool(row and row[0])


class ConcurrencyTests(TransactionTestCase):
    @pytest.mark.slow
    def test_sixteen_threads_enqueue_one_key_a_thousand_times_each_one_row(self) -> None:
        threads, calls = 16, 1_000
        start = threading.Barrier(threads)

        def enqueuer() -> list[tuple[int, bool]]:
            start.wait(PATIENCE)
            results = []
            for n in range(calls):
                found = Job.objects.enqueue(noop, {"n": n}, unique_key="the-one")
                results.append((found.id, found.created))
            return results

        running = [DbThread(enqueuer) for _ in range(threads)]
        for t in running:
            t.start()
        results = [r for t in running for r in t.result(timeout=20 * PATIENCE)]
        (row_id,) = [i for (i,) in query("SELECT id FROM pgjobs_job")]
        assert len(results) == threads * calls
        assert {job_id for job_id, _created in results} == {row_id}
        assert [created for _id, created in results].count(False) == threads * calls - 1

    def test_overlapping_enqueue_many_calls_in_opposite_orders_do_not_deadlock(self) -> None:
        # Each call inserts its keys in one statement; sent in payload order, one call's
        # uncommitted k1 blocks the other's k1 while the other's k2 blocks its k2: a deadlock.
        keys = [f"key:{i:04}" for i in range(2_000)]
        start = threading.Barrier(2)

        def enqueuer(order: list[str]) -> Enqueued:
            start.wait(PATIENCE)
            return Job.objects.enqueue_many(
                noop, [{"key": key} for key in order], unique_key=lambda p: p["key"]
            )

        running = [DbThread(enqueuer, keys), DbThread(enqueuer, keys[::-1])]
        for t in running:
            t.start()
        forward, backward = (t.result(timeout=20 * PATIENCE) for t in running)
        assert forward == backward[::-1]
        assert sorted(forward.created + backward.created).count(True) == len(keys)
        assert scalar("SELECT count(*) FROM pgjobs_job") == len(keys)
        assert scalar("SELECT count(DISTINCT unique_key) FROM pgjobs_job") == len(keys)

    def enqueue_beside_an_open_transaction(self, commit: bool) -> tuple[Job, Job]:
        """Enqueue a key in an atomic() block; a second connection enqueues it meanwhile."""
        second: DbThread | None = None
        with transaction.atomic():
            first = Job.objects.enqueue(noop, {"who": "first"}, unique_key="k")
            second = DbThread(lambda: Job.objects.enqueue(noop, {"who": "second"}, unique_key="k"))
            second.start()
            # The second INSERT waits on the first's uncommitted row; it has not returned.
            wait_until(insert_is_waiting, message="the second enqueue to wait for the first")
            assert second.is_alive()
            if not commit:
                transaction.set_rollback(True)
        return first, second.result(timeout=PATIENCE)

    def test_a_key_in_an_open_transaction_makes_the_second_wait_then_dedup(self) -> None:
        first, second = self.enqueue_beside_an_open_transaction(commit=True)
        assert second.created is False
        assert second.id == first.id
        assert Job.objects.count() == 1

    def test_a_rolled_back_holder_lets_the_waiting_enqueue_insert(self) -> None:
        first, second = self.enqueue_beside_an_open_transaction(commit=False)
        assert second.created is True
        assert second.id != first.id
        assert query("SELECT payload->>'who' FROM pgjobs_job") == [("second",)]

    def enqueue_beside_a_transaction_mode_job(self, unique_while: str) -> tuple[Job, Job]:
        """A job of key k runs in transaction mode; another connection enqueues k meanwhile."""
        first = Job.objects.enqueue(
            noop, {"who": "first"}, unique_key="k", unique_while=unique_while
        )
        with transaction.atomic():
            (claimed,) = Job.objects.claim(limit=1, mode="transaction")
            second = DbThread(lambda: Job.objects.enqueue(noop, {"who": "second"}, unique_key="k"))
            second.start()
            # The claim's update of the row (in queued mode, the key cleared) is not committed:
            # the INSERT waits for this transaction, whatever the mode.
            wait_until(insert_is_waiting, message="the enqueue to wait for the running job")
            assert second.is_alive()
            assert Job.objects.complete(claimed)
        return first, second.result(timeout=PATIENCE)

    def test_queued_mode_an_enqueue_waits_for_a_transaction_mode_job_then_inserts(self) -> None:
        first, second = self.enqueue_beside_a_transaction_mode_job("queued")
        assert second.created is True
        assert second.id != first.id
        assert holders() == [("k", "queued")]

    def test_active_mode_an_enqueue_waits_for_a_transaction_mode_job_then_inserts(self) -> None:
        # The job completed in the transaction the enqueue waited for: the key was free.
        first, second = self.enqueue_beside_a_transaction_mode_job("active")
        assert second.created is True
        assert second.id != first.id
        assert query("SELECT id, status FROM pgjobs_job ORDER BY id") == [
            (first.id, "done"),
            (second.id, "queued"),
        ]

    def test_a_deduplicated_enqueue_in_autocommit_sends_no_notification(self) -> None:
        with listening() as listener:
            first = Job.objects.enqueue(noop, unique_key="k")
            assert notifications_until_a_marker(listener) == ["default"]
            again = Job.objects.enqueue(noop, unique_key="k")
            many = Job.objects.enqueue_many(noop, [{}, {}], unique_key=lambda p: "k")
            assert notifications_until_a_marker(listener) == []
        assert again.id == first.id and again.created is False
        assert many == [first.id, first.id] and many.created == [False, False]

    def test_in_one_transaction_the_second_enqueue_sees_the_first(self) -> None:
        with transaction.atomic():
            first = Job.objects.enqueue(noop, unique_key="k")
            again = Job.objects.enqueue(noop, unique_key="k")
            many = Job.objects.enqueue_many(noop, [{}, {}], unique_key=lambda p: "k")
        assert again.id == first.id and again.created is False
        assert many == [first.id, first.id] and many.created == [False, False]

    def test_repeatable_read_meets_a_holder_it_cannot_see_with_a_serialization_failure(
        self,
    ) -> None:
        with pytest.raises(OperationalError) as info, transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                cursor.execute("SELECT 1")  # the snapshot is taken here
            # Committed by another session after this transaction's snapshot.
            other = DbThread(lambda: Job.objects.enqueue(noop, unique_key="k"))
            other.start()
            assert other.result(timeout=PATIENCE).created is True
            Job.objects.enqueue(noop, unique_key="k")
        assert isinstance(info.value.__cause__, SerializationFailure)
        # Retried as a new transaction, it finds the holder.
        assert Job.objects.enqueue(noop, unique_key="k").created is False

    def test_serializable_dedups_against_a_holder_it_can_see(self) -> None:
        first = Job.objects.enqueue(noop, unique_key="k")
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SET TRANSACTION ISOLATION LEVEL SERIALIZABLE")
            again = Job.objects.enqueue(noop, unique_key="k")
        assert again.id == first.id and again.created is False


GHOST = '{"ghost": true}'
MARKER = "tests.test_unique: marker"


@contextmanager
def vanishing_holders(times: int) -> Iterator[None]:
    """The first ``times`` INSERTs of each key 'ghost:*' find it held, the read after each one
    finds it free: a holder that finished in between, every time.

    A row trigger inserts a holder of the key just before the row; a statement trigger clears
    that holder's key before the INSERT returns.
    """
    statements = [
        "CREATE TABLE pgjobs_test_ghosts (key text PRIMARY KEY, inserts int NOT NULL)",
        f"""CREATE FUNCTION pgjobs_test_ghost() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
          IF pg_trigger_depth() = 1 AND NEW.unique_key LIKE 'ghost:%' THEN
            INSERT INTO pgjobs_test_ghosts VALUES (NEW.unique_key, 1)
            ON CONFLICT (key) DO UPDATE SET inserts = pgjobs_test_ghosts.inserts + 1;
            IF (SELECT inserts FROM pgjobs_test_ghosts WHERE key = NEW.unique_key) <= {times}
            THEN
              INSERT INTO pgjobs_job (task, payload, unique_key, unique_while)
              VALUES (NEW.task, '{GHOST}', NEW.unique_key, 'queued');
            END IF;
          END IF;
          RETURN NEW;
        END $$""",
        f"""CREATE FUNCTION pgjobs_test_ghost_gone() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
          UPDATE pgjobs_job SET unique_key = NULL WHERE payload = '{GHOST}';
          RETURN NULL;
        END $$""",
        "CREATE TRIGGER pgjobs_test_ghost BEFORE INSERT ON pgjobs_job "
        "FOR EACH ROW EXECUTE FUNCTION pgjobs_test_ghost()",
        "CREATE TRIGGER pgjobs_test_ghost_gone AFTER INSERT ON pgjobs_job "
        "FOR EACH STATEMENT WHEN (pg_trigger_depth() < 1) "
        "EXECUTE FUNCTION pgjobs_test_ghost_gone()",
    ]
    with connection.cursor() as cursor:
        for statement in statements:
            cursor.execute(statement)
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DROP TRIGGER pgjobs_test_ghost ON pgjobs_job")
            cursor.execute("DROP TRIGGER pgjobs_test_ghost_gone ON pgjobs_job")
            cursor.execute("DROP FUNCTION pgjobs_test_ghost(), pgjobs_test_ghost_gone()")
            cursor.execute("DROP TABLE pgjobs_test_ghosts")


def notifications_until_a_marker(listener: Listener) -> list[str]:
    """What the listener received before a marker sent now from another connection.

    Notifications arrive in commit order, so anything an earlier commit sent comes first:
    silence is shown without waiting for a clock.
    """
    with raw_connect() as other:
        other.execute("SELECT pg_notify(%s, %s)", [conf.channel(), MARKER])
    received = []
    for payload in (n.payload for n in listener.conn.notifies(timeout=PATIENCE)):
        if payload == MARKER:
            return received
        received.append(payload)
    raise AssertionError(f"the marker never arrived; received {received!r}")


def real_jobs() -> list[tuple[Any, ...]]:
    return query(
        "SELECT id, payload->>'n', unique_key FROM pgjobs_job WHERE payload <> %s::jsonb "
        "ORDER BY payload->>'n'",
        [GHOST],
    )


class VanishingHolderTests(TransactionTestCase):
    def test_a_holder_gone_before_the_read_is_retried_and_inserted(self) -> None:
        with vanishing_holders(times=UNIQUE_TRIES - 1):
            found = Job.objects.enqueue(noop, {"n": 1}, unique_key="ghost:1")
        assert found.created is True
        assert real_jobs() == [(found.id, "1", "ghost:1")]

    def test_enqueue_many_retries_only_the_keys_whose_holder_went(self) -> None:
        held = invoice.enqueue(n=1)
        keys = {1: "invoice:1", 2: "ghost:2", 3: None}
        with vanishing_holders(times=1):
            ids = Job.objects.enqueue_many(
                noop, [{"n": 1}, {"n": 2}, {"n": 3}], unique_key=lambda p: keys[p["n"]]
            )
        assert ids.created == [False, True, True]
        assert ids[0] == held.id
        assert real_jobs() == [
            (held.id, "1", "invoice:1"),
            (ids[1], "2", "ghost:2"),
            (ids[2], "3", None),
        ]

    def test_a_key_that_vanishes_at_every_try_is_a_clear_error(self) -> None:
        with (
            vanishing_holders(times=UNIQUE_TRIES),
            pytest.raises(UniqueKeyBusy, match=r"'ghost:1'.* 3 inserts.*enqueue again"),
        ):
            Job.objects.enqueue(noop, {"n": 1}, unique_key="ghost:1")
        assert real_jobs() == []

    def test_enqueue_many_that_gives_up_writes_nothing_and_sends_no_notification(self) -> None:
        keys = {1: None, 2: "other", 3: "ghost:3"}
        with listening() as listener:
            with (
                vanishing_holders(times=UNIQUE_TRIES),
                pytest.raises(UniqueKeyBusy, match=r"'ghost:3'.*nothing was enqueued"),
            ):
                Job.objects.enqueue_many(
                    noop, [{"n": n} for n in keys], unique_key=lambda p: keys[p["n"]]
                )
            assert notifications_until_a_marker(listener) == []
        assert scalar("SELECT count(*) FROM pgjobs_job") == 0

    def test_inside_a_transaction_only_the_call_is_rolled_back(self) -> None:
        keys = {1: None, 2: "other", 3: "ghost:3"}
        with transaction.atomic():
            before = Job.objects.enqueue(noop, {"n": 0})
            with (
                vanishing_holders(times=UNIQUE_TRIES),
                pytest.raises(UniqueKeyBusy),
            ):
                Job.objects.enqueue_many(
                    noop, [{"n": n} for n in keys], unique_key=lambda p: keys[p["n"]]
                )
            after = Job.objects.enqueue(noop, {"n": 4}, unique_key="other")
        assert after.created is True
        assert real_jobs() == [(before.id, "0", None), (after.id, "4", "other")]


@pytest.mark.django_db(transaction=True)
def test_after_a_mixed_workload_no_finished_job_holds_a_key(workers: Workers) -> None:
    """Through a real worker, jobs of both modes end every way there is; a key stays only on
    a queued or running row, and in 'queued' mode only on a job that never started."""
    serial = iter(range(1_000))

    def put(unique_while: str, func: Any, payload: dict[str, Any], **options: Any) -> int:
        key = f"{unique_while}:{next(serial)}"
        return Job.objects.enqueue(
            func, payload, unique_key=key, unique_while=unique_while, **options
        ).id

    retried = []
    for mode in ("queued", "active"):
        put(mode, noop, {})
        put(mode, discards_value_errors, {"kind": "value"})
        put(mode, fails_first, {"times": 1})
        put(mode, snooze_once, {"seconds": 3600})
        Job.objects.cancel(put(mode, noop, {}))
        retried.append(put(mode, write_order, {"email": f"{mode}@x", "fail": True}, max_attempts=1))
    workers.burst(test_jobs=True)
    assert Job.objects.retry(retried) == sorted(retried)
    workers.burst(test_jobs=True)

    statuses = {status for (status,) in query("SELECT status FROM pgjobs_job")}
    assert {"done", "failed", "cancelled", "queued"} <= statuses
    assert (
        query(
            "SELECT id, status, unique_key FROM pgjobs_job "
            "WHERE unique_key IS NOT NULL AND status NOT IN ('queued', 'running')"
        )
        == []
    )
    assert (
        query(
            "SELECT id, status, unique_key FROM pgjobs_job "
            "WHERE unique_key IS NOT NULL AND unique_while = 'queued' AND started_at IS NOT NULL"
        )
        == []
    )
    # In 'active' mode the snoozed job, queued again, still holds its key.
    assert (
        scalar(
            "SELECT count(*) FROM pgjobs_job WHERE unique_while = 'active' AND snoozes = 1 "
            "AND status = 'queued' AND unique_key IS NOT NULL"
        )
        == 1
    )


class FinishedRowsHoldNoKeyTests(TestCase):
    """The unique index holds only queued and running rows: a finished row that still has a
    key (a worker from before unique keys completes a job without giving its key up) keeps
    nothing out, and an operator's retry of a failed one can never meet the index."""

    def test_a_done_row_left_with_its_key_does_not_block_the_key(self) -> None:
        with connection.cursor() as cursor:
            cursor.execute(
                "INSERT INTO pgjobs_job (task, payload, status, attempts, unique_key, "
                "unique_while) VALUES (%s, '{}', 'done', 1, 'invoice:7', 'active') RETURNING id",
                [noop.name],
            )
            (old,) = cursor.fetchone()
        job = Job.objects.enqueue(noop, {}, unique_key="invoice:7")
        assert job.created and job.id != old
        assert not Job.objects.enqueue(noop, {}, unique_key="invoice:7").created

    def test_a_retry_of_a_failed_row_left_with_its_key_comes_back_without_it(self) -> None:
        holder = Job.objects.enqueue(noop, {}, unique_key="invoice:8")
        with connection.cursor() as cursor:
            cursor.execute(
                "INSERT INTO pgjobs_job (task, payload, status, attempts, unique_key, "
                "unique_while) VALUES (%s, '{}', 'failed', 5, 'invoice:8', 'queued') RETURNING id",
                [noop.name],
            )
            (failed,) = cursor.fetchone()
        assert Job.objects.retry([failed]) == [failed]
        assert Job.objects.get(id=failed).unique_key is None
        assert Job.objects.get(id=holder.id).unique_key == "invoice:8"
