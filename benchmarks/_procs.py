"""The processes of an MPI job, as the fault benchmark and the tests watch them.

Hydra puts ranks in sessions of their own, so neither a process group nor the
launcher's children reach every rank: processes are found through /proc, below the
launcher and by a marker on their command line. `LiveJob` runs a job with its
output read as it comes, each stdout line stamped with when it arrived.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterable
from pathlib import Path


def descendants(pid: int) -> set[int]:
    """Every process below `pid`."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    """Running (a zombie has exited: its parent just has not reaped it yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def with_marker(marker: str) -> set[int]:
    """Processes (but this one) whose command line holds `marker`: every rank, its
    supervisor and mpiexec of one job."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.add(int(entry))
            except OSError:
                continue
    return found


def kill(pids: Iterable[int]) -> None:
    """SIGKILL each of `pids` that still exists."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class LiveJob:
    """A job (in a session of its own) whose output is read while it runs."""

    def __init__(self, cmd: list[str], env: dict[str, str], cwd: str | Path | None = None,
                 ) -> None:
        self.lines: list[tuple[float, str]] = []  # (time.monotonic(), stdout line)
        self.errors: list[str] = []  # stderr, as read
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
                                     start_new_session=True)
        self._readers = [threading.Thread(target=self._read_out, daemon=True),
                         threading.Thread(target=self._read_err, daemon=True)]
        for reader in self._readers:
            reader.start()

    def _read_out(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        self.errors.extend(self.proc.stderr)

    def join(self, timeout: float) -> None:
        """Wait (up to `timeout` each) for the output to end, once the job has."""
        for reader in self._readers:
            reader.join(timeout)

    @property
    def stdout(self) -> str:
        return "\n".join(text for _, text in self.lines)

    @property
    def stderr(self) -> str:
        return "".join(self.errors)
