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
from aaccl._constants import Scenario
from aaccl.devices import CallArgs, DeviceCall
from aaccl.driver import Driver

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


@pytest.mark.parametrize("count", [16, 3000])  # eager and rendezvous
async def test_a_compression_mismatch_names_the_wire_dtype_on_every_rank(count: int) -> None:
    async with aaccl.open_world(2, timeout=5) as (a, b):
        x, y = a.allocate(count, F32), b.allocate(count, F32)
        with anyio.fail_after(5):
            results: list[BaseException | None] = [None, None]

            async def run(rank: int, call: aaccl.Call) -> None:
                try:
                    await call
                except aaccl.CCLOError as error:
                    results[rank] = error

            async with anyio.create_task_group() as tg:
                tg.start_soon(run, 0, a.allreduce(x, x, count, SUM))
                tg.start_soon(run, 1, b.allreduce(y, y, count, SUM, compress_dtype=F16))
        expected = (f"rank 0 called allreduce(count={count}, float32, SUM); "
                    f"rank 1 called allreduce(count={count}, float32 compressed to float16, SUM)")
        for error in results:
            assert isinstance(error, aaccl.CCLOError), results
            assert error.code == aaccl.ErrorCode.DMA_MISMATCH_ERROR
            assert expected in str(error)
        x[:], y[:] = 1, 2  # and the world goes on

        async def again(accl: aaccl.ACCL) -> None:
            buf = [x, y][accl.rank]
            await accl.allreduce(buf, buf, count, SUM)

        await each_rank([a, b], again)
        np.testing.assert_array_equal(x, 3)
        np.testing.assert_array_equal(y, 3)


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


# -- mixed precision: copy and combine between float32 and float16 buffers --------------
#
# pyaccl's rule: the narrower dtype is the compressed one, the arithmetic config is
# (float32, float16), and each buffer of float16 gets its OP0/OP1/RES_COMPRESSED flag.
# That config computes in float16: float32 inputs are converted (rounded to nearest by
# the soft CCLO's lanes, as numpy's astype) before the arithmetic unit sees them.

MIXED_COUNTS = [0, 1, 7, 3001]  # nothing, one element, odd counts small and large
UFUNCS = {SUM: np.add, MAX: np.maximum}


def values_of(dtype: type, seed: int, length: int) -> np.ndarray:
    """float32 values off the float16 grid, or float16 values (exact in float32)."""
    values = inputs_of(seed, length)
    return values if dtype is F32 else values.astype(F16)


def sentinel(dtype: type) -> np.floating:
    return np.dtype(dtype).type(-1234.5)  # no result of these inputs, exact in float16


def put(buf: aaccl.Buffer, values: np.ndarray, on_device: bool) -> None:
    """Give buf its values: on the host only, or on the device only (the host copy
    then holds garbage that a sync would wrongly send)."""
    buf[:len(values)] = values
    if on_device:
        buf.sync_to_device()
        buf[:] = sentinel(buf.dtype.type)


def result_of(buf: aaccl.Buffer, on_device: bool) -> np.ndarray:
    if on_device:
        assert np.all(buf == sentinel(buf.dtype.type)), "to_fpga synced the host copy"
        buf.sync_from_device()
    return np.array(buf)


@pytest.mark.parametrize("count", MIXED_COUNTS)
@pytest.mark.parametrize("src_dtype, dst_dtype", [(F32, F16), (F16, F32)],
                         ids=["f32-to-f16", "f16-to-f32"])
@pytest.mark.parametrize("from_fpga, to_fpga", [(False, False), (True, False), (False, True),
                                                (True, True)], ids=["host", "from", "to", "device"])
async def test_copy_converts(src_dtype: type, dst_dtype: type, count: int, from_fpga: bool,
                             to_fpga: bool) -> None:
    values = values_of(src_dtype, 3, count)
    expected = np.full(count + 2, sentinel(dst_dtype), dst_dtype)
    expected[:count] = values.astype(dst_dtype)  # float32 -> float16 rounds; back is exact
    async with aaccl.open_world(1) as (accl,):
        src, dst = accl.allocate(count + 2, src_dtype), accl.allocate(count + 2, dst_dtype)
        put(src, values, from_fpga)
        dst[:] = sentinel(dst_dtype)
        dst.sync_to_device()
        await accl.copy(src, dst, count, from_fpga=from_fpga, to_fpga=to_fpga)
        got = result_of(dst, to_fpga)
    assert got.dtype == dst_dtype
    np.testing.assert_array_equal(got, expected)  # and nothing beyond count changed
    if src_dtype is F32 and count:
        assert np.all(got[:count].astype(F32) != values), "no rounding: not float16"


