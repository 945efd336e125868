"""Random programs (tests/test_random_programs.py) on the MPI fabric, one rank per process.

    mpiexec -n N python tests/mpi/random_programs.py FILE [backend=trio] [in_order=1]

FILE holds a pickled list of programs of N ranks, drawn by Hypothesis on the pytest
side. Every process runs each program in a world of its own and checks every
rank's buffers against the numpy model, as the in-process test does; on success
each rank prints one `OK_MARK` line, on anything else `FAIL_MARK` and exits 1.
"""

from __future__ import annotations

import pickle
import sys
import time
import traceback

from _harness import FAIL_MARK, OK_MARK, rank_of_process, say  # (puts tests/ on sys.path)
from test_random_programs import check_program


def main() -> None:
    path, *options = sys.argv[1:]
    settings = dict(option.partition("=")[::2] for option in options)
    backend, in_order = settings.get("backend", "asyncio"), settings.get("in_order") == "1"
    with open(path, "rb") as file:
        programs = pickle.load(file)
    started, done = time.monotonic(), 0
    try:
        for program in programs:
            check_program(program, backend, in_order)
            done += 1
    except BaseException:  # noqa: BLE001 - report anything, then fail the process
        say(f"{FAIL_MARK} rank={rank_of_process()} program {done} of {len(programs)}:\n"
            f"{traceback.format_exc()}", sys.stderr)
        sys.exit(1)
    say(f"{OK_MARK} suite=random rank={rank_of_process()} size={programs[0].size} "
        f"checks={done} seconds={time.monotonic() - started:.2f}")


if __name__ == "__main__":
    main()
