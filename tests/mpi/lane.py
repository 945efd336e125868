"""The world's collectives as MPI runs them (aaccl/soft/fabric/_lane.py), past the
happy path, one rank per process:

    mpiexec -n N python tests/mpi/lane.py SUITE [timeout=...]

Suites:
  verdicts  calls that do not match (count, collective, compression, small and large
            data), a call aborted on one rank (its dependency failed), a call one
            rank rejected: every rank's call fails at once with words that name both
            sides, and the world goes on working.
  late      (timeout=0.5, 2 ranks) rank 1 comes to an allreduce long after rank 0
            gave up on it: rank 0's next collective fails at once (queued behind
            the one MPI still matches), rank 1's two fail with rank 0's reasons,
            and once rank 1 has come, the next works on both.
  many      20 000 small allreduces outstanding at once, a thousand of them chained
            by waitfor, then large ones, every result checked.
  gave_up   (timeout=0.5, 2 ranks) rank 0's allreduce times out and its program
            ends with that error while rank 1 sleeps; rank 1 then comes: both
            processes end soon with their errors (fails, by design).
  waitfor   (2 ranks) test_chaining's program where rank 0's allreduce waits for a
            receive that rank 1 sends only after the next allreduce: that one
            overtakes it, as in process (small and large, waitfor and hazards);
            then chains of allreduces between independent ones, none awaited.
  roots     (3 ranks, timeout=5, nbufs=4) test_communicators' gathers whose ranks
            name different roots on a sub-communicator (messages, no lane): each
            fails at once on every rank still in it, the allreduce after it is
            right, and no rx buffer holds a message of theirs.
  left      (timeout=10, 2 ranks) rank 0's program raises with an allreduce still
            waiting for its dependency; rank 1's next three collectives (small and
            large) each fail at once, saying rank 0 left (fails, by design).
  one       a 1-element float allreduce (SUM) of each float dtype, folded from the
            opening's blocks as numpy's scalars: the same bits on every rank as
            numpy's ufunc adding the ranks' values in rank order.
  renew     the lane makes its persistent opening afresh every 4 openings instead of
            every 2**20 (`_lane.RENEW_EVERY`): small and large collectives, one at a
            time and 200 outstanding, are all right, and it was made afresh.
"""

from __future__ import annotations

import random
import sys
import time

import anyio
import numpy as np
from _harness import Checks, run_suite, say
from test_chaining import recv_dependent_allreduce_then_an_independent_one
from test_communicators import gathers_with_different_roots
from test_soft_meeting import one_float_cases, ufunc_fold

import aaccl
from aaccl import ReduceFunction
from aaccl.soft.fabric import _lane

SUM = ReduceFunction.SUM
FAST = 1.0  # seconds within which a verdict reaches every rank (timeouts are 10x that)


async def failing(what: str, call: aaccl.Call, *words: str) -> BaseException:
    """Await `call`, which must fail quickly with an error containing `words`."""
    started = time.monotonic()
    try:
        await call
    except aaccl.ACCLError as exc:
        took = time.monotonic() - started
        assert took < FAST, f"{what}: the failure took {took:.2f} s: {exc}"
        for word in words:
            assert word in str(exc), f"{what}: {word!r} not in {exc!r}"
        return exc
    raise AssertionError(f"{what}: the call succeeded")


async def still_works(checks: Checks, accl: aaccl.ACCL, round_: int) -> None:
    """A small and a large allreduce and a bcast, checked: the world is usable."""
    size = accl.size
    for count in (3, 5000):
        src = accl.allocate(count, np.float32)
        dst = accl.allocate(count, np.float32)
        src[:] = accl.rank + round_
        await accl.allreduce(src, dst, count, SUM)
        np.testing.assert_array_equal(dst, sum(range(size)) + size * round_)
        await accl.bcast(src, count, size - 1)
        np.testing.assert_array_equal(src, size - 1 + round_)
        checks(2)


