"""NOTIFY: a hint to listening workers that a queue has work, sent only once it is visible.

The payload is the queue name, never the job. ``PGJOBS["NOTIFY"]`` picks how it is sent:

- ``"auto"`` (the default). Outside ``atomic()`` the enqueue's own INSERT calls ``pg_notify``
  (``enqueue.ENQUEUE_ONE`` / ``enqueue.ENQUEUE``, and their ``_UNIQUE`` forms): one statement, one
  commit, and PostgreSQL delivers the notification only when that transaction commits (never
  on rollback, once per channel and payload per transaction). A NOTIFY the server refuses
  then refuses the INSERT with it.
  Inside ``atomic()`` the enqueue registers an ``on_commit`` hook, once per queue per
  transaction, which hands the queue to this process's ``Notifier`` thread: the caller's
  commit does not take the database-wide lock that NOTIFYing transactions serialize on at
  commit, and under heavy enqueue the thread sends one NOTIFY for everything committed while
  it was busy.
- ``"background"``: the hook and the thread, in autocommit too.
- ``"inline"``: the hook sends the NOTIFY on the caller's own connection right after the
  commit (for servers without threads, such as uWSGI without ``enable-threads``).

A NOTIFY sent after the commit that fails is logged, not raised: the job is already safe in
the table and the worker's poll will find it.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing.util
import os
import selectors
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import psycopg
from django.db import DatabaseError, connections, transaction
from psycopg.sql import SQL, Composed, Identifier

from django_pgjobs.core import conf, execute
from django_pgjobs.core.connections import connection_params
from django_pgjobs.core.types import reason

if TYPE_CHECKING:
    from typing_extensions import LiteralString

__all__ = ["notifier"]

# A hint, never the job: listeners re-run the claim. Sent after the enqueue's commit, once per
# queue, in one statement for every queue that has news. Its own transaction need not wait
# for the WAL flush (a crash drops every listener anyway), so it never adds an fsync.
NOTIFY: LiteralString = """
SELECT pg_notify(%(channel)s, q)
FROM unnest(%(queues)s::text[]) AS q, set_config('synchronous_commit', 'off', true)
"""


def listen(channel: str) -> Composed:
    """``LISTEN "channel"``: a channel is an identifier, so it is quoted, not bound."""
    return SQL("LISTEN {}").format(Identifier(channel))


# The LISTEN connection's health probe: the cheapest statement that needs a live server.
PROBE: LiteralString = "SELECT 1"


logger = logging.getLogger(__name__)


def _failed(queues: Iterable[str]) -> None:
    logger.warning(
        "NOTIFY for queue %s failed after commit; workers will find the jobs by polling",
        ", ".join(sorted(queues)),
        exc_info=True,
        extra={"action": "notify"},
    )


class _Notify:
    """The on_commit callback for one queue on one alias; equal ones are registered once."""

    __slots__ = ("alias", "queue")

    def __init__(self, alias: str, queue: str) -> None:
        self.alias = alias
        self.queue = queue

    def __call__(self) -> None:
        if conf.get("NOTIFY") != "inline":
            notifier.request(self.alias, conf.channel(), self.queue)
            return
        try:
            execute.run(
                connections[self.alias],
                NOTIFY,
                {"channel": conf.channel(), "queues": [self.queue]},
            )
        except DatabaseError:
            _failed([self.queue])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Notify) and (other.alias, other.queue) == (self.alias, self.queue)

    def __hash__(self) -> int:
        return hash((self.alias, self.queue))


def notify_on_commit(alias: str, queue: str) -> None:
    """Wake workers of ``queue`` when the current transaction commits (at once in autocommit)."""
    callback = _Notify(alias, queue)
    connection = connections[alias]
    # Django keeps pending hooks as (savepoint ids, callable, robust); a hook registered in a
    # savepoint that rolls back is dropped with it, so this never suppresses a needed NOTIFY.
    if connection.in_atomic_block and any(
        entry[1] == callback for entry in connection.run_on_commit
    ):
        return
    transaction.on_commit(callback, using=alias)


class Notifier:
    """Sends this process's NOTIFYs from one background thread, off the enqueuing path.

    ``request()`` only records ``(alias, channel) -> queue`` and wakes the thread, which sends
    one statement per alias and channel for every queue recorded since its last send: while
    one NOTIFY is on the wire, the next ones coalesce. The thread starts on the first request
    and, after ``idle`` seconds without one, closes its connections and exits (an idle
    process keeps no extra connection; serverless Postgres may suspend). ``flush()`` waits
    until everything requested has been sent; at interpreter exit the pending NOTIFYs are
    flushed, so a script that enqueues and exits still wakes the workers at once.
    """

    def __init__(self, idle: float = 10.0) -> None:
        self.idle = idle
        self._reset()
        os.register_at_fork(after_in_child=self._reset)
        atexit.register(self.shutdown)
        # A multiprocessing child ends with os._exit, which skips atexit, and clears the
        # finalizers it inherited: register the flush again once it has started.
        multiprocessing.util.register_after_fork(self, Notifier._flush_at_child_exit)

    @staticmethod
    def _flush_at_child_exit(notifier: Notifier) -> None:
        multiprocessing.util.Finalize(notifier, notifier.shutdown, exitpriority=0)

    def _reset(self) -> None:
        # After a fork the thread is gone; its connections belong to the parent: forget them.
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._pending: dict[tuple[str, str], set[str]] = {}
        self._sending = False
        self._stop = False
        self._thread: threading.Thread | None = None

    def request(self, alias: str, channel: str, queue: str) -> None:
        with self._lock:
            self._pending.setdefault((alias, channel), set()).add(queue)
            self._stop = False
            if self._thread is None:
                thread = threading.Thread(target=self._run, name="pgjobs-notifier", daemon=True)
                try:
                    thread.start()
                except RuntimeError:
                    # No thread to be had (a thread limit, or the interpreter shutting down):
                    # drop the hints; the job is committed and a poll will find it.
                    self._pending.clear()
                    _failed([queue])
                    return
                self._thread = thread
            self._wake.notify()

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every requested NOTIFY was sent (or failed); False on timeout."""
        with self._lock:
            return self._wake.wait_for(
                lambda: not self._pending and not self._sending, timeout=timeout
            )

    def shutdown(self, timeout: float = 5.0) -> None:
        """Send what is pending, then close the connections and end the thread."""
        self.flush(timeout)
        with self._lock:
            thread, self._stop = self._thread, True
            self._wake.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        links: dict[str, psycopg.Connection[Any]] = {}
        try:
            while True:
                with self._lock:
                    self._sending = False
                    self._wake.notify_all()
                    if not self._pending and not self._stop:
                        self._wake.wait(self.idle)
                    if not self._pending:
                        self._thread = None
                        return
                    batch, self._pending, self._sending = self._pending, {}, True
                for (alias, channel), queues in batch.items():
                    self._send(links, alias, channel, sorted(queues))
        finally:
            for link in links.values():
                link.close()

    @staticmethod
    def _send(
        links: dict[str, psycopg.Connection[Any]], alias: str, channel: str, queues: list[str]
    ) -> None:
        try:
            link = links.get(alias)
            if link is None or link.closed:
                params = connection_params(alias, "pgjobs-notifier")
                link = links[alias] = psycopg.connect(**params, autocommit=True)
            link.execute(NOTIFY, {"channel": channel, "queues": queues})
        except Exception:  # any failure: the thread must live on, and the NOTIFY is a hint
            bad = links.pop(alias, None)
            if bad is not None:
                bad.close()
            _failed(queues)


