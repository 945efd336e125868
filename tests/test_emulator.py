"""aaccl driving ACCL's own emulator (`cclo_emu`: ACCL's firmware and HLS blocks run
on the host), against numpy and against the soft CCLO.

These tests run when AACCL_EMULATOR names a cclo_emu binary (docs/emulator.md says
how to build one); they start and stop the emulator processes themselves. The
emulator is slow (each rank is ~50 busy threads; every packet sleeps 10 ms), so
counts stay small but still cross rx-buffer boundaries.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aaccl
from aaccl import ErrorCode, ReduceFunction
from aaccl.testing._emulator import _free_ports
from conftest import DTYPES
from test_collectives import OPS, REDUCING, ROOTED, assert_result, check_op, fold, inputs_of

EMULATOR = os.environ.get("AACCL_EMULATOR", "")
pytestmark = pytest.mark.skipif(
    not (EMULATOR and os.access(EMULATOR, os.X_OK)),
    reason="set AACCL_EMULATOR to a cclo_emu binary built from Xilinx/ACCL "
           "test/model/emulator to run these (see docs/emulator.md)")
pytest.importorskip("zmq", reason="the emulator device needs pyzmq: pip install 'aaccl[emulator]'")

SUM, MAX = ReduceFunction.SUM, ReduceFunction.MAX
OPTIONS: dict[str, Any] = {"nbufs": 8, "bufsize": 1024, "timeout": 30.0}


@contextlib.contextmanager
def emulator(size: int, protocol: str, logs: Path) -> Iterator[int]:
    """Start `size` cclo_emu ranks; yield their start port once every rank answers."""
    from aaccl.devices._emulator import EmulatorDevice

    port = _free_ports(4 * size)
    procs = []
    try:
        for rank in range(size):
            log = open(logs / f"cclo_emu.{rank}.log", "wb")
            procs.append(subprocess.Popen(
                [EMULATOR, "-s", str(size), "-r", str(rank), "-p", str(port), "-c", protocol,
                 "-l", "0"], stdout=log, stderr=subprocess.STDOUT))
        for rank in range(size):
            EmulatorDevice(rank, port=port, protocol=protocol, connect_timeout=60).close()
        yield port
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def run_both(main: Any, size: int, port: int, protocol: str, **options: Any) -> tuple[list, list]:
    """`main` on the emulator and on the soft CCLO, with the same options."""
    options = {**OPTIONS, **options}
    on_emulator = aaccl.run(main, size, device="emulator", emulator_port=port,
                            emulator_protocol=protocol, **options)
    on_soft = aaccl.run(main, size, **options)
    return on_emulator, on_soft


def assert_same(emulated: list, soft: list, what: str) -> None:
    """Results agree bit for bit, but for float sums, whose order of addition the two
    CCLOs choose differently (each is checked against numpy's bound already)."""
    for rank, (e_rank, s_rank) in enumerate(zip(emulated, soft)):
        for i, (e, s) in enumerate(zip(e_rank, s_rank)):
            if e is None or s is None:
                assert e is None and s is None, f"{what} result {i} rank {rank}"
            elif np.issubdtype(e.dtype, np.floating):
                np.testing.assert_allclose(e, s, rtol=1e-2, atol=1e-2,
                                           err_msg=f"{what} result {i} rank {rank}")
            else:
                np.testing.assert_array_equal(e, s, err_msg=f"{what} result {i} rank {rank}")


@pytest.fixture
def tcp2(tmp_path: Path) -> Iterator[int]:
    """Two fresh TCP ranks per test: a failed test can leave the firmware spinning."""
    with emulator(2, "tcp", tmp_path) as port:
        yield port


EAGER_OPS = [op for op in OPS if op != "alltoall"]  # the firmware's alltoall needs rendezvous


def test_every_collective_matches_numpy_and_the_soft_cclo(tcp2: int) -> None:
    # 7 elements fit in one rx buffer; 300 float32 (1200 bytes) take two segments; 0 is
    # a nop for aaccl (the firmware would wait for a zero-byte receive forever); a bcast
    # from rank 1 of 300 goes one rx buffer at a time (see the next test)
    cases = [(op, count, root, func) for op in EAGER_OPS for count in (7, 300, 0)
             for root in ((0, 1) if op in ROOTED else (0,))
             for func in ((SUM, MAX) if op in REDUCING else (None,))]

    async def main(accl: aaccl.ACCL) -> list:
        return [await check_op(accl, op, np.float32, count, root, func, seed=i)
                for i, (op, count, root, func) in enumerate(cases)]

    assert_same(*run_both(main, 2, tcp2, "tcp"), "collectives")


def test_primitives(tcp2: int) -> None:
    async def main(accl: aaccl.ACCL) -> list:
        out = []
        a, b, c = (accl.allocate(301, np.float32) for _ in range(3))
        a[:], b[:] = inputs_of(accl.rank, 301, np.float32, 1), inputs_of(9, 301, np.float32, 2)
        await accl.nop()
        await accl.copy(a, c, 301)
        np.testing.assert_array_equal(c, a)
        out.append(np.array(c))
        for func in (SUM, MAX):
            await accl.combine(301, func, a, b, c)
            assert_result(np.array(c), fold(func, [np.array(a), np.array(b)]), func.name)
            out.append(np.array(c))
        # eager sends complete before the receive is posted; tags match in order
        peer = 1 - accl.rank
        for tag, count in ((5, 7), (6, 300)):
            msg = accl.allocate(count, np.int32)
            msg[:] = inputs_of(accl.rank * 10 + tag, count, np.int32, 3)
            got = accl.allocate(count, np.int32)
            await accl.send(msg, count, peer, tag=tag)
            await accl.recv(got, count, peer, tag=tag)
            np.testing.assert_array_equal(got, inputs_of(peer * 10 + tag, count, np.int32, 3))
            out.append(np.array(got))
        return out

    assert_same(*run_both(main, 2, tcp2, "tcp"), "primitives")


def test_bcast_from_the_last_rank_over_several_rx_buffers(tcp2: int) -> None:
    """ACCL's firmware (723d8ec) gets this one wrong: the root sends each segment to
    ranks 0..size-1 in turn with a zero-element move for itself, and the next segment's
    MOVE_INCREMENT adds the length of the move before, which from the last rank is that
    zero-length one, so every segment repeats the first. aaccl sends one bcast per rx
    buffer instead (aaccl/driver/_firmware.py)."""
    async def main(accl: aaccl.ACCL) -> list:
        return [await check_op(accl, "bcast", np.float32, count, 1, None, seed=5)
                for count in (300, 1000)]

    assert_same(*run_both(main, 2, tcp2, "tcp"), "bcast from the last rank")


def test_allreduce_counts_whose_ring_leaves_a_chunk_empty(tcp2: int) -> None:
    """1 element on 2 ranks (and 257 float32, a full 1 KiB segment and 1 more) hang
    ACCL's eager ring allreduce (a zero-byte chunk the DMA mover never retires); aaccl
    runs them as an allreduce of the full segments, a reduce and a bcast."""
    cases = [(count, func, dtype) for count in (1, 257, 2, 256) for func in (SUM, MAX)
             for dtype in (np.float32, np.int64)]

    async def main(accl: aaccl.ACCL) -> list:
        return [await check_op(accl, "allreduce", dtype, count, 0, func, seed=i)
                for i, (count, func, dtype) in enumerate(cases)]

    assert_same(*run_both(main, 2, tcp2, "tcp"), "small allreduces")


def test_rendezvous_only_calls_are_refused_clearly(tcp2: int) -> None:
    """ACCL's firmware always runs barrier and alltoall through rendezvous, which the
    emulator's TCP and UDP stacks lack: they fail at once instead of spinning forever."""
    async def main(accl: aaccl.ACCL) -> None:
        buf = accl.allocate(4, np.float32)
        with pytest.raises(aaccl.DeviceError, match="cannot run barrier"):
            await accl.barrier()
        with pytest.raises(aaccl.DeviceError, match="cannot run alltoall"):
            await accl.alltoall(buf, buf, 2)
        await accl.nop()  # the rank stays usable

    aaccl.run(main, 2, device="emulator", emulator_port=tcp2, **OPTIONS)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_dtype(tcp2: int, dtype: Any) -> None:
    cases = [("allreduce", 0, SUM), ("allreduce", 0, MAX), ("reduce", 1, SUM),
             ("bcast", 0, None), ("allgather", 0, None)]

    async def main(accl: aaccl.ACCL) -> list:  # 150 elements: several rx buffers from 8 bytes
        return [await check_op(accl, op, dtype, 150, root, func, seed=i)
                for i, (op, root, func) in enumerate(cases)]

    assert_same(*run_both(main, 2, tcp2, "tcp"), np.dtype(dtype).name)


def to_float16(values: np.ndarray, *, truncate: bool) -> np.ndarray:
    """float32 values through float16 and back: rounded to nearest (numpy, the soft
    CCLO) or truncated toward zero (ACCL's compression lanes in the emulator)."""
    if truncate:  # drop the 13 mantissa bits float16 lacks (normal numbers only)
        values = (values.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)
    return values.astype(np.float16).astype(np.float32)


def test_compression_float32_over_float16(tcp2: int) -> None:
    count = 300  # two rx buffers of float16 on the wire... and of float32 in memory
    data = [inputs_of(r, count, np.float32, 4) for r in range(2)]
    assert np.abs(np.concatenate(data)).min() > 2 ** -14  # normal in float16

    async def main(accl: aaccl.ACCL) -> list:
        peer = 1 - accl.rank
        src, dst = accl.allocate(count, np.float32), accl.allocate(count, np.float32)
        src[:] = data[accl.rank]
        await accl.allreduce(src, dst, count, SUM, compress_dtype=np.float16)
        near = [to_float16(d, truncate=False) for d in data]
        np.testing.assert_allclose(dst, near[0] + near[1], rtol=4e-3, atol=2e-2)
        out = [np.array(dst)]
        await accl.send(src, count, peer, tag=1, compress_dtype=np.float16)
        await accl.recv(dst, count, peer, tag=1, compress_dtype=np.float16)
        out.append(np.array(dst))
        return out

    emulated, soft = run_both(main, 2, tcp2, "tcp")
    for rank in range(2):
        # over the wire in float16: rounded to nearest by the soft CCLO, truncated
        # toward zero by the emulator's compression lanes, one float16 ulp apart at most
        peer = data[1 - rank]
        np.testing.assert_array_equal(soft[rank][1], to_float16(peer, truncate=False))
        np.testing.assert_array_equal(emulated[rank][1], to_float16(peer, truncate=True))
    assert_same(emulated, soft, "compression")


def test_chain_costs_one_await_with_host_resolved_dependencies(tcp2: int) -> None:
    async def main(accl: aaccl.ACCL) -> list:
        a, b, c = (accl.allocate(50, np.int64) for _ in range(3))
        a[:] = np.arange(50) * (accl.rank + 1)
        first = accl.copy(a, b, 50, to_fpga=True)
        second = accl.allreduce(b, c, 50, SUM, from_fpga=True, to_fpga=True, waitfor=[first])
        third = accl.bcast(c, 50, root=1, from_fpga=True, waitfor=[second])
        await third
        assert first.done() and second.done()
        np.testing.assert_array_equal(c, np.arange(50) * 3)
        return [np.array(c)]

    assert_same(*run_both(main, 2, tcp2, "tcp"), "chain")


def test_udp_stack(tmp_path: Path) -> None:
    async def main(accl: aaccl.ACCL) -> list:
        return [await check_op(accl, op, np.float32, 300, 0, func, seed=i)
                for i, (op, func) in enumerate([("allreduce", SUM), ("bcast", None),
                                                ("gather", None)])]

    with emulator(2, "udp", tmp_path) as port:
        assert_same(*run_both(main, 2, port, "udp"), "udp")


def test_three_ranks(tmp_path: Path) -> None:
    cases = [(op, root, SUM if op in REDUCING else None, 11) for op in EAGER_OPS
             for root in ((0, 2) if op in ROOTED else (0,))]
    # counts whose last ring segment leaves a chunk empty on 3 ranks (1, 2, 4, and one
    # int32 past 255, the full segment), and a bcast from the last rank in 2 segments
    cases += [("allreduce", 0, SUM, n) for n in (1, 2, 4, 256)] + [("bcast", 2, None, 300)]

    async def main(accl: aaccl.ACCL) -> list:
        return [await check_op(accl, op, np.int32, count, root, func, seed=i)
                for i, (op, root, func, count) in enumerate(cases)]

    with emulator(3, "tcp", tmp_path) as port:
        assert_same(*run_both(main, 3, port, "tcp"), "three ranks")


def test_missing_peer_times_out_then_the_device_says_it_is_stuck(tmp_path: Path) -> None:
    async def main(accl: aaccl.ACCL) -> None:
        if accl.rank == 1:
            return  # never sends
        buf = accl.allocate(8, np.float32)
        started = time.monotonic()
        recv = accl.recv(buf, 8, 1, tag=3)
        after = accl.copy(buf, buf, 8, waitfor=[recv])
        with pytest.raises(aaccl.CCLOError) as failed:
            await recv
        assert failed.value.code == ErrorCode.RECEIVE_TIMEOUT_ERROR
        assert time.monotonic() - started < 2 + 5  # the timeout, plus slack
        with pytest.raises(aaccl.DependencyError):
            await after
        with pytest.raises(aaccl.DeviceStuck, match="restart cclo_emu"):
            await accl.nop()

    with emulator(2, "tcp", tmp_path) as port:
        aaccl.run(main, 2, device="emulator", emulator_port=port, nbufs=4, timeout=2.0)


def test_no_emulator_is_a_prompt_clear_error() -> None:
    port = _free_ports(8)
    started = time.monotonic()
    with pytest.raises(Exception, match="no ACCL emulator answers at tcp://127.0.0.1"):
        aaccl.run(lambda accl: accl.nop(), 2, device="emulator", emulator_port=port)
    assert time.monotonic() - started < 15


def test_python_kernels_and_transfers_between_firmware_calls(tcp2: int) -> None:
    """Upload, a kernel on staged device memory, the firmware's allreduce, a kernel,
    a download: one chain, one await."""
    count = 300

    def scale(x: np.ndarray, factor: int) -> None:
        x *= factor

    async def main(accl: aaccl.ACCL) -> list:
        src, dst = accl.allocate(count, np.int32), accl.allocate(count, np.int32)
        src[:] = np.arange(count) + accl.rank
        kernel = accl.kernel(scale)
        up = accl.sync_to_device(src)
        doubled = kernel(src, 2, waitfor=[up])
        summed = accl.allreduce(src, dst, count, SUM, from_fpga=True, to_fpga=True,
                                waitfor=[doubled])
        tripled = kernel(dst, 3, waitfor=[summed])
        await accl.sync_from_device(dst, waitfor=[tripled])
        np.testing.assert_array_equal(dst, 3 * 2 * (2 * np.arange(count) + 1))
        return [np.array(dst)]

    assert_same(*run_both(main, 2, tcp2, "tcp"), "kernels")


def test_mixed_precision_copy_and_combine(tcp2: int) -> None:
    """OP0/OP1/RES_COMPRESSED on the real firmware: float32 into float16 and back."""
    count = 300
    data = inputs_of(0, count, np.float32, 4)

    async def main(accl: aaccl.ACCL) -> list:
        a = accl.allocate(count, np.float32)
        half, back = accl.allocate(count, np.float16), accl.allocate(count, np.float32)
        total = accl.allocate(count, np.float16)
        a[:] = data
        await accl.copy(a, half, count)
        await accl.copy(half, back, count)
        await accl.combine(count, SUM, a, a, total)
        return [np.array(half), np.array(back), np.array(total)]

    emulated, soft = run_both(main, 1, tcp2, "tcp")
    h = data.astype(np.float16)
    np.testing.assert_array_equal(soft[0][0], h)
    np.testing.assert_array_equal(soft[0][2], h + h)
    for e, t in ((emulated[0][0], True), (emulated[0][1], True)):  # the lanes truncate
        np.testing.assert_array_equal(e.astype(np.float16), to_float16(data, truncate=t))
    np.testing.assert_allclose(emulated[0][2], h + h, rtol=2e-3)


def test_pyaccl_compat_on_the_emulator(tcp2: int) -> None:
    """aaccl.compat with pyaccl's sim_sock drives the emulator from one thread in turn,
    as pyaccl's primitives notebook does."""
    from aaccl.compat import ACCLReduceFunctions, accl

    ranks = [accl(2, i, sim_mode=True, sim_sock=f"tcp://localhost:{tcp2 + i}")
             for i in range(2)]
    try:
        src, dst = ranks[0].allocate((10,)), ranks[1].allocate((10,))
        src[:] = np.arange(10)
        ranks[0].send(src, len(src), 1, tag=0)
        ranks[1].recv(dst, len(dst), 0, tag=0)
        np.testing.assert_array_equal(dst, np.arange(10))
        result = ranks[0].allocate((10,))
        ranks[0].combine(10, ACCLReduceFunctions.SUM, src, src, result)
        np.testing.assert_array_equal(result, 2 * np.arange(10))
        ranks[0].communicators[0].readback()
        assert ranks[0].communicators[0].ranks[1]["outbound_seq_number"] == 1
    finally:
        for r in ranks:
            r.deinit()
