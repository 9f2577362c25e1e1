"""How a statement is run: on a Django connection, a psycopg connection, or a worker's cursor."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeAlias

import psycopg
from django.core.exceptions import ImproperlyConfigured
from psycopg.errors import (
    DuplicatePreparedStatement,
    InvalidSqlStatementName,
    ProtocolViolation,
)
from psycopg.pq import ExecStatus

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper
    from typing_extensions import LiteralString


# A Django connection, a psycopg connection, or the cursor a worker runs its statements on
# (connections.DirectConnections.cursor()).
Connection: TypeAlias = "BaseDatabaseWrapper | psycopg.Connection[Any] | psycopg.Cursor[Any]"


def run(
    connection: Connection, statement: LiteralString, params: Mapping[str, Any]
) -> list[tuple[Any, ...]]:
    """Execute one statement; return its rows (none for a statement without a result)."""
    if isinstance(connection, (psycopg.Connection, psycopg.Cursor)):
        try:
            result = connection.execute(statement, params)
        except (InvalidSqlStatementName, DuplicatePreparedStatement, ProtocolViolation) as exc:
            # The prepared statement is gone, or is another's ("bind message supplies N
            # parameters"): a transaction-mode pooler handed this client another session.
            if isinstance(exc, ProtocolViolation) and "bind message" not in str(exc):
                raise
            raise ImproperlyConfigured(
                f"Prepared statement error on the worker's connection ({exc}): the database "
                "is probably behind a transaction-mode pooler without prepared-statement "
                "support (PgBouncer before 1.21, or max_prepared_statements = 0). Set "
                "PGJOBS['PREPARE'] = False."
            ) from exc
        return result.fetchall() if _has_rows(result) else []
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        return cursor.fetchall() if _has_rows(cursor.cursor) else []


def _has_rows(cursor: psycopg.Cursor[Any]) -> bool:
    """Whether the statement returned rows (even none). Read from the result's status:
    ``cursor.description`` says the same but builds an object per column, a cost that showed
    in every enqueue."""
    result = cursor.pgresult
    return result is not None and result.status == ExecStatus.TUPLES_OK


def records(
    connection: BaseDatabaseWrapper, statement: LiteralString, params: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """Execute one query; return its rows as dicts keyed by column name."""
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        names = [column.name for column in cursor.description]
        return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def count(
    connection: BaseDatabaseWrapper, statement: LiteralString, params: Mapping[str, Any]
) -> int:
    """Execute one statement that returns no rows; return how many rows it changed."""
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        return int(cursor.rowcount)


class TextArray(str):
    """A ``text[]`` parameter written out once as PostgreSQL's array literal: a worker sends
    its registry's names with every claim, and psycopg would adapt a list of them element by
    element each time, in the producer's thread. Sent as text and cast (``::text[]``)."""

    __slots__ = ()

    @classmethod
    def of(cls, values: Iterable[str]) -> TextArray:
        quoted = ('"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for v in values)
        return cls("{" + ",".join(quoted) + "}")
