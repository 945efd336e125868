"""The MPI fabric: one soft CCLO per process, messages carried by MPI (mpi4py).

Every message travels as a small header (pickled), followed in the same MPI message
by its payload if that is small, or else by the payload as raw bytes under a tag of
its own. Whoever polls receives them and posts them to the process's progress engine
as events: a task awaiting a call polls for a while itself (so a quick answer
completes the call on the event loop's thread), and otherwise a progress thread
does, so neither the event loop nor MPI ever waits on the other. The receiver
acknowledges a message once it is done with it.

Flow control keeps the eager semantics of the CCLO: a sender may have at most its
share of the receiver's rx buffers (`nbufs / (size - 1)` segments) in eager
messages not yet acknowledged (an eager message is acknowledged when its rx
buffers are free again). Within that window an eager send completes as soon as
MPI has a copy of the data. An eager message beyond it waits for room, as on a
card: it goes out at once, for a receive to take (acknowledged then: the payload
is the receiver's own copy), and its send completes when that happens or when
acknowledgements of earlier messages make room for it in the window, whichever
comes first; it holds up later eager messages to the same rank meanwhile. A
message above the eager threshold completes when its receive has taken it.

A point-to-point message outside the window moves by rendezvous: the header goes
at once, the payload stays with the sender until a receive matches the message,
and the receiver then asks for it (READY) with its MPI receive already posted; an
eager one that acknowledgements make room for meanwhile sends it then (PUSH, then
the payload). So a receiver holds no payload beyond its rx buffers' share that its
receives have not asked for. A sender whose
deadline passes asks the receiver to withdraw its message (WITHDRAW) and waits
for the answer: WITHDRAWN, or the acknowledgement of a receive that took it
first; sender and receiver never disagree.

A process of the job may die at any moment (killed, out of memory). Nothing here
waits on one peer inside MPI: payloads are received with nonblocking receives that
the progress thread tests (their messages are still delivered in order), an MPI error
(MPICH reports one when it cannot read a dead sender's memory) drops that message and
the progress thread goes on, and the calls waiting for the dead peer fail on their
own timeouts. Closing waits for the other ranks as long as they live, however long
their own code takes, and stops waiting once a process of the job is known to be dead
(hydra tells the survivors with SIGUSR1, see `process_lost`; a peer on this machine
is watched by its pid, see `missing`), and then watches the interpreter's exit: if
MPI's finalization outlasts EXIT_GRACE seconds, SIGALRM ends the process.

No progress thread is inside MPI when MPI is finalized: closing joins it, and so does
the interpreter's exit for a world that never closed (see `_at_exit`).
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import itertools
import math
import os
import pickle
import signal
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

import numpy as np

from ... import _threads
from ..._constants import Scenario
from ..._errors import Aborted
from .._engine import Engine, Wait
from . import _blocks as blocks
from ._inbox import Inbox
from ._lane import Lane, Op, keep_to_exit
from ._message import Collective, Key, Message, MessageState, Port

if TYPE_CHECKING:
    from .._calls._collective import CollectiveCall
    from .._calls._schedule import ScheduleCall
    from .._calls._state import Comm

HEADER, ACK, WITHDRAW = 1, 2, 3
READY, WITHDRAWN, PUSH = 0, 1, 2
"""Messages under ACK besides acknowledgements (a message id): (READY, id) asks the
sender for a payload, (WITHDRAWN, id) agrees to drop a message, and (PUSH, id,
nbytes) says that the payload comes right behind (see `_granted`)."""
NOTICES = ("leave", "abort", "fp")
"""Messages that only tell peers what happened here (see `post`)."""
PAYLOAD_TAGS = 1 << 20
"""Payload tags are PAYLOAD_TAGS + (message id modulo PAYLOAD_TAGS), past the control tags."""

IDLE_SLEEP = 0.0002
IDLE_NAP = 0.002
"""The progress thread's nap between polls while nothing of this process is under way
(no call, no MPI transfer of ours): an open world that waits costs next to no CPU,
and leaves the cores to the program's own MPI calls (a wake-up every IDLE_SLEEP
slowed four processes' 16 MiB MPI_Allreduce on 2 CPUs by a third). A task that parks
wakes it at once."""
TASK_NAP = 0.005
"""While tasks poll, the progress thread looks only this often (or when one parks)."""

INLINE_BYTES = 1 << 14
"""Payloads up to this size travel in their header's message: one MPI message to
match, and no payload receive to wait for."""

SPIN = 0.0005
"""For SPIN seconds after the last message the progress thread polls with only a
sleep(0) between polls (a loop without any sleep would keep the GIL, for up to the
interpreter's 5 ms switch interval, from the threads a message has just woken); then
it naps IDLE_SLEEP between polls, leaving the cores to compute."""


JOIN_LIMIT = 5.0
"""Seconds `close` waits for the progress thread to stop."""
INTERRUPTED = 130
"""The exit status of a rank that dies of an uncaught KeyboardInterrupt (see `_at_exit`)."""
LOOK_EVERY = 0.05
"""Seconds between two looks at the pids of the peers on this machine (`missing`)."""
EXIT_GRACE = 5
"""Seconds a process whose world lost a peer may take to exit, MPI_Finalize included."""

_open: weakref.WeakSet[MPIFabric] = weakref.WeakSet()
_closing = threading.Condition()  # notified as each `close` under way ends
_closes = 0  # how many are under way (on any thread)
_ended: list[str] = []  # why a process of the job ended (`process_lost`), once one has
_dead: dict[int, str] = {}



def _payload_tag(msg_id: int) -> int:
    return PAYLOAD_TAGS + msg_id % PAYLOAD_TAGS


class MPIFabric:
    """This process's end of an MPI world of soft CCLOs (one rank per process)."""

    def __init__(self, comm: Any, nbufs: int, bufsize: int,
                 opened: Opened | None = None) -> None:
        """`opened`: what `opening(comm)` made, waited for by the caller (nonblocking:
        `aaccl.open_world`); without it, made here, in MPI's blocking waits."""
        if opened is None:
            opened = _wait_all(opening(comm, []))
        # a communicator of our own (no clash with the user's MPI), the lane's (below),
        # and the peers whose processes this one can watch (same kernel, same pid
        # namespace)
        self.comm, lane_comm, self._neighbours = opened
        _job_pids.update(self._neighbours)
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.engine = Engine(f"mpi-{self.rank}")
        self.inbox = Inbox()
        self.bufsize = bufsize
        self.window = max(1, nbufs // max(1, self.size - 1))
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._in_flight: list[tuple[Any, object]] = []  # MPI requests and what they send
        self._eager: dict[int, tuple[int, int]] = {}  # id -> (dst, segments) awaiting ack
        self._used = [0] * self.size  # eager segments awaiting ack, per destination
        self._waiting: dict[int, _Awaited] = {}  # non-eager sends awaiting ack, by id
        # per destination, eager sends beyond the window, in order: (id, segments)
        self._for_room: list[deque[tuple[int, int]]] = [deque() for _ in range(self.size)]
        self._held: dict[int, np.ndarray] = {}  # payloads the receivers will ask for, by id
        self._holding = threading.Lock()  # a payload is held once its header is sent
        self._left_world = False  # our "leave" notice went: no payload goes after it
        self._incoming: dict[tuple[int, int], Message] = {}  # non-eager, by (src, id)
        # payloads asked for, by (src, id): their receives, and withdrawals waiting for them
        self._fetches: dict[tuple[int, int], tuple[Any, np.ndarray | None]] = {}
        self._asked: set[tuple[int, int]] = set()
        self._left: set[int] = set()  # peers whose "leave" notice came: they answer no more
        # per source, what arrived and waits (behind a payload still coming) to be handled
        self._arriving: dict[int, deque[tuple[Any, Callable[..., Any], tuple[Any, ...]]]] = {}
        self.lost: str | None = None  # why a peer is known to be gone, if one is
        self._deaths: list[dict[int, str]] = []  # ranks found dead, not yet buried
        self.buried: dict[int, str] = {}  # rank -> how its process ended (`_bury`): never sent to
        self.mpi_errors: list[str] = []  # what MPI reported (about dead peers), first few
        self._closed = False
        self._farewells = 0  # peers' last messages, one per control tag each (`close`)
        self._said_farewell = False  # sends nothing more: see `close`
        self._sending = threading.RLock()  # a send's check of the above, and its start
        self._poll_lock = threading.Lock()  # one poller at a time: arrivals stay in order
        self._polled_at = -math.inf  # when a task last polled (`poll`)
        self._tasks_gone = threading.Event()  # a polling task parked (`park`)
        self._busy: Callable[[], bool] = lambda: True  # has this rank's device calls under way?
        self._before = self._before_end  # (bound once: every poll hands it to the lane)
        from mpi4py import MPI

        self._mpi, self._byte, self._status = MPI, MPI.BYTE, MPI.Status()
        self._fetch_status = MPI.Status()
        # the world's collectives run as MPI collectives, on a communicator of their own
        self.lane: Lane | None = \
            None if lane_comm is None else Lane(lane_comm, self.engine, _ended)
        self.world_key = tuple(range(self.size))
        self._next_look = 0.0  # when `missing` next reads their pids
        _open.add(self)
        _exit_last()
        self._thread = _threads.start(self._progress, f"aaccl-mpi-{self.rank}")

    def port(self, session: int) -> MPIPort:
        assert session == self.rank
        return MPIPort(self)

    # -- sending ------------------------------------------------------------------

    def post(self, dst: int, msg: Message, timeout_code: int) -> Wait | None:
        if self.buried:
            # A process died: MPI is not used any more (see `_bury`). Notices are left
            # unsaid (the others learn what this rank learnt, from the launcher), and
            # anything else fails at its deadline: never reported sent.
            return None if msg.key[0] in NOTICES or msg.tombstone else Wait(timeout_code)
        payload = msg.payload
        nbytes = 0 if payload is None else payload.nbytes
        segments = -(-nbytes // self.bufsize)
        queued = pull = False  # an eager message waiting for room in the window
        with self._lock:
            msg_id = next(self._ids)
            eager = msg.eager and not msg.tombstone and not self._waits_for_room(dst) \
                and self._used[dst] + segments <= self.window
            if eager and segments:
                self._used[dst] += segments
                self._eager[msg_id] = (dst, segments)
            request: _Awaited | None = None
            if not eager and not msg.tombstone:
                request = self._waiting[msg_id] = _Awaited(self, dst, msg_id, timeout_code)
                if msg.eager:
                    self._for_room[dst].append((msg_id, segments))
                    queued = segments <= self.window  # may complete before MPI read it
                pull = nbytes > 0 and msg.key[0] == "p2p"
        inline = 0 < nbytes <= INLINE_BYTES and not pull
        header = (msg_id, msg.key, msg.seq, msg.tag, eager, msg.tombstone, nbytes, inline,
                  msg.fp, msg.notice)
        if msg.key[0] == "leave":  # the receivers forget what they asked us for
            with self._holding:
                self._left_world = True
                self._send_obj(header, dst, HEADER)
            return None
        if inline:  # one message: the header, then a snapshot of the payload
            assert payload is not None  # (it has bytes)
            data = pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL) + payload.tobytes()
            self._isend([data, len(data), self._byte], dst, HEADER, data)
            return request
        if pull:  # rendezvous: the payload stays here until the receiver asks for it
            assert payload is not None  # (it has bytes)
            held = payload.copy() if queued else payload
            with self._holding:  # (`_granted` may push it at once: after the header)
                self._send_obj(header, dst, HEADER)
                self._held[msg_id] = held
            return request
        self._send_obj(header, dst, HEADER)
        if nbytes:
            assert payload is not None
            if eager or queued:  # the send may complete now: MPI must not read our memory
                payload = payload.copy()
            self._isend([payload, nbytes, self._byte], dst, _payload_tag(msg_id), payload)
        return request

    def _send_obj(self, obj: object, dst: int, tag: int) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self._isend([data, len(data), self._byte], dst, tag, data)

    def _isend(self, buf: Any, dst: int, tag: int, keepalive: object) -> None:
        """Start an MPI send; `keepalive` (what it reads) lives until it completes.
        None once this rank said farewell (`_close`), which it says under the same
        lock: whatever thread sends, no message of ours follows a farewell (one that
        did would be received by the peer's next world, see `close`)."""
        with self._sending:
            if self._said_farewell or self.buried:  # nobody waits for it (or see `_bury`)
                return
            try:
                request = self.comm.Isend(buf, dst, tag)
            except _mpi_exception() as error:  # MPI failed (a peer died): it is lost
                self._mpi_error(error)
                return
        with self._lock:
            self._in_flight.append((request, keepalive))

    # -- the progress thread --------------------------------------------------------

    def poll(self, task: bool = True) -> bool:
        """Make progress once; True if anything came. A task waiting for a call polls
        here (`task`) instead of waiting for the progress thread to wake it: it does
        not wait while another thread polls (False), and gives its core away when
        nothing came; the progress thread polls here too, waiting for its turn."""
        if task:
            self._polled_at = time.monotonic()  # (the progress thread stays out of the way)
        if not self._poll_lock.acquire(not task):  # (by position: no keyword to parse)
            return False
        MPI, lane = self._mpi, self.lane
        came = False
        try:
            if self.buried:  # see `_bury`
                pass
            # the lane's collective first (the awaited call's, most often): what must
            # count before its end is taken before its end is told (`_before_end`);
            # `tested` None: nothing was in flight
            elif tested := lane is not None and lane.poll(self._before):
                came = True
                if self._fetches:  # (what `_before_end` took may have been waited for)
                    self._fetched()
            else:
                # MPICH's Improbe matches what it has already taken in, then makes
                # progress: a message that came during a nap is found by a second probe,
                # unless the lane's test made progress just now
                status = self._status
                message = self.comm.Improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)
                if message is None and tested is None:
                    message = self.comm.Improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)
                elif message is None and lane is not None:
                    tested = lane.poll(self._before)  # the probe made progress: test again
                if message is not None:
                    self._take(message, status)
                if self._arriving:
                    self._arrivals()
                if self._fetches:
                    self._fetched()
                came = message is not None or bool(tested)
        except MPI.Exception as error:  # a peer died mid-message: that one is lost
            self._mpi_error(error)
            came = False
        finally:
            self._poll_lock.release()
        if not came and task:  # give the core to a process that has work: the peer we
            os.sched_yield()  # wait for, where there are more processes than cores
        return came

    def park(self) -> None:
        """A task stopped polling before its call finished: the progress thread, which
        waits while tasks poll, takes over at once."""
        self._polled_at = -math.inf
        self._tasks_gone.set()

    def _bury(self) -> None:
        """Ranks whose processes ended abnormally (`process_lost`): first take what
        they sent before, then end the calls waiting for them as if they had left the
        world, and stop using MPI altogether. MPI promises nothing once a process of
        the job has died, and between machines MPICH's network module (UCX) does
        crash on the next send to the dead process, or while making progress on one
        already started: the rest of this world's calls fail (the world's collectives
        at once, the others at their deadlines) and it closes without MPI."""
        while self._deaths:
            ranks = self._deaths.pop(0)
            if not self.buried:
                try:
                    self._drain()
                except self._mpi.Exception as error:
                    self._mpi_error(error)
            for rank, how in ranks.items():
                if rank == self.rank or rank in self.buried or not 0 <= rank < self.size:
                    continue
                self.buried[rank] = how
                self._forget(rank)
                on_leave = self.inbox.on_leave
                if on_leave is not None:
                    lane_done = 0 if self.lane is None else self.lane.finished
                    self.engine.post(on_leave, rank, how, lane_done)
        if self.buried:  # MPI is not used any more: no answer comes
            self._give_up(None)

    def _before_end(self) -> None:
        """What a lane's collective needs taken before its end is told (`Lane.poll`'s
        `before`): every message MPI has (`_drain`) while a send of ours waits for its
        peer (an ack, a request for its payload, an answer); else only what arrived and
        waits behind a payload. (A probe costs a small collective's end a tenth of its
        time: later polls take what else came.)"""
        if self._eager or self._waiting or self._held:
            self._drain()
        elif self._arriving:
            self._arrivals()

    def _drain(self) -> None:
        """Take every message MPI already has, and what waits behind a payload: what a
        peer sent before entering a collective (the acks that free this rank's eager
        window, say) arrived before the collective's own data, and must count before
        the program goes on (a barrier, then sends that fit the window: `_before_end`);
        what a dead peer sent before it died, before its calls end (`_bury`)."""
        MPI, status = self._mpi, self._status
        while (message := self.comm.Improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)) is not None:
            self._take(message, status)
        if self._arriving:
            self._arrivals()

    def _progress(self) -> None:
        last = time.monotonic()
        while not self._closed:
            if self._deaths:
                with self._poll_lock:
                    self._bury()
            if self.buried:  # nothing to poll any more (see `_bury`)
                time.sleep(IDLE_SLEEP)
                continue
            if self.lost is not None:  # answers to our withdrawals may never come
                self._give_up(None)
            self._tasks_gone.clear()
            if time.monotonic() - self._polled_at < SPIN:
                # a task polls: keep out of its way until it parks (even a nap's wake-up
                # takes the GIL, and the task waits for it until we get a core)
                self._tasks_gone.wait(TASK_NAP)
                continue
            message = self.poll(False)
            if message:
                last = time.monotonic()
            else:
                if self.lane is not None and self.lane.busy:
                    # MPI moves a collective's data only while polled: poll on (a
                    # sleep, even of 0 s, lasts the kernel's timer slack: 50 us)
                    last = time.monotonic()
                    os.sched_yield()
                elif self._arriving or self._fetches:  # payloads on their way: poll on
                    last = time.monotonic()
                    time.sleep(0)
                else:
                    self._reap()
                    if time.monotonic() - last <= SPIN:
                        time.sleep(0)
                    elif self._in_flight or self._busy() or \
                            (self.lane is not None and not self.lane.idle):
                        time.sleep(IDLE_SLEEP)
                    else:
                        self._tasks_gone.wait(IDLE_NAP)

    def _take(self, message: Any, status: Any) -> None:
        """Receive a control message (a header, an ack, a withdrawal) and act on it."""
        if len(self._in_flight) > 64:
            self._reap()
        src, tag = status.Get_source(), status.Get_tag()
        data = bytearray(status.Get_count(self._byte))
        message.Recv([data, self._byte])
        if tag >= PAYLOAD_TAGS:  # a payload nobody waits for any more (see `_forget`)
            return
        obj = pickle.loads(data)
        if obj is None:  # the peer closes: nothing more comes from it under this tag
            self._farewells += 1
        elif tag == HEADER:
            self._receive(src, data, *obj)
        elif tag == ACK:
            if type(obj) is int:
                self._acked(obj)
            elif obj[0] == READY:
                self._ready(src, obj[1])
            elif obj[0] == PUSH:
                self._receive_payload(src, obj[1], obj[2])
            else:
                self._answered(obj[1])
        elif tag == WITHDRAW:  # handled after the message it withdraws
            self._arrive(src, None, self.engine.post, self._answer, src, obj)

    def _receive(self, src: int, data: bytearray, msg_id: int, key: Any, seq: int, tag: int,
                 eager: bool, tombstone: bool, nbytes: int, inline: bool, fp: Any = None,
                 notice: tuple[int, str] | None = None) -> None:
        """A header (in `data`, maybe followed by its payload) has come from `src`."""
        payload, request = None, None
        pull = nbytes > 0 and not eager and not inline and key[0] == "p2p"
        if inline:  # the payload is the message's tail
            payload = np.frombuffer(data, np.uint8, nbytes, len(data) - nbytes)
        elif not tombstone and not pull:
            payload = np.empty(nbytes, np.uint8)
            if nbytes:  # never a blocking receive: the sender may die before it is done
                request = self.comm.Irecv([payload, nbytes, self._byte], src, _payload_tag(msg_id))
        if key[0] == "leave":  # it answers no more, nor sends the payloads asked for
            self._forget(src)
        msg = Message(src, key, seq, tag, payload, eager, tombstone)
        msg.fp, msg.notice = fp, notice
        if pull:  # the sender keeps the payload until a receive matches (`_fetch`)
            msg.nbytes, msg.fetch = nbytes, functools.partial(self._fetch, src, msg_id)
        if not tombstone and (nbytes or not eager):  # the sender waits for our ack

            def acknowledge() -> None:
                self._incoming.pop((src, msg_id), None)
                self._send_obj(msg_id, src, ACK)

            if eager:  # it holds rx buffers of the sender's window until released
                msg.on_done = acknowledge
            else:  # the payload is our own copy: the send is done once a receive has it
                msg.on_taken = acknowledge
                self._incoming[(src, msg_id)] = msg  # until then, the sender may withdraw it
        self._arrive(src, request, self.engine.post, self.inbox.deliver, msg)

    def _arrive(self, src: int, request: Any, action: Callable[..., Any], *args: Any) -> None:
        """Do `action(*args)` once `request` (a payload's receive, or None) is complete
        and everything that arrived from `src` before it is done: in arrival order."""
        queue = self._arriving.get(src)
        if queue is None:
            if request is None or request.Test():
                action(*args)
                return
            queue = self._arriving[src] = deque()
        queue.append((request, action, args))

    def _arrivals(self) -> None:
        """Handle what has arrived in full, source by source, in order."""
        for src in list(self._arriving):
            queue = self._arriving[src]
            while queue:
                request, action, args = queue[0]
                if request is not None:
                    try:
                        if not request.Test():
                            break
                    except _mpi_exception() as error:  # MPI could not finish it: its sender died
                        queue.popleft()
                        self._mpi_error(error)
                        continue
                queue.popleft()
                action(*args)
            if not queue:
                del self._arriving[src]

    # -- rendezvous: a payload moves once a receive matches its message --------------

    def _fetch(self, src: int, msg_id: int) -> None:
        """A receive matched message `msg_id` from `src` (engine context): ask the
        sender for its payload, unless it comes already."""
        msg = self._incoming.get((src, msg_id))
        if msg is None or src in self._left or self.buried:
            return  # it never comes: its receive fails at its deadline
        if self._receive_payload(src, msg_id, msg.nbytes):
            self._send_obj((READY, msg_id), src, ACK)  # after the receive is posted

    def _receive_payload(self, src: int, msg_id: int, nbytes: int) -> bool:
        """Post the receive of a rendezvous payload into memory of our own, once
        (a receive matched its message, or the sender pushes it); False if it was
        posted already, or has come (the sender sends it once: for our READY or
        with its PUSH, whichever it has first)."""
        key = (src, msg_id)
        with self._lock:
            msg = self._incoming.get(key)
            if key in self._fetches or msg is None or msg.fetch is None:
                return False
            payload = np.empty(nbytes, np.uint8)
            try:
                request = self.comm.Irecv([payload, nbytes, self._byte], src,
                                          _payload_tag(msg_id))
            except _mpi_exception() as error:
                self._mpi_error(error)
                return False
            self._fetches[key] = (request, payload)
        return True

    def _fetched(self) -> None:
        """Hand the payloads that came to their messages (`_arrived`, in engine context)."""
        with self._lock:
            fetches = list(self._fetches.items())
        status = self._fetch_status
        for key, (request, payload) in fetches:
            try:
                if request is None or not request.Test(status):
                    continue  # handed over already, or still coming
                if status.Is_cancelled():  # its sender left (`_forget`): it never comes
                    payload = None
            except _mpi_exception() as error:  # its sender died: it never comes
                self._mpi_error(error)
                payload = None
            with self._lock:  # kept until handed over: nothing asks for it again
                self._fetches[key] = (None, payload)
            self.engine.post(self._arrived, key, payload)

    def _arrived(self, key: tuple[int, int], payload: np.ndarray | None) -> None:
        """A payload asked for came (None: it never will): its receive has it, unless
        the sender asked meanwhile to withdraw the message (then it is decided now)."""
        msg = self._incoming.get(key)
        asked = key in self._asked
        self._asked.discard(key)
        if msg is not None:
            if payload is None:  # as if withdrawn: its receive waits again, to fail in time
                payload, asked = np.empty(0, np.uint8), True
            self.inbox.fetched(msg, payload, hand_over=not asked)  # (no fetch from now on)
        with self._lock:
            self._fetches.pop(key, None)
        if asked and msg is not None:
            self._answer(*key)

    def _answer(self, src: int, msg_id: int) -> None:
        """`src` asks to withdraw message `msg_id` (engine context): agree, and say
        so, unless a receive took it (its acknowledgement is on its way then); for a
        message whose payload is on its way, once it is here."""
        key = (src, msg_id)
        msg = self._incoming.get(key)
        if msg is None:
            return  # taken: acknowledged already
        if key in self._fetches:
            self._asked.add(key)  # decided once the payload is here (`_arrived`)
            return
        if self.inbox.withdraw(msg) or msg.state is MessageState.WITHDRAWN:
            del self._incoming[key]
            msg.payload = None
            self._send_obj((WITHDRAWN, msg_id), src, ACK)

    def _ready(self, dst: int, msg_id: int) -> None:
        """The receiver asks for a payload: send it, even if we asked to withdraw the
        message meanwhile (the receiver decides: it did not agree)."""
        with self._holding:
            payload = None if self._left_world else self._held.pop(msg_id, None)
            if payload is not None:
                self._isend([payload, payload.nbytes, self._byte], dst, _payload_tag(msg_id),
                            payload)

    def _answered(self, msg_id: int) -> None:
        """The receiver agreed to drop a message: its send fails."""
        with self._lock:
            awaited = self._waiting.pop(msg_id, None)
            self._held.pop(msg_id, None)
            done = [] if awaited is None else self._make_room(awaited.dst)
        self._granted(done)
        if awaited is not None:
            self.engine.post(awaited.set, MessageState.WITHDRAWN)

    def _forget(self, src: int) -> None:
        """`src` left its world, or died: it answers nothing more (our withdrawals from
        it succeed), and of the payloads we asked it for, only those already under
        way come (the others' receives wait again, to fail as their peer is gone)."""
        with self._lock:
            self._left.add(src)
            # (one that came already is handed over as it is)
            fetches = [(key, request) for key, (request, _) in self._fetches.items()
                       if key[0] == src and request is not None]
            if self.buried:  # MPI is not used any more
                for key, _ in fetches:
                    self._fetches[key] = (None, None)
            else:  # one under way still comes (`_fetched` tells which)
                for _, request in fetches:
                    try:
                        request.Cancel()
                    except _mpi_exception() as error:
                        self._mpi_error(error)
        self._give_up(src)
        if self.buried:
            for key, _ in fetches:
                self.engine.post(self._arrived, key, None)

    def _granted(self, done: list[_Awaited]) -> None:
        """Sends done: an eager message given room in the window (`_make_room`) whose
        payload is still here goes now, as its header did, into the room the window
        keeps for it (PUSH first, so that the receiver posts its receive before the
        payload comes; or else the receiver asked for it first, and has it)."""
        for awaited in done:
            dst, msg_id = awaited.dst, awaited.msg_id
            with self._holding:  # before the send is done, and before we leave
                payload = self._held.pop(msg_id, None)
                if payload is not None:
                    self._send_obj((PUSH, msg_id, payload.nbytes), dst, ACK)
                    self._isend([payload, payload.nbytes, self._byte], dst,
                                _payload_tag(msg_id), payload)
            self.engine.post(awaited.set)

    def _give_up(self, dst: int | None) -> None:
        """Withdrawals waiting for an answer from `dst` (None: anyone) that never comes
        succeed."""
        with self._lock:
            given_up = [awaited for awaited in self._waiting.values()
                        if awaited.withdrawing and dst in (None, awaited.dst)]
            for awaited in given_up:
                del self._waiting[awaited.msg_id]
                self._held.pop(awaited.msg_id, None)
        for awaited in given_up:  # (an engine event may run here, and post: not locked)
            self.engine.post(awaited.set, MessageState.WITHDRAWN)

    def _acked(self, msg_id: int) -> None:
        with self._lock:
            eager = self._eager.pop(msg_id, None)
            if eager is not None:
                self._used[eager[0]] -= eager[1]
            awaited = self._waiting.pop(msg_id, None)
            done = [] if awaited is None else [awaited]
            if eager is not None:  # room freed
                done += self._make_room(eager[0])
            elif awaited is not None:  # a send that may have held up others is done
                done += self._make_room(awaited.dst)
        self._granted(done)

    def _waits_for_room(self, dst: int) -> bool:
        """Whether an eager send to `dst` waits for room in the window (under the lock)."""
        queue, waiting = self._for_room[dst], self._waiting
        while queue and ((awaited := waiting.get(queue[0][0])) is None or awaited.withdrawing):
            queue.popleft()  # taken or withdrawn meanwhile
        return bool(queue)

    def _make_room(self, dst: int) -> list[_Awaited]:
        """Acknowledgements freed room in `dst`'s window: the sends waiting for it that
        it now holds, in order, are done (under the lock; their messages went out as
        non-eager, and are acknowledged when taken, which frees their room again)."""
        done = []
        queue = self._for_room[dst]
        while self._waits_for_room(dst):
            msg_id, segments = queue[0]
            if self._used[dst] + segments > self.window:
                break
            queue.popleft()
            done.append(self._waiting.pop(msg_id))
            self._used[dst] += segments
            self._eager[msg_id] = (dst, segments)
        return done

    def _reap(self) -> None:
        """Forget MPI sends that have completed (and the buffers they kept alive)."""
        with self._lock:
            if self._in_flight:
                self._in_flight = [item for item in self._in_flight if not _finished(item[0])]

    def _withdraw(self, awaited: _Awaited) -> bool:
        """A non-eager send's deadline passed: ask its receiver to drop the message,
        and wait for the answer (False), which ends the send either way: acknowledged
        (taken), or agreed (`_answered`). True (the send fails now) only where no
        answer can come: the receiver left, or a process of the job is gone."""
        dst, msg_id = awaited.dst, awaited.msg_id
        with self._lock:
            if self._waiting.get(msg_id) is not awaited or awaited.withdrawing:
                return False  # acknowledged meanwhile, or asked already
            silent = dst in self._left or self.lost is not None or self._said_farewell
            if silent:
                del self._waiting[msg_id]
                self._held.pop(msg_id, None)
            awaited.withdrawing = True
            done = self._make_room(dst)  # it may have held up others
        self._granted(done)
        if not silent:
            self._send_obj(msg_id, dst, WITHDRAW)
        return silent

    def _mpi_error(self, error: BaseException) -> None:
        """MPI failed a call or a message (after a peer died, mid-transfer)."""
        if len(self.mpi_errors) < 10:
            self.mpi_errors.append(" ".join(str(error).split()))
        self.lost = self.lost or f"MPI reported an error: {self.mpi_errors[0]}"

    # -- lifetime -------------------------------------------------------------------

    @staticmethod
    def process_lost(reason: str, ranks: dict[int, str] | None = None) -> None:
        """A process of this MPI job has ended without telling its launcher (hydra
        signals the others with SIGUSR1; with MPICH 5, whenever a process exits): open
        fabrics stop waiting for their peers when they close, and `ended` says so from
        now on. `ranks`: which ranks' programs ended abnormally, and how, where that is
        known (`aaccl launch` tells): each open fabric treats them as gone (`_bury`).
        Safe in a signal handler (it takes no lock)."""
        # A reason naming the ranks replaces one that did not: hydra's signal may come
        # before the launcher's word of who ended (1 kill in 20 at 4 ranks), and what
        # fails after this says who (a list item's store: atomic, no lock)
        unnamed = _ended[0] if _ended and not _dead else None
        if not _ended:
            _ended.append(reason)
        elif ranks and unnamed is not None:
            _ended[0] = reason
        if ranks:
            _dead.update(ranks)
        for fabric in list(_open):
            if fabric.lost is None or (ranks and fabric.lost == unnamed):
                fabric.lost = reason
            if ranks:
                fabric._deaths.append(ranks)  # the progress thread buries them

    @staticmethod
    def dead() -> dict[int, str]:
        """The ranks of this MPI job whose processes are known to have ended abnormally,
        and how (see `process_lost`): MPI must not send to them."""
        return dict(_dead)

    @staticmethod
    def ended() -> str | None:
        """Why a process of this MPI job is known to have ended (see `process_lost`),
        or None: a wait for every rank (a barrier) after that may never finish."""
        return _ended[0] if _ended else None

    def missing(self) -> str | None:
        """Why a peer will never come where this rank waits for every rank, or None
        while all may still come (however long their own code takes): a process of
        the job ended without telling its launcher (`process_lost`), MPI failed, or
        the process of a peer on this machine is gone."""
        if self.lost is not None:
            return self.lost
        now = time.monotonic()  # (its callers poll every few ms: /proc is read less)
        if now < self._next_look:
            return None
        self._next_look = now + LOOK_EVERY
        for rank, pid in self._neighbours.items():
            if not _alive(pid):
                return f"rank {rank}'s process (pid {pid}) ended"
        return None

    def close(self, timeout: float | None = None) -> None:
        """Wait for every rank to get here and for everything they sent before, as long
        as they live (or up to `timeout` seconds, if given), then stop the progress
        thread and free the communicator. If the ranks did not all get here (a process
        of the job ended: see `missing`), the exit of this process is watched
        (`watch_exit`).

        Every rank sends each peer a farewell under each control tag, and sends nothing
        after it; MPI keeps a sender's messages of one tag in order, so once a rank has
        every peer's farewells (and the payloads of the headers before them), nothing
        is left in flight for it. A message still in flight when the communicator is
        freed would otherwise be received by the process's next world, as MPI reuses
        a freed communicator's context for the next one."""
        global _closes
        with _closing:
            _closes += 1
        try:
            self._close(timeout)
        finally:
            with _closing:
                _closes -= 1
                _closing.notify_all()

    def _close(self, timeout: float | None) -> None:
        from mpi4py import MPI

        done = False
        if self.buried:  # (see `post`): nothing more to say, nobody to wait for
            self._said_farewell = True
        try:
            # What this rank's engine was asked before (its "leave" notice, queued
            # while another thread drained the engine) goes before the farewells,
            # which then go in one critical section with every other send's start.
            flushed = threading.Event()
            self.engine.post(flushed.set)
            flushed.wait(JOIN_LIMIT)
            with self._sending:  # (reentrant: the farewells' own sends take it too)
                for peer in range(self.size if not self.buried else 0):
                    if peer != self.rank:
                        for tag in (HEADER, ACK, WITHDRAW):
                            self._send_obj(None, peer, tag)
                self._said_farewell = True
            expected = 3 * (self.size - 1)
            deadline = math.inf if timeout is None else time.monotonic() + timeout
            while not (done := self._farewells == expected and not self._arriving) \
                    and not self._closed and time.monotonic() < deadline:
                if self.missing() is not None:  # what it sent before it ended may be here
                    time.sleep(SETTLE)
                    done = self._farewells == expected and not self._arriving
                    break
                time.sleep(IDLE_SLEEP)
        except MPI.Exception as error:
            self._mpi_error(error)
        self._stop()
        if self._fetches:  # a payload never sent (its receive failed): MPI matches on
            done = False
        lane = self.lane
        if lane is not None and not lane.idle:
            # a collective MPI will never finish (a peer gave up on it, or is gone):
            # MPI_Finalize would wait for it
            done = False
        if not done or self._thread.is_alive():  # a peer is gone, or MPI hangs in here
            if lane is not None:
                lane.close(free=False)
            self._keep_receiving()
            watch_exit()
            return
        self._reap()
        self.comm.Free()
        if lane is not None:  # (if MPI still matches with it meanwhile, it is kept)
            lane.close(free=True)

    def _keep_receiving(self) -> None:
        """A world closed with payloads' receives still posted (a peer is gone, or
        never sent what it announced): MPI may still write into their buffers, up to
        MPI_Finalize, which comes after the interpreter's teardown. So the fabric, which
        holds them, is kept to the process's end (`keep_to_exit`)."""
        if self._arriving or self._fetches:
            keep_to_exit(self)

    def _stop(self) -> None:
        """Stop the progress thread and wait (up to JOIN_LIMIT) until it is out of MPI."""
        self._closed = True
        if self._thread is not threading.current_thread():
            self._thread.join(JOIN_LIMIT)
        _open.discard(self)


