"""The soft CCLO: a software model of ACCL's CCLO that implements `Device`.

It keeps its own exchange memory and device memory (so a missing host sync shows
stale data, as on hardware) and honours `waitfor` in its own scheduler (a dependent
call starts when its dependencies complete, with no host round trip). Large calls
run on its worker threads; small ones run on the thread that dispatches them and
park, holding no thread, while they wait for a message — the thread that delivers
it resumes them. Nothing a caller's thread runs here ever blocks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import cast

import numpy as np

from .. import _exchmem as xm
from .._constants import ErrorCode, Scenario
from ..devices import CallArgs, DeviceCall
from ..devices._jobs import HostJobs, Job
from ._engine import CallFailed, Engine, Escalate, Park, Task
from ._progress import WATCHDOG, trampoline
from ._memory import DeviceMemory
from .fabric import Inbox, Port

log = logging.getLogger("aaccl")

MAX_WORKERS = 64
"""Calls one soft CCLO runs at once; a call waiting for a peer holds a worker."""

HWID = 0x0000_00F8  # reduction, compression and stream bits as ACCL's driver reads them


class SoftDevice:
    timer_hz = 1_000_000  # SET_TIMEOUT counts microseconds

    def __init__(self, session: int, port: Port, inbox: Inbox) -> None:
        self.session, self.port, self.inbox = session, port, inbox
        self.exchmem = np.zeros(xm.SIZE // 4, np.uint32)
        self.exchmem[xm.HWID // 4] = HWID
        self.memory = DeviceMemory()
        self.timeout = 1.0
        self.max_eager_size = 0
        self.max_rendezvous_size = 0
        self._engine = Engine(self)
        self._admit_lock = threading.Lock()
        self._workers = ThreadPoolExecutor(MAX_WORKERS, thread_name_prefix=f"soft-cclo-{session}")
        self._jobs = HostJobs(f"soft-cclo-{session}", self._workers)

    # -- exchange memory and device memory ----------------------------------------

    def mmio_read(self, offset: int) -> int:
        return int(self.exchmem[self._word(offset)])

    def mmio_write(self, offset: int, value: int) -> None:
        self.exchmem[self._word(offset)] = value
        self._engine.forget_exchmem()

    @staticmethod
    def _word(offset: int) -> int:
        if offset % 4 or not 0 <= offset < xm.SIZE:
            raise IndexError(f"exchange memory offset {offset:#x} is not a word in [0, {xm.SIZE:#x})")
        return offset // 4

    def alloc(self, nbytes: int) -> int:
        return self.memory.alloc(nbytes)

    def free(self, address: int) -> None:
        self.memory.free(address)

    def write(self, address: int, data: np.ndarray) -> None:
        self.memory.view(address, data.nbytes)[:] = data.reshape(-1).view(np.uint8)

    def read(self, address: int, out: np.ndarray) -> None:
        out.reshape(-1).view(np.uint8)[:] = self.memory.view(address, out.nbytes)

    def array(self, address: int, dtype: np.dtype, count: int) -> np.ndarray:
        """`count` elements of device memory at `address`, for the engine."""
        if count == 0:
            return np.empty(0, dtype)
        try:
            return self.memory.view(address, count * dtype.itemsize).view(dtype)
        except KeyError:
            raise CallFailed(ErrorCode.DMA_DECODE_ERROR) from None

    # -- calls ----------------------------------------------------------------------

    def start(self, args: CallArgs, waitfor: Sequence[DeviceCall] = ()) -> DeviceCall:
        call = DeviceCall(args)
        with self._admit_lock:
            ticket = self._engine.admit(args)
        if not waitfor:
            self._dispatch(call, ticket)
            return call
        lock = threading.Lock()
        state = {"left": len(waitfor), "failed": False}

        def on_dependency_done(dep: DeviceCall) -> None:
            with lock:
                state["left"] -= 1
                state["failed"] |= dep.failed
                if state["left"]:
                    return
            if state["failed"]:
                self._engine.abandon(args, ticket)
                call.complete(aborted=True)
            else:
                self._dispatch(call, ticket)

        for dep in waitfor:
            dep.add_done_callback(on_dependency_done)
        return call

    def run(self, job: Job, waitfor: Sequence[DeviceCall] = ()) -> DeviceCall:
        """Host work (kernels modelled in Python, transfers) on the CCLO's own workers."""
        return self._jobs.run(job, waitfor)

    def _dispatch(self, call: DeviceCall, ticket: object) -> None:
        call.mark_started()
        args = call.args
        assert args is not None
        if args.scenario == Scenario.NOP:
            call.complete(0)  # nothing to wait for: complete on the spot
            return
        try:
            task = self._engine.task(args, ticket)
        except CallFailed as failed:
            self._complete(call, int(failed.code))
            return
        if args.scenario != Scenario.CONFIG and args.count * 8 <= self.max_eager_size:
            trampoline(self._advance, call, task, False)  # small: run here, park while waiting
        else:
            self._to_worker(call, task)

    def _to_worker(self, call: DeviceCall, task: Task) -> None:
        try:
            self._workers.submit(self._advance, call, task, True)
        except RuntimeError:  # the device was closed
            task.finish(True)
            call.complete(aborted=True)

    def _advance(self, call: DeviceCall, task: Task, blocking: bool) -> None:
        """Run `task` on this thread until it ends, parks, or must go to a worker."""
        try:
            task.advance(blocking, lambda: trampoline(self._advance, call, task, False))
        except Park:
            WATCHDOG.arm(time.monotonic() + self.timeout, lambda: self._expire(call, task))
            return
        except Escalate:
            self._to_worker(call, task)
            return
        except CallFailed as failed:
            self._fail(call, task, int(failed.code))
            return
        except Exception:  # a bug in the model must fail the call, never leave it hanging
            log.exception("soft CCLO %d: internal error in %s", self.session,
                          Scenario(cast(CallArgs, call.args).scenario).name.lower())
            self._fail(call, task, int(ErrorCode.DMA_INTERNAL_ERROR))
            return
        task.finish(False)
        self._complete(call, 0)

    def _fail(self, call: DeviceCall, task: Task, retcode: int) -> None:
        try:
            task.finish(True)
        finally:
            self._complete(call, retcode)

    def _expire(self, call: DeviceCall, task: Task) -> None:
        """A parked task's peer did not come in time (on the watchdog's thread)."""
        if task.timed_out():
            self._fail(call, task, int(ErrorCode.RECEIVE_TIMEOUT_ERROR))

    def _complete(self, call: DeviceCall, retcode: int) -> None:
        self.exchmem[xm.RETCODE // 4] = retcode
        call.complete(retcode)

    def close(self) -> None:
        self._jobs.close()
        self._workers.shutdown(wait=False)
        self.port.close()
