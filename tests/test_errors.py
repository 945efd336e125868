"""Errors: ACCL's error bits, CCLOError and DependencyError, and ranks that stay
usable after calls fail on the device."""

from __future__ import annotations

import enum
import pickle
import time

import anyio
import numpy as np
import pytest

import aaccl
from aaccl import (ACCLError, CCLOError, CompressionFlags, DependencyError, ErrorCode,
                   ReduceFunction, StreamFlags)
from aaccl import _exchmem as xm
from aaccl._constants import ConfigFunction, Scenario

TIMEOUT = 0.2

# driver/xrt/include/accl/constants.hpp, enum class errorCode
ACCL_ERROR_BITS = {
    "DMA_MISMATCH_ERROR": 0,
    "DMA_INTERNAL_ERROR": 1,
    "DMA_DECODE_ERROR": 2,
    "DMA_SLAVE_ERROR": 3,
    "DMA_NOT_OKAY_ERROR": 4,
    "DMA_NOT_END_OF_PACKET_ERROR": 5,
    "DMA_NOT_EXPECTED_BTT_ERROR": 6,
    "DMA_TIMEOUT_ERROR": 7,
    "CONFIG_SWITCH_ERROR": 8,
    "DEQUEUE_BUFFER_TIMEOUT_ERROR": 9,
    "DEQUEUE_BUFFER_SPARE_BUFFER_STATUS_ERROR": 10,
    "RECEIVE_TIMEOUT_ERROR": 11,
    "DEQUEUE_BUFFER_SPARE_BUFFER_DMATAG_MISMATCH": 12,
    "DEQUEUE_BUFFER_SPARE_BUFFER_INDEX_ERROR": 13,
    "COLLECTIVE_NOT_IMPLEMENTED": 14,
    "RECEIVE_OFFCHIP_SPARE_BUFF_ID_NOT_VALID": 15,
    "EAGER_THRESHOLD_INVALID": 16,
    "RENDEZVOUS_THRESHOLD_INVALID": 17,
    "DMA_SIZE_ERROR": 18,
    "ARITH_ERROR": 19,
    "PACK_TIMEOUT_STS_ERROR": 20,
    "PACK_SEQ_NUMBER_ERROR": 21,
    "COMPRESSION_ERROR": 22,
    "KRNL_TIMEOUT_STS_ERROR": 23,
    "KRNL_STS_COUNT_ERROR": 24,
    "SEGMENTER_EXPECTED_BTT_ERROR": 25,
    "DMA_TAG_MISMATCH_ERROR": 26,
}


# -- ACCL's numbers -------------------------------------------------------------------

def test_error_code_bits_match_accl() -> None:
    members = {name: int(code) for name, code in ErrorCode.__members__.items()}
    assert members.pop("COLLECTIVE_OP_SUCCESS") == 0
    assert members == {name: 1 << bit for name, bit in ACCL_ERROR_BITS.items()}
    assert issubclass(ErrorCode, enum.IntFlag)
    assert ErrorCode.RECEIVE_TIMEOUT_ERROR == 1 << 11
    assert ErrorCode.DMA_TAG_MISMATCH_ERROR == 1 << 26
    assert ErrorCode.COLLECTIVE_NOT_IMPLEMENTED == 0x4000