class _Awaited(Wait):
    """A non-eager send: done when the receiver acknowledges it, or set with
    MessageState.WITHDRAWN when the receiver agreed to drop it."""

    __slots__ = ("fabric", "dst", "msg_id", "withdrawing")

    def __init__(self, fabric: MPIFabric, dst: int, msg_id: int, timeout_code: int) -> None:
        super().__init__(timeout_code)
        self.fabric, self.dst, self.msg_id = fabric, dst, msg_id
        self.withdrawing = False

    def expire(self) -> bool:
        """Ask the receiver to drop the message; the send ends by its answer."""
        return self.fabric._withdraw(self)


_ROOT_RECEIVES = frozenset({Scenario.GATHER, Scenario.REDUCE})
"""Collectives whose root sends nothing: nothing of its call reaches its peers."""


class _Announce(Collective):
    """A gather's or reduce's root only receives: over MPI, where no roll call or
    opening compares the members' calls, it tells them its call, so that a rank that
    takes another for the root fails at once, as in process, and no rank waits out
    its timeout in a collective that its peers have left for the next one."""

    __slots__ = ()

    def run(self, call: ScheduleCall) -> Generator[Wait, Any, bool]:
        comm, dev = call.comm, call.dev
        assert comm is not None
        for peer in comm.sessions:
            if peer != dev.session:
                msg = Message(dev.session, ("fp", comm.key, call.seq), call.seq, 0, None,
                              eager=True)
                msg.fp = call.fp
                dev.port.post(peer, msg, 0)
        return False  # the schedule runs it
        yield  # a generator


