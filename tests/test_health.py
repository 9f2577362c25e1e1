"""``django_pgjobs.views.health`` over real HTTP, its settings' system checks, and
``jobsdoctor --watch`` (``watch.Watch``): one alarm per breach.

The server these tests run on may have autovacuum off, and the doctor then reports it: that is
a warning, never a 503, and the tests below never depend on whether it is there.
"""

from __future__ import annotations

import json
import logging
import signal
from dataclasses import fields
from datetime import timedelta
from typing import Any

import django
import pytest
from django.contrib.auth.models import User
from django.core import mail
from django.core.management import CommandError, call_command
from django.db import connection

from django_pgjobs import signals
from django_pgjobs.core import checks, validation
from django_pgjobs.models import Job
from django_pgjobs.ops import doctor
from django_pgjobs.ops.findings import Finding, Thresholds
from django_pgjobs.ops.watch import Watch
from tests.helpers import (
    http_get,
    make_job,
    raw_connect,
    register_worker,
    session_cookie,
    wait_until,
)
from tests.workers import Workers

pytestmark = pytest.mark.django_db(transaction=True)

TOKEN = "health-token-of-the-tests-01234"


@pytest.fixture
def token(settings: Any) -> str:
    settings.PGJOBS = {**settings.PGJOBS, "MONITORING_TOKEN": TOKEN}
    return TOKEN


def health(url: str, token: str) -> tuple[int, dict[str, Any]]:
    status, headers, body = http_get(url + "/pgjobs/health", {"Authorization": f"Bearer {token}"})
    assert headers["Content-Type"] == "application/json"
    return status, json.loads(body)


def checks_of(body: dict[str, Any]) -> set[str]:
    return {finding["check"] for finding in body["findings"] if finding["outage"]}


def test_a_served_queue_is_healthy_and_other_findings_are_only_warnings(
    live_server: Any, token: str
) -> None:
    make_job(queue="default")
    register_worker("web-1:1", {"default": None})
    status, body = health(live_server.url, token)
    assert status == 200, body
    assert body["healthy"] is True
    assert body["problems"] == []
    assert [f["problem"] for f in body["findings"] if not f["outage"]] == body["warnings"]
    (queue,) = body["queues"]
    assert (queue["queue"], queue["ready"]) == ("default", 1)
    assert [worker["id"] for worker in body["workers"]] == ["web-1:1"]


def test_an_expired_lease_is_a_503_naming_the_job(live_server: Any, token: str) -> None:
    register_worker("web-1:1", {"default": None})
    job = make_job(status="running", attempts=1, locked_until=timedelta(minutes=-1))
    status, body = health(live_server.url, token)
    assert status == 503
    assert body["healthy"] is False
    assert checks_of(body) == {"expired_leases"}
    (problem,) = body["problems"]
    assert "1 running job(s) have expired leases" in problem
    assert str(job) in problem


def test_the_lag_threshold_comes_from_the_settings(
    live_server: Any, token: str, settings: Any
) -> None:
    register_worker("web-1:1", {"default": None})
    make_job(run_at=timedelta(minutes=-10))
    settings.PGJOBS = {**settings.PGJOBS, "HEALTH_THRESHOLDS": {"lag": 60}}
    status, body = health(live_server.url, token)
    assert status == 503
    assert checks_of(body) == {"queue_lag"}
    assert "queue default: the oldest ready job has waited" in body["problems"][0]

    settings.PGJOBS = {**settings.PGJOBS, "HEALTH_THRESHOLDS": {"lag": 3600}}
    status, body = health(live_server.url, token)
    assert status == 200, body


