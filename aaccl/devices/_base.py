"""The narrow interface between the driver and a CCLO, whatever implements it."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple, Protocol

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

    __slots__ = ("args", "_lock", "_callbacks", "_event", "retcode", "aborted", "error", "ended",
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
        self.ended = 0  # perf_counter_ns when its outcome was set, before anyone was told
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
            self.ended = time.perf_counter_ns()  # (a trace's end: not when a callback ran)
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
    pending: deque[tuple[DeviceCall, list[Callable[[DeviceCall], None]]]] | None = \
        getattr(_local, "pending", None)
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


class Poller(Protocol):
    """Progress a waiting task can make itself on a device (the MPI fabric): see
    `aaccl.api._bridge.wait`."""

    def poll(self) -> object:
        """Make progress once, on the calling thread."""

    def park(self) -> None:
        """A task stopped polling before its call finished: the device's own thread
        takes over."""


def in_sequence(device: Device, whole: CallArgs, steps: Sequence[CallArgs],
                waitfor: Sequence[DeviceCall] = ()) -> DeviceCall:
    """`steps` as one device call with `whole`'s arguments: each waits for the one
    before (the first for `waitfor`), and the call fails as the first that failed.
    `Device.start_steps` of devices where calls match by sequence, not by their
    order on the device (the soft CCLO)."""
    calls: list[DeviceCall] = []
    for step in steps:
        calls.append(device.start(step, [calls[-1]] if calls else waitfor))
    return joined(whole, calls)


class Device(ABC):
    """What the driver and `ACCL` need from a CCLO: exchange memory, device memory,
    calls. Every device inherits it.

    The abstract methods are what every device does. The rest are capabilities only
    some devices have, declared here with what a device without them does (nothing,
    or a TypeError that says why not), so callers call them without asking first.

    `start` submits a call that runs once every call in `waitfor` succeeded; if one
    failed, the new call completes with `aborted=True` and never runs.
    """

    timer_hz: int  # units of the SET_TIMEOUT config value per second

    runs_accl_firmware: bool = False
    """The device runs ACCL's firmware: the driver gives it equivalent calls for those
    the firmware gets wrong (through `start_steps`)."""

    enforces_call_timeout: bool = False
    """The device fails a call after the timeout itself, on the host (ACCL's firmware
    never acts on SET_TIMEOUT): it takes the timeout in seconds (`set_call_timeout`),
    so it holds timeouts the 32-bit register cannot."""

    poller: Poller | None = None
    """Progress a task waiting for one of the device's calls can make itself (the MPI
    fabric), or None: its calls complete on the device's own threads."""

    gone: Mapping[int, str] = MappingProxyType({})
    """The peers (sessions) that left the device's world, and why (the soft CCLO
    learns it from their notices; other devices never do)."""

    missing: Callable[[], str | None] | None = None
    """Where the device's world can tell that a peer will never come (the MPI fabric:
    its process ended), `missing()` says why, or None while all may still come. Set
    by the world that joins the device to its fabric; None: waits for every rank are
    bounded by the timeout instead."""

    # -- what every device does ---------------------------------------------------------

    @abstractmethod
    def mmio_read(self, offset: int) -> int: ...

    @abstractmethod
    def mmio_write(self, offset: int, value: int) -> None: ...

    @abstractmethod
    def alloc(self, nbytes: int) -> int: ...

    @abstractmethod
    def free(self, address: int) -> None: ...

    @abstractmethod
    def write(self, address: int, data: np.ndarray) -> None: ...

    @abstractmethod
    def read(self, address: int, out: np.ndarray) -> None: ...

    @abstractmethod
    def start(self, args: CallArgs, waitfor: Sequence[DeviceCall] = ()) -> DeviceCall: ...

    @abstractmethod
    def run(self, job: Callable[[], None], waitfor: Sequence[DeviceCall] = ()) -> DeviceCall:
        """Run host work (a kernel modelled in Python, a DMA transfer) on the device's
        worker threads once `waitfor` succeeded, as a call of the same graph."""

    @abstractmethod
    def close(self) -> None: ...

    # -- capabilities, and what a device without them does ------------------------------

    def set_call_timeout(self, seconds: float) -> None:
        """Fail a call that runs longer than `seconds` (`enforces_call_timeout`); by
        default nothing: the device goes by SET_TIMEOUT's register."""

    def start_steps(self, whole: CallArgs, steps: Sequence[CallArgs],
                    waitfor: Sequence[DeviceCall] = ()) -> DeviceCall:
        """One call, with `whole`'s arguments, that runs `steps` back to back with no
        other call between them where the device can order them so (its own queue);
        by default each step waits for the one before (`in_sequence`)."""
        return in_sequence(self, whole, steps, waitfor)

    def array(self, address: int, dtype: np.dtype, count: int) -> np.ndarray | None:
        """`count` elements of device memory at `address` as an array, without a copy,
        where device memory is in this process (the soft CCLO); else None: `read` and
        `write` copy it."""
        return None

    def abort(self, reason: str) -> None:
        """End every outstanding call at once with `Aborted(reason)` (any thread);
        by default nothing: a card's calls end in their own time."""

    def abort_calls(self, handles: Sequence[DeviceCall], reason: str) -> None:
        """End these outstanding calls with `Aborted(reason)` (any thread); by default
        nothing."""

    def leave(self, reason: str, peers: Sequence[int]) -> None:
        """Tell `peers` (sessions) that this rank leaves the world, and why, so their
        calls that need it fail at once; by default nothing: they time out."""

    def skip_collective(self, comm: int, reason: str) -> None:
        """The host rejected a collective on communicator `comm` (its exchange-memory
        address): let the peers' calls of it fail with `reason`; by default nothing."""

    def attach_stream(self, kernel: Callable[[np.ndarray, int], Any] | None,
                      name: str) -> None:
        """Route what the CCLO writes to its kernel stream through `kernel(chunk,
        tag)` (None: the loopback); only the soft CCLO can."""
        raise TypeError("attach_stream needs the soft CCLO (device='soft'): on a card the "
                        "CCLO's kernel streams are wired to kernels when the bitstream is "
                        "linked, and ACCL's emulator loops them back (cclo_emu -b)")

    def is_card_kernel(self, target: object) -> bool:
        """Whether `target` is a kernel of the card (run by `start_kernel`), not a
        Python callable; by default no device has any."""
        return False

    def overlay_kernel(self, name: str) -> Any:
        """The card's kernel called `name` (under device="pynq", its overlay's)."""
        raise TypeError(f"kernel {name!r}: kernels by name are an overlay's, under "
                        "device='pynq'; on this device a kernel is a Python callable")

    def start_kernel(self, kernel: Any, args: Sequence[Any],
                     waitfor: Sequence[DeviceCall] = ()) -> DeviceCall:
        """Start a run of a kernel of the card (`is_card_kernel`) after `waitfor`."""
        raise TypeError(f"{type(self).__name__} runs no kernels of a card")
