"""The state machine every call of the soft CCLO goes through, and what all calls share.

`SoftCall` is a call's life (see the package's docstring), whatever it does:
submitted, running (its body, a generator, yields the `Wait`s it needs), done; it
fails by raising `CallFailed`. `Comm` is a communicator as a call reads it from
exchange memory. The kinds of call subclass `SoftCall` in their own modules.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Generator, Hashable
from typing import TYPE_CHECKING, Any

import numpy as np

from ... import _exchmem as xm
from ..._constants import TAG_ANY, ErrorCode, Scenario
from ..._errors import Aborted, ACCLError, DeviceError
from ...devices import CallArgs, DeviceCall
from .._datapath import OPERAND_FLAGS
from .._engine import Wait
from .._failure import CallFailed
from .._streams import StreamRead, stream_roles
from ..fabric._message import Collective, Key, function_name

if TYPE_CHECKING:
    from .._device import SoftDevice

log = logging.getLogger("aaccl")
_now = time.perf_counter_ns

Body = Generator[Wait, Any, None]

COLLECTIVES = frozenset({Scenario.BCAST, Scenario.SCATTER, Scenario.GATHER, Scenario.REDUCE,
                         Scenario.ALLGATHER, Scenario.ALLREDUCE, Scenario.REDUCE_SCATTER,
                         Scenario.BARRIER, Scenario.ALLTOALL})
ROOTED = frozenset({Scenario.BCAST, Scenario.SCATTER, Scenario.GATHER, Scenario.REDUCE})
REDUCING = frozenset({Scenario.REDUCE, Scenario.ALLREDUCE, Scenario.REDUCE_SCATTER,
                      Scenario.COMBINE})
MISMATCH = int(ErrorCode.DMA_MISMATCH_ERROR)
SIZE_MISMATCH = int(ErrorCode.DMA_SIZE_ERROR)

OFFLOAD_BYTES = 1 << 20
"""Copies and reductions of at least this many bytes run on the engine's data
workers (in parallel, without the GIL); smaller ones run in line."""

RECEIVE_TIMEOUT = int(ErrorCode.RECEIVE_TIMEOUT_ERROR)
DEQUEUE_TIMEOUT = int(ErrorCode.DEQUEUE_BUFFER_TIMEOUT_ERROR)
INBOUND_SEQ, OUTBOUND_SEQ = 2, 3
"""Words of a rank's communicator record that count messages from and to it."""


def describe_call(args: CallArgs, dtype: np.dtype | None = None) -> str:
    """A call as a user wrote it, from its CCLO arguments: "bcast(count=64, root=0)"."""
    scenario = Scenario(args.scenario)
    parts = [] if scenario == Scenario.BARRIER else [f"count={args.count}"]
    if dtype is not None and parts:
        parts.append(dtype.name)
    if scenario in ROOTED:
        parts.append(f"root={args.root_src_dst}")
    elif scenario == Scenario.SEND:
        parts.append(f"dst={args.root_src_dst}, {tag_words(args.tag)}")
    elif scenario == Scenario.RECV:
        parts.append(f"src={args.root_src_dst}, {tag_words(args.tag)}")
    if scenario in REDUCING:
        parts.append(function_name(args.function))
    return f"{scenario.name.lower()}({', '.join(parts)})"


def tag_words(tag: int) -> str:
    """A tag as a call's argument, in words: "tag=5", and "any tag" for TAG_ANY
    (0xFFFFFFFF, which means nothing to a reader)."""
    return "any tag" if tag == TAG_ANY else f"tag={tag}"




class State(enum.Enum):
    SUBMITTED = "submitted"  # waiting for its dependencies (and, in order, its turn)
    RUNNING = "running"  # its body runs, or waits for `SoftCall.waiting`
    DONE = "done"


SUBMITTED, RUNNING, DONE = State.SUBMITTED, State.RUNNING, State.DONE
"""(the states as globals: a member looked up on its enum costs five times as much,
several times on every call's path)"""


class Comm:
    """A communicator as read from exchange memory, with its matching key."""

    __slots__ = ("rank", "size", "sessions", "key")

    def __init__(self, record: xm.Communicator) -> None:
        self.rank, self.size = record.local_rank, len(record.ranks)
        self.sessions = tuple(r.session for r in record.ranks)
        self.key: Hashable = self.sessions  # the same group matches on every rank

    def peer(self, index: int) -> int:
        """The session of communicator rank `index` (one the CCLO cannot decode
        fails the call: a negative index too, which would wrap to the last rank)."""
        if not 0 <= index < self.size:
            raise CallFailed(ErrorCode.DMA_DECODE_ERROR)
        return self.sessions[index]


