"""``manage.py runjobs``: a thin shell over ``django_pgjobs.worker.Worker`` (and, with
``--processes N``, over ``django_pgjobs.worker.supervisor.Supervisor``)."""

from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from django_pgjobs.core import conf, validation
from django_pgjobs.exceptions import InvalidJobOptions, MetricsUnavailable
from django_pgjobs.worker import Worker
from django_pgjobs.worker.stuck import EXIT_STUCK
from django_pgjobs.worker.supervisor import Supervisor, child_command


class Command(BaseCommand):
    help = "Run jobs: claim them from the queue table, run them, record their outcome."

    def add_arguments(self, parser: ArgumentParser) -> None:
        # In the order --help lists them.
        _capacity_options(parser)
        _claim_options(parser)
        _database_options(parser)
        _stop_options(parser)
        _duty_options(parser)
        _metrics_options(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            processes = validation.positive_int("processes", options["processes"])
            if processes > 1 and options["metrics_port"] is not None:
                raise CommandError(
                    f"--metrics-port cannot serve {processes} processes: each would bind the "
                    "one port. Run that many runjobs processes, each with a --metrics-port of "
                    "its own, or scrape the queue metrics from django_pgjobs.views.metrics."
                )
            # Built even for --processes N: its checks of the options stop a bad start here,
            # rather than in N children started again and again.
            worker = Worker(
                options["queues"],
                concurrency=options["concurrency"],
                async_concurrency=options["async_concurrency"],
                batch_size=options["batch_size"],
                lease=options["lease"],
                poll_interval=options["poll_interval"],
                reap_interval=options["reap_interval"],
                mode=options["mode"],
                burst=options["burst"],
                max_jobs=options["max_jobs"],
                database=options["database"],
                listen_database=options["listen_database"],
                shutdown_timeout=options["shutdown_timeout"],
                schedule=options["schedule"],
                max_stuck_executors=options["max_stuck_executors"],
                registered_only=options["registered_only"],
                metrics_port=options["metrics_port"],
                metrics_addr=options["metrics_addr"],
            )
        except (InvalidJobOptions, MetricsUnavailable) as exc:
            raise CommandError(str(exc)) from exc
        if processes > 1:
            self._supervise(processes, options)
            return
        worker.install_signal_handlers()
        try:
            stats = worker.run()
        except MetricsUnavailable as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(stats.summary())
        if worker.stuck:
            # Too many executor threads, or the event loop, stuck past a job's timeout
            # (logged at ERROR): a supervisor restarting on failure starts a clean process.
            self.stdout.flush()
            raise SystemExit(EXIT_STUCK)

    def _supervise(self, processes: int, options: dict[str, Any]) -> None:
        command = child_command(self.__module__.rpartition(".")[2])
        if command is None:
            raise CommandError(
                "--processes starts this command line again in each process, and "
                "call_command() has none: run manage.py runjobs --processes N, or a "
                "django_pgjobs.worker.supervisor.Supervisor with a command line."
            )
        supervisor = Supervisor(command, processes, burst=options["burst"])
        supervisor.install_signal_handlers()
        status = supervisor.run()
        if status:
            raise SystemExit(status)


def _capacity_options(parser: ArgumentParser) -> None:
    """What to run, and how much of it at once: queues, threads, processes, batches."""
    parser.add_argument(
        "--queue",
        action="append",
        dest="queues",
        metavar="NAME[=N]",
        help="Queue to take jobs from; repeat for several (default "
        f"{conf.default_queue()!r}). NAME=N: at most N of its jobs at once, in slots of its "
        "own; a bare NAME shares --concurrency.",
    )
    parser.add_argument("--concurrency", type=int, help="Executor threads.")
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        metavar="N",
        help="Worker processes, each with its own --concurrency executors and connections, "
        "under a supervisor that starts again any that dies (default 1: this process is "
        "the worker).",
    )
    parser.add_argument(
        "--async-concurrency",
        type=int,
        metavar="N",
        help="async def jobs run at once on the event-loop thread, apart from "
        "--concurrency (default PGJOBS['ASYNC_CONCURRENCY'], 100).",
    )
    parser.add_argument("--batch-size", type=int, help="Most jobs one claim takes.")


def _claim_options(parser: ArgumentParser) -> None:
    """How a worker claims and reaps, and when it stops claiming (--burst, --max-jobs)."""
    parser.add_argument("--lease", type=float, metavar="SECONDS", help="Lease per claim.")
    parser.add_argument(
        "--poll-interval",
        type=float,
        metavar="SECONDS",
        help="Fallback poll (and LISTEN probe) interval of an idle worker.",
    )
    parser.add_argument(
        "--reap-interval",
        type=float,
        metavar="SECONDS",
        help="Seconds between reaps of expired leases; 0 disables them.",
    )
    parser.add_argument("--mode", choices=conf.MODES, help="lease (default) or transaction.")
    parser.add_argument(
        "--burst", action="store_true", help="Run the ready jobs, then exit 0 (for cron)."
    )
    parser.add_argument("--max-jobs", type=int, help="Exit after claiming this many jobs.")


def _database_options(parser: ArgumentParser) -> None:
    """The aliases of the jobs table and of the connection LISTEN uses."""
    parser.add_argument("--database", help="Database alias of the jobs table.")
    parser.add_argument(
        "--listen-database",
        help="Alias to LISTEN on (a direct connection when --database goes through PgBouncer).",
    )


def _stop_options(parser: ArgumentParser) -> None:
    """How long a stopping worker waits for its jobs, and when stuck executors end it."""
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        metavar="SECONDS",
        help="How long a stopping worker waits for running jobs.",
    )
    parser.add_argument(
        "--max-stuck-executors",
        type=int,
        metavar="N",
        help=f"Exit (status {EXIT_STUCK}) once more than N executor threads are stuck in "
        "jobs past their timeout.",
    )


def _duty_options(parser: ArgumentParser) -> None:
    """Which work a worker takes on: the ticks of periodic schedules, jobs of any task."""
    parser.add_argument(
        "--no-schedule",
        action="store_false",
        dest="schedule",
        help="Do not enqueue the ticks of periodic schedules (another worker does).",
    )
    parser.add_argument(
        "--claim-unregistered",
        action="store_const",
        const=False,
        dest="registered_only",
        help="Claim jobs of any task, failing those this process has not registered "
        "(default: only registered tasks, PGJOBS['CLAIM_REGISTERED_ONLY']).",
    )


def _metrics_options(parser: ArgumentParser) -> None:
    """Where this worker serves its Prometheus metrics."""
    parser.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="Serve this worker's Prometheus metrics on http://ADDR:PORT/metrics (0: any "
        "free port, logged at start). Needs the prometheus extra: "
        "pip install 'django-pgjobs[prometheus]'.",
    )
    parser.add_argument(
        "--metrics-addr",
        metavar="ADDR",
        help="Address the metrics are served on (default 127.0.0.1: this machine only; "
        "0.0.0.0 for every interface).",
    )
