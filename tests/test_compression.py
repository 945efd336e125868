"""compress_dtype=np.float16 on float32 data: half precision goes over the wire.

Inputs are float32 values that float16 cannot represent, so a compressed result
differs from the uncompressed one: data a rank received from a peer is exactly its
float16 rounding, and reductions (done by the CCLO's float16 arithmetic units) are
float16 values within float16 rounding of the reference sum.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import numpy as np
import pytest

import aaccl
from aaccl import ReduceFunction

pytestmark = pytest.mark.anyio

SUM, MAX = ReduceFunction.SUM, ReduceFunction.MAX
F16, F32 = np.float16, np.float32
EPS16 = float(np.finfo(F16).eps)
SIZE, ROOT = 4, 1
COUNTS = [7, 3000]  # eager (within one rx buffer) and rendezvous (above the eager limit)
OPS = ["bcast", "scatter", "gather", "reduce", "allgather", "allreduce", "reduce_scatter",
       "alltoall"]
CHUNKED_IN = {"scatter", "reduce_scatter", "alltoall"}
CHUNKED_OUT = {"gather", "allgather", "alltoall"}


def inputs_of(rank: int, length: int) -> np.ndarray:
    """float32 values in [-8, 8), none of them representable in float16."""
    rng = np.random.default_rng([rank, length, 16])
    values = rng.uniform(-8, 8, size=length).astype(F32)
    exact = half(values) == values
    values[exact] = np.nextafter(values[exact], F32(np.inf))  # one float32 ulp off float16
    assert np.all(half(values) != values)
    return values


def half(x: np.ndarray) -> np.ndarray:
    """float32 values as float16 carries them."""
    return x.astype(F16).astype(F32)


async def each_rank(accls: list[aaccl.ACCL],
                    body: Callable[[aaccl.ACCL], Awaitable[None]]) -> None:
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tasks:
            for accl in accls:
                tasks.start_soon(body, accl)


async def run_op(accls: list[aaccl.ACCL], op: str, count: int, func: ReduceFunction,
                 compress: bool) -> list[np.ndarray]:
    """Run `op` on every rank; return each rank's output buffer (host copy)."""
    outputs: list[np.ndarray] = [np.empty(0)] * SIZE
    kwargs = {"compress_dtype": F16} if compress else {}

    async def rank(accl: aaccl.ACCL) -> None:
        n_in = count * (SIZE if op in CHUNKED_IN else 1)
        n_out = count * (SIZE if op in CHUNKED_OUT else 1)
        src = accl.allocate(n_in, F32)
        src[:] = inputs_of(accl.rank, n_in)
        dst = accl.allocate(n_out, F32)
        dst[:] = np.nan
        if op == "bcast":
            await accl.bcast(src, count, ROOT, **kwargs)
            dst = src
        elif op == "scatter":
            await accl.scatter(src, dst, count, ROOT, **kwargs)
        elif op == "gather":
            await accl.gather(src, dst, count, ROOT, **kwargs)
        elif op == "reduce":
            await accl.reduce(src, dst, count, ROOT, func, **kwargs)
        elif op in ("allreduce", "reduce_scatter"):
            await getattr(accl, op)(src, dst, count, func, **kwargs)
        else:
            await getattr(accl, op)(src, dst, count, **kwargs)
        outputs[accl.rank] = np.array(dst)

    await each_rank(accls, rank)
    return outputs


def chunk(x: np.ndarray, i: int, count: int) -> np.ndarray:
    return x[i * count:(i + 1) * count]


