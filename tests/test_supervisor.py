"""``runjobs --processes N`` on real processes: the supervisor's children share the work, a
child killed with SIGKILL is replaced and its jobs come back through their leases, SIGTERM
drains every child (and a second one stops them at once), the children ride out a database
outage without a restart, and bad options are refused.

Each job records the process that ran it (``tests.workers.record_pid``); which process is
which comes from the supervisor's log ("runjobs process I started (pid P)")."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from django_pgjobs.models import Job
from django_pgjobs.worker.supervisor import Supervisor, without_option
from testproject.shop.models import Order
from tests.helpers import DbThread, wait_until
from tests.workers import (
    OUTAGE_OPTIONS,
    Process,
    Workers,
    count_orders,
    counts,
    query,
    record_pid,
    ride_out_an_outage,
)

pytestmark = pytest.mark.django_db(transaction=True)

STARTED = re.compile(r"runjobs process (\d+) started \(pid (\d+)\)")
GO = "go@example.com"


@pytest.fixture
def supervised(workers: Workers) -> Iterator[Workers]:
    """``workers``, and at the end every child any supervisor started is killed too (each
    runs in a session of its own: killing the supervisor leaves them running)."""
    yield workers
    for process in workers.started:
        process.kill()
    for process in workers.started:
        for _index, pid in children(process):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def children(supervisor: Process) -> list[tuple[int, int]]:
    """(index, pid) of every child the supervisor started, in the order it started them."""
    return [(int(i), int(pid)) for i, pid in STARTED.findall(supervisor.log())]


def wait_for_children(supervisor: Process, count: int) -> list[tuple[int, int]]:
    wait_until(
        lambda: len(children(supervisor)) >= count or not supervisor.alive,
        message=f"{count} children to be started",
    )
    assert supervisor.alive, supervisor.tail()
    return children(supervisor)


def runs() -> dict[int, list[tuple[int, int]]]:
    """Job id -> (pid, attempt) of each run that got to its end (``record_pid``)."""
    found: dict[int, list[tuple[int, int]]] = {}
    for email, attempt in Order.objects.values_list("email", "total_cents"):
        match = re.fullmatch(r"ran-(\d+)-(\d+)@example\.com", email)
        if match:
            found.setdefault(int(match[1]), []).append((int(match[2]), attempt))
    return found


def started() -> int:
    return Order.objects.filter(email__startswith="started-").count()


def held_by(pid: int) -> set[int]:
    """Running jobs whose latest attempt the worker of ``pid`` claimed."""
    worker_id = f"{socket.gethostname()}:{pid}"
    return {
        row[0]
        for row in query(
            "SELECT id FROM pgjobs_job WHERE status = 'running' AND worker_ids ->> -1 = %s",
            [worker_id],
        )
    }


def endings(supervisor: Process, how: str) -> int:
    """How many children the supervisor saw end ``how`` ("exited with status 0")."""
    return len(re.findall(rf"runjobs process \d+ \(pid \d+\) {how}", supervisor.log()))


def stopping_lines(
    supervisor: Process, again: bool = False, sig: signal.Signals = signal.SIGTERM
) -> int:
    """How many children logged that they began a shutdown on ``sig`` (``again``: an exit
    at once)."""
    return supervisor.log().count(
        f"{sig.name} again: exiting now" if again else f"{sig.name}: stopping ("
    )


def test_two_processes_drain_the_queue_and_both_run_jobs(supervised: Workers) -> None:
    # Two jobs that each wait until both are running: with one executor per child, they can
    # only end if each child holds one. They go first (priority); twenty more follow.
    Job.objects.enqueue_many(record_pid, [{"together": 2}] * 2, priority=10)
    Job.objects.enqueue_many(record_pid, [{}] * 20)
    supervisor = supervised.start(
        "--burst", "--processes", "2", "--concurrency", "1", test_jobs=True
    )

    assert supervisor.wait() == 0, supervisor.tail()

    assert counts() == {"done": 22}
    ran = runs()
    assert sorted(ran) == sorted(Job.objects.values_list("id", flat=True))
    assert all(len(each) == 1 for each in ran.values()), ran
    pids = {pid for [(pid, _attempt)] in ran.values()}
    # Both children ran jobs, and only they did: the supervisor runs none.
    assert pids == {pid for _index, pid in children(supervisor)}
    assert len(pids) == 2 and supervisor.pid not in pids
    # A burst child that exits 0 is done, not started again.
    log = supervisor.log()
    assert len(children(supervisor)) == 2, log
    assert endings(supervisor, "exited with status 0") == 2, log
    assert "ran " in supervisor.output()


def test_a_child_killed_with_sigkill_is_replaced_and_its_jobs_come_back(
    supervised: Workers,
) -> None:
    jobs = list(Job.objects.enqueue_many(record_pid, [{"go": GO}] * 4))
    supervisor = supervised.start(
        "--processes",
        "2",
        "--concurrency",
        "2",
        "--lease",
        "3",
        "--reap-interval",
        "1",
        "--poll-interval",
        "1",
        test_jobs=True,
    )
    first = dict(wait_for_children(supervisor, 2))
    # Two running jobs in each child (two executors each), every one of them started.
    wait_until(lambda: started() == 4, message="the four jobs to start")
    victim_index, victim = next(iter(first.items()))
    killed = held_by(victim)
    assert len(killed) == 2, (killed, counts())

    os.kill(victim, signal.SIGKILL)

    supervisor.wait_for_log(f"runjobs process {victim_index} (pid {victim}) was killed by SIGKILL")
    later = wait_for_children(supervisor, 3)
    assert later[:2] == list(first.items())
    replacement_index, replacement = later[2]
    assert replacement_index == victim_index and replacement not in first.values()
    # The killed child's jobs come back when their leases expire, and run again: on the
    # replacement, the only child with free executors (the other one's are busy). Each
    # counts a crash, so it runs alone (docs/timeouts.md): one of them at a time.
    wait_until(
        lambda: held_by(replacement) & killed,
        message="a job of the killed child to run again on its replacement",
    )
    Order.objects.create(email=GO, total_cents=1)
    wait_until(lambda: counts() == {"done": 4}, message="every job to be done")

    ran = runs()
    # Every job ended done exactly once: none lost, none recorded twice; the killed child's
    # on their second attempt, in another process.
    assert sorted(ran) == sorted(jobs)
    assert all(len(each) == 1 for each in ran.values()), ran
    survivor = next(pid for pid in first.values() if pid != victim)
    assert {job_id: ran[job_id][0][1] for job_id in killed} == dict.fromkeys(killed, 2)
    assert {ran[job_id][0][0] for job_id in killed} <= {replacement, survivor}
    assert {job_id: each for job_id, each in ran.items() if job_id not in killed} == {
        job_id: [(survivor, 1)] for job_id in set(jobs) - killed
    }
    assert dict(query("SELECT id, attempts FROM pgjobs_job")) == {
        job_id: 2 if job_id in killed else 1 for job_id in jobs
    }

    supervisor.send(signal.SIGTERM)
    assert supervisor.wait() == 0, supervisor.tail()
    assert len(children(supervisor)) == 3


def start_two_holding_jobs(supervised: Workers) -> Process:
    """A supervisor of two children with one executor each, each running a job that waits
    for the test's go-ahead, and four more jobs queued behind them."""
    Job.objects.enqueue_many(record_pid, [{"go": GO}] * 2, priority=10)
    Job.objects.enqueue_many(record_pid, [{}] * 4)
    supervisor = supervised.start(
        "--processes", "2", "--concurrency", "1", "--poll-interval", "1", test_jobs=True
    )
    wait_for_children(supervisor, 2)
    wait_until(lambda: started() == 2, message="a job to start in each child")
    return supervisor


