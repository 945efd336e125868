"""aaccl's command line: `aaccl launch -n 4 app.py`, `aaccl info`, `aaccl bench`,
`aaccl compare`, `aaccl trace plot`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .. import __version__
from . import _bench, _compare, _info
from ._launch import command, find_mpiexec, launch
from ._statuses import FAILURE_GRACE

__all__ = ["command", "find_mpiexec", "launch", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aaccl", description="aaccl's tools")
    parser.add_argument("--version", action="version", version=f"aaccl {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser(
        "launch", help="run a program as N ranks, one process each, with mpiexec",
        usage="aaccl launch [-h] -n N [-l] [--hostfile HOSTFILE] [--mpiexec MPIEXEC]\n"
              "                    [--grace SECONDS]\n"
              "                    (script.py | -m module | -c code) [arg ...]",
        description="Run a Python program as N ranks, one process each, with the installed "
                    "mpiexec; in it, aaccl.run(main) runs the process's own rank. As with "
                    "python, the program is a script, -m module or -c code, and whatever "
                    "follows it is its own arguments. Exits with the job's exit status.")
    run.add_argument("-n", "--nprocs", type=int, required=True, help="number of ranks")
    run.add_argument("-l", "--prepend-rank", action="store_true",
                     help="start each line a rank prints with its rank, as [0] "
                          "(mpiexec's -prepend-rank)")
    run.add_argument("--hostfile", help="hosts to run on (mpiexec's hostfile format)")
    run.add_argument("--mpiexec", help="the mpiexec to use (default: the installed one)")
    run.add_argument("--grace", type=float, default=FAILURE_GRACE, metavar="SECONDS",
                     help="once a rank's program has failed, end the ranks still running "
                          f"this long after (default {FAILURE_GRACE:g}; inf: never)")
    source = run.add_mutually_exclusive_group()
    source.add_argument("-m", dest="module", nargs=argparse.REMAINDER,
                        help="run a module as the program, as python -m module [arg ...]")
    source.add_argument("-c", dest="code", nargs=argparse.REMAINDER,
                        help="run code as the program, as python -c code [arg ...]")
    run.add_argument("program", nargs=argparse.REMAINDER,
                     help="the script and its arguments")
    info = commands.add_parser(
        "info", help="list the devices this machine can drive, and why others are out",
        description="List aaccl's devices (soft CCLO, MPI, ACCL's emulator, XRT, PYNQ): "
                    "which are usable here, and why the others are not.")
    info.add_argument("--emulator-port", type=int, default=5500,
                      help="start port of a running cclo_emu to look for (default 5500)")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    bench = commands.add_parser(
        "bench", help="sweep message sizes over the collectives, like nccl-tests",
        description="Time every collective over a range of sizes on device-resident "
                    "buffers and check the results against numpy; prints nccl-tests' "
                    "table (algbw, busbw, #wrong). Under mpiexec (aaccl launch -n N -m "
                    "aaccl bench ...), each process runs its own rank and rank 0 prints. "
                    "Exits with 1 if any result is wrong.")
    _bench.add_arguments(bench)
    compare = commands.add_parser(
        "compare", help="run a program on the soft CCLO and on ACCL's emulator, compare "
                        "the results bit for bit",
        description="Run an async main(accl) on the soft CCLO, with the options that make "
                    "it run calls as ACCL's firmware does (in_order=True and the same "
                    "network stack), and on running cclo_emu ranks; compare every rank's "
                    "results bit for bit. Without a program, every collective over sizes "
                    "1 to 4096 and every root. Exits with 1 if anything differs, 3 if "
                    "nothing could be compared (no emulator answers).")
    _compare.add_arguments(compare)
    trace = commands.add_parser("trace", help="work with call timelines (aaccl.tracing)")
    trace_commands = trace.add_subparsers(dest="trace_command", required=True)
    draw = trace_commands.add_parser(
        "plot", help="draw a trace as a PNG timeline",
        description="Draw a Chrome/Perfetto trace written by aaccl.tracing(path) as a PNG "
                    "timeline: one row per rank and lane, one colour per operation.")
    draw.add_argument("trace", help="the trace JSON")
    draw.add_argument("-o", "--output", default="timeline.png",
                      help="the PNG to write (default: %(default)s)")
    draw.add_argument("--title", help="the plot's title (default: the trace's file name)")
    args = parser.parse_args(argv)
    if args.command == "trace":
        from ._plot import plot

        try:
            plot(args.trace, args.output, args.title)
        except (ImportError, OSError, ValueError) as error:
            print(f"aaccl trace plot: {error}", file=sys.stderr)
            return 1
        print(f"wrote {args.output}")
        return 0
    if args.command == "bench":
        return _bench.main(args, bench)
    if args.command == "compare":
        return _compare.main(args, compare)
    if args.command == "info":
        print(_info.render(_info.report(args.emulator_port), args.json))
        return 0
    if args.nprocs < 1:
        parser.error("-n must be at least 1")
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    for flag, given in (("-m", args.module), ("-c", args.code)):
        if given is not None:  # python's -m and -c: all that follows is the program's
            if not given:
                run.error(f"{flag} needs {'a module' if flag == '-m' else 'code'} to run")
            program = [flag, *given, *args.program]
    if not program:
        run.error("name the program to run")
    if not args.grace >= 0:
        run.error("--grace must be at least 0")
    return launch(args.nprocs, program, args.hostfile, args.mpiexec, args.prepend_rank,
                  args.grace)


if __name__ == "__main__":
    sys.exit(main())
