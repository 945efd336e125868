"""Helpers the benchmarks share: statistics, machine load, formatting, and running
a benchmark's worker under mpiexec (rank 0 prints its results as one line of JSON)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

MiB = 1 << 20


def median(samples: list[float]) -> float:
    return statistics.median(samples)


def spread(samples: list[float]) -> dict[str, float]:
    return {"median": median(samples), "mean": statistics.fmean(samples),
            "min": min(samples), "max": max(samples), "n": len(samples)}


def busy_cpus(seconds: float = 0.5) -> float | None:
    """CPUs' worth of work other processes did over `seconds` (Linux; else None)."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait
    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    total = total1 - total0
    return (os.cpu_count() or 1) * (1 - (idle1 - idle0) / total) if total else None


class OtherLoad:
    """CPUs' worth of work that processes other than this one and its children did
    between construction and `cpus()` (Linux; else None): load that skews timings."""

    def __init__(self) -> None:
        self._start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        hz = os.sysconf("SC_CLK_TCK")
        busy = (sum(fields) - fields[3] - fields[4]) / hz  # all but idle and iowait
        me, children = resource.getrusage(resource.RUSAGE_SELF), \
            resource.getrusage(resource.RUSAGE_CHILDREN)
        mine = me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime
        return time.monotonic(), busy, mine

    def cpus(self) -> float | None:
        end = self._sample()
        if self._start is None or end is None or end[0] <= self._start[0]:
            return None
        (t0, busy0, mine0), (t1, busy1, mine1) = self._start, end
        return max(0.0, (busy1 - busy0) - (mine1 - mine0)) / (t1 - t0)


def fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else "PASS" if ok else "FAIL"


def mpi_env() -> dict[str, str]:
    """The environment variables that tune MPICH and its transports."""
    return {k: v for k, v in os.environ.items()
            if k.startswith(("MPIR_CVAR", "MPICH", "HYDRA", "UCX", "FI_"))}


def find_mpiexec(no_mpi: bool = False) -> tuple[str | None, str | None]:
    """(mpiexec, None), or (None, why MPI cannot be used)."""
    if no_mpi:
        return None, "--no-mpi"
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        return None, "mpiexec not found on PATH"
    if importlib.util.find_spec("mpi4py") is None:
        return None, "mpi4py is not installed"
    return mpiexec, None


def run_mpiexec(cmd: list[str], timeout: float,
                env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `cmd` (an mpiexec command line), with `env` added to the environment; the
    last JSON line it printed, or {"error": why, "command": cmd}."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL, check=False,
                              env=None if env is None else {**os.environ, **env})
    except subprocess.TimeoutExpired:
        return {"error": f"mpiexec did not finish within {timeout} s", "command": cmd}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"error": f"mpiexec exited with {proc.returncode}: {' | '.join(tail)}",
                "command": cmd}
    return json.loads(lines[-1])


def report(results: dict[str, Any], rows: list[dict[str, Any]], json_target: str | None,
           print_table: Callable[[dict[str, Any], list[dict[str, Any]]], None]) -> None:
    """The table on stdout; with --json, JSON too (on stdout for "-", else to a file)."""
    if json_target is None:
        print()
        print_table(results, rows)
        return
    text = json.dumps(results, indent=2)
    if json_target == "-":
        print(text)
        return
    with open(json_target, "w") as f:
        f.write(text + "\n")
    print_table(results, rows)


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """The options both benchmarks share: output, the MPI side's limits, the exit
    status, and the hidden ones the script passes to its own mpiexec workers."""
    parser.add_argument("--quick", action="store_true", help="small sizes, for a CI smoke test")
    parser.add_argument("--json", nargs="?", const="-", metavar="PATH",
                        help="write the results as JSON to PATH (or stdout: -, the default) "
                             "instead of the table")
    parser.add_argument("--mpi-timeout", type=float, default=900.0,
                        help="seconds each mpiexec may take")
    parser.add_argument("--check", action="store_true",
                        help="exit with status 1 if a target is missed")
    parser.add_argument("--mpi-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, help=argparse.SUPPRESS)
