"""Factories, clocks, listeners and threads for the test-suite.

Rows are written with raw SQL so a test can put a job in any state (a running job whose lease
ran out an hour ago, a done job finished last week) without going through the verbs under
test. A time column given as a ``timedelta`` is measured from the database's ``now()``, the
only clock the queue trusts.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from typing import Any, TypeVar

import psycopg
from django.db import connections
from psycopg import sql as pgsql

T = TypeVar("T")

# How long a test waits for something that takes milliseconds on an idle machine. A passing
# test never waits this long, so it can be generous: on a CI runner whose cores are all busy a
# worker process can take seconds to start. What a test shows must never hang on this number
# (no "done within N s"): a test that waits it out is failing.
PATIENCE = 60.0

NOOP = "testproject.testjobs.noop"
TIME_COLUMNS = ("run_at", "locked_until", "created_at", "started_at", "finished_at")
PLAIN_COLUMNS = ("queue", "status", "priority", "attempts", "max_attempts", "last_error")
COLUMNS = (
    "id",
    "queue",
    "task",
    "payload",
    "status",
    "priority",
    "run_at",
    "attempts",
    "max_attempts",
    "locked_until",
    "last_error",
    "created_at",
    "started_at",
    "finished_at",
)


def wait_until(
    predicate: Callable[[], T],
    timeout: float = PATIENCE,
    interval: float = 0.01,
    message: str = "",
) -> T:
    """Poll ``predicate`` until it returns something truthy (returned); fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {message or predicate}")
        time.sleep(interval)


def _values(
    task: str, payload: Any, fields: dict[str, Any]
) -> tuple[list[str], list[str], list[Any]]:
    unknown = set(fields) - set(TIME_COLUMNS) - set(PLAIN_COLUMNS)
    if unknown:
        raise TypeError(f"make_job() got unknown columns {sorted(unknown)}")
    names = ["task", "payload"]
    slots = ["%s", "%s::jsonb"]
    params: list[Any] = [task, json.dumps({} if payload is None else payload)]
    for name, value in fields.items():
        names.append(name)
        if isinstance(value, timedelta):
            slots.append("now() + %s::interval")
        elif name in TIME_COLUMNS:
            slots.append("%s::timestamptz")
        else:
            slots.append("%s")
        params.append(value)
    return names, slots, params


def make_job(
    *,
    task: str = NOOP,
    payload: dict[str, Any] | None = None,
    using: str = "default",
    **fields: Any,
) -> int:
    """Insert one job in any state and return its id; unset columns take the table defaults.

    ``make_job(status="running", attempts=1, locked_until=timedelta(minutes=-1))`` is a job
    whose worker vanished a minute ago.
    """
    names, slots, params = _values(task, payload, fields)
    statement = (
        f"INSERT INTO pgjobs_job ({', '.join(names)}) VALUES ({', '.join(slots)}) RETURNING id"
    )
    with connections[using].cursor() as cursor:
        cursor.execute(statement, params)
        return int(cursor.fetchone()[0])


def make_jobs(count: int, *, task: str = NOOP, using: str = "default", **fields: Any) -> list[int]:
    """Insert ``count`` jobs alike but for their payload (``{"n": i}``); return ids in order."""
    names, slots, params = _values(task, {}, fields)
    names[1:2] = []
    slots[1:2] = []
    params[1:2] = []
    statement = (
        f"INSERT INTO pgjobs_job ({', '.join(names)}, payload) "
        f"SELECT {', '.join(slots)}, jsonb_build_object('n', n) "
        "FROM generate_series(1, %s) AS n ORDER BY n RETURNING id"
    )
    with connections[using].cursor() as cursor:
        cursor.execute(statement, [*params, count])
        return sorted(int(row[0]) for row in cursor.fetchall())


def job_row(job_id: int, using: str = "default") -> dict[str, Any]:
    """Every column of one job, straight from the table."""
    with connections[using].cursor() as cursor:
        cursor.execute(f"SELECT {', '.join(COLUMNS)} FROM pgjobs_job WHERE id = %s", [job_id])
        row = cursor.fetchone()
    if row is None:
        raise AssertionError(f"job {job_id} does not exist")
    values = dict(zip(COLUMNS, row, strict=True))
    # Django's psycopg setup hands jsonb back as text (JSONField decodes it itself).
    if isinstance(values["payload"], str):
        values["payload"] = json.loads(values["payload"])
    return values


def query(statement: str, params: Any = None, using: str = "default") -> list[tuple[Any, ...]]:
    with connections[using].cursor() as cursor:
        cursor.execute(statement, params)
        return list(cursor.fetchall())


def scalar(statement: str, params: Any = None, using: str = "default") -> Any:
    rows = query(statement, params, using)
    assert len(rows) == 1 and len(rows[0]) == 1, rows
    return rows[0][0]


def db_now(using: str = "default") -> datetime:
    return scalar("SELECT now()", using=using)


def status_counts(using: str = "default") -> dict[str, int]:
    return dict(query("SELECT status, count(*) FROM pgjobs_job GROUP BY status", using=using))


