"""`ACCL`: one rank's handle on its CCLO, with every primitive and collective."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import anyio
import numpy as np

from .. import _trace
from .._constants import (GLOBAL_COMM, SUPPORTED_DTYPES, TAG_ANY, ReduceFunction, Scenario,
                          StreamFlags)
from .._errors import DependencyError
from .._threads import quietly
from ..devices import Device, DeviceCall
from ..devices._call import warn_at
from ..driver import Driver
from . import _bridge
from . import _checks as check
from ._buffer import Buffer, allocate
from ._call import Call, outcome
from ._hazards import Hazards, Span
from ._kernel import Kernel, attach_stream, on_card
from ._tasks import Order, asyncio_task, check_race, current_task

Calls = Iterable[Call]
OP0_STREAM, RES_STREAM = int(StreamFlags.OP0_STREAM), int(StreamFlags.RES_STREAM)
_getframe = sys._getframe
_API_LAYER = True
"""The calls a module with this global makes are its caller's: a never-awaited call
points past its frames, at the user's line (see `_submit`)."""
_COUNT_END = 2**32  # counts below it fit the CCLO's 32-bit register
_NO_REDUCTION = object()  # `_all`'s func for the collectives that reduce nothing
BOTH_STREAMS = OP0_STREAM | RES_STREAM
# every call's scenario, as module globals: looking a member up on its enum costs
# ~90 ns (Python 3.11), a global ~10
_SEND, _RECV, _NOP, _COPY, _COMBINE = (Scenario.SEND, Scenario.RECV, Scenario.NOP,
                                       Scenario.COPY, Scenario.COMBINE)
_BCAST, _SCATTER, _GATHER, _REDUCE, _BARRIER = (Scenario.BCAST, Scenario.SCATTER,
                                                Scenario.GATHER, Scenario.REDUCE,
                                                Scenario.BARRIER)
_ALLGATHER, _ALLREDUCE, _REDUCE_SCATTER, _ALLTOALL = (
    Scenario.ALLGATHER, Scenario.ALLREDUCE, Scenario.REDUCE_SCATTER, Scenario.ALLTOALL)
_weakref = weakref.ref
_ident = threading.get_ident


def _head(buf: Buffer, elements: int) -> Buffer:
    """The first `elements` elements of a (checked, so contiguous) buffer, as a flat
    Buffer: the buffer itself where it is that already, else a view that starts at
    the buffer's device address (looking it up anew costs more than the call's
    sync of a small message)."""
    if elements == buf.size and buf.ndim == 1:
        return buf
    head = cast(Buffer, buf.reshape(-1)[:elements])
    head._address = buf.device_address
    return head


def _spans(*accesses: tuple[Buffer | None, int]) -> tuple[Span, ...]:
    """The device bytes of the first `elements` elements of each (checked) buffer
    (None and 0 elements touch nothing), each in the buffer's own itemsize."""
    spans = []
    for buf, elements in accesses:
        if buf is not None and elements:
            alloc = buf._allocation
            assert alloc is not None  # checked by check.buffer
            start = buf.device_address
            spans.append((alloc.address, start, start + elements * buf.itemsize))
    return tuple(spans)


def _span(buf: Buffer, elements: int) -> tuple[Span, ...]:
    """`_spans` of one checked buffer (whose address check.buffer has looked up)."""
    if not elements:
        return ()
    start = buf._address
    assert start is not None and buf._allocation is not None
    return ((buf._allocation.address, start, start + elements * buf.itemsize),)


def _in_memory(flags: int, src: tuple[Buffer, int] | None, dst: tuple[Buffer, int] | None,
               from_fpga: bool, to_fpga: bool) -> dict[str, Any]:
    """What a call reads and writes in memory, and syncs: operand 0 (`src`) unless it
    comes from the kernel stream (OP0_STREAM), the result (`dst`) unless it goes to it
    (RES_STREAM)."""
    src = None if flags & OP0_STREAM else src
    dst = None if flags & RES_STREAM else dst
    return {"reads": _spans(src) if src else (), "writes": _spans(dst) if dst else (),
            "sync_in": (_head(*src),) if src and not from_fpga else (),
            "sync_out": _head(*dst) if dst and not to_fpga else None}


def _overlap(span: Span, spans: Sequence[Span]) -> bool:
    return any(span[0] == base and span[1] < end and start < span[2]
               for base, start, end in spans)


def _warn_racing(call: Call, earlier: Sequence[Call]) -> None:
    """`call` syncs in host memory that an earlier call, still running, syncs its
    result into once it ends: what it reads depends on which comes first (the
    program's race, which no order of the device's can settle: host memory is the
    program's to order). Said at the user's line, once per line as warnings are: no
    call numbers in the text, which would make each call's warning another."""
    op, before = call.name.split(" (")[0], earlier[0].name.split(" (")[0]
    warn_at(call._origin, f"this {op} reads its input from host memory that an earlier "
            f"{before} of its rank, still running, writes its result into when it ends: "
            "what it reads depends on which comes first. Await that call before this "
            "one, or keep the data on the device (to_fpga=True there, from_fpga=True "
            "here)")


def _completion(call: Call) -> DeviceCall:
    """A device call that completes when `call` has, host sync included (aborted if it
    failed). A card may start a call chained on another's device call before the host
    has synced the first one's result out (ERT does): a call that overwrites that
    memory waits for this instead."""
    done = DeviceCall(None)

    def finished() -> None:
        done.complete(aborted=call._error is not None)

    if not call._register(finished):
        finished()
    return done


def _write_later(device: Device, address: int, data: np.ndarray) -> Callable[[], None]:
    """A host job writing a snapshot of host data to device memory."""
    return lambda: device.write(address, data)


_CHUNK = 1 << 16
"""Bytes compared at a time by `_holds`: small temporaries for large buffers."""


def _holds(device: Device, address: int, data: np.ndarray) -> bool:
    """Whether device memory at `address` holds `data`'s bytes already, so that syncing
    them in would change nothing an earlier call reads there."""
    want = data.reshape(-1).view(np.uint8)
    have = device.array(address, np.dtype(np.uint8), want.size)  # the soft CCLO's: no copy
    if have is None:
        have = np.empty_like(want)
        device.read(address, have)
    if want.size <= _CHUNK:
        return want.tobytes() == have.tobytes()
    return all(np.array_equal(want[i:i + _CHUNK], have[i:i + _CHUNK])
               for i in range(0, want.size, _CHUNK))


