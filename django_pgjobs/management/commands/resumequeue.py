"""``manage.py resumequeue NAME``: let workers claim a paused queue's jobs again."""

from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from django_pgjobs.exceptions import InvalidJobOptions
from django_pgjobs.models import Job


class Command(BaseCommand):
    help = "Resume a paused queue: a NOTIFY wakes the workers, which claim its jobs at once."

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("queue", metavar="NAME", help="The queue to resume.")
        parser.add_argument("--database", help="Database alias of the jobs table.")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            Job.objects.db_manager(options["database"]).resume(options["queue"])
        except InvalidJobOptions as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(f"resumed queue {options['queue']}: workers claim its jobs again")
