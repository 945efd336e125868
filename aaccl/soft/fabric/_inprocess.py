"""The in-process fabric: soft CCLOs of one process, sharing one progress engine.

Delivery is a call into the receiver's inbox in engine context. Rendezvous
payloads are never copied in transit: the receiver reads them straight from the
sender's device memory, which stays put until the receiver releases it.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Hashable
from functools import reduce
from typing import TYPE_CHECKING

import numpy as np

from ..._constants import ErrorCode, Scenario
from ..._errors import Aborted
from .._datapath import fold_one
from .._engine import Alarm, Engine, Wait
from .._failure import CallFailed
from ..algorithms import SMALL_ALLREDUCE_COUNT
from ._inbox import Inbox, mismatch
from ._message import Collective, Fingerprint, Message, MessageState, Port

log = logging.getLogger("aaccl")
RECEIVE_TIMEOUT = int(ErrorCode.RECEIVE_TIMEOUT_ERROR)
_new = object.__new__
_OPERAND = operator.itemgetter(0)  # (of a rank's entry in `Meeting.arrived`)

if TYPE_CHECKING:
    from .._calls._collective import CollectiveCall
    from .._calls._schedule import ScheduleCall
    from .._calls._state import SoftCall
    from .._calls._state import Comm
    from .._datapath import Datapath
    from ._message import Key


class InProcessFabric:
    """Connects the inboxes of one process's soft CCLOs, by session (global rank)."""

    def __init__(self, size: int) -> None:
        self.engine = Engine(f"inprocess-{size}")
        self.inboxes = [Inbox() for _ in range(size)]
        self.alarm = Alarm(self.engine, self._expire)  # the deadlines of the meetings
        self.activities: dict[int, Callable[[Hashable | None], str]] = {}  # session -> what it does now
        # the collectives some ranks have joined (the roll call, `_RollCall.join`), by
        # prefix: each one's meeting, which leaves the roll with the last rank to join
        self.roll: dict[Hashable, Meeting] = {}

    def port(self, session: int) -> InProcessPort:
        return InProcessPort(self, session)

    @staticmethod
    def _expire(meetings: list[Meeting]) -> None:
        for meeting in meetings:
            meeting.overdue()


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


