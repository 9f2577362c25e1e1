"""Checks on what callers hand us, done before anything is written.

Each value has one validator here, which returns the value (normalized) or raises
``InvalidJobOptions`` / ``InvalidPayload`` naming it. The enqueue, the claim and the worker
call them for their arguments; ``SETTINGS`` holds the validator of each ``PGJOBS`` key, which
``conf`` applies when a setting is read and the system checks apply at start-up. Nothing
here touches the database: a refusal never reaches PostgreSQL, so it never aborts the
caller's transaction.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from typing import Any, TypeAlias

from django.conf import settings
from django.core import checks as django_checks
from django.utils import timezone

from django_pgjobs.core.conf import MODES, VALIDATORS
from django_pgjobs.exceptions import InvalidJobOptions, InvalidPayload, InvalidResult

# A queue name: 1 to QUEUE_NAME_MAX of these characters. The table's CHECK says the same as
# a repeated class and a length (models.Job): PostgreSQL's regex engine spends ten times as
# long on a bounded repeat, on every INSERT and UPDATE of a job.
QUEUE_NAME_CHAR = "[A-Za-z0-9_.:-]"
QUEUE_NAME_MAX = 100
QUEUE_NAME = re.compile(f"{QUEUE_NAME_CHAR}{{1,{QUEUE_NAME_MAX}}}")
PRIORITY_RANGE = range(-100, 101)
# The largest value of a PostgreSQL integer column (max_attempts, attempts).
MAX_WHOLE = 2**31 - 1
# Longer than any sensible delay, lease or interval, and well inside PostgreSQL's interval
# range (and threading's longest wait).
MAX_DURATION = timedelta(days=36_500)
MAX_SECONDS = MAX_DURATION.total_seconds()
# The retry delay is base * 2^min(attempts, 30) before the cap: keep it an interval
# PostgreSQL can hold.
MAX_BACKOFF_BASE = 86_400.0
# How deep dicts and lists may nest in a payload or a result, the payload itself being the
# first level. Deeper data is almost always a mistake (an object graph, a structure that
# contains itself), and Python's JSON encoder and decoder recurse once per level.
MAX_DEPTH = 100
# The longest integer a payload may hold: Python's default limit for converting an int to
# text and back (sys.get_int_max_str_digits()), so the worker can always decode the payload.
MAX_INT_DIGITS = 4300
_INT_LIMIT = 10**MAX_INT_DIGITS
_NEGATIVE_INT_LIMIT = -_INT_LIMIT
_WORD = 2**63
# PostgreSQL truncates identifiers (the NOTIFY channel) to 63 bytes and refuses longer ones.
MAX_CHANNEL_BYTES = 63

# The longest unique key, in characters. A btree entry must fit in a third of a page (2,704
# bytes with 8 kB pages) or the INSERT fails; 500 characters are at most 2,000 bytes of UTF-8,
# so a key that passes here always fits in pgjobs_job_unique_idx.
MAX_UNIQUE_KEY = 500
# A rate limit keeps one start time per start in its window, rewritten by every guarded claim:
# beyond this many the array costs more than the limit is worth (use a concurrency limit).
MAX_RATE_COUNT = 10_000

# How long a unique job keeps a second enqueue of its key out: while queued, or while queued
# or running.
UNIQUE_WHILE = ("queued", "active")
NOTIFY_MODES = ("auto", "background", "inline")
# PostgreSQL's values of synchronous_commit (None: leave the session's setting alone).
SYNCHRONOUS_COMMIT = (None, "off", "local", "on", "remote_write", "remote_apply")


def show(value: object) -> str:
    """A short repr for a message; an integer too long to print is described instead."""
    if isinstance(value, int) and not _NEGATIVE_INT_LIMIT < value < _INT_LIMIT:
        return f"(an integer of {_digits(value)} digits)"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _digits(value: int) -> int:
    """The number of decimal digits of ``value``, without converting it to text."""
    number = abs(value)
    digits = int((number.bit_length() - 1) * math.log10(2)) + 1
    return digits + 1 if number >= 10**digits else digits


# -- options -------------------------------------------------------------------------------


def whole_number(name: str, value: object, *, minimum: int = 1, maximum: int = MAX_WHOLE) -> int:
    """An int (not a bool) from ``minimum`` to ``maximum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidJobOptions(
            f"Invalid {name} {show(value)}: use a whole number of {minimum} or more."
        )
    if value > maximum:
        column = " (the largest a PostgreSQL integer holds)" if maximum == MAX_WHOLE else ""
        raise InvalidJobOptions(
            f"Invalid {name} {show(value)}: use a whole number of at most {maximum}{column}."
        )
    return value


