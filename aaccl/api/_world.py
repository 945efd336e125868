"""Worlds of ranks: `open_world` builds them, `run` runs one function on each.

A world's ranks are tasks of one process (the in-process fabric), or one rank per
process under `mpiexec` (the MPI fabric); the same program runs either way.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import stat
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import anyio

from .. import _exchmem as xm
from .._errors import Aborted, ACCLError, RankErrors, RemoteError, same_error
from .._ranks import ranges
from .._threads import quietly, signals_wake_loop
from ..devices import Device
from ..devices._call import root_cause
from ..devices._emulator import DEFAULT_PORT, EmulatorDevice
from ..driver import STACKS, Driver, check_buffers
from ..driver._driver import _add_note
from ..soft import Engine, InProcessFabric, MPIFabric, SoftDevice
from ._accl import ACCL

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

T = TypeVar("T")
DEVICES = ("soft", "emulator", "xrt", "pynq")
FABRICS = ("auto", "inprocess", "mpi")
_MPI_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")  # MPICH's, Open MPI's


def mpi_launched() -> bool:
    """True in a process that mpiexec/mpirun started as part of a multi-process job."""
    return any(int(os.environ.get(name, "1")) > 1 for name in _MPI_SIZE_VARIABLES)


def _started_by_mpiexec() -> bool:
    """True under mpiexec/mpirun, even in a job of one process."""
    return any(name in os.environ for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"))


def _mpi_rank_and_size() -> tuple[int, int] | None:
    """(rank, size) of this process in an mpiexec job, read from the launcher's
    environment (devices other than the soft CCLO need no MPI library)."""
    for rank, size in (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")):
        if rank in os.environ and size in os.environ:
            try:
                return int(os.environ[rank]), int(os.environ[size])
            except ValueError:
                raise RuntimeError(
                    f"the MPI launcher's environment is not one aaccl can read: {rank}="
                    f"{os.environ[rank]!r}, {size}={os.environ[size]!r} (not numbers)") from None
    return None


def process_rank() -> int:
    """This process's rank in its MPI job (under `aaccl launch` or mpiexec, where each
    process runs one rank, the rank its `ACCL` has); 0 outside one, where this one
    process runs every rank of its worlds as tasks. To print once per program, not
    once per process: `if aaccl.process_rank() == 0: print(...)`."""
    return _process_rank_and_count()[0]


def process_count() -> int:
    """How many processes run this program: the size of its MPI job (under
    `aaccl launch` or mpiexec); 1 outside one."""
    return _process_rank_and_count()[1]


def _process_rank_and_count() -> tuple[int, int]:
    job = _mpi_rank_and_size()
    if job is not None:
        return job
    if "PMIX_RANK" in os.environ:  # a PMIx launcher that names no job size: ask MPI
        world = import_mpi().COMM_WORLD
        return world.Get_rank(), world.Get_size()
    return 0, 1


def check_options(world_size: Any, device: str, fabric: str, nbufs: Any, bufsize: Any,
                  timeout: Any, in_order: Any) -> None:
    """ValueError unless open_world can open a world with these options (the pytest
    plugin checks a marker's with it, before any world opens)."""
    if device != "soft" and fabric != "auto":
        raise ValueError(f"fabric={fabric!r} is for the soft CCLO: the {device} device brings "
                         "its own network")
    if world_size is not None or fabric == "inprocess":
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    check_buffers(nbufs, bufsize, world_size)
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}: available here: {', '.join(DEVICES)}")
    if fabric not in FABRICS:
        raise ValueError(f"unknown fabric {fabric!r}: choose from {', '.join(FABRICS)}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
            or not 0 < timeout < 4000 or math.isnan(timeout):
        raise ValueError(f"timeout must be a positive number of seconds below 4000, got {timeout!r}")
    if not isinstance(in_order, bool):
        raise ValueError(f"in_order must be True or False, got {in_order!r}")


def _stack(stack: Any, device: str, emulator_protocol: Any) -> str:
    """The world's network stack: `stack`, or `emulator_protocol` (its older name),
    or "tcp"."""
    if emulator_protocol is not None:
        if stack is not None and stack != emulator_protocol:
            raise ValueError(f"stack={stack!r} and emulator_protocol={emulator_protocol!r} "
                             "disagree: emulator_protocol is stack's older name, give one")
        stack = emulator_protocol
    stack = "tcp" if stack is None else stack
    if stack not in STACKS:
        raise ValueError(f"unknown stack {stack!r}: choose from {', '.join(STACKS)}")
    if stack == "rdma" and device in ("xrt", "pynq"):
        raise ValueError(f"stack='rdma' on device={device!r}: ACCL's Alveo designs for XRT "
                         "carry a TCP or UDP stack (RDMA is Coyote's, which aaccl does not "
                         "drive)")
    return stack


def _ranks(size: int, bufsize: int,
           addresses: Sequence[tuple[str, int]] | None = None) -> list[xm.RankRecord]:
    """Every rank's communicator record: its (IP, port) on the FPGA network, or
    loopback placeholders where the fabric does not use them."""
    if addresses is None:
        addresses = [("127.0.0.1", 17000 + r) for r in range(size)]
    return [xm.RankRecord(ip=xm.ip_encode(ip), port=port, session=r, max_segment_size=bufsize)
            for r, (ip, port) in enumerate(addresses)]


@asynccontextmanager
async def open_world(world_size: int | None = None, *, device: str = "soft",
                     fabric: str = "auto", nbufs: int = 16, bufsize: int = 1024,
                     timeout: float = 10.0, in_order: bool = False,
                     stack: str | None = None, emulator_port: int = DEFAULT_PORT,
                     emulator_protocol: str | None = None, xclbin: str | None = None,
                     board_idx: int | Sequence[int] = 0, cclo_idx: int = 0,
                     addresses: Sequence[tuple[str, int]] | None = None,
                     ) -> AsyncIterator[list[ACCL]]:
    """Open this process's ranks of a world; yield their ACCLs in rank order.

    With the in-process fabric (the default outside mpiexec), `world_size` ranks
    live in this process. Under mpiexec (`fabric="auto"` or `"mpi"`), this process
    is one rank of the MPI job and the list holds its ACCL alone; `world_size`, if
    given, must match the job. `nbufs` eager rx buffers of `bufsize` bytes each per
    rank; `timeout` seconds a call waits for a peer before it fails with
    RECEIVE_TIMEOUT_ERROR. On exit, waits for every outstanding call and releases
    the devices.

    `in_order=True` makes each soft CCLO run its calls strictly one at a time, in
    submission order (ready or not: a call waiting for its `waitfor` holds back
    those behind it), as ACCL's firmware does: every program that runs on a card
    runs here, and one that needs two calls of one rank to overlap (both ranks
    receive before they send, say) times out here as it would hang on a card.
    Other devices are in order by nature.

    `stack` is the network stack the CCLOs stand on, and sets the message protocol on
    every device, the soft CCLO included: "tcp" (the default) or "udp", ACCL's stacks on
    Alveo cards and its emulator's default, make every message eager (a send completes
    once the receiver's rx buffers hold it, with no receive posted); "rdma" sends
    messages up to one rx buffer eager and larger ones rendezvous (the send waits for
    the receive), as ACCL does on Coyote's RDMA stack. ACCL's firmware runs barrier
    and alltoall only through rendezvous, so on "tcp" and "udp" it cannot; the soft
    CCLO runs them on any stack.

    `device="emulator"` drives ACCL's emulator (`cclo_emu`, ACCL's firmware run on the
    host), started beforehand with as many ranks as the world has, its start port
    (`emulator_port`) and the world's `stack` (`cclo_emu -c tcp`, `udp` or `cyt_rdma`;
    `emulator_protocol` is an older name for `stack`). Its ranks are tasks of this
    process, or one per process under mpiexec.

    `device="xrt"` (pyxrt) or `"pynq"` (pynq 3.0.1) drive Alveo cards programmed with
    `xclbin`: rank r of this process uses card `board_idx + r` (or `board_idx[r]`),
    CCLO `cclo_idx`; `addresses` gives each rank's (IP, port) on the FPGA network.
    """
    check_options(world_size, device, fabric, nbufs, bufsize, timeout, in_order)
    stack = _stack(stack, device, emulator_protocol)
    _protect_from_keyboard_interrupt()
    with signals_wake_loop():  # (a Ctrl-C any thread takes wakes the loop: _threads.py)
        async with _world(world_size, device, fabric, nbufs, bufsize, timeout, in_order,
                          stack, emulator_port, xclbin, board_idx, cclo_idx,
                          addresses) as accls:
            yield accls


@asynccontextmanager
async def _world(world_size: int | None, device: str, fabric: str, nbufs: int, bufsize: int,
                 timeout: float, in_order: bool, stack: str, emulator_port: int,
                 xclbin: str | None, board_idx: int | Sequence[int], cclo_idx: int,
                 addresses: Sequence[tuple[str, int]] | None) -> AsyncIterator[list[ACCL]]:
    """`open_world`, its options checked."""
    if device != "soft":
        make = _device_maker(device, emulator_port, stack, xclbin, board_idx, cclo_idx)
        async with _device_world(world_size, make, nbufs, bufsize, timeout, stack,
                                 addresses) as on_devices:
            yield on_devices
        return
    if fabric == "mpi" or (fabric == "auto" and (
            mpi_launched() or (world_size is None and _started_by_mpiexec()))):
        async with _mpi_world(world_size, nbufs, bufsize, timeout, in_order, stack) as mine:
            yield mine
        return
    if world_size is None:
        raise ValueError("world_size is needed outside mpiexec (ranks as tasks of this process)")
    inprocess = InProcessFabric(world_size)
    ranks = _ranks(world_size, bufsize)
    accls: list[ACCL] = []
    try:
        for rank in range(world_size):
            dev = SoftDevice(rank, inprocess.port(rank), in_order=in_order)
            accls.append(await _open(dev, rank, ranks, nbufs, bufsize, timeout, stack))
        yield accls
    except BaseException as exc:  # cancelled, interrupted, or a rank raised: nobody
        reason = _why(exc)        # will await what is outstanding, end it now
        for accl in accls:
            accl._abort(reason)
        raise
    finally:
        with anyio.CancelScope(shield=True):
            for accl in accls:
                await accl.aclose()


def _protect_from_keyboard_interrupt() -> None:
    """Under trio, a Ctrl-C waits for the next checkpoint while the soft CCLO's engine
    runs events (or a task polls the MPI fabric) on the event loop's thread. trio
    raises KeyboardInterrupt wherever that thread is, unless the code is marked
    protected: one raised inside an event left a call half-stepped, waiting for
    nothing, which no abort could end, and its world's closing waited for it for good
    (1 Ctrl-C in 5 under `aaccl launch -n 3`, on trio). asyncio's runner cancels its
    main task on the first Ctrl-C instead. Marking costs nothing at run time (trio
    keeps a table of protected code objects, read only when a SIGINT comes)."""
    trio = sys.modules.get("trio")  # (used only if the program runs on trio)
    if trio is None:
        return
    for code_of in (Engine.post, Engine._drain, MPIFabric.poll):
        trio.lowlevel.enable_ki_protection(code_of)


def _device_maker(device: str, emulator_port: int, stack: str, xclbin: str | None,
                  board_idx: int | Sequence[int], cclo_idx: int) -> Callable[[int], Device]:
    """How to open one rank's device."""
    if device == "emulator":
        def emulator(rank: int) -> Device:
            return EmulatorDevice(rank, port=emulator_port, protocol=stack)

        return emulator
    if xclbin is None:
        raise ValueError(f"device={device!r} needs xclbin=, the bitstream with ACCL's CCLO")

    def board(rank: int) -> int:
        return board_idx[rank] if isinstance(board_idx, Sequence) else board_idx + rank

    if device == "xrt":
        from ..devices._xrt import XRTDevice

        return lambda rank: XRTDevice(xclbin, device_index=board(rank), cclo_index=cclo_idx)
    from ..devices._pynq import PynqDevice

    return lambda rank: PynqDevice(xclbin, device_index=board(rank), cclo_index=cclo_idx)


@asynccontextmanager
async def _device_world(world_size: int | None, make: Callable[[int], Device], nbufs: int,
                        bufsize: int, timeout: float, stack: str = "tcp",
                        addresses: Sequence[tuple[str, int]] | None = None,
                        ) -> AsyncIterator[list[ACCL]]:
    """A world on devices that are networked already (the emulator, hardware): this
    process's ranks are all of them, or its own under mpiexec. The ranks are
    configured at once, since each configuration is hundreds of register writes."""
    job = _mpi_rank_and_size()
    if job is not None and job[1] > 1:
        mine, size = [job[0]], job[1]
        if world_size is not None and world_size != size:
            raise ValueError(f"world_size={world_size}, but this MPI job has {size} processes")
    elif world_size is None:
        raise ValueError("world_size is needed outside mpiexec (ranks as tasks of this process)")
    else:
        mine, size = list(range(world_size)), world_size
    if addresses is not None and len(addresses) != size:
        raise ValueError(f"addresses has {len(addresses)} entries for a world of {size} ranks")
    ranks = _ranks(size, bufsize, addresses)
    opened: dict[int, ACCL] = {}
    failed: dict[int, Exception] = {}

    async def open_rank(rank: int) -> None:
        try:
            dev = await anyio.to_thread.run_sync(quietly(make), rank)
            opened[rank] = await _open(dev, rank, ranks, nbufs, bufsize, timeout, stack)
        except Exception as error:
            failed[rank] = error

    try:
        async with anyio.create_task_group() as tasks:
            for rank in mine:
                tasks.start_soon(open_rank, rank)
        if failed:  # one clear error, not a group of the same one per rank
            raise failed[min(failed)]
        yield [opened[rank] for rank in mine]
    except BaseException as exc:
        reason = _why(exc)
        for accl in opened.values():
            accl._abort(reason)
        raise
    finally:
        with anyio.CancelScope(shield=True):
            for accl in opened.values():
                await accl.aclose()


async def _open(dev: Device, rank: int, ranks: list[xm.RankRecord], nbufs: int,
                bufsize: int, timeout: float, stack: str = "tcp") -> ACCL:
    driver = Driver(dev, rank, ranks, nbufs=nbufs, bufsize=bufsize, timeout=timeout,
                    stack=stack)
    try:
        return await ACCL.open(driver)
    except BaseException:
        dev.close()
        raise


def import_mpi() -> Any:
    """mpi4py's MPI module, imported as a rank of an MPI world of soft CCLOs needs it."""
    if "mpi4py.MPI" not in sys.modules:
        # MPICH's MPI_Finalize (run by mpi4py at exit) waits for every process of the
        # job; after a peer died it never returns, so a rank that reported its
        # RECEIVE_TIMEOUT_ERROR would hang at exit. Closing a world is collective
        # already: let finalize skip its barrier (set it to 0 to keep MPICH's default).
        os.environ.setdefault("MPIR_CVAR_NO_COLLECTIVE_FINALIZE", "1")
    try:
        from mpi4py import MPI
    except ImportError:
        raise ImportError("the MPI fabric needs mpi4py: pip install 'aaccl[mpi]'") from None
    return MPI


_worlds_listening = 0  # MPI worlds of this process open, while SIGUSR1 is theirs
_listening_lock = threading.Lock()


_news = b""  # an unfinished line read from the supervisor's pipe


PEERS_VARIABLE = "AACCL_LAUNCH_PEERS_FD"
"""Where `aaccl launch` tells a rank the pipe of its peers' ends (cli/_statuses.py,
which the supervisor loads without aaccl, has the same name: a test holds them equal)."""
_lost: Callable[[str, dict[int, str]], None] | None = None  # MPIFabric.process_lost


def _process_lost(signum: int, frame: Any) -> None:
    # A signal handler imports nothing: hydra sends SIGUSR1 once per process that
    # ends, so a second one comes while the first handler may still be importing,
    # and finds the module half made (issue 28's kill test, 1 trial in 10).
    if _lost is not None:
        ranks = ended_ranks()
        # the first reason is what the world's collectives fail with from now on (the
        # lane's), whoever buries the ranks first: it names them where it can
        _lost("; ".join(f"rank {rank} left the world: {how}" for rank, how in sorted(ranks.items()))
              or "a process of this MPI job ended (hydra's SIGUSR1)", ranks)


def ended_ranks() -> dict[int, str]:
    """Which ranks' programs ended abnormally, and how, as far as this rank's
    supervisor has told it so far (under `aaccl launch`; see cli/_statuses.py):
    read from its pipe without waiting."""
    global _news
    fd = os.environ.get(PEERS_VARIABLE, "")
    try:  # (a process the program started inherits the variable, not the pipe)
        if not fd.isdigit() or not stat.S_ISFIFO(os.fstat(int(fd)).st_mode):
            return {}
    except OSError:
        return {}
    try:
        while chunk := os.read(int(fd), 4096):
            _news += chunk
    except OSError:  # nothing more now (or no such pipe)
        pass
    *lines, _news = _news.split(b"\n")
    ended = {}
    for line in lines:
        rank, _, status = line.decode(errors="replace").partition(" ")
        if rank.isdigit() and status.isdigit() and int(status) != 0:
            ended[int(rank)] = how_it_ended(int(status))
    return ended


def how_it_ended(status: int) -> str:
    """A program's exit status in words (128 + N: killed by signal N)."""
    if status > 128:
        try:
            name = signal.Signals(status - 128).name
        except ValueError:
            name = f"signal {status - 128}"
        return f"its process was killed by {name}"
    return f"its program exited with status {status}"


def listen_for_lost_processes() -> Callable[[], None]:
    """Take SIGUSR1 while an MPI world is open; return what to call once it closed.

    Under `mpiexec -disable-auto-cleanup` (as `aaccl launch` runs jobs), hydra sends
    SIGUSR1 to every process of the job when one of them ends without telling it (one
    that died; with MPICH 5, any that exits). Its default action kills silently:
    survivors must live to report their timeouts. While a world is open the signal
    tells it to close without waiting for peers that are gone; once none is open
    (MPI_Finalize included) it is ignored. A program's own handler is left alone, as
    is the signal in a world opened off the main thread (Python's rule)."""
    global _worlds_listening, _lost
    from ..soft import MPIFabric

    _lost = MPIFabric.process_lost  # (bound now: the handler must not import)
    main = threading.current_thread() is threading.main_thread()
    with _listening_lock:
        if main and _worlds_listening == 0 \
                and signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, signal.SIG_IGN):
            signal.signal(signal.SIGUSR1, _process_lost)
        _worlds_listening += 1

    def done() -> None:
        global _worlds_listening
        with _listening_lock:
            _worlds_listening -= 1
            if _worlds_listening == 0 and threading.current_thread() is threading.main_thread() \
                    and signal.getsignal(signal.SIGUSR1) is _process_lost:
                signal.signal(signal.SIGUSR1, signal.SIG_IGN)

    return done


