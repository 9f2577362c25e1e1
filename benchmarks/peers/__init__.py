"""The peers of issue 7's benchmark (``BENCH_PEERS=1``): the same workloads on three other
PostgreSQL job queues, each installed in its own virtualenv, measured in the same run.

    peers = Peers(server_url, sizes, log)
    for name in peers.prepare():        # venvs under benchmarks/.peers/, one database each
        peers.w1(name); peers.w2_single(name); peers.w2_bulk(name); peers.w3(name)
    peers.close()                        # drops the peers' databases

Every workload runs ``benchmarks/peers/<driver>.py`` with that peer's virtualenv's Python, in
a subprocess, and reads the one JSON object it prints. A driver that finds a job lost,
repeated or failed exits non-zero, and the workload method raises ``PeerRunInvalid`` (a
``BenchAbort``). ``python -m benchmarks.peers`` runs the peers alone; see README.md here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import psycopg
from psycopg import sql as pgsql

from benchmarks.db import BenchAbort, recreate
from benchmarks.sizes import Sizes

HERE = Path(__file__).resolve().parent
LOCKS = HERE / "locks"
VENVS = HERE.parent / ".peers"  # git-ignored
DB_PREFIX = "pgjobs_peer_"
INSTALL_TIMEOUT = 900.0  # seconds for one pip install
RUN_TIMEOUT = 1800.0  # seconds for one driver run (its worker has its own 900 s limit)


class PeerRunInvalid(BenchAbort):
    """A peer's run lost, repeated or failed a job, or its driver failed: its figures are void."""


@dataclass(frozen=True)
class PeerSpec:
    """One peer: its driver, the pinned packages of its virtualenv, the Python it needs.

    ``lock`` names a file in ``locks/`` that pins every package the venv holds, the
    requirements' own dependencies included (pydantic, anyio, uvloop...): a peer's pace
    depends on them, and a venv built on another day must hold the same code.
    """

    name: str
    driver: str
    requirements: tuple[str, ...]
    lock: str
    min_python: tuple[int, int] = (3, 10)
    # Installed instead, with the plain ``python3``, when no Python >= min_python is found.
    fallback: tuple[str, ...] = ()
    fallback_lock: str = ""
    has_bulk: bool = True

    def __post_init__(self) -> None:
        if bool(self.fallback) != bool(self.fallback_lock):
            raise ValueError(f"peer {self.name}: a fallback needs its own lock, and only then")


PSYCOPG = "psycopg[binary]==3.3.9"
SPECS: tuple[PeerSpec, ...] = (
    PeerSpec(
        "pgqueuer",
        "pgqueuer_driver.py",
        ("pgqueuer[asyncpg]==1.6.0", "asyncpg==0.32.0"),
        lock="pgqueuer.txt",
        min_python=(3, 11),  # what its lock pins (python-dateutil 4, typer 0.29) needs
    ),
    PeerSpec(
        "procrastinate",
        "procrastinate_driver.py",
        ("procrastinate==3.10.0", PSYCOPG),
        lock="procrastinate.txt",
        min_python=(3, 11),  # what its lock pins (python-dateutil 4) needs
    ),
    # Django 6.0 has the tasks framework built in (it needs Python 3.12); on an older Python
    # the backend runs on Django 5.2 with the django-tasks backport (its ``compat`` extra).
    PeerSpec(
        "django-tasks-db",
        "djtasks_driver.py",
        ("django-tasks-db==0.13.0", "Django==6.0.10", PSYCOPG),
        lock="django-tasks-db.txt",
        min_python=(3, 12),
        fallback=(
            "django-tasks-db[compat]==0.13.0",
            "Django==5.2.19",
            "django-tasks==0.12.0",
            PSYCOPG,
        ),
        fallback_lock="django-tasks-db-compat.txt",
        has_bulk=False,
    ),
)
NAMES: tuple[str, ...] = tuple(spec.name for spec in SPECS)
NO_BULK_REASON = {
    "django-tasks-db": "Django's tasks framework has no bulk enqueue: Task.enqueue() makes one "
    "row per call, and DatabaseBackend has no batch method",
}


@dataclass
class _Ready:
    spec: PeerSpec
    python: Path
    url: str
    versions: dict[str, Any] = field(default_factory=dict)


def canonical(name: str) -> str:
    """A package's name as pip compares them (PEP 503): ``Foo_Bar.baz`` is ``foo-bar-baz``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(text: str) -> dict[str, str]:
    """A lock's (or ``pip freeze``'s) lines, by canonical name: ``name==version`` gives the
    version, ``name @ url`` (a package installed from a file or a repository) ``@ url``."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            name, sep, version = line.strip().partition("==")
            if not sep:
                name, sep, url = line.strip().partition(" @ ")
                version = f"@ {url}"
            if not sep:
                raise BenchAbort(f"not a pin (name==version or name @ url): {line!r}")
            found[canonical(name)] = version
    return found