async def verdicts(checks: Checks, accl: aaccl.ACCL) -> None:
    rank = accl.rank
    await still_works(checks, accl, 0)
    for count in (4, 40_000):  # the data rides in the opening, or follows it
        mine = count + (rank == 0)
        src, dst = accl.allocate(mine, np.float32), accl.allocate(mine, np.float32)
        await failing(f"count mismatch at {count}", accl.allreduce(src, dst, mine, SUM),
                      f"rank 0 called allreduce(count={count + 1}",
                      f"called allreduce(count={count}")
        checks()
    await still_works(checks, accl, 1)

    buf = accl.allocate(16, np.float32)
    other = accl.allocate(16, np.float32)
    call = accl.bcast(buf, 16, 0) if rank == 0 else accl.allreduce(buf, other, 16, SUM)
    await failing("different collectives", call, "rank 0 called bcast", "called allreduce")
    checks()
    await still_works(checks, accl, 2)

    for count in (16, 40_000):  # rank 1 compresses, the others do not
        data = accl.allocate(count, np.float32)
        narrow = {"compress_dtype": np.float16} if rank == 1 else {}
        await failing(f"compression mismatch at {count}",
                      accl.allreduce(data, data, count, SUM, **narrow),
                      f"called allreduce(count={count}, float32, SUM)",
                      f"rank 1 called allreduce(count={count}, float32 compressed to float16, "
                      "SUM)")
        checks()
    await still_works(checks, accl, 2)

    # rank 0's allreduce never runs: the receive it waits for fails (a size mismatch)
    if rank == 1:
        await accl.send(accl.allocate(8, np.float32), 8, 0, tag=5)
    if rank == 0:
        bad = accl.recv(accl.allocate(9, np.float32), 9, 1, tag=5)
        with_dep = accl.allreduce(buf, other, 16, SUM, waitfor=[bad])
        await failing("the failed receive", bad)
        await failing("aborted on rank 0", with_dep)
    else:
        await failing("aborted on rank 0", accl.allreduce(buf, other, 16, SUM),
                      "rank 0's allreduce", "a call it waits for failed")
    checks()
    await still_works(checks, accl, 3)

    # rank 1 passes a count its buffers cannot hold: rejected before the device
    if rank == 1:
        try:
            accl.allreduce(buf, other, 17, SUM)
        except ValueError:
            checks()
        else:
            raise AssertionError("a count past the buffers was accepted")
    else:
        await failing("rejected on rank 1", accl.allreduce(buf, other, 16, SUM),
                      "rank 1 rejected its allreduce")
        checks()
    await still_works(checks, accl, 4)


async def late(checks: Checks, accl: aaccl.ACCL) -> None:
    assert accl.size == 2
    src, dst = accl.allocate(4, np.float32), accl.allocate(4, np.float32)
    src[:] = accl.rank + 1
    await accl.allreduce(src, dst, 4, SUM)  # both are here
    if accl.rank == 0:
        try:
            await accl.allreduce(src, dst, 4, SUM)
        except aaccl.CCLOError as exc:
            assert "RECEIVE_TIMEOUT" in str(exc), exc
        else:
            raise AssertionError("rank 1 came 1.5 s late, yet no timeout")
        await failing("queued behind the one that gave up", accl.allreduce(src, dst, 4, SUM),
                      "queued behind rank 0's allreduce")
        for attempt in range(20):  # until rank 1 has come (each waits 0.5 s)
            try:
                await accl.recv(accl.allocate(1, np.float32), 1, 1, tag=9)
                break
            except aaccl.CCLOError:
                assert attempt < 19, "rank 1 never came"
    else:
        await anyio.sleep(1.5)  # the fault: rank 0's allreduce times out after 0.5 s
        # rank 0 told us (a notice), or its block in the opening does
        await failing("the one rank 0 gave up", accl.allreduce(src, dst, 4, SUM),
                      "rank 0's allreduce", "RECEIVE_TIMEOUT")
        await failing("rank 0's failed one", accl.allreduce(src, dst, 4, SUM),
                      "rank 0's allreduce", "queued behind")
        await accl.send(accl.allocate(1, np.float32), 1, 0, tag=9)
    checks()
    await accl.allreduce(src, dst, 4, SUM)
    np.testing.assert_array_equal(dst, 3)
    checks()


