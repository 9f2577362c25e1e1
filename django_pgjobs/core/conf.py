"""The only reader of settings.

Everything lives in one dict, ``settings.PGJOBS``; each key has a default and is read on access.
Each key has one validator (``validation.SETTINGS``, which ``core.validation`` hands to
``VALIDATORS`` here as it is imported): the typed readers below apply it, so a bad value raises
``InvalidJobOptions`` naming the setting wherever it is used, and ``checks.py`` applies the same
validators at start-up. A value that passed is kept until Django's ``setting_changed`` signal
reports a change of ``PGJOBS`` (``override_settings`` and pytest-django's ``settings`` send it),
so an enqueue does not validate the same settings again on every call. The reference page
``docs/reference/settings.md`` documents each one.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core.signals import setting_changed

DEFAULTS: dict[str, Any] = {
    # The database alias the queue lives in.
    "DATABASE": "default",
    # The alias whose server the LISTEN connection goes to (None: same as DATABASE). Point it
    # straight at PostgreSQL when DATABASE goes through a transaction-mode pooler.
    "LISTEN_DATABASE": None,
    # NOTIFY channel; the payload is the queue name.
    "CHANNEL": "pgjobs",
    # How an enqueue's NOTIFY is sent. "auto": in autocommit by the INSERT itself (one
    # commit), after an atomic() block commits by a background thread of the process (on its
    # own connection, coalescing). "background": always by that thread. "inline": on the
    # caller's connection right after the commit.
    "NOTIFY": "auto",
    "QUEUE": "default",
    "MAX_ATTEMPTS": 5,
    # A failed attempt n is retried BACKOFF_BASE * 2^n seconds later (20 s, 40 s, 80 s, ...),
    # never more than BACKOFF_MAX seconds later.
    "BACKOFF_BASE": 10.0,
    "BACKOFF_MAX": 3600.0,
    # Seconds a claim owns a job before the reaper may take it back.
    "LEASE": 300.0,
    "CONCURRENCY": 4,
    # async def jobs a worker runs at once on its event-loop thread, apart from CONCURRENCY.
    "ASYNC_CONCURRENCY": 100,
    "BATCH_SIZE": 10,
    # Seconds between fallback polls (and LISTEN health probes) of an idle worker.
    "POLL_INTERVAL": 10.0,
    # Seconds between in-worker reaps; 0 disables them.
    "REAP_INTERVAL": 60.0,
    "MODE": "lease",
    # synchronous_commit of a lease-mode worker's own claims and fenced writes ("off": they do
    # not wait for the WAL flush; a crash loses at most the last few, which the lease and the
    # fences recover). None keeps the server's setting. Enqueues are never affected.
    "WORKER_SYNCHRONOUS_COMMIT": "off",
    # Server-side prepared statements on a lease-mode worker's own connections. Set False
    # when DATABASE goes through a transaction-mode pooler that does not support them.
    "PREPARE": True,
    # Whether a busy lease-mode worker writes its completions in the statement of its next
    # claim (one commit where there were two: less database CPU per job, for a fleet that the
    # database's CPU limits). False: the completer writes them on its own connection, in
    # parallel with the claims (more jobs/s for one worker process on a small machine).
    "COMPLETE_WITH_CLAIM": False,
    # Whether a worker claims only jobs whose task it has registered (safe rolling deploys: an
    # old worker leaves a new task's jobs to the new workers). False: it claims any job, and
    # fails one whose task it does not know.
    "CLAIM_REGISTERED_ONLY": True,
    # Seconds a stopping worker waits for running jobs before it exits anyway.
    "SHUTDOWN_TIMEOUT": 30.0,
    # Attempts in a row that ended with the worker dying (lease expired, reaped) after which
    # a job is failed for good, however many attempts it has left.
    "MAX_CRASHES": 2,
    # Executor threads left stuck in jobs that ran past their timeout (a thread cannot be
    # killed) that a worker tolerates; one more and it stops claiming and exits non-zero.
    "MAX_STUCK_EXECUTORS": 3,
    # Extra modules to import at start-up, for @job functions outside apps' jobs/tasks modules.
    "IMPORTS": [],
    # Periodic jobs for tasks that cannot be decorated with @periodic:
    # {"name": {"task": "dotted.name", "cron": "*/5 * * * *", "kwargs": {...}}, ...}.
    "SCHEDULE": {},
    # The doctor's thresholds for views.health and jobsdoctor --watch, by name ("lag": seconds
    # the oldest ready job may wait, ...); the ones left out keep findings.Thresholds' defaults.
    "HEALTH_THRESHOLDS": {},
    # A bearer token that lets a monitoring system read views.metrics and views.health without
    # a staff session; None: staff sessions only.
    "MONITORING_TOKEN": None,
}

MODES = ("lease", "transaction")

# The validator of each key, and BACKOFF, the rule of the (BACKOFF_BASE, BACKOFF_MAX) pair.
# conf sits below every other module and imports none of the app: core.validation registers
# them here as it is imported, which the package's __init__ does (through the registry) before
# any setting can be read.
VALIDATORS: dict[str, Callable[[Any], Any]] = {}


def raw() -> object:
    """``settings.PGJOBS`` as written (the checks report it if it is not a dict)."""
    return getattr(settings, "PGJOBS", {})


def _user_settings() -> dict[str, Any]:
    value = raw()
    return value if isinstance(value, dict) else {}


def get(name: str) -> Any:
    """One setting's value as written: the user's if set, else the default (not validated)."""
    return _user_settings().get(name, DEFAULTS[name])


# The values value() has validated, by setting name; replaced by an empty dict when PGJOBS
# changes (a read that started before the change stores into the dict it started with, which
# is then unused). A bad value is never kept: it raises again at every read.
_validated: dict[str, Any] = {}


def value(name: str) -> Any:
    """One setting's value, validated: ``InvalidJobOptions`` names the setting if it is bad."""
    validated = _validated
    try:
        return validated[name]
    except KeyError:
        checked = validated[name] = VALIDATORS[name](get(name))
        return checked


