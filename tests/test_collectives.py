"""Every collective (and copy, combine) on the soft CCLO, against a numpy reference.

Each rank computes every rank's inputs from a seed, so it knows the whole
collective's expected result without talking to anyone: tests marked
`@pytest.mark.aaccl` (aaccl's pytest plugin) are simply the body of one rank. Host and device copies are
checked separately: `from_fpga` inputs are scrambled on the host after being
synced, `to_fpga` results must not reach the host until `sync_from_device`, and
elements past `count` must be left alone on both sides.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import numpy as np
import pytest

import aaccl
from aaccl import ReduceFunction
from conftest import DTYPES

pytestmark = pytest.mark.anyio

SUM, MAX = ReduceFunction.SUM, ReduceFunction.MAX
OPS = ["bcast", "scatter", "gather", "reduce", "allgather", "allreduce", "reduce_scatter",
       "alltoall"]
ROOTED = {"bcast", "scatter", "gather", "reduce"}
REDUCING = {"reduce", "allreduce", "reduce_scatter"}
TAIL = 3  # extra elements past every buffer's used part, which must stay untouched
SENTINEL = 2047  # what output buffers hold before a call: exact in every dtype, not an input
GARBAGE = -777  # what host inputs hold once they live on the device (from_fpga)

Expected = tuple[np.ndarray, "np.ndarray | None"]  # (reference, elementwise tolerance or None)


# -- the numpy reference ------------------------------------------------------------------


def inputs_of(rank: int, length: int, dtype: Any, seed: int) -> np.ndarray:
    """Rank `rank`'s input: integers with exact sums, or floats that round when summed."""
    rng = np.random.default_rng([seed, rank, length])
    if np.issubdtype(dtype, np.integer):
        return rng.integers(-1000, 1000, size=length).astype(dtype)
    return rng.uniform(-8, 8, size=length).astype(dtype)


def lengths(op: str, size: int, count: int) -> tuple[int, int]:
    """Elements of (input, output) buffer a call uses; count is per rank."""
    chunked_in = op in ("scatter", "reduce_scatter", "alltoall")
    chunked_out = op in ("gather", "allgather", "alltoall")
    return count * (size if chunked_in else 1), count * (size if chunked_out else 1)


def fold(func: ReduceFunction, values: list[np.ndarray]) -> Expected:
    """func over every rank's values: exact for MAX and integers; for float SUM, the
    exact sum with the rounding error bound of summing `len(values)` terms in dtype."""
    dtype = values[0].dtype
    if func == MAX:
        return np.maximum.reduce(values), None
    if np.issubdtype(dtype, np.integer):
        return np.sum(np.array(values, np.int64), axis=0).astype(dtype), None
    wide = np.array(values, np.float64)
    eps = float(np.finfo(dtype).eps)
    return wide.sum(axis=0), len(values) * eps * np.abs(wide).sum(axis=0)


def expected(op: str, ins: list[np.ndarray], rank: int, root: int, count: int,
             func: ReduceFunction | None) -> Expected | None:
    """What `rank`'s output buffer holds after `op`; None if the op leaves it alone."""
    size = len(ins)

    def chunk(a: np.ndarray, i: int) -> np.ndarray:
        return a[i * count:(i + 1) * count]

    if op == "bcast":
        return ins[root], None
    if op == "scatter":
        return chunk(ins[root], rank), None
    if op in ("gather", "allgather"):
        return (np.concatenate(ins), None) if op == "allgather" or rank == root else None
    if op == "alltoall":
        return np.concatenate([chunk(ins[i], rank) for i in range(size)]), None
    assert func is not None
    if op == "reduce_scatter":
        ref, tol = fold(func, ins)
        return chunk(ref, rank), None if tol is None else chunk(tol, rank)
    if op == "reduce" and rank != root:
        return None
    return fold(func, ins)


def assert_result(got: np.ndarray, want: Expected, what: str) -> None:
    ref, tol = want
    assert got.shape == ref.shape, what
    if tol is None:
        assert got.dtype == ref.dtype
        np.testing.assert_array_equal(got, ref, err_msg=what)
    else:
        err = np.abs(got.astype(np.float64) - ref)
        bad = np.flatnonzero(~(err <= tol))
        assert bad.size == 0, (f"{what}: {bad.size} elements off, first at {bad[0]}: "
                               f"got {got[bad[0]]!r}, want {ref[bad[0]]!r} +- {tol[bad[0]]!r}")


def filled(accl: aaccl.ACCL, length: int, dtype: Any) -> aaccl.Buffer:
    """A buffer of `length` (+ TAIL) elements holding SENTINEL on host and device."""
    buf = accl.allocate(length + TAIL, dtype)
    buf[:] = SENTINEL
    buf.sync_to_device()
    return buf