def positive_int(name: str, value: object) -> int:
    """A whole number of 1 or more that a PostgreSQL integer holds (limits, batch sizes)."""
    return whole_number(name, value)


def max_attempts(value: object, name: str = "max_attempts") -> int:
    return whole_number(name, value)


def priority(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value not in PRIORITY_RANGE:
        raise InvalidJobOptions(
            f"Invalid priority {show(value)}: use a whole number from -100 to 100 (larger "
            "runs first)."
        )
    return value


def seconds(
    name: str,
    value: object,
    *,
    minimum: float = 0.0,
    strict: bool = False,
    maximum: float = MAX_SECONDS,
) -> float:
    """A number of seconds (or a timedelta) from ``minimum`` (excluded if ``strict``) to
    ``maximum``, as a float. NaN, infinities and integers too large for a float are refused."""
    number = value.total_seconds() if isinstance(value, timedelta) else value
    # int and float compare exactly in Python, however large the int; NaN compares false.
    if (
        isinstance(number, bool)
        or not isinstance(number, (int, float))
        or not (minimum < number if strict else minimum <= number)
        or not number <= maximum
    ):
        low = f"more than {minimum:g}" if strict else f"at least {minimum:g}"
        high = "100 years" if maximum == MAX_SECONDS else f"{maximum:g} s"
        raise InvalidJobOptions(
            f"Invalid {name} {show(value)}: use a number of seconds or a timedelta, {low} "
            f"and at most {high}."
        )
    return float(number)


def duration(name: str, value: object, *, minimum: float = 0.0, strict: bool = False) -> timedelta:
    """``seconds()``, as a timedelta (a timedelta passed in is returned as it is)."""
    number = seconds(name, value, minimum=minimum, strict=strict)
    return value if isinstance(value, timedelta) else timedelta(seconds=number)


def positive_duration(name: str, value: object) -> timedelta:
    """A timedelta or number of seconds above 0 and at most 100 years (leases)."""
    return duration(name, value, strict=True)


def choice(name: str, value: object, allowed: tuple[object, ...]) -> Any:
    """One of ``allowed``, of the same type too: 1 == True, but PREPARE = 1 is a mistake."""
    if not any(value == a and type(value) is type(a) for a in allowed):
        raise InvalidJobOptions(
            f"Invalid {name} {show(value)}: use {' or '.join(repr(a) for a in allowed)}."
        )
    return value


def mode(value: object, name: str = "mode") -> str:
    return str(choice(name, value, MODES))


def synchronous_commit(value: object, name: str = "synchronous_commit") -> str | None:
    if value not in SYNCHRONOUS_COMMIT:
        raise InvalidJobOptions(
            f"Invalid {name} {show(value)}: use None (the server's setting) or one of "
            "'off', 'local', 'on', 'remote_write', 'remote_apply'."
        )
    return None if value is None else str(value)


def backoff(base: object, cap: object, name: str = "backoff") -> tuple[float, float]:
    """A retry delay ``(base, cap)`` in seconds: after attempt n, base * 2^n, at most cap."""
    base_s = seconds(f"{name} base", base)
    cap_s = seconds(f"{name} cap", cap)
    if base_s > MAX_BACKOFF_BASE or cap_s < base_s:
        raise InvalidJobOptions(
            f"Invalid {name} (base {base_s:g} s, cap {cap_s:g} s): use a base from 0 to "
            f"{MAX_BACKOFF_BASE:g} seconds and a cap no smaller than the base."
        )
    return base_s, cap_s


def timeout(value: object, name: str = "timeout") -> timedelta | None:
    """How long one attempt may run: None (no limit), or seconds / a timedelta above 0."""
    return None if value is None else duration(name, value, strict=True)


def exception_types(value: object, name: str) -> tuple[type[BaseException], ...]:
    """An exception class or a tuple of them (``retry_on``, ``discard_on``)."""
    items = value if isinstance(value, (tuple, list)) else (value,)
    if not items or not all(
        isinstance(item, type) and issubclass(item, BaseException) for item in items
    ):
        raise InvalidJobOptions(
            f"Invalid {name} {show(value)}: use an exception class or a tuple of them."
        )
    return tuple(items)


def retry_backoff(value: object, name: str = "backoff") -> Any:
    """``(base, cap)`` seconds, or a callable ``(attempt, exception) -> timedelta``."""
    if callable(value):
        return value
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise InvalidJobOptions(
            f"Invalid {name} {show(value)}: use (base, cap) in seconds, or a callable "
            "(attempt, exception) -> timedelta."
        )
    return backoff(value[0], value[1], name)


def rate(value: object, name: str = "rate") -> tuple[int, timedelta] | None:
    """A rate limit: ``(count, period)``, at most ``count`` starts in any ``period`` (a
    timedelta or seconds above 0); ``None`` for none."""
    if value is None:
        return None
    if not isinstance(value, tuple) or len(value) != 2:
        raise InvalidJobOptions(
            f"Invalid {name} {show(value)}: use (count, period), such as "
            "(50, timedelta(seconds=1)) for at most 50 starts in any second, or None."
        )
    return (
        whole_number(f"{name} count", value[0], maximum=MAX_RATE_COUNT),
        positive_duration(f"{name} period", value[1]),
    )


def unique_while(value: object, name: str = "unique_while") -> str:
    return str(choice(name, value, UNIQUE_WHILE))


def unique_key(value: object, name: str = "unique_key") -> str:
    """A de-duplication key: 1 to 500 characters of text PostgreSQL can store."""
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_UNIQUE_KEY:
        shown = f"of {len(value)} characters" if isinstance(value, str) and value else show(value)
        raise InvalidJobOptions(
            f"Invalid {name} {shown}: use a string of 1 to {MAX_UNIQUE_KEY} characters, "
            "such as 'invoice:42' (or None for no key)."
        )
    if not value.strip():
        raise InvalidJobOptions(
            f"Invalid {name} {value!r}: it is only whitespace; use a key that names something, "
            "such as 'invoice:42' (or None for no key)."
        )
    problem = _text_problem(value)
    if problem:
        raise InvalidJobOptions(f"Invalid {name} {value!r}: it {problem}.")
    return value


def _text_problem(value: str) -> str | None:
    """What PostgreSQL's text and jsonb cannot store in ``value`` (NUL, lone surrogates)."""
    if "\x00" in value:
        return "contains a NUL character (\\u0000), which PostgreSQL refuses"
    # Most text is ASCII: the UTF-8 encoding (which finds surrogates) is only tried on the rest.
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return (
                f"contains a lone surrogate ({value[exc.start]!r} at index {exc.start}), which "
                "is not valid UTF-8 and which PostgreSQL refuses: decode bytes with "
                "errors='replace', or drop the character"
            )
    return None


def queue_name(queue: object, name: str = "queue name") -> str:
    if not isinstance(queue, str) or not QUEUE_NAME.fullmatch(queue):
        raise InvalidJobOptions(
            f"Invalid {name} {show(queue)}: use 1-100 letters, digits, '_', '-', '.' or ':'."
        )
    return queue


def queue_limits(value: object) -> dict[str, int | None]:
    """A worker's queues, each with its own slot limit or ``None`` (the shared concurrency):
    from names, ``"NAME=N"`` strings, or a mapping of names to N or ``None``."""
    items: list[tuple[object, object]] = []
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, (list, tuple)):
        for entry in value:
            if isinstance(entry, str) and "=" in entry:
                name, _, number = entry.partition("=")
                if not number.strip().isdigit():
                    raise InvalidJobOptions(
                        f"Invalid queue {entry!r}: use NAME or NAME=N, where N is a whole number "
                        "of 1 or more (the most of that queue's jobs this worker runs at once)."
                    )
                items.append((name, int(number)))
            else:
                items.append((entry, None))
    else:
        raise InvalidJobOptions(
            f"Invalid queues {show(value)}: use a list of queue names (NAME or NAME=N), or a "
            "mapping of names to their limit in this worker."
        )
    limits: dict[str, int | None] = {}
    for given, limit in items:
        queue = queue_name(given)
        if queue in limits:
            raise InvalidJobOptions(f"Queue {queue!r} is given twice: give each queue once.")
        limits[queue] = None if limit is None else positive_int(f"limit of queue {queue}", limit)
    if not limits:
        raise InvalidJobOptions("No queues given: name at least one queue.")
    return limits