def test_the_children_ride_out_a_database_outage_and_none_is_restarted(
    supervised: Workers,
) -> None:
    # Enough work that the outage lands mid-run even when this test is slow to send it
    # (about 5 s of it is left once 50 are done).
    total = 1000
    Job.objects.enqueue_many(count_orders, [{"pause": 0.02}] * total)
    supervisor = supervised.start(
        "--processes", "2", "--concurrency", "2", *OUTAGE_OPTIONS, test_jobs=True
    )
    wait_for_children(supervisor, 2)
    # Every connection of both children (they share the supervisor's application_name).
    log = ride_out_an_outage(supervisor, total, after=50, victims=4)
    # The outage was ridden out inside each child: none died, none was started again.
    assert len(children(supervisor)) == 2, log
    supervisor.send(signal.SIGTERM)
    assert supervisor.wait() == 0, supervisor.tail()
    assert endings(supervisor, "exited with status 0") == 2, supervisor.log()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_drains_every_child_then_the_supervisor_exits_0(
    supervised: Workers, sig: signal.Signals
) -> None:
    supervisor = start_two_holding_jobs(supervised)

    supervisor.send(sig)

    # Each child got the signal, once: it stops claiming and waits for its running job.
    wait_until(lambda: stopping_lines(supervisor, sig=sig) == 2, message="both children to stop")
    assert supervisor.alive
    assert all(alive(pid) for _index, pid in children(supervisor))
    assert counts() == {"running": 2, "queued": 4}
    Order.objects.create(email=GO, total_cents=1)

    assert supervisor.wait() == 0, supervisor.tail()
    # The running jobs finished; nothing more was claimed; no child was started again.
    assert counts() == {"done": 2, "queued": 4}
    assert len(children(supervisor)) == 2
    assert stopping_lines(supervisor, again=True, sig=sig) == 0
    assert endings(supervisor, "exited with status 0") == 2


