"""What the lifecycle statements take and return, shared by ``Job.objects`` and the worker."""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, NamedTuple

from django_pgjobs.exceptions import InvalidJobOptions

# last_error keeps the end of very long errors (tracebacks end with what matters).
ERROR_LIMIT = 8000


@dataclass(frozen=True)
class ClaimedJob:
    """A job this worker now owns: pass it back to ``complete``/``fail``/``release``.

    ``payload`` holds the keyword arguments; a row whose payload is not a JSON object (only
    possible in a table older than its payload check, or written while its trigger was off)
    keeps ``payload`` empty and says what it found in ``invalid_payload``: the worker fails
    that job, and only that one.
    """

    id: int
    queue: str
    task: str
    payload: dict[str, Any]
    attempts: int
    max_attempts: int
    # When this claim was made (the row's attempted_at): every fenced write checks it too, so
    # a write retried after a lost acknowledgement cannot touch a later claim of the job.
    claimed_at: datetime | None = None
    # How often this job was given back because the queue's database was away.
    outage_releases: int = 0
    invalid_payload: str | None = None
    # A periodic job's schedule and the tick it serves (None for any other job).
    schedule: str | None = None
    scheduled_at: datetime | None = None
    # Attempts in a row before this one that ended with their worker dead.
    crashes: int = 0
    # Seconds this attempt may run (None: no limit).
    timeout: float | None = None
    # Claimed by the guarded claim (its queue has a limit, or ready jobs with lock keys): once
    # it no longer runs, a worker waiting on that limit or key may start the next
    # (``wake_freed``).
    guarded: bool = False


@dataclass(frozen=True)
class Failure:
    """One failed attempt, as django.tasks' ``TaskError`` holds it."""

    exception_class_path: str
    traceback: str

    @classmethod
    def from_exception(cls, exc: BaseException) -> Failure:
        kind = type(exc)
        return cls(
            f"{kind.__module__}.{kind.__qualname__}", "".join(traceback.format_exception(exc))
        )

    @classmethod
    def of(cls, error: str | BaseException | Failure) -> Failure:
        if isinstance(error, Failure):
            return error
        if isinstance(error, BaseException):
            return cls.from_exception(error)
        return cls("builtins.Exception", str(error))

    @property
    def summary(self) -> str:
        """The traceback's last line: the exception and its message."""
        return last_line(self.traceback)


def last_line(error: str) -> str:
    """The last non-blank line of an error text (a traceback ends with what went wrong)."""
    text = error.strip()
    return text.splitlines()[-1] if text else "error"


def reason(exc: BaseException) -> str:
    """The first line of an exception's message (a connection error's is the one that
    matters), or its class name when it has none."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class Reaped(NamedTuple):
    id: int
    status: str
    attempts: int


# A claim to fence on: a ClaimedJob, or (id, attempts[, claimed_at]).
Claim = ClaimedJob | tuple[int, int] | tuple[int, int, datetime | None]


def default_worker_id() -> str:
    """``host:pid``, recorded in ``worker_ids`` for each attempt this process claims."""
    return f"{socket.gethostname()}:{os.getpid()}"


def clean_error(error: str) -> str:
    """Error text PostgreSQL can store, at most ``ERROR_LIMIT`` characters (the tail)."""
    # PostgreSQL text holds neither NUL nor lone surrogates (an undecodable file name in a
    # message); keep the tail, where a traceback says what went wrong.
    error = str(error).replace("\x00", "\\x00")
    error = error.encode("utf-8", "backslashreplace").decode("utf-8")
    return error if len(error) <= ERROR_LIMIT else "..." + error[-ERROR_LIMIT:]


def fence_of(job: Claim) -> tuple[int, int, datetime | None]:
    """``(id, attempts, claimed_at)`` of a claim."""
    if isinstance(job, ClaimedJob):
        return job.id, job.attempts, job.claimed_at
    if not isinstance(job, tuple) or len(job) not in (2, 3):
        raise InvalidJobOptions(
            f"Invalid claim {job!r}: pass a ClaimedJob (from claim()) or (id, attempts[, "
            "claimed_at])."
        )
    return int(job[0]), int(job[1]), job[2] if len(job) > 2 else None


def fences(jobs: Iterable[Claim]) -> dict[str, list[Any]]:
    """Parallel arrays for the fenced statements, in id order (a stable lock order)."""
    ordered = sorted((fence_of(job) for job in jobs), key=lambda claim: claim[0])
    return {
        "ids": [claim[0] for claim in ordered],
        "attempts": [claim[1] for claim in ordered],
        "claimed_at": [claim[2] for claim in ordered],
    }


@dataclass(frozen=True)
class FailedAttempt:
    """One claim to fail: its error, its ``(base, cap)`` backoff, and whether it is final.

    ``delay`` (seconds), when given, replaces the backoff formula (a job's backoff callable);
    ``jitter`` draws the delay from [75 %, 100 %) of itself.
    """

    claim: Claim
    failure: Failure
    backoff: tuple[float, float]
    final: bool = False
    delay: float | None = None
    jitter: bool = False


# What a worker writes for a job whose attempt ended, one statement per kind (finish.write).
class Action:
    """The kinds of outcome, each written by its own fenced statement (``finish.write``)."""

    COMPLETE: Final = "complete"
    FAIL: Final = "fail"
    RELEASE: Final = "release"
    SNOOZE: Final = "snooze"


@dataclass
class Outcome:
    """What to write for one job: complete (with its result), fail, release or snooze.

    A ``final`` failure fails the job for good whatever attempts it has left (a payload that
    can never run, an error the job's ``discard_on`` or ``retry_on`` gives up on); an
    ``outage`` release is counted in the job's ``outage_releases``. ``delay`` (seconds) is a
    snooze's, or a failure's from the job's backoff callable (None: the ``backoff`` formula);
    ``jitter`` spreads a failure's delay. ``error`` is what the job raised (or the
    ``JobTimeout`` it ran into): what ``job_finished`` and the error's log line carry.
    ``rides``: a completion may be written in a claim's statement (``COMPLETE_WITH_CLAIM``);
    False once a claim failed on it for another reason than an outage.
    """

    job: ClaimedJob
    action: str
    duration: float = 0.0
    failure: Failure | None = None
    result: Any = None
    backoff: tuple[float, float] | None = None
    final: bool = False
    outage: bool = False
    delay: float | None = None
    jitter: bool = False
    error: BaseException | None = None
    rides: bool = True