class SoftCall(DeviceCall):
    """One call on one soft CCLO, and its device call (what `SoftDevice.start`
    returns): one object from submission to completion. Subclasses say how it is
    admitted and what it runs. Made with its arguments alone (`DeviceCall`'s
    constructor): the device that makes it sets the fields below, at once (no
    constructor of its own: one call less per call)."""

    __slots__ = ("dev", "state", "body", "waiting", "__dict__")

    args: CallArgs  # (DeviceCall's slot) a soft call is always a CCLO call, never host work
    dev: SoftDevice
    state: State
    body: Body | None  # what it runs (None: nothing yet, or its fabric runs it)
    waiting: Wait | None  # what it waits for (its deadline parked in `dev.alarm`, if any)

    # What most calls never set, as class-level defaults: a call that sets one gets it
    # in its own `__dict__` (made then), so the common call stores none of them.
    failure = 0
    """A retcode known early: the call fails when it would run or end."""
    failure_detail: str | None = None
    failure_error: Aborted | None = None
    """The failure is an abort (a peer's)."""
    aborting: ACCLError | None = None
    """Set by `abort_now`: how the call ends."""
    deps_left = 0
    """Dependencies (`waitfor`) not done yet."""
    op0_stream = res_stream = False
    """Operand 0 / the result on a kernel stream."""

    # -- submitted ------------------------------------------------------------------

    def admit(self, waitfor: tuple[DeviceCall, ...]) -> None:
        """Count the call among its CCLO's, fix its place in the message order, then
        wait for `waitfor` (engine context: the event `SoftDevice.start` posts)."""
        dev = self.dev
        if dev.aborted is not None or dev.closed:
            # submitted after the abort was processed (a rank's task still ran on):
            # nothing else would ever end it
            self.refuse(dev.aborted or DeviceError("the soft CCLO is closed"))
            return
        dev.calls[self] = None
        dev.last = self.args  # (not the call: the user's, collected once dropped)
        try:
            self.prepare()
        except CallFailed as failed:
            self.failure, self.failure_detail = failed.code, failed.detail
        if waitfor or dev.in_order or self.op0_stream or self.res_stream:
            self._when_ready(waitfor)
        else:  # (ready, in line: the common case costs no call)
            self.start()

    def _when_ready(self, waitfor: tuple[DeviceCall, ...]) -> None:
        """Run once the calls of `waitfor` are done (never, if one of them failed); a
        call on the kernel streams once the one before it on them ended, too; in
        order, once every call admitted before it ended."""
        dev = self.dev
        if dev.in_order:  # it takes its place now, ready or not, as on the firmware
            dev.queue.append(self)
        if self.op0_stream or self.res_stream:
            turn = dev.streams.turn(self)
            if turn is not None:
                waitfor = (*waitfor, turn)
        if not waitfor:
            dev.ready(self)
            return
        pending = [dep for dep in waitfor if not dep.done()]
        if any(dep.failed for dep in waitfor if dep.done()):
            self.abort()
            return
        if not pending:
            dev.ready(self)
            return
        self.deps_left = len(pending)
        post = dev.engine.post
        for dep in pending:
            dep.add_done_callback(lambda dep: post(self.dependency_done, dep))

    def prepare(self) -> None:
        """Take the call's place in the message order (at submission)."""

    def use_streams(self, size: int, is_root: bool) -> None:
        """Which of the call's operands are on the kernel streams (at submission)."""
        roles = stream_roles(self.args.scenario, self.args.stream_flags, size, is_root)
        if roles is None:
            raise CallFailed(ErrorCode.COLLECTIVE_NOT_IMPLEMENTED,
                             f"ACCL's firmware runs no {Scenario(self.args.scenario).name.lower()}"
                             " on kernel streams")
        self.op0_stream, self.res_stream = roles

    def read_stream(self, moves: list[int]) -> Generator[Wait, Any, np.ndarray]:
        """The bytes of `moves` (one per move of the firmware) from the input stream."""
        wait = self.dev.streams.read(moves)
        value = wait.value if wait.done else (yield wait)
        if isinstance(value, ACCLError):  # the stream kernel failed
            raise CallFailed(ErrorCode.KRNL_TIMEOUT_STS_ERROR, str(value), error=value)
        return value

    def dependency_done(self, dep: DeviceCall) -> None:
        if self.state is not SUBMITTED or self.deps_left <= 0:
            return  # aborted already
        if dep.failed:
            self.deps_left = 0
            self.abort()
            return
        self.deps_left -= 1
        if self.deps_left == 0:
            self.dev.ready(self)

    def refuse(self, error: ACCLError) -> None:
        """End the call before it is admitted (its CCLO was aborted or closed): it
        takes no place in the message order, which no peer follows any more."""
        self.state = DONE
        self.dev.finished(self, aborted=True, error=error)

    def abort(self) -> None:
        """A dependency failed: the call never runs."""
        self.abandon()
        self.state = DONE
        self.dev.finished(self, aborted=True, error=self.aborting)

    def fail_now(self, failed: CallFailed, error: Aborted | None = None) -> None:
        """End the call with `failed` (a peer's call of the same collective failed,
        or does not match ours), or with `error` if given: at once by failing what it
        waits for; a call whose payload a peer reads right now fails once that is
        over, and one still waiting for its `waitfor` when it would start (so a
        failed dependency of its own still makes it a DependencyError)."""
        if self.state is DONE or self.aborting is not None or self.failure:
            return
        self.failure, self.failure_detail = failed.code, failed.detail
        if self.state is SUBMITTED:
            self.failure_error = error
            return
        self.aborting = error
        self.interrupt(failed)

    def abort_now(self, error: Aborted) -> None:
        """End the call at once with `error` (its world is cancelled or closed):
        before it runs, or by failing what it waits for. A call whose payload a peer
        reads right now, or whose data job runs, ends as soon as that is over."""
        if self.state is DONE or self.aborting is not None:
            return
        self.aborting = error
        if self.state is SUBMITTED:
            self.abort()
            return
        # as a failure: a wait that cannot be withdrawn now (a data job, a peer
        # reading our data) ends the call when it is over, never a further step
        self.failure = self.failure or RECEIVE_TIMEOUT
        self.interrupt(CallFailed(RECEIVE_TIMEOUT))

    def interrupt(self, failed: CallFailed) -> None:
        """Fail what the running call waits for, if that can be withdrawn now."""
        wait = self.waiting
        if wait is not None and wait.withdraw(self):
            wait.waiter, self.waiting = None, None
            self.dev.alarm.parked.pop(self, None)
            self.resume(None, failed)

    prefix: Key | None = None  # (a collective's: its key among them)

    def describe(self) -> str:
        return describe_call(self.args)

    def where(self) -> str:
        """The call's communicator, for a peer's error: " on ranks 1, 0"."""
        return ""

    def waiting_for(self, wait: Wait) -> str:
        """What the call waits for, in words, for a timeout's message."""
        peers = self.peers_waited(wait)
        if not peers:
            return "its peers"
        return f"rank{'s' if len(peers) > 1 else ''} {', '.join(map(str, peers))}"

    def peers_waited(self, wait: Wait) -> list[int]:
        """The sessions (global ranks) a wait depends on, where known."""
        return []

    def abandon(self) -> None:
        """Give back the call's place in the message order (it will never run)."""

    # -- running --------------------------------------------------------------------

    way: Collective | None = None
    """How its fabric takes part in the call (a collective's: `CollectiveCall.way`)."""

    def start(self) -> None:
        """Run the call: its fabric's way, if that takes it, or else its body."""
        if self.state is not SUBMITTED:
            return  # aborted while it waited for its turn
        self.state, self.started = RUNNING, _now()
        if self.failure:
            self.aborting = self.failure_error
            self.abandon()
            self.finish(self.failure, self.failure_detail)
            return
        if (way := self.way) is None or not way.start(self):  # type: ignore[arg-type]
            self.body = self.run()
            self.resume(None)

    def run(self) -> Body:
        return
        yield  # every body is a generator

    def resume(self, value: Any, error: CallFailed | None = None) -> None:
        """Run the body until it waits for something not there yet, or ends."""
        body = self.body
        if error is None and self.failure:  # failed while running: no further step
            error = CallFailed(self.failure, self.failure_detail)
        if body is None:  # its fabric runs it (a meeting): its wait was withdrawn
            if error is None:
                self.finish(value or 0)
                return
            if error.error is not None and self.aborting is None:
                self.aborting = error.error
            self.finish(error.code, error.detail)
            return
        while True:
            try:
                wait = body.send(value) if error is None else body.throw(error)
            except StopIteration:
                self.finish(0)
                return
            except CallFailed as failed:
                if failed.error is not None and self.aborting is None:
                    self.aborting = failed.error
                self.finish(failed.code, failed.detail)
                return
            except Exception:  # a bug in the model fails this call, and nothing else
                log.exception("soft CCLO %d: internal error in %s", self.dev.session,
                              Scenario(self.args.scenario).name.lower())
                self.finish(int(ErrorCode.DMA_INTERNAL_ERROR))
                return
            if not wait.done:
                break
            value, error = wait.value, None
        if self.dev.gone:  # waits for a rank that left the world: it never comes
            gone = [p for p in self.peers_waited(wait) if p in self.dev.gone]
            if gone and wait.withdraw(self):
                self.aborting = self.aborting or Aborted(
                    f"rank {gone[0]} left the world: {self.dev.gone[gone[0]]}")
                self.resume(None, CallFailed(ErrorCode.RECEIVE_TIMEOUT_ERROR))
                return
        self.waiting = wait
        wait.waiter = self  # (`Wait.set` calls our `_wake`: no bound method per wait)
        if wait.timeout_code:  # (its deadline: a dict entry, `SoftDevice.alarm`)
            self.dev.alarm.park(self, self.dev.timeout)

    def _wake(self, wait: Wait) -> None:
        self.waiting = None
        dev = self.dev
        dev.alarm.parked.pop(self, None)
        dev.engine.soon(self.resume, wait.value)

    def expire(self, detail: str | None = None) -> None:
        """The deadline of the current wait passed. `detail`: what it waited for, in
        words, if the caller said so before expiring others' waits changed it."""
        wait = self.waiting
        self.dev.alarm.parked.pop(self, None)  # (gone already if the alarm expires it)
        if wait is None:
            return
        if detail is None:  # (before expiring changes what it waits for)
            detail = self.timeout_detail(wait)
        if wait.withdraw(self):
            wait.waiter, self.waiting = None, None
            self.resume(None, CallFailed(wait.timeout_code, detail))
        # else: a peer is reading our data right now; it finishes without a deadline

    def withdrawn(self, wait: Wait) -> CallFailed:
        """A send's deadline passed and, over MPI, its receiver has since agreed to drop
        the message (`MPIFabric._withdraw`): the call fails as at the deadline."""
        return CallFailed(wait.timeout_code, self.timeout_detail(wait))

    def timeout_detail(self, wait: Wait) -> str:
        """What the call waited for when its deadline passed, in words."""
        if isinstance(wait, StreamRead):
            return f"waited {self.dev.timeout:g} s for {wait.describe()}"
        detail = f"waited {self.dev.timeout:g} s for {self.waiting_for(wait)}"
        peers = self.peers_waited(wait)
        if len(peers) == 1:
            seen = self.dev.port.activity(peers[0], self.prefix)
            if seen is not None:
                detail += f"; rank {peers[0]} {seen}"
        elif self.dev.in_order and self.prefix is not None:
            for peer in peers[:3]:  # the peers whose call waits in line behind another
                seen = self.dev.port.activity(peer, self.prefix)
                if seen is not None and seen.startswith("has its call of it"):
                    detail += f"; rank {peer} {seen}"
        return detail

    def finish(self, retcode: int = 0, detail: str | None = None) -> None:
        """The call ran to its end with `retcode` (its body, or its fabric for it).
        One that ended well, out of order, ends here in one frame: most calls do."""
        self.state, self.body, self.waiting = DONE, None, None
        dev = self.dev
        dev.inbox.members.pop(self.prefix, None)  # type: ignore[arg-type]  # (`Inbox.leave`)
        if retcode or self.failure or self.aborting is not None or dev.in_order:
            self.end(retcode, detail)
            return
        dev.calls.pop(self, None)  # (`SoftDevice.finished`'s common case, inline)
        dev.retcode = 0
        self.complete()

    def end(self, retcode: int, detail: str | None) -> None:
        """The call ran to its end, failed, or in order: its device publishes it."""
        if not retcode and self.failure:  # failed while a peer read our data
            retcode, detail = self.failure, self.failure_detail
        if self.aborting is not None:
            self.dev.finished(self, aborted=True, error=self.aborting)
        else:
            self.dev.finished(self, retcode=retcode, detail=detail)


class ConfigCall(SoftCall):
    __slots__ = ()

    def admit(self, waitfor: tuple[DeviceCall, ...]) -> None:
        last = self.dev.last  # (what a peer's error names is the user's last call)
        super().admit(waitfor)
        self.dev.last = last

    def run(self) -> Body:
        code = self.dev.configure(self.args)
        if code:
            raise CallFailed(code)
        return
        yield


def check_compression(args: CallArgs) -> None:
    if args.compression_flags & OPERAND_FLAGS \
            and args.scenario not in (Scenario.COPY, Scenario.COMBINE):
        # compressed buffers (mixed precision) are modelled for copy and combine only
        raise CallFailed(ErrorCode.COMPRESSION_ERROR)