def test_a_second_sigterm_stops_every_child_at_once(supervised: Workers) -> None:
    supervisor = start_two_holding_jobs(supervised)
    supervisor.send(signal.SIGTERM)
    wait_until(lambda: stopping_lines(supervisor) == 2, message="both children to stop")

    supervisor.send(signal.SIGTERM)

    # The children exit at once (status 1), ending the leases of the jobs they held; the
    # supervisor says so with its own status 1.
    assert supervisor.wait() == 1, supervisor.tail()
    assert stopping_lines(supervisor, again=True) == 2
    assert endings(supervisor, "exited with status 1") == 2
    assert len(children(supervisor)) == 2
    assert counts() == {"running": 2, "queued": 4}
    assert query(
        "SELECT count(*) FROM pgjobs_job WHERE status = 'running' AND locked_until <= now()"
    ) == [(2,)]
    reaper = supervised.run("reapjobs")
    assert "reaped 2 jobs: 2 requeued, 0 failed" in reaper.output()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def waiting_child(ready: Path) -> list[str]:
    """A child's command line: it notes in ``ready`` that it runs, then sleeps until a signal."""
    return [
        sys.executable,
        "-c",
        f"import time; open({str(ready)!r}, 'a').write('x'); time.sleep(600)",
    ]


def wait_for_ready(ready: Path, count: int) -> None:
    wait_until(
        lambda: ready.exists() and len(ready.read_text()) == count,
        message=f"{count} children to run",
    )


def run_in_thread(supervisor: Supervisor) -> DbThread:
    thread = DbThread(supervisor.run)
    thread.start()
    return thread


def test_a_supervisor_in_python_starts_a_failing_child_again_until_stopped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    starts = tmp_path / "starts"
    # Each start notes itself, then fails at once.
    command = [
        sys.executable,
        "-c",
        f"import sys; open({str(starts)!r}, 'a').write('x'); sys.exit(3)",
    ]
    supervisor = Supervisor(command, 1)
    thread = run_in_thread(supervisor)
    child = supervisor.children[0]
    # Started again twice, and down again: waiting 4 s for its next start (a stop that came
    # while it ran would end it by the signal, as cleanly as a drained worker).
    wait_until(
        lambda: (
            starts.exists()
            and len(starts.read_text()) >= 3
            and child.process is None
            and child.returncode == 3
        ),
        message="the failing child to be started again twice, and to fail again",
    )

    supervisor.stop()

    # Its last exit was a failure: the supervisor says so.
    assert thread.result() == 1
    assert child.returncode == 3 and child.process is None
    # Each death is logged with the child's index, pid and exit status, and the wait.
    assert re.search(
        r"runjobs process 0 \(pid \d+\) exited with status 3 after [\d.]+ s; the jobs it held "
        r"come back when their leases expire; starting it again in 2 s",
        caplog.text,
    ), caplog.text


