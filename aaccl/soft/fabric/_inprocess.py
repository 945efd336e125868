"""The in-process fabric: soft CCLOs of one process, sharing one progress engine.

Delivery is a call into the receiver's inbox in engine context. Rendezvous
payloads are never copied in transit: the receiver reads them straight from the
sender's device memory, which stays put until the receiver releases it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

import numpy as np

from ..._constants import ErrorCode, Scenario
from ..._errors import Aborted
from .._engine import Alarm, Engine, Wait
from .._failure import CallFailed
from ..algorithms import SMALL_ALLREDUCE_COUNT
from ._inbox import Inbox, mismatch
from ._message import Collective, Fingerprint, Message, MessageState, Port

log = logging.getLogger("aaccl")
RECEIVE_TIMEOUT = int(ErrorCode.RECEIVE_TIMEOUT_ERROR)
_new = object.__new__

if TYPE_CHECKING:
    from .._calls._collective import CollectiveCall
    from .._calls._schedule import ScheduleCall
    from .._calls._state import Comm
    from .._datapath import Datapath
    from ._message import Key


class InProcessFabric:
    """Connects the inboxes of one process's soft CCLOs, by session (global rank)."""

    def __init__(self, size: int) -> None:
        self.engine = Engine(f"inprocess-{size}")
        self.inboxes = [Inbox() for _ in range(size)]
        self.meetings: dict[Hashable, Meeting] = {}
        self.alarm = Alarm(self.engine, self._expire)  # the deadlines of the meetings
        self.activities: dict[int, Callable[[Hashable | None], str]] = {}  # session -> what it does now
        # collectives some ranks have joined: the first one's call, and how many came
        # (every rank counts once, its call valid or not: the entry ends with the last)
        self.roll: dict[Hashable, tuple[tuple[int, Fingerprint] | None, int]] = {}

    def port(self, session: int) -> InProcessPort:
        return InProcessPort(self, session)

    def meeting(self, key: Hashable, size: int) -> Meeting:
        """The meeting of the collective `key` (gone once each rank came or left)."""
        meeting = self.meetings.get(key)
        if meeting is None:
            meeting = self.meetings[key] = Meeting(size, self, key)
        return meeting

    @staticmethod
    def _expire(meetings: list[Meeting]) -> None:
        for meeting in meetings:
            meeting.expire()


class _Handover(Wait):
    """A send whose message waits at session `dst`'s inbox (for room in its rx
    buffers, or, rendezvous, for a receive to read it from our memory): done once
    stored or released. Made in line by `InProcessPort.post`, which sets every slot."""

    __slots__ = ("inbox", "msg", "dst")  # (no __init__: see `InProcessPort.post`)

    inbox: Inbox
    msg: Message
    dst: int  # the receiver's session (a collective's call names it when it waits)

    def expire(self) -> bool:
        """Withdraw the message if no receive has started on it (then the send
        fails); a receive reading it now finishes without a deadline."""
        return self.inbox.withdraw(self.msg) or self.msg.state == MessageState.WITHDRAWN


