"""The health view's and ``jobsdoctor --watch``'s use of the doctor: ``examine()`` and ``Watch``."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from django.core.mail import mail_admins
from django.db import DatabaseError, connections

from django_pgjobs import signals
from django_pgjobs.core import conf
from django_pgjobs.ops.doctor import diagnose
from django_pgjobs.ops.findings import Finding, Report, Thresholds

__all__ = ["Watch", "examine"]

logger = logging.getLogger("django_pgjobs.doctor")


def examine(
    alias: str | None = None, thresholds: Thresholds | None = None, *, queries: bool = True
) -> tuple[Report | None, list[Finding]]:
    """``diagnose()`` for the health endpoint and ``Watch``: the report and its findings, or,
    when the database cannot be read, no report and one ``database`` outage (no worker can
    claim from it either); the connection is closed so that the next call reconnects."""
    try:
        report = diagnose(alias, thresholds, queries=queries)
    except DatabaseError as exc:
        connections[alias or conf.database()].close()
        return None, [Finding("database", f"the jobs table could not be read: {exc}", True)]
    return report, report.findings


class Watch:
    """``jobsdoctor --watch``: diagnose on every ``tick()`` and raise an alarm once per breach.

    A breach of one check (lag, expired leases, ready jobs no live worker can run, the
    database) begins with a tick that finds that outage (a ``Finding`` with ``outage``) and ends
    with the first tick that finds none of it; its alarm (the ``queue_unhealthy`` signal, an
    ERROR log line and, with ``mail``, ``mail_admins``) goes out at its first tick only, so a
    queue that stays down is not reported every interval, while another kind of outage that
    begins meanwhile is. Once a check is clear again, its next outage is a new breach. Warnings
    (vacuum, failures) never alarm: they do not stop jobs from being served.
    """

    def __init__(
        self,
        alias: str | None = None,
        thresholds: Thresholds | None = None,
        *,
        mail: bool = False,
    ) -> None:
        self.alias = alias
        self.thresholds = thresholds or Thresholds.from_settings()
        self.mail = mail
        # The checks whose breach is under way (already alarmed).
        self.breached: set[str] = set()

    def tick(self) -> list[Finding]:
        """Diagnose once and alarm if this tick begins a breach; return its findings.

        A database that cannot be read is an outage too (see ``examine()``).
        """
        _report, findings = examine(self.alias, self.thresholds)
        outages = [finding for finding in findings if finding.outage]
        new = [finding for finding in outages if finding.check not in self.breached]
        if new:
            self.alarm(new)
        elif not outages and self.breached:
            logger.info("queue healthy again", extra={"action": "watch"})
        self.breached = {finding.check for finding in outages}
        return findings

    def run(
        self,
        interval: float,
        *,
        count: int | None = None,
        stop: threading.Event | None = None,
        report: Callable[[list[Finding]], None] | None = None,
    ) -> None:
        """``tick()`` every ``interval`` seconds, ``count`` times (None: until ``stop`` is
        set); ``report`` is handed each tick's findings."""
        stop = stop or threading.Event()
        ticks = 0
        while not stop.is_set():
            findings = self.tick()
            if report is not None:
                report(findings)
            ticks += 1
            if count is not None and ticks >= count:
                return
            stop.wait(interval)

    def alarm(self, findings: list[Finding]) -> None:
        """The breach's one alarm: an ERROR log line, ``queue_unhealthy``, and the mail."""
        text = "\n".join(f"- {finding.problem}" for finding in findings)
        logger.error(
            "queue unhealthy: %s problem(s):\n%s",
            len(findings),
            text,
            extra={"action": "watch", "checks": [finding.check for finding in findings]},
        )
        signals.send(signals.queue_unhealthy, sender=Watch, findings=findings)
        if not self.mail:
            return
        try:
            mail_admins(
                f"Job queue unhealthy: {len(findings)} problem(s)",
                "jobsdoctor --watch found jobs that are not being run:\n\n"
                f"{text}\n\nNo further mail is sent until the queue has been healthy again.",
            )
        except Exception:
            # The log line above has the alarm; a mail server down must not end the watch.
            logger.exception("could not mail the admins", extra={"action": "watch"})
