"""aaccl's command line: `aaccl launch -n 4 app.py`, `aaccl info`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import _info
from ._launch import command, find_mpiexec, launch

__all__ = ["command", "find_mpiexec", "launch", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aaccl", description="aaccl's tools")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser(
        "launch", help="run a program as N ranks, one process each, with mpiexec",
        description="Run PROGRAM as N ranks, one process each, with the installed mpiexec; "
                    "in it, aaccl.run(main) runs the process's own rank. Exits with the "
                    "job's exit status.")
    run.add_argument("-n", "--nprocs", type=int, required=True, help="number of ranks")
    run.add_argument("--hostfile", help="hosts to run on (mpiexec's hostfile format)")
    run.add_argument("--mpiexec", help="the mpiexec to use (default: the installed one)")
    run.add_argument("program", nargs=argparse.REMAINDER,
                     help="script and its arguments (or -m module ...)")
    info = commands.add_parser(
        "info", help="list the devices this machine can drive, and why others are out",
        description="List aaccl's devices (soft CCLO, MPI, ACCL's emulator, XRT, PYNQ): "
                    "which are usable here, and why the others are not.")
    info.add_argument("--emulator-port", type=int, default=5500,
                      help="start port of a running cclo_emu to look for (default 5500)")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    if args.command == "info":
        print(_info.render(_info.report(args.emulator_port), args.json))
        return 0
    if args.program[:1] == ["--"]:  # `aaccl launch -n 2 -- -m package.module`
        args.program = args.program[1:]
    if args.nprocs < 1:
        parser.error("-n must be at least 1")
    if not args.program:
        parser.error("name the program to run")
    return launch(args.nprocs, args.program, args.hostfile, args.mpiexec)


if __name__ == "__main__":
    sys.exit(main())
