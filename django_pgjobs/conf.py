"""The only reader of settings.

Everything lives in one dict, ``settings.PGJOBS``; each key has a default and is read on
access, so ``override_settings`` works. ``checks.py`` validates the values; the reference page
``docs/reference/settings.md`` documents each one.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings

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
    # Seconds a stopping worker waits for running jobs before it exits anyway.
    "SHUTDOWN_TIMEOUT": 30.0,
    # Extra modules to import at start-up, for @job functions outside apps' jobs/tasks modules.
    "IMPORTS": [],
    # Periodic jobs for tasks that cannot be decorated with @periodic:
    # {"name": {"task": "dotted.name", "cron": "*/5 * * * *", "kwargs": {...}}, ...}.
    "SCHEDULE": {},
}

MODES = ("lease", "transaction")
NOTIFY_MODES = ("auto", "background", "inline")


def raw() -> object:
    """``settings.PGJOBS`` as written (the checks report it if it is not a dict)."""
    return getattr(settings, "PGJOBS", {})


def _user_settings() -> dict[str, Any]:
    value = raw()
    return value if isinstance(value, dict) else {}


def get(name: str) -> Any:
    """One setting's value: the user's if set, else the default."""
    return _user_settings().get(name, DEFAULTS[name])


def database() -> str:
    return str(get("DATABASE"))


def channel() -> str:
    return str(get("CHANNEL"))


def default_queue() -> str:
    return str(get("QUEUE"))


def max_attempts() -> int:
    return int(get("MAX_ATTEMPTS"))


def backoff() -> tuple[float, float]:
    """(base, cap) in seconds of the retry delay after a failed attempt."""
    return float(get("BACKOFF_BASE")), float(get("BACKOFF_MAX"))


def lease() -> timedelta:
    return timedelta(seconds=float(get("LEASE")))


def concurrency() -> int:
    return int(get("CONCURRENCY"))


def batch_size() -> int:
    return int(get("BATCH_SIZE"))


def poll_interval() -> float:
    return float(get("POLL_INTERVAL"))


def reap_interval() -> float:
    return float(get("REAP_INTERVAL"))


def mode() -> str:
    return str(get("MODE"))


def shutdown_timeout() -> float:
    return float(get("SHUTDOWN_TIMEOUT"))


def worker_synchronous_commit() -> str | None:
    value = get("WORKER_SYNCHRONOUS_COMMIT")
    return None if value is None else str(value)


def prepare() -> bool:
    return bool(get("PREPARE"))


def schedule() -> object:
    """``PGJOBS["SCHEDULE"]`` as written (the checks report a bad shape)."""
    return get("SCHEDULE")
