"""A small real site that uses django-pgjobs the way a user would.

The database comes from DATABASE_URL (``make demo`` and ``make test`` set it, starting a
throwaway PostgreSQL when none is given). The ``listen`` alias is the same server, used by
the worker's ``--listen-database`` option as a deployment behind PgBouncer would.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import dj_database_url
import django

BASE_DIR = Path(__file__).resolve().parent
SECRET_KEY = os.environ.get("SECRET_KEY", "testproject-only-not-secret")
DEBUG = os.environ.get("DEBUG", "") == "1"
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]

DATABASE_URL = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres")
DATABASES: dict[str, dict[str, Any]] = {
    "default": dict(dj_database_url.parse(DATABASE_URL)),
    # The alias a worker LISTENs on (runjobs --listen-database listen). LISTEN_DATABASE_URL
    # points it elsewhere, e.g. at PostgreSQL directly when "default" goes through PgBouncer.
    "listen": {
        **dj_database_url.parse(os.environ.get("LISTEN_DATABASE_URL", DATABASE_URL)),
        "TEST": {"MIRROR": "default"},
    },
}
if os.environ.get("PGJOBS_TEST_DB_OPTIONS"):
    # Extra OPTIONS for every alias, as JSON, to run the suite on another configuration
    # (docs/development.md).
    for alias in DATABASES.values():
        alias["OPTIONS"] = {
            **alias.get("OPTIONS", {}),
            **json.loads(os.environ["PGJOBS_TEST_DB_OPTIONS"]),
        }
# The same database with Django's server_side_binding and psycopg's prepare_threshold (0:
# every statement prepared at its first run), the configuration of docs/enqueue.md's faster
# enqueue, which its tests use. Its own two options win over PGJOBS_TEST_DB_OPTIONS.
DATABASES["prepared"] = {
    **DATABASES["default"],
    "OPTIONS": {
        **DATABASES["default"].get("OPTIONS", {}),
        "server_side_binding": True,
        "prepare_threshold": 0,
    },
    "TEST": {"MIRROR": "default"},
}
if os.environ.get("PGJOBS_TEST_DATABASE_NAME"):
    # Worker processes started by the tests must use the test database pytest created.
    for alias in DATABASES.values():
        alias["NAME"] = os.environ["PGJOBS_TEST_DATABASE_NAME"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_pgjobs",
    "testproject.shop",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]

ROOT_URLCONF = "testproject.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
WSGI_APPLICATION = "testproject.wsgi.application"
STATIC_URL = "static/"
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

TASKS = {
    "default": {
        "BACKEND": "django_pgjobs.backends.PgJobsBackend",
        "QUEUES": ["default", "emails", "reports"],
        "OPTIONS": {"MAX_ATTEMPTS": 3, "BACKOFF_BASE": 1.0, "BACKOFF_MAX": 60.0},
    }
}
if django.VERSION < (6, 0):
    INSTALLED_APPS.append("django_tasks")  # the backport of django.tasks

PGJOBS: dict[str, Any] = {
    "IMPORTS": ["testproject.testjobs"],
    "LISTEN_DATABASE": "listen",
}
# The levers of the worker's and the enqueue's speed, settable per process (tests behind
# PgBouncer, the benchmark's comparisons): PGJOBS_PREPARE=false, PGJOBS_NOTIFY=inline, ...
_WORDS = {"true": True, "false": False, "none": None}
for _name in ("NOTIFY", "PREPARE", "WORKER_SYNCHRONOUS_COMMIT", "COMPLETE_WITH_CLAIM"):
    if f"PGJOBS_{_name}" in os.environ:
        _value = os.environ[f"PGJOBS_{_name}"]
        PGJOBS[_name] = _WORDS.get(_value.lower(), _value)

# Extra job modules for one process (the async jobs' tests), comma-separated.
if os.environ.get("PGJOBS_IMPORTS"):
    PGJOBS["IMPORTS"] += os.environ["PGJOBS_IMPORTS"].split(",")

# Periodic schedules for one process (the admin's browser test), as JSON: PGJOBS["SCHEDULE"].
if os.environ.get("PGJOBS_SCHEDULE"):
    PGJOBS["SCHEDULE"] = json.loads(os.environ["PGJOBS_SCHEDULE"])

LOGGING: dict[str, Any] = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "loggers": {
        "django_pgjobs": {
            "handlers": ["console"],
            "level": os.environ.get("PGJOBS_LOG_LEVEL", "INFO"),
        }
    },
}
# The tests' record of the worker's warnings and errors with their `extra` fields, as an error
# reporter sees them: PGJOBS_TEST_LOG_RECORDS=<file> (tests/signal_receivers.py).
if os.environ.get("PGJOBS_TEST_LOG_RECORDS"):
    LOGGING["handlers"]["records"] = {
        "class": "tests.signal_receivers.RecordHandler",
        "path": os.environ["PGJOBS_TEST_LOG_RECORDS"],
    }
    LOGGING["loggers"]["django_pgjobs"]["handlers"].append("records")
