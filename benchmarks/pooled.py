"""Many claimers straight to PostgreSQL, and the same through PgBouncer's small pool.

Not part of ``benchmarks.run``: a diagnostic to run by hand against a database of your own
that has the schema (``manage.py migrate``), on a machine with ``pgbench`` and ``pgbouncer``;
it empties ``pgjobs_job`` before each drain::

    DATABASE_URL=postgres://... DJANGO_SETTINGS_MODULE=benchmarks.settings \\
        python -m benchmarks.pooled [--clients 4,16,64] [--pool 8] [--jobs 20000] \\
        [--rounds 3] [--turns]

Each drain is pgbench running ``claim.CLAIM`` of 10 then ``finish.COMPLETE`` (each its own
transaction, the script of the claimers section's pgbench rows) over fresh jobs with N
clients, connected two ways: to the database, and to a PgBouncer this script starts in
transaction mode with ``--pool`` server connections. ``--turns`` adds a third: to the
database, each claim's transaction first taking one advisory lock, so that the claims run
one at a time. Unlike the claimers section, the statements go unprepared every way
(``pgbench -M extended``: a PgBouncer before 1.21 cannot keep prepared statements in
transaction mode) and commits do not wait for the WAL flush. Rates are pgbench's own, without
the time its clients took to connect. The rounds take turns, every count every way in each
round, and every drain must end with each job ``done`` on its first attempt.

PgBouncer listens only on a Unix socket in a private folder; as root it runs as ``nobody``
(it refuses root), who then owns that folder.
"""

from __future__ import annotations

import argparse
import itertools
import os
import pwd
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import django
import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

django.setup()

from benchmarks.db import Admin, BenchAbort, find_pgbench, pgbench_figures  # noqa: E402
from benchmarks.workloads import ceiling_script  # noqa: E402
from django_pgjobs import registry  # noqa: E402
from django_pgjobs.core import execute  # noqa: E402

BATCH = 10
# The advisory lock the claims of --turns take one at a time.
TURNS_LOCK = 4242
# PgBouncer's port: with no TCP listener, only the name of its socket in the private folder.
PORT = 6432


def pgbouncer() -> str:
    found = shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin")
    if found is None:
        raise SystemExit("pgbouncer not found: install it (Debian: apt-get install pgbouncer)")
    return found


def log_tail(folder: Path) -> str:
    log = folder / "pgbouncer.log"
    return log.read_text()[-2000:] if log.exists() else "(no log)"


