"""A soft CCLO's kernel streams: ACCL's two AXI streams between the CCLO and user kernels.

On a card the CCLO has one stream out to the user's kernels (`accl_to_krnl`: packets
of 512-bit words, each carrying the tag of the call that wrote it as its TDEST) and
one stream in (`krnl_to_accl`: words). A call with RES_STREAM writes its result to
the output instead of memory; one with OP0_STREAM reads its first operand from the
input. ACCL's emulator connects the two in a loopback by default (what goes out
comes back in), and so does the soft CCLO until a Python kernel is attached: then
every packet goes through the kernel, and what it returns comes back in.

Reads take whole 64-byte words, as the CCLO's stream segmenter does. A packet
arrives padded to whole words, so a read of fewer bytes than a packet held drops
the rest of its last word (ACCL's firmware: "streams can't be read losslessly").

Everything here runs in engine context, except the kernel itself, which runs on
the device's workers one packet at a time, in order.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .._constants import ErrorCode, Scenario, StreamFlags
from .._errors import KernelError
from ..devices import DeviceCall
from ._engine import Wait

WORD = 64
"""Bytes per word of the CCLO's kernel streams (512 bits)."""
DEST_MASK = 0xFF
"""The TDEST of a packet: the low 8 bits of the writing call's tag."""
STREAM_TIMEOUT = int(ErrorCode.KRNL_TIMEOUT_STS_ERROR)

OP0, RES = int(StreamFlags.OP0_STREAM), int(StreamFlags.RES_STREAM)
_BOTH = frozenset({Scenario.COPY, Scenario.COMBINE, Scenario.SEND})
_ONE_RANK_COPY = frozenset({Scenario.ALLREDUCE, Scenario.ALLTOALL})

StreamKernel = Callable[[np.ndarray, int], Any]
"""`kernel(chunk, tag)`: a packet's elements and its tag; returns what goes back into
the CCLO's input stream (an array, whose bytes count), or None for nothing."""
Run = Callable[[Callable[[], None], Sequence[DeviceCall]], DeviceCall]


