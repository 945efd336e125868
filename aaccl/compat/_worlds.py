"""Where a `sim_mode=True` instance's soft CCLO meets its peers.

In a plain process, the instances it makes form worlds among themselves (the
in-process fabric): `accl(n, i, sim_mode=True)` for i in 0..n-1, in any order, make
one world, and making them again makes the next. Under mpiexec with more than one
process, each process is one rank, as pyaccl's programs run (`mpiexec -n N python
prog.py`, each process making `accl(N, rank, ...)`): the instances of a job's
processes form one world over the MPI fabric.

Either way a constructor whose arguments fail its checks takes no place in a
world, and a world that cannot form says why.
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from .._errors import ACCLError
from ..api import ACCL
from ..api._world import gather_from_every_rank, import_mpi, listen_for_lost_processes
from ..soft import InProcessFabric, MPIFabric, SoftDevice
from ..soft.fabric._mpi import watch_exit
from ._checks import Settings

T = TypeVar("T")
log = logging.getLogger("aaccl")

FORM_TIMEOUT = 60.0
"""Seconds an instance under mpiexec waits for every process of the job to make its
own (they may start, or reach their constructor, at different times)."""


class _Instance(Protocol):
    def deinit(self) -> None: ...


class Place(Protocol):
    """An instance's place in its world: what `deinit` gives back."""

    def close(self, accl: ACCL, timeout: float) -> None:
        """Wait for `accl`'s outstanding calls, release its CCLO and the place."""


# -- worlds of this process's instances -------------------------------------------------