def test_enums_match_accl() -> None:
    assert aaccl.TAG_ANY == 0xFFFFFFFF
    assert aaccl.GLOBAL_COMM == 0
    assert {f.name: int(f) for f in ReduceFunction} == {"SUM": 0, "MAX": 1}
    assert {f.name: int(f) for f in StreamFlags} == {"OP0_STREAM": 1, "RES_STREAM": 2}
    assert StreamFlags.NO_STREAM == 0
    assert {f.name: int(f) for f in CompressionFlags} == {
        "OP0_COMPRESSED": 1, "OP1_COMPRESSED": 2, "RES_COMPRESSED": 4, "ETH_COMPRESSED": 8}
    assert CompressionFlags.NO_COMPRESSION == 0
    assert {s.name.lower(): int(s) for s in Scenario} == {
        "config": 0, "copy": 1, "combine": 2, "send": 3, "recv": 4, "bcast": 5, "scatter": 6,
        "gather": 7, "reduce": 8, "allgather": 9, "allreduce": 10, "reduce_scatter": 11,
        "barrier": 12, "alltoall": 13, "nop": 255}
    assert [(f.name.lower(), int(f)) for f in ConfigFunction] == [
        ("reset_periph", 0), ("enable_pkt", 1), ("set_timeout", 2),
        ("set_max_eager_msg_size", 3), ("set_max_rendezvous_msg_size", 4)]


# -- CCLOError --------------------------------------------------------------------------

def test_error_hierarchy() -> None:
    assert issubclass(CCLOError, ACCLError)
    assert issubclass(DependencyError, ACCLError)
    assert issubclass(ACCLError, Exception)
    assert not issubclass(CCLOError, DependencyError)


@pytest.mark.parametrize("bits", [
    [ErrorCode.RECEIVE_TIMEOUT_ERROR],
    [ErrorCode.DMA_MISMATCH_ERROR, ErrorCode.DMA_TAG_MISMATCH_ERROR],
    [ErrorCode.DMA_DECODE_ERROR, ErrorCode.ARITH_ERROR, ErrorCode.COMPRESSION_ERROR,
     ErrorCode.RECEIVE_TIMEOUT_ERROR],
    list(ErrorCode.__members__.values())[1:],  # every bit at once
])
def test_cclo_error_names_every_bit(bits: list[ErrorCode]) -> None:
    code = 0
    for bit in bits:
        code |= int(bit)
    error = CCLOError("allreduce (rank 3, call 7)", code)
    assert type(error.code) is ErrorCode
    assert isinstance(error.code, enum.IntFlag)
    assert error.code == code
    assert error.operation == "allreduce (rank 3, call 7)"
    message = str(error)
    assert "allreduce (rank 3, call 7)" in message
    assert f"{code:#x}" in message
    named = {name for name in ACCL_ERROR_BITS if name in message.replace(",", " ").split()}
    assert named == {bit.name for bit in bits}
    for bit in bits:
        assert bit in error.code
    assert error.code.names() == sorted((b.name for b in bits), key=lambda n: ACCL_ERROR_BITS[n])


def test_cclo_error_unknown_bits() -> None:
    code = (1 << 30) | (1 << 27) | int(ErrorCode.RECEIVE_TIMEOUT_ERROR)
    error = CCLOError("x", code)
    assert isinstance(error.code, ErrorCode)
    assert int(error.code) == code
    message = str(error)
    assert "RECEIVE_TIMEOUT_ERROR" in message
    assert hex((1 << 30) | (1 << 27)) in message  # the bits ACCL does not define, in hex
    assert f"{code:#x}" in message
    only_unknown = CCLOError("x", 1 << 31)
    assert int(only_unknown.code) == 1 << 31
    assert hex(1 << 31) in str(only_unknown)
    assert not any(name in str(only_unknown) for name in ACCL_ERROR_BITS)


def test_cclo_error_accepts_error_codes_and_pickles() -> None:
    code = ErrorCode.DMA_SIZE_ERROR | ErrorCode.ARITH_ERROR
    error = CCLOError("reduce", code)
    assert error.code == code
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is CCLOError
    assert again.code == code and type(again.code) is ErrorCode
    assert again.operation == "reduce"
    assert str(again) == str(error)


def test_cclo_error_zero_code() -> None:
    error = CCLOError("nop", 0)
    assert error.code == ErrorCode.COLLECTIVE_OP_SUCCESS
    assert "DMA" not in str(error)


# -- device-side failures -----------------------------------------------------------------

