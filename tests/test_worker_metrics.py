"""``runjobs --metrics-port``: a real worker process serves its Prometheus metrics over real
HTTP, and what it says is checked against the table; the flag's errors are ``CommandError``s
that say what to do."""

from __future__ import annotations

import math
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from prometheus_client.parser import text_string_to_metric_families

from django_pgjobs.models import Job
from django_pgjobs.worker.metrics import WorkerMetrics
from testproject.shop.models import Order
from testproject.testjobs import boom, noop
from tests.helpers import job_row, wait_until
from tests.workers import REPO, Process, Workers, query, scalar, until_order

pytestmark = pytest.mark.django_db(transaction=True)

NOOP = "testproject.testjobs.noop"
BOOM = "testproject.testjobs.boom"


def metrics_url(worker: Process) -> str:
    """The URL the worker logged once its metrics server was bound (``--metrics-port 0``)."""
    log = worker.wait_for_log("serves its metrics on ")
    found = re.search(r"serves its metrics on (http://\S+/metrics)", log)
    assert found is not None, log
    return found.group(1)


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the page: (name, sorted labels) -> value."""
    with urllib.request.urlopen(url, timeout=30) as response:  # noqa: S310 - our own http URL
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.mark.parametrize("mode", ["lease", "transaction"])
def test_the_workers_metrics_count_what_the_table_says_it_did(workers: Workers, mode: str) -> None:
    Job.objects.enqueue_many(noop, [{"n": i} for i in range(7)])
    failed = Job.objects.enqueue(boom, {}, max_attempts=1).id
    worker = workers.start("--metrics-port", "0", "--concurrency", "3", "--mode", mode)
    url = metrics_url(worker)
    assert url.startswith("http://127.0.0.1:")  # the default address: this machine only
    wait_until(
        lambda: scalar("SELECT count(*) FROM pgjobs_job WHERE status IN ('done', 'failed')") == 8,
        message="every job to finish",
    )
    done = scalar("SELECT count(*) FROM pgjobs_job WHERE status = 'done' AND task = %s", [NOOP])
    # The counters follow the writes: wait for the last of them, then compare everything.
    samples = wait_until(
        lambda: (
            (s := scrape(url))
            and value(s, "pgjobs_worker_jobs_finished_total", task=NOOP, outcome="done") == done
            and value(s, "pgjobs_worker_jobs_finished_total", task=BOOM, outcome="failed") == 1
            and s
        ),
        message="the counters to catch up with the table",
    )
    assert done == 7 and job_row(failed)["status"] == "failed"
    finished = {
        labels: count
        for (name, labels), count in samples.items()
        if name == "pgjobs_worker_jobs_finished_total"
    }
    assert finished == {
        (("outcome", "done"), ("task", NOOP)): 7.0,
        (("outcome", "failed"), ("task", BOOM)): 1.0,
    }
    # One run time per attempt, in the task's histogram.
    assert value(samples, "pgjobs_worker_job_duration_seconds_count", task=NOOP) == 7
    assert value(samples, "pgjobs_worker_job_duration_seconds_count", task=BOOM) == 1
    assert value(samples, "pgjobs_worker_job_duration_seconds_bucket", task=NOOP, le="+Inf") == 7
    # The claims took every attempt the table counts, in batches of at most 3 (the slots).
    attempts = scalar("SELECT sum(attempts) FROM pgjobs_job")
    assert value(samples, "pgjobs_worker_claim_size_sum") == attempts == 8
    assert value(samples, "pgjobs_worker_claim_size_count") >= math.ceil(8 / 3)
    # No claim took more than the 3 free slots.
    assert value(samples, "pgjobs_worker_claim_size_bucket", le="5.0") == value(
        samples, "pgjobs_worker_claim_size_count"
    )
    assert value(samples, "pgjobs_worker_executors") == 3
    # Every slot frees once its job is done (in transaction mode a slot is busy for a moment
    # with each claim too: its claim runs on the executor).
    wait_until(
        lambda: value(scrape(url), "pgjobs_worker_executors_busy") == 0,
        message="every executor to be free",
    )
    since = value(samples, "pgjobs_worker_seconds_since_last_claim")
    assert 0 <= since < math.inf

    worker.send(signal.SIGTERM)
    assert worker.wait() == 0, worker.tail()
    # A stopped worker serves nothing.
    with pytest.raises(OSError):
        scrape(url)


def test_executors_busy_counts_the_running_jobs(workers: Workers) -> None:
    first = Job.objects.enqueue(until_order, {"email": "one@example.com"}).id
    second = Job.objects.enqueue(until_order, {"email": "two@example.com"}).id
    worker = workers.start("--metrics-port", "0", "--concurrency", "4", test_jobs=True)
    url = metrics_url(worker)
    wait_until(
        lambda: scalar("SELECT count(*) FROM pgjobs_job WHERE status = 'running'") == 2,
        message="both jobs to run",
    )
    # The claim commits just before the worker hands the jobs to its executors.
    wait_until(
        lambda: value(scrape(url), "pgjobs_worker_executors_busy") == 2,
        message="two executors to be busy",
    )
    Order.objects.create(email="one@example.com", total_cents=1)
    wait_until(lambda: job_row(first)["status"] == "done", message="the first job to end")
    wait_until(
        lambda: value(scrape(url), "pgjobs_worker_executors_busy") == 1,
        message="one executor to be free",
    )
    Order.objects.create(email="two@example.com", total_cents=1)
    wait_until(lambda: job_row(second)["status"] == "done", message="the second job to end")
    wait_until(
        lambda: value(scrape(url), "pgjobs_worker_executors_busy") == 0,
        message="every executor to be free",
    )
    assert query("SELECT DISTINCT status FROM pgjobs_job") == [("done",)]


def test_a_port_in_use_stops_the_start_with_a_clear_error(workers: Workers) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        worker = workers.start("--metrics-port", str(port))
        assert worker.wait() == 1
    assert f"CommandError: Cannot serve metrics on 127.0.0.1:{port}" in worker.log()
    assert "--metrics-port" in worker.log()


def test_a_bad_port_or_address_is_a_command_error() -> None:
    with pytest.raises(CommandError, match=r"Invalid metrics port 70000: use a whole number"):
        call_command("runjobs", "--metrics-port", "70000")
    with pytest.raises(CommandError, match=r"Invalid metrics address '  '"):
        call_command("runjobs", "--metrics-port", "0", "--metrics-addr", "  ")
    with pytest.raises(CommandError, match=r"only metrics_port starts \(runjobs --metrics-port"):
        call_command("runjobs", "--metrics-addr", "127.0.0.2")


def test_without_prometheus_client_the_flag_names_the_extra(tmp_path: Any) -> None:
    # A process in which prometheus_client cannot be imported (None in sys.modules makes
    # Python refuse it), as without the extra installed.
    script = (
        "import sys; sys.modules['prometheus_client'] = None; import django; django.setup(); "
        "from django.core.management import execute_from_command_line; "
        "execute_from_command_line(['manage.py', 'runjobs', '--burst', '--metrics-port', '0'])"
    )
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "testproject.settings"}
    run = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 1, run.stderr
    assert "CommandError: runjobs --metrics-port needs prometheus_client" in run.stderr
    assert "pip install 'django-pgjobs[prometheus]'" in run.stderr


def test_two_workers_metrics_in_one_process_do_not_clash() -> None:
    first, second = WorkerMetrics(), WorkerMetrics()
    first.finished(NOOP, "done", 0.01)
    first.finished(NOOP, "done", 0.02)
    second.finished(NOOP, "failed", 0.5)
    assert (
        first.registry.get_sample_value(
            "pgjobs_worker_jobs_finished_total", {"task": NOOP, "outcome": "done"}
        )
        == 2
    )
    assert (
        second.registry.get_sample_value(
            "pgjobs_worker_jobs_finished_total", {"task": NOOP, "outcome": "done"}
        )
        is None
    )
    assert (
        second.registry.get_sample_value(
            "pgjobs_worker_jobs_finished_total", {"task": NOOP, "outcome": "failed"}
        )
        == 1
    )
