"""The pieces of SQL every statement of a job's state shares, each written once."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import LiteralString


# The worker's own writes may commit without waiting for the WAL flush
# (PGJOBS["WORKER_SYNCHRONOUS_COMMIT"]). The setting is changed by a local set_config inside
# the statement itself, an InitPlan the planner runs once, so it lasts for this one
# transaction and never reaches another client of a transaction-mode pooler. NULL keeps the
# session's own setting. Appended to the WHERE of the claim and of each fenced write.
COMMIT: LiteralString = """
  AND (SELECT set_config('synchronous_commit',
                         coalesce(%(synchronous_commit)s::text,
                                  current_setting('synchronous_commit')), true)) IS NOT NULL"""


# The claims a fenced statement takes, as its row source `mine`: parallel arrays of ids,
# attempts and claim times (types.fences() shapes them, in id order), and the statement's own
# `arrays` beside them, named `names`.
def claims(arrays: LiteralString = "", names: LiteralString = "") -> LiteralString:
    """``unnest(ids, attempts, claimed_at, ...) AS mine(id, attempts, claimed_at, ...)``."""
    return (
        "unnest(%(ids)s::bigint[], %(attempts)s::int[], %(claimed_at)s::timestamptz[]"
        + arrays
        + ")\n     AS mine(id, attempts, claimed_at"
        + names
        + ")"
    )


# A row that is still the claim `mine` took: the same attempt, and the claim time
# (attempted_at) the claim returned. Attempts alone could match a later claim (a release gives
# the attempt back, an operator's retry resets them); no two claims share a claim time. A NULL
# claim time (a caller who kept only the id and attempts) matches on the attempts alone.
THE_CLAIM: LiteralString = """j.id = mine.id AND j.attempts = mine.attempts
  AND (mine.claimed_at IS NULL OR j.attempted_at = mine.claimed_at)"""

# The fence, the heart of the design: a write after the claim changes a row only while it is
# still this claim's and `running`. Every fenced statement joins its claims as `mine` and
# ends with this.
FENCE: LiteralString = "\nWHERE " + THE_CLAIM + " AND j.status = 'running'" + COMMIT


# A job a claim may start now: waiting, and due. Every reader of "ready" uses this (the claims,
# the outlook, the word of a freed slot, the doctor's unrunnable jobs, explain()), so none can
# count as ready a job the claim would pass over. Unqualified: inside a subquery over
# pgjobs_job the columns are that subquery's row.
READY: LiteralString = "status = 'queued' AND run_at <= now()"

# The order the claims take ready jobs in, the order of the partial index pgjobs_job_ready_idx;
# ties are broken by id where a statement needs one order (the guarded claim, explain()).
CLAIM_ORDER: LiteralString = "priority DESC, run_at"

# A queue whose jobs only the guarded claim takes: one with a concurrency or a rate limit (a
# pause stops both claims). A job with a lock key needs the guarded claim in any queue. `q` is
# the queue's row in pgjobs_queue.
LIMITED: LiteralString = "(q.concurrency IS NOT NULL OR q.rate_count IS NOT NULL)"

# The plain claims take nothing from a queue that is paused or limited: the uncorrelated
# NOT EXISTS is an InitPlan (one primary-key probe of pgjobs_queue per statement, a One-Time
# Filter); those jobs are CLAIM_GUARDED's.
UNGUARDED: LiteralString = (
    """
    AND NOT EXISTS (SELECT FROM pgjobs_queue q
                    WHERE q.name = %(queue)s
                      AND (q.paused OR """
    + LIMITED
    + "))"
)

# The running jobs that hold job j's lock key (a claim starts a keyed job only when none does).
KEY_HOLDERS: LiteralString = (
    "FROM pgjobs_job r WHERE r.lock_key = j.lock_key AND r.status = 'running'"
)

# The starts of queue q's rate window (the guarded claim stamps them): a rate-limited queue
# has room while fewer than rate_count of them fall within the last rate_period.
RATE_WINDOW: LiteralString = (
    "FROM unnest(q.starts) AS s WHERE s > statement_timestamp() - q.rate_period"
)


def running_in(queue: LiteralString) -> LiteralString:
    """The count of ``queue``'s running jobs, which a concurrency limit bounds."""
    return "(SELECT count(*) FROM pgjobs_job WHERE queue = " + queue + " AND status = 'running')"


def failed_for_good(cause: LiteralString) -> LiteralString:
    """When a failed attempt ends the job: its attempts are used up, or ``cause`` (a final
    error, a quarantine) holds. The SET clauses of that rule, shared by FAIL and REAP: the job
    ends ``failed`` with its finish time and gives its unique key up, or goes back to
    ``queued`` keeping both."""
    final: LiteralString = "j.attempts >= j.max_attempts OR " + cause
    return (
        "status       = CASE WHEN "
        + final
        + " THEN 'failed' ELSE 'queued' END,\n    finished_at  = CASE WHEN "
        + final
        + " THEN now() END,\n    unique_key   = CASE WHEN "
        + final
        + " THEN NULL ELSE j.unique_key END"
    )
