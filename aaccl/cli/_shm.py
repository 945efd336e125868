"""MPICH's shared-memory segments that a job whose ranks died leaves behind.

MPICH's ranks on one machine share a file under /dev/shm (`mpich_shm_*`, a few MiB),
which it unlinks once every local rank has attached. A rank killed or interrupted
before then (a SIGKILL, a Ctrl-C during start-up, a crash) leaves the file: it
holds memory until the machine reboots, and a test suite or a workflow that kills
ranks now and then fills /dev/shm, then the machine's memory (seen here: 6,430
files, 22 GB, and the kernel's OOM killer). `aaccl launch` removes what its job
left: the files that appeared while it ran and that no process has open or mapped.
"""

from __future__ import annotations

import os
from pathlib import Path

SHM = Path("/dev/shm")
PREFIX = "mpich_shm_"


def segments(shm: Path = SHM) -> set[str]:
    """The names of MPICH's segments there now (none where there is no /dev/shm)."""
    try:
        return {name for name in os.listdir(shm) if name.startswith(PREFIX)}
    except OSError:
        return set()


def in_use(shm: Path = SHM) -> set[str]:
    """The segments that some process we can see has open or mapped."""
    used: set[str] = set()
    prefix = f"{shm}/{PREFIX}"
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return used
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    at = line.find(prefix)
                    if at >= 0:
                        used.add(line[at + len(str(shm)) + 1:].split()[0])
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(prefix):
                    used.add(target[len(str(shm)) + 1:].split()[0])
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return used


def reap(before: set[str], shm: Path = SHM) -> int:
    """Remove the segments that appeared since `before` was taken (`segments`) and
    that no process uses; return how many went."""
    new = segments(shm) - before
    if not new:
        return 0
    removed = 0
    for name in new - in_use(shm):
        try:
            (shm / name).unlink()
            removed += 1
        except OSError:  # another's, or gone already
            pass
    return removed
