"""What the benchmark reads from ``/proc``: CPU time of processes, and a process's RSS."""

from __future__ import annotations

import os
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` split after the command name (which may hold spaces), or None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return text[text.rindex(")") + 2 :].split()


def parent_of(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[1]) if fields else None


def command_of(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None


def children_of(parent: int) -> list[int]:
    """Live processes whose parent is ``parent``."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields and int(fields[1]) == parent:
                found.append(int(entry.name))
    return found


def rss_bytes(pid: int) -> int | None:
    """VmRSS of ``pid``, or None once it has exited."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


class ServerCpu:
    """CPU seconds used by one PostgreSQL server: the postmaster and all its processes.

    Live children (backends, WAL writer, checkpointer, autovacuum) are read from their
    ``utime + stime``; children that exited are in the postmaster's ``cutime + cstime`` once it
    has reaped them. ``settle()`` waits for exited backends to be reaped before a reading.
    """

    def __init__(self, postmaster: int) -> None:
        self.postmaster = postmaster

    @classmethod
    def of_backend(cls, backend_pid: int) -> ServerCpu | None:
        """The server a backend belongs to, when that backend is a process on this machine."""
        parent = parent_of(backend_pid)
        if parent is None or command_of(parent) not in ("postgres", "postmaster"):
            return None
        return cls(parent)

    def seconds(self) -> float:
        own = _stat_fields(self.postmaster)
        if own is None:
            raise RuntimeError(f"the postmaster (pid {self.postmaster}) is gone")
        # Fields after the name: state(0) ppid(1) ... utime(11) stime(12) cutime(13) cstime(14).
        ticks = sum(int(own[i]) for i in (11, 12, 13, 14))
        for pid in children_of(self.postmaster):
            fields = _stat_fields(pid)
            if fields:
                ticks += int(fields[11]) + int(fields[12])
        return ticks / TICK

    def settle(self, children: int, timeout: float = 5.0) -> None:
        """Wait until the server has at most ``children`` processes (exited ones reaped)."""
        deadline = time.monotonic() + timeout
        while len(children_of(self.postmaster)) > children and time.monotonic() < deadline:
            time.sleep(0.02)

    def count(self) -> int:
        return len(children_of(self.postmaster))
