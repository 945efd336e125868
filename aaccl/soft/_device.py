"""The soft CCLO: a software model of ACCL's CCLO that implements `Device`.

It keeps its own exchange memory and device memory (so a missing host sync shows
stale data, as on hardware) and honours `waitfor` itself (a dependent call starts
when its dependencies complete, with no host round trip). Its calls run on its
fabric's progress engine (`_engine`); their life is in `_calls`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from .. import _exchmem as xm
from .._constants import ConfigFunction, ErrorCode, Scenario
from .._errors import Aborted, DeviceError
from ..devices import CallArgs, Device, DeviceCall
from ..devices._jobs import HostJobs, Job
from ._calls import KINDS, CallFailed, Comm, SoftCall, make_call
from ._calls._state import SUBMITTED, describe_call
from ._datapath import Datapath, UnsupportedConfig
from ._engine import Alarm
from ._memory import DeviceMemory
from ._streams import StreamKernel, StreamPorts
from .fabric import Collective, Fingerprint, Message, Port, RxPool
from .fabric._message import describe

VIEWS_KEPT = 1024
"""Views of device memory a soft CCLO keeps for its calls (see `SoftDevice.array`)."""
DECODED_KEPT = 1024
"""Distinct collective arguments whose decoding a soft CCLO keeps (`remember`)."""
Decoded = tuple[Comm, Datapath, Fingerprint, Collective | None]
"""What a collective's arguments decode to (see `SoftDevice.remember`)."""
RETCODE = xm.RETCODE
NOP = int(Scenario.NOP)  # (a global: a member looked up on its enum costs five times as much)
HWID = 0x0000_00F8  # reduction, compression and stream bits as ACCL's driver reads them


