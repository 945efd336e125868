"""Host work as calls: kernels modelled in Python and DMA transfers, run on worker
threads but scheduled in the same dependency graph as the CCLO's calls.

A job starts once every call it waits for succeeded (`start_after`), never on an
event loop, and completes a `DeviceCall` like any CCLO call, so "transfer ->
kernel -> allreduce -> transfer" is one chain and costs the caller one `await`.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence

from .._errors import DeviceError
from ._base import DeviceCall
from ._hostdeps import start_after

Job = Callable[[], None]

JOB_WORKERS = 8
"""Idle workers a device keeps for its next jobs (more start when every one is busy):
numpy, lz4 and memory copies release the GIL, so a few threads per core keep every
core busy."""


class HostJobs:
    """Runs jobs after their dependencies on worker threads; a job that raises
    completes its call with that exception as `error`.

    A ready job never waits for a worker: it goes to an idle one, or a new thread
    starts for it. A kernel is the user's code and may block (on an event another
    kernel or the event loop sets, on I/O); with a fixed number of workers, as many
    blocked kernels would hold back every transfer and kernel behind them, and a
    kernel waiting for one queued behind it would never finish. Workers that find
    no job wait for the next one, up to `JOB_WORKERS` of them; the others end. So
    threads are reused, and there are as many as jobs ran at once at the peak, plus
    at most `JOB_WORKERS` idle ones.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Condition(threading.Lock())
        self._ready: deque[tuple[DeviceCall, Job]] = deque()  # not yet taken by a worker
        self._idle = 0  # workers waiting for a job
        self._closed = False

    def run(self, job: Job, waitfor: Sequence[DeviceCall] = ()) -> DeviceCall:
        return start_after(DeviceCall(None), waitfor, lambda call: self._submit(call, job))

    def _submit(self, call: DeviceCall, job: Job) -> None:
        with self._lock:
            if self._closed:
                closed = True
            else:
                closed = False
                self._ready.append((call, job))
                if self._idle >= len(self._ready):  # an idle worker for each ready job
                    self._lock.notify()
                    return
        if closed:
            call.complete(error=DeviceError("the device is closed"))
            return
        # daemon: a kernel still blocked when the interpreter exits must not hold it up
        threading.Thread(target=self._work, name=self._name, daemon=True).start()

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._ready:
                    if self._closed or self._idle >= JOB_WORKERS:
                        return
                    self._idle += 1
                    self._lock.wait()
                    self._idle -= 1
                call, job = self._ready.popleft()
            _execute(call, job)

    def close(self) -> None:
        """Refuse new jobs; jobs already ready still run, then every worker ends."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()


def _execute(call: DeviceCall, job: Job) -> None:
    call.mark_started()
    try:
        job()
    except BaseException as error:  # the job's own failure is the call's result
        call.complete(error=error if isinstance(error, Exception) else DeviceError(repr(error)))
        return
    call.complete()
