"""The in-process fabric: soft CCLOs of one process, sharing one progress engine.

Delivery is a call into the receiver's inbox in engine context. Rendezvous
payloads are never copied in transit: the receiver reads them straight from the
sender's device memory, which stays put until the receiver releases it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from ..._constants import ErrorCode
from .._engine import Engine, Wait
from ._inbox import Inbox, mismatch
from ._message import Fingerprint, Message, MessageState


class InProcessFabric:
    """Connects the inboxes of one process's soft CCLOs, by session (global rank)."""

    def __init__(self, size: int) -> None:
        self.engine = Engine(f"inprocess-{size}")
        self.inboxes = [Inbox() for _ in range(size)]
        self.meetings: dict[Hashable, Meeting] = {}
        self.activities: dict[int, Callable[[], str]] = {}  # session -> what it does now
        # collectives some ranks have joined: the first one's call, and how many came
        # (every rank counts once, its call valid or not: the entry ends with the last)
        self.roll: dict[Hashable, tuple[tuple[int, Fingerprint] | None, int]] = {}

    def port(self, session: int) -> InProcessPort:
        return InProcessPort(self, session)


class _Handover(Wait):
    """A send whose payload the receiver (session `dst`) reads from our memory: done
    once released."""

    __slots__ = ("inbox", "msg", "dst")

    def __init__(self, inbox: Inbox, msg: Message, timeout_code: int, dst: int) -> None:
        super().__init__(timeout_code)
        self.inbox, self.msg, self.dst = inbox, msg, dst

    def expire(self) -> bool:
        """Withdraw the message if no receive has started on it (then the send
        fails); a receive reading it now finishes without a deadline."""
        return self.inbox.withdraw(self.msg) or self.msg.state == MessageState.WITHDRAWN


class Meeting:
    """Where the ranks of one small collective meet in shared memory: the last to
    arrive computes everyone's result at once (O(N) work for N ranks, instead of
    N log N messages), then sets every rank's wait.

    It is forgotten once every rank came or gave up, or once a rank gave up and
    nobody waits in it any more (a rank that rejected its call never comes): a
    rank still to come then meets in a fresh one, which can never complete either,
    so its call fails at its deadline (or on a peer's notice) as it would here."""

    __slots__ = ("size", "arrived", "seats", "seen", "abandoned", "_meetings", "_key", "first")

    def __init__(self, size: int, meetings: dict[Hashable, Meeting], key: Hashable) -> None:
        self.size, self._meetings, self._key = size, meetings, key
        self.arrived: dict[int, Any] = {}
        self.seats: list[_Seat] = []
        self.seen = 0
        self.abandoned = False
        self.first: tuple[int, Fingerprint] | None = None  # who came first, with what

    def check(self, session: int, fp: Fingerprint) -> tuple[int, str] | None:
        """A rank's call against the first one's: the mismatch, if they differ."""
        if self.first is None:
            self.first = (session, fp)
            return None
        other, theirs = self.first
        return None if theirs == fp else mismatch(fp, theirs, session, other)

    def _count(self) -> None:
        self.seen += 1
        if self.seen == self.size:  # every rank came or gave up: nobody looks it up again
            self._forget()

    def _forget(self) -> None:
        if self._meetings.get(self._key) is self:
            del self._meetings[self._key]

    def arrive(self, rank: int, contribution: Any,
               compute: Callable[[list[Any]], int]) -> Wait:
        """Take part; the Wait is set with a retcode once every rank has arrived and
        `compute` (run by the last to arrive) has run on the contributions in rank
        order. If a rank gave up, it is never set: the call fails at its deadline."""
        seat = _Seat(self, rank)
        self._count()
        if not self.abandoned:
            self.seats.append(seat)
            self.arrived[rank] = contribution
            if len(self.arrived) == self.size:
                retcode = compute([self.arrived[r] for r in range(self.size)])
                for each in self.seats:
                    each.set(retcode)
        return seat

    def leave(self, rank: int, arrived: bool) -> None:
        """A rank gave up (its call failed, or never ran): the others cannot finish."""
        self.abandoned = True
        self.arrived.pop(rank, None)
        if not arrived:
            self._count()
        if not self.arrived:  # nobody waits here any more
            self._forget()


class _Seat(Wait):
    __slots__ = ("meeting", "rank")

    def __init__(self, meeting: Meeting, rank: int) -> None:
        super().__init__(int(ErrorCode.RECEIVE_TIMEOUT_ERROR))
        self.meeting, self.rank = meeting, rank

    def expire(self) -> bool:
        self.meeting.leave(self.rank, arrived=True)
        return True

    def missing(self) -> list[int]:
        """The communicator ranks that have not arrived."""
        return [r for r in range(self.meeting.size) if r not in self.meeting.arrived]


class InProcessPort:
    def __init__(self, fabric: InProcessFabric, session: int) -> None:
        self.fabric, self.session = fabric, session
        self.engine = fabric.engine
        self.inbox = fabric.inboxes[session]

    def post(self, dst: int, msg: Message, timeout_code: int) -> Wait | None:
        inbox = self.fabric.inboxes[dst]
        if inbox.deliver(msg):
            return None
        handover = _Handover(inbox, msg, timeout_code, dst)
        msg.consumed = handover
        return handover

    def roll_call(self, key: Hashable, size: int, session: int,
                  fp: Fingerprint | None) -> tuple[int, str] | None:
        """Join collective `key` of `size` ranks: the mismatch with the first rank
        that joined, if their calls differ (found even where the two exchange no
        message, as a gather's roots of different opinion do not). `fp` None: our
        call of it will not run (the host rejected it, or it is invalid); it still
        counts, so that the entry ends once every rank came."""
        roll = self.fabric.roll
        first, seen = roll.get(key, (None, 0))
        seen += 1
        if first is None and fp is not None:
            first = (session, fp)
        if seen >= size:
            roll.pop(key, None)
        else:
            roll[key] = (first, seen)
        if fp is None or first is None:
            return None
        other, theirs = first
        return None if theirs == fp else mismatch(fp, theirs, session, other)

    def register(self, activity: Callable[[], str]) -> None:
        """How others can see what this session's CCLO is doing (for their errors)."""
        self.fabric.activities[self.session] = activity

    def activity(self, session: int) -> str | None:
        """What session's CCLO is doing now, in words (engine context)."""
        describe = self.fabric.activities.get(session)
        return None if describe is None else describe()

    def meeting(self, key: Hashable, size: int) -> Meeting:
        """The meeting of the collective `key` (gone once each rank came or left)."""
        meetings = self.fabric.meetings
        meeting = meetings.get(key)
        if meeting is None:
            meeting = meetings[key] = Meeting(size, meetings, key)
        return meeting

    def close(self) -> None:
        pass
