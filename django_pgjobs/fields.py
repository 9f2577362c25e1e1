"""A PostgreSQL array column for the ORM, without ``django.contrib.postgres``.

``pgjobs_queue.starts`` (timestamptz[]) and ``pgjobs_worker.tasks`` (text[]) are written by
the app's own SQL and only read through the ORM (the admin). Django's ``ArrayField`` would
make every project add ``django.contrib.postgres`` to INSTALLED_APPS (Django 6 refuses the
field without it, postgres.E005); psycopg already reads an array as a list and writes a list
as an array, so this field only has to name the column's type.
"""

from __future__ import annotations

from typing import Any

from django.db import models
from django.db.backends.base.base import BaseDatabaseWrapper

__all__ = ["PgArray"]


class PgArray(models.Field):  # type: ignore[type-arg]
    """A column of type ``<base>[]``, read and written as a Python list."""

    def __init__(self, base: str, **kwargs: Any) -> None:
        self.base = base
        super().__init__(**kwargs)

    def db_type(self, connection: BaseDatabaseWrapper) -> str:
        return f"{self.base}[]"

    def deconstruct(self) -> Any:
        name, path, args, kwargs = super().deconstruct()
        return name, path, [self.base, *args], kwargs
