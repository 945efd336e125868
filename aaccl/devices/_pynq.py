"""Alveo hardware through PYNQ (pynq 3.0.1, the last release with Alveo support).

As pyaccl did, the device loads the xclbin as a `pynq.Overlay` on one card, reads
and writes the CCLO's exchange memory through its IP (`ccl_offload_<i>`), keeps
buffers in the memory bank the CCLO is wired to, and starts each call as a run of
the `hostctrl_<i>` kernel with ACCL's 12 arguments. PYNQ schedules runs through
XRT's embedded scheduler (ERT), which before XRT 2.11 takes a wait list: a call
whose dependencies are all live runs of this device starts at once with
`waitfor=[their handles]`, and the card starts it when they end, with no host in
between. Anything else (a dependency on another device or not started yet, or XRT
2.11 and later, which dropped wait lists) is resolved on the host (`start_after`).

Limits, all ACCL's own:

- ERT knows when a run ends, not the CCLO's return code, so a dependent chained on
  the card runs even when its dependency failed. The device still completes it as
  aborted (DependencyError), but what it did on the card is done.
- The CCLO has one return-code register (RETCODE, 0x1FFC), written as each call
  ends. With several calls in flight it holds the latest finished call's code: the
  device reads it when it sees a run end and attributes a nonzero code to that run,
  although it may belong to a call that finished just after it.
- ACCL's firmware stores its receive timeout but never acts on it, so the device
  enforces it on the host: the card runs one call at a time, and the oldest
  unfinished call fails with RECEIVE_TIMEOUT_ERROR once it has led the queue for
  longer than the timeout. The card keeps running it; later calls queue behind it.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import math
import os
import re
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import _exchmem as xm
from .. import _threads
from .._constants import ConfigFunction, ErrorCode, Scenario
from .._errors import DeviceError
from ._base import CallArgs, Device, DeviceCall, joined
from ._hostdeps import start_after
from ._jobs import HostJobs, Job
from ._poll import FIRST_SLEEP, LONGEST_SLEEP

log = logging.getLogger("aaccl")

NEEDS_PYNQ = ("the PYNQ device needs pynq 3.0.1 (the last PYNQ release with Alveo support): "
              "pip install 'aaccl[pynq]'")
LAST_ALVEO_PYNQ = (3, 0, 1)
FIRST_ALVEO_PYNQ = (2, 5, 1)
WAITLIST_XRT = ((2, 3, 0), (2, 11, 0))
"""XRT versions whose scheduler takes wait lists: PYNQ's ERT support starts at 2.3, and
PYNQ refuses `waitfor` from 2.11 on (pynq/pl_server/xrt_device.py)."""
CONFIG_TIMEOUT = 30.0
"""Seconds a configuration call may take: it waits for no peer."""


class _Run:
    """A call running on the card (or queued in ERT) and what the host knows of it."""

    __slots__ = ("call", "handle", "deps", "timeout")

    def __init__(self, call: DeviceCall, handle: Any, deps: tuple[DeviceCall, ...],
                 timeout: float) -> None:
        self.call, self.handle, self.timeout = call, handle, timeout  # handle: ErtWaitHandle
        self.deps = deps  # chained on the card: ERT waits for their runs, whatever their retcode


class PynqDevice(Device):
    """One CCLO of an Alveo card, driven through PYNQ."""

    timer_hz = 250_000_000  # the CCLO's clock, in which SET_TIMEOUT counts
    runs_accl_firmware = True  # the driver steers clear of the firmware's known faults
    enforces_call_timeout = True  # see set_call_timeout

    def __init__(self, xclbin: str | os.PathLike[str], *, device_index: int = 0,
                 cclo_index: int = 0, memory_bank: Any = None) -> None:
        """Load `xclbin` on card `device_index` (once per process: later devices on the
        same card and file share the overlay) and take CCLO `cclo_index`. Buffers go to
        `memory_bank`: an overlay memory (`ol.bank0`), its name ("bank0", "HBM0"), or
        None for the bank the CCLO's m_axi_0 port is wired to, as pyaccl chose."""
        pynq = _import_pynq()
        self.device_index, self.cclo_index = device_index, cclo_index
        board = _board(pynq, device_index)
        overlay = _overlay(pynq, os.fspath(xclbin), board)
        with _SETUP:  # PYNQ opens a kernel's context when its driver is first made
            self._cclo = _ip(overlay, f"ccl_offload_{cclo_index}")
            self._hostctrl = _ip(overlay, f"hostctrl_{cclo_index}")
            self._bank = _memory(overlay, f"ccl_offload_{cclo_index}", memory_bank)
        self._overlay = overlay  # keeps the shared overlay alive while this device is
        self._allocate = pynq.allocate
        self._board_lock = _board_lock(board)
        # PYNQ completes ERT runs in _handle_events (ErtWaitHandle.done only reads a
        # future): call it without blocking, under the board lock
        self._progress = getattr(board, "_handle_events", None)
        self._chains = _takes_waitlists()
        self._lock = threading.Lock()  # runs, handles, buffers, closed
        self._buffers: dict[int, Any] = {}  # device address -> PYNQ buffer
        self._starts: list[int] = []  # the same addresses, sorted
        self._runs: list[_Run] = []  # in submission order
        self._handles: dict[DeviceCall, Any] = {}  # calls whose runs are live, for chaining
        self._head: _Run | None = None
        self._head_since = 0.0
        self._call_timeout = 10.0
        self._closed = False
        self._wake = threading.Event()
        self._thread = _threads.start(self._watch, f"aaccl-pynq-{device_index}.{cclo_index}")
        self._jobs = HostJobs(f"aaccl-pynq-{device_index}.{cclo_index}-jobs")

    # -- exchange memory ----------------------------------------------------------------

    def mmio_read(self, offset: int) -> int:
        return int(self._cclo.read(offset))

    def mmio_write(self, offset: int, value: int) -> None:
        self._cclo.write(offset, int(value) & 0xFFFFFFFF)

    # -- device memory: one PYNQ buffer per allocation ------------------------------------

    def alloc(self, nbytes: int) -> int:
        buf = self._allocate((max(nbytes, 1),), dtype=np.uint8, target=self._bank)
        address = int(buf.device_address)
        with self._lock:
            self._buffers[address] = buf
            bisect.insort(self._starts, address)
        return address

    def free(self, address: int) -> None:
        with self._lock:
            buf = self._buffers.pop(address)  # KeyError for an unknown address
            del self._starts[bisect.bisect_left(self._starts, address)]
        buf.freebuffer()

    def write(self, address: int, data: np.ndarray) -> None:
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        if raw.size:
            region = self._region(address, raw.size)
            region[:] = raw
            region.sync_to_device()  # a slice of a PYNQ buffer syncs just its own bytes

    def read(self, address: int, out: np.ndarray) -> None:
        raw = out.view(np.uint8).reshape(-1)
        if raw.size:
            region = self._region(address, raw.size)
            region.sync_from_device()
            raw[:] = region

    def _region(self, address: int, nbytes: int) -> Any:
        """The slice of the PYNQ buffer that holds [address, address + nbytes)."""
        with self._lock:
            i = bisect.bisect_right(self._starts, address) - 1
            buf = self._buffers[self._starts[i]] if i >= 0 else None
        offset = address - int(buf.device_address) if buf is not None else -1
        if buf is None or offset + nbytes > buf.nbytes:
            raise ValueError(f"{nbytes} bytes at {address:#x} are not in one buffer of this device")
        return buf[offset:offset + nbytes]

    # -- calls ----------------------------------------------------------------------------

    def set_call_timeout(self, seconds: float) -> None:
        """Fail a CCLO call that leads the card's queue for longer than `seconds`: the
        timeout the driver asks for, which SET_TIMEOUT's register caps near 17 s."""
        self._call_timeout = seconds

    def start(self, args: CallArgs, waitfor: Sequence[DeviceCall] = ()) -> DeviceCall:
        if args.scenario == Scenario.CONFIG and args.function == ConfigFunction.SET_TIMEOUT:
            self._call_timeout = args.count / self.timer_hz
        timeout = CONFIG_TIMEOUT if args.scenario == Scenario.CONFIG else self._call_timeout
        return self._start(DeviceCall(args), self._hostctrl, [int(a) for a in args], timeout,
                           waitfor)

    def start_steps(self, whole: CallArgs, steps: Sequence[CallArgs],
                    waitfor: Sequence[DeviceCall] = ()) -> DeviceCall:
        """One call made of several: `steps` started back to back after the same
        dependencies, so that hostctrl, which runs one run at a time in the order they
        were started, runs them together and in order. It fails as its first failed
        step (the card runs the later ones all the same)."""
        return joined(whole, [self.start(step, waitfor) for step in steps])

    def overlay_kernel(self, name: str) -> Any:
        """The overlay's kernel `name` (as PYNQ names it: "vadd_1"), for `start_kernel`."""
        with _SETUP:
            return _ip(self._overlay, name)

    def is_card_kernel(self, target: object) -> bool:
        """PYNQ's kernel objects (`overlay.vadd_1`) start runs; Python callables do not."""
        return hasattr(target, "start") and not hasattr(target, "__code__")

    def start_kernel(self, kernel: Any, args: Sequence[Any],
                     waitfor: Sequence[DeviceCall] = ()) -> DeviceCall:
        """Start a run of another kernel of the overlay (`overlay.vadd_1`, arguments as
        its `start` takes them: aaccl Buffers pass as their device address), chained on
        the card like the CCLO's calls. A kernel run has no return code and no timeout:
        ERT says when it ends."""
        return self._start(DeviceCall(None), kernel, list(args), math.inf, waitfor)

    def run(self, job: Job, waitfor: Sequence[DeviceCall] = ()) -> DeviceCall:
        return self._jobs.run(job, waitfor)

    def _start(self, call: DeviceCall, kernel: Any, args: list[Any], timeout: float,
               waitfor: Sequence[DeviceCall]) -> DeviceCall:
        on_card = self._on_card(waitfor)
        if on_card is None:
            return start_after(call, waitfor, lambda c: self._launch(c, kernel, args, timeout))
        self._launch(call, kernel, args, timeout, on_card)
        return call

    def _on_card(self, waitfor: Sequence[DeviceCall]) -> list[DeviceCall] | None:
        """The dependencies to chain on the card, or None when the host must resolve them:
        every pending one must be a live run of this device, and none may have failed."""
        pending = [dep for dep in waitfor if not dep.done() or dep.failed]
        if pending and not self._chains:
            return None
        with self._lock:
            if any(dep.done() or dep not in self._handles for dep in pending):
                return None
        return pending

    def _launch(self, call: DeviceCall, kernel: Any, args: list[Any], timeout: float,
                deps: Sequence[DeviceCall] = ()) -> None:
        """Start `call` as a run of `kernel`, after `deps` on the card. Runs on the
        caller's thread or a completion thread (through start_after): it must not block."""
        call.mark_started()  # on the card's queue: with ERT chaining, it may wait there
        with self._lock:
            closed = self._closed
            # a dependency that ended meanwhile has no handle left: nothing to wait for
            handles = [self._handles[dep] for dep in deps if dep in self._handles]
        if closed:
            call.complete(error=DeviceError("the PYNQ device is closed"))
            return
        try:
            with self._board_lock:
                if handles:
                    handle = kernel.start(*args, waitfor=handles)
                else:  # no waitfor at all: PYNQ's non-ERT start refuses even an empty one
                    handle = kernel.start(*args)
        except Exception as error:
            call.complete(error=DeviceError(f"PYNQ could not start the {_name(call)}: {error}"))
            return
        with self._lock:
            closed = self._closed  # closed meanwhile: nobody watches the card any more
            if not closed:
                self._runs.append(_Run(call, handle, tuple(deps), timeout))
                self._handles[call] = handle
        if closed:
            call.complete(error=DeviceError("the PYNQ device was closed as the call started"))
        self._wake.set()

    # -- the completion thread ------------------------------------------------------------

    def _watch(self) -> None:
        delay = 0.0
        while True:
            self._wake.clear()
            with self._lock:
                if self._closed:
                    return
                idle = not self._runs
            if idle:
                self._wake.wait()
                delay = 0.0
                continue
            try:
                changed = self._poll()
            except Exception as error:  # a bug here must not strand the callers
                log.exception("PYNQ device %d.%d: watching the card failed",
                              self.device_index, self.cclo_index)
                self._fail_all(DeviceError(f"internal error: {error!r}"))
                continue
            delay = 0.0 if changed else min(2 * delay or FIRST_SLEEP, LONGEST_SLEEP)
            self._wake.wait(delay)

    def _poll(self) -> bool:
        """One look at the card: complete the calls whose runs ended, abort those chained
        on a failed call, time out the head. True if anything happened."""
        with self._board_lock:
            if self._progress is not None:
                self._progress(0)  # XRT's wait with a zero timeout: collects ended runs
            with self._lock:
                ended = [run for run in self._runs if run.handle.done]
                for run in ended:
                    self._runs.remove(run)
                    self._handles.pop(run.call, None)
        for run in ended:  # in submission order: a dependency completes before its dependents
            self._finish(run)
        aborted = self._abort_orphans()
        return bool(ended) or aborted or self._time_out_head()

    def _finish(self, run: _Run) -> None:
        if run.call.done():
            log.info("PYNQ device %d.%d: a %s that had failed already has ended on the card",
                     self.device_index, self.cclo_index, _name(run.call))
            return
        error = _run_error(run.handle)
        if error is not None:
            run.call.complete(error=DeviceError(f"the {_name(run.call)} ended badly: {error}"))
        elif any(dep.failed for dep in run.deps):
            run.call.complete(aborted=True)
        elif run.call.args is None:  # a kernel run: no return code
            run.call.complete()
        else:
            run.call.complete(retcode=self.mmio_read(xm.RETCODE))

    def _abort_orphans(self) -> bool:
        """Complete as aborted the waiting calls whose dependency on the card failed
        (ERT will still start them); their runs stay watched until they end."""
        with self._lock:
            orphans = [run for run in self._runs
                       if not run.call.done() and any(dep.failed for dep in run.deps)]
            for run in orphans:
                self._handles.pop(run.call, None)
        for run in orphans:
            run.call.complete(aborted=True)
        return bool(orphans)

    def _time_out_head(self) -> bool:
        """Fail the oldest unfinished CCLO call once it has led the queue for too long
        (other kernels run beside the CCLO, not in its queue)."""
        now = time.monotonic()
        with self._lock:
            head = next((run for run in self._runs
                         if not run.call.done() and run.call.args is not None), None)
            if head is not self._head:
                self._head, self._head_since = head, now
                return False
            if head is None or now - self._head_since <= head.timeout:
                return False
            self._handles.pop(head.call, None)
        log.warning("PYNQ device %d.%d: %s did not finish within %g s; the card keeps running "
                    "it", self.device_index, self.cclo_index, _name(head.call), head.timeout)
        head.call.complete(retcode=int(ErrorCode.RECEIVE_TIMEOUT_ERROR))
        return True

    def _fail_all(self, error: Exception) -> None:
        with self._lock:
            runs, self._runs = self._runs, []
            self._handles.clear()
        for run in runs:
            if not run.call.done():
                run.call.complete(error=error)

    # -- lifetime ---------------------------------------------------------------------------

    def close(self) -> None:
        """Stop watching the card and free the buffers left. Calls still running fail
        (the card finishes them on its own)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake.set()
        if threading.current_thread() is not self._thread:
            self._thread.join()
        self._fail_all(DeviceError("the PYNQ device was closed while the call ran"))
        self._jobs.close()
        with self._lock:
            buffers = list(self._buffers.values())
            self._buffers.clear()
            self._starts.clear()
        for buf in buffers:
            buf.freebuffer()


# -- PYNQ itself -------------------------------------------------------------------------------

_SETUP = threading.RLock()
"""Serializes what PYNQ does not guard: listing cards, loading overlays, making drivers."""
_BOARD_LOCKS: weakref.WeakKeyDictionary[Any, threading.Lock] = weakref.WeakKeyDictionary()
_OVERLAYS: weakref.WeakValueDictionary[tuple[int, str], Any] = weakref.WeakValueDictionary()
_PYNQ_LOOP: asyncio.AbstractEventLoop | None = None


def _import_pynq() -> Any:
    try:
        import pynq
    except ModuleNotFoundError as error:
        if error.name != "pynq":
            raise ImportError(f"pynq is installed but does not import: {error}") from error
        raise ImportError(NEEDS_PYNQ) from None
    version = str(getattr(pynq, "__version__", "unknown"))
    problem = _version_problem(version)
    if problem is not None:
        raise ImportError(problem)
    if _parse_version(version) < LAST_ALVEO_PYNQ:
        warnings.warn(f"aaccl's PYNQ device is written against pynq 3.0.1's API; "
                      f"pynq {version} may differ", UserWarning, stacklevel=3)
    return pynq


def _version_problem(version: str) -> str | None:
    """Why this pynq release cannot drive Alveo cards, or None if it can."""
    parsed = _parse_version(version)
    if parsed > LAST_ALVEO_PYNQ:
        return (f"pynq {version} has no Alveo support: PYNQ dropped it after 3.0.1 (its "
                f"XrtDevice lists no Alveo card). {NEEDS_PYNQ}")
    if parsed < FIRST_ALVEO_PYNQ:
        return f"pynq {version} predates PYNQ's Alveo support (2.5.1). {NEEDS_PYNQ}"
    return None


def _parse_version(version: str) -> tuple[int, ...]:
    match = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(part) for part in match.group().split(".")) if match else (0,)


def _boards(pynq: Any) -> list[Any]:
    """`pynq.Device.devices`, listed from any thread.

    PYNQ 3.0.1's XrtDevice takes `asyncio.get_event_loop()` when it is created
    (pl_server/xrt_device.py), which raises on a thread without an event loop, such
    as the worker threads devices are opened on; and a listing that failed stays
    empty for the life of the process. Off the main thread PYNQ gets a loop of its
    own, which never needs to run: nobody awaits PYNQ's futures.
    """
    global _PYNQ_LOOP
    with _SETUP:
        if threading.current_thread() is threading.main_thread():
            return list(pynq.Device.devices)
        if _PYNQ_LOOP is None:
            _PYNQ_LOOP = asyncio.new_event_loop()
        asyncio.set_event_loop(_PYNQ_LOOP)
        try:
            return list(pynq.Device.devices)
        finally:
            asyncio.set_event_loop(None)


def _board(pynq: Any, index: int) -> Any:
    boards = _boards(pynq)
    if not boards:
        raise DeviceError("PYNQ sees no Alveo card: is XRT installed, and its setup.sh "
                        "sourced (XILINX_XRT)?")
    if not 0 <= index < len(boards):
        raise DeviceError(f"device_index={index}, but PYNQ sees {len(boards)} Alveo card(s)")
    board = boards[index]
    if hasattr(board, "has_capability") and not board.has_capability("ERT"):
        raise DeviceError("PYNQ cannot schedule kernel runs through ERT on this card (XRT "
                        "older than 2.3?): the PYNQ device needs ERT's wait handles")
    return board


def _overlay(pynq: Any, xclbin: str, board: Any) -> Any:
    """The card's overlay of `xclbin`, loaded once per process: loading it again would
    reprogram the card under CCLOs already running on it."""
    key = (id(board), os.path.abspath(xclbin))
    with _SETUP:
        overlay = _OVERLAYS.get(key)
        if overlay is None or getattr(overlay, "device", board) is not board:
            overlay = pynq.Overlay(xclbin, device=board)
            _OVERLAYS[key] = overlay
        return overlay


def _ip(overlay: Any, name: str) -> Any:
    if name not in overlay.ip_dict:
        kernels = ", ".join(sorted(overlay.ip_dict)) or "none"
        raise DeviceError(f"the xclbin has no kernel {name} (its kernels: {kernels})")
    return getattr(overlay, name)


def _memory(overlay: Any, cclo: str, bank: Any) -> Any:
    """The overlay memory buffers live in: `bank` itself, by name, or the CCLO's own."""
    if bank is None:
        port = overlay.ip_dict[cclo].get("registers", {}).get("m_axi_0", {})
        tags = port.get("MBG") or [port.get("memory")]  # PYNQ names every bank of a group
        if tags[0] is None:
            raise DeviceError(f"PYNQ does not say which memory {cclo} uses: pass memory_bank=")
        bank = tags[0]
    if not isinstance(bank, str):
        return bank
    name = re.sub("[^A-Za-z0-9_]", "", bank)  # how PYNQ names an overlay's memories: HBM[0] -> HBM0
    try:
        return getattr(overlay, name)
    except AttributeError:
        raise DeviceError(f"the overlay has no memory {bank!r}") from None