_ANNOUNCE = _Announce()


class MPIPort(Port):
    def __init__(self, fabric: MPIFabric) -> None:
        self.fabric = fabric
        self.inbox, self.engine = fabric.inbox, fabric.engine

    def post(self, dst: int, msg: Message, timeout_code: int) -> Wait | None:
        return self.fabric.post(dst, msg, timeout_code)

    def lane(self, comm_key: object) -> Lane | None:
        """Where the collectives of communicator `comm_key` (its sessions) go: MPI's
        collectives for the world's communicator, the messages for any other."""
        return self.fabric.lane if comm_key == self.fabric.world_key else None

    def collective(self, call: CollectiveCall) -> Collective | None:
        """The world's collectives take their turn in the lane (but on kernel streams:
        over messages); elsewhere, a gather's or reduce's root announces its call."""
        comm, args, fabric = call.comm, call.args, self.fabric
        assert comm is not None
        lane = fabric.lane if comm.key == fabric.world_key else None  # (`lane`, inline)
        if lane is not None and not args.stream_flags:
            return Op(0, None, lane)  # (its place in the lane: at `join`)
        if args.scenario in _ROOT_RECEIVES and comm.size > 1 and comm.rank == args.root_src_dst:
            return _ANNOUNCE
        return None

    def skip(self, comm: Comm, prefix: Key, reason: str) -> None:
        lane = self.lane(comm.key)
        if lane is not None:  # it takes its turn among the collectives MPI runs, too
            block = np.empty(blocks.BLOCK, np.uint8)
            blocks.encode(block, (0, None, "", "", None, None, comm.size),
                          state=blocks.ABORTED, why=reason)
            lane.withdraw(lane.admit(), block)

    def peer_left(self, lane_done: int, why: str) -> None:
        """A peer left the world after MPI finished `lane_done` of the world's
        collectives there (`Lane.left`)."""
        if self.fabric.lane is not None:
            self.fabric.lane.left(lane_done, Aborted(why))

    def lane_done(self) -> int:
        """How many of the world's collectives MPI is done with here (`Lane.finished`)."""
        return 0 if self.fabric.lane is None else self.fabric.lane.finished

    def watch(self, busy: Callable[[], bool]) -> None:
        """`busy()` says whether the device has calls under way (any thread): while it
        has none, the progress thread naps longer (IDLE_NAP)."""
        self.fabric._busy = busy

    @property
    def poller(self) -> MPIFabric:
        return self.fabric

    def close(self) -> None:
        pass


