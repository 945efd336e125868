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
from collections.abc import Callable, Sequence
from operator import attrgetter
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

    Each item has an entry in two queues (the item itself: no tuple per entry, which
    the garbage collector would walk as long as the item waits), `order(item)` its
    place; `live` holds the unmatched ones, and `entries` counts the queues' entries,
    dead ones included.
    """

    def __init__(self, order: Callable[[T], int] = attrgetter("order")) -> None:
        self.by_tag: dict[int, deque[T]] = {}
        self.all: deque[T] = deque()
        self.live: set[T] = set()  # the items still unmatched
        self.entries = 0
        self.order: Callable[[T], int] = order

    def add(self, item: T, *, in_order: bool = False) -> None:
        """Append (or, `in_order`, insert by order: rare, so linear), under the
        item's own tag."""
        self.live.add(item)
        self.entries += 2
        tag = item.tag
        queue = self.by_tag.get(tag)
        if queue is None:
            queue = self.by_tag[tag] = deque()
        if not in_order:
            self.all.append(item)
            queue.append(item)
            return
        order = self.order
        place = order(item)
        for queue in (self.all, queue):  # (dead entries too: an item may come back)
            at = next((i for i, other in enumerate(queue) if order(other) > place), len(queue))
            queue.insert(at, item)

    def _head(self, queue: deque[T]) -> T | None:
        """The oldest live item of `queue`, dropping the dead entries ahead of it."""
        live = self.live
        while queue:
            item = queue[0]
            if item in live:
                return item
            queue.popleft()
            self.entries -= 1
        return None

    def _tag_head(self, tag: int) -> T | None:
        """`_head` of a tag's queue, which goes once found empty."""
        queue = self.by_tag.get(tag)
        if queue is None:
            return None
        item = queue[0] if queue[0] in self.live else self._head(queue)
        if item is None:
            del self.by_tag[tag]
        return item

    def pop_oldest(self, tag: int) -> T | None:
        """Remove and return the oldest item that matches `tag`. Its entries go where
        they head their queues (most often, as where one tag is in use): lazy
        deletion leaves only the others behind."""
        live = self.live
        if not live:
            return None
        if tag == TAG_ANY:
            best = self._head(self.all)
            assert best is not None  # (every live item has an entry in `all`)
        else:
            best = self._tag_head(tag)
            other = self._tag_head(TAG_ANY) if TAG_ANY in self.by_tag else None
            if other is not None and (best is None or self.order(other) < self.order(best)):
                best = other
            if best is None:
                return None
        live.remove(best)
        queue = self.all  # (items are filed under their own tag, TAG_ANY too)
        if queue and queue[0] is best:
            queue.popleft()
            self.entries -= 1
        queue = self.by_tag[best.tag]
        if queue[0] is best:
            queue.popleft()
            self.entries -= 1
            if not queue:
                del self.by_tag[best.tag]
        if self.entries > 4 * len(live) + 8:
            self._rebuild()
        return best

    def remove(self, item: T) -> bool:
        live = self.live
        if item not in live:
            return False
        live.remove(item)
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
        self.all = deque(item for item in self.all if item in live)
        self.by_tag = {tag: kept for tag, queue in self.by_tag.items()
                       if (kept := deque(item for item in queue if item in live))}
        self.entries = len(self.all) + sum(map(len, self.by_tag.values()))


class Stream:
    """Point-to-point traffic from one source on one communicator, at one receiver."""

    def __init__(self) -> None:
        self.next_seq = 0
        self.early: dict[int, Message] = {}
        self._messages: _Queue[Message] = _Queue(attrgetter("seq"))
        self._recvs: _Queue[PostedRecv] = _Queue()

    def arrive(self, msg: Message) -> Sequence[tuple[PostedRecv, Message]]:
        """A message came; the (receive, message) pairs that now match."""
        if msg.seq == self.next_seq and not self.early:  # next in line (in process: all)
            self.next_seq += 1
            if msg.tombstone:
                return ()
            recvs = self._recvs
            recv = recvs.pop_oldest(msg.tag) if recvs.live else None
            if recv is None:
                self._messages.add(msg)
                return ()
            return ((recv, msg),)
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
            self._messages.add(msg, in_order=in_order)
            return None
        return recv, msg

    def post(self, recv: PostedRecv, in_order: bool = False) -> Message | None:
        """Post a receive (in submission order); its message, if one is waiting."""
        messages = self._messages
        msg = messages.pop_oldest(recv.tag) if messages.live else None
        if msg is None:
            self._recvs.add(recv, in_order=in_order)
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
