"""The Python calls of one small allreduce over MPI, counted (tests/test_call_budget.py):

    mpiexec -n 2 python tests/mpi/budget.py allreduce
    mpiexec -n 2 python tests/mpi/budget.py lines
    mpiexec -n 2 python tests/mpi/budget.py pieces

Each rank counts, with sys.setprofile, the Python function calls of its part of one
1-element float32 allreduce on device-resident buffers (asyncio), averaged over
TIMES calls after a warm-up, and prints `budget rank=R calls=C waited=W`. An await
goes one of two ways, and each is counted in an order of the ranks that makes it
certain, so that the counts do not depend on which rank the machine happens to run
first: `calls`, when the peer's part is in by the await's first poll (the ranks meet
between submitting and awaiting, uncounted), the common small collective's whole wait;
`waited`, when it is not (the peer submits only once this rank's first poll found
nothing, told by a message outside aaccl, uncounted), which adds the wait that polls
on. (Counted as they came, the average of the two ways moved from run to run with the
share of calls whose peer was late, between 27.1 and 28.1.) `lines` counts the
Python lines it runs instead (sys.settrace), by the same rules, and prints
`budget rank=R lines=L` (aaccl's own, and all), then the functions that run most.
`pieces` counts, by the same rules as `calls`, what a small collective is made
of: the lane's objects (`Op`), the engine's events (`Engine.post`) and the bodies
that run (`Op.run`), and prints `budget rank=R ops=O posts=P bodies=B`.

What is counted is the call's own path, deterministic: the polls that find nothing
(as many as the peer takes to answer) are left out (`MPIFabric.poll` and `Lane.poll`
are not counted, a successful poll's work is), and while counting the
awaiting task spins without a turn of the event loop (SPIN_FOR, TURN_EVERY) and the
progress thread keeps out of its way (SPIN), so that every call completes on the
awaiting task's thread.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from types import FrameType
from typing import Any

import numpy as np
from _harness import Checks, run_suite, say

import aaccl
from aaccl import ReduceFunction
from aaccl.api import _bridge
from aaccl.api._accl import ACCL
from aaccl.soft.fabric import _mpi
from aaccl.soft._engine import Engine
from aaccl.soft.fabric._lane import Lane, Op

TIMES = 200
WARMUP = 100


async def allreduce(check: Checks, accl: aaccl.ACCL) -> float:
    return await _count(check, accl, lines=False)


async def lines(check: Checks, accl: aaccl.ACCL) -> float:
    return await _count(check, accl, lines=True)


async def pieces(check: Checks, accl: aaccl.ACCL) -> float:
    return await _count(check, accl, lines=False, pieces=True)


async def _count(check: Checks, accl: aaccl.ACCL, lines: bool, pieces: bool = False) -> float:
    src = accl.allocate(1, np.float32)
    dst = accl.allocate(1, np.float32)
    src[:] = accl.rank + 1
    src.sync_to_device()

    from mpi4py import MPI

    side = MPI.COMM_WORLD.Dup()  # (the ranks' meetings outside aaccl, uncounted)
    assert accl.size == 2, f"the budget is counted on 2 ranks, not {accl.size}"
    peer = 1 - accl.rank
    counting: Callable[..., Any] | None = None  # the profiler or tracer, while counting

    def pause() -> None:
        sys.setprofile(None)
        sys.settrace(None)

    def resume() -> None:
        if counting is profile:
            sys.setprofile(profile)
        elif counting is not None:
            sys.settrace(counting)

    async def step() -> None:
        await accl.allreduce(src, dst, 1, ReduceFunction.SUM, from_fpga=True, to_fpga=True)

    async def answered_step() -> None:
        """Both ranks' parts are in before either awaits: the first poll answers."""
        call = accl.allreduce(src, dst, 1, ReduceFunction.SUM, from_fpga=True, to_fpga=True)
        pause()
        side.Barrier()
        resume()
        await call

    first_poll = ACCL._answered

    def told(poller: Any, call: Any) -> bool:  # (not counted: see `vain`)
        found = first_poll(poller, call)
        pause()
        side.Send([b"", MPI.BYTE], peer)  # our first poll is over: the peer may come
        resume()
        return found

    async def waited_step(early: bool) -> None:
        """The peer submits only once our first poll found nothing (`early`), or we
        submit once the peer's did: the early rank's await polls on."""
        if not early:
            pause()
            side.Recv([bytearray(0), MPI.BYTE], peer)
            resume()
        ACCL._answered = staticmethod(told if early else first_poll)  # type: ignore[assignment]
        try:
            await accl.allreduce(src, dst, 1, ReduceFunction.SUM, from_fpga=True, to_fpga=True)
        finally:
            ACCL._answered = staticmethod(first_poll)  # type: ignore[assignment]

    for _ in range(WARMUP):
        await step()
    poll = _mpi.MPIFabric.poll
    vain = {poll.__code__, Lane.poll.__code__, told.__code__, pause.__code__}
    calls = 0
    ran: Counter[tuple[str, str]] = Counter()  # lines run, by (file, function)
    made: Counter[Any] = Counter()  # `pieces`: calls of these functions
    counted = {Op.__init__.__code__, Engine.post.__code__, Op.run.__code__}

    def profile(frame: FrameType, event: str, arg: object) -> None:
        nonlocal calls
        if event == "call" and frame.f_code not in vain:
            calls += 1
            if frame.f_code in counted:
                made[frame.f_code] += 1

    polled = poll.__code__
    idle = False  # the last poll found nothing: its waiter's lines until the next poll are vain

    def after_poll(frame: FrameType, event: str, arg: object) -> Any:
        nonlocal idle
        if event == "return":
            idle = arg is False
        return after_poll

    def trace(frame: FrameType, event: str, arg: object) -> Any:
        nonlocal idle
        code = frame.f_code
        if code in vain:  # (what it calls is traced: a successful poll's work counts)
            if code is polled:
                idle = False
                return after_poll
            return None
        key = (code.co_filename, code.co_qualname)

        def local(frame: FrameType, event: str, arg: object) -> Any:
            if event == "line" and not idle:
                ran[key] += 1
            return local

        return local

    knobs = [(_bridge, "SPIN_FOR"), (_bridge, "TURN_EVERY"), (_mpi, "SPIN")]
    saved = [getattr(module, name) for module, name in knobs]
    for module, name in knobs:
        setattr(module, name, 3600.0)
    waited = 0.0
    try:
        for i in range(WARMUP // 10):  # (the knobs' first turn of the loop, uncounted)
            await answered_step()
            await waited_step(early=i % 2 == accl.rank)
        counting = trace if lines else profile
        resume()
        for _ in range(TIMES):
            await answered_step()
        pause()
        if not lines and not pieces:  # the other way, on the steps where we are early
            answered, calls = calls, 0
            for i in range(2 * TIMES):
                early = i % 2 == accl.rank
                counting = profile if early else None
                resume()
                await waited_step(early)
                pause()
            waited, calls = calls / TIMES, answered
    finally:
        pause()
        for (module, name), value in zip(knobs, saved):
            setattr(module, name, value)  # (the progress thread must close the world)
        side.Free()
    dst.sync_from_device()
    assert dst[0] == accl.size * (accl.size + 1) // 2, dst[0]
    check()
    if pieces:
        ops, posts, bodies = (made[fn.__code__] / TIMES
                              for fn in (Op.__init__, Engine.post, Op.run))
        say(f"budget rank={accl.rank} ops={ops:.2f} posts={posts:.2f} bodies={bodies:.2f}")
        return ops
    if not lines:
        say(f"budget rank={accl.rank} calls={calls / TIMES:.2f} waited={waited:.2f}")
        return calls / TIMES
    own = sum(n for (path, _), n in ran.items() if "/aaccl/" in path)
    report = [f"budget rank={accl.rank} lines={own / TIMES:.2f} "
              f"all={sum(ran.values()) / TIMES:.2f}"]
    report += [f"  {n / TIMES:6.2f} {path.rpartition('/')[2]}:{name}"
               for (path, name), n in ran.most_common(40)]
    say("\n".join(report))
    return own / TIMES


if __name__ == "__main__":
    run_suite({"allreduce": allreduce, "lines": lines, "pieces": pieces})
