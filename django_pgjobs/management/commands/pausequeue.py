"""``manage.py pausequeue NAME``: stop workers starting a queue's jobs (``Job.objects.pause``)."""

from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from django_pgjobs.exceptions import InvalidJobOptions
from django_pgjobs.models import Job


class Command(BaseCommand):
    help = (
        "Pause a queue: workers start none of its jobs until resumequeue; running jobs "
        "finish, and enqueue goes on."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("queue", metavar="NAME", help="The queue to pause.")
        parser.add_argument("--database", help="Database alias of the jobs table.")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            Job.objects.db_manager(options["database"]).pause(options["queue"])
        except InvalidJobOptions as exc:
            raise CommandError(str(exc)) from exc
        name = options["queue"]
        self.stdout.write(
            f"paused queue {name}: its jobs stay queued until `manage.py resumequeue {name}`; "
            "jobs already running finish"
        )