notifier = Notifier()


class Listener(threading.Thread):
    """Holds ``LISTEN <channel>`` on its own direct connection and wakes the worker.

    ``on_wake`` is called for every notification naming one of ``queues``, and once after
    each (re)connect: notifications sent while we were not listening are lost, so the worker
    must look at the table at once (the catch-up claim). A notification is only a hint.

    The connection is probed with ``SELECT 1`` when the worker asks (``probe()``, on its
    periodic tick, so the probe never adds a wake-up of its own); a dead connection is
    replaced, with backoff, until ``stop()``. The thread sleeps in ``select()`` on the
    connection's socket and on a pipe of its own, so ``stop()`` and ``probe()`` take effect
    at once and an idle listener wakes for nothing else.
    """

    def __init__(
        self,
        alias: str,
        queues: Iterable[str],
        on_wake: Callable[[], None],
    ) -> None:
        super().__init__(name="pgjobs-listener", daemon=True)
        self.alias = alias
        self.queues = frozenset(queues)
        self.on_wake = on_wake
        self._stopping = threading.Event()
        self._probe = threading.Event()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._pipe_lock = threading.Lock()
        self._pipe_closed = False

    def stop(self) -> None:
        self._stopping.set()
        self._poke()

    def probe(self) -> None:
        """Check the connection now (the listening thread wakes for it)."""
        self._probe.set()
        self._poke()

    def _poke(self) -> None:
        # Under the lock that closes the pipe: once closed, its numbers may already belong to
        # another file. A full pipe already holds a wake-up.
        with self._pipe_lock:
            if not self._pipe_closed:
                with contextlib.suppress(BlockingIOError):
                    os.write(self._wake_write, b"x")

    def run(self) -> None:
        try:
            self._run()
        finally:
            with self._pipe_lock:
                self._pipe_closed = True
                os.close(self._wake_read)
                os.close(self._wake_write)

    def _run(self) -> None:
        delay = 0.0
        params = connection_params(self.alias, "pgjobs-listener")
        channel = conf.channel()
        while not self._stopping.is_set():
            try:
                with psycopg.connect(**params, autocommit=True) as conn:
                    conn.execute(listen(channel))
                    if delay:
                        logger.warning(
                            "LISTEN connection re-established on %s",
                            self.alias,
                            extra={"action": "listen"},
                        )
                    delay = 0.0
                    self.on_wake()
                    self._listen(conn)
            except Exception as exc:  # psycopg's, or anything else: the listener lives on
                if self._stopping.is_set():
                    return
                delay = min(max(delay * 2, 0.5), 30.0)
                logger.warning(
                    "LISTEN connection to %s lost (%s); reconnecting in %.1f s",
                    self.alias,
                    reason(exc),
                    delay,
                    extra={"action": "listen"},
                )
                self._stopping.wait(delay)

    def _listen(self, conn: psycopg.Connection[Any]) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(conn.fileno(), selectors.EVENT_READ)
            selector.register(self._wake_read, selectors.EVENT_READ)
            self._wait_for_notifies(conn, selector)

    def _wait_for_notifies(
        self, conn: psycopg.Connection[Any], selector: selectors.BaseSelector
    ) -> None:
        while not self._stopping.is_set():
            # Notifications that arrived with the last statement's reply come first; then
            # sleep until the server sends something or stop()/probe() pokes the pipe.
            for note in conn.notifies(timeout=0):
                if note.payload in self.queues:
                    self.on_wake()
            ready = [key.fd for key, _ in selector.select()]
            if self._wake_read in ready:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_read, 4096)
            if self._probe.is_set() and not self._stopping.is_set():
                self._probe.clear()
                conn.execute(PROBE)
