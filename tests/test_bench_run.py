"""``BENCH_PEERS`` picks the peers of a benchmark run: all, some by name, or none; a name that
is no peer's stops the run before anything starts instead of quietly leaving the peer out."""

from __future__ import annotations

import pytest

from benchmarks.peers import NAMES
from benchmarks.run import requested_peers


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
