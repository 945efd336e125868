"""Runs calls on a soft CCLO: decodes the 12 arguments, reads the exchange memory,
and executes the call's schedule over the fabric.

`admit` runs when a call is submitted, in submission order, and fixes its place in
the message order (send sequence numbers, posted receives, collective sequence
numbers). Once its dependencies are done, `task` turns the call into a resumable
task: `advance(blocking=True)` runs it to the end on a device worker;
`advance(blocking=False)` runs it on the current thread until it would wait, then
raises `Park` (a waiter resumes it when its message arrives) or `Escalate` (finish
on a worker: it waits for something other than a message).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _exchmem as xm
from .._constants import ConfigFunction, ErrorCode, Scenario
from ..devices import CallArgs
from .algorithms import Copy, Incoming, Local, Send, Step, schedule
from .fabric import COMPLETED, Key, Message, PeerTimeout, PostedRecv, RxPool, SendRequest
from ._datapath import OPERAND_FLAGS, Datapath, UnsupportedConfig

if TYPE_CHECKING:
    from ._device import SoftDevice

COLLECTIVES = frozenset({Scenario.BCAST, Scenario.SCATTER, Scenario.GATHER, Scenario.REDUCE,
                         Scenario.ALLGATHER, Scenario.ALLREDUCE, Scenario.REDUCE_SCATTER,
                         Scenario.BARRIER, Scenario.ALLTOALL})


class CallFailed(Exception):
    def __init__(self, code: ErrorCode) -> None:
        self.code = code


class Park(Exception):
    """The task registered a waiter for a message and let go of the thread."""


class Escalate(Exception):
    """The task must wait for something other than a message: run it on a worker."""


Resume = Callable[[], None]


class Task:
    """A dispatched call. `advance` may be called again after Park/Escalate; `finish`
    runs exactly once, when the call ends, whatever its outcome."""

    def advance(self, blocking: bool, resume: Resume) -> None:
        pass

    def timed_out(self) -> bool:
        """The parked task's deadline passed: give up its waiter. False if the waiter
        fired first (then the task is running elsewhere)."""
        return False

    def finish(self, failed: bool) -> None:
        pass


class _Config(Task):
    def __init__(self, engine: Engine, args: CallArgs) -> None:
        self.engine, self.args = engine, args

    def advance(self, blocking: bool, resume: Resume) -> None:
        code = self.engine._config(self.args)
        if code:
            raise CallFailed(ErrorCode(code))


INBOUND_SEQ, OUTBOUND_SEQ = 2, 3
"""Words of a rank's communicator record that count messages from and to it."""


class _Comm:
    """A communicator as read from exchange memory, with its matching key."""

    __slots__ = ("rank", "size", "sessions", "key")

    def __init__(self, record: xm.Communicator) -> None:
        self.rank, self.size = record.local_rank, len(record.ranks)
        self.sessions = tuple(r.session for r in record.ranks)
        self.key: Hashable = self.sessions  # the same group matches on every rank