def moved_reference(op: str, rank: int, count: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(exact float32 result, mask of elements that came from another rank) for ops
    that move data; None where the rank's output is not defined."""
    n_in = count * (SIZE if op in CHUNKED_IN else 1)
    ins = [inputs_of(r, n_in) for r in range(SIZE)]
    if op == "bcast":
        return ins[ROOT], np.full(count, rank != ROOT)
    if op == "scatter":
        return chunk(ins[ROOT], rank, count), np.full(count, rank != ROOT)
    if op == "gather" and rank != ROOT:
        return None
    if op in ("gather", "allgather"):
        return (np.concatenate(ins),
                np.concatenate([np.full(count, k != rank) for k in range(SIZE)]))
    if op == "alltoall":
        return (np.concatenate([chunk(ins[k], rank, count) for k in range(SIZE)]),
                np.concatenate([np.full(count, k != rank) for k in range(SIZE)]))
    raise AssertionError(op)


def reduced_reference(op: str, rank: int, count: int,
                      func: ReduceFunction) -> tuple[np.ndarray, np.ndarray] | None:
    """(exact float32 reduction, reduction of the float16-rounded inputs in float64)."""
    n_in = count * (SIZE if op in CHUNKED_IN else 1)
    ins = np.array([inputs_of(r, n_in) for r in range(SIZE)])
    if op == "reduce" and rank != ROOT:
        return None
    if op == "reduce_scatter":
        ins = ins[:, rank * count:(rank + 1) * count]
    ufunc = np.add if func == SUM else np.maximum
    exact = ufunc.reduce(ins.astype(F32), axis=0)
    rounded = ufunc.reduce(half(ins).astype(np.float64), axis=0)
    return exact, rounded


@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("op", ["bcast", "scatter", "gather", "allgather", "alltoall"])
async def test_moving_collectives_send_float16(op: str, count: int) -> None:
    async with aaccl.open_world(SIZE, timeout=2) as accls:
        compressed = await run_op(accls, op, count, SUM, compress=True)
        plain = await run_op(accls, op, count, SUM, compress=False)
    for rank in range(SIZE):
        ref = moved_reference(op, rank, count)
        if ref is None:
            continue
        exact, remote = ref
        np.testing.assert_array_equal(plain[rank], exact)
        got = compressed[rank]
        # what came from a peer is exactly its float16 rounding ...
        np.testing.assert_array_equal(got[remote], half(exact)[remote])
        # ... and the rank's own data is its own, at most rounded the same way
        np.testing.assert_allclose(got, exact, rtol=EPS16, atol=0)
        if remote.any():
            assert np.any(got != plain[rank]), "no element was rounded: not float16 on the wire"
            assert np.all(got[remote] != exact[remote])


@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("op", ["reduce", "allreduce", "reduce_scatter"])
@pytest.mark.parametrize("func", [SUM, MAX])
async def test_reducing_collectives_use_float16(op: str, count: int,
                                                func: ReduceFunction) -> None:
    async with aaccl.open_world(SIZE, timeout=2) as accls:
        compressed = await run_op(accls, op, count, func, compress=True)
        plain = await run_op(accls, op, count, func, compress=False)
    for rank in range(SIZE):
        ref = reduced_reference(op, rank, count, func)
        if ref is None:
            continue
        exact, rounded = ref
        got = compressed[rank][:count]
        assert got.dtype == F32
        np.testing.assert_allclose(plain[rank][:count], exact, rtol=SIZE * 1e-6, atol=1e-5)
        # float16 values, each within float16 rounding of the sum of rounded inputs
        np.testing.assert_array_equal(got, half(got))
        if func == MAX:
            np.testing.assert_array_equal(got, rounded)
        else:
            magnitude = np.abs(rounded) + 8 * SIZE  # every partial sum stays below this
            assert np.all(np.abs(got - rounded) <= SIZE * EPS16 * magnitude)
        assert np.any(got != plain[rank][:count]), "not float16: the result was not rounded"
    if op == "allreduce":  # every rank folds the same float16 values: identical results
        for rank in range(1, SIZE):
            np.testing.assert_array_equal(compressed[rank], compressed[0])


async def test_compression_to_the_data_dtype_is_no_compression() -> None:
    """compress_dtype equal to the data's dtype sends the data as it is."""
    count = 10
    async with aaccl.open_world(2, timeout=2) as accls:
        async def rank(accl: aaccl.ACCL) -> None:
            buf = accl.allocate(count, F32)
            buf[:] = inputs_of(0, count)
            await accl.bcast(buf, count, 0, compress_dtype=F32)
            np.testing.assert_array_equal(buf, inputs_of(0, count))

        await each_rank(accls, rank)


async def test_compressed_chain_on_device() -> None:
    """A compressed allreduce feeding a compressed bcast on the device (to_fpga /
    from_fpga): the value rounded once stays a float16 value."""
    count = 50
    async with aaccl.open_world(SIZE, timeout=2) as accls:
        async def rank(accl: aaccl.ACCL) -> None:
            src, dst = accl.allocate(count, F32), accl.allocate(count, F32)
            src[:] = inputs_of(accl.rank, count)
            first = accl.allreduce(src, dst, count, MAX, to_fpga=True, compress_dtype=F16)
            await accl.bcast(dst, count, 2, from_fpga=True, compress_dtype=F16, waitfor=[first])
            expected = half(np.max([inputs_of(r, count) for r in range(SIZE)], axis=0))
            np.testing.assert_array_equal(dst, expected)

        await each_rank(accls, rank)