def _check_locked(python: Path, lock: Path) -> None:
    """The venv holds exactly what its lock pins: a constraint only bounds what pip installs,
    so a package the lock misses would otherwise come in at whatever version pip found."""
    frozen = subprocess.run(
        [str(python), "-m", "pip", "freeze", "--exclude-editable", "--disable-pip-version-check"],
        capture_output=True,
        text=True,
        timeout=INSTALL_TIMEOUT,
        check=True,
    ).stdout
    have, want = pins(frozen), pins(lock.read_text())
    if have != want:
        differ = sorted(
            f"{name} {have.get(name, '-')} (lock: {want.get(name, '-')})"
            for name in have.keys() | want.keys()
            if have.get(name) != want.get(name)
        )
        raise BenchAbort(f"the venv does not hold what {lock.name} pins: {', '.join(differ)}")


def database_name(peer: str) -> str:
    return DB_PREFIX + re.sub(r"\W", "_", peer)


def _python_version(exe: str) -> tuple[int, int] | None:
    try:
        done = subprocess.run(
            [exe, "-c", "import sys, venv, ensurepip; print(*sys.version_info[:2])"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    major, minor = done.stdout.split()
    return int(major), int(minor)


def _pythons() -> list[tuple[tuple[int, int], str]]:
    """Interpreters that can make a venv: ``python3`` first, then other versions found."""
    names = ["python3", *(f"python3.{minor}" for minor in range(20, 9, -1))]
    found = [path for name in names if (path := shutil.which(name))]
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found += sorted(str(p) for p in pyenv.glob("3.*/bin/python3"))
    out: list[tuple[tuple[int, int], str]] = []
    seen: set[str] = set()
    for exe in found:
        real = os.path.realpath(exe)
        if real in seen:
            continue
        seen.add(real)
        version = _python_version(exe)
        if version is not None:
            out.append((version, exe))
    return out


class Peers:
    """The peers' virtualenvs, databases and workloads, for ``benchmarks.run``."""

    def __init__(self, server_url: str, sizes: Sizes, log: IO[str]) -> None:
        self.server_url = server_url
        self.sizes = sizes
        self.log = log
        self.ready: dict[str, _Ready] = {}
        self.scratch = Path(tempfile.mkdtemp(prefix="pgjobs-peers-"))
        self._pythons: list[tuple[tuple[int, int], str]] | None = None

    # -- set-up -----------------------------------------------------------------------------

    def prepare(self, names: list[str] | None = None) -> list[str]:
        """Create (or reuse) each peer's venv, install its pinned packages, create its
        database and schema. Returns the peers that are ready; a peer that fails is skipped
        with the reason printed (and logged), not raised."""
        for spec in SPECS:
            if names is not None and spec.name not in names:
                continue
            started = time.monotonic()
            try:
                ready = self._prepare_one(spec)
            except Exception as exc:  # any failure skips this peer, not the suite
                self._say(f"peer {spec.name}: SKIPPED: {type(exc).__name__}: {exc}")
                continue
            self.ready[spec.name] = ready
            extras = ", ".join(f"{k} {v}" for k, v in ready.versions.items() if k != "version")
            self._say(
                f"peer {spec.name} {ready.versions['version']} ready ({extras}) "
                f"in {time.monotonic() - started:.0f} s"
            )
        return list(self.ready)

    def _prepare_one(self, spec: PeerSpec) -> _Ready:
        python_exe, requirements, lock = self._interpreter(spec)
        venv = VENVS / spec.name
        python = venv / "bin" / "python"
        marker = venv / "bench-requirements.txt"
        wanted = "\n".join([f"# {python_exe}", *requirements, lock.read_text()]) + "\n"
        reuse = (
            marker.exists()
            and marker.read_text() == wanted
            and _python_version(str(python)) is not None
        )
        if not reuse:
            if venv.exists():
                shutil.rmtree(venv)
            VENVS.mkdir(parents=True, exist_ok=True)
            self._say(
                f"peer {spec.name}: creating {venv} ({python_exe}) and installing "
                f"{' '.join(requirements)} as locked by {lock.name} ..."
            )
            self._check_call([python_exe, "-m", "venv", str(venv)], "python -m venv")
            self._check_call(
                [
                    str(python),
                    "-m",
                    "pip",
                    "install",
                    "--quiet",
                    "--disable-pip-version-check",
                    "--constraint",
                    str(lock),
                    *requirements,
                ],
                "pip install",
            )
            _check_locked(python, lock)
            marker.write_text(wanted)
        url = recreate(self.server_url, database_name(spec.name))
        ready = _Ready(spec=spec, python=python, url=url)
        ready.versions = self._drive(ready, "version")
        self._drive(ready, "setup")
        return ready

    def _interpreter(self, spec: PeerSpec) -> tuple[str, tuple[str, ...], Path]:
        if self._pythons is None:
            self._pythons = _pythons()
        if not self._pythons:
            raise BenchAbort("no Python interpreter that can create a virtualenv was found")
        fits = [(v, exe) for v, exe in self._pythons if v >= spec.min_python]
        if fits:
            # python3 if it fits (it is listed first), else the oldest version that fits.
            first = self._pythons[0]
            exe = first[1] if first in fits else min(fits)[1]
            return exe, spec.requirements, LOCKS / spec.lock
        if spec.fallback:
            return self._pythons[0][1], spec.fallback, LOCKS / spec.fallback_lock
        raise BenchAbort(f"needs Python >= {'.'.join(map(str, spec.min_python))}")

    def _check_call(self, command: list[str], what: str) -> None:
        self.log.write(f"\n$ {' '.join(command)}\n")
        self.log.flush()
        done = subprocess.run(
            command,
            stdout=self.log,
            stderr=subprocess.PIPE,
            text=True,
            timeout=INSTALL_TIMEOUT,
            check=False,
        )
        self.log.write(done.stderr)
        self.log.flush()
        if done.returncode != 0:
            tail = " | ".join(line for line in done.stderr.splitlines()[-3:] if line.strip())
            raise BenchAbort(f"{what} exited with {done.returncode}: {tail}")

    def close(self) -> None:
        """Drop the peers' databases and the scratch folder."""
        for name in self.ready:
            try:
                with psycopg.connect(self.server_url, autocommit=True) as conn:
                    conn.execute(
                        pgsql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                            pgsql.Identifier(database_name(name))
                        )
                    )
            except psycopg.Error as exc:
                self._say(f"peer {name}: could not drop its database: {exc}")
        self.ready.clear()
        shutil.rmtree(self.scratch, ignore_errors=True)

    # -- workloads --------------------------------------------------------------------------

    def version(self, name: str) -> str:
        return str(self.ready[name].versions["version"])

    def versions(self, name: str) -> dict[str, Any]:
        """The peer's version and its key dependencies' (Python, Django, the driver...)."""
        return dict(self.ready[name].versions)

    def w1(self, name: str) -> dict[str, Any]:
        """W1: ``sizes.jobs`` pre-enqueued no-op jobs run by the peer's own worker in its
        burst/drain mode. ``jobs_per_s`` is first job start -> last completion from the peer's
        own timestamps (as the project's W1); ``jobs_per_s_incl_startup`` counts from the
        spawn of the worker; ``worker_cpu_s`` is the worker processes' rusage."""
        return self._workload(name, "w1")

    def w2_single(self, name: str) -> dict[str, Any]:
        """W2: ``sizes.jobs`` enqueues through the peer's normal path, one transaction each."""
        return self._workload(name, "w2-single")

    def w2_bulk(self, name: str) -> dict[str, Any] | None:
        """W2: one bulk enqueue of ``sizes.jobs`` jobs; None for a peer with no bulk API
        (``NO_BULK_REASON[name]`` says why)."""
        if not self.ready[name].spec.has_bulk:
            return None
        return self._workload(name, "w2-bulk")

    def w3(self, name: str) -> dict[str, Any]:
        """W3: one idle worker; ``latency_jobs`` jobs ``latency_gap`` apart after
        ``latency_warmup`` warm-ups; commit returned -> job function start, p50/p95/p99 ms."""
        return self._workload(name, "w3")

    def _workload(self, name: str, command: str) -> dict[str, Any]:
        result = self._drive(self.ready[name], command)
        if not isinstance(result, dict):
            raise PeerRunInvalid(f"peer {name} {command}: the driver printed {result!r}")
        return {**result, "peer": name, "version": self.version(name)}

    def _drive(self, ready: _Ready, command: str) -> Any:
        sizes = self.sizes
        argv = [
            str(ready.python),
            str(HERE / ready.spec.driver),
            command,
            "--dsn",
            ready.url,
            "--jobs",
            str(sizes.jobs),
            "--concurrency",
            str(sizes.concurrency),
            "--latency-jobs",
            str(sizes.latency_jobs),
            "--gap",
            str(sizes.latency_gap),
            "--warmup",
            str(sizes.latency_warmup),
            "--scratch",
            str(self.scratch),
        ]
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("DJANGO_SETTINGS_MODULE", "PYTHONPATH", "VIRTUAL_ENV")
        }
        self.log.write(f"\n$ [{ready.spec.name}] {' '.join(argv)}\n")
        self.log.flush()
        try:
            done = subprocess.run(
                argv,
                cwd=HERE,
                env=env,
                capture_output=True,
                text=True,
                timeout=RUN_TIMEOUT,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise PeerRunInvalid(
                f"peer {ready.spec.name} {command}: no result within {RUN_TIMEOUT:.0f} s"
            ) from exc
        self.log.write(done.stderr)
        self.log.flush()
        if done.returncode != 0:
            tail = [line for line in done.stderr.splitlines() if line.strip()][-3:]
            raise PeerRunInvalid(
                f"peer {ready.spec.name} {command} exited with "
                f"{done.returncode}: {' | '.join(tail)}"
            )
        try:
            return json.loads(done.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError) as exc:
            raise PeerRunInvalid(
                f"peer {ready.spec.name} {command}: no JSON on stdout: {done.stdout[-500:]!r}"
            ) from exc

    def _say(self, line: str) -> None:
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()


__all__ = ["NAMES", "NO_BULK_REASON", "SPECS", "PeerRunInvalid", "Peers", "database_name"]