def test_a_paused_queue_is_not_late_however_long_its_jobs_wait(
    live_server: Any, token: str, settings: Any
) -> None:
    register_worker("web-1:1", {"default": None})
    make_job(run_at=timedelta(minutes=-10))
    settings.PGJOBS = {**settings.PGJOBS, "HEALTH_THRESHOLDS": {"lag": 60}}
    make_job(queue="reports")  # and no live worker serves reports
    Job.objects.pause("default")
    Job.objects.pause("reports")
    status, body = health(live_server.url, token)
    assert status == 200, body
    assert body["paused"] == ["default", "reports"]

    Job.objects.resume("default")
    Job.objects.resume("reports")
    status, body = health(live_server.url, token)
    assert status == 503
    assert checks_of(body) == {"queue_lag", "unrunnable"}


def test_ready_jobs_no_live_worker_serves_are_a_503_until_one_does(
    live_server: Any, token: str
) -> None:
    register_worker("web-1:1", {"default": None})
    make_job(queue="reports")
    status, body = health(live_server.url, token)
    assert status == 503
    assert checks_of(body) == {"unrunnable"}
    assert "no live worker serves the queue" in body["problems"][0]

    register_worker("web-2:1", {"reports": None})
    status, body = health(live_server.url, token)
    assert status == 200, body


def test_health_never_quotes_another_sessions_sql(
    live_server: Any, token: str, settings: Any
) -> None:
    # A session idle in transaction is a warning, and jobsdoctor names its last query; the
    # health JSON, readable with a token handed to scrapers and probes, must not.
    register_worker("web-1:1", {"default": None})
    settings.PGJOBS = {**settings.PGJOBS, "HEALTH_THRESHOLDS": {"idle": 0}}
    with raw_connect() as idle:
        idle.execute("BEGIN")
        idle.execute("SELECT 'secret-customer@example.com'")
        limits = Thresholds.from_settings()
        wait_until(
            lambda: any("idle in transaction" in p for p in doctor.diagnose(None, limits).problems),
            message="the session to be seen idle in transaction",
        )
        status, body = health(live_server.url, token)
        assert status == 200, body
        assert any("idle in transaction" in warning for warning in body["warnings"]), body
        assert "secret-customer" not in json.dumps(body)
        assert any("secret-customer" in p for p in doctor.diagnose(None, limits).problems)


def test_health_is_refused_without_credentials(live_server: Any, settings: Any) -> None:
    status, _headers, body = http_get(live_server.url + "/pgjobs/health")
    assert status == 403
    assert b"findings" not in body

    member = User.objects.create_user("member", password="x")
    status, _headers, _body = http_get(
        live_server.url + "/pgjobs/health", {"Cookie": session_cookie(member)}
    )
    assert status == 403

    staff = User.objects.create_user("ops", password="x", is_staff=True)
    status, _headers, body = http_get(
        live_server.url + "/pgjobs/health", {"Cookie": session_cookie(staff)}
    )
    assert status == 200
    assert json.loads(body)["healthy"] is True

    settings.PGJOBS = {**settings.PGJOBS, "MONITORING_TOKEN": TOKEN}
    status, headers, _body = http_get(live_server.url + "/pgjobs/health")
    assert status == 401
    assert headers["WWW-Authenticate"].startswith("Bearer ")
    status, _body_json = health(live_server.url, TOKEN)
    assert status == 200


# -- the settings and their system checks ---------------------------------------------------


def test_the_thresholds_a_setting_may_name_are_the_doctors() -> None:
    assert validation.HEALTH_THRESHOLDS == tuple(f.name for f in fields(Thresholds))


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ({"lag": -1}, "PGJOBS['HEALTH_THRESHOLDS']['lag'] -1"),
        ({"lagg": 60}, "unknown threshold 'lagg'"),
        ({"slot_age": 1.5}, "PGJOBS['HEALTH_THRESHOLDS']['slot_age'] 1.5"),
        ([("lag", 60)], "use a dict such as"),
    ],
)
def test_bad_health_thresholds_are_pgjobs_e015(settings: Any, value: Any, words: str) -> None:
    settings.PGJOBS = {"HEALTH_THRESHOLDS": value}
    (error,) = checks.check_settings()
    assert error.id == "pgjobs.E015"
    assert words in error.msg