class Meeting(Wait):
    """One collective as its ranks' calls report to the roll call, in process: the
    first valid call's fingerprint (every later one is compared with it at once),
    and how many ranks joined, each once, its call valid or not (`seen`): the entry
    leaves the fabric's roll with the last, and lives on in the calls that hold it.

    The ranks of a small allreduce also meet here, in shared memory (`_Meet`): the
    last to arrive computes everyone's result at once (O(N) work for N ranks,
    instead of N log N messages) and ends every rank's call, on the spot.

    A rank that sits down to wait waits for the meeting itself (`SoftCall.waiting`:
    an abort or a peer's notice withdraws it, `withdraw`, as any other wait), its
    rank known from its call. One deadline serves the meeting: parked in the
    fabric's alarm when the first rank sits down (with that rank's timeout), it
    fails every call still waiting then, naming the ranks that never came. Once a
    rank gave up (`leave`), nobody computes (it never arrives): the calls still to
    come sit down to wait all the same, and fail at their deadline or on the notice
    of the rank that gave up."""

    __slots__ = ("size", "seen", "first", "fp", "arrived", "waiting", "_fabric")

    size: int
    seen: int
    first: int  # the first valid call's rank (session) ...
    fp: Fingerprint | None  # ... and fingerprint (None: no valid call joined yet)
    # by communicator rank: (operand, result, datapath) of those that came (the others:
    # None); the last to come finds every other one seated (`waiting`)
    arrived: list[tuple[np.ndarray, np.ndarray, Datapath] | None]
    waiting: dict[int, ScheduleCall]  # ranks seated, waiting for the rest
    _fabric: InProcessFabric

    # (no __init__: `_RollCall.join` makes each in line, one call less per collective)

    def _compute(self, last: ScheduleCall) -> None:
        """Every rank's fingerprint equals the first's (the roll call): same count and
        dtype. Fold, then end every call."""
        retcode = 0
        try:
            arrived = self.arrived
            first, _, path = arrived[0]  # type: ignore[misc]  # (all came)
            if path.sums_floats and len(first) == 1:  # one float each: as scalars
                one = fold_one(map(_OPERAND, arrived))  # type: ignore[arg-type]
                for _, d, _ in arrived:  # type: ignore[misc]
                    d[0] = one
            else:
                total = self.fold()
                for _, d, _ in arrived:  # type: ignore[misc]
                    d[...] = total
        except Exception:  # a bug in the model fails this collective, and nothing else
            log.exception("soft CCLO: internal error in allreduce (its ranks meeting in process)")
            retcode = int(ErrorCode.DMA_INTERNAL_ERROR)
        self._fabric.alarm.parked.pop(self, None)
        for call in self.waiting.values():  # (`finish` drops its seat: nothing comes back here)
            call.finish(retcode)
        last.finish(retcode)

    def fold(self) -> np.ndarray:
        """Every rank's contribution combined in rank order, as the schedules do,
        into a new array."""
        arrived = self.arrived
        total, _, path = arrived[0]  # type: ignore[misc]  # (all came)
        if path.arith == path.dtype:
            # (`Datapath.combine`'s common case, folded by C) a new array per step: numpy
            # takes 3x as long for an output that is also an input (its overlap check),
            # and these arrays are small
            return reduce(path.ufunc, map(_OPERAND, arrived))  # type: ignore[arg-type]
        total = total.copy()
        for r in range(1, self.size):
            src, _, path = arrived[r]  # type: ignore[misc]
            path.combine(total, src, total)
        return total

    def overdue(self) -> None:
        """The deadline: the calls waiting here fail (engine context)."""
        # every call's words first: each expiry takes its rank out of the meeting
        expiring = [(call, call.timeout_detail(call.waiting))  # type: ignore[arg-type]
                    for call in self.waiting.values()]
        for call, detail in expiring:
            call.expire(detail)

    def withdraw(self, call: SoftCall) -> bool:
        """`call` gives up its seat (an abort, a peer's notice, the deadline)."""
        self.leave(call.comm.rank)  # type: ignore[attr-defined]  # (a collective's)
        return True

    def missing(self) -> list[int]:
        """The communicator ranks that have not arrived."""
        return [r for r, came in enumerate(self.arrived) if came is None]

    def leave(self, rank: int) -> None:
        """A rank gave up (its call failed, or never ran): the others cannot finish
        (it never arrives, so nobody computes)."""
        self.arrived[rank] = None
        self.waiting.pop(rank, None)
        if not self.waiting:  # nobody waits here any more
            self._fabric.alarm.parked.pop(self, None)


class _RollCall(Collective):
    """In process, every rank's call of a collective reports to the fabric's roll
    call (`InProcessFabric.roll`), which compares it with the first one's at once:
    a mismatch is found even where the two exchange no message, as a gather's roots
    of different opinion do not. Every rank counts once, its call valid or not, so
    that the entry ends with the last."""

    __slots__ = ("port", "roll")  # (set by InProcessPort: no __init__, one call less per call)

    port: InProcessPort
    roll: dict[Hashable, Meeting]  # (the fabric's)
    shared = True  # one per port (`_Meet` too): what a call did there is the call's
    meets = False  # its calls meet in the entry (`_Meet`), which they hold until they come

    def join(self, call: CollectiveCall | _Absent) -> tuple[int, str] | None:
        """The mismatch with the first rank that joined, if their calls differ. Every
        rank's call reports, valid or not (`fp` None: `reject`, `_Absent`): the
        collective's entry, made by the first to report, counts it, and leaves the
        roll with the last."""
        roll, key, fp = self.roll, call.prefix, call.fp
        meeting = roll.get(key)
        if meeting is None:  # the first makes the entry (in line), which counts it
            meeting = roll[key] = _new(Meeting)
            meeting.done, meeting.value, meeting.waiter = False, None, None  # (as a Wait)
            meeting.timeout_code = RECEIVE_TIMEOUT
            meeting.size = size = call.comm.size  # type: ignore[union-attr]  # (a collective's)
            meeting._fabric, meeting.first, meeting.fp = self.port.fabric, self.port.session, fp
            meeting.seen, meeting.arrived, meeting.waiting = 1, [None] * size, {}
        else:
            meeting.seen += 1
            if meeting.seen == meeting.size:  # the last (of 2 or more): nobody looks it up again
                del roll[key]
        call.meeting = meeting if self.meets else None
        return None if meeting.fp == fp or fp is None else self._differs(fp, meeting)

    def _differs(self, fp: Fingerprint, meeting: Meeting) -> tuple[int, str] | None:
        """Our call's fingerprint is not the first's: the mismatch, unless the ranks
        before us all rejected their calls (we are the first valid one, then)."""
        if meeting.fp is None:
            meeting.first, meeting.fp = self.port.session, fp
            return None
        return mismatch(fp, meeting.fp, self.port.session, meeting.first)

    def reject(self, call: CollectiveCall, failed: CallFailed) -> None:
        assert call.fp is None  # (it counts in the roll, compared with nothing)
        self.join(call)
        call.meeting = None


