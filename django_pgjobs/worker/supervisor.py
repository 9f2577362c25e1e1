"""``runjobs --processes N``: N worker processes under one supervisor.

A worker runs its jobs' Python code on one core at a time (the GIL), so CPU-bound jobs need
more processes. The supervisor starts N children, each a complete ``runjobs`` worker (its own
producer, executors, completer, listener and connections) in a fresh interpreter running the
same command line without ``--processes``. The children are spawned, never forked: a fork
would copy the parent's open database connections, its threads' locks and Django's state into
every child. The supervisor itself opens no connection and claims nothing.

A child that dies (a non-zero exit status, a signal: the out-of-memory killer's SIGKILL, a
segfault) is started again after a backoff; the jobs it held come back through their leases,
as any crashed worker's do. SIGTERM and SIGINT are passed on to every child, so the first
signal drains them all and a second stops them at once, as for one worker.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType

from django_pgjobs.core import validation
from django_pgjobs.worker.stuck import EXIT_STUCK

logger = logging.getLogger(__name__)

__all__ = ["Supervisor", "child_command"]

# Seconds before a dead child is started again: doubled for each death in a row, up to the
# most; a child that ran this long before it died is not dying in a loop (back to the first).
RESTART_DELAY = 1.0
MAX_RESTART_DELAY = 30.0
STABLE_AFTER = 60.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
OPTION = "--processes"


def child_command(name: str, option: str = OPTION) -> list[str] | None:
    """This process's command line (``sys.orig_argv``: interpreter options, the script,
    ``-m`` or ``-c``, then the arguments) without ``option`` and its value, for this
    interpreter (``sys.executable``). None unless the arguments run the management command
    ``name`` (as ``manage.py name``, ``django-admin name`` or ``python -m django name`` do):
    ``call_command()`` has no command line to run again."""
    orig = list(sys.orig_argv)
    head = len(orig) - len(sys.argv) + 1
    if head < 1 or sys.argv[1:2] != [name] or orig[head : head + 1] != [name]:
        return None
    return [sys.executable, *orig[1:head], *without_option(orig[head:], option)]


def without_option(args: Sequence[str], option: str) -> list[str]:
    """``args`` without ``option VALUE`` or ``option=VALUE``, the option also as any
    abbreviation argparse would take for it (longer than ``--`` and one letter)."""
    kept: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
            continue
        name, equals, _value = arg.partition("=")
        if len(name) > 3 and option.startswith(name):
            skip = not equals
            continue
        kept.append(arg)
    return kept


def ending(returncode: int) -> str:
    """How a child ended, for the log: its exit status, or the signal that killed it."""
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    if returncode == EXIT_STUCK:
        return (
            f"exited with status {EXIT_STUCK} (executor threads, or its event loop, stuck in "
            "jobs past their timeout)"
        )
    return f"exited with status {returncode}"


@dataclass
class Child:
    """One of the supervisor's N slots, and the process now in it."""

    index: int
    process: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    # The wait before the next restart after a death.
    delay: float = RESTART_DELAY
    # When a dead child is due to start again (monotonic), if it is waiting to.
    restart_at: float | None = None
    # The latest exit status (None: never exited).
    returncode: int | None = None
    finished: bool = False