def rx_buffers_in_use(accl: aaccl.ACCL) -> list[int]:
    """Indices of the rank's eager rx buffers whose exchange-memory status is not idle."""
    dev = accl._driver.device
    n = dev.mmio_read(xm.NUM_RX_BUFS)
    return [i for i in range(n)
            if dev.mmio_read(xm.RX_RECORDS + 4 * xm.RxBuffer.WORDS * i) != xm.RxBuffer.IDLE]


async def expect_cclo_error(call: aaccl.Call, code: ErrorCode) -> CCLOError:
    with pytest.raises(CCLOError) as info:
        await call
    assert info.value.code == code
    assert call.done()
    assert call.exception() is info.value
    return info.value


async def check_usable(accls: list[aaccl.ACCL]) -> None:
    """Every rank still runs collectives and point-to-point traffic correctly, and no
    eager rx buffer is left holding a message nobody will take."""
    n = len(accls)
    srcs = [a.allocate(6) for a in accls]
    dsts = [a.allocate(6) for a in accls]
    for a, s in zip(accls, srcs):
        s[:] = np.arange(6) * (a.rank + 1)
    calls = [a.allreduce(s, d, 6, ReduceFunction.SUM) for a, s, d in zip(accls, srcs, dsts)]
    for call in calls:
        await call
    for d in dsts:
        np.testing.assert_array_equal(d, np.arange(6) * sum(range(1, n + 1)))
    # eager sends complete before their receives are posted: around the ring
    for a, s in zip(accls, srcs):
        await a.send(s, 6, (a.rank + 1) % n, tag=5)
    for a, d in zip(accls, dsts):
        await a.recv(d, 6, (a.rank - 1) % n, tag=5)
        np.testing.assert_array_equal(d, np.arange(6) * ((a.rank - 1) % n + 1))
    for a in accls:
        assert rx_buffers_in_use(a) == []


@pytest.mark.anyio
async def test_reading_an_empty_kernel_stream_fails_on_soft_cclo() -> None:
    async with aaccl.open_world(2, timeout=TIMEOUT) as accls:
        a, b = accls
        src, dst = a.allocate(4), a.allocate(4)
        src[:] = [1, 2, 3, 4]
        error = await expect_cclo_error(a.copy(src, dst, 4, stream_flags=StreamFlags.OP0_STREAM),
                                        ErrorCode.KRNL_TIMEOUT_STS_ERROR)
        assert "KRNL_TIMEOUT_STS_ERROR" in str(error)
        assert "copy" in str(error) and "kernel stream" in str(error)
        np.testing.assert_array_equal(dst, 0)
        await a.copy(src, dst, 4)
        np.testing.assert_array_equal(dst, [1, 2, 3, 4])
        await check_usable(accls)


@pytest.mark.anyio
async def test_failed_send_and_recv_leave_no_trace() -> None:
    """A send or receive that fails before moving data gives back its place in the
    message order: the next messages between the pair still match."""
    async with aaccl.open_world(2, timeout=TIMEOUT) as accls:
        a, b = accls
        src, dst = a.allocate(4), b.allocate(4)
        src[:] = 5
        # a send whose data never comes from the (empty) kernel stream, and a receive
        # with nothing to take: each times out
        await expect_cclo_error(a.send(src, 4, 1, stream_flags=StreamFlags.OP0_STREAM),
                                ErrorCode.KRNL_TIMEOUT_STS_ERROR)
        await expect_cclo_error(b.recv(dst, 4, 0, stream_flags=StreamFlags.RES_STREAM),
                                ErrorCode.RECEIVE_TIMEOUT_ERROR)
        await a.send(src, 4, 1)
        await b.recv(dst, 4, 0)
        np.testing.assert_array_equal(dst, 5)
        await check_usable(accls)