class _Absent:
    """A rank's call of a collective that never came to be (the host rejected it),
    as the roll call sees it: it counts all the same (`InProcessPort.skip`)."""

    __slots__ = ("prefix", "comm", "meeting")

    fp = None
    meeting: Meeting | None  # (as a call's, set by `join`)

    def __init__(self, prefix: Key, comm: Comm) -> None:
        self.prefix, self.comm = prefix, comm


class _Meet(_RollCall):
    """A small allreduce meets its peers in shared memory (`Meeting`): the last to
    come computes everyone's result and ends their calls, and no message is sent.
    The roll call has compared the calls already: the meeting compares nothing.
    One per port, for all its calls: a call holds its meeting from the roll call
    (`call.meeting`) until it comes or gives its place up."""

    __slots__ = ()

    meets = True

    def start(self, call: ScheduleCall) -> bool:
        meeting, call.meeting = call.meeting, None  # (it comes: nothing to give up later)
        args, dev, rank = call.args, call.dev, call.comm.rank  # type: ignore[union-attr]
        ours = dev.views.get((args.addr_0, args.addr_2, call.path, args.count))  # (src, dst, path)
        if ours is None:
            ours = self._views(call, meeting)
            if ours is None:
                return True  # (failed)
        # Take part: the last to arrive computes and ends every call; the others wait
        # for the meeting. If a rank gave up, nobody computes: the calls fail at the
        # deadline (or on the notice of the rank that gave up).
        meeting.arrived[rank] = ours
        waiting = meeting.waiting
        if len(waiting) == meeting.size - 1:  # every other rank came: the last
            meeting._compute(call)
            return True
        waiting[rank], call.waiting = call, meeting
        if len(waiting) == 1:  # the first to sit down sets the meeting's deadline
            self.port.fabric.alarm.park(meeting, dev.timeout)
        if dev.gone:  # waits for a rank that left the world?
            sessions = call.comm.sessions  # type: ignore[union-attr]
            gone = [sessions[r] for r in meeting.missing() if sessions[r] in dev.gone]
            if gone:
                call.aborting = Aborted(f"rank {gone[0]} left the world: {dev.gone[gone[0]]}")
                call.interrupt(CallFailed(RECEIVE_TIMEOUT))
        return True

    @staticmethod
    def _views(call: ScheduleCall, meeting: Meeting
               ) -> tuple[np.ndarray, np.ndarray, Datapath] | None:
        """The call's operand and result in device memory, with its datapath, kept in
        its CCLO's views; None if the CCLO cannot decode an address: the call then
        failed (and left its meeting)."""
        args, dev, path = call.args, call.dev, call.path
        assert path is not None and call.comm is not None
        try:
            ours = dev.views[(args.addr_0, args.addr_2, path, args.count)] = (
                dev.array(args.addr_0, path.dtype, args.count),
                dev.array(args.addr_2, path.dtype, args.count), path)
        except CallFailed as failed:
            meeting.leave(call.comm.rank)
            call.finish(failed.code, failed.detail)
            return None
        return ours

    def abandon(self, call: CollectiveCall) -> None:
        meeting = call.meeting
        if meeting is not None:  # the others must not wait for us
            assert call.comm is not None
            call.meeting = None
            meeting.leave(call.comm.rank)


class InProcessPort(Port):
    def __init__(self, fabric: InProcessFabric, session: int) -> None:
        self.fabric, self.session = fabric, session
        self.engine = fabric.engine
        self.inbox = fabric.inboxes[session]
        self._roll, self._meet = _RollCall(), _Meet()
        self._roll.port, self._roll.roll = self, fabric.roll
        self._meet.port, self._meet.roll = self, fabric.roll

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
            self._roll.join(_Absent(prefix, comm))

    def register(self, activity: Callable[[Hashable | None], str]) -> None:
        """How others can see what this session's CCLO is doing (for their errors)."""
        self.fabric.activities[self.session] = activity

    def activity(self, session: int, key: Hashable | None = None) -> str | None:
        """What session's CCLO is doing now, in words (engine context)."""
        describe = self.fabric.activities.get(session)
        return None if describe is None else describe(key)
