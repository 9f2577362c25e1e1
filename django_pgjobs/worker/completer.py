"""The completer: records outcomes in batches, each row fenced, and keeps leases alive.

Executors hand it outcomes; it writes all that are waiting with one statement per kind
(complete, fail, snooze, release), so under load one round trip finishes many jobs and when idle
an outcome is written at once. A write that fails because the database is away is retried
with backoff: a failed completion write is not a finished job. If it never succeeds, the
lease expires and the reaper takes over.

It is also the heartbeat: every running job's lease is extended about every lease/3; a
job whose extension changes no row has been taken from us: it is marked cancelled when
``Job.objects.cancel()`` did that, and lost otherwise. And it keeps the timeouts: a job still
running at its deadline (start + timeout) is marked timed out, no longer heartbeated, and
failed with ``JobTimeout``; the worker is told so it can replace the executor stuck in it.
Deadlines and heartbeats share one wait, so an idle completer sleeps.

With ``PGJOBS["COMPLETE_WITH_CLAIM"]`` (``with_claims``), completions ride with the producer's
next claim instead (``claim.CLAIM_COMPLETING``): while the producer says it will claim as soon
as a slot frees (``ride()``), a job's completion waits for that claim, which an executor
finishing a job brings about at once. The producer takes them (``take_completions()``),
writes them in its claim's statement and reports what it wrote (``completed()``), or gives
them back when the statement failed (``give_back()``). A completion waits for a claim at most
``RIDE_WAIT``, and any other outcome is written at once, completions along.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from django.core.exceptions import ImproperlyConfigured
from django.db import connections

from django_pgjobs.core import finish
from django_pgjobs.core.context import JobContext
from django_pgjobs.core.finish import word_not_sent
from django_pgjobs.core.types import Action, ClaimedJob, Outcome
from django_pgjobs.worker.db import ReconnectBackoff, unavailable
from django_pgjobs.worker.executor import timed_out
from django_pgjobs.worker.outcomes import WorkerStats, finished
from django_pgjobs.worker.store import Store

if TYPE_CHECKING:
    from django_pgjobs.worker.metrics import WorkerMetrics

logger = logging.getLogger("django_pgjobs.worker")

# How long a completion waits for the producer's claim before the completer writes it itself.
# The claim comes at once as a rule (the finished job freed a slot); this bounds the rare case
# that it does not (the freed slot's queues are all guarded, a slow claim).
RIDE_WAIT = 0.02


@dataclass
class _Running:
    job: ClaimedJob
    ctx: JobContext
    extended_at: float
    # Monotonic time the job's timeout ends (inf: no timeout, heartbeated as long as it runs).
    deadline: float = math.inf
    # False once the job was taken from us (cancelled, or its lease lost) while it still runs:
    # no heartbeat and no failure to write, but a job that hangs past its deadline still
    # gets its executor abandoned and replaced.
    ours: bool = True


class Completer(threading.Thread):
    def __init__(
        self,
        store: Store,
        lease: timedelta,
        stats: WorkerStats,
        worker_id: str,
        on_retry: Callable[[], None] | None = None,
        on_timeout: Callable[[ClaimedJob], None] | None = None,
        on_written: Callable[[], None] | None = None,
        metrics: WorkerMetrics | None = None,
        with_claims: bool = False,
    ) -> None:
        super().__init__(name="pgjobs-completer", daemon=True)
        self.store = store
        # Called once a failed (or snoozed) job is queued again: its retry sends no NOTIFY.
        self.on_retry = on_retry
        # Called (on this thread) with each job that ran past its timeout, once its failure
        # is queued for writing: its executor is stuck in it.
        self.on_timeout = on_timeout
        # Called (on this thread) after outcomes were written: a suspect waiting to run alone
        # may start once every other outcome of its worker is in the table.
        self.on_written = on_written
        self.lease = lease
        self.beat = lease.total_seconds() / 3
        self.stats = stats
        self.worker_id = worker_id
        # Fed with each outcome written (None: runjobs serves no metrics).
        self.metrics = metrics
        # Taken as the lock itself (its context manager is C; the Condition's is Python, and
        # the executors take it three times a job); the Condition over it is only for the
        # wait. Reentrant: a second SIGTERM's handler reads held() on the producer's thread,
        # which may be inside one of the producer's calls here, holding it.
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        # While this thread waits on the Condition, the monotonic time its wait ends (written
        # holding the lock; None otherwise, or once notified): only a waiting thread needs
        # notifying, once, and only of what falls due before then (Condition.notify() is
        # Python too; a batch of outcomes arrives together).
        self._wakes_at: float | None = None
        self._pending: list[Outcome] = []
        # Monotonic time the oldest pending outcome was recorded.
        self._pending_since = math.inf
        # Whether completions may ride with the producer's claims (PGJOBS["COMPLETE_WITH_CLAIM"]),
        # and whether, now, they wait for its next one (ride()).
        self.with_claims = with_claims
        self._riding = False
        # The queues the producer claims through the guarded claim, which takes no completions:
        # theirs never wait for a claim (under a limit, a job counts until it is written).
        self._guarded: frozenset[str] = frozenset()
        # Jobs of the guarded claim written since the last word to other workers
        # (_wake_freed(); this thread's own).
        self._to_wake: list[int] = []
        # Completions the producer wrote, and the ids its fence let through (completed()).
        self._written: list[tuple[list[Outcome], set[int]]] = []
        self._running: dict[int, _Running] = {}
        # Every job this worker claimed and has not yet written an outcome for.
        self._held: dict[int, ClaimedJob] = {}
        self._last_failure = -math.inf
        self._closing = False
        self._give_up = threading.Event()

    # -- called by the producer and the executors -----------------------------------------

    def hold(self, jobs: list[ClaimedJob]) -> None:
        """Claimed jobs are ours until their outcome is written (or the lease is lost)."""
        with self._lock:
            self._held.update((job.id, job) for job in jobs)

    def held(self) -> list[ClaimedJob]:
        with self._lock:
            return list(self._held.values())

    def holds_any(self) -> bool:
        """Whether any job is held (the producer asks before each claim: is it busy?)."""
        return bool(self._held)

    def holds(self, job: ClaimedJob) -> bool:
        """Whether ``job`` is still ours: claimed, and neither written nor taken from us.
        One dict look-up, atomic on its own: the lock would add nothing to it."""
        return self._held.get(job.id) is job

    @property
    def last_failure(self) -> float:
        """Monotonic time of this completer's latest failed write (-inf: none yet).

        While the database was away, outcomes waited and leases were not extended: the
        worker reaps nothing until this is well in the past."""
        return self._last_failure

    def track(self, job: ClaimedJob, ctx: JobContext, *, timed: bool = True) -> None:
        """Keep the job's lease alive from now on; with ``timed``, its timeout starts now."""
        with self._lock:
            now = time.monotonic()
            deadline = now + job.timeout if timed and job.timeout is not None else math.inf
            self._running[job.id] = _Running(job, ctx, now, deadline)
            # Under load the wait ends no later than this job's first heartbeat: another
            # job's lease, extended no later than now, is due first.
            if self._wakes_at is not None and min(now + self.beat, deadline) < self._wakes_at:
                self._notify()

    def untrack(self, job: ClaimedJob) -> None:
        with self._lock:
            self._stop_tracking(job)

    def _notify(self) -> None:
        """Wake this thread if it waits and was not woken yet (called holding the lock)."""
        if self._wakes_at is not None:
            self._wakes_at = None
            self._cond.notify()

    def _stop_tracking(self, job: ClaimedJob) -> None:
        """Forget this claim's heartbeat (with the lock held): only if the entry is still this
        claim's, since a job whose outcome is written may be claimed again at once (a release,
        a retry without backoff) and the new claim's entry has the same id."""
        running = self._running.get(job.id)
        if running is not None and running.job is job:
            del self._running[job.id]

    def _release_hold(self, job: ClaimedJob) -> None:
        """Forget that this claim is held (with the lock held): only if it is still this claim,
        for the same reason; dropping the new claim's hold made its executor skip it as not
        ours, and the job waited out its whole lease ``running``."""
        if self._held.get(job.id) is job:
            del self._held[job.id]

    def record(self, outcome: Outcome) -> None:
        with self._lock:
            if not self._pending:
                self._pending_since = time.monotonic()
            self._pending.append(outcome)
            self._notify()

    # -- called by the producer ----------------------------------------------------------

    def ride(self, riding: bool, guarded: frozenset[str] = frozenset()) -> None:
        """Whether the producer makes a plain claim as soon as a slot frees: completions
        recorded while it does wait for that claim (at most ``RIDE_WAIT``), except those of
        the ``guarded`` queues; once it does not, they are written."""
        if not self.with_claims:
            return  # completions never wait: nothing to tell
        with self._lock:
            if riding != self._riding or guarded != self._guarded:
                self._riding, self._guarded = riding, guarded
                self._notify()

    def take_completions(self) -> list[Outcome]:
        """The completions waiting to be written, now the producer's to write (none unless
        completions ride with claims)."""
        if not self.with_claims:
            return []
        with self._lock:
            taken = [o for o in self._pending if self._rides(o)]
            if taken:
                self._pending = [o for o in self._pending if not self._rides(o)]
            return taken

    def completed(self, group: list[Outcome], done: set[int]) -> None:
        """The producer wrote ``group`` (from ``take_completions()``); ``done``: the ids its
        fence let through. They are counted, logged, announced (``job_finished``) and
        forgotten on this thread, as its own writes are, off the producer's path."""
        with self._lock:
            self._written.append((group, done))
            self._notify()

    def give_back(self, group: list[Outcome], *, rides: bool) -> None:
        """The producer's statement failed, so nothing of ``group`` was written: it is this
        thread's again. After an outage it may ride with a later claim (``rides``); after any
        other failure one of them may be what the database refuses, so they never ride again
        and are written here at once, one by one if need be."""
        if not rides:
            for outcome in group:
                outcome.rides = False
        with self._lock:
            self._put_back(group)
            self._notify()

    def _put_back(self, outcomes: list[Outcome]) -> None:
        """Put outcomes before the pending ones (called holding the lock)."""
        if not self._pending:
            self._pending_since = time.monotonic()
        self._pending[:0] = outcomes

    # -- called by the worker ------------------------------------------------------------

    def close(self, timeout: float) -> None:
        """Write what is pending (retrying for up to ``timeout`` s), then stop."""
        with self._lock:
            self._closing = True
            self._notify()
        self.join(timeout)
        if self.is_alive():
            self._give_up.set()
            self.join(timeout)

    # -- the thread ----------------------------------------------------------------------

    def run(self) -> None:
        backoff = ReconnectBackoff("completer")
        try:
            while True:
                late, closing = self._next_round()
                written = self._count_written()
                # The failures are built here, without the lock: the job's retry policy (a
                # backoff callable: user code) decides them.
                failures = [timed_out(r.job, r.job.timeout or 0.0) for r in late if r.ours]
                with self._lock:
                    self._pending.extend(failures)
                    # Completions still waiting for the producer's claim stay.
                    batch: list[Outcome] = []
                    if self._writable():
                        batch, self._pending = self._pending, []
                if self.on_timeout is not None:
                    for running in late:
                        self.on_timeout(running.job)
                wrote = bool(batch) or written
                try:
                    try:
                        self._write(batch)
                    except ImproperlyConfigured:
                        raise  # no write can succeed: stop, and the worker with us
                    except Exception as exc:
                        if unavailable(exc):
                            raise
                        # Not an outage: one outcome (or a bug of ours) is at fault. Write the
                        # rest one at a time, so one bad row cannot strand the others.
                        logger.exception(
                            "recording %s outcomes failed; recording them one at a time",
                            len(batch),
                            extra={"action": "complete"},
                        )
                        self._write_each(batch)
                    self._heartbeat()
                    backoff.succeeded(self.store.alias)
                    if wrote and self.on_written is not None:
                        self.on_written()
                    self._wake_freed()
                except ImproperlyConfigured:
                    logger.exception(
                        "completer stopped; %s outcomes not recorded (their leases will expire)",
                        len(batch),
                        extra={"action": "complete"},
                    )
                    return
                except Exception as exc:
                    self._last_failure = time.monotonic()
                    if not unavailable(exc):
                        logger.exception("completer error", extra={"action": "complete"})
                    # A fresh direct connection at the next try (a read-only or restarted
                    # server leaves the old one open but useless).
                    self.store.close()
                    with self._lock:
                        self._put_back(batch)
                    if self._give_up.is_set():
                        self._abandon()
                        return
                    backoff.failed(self.store.alias, exc, self._give_up)
                    continue
                if closing and not self._pending:
                    return
        finally:
            self._stopped()

    def _next_round(self) -> tuple[list[_Running], bool]:
        """Wait until there is something to do; take the jobs past their deadline off the
        running (``_time_out()``), and return them with whether the completer is closing."""
        with self._lock:
            while not (self._written or self._writable() or self._closing or self._due() <= 0):
                wait = self._wait()
                self._wakes_at = time.monotonic() + wait
                try:
                    self._cond.wait(None if wait == math.inf else wait)
                finally:
                    self._wakes_at = None
            return self._time_out(), self._closing

    def _stopped(self) -> None:
        """The thread stops: count what the producer wrote, and let go of the connections."""
        try:
            # What the producer wrote is counted and announced even when this thread stops.
            self._count_written()
        except Exception:
            logger.exception(
                "could not count the completions written with claims",
                extra={"action": "complete"},
            )
        finally:
            if self._to_wake:
                # The thread stops on a failure (the database gone, or refusing every
                # write): no word is tried any more.
                word_not_sent(len(self._to_wake), "complete", failed=False)
            self.store.close()
            connections.close_all()

    def _count_written(self) -> bool:
        """Count, log and announce what the producer's claims wrote (``completed()``), and
        forget those jobs; whether there was any."""
        with self._lock:
            written, self._written = self._written, []
        for group, done in written:
            self._finished(group, dict.fromkeys(done, "done"))
        return bool(written)

    def _write_each(self, batch: list[Outcome]) -> None:
        """Write outcomes one by one; drop (and log) any that cannot be written at all."""
        while batch:
            outcome = batch[0]
            try:
                self._write([outcome])
            except ImproperlyConfigured:
                raise
            except Exception as exc:
                if unavailable(exc):
                    raise
                logger.exception(
                    "could not record the outcome of job %s; its lease will expire and the "
                    "reaper will take it back",
                    outcome.job.id,
                    extra={"action": outcome.action, "job_id": outcome.job.id},
                )
            batch.pop(0)

    def _writable(self) -> bool:
        """Whether pending outcomes are to be written now (called holding the lock): all but
        completions waiting, for less than ``RIDE_WAIT``, for the producer's claim."""
        if not self._pending:
            return False
        if not self._riding or self._closing or time.monotonic() - self._pending_since >= RIDE_WAIT:
            return True
        return not all(self._rides(o) for o in self._pending)

    def _rides(self, o: Outcome) -> bool:
        """Whether a pending outcome may wait for, and be written by, the producer's plain
        claim (called holding the lock): a completion no claim refused before, of a job the
        plain claim took, in a queue the producer does not claim guarded now. A guarded claim
        takes no completions; under a limit a job counts until it is written, and its end
        is word to other workers (``_wake_freed()``), which the claim does not send."""
        return (
            o.action == Action.COMPLETE
            and o.rides
            and not o.job.guarded
            and o.job.queue not in self._guarded
        )

    def _wait(self) -> float:
        """Seconds until something is due: a heartbeat, a deadline, or the end of the wait of
        pending completions for a claim (inf when nothing is coming)."""
        due = self._due()
        if self._pending:
            due = min(due, max(0.0, self._pending_since + RIDE_WAIT - time.monotonic()))
        return due

    def _due(self) -> float:
        """Seconds until the next heartbeat or deadline (inf when neither is coming)."""
        if not self._running:
            return float("inf")
        deadline = min(r.deadline for r in self._running.values())
        return min(self._beat_due(), max(0.0, deadline - time.monotonic()))

    def _time_out(self) -> list[_Running]:
        """Take the jobs past their deadline off the running (called holding the lock);
        return them. Those still ours are to be failed."""
        now = time.monotonic()
        late = [r for r in self._running.values() if r.deadline <= now]
        for running in late:
            del self._running[running.job.id]
            if not running.ours:
                continue
            running.ctx.mark_timed_out()
            logger.error(
                "job %s %s attempt %s ran past its timeout of %g s: failing it",
                running.job.id,
                running.job.task,
                running.job.attempts,
                running.job.timeout,
                extra={
                    "action": "fail",
                    "job_id": running.job.id,
                    "task": running.job.task,
                    "attempts": running.job.attempts,
                    "worker_id": self.worker_id,
                },
            )
        return late

    def _beat_due(self) -> float:
        """Seconds until some running job's lease needs extending (inf when none runs)."""
        oldest = min((r.extended_at for r in self._running.values() if r.ours), default=None)
        if oldest is None:
            return float("inf")
        return max(0.0, oldest + self.beat - time.monotonic())

    def _write(self, batch: list[Outcome]) -> None:
        # Each kind is removed from the batch as soon as its statement commits, before
        # anything else is asked of the database, so a retry after an outage never writes it
        # twice.
        for action in (Action.COMPLETE, Action.FAIL, Action.SNOOZE, Action.RELEASE):
            group = [o for o in batch if o.action == action]
            if not group:
                continue
            statuses = self._write_group(action, group)
            batch[:] = [o for o in batch if o.action != action]
            if statuses is None:
                self._forget(group)
            else:
                self._finished(group, statuses)
            self._to_wake.extend(
                o.job.id
                for o in group
                if o.job.guarded and (statuses is None or o.job.id in statuses)
            )

    def _wake_freed(self) -> None:
        """Send word of the slots under a limit, and the lock keys, that the jobs written
        since the last word freed: another worker may be waiting for them. Never raises: the
        outcomes are written, and a word lost costs a waiting worker a tick, not a job."""
        if not self._to_wake:
            return
        freed, self._to_wake = self._to_wake, []
        try:
            self.store.wake_freed(freed)
        except Exception:
            word_not_sent(len(freed), "complete")

    def _write_group(self, action: str, group: list[Outcome]) -> dict[int, str] | None:
        """Write one kind of outcome in one statement; the new status of each job it changed
        (None for releases, which are only counted)."""
        statuses = finish.write(self.store, action, group)
        if action != Action.RELEASE:
            return statuses
        self.stats.add("released", len(statuses))
        return None

    def _finished(self, group: list[Outcome], statuses: dict[int, str]) -> None:
        self._forget(group)
        refused = [o.job for o in group if o.job.id not in statuses]
        if refused:
            # A job cancelled after its function returned but before a heartbeat noticed. The
            # outcomes are already written: if this read fails, they are counted as lost.
            try:
                cancelled = self.store.cancelled_among(refused)
            except Exception:
                logger.warning(
                    "could not tell whether %s refused outcomes were cancelled jobs",
                    len(refused),
                    exc_info=True,
                    extra={"action": "cancel"},
                )
                cancelled = set()
            statuses = statuses | dict.fromkeys(cancelled, "cancelled")
        for o in group:
            finished(
                o,
                statuses.get(o.job.id),
                stats=self.stats,
                worker_id=self.worker_id,
                metrics=self.metrics,
            )
        if self.on_retry is not None and "queued" in statuses.values():
            self.on_retry()

    def _forget(self, group: list[Outcome]) -> None:
        with self._lock:
            for o in group:
                self._release_hold(o.job)

    def _heartbeat(self) -> None:
        now = time.monotonic()
        with self._lock:
            due = [r for r in self._running.values() if r.ours and now - r.extended_at >= self.beat]
        if not due:
            return
        kept = self.store.extend_lease([r.job for r in due], self.lease)
        refused = [r for r in due if r.job.id not in kept]
        # Only a refused extension asks why: a cancel, or a lease lost to the reaper.
        cancelled = self.store.cancelled_among([r.job for r in refused]) if refused else set()
        for running in due:
            if running.job.id in kept:
                running.extended_at = now
                continue
            if running.job.id in cancelled:
                running.ctx.mark_cancelled()
            else:
                running.ctx.mark_lost()
            with self._lock:
                running.ours = False
                if running.deadline == math.inf:
                    self._stop_tracking(running.job)
                self._release_hold(running.job)

    def _abandon(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        if pending:
            logger.error(
                "gave up recording %s outcomes (database unavailable); their leases will "
                "expire and the reaper will requeue them: %s",
                len(pending),
                ", ".join(str(o.job.id) for o in pending),
                extra={"action": "complete"},
            )