class Meeting:
    """Where the ranks of one small allreduce meet in shared memory: the last to
    arrive computes everyone's result at once (O(N) work for N ranks, instead of
    N log N messages) and ends every rank's call, on the spot.

    One deadline serves the meeting: parked in the fabric's alarm when the first
    rank sits down to wait (with that rank's timeout), it fails every call still
    waiting then, naming the ranks that never came. It is forgotten once every rank came or gave up, or once
    a rank gave up and nobody waits in it any more (a rank that rejected its call
    never comes): a rank still to come then meets in a fresh one, which can never
    complete either, so its call fails at its deadline (or on a peer's notice)."""

    __slots__ = ("size", "arrived", "waiting", "seen", "abandoned", "_fabric", "_key")

    def __init__(self, size: int, fabric: InProcessFabric, key: Hashable) -> None:
        self.size, self._fabric, self._key = size, fabric, key
        self.arrived: dict[int, tuple[np.ndarray, np.ndarray, Datapath]] = {}
        self.waiting: dict[int, ScheduleCall] = {}  # ranks seated, waiting for the rest
        self.seen = 0
        self.abandoned = False

    def _forget(self) -> None:
        meetings = self._fabric.meetings
        if meetings.get(self._key) is self:
            del meetings[self._key]

    def _compute(self, last: ScheduleCall) -> None:
        """Every rank's fingerprint equals the first's (the roll call): same count and
        dtype. Fold, then end every call."""
        arrived = self.arrived
        retcode = 0
        try:
            total = self.fold()
            for _, d, _ in arrived.values():
                d[...] = total
        except Exception:  # a bug in the model fails this collective, and nothing else
            log.exception("soft CCLO: internal error in allreduce (its ranks meeting in process)")
            retcode = int(ErrorCode.DMA_INTERNAL_ERROR)
        self._fabric.alarm.parked.pop(self, None)
        waiting, self.waiting = self.waiting, {}
        for call in waiting.values():
            call.waiting = None
            call.finish(retcode)
        last.finish(retcode)

    def fold(self) -> np.ndarray:
        """Every rank's contribution combined in rank order, as the schedules do,
        into a new array."""
        arrived = self.arrived
        total, _, path = arrived[0]
        if path.arith != path.dtype:
            total = total.copy()
            for r in range(1, self.size):
                src, _, path = arrived[r]
                path.combine(total, src, total)
            return total
        # (`Datapath.combine`'s common case, inline) a new array per step: numpy takes
        # 3x as long for an output that is also an input (its overlap check), and
        # these arrays are small
        ufunc = path.ufunc
        for r in range(1, self.size):
            total = ufunc(total, arrived[r][0])
        return total

    def expire(self) -> None:
        """The deadline: the calls waiting here fail (engine context)."""
        # every call's words first: each expiry takes its rank out of the meeting
        expiring = [(call, call.timeout_detail(call.waiting))  # type: ignore[arg-type]
                    for call in self.waiting.values()]
        for call, detail in expiring:
            call.expire(detail)

    def leave(self, rank: int, arrived: bool) -> None:
        """A rank gave up (its call failed, or never ran): the others cannot finish."""
        self.abandoned = True
        self.arrived.pop(rank, None)
        self.waiting.pop(rank, None)
        if not arrived:
            self.seen += 1
            if self.seen == self.size:
                self._forget()
        if not self.arrived:  # nobody waits here any more
            self._forget()
            self._fabric.alarm.parked.pop(self, None)


class _Seat(Wait):
    """A rank's wait in a meeting: `SoftCall.waiting` while it waits, so that an
    abort or a peer's notice withdraws it (`expire`) as any other wait."""

    __slots__ = ("meeting", "rank")  # (no __init__: `Meeting.arrive` seats the rank)

    meeting: Meeting
    rank: int

    def expire(self) -> bool:
        self.meeting.leave(self.rank, arrived=True)
        return True

    def missing(self) -> list[int]:
        """The communicator ranks that have not arrived."""
        return [r for r in range(self.meeting.size) if r not in self.meeting.arrived]


class _RollCall(Collective):
    """In process, every rank's call of a collective reports to the fabric's roll
    call (`InProcessFabric.roll`), which compares it with the first one's at once:
    a mismatch is found even where the two exchange no message, as a gather's roots
    of different opinion do not. Every rank counts once, its call valid or not, so
    that the entry ends with the last."""

    __slots__ = ("port",)  # (set by InProcessPort: no __init__, one call less per call)

    port: InProcessPort
    shared = True  # one per port (`_Meet` too): what a call did there is the call's

    def join(self, call: CollectiveCall) -> tuple[int, str] | None:
        """The mismatch with the first rank that joined, if their calls differ."""
        assert call.comm is not None and call.fp is not None
        roll, key, session, fp = self.port.fabric.roll, call.prefix, call.dev.session, call.fp
        first, seen = roll.get(key, (None, 0))
        if seen + 1 >= call.comm.size:
            roll.pop(key, None)
        else:
            roll[key] = (first or (session, fp), seen + 1)
        if first is None or first[1] == fp:
            return None
        return mismatch(fp, first[1], session, first[0])

    def reject(self, call: CollectiveCall, failed: CallFailed) -> None:
        assert call.comm is not None
        self.port.absent(call.prefix, call.comm.size)


