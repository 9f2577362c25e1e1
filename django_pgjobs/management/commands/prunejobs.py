"""``manage.py prunejobs``: delete (or archive) finished jobs in short batches."""

from __future__ import annotations

import re
from argparse import ArgumentParser
from datetime import timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from django_pgjobs.exceptions import InvalidJobOptions
from django_pgjobs.models import Job

UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def parse_age(text: str) -> timedelta:
    """``7d``, ``12h``, ``30m``, ``90s``, ``2w`` -> timedelta."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text)
    if not match:
        raise CommandError(
            f"--older-than {text!r}: use a number and a unit, e.g. 7d, 12h, 30m, 90s or 2w."
        )
    return timedelta(**{UNITS[match.group(2)]: float(match.group(1))})


class Command(BaseCommand):
    help = (
        "Delete finished jobs older than a cutoff, in batches of --batch-size (each its own "
        "short statement), or move them to pgjobs_job_archive with --archive. Queued and "
        "running jobs are never touched."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument(
            "--older-than",
            default="7d",
            metavar="AGE",
            help="Finished longer ago than this: 7d (default), 12h, 30m, 90s, 2w.",
        )
        parser.add_argument(
            "--status",
            choices=("done", "failed", "cancelled", "all"),
            default="done",
            help="Which finished jobs: done (default), failed, cancelled, or all (the three).",
        )
        parser.add_argument("--batch-size", type=int, default=10_000, help="Rows per batch.")
        parser.add_argument(
            "--archive",
            action="store_true",
            help="Move the jobs to pgjobs_job_archive instead of deleting them.",
        )
        parser.add_argument("--database", help="Database alias of the jobs table.")

    def handle(self, *args: Any, **options: Any) -> None:
        age = parse_age(options["older_than"])
        verb = "archived" if options["archive"] else "deleted"

        def progress(total: int) -> None:
            self.stdout.write(f"  {verb} {total} so far")

        try:
            total = Job.objects.db_manager(options["database"]).prune(
                older_than=age,
                status=options["status"],
                batch_size=options["batch_size"],
                archive=options["archive"],
                progress=progress,
            )
        except InvalidJobOptions as exc:
            raise CommandError(str(exc)) from exc
        which = "done, failed and cancelled" if options["status"] == "all" else options["status"]
        self.stdout.write(
            f"{verb} {total} {which} jobs finished more than {options['older_than']} ago"
        )
