"""The world's collectives over MPI, run by MPI's own collectives.

MPI matches collectives by their order on a communicator, so whatever becomes of
their calls, every rank must start the same MPI collectives in the same order. The
lane takes the world communicator's collectives in submission order (the same on
every rank of a program whose ranks call the same collectives) and starts a call's
opening exchange (`_blocks`: fingerprints, maybe the data) only once the call
before it has started all its MPI collectives: the opening must be over before
anyone knows whether a transfer follows.

A call still waiting for its dependencies holds back no later call that is ready
(in process, such a call overtakes it: a program may need it to). When the lane's
head is not ready but a call behind it is, the head takes its turn at once with a
*pending* block (its fingerprint, no data): every rank sees it in the opening, so
every rank then runs that collective with the soft CCLO's schedules, over messages
(which match by the collective's number, in any order), and MPI sees the same
collectives in the same order on every rank all the same.

A call that never runs still takes its turn, with a block that says why, so its
peers' calls fail at once with that reason. An MPI collective cannot be withdrawn:
a call that ends while MPI works on it (its timeout, a cancelled world) leaves it
to finish in the background, its buffers kept alive. Until such an opening ends
(a late peer comes), the calls queued behind it fail at once, each still taking its
turn later; if it never ends, neither does the lane, and nothing waits on it.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from ..._constants import ErrorCode, ReduceFunction, Scenario
from ..._errors import Aborted
from .._engine import Alarm, Engine, Wait
from .._failure import CallFailed
from . import _blocks as blocks
from ._blocks import BLOCK, HEAD, PENDING, agree, encode
from ._inbox import mismatch
from ._message import Collective, Fingerprint

if TYPE_CHECKING:
    from .._datapath import Datapath
    from .._calls._collective import CollectiveCall
    from .._calls._schedule import ScheduleCall

log = logging.getLogger("aaccl")

RECEIVE_TIMEOUT = int(ErrorCode.RECEIVE_TIMEOUT_ERROR)
MISMATCH = int(ErrorCode.DMA_MISMATCH_ERROR)
_TYPED = frozenset({"<f4", "<f8", "<i4", "<i8"})
_REDUCING = frozenset({Scenario.REDUCE, Scenario.ALLREDUCE, Scenario.REDUCE_SCATTER})

Post = Callable[..., None]

SHAPES_KEPT = 4096
"""Distinct fingerprints whose shapes a lane keeps (`Lane.shapes`)."""

OPENING_SPIN = 0.002
"""Seconds after an opening starts during which whoever polls does so without a nap:
the peers are usually close behind (the round trip of MPI's allgather)."""

RENEW_EVERY = 1 << 20
"""Openings after which the lane makes its persistent opening afresh (`Lane._renew`).
MPICH gives a persistent collective one tag for good, when it is made, and every
nonblocking one the next of a counter that wraps at MPI_TAG_UB (2**29 - 1 here)
without looking at persistent ones: after that many transfers the counter would reach
the opening's tag again while both may be in flight, and their messages would cross.
A lane's collective takes at most two tags (an Iallgather, a transfer)."""


def runs_natively(fp: Fingerprint) -> bool:
    """Whether an MPI collective can move this collective's data (after the opening):
    no compression on the wire, and for reductions a type and function MPI has."""
    scenario, _, dtype, wire, _, function, _ = fp
    if dtype != wire or scenario == Scenario.BARRIER:
        return False
    if scenario in _REDUCING:
        return dtype in _TYPED and function in (ReduceFunction.SUM, ReduceFunction.MAX)
    return True


class Turn(Wait):
    """A call waits for its turn in the lane: for this rank's earlier collectives,
    which is no peer's fault, so there is no deadline (set with a CallFailed if the
    call before it was given up while MPI still matched it)."""

    __slots__ = ()

    def expire(self) -> bool:
        return True  # the call takes its turn all the same, as a withdrawn one


class Matched(Wait):
    """An MPI collective in flight (made with RECEIVE_TIMEOUT); ending the call leaves
    it to finish alone."""

    __slots__ = ()

    def expire(self) -> bool:
        return True


def keep_to_exit(holder: object) -> None:
    """Keep `holder` (a closed world's lane or fabric, whose transfers MPI may not
    have finished) and all it holds that MPI may still write into (a transfer's
    operand and result, the openings' buffers, a payload's receive), to the very end
    of the process: a reference nothing drops. A
    module's list would not do: mpi4py finalizes MPI after the interpreter has torn
    its modules down and freed their objects (Py_AtExit), and MPI_Finalize still
    delivers what a peer sends to a collective left unfinished (a Ctrl-C under
    `aaccl launch`: a peer's 4 KiB of an allreduce that a departed rank's leaving
    ended here, written into freed device memory, "malloc(): unsorted double linked
    list corrupted")."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(holder))


SETTLED, BROKEN = ("settled",), ("broken",)
"""What the opening of a parked call ends with when its blocks agree (`Lane._opened`):
its result is in place, or settling it failed (a bug: logged)."""

TAKEN = Turn()
TAKEN.set(None)
"""The turn of a call whose opening started before it waited for its turn (in its own
`start`, most often): one done wait for all of them, nothing to tell."""


class _Failed:
    """An opening's request that MPI failed when first tested (`Op.start`): its
    test raises that error, as MPI's did."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error

    def Test(self) -> bool:  # noqa: N802  (MPI's name)
        raise self.error


class Lane:
    """The world communicator's collectives of one process, in MPI's order."""

    def __init__(self, comm: Any, engine: Engine, ended: Sequence[str] = ()) -> None:
        """`ended`: why a process of the job has ended, once one has (its first
        item; a list that whoever learns it fills): the world's collectives can never
        complete then, and nothing more is started in MPI (which may crash sending to
        a dead process)."""
        self.comm, self.size, self._post, self._ended = comm, comm.Get_size(), engine.post, ended
        self._lock = threading.Lock()
        self._queue: deque[Op] = deque()  # admitted, opening not started yet
        self._opening: tuple[Any, Op] | None = None  # in flight: holds the lane back
        self._moving: list[tuple[Any, Op]] = []  # transfers in flight
        self._admitted = 0
        self._stalled: int | None = None  # the first op that a peer's leaving left in flight
        self._ready = 0  # queued calls whose block is set (they wait for their turn only)
        self._spin_until = 0.0
        self.stuck = ""  # why calls behind the opening in flight fail now, if they do
        self._dead_from: int | None = None  # a peer left: no collective from here on runs
        self._dead_why: Aborted | None = None
        self._graveyard: list[tuple[Any, Op]] = []  # MPI holds them (and their buffers)
        # One opening is in flight at a time, so every opening goes through the same two
        # buffers: by one persistent MPI request where MPI has them (MPI 4), whose start
        # costs half an Iallgather's. `_sent`: the fingerprint whose running block's
        # header `_send` holds (a call like the one before it writes its data only).
        self._send = bytearray(BLOCK)
        self._gathered = bytearray(self.size * BLOCK)
        self._heads = blocks.headers(self._gathered, self.size)  # (`agree`'s)
        self._data = memoryview(self._send)[HEAD:]  # (where a running block's data goes)
        self._sent: Fingerprint | None = None
        self._request: Any = None
        self._renew_at = RENEW_EVERY  # the index of the op whose opening renews it
        try:
            self._request = comm.Allgather_init(self._send, self._gathered)
        except (AttributeError, NotImplementedError):  # (mpi4py < 4, or MPI < 4)
            pass
        # by fingerprint, for a collective whose data rides in the opening: how many
        # elements this rank puts in its block, and how far the call reaches into its
        # operand and result (False: the data does not ride in it); see Op.start
        self.shapes: dict[Fingerprint, Shape | bool] = {}
        # engine context: the calls parked on their openings (Op.start), with
        # their deadlines, under one engine timer: a call costs no timer of its own
        self.alarm = Alarm(engine, self._expire)

    # -- engine context -------------------------------------------------------------

    def admit(self, fp: Fingerprint | None = None) -> Op:
        """A collective was submitted: its place, in submission order. (No lock: only
        engine context admits, and a poller's `_pump` never starts the queue's last
        op before its call starts it: it is not ready, nor is one behind it.)"""
        op = Op(self._admitted, fp, self)
        self._admitted += 1
        self._queue.append(op)
        return op

    @property
    def finished(self) -> int:
        """How many of the lane's collectives MPI is done with, from the first on: a
        rank that leaves its world tells its peers, whose calls of the later ones
        then fail at once (it takes no part in them), while MPI completes the others.
        (Those not finished are queued, in flight, or stalled: see `left`.)"""
        with self._lock:
            first = [op.index for _, op in self._moving]
            if self._opening is not None:
                first.append(self._opening[1].index)
            if self._queue:
                first.append(self._queue[0].index)
            if self._stalled is not None:
                first.append(self._stalled)
            return min(first, default=self._admitted)

    def withdraw(self, op: Op, block: np.ndarray | bytearray) -> None:
        """The call will not run (or gave up before its turn): it takes its turn with
        `block`, which says why; a call whose opening is in flight is left to it."""
        self.start(op, block, None, withdrawn=True)

    def start(self, op: Op, block: np.ndarray | bytearray, transfer: Callable[[], Any] | None,
              withdrawn: bool = False) -> None:
        """The call runs: its block is ready, and so is its data's transfer (if the
        opening agrees on one). In engine context, from the call itself: if its
        opening starts right away, its turn is over before it waits for it (`op.turn`
        is done: no event for that). (`withdrawn`: see `withdraw`.)"""
        events: list[tuple[Post, tuple[Any, ...]]] = []
        with self._lock:
            if not op.issued:  # (else MPI has its opening, and its turn is over)
                if op.block is None:
                    self._ready += 1
                op.block, op.transfer = block, transfer
                if self.stuck:  # has the late peer come meanwhile?
                    self._test(events)
                if self.stuck and not withdrawn:
                    self._turn(op, self.stuck, events)
                self._pump(events)
                if not op.issued and op.turn is None and not withdrawn:
                    op.turn = Turn()  # its call waits for it: set by an event
        if events:
            self._emit(events)

    def _open(self, index: int) -> Any:
        """Start the opening of op `index`, whose block `_send` holds (with the lock):
        its request."""
        request = self._request
        if request is None:
            return self.comm.Iallgather(self._send, self._gathered)
        if index >= self._renew_at:
            request = self._renew(index)
        request.Start()
        return request

    def _renew(self, index: int) -> Any:
        """Make the persistent opening afresh (RENEW_EVERY), at op `index`'s opening,
        the same on every rank (MPI matches persistent collectives' making in order
        too); the old one is inactive (no opening is in flight), so it is freed."""
        old = self._request
        self._request = request = self.comm.Allgather_init(self._send, self._gathered)
        self._renew_at = index + RENEW_EVERY
        old.Free()
        return request

    def close(self, free: bool) -> None:
        """The world closes (on any thread): start nothing in MPI from now on (a call
        that comes late fails at its turn), and free the lane's MPI objects if `free`
        and nothing is in flight (`idle`). Else the lane is kept to the process's end:
        MPI may still write into its buffers, and freeing an active request would not
        stop it."""
        with self._lock:
            self._dead_from, self._dead_why = self._admitted, Aborted("the world is closed")
            request, opening = self._request, self._opening
            if request is not None and (opening is None or opening[0] is not request) \
                    and all(r is not request for r, _ in self._graveyard):
                request.Free()  # (inactive: freed before MPI_Finalize, as MPI asks)
                self._request = None  # (freed once: `close` may come twice, see _at_exit)
            if not (free and self.idle):
                keep_to_exit(self)
                return
        self.comm.Free()

    @staticmethod
    def _expire(overdue: list[Op]) -> None:
        """Calls parked past their deadlines (engine context) expire, every call's
        words first, as they are at the deadline."""
        expiring = [(op.call, op.call.timeout_detail(op.call.waiting))
                    for op in overdue if op.call is not None and op.call.waiting is not None]
        for call, detail in expiring:
            call.expire(detail)

    # -- any thread -----------------------------------------------------------------

    def poll(self, before: Callable[[], object] | None = None) -> bool | None:
        """Test what is in flight; True if anything ended, None if nothing was in
        flight (no MPI request tested). `before` runs before what ended is told to
        the engine (see MPIFabric.poll). (A vain test of an opening, the most
        frequent, calls no Python function.)"""
        if self._moving:
            events: list[tuple[Post, tuple[Any, ...]]] = []
            with self._lock:
                came = self._test(events)
        else:
            if self._opening is None:
                return None
            lock = self._lock
            lock.acquire()  # (not `with`, whose __exit__ is one call more on every poll)
            try:
                opening = self._opening
                if opening is None:
                    return None
                try:
                    done: bool | Exception = opening[0].Test()
                except Exception as error:
                    done = error
                if done is False:
                    return False
                events = []
                if done is True:  # (`_test`, inline: every collective's end)
                    self._opened(opening[1], events)
                    if self._queue:
                        self._pump(events)
                    came = True
                else:
                    came = self._test(events, done)
            finally:
                lock.release()
        if events:
            if before is not None:
                before()
            post = self._post
            for fn, args in events:
                post(fn, *args)
        return came

    @property
    def busy(self) -> bool:
        """MPI moves a collective's data (only while polled), or has just started an
        opening: whoever polls should not nap. (Past OPENING_SPIN, an opening waits
        for peers who may be far behind: polling on would take a core from them.)"""
        return bool(self._moving) or (self._opening is not None
                                      and time.monotonic() < self._spin_until)

    @property
    def idle(self) -> bool:
        """Nothing queued or in flight: the communicator may be freed."""
        return (not self._queue and self._opening is None and not self._moving
                and not self._graveyard)

    def left(self, index: int, why: Aborted) -> None:
        """A peer left the world once MPI had finished the lane's first `index`
        collectives there: the later ones can never complete. Those in flight fail
        now (MPI keeps them, never to finish), and every later call fails as soon as
        its turn comes, with `why`, with nothing started in MPI."""
        events: list[tuple[Post, tuple[Any, ...]]] = []
        with self._lock:
            if self._dead_from is None or index < self._dead_from:
                self._dead_from, self._dead_why = index, why
            hopeless = [(r, op) for r, op in self._moving if op.index >= index]
            if hopeless:
                self._moving = [(r, op) for r, op in self._moving if op.index < index]
                events += [(op.moved.set, (why,)) for _, op in hopeless
                           if op.moved is not None]
            if self._opening is not None and self._opening[1].index >= index:
                hopeless.append(self._opening)
                events.append((self._opening[1].set, (why,)))
                self._opening, self.stuck = None, ""
            if hopeless:  # (MPI keeps them, never to finish: nor do they here)
                self._graveyard += hopeless
                stalled = min(op.index for _, op in hopeless)
                if self._stalled is None or stalled < self._stalled:
                    self._stalled = stalled
            self._pump(events)
        self._emit(events)

    # -- with the lock ----------------------------------------------------------------

    def _emit(self, events: list[tuple[Post, tuple[Any, ...]]]) -> None:
        for fn, args in events:
            self._post(fn, *args)

    @staticmethod
    def _turn(op: Op, why: Any, events: list[tuple[Post, tuple[Any, ...]]]) -> None:
        """Tell `op`'s call its turn is over (`why` it fails, if it does): an event if
        the call waits for it, else its turn is set done here (nobody waits on it)."""
        turn = op.turn
        if turn is not None:
            events.append((turn.set, (why,)))
        elif why is None:
            op.turn = TAKEN
        else:
            op.turn = turn = Turn()
            turn.set(why)

    @staticmethod
    def _cannot(gone: str) -> Aborted:
        return Aborted(f"{gone}: the world's collectives cannot complete any more")

    def _pump(self, events: list[tuple[Post, tuple[Any, ...]]]) -> None:
        """Start openings, in order, while the head's block is ready, or the head is
        pending (not ready, its fingerprint known) and a call behind it is ready."""
        while self._opening is None and self._queue:
            op = self._queue[0]
            if op.block is not None:
                self._ready -= 1
            elif self._ready and op.fp is not None:
                op.block = np.empty(BLOCK, np.uint8)
                encode(op.block, op.fp, state=PENDING)
            else:
                break
            self._queue.popleft()
            op.issued = True
            if self._dead_from is not None and op.index >= self._dead_from:
                self._turn(op, self._dead_why, events)  # no peer would match it
                self._finish(op)
                continue
            gone = self._ended[0] if self._ended else None
            if gone is not None:
                self._turn(op, None, events)
                events.append((op.set, (self._cannot(gone),)))
                self._finish(op)
                continue
            # (BLOCK bytes: `_send` keeps its size; an ndarray is a buffer, see _blocks)
            self._send[:] = memoryview(op.block)  # type: ignore[arg-type]
            self._sent = None
            try:
                request = self._open(op.index)
            except Exception as error:  # MPI failed (a peer died)
                self._turn(op, None, events)
                events.append((op.set, (str(error),)))
                self._finish(op)
                continue
            self._opening = (request, op)
            self._spin_until = time.monotonic() + OPENING_SPIN
            if op.turn is None:  # (`_turn`, inline: in its call's `start`, most often)
                op.turn = TAKEN
            else:
                events.append((op.turn.set, (None,)))

    def _test(self, events: list[tuple[Post, tuple[Any, ...]]],
              tested: bool | Exception | None = None) -> bool:
        """Test what is in flight (with the lock); `tested`: what a test of the
        opening in flight (if any) returned or raised just now (`poll`)."""
        came = False
        if self._moving:
            still = []
            for request, op in self._moving:
                assert op.moved is not None
                try:
                    done = request.Test()
                except Exception as error:
                    events.append((op.moved.set, (str(error),)))
                    self._hold(request, op)
                    self._finish(op, held=True)
                    continue
                if done:
                    events.append((op.moved.set, (None,)))
                    self._finish(op)
                    came = True
                else:
                    still.append((request, op))
            self._moving = still
        if self._opening is not None:
            request, op = self._opening
            try:
                if isinstance(tested, Exception):
                    raise tested
                done = tested or request.Test()
            except Exception as error:
                self._opening, self.stuck = None, ""
                events.append((op.set, (str(error),)))
                self._hold(request, op)
                self._finish(op)
                self._pump(events)
                return True
            if done:
                self._opened(op, events)
                if self._queue:
                    self._pump(events)
                came = True
        return came

    def _opened(self, op: Op, events: list[tuple[Post, tuple[Any, ...]]]) -> None:
        """An opening ended: start its transfer if every block agrees on one. The
        blocks are read here (the next opening reuses the buffer): a parked call
        whose blocks agree settles from them now (its data rode in them: no transfer,
        nothing to finish; `Op.set` ends it), anyone else is given a copy."""
        self._opening, self.stuck = None, ""
        gathered = self._gathered
        agreed = agree(self._heads)
        call = op.call
        if agreed and call is not None:  # settle: the parked call's result, from the blocks
            op0, res, _, fold = op.ours  # type: ignore[misc]
            try:
                if fold is not None:  # an allreduce (`blocks.settle`'s, inline)
                    first, second, rest, ufunc = fold
                    if ufunc is None:  # (one float each: `fold_one`'s, inline: a call
                        # less per rank, which tests/mpi/budget.py counts)
                        one = first[0] + second[0]
                        for row in rest:
                            one = one + row[0]
                        res[0] = one  # type: ignore[index]  # (a fold has a result)
                    else:
                        ufunc(first, second, res)  # (`out` by position: half the cost)
                        for row in rest:
                            ufunc(res, row, res)
                else:
                    assert call.comm is not None and call.path is not None
                    blocks.settle(call.fp, call.comm.rank, gathered,  # type: ignore[arg-type]
                                  op0, res, call.path.combine)
                settled = SETTLED
            except Exception:  # a bug in the model fails this call, and nothing else
                log.exception("soft CCLO: internal error settling a collective")
                settled = BROKEN
            events.append((op.set, (settled,)))
            return
        moving = False
        gone = self._ended[0] if self._ended and agreed and op.transfer is not None else None
        if gone is not None:
            moving = True
            op.moved = Matched(RECEIVE_TIMEOUT)
            events.append((op.moved.set, (self._cannot(gone),)))
            self._finish(op)
        elif agreed and op.transfer is not None:
            moving = True
            op.moved = moved = Matched(RECEIVE_TIMEOUT)
            try:  # (the op keeps `transfer`, which holds the buffers, until MPI is done)
                self._moving.append((op.transfer(), op))
            except Exception as error:  # (a peer died)
                events.append((moved.set, (str(error),)))
                self._finish(op)
        if not moving:
            self._finish(op)
        events.append((op.set, ((bytearray(gathered), agreed, moving),)))

    @staticmethod
    def _finish(op: Op, held: bool = False) -> None:
        """MPI is done with all of `op` (or keeps it: `held`): what it held goes with
        its call (the lane holds it no more)."""
        op.block = None
        if not held:  # (else `_hold` keeps its transfer's buffers)
            op.transfer = None

    def _hold(self, request: Any, op: Op) -> None:
        """MPI failed a test of `request` (a peer died, most often), which need not
        have ended it: what it may still write into is kept to the process's end, with
        the lane (`idle` is False from now on), and the persistent opening is never
        started again (a later opening is an Iallgather)."""
        if not isinstance(request, _Failed):
            self._graveyard.append((request, op))
        if request is self._request:
            self._request = None

    def abandoned(self, op: Op, why: str) -> None:
        """The call ended while its opening is in flight: the calls queued behind it
        fail at once (`why`), until a late peer completes the opening."""
        events: list[tuple[Post, tuple[Any, ...]]] = []
        with self._lock:
            if self._opening is not None and self._opening[1] is op:
                self.stuck = why
                for queued in self._queue:
                    if queued.block is not None:
                        self._turn(queued, why, events)
        self._emit(events)



def transfer(comm: Any, fp: Fingerprint, rank: int, op0: np.ndarray | None,
             res: np.ndarray | None) -> Callable[[], Any]:
    """What starts the MPI collective that moves a call's data (`runs_natively`):
    `op0` and `res` are the call's operand and result in device memory, as far as
    the call reaches into them. An operand that overlaps the result (in place) is
    copied first: MPI forbids aliased buffers."""
    from mpi4py import MPI

    scenario, count, _, _, root, function, size = fp
    assert count is not None
    n = size * count if scenario in (Scenario.SCATTER, Scenario.ALLTOALL,
                                     Scenario.REDUCE_SCATTER) else count
    send = None if op0 is None else op0[:n]
    recv = res
    if send is not None and recv is not None and np.may_share_memory(send, recv):
        send = send.copy()
    if scenario in _REDUCING:
        op = MPI.SUM if function == ReduceFunction.SUM else MPI.MAX
        if scenario == Scenario.ALLREDUCE:
            return lambda: comm.Iallreduce(send, recv, op)
        if scenario == Scenario.REDUCE:
            return lambda: comm.Ireduce(send, recv if rank == root else None, op, root)
        return lambda: comm.Ireduce_scatter_block(send, recv, op)

    def raw(array: np.ndarray | None) -> Any:  # moved as bytes, whatever the dtype
        return None if array is None else array.reshape(-1).view(np.uint8)

    if scenario == Scenario.BCAST:
        return lambda: comm.Ibcast(raw(op0[:count] if op0 is not None else None), root)
    if scenario == Scenario.SCATTER:
        return lambda: comm.Iscatter(raw(send) if rank == root else None, raw(recv), root)
    if scenario == Scenario.GATHER:
        return lambda: comm.Igather(raw(send), raw(recv) if rank == root else None, root)
    if scenario == Scenario.ALLGATHER:
        return lambda: comm.Iallgather(raw(send), raw(recv))
    if scenario == Scenario.ALLTOALL:
        return lambda: comm.Ialltoall(raw(send), raw(recv))
    raise ValueError(f"no MPI collective for {Scenario(scenario).name}")


def _operands(call: ScheduleCall) -> tuple[Datapath, np.ndarray | None, np.ndarray | None]:
    """A call's datapath, and its operand and result in device memory as far as its
    schedule reaches into them (None where it has none)."""
    args, dev = call.args, call.dev
    path = call.path if call.path is not None else dev.datapath(args)
    reach = call.reach()
    op0 = dev.array(args.addr_0, path.dtype, reach[0]) if reach[0] else None
    res = dev.array(args.addr_2, path.dtype, reach[2]) if reach[2] else None
    return path, op0, res


Fold = tuple[np.ndarray, np.ndarray, tuple[np.ndarray, ...], Callable[..., Any] | None]
"""How an allreduce whose data rides in the opening settles (`_shape`): every rank's
row of the lane's gathered blocks (views made once: ranks 0 and 1, then the rest),
folded with a ufunc in rank order (None: one float each, summed as numpy's scalars,
`fold_one`)."""
Shape = tuple[int, int, int, Fold | None]
Views = tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None, Fold | None]
"""A call's operand and result, the part of its operand its block carries (a view of
its bytes), and its fold (`Op._views`)."""


