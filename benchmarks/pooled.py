"""Many claimers straight to PostgreSQL, and the same through PgBouncer's small pool.

Not part of ``benchmarks.run``: a diagnostic to run by hand against a database of your own
that has the schema (``manage.py migrate``), on a machine with ``pgbench`` and ``pgbouncer``;
it empties ``pgjobs_job`` before each drain::

    DATABASE_URL=postgres://... DJANGO_SETTINGS_MODULE=benchmarks.settings \\
        python -m benchmarks.pooled [--clients 4,16,64] [--pool 8] [--jobs 20000] [--rounds 3]

Each drain is the claimers section's pgbench one (``sql.CLAIM`` of 10, then ``sql.COMPLETE``,
each its own transaction), with N clients connected either to the database or to a PgBouncer
this script starts in transaction mode with ``--pool`` server connections. The statements go
unprepared both ways (``pgbench -M extended``): a PgBouncer before 1.21 cannot keep prepared
statements in transaction mode. The rounds take turns, every count both ways in each round,
and every drain must end with each job ``done`` on its first attempt.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import django
import psycopg

django.setup()

from benchmarks.db import Admin, BenchAbort  # noqa: E402
from benchmarks.workloads import ceiling_script  # noqa: E402
from django_pgjobs import registry, sql  # noqa: E402

BATCH = 10
# The advisory lock the claims of --turns take one at a time.
TURNS_LOCK = 4242


def find(program: str) -> str:
    found = shutil.which(program) or shutil.which(program, path="/usr/sbin:/usr/local/sbin")
    if found is None:
        raise SystemExit(f"{program} not found: install it (Debian: apt-get install {program})")
    return found


def start_pgbouncer(url: str, pool: int, folder: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A PgBouncer in transaction mode in front of ``url``'s database, ``pool`` server
    connections; returns it and the URL that goes through it."""
    parts = urlsplit(url)
    database, user = parts.path.lstrip("/"), parts.username or os.environ.get("USER", "postgres")
    port = 6400 + os.getpid() % 500
    (folder / "users.txt").write_text(f'"{user}" "{parts.password or ""}"\n')
    (folder / "pgbouncer.ini").write_text(
        f"[databases]\n{database} = host={parts.hostname or '127.0.0.1'} "
        f"port={parts.port or 5432} dbname={database}\n\n"
        f"[pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {port}\n"
        f"auth_type = trust\nauth_file = {folder / 'users.txt'}\npool_mode = transaction\n"
        f"default_pool_size = {pool}\nmax_client_conn = 1000\n"
        "ignore_startup_parameters = extra_float_digits\n"
        f"logfile = {folder / 'pgbouncer.log'}\n"
    )
    # PgBouncer will not run as root: it drops to an unprivileged user, who must read its files.
    command = [find("pgbouncer"), str(folder / "pgbouncer.ini")]
    if os.geteuid() == 0:
        folder.chmod(0o777)
        command[1:1] = ["-u", "nobody"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pooled = parts._replace(netloc=f"{user}@127.0.0.1:{port}").geturl()
    for _ in range(100):
        try:
            Admin(pooled).close()
            return process, pooled
        except psycopg.OperationalError:  # not listening yet
            if process.poll() is not None:
                raise BenchAbort(f"pgbouncer exited; see {folder / 'pgbouncer.log'}") from None
            time.sleep(0.1)
    process.kill()
    raise BenchAbort(f"pgbouncer did not accept a connection; see {folder / 'pgbouncer.log'}")


def drain(admin: Admin, script: Path, target: str, clients: int, jobs: int) -> float:
    """One pgbench drain of ``jobs`` fresh jobs by ``clients`` connected to ``target``:
    jobs per second."""
    admin.run("TRUNCATE pgjobs_job")
    admin.fill(jobs)
    admin.run("VACUUM ANALYZE pgjobs_job")
    admin.checkpoint()
    started = time.perf_counter()
    subprocess.run(
        [
            find("pgbench"),
            "--no-vacuum",
            "--protocol=extended",
            f"--client={clients}",
            "--jobs=2",
            f"--transactions={-(-jobs // (clients * BATCH))}",
            f"--file={script}",
            "-D",
            "queue=default",
            "-D",
            "lease=300 seconds",
            "-D",
            "worker_id=pgbench",
            "-D",
            "suspects=false",
            "-D",
            f"tasks={sql.TextArray.of(registry.names())}",
            "-D",
            "synchronous_commit=off",
            target,
        ],
        check=True,
        capture_output=True,
    )
    seconds = time.perf_counter() - started
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
    return (
        f"BEGIN;\nSELECT pg_advisory_xact_lock({TURNS_LOCK});\n{claim}\\gset\nCOMMIT;\n{complete}"
    )


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
    admin = Admin(url)
    rates: dict[tuple[int, str], list[float]] = {}
    ways = ["direct", "pooled", *(["turns"] if args.turns else [])]
    with tempfile.TemporaryDirectory(prefix="pgjobs-pooled-") as scratch:
        folder = Path(scratch)
        plain = ceiling_script(BATCH)
        scripts = {"direct": plain, "pooled": plain, "turns": turns_script(plain)}
        bouncer, pooled = start_pgbouncer(url, args.pool, folder)
        targets = {"direct": url, "pooled": pooled, "turns": url}
        try:
            for way in ways:
                (folder / f"{way}.sql").write_text(scripts[way])
                (folder / f"{way}.sql").chmod(0o644)
            for _ in range(args.rounds):
                for clients in counts:
                    for way in ways:
                        rate = drain(admin, folder / f"{way}.sql", targets[way], clients, args.jobs)
                        rates.setdefault((clients, way), []).append(rate)
        finally:
            bouncer.terminate()
            bouncer.wait()
            admin.run("TRUNCATE pgjobs_job")
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
