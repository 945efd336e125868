"""`aaccl launch`: start one rank per process with the installed mpiexec."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from . import _shm
from ._rank import WHOLE_LINES, missing
from ._statuses import FAILURE_GRACE, Board


def find_mpiexec(explicit: str | None = None) -> str:
    """The mpiexec to use: the one named, the one installed beside this Python (the
    `mpich` wheel of `aaccl[mpi]`), or the first on PATH."""
    if explicit:
        return explicit
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if found is None:
        raise SystemExit("aaccl launch: no mpiexec found: pip install 'aaccl[mpi]' "
                         "(or name one with --mpiexec)")
    return found


def is_hydra(mpiexec: str) -> bool:
    """MPICH's launcher (hydra) takes -f for hostfiles and -disable-auto-cleanup."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "HYDRA" in (out.stdout + out.stderr).upper()


# Each rank's supervisor (_rank.py), started without the working directory on
# sys.path (`python -m` would put it first, and a folder there named `aaccl` would
# shadow the installed package); _rank.run gives the program the sys.path entry
# `python` would. It is loaded from the installed aaccl's cli folder as a package of
# its own (find_spec finds a top-level package without running it), so that neither
# aaccl nor numpy is imported before the program.
SHIM = ("import sys, types, importlib.util as u; sys.path[:1] = [p for p in sys.path[:1] if p]; "
        "cli = types.ModuleType('_aaccl_launch'); "
        "cli.__path__ = [u.find_spec('aaccl').submodule_search_locations[0] + '/cli']; "
        "sys.modules[cli.__name__] = cli; "
        "from _aaccl_launch._rank import main; main(sys.argv[1:])")


# mpiexec runs under this, which asks Linux to SIGKILL it when the launcher dies, then
# becomes mpiexec (the request survives exec): a launcher killed (kill -9, a batch
# system's time limit) left mpiexec and every rank running, orphaned, for good; with
# mpiexec gone, hydra's proxies end their ranks. (Not preexec_fn: the launcher has a
# thread by then, the Board's, and code run between fork and exec may deadlock.)
DIE_WITH_LAUNCHER = (
    "import ctypes, os, signal, sys\n"
    "try:\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)\n"
    "except (OSError, AttributeError):\n"
    "    pass\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(128 + signal.SIGKILL)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n")


def command(mpiexec: str, nprocs: int, program: Sequence[str], hostfile: str | None,
            hydra: bool, prepend_rank: bool = False) -> list[str]:
    """The mpiexec command line that runs `program` (a script and its arguments,
    `-m module ...` or `-c code ...`) as `nprocs` ranks; with `prepend_rank`, the
    launcher's own option that starts each output line with the rank."""
    cmd = [mpiexec, "-n", str(nprocs)]
    if hostfile:
        cmd += ["-f" if hydra else "--hostfile", hostfile]
    if hydra:
        # A rank that dies must not take its peers down before they can report
        # which call failed; aaccl's timeouts make sure nobody waits forever, and its
        # worlds exit soon after. Hydra's proxy also kills every rank it runs when one
        # dies of a signal: each rank runs under a supervisor (_rank.py) that exits
        # normally instead. All ranks of a machine share one proxy, so MPICH moves
        # their messages through shared memory.
        cmd.append("-disable-auto-cleanup")
    # The program hands the OS whole lines (see _rank.py): the launcher passes each
    # rank's output on chunk by chunk, so lines written in pieces (print under
    # PYTHONUNBUFFERED, as many containers set it, writes its text and its newline
    # apart) would come out mixed with other ranks' mid-line, and hydra's -prepend-rank
    # (Open MPI: --tag-output) prefixes each chunk, not each line.
    shim = [sys.executable, "-c", SHIM, WHOLE_LINES]
    if prepend_rank:
        cmd.append("-prepend-rank" if hydra else "--tag-output")
    return cmd + shim + list(program)


def job_status(launcher: int, reported: Sequence[int], nprocs: int) -> int:
    """The job's exit status: the worst of the ranks' own statuses when every rank
    reported one (128 + N for a program killed by signal N); otherwise (a supervisor
    itself was killed, or could not reach the launcher) the worst of those and the
    launcher's."""
    if len(reported) == nprocs:
        return max(reported)
    return max([launcher, *reported])


def stop(proc: subprocess.Popen[bytes]) -> int:
    """End the job after Ctrl-C; mpiexec's status. A Ctrl-C at the terminal reached
    mpiexec too (it is in our foreground process group) and hydra passes it on to
    the ranks: a second SIGINT would make hydra kill them at once ("press Ctrl-C
    again to force abort", with its proxies' errors), so it is forwarded only when
    the signal was ours alone (sent by a program), or on another Ctrl-C."""
    if not _from_the_terminal():
        proc.send_signal(signal.SIGINT)
    previous = signal.signal(signal.SIGINT, lambda *_: proc.send_signal(signal.SIGINT))
    try:
        return proc.wait()
    finally:
        signal.signal(signal.SIGINT, previous)


def _from_the_terminal() -> bool:
    """Whether this process is in its terminal's foreground process group (where a
    Ctrl-C goes to every process of the group)."""
    for stream in (sys.stdin, sys.stderr):
        try:
            if os.tcgetpgrp(stream.fileno()) == os.getpgrp():
                return True
        except (OSError, ValueError, AttributeError):
            continue
    return False


def launch(nprocs: int, program: Sequence[str], hostfile: str | None = None,
           mpiexec: str | None = None, prepend_rank: bool = False,
           grace: float = FAILURE_GRACE) -> int:
    """Run the ranks; return the job's exit status (see `job_status`). `grace`: seconds
    the ranks still running get to end on their own once a rank has failed (`Board`)."""
    cannot = None if hostfile is not None or program[0] == "-m" else missing(list(program))
    if cannot is not None:  # what python says, once (on other machines, each rank says it)
        print(f"aaccl launch: {cannot[0]}", file=sys.stderr)
        return cannot[1]
    exe = find_mpiexec(mpiexec)
    cmd = command(exe, nprocs, program, hostfile, is_hydra(exe), prepend_rank)
    interrupted = False
    segments = _shm.segments()  # MPICH's, before the job: those it leaves go after it
    with Board(nprocs, grace) as board:
        # With SIGPIPE ignored (as in Python), hydra sees EPIPE when it writes to the
        # proxy of a rank that already exited, instead of dying of the signal.
        if sys.platform.startswith("linux"):  # (prctl is Linux's)
            cmd = [sys.executable, "-c", DIE_WITH_LAUNCHER, str(os.getpid()), *cmd]
        proc = subprocess.Popen(cmd, env={**os.environ, **board.env}, restore_signals=False)
        try:
            code = proc.wait()
        except KeyboardInterrupt:
            interrupted = True
            code = stop(proc)
        reported = board.statuses()
    _shm.reap(segments)
    launcher = 128 - code if code < 0 else code
    status = job_status(launcher, reported, nprocs)
    if interrupted:
        print(f"aaccl launch: interrupted (Ctrl-C); the job's {nprocs} ranks ended "
              f"(exit status {status})", file=sys.stderr)
        return status
    if launcher != 0 and len(reported) == nprocs and status == 0:
        print(f"aaccl launch: every rank exited 0; {Path(exe).name} exited {launcher} "
              "on its own (hydra's errors above come from tearing down the job)",
              file=sys.stderr)
    return status