def put_input(buf: aaccl.Buffer, data: np.ndarray, from_fpga: bool) -> np.ndarray:
    """Write an input; with from_fpga, sync it and scramble the host copy, so a call that
    wrongly reads host memory sees garbage. Returns what the host copy now holds."""
    buf[:data.size] = data
    if from_fpga:
        buf.sync_to_device()
        buf[:data.size] = GARBAGE
    return np.array(buf)


def device_copy(buf: aaccl.Buffer) -> np.ndarray:
    """The buffer's device contents, leaving the host copy as it was."""
    host = np.array(buf)
    buf.sync_from_device()
    device = np.array(buf)
    buf[:] = host
    return device


def start(accl: aaccl.ACCL, op: str, sbuf: aaccl.Buffer | None, rbuf: aaccl.Buffer | None,
          count: int, root: int, func: ReduceFunction | None, **kw: Any) -> aaccl.Call:
    if op == "bcast":
        return accl.bcast(sbuf, count, root, **kw)
    if op in ("scatter", "gather"):
        return getattr(accl, op)(sbuf, rbuf, count, root, **kw)
    if op == "reduce":
        return accl.reduce(sbuf, rbuf, count, root, func, **kw)
    if op in REDUCING:
        return getattr(accl, op)(sbuf, rbuf, count, func, **kw)
    return getattr(accl, op)(sbuf, rbuf, count, **kw)


async def check_op(accl: aaccl.ACCL, op: str, dtype: Any, count: int, root: int,
                   func: ReduceFunction | None, seed: int, *, from_fpga: bool = False,
                   to_fpga: bool = False, omit_unused: bool = False) -> np.ndarray | None:
    """Run one collective on this rank and check host and device copies of every buffer
    against the reference. Returns this rank's result (device copy), if it has one."""
    rank, size = accl.rank, accl.size
    n_in, n_out = lengths(op, size, count)
    ins = [inputs_of(r, n_in, dtype, seed) for r in range(size)]
    want = expected(op, ins, rank, root, count, func)
    what = (f"{op} rank {rank}/{size} root {root} count {count} {np.dtype(dtype).name} "
            f"{func and func.name} from_fpga={from_fpga} to_fpga={to_fpga}")
    is_root = rank == root
    kw = {"from_fpga": from_fpga, "to_fpga": to_fpga}

    if op == "bcast":
        buf = filled(accl, n_in, dtype)
        host_before = put_input(buf, ins[rank], from_fpga) if is_root else np.array(buf)
        await start(accl, op, buf, None, count, root, func, **kw)
        if is_root:
            # the root's host copy is its input, or the device's copy of it when the
            # input came from the device and the result goes to the host
            host_want = ins[rank] if not to_fpga or not from_fpga else host_before[:n_in]
        else:
            host_want = host_before[:n_in] if to_fpga else ins[root]
        np.testing.assert_array_equal(buf[:n_in], host_want, err_msg=f"{what}: host copy")
        np.testing.assert_array_equal(buf[n_in:], SENTINEL, err_msg=f"{what}: host tail")
        device = device_copy(buf)
        assert want is not None
        assert_result(device[:n_in], want, f"{what}: device copy")
        np.testing.assert_array_equal(device[n_in:], SENTINEL, err_msg=f"{what}: device tail")
        return device[:n_in]

    uses_sbuf = not (omit_unused and op == "scatter" and not is_root)
    uses_rbuf = not (omit_unused and op in ("gather", "reduce") and not is_root)
    sbuf = filled(accl, n_in, dtype) if uses_sbuf else None
    rbuf = filled(accl, n_out, dtype) if uses_rbuf else None
    s_host = put_input(sbuf, ins[rank], from_fpga) if sbuf is not None else None
    await start(accl, op, sbuf, rbuf, count, root, func, **kw)

    if sbuf is not None:  # inputs are left alone, on the host and on the device
        np.testing.assert_array_equal(sbuf, s_host, err_msg=f"{what}: sbuf host copy")
        device = device_copy(sbuf)
        if not (op == "scatter" and not is_root):  # a non-root's sbuf is never synced
            np.testing.assert_array_equal(device[:n_in], ins[rank], err_msg=f"{what}: sbuf")
        np.testing.assert_array_equal(device[n_in:], SENTINEL, err_msg=f"{what}: sbuf tail")
    if rbuf is None:
        return None
    if want is None or to_fpga:
        np.testing.assert_array_equal(rbuf, SENTINEL, err_msg=f"{what}: rbuf host copy changed")
    else:
        assert_result(rbuf[:n_out], want, f"{what}: rbuf host copy")
        np.testing.assert_array_equal(rbuf[n_out:], SENTINEL, err_msg=f"{what}: host tail")
    device = device_copy(rbuf)
    np.testing.assert_array_equal(device[n_out:], SENTINEL, err_msg=f"{what}: device tail")
    if want is None:
        np.testing.assert_array_equal(device, SENTINEL, err_msg=f"{what}: rbuf written")
        return None
    assert_result(device[:n_out], want, f"{what}: rbuf device copy")
    if to_fpga:  # the host copy updates only when asked to
        rbuf.sync_from_device()
        assert_result(rbuf[:n_out], want, f"{what}: rbuf after sync_from_device")
    return device[:n_out]


