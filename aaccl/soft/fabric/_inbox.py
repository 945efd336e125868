"""A soft CCLO's receive side: eager rx buffers and message matching.

Matching follows MPI's rules. Point-to-point messages from one source on one
communicator become visible in the sender's submission order (`seq`); a receive
takes the first visible message whose tag matches and that no receive posted
earlier could take. Collective steps match exactly on (comm, seq, scenario, tag).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np

from ..._constants import TAG_ANY
from ._message import DONE, PENDING, TAKEN, WITHDRAWN, Key, Message, PeerTimeout


def tags_match(a: int, b: int) -> bool:
    return a == b or a == TAG_ANY or b == TAG_ANY


Waiter = Callable[[], None]
"""Resumes a parked call; the inbox calls it once, outside its lock."""


class PostedRecv:
    __slots__ = ("tag", "active", "waiter")

    def __init__(self, tag: int) -> None:
        self.tag, self.active = tag, True
        self.waiter: Waiter | None = None


class _Stream:
    """Point-to-point traffic from one source on one communicator."""

    __slots__ = ("next_seq", "early", "visible", "posted")

    def __init__(self) -> None:
        self.next_seq = 0
        self.early: dict[int, Message] = {}
        self.visible: list[Message] = []
        self.posted: list[PostedRecv] = []

    def arrive(self, msg: Message) -> None:
        self.early[msg.seq] = msg
        while self.next_seq in self.early:
            ready = self.early.pop(self.next_seq)
            self.next_seq += 1
            if not ready.tombstone:
                self.visible.append(ready)

    def match(self, recv: PostedRecv) -> Message | None:
        claimed: set[int] = set()
        for posted in self.posted:
            for msg in self.visible:
                if id(msg) not in claimed and tags_match(posted.tag, msg.tag):
                    if posted is recv:
                        return msg
                    claimed.add(id(msg))
                    break
            if posted is recv:
                return None
        return None


class RxPool:
    """The eager rx buffers, as the exchange memory lists them."""

    def __init__(self, views: list[np.ndarray], bufsize: int,
                 mark: Callable[[int, int, Message | None], None]) -> None:
        self.views, self.bufsize, self._mark = views, bufsize, mark
        self.free = list(range(len(views)))[::-1]

    def store(self, msg: Message) -> bool:
        """Copy an eager message's payload into free rx buffers, if enough are free."""
        assert msg.payload is not None
        need = -(-msg.nbytes // self.bufsize)
        if need > len(self.free):
            return False
        data = msg.payload
        for i in range(need):
            slot = self.free.pop()
            chunk = data[i * self.bufsize:(i + 1) * self.bufsize]
            self.views[slot][:chunk.nbytes] = chunk
            msg.slots.append(slot)
            self._mark(slot, 1, msg)
        msg.payload = None
        return True

    def gather(self, msg: Message) -> np.ndarray:
        if len(msg.slots) == 1:
            return self.views[msg.slots[0]][:msg.nbytes]
        out = np.empty(msg.nbytes, np.uint8)
        for i, slot in enumerate(msg.slots):
            chunk = out[i * self.bufsize:(i + 1) * self.bufsize]
            chunk[:] = self.views[slot][:chunk.nbytes]
        return out

    def release(self, msg: Message) -> None:
        for slot in msg.slots:
            self._mark(slot, 0, None)
            self.free.append(slot)
        msg.slots = []


def _taken(msg: Message) -> Message:
    """Tell whoever asked (outside the lock) that a receive has claimed `msg`."""
    if msg.on_taken is not None:
        msg.on_taken()
    return msg


class Inbox:
    """Everything addressed to one soft CCLO."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._streams: dict[tuple[Key, int], _Stream] = {}
        self._steps: dict[tuple[int, Key], Message] = {}
        self._step_waiters: dict[tuple[int, Key], Waiter] = {}
        self._abandoned: set[Key] = set()  # ("coll", comm, seq) of collectives that gave up
        self._rx: RxPool | None = None

    def set_rx_pool(self, pool: RxPool | None) -> None:
        with self._cond:
            self._rx = pool

    # -- sender side --------------------------------------------------------------

    def deliver(self, msg: Message) -> bool:
        """Accept a message; True if its payload was copied here (the send is done)."""
        ready: list[Waiter] = []
        with self._cond:
            dropped = msg.key[0] != "p2p" and msg.key[:3] in self._abandoned
            if dropped:
                if not msg.eager:
                    return False  # nobody will read it: the sender times out and withdraws
                msg.state = DONE  # eager: it has left the sender, and nobody will take it
            else:
                copied = msg.payload is None or (
                    msg.eager and self._rx is not None and self._rx.store(msg))
                if msg.key[0] == "p2p":
                    stream = self._stream(msg.key, msg.src)
                    stream.arrive(msg)
                    ready = self._ready(stream)
                else:
                    self._steps[(msg.src, msg.key)] = msg
                    waiter = self._step_waiters.pop((msg.src, msg.key), None)
                    ready = [] if waiter is None else [waiter]
                self._cond.notify_all()
        if dropped:
            if msg.on_done is not None:
                msg.on_done()
            return True
        for waiter in ready:
            waiter()
        return copied

    @staticmethod
    def _ready(stream: _Stream) -> list[Waiter]:
        """Waiters of parked receives that a message now matches (call with the lock)."""
        ready = []
        for posted in stream.posted:
            if posted.waiter is not None and stream.match(posted) is not None:
                ready.append(posted.waiter)
                posted.waiter = None
        return ready

    def wait_consumed(self, msg: Message, deadline: float) -> bool:
        """Wait until the receiver is done with a rendezvous payload; on timeout,
        withdraw it if the receiver has not started on it."""
        with self._cond:
            while msg.state != DONE:
                if msg.state == WITHDRAWN:  # asked again after it timed out
                    return False
                remaining = deadline - time.monotonic()
                if remaining <= 0 and msg.state == PENDING:
                    self._withdraw(msg)
                    return False
                self._cond.wait(remaining if msg.state == PENDING else None)
        return True

    def _withdraw(self, msg: Message) -> None:
        msg.state = WITHDRAWN
        if msg.key[0] == "p2p":
            stream = self._stream(msg.key, msg.src)
            if msg in stream.visible:
                stream.visible.remove(msg)
            else:  # still waiting behind a gap: keep the sequence, drop the data
                msg.tombstone = True
        else:
            self._steps.pop((msg.src, msg.key), None)

    # -- receiver side ------------------------------------------------------------

    def abandon_steps(self, prefix: Key) -> None:
        """A collective (steps keyed `prefix + (scenario, tag)`) failed or never ran
        here: free its eager messages' rx buffers, now and as they arrive."""
        with self._cond:
            self._abandoned.add(prefix)
            for slot in [k for k, m in self._steps.items()
                         if k[1][:3] == prefix and m.payload is None]:
                msg = self._steps.pop(slot)
                if msg.slots and self._rx is not None:
                    self._rx.release(msg)
                msg.state = DONE

    def _stream(self, key: Key, src: int) -> _Stream:
        stream = self._streams.get((key, src))
        if stream is None:
            stream = self._streams[(key, src)] = _Stream()
        return stream

    def post(self, key: Key, src: int, tag: int) -> PostedRecv:
        """Post a point-to-point receive; its place in the order is fixed now."""
        recv = PostedRecv(tag)
        with self._cond:
            self._stream(key, src).posted.append(recv)
        return recv

    def cancel(self, key: Key, src: int, recv: PostedRecv) -> None:
        ready: list[Waiter] = []
        with self._cond:
            if recv.active:
                recv.active = False
                stream = self._stream(key, src)
                stream.posted.remove(recv)
                ready = self._ready(stream)  # what recv claimed may now go to a later one
                self._cond.notify_all()
        for waiter in ready:
            waiter()

    def take_posted(self, key: Key, src: int, recv: PostedRecv, deadline: float) -> Message:
        stream = self._stream(key, src)
        ready: list[Waiter] = []
        with self._cond:
            while (msg := stream.match(recv)) is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            else:
                ready = self._claim(stream, recv, msg)
        if msg is None:
            self.cancel(key, src, recv)
            raise PeerTimeout
        for waiter in ready:
            waiter()
        return _taken(msg)

    def _claim(self, stream: _Stream, recv: PostedRecv, msg: Message) -> list[Waiter]:
        """Give `msg` to `recv` (call with the lock); return the parked receives that
        may match now that both are out of the way."""
        recv.active = False
        stream.posted.remove(recv)
        stream.visible.remove(msg)
        msg.state = TAKEN
        return self._ready(stream)

    def take_posted_nowait(self, key: Key, src: int, recv: PostedRecv,
                           waiter: Waiter) -> Message | None:
        """Take recv's message if it is here; otherwise park: `waiter` fires once it is."""
        stream = self._stream(key, src)
        with self._cond:
            msg = stream.match(recv)
            if msg is None:
                recv.waiter = waiter
                return None
            ready = self._claim(stream, recv, msg)
        for other in ready:
            other()
        return _taken(msg)

    def unpark_posted(self, key: Key, src: int, recv: PostedRecv) -> bool:
        """Give up a parked receive (it timed out); False if its waiter already fired."""
        with self._cond:
            if recv.waiter is None:
                return False
            recv.waiter = None
        self.cancel(key, src, recv)
        return True

    def take_step_nowait(self, src: int, key: Key, waiter: Waiter) -> Message | None:
        """Take a collective step's message if it is here; otherwise park."""
        with self._cond:
            msg = self._steps.pop((src, key), None)
            if msg is None:
                self._step_waiters[(src, key)] = waiter
                return None
            msg.state = TAKEN
        return _taken(msg)

    def unpark_step(self, src: int, key: Key) -> bool:
        """Give up a parked step (it timed out); False if its waiter already fired."""
        with self._cond:
            return self._step_waiters.pop((src, key), None) is not None

    def take_step(self, src: int, key: Key, deadline: float) -> Message:
        with self._cond:
            while (msg := self._steps.pop((src, key), None)) is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise PeerTimeout
                self._cond.wait(remaining)
            msg.state = TAKEN
        return _taken(msg)

    def data(self, msg: Message) -> np.ndarray:
        """A taken message's payload bytes (valid until `release`)."""
        if msg.payload is not None or msg.nbytes == 0:
            return msg.payload if msg.payload is not None else np.empty(0, np.uint8)
        assert self._rx is not None
        return self._rx.gather(msg)

    def release(self, msg: Message) -> None:
        with self._cond:
            if msg.slots and self._rx is not None:
                self._rx.release(msg)
            msg.state = DONE
            self._cond.notify_all()
        if msg.on_done is not None:
            msg.on_done()

    def withdraw(self, msg: Message) -> bool:
        """The sender gave up on a message: drop it unless the receiver has taken it."""
        with self._cond:
            if msg.state != PENDING:
                return False
            self._withdraw(msg)
            return True
