"""The queue-name CHECK, the same names refused, at about a ninth of the cost.

``queue ~ '^[A-Za-z0-9_.:-]{1,100}$'`` (0006) made PostgreSQL's regex engine expand the
bounded repeat: about 4.7 us per row for an 8-character name on the AMD EPYC machine, more for
longer ones, paid on every INSERT and on every UPDATE of a job (the claim and the completion
re-check each CHECK of the row they change). ``queue ~ '^[A-Za-z0-9_.:-]+$' AND length(queue)
<= 100`` accepts exactly the same names in about 0.5 us (``python -m benchmarks.checks``).

Online, as 0008 changed the status CHECK: the old constraint is dropped and the new one added
``NOT VALID`` in one ALTER TABLE (a catalog change under a brief ACCESS EXCLUSIVE lock,
bounded by lock_timeout), then validated in a statement of its own, which reads the table
under SHARE UPDATE EXCLUSIVE and blocks no reads or writes. Every row the old constraint let
in passes the new one, so the validation cannot fail. Non-atomic: each statement commits on
its own.
"""

import django
from django.db import migrations, models
from django.db.models.functions import Length
from django.db.models.lookups import LessThanOrEqual


def alter(condition: str) -> list[str]:
    return [
        "SET lock_timeout = '5s'",
        f"""
ALTER TABLE pgjobs_job
  DROP CONSTRAINT IF EXISTS pgjobs_job_queue_check,
  ADD CONSTRAINT pgjobs_job_queue_check CHECK ({condition}) NOT VALID
""",
        "ALTER TABLE pgjobs_job VALIDATE CONSTRAINT pgjobs_job_queue_check",
        "RESET lock_timeout",
    ]


FORWARD = alter("queue ~ '^[A-Za-z0-9_.:-]+$' AND length(queue) <= 100")
BACKWARD = alter("queue ~ '^[A-Za-z0-9_.:-]{1,100}$'")


def check(condition: models.Q, name: str) -> models.CheckConstraint:
    if django.VERSION >= (5, 1):
        return models.CheckConstraint(condition=condition, name=name)
    return models.CheckConstraint(check=condition, name=name)


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("django_pgjobs", "0009_queue_control")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunSQL(FORWARD, BACKWARD)],
            state_operations=[
                migrations.RemoveConstraint("job", "pgjobs_job_queue_check"),
                migrations.AddConstraint(
                    "job",
                    check(
                        models.Q(queue__regex="^[A-Za-z0-9_.:-]+$")
                        & models.Q(LessThanOrEqual(Length("queue"), 100)),
                        "pgjobs_job_queue_check",
                    ),
                ),
            ],
        ),
    ]
