"""The narrow interface between the driver and a CCLO, whatever implements it."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import numpy as np


class CallArgs(NamedTuple):
    """The CCLO's 12 call arguments, in ACCL's order."""

    scenario: int
    count: int  # type: ignore[assignment]  # ACCL's name, though it hides tuple.count
    comm: int
    root_src_dst: int
    function: int
    tag: int
    arithcfg: int
    compression_flags: int
    stream_flags: int
    addr_0: int
    addr_1: int
    addr_2: int


class DeviceCall:
    """Completion of one call on a device: a return code, or "never ran".

    `args` are the CCLO call's arguments, or None for host work (a job or a kernel
    run), which has no return code: it succeeds or ends with `error`.

    Devices complete it from their own threads. Its `owner` (the API's Call, which
    attaches itself with `own`) learns first, before anyone can see the device call
    done: so a dependent submitted meanwhile finds the owner's error in place. Then
    the callbacks run, on the completing thread; they must not block. A callback
    that raises is logged on the `aaccl` logger and the others run all the same. A
    completion that happens inside another's callbacks on the same thread (a chain
    failing call after call) queues its callbacks behind the running ones instead of
    nesting, so no chain is too long for the stack.
    """

    __slots__ = ("args", "_lock", "_callbacks", "_event", "retcode", "aborted", "error",
                 "started", "detail", "_owner", "_settled")

    def __init__(self, args: CallArgs | None) -> None:
        self.args = args
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[DeviceCall], None]] | None = []
        self._event: threading.Event | None = None
        self.retcode = 0
        self.aborted = False  # a dependency failed, so the call never ran
        self.error: Exception | None = None  # the device could not run it, or host work raised
        self.started = 0  # perf_counter_ns when the device began running it (0: not yet)
        self.detail: str | None = None  # what went wrong, in words, where the device knows
        self._owner: Owner | None = None
        self._settled = False  # its outcome is set (its owner told or being told)

    def done(self) -> bool:
        return self._callbacks is None

    def mark_started(self) -> None:
        """Devices call this when the call leaves their queue and begins to run."""
        self.started = time.perf_counter_ns()

    @property
    def failed(self) -> bool:
        return self.aborted or self.retcode != 0 or self.error is not None

    def own(self, owner: Owner) -> None:
        """Make `owner._completed(self)` the call's first completion callback, or call
        it now if the outcome is set already (any thread)."""
        with self._lock:
            if not self._settled:
                self._owner = owner
                return
        owner._completed(self)

    def add_done_callback(self, fn: Callable[[DeviceCall], None]) -> None:
        """Run `fn(self)` on completion, or right now if already complete."""
        with self._lock:
            if self._callbacks is not None:
                self._callbacks.append(fn)
                return
        fn(self)

    def wait(self, timeout: float | None = None) -> bool:
        """Block the calling thread until complete; never call it on an event loop."""
        with self._lock:
            if self._callbacks is None:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(timeout)

    def complete(self, retcode: int = 0, aborted: bool = False,
                 error: Exception | None = None, detail: str | None = None) -> None:
        with self._lock:
            if self._settled:
                raise RuntimeError("device call completed twice")
            self.retcode, self.aborted, self.error = retcode, aborted, error
            self.detail = detail
            self._settled = True
            owner, self._owner = self._owner, None
        if owner is not None:
            try:
                owner._completed(self)
            except Exception:  # its own failure: the callbacks still run (and wake)
                log.exception("the owner of a device call failed to complete it")
        with self._lock:
            callbacks, self._callbacks = self._callbacks, None
            event = self._event
        if event is not None:
            event.set()
        if callbacks:
            _run_callbacks(self, callbacks)


class Owner(Protocol):
    """What owns a device call (the API's Call): told first when it completes."""

    def _completed(self, dev: DeviceCall) -> None: ...


def joined(whole: CallArgs, calls: Sequence[DeviceCall]) -> DeviceCall:
    """One device call, with `whole`'s arguments, for several that together do its
    work: it completes once all of them have, failed as the first (in `calls`' order)
    that failed."""
    result = DeviceCall(whole)
    left = [len(calls)]
    lock = threading.Lock()

    def one_done(_: DeviceCall) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        result.started = min((c.started for c in calls if c.started), default=0)
        failed = next((c for c in calls if c.failed), None)
        if failed is None:
            result.complete()
        else:
            result.complete(retcode=failed.retcode, aborted=failed.aborted,
                            error=failed.error, detail=failed.detail)

    if not calls:
        result.complete()
    for call in calls:
        call.add_done_callback(one_done)
    return result


_local = threading.local()
log = logging.getLogger("aaccl")


def _run_callbacks(call: DeviceCall, callbacks: list[Callable[[DeviceCall], None]]) -> None:
    """Run completion callbacks iteratively: one thread, one loop at a time."""
    if not callbacks:
        return
    pending: deque | None = getattr(_local, "pending", None)
    if pending is not None:
        pending.append((call, callbacks))
        return
    pending = _local.pending = deque([(call, callbacks)])
    try:
        while pending:
            done, fns = pending.popleft()
            for fn in fns:
                try:
                    fn(done)
                except Exception:  # its own failure: the others still run (and wake)
                    log.exception("a completion callback of a device call raised")
    finally:
        _local.pending = None


class Device(Protocol):
    """What the driver needs from a CCLO: exchange memory, device memory, calls.

    `start` submits a call that runs once every call in `waitfor` succeeded; if one
    failed, the new call completes with `aborted=True` and never runs.

    A device that enforces the call timeout on the host (ACCL's firmware never acts
    on SET_TIMEOUT) also has `set_call_timeout(seconds)`: the driver passes the
    timeout it was asked for, which the 32-bit register may not hold. A device
    that runs ACCL's firmware says so (`runs_accl_firmware = True`): the driver then
    gives it equivalent calls for those the firmware gets wrong, through
    `start_steps(whole, steps, waitfor)` where the device has it: one call that runs
    `steps` back to back, with no other call between them.
    """

    timer_hz: int  # units of the SET_TIMEOUT config value per second

    def mmio_read(self, offset: int) -> int: ...

    def mmio_write(self, offset: int, value: int) -> None: ...

    def alloc(self, nbytes: int) -> int: ...

    def free(self, address: int) -> None: ...

    def write(self, address: int, data: np.ndarray) -> None: ...

    def read(self, address: int, out: np.ndarray) -> None: ...

    def start(self, args: CallArgs, waitfor: Sequence[DeviceCall] = ()) -> DeviceCall: ...

    def run(self, job: Callable[[], None], waitfor: Sequence[DeviceCall] = ()) -> DeviceCall:
        """Run host work (a kernel modelled in Python, a DMA transfer) on the device's
        worker threads once `waitfor` succeeded, as a call of the same graph."""
        ...

    def close(self) -> None: ...
