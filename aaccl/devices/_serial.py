"""Calls run one at a time from a host-side queue: what ACCL's emulator and XRT need.

ACCL's firmware leaves every call's return code in one register (RETCODE, 0x1FFC),
and neither the emulator nor XRT 2.11+ takes a wait list. So these devices queue
calls on the host, start each when its dependencies succeeded (`start_after`) and
the previous call finished, and read the return code before the next call starts —
as ACCL's own SimDevice and XRTDevice do. Calls that communicate keep the order
they were submitted in (see `_submit`).

ACCL's firmware keeps its receive timeout but never acts on it, so the timeout is
enforced here: the call fails with RECEIVE_TIMEOUT_ERROR, and until the device
finishes it (if ever) later calls fail at once with `DeviceStuck`. The timeout is
the one the driver asks for in seconds (`set_call_timeout`), not what SET_TIMEOUT's
32-bit register holds: that saturates near 17 s at 250 MHz.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

from .. import _exchmem as xm
from .. import _threads
from .._constants import ConfigFunction, ErrorCode, Scenario
from .._errors import DeviceError, DeviceStuck
from ._base import CallArgs, Device, DeviceCall
from ._hostdeps import start_after
from ._jobs import HostJobs, Job

log = logging.getLogger("aaccl")

TIMEOUT_GRACE = 1.0
"""Seconds past the configured timeout before the host gives up on a call."""
LOCAL = frozenset({Scenario.CONFIG, Scenario.COPY, Scenario.COMBINE, Scenario.NOP})
"""Calls that move no message: they may start before an earlier call that waits."""


class SerialDevice(Device):
    """The call queue and runner thread of a device that runs one call at a time.

    Subclasses start a call (`_launch`, returning a handle), wait for it (`_wait`,
    its final state or None at the deadline), read how it went (`_outcome`), and say
    how to recover from a stuck call (`stuck_remedy`).
    """

    timer_hz = 250_000_000  # the CCLO's clock, in which the firmware counts its timeout
    runs_accl_firmware = True  # the driver steers clear of the firmware's known faults
    enforces_call_timeout = True  # see set_call_timeout
    config_timeout = 30.0  # seconds a configuration call may take: it waits for no peer
    stuck_remedy = "reset the device"

    def _start_runner(self, name: str) -> None:
        self._call_timeout = 10.0
        self._stuck: Any = None  # the handle of a call that timed out, while it still runs
        self._stuck_since: float | None = None  # when it timed out; None: nothing stuck
        self._closed = False
        self._closing = threading.Lock()  # no call is queued behind close's sentinel
        self._queue: queue.SimpleQueue[DeviceCall | None] = queue.SimpleQueue()
        self._steps: dict[DeviceCall, tuple[CallArgs, ...]] = {}  # see start_steps
        self._steps_lock = threading.Lock()
        # communicating calls submitted and not yet queued, in submission order (see
        # _submit); reentrant: queueing on a closed device completes the call at once
        self._turns: dict[DeviceCall, bool] = {}
        self._turns_lock = threading.RLock()
        self._runner = _threads.start(self._run_calls, name)
        self._jobs = HostJobs(f"{name}-jobs")

    # -- what a subclass provides ---------------------------------------------------------

    def mmio_read(self, offset: int) -> int:
        raise NotImplementedError

    def _launch(self, args: CallArgs) -> Any:
        """Start the call on the device; return what `_wait` needs to follow it."""
        raise NotImplementedError

    def _wait(self, handle: Any, deadline: float) -> Any:
        """The call's final state once it ended, or None at `deadline` (monotonic)."""
        raise NotImplementedError

    def _outcome(self, state: Any) -> int | Exception:
        """How a call that ended went: the return code it left in RETCODE, or why it
        left none."""
        return self.mmio_read(xm.RETCODE)

    def set_call_timeout(self, seconds: float) -> None:
        """Fail a call that runs longer than `seconds` (plus TIMEOUT_GRACE), whatever
        SET_TIMEOUT's register could hold."""
        self._call_timeout = seconds

    # -- the queue ------------------------------------------------------------------------

    def start(self, args: CallArgs, waitfor: Sequence[DeviceCall] = ()) -> DeviceCall:
        if args.scenario == Scenario.CONFIG and args.function == ConfigFunction.SET_TIMEOUT:
            self._call_timeout = args.count / self.timer_hz
        return self._submit(DeviceCall(args), waitfor)

    def _submit(self, call: DeviceCall, waitfor: Sequence[DeviceCall]) -> DeviceCall:
        """Queue `call` once `waitfor` succeeded. A call that communicates (send, recv,
        a collective) also waits for its turn among those submitted before it: the
        firmware matches messages by their order, so every rank must run its
        communicating calls in the order its program submitted them, whichever
        dependencies resolve first. Local calls (copy, combine, nop) may pass."""
        assert call.args is not None
        if call.args.scenario in LOCAL:
            return start_after(call, waitfor, self._enqueue)
        with self._turns_lock:
            self._turns[call] = False  # submitted; True once its dependencies succeeded
        call.add_done_callback(self._left_turns)
        return start_after(call, waitfor, self._ready)

    def _ready(self, call: DeviceCall) -> None:
        with self._turns_lock:
            self._turns[call] = True
            self._release()

    def _left_turns(self, call: DeviceCall) -> None:
        """A communicating call ended (it ran, or failed before its turn): make way."""
        with self._turns_lock:
            if self._turns.pop(call, None) is not None:
                self._release()

    def _release(self) -> None:
        """Queue the communicating calls at the head whose dependencies succeeded, in
        order (with _turns_lock held: nothing queues between them)."""
        while self._turns:
            head, ready = next(iter(self._turns.items()))
            if not ready:
                return
            del self._turns[head]
            self._enqueue(head)

    def start_steps(self, whole: CallArgs, steps: Sequence[CallArgs],
                    waitfor: Sequence[DeviceCall] = ()) -> DeviceCall:
        """One call made of several: `steps` run back to back in the queue place of one
        call, so no other call comes between them (every rank's firmware must see
        its collectives in the same order). It fails as its first failed step; the
        steps after that one never run."""
        call = DeviceCall(whole)
        with self._steps_lock:
            self._steps[call] = tuple(steps)
        call.add_done_callback(self._forget_steps)
        return self._submit(call, waitfor)

    def _forget_steps(self, call: DeviceCall) -> None:
        with self._steps_lock:
            self._steps.pop(call, None)

    def run(self, job: Job, waitfor: Sequence[DeviceCall] = ()) -> DeviceCall:
        """Host work runs beside the queue: only the CCLO takes one call at a time."""
        return self._jobs.run(job, waitfor)

    def _enqueue(self, call: DeviceCall) -> None:
        with self._closing:
            if not self._closed:
                self._queue.put(call)
                return
        call.complete(error=DeviceError(f"{self!r} is closed"))

    def _run_calls(self) -> None:
        while (call := self._queue.get()) is not None:
            try:
                self._execute(call)
            except Exception as error:  # the device's own errors, and bugs: never strand callers
                if not isinstance(error, DeviceError):
                    log.exception("%r: call %s failed", self, call.args)
                    error = DeviceError(f"{self!r} failed the call: {error!r}")
                if not call.done():
                    call.complete(error=error)
            del call  # the user's: not kept while this thread waits for the next

    def _execute(self, call: DeviceCall) -> None:
        if self._stuck_since is not None and not self._unstuck():
            call.complete(error=DeviceStuck(
                f"{self!r} still runs a call that timed out "
                f"{time.monotonic() - self._stuck_since:.1f} s ago; its firmware cannot "
                f"abandon a call, so {self.stuck_remedy}"))
            return
        assert call.args is not None  # the queue holds CCLO calls only
        with self._steps_lock:
            steps = self._steps.get(call, (call.args,))
        call.mark_started()
        for args in steps:
            handle = self._launch(args)
            limit = self.config_timeout if args.scenario == Scenario.CONFIG \
                else self._call_timeout + TIMEOUT_GRACE
            state = self._wait(handle, time.monotonic() + limit)
            if state is None:
                log.warning("%r: call %s did not finish within the timeout; the device keeps "
                            "running it", self, args.scenario)
                self._stuck, self._stuck_since = handle, time.monotonic()
                call.complete(retcode=int(ErrorCode.RECEIVE_TIMEOUT_ERROR))
                return
            outcome = self._outcome(state)
            if isinstance(outcome, Exception):
                call.complete(error=outcome)
                return
            if outcome:
                call.complete(retcode=outcome)
                return
        call.complete()

    def _unstuck(self) -> bool:
        """True once the device has finished the call that timed out."""
        if self._wait(self._stuck, time.monotonic()) is None:
            return False
        log.info("%r: the call that timed out finished after all", self)
        self._stuck = self._stuck_since = None
        return True

    def _stop_runner(self) -> bool:
        """Let queued calls run, then stop the runner; False if it was stopped already."""
        with self._closing:
            if self._closed:
                return False
            self._closed = True
            self._queue.put(None)
        self._runner.join(timeout=self.config_timeout)
        self._jobs.close()
        return True