# -- running ranks ----------------------------------------------------------------------


async def on_world(size: int, main: Callable[[aaccl.ACCL], Awaitable[Any]],
                   **options: Any) -> list[Any]:
    """Run `main` on every rank of a fresh world, one task per rank."""
    results: list[Any] = [None] * size
    with anyio.fail_after(60):
        async with aaccl.open_world(size, **options) as accls:
            async with anyio.create_task_group() as tasks:
                for accl in accls:
                    async def rank(accl: aaccl.ACCL = accl) -> None:
                        results[accl.rank] = await main(accl)
                    tasks.start_soon(rank)
    return results


def funcs_of(op: str) -> list[ReduceFunction | None]:
    return [SUM, MAX] if op in REDUCING else [None]


def roots_of(op: str, size: int) -> list[int]:
    return sorted({0, size - 1}) if op in ROOTED else [0]


async def sweep(size: int, op: str, dtype: Any, counts: list[int], seed: int = 1,
                **options: Any) -> None:
    """Every count x root x function for `op` in one world, in the same order on every
    rank; allreduce results must be bitwise identical on every rank."""
    cases = [(c, r, f) for c in counts for r in roots_of(op, size) for f in funcs_of(op)]

    async def main(accl: aaccl.ACCL) -> list[np.ndarray | None]:
        return [await check_op(accl, op, dtype, c, r, f, seed + i, omit_unused=bool(i % 2))
                for i, (c, r, f) in enumerate(cases)]

    results = await on_world(size, main, **options)
    if op in ("allreduce", "allgather"):
        for i, case in enumerate(cases):
            for rank in range(1, size):
                assert results[rank][i].tobytes() == results[0][i].tobytes(), \
                    f"{op} {case}: rank {rank} differs from rank 0"


# -- world sizes, dtypes, segmentation ---------------------------------------------------


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("op", OPS)
async def test_world_sizes(op: str, size: int) -> None:
    # 0 and 1; odd; 301 is odd, indivisible by 2..5 and 1204 bytes (> one 1024-byte rx
    # buffer); 1031 takes allreduce's reduce-scatter + allgather path in uneven chunks
    await sweep(size, op, np.float32, [0, 1, 7, 301, 1031])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", OPS)
async def test_dtypes(op: str, dtype: Any) -> None:
    # 777 elements exceed one rx buffer for every dtype; 1537 is a large allreduce
    await sweep(3, op, dtype, [1, 37, 777, 1537])


@pytest.mark.parametrize(("bufsize", "nbufs"), [(64, 4), (64, 16)], ids=["rendezvous", "segments"])
@pytest.mark.parametrize("op", OPS)
async def test_small_rx_buffers(op: str, bufsize: int, nbufs: int) -> None:
    """Eager messages of one rx buffer or several, and rendezvous beyond the eager limit
    (bufsize * nbufs // 4): 8 bytes up to 2.4 KB per message, 4 ranks."""
    await sweep(4, op, np.float64, [1, 7, 8, 9, 30, 33, 300], bufsize=bufsize, nbufs=nbufs)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize(("size", "dtype", "options"), [
    (1, np.float32, {}),
    (2, np.float64, {}),
    (3, np.float32, {}),
    (4, np.int64, {}),
    (5, np.float16, {}),
    (3, np.int32, {"bufsize": 64, "nbufs": 4}),
], ids=["1-float32", "2-float64", "3-float32", "4-int64", "5-float16", "3-int32-rendezvous"])
def test_large_allreduce(size: int, dtype: Any, options: dict[str, Any], backend: str) -> None:
    """70 000 elements: reduce-scatter then allgather, through aaccl.run; also in place."""
    count = 70_000

    async def main(accl: aaccl.ACCL) -> list[np.ndarray]:
        out = [await check_op(accl, "allreduce", dtype, count, 0, func, 7 + i)
               for i, func in enumerate([SUM, MAX])]
        buf = accl.allocate(count, dtype)
        buf[:] = inputs_of(accl.rank, count, dtype, 9)
        await accl.allreduce(buf, buf, count, SUM)
        assert_result(np.array(buf), fold(SUM, [inputs_of(r, count, dtype, 9)
                                                for r in range(size)]), "in place")
        return out + [np.array(buf)]

    results = aaccl.run(main, world_size=size, backend=backend, **options)
    for rank in range(1, size):
        for got, first in zip(results[rank], results[0]):
            assert got.tobytes() == first.tobytes()


