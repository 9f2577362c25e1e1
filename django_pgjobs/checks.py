"""System checks for the PGJOBS setting and the queue's database (ids pgjobs.E001...)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

from django.conf import settings
from django.core import checks

from django_pgjobs import conf, validation
from django_pgjobs.exceptions import InvalidJobOptions


def register() -> None:
    checks.register(check_settings, checks.Tags.compatibility)
    checks.register(check_engine, checks.Tags.compatibility)
    checks.register(check_schedules, checks.Tags.compatibility)


def _number(name: str, *, minimum: float, integer: bool) -> checks.CheckMessage | None:
    value = conf.get(name)
    kinds = (int,) if integer else (int, float)
    # NaN and infinity compare as valid but cannot become a timedelta.
    if (
        isinstance(value, bool)
        or not isinstance(value, kinds)
        or not math.isfinite(value)
        or value < minimum
    ):
        kind = "a whole number" if integer else "a number of seconds"
        return checks.Error(
            f"PGJOBS[{name!r}] is {value!r}.",
            hint=f"Set it to {kind} of at least {minimum:g} (default {conf.DEFAULTS[name]!r}).",
            id="pgjobs.E002",
        )
    return None


# The retry delay is base * 2^min(attempts, 30) before the cap: keep it an interval PostgreSQL
# can hold.
MAX_BACKOFF_BASE = 86_400.0


def backoff_errors(base: object, cap: object, where: str) -> list[checks.CheckMessage]:
    """pgjobs.E009 for a backoff pair that is out of range (numbers are checked elsewhere)."""
    numbers = all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        for v in (base, cap)
    )
    if not numbers:
        return []
    assert isinstance(base, (int, float)) and isinstance(cap, (int, float))
    if base > MAX_BACKOFF_BASE or cap < base:
        return [
            checks.Error(
                f"{where} backoff is BACKOFF_BASE={base!r}, BACKOFF_MAX={cap!r}.",
                hint=f"Use 0 <= BACKOFF_BASE <= {MAX_BACKOFF_BASE:g} and BACKOFF_MAX >= "
                "BACKOFF_BASE (defaults 10 and 3600 seconds).",
                id="pgjobs.E009",
            )
        ]
    return []


class _Choice(NamedTuple):
    """A setting that takes one of a few values."""

    key: str
    allowed: tuple[object, ...]
    hint: str
    id: str


_CHOICES = (
    _Choice(
        key="MODE",
        allowed=conf.MODES,
        hint="Use 'lease' (the default) or 'transaction'.",
        id="pgjobs.E004",
    ),
    _Choice(
        key="PREPARE",
        allowed=(True, False),
        hint="Use True (the default) or False (behind a transaction-mode pooler without "
        "prepared-statement support).",
        id="pgjobs.E013",
    ),
    _Choice(
        key="NOTIFY",
        allowed=conf.NOTIFY_MODES,
        hint="Use 'auto' (the default), 'background' or 'inline'.",
        id="pgjobs.E012",
    ),
)


def check_settings(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[Any]:
    raw = conf.raw()
    if not isinstance(raw, dict):
        return [
            checks.Error(
                f"PGJOBS must be a dict, not {type(raw).__name__}.",
                hint="Write PGJOBS = {'CONCURRENCY': 4, ...} in your settings.",
                id="pgjobs.E001",
            )
        ]
    errors: list[Any] = [
        checks.Error(
            f"PGJOBS has an unknown key {key!r}.",
            hint=f"Known keys: {', '.join(sorted(conf.DEFAULTS))}.",
            id="pgjobs.E003",
        )
        for key in raw
        if key not in conf.DEFAULTS
    ]
    numbers = {
        "MAX_ATTEMPTS": (1, True),
        "CONCURRENCY": (1, True),
        "BATCH_SIZE": (1, True),
        "LEASE": (1, False),
        "POLL_INTERVAL": (0.01, False),
        "REAP_INTERVAL": (0, False),
        "SHUTDOWN_TIMEOUT": (0, False),
        "BACKOFF_BASE": (0, False),
        "BACKOFF_MAX": (0, False),
    }
    for name, (minimum, integer) in numbers.items():
        error = _number(name, minimum=minimum, integer=integer)
        if error:
            errors.append(error)
    errors.extend(backoff_errors(conf.get("BACKOFF_BASE"), conf.get("BACKOFF_MAX"), "PGJOBS"))
    for choice in _CHOICES:
        value = conf.get(choice.key)
        # The type too: 1 == True, but PREPARE = 1 is a mistake worth naming.
        if not any(value == a and type(value) is type(a) for a in choice.allowed):
            errors.append(
                checks.Error(
                    f"PGJOBS[{choice.key!r}] is {value!r}.", hint=choice.hint, id=choice.id
                )
            )
    try:
        validation.synchronous_commit(conf.get("WORKER_SYNCHRONOUS_COMMIT"))
    except InvalidJobOptions as exc:
        errors.append(
            checks.Error(
                f"PGJOBS['WORKER_SYNCHRONOUS_COMMIT']: {exc}",
                hint="'off' (the default) lets the worker's claims and outcomes commit "
                "without waiting for the WAL flush; None keeps the server's setting.",
                id="pgjobs.E011",
            )
        )
    try:
        validation.queue_name(conf.get("QUEUE"))
    except InvalidJobOptions as exc:
        errors.append(checks.Error(f"PGJOBS['QUEUE']: {exc}", id="pgjobs.E005"))
    for key in ("DATABASE", "LISTEN_DATABASE"):
        alias = conf.get(key)
        if alias is not None and alias not in settings.DATABASES:
            errors.append(
                checks.Error(
                    f"PGJOBS[{key!r}] names the database alias {alias!r}, which is not in "
                    "DATABASES.",
                    hint=f"Use one of: {', '.join(settings.DATABASES)}.",
                    id="pgjobs.E006",
                )
            )
    channel = conf.get("CHANNEL")
    if not isinstance(channel, str) or not channel or len(channel) > 63:
        errors.append(
            checks.Error(
                f"PGJOBS['CHANNEL'] is {channel!r}.",
                hint="Use a non-empty name of at most 63 characters (default 'pgjobs').",
                id="pgjobs.E007",
            )
        )
    imports = conf.get("IMPORTS")
    if not isinstance(imports, (list, tuple)) or not all(isinstance(m, str) for m in imports):
        errors.append(
            checks.Error(
                f"PGJOBS['IMPORTS'] is {imports!r}.",
                hint="Use a list of dotted module paths.",
                id="pgjobs.E008",
            )
        )
    return errors


def check_engine(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[Any]:
    errors: list[Any] = []
    for key in ("DATABASE", "LISTEN_DATABASE"):
        alias = conf.get(key)
        if not isinstance(alias, str) or alias not in settings.DATABASES:
            continue
        engine = settings.DATABASES[alias].get("ENGINE", "")
        if "postgresql" not in engine:
            errors.append(
                checks.Error(
                    f"PGJOBS[{key!r}] is the alias {alias!r}, whose ENGINE is {engine!r}.",
                    hint="django-pgjobs needs PostgreSQL: 'django.db.backends.postgresql'.",
                    id="pgjobs.E010",
                )
            )
    return errors


def check_schedules(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[Any]:
    """Every periodic schedule (``@periodic`` and ``PGJOBS["SCHEDULE"]``): ids pgjobs.E030+."""
    from django_pgjobs import schedules

    errors: list[Any] = []
    setting = conf.schedule()
    entries = setting.items() if isinstance(setting, dict) else []
    if not isinstance(setting, dict):
        errors.append(
            checks.Error(
                f"PGJOBS['SCHEDULE'] is {setting!r}.",
                hint="Use a dict: {'name': {'task': 'dotted.name', 'cron': '*/5 * * * *'}}.",
                id="pgjobs.E038",
            )
        )
    for name, entry in entries:
        if not isinstance(entry, dict):
            errors.append(
                checks.Error(
                    f"PGJOBS['SCHEDULE'][{name!r}] is {entry!r}, not a dict.",
                    hint="Use {'task': 'dotted.name', 'cron': '...'} (or 'every': seconds).",
                    id="pgjobs.E038",
                )
            )
            continue
        unknown = sorted(set(entry) - set(schedules.SETTING_KEYS))
        if unknown:
            errors.append(
                checks.Error(
                    f"PGJOBS['SCHEDULE'][{name!r}] has unknown keys {unknown}.",
                    hint=f"Known keys: {', '.join(schedules.SETTING_KEYS)}.",
                    id="pgjobs.E038",
                )
            )
    errors.extend(
        checks.Error(message, hint=hint, id=check_id)
        for check_id, message, hint in schedules.problems(schedules.declared())
    )
    return errors