def task_name(value: object, name: str = "task name") -> str:
    """A name to register a job function under: non-empty text PostgreSQL can store."""
    if not isinstance(value, str) or not value:
        raise InvalidJobOptions(
            f"Invalid {name} {show(value)}: use a non-empty string, such as 'app.jobs.send'."
        )
    problem = _text_problem(value)
    if problem:
        raise InvalidJobOptions(f"Invalid {name} {value!r}: it {problem}.")
    return value


def schedule(run_at: object, delay: object) -> tuple[datetime | None, timedelta | None]:
    """Validate ``run_at`` / ``delay``: at most one, a delay not negative, a run_at aware."""
    if run_at is not None and delay is not None:
        raise InvalidJobOptions("Pass run_at or delay, not both.")
    if delay is not None:
        return None, duration("delay", delay)
    if run_at is not None:
        if not isinstance(run_at, datetime):
            raise InvalidJobOptions(f"Invalid run_at {show(run_at)}: use a datetime.")
        if timezone.is_naive(run_at):
            if settings.USE_TZ:
                raise InvalidJobOptions(
                    f"run_at {run_at.isoformat()} is naive while USE_TZ is on: pass an aware "
                    "datetime (django.utils.timezone.now() + ..., or make_aware())."
                )
            run_at = timezone.make_aware(run_at)
        try:
            # The job's times are read back in UTC: the instant must exist there.
            run_at.astimezone(dt_timezone.utc)
        except (OverflowError, ValueError):
            raise InvalidJobOptions(
                f"Invalid run_at {run_at.isoformat()}: in UTC it falls outside the years "
                "1-9999 a datetime can hold."
            ) from None
        return run_at, None
    return None, None


