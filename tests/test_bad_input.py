"""Input that used to slip past validation: each is refused with the library's own error
before anything is sent, and the caller's transaction goes on as if nothing happened.

Before, each of these reached PostgreSQL (a DataError that aborted the caller's
transaction), or raised a bare ValueError, OverflowError or RecursionError.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from django_pgjobs import job
from django_pgjobs.core import validation
from django_pgjobs.exceptions import (
    InvalidJobOptions,
    InvalidPayload,
    InvalidResult,
    PgJobsError,
)
from django_pgjobs.models import Job
from testproject.shop.models import Order
from testproject.testjobs import noop
from tests.helpers import job_row, make_job, nested

pytestmark = pytest.mark.django_db

# The latest and the earliest instants a datetime can hold, at offsets that push them out of
# the range of a datetime in UTC (the enqueue reads run_at back in UTC).
PAST_THE_END = dt.datetime.max.replace(tzinfo=dt.timezone(-dt.timedelta(hours=14)))
BEFORE_THE_START = dt.datetime.min.replace(tzinfo=dt.timezone(dt.timedelta(hours=14)))


def contains_itself() -> list[Any]:
    loop: list[Any] = []
    loop.append(loop)
    return loop


def refused(error: type[Exception], call: Callable[[], Any], match: str) -> Exception:
    """Run ``call`` inside the caller's own atomic() block, between two writes of its own.

    The call must raise ``error`` without sending a single statement, and the block must go
    on (a statement that failed in PostgreSQL would have aborted it) and commit both orders.
    """
    orders, jobs = Order.objects.count(), Job.objects.count()
    with transaction.atomic():
        Order.objects.create(email="before@example.com", total_cents=1)
        with (
            CaptureQueriesContext(connection) as sent,
            pytest.raises(error, match=match) as info,
        ):
            call()
        assert [q["sql"] for q in sent.captured_queries] == []
        Order.objects.create(email="after@example.com", total_cents=2)
    assert Order.objects.count() == orders + 2
    assert Job.objects.count() == jobs
    assert isinstance(info.value, PgJobsError)
    return info.value


# -- payloads ------------------------------------------------------------------------------

BAD_PAYLOADS = [
    pytest.param({"note": "caf\udce9"}, r"payload\['note'\].*surrogate", id="surrogate-value"),
    pytest.param({"caf\ud800": 1}, r"payload has a key .*surrogate", id="surrogate-key"),
    pytest.param(
        {"items": ["ok", {"é\udfff": 1}]},
        r"payload\['items'\]\[1\] has a key .*surrogate",
        id="surrogate-nested-key",
    ),
    pytest.param({"note": "a\x00b"}, r"payload\['note'\] contains a NUL", id="nul-value"),
    pytest.param({"a\x00": 1}, r"payload has a key 'a\\x00' that contains a NUL", id="nul-key"),
    pytest.param({"n": 10**5000}, r"payload\['n'\] is an integer of 5001 digits", id="long-int"),
    pytest.param(
        {"a": {"b": [-(10**4300)]}},
        r"payload\['a'\]\['b'\]\[0\] is an integer of 4301 digits",
        id="long-negative-int-nested",
    ),
    pytest.param(
        {"deep": nested(5000)},
        r"payload\['deep'\](\[0\]){99} is nested more than 100 levels deep",
        id="nested-5000-deep",
    ),
    pytest.param(
        {"loop": contains_itself()},
        r"payload\['loop'\](\[0\]){99} is nested more than 100 levels deep",
        id="contains-itself",
    ),
]


@pytest.mark.parametrize(("payload", "match"), BAD_PAYLOADS)
def test_a_bad_payload_is_refused_before_anything_is_sent(payload: Any, match: str) -> None:
    error = refused(InvalidPayload, lambda: Job.objects.enqueue(noop, payload), match)
    assert isinstance(error, TypeError)


@pytest.mark.parametrize(("payload", "match"), BAD_PAYLOADS)
def test_one_bad_payload_among_many_writes_none(payload: Any, match: str) -> None:
    payloads = [{"n": 1}, payload, {"n": 3}]
    refused(InvalidPayload, lambda: Job.objects.enqueue_many(noop, payloads), match)


def test_payloads_at_the_limits_are_written_and_read_back_exactly() -> None:
    longest = 10**4300 - 1  # 4300 digits
    deepest = nested(validation.MAX_DEPTH - 1)  # inside the payload: MAX_DEPTH levels in all
    payload = {"n": longest, "m": -longest, "deep": deepest, "text": "é ✓ 𝄞 日本"}

    job_id = Job.objects.enqueue(noop, payload).id

    assert job_row(job_id)["payload"] == payload
    assert Job.objects.get(pk=job_id).payload == payload


def test_the_depth_limit_counts_dicts_and_lists_alike() -> None:
    inner: dict[str, Any] = {}
    deepest = inner
    for _ in range(validation.MAX_DEPTH - 2):
        deepest = {"d": deepest}
    Job.objects.enqueue(noop, {"d": deepest})
    refused(
        InvalidPayload,
        lambda: Job.objects.enqueue(noop, {"d": {"d": deepest}}),
        "more than 100 levels",
    )


# -- options -------------------------------------------------------------------------------

BAD_OPTIONS = [
    pytest.param({"max_attempts": 2**31}, "max_attempts", id="max_attempts-2**31"),
    pytest.param({"max_attempts": 10**30}, "max_attempts", id="max_attempts-10**30"),
    pytest.param({"delay": 10**400}, "delay", id="delay-too-large-for-a-float"),
    pytest.param({"delay": -(10**400)}, "delay", id="delay-negative-huge"),
    pytest.param({"run_at": PAST_THE_END}, "run_at", id="run_at-after-year-9999-in-utc"),
    pytest.param({"run_at": BEFORE_THE_START}, "run_at", id="run_at-before-year-1-in-utc"),
]


@pytest.mark.parametrize(("options", "match"), BAD_OPTIONS)
def test_an_option_out_of_range_is_refused_before_anything_is_sent(
    options: dict[str, Any], match: str
) -> None:
    error = refused(InvalidJobOptions, lambda: Job.objects.enqueue(noop, {}, **options), match)
    assert isinstance(error, ValueError)
    refused(InvalidJobOptions, lambda: Job.objects.enqueue_many(noop, [{}], **options), match)


def test_the_largest_max_attempts_the_column_holds_is_accepted() -> None:
    job_id = Job.objects.enqueue(noop, {}, max_attempts=2**31 - 1).id
    assert job_row(job_id)["max_attempts"] == 2**31 - 1


@pytest.mark.parametrize(
    ("options", "match"),
    [
        pytest.param({"limit": 2**31}, "limit", id="limit-2**31"),
        pytest.param({"limit": 2**63}, "limit", id="limit-past-bigint"),
        pytest.param({"lease": 10**400}, "lease", id="lease-too-large-for-a-float"),
    ],
)
def test_a_claim_option_out_of_range_is_refused_before_anything_is_sent(
    options: dict[str, Any], match: str
) -> None:
    refused(InvalidJobOptions, lambda: Job.objects.claim(mode="transaction", **options), match)


def test_a_max_attempts_setting_the_column_cannot_hold_is_refused_at_enqueue() -> None:
    with override_settings(PGJOBS={"MAX_ATTEMPTS": 2**31}):
        refused(InvalidJobOptions, lambda: Job.objects.enqueue(noop), r"PGJOBS\['MAX_ATTEMPTS'\]")


def registrable() -> None:
    """A module-level function for the registration tests (never registered successfully)."""


@pytest.mark.parametrize(
    ("options", "match"),
    [
        pytest.param({"max_attempts": 2**31}, "max_attempts", id="max_attempts-2**31"),
        pytest.param({"name": 5}, "name", id="name-not-a-string"),
        pytest.param({"name": "jobs.a\x00b"}, "NUL", id="name-with-nul"),
        pytest.param({"name": "jobs.caf\udce9"}, "surrogate", id="name-with-surrogate"),
    ],
)
def test_job_options_the_table_cannot_hold_are_refused_when_registering(
    options: dict[str, Any], match: str
) -> None:
    with pytest.raises(InvalidJobOptions, match=match):
        job(**options)(registrable)


# -- results -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "match"),
    [
        pytest.param("caf\udce9", "the return value .*surrogate", id="surrogate"),
        pytest.param({"n": [10**5000]}, r"the return value\['n'\]\[0\] is an integer", id="int"),
        pytest.param(nested(5000), "the return value.* more than 100 levels", id="deep"),
    ],
)
def test_a_result_jsonb_cannot_hold_is_refused_and_the_job_stays_running(
    value: Any, match: str
) -> None:
    job_id = make_job(status="running", attempts=1, locked_until=dt.timedelta(minutes=5))
    with transaction.atomic():
        with (
            CaptureQueriesContext(connection) as sent,
            pytest.raises(InvalidResult, match=match),
        ):
            Job.objects.complete(job_id, 1, result=value)
        assert sent.captured_queries == []
        assert job_row(job_id)["status"] == "running"  # the transaction still works


@pytest.mark.parametrize(
    "backoff",
    [
        pytest.param((10, 1e300), id="cap-past-any-interval"),
        pytest.param((float("nan"), 60), id="nan-base"),
        pytest.param((120, 60), id="cap-below-base"),
    ],
)
def test_a_backoff_the_interval_cannot_hold_is_refused_and_the_job_stays_running(
    backoff: tuple[float, float],
) -> None:
    # Was a DataError ("interval out of range") from the fenced write, aborting the caller.
    job_id = make_job(status="running", attempts=1, locked_until=dt.timedelta(minutes=5))
    with transaction.atomic():
        with (
            CaptureQueriesContext(connection) as sent,
            pytest.raises(InvalidJobOptions, match="Invalid backoff"),
        ):
            Job.objects.fail(job_id, 1, "boom", backoff=backoff)
        assert sent.captured_queries == []
        assert job_row(job_id)["status"] == "running"  # the transaction still works


def test_a_prune_cutoff_the_timestamp_cannot_hold_is_refused() -> None:
    # Was a DataError ("timestamp out of range") from the prune's first batch.
    refused(
        InvalidJobOptions,
        lambda: Job.objects.prune(older_than=dt.timedelta.max),
        "Invalid older_than",
    )


# -- unique keys ---------------------------------------------------------------------------

BAD_UNIQUE_KEYS = [
    pytest.param("", r"Invalid unique_key '': use a string of 1 to 500", id="empty"),
    pytest.param("k" * 501, r"unique_key of 501 characters: use a string of 1 to 500", id="long"),
    pytest.param("a\x00b", r"unique_key 'a\\x00b': it contains a NUL", id="nul"),
    pytest.param("caf\udce9", r"unique_key .*lone surrogate", id="surrogate"),
    pytest.param(42, r"Invalid unique_key 42: use a string", id="int"),
]


@pytest.mark.parametrize(("key", "match"), BAD_UNIQUE_KEYS)
def test_a_bad_unique_key_is_refused_before_anything_is_sent(key: Any, match: str) -> None:
    refused(InvalidJobOptions, lambda: Job.objects.enqueue(noop, unique_key=key), match)


@pytest.mark.parametrize(("key", "match"), BAD_UNIQUE_KEYS)
def test_one_bad_key_from_a_callable_among_many_writes_none(key: Any, match: str) -> None:
    keys = ["fine", None, key]
    refused(
        InvalidJobOptions,
        lambda: Job.objects.enqueue_many(
            noop, [{"n": n} for n in range(3)], unique_key=lambda p: keys[p["n"]]
        ),
        match.replace("unique_key", "unique_key of testproject.testjobs.noop"),
    )


def test_the_longest_unique_key_fits_the_index() -> None:
    # 500 characters of 4 bytes each: 2,000 bytes, within a btree entry's limit.
    key = "\N{GRINNING FACE}" * 500
    job = Job.objects.enqueue(noop, unique_key=key)
    assert job_row(job.id)["id"] == job.id
    assert Job.objects.enqueue(noop, unique_key=key).id == job.id


@pytest.mark.parametrize(
    ("call", "match"),
    [
        pytest.param(
            lambda: Job.objects.enqueue(noop, unique_key="k", unique_while="forever"),
            r"Invalid unique_while 'forever': use 'queued' or 'active'",
            id="mode",
        ),
        pytest.param(
            lambda: Job.objects.enqueue(noop, unique_while="active"),
            r"unique_while 'active' for task 'testproject.testjobs.noop' without a unique key",
            id="mode-without-key",
        ),
        # A bad window with no key is reported as the missing key (the keys are checked
        # first), and the window after the time and the payloads.
        pytest.param(
            lambda: Job.objects.enqueue(noop, unique_while="bogus"),
            r"unique_while 'bogus' for task 'testproject.testjobs.noop' without a unique key",
            id="bad-mode-without-key",
        ),
        pytest.param(
            lambda: Job.objects.enqueue(noop, unique_key="k", unique_while="bogus", run_at="x"),
            r"Invalid run_at 'x'",
            id="time-before-mode",
        ),
        pytest.param(
            lambda: Job.objects.enqueue_many(noop, [{}], unique_key="k"),
            r"Invalid unique_key 'k' for enqueue_many\(\): use a callable",
            id="many-takes-a-callable",
        ),
    ],
)
def test_unique_options_are_refused_before_anything_is_sent(
    call: Callable[[], Any], match: str
) -> None:
    refused(InvalidJobOptions, call, match)