# -- data that lives on the device ------------------------------------------------------


@pytest.mark.parametrize(("from_fpga", "to_fpga"), [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.aaccl(world_size=3)
async def test_device_resident(accl: aaccl.ACCL, op: str, from_fpga: bool, to_fpga: bool) -> None:
    """Inputs synced by hand (the host copy then scrambled), results left on the device:
    the host copy must not change until sync_from_device."""
    for count in (5, 301):
        for root in roots_of(op, accl.size):
            for func in funcs_of(op):
                await check_op(accl, op, np.int32, count, root, func, count + root,
                               from_fpga=from_fpga, to_fpga=to_fpga)
                await check_op(accl, op, np.float32, count, root, func, count + root,
                               from_fpga=from_fpga, to_fpga=to_fpga)


@pytest.mark.aaccl(world_size=4)
async def test_to_fpga_leaves_host_copy_stale(accl: aaccl.ACCL) -> None:
    src = accl.allocate(16, np.int64)
    dst = accl.allocate(16, np.int64)
    src[:] = np.arange(16) * (accl.rank + 1)
    await accl.allreduce(src, dst, 16, SUM, to_fpga=True)
    np.testing.assert_array_equal(dst, 0)  # still the host's zeros
    dst.sync_from_device()
    np.testing.assert_array_equal(dst, np.arange(16) * 10)


@pytest.mark.aaccl(world_size=4)
async def test_device_chain_with_one_await(accl: aaccl.ACCL) -> None:
    """allreduce -> bcast -> copy -> combine, all on the device, joined by waitfor."""
    n, last = 300, accl.size - 1
    src, red, cpy, out = (accl.allocate(n, np.float64) for _ in range(4))
    src[:] = inputs_of(accl.rank, n, np.float64, 3)
    a = accl.allreduce(src, red, n, MAX, to_fpga=True)
    if accl.rank == last:
        red[:] = GARBAGE  # the host copy is stale; bcast must send the device's copy
    b = accl.bcast(red, n, last, from_fpga=True, to_fpga=True, waitfor=[a])
    c = accl.copy(red, cpy, n, from_fpga=True, to_fpga=True, waitfor=[b])
    d = accl.combine(n, SUM, red, cpy, out, val1_from_fpga=True, val2_from_fpga=True,
                     waitfor=[c])
    await d
    assert a.done() and b.done() and c.done()
    want = 2 * np.maximum.reduce([inputs_of(r, n, np.float64, 3) for r in range(accl.size)])
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(cpy, 0)  # never synced back
    cpy.sync_from_device()
    np.testing.assert_array_equal(cpy, want / 2)


# -- in place ---------------------------------------------------------------------------


@pytest.mark.parametrize("options", [{}, {"bufsize": 64, "nbufs": 4}], ids=["eager", "rendezvous"])
@pytest.mark.parametrize("size", [1, 2, 3, 5])
async def test_inplace_allreduce(size: int, options: dict[str, Any]) -> None:
    counts = [1, 8, 301, 1031, 5000]

    async def main(accl: aaccl.ACCL) -> list[bytes]:
        out = []
        for dtype in (np.float32, np.int32):
            for count in counts:
                for func in (SUM, MAX):
                    ins = [inputs_of(r, count, dtype, count) for r in range(size)]
                    buf = filled(accl, count, dtype)
                    buf[:count] = ins[accl.rank]
                    await accl.allreduce(buf, buf, count, func)
                    what = f"in-place allreduce {count} {np.dtype(dtype).name} {func.name}"
                    assert_result(buf[:count], fold(func, ins), what)
                    device = device_copy(buf)
                    np.testing.assert_array_equal(device, buf, err_msg=what)
                    np.testing.assert_array_equal(device[count:], SENTINEL, err_msg=what)
                    out.append(device.tobytes())
        return out

    results = await on_world(size, main, **options)
    assert all(r == results[0] for r in results)


@pytest.mark.parametrize("options", [{}, {"bufsize": 64, "nbufs": 4}], ids=["eager", "rendezvous"])
@pytest.mark.parametrize("size", [1, 2, 3, 5])
async def test_inplace_alltoall(size: int, options: dict[str, Any]) -> None:
    async def main(accl: aaccl.ACCL) -> None:
        for dtype in (np.float16, np.int64):
            for count in (1, 7, 301):
                ins = [inputs_of(r, count * size, dtype, count) for r in range(size)]
                buf = filled(accl, count * size, dtype)
                buf[:count * size] = ins[accl.rank]
                await accl.alltoall(buf, buf, count)
                want = expected("alltoall", ins, accl.rank, 0, count, None)
                assert want is not None
                assert_result(buf[:count * size], want, f"in-place alltoall {count}")
                assert_result(device_copy(buf)[:count * size], want, "device copy")

    await on_world(size, main, **options)


# -- barrier ----------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
async def test_barrier(size: int) -> None:
    """No rank leaves a barrier before the last one enters it: the last rank enters only
    once every other rank's barrier call exists, and those cannot be done before."""
    entered: list[aaccl.Call | None] = [None] * size
    rounds = [anyio.Event() for _ in range(3)]

    async def main(accl: aaccl.ACCL) -> None:
        for others_in in rounds:
            if accl.rank < size - 1:
                entered[accl.rank] = call = accl.barrier()
                if all(c is not None for c in entered[:size - 1]):
                    others_in.set()
                await call
                assert entered[size - 1] is not None, "left the barrier before the last rank entered"
            else:
                if size > 1:
                    await others_in.wait()
                    assert not any(c.done() for c in entered[:size - 1] if c is not None)
                entered[accl.rank] = call = accl.barrier()
                await call
            # everyone is out before anyone starts the next round
            await accl.barrier()
            entered[accl.rank] = None
            await accl.barrier()

    await on_world(size, main)


# -- copy and combine -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.aaccl(world_size=2)
async def test_copy(accl: aaccl.ACCL, dtype: Any) -> None:
    for count in (0, 1, 7, 301, 5000):
        for from_fpga, to_fpga in ((False, False), (True, False), (False, True), (True, True)):
            data = inputs_of(accl.rank, count, dtype, count)
            src, dst = filled(accl, count, dtype), filled(accl, count, dtype)
            s_host = put_input(src, data, from_fpga)
            await accl.copy(src, dst, count, from_fpga=from_fpga, to_fpga=to_fpga)
            what = f"copy {count} from_fpga={from_fpga} to_fpga={to_fpga}"
            np.testing.assert_array_equal(src, s_host, err_msg=what)
            if to_fpga:
                np.testing.assert_array_equal(dst, SENTINEL, err_msg=what)
            else:
                np.testing.assert_array_equal(dst[:count], data, err_msg=what)
            device = device_copy(dst)
            np.testing.assert_array_equal(device[:count], data, err_msg=what)
            np.testing.assert_array_equal(device[count:], SENTINEL, err_msg=what)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.aaccl(world_size=2)
async def test_combine(accl: aaccl.ACCL, dtype: Any) -> None:
    for count in (0, 1, 7, 301, 5000):
        for func in (SUM, MAX):
            for flags in ((False, False, False), (True, False, True), (False, True, False),
                          (True, True, True)):
                v1_dev, v2_dev, to_fpga = flags
                a = inputs_of(accl.rank, count, dtype, count)
                b = inputs_of(accl.rank + 10, count, dtype, count)
                va, vb, out = (filled(accl, count, dtype) for _ in range(3))
                ha, hb = put_input(va, a, v1_dev), put_input(vb, b, v2_dev)
                await accl.combine(count, func, va, vb, out, val1_from_fpga=v1_dev,
                                   val2_from_fpga=v2_dev, to_fpga=to_fpga)
                what = f"combine {count} {func.name} {flags}"
                np.testing.assert_array_equal(va, ha, err_msg=what)
                np.testing.assert_array_equal(vb, hb, err_msg=what)
                want = fold(func, [a, b])
                if to_fpga:
                    np.testing.assert_array_equal(out, SENTINEL, err_msg=what)
                else:
                    assert_result(out[:count], want, what)
                device = device_copy(out)
                assert_result(device[:count], want, what)
                np.testing.assert_array_equal(device[count:], SENTINEL, err_msg=what)


@pytest.mark.aaccl(world_size=1)
async def test_combine_in_place(accl: aaccl.ACCL) -> None:
    acc = accl.allocate(100, np.int64)
    step = accl.allocate(100, np.int64)
    step[:] = np.arange(100)
    for _ in range(5):
        await accl.combine(100, SUM, acc, step, acc)
    np.testing.assert_array_equal(acc, 5 * np.arange(100))
