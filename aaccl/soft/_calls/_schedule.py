"""copy, combine and the collectives: a `ScheduleCall` runs the steps its algorithm
plans for this rank (`algorithms.schedule`): sends, copies and reductions, reading
its peers' messages as they come, saving in-place inputs that a step overwrites."""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator
from typing import Any

import numpy as np

from ..._constants import ErrorCode, Scenario
from ..._errors import Aborted
from .._datapath import Datapath
from .._engine import Wait
from ..algorithms import SMALL_ALLREDUCE_COUNT, Copy, Incoming, Local, Send, Step, schedule
from ..fabric import Fingerprint, Key, Message, MessageState
from ..fabric import _blocks as blocks
from ..fabric._inbox import mismatch
from ..fabric._lane import Lane, Matched, Op, runs_natively, transfer
from ..fabric._message import describe
from ._state import (COLLECTIVES, MISMATCH, OFFLOAD_BYTES, RECEIVE_TIMEOUT, REDUCING, ROOTED,
                     SIZE_MISMATCH, Body, CallFailed, Comm, SoftCall, check_compression,
                     describe_call)


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


_ROOT_RECEIVES = frozenset({Scenario.GATHER, Scenario.REDUCE})
"""Collectives whose root sends nothing: nothing of its call reaches its peers."""


class _Sending:
    """A payload of ours a peer reads in place: [start, end) of device memory."""

    __slots__ = ("start", "end", "handover")

    def __init__(self, start: int, end: int, handover: Wait) -> None:
        self.start, self.end, self.handover = start, end, handover


