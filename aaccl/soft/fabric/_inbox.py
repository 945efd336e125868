"""A soft CCLO's receive side: eager rx buffers and message matching.

Everything here runs in its engine's context (one thread at a time), so nothing
locks. Point-to-point messages match in MPI's order (`Stream`); a collective's
steps match exactly on (source, comm, seq, scenario, tag), in a dict.

Every record of a collective ends with our call of it. Collectives on a
communicator are numbered in submission order on every rank (`admit`), so one
number per communicator says which are over here: a collective numbered below the
next one we admit, with no call of ours running, has ended here (it finished,
failed, or was rejected by the host). What its peers send for it or say of it
after that is dropped on arrival (an eager message's rx buffers freed, a
rendezvous one's sender told it never arrived), and what came before it ended
goes when it ends (`leave`, `abandon_steps`). So nothing is kept per collective
once it ended, whatever its peers still do.

A message that comes for a collective whose call here ended well can only come
from a peer whose call of it does not match ours (a matching call's messages are
all taken before ours ends): `on_stray` hears of it, so that the members fail at
once. For that the inbox remembers which of its last `GAVE_UP_KEPT` ended calls
failed (their peers may still send, rightly): a window, not a record per call.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Hashable
from typing import Protocol

import numpy as np

from ..._constants import ErrorCode
from .._engine import Wait
from ._matching import PostedRecv, Stream
from ._message import Fingerprint, Key, Message, MessageState, describe

RECEIVE_TIMEOUT = int(ErrorCode.RECEIVE_TIMEOUT_ERROR)
_new = object.__new__
SIZE_MISMATCH = int(ErrorCode.DMA_SIZE_ERROR)
MISMATCH = int(ErrorCode.DMA_MISMATCH_ERROR)

Failure = tuple[int, str]
"""(retcode, why) a collective fails with."""

GAVE_UP_KEPT = 1024
"""Collectives that failed here whose late messages are still known as rightful."""


def mismatch(fp: Fingerprint, other: Fingerprint, ours: int, theirs: int) -> Failure:
    """The failure of two calls of one collective (by rank `ours` and `theirs`)
    that do not agree: count alone is ACCL's DMA_SIZE_ERROR, anything else
    DMA_MISMATCH_ERROR; the words name both sides, in rank order."""
    code = SIZE_MISMATCH if fp[:1] + fp[2:] == other[:1] + other[2:] else MISMATCH
    (a, x), (b, y) = sorted(((ours, fp), (theirs, other)))
    return code, f"rank {a} called {describe(x)}; rank {b} called {describe(y)}"


class Member(Protocol):
    """This CCLO's call of a collective, as registered for checks and notices (the
    call itself: nothing is made per collective to register it)."""

    fp: Fingerprint | None  # (None: it failed before it had one)

    @property
    def session(self) -> int:
        """The rank (session) whose call it is."""

    def peer_failed(self, code: int, why: str, notified: bool) -> None:
        """A peer's call of the collective failed (`notified`) or does not match."""


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
        data, free, views, size = msg.payload, self.free, self.views, self.bufsize
        slots = [free.pop()] if need == 1 else [free.pop() for _ in range(need)]
        for i, slot in enumerate(slots):
            chunk = data[i * size:(i + 1) * size]
            views[slot][:chunk.nbytes] = chunk
            self._mark(slot, 1, msg)
        msg.slots, msg.payload = slots, None
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
        mark, free = self._mark, self.free
        for slot in msg.slots:
            mark(slot, 0, None)
            free.append(slot)
        msg.slots = ()


class StepWait(Wait):
    """A collective step waiting for its message; expiring forgets the waiter."""

    __slots__ = ("inbox", "slot")

    def __init__(self, inbox: Inbox, slot: tuple[int, Key]) -> None:
        super().__init__(RECEIVE_TIMEOUT)
        self.inbox, self.slot = inbox, slot

    def sources(self) -> list[int]:
        """The session whose message this waits for."""
        return [self.slot[0]]

    def expire(self) -> bool:
        self.inbox._step_waits.pop(self.slot, None)
        return True


