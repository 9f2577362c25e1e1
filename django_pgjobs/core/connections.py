"""Direct psycopg connections to the server behind a Django database alias.

The LISTEN connection, the notifier's and a lease-mode worker's own connections bypass Django's
connection handling: they are built here from the alias's settings, so every one of them
reaches the same server, as the same user, with the same options.
"""

from __future__ import annotations

import threading
from typing import Any

import psycopg
from django.db import connections

# Options Django understands but libpq does not.
_DJANGO_ONLY_OPTIONS = {"isolation_level", "server_side_binding", "assume_role", "pool"}


def connection_params(alias: str, application_name: str | None = None) -> dict[str, Any]:
    """libpq parameters for a direct psycopg connection to the server behind ``alias``.

    ``application_name`` names the connection unless the alias's ``OPTIONS`` name it; left
    out, it is named as Django's own connections are (``OPTIONS``, else ``PGAPPNAME``).
    """
    settings_dict = connections[alias].settings_dict
    params: dict[str, Any] = {
        "dbname": settings_dict["NAME"],
        "user": settings_dict.get("USER") or None,
        "password": settings_dict.get("PASSWORD") or None,
        "host": settings_dict.get("HOST") or None,
        "port": settings_dict.get("PORT") or None,
        # Notice a half-open socket without sending a query (which would keep serverless
        # compute awake): the kernel probes an idle connection and fails it if unanswered.
        "keepalives": 1,
        "keepalives_idle": 60,
        "keepalives_interval": 10,
        "keepalives_count": 3,
        "application_name": application_name,
    }
    params.update(
        (key, value)
        for key, value in settings_dict.get("OPTIONS", {}).items()
        if key not in _DJANGO_ONLY_OPTIONS
    )
    return {key: value for key, value in params.items() if value is not None}


class DirectConnections:
    """A lease-mode worker's own psycopg connections for its hot statements, one per thread.

    The claim and the fenced writes are a handful of statements run thousands of times: on
    a plain autocommit connection they skip Django's cursor wrappers, and with ``prepare``
    (``PGJOBS["PREPARE"]``) the server plans each once per connection instead of on every
    call. Behind a transaction-mode pooler without prepared-statement support (PgBouncer
    before 1.21, or ``max_prepared_statements = 0``) set ``PREPARE`` to False, or the
    alias's ``DISABLE_SERVER_SIDE_CURSORS`` to True as Django asks of such an alias. A
    broken connection is replaced on the next ``get()``; the worker closes one after an
    outage, so a server that went read-only is not asked again on the same session.
    """

    def __init__(self, alias: str, *, prepare: bool) -> None:
        self.params = connection_params(alias)
        # The alias's own OPTIONS["prepare_threshold"] is kept (None there means "never");
        # otherwise prepare at the first execution.
        settings_dict = connections[alias].settings_dict
        options = settings_dict.get("OPTIONS", {})
        self.params.pop("prepare_threshold", None)
        threshold = options.get("prepare_threshold", 0)
        # DISABLE_SERVER_SIDE_CURSORS is what Django asks of an alias behind a transaction
        # pooler: such an alias gets no prepared statements either.
        if settings_dict.get("DISABLE_SERVER_SIDE_CURSORS"):
            prepare = False
        self.prepare_threshold = threshold if prepare else None
        self._local = threading.local()

    def get(self) -> psycopg.Connection[Any]:
        conn: psycopg.Connection[Any] | None = getattr(self._local, "conn", None)
        if conn is None or conn.closed or conn.broken:
            if conn is not None:
                conn.close()
            conn = psycopg.connect(
                **self.params, autocommit=True, prepare_threshold=self.prepare_threshold
            )
            # The one explicit transaction on these connections, the guarded claim, counts
            # what the claims before it committed: it needs READ COMMITTED's fresh snapshot
            # per statement, whatever the server's default_transaction_isolation says.
            conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED
            self._local.conn = conn
        return conn

    def cursor(self) -> psycopg.Cursor[Any]:
        """The calling thread's one cursor on its connection (``get()``), for every statement.

        ``connection.execute()`` builds a cursor, and a map of its adapters, per statement:
        a quarter of the client's CPU for a small statement (23 of 90 µs, ``timeit``). A
        statement's rows must be read before the next one runs, as ``execute.run()`` does."""
        conn = self.get()
        cursor: psycopg.Cursor[Any] | None = getattr(self._local, "cursor", None)
        if cursor is None or cursor.connection is not conn or cursor.closed:
            cursor = self._local.cursor = conn.cursor()
        return cursor

    def close(self) -> None:
        """Close the calling thread's connection."""
        conn = getattr(self._local, "conn", None)
        self._local.cursor = None
        if conn is not None:
            self._local.conn = None
            conn.close()