def _board_lock(board: Any) -> threading.Lock:
    """One lock per card for starting runs and collecting ended ones: PYNQ keeps a card's
    runs in one unguarded list (XrtDevice.active_bos) that both rebuild."""
    with _SETUP:
        lock = _BOARD_LOCKS.get(board)
        if lock is None:
            lock = _BOARD_LOCKS[board] = threading.Lock()
        return lock


def _takes_waitlists() -> bool:
    """Whether XRT schedules runs after a wait list (pynq reads XRT's version at import)."""
    xrt_device = sys.modules.get("pynq.pl_server.xrt_device")
    version = getattr(xrt_device, "_xrt_version", None)
    return version is not None and WAITLIST_XRT[0] <= tuple(version) < WAITLIST_XRT[1]


def _run_error(handle: Any) -> str | None:
    """Why ERT failed a run (PYNQ puts it in the handle's future), or None."""
    future = getattr(handle, "_future", None)
    if future is None or not future.done() or future.cancelled():
        return None
    error = future.exception()
    return None if error is None else str(error)


def _name(call: DeviceCall) -> str:
    if call.args is None:
        return "kernel run"
    try:
        return Scenario(call.args.scenario).name.lower()
    except ValueError:
        return f"scenario {call.args.scenario}"


def available() -> tuple[bool, str]:
    """Whether this machine can use the PYNQ device, and why (for `aaccl info`)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            pynq = _import_pynq()
        except ImportError as error:
            return False, str(error)
    version = getattr(pynq, "__version__", "unknown")
    try:
        boards = _boards(pynq)
    except Exception as error:
        return False, f"pynq {version} could not list Alveo cards: {error}"
    if not boards:
        return False, (f"pynq {version} sees no Alveo card (is XRT installed, and its "
                       "setup.sh sourced so XILINX_XRT is set?)")
    names = ", ".join(str(getattr(board, "name", "?")) for board in boards)
    note = "".join(f" ({w.message})" for w in caught)
    return True, f"pynq {version} sees {len(boards)} Alveo card(s): {names}{note}"
