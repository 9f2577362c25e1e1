"""System checks: each id fires for its bad setting, and none for the defaults."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.core import checks as django_checks
from django.core.exceptions import ImproperlyConfigured
from django.db import connection
from django.db.utils import load_backend
from django.test import override_settings

from django_pgjobs.core import checks, conf, validation

VALID: dict[str, Any] = {
    "DATABASE": "default",
    "LISTEN_DATABASE": "listen",
    "CHANNEL": "jobs_1",
    "QUEUE": "work.high",
    "MAX_ATTEMPTS": 1,
    "LEASE": 1,
    "CONCURRENCY": 32,
    "ASYNC_CONCURRENCY": 500,
    "BATCH_SIZE": 1,
    "POLL_INTERVAL": 0.5,
    "REAP_INTERVAL": 0,
    "MODE": "transaction",
    "SHUTDOWN_TIMEOUT": 0,
    "IMPORTS": ("testproject.testjobs",),
    "BACKOFF_BASE": 0,
    "BACKOFF_MAX": 0.5,
    "NOTIFY": "inline",
    "WORKER_SYNCHRONOUS_COMMIT": None,
    "PREPARE": False,
    "COMPLETE_WITH_CLAIM": True,
    "CLAIM_REGISTERED_ONLY": False,
    "MAX_CRASHES": 1,
    "MAX_STUCK_EXECUTORS": 1,
    "SCHEDULE": {"nightly": {"task": "testproject.testjobs.noop", "cron": "0 2 * * *"}},
    "HEALTH_THRESHOLDS": {"lag": 60, "slot_age": 0},
    "MONITORING_TOKEN": "a-monitoring-token-of-32-characters",
}

BAD: list[tuple[Any, str]] = [
    (["QUEUE", "x"], "pgjobs.E001"),
    ({"CONCURENCY": 4}, "pgjobs.E003"),
    ({"MAX_ATTEMPTS": 0}, "pgjobs.E002"),
    ({"MAX_ATTEMPTS": 2.5}, "pgjobs.E002"),
    ({"MAX_CRASHES": 0}, "pgjobs.E002"),
    ({"MAX_STUCK_EXECUTORS": "3"}, "pgjobs.E002"),
    ({"CONCURRENCY": "4"}, "pgjobs.E002"),
    ({"CONCURRENCY": 0}, "pgjobs.E002"),
    ({"ASYNC_CONCURRENCY": 0}, "pgjobs.E002"),
    ({"ASYNC_CONCURRENCY": "100"}, "pgjobs.E002"),
    ({"BATCH_SIZE": True}, "pgjobs.E002"),
    ({"BATCH_SIZE": -1}, "pgjobs.E002"),
    ({"LEASE": 0.5}, "pgjobs.E002"),
    ({"LEASE": "300"}, "pgjobs.E002"),
    ({"LEASE": float("nan")}, "pgjobs.E002"),
    ({"LEASE": float("inf")}, "pgjobs.E002"),
    ({"POLL_INTERVAL": 0}, "pgjobs.E002"),
    ({"POLL_INTERVAL": None}, "pgjobs.E002"),
    ({"REAP_INTERVAL": -1}, "pgjobs.E002"),
    ({"SHUTDOWN_TIMEOUT": -0.1}, "pgjobs.E002"),
    # Values the table or a timedelta cannot hold (the check itself used to raise
    # OverflowError on an int too large for a float).
    ({"MAX_ATTEMPTS": 2**31}, "pgjobs.E002"),
    ({"CONCURRENCY": 2**31}, "pgjobs.E002"),
    ({"LEASE": 10**400}, "pgjobs.E002"),
    ({"LEASE": 1e300}, "pgjobs.E002"),
    ({"POLL_INTERVAL": 1e300}, "pgjobs.E002"),
    ({"SHUTDOWN_TIMEOUT": float("inf")}, "pgjobs.E002"),
    ({"BACKOFF_MAX": 1e300}, "pgjobs.E002"),
    ({"MODE": "batch"}, "pgjobs.E004"),
    ({"QUEUE": ""}, "pgjobs.E005"),
    ({"QUEUE": "two words"}, "pgjobs.E005"),
    ({"DATABASE": "nowhere"}, "pgjobs.E006"),
    ({"LISTEN_DATABASE": "nowhere"}, "pgjobs.E006"),
    ({"CHANNEL": ""}, "pgjobs.E007"),
    ({"CHANNEL": "c" * 64}, "pgjobs.E007"),
    ({"CHANNEL": None}, "pgjobs.E007"),
    # PostgreSQL counts an identifier's bytes, not its characters: 80 bytes here.
    ({"CHANNEL": "é" * 40}, "pgjobs.E007"),
    ({"CHANNEL": "jobs\x00"}, "pgjobs.E007"),
    ({"IMPORTS": "testproject.testjobs"}, "pgjobs.E008"),
    ({"IMPORTS": [1]}, "pgjobs.E008"),
    ({"BACKOFF_BASE": -1}, "pgjobs.E002"),
    ({"BACKOFF_MAX": "1h"}, "pgjobs.E002"),
    ({"BACKOFF_BASE": 100_000}, "pgjobs.E009"),
    ({"BACKOFF_BASE": 60, "BACKOFF_MAX": 30}, "pgjobs.E009"),
    ({"WORKER_SYNCHRONOUS_COMMIT": False}, "pgjobs.E011"),
    ({"WORKER_SYNCHRONOUS_COMMIT": "of"}, "pgjobs.E011"),
    ({"NOTIFY": "after_commit"}, "pgjobs.E012"),
    ({"NOTIFY": None}, "pgjobs.E012"),
    ({"PREPARE": "yes"}, "pgjobs.E013"),
    ({"PREPARE": 1}, "pgjobs.E013"),
    ({"COMPLETE_WITH_CLAIM": "yes"}, "pgjobs.E017"),
    ({"COMPLETE_WITH_CLAIM": None}, "pgjobs.E017"),
    ({"CLAIM_REGISTERED_ONLY": "no"}, "pgjobs.E014"),
    ({"CLAIM_REGISTERED_ONLY": 0}, "pgjobs.E014"),
    ({"HEALTH_THRESHOLDS": {"lag": "5m"}}, "pgjobs.E015"),
    ({"HEALTH_THRESHOLDS": None}, "pgjobs.E015"),
    ({"MONITORING_TOKEN": ""}, "pgjobs.E016"),
]


def ids(messages: list[Any]) -> list[str]:
    return [m.id for m in messages]


def run_all() -> list[Any]:
    return checks.check_settings() + checks.check_engine()


def test_the_project_settings_pass() -> None:
    assert run_all() == []
    with override_settings(PGJOBS={}):
        assert run_all() == []


def test_every_setting_set_validly_passes() -> None:
    assert set(VALID) == set(conf.DEFAULTS)
    with override_settings(PGJOBS=VALID):
        assert run_all() == []


@pytest.mark.parametrize(("pgjobs", "check_id"), BAD, ids=[f"{b[1]}-{b[0]}" for b in BAD])
def test_bad_setting_is_reported(pgjobs: Any, check_id: str) -> None:
    with override_settings(PGJOBS=pgjobs):
        errors = run_all()
    assert ids(errors) == [check_id]
    (error,) = errors
    assert isinstance(error, django_checks.Error)
    if isinstance(pgjobs, dict):
        for key in pgjobs:
            assert key in error.msg  # the message names the setting
    assert error.hint or check_id == "pgjobs.E005"


def test_several_errors_are_all_reported() -> None:
    with override_settings(PGJOBS={"MODE": "x", "CONCURRENCY": 0, "QUEUE": "a b", "X": 1}):
        assert sorted(ids(run_all())) == [
            "pgjobs.E002",
            "pgjobs.E003",
            "pgjobs.E004",
            "pgjobs.E005",
        ]


def test_checks_are_registered_with_django() -> None:
    with override_settings(PGJOBS={"MODE": "batch"}):
        found = django_checks.run_checks(tags=[django_checks.Tags.compatibility])
    assert "pgjobs.E004" in ids(found)
    assert "pgjobs.E004" not in ids(django_checks.run_checks())


def test_non_postgresql_alias_is_reported() -> None:
    databases = {
        **settings.DATABASES,
        "sqlite": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"},
    }
    # Django warns that DATABASES overrides do not reach open connections: the check only
    # reads the setting, so that is fine here.
    for key in ("DATABASE", "LISTEN_DATABASE"):
        with (
            pytest.warns(UserWarning, match="DATABASES"),
            override_settings(DATABASES=databases, PGJOBS={key: "sqlite"}),
        ):
            errors = run_all()
        assert ids(errors) == ["pgjobs.E010"]
        assert "sqlite" in errors[0].msg
        assert "postgresql" in errors[0].hint


POSTGRESQL_BACKENDS = [
    pytest.param("django.db.backends.postgresql", id="postgresql"),
    # Django's own backend under a project's name: the checks used to match the ENGINE
    # string, and refused every such backend (PostGIS included).
    pytest.param("testproject.pgsubclass", id="subclass-in-the-test-project"),
    pytest.param("django.contrib.gis.db.backends.postgis", id="postgis"),
]


@pytest.mark.parametrize("engine", POSTGRESQL_BACKENDS)
@pytest.mark.django_db
def test_a_backend_built_on_postgresql_passes_whatever_its_engine_is_called(engine: str) -> None:
    try:
        backend = load_backend(engine)
    except ImproperlyConfigured as exc:  # PostGIS's backend loads only where GDAL is installed
        pytest.skip(f"{engine} cannot be loaded here: {exc}")
    # A real backend: it connects to the test database and runs a query.
    params = {**connection.settings_dict, "ENGINE": engine}
    wrapper = backend.DatabaseWrapper(params, "built_on_postgresql")
    try:
        with wrapper.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pgjobs_job")
            assert cursor.fetchone() == (0,)
    finally:
        wrapper.close()
    databases = {**settings.DATABASES, "built_on_postgresql": params}
    with (
        pytest.warns(UserWarning, match="DATABASES"),
        override_settings(
            DATABASES=databases,
            PGJOBS={"DATABASE": "built_on_postgresql", "LISTEN_DATABASE": "built_on_postgresql"},
        ),
    ):
        assert run_all() == []


def test_a_backend_that_cannot_be_loaded_is_reported() -> None:
    databases = {**settings.DATABASES, "gone": {"ENGINE": "nowhere.backend", "NAME": "x"}}
    with (
        pytest.warns(UserWarning, match="DATABASES"),
        override_settings(DATABASES=databases, PGJOBS={"DATABASE": "gone"}),
    ):
        errors = run_all()
    assert ids(errors) == ["pgjobs.E010"]
    assert "'nowhere.backend'" in errors[0].msg and "cannot be loaded" in errors[0].msg


def test_every_check_id_is_tested() -> None:
    # The backoff check, pgjobs.E009, lives in validation beside the rule it checks.
    source = Path(checks.__file__).read_text() + Path(validation.__file__).read_text()
    declared = set(re.findall(r'"(pgjobs\.[EW]\d{3})"', source))
    # E038 (PGJOBS["SCHEDULE"]'s shape) is tested with the schedules, in test_periodic.py.
    tested = {check_id for _, check_id in BAD} | {"pgjobs.E010", "pgjobs.E038"}
    assert declared == tested
