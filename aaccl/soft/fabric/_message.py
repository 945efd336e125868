"""Messages between soft CCLOs, and the sender's view of one in flight."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

PENDING, TAKEN, DONE, WITHDRAWN = range(4)

Key = tuple[Any, ...]
"""A message's matching key: ("p2p", comm) or ("coll", comm, seq, scenario, tag)."""


class PeerTimeout(Exception):
    """A peer did not show up before the deadline."""


class Message:
    """One message: a header and its payload, wherever the payload now lives.

    `key` is the matching key: (comm, seq, scenario, tag) for a collective step, or
    (comm,) for point-to-point, where `seq` orders messages and `tag` is the user's.
    Eager payloads are copied into the receiver's rx buffers (`slots`); others stay in
    the sender's memory (`payload`) until the receiver consumes them (rendezvous).
    """

    __slots__ = ("src", "key", "seq", "tag", "nbytes", "payload", "slots", "state",
                 "eager", "tombstone", "on_taken", "on_done")

    def __init__(self, src: int, key: Key, seq: int, tag: int, payload: np.ndarray | None,
                 eager: bool, tombstone: bool = False) -> None:
        self.src, self.key, self.seq, self.tag = src, key, seq, tag
        self.payload = payload
        self.nbytes = 0 if payload is None else payload.nbytes
        self.slots: list[int] = []
        self.state = PENDING
        self.eager = eager
        self.tombstone = tombstone
        self.on_taken: Callable[[], None] | None = None  # a receive has claimed it
        self.on_done: Callable[[], None] | None = None  # the receiver is done with it


class SendRequest(Protocol):
    def wait(self, deadline: float) -> bool:
        """True once the receiver has the data; False if the deadline passed first (the
        message is then withdrawn and never delivered)."""


class Port(Protocol):
    """A rank's connection to the fabric: posts messages to peers by session."""

    def post(self, dst: int, msg: Message) -> SendRequest: ...

    def close(self) -> None: ...


class Completed:
    """A send the fabric finished on posting (the data was copied)."""

    @staticmethod
    def wait(deadline: float) -> bool:
        return True


COMPLETED = Completed()
