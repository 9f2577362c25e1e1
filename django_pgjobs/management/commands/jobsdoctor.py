"""``manage.py jobsdoctor``: the queue's health report; exit status 1 when unhealthy.

With ``--watch SECONDS`` it runs ``watch.Watch`` instead: a line per check, and one alarm per
breach (see ``Watch``) until it is stopped (SIGINT, SIGTERM) or has run ``--count`` checks.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from argparse import ArgumentParser
from dataclasses import asdict, replace
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from django_pgjobs.core.types import last_line
from django_pgjobs.ops import dashboard, doctor, findings
from django_pgjobs.ops.watch import Watch


class Command(BaseCommand):
    help = "Report the queue's health; exit 1, with each problem on its own line, if unhealthy."

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--json", action="store_true", help="Print the report as JSON.")
        parser.add_argument(
            "--idle-threshold",
            type=float,
            metavar="SECONDS",
            help=(
                "Report sessions idle in transaction longer than this (default 5, or "
                "PGJOBS['HEALTH_THRESHOLDS']['idle'])."
            ),
        )
        parser.add_argument(
            "--transaction-threshold",
            type=float,
            metavar="SECONDS",
            help=(
                "Report the oldest open transaction when older than this (default 300, or "
                "PGJOBS['HEALTH_THRESHOLDS']['transaction'])."
            ),
        )
        parser.add_argument(
            "--lag-threshold",
            type=float,
            metavar="SECONDS",
            help=(
                "Report a queue whose oldest ready job waited longer (default 300, or "
                "PGJOBS['HEALTH_THRESHOLDS']['lag'])."
            ),
        )
        parser.add_argument(
            "--slot-age-threshold",
            type=int,
            metavar="TRANSACTIONS",
            help=(
                "Report a replication slot holding back vacuum of the jobs table once its xmin "
                "is older than this many transactions (default 100000, or "
                "PGJOBS['HEALTH_THRESHOLDS']['slot_age'])."
            ),
        )
        parser.add_argument("--database", help="Database alias of the jobs table.")
        parser.add_argument(
            "--watch",
            type=float,
            metavar="SECONDS",
            help=(
                "Check every SECONDS until stopped; on a breach (jobs not being run) send "
                "queue_unhealthy and log at ERROR, once until the queue is healthy again."
            ),
        )
        parser.add_argument(
            "--count",
            type=int,
            metavar="N",
            help="With --watch: stop after N checks (default: run until SIGINT or SIGTERM).",
        )
        parser.add_argument(
            "--mail-admins",
            action="store_true",
            help="With --watch: also send each breach's alarm to settings.ADMINS (mail_admins).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        given = {}
        for name in ("idle", "transaction", "lag", "slot_age"):
            value = options[f"{name}_threshold"]
            if value is None:
                continue
            if not value >= 0:  # NaN too
                option = "--" + name.replace("_", "-") + "-threshold"
                raise CommandError(f"{option} must be 0 or more (got {value}).")
            given[name] = value
        limits = replace(findings.Thresholds.from_settings(), **given)
        if options["watch"] is not None:
            self._watch(limits, options)
            return
        if options["count"] is not None or options["mail_admins"]:
            raise CommandError("--count and --mail-admins go with --watch SECONDS.")
        report = doctor.diagnose(options["database"], limits)
        if options["json"]:
            self.stdout.write(json.dumps(_plain(report), indent=2, default=str))
        else:
            self._print(report)
        if not report.healthy:
            sys.exit(1)

    def _watch(self, limits: findings.Thresholds, options: dict[str, Any]) -> None:
        interval, count = options["watch"], options["count"]
        if not interval > 0:  # NaN too
            raise CommandError(f"--watch must be a number of seconds above 0 (got {interval}).")
        if count is not None and count < 1:
            raise CommandError(f"--count must be 1 or more (got {count}).")
        stop = threading.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: stop.set())
        watcher = Watch(options["database"], limits, mail=options["mail_admins"])
        watcher.run(interval, count=count, stop=stop, report=self._print_tick)

    def _print_tick(self, findings: list[findings.Finding]) -> None:
        outages = [finding for finding in findings if finding.outage]
        warnings = len(findings) - len(outages)
        state = f"UNHEALTHY: {len(outages)} outage(s)" if outages else "healthy"
        self.stdout.write(f"{timezone.now():%Y-%m-%d %H:%M:%S%z} {state}, {warnings} warning(s)")
        for finding in outages:
            self.stdout.write(f"  OUTAGE: {finding.problem}")
        self.stdout.flush()

    def _print(self, report: findings.Report) -> None:
        """The report as text, a section at a time; the problems (or "Healthy.") last."""
        self._print_queues(report)
        self._print_workers(report)
        self._print_table(report)
        self._print_schedules(report)
        self._print_verdict(report)

    def _print_queues(self, report: findings.Report) -> None:
        """Each queue's counts, then the recent failures and the jobs that killed workers."""
        write = self.stdout.write
        write("Queues:")
        for q in report.queues:
            write(
                f"  {q.queue}: {q.ready} ready (oldest waited {q.lag_seconds:.1f} s), "
                f"{q.scheduled} scheduled, {q.running} running ({q.expired} expired leases), "
                f"{q.failed} failed, {q.done_last_hour} done in the last hour"
            )
        if not report.queues:
            write("  (no live jobs)")
        write(f"Failures in the last hour: {report.failures_last_hour}")
        for failure in report.recent_failures[:5]:
            error = failure["last_error"] or ""
            write(f"  job {failure['id']} {failure['task']}: {last_line(error) if error else ''}")
        write(
            f"Quarantined in the last hour (their worker died, PGJOBS['MAX_CRASHES'] times in a "
            f"row): {report.quarantined_count}"
        )
        for row in report.quarantined[:5]:
            write(f"  job {row['id']} {row['task']}: {row['crashes']} worker deaths in a row")
        write(f"Live jobs whose last attempt ended with a dead worker: {report.suspects}")

    def _print_workers(self, report: findings.Report) -> None:
        """The live workers, the ready jobs none of them can run, and the paused queues."""
        write = self.stdout.write
        write(f"Live workers: {len(report.workers)}")
        for worker in report.workers:
            tasks = worker["tasks"]
            write(
                f"  {worker['id']} on {worker['host']} (pid {worker['pid']}, {worker['mode']} "
                f"mode, version {worker['version']}): queues {dashboard.worker_queues(worker)}; "
                f"tasks {'any' if tasks is None else len(tasks)}; started "
                f"{worker['started_at'].isoformat()}, last heartbeat "
                f"{worker['heartbeat_at'].isoformat()}"
            )
        write("Ready jobs no live worker can run:" + ("" if report.unrunnable else " none"))
        for row in report.unrunnable:
            unserved = "" if row["served"] else " (no live worker serves this queue)"
            write(f"  {row['queue']}: {row['ready']} of {row['task']}{unserved}")
        write(f"Paused queues: {', '.join(report.paused) or 'none'}")

    def _print_table(self, report: findings.Report) -> None:
        """The jobs table's upkeep: dead rows and autovacuum, what holds vacuum back, sessions
        idle in transaction, invalid indexes."""
        write = self.stdout.write
        table, settings = report.table, report.settings
        write(
            f"Table pgjobs_job: {table['n_live_tup']} live rows, {table['n_dead_tup']} dead "
            f"({table['dead_per_live_row']} per live row; autovacuum vacuums past "
            f"{table['vacuum_threshold']}), last autovacuum {table['last_autovacuum'] or 'never'}, "
            f"last vacuum {table['last_vacuum'] or 'never'}, "
            f"options {', '.join(table['reloptions'] or []) or 'none'}"
        )
        write(
            f"Autovacuum: {'on' if settings['autovacuum'] else 'off'} "
            f"(naptime {settings['autovacuum_naptime']:g} s), "
            f"track_counts {'on' if settings['track_counts'] else 'off'}"
            + (", vacuuming pgjobs_job now" if table["vacuum_running"] else "")
        )
        write("Xmin horizon held by:" + ("" if report.horizon else " nothing"))
        for holder in report.horizon:
            scope = "" if holder.holds_table else " (not pgjobs_job)"
            query = f"; query: {holder.query}" if holder.query else ""
            write(f"  {holder}: {holder.held_for()}{scope}{query}")
        write(
            "Locks that keep autovacuum off pgjobs_job: "
            + (
                ", ".join(f"pid {lock['pid']} {lock['mode']}" for lock in report.vacuum_locks)
                or "none"
            )
        )
        write(f"Sessions idle in transaction: {len(report.idle_in_transaction)}")
        write(f"Invalid indexes: {', '.join(report.invalid_indexes) or 'none'}")

    def _print_schedules(self, report: findings.Report) -> None:
        write = self.stdout.write
        write("Schedules:" + ("" if report.schedules else " none"))
        for schedule in report.schedules:
            last = schedule["last_tick"]
            job = (
                f" (job {schedule['last_job_id']} {schedule['job_status'] or 'pruned'})"
                if schedule["last_job_id"]
                else ""
            )
            write(
                f"  {schedule['name']}: {schedule['task']}, {schedule['description']}; last tick "
                f"{last.isoformat() if last else 'never'}{job}, next "
                f"{schedule['next_tick'].isoformat()}"
                + (f"; {schedule['failures']} failed step(s)" if schedule["last_error"] else "")
            )

    def _print_verdict(self, report: findings.Report) -> None:
        write = self.stdout.write
        if report.healthy:
            write("Healthy.")
            return
        write(f"{len(report.problems)} problem(s):")
        for problem in report.problems:
            write(f"PROBLEM: {problem}")


def _plain(report: findings.Report) -> dict[str, Any]:
    return {**asdict(report), "healthy": report.healthy}
