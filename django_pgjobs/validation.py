"""Checks on what callers hand us, done before anything is written."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from datetime import datetime, timedelta

from django.conf import settings
from django.utils import timezone

from django_pgjobs.exceptions import InvalidJobOptions, InvalidPayload, InvalidResult

QUEUE_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,100}")
PRIORITY_RANGE = range(-100, 101)


def queue_name(queue: object) -> str:
    if not isinstance(queue, str) or not QUEUE_NAME.fullmatch(queue):
        raise InvalidJobOptions(
            f"Invalid queue name {queue!r}: use 1-100 letters, digits, '_', '-', '.' or ':'."
        )
    return queue


def priority(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value not in PRIORITY_RANGE:
        raise InvalidJobOptions(
            f"Invalid priority {value!r}: use a whole number from -100 to 100 (larger runs first)."
        )
    return value


def max_attempts(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidJobOptions(f"Invalid max_attempts {value!r}: use a whole number of 1 or more.")
    return value


def positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidJobOptions(f"Invalid {name} {value!r}: use a whole number of 1 or more.")
    return value


# PostgreSQL's values of synchronous_commit (None: leave the session's setting alone).
SYNCHRONOUS_COMMIT = (None, "off", "local", "on", "remote_write", "remote_apply")


def synchronous_commit(value: object) -> str | None:
    if value not in SYNCHRONOUS_COMMIT:
        raise InvalidJobOptions(
            f"Invalid synchronous_commit {value!r}: use None (the server's setting) or one of "
            "'off', 'local', 'on', 'remote_write', 'remote_apply'."
        )
    return value


# Longer than any sensible delay or lease, and well inside PostgreSQL's interval range.
MAX_DURATION = timedelta(days=36_500)


def _duration(value: object) -> object:
    """Seconds as a timedelta; NaN, infinite or absurd numbers stay as they are (refused)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if math.isfinite(value) and abs(value) <= MAX_DURATION.total_seconds():
            return timedelta(seconds=value)
    return value


def positive_duration(name: str, value: object) -> timedelta:
    value = _duration(value)
    if not isinstance(value, timedelta) or not timedelta(0) < value <= MAX_DURATION:
        raise InvalidJobOptions(
            f"Invalid {name} {value!r}: use a positive timedelta or number of seconds, at "
            "most 100 years."
        )
    return value


def schedule(run_at: object, delay: object) -> tuple[datetime | None, timedelta | None]:
    """Validate ``run_at`` / ``delay``: at most one, a delay not negative, a run_at aware."""
    if run_at is not None and delay is not None:
        raise InvalidJobOptions("Pass run_at or delay, not both.")
    if delay is not None:
        delay = _duration(delay)
        if not isinstance(delay, timedelta) or not timedelta(0) <= delay <= MAX_DURATION:
            raise InvalidJobOptions(
                f"Invalid delay {delay!r}: use a timedelta or number of seconds, from 0 to "
                "100 years."
            )
        return None, delay
    if run_at is not None:
        if not isinstance(run_at, datetime):
            raise InvalidJobOptions(f"Invalid run_at {run_at!r}: use a datetime.")
        if timezone.is_naive(run_at):
            if settings.USE_TZ:
                raise InvalidJobOptions(
                    f"run_at {run_at.isoformat()} is naive while USE_TZ is on: pass an aware "
                    "datetime (django.utils.timezone.now() + ..., or make_aware())."
                )
            run_at = timezone.make_aware(run_at)
        return run_at, None
    return None, None


# One encoder for every payload and result: json.dumps with options builds a new one per call.
_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)


def payload(value: object) -> str:
    """Return the payload as JSON text, or raise ``InvalidPayload`` naming the bad key.

    jsonb refuses NaN, Infinity and the NUL character, so they are refused here, before the
    INSERT, with the path of the value that holds them.
    """
    if not isinstance(value, Mapping):
        raise InvalidPayload(
            f"The payload must be a dict of keyword arguments, not {type(value).__name__}."
        )
    value = dict(value)
    _check(value, "payload")
    return _ENCODER.encode(value)


def _check(value: object, path: str, error: type[Exception] = InvalidPayload) -> None:
    if value is None or isinstance(value, (bool, int)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise error(f"{path} is {value!r}: JSON has no NaN or Infinity.")
        return
    if isinstance(value, str):
        if "\x00" in value:
            raise error(f"{path} contains a NUL character (\\u0000), which jsonb refuses.")
        return
    # dict, not any Mapping: json.dumps cannot write other mappings.
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise error(f"{path} has a key {key!r} that is not a string.")
            if "\x00" in key:
                raise error(f"{path} has a key with a NUL character (\\u0000).")
            _check(item, f"{path}[{key!r}]", error)
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check(item, f"{path}[{index}]", error)
        return
    raise error(
        f"{path} is a {type(value).__name__} ({value!r:.60}), which JSON cannot hold: "
        "pass str, int, float, bool, None, list or dict (e.g. an id instead of an object)."
    )


def result(value: object) -> str | None:
    """A task's return value as JSON text (None stays SQL NULL), or ``InvalidResult``."""
    if value is None:
        return None
    _check(value, "the return value", InvalidResult)
    return _ENCODER.encode(value)
