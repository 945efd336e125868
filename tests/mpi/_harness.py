"""What every MPI worker script shares: run one suite on this process's rank, report.

A worker is launched as `mpiexec -n N python tests/mpi/<worker>.py SUITE [key=value ...]`.
Each process runs the suite's coroutine on its own rank through `aaccl.run` (the MPI
fabric: one rank per process) and checks every result against numpy itself. On
success each rank prints one `OK_MARK` line; on any mismatch or error it prints
`FAIL_MARK` with the traceback and exits 1, so the pytest side asserts on exit codes
and output alone.

The numpy references are the in-process tests' own (tests/ is put on sys.path), so
both fabrics are held to the same checks.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the references

import aaccl

OK_MARK = "aaccl-mpi-ok"
FAIL_MARK = "aaccl-mpi-FAIL"

Suite = Callable[["Checks", aaccl.ACCL], Awaitable[Any]]
"""A suite's body, run on every rank; what it returns reaches every rank's `verify`."""

OPTIONS: dict[str, Any] = {}
"""The world's options, as given on the command line (for suites that depend on them)."""


class Checks:
    """Counts what a rank checked, so a suite that silently did nothing shows."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, n: int = 1) -> None:
        self.count += n


def _parse(argv: list[str]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for arg in argv:
        key, _, value = arg.partition("=")
        options[key] = value if key in ("backend", "fabric", "stack") else float(value) \
            if "." in value else int(value)
    return options


def rank_of_process() -> str:
    return os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "?"))


def run_suite(suites: dict[str, Suite],
              verify: Callable[[str, list[Any]], None] | None = None) -> None:
    """Run `sys.argv[1]`'s suite with options from `key=value` arguments (`backend`,
    `fabric`, `world_size`, `nbufs`, `bufsize`, `timeout`); exit 0 only if every check
    on every rank passed."""
    name, options = sys.argv[1], _parse(sys.argv[2:])
    OPTIONS.update(options)
    checks = Checks()
    started = time.monotonic()
    try:
        body = suites[name]

        async def main(accl: aaccl.ACCL) -> Any:
            return await body(checks, accl)

        results = aaccl.run(main, **options)
        if verify is not None:  # every rank's results, on every rank
            verify(name, results)
    except BaseException:  # noqa: BLE001 - report anything, then fail the process
        say(f"{FAIL_MARK} rank={rank_of_process()} suite={name} {options}:\n"
            f"{traceback.format_exc()}", sys.stderr)
        sys.exit(1)
    say(f"{OK_MARK} suite={name} rank={rank_of_process()} size={len(results)} "
        f"checks={checks.count} seconds={time.monotonic() - started:.2f}")


def say(text: str, stream: Any = None) -> None:
    """Write `text` and its newline in one write, so mpiexec, which interleaves the
    ranks' output, keeps it in one piece."""
    stream = sys.stdout if stream is None else stream
    stream.write(text + "\n")
    stream.flush()
