"""One rank under `aaccl launch`: runs the program in this process and records its
exit status, because MPICH's launcher does not always report it.

    python -m aaccl.cli._rank script.py args...  |  -m module args...  |  -c code args...

The status goes to $AACCL_LAUNCH_STATUS/<rank> just before the interpreter exits
(so MPI still finalizes as usual); a rank killed by a signal leaves no file.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from pathlib import Path

RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")


def exit_status(exc: SystemExit) -> int:
    """The status Python itself would exit with for `exc`."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def run(program: list[str]) -> int:
    sys.argv = list(program)
    try:
        if program[0] == "-m":
            sys.argv = program[1:]
            runpy.run_module(program[1], run_name="__main__", alter_sys=True)
        elif program[0] == "-c":
            sys.argv = ["-c", *program[2:]]
            exec(compile(program[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.path[0] = str(Path(program[0]).resolve().parent)
            runpy.run_path(program[0], run_name="__main__")
    except SystemExit as exc:
        return exit_status(exc)
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def record(status: int) -> None:
    directory = os.environ.get("AACCL_LAUNCH_STATUS")
    rank = next((os.environ[v] for v in RANK_VARIABLES if v in os.environ), None)
    if directory and rank is not None:
        (Path(directory) / rank).write_text(str(status))


if __name__ == "__main__":
    code = run(sys.argv[1:])
    record(code)
    sys.exit(code)
