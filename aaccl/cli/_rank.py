"""One rank under `aaccl launch`: a small supervisor process and, forked from it, the
process that runs the program.

    python -m aaccl.cli._rank script.py args...  |  -m module args...  |  -c code args...

Why two processes: MPICH's launcher (hydra) runs the ranks of a machine under one
proxy, and a proxy SIGKILLs all its ranks as soon as one of them dies of a signal, so
a killed rank would take every peer down before they could report which call failed.
The supervisor is what the proxy sees: when the program dies of signal N, the
supervisor exits normally with status 128 + N, and the peers live on to fail on their
timeouts and exit on their own.

Signals: hydra's proxy signals a rank's whole process group (the supervisor and the
program); the supervisor ignores those. A signal sent to the supervisor alone (by
anyone but its proxy) is forwarded to the program.

The supervisor writes the program's exit status to $AACCL_LAUNCH_STATUS/<rank> once
the program has exited (MPI finalized or not), because hydra does not always report
it; then it exits with that status.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import traceback
from pathlib import Path

RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
FORWARDED = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2}


def exit_status(exc: SystemExit) -> int:
    """The status Python itself would exit with for `exc`."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def run(program: list[str]) -> int:
    """Run the program in this process; its exit status."""
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


def status_of(wait_status: int) -> int:
    """A process's exit status as a shell reports it: 128 + N if signal N killed it."""
    if os.WIFSIGNALED(wait_status):
        return 128 + os.WTERMSIG(wait_status)
    return os.waitstatus_to_exitcode(wait_status) & 0xFF


def supervise(child: int) -> int:
    """Wait for `child`, forwarding the signals sent to this process alone; its exit
    status. FORWARDED and SIGCHLD must be blocked (since before the fork)."""
    proxy = os.getppid()
    pmi_fd = os.environ.get("PMI_FD", "")
    if pmi_fd.isdigit():  # the program's connection to the proxy: let it close with it
        try:
            os.close(int(pmi_fd))
        except OSError:
            pass
    while True:
        done, wait_status = os.waitpid(child, os.WNOHANG)
        if done == child:
            return status_of(wait_status)
        info = signal.sigwaitinfo(FORWARDED | {signal.SIGCHLD})
        if info.si_signo != signal.SIGCHLD and info.si_pid != proxy:
            try:  # a signal for this rank that the program did not get
                os.kill(child, info.si_signo)
            except ProcessLookupError:
                pass


def record(status: int) -> None:
    directory = os.environ.get("AACCL_LAUNCH_STATUS")
    rank = next((os.environ[v] for v in RANK_VARIABLES if v in os.environ), None)
    if directory and rank is not None:
        (Path(directory) / rank).write_text(str(status))


def main(program: list[str]) -> None:
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED | {signal.SIGCHLD})
    pid = os.fork()
    if pid == 0:  # the program, to an ordinary interpreter exit (MPI finalizes as usual)
        # hydra signals SIGUSR1 whenever a process of the job ends (see _mpi_world):
        # harmless to a program that does not listen for it
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        sys.exit(run(program))
    status = supervise(pid)
    record(status)
    # not through the interpreter's exit: what the program's imports left (threads of
    # numerical libraries, say) has no business running in this process
    os._exit(status)


if __name__ == "__main__":
    main(sys.argv[1:])