@pytest.mark.anyio
async def test_recv_without_sender_times_out() -> None:
    async with aaccl.open_world(2, timeout=TIMEOUT) as accls:
        a, b = accls
        dst = b.allocate(4)
        start = time.monotonic()
        error = await expect_cclo_error(b.recv(dst, 4, 0), ErrorCode.RECEIVE_TIMEOUT_ERROR)
        elapsed = time.monotonic() - start
        assert TIMEOUT * 0.9 <= elapsed < TIMEOUT + 5
        assert "RECEIVE_TIMEOUT_ERROR" in str(error) and "recv" in str(error)
        # a message sent after the receive gave up is taken by the next receive
        src = a.allocate(4)
        src[:] = 9
        await a.send(src, 4, 1)
        await b.recv(dst, 4, 0)
        np.testing.assert_array_equal(dst, 9)
        await check_usable(accls)


@pytest.mark.anyio
@pytest.mark.parametrize("count", [4, 3000])  # eager, rendezvous
@pytest.mark.parametrize("collective", ["bcast", "allreduce", "gather", "barrier"])
async def test_collective_without_peer_times_out(collective: str, count: int) -> None:
    """Rank 0 never joins; the others fail with RECEIVE_TIMEOUT_ERROR after the
    timeout. Collectives match in order, so the ranks are back in step once rank 0
    makes its (late) call; after that, everything works and no rx buffer leaks. (On
    the RDMA stack, where 3000 elements go rendezvous.)"""
    async with aaccl.open_world(3, timeout=TIMEOUT, stack="rdma") as accls:
        srcs = [a.allocate(3 * count) for a in accls]
        dsts = [a.allocate(3 * count) for a in accls]

        def call(a: aaccl.ACCL) -> aaccl.Call:
            s, d = srcs[a.rank], dsts[a.rank]
            if collective == "bcast":
                return a.bcast(s, count, root=0)
            if collective == "allreduce":
                return a.allreduce(s, d, count, ReduceFunction.SUM)
            if collective == "gather":
                return a.gather(s, d, count, root=1)
            return a.barrier()

        start = time.monotonic()
        lonely = [call(a) for a in accls[1:]]
        for rank, c in enumerate(lonely, 1):
            if collective == "gather" and rank != 1 and count == 4:
                await c  # a non-root gather rank only sends: eagerly, it does not wait
            else:
                await expect_cclo_error(c, ErrorCode.RECEIVE_TIMEOUT_ERROR)
        assert time.monotonic() - start >= TIMEOUT * 0.9
        late = call(accls[0])
        try:
            await late  # it may find all it needs (eager messages) or time out itself
        except CCLOError as error:
            assert error.code == ErrorCode.RECEIVE_TIMEOUT_ERROR
        await check_usable(accls)


@pytest.mark.anyio
async def test_a_meeting_that_times_out_names_the_missing_rank_on_every_rank() -> None:
    """In process, a small allreduce meets in shared memory under one deadline: every
    waiting rank fails at it, each naming the rank that never came (not the others
    that gave up at the same deadline), and the next allreduce of all ranks is right."""
    async with aaccl.open_world(4, timeout=TIMEOUT) as accls:
        bufs = [(a.allocate(1), a.allocate(1)) for a in accls]
        start = time.monotonic()
        waiting = [a.allreduce(s, d, 1, ReduceFunction.SUM) for a, (s, d) in
                   zip(accls[1:], bufs[1:])]
        for c in waiting:
            with pytest.raises(CCLOError, match=r"waited .* for rank 0;") as failed:
                await c
            assert failed.value.code & ErrorCode.RECEIVE_TIMEOUT_ERROR
        assert TIMEOUT * 0.9 <= time.monotonic() - start < TIMEOUT + 5
        with pytest.raises(ACCLError):  # it comes late: its peers gave up on it
            await accls[0].allreduce(*bufs[0], 1, ReduceFunction.SUM)
        for a, (s, _) in zip(accls, bufs):
            s[:] = a.rank + 1
        await anyio_all([a.allreduce(s, d, 1, ReduceFunction.SUM) for a, (s, d) in
                         zip(accls, bufs)])
        assert [float(d[0]) for _, d in bufs] == [10.0] * 4


