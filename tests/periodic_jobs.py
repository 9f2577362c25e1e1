"""Periodic jobs for the worker-process tests (test_periodic_workers.py).

The jobs are registered wherever this module is imported; their schedules are declared only
in a process started with ``PGJOBS_TEST_SCHEDULES`` (a JSON object: schedule name -> the
arguments of ``@periodic`` plus ``"task"``, with ``every`` in seconds), so the test process
and every other test's workers run no schedule.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from typing import Any

from django_pgjobs import current_job, job, periodic


@job
def tick(**kwargs: object) -> None:
    """A periodic job that does nothing: its row says all a test needs."""


@job(max_attempts=3)
def flaky_tick(**kwargs: object) -> None:
    """Fails its first attempt, after recording the tick current_job() reports."""
    from testproject.shop.models import Order

    ctx = current_job()
    assert ctx is not None and ctx.scheduled_at is not None
    Order.objects.create(
        email=f"{ctx.schedule}|{ctx.scheduled_at.isoformat()}", total_cents=ctx.attempts
    )
    if ctx.attempts == 1:
        raise RuntimeError("the first attempt fails on purpose")


# Retried half a second later, not after the default 20 s.
flaky_tick.backoff = (0.25, 0.5)

TASKS = {"tick": tick, "flaky_tick": flaky_tick}

for _name, _arguments in json.loads(os.environ.get("PGJOBS_TEST_SCHEDULES", "{}")).items():
    _options: dict[str, Any] = dict(_arguments)
    _task = TASKS[_options.pop("task")]
    if "every" in _options:
        _options["every"] = timedelta(seconds=_options["every"])
    periodic(name=_name, **_options)(_task)