WORLD_CLOSED = "its world closed"
"""How the departure of a rank whose world closed early (an error, a cancellation,
Ctrl-C, SystemExit) begins: that process gathers no results (`_gather_results`)."""


@asynccontextmanager
async def _mpi_world(world_size: int | None, nbufs: int, bufsize: int, timeout: float,
                     in_order: bool, stack: str = "tcp") -> AsyncIterator[list[ACCL]]:
    stop_listening = listen_for_lost_processes()
    try:
        MPI = import_mpi()
        size = MPI.COMM_WORLD.Get_size()
        if world_size is not None and world_size != size:
            raise ValueError(f"world_size={world_size}, but this MPI job has {size} processes")
        check_buffers(nbufs, bufsize, size)
        fabric = await _open_fabric(MPI.COMM_WORLD, nbufs, bufsize, timeout)
        wait: float | None = timeout  # for the peers, on closing (see below)
        try:
            dev = SoftDevice(fabric.rank, fabric.port(fabric.rank), in_order=in_order)
            dev.missing = fabric.missing  # a peer whose process ended never comes
            accl = await _open(dev, fabric.rank, _ranks(size, bufsize), nbufs, bufsize, timeout,
                               stack)
            try:
                yield [accl]
            except BaseException as exc:
                reason = _why(exc)
                accl._abort(reason)
                accl._depart(f"{WORLD_CLOSED}: {reason}")
                raise
            else:
                with anyio.CancelScope(shield=True):
                    await accl._settle()  # what it sent may still be needed
                accl._depart("its program returned and its world closed")
                wait = None  # the peers' own code may take any time: wait while they live
            finally:
                with anyio.CancelScope(shield=True):
                    await accl.aclose()
        finally:
            with anyio.CancelScope(shield=True):
                # a world left by an error or Ctrl-C waits for its peers up to the timeout
                await anyio.to_thread.run_sync(quietly(fabric.close), wait)
    finally:
        stop_listening()


