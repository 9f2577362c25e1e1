"""Settings of the benchmark's worker processes and of the driver: the testproject's, plus the
benchmark's own job module and an alias for the database that holds a long done history.

``DATABASE_URL`` (read by the testproject settings) names the empty-history database;
``BENCH_HISTORY_DATABASE_URL`` the one with the done rows (alias ``history``);
``BENCH_SCRAPE_DATABASE_URL`` the scrape section's (alias ``scrape``). W2 also enqueues through
the testproject's alias ``prepared``.
"""

from __future__ import annotations

import os
from typing import Any

import dj_database_url

from testproject import settings as _base

globals().update({name: value for name, value in vars(_base).items() if name.isupper()})

PGJOBS: dict[str, Any] = {
    **_base.PGJOBS,
    "IMPORTS": [*_base.PGJOBS.get("IMPORTS", []), "benchmarks.jobs"],
}

DATABASES: dict[str, dict[str, Any]] = dict(_base.DATABASES)
if os.environ.get("BENCH_HISTORY_DATABASE_URL"):
    DATABASES["history"] = dict(dj_database_url.parse(os.environ["BENCH_HISTORY_DATABASE_URL"]))
if os.environ.get("BENCH_SCRAPE_DATABASE_URL"):
    DATABASES["scrape"] = dict(dj_database_url.parse(os.environ["BENCH_SCRAPE_DATABASE_URL"]))