def _shape(lane: Lane, call: ScheduleCall, fp: Fingerprint) -> Shape | bool:
    """For `Lane.shapes`: (elements this rank puts in its block, reach into the
    operand, reach into the result, and for an allreduce that the datapath adds in
    its own type the fold that settles it) if the call's data rides in its opening."""
    if not blocks.fits(fp):
        return False
    comm, path = call.comm, call.path
    assert comm is not None
    reach = call.reach()
    fold: Fold | None = None
    scenario, count, dtype, _, _, _, size = fp
    if scenario == Scenario.ALLREDUCE and count and reach[2] == count and path is not None \
            and path.dtype == path.arith == np.dtype(dtype):  # (`Datapath.combine`'s case)
        rows = np.ndarray((size, count), path.arith, lane._gathered, blocks.HEAD,
                          (BLOCK, path.arith.itemsize))
        fold = (rows[0], rows[1], tuple(rows[2:]),
                None if path.sums_floats and count == 1 else path.ufunc)
    return blocks.share(fp, comm.rank) if reach[0] else 0, reach[0], reach[2], fold


class Op(Matched, Collective):
    """One collective call's place in the lane, which is also how its call takes
    part in the collective (`MPIPort.collective`) and the wait for its opening
    exchange (done with what the opening brought, set by an event): its turn in the
    lane, the opening, then (if the data did not ride in it) MPI's collective moves
    the data. A call that ends before its turn is over still takes it, with a block
    that says why. (`Lane.admit` makes one with no call: a collective the host
    rejected, `MPIPort.skip`.)

    A call whose data rides in the opening and whose opening starts at once (the
    lane holds nothing back: the common small collective) runs with no body
    (`start`): it parks on its opening, whose end settles the data (`Lane._opened`,
    on the thread that saw it end) and ends the call (`set`); anything else that ending
    brings (a verdict, a pending peer, a failure) is left to the body after all.

    Its other waits are made as they are needed: `turn` once its call waits for it
    (while it is None, nobody waits: the lane sets it done itself, TAKEN or with
    why), and `moved` once MPI moves the data in a collective of its own."""

    __slots__ = ("lane", "index", "fp", "block", "transfer", "turn", "moved", "issued", "left",
                 "call", "ours")

    lane: Lane
    index: int  # its place in the lane: the same on every rank
    fp: Fingerprint | None  # its call's, for a pending block (None: it takes its turn when it runs)
    block: np.ndarray | bytearray | None  # set when the call starts or is withdrawn
    # starts the data's MPI collective, and holds its operand and result until MPI is
    # done with them (`Lane._finish`): mpi4py's request does not keep them alive (not
    # for Iallreduce), and a freed buffer MPI still writes into corrupts the heap (the
    # world's device memory, freed as it closes on Ctrl-C, under a transfer that a
    # departed peer left unfinished)
    transfer: Callable[[], Any] | None
    turn: Wait | None
    moved: Wait | None
    issued: bool  # its opening has started
    left: bool  # its call gave its place up (`leave`), or never had one to give
    call: ScheduleCall | None  # parked on the opening, with no body (`start`): settled at its end
    ours: Views | None  # ... and its operand, result and fold (`_views`)

    def __init__(self, index: int, fp: Fingerprint | None, lane: Lane | None = None) -> None:
        self.done, self.value, self.waiter, self.timeout_code = False, None, None, RECEIVE_TIMEOUT
        # (`lane` None: an op in no lane, a test's)
        self.index, self.fp, self.lane = index, fp, lane  # type: ignore[assignment]
        self.block = self.transfer = self.turn = self.moved = self.call = self.ours = None
        self.issued = self.left = False

    def join(self, call: CollectiveCall) -> tuple[int, str] | None:
        lane = self.lane  # (`Lane.admit`, inline: on every collective's path)
        self.index, self.fp = lane._admitted, call.fp  # (its fingerprint: see Lane._pump)
        lane._admitted += 1
        lane._queue.append(self)
        return None

    def reject(self, call: CollectiveCall, failed: CallFailed) -> None:
        self.join(call)
        self.leave(call, failed.code, failed.detail)

    def start(self, call: ScheduleCall) -> bool:
        """Run a collective whose data rides in the opening with no body, when its
        opening starts at once (`Lane.start`'s case where the lane's only queued op
        is ours and nothing holds it back: the opening starts here, our turn is over,
        TAKEN): True once it is parked on it; False for the body."""
        fp, lane, dev, args = call.fp, self.lane, call.dev, call.args
        if fp is None or self.left or dev.gone:  # (a peer left: the body's)
            return False
        key = (fp, args.addr_0, args.addr_2)  # (a fingerprint first: no key of `array`'s)
        ours: Views | Literal[False] | None = dev.views.get(key)
        if ours is None:
            ours = self._views(call, fp, key)
        if ours is False:
            return False
        mine = ours[2]
        now = time.monotonic()  # (the opening's spin and the call's deadline count from it)
        lock = lane._lock
        lock.acquire()  # (as in `Lane.poll`: every small collective's)
        try:
            queue = lane._queue  # (nothing is `stuck` unless an opening is in flight)
            if lane._opening is not None or len(queue) != 1 or queue[0] is not self \
                    or lane._dead_from is not None or lane._ended:
                request = None
            else:
                if fp is not lane._sent:  # (the fingerprints of like calls are one object)
                    lane._send[:] = blocks.TEMPLATES.get(fp) or blocks.template(fp)
                    lane._sent = fp
                if mine is not None:  # (its bytes, from device memory: no copy between)
                    lane._data[:len(mine)] = mine  # type: ignore[call-overload]
                try:
                    request = lane._open(self.index)
                except Exception:  # MPI failed (a peer died): as `_pump` says
                    request = None
            if request is not None:
                try:  # (MPI moves data only when called: our block leaves now, not at
                    request.Test()  # our first poll, so a peer's first poll can end it)
                except Exception as error:  # (a persistent request tests True after it)
                    lane._hold(request, self)
                    request = _Failed(error)
                queue.popleft()
                # (under the lock: once it goes, the opening may end and settle on another thread)
                self.issued, self.turn, self.call, self.ours = True, TAKEN, call, ours
                lane._opening = (request, self)
                lane._spin_until = now + OPENING_SPIN
        finally:
            lock.release()
        if request is None:  # it waits for its turn: the body's
            lane.start(self, blocks.opening(fp, None if mine is None else mine.tobytes()), None)
            return False
        call.waiting = self
        alarm = lane.alarm  # (`Alarm.park`, inline: on every small collective's path)
        alarm.parked[self] = deadline = now + dev.timeout
        if deadline < alarm.at:
            alarm.set(dev.timeout, deadline)
        return True

    def _views(self, call: ScheduleCall, fp: Fingerprint,
               key: tuple[Any, ...]) -> Views | Literal[False]:
        """For `start`, kept in the CCLO's views under `key` until memory is freed (a
        loop of small calls on the same buffers makes them once): the call's operand
        and result in device memory as far as it reaches into them, the part of the
        operand its block carries (a view of its bytes), and its fold (`_shape`); False
        if its data does not ride in the opening."""
        lane, dev, args, path = self.lane, call.dev, call.args, call.path
        shape = lane.shapes.get(fp)
        if shape is None:
            if len(lane.shapes) >= SHAPES_KEPT:
                lane.shapes.clear()
            shape = lane.shapes[fp] = _shape(lane, call, fp)
        ours: Views | Literal[False] = False
        if shape is not False:
            assert path is not None  # (decoded at admission)
            mine, reach0, reach2, fold = shape  # type: ignore[misc]
            op0 = dev.array(args.addr_0, path.dtype, reach0) if reach0 else None
            res = dev.array(args.addr_2, path.dtype, reach2) if reach2 else None
            ours = (op0, res, None if not mine or op0 is None else op0[:mine].view(np.uint8), fold)
        dev.views[key] = ours
        return ours

    def _begin(self, call: ScheduleCall, op0: np.ndarray | None, res: np.ndarray | None,
               inline: bool) -> None:
        """Put our block in the lane, and our data's transfer if MPI moves it."""
        fp, comm = call.fp, call.comm
        assert fp is not None and comm is not None
        mine = blocks.share(fp, comm.rank) if inline and op0 is not None else 0
        block = blocks.opening(fp, op0[:mine].tobytes() if mine and op0 is not None else None)
        moves = None
        if not inline and runs_natively(fp):
            moves = transfer(self.lane.comm, fp, comm.rank, op0, res)
        self.lane.start(self, block, moves)

    def set(self, value: Any = None) -> None:
        """The opening ended (an event): as any wait's end (`Wait.set`), but for a call
        parked on it with no body, which ends here (SETTLED: its result is in place),
        or whose body takes over (anything else: a verdict, a pending peer, a failure)."""
        call = self.call
        if call is None:
            Wait.set(self, value)
            return
        self.done, self.value, self.call, self.ours = True, value, None, None
        call.waiting = None
        del self.lane.alarm.parked[self]
        if value is SETTLED:
            call.finish(0)
        elif value is BROKEN:
            call.abandon()
            call.finish(int(ErrorCode.DMA_INTERNAL_ERROR))
        else:
            call.body = call.run()
            call.resume(None)

    def expire(self) -> bool:
        """An MPI collective cannot be withdrawn: the call ends, its opening goes on
        (`ended`, for a call parked on it)."""
        if self.call is not None:
            self.ended()
        return True

    def ended(self) -> None:
        """Our call with no body ends while its opening is in flight (its deadline, an
        abort, a peer's failure): as the body does when that wait fails. Nothing
        settles it from now on (it may own its memory no longer)."""
        lane = self.lane
        with lane._lock:
            call, self.call, self.ours = self.call, None, None
        if call is None:
            return
        lane.alarm.parked.pop(self, None)
        if not call.failure and call.aborting is None:  # its deadline: it gave up
            self.leave(call, RECEIVE_TIMEOUT, None, timed_out=True)
        call.abandon()

    def run(self, call: ScheduleCall) -> Generator[Wait, Any, bool]:
        """Take our turn in the lane: the opening exchange, then (if the data did not
        ride in it) MPI's collective moves it. False: MPI cannot, the schedule must."""
        if self.left:
            return False
        try:
            comm, fp = call.comm, call.fp
            assert comm is not None and fp is not None
            path, op0, res = _operands(call)
            inline = blocks.fits(fp)
            if not self.issued and self.block is None:
                # (else it took its turn while pending: the schedule runs it)
                self._begin(call, op0, res, inline)
            try:
                turn = self.turn
                assert turn is not None  # (made when its call waits for it: see Op)
                why = turn.value if turn.done else (yield turn)
                if isinstance(why, Aborted):  # a peer left the world: it never runs
                    raise CallFailed(RECEIVE_TIMEOUT, str(why), error=why)
                if why:
                    raise CallFailed(RECEIVE_TIMEOUT, why)
                opened = self.value if self.done else (yield self)
                if isinstance(opened, Aborted):
                    raise CallFailed(RECEIVE_TIMEOUT, str(opened), error=opened)
            except CallFailed as failed:
                if not call.failure and call.aborting is None and failed.code == RECEIVE_TIMEOUT:
                    self.leave(call, failed.code, failed.detail, timed_out=True)
                raise
            if isinstance(opened, str):
                raise CallFailed(ErrorCode.DMA_INTERNAL_ERROR, f"MPI failed: {opened}")
            gathered, agreed, moving = opened
            if not agreed:  # fails, or some rank's call was pending: the schedule runs it
                self._verdict(call, blocks.read(gathered, comm.size))
                return False
            if inline:
                blocks.settle(fp, comm.rank, gathered, op0, res, path.combine)
                return True
            if not moving:
                return False
            moved = self.moved
            assert moved is not None  # (made when MPI moves the data on its own)
            error = moved.value if moved.done else (yield moved)
            if isinstance(error, Aborted):
                raise CallFailed(RECEIVE_TIMEOUT, str(error), error=error)
            if error:
                raise CallFailed(ErrorCode.DMA_INTERNAL_ERROR, f"MPI failed: {error}")
            return True
        except BaseException:
            call.abandon()
            raise

    @staticmethod
    def _verdict(call: CollectiveCall, exchanged: list[blocks.Block]) -> None:
        """Fail our call as every rank does, from the same blocks (which do not all
        `agree`): a peer's call did not run, or does not match ours. Return if they
        only say that some rank's call was pending (every rank's runs, later)."""
        comm, fp = call.comm, call.fp
        assert comm is not None and fp is not None
        for k, block in enumerate(exchanged):
            if block.state not in (blocks.RUNS, blocks.PENDING) and k != comm.rank:
                call.quiet = True  # the peer told everyone, in its block
                why = block.why
                if block.state == blocks.ABORTED:
                    raise CallFailed(MISMATCH, why, error=Aborted(why))
                raise CallFailed(block.code, why)
        for k, block in enumerate(exchanged):
            if block.fp != fp:
                call.quiet = True  # every rank sees the same mismatch
                raise CallFailed(*mismatch(fp, block.fp, call.dev.session, comm.sessions[k]))
        if any(block.state == blocks.PENDING for block in exchanged):
            return
        raise CallFailed(ErrorCode.DMA_INTERNAL_ERROR, "the opening's blocks disagree, "
                         "yet every rank's call runs, as ours does")

    def leave(self, call: CollectiveCall, code: int, why: str | None,
              timed_out: bool = False) -> None:
        """Our call ends before its turn in the lane is over: it still takes its
        turn, with a block that says why (MPI must see the same collectives on every
        rank); if its opening is in flight and we gave up on the peers, the calls
        queued behind it fail at once."""
        lane, comm = self.lane, call.comm
        if self.left or comm is None:
            return
        self.left = True
        if not self.issued:
            fp = call.fp or (call.args.scenario, call.args.count, "", "", None, None, comm.size)
            block = np.empty(blocks.BLOCK, np.uint8)
            blocks.encode(block, fp, state=blocks.FAILED if code else blocks.ABORTED,
                          code=code, why=call.notice(code, why))
            lane.withdraw(self, block)
        elif timed_out and not self.done:
            lane.abandoned(self, f"it was queued behind rank {call.dev.session}'s "
                               f"{call.describe()}, which gave up on its peers while MPI "
                               "still matched it (it fails until they come)")

    def abandon(self, call: CollectiveCall) -> None:
        if call.aborting is not None:
            self.leave(call, 0, str(call.aborting))
        elif call.failure:
            self.leave(call, call.failure, call.failure_detail)

    def abort(self, call: CollectiveCall, why: str) -> None:
        self.leave(call, 0, why)

    def peers_waited(self, call: CollectiveCall, wait: Wait) -> list[int] | None:
        if not isinstance(wait, Matched) or call.comm is None:
            return None
        # every other member, but one that left after its part of this collective
        index, gone, me = self.index, call.dev.gone_lane, call.dev.session
        return [s for s in call.comm.sessions if s != me and not index < gone.get(s, 0)]

    def waiting_for(self, call: CollectiveCall, wait: Wait) -> str | None:
        if not isinstance(wait, Matched):
            return None
        peers = call.peers_waited(wait)
        who = f"rank{'s' if len(peers) > 1 else ''} {', '.join(map(str, peers))}"
        stage = "allgather that opens" if wait is self else "collective that moves the data of"
        return (f"MPI's {stage} the collective with {who}"
                + (" (MPI does not say which of them is missing)" if len(peers) > 1 else ""))
