"""Bad arguments raise ValueError/TypeError before anything reaches the device.

Every case runs on a fresh world of two ranks with a spy on both soft CCLOs that
records each device access (calls, memory transfers, allocations, exchange-memory
writes). The bad call must raise, the spies must have seen nothing, and a valid
collective afterwards must still work.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import aaccl
from aaccl.devices import DeviceCall
from aaccl import ReduceFunction

SUM = ReduceFunction.SUM
SPIED = ("start", "write", "read", "alloc", "free", "mmio_write")


class DeviceSpy:
    """Records every access to one soft CCLO, by wrapping its methods on the instance."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self.seen: list[str] = []
        self.skipped = False  # the rank told its peers it rejected a collective
        for name in SPIED:
            setattr(device, name, self._wrap(name, getattr(device, name)))
        skip = device.skip_collective

        def skipped(*args: Any) -> None:
            self.skipped = True
            skip(*args)
        device.skip_collective = skipped

    def _wrap(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def spied(*args: Any, **kwargs: Any) -> Any:
            self.seen.append(name)
            return method(*args, **kwargs)
        return spied

    def remove(self) -> None:
        for name in (*SPIED, "skip_collective"):
            delattr(self.device, name)


@dataclass
class Env:
    """Rank 0 (`me`) and its buffers; rank 1 (`other`) and one of its buffers and calls."""

    me: aaccl.ACCL
    other: aaccl.ACCL
    f: aaccl.Buffer
    g: aaccl.Buffer
    d64: aaccl.Buffer
    i32: aaccl.Buffer
    matrix: aaccl.Buffer
    theirs: aaccl.Buffer
    small: aaccl.Buffer
    big: aaccl.Buffer
    d64b: aaccl.Buffer
    u8: aaccl.Buffer
    c64: aaccl.Buffer
    their_call: aaccl.Call
    my_call: aaccl.Call


async def make_env(accls: list[aaccl.ACCL]) -> Env:
    me, other = accls
    their_call, my_call = other.nop(), me.nop()
    await their_call
    await my_call
    return Env(me, other, me.allocate(8), me.allocate(8), me.allocate(8, np.float64),
               me.allocate(8, np.int32), me.allocate((4, 4)), other.allocate(8),
               me.allocate(4), me.allocate(16), me.allocate(8, np.float64),
               me.allocate(32, np.uint8), me.allocate(8, np.complex64), their_call, my_call)


async def check_usable(accls: list[aaccl.ACCL]) -> None:
    """Every rank still runs a collective correctly."""
    srcs = [a.allocate(5) for a in accls]
    dsts = [a.allocate(5) for a in accls]
    for a, s in zip(accls, srcs):
        s[:] = np.arange(5) + a.rank
    calls = [a.allreduce(s, d, 5, SUM) for a, s, d in zip(accls, srcs, dsts)]
    for call in calls:
        await call
    for d in dsts:
        np.testing.assert_array_equal(d, sum(np.arange(5) + r for r in range(len(accls))))


Case = tuple[str, Callable[[Env], Any], type]


def _read_only(buf: aaccl.Buffer) -> aaccl.Buffer:
    view = buf[:]  # (a view of it: the buffer itself stays writeable for other cases)
    view.flags.writeable = False
    return view

CASES: list[Case] = [
    # count
    ("count-too-large-copy", lambda e: e.me.copy(e.f, e.g, 9), ValueError),
    ("count-too-large-for-dst", lambda e: e.me.copy(e.f, e.small, 5), ValueError),
    ("count-negative", lambda e: e.me.copy(e.f, e.g, -1), ValueError),
    ("count-float", lambda e: e.me.copy(e.f, e.g, 2.0), TypeError),
    ("count-str", lambda e: e.me.copy(e.f, e.g, "4"), TypeError),
    ("count-bool", lambda e: e.me.copy(e.f, e.g, True), TypeError),
    ("count-none", lambda e: e.me.bcast(e.f, None, 0), TypeError),
    ("count-over-32-bits", lambda e: e.me.copy(e.f, e.g, 2**32), ValueError),
    ("count-too-large-combine", lambda e: e.me.combine(9, SUM, e.f, e.g, e.g), ValueError),
    ("count-too-large-send", lambda e: e.me.send(e.f, 9, 1), ValueError),
    ("count-too-large-recv", lambda e: e.me.recv(e.f, 9, 1), ValueError),
    ("count-too-large-bcast", lambda e: e.me.bcast(e.f, 9, 0), ValueError),
    ("count-too-large-bcast-nonroot", lambda e: e.me.bcast(e.f, 9, 1), ValueError),
    ("count-too-large-allreduce", lambda e: e.me.allreduce(e.f, e.g, 9, SUM), ValueError),
    ("count-too-large-allreduce-rbuf",
     lambda e: e.me.allreduce(e.f, e.small, 5, SUM), ValueError),
    # chunked buffers hold count * size (= 2 here) elements
    ("count-allgather-rbuf", lambda e: e.me.allgather(e.f, e.g, 5), ValueError),
    ("count-reduce-scatter-sbuf", lambda e: e.me.reduce_scatter(e.f, e.g, 5, SUM), ValueError),
    ("count-alltoall", lambda e: e.me.alltoall(e.f, e.g, 5), ValueError),
    ("count-scatter-root-sbuf", lambda e: e.me.scatter(e.f, e.g, 5, 0), ValueError),
    ("count-gather-root-rbuf", lambda e: e.me.gather(e.f, e.g, 5, 0), ValueError),
    ("count-reduce-root-rbuf", lambda e: e.me.reduce(e.f, e.small, 5, 0, SUM),
     ValueError),
    # root / src / dst
    ("root-too-large-bcast", lambda e: e.me.bcast(e.f, 4, 2), ValueError),
    ("root-negative-bcast", lambda e: e.me.bcast(e.f, 4, -1), ValueError),
    ("root-float-bcast", lambda e: e.me.bcast(e.f, 4, 1.0), TypeError),
    ("root-scatter", lambda e: e.me.scatter(e.f, e.g, 2, 2), ValueError),
    ("root-gather", lambda e: e.me.gather(e.f, e.g, 2, 5), ValueError),
    ("root-reduce", lambda e: e.me.reduce(e.f, e.g, 2, -1, SUM), ValueError),
    ("dst-too-large", lambda e: e.me.send(e.f, 4, 2), ValueError),
    ("dst-negative", lambda e: e.me.send(e.f, 4, -1), ValueError),
    ("dst-none", lambda e: e.me.send(e.f, 4, None), TypeError),
    ("src-too-large", lambda e: e.me.recv(e.f, 4, 2), ValueError),
    # comm_id
    ("comm-unknown", lambda e: e.me.allreduce(e.f, e.g, 4, SUM, comm_id=1), ValueError),
    ("comm-negative", lambda e: e.me.bcast(e.f, 4, 0, comm_id=-1), ValueError),
    ("comm-str", lambda e: e.me.send(e.f, 4, 1, comm_id="0"), ValueError),
    ("comm-numpy", lambda e: e.me.allreduce(e.f, e.g, 4, SUM, comm_id=np.int64(0)), ValueError),
    # a result that could not come back to the host
    ("rbuf-read-only", lambda e: e.me.allreduce(e.f, _read_only(e.g), 4, SUM), ValueError),
    ("dst-read-only-copy", lambda e: e.me.copy(e.f, _read_only(e.g), 4), ValueError),
    ("comm-barrier", lambda e: e.me.barrier(comm_id=3), ValueError),
    ("comm-recv", lambda e: e.me.recv(e.f, 4, 1, comm_id=9), ValueError),
    # not a Buffer of this rank
    ("ndarray-src", lambda e: e.me.copy(np.zeros(8, np.float32), e.g, 4), TypeError),
    ("ndarray-dst", lambda e: e.me.copy(e.f, np.zeros(8, np.float32), 4), TypeError),
    ("ndarray-bcast", lambda e: e.me.bcast(np.zeros(8, np.float32), 4, 0), TypeError),
    ("list-send", lambda e: e.me.send([0.0] * 8, 4, 1), TypeError),
    ("asarray-allreduce", lambda e: e.me.allreduce(np.asarray(e.f), e.g, 4, SUM), TypeError),
    ("other-rank-send", lambda e: e.me.send(e.theirs, 4, 1), ValueError),
    ("other-rank-allreduce", lambda e: e.me.allreduce(e.f, e.theirs, 4, SUM), ValueError),
    ("other-rank-copy", lambda e: e.me.copy(e.theirs, e.g, 4), ValueError),
    ("other-rank-view", lambda e: e.me.recv(e.theirs[2:], 4, 1), ValueError),
    # computed arrays and views that are not device memory
    ("computed-sum", lambda e: e.me.copy(e.f + 1, e.g, 4), TypeError),
    ("computed-product", lambda e: e.me.bcast(e.f * 2, 4, 0), TypeError),
    ("computed-copy", lambda e: e.me.send(e.f.copy(), 4, 1), TypeError),
    ("computed-astype", lambda e: e.me.copy(e.g, e.d64.astype(np.float32), 4), TypeError),
    ("strided-view", lambda e: e.me.copy(e.f[::2], e.g, 4), TypeError),
    ("reversed-view", lambda e: e.me.copy(e.f[::-1], e.g, 4), TypeError),
    ("column-view", lambda e: e.me.allreduce(e.matrix[:, 1], e.g, 4, SUM), TypeError),
    ("transposed-view", lambda e: e.me.copy(e.matrix.T, e.big, 16), TypeError),
    # dtypes
    ("dtype-copy", lambda e: e.me.copy(e.f, e.d64, 4), TypeError),
    ("dtype-allreduce", lambda e: e.me.allreduce(e.f, e.i32, 4, SUM), TypeError),
    ("dtype-combine", lambda e: e.me.combine(4, SUM, e.f, e.f, e.d64), TypeError),
    ("dtype-scatter", lambda e: e.me.scatter(e.f, e.i32, 2, 0), TypeError),
    ("dtype-gather", lambda e: e.me.gather(e.d64, e.g, 2, 0), TypeError),
    ("dtype-reduce", lambda e: e.me.reduce(e.i32, e.g, 2, 0, SUM), TypeError),
    ("dtype-alltoall", lambda e: e.me.alltoall(e.f, e.d64, 2), TypeError),
    # compression
    ("compress-f32-i32", lambda e: e.me.allreduce(e.f, e.g, 4, SUM, compress_dtype=np.int32),
     ValueError),
    ("compress-f32-f64", lambda e: e.me.bcast(e.f, 4, 0, compress_dtype=np.float64), ValueError),
    ("compress-f64-f16", lambda e: e.me.send(e.d64, 4, 1, compress_dtype=np.float16), ValueError),
    ("compress-i32-f16", lambda e: e.me.recv(e.i32, 4, 1, compress_dtype=np.float16), ValueError),
    ("compress-f64-f32", lambda e: e.me.gather(e.d64, e.d64b, 2, 0, compress_dtype=np.float32), ValueError),
    ("compress-not-a-dtype", lambda e: e.me.allgather(e.f, e.g, 2, compress_dtype="nonsense"),
     TypeError),
    # reduce functions
    ("func-2", lambda e: e.me.allreduce(e.f, e.g, 4, 2), ValueError),
    ("func-negative", lambda e: e.me.reduce(e.f, e.g, 4, 0, -1), ValueError),
    ("func-str", lambda e: e.me.allreduce(e.f, e.g, 4, "SUM"), ValueError),
    ("func-none", lambda e: e.me.reduce_scatter(e.f, e.g, 2, None), ValueError),
    ("func-combine", lambda e: e.me.combine(4, 7, e.f, e.g, e.g), ValueError),
    ("func-fraction", lambda e: e.me.allreduce(e.f, e.g, 4, 0.5), ValueError),
    ("func-float-equal-to-sum", lambda e: e.me.allreduce(e.f, e.g, 4, 0.0), ValueError),
    ("func-bool", lambda e: e.me.reduce(e.f, e.g, 4, 0, True), ValueError),
    ("func-numpy-bool", lambda e: e.me.combine(4, np.True_, e.f, e.g, e.g), ValueError),
    # tags
    ("tag-negative", lambda e: e.me.send(e.f, 4, 1, tag=-1), ValueError),
    ("tag-over-32-bits", lambda e: e.me.send(e.f, 4, 1, tag=2**32), ValueError),
    ("tag-float", lambda e: e.me.recv(e.f, 4, 1, tag=1.5), TypeError),
    ("tag-str", lambda e: e.me.recv(e.f, 4, 1, tag="x"), TypeError),
    # waitfor
    ("waitfor-object", lambda e: e.me.nop(waitfor=[object()]), TypeError),
    ("waitfor-int", lambda e: e.me.copy(e.f, e.g, 4, waitfor=[e.my_call, 5]), TypeError),
    ("waitfor-device-call", lambda e: e.me.nop(waitfor=[DeviceCall(None)]), TypeError),
    ("waitfor-none", lambda e: e.me.allreduce(e.f, e.g, 4, SUM, waitfor=None), TypeError),
    ("waitfor-one-call", lambda e: e.me.nop(waitfor=e.my_call), TypeError),
    ("waitfor-int-alone", lambda e: e.me.bcast(e.f, 4, 0, waitfor=3), TypeError),
    # flags are True or False
    ("from-fpga-str", lambda e: e.me.copy(e.f, e.g, 4, from_fpga="yes"), TypeError),
    ("to-fpga-none", lambda e: e.me.allreduce(e.f, e.g, 4, SUM, to_fpga=None), TypeError),
    ("to-fpga-int", lambda e: e.me.recv(e.f, 4, 1, to_fpga=1), TypeError),
    ("from-fpga-list", lambda e: e.me.send(e.f, 4, 1, from_fpga=[]), TypeError),
    ("val2-from-fpga-str", lambda e: e.me.combine(4, SUM, e.f, e.g, e.g, val2_from_fpga="no"),
     TypeError),
    ("from-fpga-bcast", lambda e: e.me.bcast(e.f, 4, 0, from_fpga=0), TypeError),
    ("to-fpga-gather", lambda e: e.me.gather(e.f, e.big, 4, 0, to_fpga="False"), TypeError),
    ("waitfor-other-rank", lambda e: e.me.nop(waitfor=[e.their_call]), ValueError),
    ("waitfor-other-rank-collective",
     lambda e: e.me.bcast(e.f, 4, 0, waitfor=[e.my_call, e.their_call]), ValueError),
    # split_communicator
    ("split-repeated", lambda e: e.me.split_communicator([0, 0]), ValueError),
    ("split-repeated-other", lambda e: e.me.split_communicator([0, 1, 1]), ValueError),
    ("split-out-of-range", lambda e: e.me.split_communicator([0, 2]), ValueError),
    ("split-negative", lambda e: e.me.split_communicator([-1, 0]), ValueError),
    ("split-without-caller", lambda e: e.me.split_communicator([1]), ValueError),
    ("split-empty", lambda e: e.me.split_communicator([]), ValueError),
    ("split-float", lambda e: e.me.split_communicator([0, 1.0]), TypeError),
    # allocate
    # dtypes the CCLO does not move (they serve kernels and transfers)
    ("uint8-copy", lambda e: e.me.copy(e.u8, e.u8, 4), TypeError),
    ("uint8-send", lambda e: e.me.send(e.u8, 4, 1), TypeError),
    ("uint8-bcast", lambda e: e.me.bcast(e.u8, 4, 0), TypeError),
    ("complex-allreduce", lambda e: e.me.allreduce(e.c64, e.c64, 4, SUM), TypeError),
    ("complex-combine", lambda e: e.me.combine(4, SUM, e.c64, e.c64, e.c64), TypeError),
    ("uint8-recv", lambda e: e.me.recv(e.u8, 4, 1), TypeError),
    ("allocate-object", lambda e: e.me.allocate(4, object), TypeError),
    ("allocate-not-a-dtype", lambda e: e.me.allocate(4, "nonsense"), TypeError),
]


@pytest.mark.anyio
@pytest.mark.parametrize("bad_call, error", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
async def test_bad_call_reaches_no_device(bad_call: Callable[[Env], Any], error: type) -> None:
    async with aaccl.open_world(2, timeout=2.0) as accls:  # a call that slips through fails fast
        env = await make_env(accls)
        spies = [DeviceSpy(a._driver.device) for a in accls]
        communicators = len(env.me._driver.communicators)
        with pytest.raises(error):
            bad_call(env)
        assert [s.seen for s in spies] == [[], []]
        assert len(env.me._driver.communicators) == communicators
        for spy in spies:
            spy.remove()
        if spies[0].skipped:
            # a rejected collective still takes its place: the peer's call of it is
            # aborted (here: its next collective), naming this rank and the error
            with pytest.raises(aaccl.Aborted, match=f"rank 0 rejected its .*{error.__name__}"):
                await env.other.barrier()
        await check_usable(accls)


@pytest.mark.anyio
async def test_valid_variants_are_accepted() -> None:
    """The checks do not reject what they should accept: numpy integers, contiguous
    views, count 0, TAG_ANY, enum-valued functions given as ints, compress to self."""
    async with aaccl.open_world(2) as (a, b):
        f, g = a.allocate(8), a.allocate(8)
        f[:] = np.arange(8)
        await a.copy(f[2:6], g[:4], np.int64(4))
        np.testing.assert_array_equal(g[:4], [2, 3, 4, 5])
        await a.copy(f.reshape(2, 4)[1], g, np.uint8(4))
        np.testing.assert_array_equal(g[:4], [4, 5, 6, 7])
        await a.copy(f, g, 0)
        await a.combine(8, 1, f, g, g)  # MAX as a plain int
        await a.combine(8, np.int64(1), f, g, g)  # MAX as a numpy integer
        np.testing.assert_array_equal(g, np.maximum(f, g))
        s, r = a.send(f, 3, np.int32(1), tag=aaccl.TAG_ANY), b.recv(b.allocate(3), 3, 0, tag=7)
        await s
        await r
        await a.copy(f, g, 8, from_fpga=np.bool_(False), to_fpga=np.True_)  # numpy flags
        await a.copy(g, f, 8, from_fpga=True, waitfor=iter([]))  # any iterable
        c1 = a.bcast(f, 8, np.int64(0), compress_dtype=np.float32)  # wire dtype = data dtype
        c2 = b.bcast(b.allocate(8), 8, 0, compress_dtype=np.float32)
        await c1
        await c2


WORLD_OPTIONS = [
    ("world-size-0", dict(world_size=0), ValueError),
    ("world-size-negative", dict(world_size=-2), ValueError),
    ("world-size-float", dict(world_size=2.0), ValueError),
    ("world-size-bool", dict(world_size=True), ValueError),
    ("device-unknown", dict(device="nonsense"), ValueError),
    ("device-xrt", dict(device="xrt-but-no-fpga"), ValueError),
    ("nbufs-0", dict(nbufs=0), ValueError),
    ("nbufs-negative", dict(nbufs=-1), ValueError),
    ("nbufs-float", dict(nbufs=4.0), ValueError),
    ("nbufs-beyond-the-exchange-memory", dict(nbufs=281), ValueError),  # 280 fit beside 2 ranks
    ("world-beyond-the-exchange-memory", dict(world_size=329), ValueError),
    ("rx-buffers-of-4-GiB", dict(nbufs=16, bufsize=2**28), ValueError),
    ("bufsize-0", dict(bufsize=0), ValueError),
    ("bufsize-not-multiple-of-8", dict(bufsize=1001), ValueError),
    ("bufsize-4", dict(bufsize=4), ValueError),
    ("timeout-0", dict(timeout=0), ValueError),
    ("timeout-negative", dict(timeout=-1.0), ValueError),
    ("timeout-nan", dict(timeout=math.nan), ValueError),
    ("timeout-inf", dict(timeout=math.inf), ValueError),
    ("timeout-str", dict(timeout="1"), ValueError),
    ("timeout-none", dict(timeout=None), ValueError),
    ("timeout-bool", dict(timeout=True), ValueError),
    ("in-order-int", dict(in_order=1), ValueError),
]


@pytest.mark.anyio
@pytest.mark.parametrize("options, error", [c[1:] for c in WORLD_OPTIONS],
                         ids=[c[0] for c in WORLD_OPTIONS])
async def test_bad_open_world_options(options: dict[str, Any], error: type) -> None:
    options = {"world_size": 2, **options}
    entered = False
    with pytest.raises(error):
        async with aaccl.open_world(options.pop("world_size"), **options):
            entered = True
    assert not entered


@pytest.mark.parametrize("options", [dict(world_size=0), dict(world_size=2, nbufs=0),
                                     dict(world_size=2, bufsize=12),
                                     dict(world_size=2, timeout=0)])
def test_bad_run_options(options: dict[str, Any]) -> None:
    ran = []

    async def main(accl: aaccl.ACCL) -> None:
        ran.append(accl.rank)

    with pytest.raises(ValueError):
        aaccl.run(main, **options)
    assert ran == []


@pytest.mark.anyio
async def test_good_open_world_options() -> None:
    """The boundaries of the checks: the smallest valid values work."""
    async with aaccl.open_world(1, nbufs=1, bufsize=8, timeout=0.5) as (a,):
        src, dst = a.allocate(3), a.allocate(3)
        src[:] = [1, 2, 3]
        await a.allreduce(src, dst, 3, SUM)
        np.testing.assert_array_equal(dst, [1, 2, 3])