# -- settings ------------------------------------------------------------------------------


def alias(value: object, name: str, *, optional: bool = False) -> str | None:
    """A database alias named in ``DATABASES`` (or None, when ``optional``)."""
    if value is None and optional:
        return None
    if not isinstance(value, str) or value not in settings.DATABASES:
        raise InvalidJobOptions(
            f"Invalid {name} {show(value)}: it is not an alias in DATABASES (use one of: "
            f"{', '.join(settings.DATABASES)})."
        )
    return value


def channel(value: object, name: str = "channel") -> str:
    """A NOTIFY channel: PostgreSQL identifiers are at most 63 bytes of UTF-8, without NUL."""
    if isinstance(value, str) and value and "\x00" not in value:
        try:
            if len(value.encode("utf-8")) <= MAX_CHANNEL_BYTES:
                return value
        except UnicodeEncodeError:
            pass
    raise InvalidJobOptions(
        f"Invalid {name} {show(value)}: use a non-empty name of at most "
        f"{MAX_CHANNEL_BYTES} bytes in UTF-8 (63 ASCII characters), without NUL."
    )


def imports(value: object, name: str = "imports") -> list[str]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(m, str) for m in value):
        raise InvalidJobOptions(f"Invalid {name} {show(value)}: use a list of dotted module paths.")
    return list(value)


# The thresholds of findings.Thresholds that PGJOBS["HEALTH_THRESHOLDS"] may set (a test keeps
# the two in step): seconds, but ``slot_age`` counts transactions.
HEALTH_THRESHOLDS = ("idle", "transaction", "lag", "slot_age", "naptimes")
# The shortest PGJOBS["MONITORING_TOKEN"]: a bearer token is a password sent on every scrape.
MIN_TOKEN_LENGTH = 16


def health_thresholds(value: object, name: str = "health thresholds") -> dict[str, float]:
    """The doctor's thresholds a project sets for ``views.health`` and ``jobsdoctor --watch``:
    a dict of known names to numbers, 0 or more (``slot_age`` a whole number)."""
    if not isinstance(value, Mapping):
        raise InvalidJobOptions(f"Invalid {name} {show(value)}: use a dict such as {{'lag': 300}}.")
    found: dict[str, float] = {}
    for key, number in value.items():
        if key not in HEALTH_THRESHOLDS:
            raise InvalidJobOptions(
                f"Invalid {name}: unknown threshold {show(key)}; known ones are "
                f"{', '.join(HEALTH_THRESHOLDS)}."
            )
        where = f"{name}[{key!r}]"
        if key == "slot_age":
            found[key] = whole_number(where, number, minimum=0, maximum=2**63 - 1)
        else:
            found[key] = seconds(where, number)
    return found