COMBINE_DTYPES = [(a, b, r) for a in (F32, F16) for b in (F32, F16) for r in (F32, F16)
                  if not (a is b is r)]


@pytest.mark.parametrize("count", MIXED_COUNTS)
@pytest.mark.parametrize("func", [SUM, MAX])
@pytest.mark.parametrize("dtypes", COMBINE_DTYPES,
                         ids=["-".join(np.dtype(d).name for d in ds) for ds in COMBINE_DTYPES])
async def test_combine_computes_in_float16(dtypes: tuple[type, type, type], func: ReduceFunction,
                                           count: int) -> None:
    a_dtype, b_dtype, res_dtype = dtypes
    a, b = values_of(a_dtype, 5, count), values_of(b_dtype, 6, count)
    expected = np.full(count + 1, sentinel(res_dtype), res_dtype)
    expected[:count] = UFUNCS[func](a.astype(F16), b.astype(F16)).astype(res_dtype)
    async with aaccl.open_world(1) as (accl,):
        bufs = [accl.allocate(count + 1, dt) for dt in dtypes]
        put(bufs[0], a, False)
        put(bufs[1], b, False)
        bufs[2][:] = sentinel(res_dtype)
        bufs[2].sync_to_device()
        await accl.combine(count, func, *bufs)
        got = np.array(bufs[2])
    assert got.dtype == res_dtype
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(got[:count], got[:count].astype(F16))  # float16 values


@pytest.mark.parametrize("val1_from_fpga, val2_from_fpga, to_fpga",
                         [(True, False, False), (False, True, False), (False, False, True),
                          (True, True, True)])
async def test_combine_mixed_on_device(val1_from_fpga: bool, val2_from_fpga: bool,
                                       to_fpga: bool) -> None:
    count = 77
    a, b = values_of(F32, 7, count), values_of(F16, 8, count)
    expected = (a.astype(F16) + b).astype(F32)
    async with aaccl.open_world(1) as (accl,):
        va, vb, out = accl.allocate(count, F32), accl.allocate(count, F16), accl.allocate(count, F32)
        put(va, a, val1_from_fpga)
        put(vb, b, val2_from_fpga)
        out[:] = sentinel(F32)
        await accl.combine(count, SUM, va, vb, out, val1_from_fpga, val2_from_fpga, to_fpga)
        got = result_of(out, to_fpga)
    np.testing.assert_array_equal(got, expected)


async def test_mixed_chain_on_device() -> None:
    """float32 -> float16 copy, a float16 + float32 combine into float32, and a copy
    back to float16, chained on the device with no host sync in between."""
    count = 33
    x, y = values_of(F32, 9, count), values_of(F32, 10, count)
    async with aaccl.open_world(1) as (accl,):
        src, half_buf = accl.allocate(count, F32), accl.allocate(count, F16)
        other, total, back = (accl.allocate(count, F32), accl.allocate(count, F32),
                              accl.allocate(count, F16))
        src[:], other[:] = x, y
        first = accl.copy(src, half_buf, count, to_fpga=True)
        second = accl.combine(count, SUM, half_buf, other, total, val1_from_fpga=True,
                              to_fpga=True, waitfor=[first])
        await accl.copy(total, back, count, from_fpga=True, waitfor=[second])
    np.testing.assert_array_equal(back, x.astype(F16) + y.astype(F16))


async def test_mixed_copy_across_ranks_in_one_world() -> None:
    """Every rank converts on its own CCLO; a compressed bcast of the result after."""
    count = 10
    async with aaccl.open_world(SIZE, timeout=2) as accls:
        async def rank(accl: aaccl.ACCL) -> None:
            src, dst = accl.allocate(count, F32), accl.allocate(count, F16)
            src[:] = inputs_of(accl.rank, count)
            await accl.copy(src, dst, count)
            np.testing.assert_array_equal(dst, inputs_of(accl.rank, count).astype(F16))

        await each_rank(accls, rank)