class Supervisor:
    """Keep ``processes`` children running ``command`` (a ``runjobs`` command line).

    ``run()`` starts them, starts again each one that dies (after ``RESTART_DELAY`` seconds,
    doubled per death in a row up to ``MAX_RESTART_DELAY``, back to the first after a child
    ran ``STABLE_AFTER`` seconds), and returns the exit status once every child has ended:
    0 when each last exited 0 (and, with ``burst``, none died on the way), else 1. With
    ``burst`` a child that exits 0 has drained its queues and is done; otherwise one that
    exits 0 (``--max-jobs``) is replaced at once. SIGHUP drains the children as a first
    SIGTERM does, and a supervisor leaving ``run()`` on an error terminates them.
    ``stop()`` (or SIGTERM/SIGINT once ``install_signal_handlers()`` was called) passes the
    signal on to every child: the first drains them, a second stops them at once; no child
    is started again once a stop began.
    """

    def __init__(self, command: Sequence[str], processes: int, *, burst: bool = False) -> None:
        self.command = list(command)
        self.processes = validation.positive_int("processes", processes)
        self.burst = burst
        self.children = [Child(index) for index in range(self.processes)]
        self.signals = 0
        # Children that died (a non-zero exit or a signal not passed on by us).
        self.deaths = 0
        # Signals, and children whose process exited, in the order they came.
        # SimpleQueue.put() is reentrant: the signal handler may run inside the loop's get().
        self._events: queue.SimpleQueue[signal.Signals | Child] = queue.SimpleQueue()

    # -- control ---------------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)
        # A hangup (the terminal or ssh session went away) would kill the supervisor and
        # leave its children, in sessions of their own, running with no one to stop them:
        # it drains them instead, as a first SIGTERM does.
        signal.signal(signal.SIGHUP, self._on_hangup)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._events.put(signal.Signals(signum))

    def _on_hangup(self, signum: int, frame: FrameType | None) -> None:
        self._events.put(signal.SIGTERM)

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """As if the supervisor received ``signum``; callable from any thread."""
        self._events.put(signal.Signals(signum))

    @property
    def stopping(self) -> bool:
        return self.signals > 0

    # -- the run ---------------------------------------------------------------------------

    def run(self) -> int:
        logger.info(
            "supervisor (pid %s) starting %s runjobs processes: %s",
            os.getpid(),
            self.processes,
            " ".join(self.command),
            extra={"action": "start"},
        )
        try:
            for child in self.children:
                self._start(child)
            while not all(child.finished for child in self.children):
                due = [c.restart_at for c in self.children if c.restart_at is not None]
                timeout = max(0.0, min(due) - time.monotonic()) if due else None
                try:
                    event: signal.Signals | Child | None = self._events.get(timeout=timeout)
                except queue.Empty:
                    event = None
                if isinstance(event, Child):
                    self._on_exit(event)
                elif event is not None:
                    self._on_stop_signal(event)
                self._restart_due()
        finally:
            # Leaving early (an error of ours, a KeyboardInterrupt): no child outlives us.
            self._terminate_running()
        status = 0 if all(child.returncode == 0 for child in self.children) else 1
        if self.burst and self.deaths:
            # A burst whose child died did not run every job: the replacement found the dead
            # one's jobs still leased and ended, and they wait for a reaper.
            status = 1
        logger.info(
            "supervisor (pid %s) stopped: %s",
            os.getpid(),
            ", ".join(
                f"process {c.index} "
                + ("was never started" if c.returncode is None else ending(c.returncode))
                for c in self.children
            ),
            extra={"action": "stop"},
        )
        return status

    def _terminate_running(self) -> None:
        for child in self.children:
            process = child.process
            if process is not None and process.poll() is None:
                logger.error(
                    "supervisor exiting early: stopping runjobs process %s (pid %s)",
                    child.index,
                    process.pid,
                    extra={"action": "shutdown"},
                )
                process.terminate()

    def _start(self, child: Child) -> None:
        child.restart_at = None
        try:
            # A session of its own: a terminal's Ctrl+C reaches the supervisor only, which
            # passes it on once (twice would stop the children at once).
            # The command line is this process's own (child_command()), not outside input.
            process = subprocess.Popen(  # noqa: S603
                self.command, stdin=subprocess.DEVNULL, start_new_session=True
            )
        except OSError:
            logger.exception(
                "runjobs process %s could not be started; trying again in %.0f s",
                child.index,
                child.delay,
                extra={"action": "start"},
            )
            self._retry_later(child)
            return
        child.process, child.started = process, time.monotonic()
        logger.info(
            "runjobs process %s started (pid %s)",
            child.index,
            process.pid,
            extra={"action": "start"},
        )
        threading.Thread(
            target=self._watch,
            args=(child, process),
            name=f"pgjobs-supervise-{child.index}",
            daemon=True,
        ).start()

    def _watch(self, child: Child, process: subprocess.Popen[bytes]) -> None:
        process.wait()
        self._events.put(child)

    def _retry_later(self, child: Child) -> None:
        child.restart_at = time.monotonic() + child.delay
        child.delay = min(child.delay * 2, MAX_RESTART_DELAY)

    def _restart_due(self) -> None:
        now = time.monotonic()
        for child in self.children:
            if child.restart_at is not None and child.restart_at <= now:
                self._start(child)

    def _on_exit(self, child: Child) -> None:
        process = child.process
        assert process is not None
        returncode = process.returncode
        ran = time.monotonic() - child.started
        child.process = None
        if self.stopping and -returncode in STOP_SIGNALS:
            # Killed by the signal passed on before its worker had installed its handlers:
            # it had claimed nothing yet, so it stopped as cleanly as a drained one.
            returncode = 0
        child.returncode = returncode
        how = ending(returncode)
        extra = {"action": "stop", "pid": process.pid, "returncode": returncode}
        if returncode != 0:
            self.deaths += 1
        if self.stopping or (self.burst and returncode == 0):
            child.finished = True
            logger.log(
                logging.INFO if returncode == 0 else logging.WARNING,
                "runjobs process %s (pid %s) %s after %.1f s",
                child.index,
                process.pid,
                how,
                ran,
                extra=extra,
            )
            return
        if returncode == 0:
            # It ended on --max-jobs: a fresh process takes its place, as a process manager
            # would start one.
            logger.info(
                "runjobs process %s (pid %s) %s after %.1f s; starting a fresh one",
                child.index,
                process.pid,
                how,
                ran,
                extra=extra,
            )
            child.delay = RESTART_DELAY
            self._start(child)
            return
        if ran >= STABLE_AFTER:
            child.delay = RESTART_DELAY
        logger.error(
            "runjobs process %s (pid %s) %s after %.1f s; the jobs it held come back when "
            "their leases expire; starting it again in %.0f s",
            child.index,
            process.pid,
            how,
            ran,
            child.delay,
            extra=extra,
        )
        self._retry_later(child)

    def _on_stop_signal(self, sig: signal.Signals) -> None:
        self.signals += 1
        if self.signals > 2:
            return  # the children are exiting at once already
        for child in self.children:
            if child.process is None:
                # Waiting to be started again (or done): it stays down.
                child.restart_at = None
                child.finished = True
        running = [child for child in self.children if child.process is not None]
        if self.signals == 1:
            logger.info(
                "%s: stopping %s runjobs processes (each finishes or releases its jobs; "
                "signal again to stop them at once)",
                sig.name,
                len(running),
                extra={"action": "shutdown"},
            )
        else:
            logger.warning(
                "%s again: %s runjobs processes stop at once",
                sig.name,
                len(running),
                extra={"action": "shutdown"},
            )
        for child in running:
            assert child.process is not None
            child.process.send_signal(sig)