def start_pgbouncer(url: str, pool: int, folder: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A PgBouncer in transaction mode in front of ``url``'s database, ``pool`` server
    connections, on a socket in ``folder``; returns it and the conninfo that goes through it."""
    target = conninfo_to_dict(url)
    database = str(target.get("dbname") or target.get("user") or "postgres")
    user = str(target.get("user") or pwd.getpwuid(os.geteuid()).pw_name)
    server = {k: target[k] for k in ("host", "port", "dbname", "user", "password") if k in target}
    (folder / "users.txt").write_text(f'"{user}" "{target.get("password") or ""}"\n')
    (folder / "pgbouncer.ini").write_text(
        f"[databases]\n{database} = {make_conninfo(**server)}\n\n"
        f"[pgbouncer]\nlisten_addr =\nlisten_port = {PORT}\nunix_socket_dir = {folder}\n"
        f"auth_type = trust\nauth_file = {folder / 'users.txt'}\npool_mode = transaction\n"
        f"default_pool_size = {pool}\nmax_client_conn = 1000\n"
        "ignore_startup_parameters = extra_float_digits\n"
        f"logfile = {folder / 'pgbouncer.log'}\n"
    )
    command = [pgbouncer(), str(folder / "pgbouncer.ini")]
    if os.geteuid() == 0:
        nobody = pwd.getpwnam("nobody")
        for path in (folder, *folder.iterdir()):
            os.chown(path, nobody.pw_uid, nobody.pw_gid)
        command[1:1] = ["-u", "nobody"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pooled = make_conninfo(host=str(folder), port=PORT, dbname=database, user=user)
    last: Exception | None = None
    for _ in range(100):
        if process.poll() is not None:
            raise BenchAbort(f"pgbouncer exited with {process.returncode}:\n{log_tail(folder)}")
        try:
            Admin(pooled).close()
            return process, pooled
        except psycopg.OperationalError as error:  # not listening yet, or refused
            last = error
            time.sleep(0.1)
    process.kill()
    process.wait()
    raise BenchAbort(f"pgbouncer refused every connection ({last}):\n{log_tail(folder)}")


def drain(admin: Admin, script: Path, target: str, clients: int, jobs: int) -> float:
    """One pgbench drain of ``jobs`` fresh jobs by ``clients`` connected to ``target``:
    jobs per second."""
    admin.run("TRUNCATE pgjobs_job")
    admin.fill(jobs)
    admin.run("VACUUM ANALYZE pgjobs_job")
    admin.checkpoint()
    pgbench = find_pgbench(None)
    if pgbench is None:
        raise SystemExit("pgbench not found: install PostgreSQL's client programs")
    command = [
        str(pgbench),
        "--no-vacuum",
        "--protocol=extended",
        f"--client={clients}",
        "--jobs=2",
        f"--transactions={-(-jobs // (clients * BATCH))}",
        f"--file={script}",
        *("-D", "queue=default", "-D", "lease=300 seconds", "-D", "worker_id=pgbench"),
        *("-D", "suspects=false", "-D", f"tasks={execute.TextArray.of(registry.names())}"),
        *("-D", "synchronous_commit=off"),
        target,
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise BenchAbort(f"pgbench exited with {result.returncode}: {result.stderr[-2000:]}")
    seconds = pgbench_figures(result.stdout)["seconds"]
    done, bad = admin.conn.execute(
        "SELECT count(*) FILTER (WHERE status = 'done' AND attempts = 1), "
        "count(*) FILTER (WHERE status <> 'done' OR attempts <> 1) FROM pgjobs_job"
    ).fetchone() or (0, 0)
    if bad or done != jobs:
        raise BenchAbort(f"{clients} clients: {done} of {jobs} done once, {bad} not")
    return jobs / seconds


def turns_script(plain: str) -> str:
    """``plain`` with each claim in a transaction that first takes one advisory lock, held
    until it commits: the fleet's claims one at a time, each with a snapshot taken after
    the claim before it committed."""
    claim, complete = plain.split("\\gset\n")
    lock = f"SELECT pg_advisory_xact_lock({TURNS_LOCK});"
    return f"BEGIN;\n{lock}\n{claim}\\gset\nCOMMIT;\n{complete}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="4,16,64", help="client counts (default 4,16,64)")
    parser.add_argument("--pool", type=int, default=8, help="PgBouncer's server connections")
    parser.add_argument("--jobs", type=int, default=20_000, help="jobs per drain")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each of every drain")
    parser.add_argument(
        "--turns",
        action="store_true",
        help="also direct, with the claims taking turns under one advisory lock",
    )
    args = parser.parse_args()
    counts = [int(c) for c in args.clients.split(",")]
    url = os.environ["DATABASE_URL"]
    ways = ["direct", "pooled", *(["turns"] if args.turns else [])]
    rates: dict[tuple[int, str], list[float]] = {}
    admin = Admin(url)
    with tempfile.TemporaryDirectory(prefix="pgjobs-pooled-") as scratch:
        folder = Path(scratch)
        plain = ceiling_script(BATCH)
        for way, text in (("plain", plain), ("turns", turns_script(plain))):
            (folder / f"{way}.sql").write_text(text)
        bouncer, pooled = start_pgbouncer(url, args.pool, folder)
        targets = {"direct": url, "pooled": pooled, "turns": url}
        try:
            for _ in range(args.rounds):
                for clients in counts:
                    for way in ways:
                        script = folder / ("turns.sql" if way == "turns" else "plain.sql")
                        rate = drain(admin, script, targets[way], clients, args.jobs)
                        rates.setdefault((clients, way), []).append(rate)
        finally:
            bouncer.terminate()
            bouncer.wait()
            admin.close()
    print(f"jobs/s, median (min - max) of {args.rounds} rounds; pooled: {args.pool} connections")
    print(f"{'clients':>7} | " + " | ".join(f"{way:>24}" for way in ways) + " | pooled / direct")
    for clients in counts:
        cells = []
        for way in ways:
            values = rates[(clients, way)]
            cells.append(
                f"{statistics.median(values):>8,.0f} ({min(values):,.0f} - {max(values):,.0f})"
            )
        ratio = statistics.median(rates[(clients, "pooled")]) / statistics.median(
            rates[(clients, "direct")]
        )
        print(f"{clients:>7} | " + " | ".join(f"{c:>24}" for c in cells) + f" | {ratio:.2f}x")
    for fewer, more in itertools.pairwise(counts):
        for way in ways:
            fall = statistics.median(rates[(more, way)]) / statistics.median(rates[(fewer, way)])
            print(f"{way}: {more} clients / {fewer}: {fall:.2f}x")


if __name__ == "__main__":
    main()