def test_a_stop_from_python_reaches_every_child_and_none_starts_again(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    # Children that say they run, then wait for their signal (Python's default SIGTERM: an
    # end by the signal the supervisor passed on, which counts as a clean stop).
    supervisor = Supervisor(waiting_child(ready), 2)
    thread = run_in_thread(supervisor)
    wait_for_ready(ready, 2)

    supervisor.stop()

    assert thread.result() == 0
    assert [child.returncode for child in supervisor.children] == [0, 0]
    assert len(ready.read_text()) == 2


def test_burst_children_that_exit_0_end_the_supervisor() -> None:
    supervisor = Supervisor([sys.executable, "-c", "pass"], 3, burst=True)
    assert supervisor.run() == 0
    assert [child.finished for child in supervisor.children] == [True] * 3


def test_a_burst_whose_child_died_ends_with_status_1(tmp_path: Path) -> None:
    # The first start is killed (as by the OOM killer), the next exits 0, as the replacement
    # of a burst child does when the dead one's jobs are still leased: the run did not run
    # every job, and must not report success.
    starts = tmp_path / "starts"
    script = (
        "import os, signal\n"
        f"path = {str(starts)!r}\n"
        "first = not os.path.exists(path)\n"
        "open(path, 'a').write('x')\n"
        "if first:\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    supervisor = Supervisor([sys.executable, "-c", script], 1, burst=True)

    assert supervisor.run() == 1
    assert starts.read_text() == "xx"
    assert supervisor.deaths == 1
    assert supervisor.children[0].returncode == 0


def test_a_hangup_drains_the_children_instead_of_orphaning_them(supervised: Workers) -> None:
    # The children run in sessions of their own: a supervisor killed by SIGHUP (a closed
    # terminal or ssh session) would leave them claiming with no one to stop them.
    supervisor = start_two_holding_jobs(supervised)
    pids = [pid for _index, pid in children(supervisor)]

    supervisor.send(signal.SIGHUP)

    # Passed on as a first SIGTERM: both children drain.
    wait_until(
        lambda: stopping_lines(supervisor, sig=signal.SIGTERM) == 2,
        message="both children to stop",
    )
    assert supervisor.alive
    Order.objects.create(email=GO, total_cents=1)
    assert supervisor.wait() == 0, supervisor.tail()
    wait_until(lambda: not any(alive(pid) for pid in pids), message="both children to exit")
    assert counts() == {"done": 2, "queued": 4}


def test_a_supervisor_leaving_early_stops_its_children(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    supervisor = Supervisor(waiting_child(ready), 2)

    def failing_stop(sig: signal.Signals) -> None:
        # An error of the supervisor's own, before it passed the stop on.
        raise RuntimeError("the supervisor's own bug")

    supervisor._on_stop_signal = failing_stop  # type: ignore[method-assign]
    thread = run_in_thread(supervisor)
    wait_for_ready(ready, 2)

    def recorded() -> list[int]:
        pids = [c.process.pid for c in supervisor.children if c.process is not None]
        return pids if len(pids) == 2 else []

    # A child notes that it runs as soon as it starts, which on a busy machine can come before
    # the supervisor's thread, back from starting it, has recorded its process.
    pids = wait_until(recorded, message="the supervisor to record both children")

    supervisor.stop()

    with pytest.raises(RuntimeError, match="own bug"):
        thread.result()
    wait_until(lambda: not any(alive(pid) for pid in pids), message="both children to exit")


@pytest.mark.parametrize("processes", [0, -1])
def test_processes_must_be_one_or_more(processes: int) -> None:
    with pytest.raises(CommandError, match=rf"Invalid processes {processes}: use a whole number"):
        call_command("runjobs", processes=processes)


def test_metrics_port_cannot_serve_several_processes() -> None:
    with pytest.raises(CommandError, match="--metrics-port cannot serve 2 processes"):
        call_command("runjobs", processes=2, metrics_port=9100)


def test_several_processes_need_a_command_line() -> None:
    with pytest.raises(CommandError, match=r"call_command\(\) has none"):
        call_command("runjobs", processes=2, burst=True)


def test_bad_options_stop_the_supervisor_before_any_child_starts(supervised: Workers) -> None:
    supervisor = supervised.start("--processes", "2", "--concurrency", "0")
    assert supervisor.wait() == 1
    assert "Invalid concurrency 0" in supervisor.log()
    assert children(supervisor) == []


@pytest.mark.parametrize(
    ("args", "kept"),
    [
        (["--burst", "--processes", "2", "-v", "2"], ["--burst", "-v", "2"]),
        (["--processes=2", "--poll-interval", "1"], ["--poll-interval", "1"]),
        (["--proc", "3", "--queue", "a"], ["--queue", "a"]),
        (["--pr=3"], []),
        (
            ["--poll-interval=5", "--queue", "processes"],
            ["--poll-interval=5", "--queue", "processes"],
        ),
    ],
)
def test_the_children_run_the_command_line_without_processes(
    args: list[str], kept: list[str]
) -> None:
    assert without_option(args, "--processes") == kept
