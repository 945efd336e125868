"""One rank under `aaccl launch`: a small supervisor process and, forked from it, the
process that runs the program.

    python -c "$SHIM" [--whole-lines] script.py args... | -m module args... | -c code args...

($SHIM, in _launch.py, loads this module and _statuses.py, which import nothing but
the standard library, from the installed aaccl's folder without importing the aaccl
package (nor numpy with it): the program starts as under `python`, free to set
OPENBLAS_NUM_THREADS before its first numpy import, and pytest rewrites aaccl's plugin
as it imports it. The working directory is not on sys.path meanwhile, so the ranks
find the installed aaccl wherever they start; the program then gets the sys.path entry
`python` would give it.)

Why two processes: MPICH's launcher (hydra) runs the ranks of a machine under one
proxy, and a proxy SIGKILLs all its ranks as soon as one of them dies of a signal, so
a killed rank would take every peer down before they could report which call failed.
The supervisor is what the proxy sees: when the program dies of signal N, the
supervisor exits normally with status 128 + N, and the peers live on to fail on their
timeouts and exit on their own.

Signals: hydra's proxy signals a rank's whole process group (the supervisor and the
program); the supervisor ignores those. A signal sent to the supervisor alone (by
anyone but its proxy) is forwarded to the program.

Once the program has exited (MPI finalized or not), the supervisor reports its exit
status to `aaccl launch` and waits until every rank of the job has ended
(_statuses.py says why); then it exits with that status.

With --whole-lines (what `aaccl launch` passes), the program's stdout and stderr
hand the OS whole lines: the launcher passes each rank's output on chunk by chunk,
so a line written in pieces (print under PYTHONUNBUFFERED writes its text and its
newline apart) would come out mixed mid-line with other ranks' lines, and with `-l`
get a second rank prefix (hydra's -prepend-rank prefixes every chunk).
"""

from __future__ import annotations

import atexit
import ctypes
import importlib.util
import io
import os
import runpy
import signal
import sys
import threading
import traceback
from pathlib import Path
from types import TracebackType
from typing import Any

from ._statuses import KILL_AFTER, PEERS_VARIABLE, Launcher

RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
# torchrun's names for what each launcher calls its own way: MPICH's (hydra), Open MPI's
TORCH_VARIABLES = {
    "RANK": ("PMI_RANK", "OMPI_COMM_WORLD_RANK"),
    "WORLD_SIZE": ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE"),
    "LOCAL_RANK": ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK"),
    "LOCAL_WORLD_SIZE": ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"),
}
WHOLE_LINES = "--whole-lines"
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


def keep_installed() -> None:
    """Where a folder named `aaccl` on the program's sys.path (a checkout in the working
    directory, say) would shadow the installed aaccl that launched it, import the
    installed one now, so that every rank runs the aaccl its launcher speaks to. Only
    then: otherwise the program imports aaccl, and numpy with it, itself."""
    installed = Path(__file__).resolve().parent.parent  # (loaded from its cli folder)
    try:
        spec = importlib.util.find_spec("aaccl")
    except (ImportError, ValueError):
        spec = None
    found = None if spec is None or not spec.submodule_search_locations else \
        Path(spec.submodule_search_locations[0]).resolve()
    if found is None or found == installed:
        return
    first = sys.path.pop(0)
    try:
        importlib.import_module("aaccl")
    finally:
        sys.path.insert(0, first)


def torch_variables(env: dict[str, str]) -> dict[str, str]:
    """RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE, as torchrun sets them, from
    the launcher's own variables in `env` (those it sets)."""
    found = {}
    for name, theirs in TORCH_VARIABLES.items():
        value = next((env[v] for v in theirs if v in env), None)
        if value is not None:
            found[name] = value
    return found


THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def thread_defaults(env: dict[str, str], cores: int) -> dict[str, str]:
    """The math libraries' thread counts, where the user set none: this machine's
    cores shared among its ranks (as torchrun sets OMP_NUM_THREADS). Each BLAS would
    otherwise start a thread per core in every rank: with 2 ranks on 2 cores, a numpy
    matmul in each took 20x as long."""
    ranks = int(env.get("LOCAL_WORLD_SIZE", "1") or 1)
    if ranks <= 1:
        return {}
    share = str(max(1, cores // ranks))
    return {name: share for name in THREAD_VARIABLES if name not in env}


def missing(program: list[str]) -> tuple[str, int] | None:
    """What `python` says (after its name and a colon), and its exit status, when it
    cannot start `program` (a script that is not there, a folder with no __main__.py,
    a module that does not exist); None if it can."""
    if program[0] == "-m":
        try:
            found = importlib.util.find_spec(program[1]) is not None
        except (ImportError, ValueError):
            found = False
        return None if found else (f"No module named {program[1]}", 1)
    if program[0] == "-c":
        return None
    if os.path.isdir(program[0]) and not os.path.exists(os.path.join(program[0], "__main__.py")):
        return f"can't find '__main__' module in {program[0]!r}", 1
    if os.path.exists(program[0]):
        return None
    return (f"can't open file {str(Path(program[0]).absolute())!r}: "
            "[Errno 2] No such file or directory", 2)


def run(program: list[str]) -> int:
    """Run the program in this process, with sys.path as `python` would start it
    (sys.path[0]: the script's directory, the working directory for -m, "" for -c);
    its exit status. As python, one line for a program that is not there; no
    traceback for Ctrl-C (`aaccl launch` says it once for every rank)."""
    first = {"-m": os.getcwd(), "-c": ""}.get(program[0])
    if first is None:
        first = str(Path(program[0]).resolve().parent)
    if not getattr(sys.flags, "safe_path", False):  # python -P adds none
        sys.path.insert(0, first)
        keep_installed()
    sys.argv = list(program)
    cannot = missing(program)
    if cannot is not None:
        # one write: the ranks share the launcher's stderr, and print's text and its
        # newline, written apart, interleave with another rank's
        sys.stderr.write(f"{Path(sys.executable).name}: {cannot[0]}\n")
        sys.stderr.flush()
        return cannot[1]
    try:
        if program[0] == "-m":
            sys.argv = program[1:]
            runpy.run_module(program[1], run_name="__main__", alter_sys=True)
        elif program[0] == "-c":
            sys.argv = ["-c", *program[2:]]
            exec(compile(program[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            runpy.run_path(program[0], run_name="__main__")
    except SystemExit as exc:
        return exit_status(exc)
    except KeyboardInterrupt:  # Python dies of SIGINT here: a shell says 128 + SIGINT
        return 128 + signal.SIGINT
    except BaseException as exc:
        # an error aaccl.run raised in every process alike: one traceback for the job
        shown_by = getattr(exc, REPORTED_BY, None)
        if shown_by is None or str(shown_by) == _rank():
            traceback.print_exception(type(exc), exc, _from_the_program(exc.__traceback__))
        return 1
    return 0


REPORTED_BY = "_aaccl_reported_by"
"""The attribute aaccl.run sets on an error it raises in every process alike: the rank
whose process shows its traceback (aaccl.api._world's; this module imports no aaccl)."""


def _from_the_program(tb: TracebackType | None) -> TracebackType | None:
    """A traceback from the program's first frame on, as `python` prints it: without
    this module's and runpy's frames, which only say how the program was started."""
    while tb is not None and (tb.tb_frame.f_code.co_filename == __file__
                              or tb.tb_frame.f_code.co_filename.startswith("<frozen runpy")):
        tb = tb.tb_next
    return tb


def _rank() -> str:
    """This rank's number, as its launcher says it ("" if none does)."""
    return next((os.environ[v] for v in RANK_VARIABLES if v in os.environ), "")


class WholeLines(io.RawIOBase):
    """A file descriptor that is handed whole lines: an unfinished line waits for
    its newline, or for a flush (as Python's own streams; the interpreter flushes
    on exit)."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self.fd, self.pending = fd, bytearray()

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.fd

    def write(self, data: Any) -> int:
        self.pending += data
        end = self.pending.rfind(b"\n") + 1
        if end:
            self._hand_over(end)
        return len(data)

    def flush(self) -> None:
        self._hand_over(len(self.pending))

    def _hand_over(self, end: int) -> None:
        done = 0
        with memoryview(self.pending) as pending:
            while done < end:
                done += os.write(self.fd, pending[done:end])
        del self.pending[:end]


def write_whole_lines() -> None:
    """Make stdout and stderr hand the OS whole lines (see the module's docstring)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        stream.flush()
        setattr(sys, name, io.TextIOWrapper(WholeLines(stream.fileno()), stream.encoding,
                                            stream.errors, write_through=True))


def status_of(wait_status: int) -> int:
    """A process's exit status as a shell reports it: 128 + N if signal N killed it."""
    if os.WIFSIGNALED(wait_status):
        return 128 + os.WTERMSIG(wait_status)
    return os.waitstatus_to_exitcode(wait_status) & 0xFF


def supervise(child: int, proxy: int) -> int:
    """Wait for `child`, forwarding the signals sent to this process alone (by anyone
    but `proxy`); its exit status. FORWARDED and SIGCHLD must be blocked (since
    before the fork)."""
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


exiting = [0]  # the program's exit status, once it has one


def skip_finalize_after_a_death() -> None:
    """At the program's exit (after its own atexit functions), if aaccl learned that a
    peer's process died: exit now, with the program's status, instead of through
    MPI_Finalize, which would disconnect from the dead process and, between
    machines (UCX), fail doing so and abort the job, killing ranks that have yet to
    report."""
    fabric = sys.modules.get("aaccl.soft.fabric._mpi")
    if fabric is not None and fabric.MPIFabric.dead():
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(exiting[0])


PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """Have Linux SIGKILL this process when its supervisor dies: a supervisor killed
    by hand would otherwise leave its program behind, stuck in MPI_Finalize for
    good with nobody to wait for it (hydra's proxy only knew the supervisor)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the program may outlive it
        return
    if os.getppid() != parent:  # the supervisor died before the request took hold
        os._exit(128 + signal.SIGKILL)


def main(argv: list[str]) -> None:
    whole_lines = argv[:1] == [WHOLE_LINES]
    program = argv[1:] if whole_lines else argv
    os.environ.update(torch_variables(dict(os.environ)))
    os.environ.update(thread_defaults(dict(os.environ), os.cpu_count() or 1))
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED | {signal.SIGCHLD})
    supervisor = os.getpid()
    news_r, news_w = os.pipe()  # who else ended: the supervisor tells the program
    pid = os.fork()
    if pid == 0:  # the program, to an ordinary interpreter exit (MPI finalizes as usual)
        die_with_parent(supervisor)
        os.close(news_w)
        os.set_blocking(news_r, False)
        os.environ[PEERS_VARIABLE] = str(news_r)
        # hydra signals SIGUSR1 whenever a process of the job ends (see _mpi_world):
        # harmless to a program that does not listen for it
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        if whole_lines:
            write_whole_lines()
        atexit.register(skip_finalize_after_a_death)  # first: it runs after the others
        exiting[0] = run(program)
        sys.exit(exiting[0])
    os.close(news_r)
    os.set_blocking(news_w, False)

    def ended(peer: int, status: int) -> None:
        """Another rank's program ended: tell this one (a line in the pipe, then
        SIGUSR1, which aaccl's MPI worlds listen for while open)."""
        try:
            os.write(news_w, f"{peer} {status}\n".encode())
            os.kill(pid, signal.SIGUSR1)
        except OSError:  # the program is gone, or never reads the pipe: it is full
            pass

    done = threading.Event()  # the program has been waited for: its pid is not ours

    def stop() -> None:
        """The launcher ends the program (another rank failed a while ago): SIGTERM,
        then SIGKILL if it is still there KILL_AFTER seconds later."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if done.is_set():
                return
            try:
                os.kill(pid, sig)
            except OSError:
                return
            done.wait(KILL_AFTER)

    proxy = os.getppid()
    rank = _rank()
    # connected after the fork: the program must not inherit the connection
    launcher = Launcher.connect(int(rank), proxy, ended, lambda: threading.Thread(
        target=stop, name="aaccl-stop", daemon=True).start()) if rank.isdigit() else None
    status = supervise(pid, proxy)
    done.set()
    if launcher is not None:
        launcher.finish(status)
    # not through the interpreter's exit: what the program's imports left (threads of
    # numerical libraries, say) has no business running in this process
    os._exit(status)


if __name__ == "__main__":
    main(sys.argv[1:])
