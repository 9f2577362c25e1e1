"""The benchmark's own parts: ``BENCH_PEERS`` picks the peers of a run (all, some by name, or
none; a name that is no peer's stops the run before anything starts instead of quietly
leaving the peer out), each peer's lock pins its whole venv, and the combined-statement probe
drains a queue correctly."""

from __future__ import annotations

import re
from pathlib import Path

import psycopg
import pytest

from benchmarks.peers import LOCKS, NAMES, SPECS
from benchmarks.run import requested_peers
from django_pgjobs.connections import connection_params
from django_pgjobs.models import Job
from testproject.testjobs import noop
from tests.helpers import status_counts


@pytest.mark.parametrize("value", ["", "0", "  "])
def test_unset_or_zero_runs_no_peer(value: str) -> None:
    assert requested_peers(value) == []


def test_one_runs_every_peer() -> None:
    assert requested_peers("1") is None


def test_names_pick_those_peers() -> None:
    assert requested_peers("pgqueuer") == ["pgqueuer"]
    assert requested_peers(" procrastinate , pgqueuer ") == ["procrastinate", "pgqueuer"]


def test_an_unknown_name_is_refused_with_the_known_ones() -> None:
    with pytest.raises(SystemExit) as raised:
        requested_peers("pgqueuer,celery")
    message = str(raised.value)
    assert "unknown peer(s) celery" in message
    assert all(name in message for name in NAMES)


def _pins(lock: Path) -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in lock.read_text().splitlines():
        if line and not line.startswith("#"):
            pinned = re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)", line)
            assert pinned, f"{lock.name}: {line!r} is not name==version"
            pins[pinned[1].lower().replace("_", "-")] = pinned[2]
    return pins


@pytest.mark.parametrize(
    ("requirements", "lock"),
    [(spec.requirements, spec.lock) for spec in SPECS]
    + [(spec.fallback, spec.fallback_lock) for spec in SPECS if spec.fallback],
)
def test_a_peers_lock_pins_every_package_at_its_requirements_versions(
    requirements: tuple[str, ...], lock: str
) -> None:
    pins = _pins(LOCKS / lock)
    for requirement in requirements:
        name, version = re.fullmatch(r"([\w.-]+)(?:\[[\w,]+\])?==(\S+)", requirement).groups()  # type: ignore[union-attr]
        assert pins.get(name.lower().replace("_", "-")) == version, (lock, requirement)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("together", [False, True], ids=["two-statements", "one-statement"])
def test_the_combined_probe_completes_each_job_once_either_way(together: bool) -> None:
    """benchmarks.combined's two ways drain the queue with the worker's own fenced statements:
    its figures are worth reading only if every job ends done after one attempt."""
    from benchmarks.combined import BASE, drain

    Job.objects.enqueue_many(noop, [{}] * 21)
    with psycopg.connect(**connection_params("default", "pgjobs-test"), autocommit=True) as conn:
        claimed = drain(conn, 8, together, BASE)
    assert claimed == 21
    assert status_counts() == {"done": 21}
    assert set(Job.objects.values_list("attempts", flat=True)) == {1}
