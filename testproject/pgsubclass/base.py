"""A database backend built on Django's PostgreSQL one under another name, as PostGIS is.

The system checks must accept it: django-pgjobs needs a PostgreSQL server, whatever the
backend's ENGINE path says (tests/test_checks.py; PostGIS itself needs GDAL to load).
"""

from __future__ import annotations

from django.db.backends.postgresql.base import DatabaseWrapper as PostgreSQLDatabaseWrapper


class DatabaseWrapper(PostgreSQLDatabaseWrapper):
    """Django's PostgreSQL backend, unchanged: its vendor is "postgresql"."""
