"""Why isn't this job running? The reasons, in plain language, computed when asked.

``explain(job)`` reads the job and everything the claim checks about it in one statement
(``EXPLAIN_JOB``, one snapshot, partial indexes only) and returns a list of ``Reason``:
each a ``code`` a program can test, a ``message`` a person can read, and the ``data`` behind
it. The statement is built from the claim's own fragments (``core.fragments``: what is ready,
the claim's order, which queues need the guarded claim, a key's holders, a rate window, a
queue's running jobs), so the explanation cannot say "ready" of a job the claim would pass
over, or the reverse:

- a queued job: when it is due (scheduled, or waiting for its retry), and, once due, what
  holds it back (its queue paused or at a limit, its lock key held or another job of the key
  first, its workers' crash record), who could run it (live workers serving the queue that
  know its task, in lease mode where the job needs the guarded claim), and how many ready
  jobs come before it;
- a running job: its worker (from the registry), its lease, and whether the lease expired;
- a finished job: how it ended.

Nothing is stored or cached: a reason is as true as the moment it was read, and the next
claim may change it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from django.db import connections

from django_pgjobs.core import conf
from django_pgjobs.core.execute import records
from django_pgjobs.core.fragments import (
    CLAIM_ORDER,
    KEY_HOLDERS,
    LIMITED,
    RATE_WINDOW,
    READY,
    running_in,
)
from django_pgjobs.core.types import last_line
from django_pgjobs.models import Job, Status

if TYPE_CHECKING:
    from typing_extensions import LiteralString

__all__ = ["Reason", "explain"]

# One statement reads everything the explanation needs, in one snapshot, so its reasons cannot
# contradict each other: the job, its queue's row, and what the claim would check about it.
# Each part reads a partial index or a primary key (the queue's running jobs, the running
# holder of its lock key, the ready jobs ahead of it in the claim's order, the live workers),
# and runs only for the status it concerns: PostgreSQL evaluates the subquery of a CASE branch
# only when the branch is taken. Each condition is the claim's own, from the same fragments:
# `due` is READY, `guarded` the rule that sends a job to the guarded claim (a lock key, or a
# LIMITED queue), the queue's running jobs against `concurrency`, its RATE_WINDOW against
# `rate_count` (room when the earliest start leaves the window), a running job among the
# KEY_HOLDERS, the first ready job of the key in the CLAIM_ORDER (a claim starts one per key).
# The count of jobs ahead is bounded by `ahead_limit` in each of its two parts: higher
# priority, then the same priority and an earlier run_at, each a range of the ready index.
EXPLAIN_JOB: LiteralString = (
    """
WITH j AS (
  SELECT id, queue, task, status, priority, run_at, attempts, max_attempts, last_error,
         lock_key, crashes, locked_until, attempted_at, finished_at,
         worker_ids ->> -1 AS worker_id, """
    + READY
    + """ AS due
  FROM pgjobs_job WHERE id = %(id)s
)
SELECT j.id, j.queue, j.task, j.status, j.priority, j.run_at, j.attempts, j.max_attempts,
       j.last_error, j.lock_key, j.crashes, j.locked_until, j.attempted_at, j.finished_at,
       j.worker_id, j.due, now() AS now,
       coalesce(q.paused, false) AS paused, q.concurrency, q.rate_count,
       extract(epoch FROM q.rate_period)::float8 AS rate_period,
       j.lock_key IS NOT NULL OR coalesce("""
    + LIMITED
    + """, false) AS guarded,
       CASE WHEN j.status = 'queued' AND q.concurrency IS NOT NULL THEN
         """
    + running_in("j.queue")
    + """
       END AS running,
       window_.started AS rate_started, window_.first + q.rate_period AS rate_free,
       CASE WHEN j.status = 'queued' AND j.lock_key IS NOT NULL THEN
         (SELECT r.id """
    + KEY_HOLDERS
    + """ ORDER BY r.id LIMIT 1)
       END AS key_holder,
       CASE WHEN j.due AND j.lock_key IS NOT NULL THEN
         (SELECT k.id FROM pgjobs_job k
          WHERE k.queue = j.queue AND """
    + READY
    + """ AND k.lock_key = j.lock_key
          ORDER BY """
    + CLAIM_ORDER
    + """, id LIMIT 1)
       END AS key_first,
       CASE WHEN j.due THEN
         (SELECT count(*) FROM (SELECT FROM pgjobs_job a
                                WHERE a.queue = j.queue AND """
    + READY
    + """
                                  AND a.priority > j.priority
                                LIMIT %(ahead_limit)s) AS higher)
         + (SELECT count(*) FROM (SELECT FROM pgjobs_job a
                                  WHERE a.queue = j.queue AND a.status = 'queued'
                                    AND a.priority = j.priority AND a.run_at < j.run_at
                                  LIMIT %(ahead_limit)s) AS older)
       END AS ahead,
       fleet.live, fleet.serving, fleet.knowing, fleet.leasing,
       runner.host AS runner_host, runner.pid AS runner_pid,
       runner.heartbeat_at AS runner_beat, runner.expires_at >= now() AS runner_live