def words(nbytes: int) -> int:
    return -(-nbytes // WORD)


def stream_roles(scenario: int, flags: int, size: int, is_root: bool) -> tuple[bool, bool] | None:
    """(reads operand 0 from the input stream, writes its result to the output
    stream) for a call, as ACCL's firmware reads its stream flags; None where the
    firmware fails the call (COLLECTIVE_NOT_IMPLEMENTED).

    copy, combine and send honour both flags (a send's result stream is the peer's:
    a one-sided put); recv writes its result only; reduce reads every rank's
    contribution and writes the root's result; allreduce and alltoall on one rank
    are a copy; alltoall on more ranks takes no streams; every other call ignores
    them and works in memory.
    """
    op0, res = bool(flags & OP0), bool(flags & RES)
    if not (op0 or res):
        return False, False
    if scenario in _BOTH:
        return op0, res
    if scenario == Scenario.RECV:
        return False, res
    if scenario == Scenario.REDUCE:
        return op0, res and is_root
    if scenario in _ONE_RANK_COPY and size == 1:
        return op0, res
    if scenario == Scenario.ALLTOALL:
        return None
    return False, False


def segments(nbytes: int, segment: int) -> list[int]:
    """The byte sizes of the moves a message of `nbytes` takes, `segment` bytes each."""
    if nbytes == 0:
        return []
    segment = max(segment, 1)
    full, rest = divmod(nbytes, segment)
    return [segment] * full + ([rest] if rest else [])


class StreamRead(Wait):
    """A call waiting for words on the input stream; set with the bytes it read (or
    with the KernelError of a stream kernel that failed)."""

    __slots__ = ("ports", "moves", "nbytes")

    def __init__(self, ports: StreamPorts, moves: list[int]) -> None:
        super().__init__(STREAM_TIMEOUT)
        self.ports, self.moves = ports, moves
        self.nbytes = sum(words(m) for m in moves) * WORD

    def expire(self) -> bool:
        self.ports.withdraw(self)
        return True

    def describe(self) -> str:
        """What the read waits for, for its timeout's message."""
        n = self.nbytes // WORD
        return (f"{sum(self.moves)} bytes ({n} word{'' if n == 1 else 's'}) from the kernel "
                f"stream, which holds {self.ports.held} ({self.ports.describe()})")


def _nobody() -> None:
    """No call yet: what a dead weak reference says."""
    return None


class StreamPorts:
    """One rank's kernel streams: the CCLO's output (`emit`) and input (`read`)."""

    def __init__(self, run: Run, post: Callable[..., None]) -> None:
        self._run, self._post = run, post  # the device's workers; the engine's queue
        self._input: deque[np.ndarray] = deque()  # packets of whole words (uint8)
        self._offset = 0  # bytes of the first packet read already
        self.held = 0  # bytes in the input stream
        self._readers: deque[StreamRead] = deque()
        self.kernel: StreamKernel | None = None  # None: the loopback
        self.name = "loopback"
        self._queue: deque[tuple[np.ndarray, int, StreamKernel, str]] = deque()
        self._busy = False  # the kernel runs on a packet now
        self._failed: KernelError | None = None  # for the next read
        # the last call admitted that uses the streams (weakly: the user's, collected
        # once dropped; a collected one has ended)
        self._last: Callable[[], DeviceCall | None] = _nobody
        self.closed = False

    def describe(self) -> str:
        if self.kernel is None:
            return "no kernel attached: the loopback returns what the CCLO wrote to its output"
        return f"kernel {self.name} attached"

    # -- calls take turns ---------------------------------------------------------------

    def turn(self, handle: DeviceCall) -> DeviceCall | None:
        """Calls that use the streams run one at a time, in submission order, as every
        call does on a card: a dependency that is done once the previous such call has
        ended, however it ended (None if it has)."""
        previous, self._last = self._last(), weakref.ref(handle)
        if previous is None or previous.done():
            return None
        done = DeviceCall(None)
        previous.add_done_callback(lambda _: done.complete())
        return done

    # -- the kernel side ----------------------------------------------------------------

    def attach(self, kernel: StreamKernel | None, name: str) -> None:
        """Route packets written from now on through `kernel` (None: the loopback)."""
        self.kernel, self.name = kernel, (name if kernel is not None else "loopback")

    def emit(self, data: np.ndarray, tag: int) -> None:
        """The CCLO writes one packet to its output stream."""
        if data.size == 0 or self.closed:
            return
        kernel = self.kernel
        if kernel is None:
            self._push(packet(data))
            return
        self._queue.append((data.copy(), tag & DEST_MASK, kernel, self.name))
        self._next()

    def _next(self) -> None:
        if self._busy or not self._queue or self.closed:
            return
        self._busy = True
        data, tag, kernel, name = self._queue.popleft()
        out: list[np.ndarray | None] = []

        def job() -> None:
            out.append(_returned(kernel(data, tag), name))  # padded here, off the engine

        def ran(call: DeviceCall) -> None:
            self._post(self._ran, name, call.error, out[0] if out else None)

        self._run(job, ()).add_done_callback(ran)

    def _ran(self, name: str, error: Exception | None, returned: np.ndarray | None) -> None:
        self._busy = False
        if self.closed:
            return
        if error is not None:
            failed = KernelError(f"stream kernel {name} raised {type(error).__name__}: {error}")
            failed.__cause__ = error
            self._failed = failed
            self._serve()
        elif returned is not None:
            self._push(returned)
        self._next()

    def _push(self, padded: np.ndarray) -> None:
        """A packet of whole words into the input stream."""
        if padded.size:
            self._input.append(padded)
            self.held += padded.size
            self._serve()

    # -- the CCLO's input -----------------------------------------------------------------

    def read(self, moves: list[int]) -> StreamRead:
        """A read of one move per entry of `moves` (bytes): each takes whole words and
        keeps its first bytes. Set now, or when enough words have come."""
        wait = StreamRead(self, moves)
        self._readers.append(wait)
        self._serve()
        return wait

    def withdraw(self, wait: StreamRead) -> None:
        if wait in self._readers:
            self._readers.remove(wait)

    def _serve(self) -> None:
        while self._readers:
            head = self._readers[0]
            if self._failed is not None:
                self._readers.popleft()
                failed, self._failed = self._failed, None
                head.set(failed)
            elif head.nbytes <= self.held:
                self._readers.popleft()
                head.set(self._take(head.moves))
            else:
                return

    def _take(self, moves: list[int]) -> np.ndarray:
        out = np.empty(sum(moves), np.uint8)
        at = 0
        for move in moves:
            whole = self._bytes(words(move) * WORD)
            out[at:at + move] = whole[:move]
            at += move
        return out

    def _bytes(self, n: int) -> np.ndarray:
        """The next n bytes of the input stream (n <= held)."""
        parts = []
        self.held -= n
        while n:
            head = self._input[0]
            part = head[self._offset:self._offset + n]
            parts.append(part)
            n -= part.size
            self._offset += part.size
            if self._offset == head.size:
                self._input.popleft()
                self._offset = 0
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def close(self) -> None:
        self.closed = True
        self._input.clear()
        self._queue.clear()
        self.held = 0


def packet(data: np.ndarray) -> np.ndarray:
    """A copy of `data`'s bytes, padded with zeros to whole words."""
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    out = np.zeros(words(raw.size) * WORD, np.uint8)
    out[:raw.size] = raw
    return out


def _returned(value: Any, name: str) -> np.ndarray | None:
    """What a stream kernel returned, as the packet it puts into the CCLO's input."""
    if value is None:
        return None
    array = np.asarray(value)
    if array.dtype.hasobject:
        raise TypeError(f"stream kernel {name} returned {type(value).__name__}: return a "
                        "numpy array (its bytes go into the CCLO's input stream) or None")
    return packet(array)
