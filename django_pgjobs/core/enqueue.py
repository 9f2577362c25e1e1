"""Enqueueing: the statements (one job or many, with or without a unique key, carrying their
own ``pg_notify`` when they run in autocommit) and their runners. ``plan()`` checks every
option and payload and shapes the INSERT before anything is sent; ``one()`` and ``many()``
write it, read a unique key's holder back, and send ``job_enqueued`` on commit.
``Job.objects.enqueue()`` and ``enqueue_many()`` are these, on the manager's alias.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from datetime import timezone as dt_timezone
from typing import TYPE_CHECKING, Any

from django.conf import settings as django_settings
from django.db import connections, models, transaction
from django.db.models.base import ModelState
from django.db.models.signals import post_init, pre_init
from django.utils import timezone

from django_pgjobs import signals
from django_pgjobs.core import conf, registry, validation
from django_pgjobs.core.execute import run
from django_pgjobs.core.options import JobOptions, payload_keys, unique_keys
from django_pgjobs.core.options import unique_while as held_while
from django_pgjobs.exceptions import UniqueKeyBusy
from django_pgjobs.notify import notify_on_commit

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper
    from typing_extensions import LiteralString

    from django_pgjobs.managers import JobManager
    from django_pgjobs.models import Job

# The verbs log under the manager's name, the logger the docs point users to.
logger = logging.getLogger("django_pgjobs.managers")


# In autocommit the enqueue's own statement sends the NOTIFY (PGJOBS["NOTIFY"] "auto"):
# one statement and one commit, and PostgreSQL delivers it only once the row is committed.
# With a NULL channel the planner folds the condition away and nothing is sent. The
# subquery is an InitPlan, so it runs once per statement, not once per row.
_NOTIFY_HERE: LiteralString = """
WHERE %(notify_channel)s::text IS NULL
   OR (SELECT pg_notify(%(notify_channel)s, %(queue)s)) IS NOT NULL"""


# The columns every enqueue writes; a job without a key writes NULL for both unique ones, a
# job without a lock key NULL for lock_key.
_ENQUEUE_INTO: LiteralString = """
INSERT INTO pgjobs_job (queue, task, payload, priority, max_attempts, run_at, timeout,
                        lock_key, unique_key, unique_while)"""


# A unique key another job holds inserts nothing and returns no row: the partial unique index
# decides, never a read before the write, so it holds across processes and transactions (a
# holder not yet committed makes the INSERT wait for its outcome). The column and predicate
# name the index so PostgreSQL can infer it. The index holds only queued and running rows,
# so a finished row never keeps a key (not even one a worker from before unique keys
# completed without giving it up). Only the *_UNIQUE statements carry it: every
# row of an INSERT with ON CONFLICT takes the conflict-checked path, which costs a keyless
# row WAL and time for nothing.
_SKIP_HELD_KEY: LiteralString = """
ON CONFLICT (unique_key) WHERE unique_key IS NOT NULL AND status IN ('queued', 'running')
DO NOTHING"""


# One job: enqueue() is the hot path. A VALUES row costs the server less than a SELECT with
# the InitPlan above, so its NOTIFY rides in the RETURNING list instead (one row: one call;
# a NULL channel is folded away; no row, a key held elsewhere: no NOTIFY). The times come
# back as fixed-width ISO 8601 text in UTC (whatever the DateStyle or TimeZone): cheaper to
# read than timestamptz through Django's loader, and exact to the microsecond.
_ENQUEUE_ONE_ROW: LiteralString = """
VALUES (%(queue)s, %(task)s, %(payload)s::jsonb, %(priority)s, %(max_attempts)s,
        coalesce(%(run_at)s::timestamptz, now() + coalesce(%(delay)s::interval, interval '0')),
        %(timeout)s::interval, %(lock_key)s, %(unique_key)s, %(unique_while)s)"""


_ENQUEUE_ONE_RETURNING: LiteralString = """
RETURNING id,
  to_char(run_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"'),
  to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"'),
  CASE WHEN %(notify_channel)s::text IS NOT NULL THEN pg_notify(%(notify_channel)s, queue) END
"""


# One job without a unique key.
ENQUEUE_ONE: LiteralString = _ENQUEUE_INTO + _ENQUEUE_ONE_ROW + _ENQUEUE_ONE_RETURNING


# One job with a unique key: no row when another job holds it.
ENQUEUE_ONE_UNIQUE: LiteralString = (
    _ENQUEUE_INTO + _ENQUEUE_ONE_ROW + _SKIP_HELD_KEY + _ENQUEUE_ONE_RETURNING
)


# The columns of one row of a bulk INSERT, for the payload p at position n, with its lock key
# (NULL, an array of none, for a call without them); the unique key's two follow.
_ENQUEUE_MANY_ROW: LiteralString = """
SELECT %(queue)s, %(task)s, p, %(priority)s, %(max_attempts)s,
       coalesce(%(run_at)s::timestamptz, now() + coalesce(%(delay)s::interval, interval '0')),
       %(timeout)s::interval, (%(lock_keys)s::text[])[n]"""


# One INSERT for any number of jobs without keys. The payloads arrive as one JSON array (one
# parameter, parsed once by the server) rather than a jsonb[] whose every element the client
# escapes; ids come back in the payloads' order.
ENQUEUE: LiteralString = (
    _ENQUEUE_INTO
    + _ENQUEUE_MANY_ROW
    + """, NULL, NULL
FROM jsonb_array_elements(%(payloads)s::jsonb) WITH ORDINALITY AS t(p, n)"""
    + _NOTIFY_HERE
    + """
ORDER BY n
RETURNING id
"""
)


# One INSERT for jobs of which some have a unique key (NULL: none), zipped with the payloads
# by ROWS FROM, in the order sent. The caller sends each key once and the keyed rows sorted by
# key, so two calls with overlapping keys take them in one order and cannot deadlock; a row is
# skipped only for a key another job holds, and keyed rows are matched back by the key they
# return, keyless ones by their order. Its NOTIFY is an InitPlan over the rows inserted, so
# a call whose every key is held sends none.
ENQUEUE_UNIQUE: LiteralString = (
    """
WITH inserted AS ("""
    + _ENQUEUE_INTO
    + _ENQUEUE_MANY_ROW
    + """, k, CASE WHEN k IS NOT NULL THEN %(unique_while)s END
FROM ROWS FROM (jsonb_array_elements(%(payloads)s::jsonb), unnest(%(unique_keys)s::text[]))
     WITH ORDINALITY AS t(p, k, n)
ORDER BY n"""
    + _SKIP_HELD_KEY
    + """
RETURNING id, unique_key
)
SELECT id, unique_key FROM inserted
WHERE %(notify_channel)s::text IS NULL
   OR (SELECT pg_notify(%(notify_channel)s, %(queue)s) FROM inserted LIMIT 1) IS NOT NULL
"""
)


# The job that holds this unique key, its whole row (loaded as a Job): what enqueue() returns
# when its key was taken. No row: the holder left its window in between.
UNIQUE_HOLDER: LiteralString = """
SELECT * FROM pgjobs_job
WHERE unique_key = %(unique_key)s AND status IN ('queued', 'running')
"""


# The ids of the jobs that hold these unique keys: all enqueue_many() returns for them.
UNIQUE_HOLDER_IDS: LiteralString = """
SELECT unique_key, id FROM pgjobs_job
WHERE unique_key = ANY(%(unique_keys)s::text[]) AND status IN ('queued', 'running')
"""


# -- the runners: an enqueue checked into a Plan, then written.


def _timestamp(text: str) -> datetime:
    """A timestamp the enqueue returned as ISO 8601 text in UTC, as Django would load it."""
    value = datetime.fromisoformat(text)
    if not django_settings.USE_TZ:
        return timezone.make_naive(value)
    return value.astimezone(dt_timezone.utc)


@dataclass(frozen=True, slots=True)
class _Columns:
    """A model's concrete columns in the order ``Model.from_db`` takes them (Django's
    positional fast path), where each one is, and their defaults: the constant ones once,
    the callable ones (an empty list) to call for each instance."""

    names: list[str]
    positions: dict[str, int]
    constants: list[Any]
    factories: list[tuple[int, Callable[[], Any]]]
    # Whether an instance can be built by writing its attributes into its __dict__ (see
    # _direct()).
    direct: bool


# What a model's class may define for _loaded() to build its instances directly: any of these
# would have run (or been bypassed) when Model.__init__ or Model.from_db built one.
_BUILDING = ("__new__", "__init__", "__setattr__", "from_db")


def _direct(model: type[models.Model], names: list[str]) -> bool:
    """Whether an instance of ``model`` may be built by writing its attributes straight into
    its ``__dict__``: ``Model.__init__`` sets each column with ``setattr`` and then calls
    ``super().__init__()``, so that is the same instance only when no class of the model's
    own (Job, a proxy of it, a mixin anywhere in its MRO) defines one of ``_BUILDING``, and
    no column's class attribute acts when set (a descriptor with ``__set__``). Django's own
    classes (``Model`` and its bases) are known to set nothing more."""
    own = [klass for klass in model.__mro__ if klass not in models.Model.__mro__]
    return not any(name in vars(klass) for klass in own for name in _BUILDING) and not any(
        hasattr(type(inspect.getattr_static(model, name, None)), "__set__") for name in names
    )


# Per model class, decided at its first enqueue (a class patched later is not looked at again).
@functools.cache
def _columns(model: type[models.Model]) -> _Columns:
    fields = model._meta.concrete_fields
    names = [field.attname for field in fields]
    # A field without a default has Django's NOT_PROVIDED there, a class: callable too.
    called = {
        i for i, field in enumerate(fields) if field.has_default() and callable(field.default)
    }
    return _Columns(
        names,
        {name: i for i, name in enumerate(names)},
        [None if i in called else field.get_default() for i, field in enumerate(fields)],
        [(i, fields[i].default) for i in sorted(called)],
        _direct(model, names),
    )


def _loaded(model: type[Job], alias: str, known: Mapping[str, Any]) -> Job:
    """The ``Job`` as Django would load its row: ``known`` columns, the others' defaults
    (NULL, 0, an empty list: what the INSERT left them).

    Built as ``Model.__init__`` builds it, without going through it when nothing would see
    the difference (no ``pre_init`` or ``post_init`` receiver for the model, and
    ``_direct()``): its generic loop over the columns cost an enqueue 17 to 24 µs of client
    CPU."""
    columns = _columns(model)
    values = columns.constants.copy()
    for i, factory in columns.factories:
        values[i] = factory()
    for name, value in known.items():
        values[columns.positions[name]] = value
    if (
        not columns.direct
        or signals.listening(pre_init, model)
        or signals.listening(post_init, model)
    ):
        return model.from_db(alias, columns.names, values)
    job = model.__new__(model)
    state = ModelState()
    state.adding = False
    state.db = alias
    attributes = job.__dict__
    attributes["_state"] = state
    attributes.update(zip(columns.names, values, strict=True))
    return job


UNIQUE_TRIES = 3


class Enqueued(list[int]):
    """What ``enqueue_many()`` returns: the job ids, one per payload, in order.

    ``created`` is parallel to it: ``False`` where the id is that of a job that already held
    the payload's unique key, or of an earlier payload of the same call with the same key.
    """

    def __init__(self, ids: Iterable[int] = (), created: list[bool] | None = None) -> None:
        super().__init__(ids)
        # Without `created` (a copy, such as Django makes of a list it is given), all are new.
        self.created = [True] * len(self) if created is None else created


@dataclass(frozen=True, slots=True)
class Plan:
    """An enqueue, checked: the manager it runs for (its model and alias), its connection,
    columns, statement parameters and payloads."""

    manager: JobManager
    connection: BaseDatabaseWrapper
    fields: dict[str, Any]
    params: dict[str, Any]
    # The payloads, checked (validation.checked_payload), encoded as they are sent.
    payloads: list[dict[str, Any]]
    # One key per payload (None: that payload has none), or None when no payload has one.
    keys: list[str | None] | None
    # The lock keys, the same way.
    locks: list[str | None] | None
    # Whether the INSERT carries its own NOTIFY (else an on_commit hook sends it).
    here: bool
    # Whether the task is a @job function, whose enqueues send job_enqueued (a django.tasks
    # task's send Django's task_enqueued, from the backend).
    announce: bool

    @property
    def alias(self) -> str:
        return self.manager.db_alias

    def notify(self) -> None:
        """After a job was written: register the hook, unless the INSERT notified itself."""
        if not self.here:
            notify_on_commit(self.alias, self.fields["queue"])


def _busy(fields: Mapping[str, Any], keys: list[str]) -> UniqueKeyBusy:
    return UniqueKeyBusy(
        f"Task {fields['task']!r}, queue {fields['queue']!r}: unique key(s) {keys[:3]!r} were "
        f"held by another job at each of {UNIQUE_TRIES} inserts, yet by no job when read back "
        "(jobs with these keys are enqueued and finished faster than this enqueue can look); "
        "nothing was enqueued for them: enqueue again."
    )


def plan(
    manager: JobManager,
    task: str | Callable[..., Any],
    payloads: Sequence[Any],
    *,
    queue: str | None,
    run_at: Any,
    delay: Any,
    priority: int | None,
    max_attempts: int | None,
    timeout: Any,
    unique_key: str | Callable[[dict[str, Any]], str | None] | None,
    unique_while: str | None,
    lock_key: str | Callable[[dict[str, Any]], str | None] | None,
) -> Plan:
    """Check every option and payload (nothing is sent before) and shape the INSERT."""
    func = registry.resolve(task)
    options = JobOptions.resolve(
        func, queue=queue, priority=priority, max_attempts=max_attempts, timeout=timeout
    )
    fields = options.columns()
    when, wait = validation.schedule(run_at, delay)
    checked = [validation.checked_payload(p) for p in payloads]
    keys = unique_keys(func, payloads, unique_key, unique_while)
    locks = payload_keys(func, payloads, lock_key, "lock_key")
    mode = held_while(func, unique_while)
    connection = manager.connection()
    # Outside atomic() the INSERT sends its own NOTIFY: in autocommit it is the whole
    # transaction ("auto"); under manual transaction management (set_autocommit(False))
    # Django has no on_commit, and PostgreSQL delivers it when the caller commits.
    here = not connection.in_atomic_block and (
        conf.notify() == "auto" or not connection.get_autocommit()
    )
    params = {
        **fields,
        "run_at": when,
        "delay": wait,
        "notify_channel": conf.channel() if here else None,
        "unique_while": mode if keys else None,
    }
    return Plan(
        manager, connection, fields, params, checked, keys, locks, here, not func.stores_result
    )


def one(plan: Plan, payload: dict[str, Any]) -> Job:
    """Insert the plan's one job; the ``Job``, or the holder of its unique key (``created``
    False), trying again (up to ``UNIQUE_TRIES`` times) when the holder left in between."""
    key = plan.keys[0] if plan.keys else None
    lock = plan.locks[0] if plan.locks else None
    text = validation.encode(plan.payloads[0])
    params = plan.params | {"payload": text, "unique_key": key, "lock_key": lock}
    statement = ENQUEUE_ONE if key is None else ENQUEUE_ONE_UNIQUE
    rows = run(plan.connection, statement, params)
    tries = 1
    while not rows and key is not None:
        holder = _holder(plan, key)
        if holder is not None:
            holder.created = False
            return holder
        # The holder left the key's window between the insert and the read: try again.
        if tries == UNIQUE_TRIES:
            raise _busy(plan.fields, [key])
        tries += 1
        rows = run(plan.connection, statement, params)
    plan.notify()
    job_id, job_run_at, created_at, _notified = rows[0]
    known = {
        "id": job_id,
        "payload": payload,
        "run_at": _timestamp(job_run_at),
        "created_at": _timestamp(created_at),
        "attempts": 0,
        "status": "queued",
        "unique_key": key,
        "unique_while": params["unique_while"],
        "lock_key": lock,
        **plan.fields,
    }
    job = _loaded(plan.manager.model, plan.alias, known)
    job.created = True
    _announce(plan, job=job)
    return job


def many(plan: Plan) -> Enqueued:
    """Insert the plan's jobs with one INSERT (keyed ones in rounds, all or nothing); their ids
    in payload order, with which were created."""
    if not plan.payloads:
        return Enqueued([], [])
    if not plan.keys:
        rows = _insert_many(plan, ENQUEUE, list(range(len(plan.payloads))), None)
        plan.notify()
        _announce(plan, ids=[row[0] for row in rows])
        return Enqueued([row[0] for row in rows], [True] * len(rows))
    # Each key is sent once, with its first payload; the later ones share its outcome.
    first: dict[str, int] = {}
    for index, key in enumerate(plan.keys):
        if key is not None:
            first.setdefault(key, index)
    # All or nothing: a UniqueKeyBusy rolls back the rows already inserted (a savepoint
    # inside the caller's transaction).
    with transaction.atomic(using=plan.alias):
        keyless, new, held = _insert_unique(plan, plan.keys, first)
    ids: list[int] = []
    created: list[bool] = []
    for index, key in enumerate(plan.keys):
        if key is None:
            ids.append(next(keyless))
            created.append(True)
        elif key in new:
            ids.append(new[key])
            created.append(first[key] == index)
        else:
            ids.append(held[key])
            created.append(False)
    # After the block: in autocommit the hook runs once the rows are committed.
    if any(created):
        plan.notify()
        _announce(plan, ids=[i for i, new in zip(ids, created, strict=True) if new])
    return Enqueued(ids, created)


def _insert_unique(
    plan: Plan, keys: list[str | None], first: dict[str, int]
) -> tuple[Iterator[int], dict[str, int], dict[str, int]]:
    """Insert the payloads of a call with keys; return the keyless rows' ids (in payload
    order), the keys inserted (key -> id) and the keys held by other jobs (key -> id).

    The keyed rows go in sorted by key, in every round: two calls that share keys take
    them in the same order, so one waits for the other instead of both deadlocking.
    """
    waiting = sorted(first)
    sent = [i for i, key in enumerate(keys) if key is None]
    sent += [first[key] for key in waiting]
    rows = _insert_many(plan, ENQUEUE_UNIQUE, sent, [keys[i] for i in sent])
    keyless = iter([row[0] for row in rows if row[1] is None])
    new = {key: job_id for job_id, key in rows if key is not None}
    held: dict[str, int] = {}
    waiting = [key for key in waiting if key not in new]
    tries = 1
    while waiting:
        held.update(run(plan.connection, UNIQUE_HOLDER_IDS, {"unique_keys": waiting}))
        waiting = [key for key in waiting if key not in held]
        if not waiting:
            break
        # Their holders left the window between the insert and the read: try again.
        if tries == UNIQUE_TRIES:
            raise _busy(plan.fields, waiting)
        tries += 1
        rows = _insert_many(plan, ENQUEUE_UNIQUE, [first[key] for key in waiting], waiting)
        new.update((key, job_id) for job_id, key in rows)
        waiting = [key for key in waiting if key not in new]
    return keyless, new, held


def _insert_many(
    plan: Plan,
    statement: LiteralString,
    indexes: list[int],
    keys: Sequence[str | None] | None,
) -> list[tuple[Any, ...]]:
    """Run a bulk INSERT of the payloads at ``indexes``, with their unique ``keys``; its
    rows are (id[, unique_key]), skipped keys missing."""
    payloads = validation.encode([plan.payloads[i] for i in indexes])
    locks = None if plan.locks is None else [plan.locks[i] for i in indexes]
    params = {"payloads": payloads, "unique_keys": keys, "lock_keys": locks}
    return run(plan.connection, statement, plan.params | params)


def _holder(plan: Plan, key: str) -> Job | None:
    """The job that holds this unique key now, or ``None`` if no job does."""
    rows = plan.manager.get_queryset().using(plan.alias).raw(UNIQUE_HOLDER, {"unique_key": key})
    return next(iter(rows), None)


def _announce(plan: Plan, *, job: Job | None = None, ids: Sequence[int] = ()) -> None:
    """Send ``job_enqueued`` for the new ``job`` (or each new job of ``ids``, read back in
    one query) once the enqueue's transaction commits, as the NOTIFY is: at once in
    autocommit, never for a rolled-back one. Only for ``@job`` functions, and only when
    someone listens: otherwise an enqueue pays one check. Under manual transaction
    management (``set_autocommit(False)``) Django has no ``on_commit``, so none is sent."""
    from django_pgjobs.models import Job as sender

    if not plan.announce or not signals.listening(signals.job_enqueued, sender):
        return
    connection = connections[plan.alias]
    if not connection.in_atomic_block and not connection.get_autocommit():
        return
    alias = plan.alias

    def send() -> None:
        # After the commit: whatever goes wrong here (the read-back, a receiver) must not
        # reach the caller, whose jobs are in the table (a retried enqueue would repeat
        # them), nor stop Django's later on_commit hooks.
        try:
            jobs = [job] if job is not None else sender.objects.using(alias).filter(id__in=ids)
            for each in sorted(jobs, key=lambda row: row.id):
                signals.send(signals.job_enqueued, sender, job=each)
        except Exception:
            logger.exception(
                "job_enqueued was not sent for %s committed job(s)",
                1 if job is not None else len(ids),
                extra={"action": "enqueue"},
            )

    transaction.on_commit(send, using=alias)