class ACCL:
    """One rank: its CCLO, its buffers, and the operations it runs.

    Every operation validates its arguments, syncs host data to the device (unless
    `from_fpga`), submits one call and returns its `Call` at once; the result is
    synced back to host memory (unless `to_fpga`) before the call completes. A call
    waits for the earlier unfinished calls whose device memory it shares, one of them
    writing, so results are those of running the calls one at a time, in order.
    Leaving `async with accl:` (or `aclose()`) waits for outstanding calls and
    releases the device.
    """

    def __init__(self, driver: Driver) -> None:
        self._driver = driver
        world = driver.comm(GLOBAL_COMM)
        self._rank, self._size = world.local_rank, len(world.ranks)
        self._lock = Call._lock  # (every call's, so that adopting one and booking it is
        # one critical section, and so are completing and forgetting it: see `LOCK`)
        self._outstanding: set[Call] = set()
        # the device memory of unfinished calls, and which earlier calls each waits for
        # because of it (for its DependencyError); both guarded by _lock
        self._hazards: Hazards[Call] = Hazards()
        self._hazard_deps: dict[Call, tuple[Call, ...]] = {}
        self._syncs_out: dict[Call, Span] = {}  # what they sync to the host once run
        self._forgets = self._forget  # (every call's `on_done`: no bound method per call)
        self._ncalls = 0
        # message orders (communicators of the same members share one), by comm_id and
        # by members: who issued their last collective (see _tasks)
        self._orders: dict[int, Order] = {}
        self._members: dict[tuple[int, ...], Order] = {}
        self._closed = False
        self._released = False  # its device closed: its buffers cannot sync any more
        self._departed = False  # told the other ranks it left (`_depart`)
        # progress a waiting task makes itself (the MPI fabric), see _bridge.wait
        self._poller: _bridge.Poller | None = driver.device.poller
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop last found running its calls

    @classmethod
    async def open(cls, driver: Driver) -> ACCL:
        """Configure the driver's CCLO (off the event loop) and return its ACCL."""
        await anyio.to_thread.run_sync(quietly(driver.configure))
        return cls(driver)

    @property
    def rank(self) -> int:
        """This rank's index in the global communicator."""
        return self._rank

    @property
    def size(self) -> int:
        """Number of ranks in the global communicator."""
        return self._size

    def __repr__(self) -> str:
        return f"<ACCL rank {self._rank} of {self._size}>"

    # -- lifetime -----------------------------------------------------------------

    async def __aenter__(self) -> ACCL:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Wait for every outstanding call, then release the device."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            await self._settle()
            self._released = True
            await anyio.to_thread.run_sync(quietly(self._driver.close))

    # -- lifecycle: what aaccl's worlds (`open_world`, `run`), its test runner
    # (aaccl.testing) and its pyaccl layer (aaccl.compat) do with a rank beyond the
    # public API. Internal; nothing else reaches into a rank's calls or device.

    async def _settle(self) -> None:
        """Wait until every outstanding call has ended; abort at once those whose
        await was cancelled (`wait_for`, a timeout scope): nobody waits for them."""
        with self._lock:
            given_up = [c for c in self._outstanding if c._given_up]
        if given_up:
            self._driver.device.abort_calls(
                given_up, "its await was cancelled and its rank left the world")
        while True:
            with self._lock:
                pending = next(iter(self._outstanding), None)
            if pending is None:
                return
            await _bridge.wait(pending._register)
            with self._lock:
                self._outstanding.discard(pending)

    def _depart(self, reason: str) -> None:
        """Tell every other rank that this one leaves the world, and why (where the
        device can: the soft CCLO), so their calls waiting for it fail at once."""
        if not self._departed:
            self._departed = True
            self._driver.device.leave(reason, range(self._size))

    def _rejected(self, op: str, comm_id: object, exc: Exception) -> None:
        """This rank rejected its collective `op` on `comm_id` (raising `exc`): the
        call still takes its place among the communicator's collectives, where the
        device can say so (the soft CCLO), so that the peers' calls of it fail at once,
        naming this rank and the error, instead of timing out or, worse, matching this
        rank's next collective. (Every collective catches its own checks' errors: a
        wrapper around each would cost a frame and its arguments' repacking per call.)"""
        if self._closed:
            return
        if isinstance(comm_id, bool) or not isinstance(comm_id, int) \
                or not 0 <= comm_id < len(self._driver.communicators):
            return  # no communicator to tell
        self._driver.device.skip_collective(
            self._driver.communicators[comm_id][0],
            f"rank {self._rank} rejected its {op}: {type(exc).__name__}: {exc}")

    def _abort(self, reason: str) -> None:
        """End every outstanding call of this rank at once with `Aborted(reason)`,
        where the device can (the soft CCLO); a card's running call ends in its own
        time. The rank stays open."""
        self._driver.device.abort(reason)

    def _settle_blocking(self) -> None:
        """_settle for a thread without an event loop (aaccl.compat): block until every
        call outstanding now has ended."""
        with self._lock:
            pending = list(self._outstanding)
        for call in pending:
            call.block()

    def _close_blocking(self) -> None:
        """aclose for a thread without an event loop (aaccl.compat)."""
        if self._closed:
            return
        self._closed = True
        self._settle_blocking()
        self._released = True
        self._driver.close()

    def _unfinished(self) -> tuple[str, ...]:
        """The names of this rank's calls not finished yet (for reports)."""
        with self._lock:
            return tuple(c.name for c in self._outstanding if not c.done())

    def _peers_gone(self) -> dict[int, str]:
        """The ranks known to have left this rank's world, and why (`Device.gone`)."""
        return dict(self._driver.device.gone)

    def _peers_missing(self) -> Callable[[], str | None] | None:
        """What says why a peer will never come where every rank meets (the MPI
        fabric's `missing`: its process ended), or None on devices without it: they
        bound such waits by the timeout (`Device.missing`)."""
        return self._driver.device.missing

    # -- memory and communicators ---------------------------------------------------

    def allocate(self, shape: int | tuple[int, ...], dtype: Any = np.float32) -> Buffer:
        """A zeroed host array with a twin in this rank's device memory. The CCLO moves
        float16/32/64 and int32/64; buffers of other dtypes (bytes, say) serve kernels
        and transfers."""
        self._check_open()
        return allocate(self._driver.device, self, shape, check.dtype(dtype))

    def split_communicator(self, indices: Sequence[int]) -> int:
        """Make a communicator of the global ranks `indices` (this rank among them);
        return its `comm_id`. Every member must split with the same indices."""
        self._check_open()
        ranks = [check.index(i, "rank", self._size) for i in indices]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"indices {list(indices)} repeat a rank")
        if self._rank not in ranks:
            raise ValueError(f"rank {self._rank} is not in indices {ranks}: only members "
                             "split a communicator")
        return self._driver.split_communicator(ranks)

    def _comm_size(self, comm_id: Any) -> int:
        comms = self._driver.communicators
        if isinstance(comm_id, bool) or not isinstance(comm_id, int):
            hint = " (int(comm_id) converts it)" if hasattr(comm_id, "__index__") else ""
            raise ValueError(f"comm_id must be an int, a communicator's ID, not "
                            f"{type(comm_id).__module__}.{type(comm_id).__qualname__}{hint}"
                            .replace("builtins.", ""))
        if not 0 <= comm_id < len(comms):
            raise ValueError(f"unknown comm_id {comm_id!r}: this rank has communicators "
                             f"0..{len(comms) - 1}")
        return len(comms[comm_id][1].ranks)

    def _comm_rank(self, comm_id: int) -> int:
        return self._driver.comm(comm_id).local_rank

    # -- submission -----------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")

    def _submit(self, op: str, scenario: Scenario, waitfor: Calls,
                sync_in: Sequence[Buffer] = (), sync_out: Buffer | None = None,
                buffers: tuple[Buffer | None, ...] = (None, None, None),
                reads: tuple[Span, ...] = (), writes: tuple[Span, ...] = (),
                addrs: tuple[int, int, int] | None = None,
                depth: int = 2, count: int = 0, comm_id: int | None = None,
                root_src_dst: int = 0, function: int = 0, tag: int = TAG_ANY,
                dtype: np.dtype | None = None, compress_dtype: np.dtype | None = None,
                operand_dtypes: Any = None, stream_flags: int = 0,
                start: Callable[[Sequence[DeviceCall]], DeviceCall] | None = None,
                engine: str = "cclo") -> Call:
        """Every call's one path: sync inputs in, start the call after `waitfor` and
        after the earlier calls its device memory (`reads`, `writes`; `sync_in` lies
        within `reads`) conflicts with, adopt the device's call and keep it, with the
        memory it uses, until it ends (`_forget`). `addrs`: the device addresses of
        `buffers` (the CCLO's three), where the caller has them at hand; `buffers` are
        kept allocated until the call ends. `depth`: the user's frame as seen from this
        one (2 for a public method calling it). The rest is the call, for
        `Driver.start` (`comm_id` None: a call without a communicator), unless `start`
        starts host work instead (`start(waits)`: a transfer, a kernel's run, on
        `engine`). (Every argument may come by position, as `_all`'s do: keywords cost
        on every call's path.)"""
        if self._closed:
            self._check_open()
        if sync_out is not None and not sync_out.flags.writeable:
            raise ValueError(f"{op}: the buffer that receives its result is read-only "
                             "(writeable=False), so its result could not come back to the "
                             "host: make it writeable, or pass to_fpga=True to leave the "
                             "result in device memory")
        deps = () if type(waitfor) is tuple and not waitfor else check.waitfor(waitfor, self)
        submitted = time.perf_counter_ns() if _trace._active is not None else 0
        waits: Sequence[DeviceCall]
        hazards: tuple[Call, ...]
        book = self._hazards  # (its fields read directly: bool(book) would be a call)
        if (reads or writes) and (book._one is not None or book._regions or book._lone) \
                and book.uses(reads, writes):
            waits = ordered = list(deps)
            hazards, synced, racing = self._order(deps, ordered, reads, writes, sync_in)
            writes += synced
        else:
            waits, hazards, racing = deps, (), ()
            for region in sync_in:
                region.sync_to_device()
        if start is not None:
            call = start(waits)
        else:
            if addrs is None:
                b0, b1, b2 = buffers  # checked: their addresses are known
                addrs = (0 if b0 is None else b0._address, 0 if b1 is None else b1._address,
                         0 if b2 is None else b2._address)  # type: ignore[assignment]
            call = self._driver.start(  # (by position: keywords cost on every call)
                scenario, count, GLOBAL_COMM if comm_id is None else comm_id, root_src_dst,
                function, tag, dtype, compress_dtype, operand_dtypes, stream_flags,
                addrs, waits)  # type: ignore[arg-type]  # (`addrs` is set above if it was None)
        # The device's call is the rank's from now on: one object from device to user.
        # Where the user made it, for its never-awaited warning: `depth` frames up, past
        # any further API layer (aaccl.compat's); its code and instruction offset, not
        # the frame, which would keep the user's locals alive (the line is looked up if
        # ever needed). Its name is formatted if ever read; errors name the
        # communicator where it is not the world. `submitted` is 0 unless tracing:
        # then the call's run is recorded once it ended.
        self._ncalls += 1
        on_done = self._forgets if not submitted else self._traced(op, engine, submitted)
        frame = _getframe(depth)
        while "_API_LAYER" in frame.f_globals:
            frame = frame.f_back  # type: ignore[assignment]  # the user's is further up
        call._name = (op, self._rank, self._ncalls,
                      "" if not comm_id else f", communicator {comm_id}")
        call._origin = (frame.f_code, frame.f_lasti, frame.f_globals)
        if racing:
            _warn_racing(call, racing)
        call._buffers, call._deps = buffers, deps + hazards if hazards else deps
        finish = None if sync_out is None else sync_out.sync_from_device
        pending = False
        if not call._settled:  # (once settled it stays so: a nop's needs no lock)
            lock = self._lock  # (every call's: its completion runs `_forget` under it;
            lock.acquire()  # not `with`, whose __exit__ is a call more on every call's path)
            try:
                if not call._settled:  # adopted, with its books, in one critical section
                    pending, call.owner, call._finish, call._on_done = True, self, finish, on_done
                    self._outstanding.add(call)
                    if reads or writes:  # (alone in the books: one slot, set in line)
                        if book._one is None and not book._regions and not book._lone:
                            book._one, book._one_spans = call, (reads, writes)
                        else:
                            book.add(call, reads, writes)
                    if hazards:  # (its error is explained once it ends: `_forget`)
                        self._hazard_deps[call], hazards = hazards, ()
                    if sync_out is not None and sync_out.size:  # (what it syncs out once run)
                        self._syncs_out[call] = _span(sync_out, sync_out.size)[0]
            finally:
                lock.release()
        if not pending:  # ended on the spot (a nop, the last rank of a meeting, a failure)
            call._ended(self, finish)
            if submitted:  # (its run is traced all the same)
                with self._lock:
                    on_done(call)
        if hazards:  # it ended already: nobody has seen its error yet
            self._explain(call, hazards)
        if comm_id is not None and scenario is not _SEND and scenario is not _RECV:
            # a collective: which task issues it, against the last one on its order
            loop: Any = self._loop  # (`running_loop`, its common case in one line)
            if loop is not None and loop._thread_id == _ident():
                task = asyncio_task(loop)
            else:  # (trio's task, another loop's, a thread)
                task = current_task(self)
            order = self._orders.get(comm_id) or self._message_order(comm_id)
            if order.task is not task:  # (or the order's first collective: nobody's last)
                before = order.last()  # (None: dropped, so ended and never to be seen)
                if before is not None and (not before._settled or not before._seen):
                    check_race(order, call, before, deps, task)
                order.task = task
            order.last = _weakref(call)
        return call

    def _message_order(self, comm_id: int) -> Order:
        """The message order of communicator `comm_id`, which communicators of the same
        members (in the same order) share, as on a card (docs/concepts/concurrency.md)."""
        members = tuple(r.session for r in self._driver.comm(comm_id).ranks)
        order = self._members.get(members)
        if order is None:
            order = self._members[members] = Order(comm_id)
        else:
            order.comm_ids.append(comm_id)
        self._orders[comm_id] = order
        return order

    def _order(self, deps: tuple[Call, ...], waits: list[DeviceCall], reads: tuple[Span, ...],
               writes: tuple[Span, ...], sync_in: Sequence[Buffer] = (),
               ) -> tuple[tuple[Call, ...], tuple[Span, ...], tuple[Call, ...]]:
        """Results as if in order: the earlier unfinished calls a new call conflicts
        with (beyond its `deps`), added to its device `waits`.

        Host data is synced in now, unless that would change device memory an
        earlier call still uses: then a snapshot of it (the call's input as of its
        submission) is written by a host job once those calls are done, and the call
        waits for the job. (Where earlier calls only read those bytes and they are
        equal already, as when one buffer is sent again and again, nothing is written
        and nothing waits.) Returns the hazards and the spans such jobs write, which
        count as the call's writes. An earlier call whose result is still to be
        synced to the host from memory this call writes is waited for whole
        (`_completion`), not just its run on the device. Last, the earlier calls that
        sync their result into host memory this call syncs in (`_warn_racing`).
        """
        regions = [(region, _spans((region, region.size))) for region in sync_in]
        book = self._hazards
        with self._lock:
            found = book.conflicts(reads, writes)
            blocked = [(region, span, book.conflicts(span, ())) for region, span in regions]
        device = self._driver.device
        synced: list[Span] = []
        for region, span, writers in blocked:
            data = np.asarray(region)
            if not writers:
                if not book.uses(span):  # nobody uses that allocation now
                    region.sync_to_device()
                    continue
                if _holds(device, span[0][1], data):
                    continue  # readers only, and they read these very bytes
            # who uses those bytes, only now: a buffer sent again and again has every
            # outstanding send among its readers, and listing them all for each new
            # send would cost time quadratic in their number
            with self._lock:
                users = book.conflicts((), span)
            if not users:
                region.sync_to_device()
                continue
            job = _write_later(device, span[0][1], data.copy())
            waits.append(device.run(job, users))
            synced += span
            found += users
        conflicting = dict.fromkeys(found)
        written = (*writes, *synced)
        taken = [s for _, span in regions for s in span]  # (the host data it syncs in)
        racing: list[Call] = []
        for call in conflicting:
            out = self._syncs_out.get(call)
            if out is not None and _overlap(out, taken):  # (a writer of what it reads)
                racing.append(call)
            if out is not None and _overlap(out, written):
                waits.append(_completion(call))
            elif call not in deps:
                waits.append(call)
        return tuple(c for c in conflicting if c not in deps), tuple(synced), tuple(racing)

    def _traced(self, op: str, engine: str, submitted: int) -> Callable[[Call], None]:
        """A traced call's `on_done`: records its run (before anyone is woken), then
        forgets it."""
        trace = _trace._active
        if trace is None:  # tracing ended since the call was submitted
            return self._forgets
        record = self._record(trace, op, engine, submitted)

        def on_done(call: Call) -> None:
            record(call)
            self._forget(call)

        return on_done

    def _record(self, trace: _trace.Trace, op: str, engine: str,
                submitted: int) -> Callable[[DeviceCall], None]:
        """Trace the host's submission (with its syncs); return what traces the call's
        run on the device once it completed (its Call's `on_done`: before the Call
        wakes anyone)."""
        rank, number = self._rank, self._ncalls
        trace.add(rank, "host", f"submit {op}", submitted, time.perf_counter_ns(), call=number)

        def completed(dev: DeviceCall) -> None:
            end = dev.ended or time.perf_counter_ns()
            extra = {} if dev.args is None else {"count": dev.args.count}
            trace.add(rank, engine, op, dev.started or end, end, call=number,
                      submitted_us=(submitted - trace.origin) / 1000,
                      failed=dev.failed, **extra)

        return completed

    _outcome = staticmethod(outcome)  # (what a call's device outcome means: Call's owner)

    _wait = staticmethod(_bridge.wait)  # (how a Call waits where asyncio's future cannot)
    _wait_trio = staticmethod(_bridge.wait_trio)  # (... and where no asyncio loop runs)
    _answered = staticmethod(_bridge.answered)  # (an await's first poll, with a poller)

    def _forget(self, call: Call) -> None:
        """A tracked call ended (its `on_done`, run under the lock its completion holds:
        the one every call and every rank's books share, `devices._call.LOCK`): its
        records go, in a few lines where it was alone in the books."""
        self._outstanding.discard(call)
        book = self._hazards
        if book._one is call:
            book._one = book._one_spans = None
        elif book._held or book._solo:  # (every call the books list is in one of them)
            book.discard(call)
        if self._syncs_out or self._hazard_deps:
            self._syncs_out.pop(call, None)
            hazards = self._hazard_deps.pop(call, None)
            if hazards is not None:
                self._explain(call, hazards)

    @staticmethod
    def _explain(call: Call, hazards: tuple[Call, ...]) -> None:
        """Name the failed calls a call waited for only because they used the same
        memory: the user never listed them in `waitfor`. Runs before anyone can see
        the call's error (from its on_done callback, or before it is returned)."""
        error = call._error
        if not isinstance(error, DependencyError):
            return
        failed = [d for d in call._deps if d._error is not None]
        if not any(d in hazards for d in failed):
            return
        reasons = [f"{d.name} failed" + (" (an earlier call on the same buffer)"
                                         if d in hazards else "") for d in failed]
        explained = DependencyError(f"{call.name} did not run: {'; '.join(reasons)}")
        explained.__cause__ = error.__cause__
        call._error = explained

    # -- kernels and transfers ---------------------------------------------------------

    def kernel(self, target: Any, *, name: str | None = None) -> Kernel:
        """A compute kernel whose runs are Calls: a Python callable (run on the device's
        workers, with Buffers as their device memory) or, under device="pynq", a kernel
        of the overlay, by name ("vadd_1") or as PYNQ's object. See `Kernel`."""
        self._check_open()
        device = self._driver.device
        if isinstance(target, str):
            name, target = name or target, device.overlay_kernel(target)
        hardware = on_card(device, target)
        label = name or str(getattr(target, "__name__", type(target).__name__))
        return Kernel(self, target, label, hardware)

    def attach_stream(self, kernel: Any) -> None:
        """Put `kernel` between the CCLO's kernel streams (soft CCLO): each packet a
        call writes to the stream (RES_STREAM) goes to `kernel(chunk, tag)`, and the
        array it returns comes back in, where calls with OP0_STREAM read. A Python
        callable or a `Kernel` of this rank; None restores the loopback."""
        self._check_open()
        attach_stream(self._driver.device, kernel, self)

    def _run_kernel(self, kernel: Kernel, args: tuple[Any, ...], kwargs: dict[str, Any],
                    waitfor: Calls) -> Call:
        self._check_open()
        deps = check.waitfor(waitfor, self)
        buffers = tuple(check.buffer(a, f"argument {i} of {kernel.name}", self, 0, cclo=False)
                        for i, a in [*enumerate(args), *kwargs.items()]
                        if isinstance(a, Buffer))
        spans = _spans(*((b, b.size) for b in buffers))  # a kernel may read and write each
        device = self._driver.device
        # (depth 3: _submit <- _run_kernel <- Kernel.__call__ <- user)
        return self._submit(f"kernel {kernel.name}", _NOP, deps, buffers=buffers, writes=spans,
                            depth=3, engine="kernel",
                            start=lambda waits: kernel._start(device, args, kwargs, waits))

    def sync_to_device(self, buf: Buffer, *, waitfor: Calls = ()) -> Call:
        """Copy buf's host elements to device memory, as a call: it runs on the device's
        workers once `waitfor` succeeded, so it overlaps with compute and other calls.
        Pass a slice (`buf[:n]`) to move part of a buffer."""
        return self._transfer("sync_to_device", buf, Buffer.sync_to_device, True, waitfor)

    def sync_from_device(self, buf: Buffer, *, waitfor: Calls = ()) -> Call:
        """Copy buf's device memory into its host elements, as a call (see
        `sync_to_device`)."""
        return self._transfer("sync_from_device", buf, Buffer.sync_from_device, False, waitfor)

    def _transfer(self, op: str, buf: Buffer, move: Callable[[Buffer], None], to_device: bool,
                  waitfor: Calls) -> Call:
        self._check_open()
        deps = check.waitfor(waitfor, self)
        region = check.buffer(buf, "buf", self, 0, cclo=False)
        spans = _spans((region, region.size))
        reads, writes = ((), spans) if to_device else (spans, ())
        device = self._driver.device
        # (depth 3: _submit <- _transfer <- sync_to_device <- user)
        return self._submit(op, _NOP, deps, buffers=(region,), reads=reads, writes=writes,
                            depth=3, engine="dma",
                            start=lambda waits: device.run(lambda: move(region), waits))

    # -- primitives -------------------------------------------------------------------

    def nop(self, *, waitfor: Calls = ()) -> Call:
        """A call that does nothing: measures the round trip, or joins dependencies."""
        return self._submit("nop", _NOP, waitfor, (), None, (), (), (), (0, 0, 0))

    def copy(self, srcbuf: Buffer, dstbuf: Buffer, count: int, from_fpga: bool = False,
             to_fpga: bool = False, *, stream_flags: int = 0, waitfor: Calls = ()) -> Call:
        """dstbuf[:count] = srcbuf[:count], on the device. float32 and float16 buffers
        mix: the CCLO converts between them. With OP0_STREAM the elements come from the
        kernel stream, with RES_STREAM they go to it (that buffer only gives the dtype)."""
        check.flags(from_fpga=from_fpga, to_fpga=to_fpga)
        n = check.count(count)
        flags = check.stream_flags(stream_flags, "copy", BOTH_STREAMS)
        src = check.buffer(srcbuf, "srcbuf", self, 0 if flags & OP0_STREAM else n)
        dst = check.buffer(dstbuf, "dstbuf", self, 0 if flags & RES_STREAM else n)
        src_dtype, dst_dtype = check.mixed_dtypes(srcbuf=src, dstbuf=dst)
        return self._submit("copy", _COPY, waitfor, count=n,
                            operand_dtypes=(src_dtype, None, dst_dtype),
                            stream_flags=flags, buffers=(src, None, dst),
                            **_in_memory(flags, (src, n), (dst, n), from_fpga, to_fpga))

    def combine(self, count: int, func: ReduceFunction, val1: Buffer, val2: Buffer,
                result: Buffer, val1_from_fpga: bool = False, val2_from_fpga: bool = False,
                to_fpga: bool = False, *, stream_flags: int = 0, waitfor: Calls = ()) -> Call:
        """result[:count] = func(val1, val2), elementwise on the device. float32 and
        float16 buffers mix: then the CCLO computes in float16, converting float32
        inputs to float16 first. With OP0_STREAM val1 comes from the kernel stream,
        with RES_STREAM the result goes to it (that buffer only gives the dtype)."""
        check.flags(val1_from_fpga=val1_from_fpga, val2_from_fpga=val2_from_fpga, to_fpga=to_fpga)
        n, fn = check.count(count), check.function(func)
        flags = check.stream_flags(stream_flags, "combine", BOTH_STREAMS)
        a = check.buffer(val1, "val1", self, 0 if flags & OP0_STREAM else n)
        b = check.buffer(val2, "val2", self, n)
        out = check.buffer(result, "result", self, 0 if flags & RES_STREAM else n)
        dtypes = check.mixed_dtypes(val1=a, val2=b, result=out)
        memory = _in_memory(flags, (a, n), (out, n), val1_from_fpga, to_fpga)
        memory["reads"] += _spans((b, n))
        if not val2_from_fpga:
            memory["sync_in"] += (_head(b, n),)
        return self._submit("combine", _COMBINE, waitfor, count=n, function=int(fn),
                            operand_dtypes=(dtypes[0], dtypes[1], dtypes[2]),
                            stream_flags=flags, buffers=(a, b, out), **memory)

    def send(self, srcbuf: Buffer, count: int, dst: int, tag: int = TAG_ANY,
             comm_id: int = GLOBAL_COMM, from_fpga: bool = False, compress_dtype: Any = None,
             stream_flags: int = 0, *, waitfor: Calls = ()) -> Call:
        """Send srcbuf[:count] to rank `dst`; done once the data has left (eager) or the
        receiver has it. With OP0_STREAM the data comes from the kernel stream (srcbuf
        only gives the dtype); with RES_STREAM it goes into rank `dst`'s kernel stream,
        under `tag` (0..246), and no recv takes it."""
        comms = self._driver.communicators
        if type(srcbuf) is Buffer and type(count) is int and type(dst) is int \
                and type(tag) is int and type(comm_id) is int and type(from_fpga) is bool \
                and compress_dtype is None and type(stream_flags) is int and not stream_flags \
                and 0 <= comm_id < len(comms) and 0 <= dst < len(comms[comm_id][1].ranks) \
                and 0 <= count <= srcbuf.size and count < _COUNT_END and 0 <= tag <= TAG_ANY \
                and (alloc := srcbuf._allocation) is not None and alloc.owner is self \
                and (srcbuf._address is not None or srcbuf._locate() is not None) \
                and srcbuf.dtype in SUPPORTED_DTYPES:
            # the common case, checked in one test (the checks below say what is wrong)
            at: int = srcbuf._address  # type: ignore[assignment]  # (located just now)
            return self._submit(
                "send", _SEND, waitfor, count=count, comm_id=comm_id, root_src_dst=dst, tag=tag,
                dtype=srcbuf.dtype, buffers=(srcbuf, None, None), addrs=(at, 0, 0),
                reads=((alloc.address, at, at + count * srcbuf.itemsize),) if count else (),
                sync_in=() if from_fpga else (
                    srcbuf if count == srcbuf.size and srcbuf.ndim == 1
                    else _head(srcbuf, count),))
        check.flags(from_fpga=from_fpga)
        size = self._comm_size(comm_id)
        n, peer, t = check.count(count), check.index(dst, "dst", size), check.tag(tag)
        flags = check.stream_flags(stream_flags, "send", BOTH_STREAMS)
        if flags & RES_STREAM:
            check.stream_id(t)
        src = check.buffer(srcbuf, "srcbuf", self, 0 if flags & OP0_STREAM else n)
        wire = check.compression(src.dtype, compress_dtype)
        return self._submit("send", _SEND, waitfor, count=n, comm_id=comm_id,
                            root_src_dst=peer, tag=t, dtype=src.dtype, compress_dtype=wire,
                            stream_flags=flags, buffers=(src, None, None),
                            **_in_memory(flags, (src, n), None, from_fpga, True))

    def recv(self, dstbuf: Buffer, count: int, src: int, tag: int = TAG_ANY,
             comm_id: int = GLOBAL_COMM, to_fpga: bool = False, compress_dtype: Any = None,
             *, stream_flags: int = 0, waitfor: Calls = ()) -> Call:
        """Receive `count` elements from rank `src` into dstbuf. With RES_STREAM they go
        to the kernel stream instead (dstbuf only gives the dtype)."""
        comms = self._driver.communicators
        if type(dstbuf) is Buffer and type(count) is int and type(src) is int \
                and type(tag) is int and type(comm_id) is int and type(to_fpga) is bool \
                and compress_dtype is None and type(stream_flags) is int and not stream_flags \
                and 0 <= comm_id < len(comms) and 0 <= src < len(comms[comm_id][1].ranks) \
                and 0 <= count <= dstbuf.size and count < _COUNT_END and 0 <= tag <= TAG_ANY \
                and (alloc := dstbuf._allocation) is not None and alloc.owner is self \
                and (dstbuf._address is not None or dstbuf._locate() is not None) \
                and dstbuf.dtype in SUPPORTED_DTYPES:
            # the common case, checked in one test (the checks below say what is wrong)
            at: int = dstbuf._address  # type: ignore[assignment]  # (located just now)
            return self._submit(
                "recv", _RECV, waitfor, count=count, comm_id=comm_id, root_src_dst=src, tag=tag,
                dtype=dstbuf.dtype, buffers=(None, None, dstbuf), addrs=(0, 0, at),
                writes=((alloc.address, at, at + count * dstbuf.itemsize),) if count else (),
                sync_out=None if to_fpga else
                dstbuf if count == dstbuf.size and dstbuf.ndim == 1 else _head(dstbuf, count))
        check.flags(to_fpga=to_fpga)
        size = self._comm_size(comm_id)
        n, peer, t = check.count(count), check.index(src, "src", size), check.tag(tag)
        flags = check.stream_flags(stream_flags, "recv", RES_STREAM)
        dst = check.buffer(dstbuf, "dstbuf", self, 0 if flags else n)
        wire = check.compression(dst.dtype, compress_dtype)
        return self._submit("recv", _RECV, waitfor, count=n, comm_id=comm_id,
                            root_src_dst=peer, tag=t, dtype=dst.dtype, compress_dtype=wire,
                            stream_flags=flags, buffers=(None, None, dst),
                            **_in_memory(flags, None, (dst, n), True, to_fpga))

    # -- collectives ------------------------------------------------------------------

    def bcast(self, buf: Buffer, count: int, root: int, comm_id: int = GLOBAL_COMM,
              from_fpga: bool = False, to_fpga: bool = False, compress_dtype: Any = None,
              *, waitfor: Calls = ()) -> Call:
        """Copy root's buf[:count] into every rank's buf."""
        try:
            check.flags(from_fpga=from_fpga, to_fpga=to_fpga)
            size = self._comm_size(comm_id)
            n, r = check.count(count), check.index(root, "root", size)
            b = check.buffer(buf, "buf", self, n)
            wire = check.compression(b.dtype, compress_dtype)
            is_root = r == self._comm_rank(comm_id)
            return self._submit("bcast", _BCAST, waitfor, count=n, comm_id=comm_id,
                                root_src_dst=r, dtype=b.dtype, compress_dtype=wire,
                                buffers=(b, None, b),
                                reads=_spans((b, n)) if is_root else (),
                                writes=() if is_root else _spans((b, n)),
                                sync_in=(_head(b, n),) if is_root and not from_fpga else (),
                                # the root's host copy is current unless its data came
                                # from the device
                                sync_out=None if to_fpga or (is_root and not from_fpga)
                                else _head(b, n))
        except (TypeError, ValueError) as exc:
            self._rejected("bcast", comm_id, exc)
            raise

    def scatter(self, sbuf: Buffer | None, rbuf: Buffer, count: int, root: int,
                comm_id: int = GLOBAL_COMM, from_fpga: bool = False, to_fpga: bool = False,
                compress_dtype: Any = None, *, waitfor: Calls = ()) -> Call:
        """Root's sbuf holds `count` elements per rank; rank i receives chunk i in rbuf."""
        try:
            check.flags(from_fpga=from_fpga, to_fpga=to_fpga)
            size = self._comm_size(comm_id)
            n, r = check.count(count), check.index(root, "root", size)
            is_root = r == self._comm_rank(comm_id)
            s = check.buffer(sbuf, "sbuf", self, n * size) if is_root or sbuf is not None else None
            d = check.buffer(rbuf, "rbuf", self, n)
            dtype = check.same_dtype(sbuf=s, rbuf=d)
            wire = check.compression(dtype, compress_dtype)
            return self._submit("scatter", _SCATTER, waitfor, count=n, comm_id=comm_id,
                                root_src_dst=r, dtype=dtype, compress_dtype=wire,
                                buffers=(s, None, d),
                                reads=_spans((s, n * size)) if is_root else (),
                                writes=_spans((d, n)),
                                sync_in=(_head(s, n * size),) if is_root and s is not None
                                and not from_fpga else (),
                                sync_out=None if to_fpga else _head(d, n))
        except (TypeError, ValueError) as exc:
            self._rejected("scatter", comm_id, exc)
            raise

    def gather(self, sbuf: Buffer, rbuf: Buffer | None, count: int, root: int,
               comm_id: int = GLOBAL_COMM, from_fpga: bool = False, to_fpga: bool = False,
               compress_dtype: Any = None, *, waitfor: Calls = ()) -> Call:
        """Root's rbuf receives every rank's sbuf[:count], in rank order."""
        try:
            check.flags(from_fpga=from_fpga, to_fpga=to_fpga)
            size = self._comm_size(comm_id)
            n, r = check.count(count), check.index(root, "root", size)
            is_root = r == self._comm_rank(comm_id)
            s = check.buffer(sbuf, "sbuf", self, n)
            d = check.buffer(rbuf, "rbuf", self, n * size) if is_root or rbuf is not None else None
            dtype = check.same_dtype(sbuf=s, rbuf=d)
            wire = check.compression(dtype, compress_dtype)
            return self._submit("gather", _GATHER, waitfor, count=n, comm_id=comm_id,
                                root_src_dst=r, dtype=dtype, compress_dtype=wire,
                                buffers=(s, None, d),
                                reads=_spans((s, n)),
                                writes=_spans((d, n * size)) if is_root else (),
                                sync_in=() if from_fpga else (_head(s, n),),
                                sync_out=_head(d, n * size) if is_root and d is not None
                                and not to_fpga else None)
        except (TypeError, ValueError) as exc:
            self._rejected("gather", comm_id, exc)
            raise

    def reduce(self, sbuf: Buffer, rbuf: Buffer | None, count: int, root: int,
               func: ReduceFunction, comm_id: int = GLOBAL_COMM, from_fpga: bool = False,
               to_fpga: bool = False, compress_dtype: Any = None, *, stream_flags: int = 0,
               waitfor: Calls = ()) -> Call:
        """Root's rbuf receives func over every rank's sbuf[:count]. With OP0_STREAM
        each rank's contribution comes from its kernel stream, with RES_STREAM the
        root's result goes to its kernel stream (those buffers only give the dtype)."""
        try:
            check.flags(from_fpga=from_fpga, to_fpga=to_fpga)
            size = self._comm_size(comm_id)
            n, r, fn = check.count(count), check.index(root, "root", size), check.function(func)
            flags = check.stream_flags(stream_flags, "reduce", BOTH_STREAMS)
            is_root = r == self._comm_rank(comm_id)
            s = check.buffer(sbuf, "sbuf", self, 0 if flags & OP0_STREAM else n)
            d = check.buffer(rbuf, "rbuf", self, 0 if flags & RES_STREAM else n) \
                if is_root or rbuf is not None else None
            dtype = check.same_dtype(sbuf=s, rbuf=d)
            wire = check.compression(dtype, compress_dtype)
            return self._submit("reduce", _REDUCE, waitfor, count=n, comm_id=comm_id,
                                root_src_dst=r, function=int(fn), dtype=dtype, compress_dtype=wire,
                                stream_flags=flags, buffers=(s, None, d),
                                **_in_memory(flags, (s, n), (d, n) if is_root and d is not None
                                             else None, from_fpga, to_fpga))
        except (TypeError, ValueError) as exc:
            self._rejected("reduce", comm_id, exc)
            raise

    def _all(self, op: str, scenario: Scenario, sbuf: Buffer, rbuf: Buffer, count: int,
             chunked_in: bool, chunked_out: bool, func: Any, comm_id: int, from_fpga: bool,
             to_fpga: bool, compress_dtype: Any, waitfor: Calls) -> Call:
        """Collectives where every rank both sends and receives; a chunked buffer holds
        `count` elements per rank; `func` is _NO_REDUCTION for those that reduce nothing."""
        try:
            if type(sbuf) is Buffer and type(rbuf) is Buffer and type(count) is int \
                    and type(comm_id) is int and type(from_fpga) is bool and type(to_fpga) is bool \
                    and 0 <= comm_id < len(comms := self._driver.communicators) \
                    and 0 <= count < _COUNT_END and compress_dtype is None \
                    and (sa := sbuf._allocation) is not None and sa.owner is self \
                    and (da := rbuf._allocation) is not None and da.owner is self \
                    and (s_at := sbuf._address) is not None \
                    and (d_at := rbuf._address) is not None \
                    and (dtype := sbuf.dtype) in SUPPORTED_DTYPES and rbuf.dtype == dtype \
                    and (func is _NO_REDUCTION or type(func) is ReduceFunction):
                # the common case, checked in one test but for the sizes, which a chunked
                # buffer's need the communicator's for (the checks below say what is wrong)
                size = len(comms[comm_id][1].ranks) if chunked_in or chunked_out else 1
                function = 0 if func is _NO_REDUCTION else int(func)  # type: ignore[call-overload]
            else:  # (or convert what is right: a numpy integer, say)
                check.flags(from_fpga=from_fpga, to_fpga=to_fpga)
                function = 0 if func is _NO_REDUCTION else int(check.function(func))
                size, count = self._comm_size(comm_id), check.count(count)
                sbuf, rbuf = check.buffers(sbuf, rbuf, self, (size if chunked_in else 1) * count,
                                           (size if chunked_out else 1) * count)
                dtype = check.same_dtype(sbuf=sbuf, rbuf=rbuf)
                compress_dtype = check.compression(dtype, compress_dtype)
                sa, da = sbuf._allocation, rbuf._allocation
                s_at, d_at = sbuf._address, rbuf._address  # (looked up by check.buffer)
                assert sa is not None and da is not None and s_at is not None and d_at is not None
            ins, outs = (size if chunked_in else 1) * count, (size if chunked_out else 1) * count
            if ins > sbuf.size or outs > rbuf.size:
                check.buffers(sbuf, rbuf, self, ins, outs)  # (raises, naming the buffer)
            reads = ((sa.address, s_at, s_at + ins * sbuf.itemsize),) if count else ()
            writes = ((da.address, d_at, d_at + outs * rbuf.itemsize),) if count else ()
            # by position (`_submit`'s order); depth 3: _submit <- _all <- allreduce <- user
            return self._submit(
                op, scenario, waitfor, () if from_fpga else (_head(sbuf, ins),),
                None if to_fpga else _head(rbuf, outs), (sbuf, rbuf, rbuf), reads, writes,
                (s_at, d_at, d_at), 3, count, comm_id, 0, function, TAG_ANY, dtype,
                compress_dtype)
        except (TypeError, ValueError) as exc:
            self._rejected(op, comm_id, exc)
            raise

    def allgather(self, sbuf: Buffer, rbuf: Buffer, count: int, comm_id: int = GLOBAL_COMM,
                  from_fpga: bool = False, to_fpga: bool = False, compress_dtype: Any = None,
                  *, waitfor: Calls = ()) -> Call:
        """Every rank's rbuf receives every rank's sbuf[:count], in rank order."""
        return self._all("allgather", _ALLGATHER, sbuf, rbuf, count, False, True,
                         _NO_REDUCTION, comm_id, from_fpga, to_fpga, compress_dtype, waitfor)

    def allreduce(self, sbuf: Buffer, rbuf: Buffer, count: int, func: ReduceFunction,
                  comm_id: int = GLOBAL_COMM, from_fpga: bool = False, to_fpga: bool = False,
                  compress_dtype: Any = None, *, waitfor: Calls = ()) -> Call:
        """Every rank's rbuf receives func over every rank's sbuf[:count]."""
        return self._all("allreduce", _ALLREDUCE, sbuf, rbuf, count, False, False, func,
                         comm_id, from_fpga, to_fpga, compress_dtype, waitfor)

    def reduce_scatter(self, sbuf: Buffer, rbuf: Buffer, count: int, func: ReduceFunction,
                       comm_id: int = GLOBAL_COMM, from_fpga: bool = False,
                       to_fpga: bool = False, compress_dtype: Any = None,
                       *, waitfor: Calls = ()) -> Call:
        """Rank i's rbuf receives chunk i (of `count` elements) of func over every
        rank's sbuf[:count * size]."""
        return self._all("reduce_scatter", _REDUCE_SCATTER, sbuf, rbuf, count, True, False,
                         func, comm_id, from_fpga, to_fpga, compress_dtype, waitfor)

    def alltoall(self, sbuf: Buffer, rbuf: Buffer, count: int, comm_id: int = GLOBAL_COMM,
                 from_fpga: bool = False, to_fpga: bool = False, compress_dtype: Any = None,
                 *, waitfor: Calls = ()) -> Call:
        """Chunk j of rank i's sbuf lands as chunk i of rank j's rbuf."""
        return self._all("alltoall", _ALLTOALL, sbuf, rbuf, count, True, True,
                         _NO_REDUCTION, comm_id, from_fpga, to_fpga, compress_dtype, waitfor)

    def barrier(self, comm_id: int = GLOBAL_COMM, *, waitfor: Calls = ()) -> Call:
        """Completes once every rank of the communicator has entered the barrier."""
        try:
            self._comm_size(comm_id)
            return self._submit("barrier", _BARRIER, waitfor, comm_id=comm_id,
                                dtype=np.dtype(np.float32))
        except (TypeError, ValueError) as exc:
            self._rejected("barrier", comm_id, exc)
            raise