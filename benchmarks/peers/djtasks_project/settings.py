"""Settings of the django-tasks-db peer: one database (PEERS_DSN), the database task backend.

Self-contained: nothing of django-pgjobs. DEBUG is off, as in production (with DEBUG on,
Django keeps every query in memory and the worker would also default to ``--reload``).
"""

from __future__ import annotations

import os
from urllib.parse import unquote, urlsplit

_url = urlsplit(os.environ.get("PEERS_DSN", "postgres://postgres@127.0.0.1:5432/postgres"))

SECRET_KEY = "peer-benchmark-not-secret"  # noqa: S105
DEBUG = False
USE_TZ = True
ALLOWED_HOSTS: list[str] = []
INSTALLED_APPS = ["django_tasks_db"]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _url.path.lstrip("/"),
        "USER": unquote(_url.username or ""),
        "PASSWORD": unquote(_url.password or ""),
        "HOST": _url.hostname or "",
        "PORT": str(_url.port or ""),
    }
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
TASKS = {"default": {"BACKEND": "django_tasks_db.DatabaseBackend"}}