FROM j
LEFT JOIN pgjobs_queue q ON q.name = j.queue
LEFT JOIN LATERAL (
  SELECT count(*) AS started, min(s) AS first """
    + RATE_WINDOW
    + """
) AS window_ ON j.status = 'queued' AND q.rate_count IS NOT NULL
LEFT JOIN LATERAL (
  SELECT count(*) AS live,
         count(*) FILTER (WHERE w.queues ? j.queue) AS serving,
         count(*) FILTER (WHERE w.queues ? j.queue
                            AND (w.tasks IS NULL OR j.task = ANY(w.tasks))) AS knowing,
         count(*) FILTER (WHERE w.queues ? j.queue AND w.mode = 'lease'
                            AND (w.tasks IS NULL OR j.task = ANY(w.tasks))) AS leasing
  FROM pgjobs_worker w
  WHERE w.expires_at >= now()
) AS fleet ON j.status = 'queued'
LEFT JOIN pgjobs_worker runner ON runner.id = j.worker_id AND j.status = 'running'
"""
)


# The jobs ahead are counted up to this many in each part; more reads as "more than".
AHEAD_LIMIT = 1000


# How much of an error a reason quotes: its last line, cut to this many characters.
ERROR_PREVIEW = 200


@dataclass(frozen=True)
class Reason:
    """One reason why a job is where it is: ``code`` (stable, for programs and tests),
    ``message`` (plain language, for people) and ``data`` (the facts behind the message)."""

    code: str
    message: str
    data: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.message


def explain(job: Job | int, alias: str | None = None) -> list[Reason]:
    """The reasons why ``job`` (a ``Job`` or its id) is queued, running or finished, now.

    Read from the database at the call, in one statement: pass the job, not a stale copy
    of its state. A job that no longer exists (pruned) gets one reason, ``gone``.
    """
    job_id = job.pk if isinstance(job, Job) else job
    if isinstance(job_id, bool) or not isinstance(job_id, int):
        raise TypeError(f"explain() takes a Job or a job id (an int), not {job_id!r}.")
    facts = records(
        connections[alias or conf.database()],
        EXPLAIN_JOB,
        {"id": job_id, "ahead_limit": AHEAD_LIMIT + 1},
    )
    if not facts:
        return [Reason("gone", f"Job {job_id} no longer exists (pruned or deleted).")]
    row = facts[0]
    if row["status"] == Status.QUEUED:
        return _queued(row)
    if row["status"] == Status.RUNNING:
        return _running(row)
    return [_finished(row)]


# -- queued ----------------------------------------------------------------------------------


def _queued(row: dict[str, Any]) -> list[Reason]:
    reasons = [_due(row)] if not row["due"] else []
    if row["paused"]:
        reasons.append(
            Reason(
                "paused",
                f"Its queue {row['queue']} is paused: no worker starts its jobs until it is "
                "resumed.",
                {"queue": row["queue"]},
            )
        )
    if row["due"]:
        reasons += _limits(row) + _key(row) + _suspect(row)
    reasons += _workers(row)
    if row["due"]:
        reasons.append(_ahead(row, blocked=bool(reasons)))
    return reasons


def _due(row: dict[str, Any]) -> Reason:
    when = _when(row["run_at"], row["now"])
    if row["attempts"] and row["last_error"]:
        error = _error(row["last_error"])
        return Reason(
            "retry",
            f"Waiting for its retry: attempt {row['attempts'] + 1} of {row['max_attempts']} "
            f"is due {when}, after attempt {row['attempts']} failed with: {error}",
            {"run_at": row["run_at"], "attempts": row["attempts"], "last_error": error},
        )
    return Reason("scheduled", f"Scheduled for later: due {when}.", {"run_at": row["run_at"]})


def _limits(row: dict[str, Any]) -> list[Reason]:
    reasons = []
    queue, concurrency = row["queue"], row["concurrency"]
    if concurrency is not None and row["running"] >= concurrency:
        reasons.append(
            Reason(
                "concurrency",
                f"Its queue {queue} is at its concurrency limit: {row['running']} running of "
                f"{concurrency} allowed. The next job starts when one of them ends.",
                {"queue": queue, "running": row["running"], "concurrency": concurrency},
            )
        )
    count = row["rate_count"]
    if count is not None and row["rate_started"] >= count:
        period = row["rate_period"]
        reasons.append(
            Reason(
                "rate",
                f"Its queue {queue} is at its rate limit: {row['rate_started']} started in "
                f"the last {period:g} s, of {count} allowed. Room comes "
                f"{_when(row['rate_free'], row['now'])}.",
                {
                    "queue": queue,
                    "started": row["rate_started"],
                    "rate_count": count,
                    "rate_period": period,
                    "free_at": row["rate_free"],
                },
            )
        )
    return reasons


def _key(row: dict[str, Any]) -> list[Reason]:
    key = row["lock_key"]
    if key is None:
        return []
    if row["key_holder"] is not None:
        return [
            Reason(
                "lock_key",
                f"Waiting for its lock key {key!r}: job {row['key_holder']} holds it (running). "
                "It starts after that job ends.",
                {"lock_key": key, "holder": row["key_holder"]},
            )
        ]
    if row["key_first"] is not None and row["key_first"] != row["id"]:
        return [
            Reason(
                "lock_key_turn",
                f"Job {row['key_first']}, with the same lock key {key!r}, comes first (or level "
                "with it) in the claim's order: a claim starts one job of a key at a time.",
                {"lock_key": key, "first": row["key_first"]},
            )
        ]
    return []


def _suspect(row: dict[str, Any]) -> list[Reason]:
    if not row["crashes"]:
        return []
    return [
        Reason(
            "suspect",
            f"Its worker died during its last {row['crashes']} attempt(s): only an idle worker "
            "claims it, and runs it alone, so that it cannot take other jobs down with it.",
            {"crashes": row["crashes"]},
        )
    ]


def _workers(row: dict[str, Any]) -> list[Reason]:
    queue, task = row["queue"], row["task"]
    if not row["serving"]:
        return [
            Reason(
                "no_worker",
                f"No live worker serves its queue {queue} ({row['live']} live worker(s) in "
                f"all): start one with `manage.py runjobs --queue {queue}`.",
                {"queue": queue, "live": row["live"]},
            )
        ]
    if not row["knowing"]:
        return [
            Reason(
                "unknown_task",
                f"None of the {row['serving']} live worker(s) serving {queue} has its task "
                f"{task} registered, and a worker claims only the tasks it knows: deploy "
                "workers with the code that defines it.",
                {"queue": queue, "task": task, "serving": row["serving"]},
            )
        ]
    if row["guarded"] and not row["leasing"]:
        why = "it has a lock key" if row["lock_key"] is not None else f"{queue} has a limit"
        return [
            Reason(
                "transaction_mode",
                f"Every live worker that could run it is in transaction mode, and {why}: only "
                "lease-mode workers run jobs with lock keys or of limited queues. Start one "
                f"with `manage.py runjobs --queue {queue}` (lease mode is the default).",
                {"queue": queue, "knowing": row["knowing"]},
            )
        ]
    return []


def _ahead(row: dict[str, Any], *, blocked: bool) -> Reason:
    ahead = row["ahead"]
    count = f"more than {AHEAD_LIMIT}" if ahead > AHEAD_LIMIT else str(ahead)
    data = {"ahead": min(ahead, AHEAD_LIMIT + 1), "queue": row["queue"]}
    if ahead:
        return Reason(
            "ahead",
            f"{count} ready job(s) of queue {row['queue']} come before it (higher priority, or "
            "the same priority and due earlier); claims take them first.",
            data,
        )
    if blocked:
        return Reason("ahead", "No ready job comes before it in its queue.", data)
    return Reason(
        "next",
        f"Nothing holds it back: it is first in queue {row['queue']}, and the next claim of a "
        "worker serving the queue takes it.",
        data,
    )


# -- running and finished --------------------------------------------------------------------


def _running(row: dict[str, Any]) -> list[Reason]:
    worker, now = row["worker_id"], row["now"]
    if row["runner_host"] is not None:
        where = f"host {row['runner_host']}, pid {row['runner_pid']}"
        beat = f"its latest beat {_when(row['runner_beat'], now)}"
        state = "" if row["runner_live"] else "; its registry row has expired"
        running = f"Running on worker {worker} ({where}; {beat}{state})"
    else:
        running = f"Running on worker {worker}, which is not in the registry of live workers"
    claimed = _when(row["attempted_at"], now) if row["attempted_at"] else "at an unknown time"
    reasons = [
        Reason(
            "running",
            f"{running}: attempt {row['attempts']} of {row['max_attempts']}, claimed {claimed}.",
            {
                "worker_id": worker,
                "host": row["runner_host"],
                "pid": row["runner_pid"],
                "heartbeat_at": row["runner_beat"],
                "attempted_at": row["attempted_at"],
            },
        )
    ]
    lease = row["locked_until"]
    if lease is None:
        # Only a row written by hand: every claim sets a lease. The reap compares it to now(),
        # which a NULL never passes.
        reasons.append(
            Reason(
                "no_lease",
                "It has no lease (locked_until is empty), so the reaper never takes it back: "
                "cancel it if no worker is running it.",
                {"locked_until": None},
            )
        )
        return reasons
    expired = lease < now
    if lease == row["attempted_at"]:
        message = (
            "Its worker gave it up as it stopped (lease ended at the claim): the next reap "
            "puts it back in the queue, without counting a crash."
        )
    elif expired:
        message = (
            f"Its lease expired {_when(lease, now)}: the worker died or lost the database. The "
            "next reap takes it back (queued again, or failed once its attempts are used up)."
        )
    else:
        message = f"Its lease runs out {_when(lease, now)}; the worker extends it as it runs."
    reasons.append(
        Reason("lease_expired" if expired else "lease", message, {"locked_until": lease})
    )
    return reasons


def _finished(row: dict[str, Any]) -> Reason:
    ended = _when(row["finished_at"], row["now"]) if row["finished_at"] else "at an unknown time"
    data = {"finished_at": row["finished_at"], "attempts": row["attempts"]}
    if row["status"] == Status.DONE:
        return Reason("done", f"Done: it ran to the end {ended}.", data)
    if row["status"] == Status.CANCELLED:
        return Reason("cancelled", f"Cancelled {ended}: it will not run.", data)
    error = _error(row["last_error"] or "")
    return Reason(
        "failed",
        f"Failed for good {ended}, after {row['attempts']} of {row['max_attempts']} attempt(s): "
        f"{error or 'no error recorded'}. Retry it from the failed jobs' list if it should run.",
        {**data, "last_error": error},
    )


def _when(moment: datetime, now: datetime) -> str:
    """``moment`` in UTC, and how far it is from the database's ``now``."""
    seconds = (moment - now).total_seconds()
    span = _span(abs(seconds))
    relative = "now" if span == "0 s" else (f"in {span}" if seconds > 0 else f"{span} ago")
    return f"at {moment.astimezone(timezone.utc):%Y-%m-%d %H:%M:%S} UTC ({relative})"


# Units from the largest; a span is told in its largest unit and the next one down.
_UNITS = (("d", 86400), ("h", 3600), ("min", 60), ("s", 1))


def _span(seconds: float) -> str:
    """``seconds`` as a person says it: "2 h 5 min", "3 min", "40 s"."""
    whole = int(seconds)
    for index, (unit, size) in enumerate(_UNITS[:-1]):
        if whole >= size:
            smaller, smaller_size = _UNITS[index + 1]
            rest = whole % size // smaller_size
            return f"{whole // size} {unit}" + (f" {rest} {smaller}" if rest else "")
    return f"{whole} s"


def _error(text: str) -> str:
    line = last_line(text) if text.strip() else ""
    return line if len(line) <= ERROR_PREVIEW else line[: ERROR_PREVIEW - 1] + "…"
