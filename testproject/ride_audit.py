"""An audit of which transactions both completed jobs and claimed the next ones: shows a
worker's completions riding with its claims (``PGJOBS["COMPLETE_WITH_CLAIM"]``) to the tests
and the demo. A statement-level trigger with transition tables notes, for every UPDATE of
``pgjobs_job``, its transaction and how many jobs it finished and claimed."""

from __future__ import annotations

INSTALL = [
    "CREATE TABLE ride_audit (tx bigint, done int, claimed int)",
    """
    CREATE FUNCTION ride_audit() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
      INSERT INTO ride_audit
      SELECT txid_current(),
             count(*) FILTER (WHERE o.status = 'running' AND n.status = 'done'),
             count(*) FILTER (WHERE o.status = 'queued' AND n.status = 'running')
      FROM old_rows o JOIN new_rows n USING (id);
      RETURN NULL;
    END $$
    """,
    """
    CREATE TRIGGER ride_audit AFTER UPDATE ON pgjobs_job
      REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
      FOR EACH STATEMENT EXECUTE FUNCTION ride_audit()
    """,
]

REMOVE = [
    "DROP TRIGGER ride_audit ON pgjobs_job",
    "DROP FUNCTION ride_audit()",
    "DROP TABLE ride_audit",
]

# One row: the transactions that both completed and claimed, the completions they wrote, and
# all the completions written.
COUNTS = """
SELECT count(*) FILTER (WHERE done > 0 AND claimed > 0),
       coalesce(sum(done) FILTER (WHERE claimed > 0), 0),
       coalesce(sum(done), 0)
FROM (SELECT sum(done) AS done, sum(claimed) AS claimed
      FROM ride_audit GROUP BY tx) per_transaction
"""