def monitoring_token(value: object, name: str = "monitoring token") -> str | None:
    """None (only staff sessions may read the monitoring views), or a bearer token of at least
    ``MIN_TOKEN_LENGTH`` printable ASCII characters (it travels in an HTTP header)."""
    if value is None:
        return None
    if (
        not isinstance(value, str)
        or len(value) < MIN_TOKEN_LENGTH
        or not all("!" <= c <= "~" for c in value)
    ):
        raise InvalidJobOptions(
            f"Invalid {name}: use None or a string of at least {MIN_TOKEN_LENGTH} printable "
            "ASCII characters without spaces (for example secrets.token_urlsafe(32))."
        )
    return value


def _setting(key: str) -> str:
    return f"PGJOBS[{key!r}]"


def _whole(key: str) -> Callable[[object], int]:
    return lambda value: whole_number(_setting(key), value)


def _seconds(key: str, minimum: float) -> Callable[[object], float]:
    return lambda value: seconds(_setting(key), value, minimum=minimum)


# The validator of each PGJOBS key: it returns the value, normalized, or raises
# InvalidJobOptions naming the setting. The BACKOFF_BASE / BACKOFF_MAX pair has a further
# rule of its own: backoff().
SETTINGS: dict[str, Callable[[object], Any]] = {
    "DATABASE": lambda value: alias(value, _setting("DATABASE")),
    "LISTEN_DATABASE": lambda value: alias(value, _setting("LISTEN_DATABASE"), optional=True),
    "CHANNEL": lambda value: channel(value, _setting("CHANNEL")),
    "NOTIFY": lambda value: choice(_setting("NOTIFY"), value, NOTIFY_MODES),
    "QUEUE": lambda value: queue_name(value, _setting("QUEUE")),
    "MAX_ATTEMPTS": _whole("MAX_ATTEMPTS"),
    "BACKOFF_BASE": _seconds("BACKOFF_BASE", 0),
    "BACKOFF_MAX": _seconds("BACKOFF_MAX", 0),
    "LEASE": _seconds("LEASE", 1),
    "CONCURRENCY": _whole("CONCURRENCY"),
    "ASYNC_CONCURRENCY": _whole("ASYNC_CONCURRENCY"),
    "BATCH_SIZE": _whole("BATCH_SIZE"),
    "POLL_INTERVAL": _seconds("POLL_INTERVAL", 0.01),
    "REAP_INTERVAL": _seconds("REAP_INTERVAL", 0),
    "MODE": lambda value: mode(value, _setting("MODE")),
    "WORKER_SYNCHRONOUS_COMMIT": lambda value: synchronous_commit(
        value, _setting("WORKER_SYNCHRONOUS_COMMIT")
    ),
    "PREPARE": lambda value: choice(_setting("PREPARE"), value, (True, False)),
    "COMPLETE_WITH_CLAIM": lambda value: choice(
        _setting("COMPLETE_WITH_CLAIM"), value, (True, False)
    ),
    "CLAIM_REGISTERED_ONLY": lambda value: choice(
        _setting("CLAIM_REGISTERED_ONLY"), value, (True, False)
    ),
    "SHUTDOWN_TIMEOUT": _seconds("SHUTDOWN_TIMEOUT", 0),
    "MAX_CRASHES": _whole("MAX_CRASHES"),
    "MAX_STUCK_EXECUTORS": _whole("MAX_STUCK_EXECUTORS"),
    "IMPORTS": lambda value: imports(value, _setting("IMPORTS")),
    "HEALTH_THRESHOLDS": lambda value: health_thresholds(value, _setting("HEALTH_THRESHOLDS")),
    "MONITORING_TOKEN": lambda value: monitoring_token(value, _setting("MONITORING_TOKEN")),
}


# conf applies them when a setting is read (conf imports nothing of the app: they are handed
# to it here).
VALIDATORS.update(SETTINGS)
VALIDATORS["BACKOFF"] = lambda pair: backoff(
    pair[0], pair[1], "PGJOBS['BACKOFF_BASE'] / ['BACKOFF_MAX']"
)


# -- payloads and results ------------------------------------------------------------------

# One encoder for every payload and result: json.dumps with options builds a new one per call.
_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)

# Where a value sits, built only when an error must name it: (parent, key) pairs down from
# the root's name ("payload", "the return value").
_Where: TypeAlias = "tuple[Any, object] | str"


def _path(where: _Where) -> str:
    keys: list[object] = []
    while isinstance(where, tuple):
        where, key = where
        keys.append(key)
    return where + "".join(f"[{key!r}]" for key in reversed(keys))