@pytest.mark.parametrize("shift", [-2, 0, 1, 2, 3])
async def test_copy_converts_in_place(shift: int) -> None:
    """float32 elements converted into float16 elements of the same memory (a dtype
    view of one buffer): every element is read before any is overwritten."""
    count = 6
    values = values_of(F32, 11, count + 2)
    async with aaccl.open_world(1) as (accl,):
        wide = accl.allocate(count + 2, F32)
        wide[:] = values
        narrow = wide.view(F16)  # the same device memory, twice the elements
        src = wide[1:1 + count]
        dst = narrow[2 + shift:2 + shift + count]  # overlaps src's bytes
        await accl.copy(src, dst, count)
        np.testing.assert_array_equal(dst, values[1:1 + count].astype(F16))


@pytest.mark.parametrize("shift", [-3, -1, 1, 3])
async def test_copy_between_overlapping_slices(shift: int) -> None:
    """Same dtype, overlapping but shifted: the elements move (only a copy onto
    itself is a no-op)."""
    count = 5
    async with aaccl.open_world(1) as (accl,):
        buf = accl.allocate(12, F32)
        buf[:] = np.arange(12)
        start = 4
        await accl.copy(buf[start:start + count], buf[start + shift:start + shift + count], count)
        np.testing.assert_array_equal(buf[start + shift:start + shift + count],
                                      np.arange(start, start + count))


class StartSpy:
    """Records the device calls and memory writes of one rank."""

    def __init__(self, accl: aaccl.ACCL) -> None:
        self.device, self.seen = accl._driver.device, []
        for name in ("start", "write"):
            method = getattr(self.device, name)
            setattr(self.device, name, self._wrap(name, method))

    def _wrap(self, name: str, method: Callable[..., object]) -> Callable[..., object]:
        def spied(*args: object, **kwargs: object) -> object:
            self.seen.append((name, args[0] if name == "start" else None))
            return method(*args, **kwargs)
        return spied

    def remove(self) -> None:
        for name in ("start", "write"):
            delattr(self.device, name)


BAD_MIXES = [
    ("copy-i32-f32", lambda accl, bufs: accl.copy(bufs["i32"], bufs["f32"], 4)),
    ("copy-f64-f16", lambda accl, bufs: accl.copy(bufs["f64"], bufs["f16"], 4)),
    ("copy-f16-f64", lambda accl, bufs: accl.copy(bufs["f16"], bufs["f64"], 4)),
    ("copy-f32-f64", lambda accl, bufs: accl.copy(bufs["f32"], bufs["f64"], 4)),
    ("combine-i32-f32", lambda accl, bufs: accl.combine(4, SUM, bufs["i32"], bufs["f32"],
                                                        bufs["f32"])),
    ("combine-f64-f16", lambda accl, bufs: accl.combine(4, SUM, bufs["f64"], bufs["f16"],
                                                        bufs["f16"])),
    ("combine-three-dtypes", lambda accl, bufs: accl.combine(4, SUM, bufs["f32"], bufs["f16"],
                                                             bufs["f64"])),
    ("combine-i64-i32", lambda accl, bufs: accl.combine(4, MAX, bufs["i64"], bufs["i32"],
                                                        bufs["i32"])),
]


@pytest.mark.parametrize("bad_call", [c[1] for c in BAD_MIXES], ids=[c[0] for c in BAD_MIXES])
async def test_bad_mixes_raise_before_the_device(
        bad_call: Callable[[aaccl.ACCL, dict[str, aaccl.Buffer]], object]) -> None:
    async with aaccl.open_world(1) as (accl,):
        bufs = {np.dtype(dt).name[0] + str(8 * np.dtype(dt).itemsize): accl.allocate(8, dt)
                for dt in (F16, F32, np.float64, np.int32, np.int64)}
        spy = StartSpy(accl)
        try:
            with pytest.raises(TypeError, match="buffers must share one dtype or mix "
                                                "float32 with float16"):
                bad_call(accl, bufs)
            assert spy.seen == []
        finally:
            spy.remove()
        await accl.copy(bufs["f32"], bufs["f16"], 8)  # the rank is still usable