async def anyio_all(calls: list[aaccl.Call]) -> None:
    for c in calls:
        await c


@pytest.mark.anyio
@pytest.mark.parametrize("count", [4, 3000])  # eager, rendezvous
async def test_root_alone_in_a_collective(count: int) -> None:
    """The root of a bcast whose peers never join: eager sends complete, rendezvous
    sends fail with RECEIVE_TIMEOUT_ERROR once the timeout passes (and never hang).
    (On the RDMA stack, where 3000 elements go rendezvous.)"""
    async with aaccl.open_world(3, timeout=TIMEOUT, stack="rdma") as accls:
        buf = accls[0].allocate(count)
        start = time.monotonic()
        call = accls[0].bcast(buf, count, root=0)
        if count == 4:
            await call
        else:
            await expect_cclo_error(call, ErrorCode.RECEIVE_TIMEOUT_ERROR)
            assert TIMEOUT * 0.9 <= time.monotonic() - start < TIMEOUT + 5
        # the peers' late calls find the data (eager) or time out (withdrawn rendezvous)
        late = [a.bcast(a.allocate(count), count, root=0) for a in accls[1:]]
        for c in late:
            if count == 4:
                await c
            else:
                await expect_cclo_error(c, ErrorCode.RECEIVE_TIMEOUT_ERROR)
        await check_usable(accls)


@pytest.mark.anyio
async def test_dependency_error_chain() -> None:
    async with aaccl.open_world(2, timeout=TIMEOUT) as accls:
        a, b = accls
        src, mid, dst = a.allocate(4), a.allocate(4), a.allocate(4)
        src[:] = 3
        failing = a.copy(src, mid, 4, stream_flags=StreamFlags.OP0_STREAM)  # nothing to read
        second = a.copy(mid, dst, 4, from_fpga=True, waitfor=[failing])
        third = a.nop(waitfor=[second])
        await expect_cclo_error(failing, ErrorCode.KRNL_TIMEOUT_STS_ERROR)
        for dependent in (second, third):
            with pytest.raises(DependencyError) as info:
                await dependent
            assert dependent.done()
            assert isinstance(info.value, ACCLError)
            assert not isinstance(info.value, CCLOError)
        np.testing.assert_array_equal(dst, 0)  # the copy never ran
        # independent calls of the same rank were never affected
        await a.copy(src, dst, 4)
        np.testing.assert_array_equal(dst, 3)
        await check_usable(accls)


# (the bcast reads on the host what the failing recv was to write: on purpose)
@pytest.mark.filterwarnings("ignore:this .* reads its input from host memory:RuntimeWarning")
@pytest.mark.anyio
async def test_collective_chained_to_failed_call() -> None:
    """A collective that waits for a failed call never runs on that rank; its peers'
    parts are aborted as soon as it gives up, or as soon as they are made (a notice,
    not their timeout), and the ranks are still in step for the next collective."""
    async with aaccl.open_world(2, timeout=TIMEOUT) as accls:
        a, b = accls
        dst = b.allocate(4)
        failing = b.recv(dst, 4, 0)  # rank 0 never sends
        chained = b.bcast(dst, 4, root=1, waitfor=[failing])
        await expect_cclo_error(failing, ErrorCode.RECEIVE_TIMEOUT_ERROR)
        with pytest.raises(DependencyError) as info:
            await chained
        assert isinstance(info.value.__cause__, CCLOError)
        # made after rank 1 gave up: it learns at once (rank 1's notice waited for it)
        with anyio.fail_after(TIMEOUT / 2):
            with pytest.raises(aaccl.Aborted, match="rank 1's bcast.*did not run"):
                await a.bcast(a.allocate(4), 4, root=1)
        await check_usable(accls)