def payload(value: object) -> str:
    """Return the payload as JSON text, or raise ``InvalidPayload`` naming the bad value."""
    return encode(checked_payload(value))


def checked_payload(value: object) -> dict[str, Any]:
    """Return the payload as a new dict, or raise ``InvalidPayload`` naming the bad value.

    Refused here, before the INSERT, with the path of the value: what JSON cannot hold,
    what jsonb refuses (NaN, Infinity, NUL, lone surrogates), integers of more than
    ``MAX_INT_DIGITS`` digits, and dicts and lists nested more than ``MAX_DEPTH`` deep.
    """
    # type() first: isinstance() against the Mapping ABC is the slow test of a plain dict.
    if type(value) is not dict and not isinstance(value, Mapping):
        raise InvalidPayload(
            f"The payload must be a dict of keyword arguments, not {type(value).__name__}."
        )
    value = dict(value)
    _check_items(value, "payload", InvalidPayload, 1)
    return value


def encode(value: object) -> str:
    """JSON text of checked values. The encoder sets itself up at every call, so a list of
    payloads is encoded in one call (a third of the time of one call per payload)."""
    return _ENCODER.encode(value)


def _check(value: object, where: _Where, error: type[Exception], depth: int) -> None:
    if value is None or value is True or value is False:
        return
    if isinstance(value, int):
        if not _NEGATIVE_INT_LIMIT < value < _INT_LIMIT:
            raise error(
                f"{_path(where)} is an integer of {_digits(value)} digits: at most "
                f"{MAX_INT_DIGITS} digits can be stored and read back (pass it as a string)."
            )
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise error(f"{_path(where)} is {value!r}: JSON has no NaN or Infinity.")
        return
    if isinstance(value, str):
        problem = _text_problem(value)
        if problem:
            raise error(f"{_path(where)} {problem}.")
        return
    if isinstance(value, (dict, list, tuple)) and depth > MAX_DEPTH:
        raise error(
            f"{_path(where)} is nested more than {MAX_DEPTH} levels deep (or contains "
            "itself): pass flatter data, such as ids to look up."
        )
    # dict, not any Mapping: json.dumps cannot write other mappings.
    if isinstance(value, dict):
        _check_items(value, where, error, depth)
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check(item, (where, index), error, depth + 1)
        return
    raise error(
        f"{_path(where)} is a {type(value).__name__} ({show(value):.60}), which JSON cannot "
        "hold: pass str, int, float, bool, None, list or dict (e.g. an id instead of an object)."
    )


def _check_items(value: dict[Any, Any], where: _Where, error: type[Exception], depth: int) -> None:
    """``_check`` of a dict's keys and items (the dict itself is at ``depth``)."""
    for key, item in value.items():
        if not isinstance(key, str):
            raise error(f"{_path(where)} has a key {show(key)} that is not a string.")
        if "\x00" in key or not key.isascii():
            problem = _text_problem(key)
            if problem:
                raise error(f"{_path(where)} has a key {key!r} that {problem}.")
        # The common items, ASCII text and integers of a machine word, are passed here
        # without a call: most payloads are a handful of ids and names.
        kind = type(item)
        if kind is str and "\x00" not in item and item.isascii():
            continue
        if kind is int and -_WORD < item < _WORD:
            continue
        _check(item, (where, key), error, depth + 1)


def result(value: object) -> str | None:
    """A task's return value as JSON text (None stays SQL NULL), or ``InvalidResult``."""
    if value is None:
        return None
    _check(value, "the return value", InvalidResult, 1)
    return _ENCODER.encode(value)


def backoff_errors(base: object, cap: object, where: str) -> list[django_checks.CheckMessage]:
    """pgjobs.E009 for a backoff pair whose base and cap are numbers but out of range (the
    settings' and a django.tasks backend's checks).

    Values that are not numbers of seconds at all are left to their own checks.
    """
    try:
        seconds("base", base)
        seconds("cap", cap)
    except InvalidJobOptions:
        return []
    try:
        backoff(base, cap)
    except InvalidJobOptions as exc:
        return [
            django_checks.Error(
                f"{where} backoff is BACKOFF_BASE={base!r}, BACKOFF_MAX={cap!r}.",
                hint=f"{exc} (Defaults: 10 and 3600 seconds.)",
                id="pgjobs.E009",
            )
        ]
    return []