class _Meet(_RollCall):
    """A small allreduce meets its peers in shared memory (`Meeting`): the last to
    come computes everyone's result and ends their calls, and no message is sent.
    The roll call has compared the calls already: the meeting compares nothing.
    One per port, for all its calls: what a call did there is the call's (`call.met`)."""

    __slots__ = ()

    def start(self, call: ScheduleCall) -> bool:
        args, dev, comm, prefix = call.args, call.dev, call.comm, call.prefix
        assert comm is not None and prefix is not None and call.path is not None
        dtype, count = call.path.dtype, args.count
        views = dev.views  # (looked up here: a loop of small calls finds them kept)
        src = views.get((args.addr_0, dtype, count))
        if src is None:
            src = dev.array(args.addr_0, dtype, count)
        dst = views.get((args.addr_2, dtype, count))
        if dst is None:
            dst = dev.array(args.addr_2, dtype, count)
        fabric = self.port.fabric
        meeting = fabric.meetings.get(prefix)  # (`InProcessFabric.meeting`, inline)
        if meeting is None:
            meeting = fabric.meetings[prefix] = Meeting(comm.size, fabric, prefix)
        call.met = True
        # Take part: the last to arrive computes and ends every call; the others wait,
        # seated. If a rank gave up, nobody computes: the calls fail at the deadline (or
        # on the notice of the rank that gave up).
        rank = comm.rank
        meeting.seen += 1
        if meeting.seen == meeting.size:  # every rank came or gave up: not looked up again
            meeting._forget()
        if not meeting.abandoned:
            arrived = meeting.arrived
            arrived[rank] = (src, dst, call.path)
            if len(arrived) == meeting.size:
                meeting._compute(call)
                return True
        seat = _new(_Seat)  # (no __init__: one call less per waiting rank)
        seat.done, seat.value, seat.waiter, seat.timeout_code = False, None, None, RECEIVE_TIMEOUT
        seat.meeting, seat.rank = meeting, rank
        meeting.waiting[rank] = call
        call.waiting = seat
        alarm = fabric.alarm
        if meeting not in alarm.parked:
            alarm.park(meeting, dev.timeout)
        if dev.gone:  # waits for a rank that left the world?
            gone = [comm.sessions[r] for r in seat.missing() if comm.sessions[r] in dev.gone]
            if gone:
                call.aborting = Aborted(f"rank {gone[0]} left the world: {dev.gone[gone[0]]}")
                call.interrupt(CallFailed(RECEIVE_TIMEOUT))
        return True

    def abandon(self, call: CollectiveCall) -> None:
        if not call.met:  # the others must not wait for us
            call.met = True
            assert call.comm is not None
            self.port.fabric.meeting(call.prefix, call.comm.size).leave(call.comm.rank, False)


class InProcessPort(Port):
    def __init__(self, fabric: InProcessFabric, session: int) -> None:
        self.fabric, self.session = fabric, session
        self.engine = fabric.engine
        self.inbox = fabric.inboxes[session]
        self._roll = _RollCall()
        self._roll.port = self
        self._meet = _Meet()
        self._meet.port = self

    def post(self, dst: int, msg: Message, timeout_code: int) -> Wait | None:
        inbox = self.fabric.inboxes[dst]
        if inbox.deliver(msg):
            return None
        handover = _new(_Handover)  # (its __init__ and Wait's, in line: two calls less)
        handover.done, handover.value, handover.waiter = False, None, None
        handover.timeout_code, handover.inbox, handover.msg = timeout_code, inbox, msg
        handover.dst = dst
        msg.consumed = handover
        return handover

    def absent(self, key: Hashable, size: int) -> None:
        """This rank's call of collective `key` (of `size` ranks) will not run (the
        host rejected it, or it is invalid): it counts in the roll all the same."""
        roll = self.fabric.roll
        first, seen = roll.get(key, (None, 0))
        if seen + 1 >= size:
            roll.pop(key, None)
        else:
            roll[key] = (first, seen + 1)

    def collective(self, call: CollectiveCall) -> Collective | None:
        """Every collective of more than one rank reports to the roll call; a small
        allreduce also meets its peers in shared memory."""
        comm, args = call.comm, call.args
        assert comm is not None
        if comm.size == 1:
            return None
        if args.scenario == Scenario.ALLREDUCE and args.count <= SMALL_ALLREDUCE_COUNT \
                and not args.compression_flags:
            return self._meet
        return self._roll

    def skip(self, comm: Comm, prefix: Key, reason: str) -> None:
        if comm.size > 1:  # it counts, so that the roll's entry ends
            self.absent(prefix, comm.size)

    def register(self, activity: Callable[[Hashable | None], str]) -> None:
        """How others can see what this session's CCLO is doing (for their errors)."""
        self.fabric.activities[self.session] = activity

    def activity(self, session: int, key: Hashable | None = None) -> str | None:
        """What session's CCLO is doing now, in words (engine context)."""
        describe = self.fabric.activities.get(session)
        return None if describe is None else describe(key)