class Engine:
    def __init__(self, device: SoftDevice) -> None:
        self.dev = device
        self._comms: dict[int, _Comm] = {}
        self._configs: dict[int, xm.ArithConfig] = {}
        self._paths: dict[tuple[int, int, int], Datapath] = {}
        self._send_seq: dict[tuple[Hashable, int], int] = {}
        self._coll_seq: dict[Hashable, int] = {}

    def forget_exchmem(self) -> None:
        """The host rewrote exchange memory: parse it again when next needed."""
        self._comms.clear()
        self._configs.clear()
        self._paths.clear()

    # -- exchange memory ------------------------------------------------------------

    def comm(self, address: int) -> _Comm:
        comm = self._comms.get(address)
        if comm is None:
            try:
                record = xm.Communicator.read(self.dev.mmio_read, address)
            except (ValueError, IndexError):
                raise CallFailed(ErrorCode.DMA_DECODE_ERROR) from None
            if not record.ranks or record.local_rank >= len(record.ranks):
                raise CallFailed(ErrorCode.DMA_DECODE_ERROR)
            comm = self._comms[address] = _Comm(record)
        return comm

    def datapath(self, args: CallArgs) -> Datapath:
        cfg = self._configs.get(args.arithcfg)
        if cfg is None:
            try:
                cfg = self._configs[args.arithcfg] = xm.ArithConfig.read(self.dev.mmio_read,
                                                                         args.arithcfg)
            except (ValueError, IndexError):
                raise CallFailed(ErrorCode.ARITH_ERROR) from None
        key = (args.arithcfg, args.compression_flags, args.function)
        path = self._paths.get(key)
        if path is None:
            try:
                path = self._paths[key] = Datapath(cfg, args.compression_flags, args.function)
            except UnsupportedConfig as unsupported:
                raise CallFailed(unsupported.code) from None
        return path

    def _peer(self, comm: _Comm, index: int) -> int:
        if index >= comm.size:
            raise CallFailed(ErrorCode.DMA_DECODE_ERROR)
        return comm.sessions[index]

    # -- submission -------------------------------------------------------------------

    def admit(self, args: CallArgs) -> Any:
        """Fix the call's place in the message order; runs in submission order."""
        try:
            scenario = args.scenario
            if scenario == Scenario.SEND:
                comm = self.comm(args.comm)
                slot = (comm.key, self._peer(comm, args.root_src_dst))
                seq = self._send_seq.get(slot, 0)
                self._send_seq[slot] = seq + 1
                self.count_message(args, OUTBOUND_SEQ)
                return seq
            if scenario == Scenario.RECV:
                comm = self.comm(args.comm)
                src = self._peer(comm, args.root_src_dst)
                return self.dev.inbox.post(("p2p", comm.key), src, args.tag)
            if scenario in COLLECTIVES:
                comm = self.comm(args.comm)
                seq = self._coll_seq.get(comm.key, 0)
                self._coll_seq[comm.key] = seq + 1
                return seq
        except CallFailed as failed:
            return failed
        return None

    def count_message(self, args: CallArgs, field: int) -> None:
        """Count a send or receive in the peer's record of the communicator, as the
        firmware does (the soft CCLO orders messages by its own counters; this is
        for the host, which reads the record back)."""
        word = (args.comm + 4 * (2 + xm.RankRecord.WORDS * args.root_src_dst + field)) // 4
        self.dev.exchmem[word] += 1

    def abandon(self, args: CallArgs, ticket: Any) -> None:
        """The call will never run: give back its place in the message order."""
        if args.scenario == Scenario.SEND and isinstance(ticket, int):
            self._send_tombstone(args, ticket)
        elif isinstance(ticket, PostedRecv):
            comm = self.comm(args.comm)
            self.dev.inbox.cancel(("p2p", comm.key), comm.sessions[args.root_src_dst], ticket)
        elif args.scenario in COLLECTIVES and isinstance(ticket, int):  # prefix of _Run._key
            self.dev.inbox.abandon_steps(("coll", self.comm(args.comm).key, ticket))

    def _send_tombstone(self, args: CallArgs, seq: int) -> None:
        comm = self.comm(args.comm)
        dst = comm.sessions[args.root_src_dst]
        self.dev.port.post(dst, Message(self.dev.session, ("p2p", comm.key), seq, args.tag,
                                        None, eager=True, tombstone=True))

    # -- execution --------------------------------------------------------------------

    def task(self, args: CallArgs, ticket: Any) -> Task:
        """The task that runs a dispatched call (CallFailed if it cannot run at all)."""
        try:
            if isinstance(ticket, CallFailed):
                raise ticket
            scenario = args.scenario
            if scenario in (Scenario.NOP, Scenario.CONFIG):
                return _Config(self, args) if scenario == Scenario.CONFIG else Task()
            if args.stream_flags:
                raise CallFailed(ErrorCode.COLLECTIVE_NOT_IMPLEMENTED)  # no kernel streams here
            if args.compression_flags & OPERAND_FLAGS \
                    and scenario not in (Scenario.COPY, Scenario.COMBINE):
                # compressed buffers (mixed precision) are modelled for copy and combine only
                raise CallFailed(ErrorCode.COMPRESSION_ERROR)
            if scenario == Scenario.SEND:
                return _SendTask(self, args, ticket)
            if scenario == Scenario.RECV:
                return _RecvTask(self, args, ticket)
            if scenario in (Scenario.COPY, Scenario.COMBINE):
                return _Run(self, args, None, 0, _plan(scenario, 0, 1, 0, args.count))
            if scenario in COLLECTIVES:
                comm = self.comm(args.comm)
                if scenario in (Scenario.BCAST, Scenario.SCATTER, Scenario.GATHER,
                                Scenario.REDUCE) and args.root_src_dst >= comm.size:
                    raise CallFailed(ErrorCode.DMA_DECODE_ERROR)
                return _Run(self, args, comm, ticket,
                            _plan(scenario, comm.rank, comm.size, args.root_src_dst, args.count))
            raise CallFailed(ErrorCode.COLLECTIVE_NOT_IMPLEMENTED)
        except CallFailed:
            self.abandon(args, ticket)  # its sequence number, posted receive, peers' steps
            raise

    def _config(self, args: CallArgs) -> int:
        dev, function = self.dev, args.function
        if function == ConfigFunction.RESET_PERIPH:
            dev.inbox.set_rx_pool(None)
        elif function == ConfigFunction.ENABLE_PKT:
            if dev.mmio_read(xm.CFGRDY) != 1:
                return int(ErrorCode.CONFIG_SWITCH_ERROR)
            dev.inbox.set_rx_pool(self._rx_pool())
        elif function == ConfigFunction.SET_TIMEOUT:
            dev.timeout = args.count / dev.timer_hz
        elif function == ConfigFunction.SET_MAX_EAGER_MSG_SIZE:
            if args.count > dev.mmio_read(xm.RX_BUF_SIZE) * dev.mmio_read(xm.NUM_RX_BUFS):
                return int(ErrorCode.EAGER_THRESHOLD_INVALID)
            dev.max_eager_size = args.count
        elif function == ConfigFunction.SET_MAX_RENDEZVOUS_MSG_SIZE:
            dev.max_rendezvous_size = args.count
        else:
            return int(ErrorCode.CONFIG_SWITCH_ERROR)
        return 0

    def _rx_pool(self) -> RxPool:
        dev = self.dev
        n, bufsize = dev.mmio_read(xm.NUM_RX_BUFS), dev.mmio_read(xm.RX_BUF_SIZE)
        records = [xm.RxBuffer.read(dev.mmio_read, xm.RX_RECORDS + 4 * xm.RxBuffer.WORDS * i)
                   for i in range(n)]
        views = [dev.memory.view(r.address, bufsize) for r in records]

        def mark(slot: int, status: int, msg: Message | None) -> None:
            base = (xm.RX_RECORDS + 4 * xm.RxBuffer.WORDS * slot) // 4
            dev.exchmem[base] = status
            if msg is not None:
                dev.exchmem[base + 3:base + 6] = (msg.tag, msg.nbytes, msg.src)

        return RxPool(views, bufsize, mark)