class ScheduleCall(SoftCall):
    """copy, combine and the collectives: a schedule of sends, copies and reductions."""

    __slots__ = ("comm", "seq", "path", "addrs", "itemsizes", "views", "sending", "taken",
                 "saved", "prefix", "met", "fp", "quiet", "lane", "op", "lane_index")

    def prepare(self) -> None:
        args, dev = self.args, self.dev
        self.comm: Comm | None = None
        self.prefix: Key | None = None
        self.seq = 0
        self.met = False
        self.fp: Fingerprint | None = None
        self.quiet = False  # its failure came from a peer, which has told the others
        self.lane: Lane | None = None
        self.op: Op | None = None  # its place among the collectives MPI runs
        if args.scenario in COLLECTIVES:
            self.comm = comm = dev.comm(args.comm)
            self.seq = dev.inbox.admit(comm.key)
            self.prefix = ("coll", comm.key, self.seq)
            lane = getattr(dev.port, "lane", None)
            if lane is not None and not args.stream_flags:
                self.lane = lane(comm.key)
            try:
                if args.scenario in ROOTED and args.root_src_dst >= comm.size:
                    raise CallFailed(ErrorCode.DMA_DECODE_ERROR)
                path = dev.datapath(args)
            except CallFailed as failed:  # it can never run: it takes its turn at once
                roll_call = getattr(dev.port, "roll_call", None)  # (it counts all the same)
                if roll_call is not None and comm.size > 1:
                    roll_call(self.prefix, comm.size, dev.session, None)
                if self.lane is not None:
                    self.op = self.lane.admit()
                    self.lane_index = self.op.index
                    self._leave_lane(failed.code, failed.detail)
                raise
            scenario = Scenario(args.scenario)
            self.fp = (int(scenario), None if scenario == Scenario.BARRIER else args.count,
                       path.dtype.str, path.wire.str,
                       args.root_src_dst if scenario in ROOTED else None,
                       args.function if scenario in REDUCING else None, comm.size)
            if self.lane is not None:  # (its fingerprint first: see Lane._pump)
                self.op = self.lane.admit(self.fp)
                self.lane_index = self.op.index
            self._join(comm)
        if args.stream_flags:
            rank, size = (0, 1) if self.comm is None else (self.comm.rank, self.comm.size)
            self.use_streams(size, args.root_src_dst == rank or args.scenario not in ROOTED)
        check_compression(args)

    def describe(self) -> str:
        fp = getattr(self, "fp", None)
        return describe_call(self.args) if fp is None else describe(fp)

    def _join(self, comm: Comm) -> None:
        """Check our call against the peers' calls of this collective (fingerprints
        in their messages), now and as their messages come."""
        assert self.prefix is not None and self.fp is not None
        failure = self.dev.inbox.join(self.prefix, self.dev.session, self.fp,
                                      self._peer_failed)
        roll_call = getattr(self.dev.port, "roll_call", None)  # in process: all at once
        if roll_call is not None and comm.size > 1:
            differs = roll_call(self.prefix, comm.size, self.dev.session, self.fp)
            if failure is None and differs is not None:
                failure = (*differs, False)
        if failure is not None:
            code, why, notified = failure
            self.quiet = notified
            if not code:  # a peer's call was aborted, or it rejected its call
                self.failure_error = Aborted(why)
                code = MISMATCH  # (the call ends with `failure_error`)
            raise CallFailed(code, why)

    def _peer_failed(self, code: int, why: str, notified: bool) -> None:
        """Inbox: a peer's call of our collective failed (`notified`) or does not
        match ours: so does ours, at once (as an event: we may be inside a send)."""
        self.quiet = self.quiet or notified
        if code:
            self.dev.engine.soon(self.fail_now, CallFailed(code, why))
        else:  # the peer's call was aborted: ours is too
            self.dev.engine.soon(self.fail_now, CallFailed(MISMATCH, why), Aborted(why))

    def abandon(self) -> None:
        if self.aborting is not None:
            self._leave_lane(0, str(self.aborting))
        elif self.failure:
            self._leave_lane(self.failure, self.failure_detail)
        if getattr(self, "prefix", None) is None:
            return
        assert self.comm is not None
        if self._meets() and not self.met:  # the others must not wait for us
            self.met = True
            self.dev.port.meeting(self.prefix, self.comm.size).leave(self.comm.rank, False)
        self.dev.inbox.abandon_steps(self.prefix)  # peers' messages would fill rx buffers

    def abort(self) -> None:
        why = "it did not run: a call it waits for failed" if self.aborting is None \
            else str(self.aborting)
        self._tell_peers(0, why)
        self._leave_lane(0, why)
        super().abort()

    def finish(self, retcode: int, detail: str | None = None) -> None:
        if getattr(self, "prefix", None) is not None:
            self.dev.inbox.leave(self.prefix)
        if self.aborting is not None:
            self._tell_peers(0, str(self.aborting))
        elif retcode or self.failure:
            code, why = (retcode, detail) if retcode else (self.failure, self.failure_detail)
            self._tell_peers(code, why)
        super().finish(retcode, detail)

    def _tell_peers(self, code: int, why: str | None) -> None:
        """Our call of a collective failed: tell every other member, so that theirs
        fail at once (or as soon as they make it) instead of timing out."""
        prefix, comm = getattr(self, "prefix", None), self.comm
        if prefix is None or comm is None:
            return
        self.dev.inbox.leave(prefix)
        if self.quiet or comm.size == 1 or self.dev.aborted is not None:
            return
        self.quiet = True
        me, notice = self.dev.session, self._notice(code, why)
        for peer in comm.sessions:
            if peer != me:
                msg = Message(me, ("abort", comm.key, self.seq), self.seq, 0, None, eager=True)
                msg.notice = (code, notice)
                self.dev.port.post(peer, msg, 0)

    def waiting_for(self, wait: Wait) -> str:
        if isinstance(wait, Matched):
            peers = self.peers_waited(wait)
            who = f"rank{'s' if len(peers) > 1 else ''} {', '.join(map(str, peers))}"
            stage = "allgather that opens" if wait is getattr(self.op, "opening", None) \
                else "collective that moves the data of"
            return (f"MPI's {stage} the collective with {who}"
                    + (" (MPI does not say which of them is missing)" if len(peers) > 1 else ""))
        return super().waiting_for(wait)

    def _notice(self, code: int, why: str | None) -> str:
        """Our call's failure, in words for its peers."""
        desc = self.describe()
        if code in (MISMATCH, SIZE_MISMATCH) and why:
            return why  # names both sides already
        if code:
            names = ", ".join(ErrorCode(code).names())
            return f"rank {self.dev.session}'s {desc} failed ({names})" + (f": {why}" if why else "")
        return f"rank {self.dev.session}'s {desc} was aborted: {why}"

    def peers_waited(self, wait: Wait) -> list[int]:
        if isinstance(wait, Matched) and self.comm is not None:
            # every other member, but one that left after its part of this collective
            index, gone = self.lane_index, self.dev.gone_lane
            return [s for s in self.comm.sessions
                    if s != self.dev.session and not index < gone.get(s, 0)]
        sources = getattr(wait, "sources", None)
        if sources is not None:
            return sources()
        missing = getattr(wait, "missing", None)
        if missing is not None and self.comm is not None:
            return [self.comm.sessions[r] for r in missing()]
        dst = getattr(wait, "dst", None)  # over MPI: a payload a peer is to take
        return [] if dst is None else [dst]

    # -- collectives MPI runs (over MPI, the world's communicator) ----------------------

    def _by_mpi(self) -> Generator[Wait, Any, bool]:
        """Take our turn in the lane: the opening exchange, then (if the data did not
        ride in it) MPI's collective moves it. False: MPI cannot, the schedule must."""
        args, dev, comm, op, lane, fp = self.args, self.dev, self.comm, self.op, self.lane, self.fp
        assert comm is not None and op is not None and lane is not None and fp is not None
        path = dev.datapath(args)
        reach = _plan(args.scenario, comm.rank, comm.size, args.root_src_dst, args.count).reach
        op0, _, res = (dev.array(address, path.dtype, n) if n else None
                       for address, n in zip((args.addr_0, args.addr_1, args.addr_2), reach))
        inline = blocks.fits(fp)
        if not op.issued:  # (else it took its turn while pending: the schedule runs it)
            block = np.empty(blocks.BLOCK, np.uint8)
            mine = blocks.share(fp, comm.rank)
            blocks.encode(block, fp, op0[:mine] if inline and mine and op0 is not None else None)
            moves = None
            if not inline and runs_natively(fp):
                moves = transfer(lane.comm, fp, comm.rank, op0, res)
            lane.start(op, block, moves)
        try:
            why = op.turn.value if op.turn.done else (yield op.turn)
            if isinstance(why, Aborted):  # a peer left the world: it never runs
                raise CallFailed(RECEIVE_TIMEOUT, str(why), error=why)
            if why:
                raise CallFailed(RECEIVE_TIMEOUT, why)
            opened = op.opening.value if op.opening.done else (yield op.opening)
            if isinstance(opened, Aborted):
                raise CallFailed(RECEIVE_TIMEOUT, str(opened), error=opened)
        except CallFailed as failed:
            if not self.failure and self.aborting is None and failed.code == RECEIVE_TIMEOUT:
                self._leave_lane(failed.code, failed.detail, timed_out=True)
            raise
        if isinstance(opened, str):
            raise CallFailed(ErrorCode.DMA_INTERNAL_ERROR, f"MPI failed: {opened}")
        gathered, agreed, moving = opened
        if not agreed:  # fails, or some rank's call was pending: the schedule runs it
            self._verdict(blocks.read(gathered, comm.size))
            return False
        if inline:
            blocks.settle(fp, comm.rank, gathered, op0, res, path.combine)
            return True
        if not moving:
            return False
        error = op.moved.value if op.moved.done else (yield op.moved)
        if isinstance(error, Aborted):
            raise CallFailed(RECEIVE_TIMEOUT, str(error), error=error)
        if error:
            raise CallFailed(ErrorCode.DMA_INTERNAL_ERROR, f"MPI failed: {error}")
        return True

    def _verdict(self, exchanged: list[blocks.Block]) -> None:
        """Fail our call as every rank does, from the same blocks (which do not all
        `agree`): a peer's call did not run, or does not match ours. Return if they
        only say that some rank's call was pending (every rank's runs, later)."""
        comm, fp = self.comm, self.fp
        assert comm is not None and fp is not None
        for k, block in enumerate(exchanged):
            if block.state not in (blocks.RUNS, blocks.PENDING) and k != comm.rank:
                self.quiet = True  # the peer told everyone, in its block
                why = block.why
                if block.state == blocks.ABORTED:
                    raise CallFailed(MISMATCH, why, error=Aborted(why))
                raise CallFailed(block.code, why)
        for k, block in enumerate(exchanged):
            if block.fp != fp:
                self.quiet = True  # every rank sees the same mismatch
                raise CallFailed(*mismatch(fp, block.fp, self.dev.session, comm.sessions[k]))
        if any(block.state == blocks.PENDING for block in exchanged):
            return
        raise CallFailed(ErrorCode.DMA_INTERNAL_ERROR, "the opening's blocks disagree, "
                         "yet every rank's call runs, as ours does")

    def _leave_lane(self, code: int, why: str | None, timed_out: bool = False) -> None:
        """Our call ends before its turn in the lane is over: it still takes its
        turn, with a block that says why (MPI must see the same collectives on every
        rank); if its opening is in flight and we gave up on the peers, the calls
        queued behind it fail at once."""
        op, lane, comm = self.op, self.lane, self.comm
        if op is None or lane is None or comm is None:
            return
        self.op = None
        if not op.issued:
            fp = self.fp or (self.args.scenario, self.args.count, "", "", None, None, comm.size)
            block = np.empty(blocks.BLOCK, np.uint8)
            blocks.encode(block, fp, state=blocks.FAILED if code else blocks.ABORTED,
                          code=code, why=self._notice(code, why))
            lane.withdraw(op, block)
        elif timed_out and not op.opening.done:
            lane.abandoned(op, f"it was queued behind rank {self.dev.session}'s "
                               f"{self.describe()}, which gave up on its peers while MPI "
                               "still matched it (it fails until they come)")

    def _meets(self) -> bool:
        """In process, a small allreduce meets its peers in shared memory."""
        args, comm = self.args, self.comm
        return (args.scenario == Scenario.ALLREDUCE and comm is not None and comm.size > 1
                and args.count <= SMALL_ALLREDUCE_COUNT and not args.compression_flags
                and hasattr(self.dev.port, "meeting"))

    def _meet(self) -> Body:
        args, dev, comm, prefix = self.args, self.dev, self.comm, self.prefix
        assert comm is not None and prefix is not None
        path = dev.datapath(args)
        src = dev.array(args.addr_0, path.dtype, args.count)
        dst = dev.array(args.addr_2, path.dtype, args.count)

        def compute(contributions: list[tuple[np.ndarray, np.ndarray, Datapath]]) -> int:
            # every rank's fingerprint equals the first's (meeting.check): same count, dtype
            total = contributions[0][0].copy()
            for s, _, _ in contributions[1:]:  # folded in rank order, as the schedules do
                path.combine(total, s, total)
            for _, d, _ in contributions:
                d[...] = total
            return 0

        meeting = dev.port.meeting(prefix, comm.size)
        assert self.fp is not None
        conflict = meeting.check(dev.session, self.fp)
        if conflict is not None:
            self.abandon()
            raise CallFailed(*conflict)
        self.met = True
        seat = meeting.arrive(comm.rank, (src, dst, path), compute)
        retcode = seat.value if seat.done else (yield seat)
        if retcode:
            raise CallFailed(retcode)

    def run(self) -> Body:
        args, dev, comm = self.args, self.dev, self.comm
        if self._meets():
            yield from self._meet()
            return
        if self.op is not None:
            try:
                done = yield from self._by_mpi()
            except BaseException:
                self.abandon()
                raise
            if done:
                return
        elif args.scenario in _ROOT_RECEIVES and comm is not None and comm.size > 1 \
                and comm.rank == args.root_src_dst and self.lane is None \
                and not hasattr(dev.port, "roll_call"):
            self._announce()
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
                dev.streams.emit(self.views[2], 0)
        except BaseException:
            self._release()
            for sending in self.sending:  # withdraw what no peer has started on
                if not sending.handover.done:
                    sending.handover.expire()
            self.abandon()
            raise
        self.sending.clear()

    def _announce(self) -> None:
        """A gather's or reduce's root only receives: over MPI, where no roll call or
        opening compares the members' calls, tell them ours, so that a rank that takes
        another for the root fails at once, as in process, and no rank waits out its
        timeout in a collective that its peers have left for the next one."""
        comm, dev = self.comm, self.dev
        assert comm is not None
        for peer in comm.sessions:
            if peer != dev.session:
                msg = Message(dev.session, ("fp", comm.key, self.seq), self.seq, 0, None,
                              eager=True)
                msg.fp = self.fp
                dev.port.post(peer, msg, 0)

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
