"""A small allreduce's ranks meeting in process (aaccl/soft/fabric/_inprocess.py),
where the API's checks cannot reach: calls made through the driver."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import aaccl
from aaccl import ErrorCode, ReduceFunction
from aaccl._constants import Scenario

F32 = np.dtype(np.float32)


def test_an_address_the_cclo_cannot_decode_fails_the_meeting_at_once() -> None:
    """Rank 1's operand is at no address of its device memory: its call fails with
    DMA_DECODE_ERROR, and rank 0's, waiting in the meeting, on its notice, well
    before the timeout (it used to leave rank 1's call pending forever)."""
    async def main() -> list[aaccl.devices.DeviceCall]:
        async with aaccl.open_world(2, timeout=30.0) as (a, b):
            src = [x.allocate(4, np.float32) for x in (a, b)]
            dst = [x.allocate(4, np.float32) for x in (a, b)]
            calls = [x._driver.start(Scenario.ALLREDUCE, 4, 0, 0, int(ReduceFunction.SUM),
                                     dtype=F32, addrs=(addr, 0, d._address))
                     for x, addr, d in ((a, src[0]._address, dst[0]),
                                        (b, 123_456_789, dst[1]))]
            for call in calls:
                assert await asyncio.to_thread(call.block, 10), "the call never ended"
            return calls

    ours, theirs = asyncio.run(main())
    assert theirs.retcode == ErrorCode.DMA_DECODE_ERROR
    assert ours.retcode == ErrorCode.DMA_DECODE_ERROR
    assert ours.detail is not None and "rank 1's allreduce" in ours.detail


@pytest.mark.parametrize("in_order", [False, True])
def test_a_freed_buffer_is_not_read_through_the_views_kept_for_its_arguments(
        in_order: bool) -> None:
    """A loop of one small allreduce keeps its buffers' views (`SoftDevice.views`)
    and its arguments' decoding; once rank 1 frees its operand, its next call with
    the same arguments fails with DMA_DECODE_ERROR (and rank 0's on its notice)
    instead of reading the freed memory through what was kept."""
    async def main() -> tuple[list[aaccl.devices.DeviceCall], list[aaccl.devices.DeviceCall]]:
        async with aaccl.open_world(2, timeout=30.0, in_order=in_order) as accls:
            devs = [x._driver.device for x in accls]
            src = [dev.alloc(16) for dev in devs]
            dst = [dev.alloc(16) for dev in devs]
            for dev, address in zip(devs, src):
                dev.write(address, np.ones(4, np.float32))

            def round() -> list[aaccl.devices.DeviceCall]:
                return [x._driver.start(Scenario.ALLREDUCE, 4, 0, 0, int(ReduceFunction.SUM),
                                        dtype=F32, addrs=(s, 0, d))
                        for x, s, d in zip(accls, src, dst)]

            for _ in range(3):  # (the second and third find what the first kept)
                for call in round():
                    assert await asyncio.to_thread(call.block, 10)
                for dev, address in zip(devs, dst):
                    out = np.zeros(4, np.float32)
                    dev.read(address, out)
                    assert (out == 2).all()
            first = round()
            for call in first:
                assert await asyncio.to_thread(call.block, 10)
            devs[1].free(src[1])
            calls = round()
            for call in calls:
                assert await asyncio.to_thread(call.block, 10), "the call never ended"
            return first, calls

    first, (ours, theirs) = asyncio.run(main())
    assert [call.retcode for call in first] == [0, 0]
    assert theirs.retcode == ErrorCode.DMA_DECODE_ERROR
    assert ours.retcode == ErrorCode.DMA_DECODE_ERROR


def test_a_loop_over_many_slices_keeps_a_bounded_number_of_entries() -> None:
    """Each slice is a call with its own addresses: the views the CCLO keeps of
    them stay bounded, and the decoding by all but the addresses is one entry."""
    from aaccl.soft._device import VIEWS_KEPT

    async def main() -> tuple[int, int]:
        async with aaccl.open_world(2) as accls:
            bufs = [(x.allocate(1500, np.float32), x.allocate(1500, np.float32))
                    for x in accls]
            for i in range(1500):
                calls = [x.allreduce(s[i:i + 1], d[i:i + 1], 1, ReduceFunction.SUM,
                                     from_fpga=True, to_fpga=True)
                         for x, (s, d) in zip(accls, bufs)]
                for call in calls:
                    await call
            dev = accls[0]._driver.device
            return len(dev.views), len(dev.decoded)

    views, decoded = asyncio.run(main())
    assert 0 < views <= VIEWS_KEPT
    assert decoded == 1


def one_float_cases(dtype: np.dtype, size: int) -> list[list[float]]:
    """Rank-by-rank values of a 1-element sum whose result depends on the order and
    rounding of every step (in `dtype`), signed zeros, and a NaN: the meeting sums one
    float per rank as numpy's scalars (`fold_one`), which must equal its ufuncs."""
    rng = np.random.default_rng(size)
    big = float(np.finfo(dtype).max) / (4 * size)  # (no overflow: no warning)
    cases = [rng.uniform(-1, 1, size) * 10.0 ** rng.integers(-4, 5, size)
             for _ in range(6)]
    cases += [[big, 1.0, -big, 1.0, 0.1][:size] + [0.5] * (size - 5),
              [-0.0] * size, [1.0, float("nan")] + [2.0] * (size - 2)]
    return [list(map(float, case)) for case in cases]


def ufunc_fold(case: list[float], dtype: np.dtype) -> np.ndarray:
    """The reference for `one_float_cases`: numpy's ufunc adding the ranks' 1-element
    arrays in rank order."""
    total = np.array([case[0]], dtype)
    for value in case[1:]:
        total = np.add(total, np.array([value], dtype))
    return total


@pytest.mark.parametrize("size", [2, 3, 5])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_one_float_summed_as_scalars_is_bitwise_numpys_fold(dtype: type, size: int) -> None:
    """A 1-element float allreduce (SUM) folds as numpy's scalars: the same bits as
    numpy's ufunc adding the ranks' arrays in rank order, on every rank. (Not where
    two NaNs meet: which one a sum keeps is open, and the two ways differ; a sum
    with one NaN is the NaN.)"""
    cases = one_float_cases(np.dtype(dtype), size)

    async def main() -> list[np.ndarray]:
        async with aaccl.open_world(size) as accls:
            srcs = [x.allocate(1, dtype) for x in accls]
            dsts = [x.allocate(1, dtype) for x in accls]
            got = []
            for case in cases:
                for src, value in zip(srcs, case):
                    src[0] = value
                await asyncio.gather(*(x.allreduce(s, d, 1, ReduceFunction.SUM)
                                       for x, s, d in zip(accls, srcs, dsts)))
                got.append(np.concatenate([np.asarray(d).copy() for d in dsts]))
            return got

    bits = np.dtype(f"u{np.dtype(dtype).itemsize}")
    for case, got in zip(cases, asyncio.run(main())):
        expected = ufunc_fold(case, np.dtype(dtype))
        assert (got.view(bits) == expected.view(bits)[0]).all(), (case, got, expected)