_watching = False


def watch_exit() -> None:
    """Make sure this process ends soon after it starts to exit: MPI_Finalize, which
    mpi4py calls after the interpreter's atexit functions, may wait for a dead peer.
    At exit, SIGALRM is armed to end the process EXIT_GRACE seconds later, unless the
    program handles SIGALRM or has an alarm of its own pending."""
    global _watching
    if not _watching:
        _watching = True
        atexit.register(_arm_exit_alarm)


def _arm_exit_alarm() -> None:
    if signal.getsignal(signal.SIGALRM) is signal.SIG_DFL:
        pending = signal.alarm(EXIT_GRACE)
        if pending:  # the program's own alarm: keep it
            signal.alarm(pending)


def _exit_last() -> None:
    """(Re)register `_at_exit` so that it runs before the other atexit functions
    (they run last registered first)."""
    atexit.unregister(_at_exit)
    atexit.register(_at_exit)


def _at_exit() -> None:
    """The interpreter exits (mpi4py finalizes MPI after the atexit functions): stop
    the progress threads of the worlds still open, so that none is inside MPI then.

    A rank that dies of an uncaught KeyboardInterrupt (Ctrl-C, which mpiexec forwards
    to every rank) would end by SIGINT, as Python does. MPICH's launcher takes a rank
    killed by a signal for a crash: it SIGKILLs the ranks still exiting, and reports
    the job's status as the bitwise OR of theirs (SIGINT 2 | SIGKILL 9 = 11, which it
    prints as "Segmentation fault (signal 11)"). So such a rank runs the remaining
    atexit functions, finalizes MPI and exits with status 130 (128 + SIGINT) instead.
    (After a Ctrl-C hydra still SIGKILLs the ranks still running once one exits: the
    job's status is 130 if every rank got out first, else 9.)"""
    for fabric in list(_open):
        fabric._stop()  # (a `close` under way on another thread stops waiting too)
        fabric._keep_receiving()  # (the teardown frees what is not kept)
        if fabric.lane is not None and not fabric._thread.is_alive():
            fabric.lane.close(free=False)  # (its inactive MPI request is freed before MPI_Finalize)
    with _closing:  # and none frees its communicators while MPI is finalized
        _closing.wait_for(lambda: _closes == 0, JOIN_LIMIT)
    MPI = sys.modules.get("mpi4py.MPI")
    if _abandoned and MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized():
        _reap()
    error = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if not isinstance(error, KeyboardInterrupt) or MPI is None \
            or not _JOB_VARIABLES.intersection(os.environ) \
            or not MPI.Is_initialized() or MPI.Is_finalized():
        return
    atexit.unregister(_at_exit)
    # the others, in their order (`_exit_last` made this one run first: only those
    # registered since the last world opened, such as `_arm_exit_alarm`, run again)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    MPI.Finalize()
    os._exit(INTERRUPTED)


