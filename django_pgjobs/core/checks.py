"""System checks for the PGJOBS setting and the queue's database (ids pgjobs.E001...).

Each key is checked by its validator in ``validation.SETTINGS``, the same one ``conf`` applies
when the setting is read; a refusal becomes that setting's ``checks.Error``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.conf import settings
from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.db.utils import load_backend

from django_pgjobs.core import conf, validation
from django_pgjobs.exceptions import InvalidJobOptions


def register() -> None:
    checks.register(check_settings, checks.Tags.compatibility)
    checks.register(check_engine, checks.Tags.compatibility)
    checks.register(check_schedules, checks.Tags.compatibility)


_NUMBER = "pgjobs.E002"
# The id of each key's error, and a hint beyond what the validator's message says.
_IDS = {
    "MAX_ATTEMPTS": _NUMBER,
    "CONCURRENCY": _NUMBER,
    "ASYNC_CONCURRENCY": _NUMBER,
    "BATCH_SIZE": _NUMBER,
    "LEASE": _NUMBER,
    "POLL_INTERVAL": _NUMBER,
    "REAP_INTERVAL": _NUMBER,
    "SHUTDOWN_TIMEOUT": _NUMBER,
    "MAX_CRASHES": _NUMBER,
    "MAX_STUCK_EXECUTORS": _NUMBER,
    "BACKOFF_BASE": _NUMBER,
    "BACKOFF_MAX": _NUMBER,
    "MODE": "pgjobs.E004",
    "QUEUE": "pgjobs.E005",
    "DATABASE": "pgjobs.E006",
    "LISTEN_DATABASE": "pgjobs.E006",
    "CHANNEL": "pgjobs.E007",
    "IMPORTS": "pgjobs.E008",
    "WORKER_SYNCHRONOUS_COMMIT": "pgjobs.E011",
    "NOTIFY": "pgjobs.E012",
    "PREPARE": "pgjobs.E013",
    "CLAIM_REGISTERED_ONLY": "pgjobs.E014",
    "HEALTH_THRESHOLDS": "pgjobs.E015",
    "MONITORING_TOKEN": "pgjobs.E016",
    "COMPLETE_WITH_CLAIM": "pgjobs.E017",
}
_HINTS = {
    "MODE": "'lease' (the default) commits each claim at once; 'transaction' runs each job "
    "inside its claim's transaction.",
    "QUEUE": "The queue of jobs enqueued without one (default 'default').",
    "DATABASE": "The alias of the database that holds the jobs table (default 'default').",
    "LISTEN_DATABASE": "None (the default) listens on PGJOBS['DATABASE']'s server.",
    "CHANNEL": "The NOTIFY channel (default 'pgjobs').",
    "IMPORTS": "For example ['myproject.jobs'].",
    "WORKER_SYNCHRONOUS_COMMIT": "'off' (the default) lets the worker's claims and outcomes "
    "commit without waiting for the WAL flush; None keeps the server's setting.",
    "NOTIFY": "'auto' (the default), 'background' or 'inline'.",
    "PREPARE": "True (the default), or False behind a transaction-mode pooler without "
    "prepared-statement support.",
    "COMPLETE_WITH_CLAIM": "False (the default) writes a worker's completions apart from its "
    "claims; True writes a busy worker's completions in its next claim's statement.",
    "CLAIM_REGISTERED_ONLY": "True (the default) claims only jobs whose task the worker has "
    "registered; False claims any job.",
    "HEALTH_THRESHOLDS": "For example {'lag': 120}: the oldest ready job may wait 120 s before "
    "views.health answers 503 and jobsdoctor --watch alarms.",
    "MONITORING_TOKEN": "None (the default: staff sessions only), or a long random string "
    "such as secrets.token_urlsafe(32), read from the environment.",
}


def _hint(key: str) -> str:
    return _HINTS.get(key, f"The default is {conf.DEFAULTS[key]!r}.")


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
    for key, validate in validation.SETTINGS.items():
        try:
            validate(conf.get(key))
        except InvalidJobOptions as exc:
            errors.append(checks.Error(str(exc), hint=_hint(key), id=_IDS[key]))
    errors.extend(
        validation.backoff_errors(conf.get("BACKOFF_BASE"), conf.get("BACKOFF_MAX"), "PGJOBS")
    )
    return errors


def check_engine(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[Any]:
    """pgjobs.E010 for a queue alias whose backend is not PostgreSQL.

    The test is the backend's ``vendor``, the attribute Django's own PostgreSQL-only
    features test: a backend built on Django's PostgreSQL one (PostGIS, or a project's
    subclass) passes whatever its ENGINE is called.
    """
    errors: list[Any] = []
    for key in ("DATABASE", "LISTEN_DATABASE"):
        alias = conf.get(key)
        if not isinstance(alias, str) or alias not in settings.DATABASES:
            continue
        engine = settings.DATABASES[alias].get("ENGINE") or "django.db.backends.dummy"
        try:
            # What connections[alias] is built from; loading it opens no connection.
            vendor = load_backend(engine).DatabaseWrapper.vendor
        except (ImportError, ImproperlyConfigured, AttributeError, TypeError) as exc:
            problem = f"cannot be loaded ({exc})"
        else:
            if vendor == "postgresql":
                continue
            problem = f"is a {vendor} backend"
        errors.append(
            checks.Error(
                f"PGJOBS[{key!r}] is the alias {alias!r}, whose ENGINE {engine!r} {problem}.",
                hint="django-pgjobs needs PostgreSQL: 'django.db.backends.postgresql', or a "
                "backend built on it (such as PostGIS).",
                id="pgjobs.E010",
            )
        )
    return errors


def check_schedules(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[Any]:
    """Every periodic schedule (``@periodic`` and ``PGJOBS["SCHEDULE"]``): ids pgjobs.E030+."""
    from django_pgjobs.core import schedules

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
