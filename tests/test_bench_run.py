"""The benchmark's own parts: ``BENCH_PEERS`` picks the peers of a run (all, some by name, or
none; a name that is no peer's stops the run before anything starts instead of quietly
leaving the peer out), each peer's lock pins its requirements and a venv that holds anything
else is refused, and the combined-statement probe drains a queue correctly."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from benchmarks.db import BenchAbort
from benchmarks.peers import LOCKS, NAMES, SPECS, _check_locked, canonical, pins
from benchmarks.report import Row, build_targets
from benchmarks.run import SECTIONS, parse_args, requested_peers
from django_pgjobs.core.connections import connection_params
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


@pytest.mark.parametrize(
    ("requirements", "lock"),
    [(spec.requirements, spec.lock) for spec in SPECS]
    + [(spec.fallback, spec.fallback_lock) for spec in SPECS if spec.fallback],
)
def test_a_peers_lock_pins_its_requirements_at_their_versions(
    requirements: tuple[str, ...], lock: str
) -> None:
    pinned = pins((LOCKS / lock).read_text())
    for requirement in requirements:
        parsed = re.fullmatch(r"([A-Za-z0-9][\w.-]*)(?:\[[^\]]*\])?==(\S+)", requirement)
        assert parsed, f"{requirement!r} is not name[extras]==version"
        assert pinned.get(canonical(parsed[1])) == parsed[2], (lock, requirement)


def test_a_venv_that_holds_other_versions_than_its_lock_is_refused(tmp_path: Path) -> None:
    """Checked on this venv's own ``pip freeze`` (where this project may be a ``name @ url``
    line, installed from its sdist by tox): as locked it passes; a package at another version,
    or one the lock leaves out, is named."""
    frozen = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "freeze",
            "--exclude-editable",
            "--disable-pip-version-check",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    lines = [line for line in frozen.splitlines() if line.strip() and not line.startswith("#")]
    python = Path(sys.executable)
    lock = tmp_path / "lock.txt"
    lock.write_text("# this venv\n" + "\n".join(lines) + "\n")
    _check_locked(python, lock)

    pinned = next(line for line in lines if "==" in line)
    rest = [line for line in lines if line != pinned]
    name, _, version = pinned.partition("==")
    lock.write_text("\n".join([f"{name}=={version}.1", *rest]) + "\n")
    with pytest.raises(BenchAbort, match=f"{re.escape(name)} {re.escape(version)} \\(lock: "):
        _check_locked(python, lock)

    lock.write_text("\n".join(rest) + "\n")
    with pytest.raises(BenchAbort, match=f"{re.escape(name)} {re.escape(version)} \\(lock: -\\)"):
        _check_locked(python, lock)


def test_a_lock_line_that_is_no_pin_is_refused() -> None:
    with pytest.raises(BenchAbort, match="not a pin"):
        pins("pgqueuer>=1.6\n")
    # What pip freeze writes for a package installed from a file: kept, with its address.
    assert pins("Foo_Bar @ file:///tmp/foo.tar.gz\n") == {"foo-bar": "@ file:///tmp/foo.tar.gz"}


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


def test_the_statements_diagnostic_knows_the_worker_statements_by_their_normalised_text() -> None:
    """benchmarks.statements finds the worker's statements in pg_stat_statements by how their
    normalised text begins (constants and parameters as ``$n``) and a part only they have:
    each must still match its statement, and no other's, or the breakdown would quietly print
    zeros or count another statement."""
    from benchmarks.statements import KINDS
    from django_pgjobs.core import claim, finish, upkeep

    def normalised(statement: str) -> str:
        text = re.sub(r"%\(\w+\)s|'[^']*'|\b\d+\b", "$1", statement)
        return re.sub(r"\s+", " ", text).strip()

    statements = {
        "claim": claim.limited(claim.CLAIM, 8),
        "idle claim": claim.limited(claim.CLAIM_IDLE, 8),
        "complete": finish.COMPLETE,
        "outlook": claim.OUTLOOK,
    }
    others = [
        finish.FAIL,
        finish.EXTEND_LEASE,
        finish.RELEASE,
        claim.CLAIM_GUARDED,
        claim.CLAIM_COMPLETING,
        upkeep.REAP,
        finish.SNOOZE,
    ]
    for kind, start, part in KINDS:
        text = normalised(statements[kind])
        assert text.startswith(start) and part in text, kind
        for other in map(normalised, others):
            assert not (other.startswith(start) and part in other), (kind, other)


def test_the_single_enqueue_target_shows_its_bound_beside_it() -> None:
    rows = [
        Row("w2_single.jobs_per_s", "enqueue()", "jobs/s", [1_950.0, 2_000.0, 2_050.0]),
        Row("w2_returning.jobs_per_s", "bare", "jobs/s", [2_400.0]),
        Row("w2_single_prepared.jobs_per_s", "prepared", "jobs/s", [2_420.0]),
        Row("peer.pgqueuer.w2_single.jobs_per_s", "pgqueuer", "jobs/s", [2_300.0]),
    ]
    targets = {target.name: target for target in build_targets(rows, None, 0)}
    defaults = targets["W2 enqueue() vs pgqueuer's single enqueue, side by side"]
    assert defaults.measured == (
        "0.87x (2,000 vs 2,300 jobs/s); its bound, the bare INSERT ... RETURNING id: 1.04x"
    )
    assert defaults.passed is False
    prepared = targets[
        "W2 enqueue() with server-side binding, prepared vs pgqueuer's single enqueue, side by side"
    ]
    assert prepared.measured == "1.05x (2,420 vs 2,300 jobs/s)"
    assert prepared.passed is True


def test_only_runs_the_sections_it_names_and_refuses_unknown_ones() -> None:
    assert parse_args(["--only", "async, cores"]).skip == set(SECTIONS) - {"async", "cores"}
    assert parse_args(["--skip", "w1"]).skip == {"w1"}
    assert parse_args([]).skip == set()
    for argv in (["--only", "w1,celery"], ["--only", "w1", "--skip", "w2"]):
        with pytest.raises(SystemExit):
            parse_args(argv)
