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


# The plain claims take nothing from a queue that is paused or has a limit: the uncorrelated
# NOT EXISTS is an InitPlan (one primary-key probe of pgjobs_queue per statement, a One-Time
# Filter); those jobs are CLAIM_GUARDED's.
UNGUARDED: LiteralString = """
    AND NOT EXISTS (SELECT FROM pgjobs_queue q
                    WHERE q.name = %(queue)s
                      AND (q.paused OR q.concurrency IS NOT NULL OR q.rate_count IS NOT NULL))"""


# The fence, the heart of the design: a write after the claim changes a row only while it is
# still this claim's, `running` with the attempt number and the claim time (attempted_at)
# the claim returned. Attempts alone could match a later claim (a release gives the attempt
# back, an operator's retry resets them); no two claims share a claim time. A NULL claim time
# (a caller who kept only the id and attempts) fences on the attempts alone. Every fenced
# statement joins its claims as `mine` (id, attempts, claimed_at, ...) and ends with this.
FENCE: LiteralString = (
    """
WHERE j.id = mine.id AND j.status = 'running' AND j.attempts = mine.attempts
  AND (mine.claimed_at IS NULL OR j.attempted_at = mine.claimed_at)"""
    + COMMIT
)