class SoftDevice(Device):
    """One rank's soft CCLO. `in_order=True` runs its calls strictly one at a time in
    submission order, ready or not, as ACCL's firmware does."""

    timer_hz = 1_000_000  # SET_TIMEOUT counts microseconds

    def __init__(self, session: int, port: Port, *, in_order: bool = False) -> None:
        self.session, self.port = session, port
        self.inbox, self.engine = port.inbox, port.engine
        # the deadlines of its calls' waits: a dict entry each, under one engine timer
        self.alarm = Alarm(self.engine, _expire)
        self.poller = port.poller  # see ACCL._poller
        self.in_order = in_order
        self.exchmem = np.zeros(xm.SIZE // 4, np.uint32)
        self.exchmem[xm.HWID // 4] = HWID
        # the RETCODE register, where each call leaves its return code: a word of
        # exchange memory kept as an int (`mmio_read`), which costs a call's end a
        # quarter of what a store into the array does
        self.retcode = 0
        self.memory = DeviceMemory()
        # views of device memory its calls made (and tuples of them), by what they are
        # made of: kept (see `array`) until memory is freed
        self.views: dict[Hashable, Any] = {}
        self.timeout = 1.0
        self.max_eager_size = 0
        self.max_rendezvous_size = 0
        self._comms: dict[int, Comm] = {}
        self._configs: dict[int, xm.ArithConfig] = {}
        self._paths: dict[tuple[int, int, int], Datapath] = {}
        self.decoded: dict[tuple[int, ...], Decoded] = {}
        self._send_seq: dict[tuple[Hashable, int], int] = {}
        self.queue: deque[SoftCall] = deque()  # in order: calls admitted, not ended; head runs
        self.calls: dict[SoftCall, None] = {}  # admitted, not finished (in order)
        self._jobs = HostJobs(f"soft-cclo-{session}")
        self.streams = StreamPorts(self._jobs.run, self.engine.post)
        self.closed = False
        self.last: CallArgs | None = None  # the last call admitted (for `activity`)
        self.gone: dict[int, str] = {}  # peers (sessions) that left the world, and why
        port.watch(lambda: bool(self.calls))  # (the MPI fabric naps while we have no calls)
        self.gone_lane: dict[int, int] = {}  # ... and how far MPI ran their collectives
        # aborted whole: failing calls send no notices, and later ones fail at once
        self.aborted: Aborted | None = None
        self.inbox.on_leave = self._peer_left
        self.inbox.on_stray = self._stray
        port.register(self.activity)
        self.engine.attach()
        self.engine.post(self.inbox.stream_to, self._put_arrived)

    def activity(self, key: Hashable | None = None) -> str:
        """What this CCLO is doing, for a peer's error message (engine context). In
        order, where its call of the peer's collective `key` (a prefix) waits in line
        behind another call, that call: the one to look at."""
        calls = list(self.calls)
        if not calls:
            last = "" if self.last is None else f" (its last: {describe_call(self.last)})"
            return "has no call outstanding" + last
        queue = self.queue
        if self.in_order and queue:
            head = queue[0]
            if key is not None:
                mine = next((c for c in queue if c.prefix == key), None)
                if mine is not None and mine is not head:
                    ahead = queue.index(mine)
                    others = f" and {ahead - 1} more" if ahead > 1 else ""
                    return (f"has its call of it, {mine.describe()}, queued behind "
                            f"{head.describe()}{head.where()}{others} (in_order: a rank "
                            "runs one call at a time, in the order it issued them, as on a "
                            "card)")
            behind = len(queue) - 1
            return (f"runs {head.describe()}{head.where()}" + (
                f", {behind} more queued behind it (in_order)" if behind else ""))
        listed = ", ".join(c.describe() for c in calls[:3])
        more = f" and {len(calls) - 3} more" if len(calls) > 3 else ""
        return f"is in {listed}{more}"

    # -- exchange memory and device memory ----------------------------------------

    def mmio_read(self, offset: int) -> int:
        if offset == RETCODE:
            return self.retcode
        return int(self.exchmem[self._word(offset)])

    def mmio_write(self, offset: int, value: int) -> None:
        word = self._word(offset)
        self.exchmem[word] = value
        if offset == RETCODE:
            self.retcode = int(self.exchmem[word])
        self._comms.clear()  # parse exchange memory again when next needed
        self._configs.clear()
        self._paths.clear()
        self.decoded.clear()

    def remember(self, args: CallArgs, decoded: Decoded) -> None:
        """What a collective's arguments decode to (`decoded`, keyed by all but its
        addresses: its communicator, datapath, fingerprint, and its fabric's part if
        that is `Collective.shared`), so that calls with the same arguments skip
        decoding them; kept until exchange memory is written."""
        if len(self.decoded) >= DECODED_KEPT:
            self.decoded.clear()
        self.decoded[args[:9]] = decoded

    @staticmethod
    def _word(offset: int) -> int:
        if offset % 4 or not 0 <= offset < xm.SIZE:
            raise IndexError(f"exchange memory offset {offset:#x} is not a word in [0, {xm.SIZE:#x})")
        return offset // 4

    def alloc(self, nbytes: int) -> int:
        return self.memory.alloc(nbytes)

    def free(self, address: int) -> None:
        self.views.clear()  # (any thread: a dict's clear is atomic)
        self.memory.free(address)

    def write(self, address: int, data: np.ndarray) -> None:
        self.memory.view(address, data.nbytes)[:] = data.reshape(-1).view(np.uint8)

    def read(self, address: int, out: np.ndarray) -> None:
        out.reshape(-1).view(np.uint8)[:] = self.memory.view(address, out.nbytes)

    def array(self, address: int, dtype: np.dtype, count: int) -> np.ndarray:
        """`count` elements of device memory at `address`, for a call. The views of
        recent calls are kept (a loop of small calls on the same buffers looks each
        up once), until memory is freed."""
        key = (address, dtype, count)
        view = self.views.get(key)
        if view is not None:
            return view
        if count == 0:
            return np.empty(0, dtype)
        try:
            view = self.memory.view(address, count * dtype.itemsize).view(dtype)
        except KeyError:
            raise CallFailed(ErrorCode.DMA_DECODE_ERROR) from None
        arrays = self.views
        if len(arrays) >= VIEWS_KEPT:
            arrays.clear()
        arrays[key] = view
        return view

    # -- what calls read from exchange memory ----------------------------------------

    def comm(self, address: int) -> Comm:
        comm = self._comms.get(address)
        if comm is None:
            try:
                record = xm.Communicator.read(self.mmio_read, address)
            except (ValueError, IndexError):
                raise CallFailed(ErrorCode.DMA_DECODE_ERROR) from None
            if not record.ranks or record.local_rank >= len(record.ranks):
                raise CallFailed(ErrorCode.DMA_DECODE_ERROR)
            comm = self._comms[address] = Comm(record)
        return comm

    def datapath(self, args: CallArgs) -> Datapath:
        key = (args.arithcfg, args.compression_flags, args.function)
        path = self._paths.get(key)
        if path is None:
            cfg = self._configs.get(args.arithcfg)
            if cfg is None:
                try:
                    cfg = self._configs[args.arithcfg] = xm.ArithConfig.read(self.mmio_read,
                                                                             args.arithcfg)
                except (ValueError, IndexError):
                    raise CallFailed(ErrorCode.ARITH_ERROR) from None
            try:
                path = self._paths[key] = Datapath(cfg, args.compression_flags, args.function)
            except UnsupportedConfig as unsupported:
                raise CallFailed(unsupported.code) from None
        return path

    def segment_elements(self, dtype: np.dtype) -> int:
        """Elements per segment of a message, as the firmware moves it: an rx buffer's
        worth (at least one)."""
        return max(1, self.mmio_read(xm.RX_BUF_SIZE) // dtype.itemsize)

    def next_send_seq(self, comm_key: Hashable, dst: int) -> int:
        seq = self._send_seq.get((comm_key, dst), 0)
        self._send_seq[(comm_key, dst)] = seq + 1
        return seq

    def count_message(self, args: CallArgs, field: int) -> None:
        """Count a send or receive in the peer's record of the communicator, as the
        firmware does (the soft CCLO orders messages by its own counters; this is
        for the host, which reads the record back)."""
        word = (args.comm + 4 * (2 + xm.RankRecord.WORDS * args.root_src_dst + field)) // 4
        self.exchmem[word] += 1

    def configure(self, args: CallArgs) -> int:
        """Run a config call; its return code."""
        function = args.function
        if function == ConfigFunction.RESET_PERIPH:
            self.inbox.rx = None
        elif function == ConfigFunction.ENABLE_PKT:
            if self.mmio_read(xm.CFGRDY) != 1:
                return int(ErrorCode.CONFIG_SWITCH_ERROR)
            self.inbox.rx = self._rx_pool()
        elif function == ConfigFunction.SET_TIMEOUT:
            self.timeout = args.count / self.timer_hz
        elif function == ConfigFunction.SET_MAX_EAGER_MSG_SIZE:
            # as the firmware: at least one rx buffer; above all of them is fine (an eager
            # message the rx buffers cannot hold whole waits for its receive), so that an
            # eager-only stack ("tcp", "udp": 1 GiB) behaves here as on ACCL's devices
            if args.count < self.mmio_read(xm.RX_BUF_SIZE):
                return int(ErrorCode.EAGER_THRESHOLD_INVALID)
            self.max_eager_size = args.count
        elif function == ConfigFunction.SET_MAX_RENDEZVOUS_MSG_SIZE:
            self.max_rendezvous_size = args.count
        else:
            return int(ErrorCode.CONFIG_SWITCH_ERROR)
        return 0

    def _rx_pool(self) -> RxPool:
        n, bufsize = self.mmio_read(xm.NUM_RX_BUFS), self.mmio_read(xm.RX_BUF_SIZE)
        records = [xm.RxBuffer.read(self.mmio_read, xm.RX_RECORDS + 4 * xm.RxBuffer.WORDS * i)
                   for i in range(n)]
        views = [self.memory.view(r.address, bufsize) for r in records]
        exchmem = self.exchmem

        def mark(slot: int, status: int, msg: Message | None) -> None:
            base = (xm.RX_RECORDS + 4 * xm.RxBuffer.WORDS * slot) // 4
            exchmem[base] = status
            if msg is not None:
                exchmem[base + 3:base + 6] = (msg.tag, msg.nbytes, msg.src)

        return RxPool(views, bufsize, mark)

    # -- calls ------------------------------------------------------------------------

    def start(self, args: CallArgs, waitfor: Sequence[DeviceCall] = ()) -> DeviceCall:
        if self.closed or args.scenario == NOP and not waitfor and not self.in_order:
            if self.closed:
                refused = DeviceCall(args)
                refused.complete(error=DeviceError("the soft CCLO is closed"))
                return refused
            # a nop with nothing to wait for: done on the spot
            self.retcode = 0
            return DeviceCall(args, done=True)
        call = KINDS.get(args.scenario, make_call)(args)
        call.dev, call.state, call.body, call.waiting = self, SUBMITTED, None, None
        self.engine.post(call.admit, tuple(waitfor))
        return call

    def ready(self, call: SoftCall) -> None:
        """A call's dependencies are done: run it (in order: once it heads the queue,
        that is once every call admitted before it has ended)."""
        if not self.in_order or self.queue[0] is call:
            call.start()

    def finished(self, call: SoftCall, retcode: int = 0, aborted: bool = False,
                 error: Exception | None = None, detail: str | None = None) -> None:
        """A call ended (engine context): publish its return code, release the next.
        `aborted`: it never ran (a dependency failed), or `error` ended it."""
        self.calls.pop(call, None)
        if error is None and call.started:
            self.retcode = retcode
        if self.in_order:
            self._leave_queue(call)
        if error is not None:
            call.complete(error=error)
        else:
            call.complete(retcode, aborted=aborted, detail=detail)

    def _leave_queue(self, call: SoftCall) -> None:
        """In order: an ended call leaves the queue, however it ended (ran, failed,
        aborted before its turn); if it was the head, the next runs once ready. The
        head's wait for a peer has a deadline, so the calls behind it wait no longer
        than the calls before them take: a program that deadlocks on a card times out."""
        queue = self.queue
        if queue and queue[0] is call:
            queue.popleft()
            if queue and not queue[0].deps_left:  # ready (only the head ever runs)
                self.engine.soon(queue[0].start)  # (not in line: no recursion per call)
        else:
            try:
                queue.remove(call)  # aborted before its turn (all at once: near the front)
            except ValueError:
                pass  # admitted into a closed CCLO: never queued

    def skip_collective(self, comm: int, reason: str) -> None:
        """The host rejected a collective on communicator `comm` (its exchange-memory
        address): it takes its place in the order of collectives all the same, and
        the peers' calls of it are aborted with `reason` (any thread)."""
        self.engine.post(self._skip, comm, reason)

    def _skip(self, address: int, reason: str) -> None:
        if self.closed:
            return
        try:
            comm = self.comm(address)
        except CallFailed:
            return
        seq = self.inbox.admit(comm.key)
        prefix = ("coll", comm.key, seq)
        self.inbox.abandon_steps(prefix)  # what the peers sent for it frees its rx buffers
        self.port.skip(comm, prefix, reason)  # it takes its place in the fabric's order, too
        for peer in comm.sessions:
            if peer != self.session:
                msg = Message(self.session, ("abort", comm.key, seq), seq, 0, None, eager=True)
                msg.notice = (0, reason)
                self.port.post(peer, msg, 0)

    def leave(self, reason: str, peers: Sequence[int]) -> None:
        """Tell `peers` (sessions) that this rank leaves the world, and why: their
        calls that need this rank fail at once instead of at their timeout."""
        self.engine.post(self._leave, reason, tuple(peers))

    def _leave(self, reason: str, peers: tuple[int, ...]) -> None:
        done = self.port.lane_done()
        for peer in peers:
            if peer != self.session:
                msg = Message(self.session, ("leave",), done, 0, None, eager=True)
                msg.notice = (0, reason)
                self.port.post(peer, msg, 0)

    def _stray(self, msg: Message) -> None:
        """A peer's message of a collective came after our call of it ended (engine
        context): the calls do not match. Tell every member, so that those still in
        it fail at once (a gather's root waiting for data that went to another)."""
        if self.aborted is not None:
            return
        _, comm_key, seq = msg.key[:3]
        assert msg.fp is not None
        why = (f"rank {msg.src}'s {describe(msg.fp)} sent rank {self.session} data after "
               f"its call of that collective had ended: their calls do not match")
        for peer in comm_key:
            if peer != self.session:
                notice = Message(self.session, ("abort", comm_key, seq), seq, 0, None,
                                 eager=True)
                notice.notice = (int(ErrorCode.DMA_MISMATCH_ERROR), why)
                self.port.post(peer, notice, 0)

    def peer_left(self, session: int, reason: str) -> None:
        """Treat peer `session` as gone from the world, for `reason` (any thread): as
        if it had said so itself (aaccl.compat, when a peer's process never came)."""
        self.engine.post(self._peer_left, session, reason)

    def _peer_left(self, session: int, reason: str, lane_done: int = 0) -> None:
        """A peer left (engine context): calls here that wait for it end now, and
        later ones as soon as they would wait for it (SoftCall.resume). What it sent
        before it left is still received, and the first `lane_done` collectives MPI
        runs (`fabric._lane`) still complete."""
        self.gone[session] = reason
        self.gone_lane[session] = lane_done
        error = Aborted(f"rank {session} left the world: {reason}")
        for call in list(self.calls):
            if call.waiting is not None and session in call.peers_waited(call.waiting):
                call.abort_now(error)
        # the world's collectives from there on never run (over MPI)
        self.port.peer_left(lane_done, str(error))

    def abort_calls(self, handles: Sequence[DeviceCall], reason: str) -> None:
        """End these outstanding calls (their device calls) with `Aborted(reason)`, in
        one pass over the outstanding calls however many there are (any thread)."""
        self.engine.post(self._abort_calls, frozenset(handles), reason)

    def _abort_calls(self, handles: frozenset[DeviceCall], reason: str) -> None:
        error = Aborted(reason)
        for call in [c for c in self.calls if c in handles]:
            call.abort_now(error)

    def abort(self, reason: str) -> None:
        """End every outstanding call at once with `Aborted(reason)` (any thread)."""
        self.engine.post(self._abort, Aborted(reason))

    def _abort(self, error: Aborted) -> None:
        # every call of this CCLO ends, as do its world's (or it leaves, and says so
        # once): no notice per collective, which for thousands of calls on many
        # ranks would cost more than the abort itself
        self.aborted = error
        for call in list(self.calls):
            call.abort_now(error)

    # -- kernel streams -------------------------------------------------------------------

    def attach_stream(self, kernel: StreamKernel | None, name: str) -> None:
        """Route what the CCLO writes to its stream output through `kernel` from now
        on (None: back to the loopback); any thread."""
        self.engine.post(self.streams.attach, kernel, name)

    def _put_arrived(self, msg: Message) -> None:
        """A peer's send into our kernel stream (RES_STREAM): one packet per segment."""
        assert msg.fp is not None and msg.payload is not None
        wire, segment = msg.fp
        values = msg.payload.view(np.dtype(wire))
        for start in range(0, values.size, segment):
            self.streams.emit(values[start:start + segment], msg.tag)

    def run(self, job: Job, waitfor: Sequence[DeviceCall] = ()) -> DeviceCall:
        """Host work (kernels modelled in Python, transfers) on the CCLO's own workers."""
        return self._jobs.run(job, waitfor)

    def close(self) -> None:
        """Fail what is still outstanding (an aborted world), release the engine."""
        if self.closed:
            return
        self.closed = True
        self.engine.post(self._close)

    def _close(self) -> None:
        self._abort(Aborted("its soft CCLO was closed"))
        self.alarm.parked.clear()  # (waits that outlive the abort: their engine goes)
        self.streams.close()
        self._jobs.close()
        self.port.close()
        self.engine.detach()


def _expire(calls: list[SoftCall]) -> None:
    """The calls whose waits' deadlines passed (`SoftDevice.alarm`): each fails, or
    goes on without a deadline where its wait cannot be withdrawn."""
    for call in calls:
        call.expire()
