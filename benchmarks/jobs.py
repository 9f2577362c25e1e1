"""Jobs only the benchmark runs (imported by the worker through ``benchmarks.settings``)."""

from __future__ import annotations

import asyncio
import os
import time

from django_pgjobs import job


@job
def stamp(seq: int, out: str) -> None:
    """W3: note when this job's function started, first thing, as ``seq time.time()``."""
    started = time.time()
    line = f"{seq} {started!r}\n".encode()
    fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


# Rounds of crunch()'s loop: about 5 ms of pure Python on the machine the figures come from.
CRUNCH_ROUNDS = 40_000


@job
def crunch(**kwargs: object) -> int:
    """The cores section's CPU-bound job: a fixed amount of pure-Python work, holding the GIL
    the whole time (no I/O, no C call that lets it go)."""
    total = 0
    for i in range(CRUNCH_ROUNDS):
        total += i * i % 7
    return total


@job
def doze(seconds: float) -> None:
    """The async section's job on an executor thread: an I/O wait that holds its thread."""
    time.sleep(seconds)


@job
async def nap(seconds: float) -> None:
    """The same wait as ``doze``, awaited on the worker's event loop."""
    await asyncio.sleep(seconds)