async def many(checks: Checks, accl: aaccl.ACCL) -> None:
    rank, size = accl.rank, accl.size
    n = 20_000
    src = accl.allocate(n, np.int64)
    dst = accl.allocate(n, np.int64)
    src[:] = np.arange(n) * (rank + 1)
    src.sync_to_device()
    calls = [accl.allreduce(src[i:i + 1], dst[i:i + 1], 1, SUM, from_fpga=True, to_fpga=True)
             for i in range(n)]
    for call in calls:
        await call
    dst.sync_from_device()
    np.testing.assert_array_equal(dst, np.arange(n) * (size * (size + 1) // 2))
    checks()
    # a chain: each allreduce folds the previous result (waitfor, no await between)
    acc = accl.allocate(1, np.int64)
    acc[:] = 1
    acc.sync_to_device()
    last = None
    for _ in range(1000):
        last = accl.allreduce(acc, acc, 1, ReduceFunction.MAX, from_fpga=True, to_fpga=True,
                              waitfor=[] if last is None else [last])
    await last
    acc.sync_from_device()
    assert acc[0] == 1
    checks()
    big = accl.allocate(1 << 20, np.float32)
    out = accl.allocate(1 << 20, np.float32)
    big[:] = rank
    pending = [accl.allreduce(big, out, 1 << 20, SUM) for _ in range(8)]
    for call in pending:
        await call
    np.testing.assert_array_equal(out, sum(range(size)))
    checks()


async def waitfor(checks: Checks, accl: aaccl.ACCL) -> None:
    for count in (4, 5000):  # the data rides in the opening, or follows it
        for hazard in (False, True):
            await recv_dependent_allreduce_then_an_independent_one(accl, count, hazard)
            checks()
    # chains (each allreduce folds the last one's result) between independent ones,
    # none awaited, then awaited in an order of each rank's own: a link whose turn
    # comes while the one before still runs is pending, on one rank or on all
    rank, size = accl.rank, accl.size
    program = random.Random(5)  # the same on every rank
    for trial in range(10):
        n = program.choice([4, 5000])
        acc = accl.allocate(n, np.float64)
        acc[:] = 1
        acc.sync_to_device()
        calls, outs, last, links = [], [], None, 0
        for i in range(program.randint(2, 10)):
            if program.random() < 0.5:
                last = accl.allreduce(acc, acc, n, SUM, from_fpga=True, to_fpga=True,
                                      waitfor=[] if last is None else [last])
                calls.append(last)
                links += 1
            else:
                m = program.choice([4, 5000])
                src, dst = accl.allocate(m, np.float32), accl.allocate(m, np.float32)
                src[:] = rank + i
                outs.append((dst, sum(r + i for r in range(size))))
                calls.append(accl.allreduce(src, dst, m, SUM))
        random.Random(100 * trial + rank).shuffle(calls)
        for call in calls:
            await call
        for dst, expected in outs:
            np.testing.assert_array_equal(dst, expected)
        acc.sync_from_device()
        np.testing.assert_array_equal(acc, size ** links)
        checks()
    await still_works(checks, accl, 0)


async def roots(checks: Checks, accl: aaccl.ACCL) -> None:
    await gathers_with_different_roots(accl, fast=2.0)
    checks()
    await still_works(checks, accl, 0)


async def gave_up(checks: Checks, accl: aaccl.ACCL) -> None:
    src, dst = accl.allocate(4, np.float32), accl.allocate(4, np.float32)
    await accl.allreduce(src, dst, 4, SUM)
    checks()
    if accl.rank == 1:
        await anyio.sleep(1.5)  # the fault: rank 0 gives up after 0.5 s, and ends
    await accl.allreduce(src, dst, 4, SUM)


async def left(checks: Checks, accl: aaccl.ACCL) -> None:
    src, dst = accl.allocate(4000, np.float32), accl.allocate(4000, np.float32)
    await accl.allreduce(src, dst, 4000, SUM)
    checks()
    if accl.rank == 0:  # an allreduce waits for a message nobody sends, and we give up
        accl.allreduce(src, dst, 4000, SUM, waitfor=[accl.recv(dst, 1, 1, tag=3)])
        raise RuntimeError("rank 0 gives up")
    for i, count in enumerate((4000, 4, 4000)):
        exc = await failing(f"collective {i} after rank 0 left",
                            accl.allreduce(src, dst, count, SUM), "rank 0")
        assert isinstance(exc, aaccl.Aborted), exc
        say(f"lane-left rank=1 call={i} {exc}")


async def one(checks: Checks, accl: aaccl.ACCL) -> None:
    size = accl.size
    for dtype in (np.float16, np.float32, np.float64):
        src, dst = accl.allocate(1, dtype), accl.allocate(1, dtype)
        bits = np.dtype(f"u{np.dtype(dtype).itemsize}")
        for case in one_float_cases(np.dtype(dtype), size):
            src[0] = case[accl.rank]
            await accl.allreduce(src, dst, 1, SUM)
            expected = ufunc_fold(case, np.dtype(dtype))
            assert dst.view(bits)[0] == expected.view(bits)[0], (case, dst, expected)
            checks()


async def renew(checks: Checks, accl: aaccl.ACCL) -> None:
    renewed = 0
    make = _lane.Lane._renew

    def counted(lane: _lane.Lane, index: int) -> object:
        nonlocal renewed
        renewed += 1
        return make(lane, index)

    _lane.Lane._renew = counted  # type: ignore[method-assign]
    try:
        for round_ in range(6):
            await still_works(checks, accl, round_)
        n = 200
        src = accl.allocate(n, np.int64)
        dst = accl.allocate(n, np.int64)
        src[:] = np.arange(n) * (accl.rank + 1)
        src.sync_to_device()
        calls = [accl.allreduce(src[i:i + 1], dst[i:i + 1], 1, SUM, from_fpga=True,
                                to_fpga=True) for i in range(n)]
        for call in calls:
            await call
        dst.sync_from_device()
        size = accl.size
        np.testing.assert_array_equal(dst, np.arange(n) * (size * (size + 1) // 2))
        checks()
    finally:
        _lane.Lane._renew = make  # type: ignore[method-assign]
    assert renewed >= 50, renewed  # (224 openings: one in 4 renews)
    checks()


if __name__ == "__main__":
    if "renew" in sys.argv:  # (before the world's lane is made: see `renew`)
        _lane.RENEW_EVERY = 4
    run_suite({"verdicts": verdicts, "late": late, "many": many, "waitfor": waitfor,
               "roots": roots, "gave_up": gave_up, "left": left, "renew": renew, "one": one})
