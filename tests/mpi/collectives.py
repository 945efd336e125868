"""Every collective, copy/combine and send/recv over the MPI fabric, one rank per process.

    mpiexec -n N python tests/mpi/collectives.py SUITE [backend=trio] [nbufs=4 bufsize=64] ...

Suites:
  all       every collective x every dtype x counts 0/1, odd, not dividing the world
            size, larger than one rx buffer, and > 1024 (allreduce's reduce-scatter +
            allgather path) x first and last root x SUM/MAX; device-resident inputs and
            results; in place; a 70 000-element allreduce; barrier; copy/combine; a
            send/recv ring. Allreduce/allgather results must be bitwise identical on
            every rank.
  small     the same collectives with small rx buffers (run with nbufs=4 bufsize=64):
            eager messages of one or several rx buffers, and rendezvous beyond that.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
from _harness import Checks, run_suite
from conftest import DTYPES
from test_collectives import (
    OPS,
    SENTINEL,
    assert_result,
    check_op,
    device_copy,
    expected,
    filled,
    fold,
    funcs_of,
    inputs_of,
    put_input,
    roots_of,
)

import aaccl
from aaccl import ReduceFunction

SUM, MAX = ReduceFunction.SUM, ReduceFunction.MAX
COMPARED = ("allreduce", "allgather")  # results every rank must hold bit for bit


def digest(a: np.ndarray | None) -> str:
    return "" if a is None else hashlib.sha1(np.ascontiguousarray(a).tobytes()).hexdigest()


async def sweep(checks: Checks, accl: aaccl.ACCL, ops: list[str], dtypes: list[Any],
                counts: list[int], seed: int) -> dict[str, str]:
    """Every op x dtype x count x root x function, in the same order on every rank;
    returns digests of the results that must agree across ranks."""
    out: dict[str, str] = {}
    i = 0
    for op in ops:
        for dtype in dtypes:
            for count in counts:
                for root in roots_of(op, accl.size):
                    for func in funcs_of(op):
                        i += 1
                        got = await check_op(accl, op, dtype, count, root, func, seed + i,
                                             omit_unused=bool(i % 2))
                        checks()
                        if op in COMPARED:
                            out[f"{op} {np.dtype(dtype).name} {count} {func}"] = digest(got)
    return out


async def device_resident(checks: Checks, accl: aaccl.ACCL) -> None:
    """Inputs synced by hand and scrambled on the host; results left on the device."""
    for from_fpga, to_fpga in ((True, True), (True, False), (False, True)):
        for op in OPS:
            for count in (5, 301):
                root = roots_of(op, accl.size)[-1]
                for func in funcs_of(op):
                    await check_op(accl, op, np.int32, count, root, func, count + root,
                                   from_fpga=from_fpga, to_fpga=to_fpga)
                    checks()


async def in_place(checks: Checks, accl: aaccl.ACCL) -> dict[str, str]:
    size, out = accl.size, {}
    for dtype in (np.float32, np.int32):
        for count in (1, 301, 1031, 5000):
            for func in (SUM, MAX):
                ins = [inputs_of(r, count, dtype, count) for r in range(size)]
                buf = filled(accl, count, dtype)
                buf[:count] = ins[accl.rank]
                await accl.allreduce(buf, buf, count, func)
                what = f"in-place allreduce {count} {np.dtype(dtype).name} {func.name}"
                assert_result(buf[:count], fold(func, ins), what)
                np.testing.assert_array_equal(device_copy(buf)[count:], SENTINEL, err_msg=what)
                out[what] = digest(np.array(buf))
                checks()
    for count in (1, 7, 301):
        ins = [inputs_of(r, count * size, np.int64, count) for r in range(size)]
        buf = filled(accl, count * size, np.int64)
        buf[:count * size] = ins[accl.rank]
        await accl.alltoall(buf, buf, count)
        want = expected("alltoall", ins, accl.rank, 0, count, None)
        assert want is not None
        assert_result(buf[:count * size], want, f"in-place alltoall {count}")
        checks()
    return out


async def large_allreduce(checks: Checks, accl: aaccl.ACCL) -> dict[str, str]:
    """70 000 float32: reduce-scatter + allgather, many rx buffers and rendezvous."""
    count, size = 70_000, accl.size
    got = await check_op(accl, "allreduce", np.float32, count, 0, SUM, 70)
    buf = accl.allocate(count, np.float32)
    buf[:] = inputs_of(accl.rank, count, np.float32, 9)
    await accl.allreduce(buf, buf, count, MAX)
    assert_result(np.array(buf), fold(MAX, [inputs_of(r, count, np.float32, 9)
                                            for r in range(size)]), "in-place 70 000 MAX")
    checks(2)
    return {"allreduce 70000 SUM": digest(got), "allreduce 70000 MAX": digest(np.array(buf))}


async def barrier_and_local_ops(checks: Checks, accl: aaccl.ACCL) -> None:
    for _ in range(3):
        await accl.barrier()
    checks()
    for dtype in DTYPES:
        for count in (0, 1, 7, 301, 5000):
            a = inputs_of(accl.rank, count, dtype, count)
            b = inputs_of(accl.rank + 10, count, dtype, count)
            src, dst = filled(accl, count, dtype), filled(accl, count, dtype)
            put_input(src, a, from_fpga=False)
            await accl.copy(src, dst, count)
            np.testing.assert_array_equal(dst[:count], a, err_msg=f"copy {count}")
            np.testing.assert_array_equal(dst[count:], SENTINEL)
            for func in (SUM, MAX):
                va, vb, out = (filled(accl, count, dtype) for _ in range(3))
                put_input(va, a, from_fpga=True)
                put_input(vb, b, from_fpga=False)
                await accl.combine(count, func, va, vb, out, val1_from_fpga=True, to_fpga=True)
                np.testing.assert_array_equal(out, SENTINEL)  # to_fpga: host copy untouched
                assert_result(device_copy(out)[:count], fold(func, [a, b]),
                              f"combine {count} {func.name}")
            checks(3)


async def ring(checks: Checks, accl: aaccl.ACCL) -> None:
    """send/recv around the ring in every dtype and size class; with one rank, to self."""
    size, rank = accl.size, accl.rank
    right, left = (rank + 1) % size, (rank - 1) % size
    for dtype in DTYPES:
        for count in (1, 7, 301, 5000):
            mine = inputs_of(rank, count, dtype, 40 + count)
            src = filled(accl, count, dtype)
            src[:count] = mine
            dst = filled(accl, count, dtype)
            sent = accl.send(src, count, right, tag=count)
            await accl.recv(dst, count, left, tag=count)
            await sent
            np.testing.assert_array_equal(dst[:count], inputs_of(left, count, dtype, 40 + count),
                                          err_msg=f"ring {np.dtype(dtype).name} {count}")
            np.testing.assert_array_equal(dst[count:], SENTINEL)
            checks()


async def everything(checks: Checks, accl: aaccl.ACCL) -> dict[str, str]:
    out = await sweep(checks, accl, OPS, DTYPES, [1, 7, 301, 1031], seed=1)
    out.update(await sweep(checks, accl, OPS, [np.float32], [0], seed=5000))
    await device_resident(checks, accl)
    out.update(await in_place(checks, accl))
    if accl.size > 1:
        out.update(await large_allreduce(checks, accl))
    await barrier_and_local_ops(checks, accl)
    await ring(checks, accl)
    return out


async def small_buffers(checks: Checks, accl: aaccl.ACCL) -> dict[str, str]:
    # With 64-byte rx buffers: 8 bytes up to 2.4 KB per message, eager over one rx
    # buffer or several, and rendezvous beyond the eager threshold.
    out = await sweep(checks, accl, OPS, [np.float64], [1, 7, 8, 9, 30, 33, 300], seed=7)
    out.update(await sweep(checks, accl, ["allreduce"], [np.float32], [1537], seed=9))
    await ring(checks, accl)
    return out


def verify(name: str, results: list[dict[str, str]]) -> None:
    for rank, digests in enumerate(results):
        assert digests == results[0], f"rank {rank}'s results differ from rank 0's: " + \
            ", ".join(k for k in digests if digests[k] != results[0].get(k))


if __name__ == "__main__":
    run_suite({"all": everything, "small": small_buffers}, verify)