class _SendTask(Task):
    def __init__(self, engine: Engine, args: CallArgs, seq: int) -> None:
        self.engine, self.args, self.seq = engine, args, seq
        self.request: SendRequest | None = None

    def advance(self, blocking: bool, resume: Resume) -> None:
        engine, args, dev = self.engine, self.args, self.engine.dev
        if self.request is None:
            comm = engine.comm(args.comm)
            dst = engine._peer(comm, args.root_src_dst)
            path = engine.datapath(args)
            payload = path.to_wire(dev.array(args.addr_0, path.dtype, args.count))
            msg = Message(dev.session, ("p2p", comm.key), self.seq, args.tag,
                          payload.view(np.uint8), eager=payload.nbytes <= dev.max_eager_size)
            self.request = dev.port.post(dst, msg)
        if self.request is COMPLETED:
            return
        if not blocking:
            raise Escalate
        if not self.request.wait(time.monotonic() + dev.timeout):
            raise CallFailed(ErrorCode.DEQUEUE_BUFFER_TIMEOUT_ERROR)

    def finish(self, failed: bool) -> None:
        if self.request is None:
            self.engine._send_tombstone(self.args, self.seq)


class _RecvTask(Task):
    def __init__(self, engine: Engine, args: CallArgs, posted: PostedRecv) -> None:
        self.engine, self.args, self.posted = engine, args, posted
        comm = engine.comm(args.comm)
        self.src, self.key = comm.sessions[args.root_src_dst], ("p2p", comm.key)
        self.taken = False

    def advance(self, blocking: bool, resume: Resume) -> None:
        dev, args = self.engine.dev, self.args
        path = self.engine.datapath(args)
        dst = dev.array(args.addr_2, path.dtype, args.count)
        if blocking:
            try:
                msg = dev.inbox.take_posted(self.key, self.src, self.posted,
                                            time.monotonic() + dev.timeout)
            except PeerTimeout:
                raise CallFailed(ErrorCode.RECEIVE_TIMEOUT_ERROR) from None
        else:
            waiting = dev.inbox.take_posted_nowait(self.key, self.src, self.posted, resume)
            if waiting is None:
                raise Park
            msg = waiting
        self.taken = True
        self.engine.count_message(args, INBOUND_SEQ)
        try:
            data = dev.inbox.data(msg)
            if data.nbytes != args.count * path.wire.itemsize:
                raise CallFailed(ErrorCode.DMA_SIZE_ERROR)
            np.copyto(dst, data.view(path.wire), casting="unsafe")
        finally:
            dev.inbox.release(msg)

    def timed_out(self) -> bool:
        return self.engine.dev.inbox.unpark_posted(self.key, self.src, self.posted)

    def finish(self, failed: bool) -> None:
        if not self.taken:
            self.engine.dev.inbox.cancel(self.key, self.src, self.posted)


