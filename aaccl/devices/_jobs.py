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

from .. import _threads
from .._errors import DeviceError
from ._base import DeviceCall
from ._hostdeps import start_after

Job = Callable[[], None]

JOB_WORKERS = 8
"""Idle workers a device keeps for its next jobs (more start when every one is busy):
numpy, lz4 and memory copies release the GIL, so a few threads per core keep every
core busy."""

LINGER = 1.0
"""Seconds an idle worker beyond `JOB_WORKERS` waits for a job before it ends: a
pipeline whose bursts need a few more workers reuses them instead of starting a
thread per burst."""


class HostJobs:
    """Runs jobs after their dependencies on worker threads; a job that raises
    completes its call with that exception as `error`.

    A ready job never waits for a worker: it goes to an idle one, or a new thread
    starts for it. A kernel is the user's code and may block (on an event another
    kernel or the event loop sets, on I/O); with a fixed number of workers, as many
    blocked kernels would hold back every transfer and kernel behind them, and a
    kernel waiting for one queued behind it would never finish. Workers that find
    no job wait for the next one, up to `JOB_WORKERS` of them; the others wait
    `LINGER` seconds, then end. So threads are reused, and there are as many as jobs
    ran at once at the peak, plus at most `JOB_WORKERS` idle ones a second later.

    A worker whose job ends completes its call on its own thread, and the calls that
    completion makes ready start there and then: the first ready job is the
    worker's own next job (it counts as idle while it completes), so a chain of
    jobs (transfer -> kernel -> transfer) runs on one thread, with no hand-off to
    another thread for each link.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Condition(threading.Lock())
        self._ready: deque[tuple[DeviceCall, Job]] = deque()  # not yet taken by a worker
        self._idle = 0  # workers waiting for a job
        self._claimed = 0  # ready jobs that a worker completing its call will take
        self._closed = False
        self._local = threading.local()  # .spare: this worker is completing its job

    def run(self, job: Job, waitfor: Sequence[DeviceCall] = ()) -> DeviceCall:
        return start_after(DeviceCall(None), waitfor, lambda call: self._submit(call, job))

    def _submit(self, call: DeviceCall, job: Job) -> None:
        local = self._local
        with self._lock:
            if self._closed:
                closed = True
            else:
                closed = False
                self._ready.append((call, job))
                if getattr(local, "spare", False):  # our worker takes it once it completed
                    local.spare = False
                    self._claimed += 1
                    return
                if self._idle + self._claimed >= len(self._ready):  # a worker for each
                    self._lock.notify()
                    return
        if closed:
            call.complete(error=DeviceError("the device is closed"))
            return
        # daemon: a kernel still blocked when the interpreter exits must not hold it up
        _threads.start(self._work, self._name)

    def _work(self) -> None:
        local = self._local
        claimed = False
        while True:
            with self._lock:
                if claimed:  # a ready job is ours (or another's, and then one of theirs)
                    self._claimed -= 1
                while not self._ready:
                    if self._closed:
                        return
                    extra = self._idle >= JOB_WORKERS
                    self._idle += 1
                    woken = self._lock.wait(LINGER if extra else None)
                    self._idle -= 1
                    if extra and not woken and not self._ready:
                        return
                call, job = self._ready.popleft()
            error = _execute(call, job)
            local.spare = True  # (not while the job runs: it may wait for jobs it starts)
            try:
                _complete(call, error)
            finally:
                claimed, local.spare = not local.spare, False
                # the call is its user's: not kept while this worker waits for the next
                del call, job, error

    def close(self) -> None:
        """Refuse new jobs; jobs already ready still run, then every worker ends."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()


def _execute(call: DeviceCall, job: Job) -> BaseException | None:
    """Run the job; what it raised, if anything."""
    call.mark_started()
    try:
        job()
    except BaseException as error:  # the job's own failure is the call's result
        return error
    return None


def _complete(call: DeviceCall, error: BaseException | None) -> None:
    if error is None:
        call.complete()
    else:
        call.complete(error=error if isinstance(error, Exception) else DeviceError(repr(error)))