async def _open_fabric(comm: Any, nbufs: int, bufsize: int, timeout: float) -> MPIFabric:
    """This process's MPI fabric, on `comm` (COMM_WORLD), opened nonblocking
    (`opening`): MPI's blocking `Comm.Dup` would wait forever for a rank that never
    comes. Every process of the job must come; a rank that comes early waits for the
    others however long their own code takes (reading their data, say), as long as
    their processes live: it fails at once, naming them, when a process of the job is
    known to have ended (the launcher said so, before or during the wait; hydra's
    SIGUSR1; the pid, on this machine, of a rank that the last world found there).
    Once every rank has come, the rest of the opening is MPI's own work, bounded by
    `timeout` (a rank may give up meanwhile: its opening cancelled). An opening given
    up on leaves its MPI requests pending (`abandon`)."""
    from ..soft.fabric import _mpi

    me = comm.Get_rank()
    news = ended_ranks()  # what the launcher said while no world of ours listened
    if news:
        MPIFabric.process_lost("; ".join(f"rank {rank} left the world: {how}"
                                         for rank, how in sorted(news.items())), news)

    def why_not(gone: str | None) -> str:
        if gone is None:
            return (f"rank {me} waited {timeout:g} s for the other ranks of the MPI job "
                    "to finish opening the world (open_world) after every rank had come "
                    "to it (MPI does not say which is missing: one gave up, or its "
                    "opening was cancelled)")
        return (f"rank {me} cannot open its MPI world (open_world): {gone}; a world opens "
                "only once every process of the job comes to open it")

    gone = _mpi.gone_before_opening()
    if gone is not None:  # nothing is started in MPI that could never finish
        raise ACCLError(why_not(gone))
    made: list[tuple[Any, Any, Any]] = []
    steps = _mpi.opening(comm, made)
    deadline = math.inf  # until every rank has come: as long as their processes live
    try:
        request = next(steps)
        while True:
            while not request.Test():
                gone = _mpi.gone_before_opening()
                if gone is not None or time.monotonic() > deadline:
                    await anyio.sleep(0.05)  # one last look: it may have come meanwhile
                    if request.Test():
                        break
                    raise ACCLError(why_not(gone))
                await anyio.sleep(0.002)
            if deadline == math.inf:  # every rank came
                deadline = time.monotonic() + timeout
            request = steps.send(None)
    except StopIteration as end:
        return MPIFabric(comm, nbufs, bufsize, end.value)
    except BaseException:
        _mpi.abandon(made)
        raise