@pytest.mark.parametrize("value", ["short", 12345678901234567890, "a token with spaces inside"])
def test_a_bad_monitoring_token_is_pgjobs_e016(settings: Any, value: Any) -> None:
    settings.PGJOBS = {"MONITORING_TOKEN": value}
    (error,) = checks.check_settings()
    assert error.id == "pgjobs.E016"
    assert "PGJOBS['MONITORING_TOKEN']" in error.msg


def test_good_monitoring_settings_pass_the_checks(settings: Any) -> None:
    settings.PGJOBS = {
        "HEALTH_THRESHOLDS": {"lag": 60, "slot_age": 1000, "idle": 2.5},
        "MONITORING_TOKEN": TOKEN,
    }
    assert checks.check_settings() == []
    assert Thresholds.from_settings() == Thresholds(lag=60, slot_age=1000, idle=2.5)


# -- alarms: watch.Watch and jobsdoctor --watch --------------------------------------------


class Alarms:
    """What the alarms sent: each queue_unhealthy's findings."""

    def __init__(self) -> None:
        self.sent: list[list[Finding]] = []

    def __call__(self, sender: Any, findings: list[Finding], **named: Any) -> None:
        assert sender is Watch
        self.sent.append(findings)


@pytest.fixture
def alarms() -> Any:
    received = Alarms()
    signals.queue_unhealthy.connect(received)
    yield received
    signals.queue_unhealthy.disconnect(received)


# Django 6.0 takes addresses and deprecates (name, address) pairs, which Django 4.2 and 5.2
# require.
ADMINS: list[Any] = (
    ["ops@example.com"] if django.VERSION >= (6, 0) else [("Ops", "ops@example.com")]
)


# Django 6.1 deprecates the EMAIL_* settings (pytest-django sets one) and a mail sent with no
# MAILERS: warnings of the version, not of the watch.
@pytest.mark.filterwarnings("ignore:The EMAIL_[A-Z_]+ setting is deprecated")
@pytest.mark.filterwarnings("ignore:Django 2028 will not have a default mailer")
def test_a_breach_alarms_once_until_the_queue_is_healthy_again(
    alarms: Alarms, settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    settings.ADMINS = ADMINS
    caplog.set_level(logging.INFO, logger="django_pgjobs.doctor")
    register_worker("web-1:1", {"default": None})
    watch = Watch(mail=True)

    def errors() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.levelno >= logging.ERROR]

    watch.tick()
    assert (alarms.sent, mail.outbox, errors()) == ([], [], [])

    job = make_job(status="running", attempts=1, locked_until=timedelta(minutes=-1))
    for _ in range(3):
        findings = watch.tick()
        assert "expired_leases" in {f.check for f in findings if f.outage}
    assert [[f.check for f in sent] for sent in alarms.sent] == [["expired_leases"]]
    (message,) = mail.outbox
    assert message.to == ["ops@example.com"]
    assert "1 problem(s)" in message.subject
    assert f"e.g. {job}" in message.body
    (record,) = errors()
    assert record.name == "django_pgjobs.doctor"
    assert "expired leases" in record.getMessage()

    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE pgjobs_job SET status = 'done', locked_until = NULL WHERE id = %s", [job]
        )
    watch.tick()
    watch.tick()
    assert len(alarms.sent) == 1
    assert "queue healthy again" in caplog.text

    make_job(queue="reports")  # a queue no live worker serves: a new breach
    watch.tick()
    watch.tick()
    assert [[f.check for f in sent] for sent in alarms.sent] == [
        ["expired_leases"],
        ["unrunnable"],
    ]
    assert len(mail.outbox) == 2
    assert len(errors()) == 2


