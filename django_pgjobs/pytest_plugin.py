"""The pytest plugin: a ``pgjobs`` fixture with the helpers of ``django_pgjobs.testing``.

Registered through the ``pytest11`` entry point, so installing django-pgjobs is enough. It
needs pytest-django: the fixture takes its ``db`` fixture (the test's transaction, rolled
back at the end), which is where ``run_jobs()`` runs. The plugin imports nothing of Django
until a test asks for the fixture: loading it costs nothing and does not set Django up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from django_pgjobs.testing import PgJobs

__all__ = ["pgjobs"]


@pytest.fixture
def pgjobs(db: None) -> PgJobs:
    """``run_jobs()``, ``enqueued()``, ``assert_enqueued()``, ``assert_not_enqueued()`` and
    the test clock (``advance()``, ``set_clock()``, ``now()``), inside the test's transaction."""
    from django_pgjobs.testing import PgJobs

    return PgJobs()