_JOB_VARIABLES = frozenset(("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"))
SETTLE = 0.05
"""Seconds a closing rank still takes what a peer that just ended had sent it."""


Opened = tuple[Any, Any, dict[int, int]]
"""What a fabric's opening makes: its communicator, its lane's (or None), and the pids
of the peers on this machine, by rank."""
_job_pids: dict[int, int] = {}
"""The pids of this job's processes on this machine, by rank, as the last world that
opened found them: a later opening knows that a rank whose process is gone never comes."""
_abandoned: list[list[tuple[Any, Any, Any]]] = []
"""Openings given up on (a peer never came, or the opening was cancelled): what they
started, (communicator made or None, its request, what the request reads and writes),
kept until MPI has completed every one of them (when the late peers come) and then
freed (`_reap`): MPI_Finalize warns of a communicator never freed."""
_MACHINE = 20  # bytes of a machine's digest in the opening's allgather (then the pid)


def opening(comm: Any, made: list[tuple[Any, Any, Any]]) -> Generator[Any, None, Opened]:
    """A fabric's communicators, made from `comm` one nonblocking step at a time, so
    that the rank waiting for a peer that never comes can give up (and say why) where
    MPI's blocking `Comm.Dup` would wait forever: yields each MPI request to wait for.

    First a duplicate of `comm` (every process of `comm` must come); then, on it,
    together, the lane's own duplicate and an allgather of where each rank runs.
    Every rank starts the same collectives in the same order, so an opening given up
    on (see `abandon`) leaves `comm` in order: a late peer's opening matches it, and
    the next opening of every rank matches the next. `made` gets what each step
    starts, as it starts it (see `_abandoned`)."""
    _reap()
    own, request = comm.Idup()
    made.append((own, request, None))
    yield request
    rank, size = own.Get_rank(), own.Get_size()
    lane_comm, requests = None, []
    if size > 1 and os.environ.get("AACCL_MPI_COLLECTIVES", "1") != "0":
        lane_comm, lane_request = own.Idup()
        made.append((lane_comm, lane_request, None))
        requests.append(lane_request)
    here = hashlib.sha1(repr(_machine()).encode()).digest()
    mine = np.frombuffer(bytearray(here + os.getpid().to_bytes(8, "little")), np.uint8)
    everyone = np.empty((size, mine.size), np.uint8)
    requests.append(own.Iallgather(mine, everyone))
    made.append((None, requests[-1], (mine, everyone)))
    for request in requests:  # (all started: waited for one after the other)
        yield request
    neighbours = {r: int.from_bytes(row[_MACHINE:].tobytes(), "little")
                  for r, row in enumerate(everyone)
                  if row[:_MACHINE].tobytes() == here and r != rank}
    return own, lane_comm, neighbours


