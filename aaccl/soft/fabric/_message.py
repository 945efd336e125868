"""Messages between soft CCLOs, and what a fabric offers a sender."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..._constants import ReduceFunction, Scenario
from .._engine import Engine, Wait

if TYPE_CHECKING:
    from ._inbox import Inbox

Key = tuple[Any, ...]
"""A message's matching key: ("p2p", comm), ("coll", comm, seq, scenario, tag),
("abort", comm, seq) for a notice that collective `seq` failed on the sender,
("leave",) for a notice that the sender left its world, or ("stream",) for data put
into the receiver's kernel stream (a send with RES_STREAM)."""

Fingerprint = tuple[Any, ...]
"""What must agree between the ranks of one collective: (scenario, count or None,
dtype, wire dtype, root or None, function or None, communicator size); between a
send and its receive: (count, wire dtype, dtype)."""


def describe(fp: Fingerprint) -> str:
    """A collective's call as its user wrote it, from its fingerprint (so that
    messages need carry no words): "bcast(count=64, float32, root=0)", and the wire
    dtype where it differs: "allreduce(count=16, float32 compressed to float16, SUM)"."""
    scenario, count, dtype, wire, root, function, _ = fp
    parts = [] if count is None else [f"count={count}", np.dtype(dtype).name]
    if parts and wire and wire != dtype:
        parts[1] += f" compressed to {np.dtype(wire).name}"
    if root is not None:
        parts.append(f"root={root}")
    if function is not None:
        parts.append(function_name(function))
    return f"{Scenario(scenario).name.lower()}({', '.join(parts)})"


def function_name(function: int) -> str:
    """A reduce function's name, as in the user's call ("SUM")."""
    try:
        return ReduceFunction(function).name
    except ValueError:
        return f"function {function}"


class MessageState(enum.Enum):
    PENDING = "pending"  # delivered, no receive has it yet
    TAKEN = "taken"  # a receive is reading it
    DONE = "done"  # the receiver is done with it (or it was dropped)
    WITHDRAWN = "withdrawn"  # the sender gave up before a receive took it


class Message:
    """One message: a header and its payload, wherever the payload now lives.

    Eager payloads are copied into the receiver's rx buffers (`slots`); others stay
    where the sender put them (`payload`: its device memory in process; over MPI, the
    sender's memory until a receive matches, then our own copy, see `fetch`) until
    the receiver is done, which sets `consumed`.
    """

    __slots__ = ("src", "key", "seq", "tag", "nbytes", "payload", "slots", "state", "eager",
                 "tombstone", "consumed", "matched", "on_taken", "on_done", "fetch", "fp", "notice")

    def __init__(self, src: int, key: Key, seq: int, tag: int, payload: np.ndarray | None,
                 eager: bool, tombstone: bool = False) -> None:
        self.src, self.key, self.seq, self.tag = src, key, seq, tag
        self.payload = payload
        self.nbytes = 0 if payload is None else payload.nbytes
        self.slots: list[int] = []
        self.state = MessageState.PENDING
        self.eager = eager
        self.tombstone = tombstone
        self.consumed: Wait | None = None  # in process: the sender's wait for a handover
        self.matched: Any = None  # the PostedRecv it went to, until that receive runs
        self.on_taken: Callable[[], None] | None = None  # MPI: acknowledge a receive
        self.on_done: Callable[[], None] | None = None  # MPI: acknowledge freed rx buffers
        # MPI: ask the sender for the payload, which stays there until a receive matches
        self.fetch: Callable[[], None] | None = None
        self.fp: Fingerprint | None = None  # the sending call's, to check against ours
        self.notice: tuple[int, str] | None = None  # an abort notice: (retcode, why)


class Port(Protocol):
    """A rank's connection to its fabric (called in engine context): where its
    messages arrive and the engine that runs its calls."""

    inbox: Inbox
    engine: Engine

    def post(self, dst: int, msg: Message, timeout_code: int) -> Wait | None:
        """Deliver `msg` to session `dst`. None: the send is done (the data was
        copied); otherwise a Wait that is set once the receiver has the data. Its
        `expire` withdraws the message if no receive has taken it yet, and the
        sender then fails with `timeout_code`."""
        ...

    def close(self) -> None: ...
