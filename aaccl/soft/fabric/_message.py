"""Messages between soft CCLOs, and what a fabric offers a sender."""

from __future__ import annotations

import enum
from collections.abc import Callable, Generator, Hashable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..._constants import ReduceFunction, Scenario
from .._engine import Engine, Wait

if TYPE_CHECKING:
    from .._calls._collective import CollectiveCall
    from .._calls._schedule import ScheduleCall
    from .._calls._state import Comm
    from .._failure import CallFailed
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
        self.slots: Sequence[int] = ()  # its rx buffers (none yet: no list per message)
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


class Collective:
    """How a fabric takes part in one rank's call of a collective, beyond the
    messages of the call's schedule (`Port.collective` says which, per call).
    These defaults do nothing: the schedule runs the collective over messages.

    In process, the ranks' calls report to a roll call that compares them at once,
    and a small allreduce meets its peers in shared memory (`_inprocess`); over MPI,
    the world communicator's collectives take their turn in the lane (`_lane`), and
    a gather's or reduce's root announces its call (`_mpi`)."""

    __slots__ = ()

    shared = False
    """One object serves every call with the same arguments (it keeps nothing of a
    call): a CCLO remembers it with their decoding (`SoftDevice.remember`) instead
    of asking `Port.collective` for every call."""

    def join(self, call: CollectiveCall) -> tuple[int, str] | None:
        """The call is admitted, its fingerprint known: the mismatch with a peer's
        call that the fabric finds now (retcode, why), if any."""
        return None

    def reject(self, call: CollectiveCall, failed: CallFailed) -> None:
        """The call can never run (`failed`, at submission): it takes its place
        among the fabric's collectives all the same."""

    def start(self, call: ScheduleCall) -> bool:
        """Run the call without a body, if the fabric can (an in-process meeting):
        True if it took the call, which it then ends itself (`SoftCall.finish`), or
        parks on a `Wait` in `call.waiting` that an abort can withdraw."""
        return False

    def run(self, call: ScheduleCall) -> Generator[Wait, Any, bool]:
        """Run before the schedule: True if the collective is done, False if the
        schedule is to run it."""
        return False
        yield  # a generator

    def abandon(self, call: CollectiveCall) -> None:
        """The call will never run or ends early: its peers must not wait for it."""

    def abort(self, call: CollectiveCall, why: str) -> None:
        """The call never runs: a call it waits for failed, or it was aborted."""

    def peers_waited(self, call: CollectiveCall, wait: Wait) -> list[int] | None:
        """The sessions a wait of the fabric's depends on (None: not the fabric's)."""
        return None

    def waiting_for(self, call: CollectiveCall, wait: Wait) -> str | None:
        """What a wait of the fabric's waits for, in words (None: not the fabric's)."""
        return None


class Port:
    """A rank's connection to its fabric (called in engine context): where its
    messages arrive and the engine that runs its calls, and what else the fabric
    offers its soft CCLO. These defaults are a fabric that offers nothing else."""

    inbox: Inbox
    engine: Engine
    poller: Any = None
    """What the host polls while it waits for a call, if anything (`ACCL._poller`)."""

    def post(self, dst: int, msg: Message, timeout_code: int) -> Wait | None:
        """Deliver `msg` to session `dst`. None: the send is done (the data was
        copied); otherwise a Wait that is set once the receiver has the data. Its
        `expire` withdraws the message if no receive has taken it yet, and the
        sender then fails with `timeout_code`."""
        raise NotImplementedError

    def collective(self, call: CollectiveCall) -> Collective | None:
        """How this fabric takes part in `call`'s collective (at submission, once
        its communicator and sequence number are known); None: it runs over
        messages alone."""
        return None

    def skip(self, comm: Comm, prefix: Key, reason: str) -> None:
        """The host rejected a collective `prefix` of `comm`: it takes its place
        among the fabric's collectives all the same."""

    def register(self, activity: Callable[[Hashable | None], str]) -> None:
        """How others can see what this session's CCLO is doing (for their errors):
        `activity(key)`, where `key` names the collective they wait for in it."""

    def activity(self, session: int, key: Hashable | None = None) -> str | None:
        """What `session`'s CCLO is doing now, in words, if this fabric can tell; with
        `key` (a collective's prefix), what became of its call of that collective."""
        return None

    def watch(self, busy: Callable[[], bool]) -> None:
        """`busy()` says whether the device has calls under way (any thread)."""

    def lane_done(self) -> int:
        """How many of the world's collectives the fabric is done with here (told to
        peers when this rank leaves its world)."""
        return 0

    def peer_left(self, lane_done: int, why: str) -> None:
        """A peer left the world after the fabric finished `lane_done` of the world's
        collectives there."""

    def close(self) -> None:
        pass
