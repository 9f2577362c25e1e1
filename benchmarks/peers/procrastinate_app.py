"""The procrastinate app of the peer benchmark (PEERS_DSN), with procrastinate's own virtualenv.

Two tasks, both ``async def`` (procrastinate's worker is asyncio; a sync task would run in a
thread): ``noop`` (W1, W2) and ``stamp`` (W3: writes ``seq time.time()`` to ``out``, first
thing). The worker is procrastinate's own CLI:
``python -m procrastinate --app=procrastinate_app.app worker ...``.
"""

from __future__ import annotations

import os
import time

from procrastinate import App, PsycopgConnector

app = App(connector=PsycopgConnector(conninfo=os.environ.get("PEERS_DSN", "")))


@app.task(name="noop")
async def noop(n: int) -> None:
    return None


@app.task(name="stamp")
async def stamp(seq: int, out: str) -> None:
    started = time.time()
    fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{seq} {started!r}\n".encode())
    finally:
        os.close(fd)