def run(main: Callable[[ACCL], Awaitable[T]], world_size: int | None = None, *,
        backend: str = "asyncio", **options: Any) -> list[T]:
    """Run `main(accl)` for every rank; return their results in rank order.

    Outside mpiexec, the ranks are tasks of one event loop in this process. Under
    mpiexec, this process runs its own rank, and every process gets the list of all
    ranks' results (`process_rank()` tells which process this is). `backend` is
    "asyncio" or "trio"; `options` go to `open_world`.

    If a rank raises, every outstanding call of every rank is aborted at once
    (`Aborted`, naming the rank and its error) and the other ranks are cancelled.
    `run` then raises one error, the same in every process: the ranks' own errors
    count, not the `Aborted` they caused elsewhere. If they are all the same error
    (same type and message but for the rank numbers they name; for `CCLOError`, the
    same error bits), `run` raises it as itself, the lowest rank's, with a note
    naming the ranks; if they differ, `RankErrors`, an `ACCLError` holding each
    rank's. KeyboardInterrupt and SystemExit propagate as themselves.
    """
    errors: dict[int, BaseException] = {}
    stopped: list[BaseException] = []  # a rank's KeyboardInterrupt or SystemExit

    async def world() -> list[T]:
        results: dict[int, Any] = {}

        async with open_world(world_size, **options) as accls:
            one_of_many = len(accls) == 1 and accls[0].size > 1  # one rank of an MPI job

            async def rank(accl: ACCL) -> None:
                try:
                    results[accl.rank] = await main(accl)
                    # done: what it sent may still be needed; then it leaves, so that
                    # calls still waiting for it fail at once
                    await accl._settle()
                    accl._depart("its program returned")
                except Exception as exc:
                    errors[accl.rank] = exc
                    reason = f"rank {accl.rank} raised {type(exc).__name__}: {exc}"
                    if not isinstance(exc, Aborted):
                        for each in accls:
                            each._abort(reason)
                    if one_of_many:  # the others' calls waiting for us fail now, even
                        accl._depart(reason)  # when ours was aborted: we make no more
                    if not one_of_many:
                        raise
                except (KeyboardInterrupt, SystemExit) as exc:
                    # ends the world as an error does: asyncio would let it out of
                    # the loop at once, leaving the other ranks' tasks behind
                    stopped.append(exc)
                    reason = f"rank {accl.rank} raised {type(exc).__name__}"
                    for each in accls:
                        each._abort(reason)
                    if one_of_many:  # its world closes: it gathers no results
                        accl._depart(f"{WORLD_CLOSED}: {reason}")
                    raise _Stopped from exc

            async with anyio.create_task_group() as tasks:
                for accl in accls:
                    tasks.start_soon(rank, accl)
            if one_of_many:
                me = accls[0].rank
                outcome = (True, _portable(errors[me])) if me in errors else (False, results[me])
                try:
                    everyone = await _gather_results(outcome, accls[0],
                                                     options.get("timeout", 10.0))
                except ACCLError:
                    if me in errors:  # its own error says more than the others' absence
                        raise errors[me] from errors[me].__cause__
                    raise
                failed = {r: errors[me] if r == me else _rebuilt(*value)
                          for r, (bad, value) in enumerate(everyone) if bad}
                if failed:
                    failure = _failure(failed, me)
                    raise failure from failure.__cause__
                return [value for _, value in everyone]
        return [results[r] for r in range(len(results))]

    try:
        return anyio.run(world, backend=backend)
    except BaseExceptionGroup as group:
        stop = stopped[0] if stopped else _stopping(group)
        if stop is not None:
            raise stop from None
        if errors:
            failure = _failure(errors)
            raise failure from failure.__cause__  # (not the group: the failure's own)
        if len(group.exceptions) == 1:
            only = group.exceptions[0]
            raise only from only.__cause__
        raise


