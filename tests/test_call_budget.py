"""The Python function calls a small call costs, counted (sys.setprofile).

Timings are noise on a shared CI machine; the number of Python calls one small
allreduce, one nop or one send/recv pair makes is not (the same on every run, in
process). These budgets hold the counts of the lean path (issue 28) as ceilings,
with a call or two of slack, so that no change adds a layer to the small-call path unnoticed
(DESIGN.md's call budget: every layer must earn its calls).
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import Any

import numpy as np
import pytest

import aaccl
from aaccl import ReduceFunction
from test_mpi_fabric import MPIEXEC, assert_passed, launch

RANKS = 4
ALLREDUCE_BUDGET = 51
"""Python calls per rank for one 1-element float32 allreduce of 4 in-process ranks
on device-resident buffers, asyncio.gather and the event loop's own included (about
27 of them): 50.50 once every call and every rank's books share one lock (a call is
adopted and booked in one critical section, and forgotten in its completion's: no
`Call._adopt` frame) and the order check keeps its last task and call in two fields;
51.25 once the first rank to sit down parks the meeting's deadline
through `Alarm.park` again (no copy of it); 51.00 once a soft call has no constructor of its own, the roll call counts
a rank and makes the meeting in `_RollCall.join`, and the meeting's deadline is
parked in line; 53.50 once every call goes one way, `_submit`, which adopts and books
the device's call itself (no `_track` frame); 54.50 once the roll call's count is one method of the fabric (shared
with a rank whose call will not run); 53.75 once a completion wakes a task of its own loop in line and a
collective joins the inbox in line when nothing came before it; 54.75 once a call alone on its memory is one slot of the hazard books,
a collective's common case is one test, its roll-call entry is its meeting and the
driver keeps each dtype's encoding; 58.25 once the collectives catch their own checks' errors (no wrapper)
and a rank takes its seat in the meeting in `_Meet.start`; 60.25 once a call is one
object from the device to the user; 61.5
once a call that ended well ends in one frame, the meetings' deadlines share one
timer, a collective joins in line and a loop of one collective remembers its fabric
part; 67.75 once admission is one event, the meeting one per port and both
buffers checked in one call; 72.75 after issue 28's lean path (139.75 to 140.08 at
71edb87)."""
NOP_BUDGET = 8
"""Python calls for one `await accl.nop()` (8 through `_submit` too, once it adopts
the call itself where `_track` did; 8 once a call is one object: the device
makes a nop's, where it handed out one shared device call and the API made the Call,
and the rank adopts it; 7 once a nop with nothing to wait for skips `_submit`; 8
after issue 28's lean path; 24 at 71edb87)."""
MPI_ALLREDUCE_BUDGET = 28
"""Python calls per rank for one 1-element float32 allreduce over MPI (2 processes,
device-resident buffers), the polls that find nothing not counted: tests/mpi/budget.py,
each way an await can go held to it (27.00 where the first poll finds the peer's part
in, 28.00 where the await polls on, each counted in an order of the ranks that makes
it certain; before, the two ways were counted as they came, 27.11 to 28.08 from run
to run with the share of late peers, and 28.04 to 28.10 failed this budget in about
one run of eight on a quiet machine;
27.11 with the in-process cuts of the shared lock; 28.11 once a collective is one object in the MPI lane (`Op`: its place, the wait for
its opening and its part) with the in-process cuts above; 30.11 once a Call's await waits through `_bridge.wait` itself, handed the loop it
found (no `ACCL._wait`, no second `running_loop`), and `_submit` adopts the call
itself; 33.11 once a small collective's opening starts through `Lane._open`, the one copy of
it; 32.12 once the lane's small collective finds its operand, result and fold in one
lookup of its CCLO's views, with the in-process cuts beside it; 35.10 with the in-process path's cuts above and the opening one persistent MPI
request; 39.12 once a call is one object from the device to the user; 40.12 to 40.20
once a call that ended well ends in one frame and a collective joins in line; 43.12
with the in-process path's admission in one event and two buffers checked in
one call; 46.12 once the lane starts a lone opening in Lane.begin, an allreduce settles with
its fold, and the awaiting task spins before it registers a waker; 52.10 on every run
once a small collective runs with no body, parked on its opening,
under one alarm per lane; 74.11 after issue 28's lean path; 131.09 with the lean lane
alone; 163 to 294 before, vain polls counted, which its wait then could not help
making)."""

TRIO_ALLREDUCE_BUDGET = 24
"""aaccl's own Python calls per rank for one 1-element float32 allreduce of 4
in-process ranks on trio, each rank a task of its own calling in a loop. trio's own
are not counted: its scheduler's vary with its mode (about 15 calls, 1.5 more when
hypothesis, imported, has it shuffle each batch). 23.00 to 23.25 (with the order
trio runs the ranks in) once a trio task keeps its run's token in its context and its
await goes to trio's wait with no asyncio lookups in between (no `running_loop`, no
`wait` coroutine around it); 26.50 before."""
AACCL = os.path.dirname(aaccl.__file__)

P2P_BUDGET = 139
"""Python calls for one send/recv pair between 2 in-process ranks: a 1-element
float32 send of a fresh slice (whose device address is not looked up yet) to a
receive into another, device-resident (from_fpga, to_fpga), awaited together with
asyncio.gather, the event loop's own calls included. 138 once a soft call has no
constructor of its own; 140 once `_submit` adopts the
calls itself (no `_track` frame); 142 once a send and a recv
are checked in one condition (a slice's address through ctypes.c_char, not numpy's
ctypes), admitted without the stream and compression checks they do not need,
matched with no tuple per queued item, and a peer looked up in line; 204.12 at
39a02cf."""


async def count_calls(step: Callable[[], Awaitable[Any]], times: int,
                      warmup: int = 100, within: str = "") -> float:
    """Python function calls per `step`, averaged over `times` (after `warmup` steps);
    with `within`, only those of the code in that folder."""
    for _ in range(warmup):
        await step()
    calls = 0

    def profile(frame: FrameType, event: str, arg: object) -> None:
        nonlocal calls
        if event == "call" and frame.f_code.co_filename.startswith(within):
            calls += 1

    sys.setprofile(profile)
    try:
        for _ in range(times):
            await step()
    finally:
        sys.setprofile(None)
    return calls / times


async def measure() -> tuple[float, float]:
    async with aaccl.open_world(RANKS) as accls:
        srcs = [accl.allocate(1, np.float32) for accl in accls]
        dsts = [accl.allocate(1, np.float32) for accl in accls]
        for accl, src in zip(accls, srcs):
            src[:] = accl.rank + 1
            src.sync_to_device()

        async def allreduce() -> None:
            await asyncio.gather(*(accl.allreduce(src, dst, 1, ReduceFunction.SUM,
                                                  from_fpga=True, to_fpga=True)
                                   for accl, src, dst in zip(accls, srcs, dsts)))

        per_allreduce = await count_calls(allreduce, 200) / RANKS
        per_nop = await count_calls(accls[0].nop, 200)
        for dst in dsts:  # the counted calls did their work
            dst.sync_from_device()
            assert dst[0] == RANKS * (RANKS + 1) // 2
    return per_allreduce, per_nop


async def measure_pair() -> float:
    async with aaccl.open_world(2) as (a, b):
        n = 300
        src, dst = a.allocate(n, np.float32), b.allocate(n, np.float32)
        src[:] = np.arange(n)
        src.sync_to_device()
        slices = iter([(src[i:i + 1], dst[i:i + 1]) for i in range(n)])  # fresh ones

        async def pair() -> None:
            s, d = next(slices)
            await asyncio.gather(a.send(s, 1, 1, tag=7, from_fpga=True),
                                 b.recv(d, 1, 0, tag=7, to_fpga=True))

        per_pair = await count_calls(pair, 200)
        dst.sync_from_device()  # the counted pairs did their work
        assert np.array_equal(dst, src)
    return per_pair


def test_small_calls_stay_within_their_python_call_budget() -> None:
    per_allreduce, per_nop = asyncio.run(measure())
    assert per_allreduce <= ALLREDUCE_BUDGET, (
        f"one small allreduce makes {per_allreduce:.2f} Python calls per rank, over its "
        f"budget of {ALLREDUCE_BUDGET}")
    assert per_nop <= NOP_BUDGET, (
        f"one nop makes {per_nop:.2f} Python calls, over its budget of {NOP_BUDGET}")


def test_a_small_allreduce_on_trio_stays_within_its_python_call_budget() -> None:
    trio = pytest.importorskip("trio")
    times = 200

    async def measure_trio() -> float:
        async with aaccl.open_world(RANKS) as accls:
            bufs = [(accl.allocate(1, np.float32), accl.allocate(1, np.float32))
                    for accl in accls]
            for accl, (src, _) in zip(accls, bufs):
                src[:] = accl.rank + 1
                src.sync_to_device()

            async def rank(accl: aaccl.ACCL, src: aaccl.Buffer, dst: aaccl.Buffer,
                           n: int) -> None:
                for _ in range(n):
                    await accl.allreduce(src, dst, 1, ReduceFunction.SUM, from_fpga=True,
                                         to_fpga=True)

            async def every_rank(n: int) -> None:
                async with trio.open_nursery() as nursery:
                    for accl, (src, dst) in zip(accls, bufs):
                        nursery.start_soon(rank, accl, src, dst, n)

            # one step: every rank's `times` calls (a nursery per call would count trio's)
            calls = await count_calls(lambda: every_rank(times), 1, warmup=1, within=AACCL)
            for _, dst in bufs:  # the counted calls did their work
                dst.sync_from_device()
                assert dst[0] == RANKS * (RANKS + 1) // 2
        return calls / (times * RANKS)

    per_allreduce = trio.run(measure_trio)
    assert per_allreduce <= TRIO_ALLREDUCE_BUDGET, (
        f"one small allreduce on trio makes {per_allreduce:.2f} Python calls per rank, "
        f"over its budget of {TRIO_ALLREDUCE_BUDGET}")


def test_a_send_and_its_recv_stay_within_their_python_call_budget() -> None:
    per_pair = asyncio.run(measure_pair())
    assert per_pair <= P2P_BUDGET, (
        f"one send/recv pair makes {per_pair:.2f} Python calls, over its budget of "
        f"{P2P_BUDGET}")


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (pip install 'aaccl[mpi]')")
def test_a_small_allreduce_over_mpi_stays_within_its_python_call_budget() -> None:
    job = launch(2, "budget.py", "allreduce", limit=120)
    assert_passed(job, 2)
    for way, what in (("calls", "whose peer's part is in by its first poll"),
                      ("waited", "that polls on for its peer's part")):
        counts = [float(word.split("=")[1]) for line in job.stdout.splitlines()
                  if line.startswith("budget ") for word in line.split()
                  if word.startswith(f"{way}=")]
        assert len(counts) == 2, job.explain()
        assert max(counts) <= MPI_ALLREDUCE_BUDGET, (
            f"one small allreduce over MPI {what} makes {max(counts):.2f} Python calls per "
            f"rank, over its budget of {MPI_ALLREDUCE_BUDGET}")


def test_a_loop_of_small_calls_asks_asyncio_for_its_loop_once(monkeypatch) -> None:
    """asyncio's `_get_running_loop` makes a system call (getpid) each time: a rank
    finds its loop once, then checks the thread it runs in (`running_loop`)."""
    from aaccl.devices import _call

    asked = 0
    real = _call._running_loop

    def counted() -> object:
        nonlocal asked
        asked += 1
        return real()

    async def main() -> None:
        async with aaccl.open_world(2) as accls:
            bufs = [(a.allocate(1, np.float32), a.allocate(1, np.float32)) for a in accls]
            for _ in range(100):
                await asyncio.gather(*(a.allreduce(s, d, 1, ReduceFunction.SUM, from_fpga=True,
                                                   to_fpga=True)
                                       for a, (s, d) in zip(accls, bufs)))

    monkeypatch.setattr(_call, "_running_loop", counted)
    asyncio.run(main())
    assert asked <= 2, f"200 small calls asked asyncio for the running loop {asked} times"
