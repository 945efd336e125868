"""The Python calls of one small allreduce over MPI, counted (tests/test_call_budget.py):

    mpiexec -n N python tests/mpi/budget.py allreduce

Each rank counts, with sys.setprofile, the Python function calls of its part of one
1-element float32 allreduce on device-resident buffers (asyncio), averaged over
TIMES calls after a warm-up, and prints `budget rank=R calls=C`.

What is counted is the call's own path, deterministic: the polls that find nothing
(as many as the peer takes to answer) are left out (`MPIFabric.poll`, `_poll_once`
and `Lane.poll` are not counted, a successful poll's work is), and while counting the
awaiting task spins without a turn of the event loop (SPIN_FOR, TURN_EVERY) and the
progress thread keeps out of its way (SPIN), so that every call completes on the
awaiting task's thread.
"""

from __future__ import annotations

import sys
from types import FrameType

import numpy as np
from _harness import Checks, run_suite, say

import aaccl
from aaccl import ReduceFunction
from aaccl.api import _bridge
from aaccl.soft.fabric import _mpi
from aaccl.soft.fabric._lane import Lane

TIMES = 200
WARMUP = 100


async def allreduce(check: Checks, accl: aaccl.ACCL) -> float:
    src = accl.allocate(1, np.float32)
    dst = accl.allocate(1, np.float32)
    src[:] = accl.rank + 1
    src.sync_to_device()

    async def step() -> None:
        await accl.allreduce(src, dst, 1, ReduceFunction.SUM, from_fpga=True, to_fpga=True)

    for _ in range(WARMUP):
        await step()
    vain = {_mpi.MPIFabric.poll.__code__, _mpi.MPIFabric._poll_once.__code__,
            Lane.poll.__code__}
    calls = 0

    def profile(frame: FrameType, event: str, arg: object) -> None:
        nonlocal calls
        if event == "call" and frame.f_code not in vain:
            calls += 1

    knobs = [(_bridge, "SPIN_FOR"), (_bridge, "TURN_EVERY"), (_mpi, "SPIN")]
    saved = [getattr(module, name) for module, name in knobs]
    for module, name in knobs:
        setattr(module, name, 3600.0)
    sys.setprofile(profile)
    try:
        for _ in range(TIMES):
            await step()
    finally:
        sys.setprofile(None)
        for (module, name), value in zip(knobs, saved):
            setattr(module, name, value)  # (the progress thread must close the world)
    dst.sync_from_device()
    assert dst[0] == accl.size * (accl.size + 1) // 2, dst[0]
    check()
    say(f"budget rank={accl.rank} calls={calls / TIMES:.2f}")
    return calls / TIMES


if __name__ == "__main__":
    run_suite({"allreduce": allreduce})
