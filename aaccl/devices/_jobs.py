"""Host work as calls: kernels modelled in Python and DMA transfers, run on worker
threads but scheduled in the same dependency graph as the CCLO's calls.

A job starts once every call it waits for succeeded (`start_after`), never on an
event loop, and completes a `DeviceCall` like any CCLO call, so "transfer ->
kernel -> allreduce -> transfer" is one chain and costs the caller one `await`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor

from .._errors import DeviceError
from ._base import DeviceCall
from ._hostdeps import start_after

Job = Callable[[], None]

JOB_WORKERS = 8
"""Jobs a device runs at once, unless it lends its own workers: numpy, lz4 and
memory copies release the GIL, so a few threads per core keep every core busy."""


class HostJobs:
    """Runs jobs after their dependencies on an executor; a job that raises completes
    its call with that exception as `error`."""

    def __init__(self, name: str, executor: Executor | None = None) -> None:
        self._owned = executor is None
        self._executor = executor or ThreadPoolExecutor(JOB_WORKERS, thread_name_prefix=name)

    def run(self, job: Job, waitfor: Sequence[DeviceCall] = ()) -> DeviceCall:
        return start_after(DeviceCall(None), waitfor, lambda call: self._submit(call, job))

    def _submit(self, call: DeviceCall, job: Job) -> None:
        try:
            self._executor.submit(_execute, call, job)
        except RuntimeError:  # the executor was shut down with its device
            call.complete(error=DeviceError("the device is closed"))

    def close(self) -> None:
        if self._owned:
            self._executor.shutdown(wait=False)


def _execute(call: DeviceCall, job: Job) -> None:
    call.mark_started()
    try:
        job()
    except BaseException as error:  # the job's own failure is the call's result
        call.complete(error=error if isinstance(error, Exception) else DeviceError(repr(error)))
        return
    call.complete()