def _forget_validated(*, setting: str, **kwargs: Any) -> None:
    global _validated
    if setting == "PGJOBS":
        _validated = {}


setting_changed.connect(_forget_validated, dispatch_uid="django_pgjobs.core.conf")


def database() -> str:
    return str(value("DATABASE"))


def listen_database() -> str | None:
    alias: str | None = value("LISTEN_DATABASE")
    return alias


def channel() -> str:
    # Read as written: a NOTIFY is only a hint, and one the server refuses after a commit is
    # logged, never raised at the caller. The system check (pgjobs.E007) reports a bad one.
    return str(get("CHANNEL"))


def default_queue() -> str:
    return str(value("QUEUE"))


def max_attempts() -> int:
    return int(value("MAX_ATTEMPTS"))


def backoff() -> tuple[float, float]:
    """(base, cap) in seconds of the retry delay after a failed attempt."""
    pair: tuple[float, float] = VALIDATORS["BACKOFF"]((value("BACKOFF_BASE"), value("BACKOFF_MAX")))
    return pair


def lease() -> timedelta:
    return timedelta(seconds=value("LEASE"))


def concurrency() -> int:
    return int(value("CONCURRENCY"))


def async_concurrency() -> int:
    return int(value("ASYNC_CONCURRENCY"))


def batch_size() -> int:
    return int(value("BATCH_SIZE"))


def poll_interval() -> float:
    return float(value("POLL_INTERVAL"))


def reap_interval() -> float:
    return float(value("REAP_INTERVAL"))


def mode() -> str:
    return str(value("MODE"))


def notify() -> str:
    return str(value("NOTIFY"))


def shutdown_timeout() -> float:
    return float(value("SHUTDOWN_TIMEOUT"))


def max_crashes() -> int:
    return int(value("MAX_CRASHES"))


def max_stuck_executors() -> int:
    return int(value("MAX_STUCK_EXECUTORS"))


def worker_synchronous_commit() -> str | None:
    commit: str | None = value("WORKER_SYNCHRONOUS_COMMIT")
    return commit


def prepare() -> bool:
    return bool(value("PREPARE"))


def complete_with_claim() -> bool:
    return bool(value("COMPLETE_WITH_CLAIM"))


def claim_registered_only() -> bool:
    return bool(value("CLAIM_REGISTERED_ONLY"))


def imports() -> list[str]:
    modules: list[str] = value("IMPORTS")
    return modules


def schedule() -> object:
    """``PGJOBS["SCHEDULE"]`` as written (the checks report a bad shape)."""
    return get("SCHEDULE")


def health_thresholds() -> dict[str, Any]:
    """The thresholds set, by ``findings.Thresholds`` field name (seconds; ``slot_age`` an int)."""
    thresholds: dict[str, Any] = value("HEALTH_THRESHOLDS")
    return thresholds


def monitoring_token() -> str | None:
    token: str | None = value("MONITORING_TOKEN")
    return token