def _failure(errors: dict[int, BaseException], mine: int | None = None) -> BaseException:
    """The one error `run` raises for ranks that failed: the ranks' own errors, not
    the `Aborted` they caused elsewhere, nor the `DependencyError` of a call whose
    dependency was aborted (unless every rank was aborted); as itself
    when they are all the same error (`same_error`), with a note naming the ranks:
    this process's rank's (`mine`) if it is one of them, else the lowest rank's;
    else `RankErrors`. Deterministic: which ranks got as far as their own error may
    vary from run to run, what they failed with does not."""
    own = {r: e for r, e in errors.items()  # (a call whose dependency was aborted too)
           if not isinstance(root_cause(e), Aborted)} or errors
    if len({same_error(e) for e in own.values()}) > 1:
        failure: BaseException = RankErrors(own)
        if mine is not None:
            setattr(failure, REPORTED_BY, min(own))
        return failure
    shown = mine if mine in own else min(own)
    error = own[shown]
    if len(own) == 1:
        note = f"aaccl.run: rank {shown} raised this"
    else:
        note = (f"aaccl.run: {ranges(own)} raised this error (the same but for rank "
                f"numbers); this is rank {shown}'s")
    aborted = sorted(set(errors) - set(own))
    if aborted:
        note += f"; {ranges(aborted)} {'was' if len(aborted) == 1 else 'were'} aborted"
    if mine is not None and mine not in errors:
        note += f"; rank {mine}, this process's, returned"
    _add_note(error, note)
    if mine is not None:
        setattr(error, REPORTED_BY, min(own))
    return error


