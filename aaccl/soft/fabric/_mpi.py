"""The MPI fabric: one soft CCLO per process, messages carried by MPI (mpi4py).

Every message travels as a small header (pickled) and, unless empty, its payload
(raw bytes, under a tag of its own). A progress thread in each process receives
them and posts them to the process's progress engine as events, so neither the
event loop nor MPI ever waits on the other. The receiver acknowledges a message
once it is done with it.

Flow control keeps the eager semantics of the CCLO: a sender may have at most its
share of the receiver's rx buffers (`nbufs / (size - 1)` segments) in eager
messages not yet acknowledged (an eager message is acknowledged when its rx
buffers are free again). Within that window an eager send completes as soon as
MPI has a copy of the data; beyond it, or for messages above the eager threshold,
the send completes when a receive has taken the data (acknowledged then: the
payload is the receiver's own copy), and a sender that times out withdraws it.
"""

from __future__ import annotations

import itertools
import pickle
import threading
import time
from typing import Any

import numpy as np

from .._engine import Engine, Wait
from ._inbox import Inbox
from ._message import Message

HEADER, ACK, WITHDRAW = 1, 2, 3
PAYLOAD_TAGS = 1 << 20
"""Payload tags are PAYLOAD_TAGS + (message id modulo PAYLOAD_TAGS), past the control tags."""

IDLE_SLEEP = 0.0002
SPIN = 0.0005
"""For SPIN seconds after the last message the progress thread polls with only a
sleep(0) between polls (a loop without any sleep would keep the GIL, for up to the
interpreter's 5 ms switch interval, from the threads a message has just woken); then
it naps IDLE_SLEEP between polls, leaving the cores to compute."""


def _payload_tag(msg_id: int) -> int:
    return PAYLOAD_TAGS + msg_id % PAYLOAD_TAGS