@contextlib.contextmanager
def statement_timeout(seconds: float, using: str = "default") -> Iterator[None]:
    """Make a statement that would wait on someone else's lock fail after ``seconds``."""
    with connections[using].cursor() as cursor:
        cursor.execute(
            "SELECT set_config('statement_timeout', %s, false)", [f"{int(seconds * 1000)}ms"]
        )
    try:
        yield
    finally:
        with connections[using].cursor() as cursor:
            cursor.execute("RESET statement_timeout")


def raw_connect(using: str = "default") -> psycopg.Connection[Any]:
    """A psycopg connection of its own, outside Django, to the alias's (test) database."""
    settings = connections[using].settings_dict
    params = {
        "dbname": settings["NAME"],
        "user": settings.get("USER") or None,
        "password": settings.get("PASSWORD") or None,
        "host": settings.get("HOST") or None,
        "port": settings.get("PORT") or None,
    }
    return psycopg.connect(**{k: v for k, v in params.items() if v is not None}, autocommit=True)


@contextlib.contextmanager
def listening(channel: str = "pgjobs", using: str = "default") -> Iterator[Listener]:
    """LISTEN on ``channel`` from a second connection for the duration of the block."""
    with raw_connect(using) as conn:
        conn.execute(pgsql.SQL("LISTEN {}").format(pgsql.Identifier(channel)))
        yield Listener(conn, channel)


class Listener:
    def __init__(self, conn: psycopg.Connection[Any], channel: str) -> None:
        self.conn = conn
        self.channel = channel

    def heard(self) -> list[str]:
        """Every payload that reached the channel so far, and nothing of what comes later: a
        marker sent now arrives after each of them, and ends the read."""
        self.conn.execute("SELECT pg_notify(%s, 'marker')", [self.channel])
        payloads = []
        for note in self.conn.notifies(timeout=PATIENCE):
            if note.payload == "marker":
                return payloads
            payloads.append(note.payload)
        raise AssertionError("the marker NOTIFY never came back")

    def receive(self, expected: int, timeout: float = PATIENCE) -> list[str]:
        """Up to ``expected`` payloads: returns as soon as they are in, or after ``timeout``."""
        return [n.payload for n in self.conn.notifies(timeout=timeout, stop_after=expected)]

    def quiet(self, timeout: float = 0.3) -> list[str]:
        """Whatever arrives within ``timeout``: a test of silence expects ``[]``."""
        return [n.payload for n in self.conn.notifies(timeout=timeout)]


class DbThread(threading.Thread):
    """Run ``target`` in a thread with its own Django connections, closed at the end.

    ``result()`` joins it and returns what ``target`` returned, or re-raises what it raised.
    """

    def __init__(self, target: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        super().__init__(daemon=True)
        self._call = (target, args, kwargs)
        self._value: Any = None
        self._error: BaseException | None = None

    def run(self) -> None:
        target, args, kwargs = self._call
        try:
            self._value = target(*args, **kwargs)
        except BaseException as exc:
            self._error = exc
        finally:
            connections.close_all()

    def result(self, timeout: float = 30.0) -> Any:
        self.join(timeout)
        if self.is_alive():
            raise AssertionError(f"thread {self.name} still running after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._value


def nested(depth: int) -> list[Any]:
    """``depth`` lists, each inside the previous one (a value nested ``depth`` levels deep)."""
    outer: list[Any] = []
    inner = outer
    for _ in range(depth - 1):
        inner.append([])
        inner = inner[0]
    return outer


def worker_record(
    worker_id: str,
    queues: dict[str, int | None],
    tasks: list[str] | None,
    ttl: timedelta = timedelta(minutes=5),
    host: str = "web-1",
) -> dict[str, Any]:
    """The parameters of ``upkeep.WORKER_BEAT`` for a worker's registry row, as a worker writes
    it on its tick; a negative ``ttl`` is a row already expired."""
    return {
        "worker_id": worker_id,
        "host": host,
        "pid": 4242,
        "mode": "lease",
        "queues": json.dumps(queues),
        "tasks": tasks,
        "version": "9.9.9",
        "started_at": datetime.now(dt_timezone.utc),
        "ttl": ttl,
    }


def http_get(
    url: str, headers: dict[str, str] | None = None, method: str = "GET"
) -> tuple[int, dict[str, str], bytes]:
    """One real HTTP request (to ``live_server``): status, headers and body, for any status."""
    request = urllib.request.Request(url, headers=headers or {}, method=method)  # noqa: S310
    try:
        with urllib.request.urlopen(request, timeout=PATIENCE) as response:  # noqa: S310
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        with error:
            return error.code, dict(error.headers), error.read()


def session_cookie(user: Any) -> str:
    """A ``Cookie`` header value that signs ``user`` in on a real HTTP request (the session
    is saved in the database, which the live server reads)."""
    from django.conf import settings
    from django.test import Client

    client = Client()
    client.force_login(user)
    name = settings.SESSION_COOKIE_NAME
    return f"{name}={client.cookies[name].value}"


def register_worker(
    worker_id: str, queues: dict[str, int | None], tasks: list[str] | None = None
) -> None:
    """A live worker's registry row, written with the worker's own ``upkeep.WORKER_BEAT``."""
    from django_pgjobs.core import execute, upkeep

    execute.run(connections["default"], upkeep.WORKER_BEAT, worker_record(worker_id, queues, tasks))
