"""``manage.py reapjobs``: requeue jobs whose lease expired, once or in a loop (for cron)."""

from __future__ import annotations

import signal
import threading
from argparse import ArgumentParser
from types import FrameType
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError

from django_pgjobs.models import Job
from django_pgjobs.worker.db import ReconnectBackoff, unavailable


class Command(BaseCommand):
    help = "Send jobs whose lease expired back to the queue (or to failed once out of attempts)."

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--loop", action="store_true", help="Keep reaping until stopped.")
        parser.add_argument(
            "--interval",
            type=float,
            default=60.0,
            metavar="SECONDS",
            help="Seconds between reaps with --loop (default 60).",
        )
        parser.add_argument("--database", help="Database alias of the jobs table.")

    def handle(self, *args: Any, **options: Any) -> None:
        if options["interval"] <= 0:
            raise CommandError("--interval must be a positive number of seconds.")
        manager = Job.objects.db_manager(options["database"])
        stop = threading.Event()
        if options["loop"]:

            def on_signal(signum: int, frame: FrameType | None) -> None:
                stop.set()

            signal.signal(signal.SIGTERM, on_signal)
            signal.signal(signal.SIGINT, on_signal)
        backoff = ReconnectBackoff("reapjobs")
        while True:
            try:
                reaped = manager.reap()
            except DatabaseError as exc:
                # A looping reaper rides out an outage like the worker does.
                if not (options["loop"] and unavailable(exc)):
                    raise
                backoff.failed(manager.db_alias, exc, stop)
                if stop.is_set():
                    return
                continue
            backoff.succeeded(manager.db_alias)
            requeued = sum(1 for row in reaped if row.status == "queued")
            self.stdout.write(
                f"reaped {len(reaped)} jobs: {requeued} requeued, {len(reaped) - requeued} failed"
            )
            for row in reaped:
                self.stdout.write(f"  job {row.id}: {row.status} after {row.attempts} attempts")
            if not options["loop"] or stop.wait(options["interval"]):
                return
