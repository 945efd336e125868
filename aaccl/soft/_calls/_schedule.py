"""copy, combine and the collectives: a `ScheduleCall` runs the steps its algorithm
plans for this rank (`algorithms.schedule`): sends, copies and reductions, reading
its peers' messages as they come, saving in-place inputs that a step overwrites."""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator
from typing import Any

import numpy as np

from ..._constants import ErrorCode, Scenario
from .._engine import Wait
from ..algorithms import Copy, Incoming, Local, Send, Step, schedule
from ..fabric import Key, Message, MessageState
from ..fabric._inbox import mismatch
from ._collective import CollectiveCall
from ._state import OFFLOAD_BYTES, RECEIVE_TIMEOUT, Body, CallFailed


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


class _Sending:
    """A payload of ours a peer reads in place: [start, end) of device memory."""

    __slots__ = ("start", "end", "handover")

    def __init__(self, start: int, end: int, handover: Wait) -> None:
        self.start, self.end, self.handover = start, end, handover


class ScheduleCall(CollectiveCall):
    """copy, combine and the collectives: a schedule of sends, copies and reductions."""

    __slots__ = ("addrs", "itemsizes", "views", "sending", "taken", "saved")

    addrs: tuple[int, ...]  # each slot's address (one of its own for a slot on a stream)

    def run(self) -> Body:
        args, dev, comm = self.args, self.dev, self.comm
        if self.way is not None and (yield from self.way.run(self)):
            return  # the fabric ran it
        plan = _plan(args.scenario, 0 if comm is None else comm.rank,
                     1 if comm is None else comm.size, args.root_src_dst, args.count)
        self.path = path = dev.datapath(args)
        self.addrs = (args.addr_0, args.addr_1, args.addr_2)
        self.itemsizes = path.itemsizes
        self.sending: list[_Sending] = []
        self.taken: dict[Incoming, Message] = {}
        self.saved: dict[tuple[Local, int], np.ndarray] = {}
        on_stream = (self.op0_stream, False, self.res_stream)
        self.views = [dev.array(address, dtype, n) if n and not streamed else None
                      for address, dtype, n, streamed
                      in zip(self.addrs, path.slots, plan.reach, on_stream)]
        if self.op0_stream or self.res_stream:
            # a slot on a stream is memory of its own: an address range no buffer has
            self.addrs = tuple(-(1 + slot) << 56 if streamed else address for slot,
                               (address, streamed) in enumerate(zip(self.addrs, on_stream)))
        if self.res_stream:
            self.views[2] = np.empty(plan.reach[2], path.slots[2])
        try:
            if self.op0_stream:  # one move reads the whole operand
                raw = yield from self.read_stream([plan.reach[0] * path.itemsizes[0]])
                self.views[0] = raw.view(path.slots[0])
            self._save_overwritten_inputs(plan.steps, plan.reach)
            for step in plan.steps:
                if isinstance(step, Send):
                    self._send(step)
                elif isinstance(step, Copy):
                    yield from self._apply((step.src,), step.dst, step.count, self._copy)
                else:
                    yield from self._apply((step.a, step.b), step.dst, step.count,
                                           self._combine)
            for sending in self.sending:
                if not sending.handover.done \
                        and (yield sending.handover) is MessageState.WITHDRAWN:
                    raise self.withdrawn(sending.handover)
            if self.res_stream:  # the result goes out as one packet, tag 0
                assert self.views[2] is not None
                dev.streams.emit(self.views[2], 0)
        except BaseException:
            self._release()
            for sending in self.sending:  # withdraw what no peer has started on
                if not sending.handover.done:
                    sending.handover.expire()
            self.abandon()
            self._drop()
            raise
        self.sending.clear()
        self._drop()

    def _drop(self) -> None:
        """The schedule ended: let go of its views of device memory and saved inputs
        (the call lives on as its Call's device call, for as long as the user keeps it)."""
        self.views, self.saved = [], {}

    def reach(self) -> list[int]:
        """How far the call's schedule reaches into each buffer slot, in elements."""
        args, comm = self.args, self.comm
        assert comm is not None
        return _plan(args.scenario, comm.rank, comm.size, args.root_src_dst, args.count).reach

    def _span(self, loc: Local, count: int) -> tuple[int, int]:
        itemsize = self.itemsizes[loc.slot]
        start = self.addrs[loc.slot] + loc.offset * itemsize
        return start, start + count * itemsize

    def _save_overwritten_inputs(self, steps: list[Step], reach: list[int]) -> None:
        """In place (buffers of two slots overlap), a step may read an input that an
        earlier step overwrote through the other slot, e.g. a rank's own contribution
        to a reduction folded in rank order: keep a copy of such inputs for it."""
        spans = [(a, a + n * size) for a, n, size in zip(self.addrs, reach, self.itemsizes) if n]
        if not any(a0 < b1 and b0 < a1 for i, (a0, a1) in enumerate(spans)
                   for b0, b1 in spans[i + 1:]):
            return  # not in place: the buffers the plan uses are apart
        written: list[tuple[Local, int, int]] = []
        for step in steps:
            if not step.count:
                continue
            for loc in _reads(step):
                if isinstance(loc, Local):
                    start, end = self._span(loc, step.count)
                    if any(w != loc and ws < end and start < we for w, ws, we in written):
                        self.saved[(loc, step.count)] = self._local(loc, step.count).copy()
            if not isinstance(step, Send):
                written.append((step.dst, *self._span(step.dst, step.count)))

    def _read(self, loc: Local, count: int) -> np.ndarray:
        saved = self.saved.get((loc, count))
        return self._local(loc, count) if saved is None else saved

    def _local(self, loc: Local, count: int) -> np.ndarray:
        view = self.views[loc.slot]
        if view is None:
            assert self.path is not None  # (set by `run`, as the views are)
            return np.empty(0, self.path.slots[loc.slot])
        return view[loc.offset:loc.offset + count]

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
        assert self.path is not None
        self.path.combine(ab[0], ab[1], dst)

    def _apply(self, operands: tuple[Local | Incoming, ...], loc: Local, count: int,
               fn: Callable[[list[np.ndarray], np.ndarray], None]) -> Body:
        arrays = []
        for op in operands:
            arrays.append((yield from self._operand(op, count)))
        start, end = self._span(loc, count)
        busy = [s for s in self.sending if s.start < end and start < s.end]
        if busy:
            # A peer still reads what we would overwrite. Let go of what we took from
            # peers first (they may be waiting for that before reading ours).
            arrays = [a.copy() if isinstance(op, Incoming) else a
                      for a, op in zip(arrays, operands)]
            self._release()
            for sending in busy:
                if not sending.handover.done \
                        and (yield sending.handover) is MessageState.WITHDRAWN:
                    raise self.withdrawn(sending.handover)
                self.sending.remove(sending)
        out = self._local(loc, count)
        if out.nbytes >= OFFLOAD_BYTES:
            error = yield self.dev.engine.offload(lambda: fn(arrays, out))
            if error is not None:
                raise error
        else:
            fn(arrays, out)
        self._release()

    def _key(self, tag: int) -> Key:
        assert self.prefix is not None
        return self.prefix + (self.args.scenario, tag)

    def _operand(self, op: Local | Incoming, count: int) -> Generator[Wait, Any, np.ndarray]:
        if isinstance(op, Local):
            return self._read(op, count)
        assert self.comm is not None
        msg = self.taken.get(op)
        if msg is None:
            wait = self.dev.inbox.expect_step(self.comm.sessions[op.peer], self._key(op.tag))
            msg = wait.value if wait.done else (yield wait)
            self.taken[op] = msg
            if msg.fp is not None and msg.fp != self.fp:  # never compute with it
                assert self.fp is not None
                raise CallFailed(*mismatch(self.fp, msg.fp, self.dev.session, msg.src))
        data = self.dev.inbox.data(msg)
        assert self.path is not None
        if data.nbytes != count * self.path.wire.itemsize:
            raise CallFailed(ErrorCode.DMA_SIZE_ERROR)
        return data.view(self.path.wire)

    def _release(self) -> None:
        while self.taken:
            self.dev.inbox.release(self.taken.popitem()[1])

    def _send(self, step: Send) -> None:
        assert self.comm is not None
        dev = self.dev
        data = self._read(step.src, step.count)
        assert self.path is not None
        payload = self.path.to_wire(data)
        msg = Message(dev.session, self._key(step.tag), self.seq, step.tag,
                      payload.view(np.uint8), eager=payload.nbytes <= dev.max_eager_size)
        msg.fp = self.fp
        handover = dev.port.post(self.comm.sessions[step.peer], msg, RECEIVE_TIMEOUT)
        if handover is not None:
            start, end = self._span(step.src, step.count)
            if payload is not data or (step.src, step.count) in self.saved:
                end = start  # a copy is ours alone: no peer reads our memory
            self.sending.append(_Sending(start, end, handover))