def _wait_all(steps: Generator[Any, None, Opened]) -> Opened:
    """Run `opening`'s steps in MPI's blocking waits."""
    try:
        request = next(steps)
        while True:
            request.Wait()
            request = steps.send(None)
    except StopIteration as end:
        return end.value


def abandon(made: list[tuple[Any, Any, Any]]) -> None:
    """An opening given up on: what it `made` stays alive until MPI is done with it
    (`_abandoned`), and the exit of this process is watched (MPI_Finalize may wait for
    its requests)."""
    _abandoned.append(made)
    watch_exit()
    _exit_last()  # (`_at_exit` frees what MPI completed by then)


def _reap() -> None:
    """Free the communicators of abandoned openings that MPI has completed (their late
    peers came, and gave up in turn)."""
    for made in list(_abandoned):
        if all(_finished(request) for _, request, _ in made):
            _abandoned.remove(made)
            for comm, _, _ in made:
                if comm is not None:
                    try:
                        comm.Free()
                    except _mpi_exception():
                        pass


def gone_before_opening() -> str | None:
    """Why a rank of this job will never come to a world's opening, as far as this
    process can tell: a process of the job is known to have ended (`process_lost`),
    or one whose pid the last world found on this machine is gone."""
    if _dead:
        return ", ".join(f"rank {rank} ended: {how}" for rank, how in sorted(_dead.items()))
    if _ended:
        return _ended[0]
    gone = [f"rank {rank}'s process (pid {pid}) ended"
            for rank, pid in sorted(_job_pids.items()) if not _alive(pid)]
    return ", ".join(gone) or None


def _machine() -> tuple[str, str]:
    """Which kernel and pid namespace this process runs in: processes that share them
    can watch each other's pids."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            return boot.read().strip(), os.readlink("/proc/self/ns/pid")
    except OSError:  # not Linux: nobody's pid is watched
        return f"{os.getpid()}-{id(_open)}", ""


def _alive(pid: int) -> bool:
    """Whether process `pid` (of this kernel and namespace) still runs (a zombie, one
    that ended but was not waited for yet, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rpartition(b")")[2].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def _finished(request: Any) -> bool:
    """An MPI request that is done, or that MPI failed (its peer died)."""
    try:
        return bool(request.Test())
    except _mpi_exception():
        return True


def _mpi_exception() -> type[Exception]:
    from mpi4py import MPI

    return MPI.Exception
