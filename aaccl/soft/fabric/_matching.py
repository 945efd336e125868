"""Point-to-point matching in MPI's order, in O(1) amortized per message.

Messages from one source on one communicator become visible in the sender's
submission order (`seq`; a gap waits for the missing message or its tombstone).
A message goes to the oldest posted receive whose tag matches; a receive takes
the oldest unmatched message whose tag matches. TAG_ANY on either side matches
any tag. Each side is kept in queues per tag plus one queue of all, oldest first,
with lazy deletion, so a match looks at no more than two queue heads.

Lazy deletion leaves an item matched through one queue in the other (a receive by
tag leaves its message in the queue of all; TAG_ANY leaves it in its tag's queue).
So that memory stays flat however long a program runs, a `_Queue` counts its
entries, dead ones included, and rebuilds its queues from its live items (keeping
their order, so the matching order is untouched) once dead entries outnumber live
ones: at most 4 entries per live item (plus 8), and O(1) amortized, as a rebuild
costs O(entries) and the matches since the last one made most of them dead. A
tag's queue goes once found empty.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

from ..._constants import TAG_ANY
from .._engine import Wait
from ._message import Message

T = TypeVar("T", "PostedRecv", Message)


class PostedRecv(Wait):
    """A receive, in the order its call was submitted; set with its message."""

    __slots__ = ("tag", "order", "active")

    def __init__(self, tag: int, order: int, timeout_code: int) -> None:
        super().__init__(timeout_code)
        self.tag, self.order, self.active = tag, order, True


class _Queue(Generic[T]):
    """Unmatched items (receives or messages), oldest first, by tag and all together.

    Each item has an entry in two queues; `entries` counts them, dead ones included.
    """

    def __init__(self) -> None:
        self.by_tag: dict[int, deque[tuple[int, T]]] = {}
        self.all: deque[tuple[int, T]] = deque()
        self.live: dict[int, T] = {}  # id -> item, for the ones still unmatched
        self.entries = 0

    def add(self, order: int, tag: int, item: T, *, in_order: bool = False) -> None:
        """Append (or, `in_order`, insert by order: rare, so linear)."""
        self.live[id(item)] = item
        self.entries += 2
        entry = (order, item)
        for queue in (self.all, self.by_tag.setdefault(tag, deque())):
            if in_order:
                at = next((i for i, (o, _) in enumerate(queue) if o > order), len(queue))
                queue.insert(at, entry)
            else:
                queue.append(entry)

    def _head(self, queue: deque[tuple[int, T]] | None) -> tuple[int, T] | None:
        live = self.live
        while queue:
            entry = queue[0]
            if live.get(id(entry[1])) is entry[1]:
                return entry
            queue.popleft()
            self.entries -= 1
        return None

    def pop_oldest(self, tag: int) -> T | None:
        """Remove and return the oldest item that matches `tag`."""
        if tag == TAG_ANY:
            best = self._head(self.all)
        else:
            by_tag = self.by_tag
            queue = by_tag.get(tag)
            best = self._head(queue)
            if best is None and queue is not None:
                del by_tag[tag]
            queue = by_tag.get(TAG_ANY)
            other = self._head(queue)
            if other is None:
                if queue is not None:
                    del by_tag[TAG_ANY]
            elif best is None or other[0] < best[0]:
                best = other
        if best is None:
            return None
        item = best[1]
        live = self.live
        del live[id(item)]
        if self.entries > 4 * len(live) + 8:
            self._rebuild()
        return item

    def remove(self, item: T) -> bool:
        live = self.live
        if live.get(id(item)) is not item:
            return False
        del live[id(item)]
        if self.entries > 4 * len(live) + 8:
            self._rebuild()
        return True

    def _rebuild(self) -> None:
        """Dead entries outnumber live ones (which bounds them, and also what a
        rebuild costs): keep the live ones, in order."""
        live = self.live
        if not live:
            self.all, self.by_tag, self.entries = deque(), {}, 0
            return
        keep = live.get
        self.all = deque(e for e in self.all if keep(id(e[1])) is e[1])
        self.by_tag = {tag: kept for tag, queue in self.by_tag.items()
                       if (kept := deque(e for e in queue if keep(id(e[1])) is e[1]))}
        self.entries = len(self.all) + sum(map(len, self.by_tag.values()))


class Stream:
    """Point-to-point traffic from one source on one communicator, at one receiver."""

    def __init__(self) -> None:
        self.next_seq = 0
        self.early: dict[int, Message] = {}
        self._messages: _Queue[Message] = _Queue()
        self._recvs: _Queue[PostedRecv] = _Queue()

    def arrive(self, msg: Message) -> list[tuple[PostedRecv, Message]]:
        """A message came; the (receive, message) pairs that now match."""
        self.early[msg.seq] = msg
        matched = []
        while self.next_seq in self.early:
            ready = self.early.pop(self.next_seq)
            self.next_seq += 1
            if not ready.tombstone:
                pair = self._offer(ready, in_order=False)
                if pair is not None:
                    matched.append(pair)
        return matched

    def _offer(self, msg: Message, in_order: bool) -> tuple[PostedRecv, Message] | None:
        recv = self._recvs.pop_oldest(msg.tag)
        if recv is None:
            self._messages.add(msg.seq, msg.tag, msg, in_order=in_order)
            return None
        return recv, msg

    def post(self, recv: PostedRecv, in_order: bool = False) -> Message | None:
        """Post a receive (in submission order); its message, if one is waiting."""
        msg = self._messages.pop_oldest(recv.tag)
        if msg is None:
            self._recvs.add(recv.order, recv.tag, recv, in_order=in_order)
        return msg

    def cancel(self, recv: PostedRecv) -> None:
        """A receive that never matched gives up its place."""
        self._recvs.remove(recv)

    def unmatch(self, msg: Message) -> tuple[PostedRecv, Message] | None:
        """A matched message whose receive will not run goes to the next receive
        that can take it, or back among the unmatched messages."""
        return self._offer(msg, in_order=True)

    def withdraw(self, msg: Message) -> bool:
        """The sender gave up on a message no receive has matched: drop it."""
        if self._messages.remove(msg):
            return True
        if self.early.get(msg.seq) is msg:
            msg.tombstone = True  # still behind a gap: keep its place in the sequence
            return True
        return False