class _Stopped(Exception):
    """A rank raised KeyboardInterrupt or SystemExit: `run` raises it once the world
    has closed."""


REPORTED_BY = "_aaccl_reported_by"
"""Set on the error `run` raises under MPI, where every process raises the same one:
the rank whose process is to print its traceback (`aaccl launch` prints one, not one
per rank)."""


def _stopping(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    """A KeyboardInterrupt, SystemExit or other BaseException (not a cancellation)
    among a group's leaves: what must end the program as itself."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            found = _stopping(exc)
            if found is not None:
                return found
        elif not isinstance(exc, (Exception, *_cancelled())):
            return exc
    return None


def _portable(error: BaseException) -> tuple[str, str, bytes | None, bytes | None]:
    """A rank's error as it travels to the other processes: its one-line text, what
    it is the same as, itself pickled (where it pickles), and the failure it comes
    from (`root_cause`: a DependencyError's), pickled, where that is another error
    (pickling an error leaves its `__cause__` behind)."""
    root = root_cause(error)
    text = f"{type(error).__name__}: {error}"
    return (text, same_error(error), _pickled(error),
            _pickled(root) if root is not None and root is not error else None)


def _pickled(error: BaseException) -> bytes | None:
    import pickle

    try:
        return pickle.dumps(error, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        return None


def _rebuilt(text: str, kind: str, pickled: bytes | None,
             root: bytes | None = None) -> BaseException:
    """Another process's rank's error, from `_portable`."""
    import pickle

    error: BaseException = RemoteError(text, kind)
    if pickled is not None:
        try:
            theirs = pickle.loads(pickled)
            if isinstance(theirs, BaseException) and same_error(theirs) == kind:
                error = theirs  # (a changed message, say, would change what it matches)
        except Exception:
            pass
    if root is not None:
        try:
            cause = pickle.loads(root)
        except Exception:
            cause = None
        if isinstance(cause, BaseException):
            error.__cause__ = cause
    return error


def _why(exc: BaseException) -> str:
    """Why a world ends early, for the `Aborted` errors of its outstanding calls."""
    if isinstance(exc, BaseExceptionGroup):
        leaves = [e for e in exc.exceptions if not isinstance(e, _cancelled())]
        return _why(leaves[0] if leaves else exc.exceptions[0])
    if isinstance(exc, KeyboardInterrupt):
        return "the program was interrupted (KeyboardInterrupt)"
    if isinstance(exc, _cancelled()):
        return "its world was cancelled"
    if isinstance(exc, ACCLError):
        return f"the world closed after an error: {exc}"
    return f"the world closed after {type(exc).__name__}: {exc}"


def _cancelled() -> tuple[type[BaseException], ...]:
    """The cancellation exceptions of both backends (without importing trio)."""
    kinds: list[type[BaseException]] = [asyncio.CancelledError]
    trio = sys.modules.get("trio")
    if trio is not None:
        kinds.append(trio.Cancelled)
    return tuple(kinds)


async def _gather_results(mine: Any, accl: ACCL, timeout: float) -> list[Any]:
    """Every MPI rank's result, once all have one, however long their own code takes
    (over the MPI fabric; on other devices, up to `timeout`). A rank that died makes
    this fail as soon as the launcher or the fabric says so: never a hang."""
    me, missing = accl.rank, accl._peers_missing()

    def gone() -> str | None:
        # a peer whose world closed early never gathers, and waits (up to the timeout)
        # for our farewells, which we say once we have gathered: do not wait for it
        closed = [f"rank {r} left the world: {why}" for r, why in
                  sorted(accl._peers_gone().items()) if why.startswith(WORLD_CLOSED)]
        if closed:
            return "; ".join(closed)
        return None if missing is None else missing()

    return await gather_every_rank(
        mine, None if missing else timeout, lambda ended:
        f"rank {me} cannot gather every rank's result: {ended}" if ended
        else f"not every rank finished within {timeout} s of rank {me}", gone)


def _gathered(mine: Any, why_not: Callable[[str | None], str]
              ) -> Generator[Any, None, list[Any]]:
    """Every process's `mine`, in MPI rank order: yields MPI's requests to wait for."""
    import pickle

    import numpy as np
    from mpi4py import MPI

    from ..soft import MPIFabric

    comm = MPI.COMM_WORLD
    dead = MPIFabric.dead()
    if dead:  # never send to a dead process: MPI's network module may crash on it
        raise ACCLError(why_not("; ".join(f"rank {r}: {how}" for r, how in sorted(dead.items()))))
    data = np.frombuffer(pickle.dumps(mine, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
    sizes = np.empty(comm.size, np.int64)
    yield comm.Iallgather(np.array([data.size], np.int64), sizes)
    offsets = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    everything = np.empty(int(sizes.sum()), np.uint8)
    yield comm.Iallgatherv(data, [everything, (sizes, offsets), MPI.BYTE])
    return [pickle.loads(everything[o:o + n].tobytes()) for o, n in zip(offsets, sizes)]


def _done(request: Any, deadline: float, why_not: Callable[[str | None], str],
          missing: Callable[[], str | None] | None) -> bool:
    """False while `request` may still finish; True once it has; ACCLError once a
    process of the job ended (the launcher said so, or `missing` does) or `deadline`
    passed, after one last look (what a peer sent before it ended may have come)."""
    if request.Test():
        return True
    from ..soft import MPIFabric

    ended = MPIFabric.ended() or (missing() if missing is not None else None)
    if ended is None and time.monotonic() <= deadline:
        return False
    time.sleep(0.05)
    if request.Test():
        return True
    raise ACCLError(why_not(ended))


def gather_from_every_rank(mine: Any, timeout: float | None,
                           why_not: Callable[[str | None], str],
                           missing: Callable[[], str | None] | None = None) -> list[Any]:
    """Every process's `mine` (any picklable value), in MPI rank order, once every
    process of the job has called this. If the launcher says a process ended first,
    or `missing()` gives why a peer never will (an MPI fabric's `missing`), or one
    does not come within `timeout` (None: no limit), raise ACCLError(why_not(the
    reason, or None for the timeout)): never a hang."""
    deadline = math.inf if timeout is None else time.monotonic() + timeout
    steps = _gathered(mine, why_not)
    try:
        request = next(steps)
        while True:  # nonblocking all along: a peer may be gone
            while not _done(request, deadline, why_not, missing):
                time.sleep(0.001)
            request = steps.send(None)
    except StopIteration as end:
        return end.value


async def gather_every_rank(mine: Any, timeout: float | None,
                            why_not: Callable[[str | None], str],
                            missing: Callable[[], str | None] | None = None) -> list[Any]:
    """`gather_from_every_rank` on the event loop: the task may be cancelled (Ctrl-C)
    while it waits for peers still running their own code."""
    deadline = math.inf if timeout is None else time.monotonic() + timeout
    steps = _gathered(mine, why_not)
    try:
        request = next(steps)
        while True:
            while not _done(request, deadline, why_not, missing):
                await anyio.sleep(0.002)
            request = steps.send(None)
    except StopIteration as end:
        return end.value