def _address(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


def _reads(step: Step) -> tuple[Local | Incoming, ...]:
    return (step.src,) if isinstance(step, (Send, Copy)) else (step.a, step.b)


class Plan:
    """A schedule and how far into each buffer slot it reaches (in elements)."""

    __slots__ = ("steps", "reach")

    def __init__(self, steps: list[Step]) -> None:
        self.steps = steps
        self.reach = [0, 0, 0]
        for step in steps:
            for loc in _reads(step) + (() if isinstance(step, Send) else (step.dst,)):
                if isinstance(loc, Local) and step.count:
                    self.reach[loc.slot] = max(self.reach[loc.slot], loc.offset + step.count)


@functools.lru_cache(maxsize=4096)
def _plan(scenario: int, rank: int, size: int, root: int, count: int) -> Plan:
    """Plans are pure and immutable: compute each one once."""
    return Plan(schedule(Scenario(scenario), rank, size, root, count))


class _Run(Task):
    """One call's schedule in progress on one rank."""

    def __init__(self, engine: Engine, args: CallArgs, comm: _Comm | None, seq: int,
                 plan: Plan) -> None:
        self.engine, self.dev, self.args, self.comm, self.seq = engine, engine.dev, args, comm, seq
        self.path = engine.datapath(args)
        self.addrs = (args.addr_0, args.addr_1, args.addr_2)
        self.itemsizes = self.path.itemsizes
        self.plan, self.pc = plan.steps, 0
        self.sending: list[tuple[int, int, SendRequest]] = []  # rendezvous payloads in our memory
        self.taken: dict[Incoming, Message] = {}  # messages the current step holds
        self.parked: Incoming | None = None
        self.saved: dict[tuple[Local, int], np.ndarray] = {}  # inputs as they were (in place)
        # each slot's elements as far as the plan reaches, resolved once
        self.reach = plan.reach
        self.views = [self.dev.array(address, dtype, n) if n else None
                      for address, dtype, n in zip(self.addrs, self.path.slots, plan.reach)]
        self._save_overwritten_inputs(plan.steps)

    def advance(self, blocking: bool, resume: Resume) -> None:
        self.blocking, self.resume = blocking, resume
        try:
            while self.pc < len(self.plan):
                step = self.plan[self.pc]
                if isinstance(step, Send):
                    self._send(step)
                elif isinstance(step, Copy):
                    self._apply([step.src], step.dst, step.count, self._copy)
                else:
                    self._apply([step.a, step.b], step.dst, step.count, self._combine)
                self.pc += 1
            if self.sending:
                if not blocking:
                    raise Escalate
                deadline = time.monotonic() + self.dev.timeout
                for _, _, request in self.sending:
                    if not request.wait(deadline):
                        raise CallFailed(ErrorCode.RECEIVE_TIMEOUT_ERROR)
                self.sending.clear()
        except PeerTimeout:
            raise CallFailed(ErrorCode.RECEIVE_TIMEOUT_ERROR) from None

    def timed_out(self) -> bool:
        parked, self.parked = self.parked, None
        return parked is not None and self.comm is not None and self.dev.inbox.unpark_step(
            self.comm.sessions[parked.peer], self._key(parked.tag))

    def finish(self, failed: bool) -> None:
        self._release()
        now = time.monotonic()
        for _, _, request in self.sending:  # withdraw what no peer has started on
            request.wait(now)
        if failed and self.comm is not None:
            self.engine.abandon(self.args, self.seq)  # peers' messages would fill rx buffers

    def _span(self, loc: Local, count: int) -> tuple[int, int]:
        itemsize = self.itemsizes[loc.slot]
        start = self.addrs[loc.slot] + loc.offset * itemsize
        return start, start + count * itemsize

    def _save_overwritten_inputs(self, steps: list[Step]) -> None:
        """In place (buffers of two slots overlap), a step may read an input that an
        earlier step overwrote through the other slot, e.g. a rank's own contribution
        to a reduction folded in rank order: keep a copy of such inputs for it."""
        spans = [(a, a + n * size) for a, n, size in zip(self.addrs, self.reach, self.itemsizes)
                 if n]
        if not any(a0 < b1 and b0 < a1 for i, (a0, a1) in enumerate(spans)
                   for b0, b1 in spans[i + 1:]):
            return  # not in place: the buffers the plan uses are apart
        uses = [(step.count, [op for op in _reads(step) if isinstance(op, Local)],
                 None if isinstance(step, Send) else step.dst) for step in steps if step.count]
        written: list[tuple[Local, int, int]] = []
        for count, reads, write in uses:
            for loc in reads:
                start, end = self._span(loc, count)
                if any(w != loc and ws < end and start < we for w, ws, we in written):
                    self.saved[(loc, count)] = self._local(loc, count).copy()
            if write is not None:
                written.append((write, *self._span(write, count)))

    def _read(self, loc: Local, count: int) -> np.ndarray:
        saved = self.saved.get((loc, count))
        return self._local(loc, count) if saved is None else saved

    @staticmethod
    def _copy(src: list[np.ndarray], dst: np.ndarray) -> None:
        data = src[0]
        if np.shares_memory(data, dst):
            if data.dtype == dst.dtype and _address(data) == _address(dst):
                return  # in place: the elements are where they belong
            # overlapping, shifted or converted (a compressed slot): numpy does not
            # convert overlapping arrays in a safe order, so read everything first
            data = data.copy()
        np.copyto(dst, data, casting="unsafe")

    def _combine(self, ab: list[np.ndarray], dst: np.ndarray) -> None:
        self.path.combine(ab[0], ab[1], dst)

    def _apply(self, operands: list[Local | Incoming], loc: Local, count: int,
               fn: Callable[[list[np.ndarray], np.ndarray], None]) -> None:
        arrays = [self._operand(op, count) for op in operands]
        start, end = self._span(loc, count)
        busy = [entry for entry in self.sending if entry[0] < end and start < entry[1]]
        if busy and not self.blocking:
            raise Escalate
        if busy:
            # A peer still reads what we would overwrite. Let go of what we took from
            # peers first (they may be waiting for that before reading ours).
            arrays = [a.copy() if isinstance(op, Incoming) else a for a, op in zip(arrays, operands)]
            self._release()
            deadline = time.monotonic() + self.dev.timeout
            for entry in busy:
                if not entry[2].wait(deadline):
                    raise CallFailed(ErrorCode.RECEIVE_TIMEOUT_ERROR)
                self.sending.remove(entry)
        fn(arrays, self._local(loc, count))
        self._release()

    def _local(self, loc: Local, count: int) -> np.ndarray:
        view = self.views[loc.slot]
        if view is None:
            return np.empty(0, self.path.slots[loc.slot])
        return view[loc.offset:loc.offset + count]

    def _key(self, tag: int) -> Key:
        assert self.comm is not None
        return ("coll", self.comm.key, self.seq, self.args.scenario, tag)

    def _operand(self, op: Local | Incoming, count: int) -> np.ndarray:
        if isinstance(op, Local):
            return self._read(op, count)
        assert self.comm is not None
        msg = self.taken.get(op)
        if msg is None:
            src, key = self.comm.sessions[op.peer], self._key(op.tag)
            if self.blocking:
                msg = self.dev.inbox.take_step(src, key, time.monotonic() + self.dev.timeout)
            else:
                msg = self.dev.inbox.take_step_nowait(src, key, self.resume)
                if msg is None:
                    self.parked = op
                    raise Park
            self.taken[op] = msg
        data = self.dev.inbox.data(msg)
        if data.nbytes != count * self.path.wire.itemsize:
            raise CallFailed(ErrorCode.DMA_SIZE_ERROR)
        return data.view(self.path.wire)

    def _release(self) -> None:
        while self.taken:
            self.dev.inbox.release(self.taken.popitem()[1])

    def _send(self, step: Send) -> None:
        assert self.comm is not None
        data = self._read(step.src, step.count)
        payload = self.path.to_wire(data)
        msg = Message(self.dev.session, self._key(step.tag), self.seq, step.tag,
                      payload.view(np.uint8), eager=payload.nbytes <= self.dev.max_eager_size)
        request = self.dev.port.post(self.comm.sessions[step.peer], msg)
        if request is not COMPLETED:
            start, end = self._span(step.src, step.count)
            if payload is not data or (step.src, step.count) in self.saved:
                end = start  # a copy is ours alone: no peer reads our memory
            self.sending.append((start, end, request))