class _Forming:
    """The world of `size` ranks this process is making, until every rank is made."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.fabric = InProcessFabric(size)
        self.devices: dict[int, SoftDevice] = {}


_forming: dict[int, _Forming] = {}  # by size: at most one world of each size forms at a time
_lock = threading.Lock()
Notice = tuple[SoftDevice, int, str]


def join(size: int, rank: int, open_rank: Callable[[SoftDevice], T]) -> tuple[T, Place]:
    """Open rank `rank` of the world of `size` ranks being made in this process, with
    `open_rank(device)` (which configures the device, or closes it and raises: then
    the rank takes no place).

    If the forming world has this rank already, the rank starts a new world: the old
    one can never be complete (a stray instance, or a world left half made), so its
    instances' calls that need the missing ranks fail at once, saying so, instead of
    every later world of this size being one rank off."""
    with _lock:
        world = stale = _forming.get(size)
        if world is None or rank in world.devices:
            world = _Forming(size)
        else:
            stale = None
        device = SoftDevice(rank, world.fabric.port(rank))
        opened = open_rank(device)
        world.devices[rank] = device
        if len(world.devices) == size:
            _forming.pop(size, None)
        else:
            _forming[size] = world
        notices = [] if stale is None else _never_complete(
            stale, f"a later accl({size}, {rank}, sim_mode=True) started a new world first")
    _tell(notices)
    return opened, _InProcessPlace(world, rank)


class _InProcessPlace:
    def __init__(self, world: _Forming, rank: int) -> None:
        self.world, self.rank = world, rank

    def close(self, accl: ACCL, timeout: float) -> None:
        accl._close_blocking()
        with _lock:  # a world with a closed rank can never be complete: nobody joins it
            notices: list[Notice] = []
            if _forming.get(self.world.size) is self.world:
                del _forming[self.world.size]
                notices = _never_complete(self.world, f"rank {self.rank} of its world was "
                                                      "closed (deinit) first")
        _tell(notices)


def _never_complete(world: _Forming, why: str) -> list[Notice]:
    """What to tell the open ranks of a world whose missing ranks will never come."""
    missing = [r for r in range(world.size) if r not in world.devices]
    return [(device, r, (f"its accl({world.size}, {r}, sim_mode=True) was never made: {why} "
                         "(each rank of a world is made once, before the next world's)"))
            for device in world.devices.values() if not device.closed for r in missing]


def _tell(notices: list[Notice]) -> None:
    for device, missing, reason in notices:  # as if the missing rank had left its world
        device.peer_left(missing, reason)


# -- one world across the processes of an MPI job -----------------------------------------

def join_mpi(wanted: Settings | Exception, open_rank: Callable[[SoftDevice], T],
             ) -> tuple[T, Place]:
    """Open this process's rank of the MPI job's world, with `open_rank(device)` (as
    for `join`).

    Collective: every process of the job makes its instance, and they compare their
    arguments first. `wanted` is this process's checked arguments, or the error its
    arguments raised: that process raises its own error, the others a ValueError
    naming it, as they do when a process's `nranks` or `local_rank` does not match the
    job or the processes disagree on buffers. A process that does not come within
    FORM_TIMEOUT, or ends, fails the others with an ACCLError. After a failed world
    the job is where it was: the next constructor of every process forms the next."""
    stop_listening = listen_for_lost_processes()
    try:
        comm = import_mpi().COMM_WORLD
        me, size = comm.Get_rank(), comm.Get_size()
        mine = (f"{type(wanted).__name__}: {wanted}" if isinstance(wanted, Exception)
                else (wanted.size, wanted.rank, wanted.nbufs, wanted.bufsize))
        try:
            everyone = _gather(mine, me, "make its accl(...)")
        except ACCLError:
            if isinstance(wanted, Exception):  # its own error says more
                raise wanted from None
            raise
        if isinstance(wanted, Exception):
            raise wanted
        problems = _mismatches(everyone, size)
        if problems:
            raise ValueError(f"the MPI job's world cannot form: {'; '.join(problems)}")
        fabric = MPIFabric(comm, wanted.nbufs, wanted.bufsize)
        try:
            device = SoftDevice(me, fabric.port(me))
            device.missing = fabric.missing  # a peer whose process ended never comes
            failed: BaseException | None = None
            try:
                opened = open_rank(device)
            except Exception as error:  # the others must hear of it, too
                failed = error
            outcomes = _gather(None if failed is None else f"{type(failed).__name__}: {failed}",
                               me, "configure its CCLO")
            if failed is not None:
                raise failed
            bad = [f"process {p}'s CCLO failed to configure: {text}"
                   for p, text in enumerate(outcomes) if text is not None]
            if bad:
                device.close()
                raise ACCLError(f"the MPI job's world cannot form: {'; '.join(bad)}")
        except BaseException:
            fabric.close(FORM_TIMEOUT)  # every process comes here: each saw what failed
            raise
    except BaseException:
        stop_listening()
        raise
    return opened, _MPIPlace(fabric, stop_listening)


def _gather(mine: Any, me: int, what: str) -> list[Any]:
    def why_not(ended: str | None) -> str:
        if ended is not None:
            return f"the MPI job's world cannot form: {ended}"
        return (f"the MPI job's world cannot form: not every process came to {what} within "
                f"{FORM_TIMEOUT:g} s of process {me} (each process of `mpiexec -n N` makes "
                "one accl(N, its rank, sim_mode=True))")

    try:
        return gather_from_every_rank(mine, FORM_TIMEOUT, why_not)
    except ACCLError:
        watch_exit()  # a process is missing: MPI's finalization must not wait for it
        raise


def _mismatches(everyone: list[Any], size: int) -> list[str]:
    """What stops the processes' instances from forming one world: each process's
    (nranks, local_rank, nbufs, bufsize), or the error its arguments raised."""
    problems = [f"process {p}'s arguments were rejected ({card})"
                for p, card in enumerate(everyone) if isinstance(card, str)]
    cards = {p: card for p, card in enumerate(everyone) if not isinstance(card, str)}
    sizes = {p: card[0] for p, card in cards.items() if card[0] != size}
    if sizes:
        problems.append(f"nranks must be {size}, the job's number of processes (under "
                        f"mpiexec each process is one rank), but {_passed(sizes, len(cards))}")
    ranks = {p: card[1] for p, card in cards.items() if card[0] == size and card[1] != p}
    if ranks:
        problems.append("local_rank must be the process's MPI rank, but "
                        f"{_passed(ranks, len(cards))}")
    buffers = {p: f"nbufs={card[2]}, bufsize={card[3]}" for p, card in cards.items()}
    if len(set(buffers.values())) > 1:
        problems.append(f"the processes' rx buffers differ: {_passed(buffers, 0)}")
    return problems


def _passed(values: dict[int, Any], of: int, shown: int = 6) -> str:
    """Which process passed what, in few words."""
    if len(values) == of and len(set(values.values())) == 1:
        return f"every process passed {next(iter(values.values()))}"
    listed = [f"process {p} passed {v}" for p, v in list(values.items())[:shown]]
    more = f" and {len(values) - shown} more" if len(values) > shown else ""
    return ", ".join(listed) + more


class _MPIPlace:
    def __init__(self, fabric: MPIFabric, stop_listening: Callable[[], None]) -> None:
        self.fabric, self.stop_listening = fabric, stop_listening

    def close(self, accl: ACCL, timeout: float) -> None:
        """Like leaving `aaccl.run`'s world: what this rank sent may still be needed, so
        its calls end first; then it tells the others it left (their calls waiting for
        it fail at once), and waits up to `timeout` for every process to close."""
        accl._settle_blocking()
        accl._depart("its accl was closed (deinit)")
        try:
            accl._close_blocking()
        finally:
            self.fabric.close(timeout)
            self.stop_listening()


_to_deinit: list[_Instance] = []  # in the order they were made
_to_deinit_lock = threading.Lock()


def deinit_at_exit(instance: _Instance) -> None:
    """Deinit `instance` when the interpreter exits, unless the program did first
    (`deinitialized`). pyaccl's programs often leave that to the exit, or drop their
    instance: its peers' calls that wait for this rank then fail at once, and the
    job's processes close their world together. Every process deinits its instances
    in the order it made them, as it made them collectively."""
    with _to_deinit_lock:
        if not _to_deinit:
            atexit.register(_deinit_all)
        _to_deinit.append(instance)


def deinitialized(instance: _Instance) -> None:
    with _to_deinit_lock:
        if instance in _to_deinit:
            _to_deinit.remove(instance)


def _deinit_all() -> None:
    atexit.unregister(_deinit_all)
    while _to_deinit:
        with _to_deinit_lock:
            instance = _to_deinit.pop(0)
        try:
            instance.deinit()
        except Exception:  # the others still close
            log.exception("aaccl.compat: deinit at exit failed")