class Inbox:
    """Everything addressed to one soft CCLO."""

    def __init__(self) -> None:
        self._streams: dict[tuple[Key, int], Stream] = {}
        self._steps: dict[tuple[int, Key], Message] = {}
        self._step_waits: dict[tuple[int, Key], StepWait] = {}
        # per communicator: the next collective's seq (`admit`; a collective's call
        # takes it in line)
        self.coll_seq: dict[Hashable, int] = {}
        self._gave_up: dict[Key, None] = {}  # the last GAVE_UP_KEPT collectives that failed here
        # our running collectives, by prefix (one ends: `leave`, or its pop in line)
        self.members: dict[Key, Member] = {}
        self._seen: dict[Key, tuple[int, Fingerprint]] = {}  # before we joined
        self._failed: dict[Key, Failure] = {}  # notices for collectives we have not joined
        # a peer's message of a collective whose call here ended well (see `deliver`)
        self.on_stray: Callable[[Message], None] | None = None
        # a peer left its world (why, and how many collectives MPI ran it through)
        self.on_leave: Callable[[int, str, int], None] | None = None
        self._on_stream: Callable[[Message], None] | None = None  # see `stream_to`
        self._early_puts: list[Message] = []  # puts that came before the CCLO was there
        self._orders = itertools.count()
        self.rx: RxPool | None = None
        self._no_room: deque[Message] = deque()  # eager messages waiting for rx buffers

    def _stream(self, key: Key, src: int) -> Stream:
        stream = self._streams.get((key, src))
        if stream is None:
            stream = self._streams[(key, src)] = Stream()
        return stream

    # -- arrivals -----------------------------------------------------------------

    def deliver(self, msg: Message) -> bool:
        """Accept a message; True if its payload was copied here (the send is done)."""
        key = msg.key
        kind = key[0]
        if kind == "p2p":  # (the common case first)
            copied = msg.payload is None or (msg.eager and self._store(msg))
            stream = self._streams.get((key, msg.src)) or self._stream(key, msg.src)
            for recv, matched in stream.arrive(msg):
                self._match(recv, matched)
            return copied
        if kind == "abort":
            self._notice(msg)
            return True
        if kind == "fp":  # a peer's call of a collective, for us to check ours against
            prefix = ("coll",) + msg.key[1:3]
            if not self._ended(prefix):
                self._check(msg, prefix)
            return self._taken_now(msg)
        if kind == "leave":
            if self.on_leave is not None and msg.notice is not None:
                self.on_leave(msg.src, msg.notice[1], msg.seq)
            return True
        if kind == "stream":  # one-sided: no rx buffer, no receive; the data is taken now
            if self._on_stream is not None:
                self._on_stream(msg)
            else:  # a peer's CCLO started first (over MPI): keep it for ours
                assert msg.payload is not None
                msg.payload = msg.payload.copy()
                self._early_puts.append(msg)
            return self._taken_now(msg)
        if kind == "coll":
            prefix = msg.key[:3]
            if self._ended(prefix):  # nobody here reads it
                if prefix not in self._gave_up and msg.fp is not None \
                        and self.on_stray is not None:
                    self.on_stray(msg)  # ours ended well: theirs does not match it
                return self._drop(msg)
            self._check(msg, prefix)
        copied = msg.payload is None or (msg.eager and self._store(msg))
        slot = (msg.src, msg.key)
        wait = self._step_waits.pop(slot, None)
        if wait is None:
            self._steps[slot] = msg
        else:
            wait.set(self._take(msg))
        return copied

    @staticmethod
    def _taken_now(msg: Message) -> bool:
        """A message used up on arrival (no rx buffer, no receive): its sender is
        told it was taken and is done."""
        msg.state = MessageState.DONE
        for acknowledge in (msg.on_taken, msg.on_done):
            if acknowledge is not None:
                acknowledge()
        return True

    @staticmethod
    def _drop(msg: Message) -> bool:
        """A collective's message nobody here will read: keep nothing of it (an eager
        one's send is done; a rendezvous one's sender sees it never arrived)."""
        if not msg.eager:
            msg.state = MessageState.WITHDRAWN  # the sender's wait fails at its deadline
            return False
        msg.state = MessageState.DONE
        if msg.on_done is not None:
            msg.on_done()
        return True

    def _store(self, msg: Message) -> bool:
        """Copy an eager payload into the rx buffers. As on a card, whose receive path
        stalls until a buffer frees, one they have no room for waits for room behind
        any that wait already: its send completes once it has room (`_make_room`) or
        once its receive took it, whichever comes first. One larger than all rx
        buffers stays until its receive takes it, and holds up those behind it."""
        rx = self.rx
        if rx is None:
            return False
        if not self._no_room and rx.store(msg):
            return True
        self._no_room.append(msg)
        return False

    def _make_room(self) -> None:
        """Rx buffers were freed, or a waiting message taken: store the messages
        waiting for room, in order, and complete their sends."""
        queue, rx = self._no_room, self.rx
        while queue and rx is not None:
            msg = queue[0]
            if msg.state == MessageState.PENDING and msg.payload is not None:
                if not rx.store(msg):
                    return
                if msg.consumed is not None:
                    msg.consumed.set()
            queue.popleft()  # stored now, or taken, withdrawn or dropped meanwhile

    def withdraw(self, msg: Message) -> bool:
        """The sender gave up: drop the message unless a receive has started on it."""
        if msg.state != MessageState.PENDING:
            return False
        msg.state = MessageState.WITHDRAWN
        if self._no_room:  # it may have held up others
            self._make_room()
        if msg.key[0] != "p2p":
            self._steps.pop((msg.src, msg.key), None)
            return True
        stream = self._stream(msg.key, msg.src)
        recv, msg.matched = msg.matched, None
        if recv is not None:  # matched to a receive that has not run yet: it waits again
            recv.done, recv.value = False, None
            other = stream.post(recv, in_order=True)
            if other is not None:
                self._match(recv, other)
        else:
            stream.withdraw(msg)
        return True

    def stream_to(self, sink: Callable[[Message], None]) -> None:
        """Hand puts into our kernel stream (sends with RES_STREAM) to `sink`, those
        that came already first."""
        self._on_stream = sink
        early, self._early_puts = self._early_puts, []
        for msg in early:
            sink(msg)

    @staticmethod
    def _match(recv: PostedRecv, msg: Message) -> None:
        msg.matched = recv
        if msg.fetch is None:
            recv.set(msg)
        else:  # (MPI) its payload is still with its sender: the receive gets it once here
            recv.value = msg
            msg.fetch()

    def fetched(self, msg: Message, payload: np.ndarray, hand_over: bool = True) -> None:
        """(MPI) The payload of a message that a receive matched came from its sender:
        that receive (if it still waits for it) has it now, unless not `hand_over`."""
        msg.payload, msg.fetch = payload, None
        recv = msg.matched
        if recv is not None:
            recv.value = None
            if hand_over:
                recv.set(msg)

    # -- point to point -------------------------------------------------------------

    def post(self, key: Key, src: int, tag: int) -> PostedRecv:
        """Post a receive; its place in the matching order is fixed now."""
        recv = _new(PostedRecv)  # (PostedRecv.__init__ and Wait's, in line)
        recv.done, recv.value, recv.waiter, recv.timeout_code = False, None, None, RECEIVE_TIMEOUT
        recv.tag, recv.order, recv.active = tag, next(self._orders), True
        msg = (self._streams.get((key, src)) or self._stream(key, src)).post(recv)
        if msg is not None:
            msg.matched = recv
            if msg.fetch is None:
                recv.done, recv.value = True, msg  # (`Wait.set`: nobody waits on it yet)
            else:  # (MPI) its payload is still with its sender
                recv.value = msg
                msg.fetch()
        return recv

    def cancel(self, key: Key, src: int, recv: PostedRecv) -> None:
        """A receive ends without taking a message (it failed or never ran): one it
        had matched goes to the next receive that can take it."""
        if not recv.active:
            return
        recv.active = False
        stream = self._stream(key, src)
        msg: Message | None = recv.value  # (set before `done` while a payload comes)
        if msg is None:
            stream.cancel(recv)
            return
        msg.matched = None
        pair = stream.unmatch(msg)
        if pair is not None:
            self._match(*pair)

    def take(self, recv: PostedRecv) -> Message:
        """The matched message of a receive that now runs."""
        recv.active = False
        msg: Message = recv.value
        msg.matched = None
        msg.state = MessageState.TAKEN  # (`_take`, in line)
        if msg.on_taken is not None:
            msg.on_taken()
        return msg

    # -- collective steps -----------------------------------------------------------

    def admit(self, comm_key: Hashable) -> int:
        """The number of our next collective on communicator `comm_key` (the same
        on every rank); from now on, what comes for it is ours to end."""
        seq = self.coll_seq.get(comm_key, 0)
        self.coll_seq[comm_key] = seq + 1
        return seq

    def _ended(self, prefix: Key) -> bool:
        """Our call of collective `prefix` was admitted and is no longer running."""
        return prefix[2] < self.coll_seq.get(prefix[1], 0) and prefix not in self.members

    def join(self, prefix: Key, member: Member) -> tuple[int, str, bool] | None:
        """Our call of collective `prefix` is admitted: check it against what peers
        sent for it already (and whether one of them failed it); later arrivals are
        checked as they come, and `member.peer_failed(code, why, notified)` ends our
        call. (`CollectiveCall.prepare` makes the common case, nothing come before,
        in line.)"""
        fp = member.fp
        failed = self._failed.pop(prefix, None)
        seen = self._seen.pop(prefix, None)
        if failed is not None:
            self._give_up(prefix)
            return (*failed, True)
        if seen is not None and seen[1] != fp:
            assert fp is not None  # (a call that joins has one)
            self._give_up(prefix)
            return (*mismatch(fp, seen[1], member.session, seen[0]), False)
        self.members[prefix] = member
        return None

    def leave(self, prefix: Key) -> None:
        """Our call of `prefix` ended."""
        self.members.pop(prefix, None)

    def _check(self, msg: Message, prefix: Key) -> None:
        """Check a message of collective `prefix` (not ended here) against our call
        of it, or keep its call for ours to check when it comes."""
        member = self.members.get(prefix)
        if member is None:
            if msg.fp is not None and prefix not in self._seen:
                self._seen[prefix] = (msg.src, msg.fp)
        elif msg.fp is not None and msg.fp != member.fp:
            assert member.fp is not None
            code, why = mismatch(member.fp, msg.fp, member.session, msg.src)
            member.peer_failed(code, why, False)

    def _notice(self, msg: Message) -> None:
        """A peer's call of a collective failed: so does ours, now or when it comes;
        what it sends or sent is dropped."""
        assert msg.notice is not None
        prefix = ("coll",) + msg.key[1:3]
        code, why = msg.notice
        member = self.members.pop(prefix, None)
        self._seen.pop(prefix, None)
        if member is not None:
            member.peer_failed(code, why, True)
        elif not self._ended(prefix):
            self._failed.setdefault(prefix, (code, why))  # for our call, when it comes

    def expect_step(self, src: int, key: Key) -> Wait:
        """The message `src` sends for this step: set now, or when it comes."""
        slot = (src, key)
        msg = self._steps.pop(slot, None)
        if msg is not None:
            wait = Wait()
            wait.set(self._take(msg))
            return wait
        wait = self._step_waits[slot] = StepWait(self, slot)
        return wait

    def _give_up(self, prefix: Key) -> None:
        """Our call of `prefix` failed: its peers' late messages are rightful."""
        gave_up = self._gave_up
        gave_up[prefix] = None
        if len(gave_up) > GAVE_UP_KEPT:
            del gave_up[next(iter(gave_up))]

    def abandon_steps(self, prefix: Key) -> None:
        """Our call of a collective (steps keyed `prefix + (scenario, tag)`) failed or
        never ran: it ends here, and its eager messages' rx buffers are freed, now
        and as they arrive."""
        self.members.pop(prefix, None)
        self._seen.pop(prefix, None)
        self._failed.pop(prefix, None)
        self._give_up(prefix)
        for slot in [k for k in self._steps if k[1][:3] == prefix]:
            msg = self._steps.pop(slot)
            if msg.eager or msg.payload is None:
                self.release(msg)
            else:
                self.withdraw(msg)  # rendezvous: the sender sees it never arrived

    # -- payloads ---------------------------------------------------------------------

    @staticmethod
    def _take(msg: Message) -> Message:
        msg.state = MessageState.TAKEN
        if msg.on_taken is not None:
            msg.on_taken()
        return msg

    def data(self, msg: Message) -> np.ndarray:
        """A taken message's payload bytes (valid until `release`)."""
        if msg.payload is not None:
            return msg.payload
        if msg.nbytes == 0:
            return np.empty(0, np.uint8)
        assert self.rx is not None
        if len(msg.slots) == 1:  # (`RxPool.gather`'s common case, in line)
            return self.rx.views[msg.slots[0]][:msg.nbytes]
        return self.rx.gather(msg)

    def release(self, msg: Message) -> None:
        """The receiver is done with a message: free its rx buffers, tell the sender."""
        if msg.slots and self.rx is not None:
            self.rx.release(msg)
        msg.state, msg.payload = MessageState.DONE, None  # nothing of it outlives it
        if msg.consumed is not None:
            msg.consumed.set()
        if msg.on_done is not None:
            msg.on_done()
        if self._no_room:
            self._make_room()