def test_another_kind_of_outage_during_a_breach_alarms_too(alarms: Alarms) -> None:
    register_worker("web-1:1", {"default": None})
    watch = Watch()
    make_job(status="running", attempts=1, locked_until=timedelta(minutes=-1))
    watch.tick()
    # While the expired lease stays, a queue loses its workers: that is news.
    make_job(queue="reports")
    watch.tick()
    watch.tick()
    assert [[f.check for f in sent] for sent in alarms.sent] == [
        ["expired_leases"],
        ["unrunnable"],
    ]


def test_warnings_alone_never_alarm(alarms: Alarms) -> None:
    watch = Watch()
    findings = [*watch.tick(), *watch.tick()]
    assert all(not finding.outage for finding in findings)
    assert alarms.sent == []


def test_without_mail_admins_no_mail_is_sent(alarms: Alarms, settings: Any) -> None:
    settings.ADMINS = ADMINS
    make_job(status="running", attempts=1, locked_until=timedelta(minutes=-1))
    Watch().tick()
    assert len(alarms.sent) == 1
    assert mail.outbox == []


# Django 6.1 deprecates the EMAIL_* settings (pytest-django sets one) and a mail sent with no
# MAILERS: warnings of the version, not of the watch.
@pytest.mark.filterwarnings("ignore:The EMAIL_[A-Z_]+ setting is deprecated")
@pytest.mark.filterwarnings("ignore:Django 2028 will not have a default mailer")
def test_a_mail_server_that_refuses_is_logged_and_the_watch_goes_on(
    alarms: Alarms, settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    settings.ADMINS = ADMINS
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST, settings.EMAIL_PORT = "127.0.0.1", 1  # nothing listens there
    make_job(status="running", attempts=1, locked_until=timedelta(minutes=-1))
    watch = Watch(mail=True)
    watch.tick()
    watch.tick()
    assert len(alarms.sent) == 1
    (refused,) = [r for r in caplog.records if r.getMessage() == "could not mail the admins"]
    assert refused.exc_info is not None
    assert isinstance(refused.exc_info[1], OSError)


def test_the_watch_command_alarms_once_over_its_ticks_and_exits(workers: Workers) -> None:
    make_job(status="running", attempts=1, locked_until=timedelta(minutes=-1))
    process = workers.run("jobsdoctor", "--watch", "0.05", "--count", "4")
    ticks = [line for line in process.output().splitlines() if "outage(s)" in line]
    assert len(ticks) == 4
    assert all("UNHEALTHY: 1 outage(s)" in line for line in ticks)
    assert process.log().count("ERROR django_pgjobs.doctor: queue unhealthy") == 1


def test_the_watch_command_stops_on_sigterm(workers: Workers) -> None:
    process = workers.command("jobsdoctor", "--watch", "0.05")
    wait_until(lambda: process.output().count(" healthy, ") >= 2, message="two watch ticks")
    process.send(signal.SIGTERM)
    assert process.wait() == 0
    assert "ERROR" not in process.log()


def test_watch_options_are_checked() -> None:
    with pytest.raises(CommandError, match="--watch must be a number of seconds above 0"):
        call_command("jobsdoctor", "--watch", "0")
    with pytest.raises(CommandError, match="--count must be 1 or more"):
        call_command("jobsdoctor", "--watch", "1", "--count", "0")
    with pytest.raises(CommandError, match="--count and --mail-admins go with --watch"):
        call_command("jobsdoctor", "--mail-admins")


def test_a_database_the_watch_cannot_reach_is_one_outage(workers: Workers) -> None:
    process = workers.run(
        "jobsdoctor",
        "--watch",
        "0.05",
        "--count",
        "3",
        database_url="postgres://postgres@127.0.0.1:1/nowhere",
    )
    ticks = [line for line in process.output().splitlines() if "outage(s)" in line]
    assert len(ticks) == 3
    assert all("UNHEALTHY: 1 outage(s), 0 warning(s)" in line for line in ticks)
    assert process.output().count("OUTAGE: the jobs table could not be read: ") == 3
    assert process.log().count("ERROR django_pgjobs.doctor: queue unhealthy") == 1