class MPIFabric:
    """This process's end of an MPI world of soft CCLOs (one rank per process)."""

    def __init__(self, comm: Any, nbufs: int, bufsize: int) -> None:
        self.comm = comm.Dup()  # a communicator of our own: no clash with the user's MPI
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
        self._incoming: dict[tuple[int, int], Message] = {}  # non-eager, by (src, id)
        self._closed = False
        self._thread = threading.Thread(target=self._progress, name=f"aaccl-mpi-{self.rank}",
                                        daemon=True)
        self._thread.start()

    def port(self, session: int) -> MPIPort:
        assert session == self.rank
        return MPIPort(self)

    # -- sending ------------------------------------------------------------------

    def post(self, dst: int, msg: Message, timeout_code: int) -> Wait | None:
        payload = msg.payload
        nbytes = 0 if payload is None else payload.nbytes
        segments = -(-nbytes // self.bufsize)
        with self._lock:
            msg_id = next(self._ids)
            eager = msg.eager and not msg.tombstone and self._used[dst] + segments <= self.window
            if eager and segments:
                self._used[dst] += segments
                self._eager[msg_id] = (dst, segments)
            request: _Awaited | None = None
            if not eager and not msg.tombstone:
                request = self._waiting[msg_id] = _Awaited(self, dst, msg_id, timeout_code)
        if eager and payload is not None:
            payload = payload.copy()  # the send completes now: MPI must not read our memory
        header = (msg_id, msg.key, msg.seq, msg.tag, eager, msg.tombstone, nbytes)
        self._send_obj(header, dst, HEADER)
        if nbytes:
            self._track(self.comm.Isend([payload, nbytes, _BYTE()], dst, _payload_tag(msg_id)),
                        payload)
        return request

    def _send_obj(self, obj: object, dst: int, tag: int) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self._track(self.comm.Isend([data, len(data), _BYTE()], dst, tag), data)

    def _track(self, request: Any, keepalive: object) -> None:
        with self._lock:
            self._in_flight.append((request, keepalive))

    # -- the progress thread --------------------------------------------------------

    def _progress(self) -> None:
        from mpi4py import MPI

        status = MPI.Status()
        last = time.monotonic()
        while not self._closed:
            # MPICH's Improbe matches what it has already taken in, then makes
            # progress: a message that came during a nap is found by a second probe
            message = (self.comm.Improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)
                       or self.comm.Improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status))
            if message is None:
                self._reap()
                time.sleep(IDLE_SLEEP if time.monotonic() - last > SPIN else 0)
                continue
            last = time.monotonic()
            if len(self._in_flight) > 64:
                self._reap()
            src, tag = status.Get_source(), status.Get_tag()
            data = bytearray(status.Get_count(MPI.BYTE))
            message.Recv([data, MPI.BYTE])
            obj = pickle.loads(data)
            if tag == HEADER:
                self._receive(src, *obj)
            elif tag == ACK:
                self._acked(obj)
            elif tag == WITHDRAW:
                msg = self._incoming.pop((src, obj), None)
                if msg is not None:
                    self.engine.post(self.inbox.withdraw, msg)

    def _receive(self, src: int, msg_id: int, key: Any, seq: int, tag: int, eager: bool,
                 tombstone: bool, nbytes: int) -> None:
        payload = None
        if not tombstone:
            payload = np.empty(nbytes, np.uint8)
            if nbytes:
                self.comm.Recv([payload, nbytes, _BYTE()], src, _payload_tag(msg_id))
        msg = Message(src, key, seq, tag, payload, eager, tombstone)
        if not tombstone and (nbytes or not eager):  # the sender waits for our ack

            def acknowledge() -> None:
                self._incoming.pop((src, msg_id), None)
                self._send_obj(msg_id, src, ACK)

            if eager:  # it holds rx buffers of the sender's window until released
                msg.on_done = acknowledge
            else:  # the payload is our own copy: the send is done once a receive has it
                msg.on_taken = acknowledge
                self._incoming[(src, msg_id)] = msg  # until then, the sender may withdraw it
        self.engine.post(self.inbox.deliver, msg)

    def _acked(self, msg_id: int) -> None:
        with self._lock:
            eager = self._eager.pop(msg_id, None)
            if eager is not None:
                self._used[eager[0]] -= eager[1]
            awaited = self._waiting.pop(msg_id, None)
        if awaited is not None:
            self.engine.post(awaited.set)

    def _reap(self) -> None:
        """Forget MPI sends that have completed (and the buffers they kept alive)."""
        with self._lock:
            if self._in_flight:
                self._in_flight = [item for item in self._in_flight if not item[0].Test()]

    def _withdraw(self, dst: int, msg_id: int) -> bool:
        """Give up on a non-eager send; False if it was acknowledged meanwhile."""
        with self._lock:
            if self._waiting.pop(msg_id, None) is None:
                return False
        self._send_obj(msg_id, dst, WITHDRAW)
        return True

    # -- lifetime -------------------------------------------------------------------

    def close(self, timeout: float) -> None:
        """Wait (up to `timeout`) for every rank to get here, so no acknowledgement is
        still on its way, then stop the progress thread and free the communicator."""
        barrier = self.comm.Ibarrier()
        deadline = time.monotonic() + timeout
        while not barrier.Test() and time.monotonic() < deadline:
            time.sleep(IDLE_SLEEP)
        self._closed = True
        self._thread.join()
        self._reap()
        if barrier.Test():
            self.comm.Free()


class _Awaited(Wait):
    """A non-eager send: done when the receiver acknowledges it."""

    __slots__ = ("fabric", "dst", "msg_id")

    def __init__(self, fabric: MPIFabric, dst: int, msg_id: int, timeout_code: int) -> None:
        super().__init__(timeout_code)
        self.fabric, self.dst, self.msg_id = fabric, dst, msg_id

    def expire(self) -> bool:
        """Withdraw the message unless its acknowledgement is on its way here."""
        return self.fabric._withdraw(self.dst, self.msg_id)


class MPIPort:
    def __init__(self, fabric: MPIFabric) -> None:
        self.fabric = fabric
        self.inbox, self.engine = fabric.inbox, fabric.engine

    def post(self, dst: int, msg: Message, timeout_code: int) -> Wait | None:
        return self.fabric.post(dst, msg, timeout_code)

    def close(self) -> None:
        pass


def _BYTE() -> Any:
    from mpi4py import MPI

    return MPI.BYTE