# -- the driver's encoding and the soft CCLO's limits ---------------------------------------

OP0, OP1, RES, ETH = (aaccl.CompressionFlags.OP0_COMPRESSED,
                      aaccl.CompressionFlags.OP1_COMPRESSED,
                      aaccl.CompressionFlags.RES_COMPRESSED,
                      aaccl.CompressionFlags.ETH_COMPRESSED)
D16, D32 = np.dtype(F16), np.dtype(F32)


@pytest.mark.parametrize("operands, flags", [
    ((D32, None, D16), RES),
    ((D16, None, D32), OP0),
    ((D32, D32, D16), RES),
    ((D16, D32, D32), OP0),
    ((D32, D16, D32), OP1),
    ((D16, D16, D32), OP0 | OP1),
    ((D16, D32, D16), OP0 | RES),
])
async def test_driver_marks_the_narrow_operands(operands: tuple[np.dtype | None, ...],
                                                flags: aaccl.CompressionFlags) -> None:
    async with aaccl.open_world(1) as (accl,):
        spy = StartSpy(accl)
        driver = accl._driver
        try:
            scenario = Scenario.COPY if operands[1] is None else Scenario.COMBINE
            count = 0  # nothing to move: only the encoding matters
            driver.start(scenario, count=count, operand_dtypes=operands).block(5)
            driver.start(scenario, count=count, operand_dtypes=operands,
                         compress_dtype=D16).block(5)
            driver.start(scenario, count=count, operand_dtypes=(D32, D32, D32)).block(5)
        finally:
            spy.remove()
        (_, mixed), (_, eth), (_, plain) = spy.seen
        assert mixed.compression_flags == flags and eth.compression_flags == flags | ETH
        assert mixed.arithcfg == eth.arithcfg == driver._arith[(D32, D16)]
        assert plain.compression_flags == 0 and plain.arithcfg == driver._arith[(D32, D32)]


async def test_driver_rejects_mixes_without_a_config() -> None:
    async with aaccl.open_world(1) as (accl,):
        driver = accl._driver
        for operands in [(np.dtype(np.int32), None, D32), (np.dtype(np.float64), None, D16),
                         (D16, D32, np.dtype(np.float64))]:
            with pytest.raises(TypeError):
                driver.start(Scenario.COPY, count=1, operand_dtypes=operands)
        with pytest.raises(TypeError):
            driver.start(Scenario.COPY, count=1, dtype=D32, operand_dtypes=(D32, None, D16))
        with pytest.raises(TypeError):
            driver.start(Scenario.COPY, count=1, operand_dtypes=(D32, None, D16),
                         compress_dtype=np.dtype(np.float64))


def finished(driver: Driver, call: DeviceCall) -> Exception | None:
    assert call.block(5)
    return driver.error(call, "call")


async def test_soft_cclo_refuses_compressed_operands_it_does_not_model() -> None:
    """Collectives with OP0/OP1/RES_COMPRESSED, and those flags with a config that has
    no compression lanes, fail with COMPRESSION_ERROR (the call, not the rank)."""
    async with aaccl.open_world(1) as (accl,):
        driver = accl._driver
        buf = accl.allocate(8, F32)
        address = buf.device_address
        bcast = driver.start(Scenario.BCAST, count=4, operand_dtypes=(D16, None, D32),
                             addrs=(address, 0, address))
        plain_cfg = CallArgs(int(Scenario.COPY), 4, driver.communicators[0][0], 0, 0,
                             aaccl.TAG_ANY, driver._arith[(D32, D32)], int(RES), 0,
                             address, 0, address + 16)
        copy = driver.device.start(plain_cfg)
        for call in (bcast, copy):
            error = finished(driver, call)
            assert isinstance(error, aaccl.CCLOError)
            assert error.code == aaccl.ErrorCode.COMPRESSION_ERROR
        await accl.copy(buf, accl.allocate(8, F16), 8)  # still usable
