"""What every peer driver shares: the command line, the worker process, W3's pacing, output.

Standard library only: each driver runs with its peer's own virtualenv's Python, which has
that peer's packages and nothing of this project's (the driver's folder is on ``sys.path``
because Python puts a script's folder there).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

HERE = Path(__file__).resolve().parent
WORKER_TIMEOUT = 900.0  # seconds; a worker running longer than this is stuck
STAMP_TIMEOUT = 60.0  # seconds for W3's jobs to start once the last one is enqueued


class RunInvalid(Exception):
    """The run lost, repeated or failed a job, or a worker failed: its figures are void."""


def fail(message: str) -> NoReturn:
    print(f"{Path(sys.argv[0]).name}: INVALID RUN: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def emit(result: dict[str, Any] | None) -> None:
    """The driver's one line of output: a JSON object (or null) on stdout."""
    print(json.dumps(result), flush=True)


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("command", choices=("setup", "version", "w1", "w2-single", "w2-bulk", "w3"))
    p.add_argument("--dsn", default="", help="the peer's own database (postgres://...)")
    p.add_argument("--jobs", type=int, default=10_000, help="jobs of W1 and W2")
    p.add_argument("--concurrency", type=int, default=8, help="W1's worker concurrency")
    p.add_argument("--latency-jobs", type=int, default=200, help="W3's measured jobs")
    p.add_argument("--gap", type=float, default=0.050, help="W3's seconds between enqueues")
    p.add_argument("--warmup", type=int, default=5, help="W3's warm-up jobs (not measured)")
    p.add_argument("--scratch", default="", help="a folder for W3's stamp file")
    return p


def worker_env(dsn: str, **extra: str) -> dict[str, str]:
    env = {**os.environ, "PEERS_DSN": dsn, "PYTHONPATH": str(HERE)}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    env.update(extra)
    return env


def install(command: list[str], env: dict[str, str], what: str) -> dict[str, Any]:
    """Run a peer's schema installer; its output goes to the log (stderr)."""
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    sys.stderr.write(done.stdout + done.stderr)
    if done.returncode:
        raise RunInvalid(f"{what} exited with {done.returncode}")
    return {"installed": True}


