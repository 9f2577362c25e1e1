"""The CHECK constraints refuse, from plain SQL, each kind of row enqueue() would refuse.

Each bad kind is tried as an INSERT and as an UPDATE of a good row, and must fail with the
constraint's name in the error; the good values beside it must pass, so a constraint that
refused everything would fail here too.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.db import IntegrityError, transaction
from django.test import TestCase

from django_pgjobs.core import validation
from django_pgjobs.exceptions import InvalidJobOptions
from django_pgjobs.models import Job
from tests.helpers import make_job, query, scalar

QUEUE_NAMES = [
    "default",
    "a",
    "x" * 100,
    "A-z_0.9:x",
    "emails:high-priority.v2",
    "",
    "x" * 101,
    "two words",
    "tab\tinside",
    "line\n",
    "\nline",
    "slash/name",
    "café",
    "quote'name",
    "semi;colon",
    "*",
    "x" * 100 + "\n",
    "x" * 99 + "é",
    "é" * 50,
    "\nx",
    "x\r",
]


def insert(**columns: Any) -> int:
    """INSERT one job with these columns (the rest take the table defaults)."""
    columns.setdefault("task", "x.y")
    names = ", ".join(columns)
    slots = ", ".join("%s::jsonb" if name == "payload" else "%s" for name in columns)
    with transaction.atomic():
        return int(
            scalar(
                f"INSERT INTO pgjobs_job ({names}) VALUES ({slots}) RETURNING id",
                list(columns.values()),
            )
        )


def update(job_id: int, **columns: Any) -> None:
    sets = ", ".join(
        f"{name} = %s::jsonb" if name == "payload" else f"{name} = %s" for name in columns
    )
    with transaction.atomic():
        query(
            f"UPDATE pgjobs_job SET {sets} WHERE id = %s RETURNING id",
            [*columns.values(), job_id],
        )


def refused(constraint: str) -> Any:
    return pytest.raises(IntegrityError, match=constraint)


class PayloadConstraintTests(TestCase):
    def test_a_payload_that_is_not_an_object_is_refused(self) -> None:
        good = insert(payload='{"a": 1}')
        for payload in ('"text"', '"{\\"a\\": 1}"', "[1, 2]", "[]", "3", "true", "null"):
            with self.subTest(payload=payload):
                with refused("pgjobs_job_payload_check"):
                    insert(payload=payload)
                with refused("pgjobs_job_payload_check"):
                    update(good, payload=payload)
        assert insert(payload="{}") > good
        # The trigger's error carries the name where the CHECK's did, for code that reads it.
        with refused("pgjobs_job_payload_check") as refusal:
            insert(payload="[]")
        diag = refusal.value.__cause__.diag
        assert (diag.constraint_name, diag.table_name, diag.sqlstate) == (
            "pgjobs_job_payload_check",
            "pgjobs_job",
            "23514",
        )


class QueueConstraintTests(TestCase):
    def test_the_constraint_accepts_exactly_the_names_python_accepts(self) -> None:
        good = insert(queue="default")
        for name in QUEUE_NAMES:
            with self.subTest(queue=name):
                try:
                    validation.queue_name(name)
                except InvalidJobOptions:
                    with refused("pgjobs_job_queue_check"):
                        insert(queue=name)
                    with refused("pgjobs_job_queue_check"):
                        update(good, queue=name)
                else:
                    assert (
                        scalar("SELECT queue FROM pgjobs_job WHERE id = %s", [insert(queue=name)])
                        == name
                    )
        # Both kinds are in the list: the loop above tried both branches.
        python_refuses = [n for n in QUEUE_NAMES if not validation.QUEUE_NAME.fullmatch(n)]
        assert 0 < len(python_refuses) < len(QUEUE_NAMES)


class QueueConditionTests(TestCase):
    def test_the_check_since_0010_refuses_exactly_what_0006_refused(self) -> None:
        # Both conditions as the migrations wrote them, side by side over the same names: the
        # cheaper one (no bounded repeat) must not let in or keep out a single other name.
        old = "queue ~ '^[A-Za-z0-9_.:-]{1,100}$'"
        new = "queue ~ '^[A-Za-z0-9_.:-]+$' AND length(queue) <= 100"
        names = [*QUEUE_NAMES, *(chr(c) for c in range(1, 0x3000)), "x" * 99 + "\n", None]
        rows = query(f"SELECT queue, {old}, {new} FROM unnest(%s::text[]) AS q(queue)", [names])
        differ = [name for name, before, after in rows if before is not after]
        assert differ == [] and len(rows) == len(names)
        assert {before for _, before, _ in rows} == {True, False, None}


class AttemptsConstraintTests(TestCase):
    def test_max_attempts_below_one_is_refused(self) -> None:
        good = insert(max_attempts=1, status="done")
        with refused("pgjobs_job_max_attempts_check"):
            insert(max_attempts=0, status="done")
        with refused("pgjobs_job_max_attempts_check"):
            update(good, max_attempts=0)
        # Below 0 is below attempts too (never negative): either constraint may speak first.
        for value in (-1, -(2**31)):
            with self.subTest(max_attempts=value):
                with refused("pgjobs_job_(max_)?attempts_check"):
                    insert(max_attempts=value, status="done")
                with refused("pgjobs_job_(max_)?attempts_check"):
                    update(good, max_attempts=value)

    def test_negative_attempts_are_refused(self) -> None:
        good = insert()
        with refused("pgjobs_job_attempts_check"):
            insert(attempts=-1)
        with refused("pgjobs_job_attempts_check"):
            update(good, attempts=-1)

    def test_attempts_above_max_attempts_are_refused(self) -> None:
        good = insert(status="running", attempts=2, max_attempts=3)
        with refused("pgjobs_job_attempts_check"):
            insert(status="running", attempts=4, max_attempts=3)
        with refused("pgjobs_job_attempts_check"):
            update(good, attempts=4)
        with refused("pgjobs_job_attempts_check"):
            update(good, max_attempts=1)
        # At the limit is a job that used its last attempt: fine while running or finished.
        for status in ("running", "done", "failed"):
            insert(status=status, attempts=3, max_attempts=3)

    def test_a_queued_job_with_no_attempt_left_is_refused(self) -> None:
        # The claim adds an attempt: a queued 3/3 would become a running 4/3, and the whole
        # claim (every job in its batch) would fail on the attempts constraint.
        good = insert(status="queued", attempts=2, max_attempts=3)
        with refused("pgjobs_job_queued_attempts_check"):
            insert(status="queued", attempts=3, max_attempts=3)
        with refused("pgjobs_job_queued_attempts_check"):
            update(good, attempts=3)
        with refused("pgjobs_job_queued_attempts_check"):
            update(good, max_attempts=2)
        failed = insert(status="failed", attempts=3, max_attempts=3)
        with refused("pgjobs_job_queued_attempts_check"):
            update(failed, status="queued")

    def test_a_queued_job_with_its_last_attempt_left_can_be_claimed(self) -> None:
        job_id = make_job(queue="last", attempts=2, max_attempts=3)
        with transaction.atomic():
            claimed = Job.objects.claim(queue="last", mode="transaction")
        assert [(job.id, job.attempts) for job in claimed] == [(job_id, 3)]
        assert scalar("SELECT status FROM pgjobs_job WHERE id = %s", [job_id]) == "running"