def spawn(command: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start a worker; its output goes to the driver's stderr (the suite's worker log)."""
    print(f"$ {' '.join(command)}", file=sys.stderr, flush=True)
    return subprocess.Popen(command, env=env, cwd=HERE, stdout=sys.stderr, stderr=sys.stderr)


class Reaper:
    """Reaps one worker in a thread with ``os.wait4``: exit code, CPU seconds, exit time."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.code: int | None = None
        self.cpu_s = 0.0
        self.exited_at = 0.0
        self.thread = threading.Thread(target=self._wait, daemon=True)
        self.thread.start()

    def _wait(self) -> None:
        _pid, status, usage = os.wait4(self.proc.pid, 0)
        self.exited_at = time.time()
        self.code = os.waitstatus_to_exitcode(status)
        self.proc.returncode = self.code
        self.cpu_s = usage.ru_utime + usage.ru_stime

    def alive(self) -> bool:
        return self.thread.is_alive()

    def join(self, timeout: float = WORKER_TIMEOUT) -> int:
        self.thread.join(timeout)
        if self.thread.is_alive():
            self.proc.kill()
            self.thread.join(10)
            raise RunInvalid(f"a worker ran longer than {timeout:.0f} s: killed")
        assert self.code is not None
        return self.code

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (a graceful stop for all three peers), then wait."""
        if self.alive():
            self.proc.terminate()
        return self.join(timeout)


def run_workers(commands: list[list[str]], env: dict[str, str]) -> tuple[float, float, float]:
    """Run workers that exit by themselves (burst/drain mode) and wait for all of them.

    Returns (spawned at, last exit at, CPU seconds of all of them), wall clock from
    ``time.time()``. Any non-zero exit makes the run invalid.
    """
    started = time.time()
    reapers = [Reaper(spawn(command, env)) for command in commands]
    codes = [reaper.join() for reaper in reapers]
    if any(codes):
        raise RunInvalid(f"worker exit codes {codes}; see the worker log")
    return started, max(r.exited_at for r in reapers), sum(r.cpu_s for r in reapers)


def empty_run_cpu(commands: list[list[str]], env: dict[str, str]) -> float:
    """CPU seconds of the same workers on an empty queue: start-up, one look, shut-down."""
    _spawned, _exited, cpu = run_workers(commands, env)
    return cpu


def w1_result(
    *,
    jobs: int,
    concurrency: int | None,
    processes: int,
    spawned: float,
    first_start: float,
    last_done: float,
    exited: float,
    cpu_s: float,
    empty_cpu_s: float,
    **extra: Any,
) -> dict[str, Any]:
    """W1's figures. ``jobs_per_s``: first job start -> last completion, from the peer's own
    timestamps (the project's W1 definition); ``jobs_per_s_incl_startup``: from the spawn."""
    span = last_done - first_start
    incl = last_done - spawned
    return {
        "jobs": jobs,
        "concurrency": concurrency,
        "processes": processes,
        "span_s": span,
        "jobs_per_s": jobs / span if span > 0 else None,
        "seconds": incl,
        "jobs_per_s_incl_startup": jobs / incl if incl > 0 else None,
        "wall_s": exited - spawned,
        "worker_cpu_s": cpu_s,
        "worker_cpu_ms_per_job": cpu_s * 1000 / jobs,
        "empty_run_cpu_s": empty_cpu_s,
        "worker_cpu_net_ms_per_job": (cpu_s - empty_cpu_s) * 1000 / jobs,
        **extra,
    }


def rate(jobs: int, seconds: float, **extra: Any) -> dict[str, Any]:
    return {"jobs": jobs, "seconds": seconds, "jobs_per_s": jobs / seconds, **extra}


def paced(first: int, total: int, gap: float) -> Iterator[int]:
    """Yield ``first .. total-1``, each ``gap`` seconds after the previous one's slot."""
    begin = time.monotonic()
    for seq in range(first, total):
        delay = begin + (seq - first) * gap - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        yield seq


def read_stamps(path: Path, total: int, timeout: float = STAMP_TIMEOUT) -> dict[int, float]:
    """The ``seq time`` lines the stamp job wrote; every seq exactly once, or the run is void."""
    deadline = time.monotonic() + timeout
    while True:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= total or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    seen: dict[int, float] = {}
    for line in lines:
        seq, at = line.split()
        if int(seq) in seen:
            raise RunInvalid(f"W3: job {seq} started twice")
        seen[int(seq)] = float(at)
    if len(seen) != total:
        raise RunInvalid(f"W3: {len(seen)} of {total} jobs started within {timeout:.0f} s")
    return seen


def wait_for_stamp(path: Path, seq: int, reaper: Reaper, timeout: float = 120.0) -> None:
    """Wait until job ``seq`` has started: the idle worker is up and taking jobs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not reaper.alive():
            raise RunInvalid(f"W3: the worker exited with {reaper.code} before taking a job")
        if path.exists() and any(
            line.split()[0] == str(seq) for line in path.read_text().splitlines()
        ):
            return
        time.sleep(0.02)
    raise RunInvalid(f"W3: the warm-up job did not start within {timeout:.0f} s")


def w3_result(
    committed: dict[int, float],
    started: dict[int, float],
    warmup: int,
    gap: float,
    **extra: Any,
) -> dict[str, Any]:
    latencies = sorted((started[seq] - committed[seq]) * 1000 for seq in committed if seq >= warmup)
    cuts = statistics.quantiles(latencies, n=100, method="inclusive")
    return {
        "jobs": len(latencies),
        "gap_s": gap,
        "p50_ms": cuts[49],
        "p95_ms": cuts[94],
        "p99_ms": cuts[98],
        "min_ms": latencies[0],
        "max_ms": latencies[-1],
        "latencies_ms": latencies,
        **extra,
    }


def w3_run(
    args: argparse.Namespace,
    start_worker: Callable[[], Reaper],
    enqueue: Callable[[int, str], float],
    **extra: Any,
) -> dict[str, Any]:
    """W3 for any peer: ``enqueue(seq, out)`` returns ``time.time()`` right after its commit."""
    out = Path(args.scratch or "/tmp") / f"peer-stamps-{os.getpid()}.txt"  # noqa: S108
    out.unlink(missing_ok=True)
    total = args.warmup + args.latency_jobs
    committed: dict[int, float] = {}
    reaper = start_worker()
    try:
        enqueue(0, str(out))  # the first warm-up job: proves the worker is up and polling
        wait_for_stamp(out, 0, reaper)
        time.sleep(0.5)
        for seq in paced(1, total, args.gap):
            committed[seq] = enqueue(seq, str(out))
        started = read_stamps(out, total)
    finally:
        code = reaper.stop()
        out.unlink(missing_ok=True)
    if code not in (0, -15, 143):
        raise RunInvalid(f"W3: the worker exited with {code}; see the worker log")
    return w3_result(committed, started, args.warmup, args.gap, **extra)


def main_guard(run: Callable[[], dict[str, Any] | None]) -> None:
    """Run one subcommand; print its JSON, or exit 2 with the reason the run is invalid."""
    try:
        result = run()
    except RunInvalid as exc:
        fail(str(exc))
    emit(result)
