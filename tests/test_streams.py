"""Kernel streams on the soft CCLO (OP0_STREAM, RES_STREAM), against numpy.

A rank's CCLO has a stream out to its kernels and a stream in from them; by default
they form a loopback, as in ACCL's emulator: what a call writes with RES_STREAM, a
call with OP0_STREAM reads back. `ACCL.attach_stream` puts a Python kernel between
them. The firmware's rules (which calls take which flags, one packet per segment,
reads in whole 64-byte words, a send's RES_STREAM landing in the peer's stream) are
checked against ACCL's sources as read in aaccl/soft/_streams.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import aaccl
from aaccl import CCLOError, ErrorCode, KernelError, ReduceFunction, StreamFlags
from aaccl._constants import Scenario
from aaccl.devices import DeviceCall
from aaccl.soft._streams import WORD, StreamPorts, segments, stream_roles
from aaccl.soft.fabric import Inbox, Message
from conftest import run_ranks

OP0, RES = StreamFlags.OP0_STREAM, StreamFlags.RES_STREAM
BOTH = OP0 | RES
SUM = ReduceFunction.SUM
TIMEOUT = 5.0  # for waits that end by themselves
SHORT = 0.3  # for waits that are to time out
N = 700  # float32: 2800 bytes, three segments of a 1024-byte rx buffer


def values(rank: int, n: int = N, dtype: Any = np.float32) -> np.ndarray:
    return (np.arange(n) % 251 + 1000 * rank).astype(dtype)


def filled(accl: aaccl.ACCL, data: np.ndarray) -> aaccl.Buffer:
    buf = accl.allocate(data.shape, data.dtype)
    buf[:] = data
    return buf


async def drain(accl: aaccl.ACCL, n: int, dtype: Any = np.float32) -> np.ndarray:
    """Read n elements from the rank's kernel stream into memory."""
    dtype_of, dst = accl.allocate(1, dtype), accl.allocate(n, dtype)
    await accl.copy(dtype_of, dst, n, stream_flags=OP0)
    return np.array(dst)


async def load(accl: aaccl.ACCL, data: np.ndarray) -> None:
    """Write `data` to the rank's kernel stream (one packet)."""
    await accl.copy(filled(accl, data), accl.allocate(1, data.dtype), data.size,
                    stream_flags=RES)


# -- the firmware's rules, without a CCLO ------------------------------------------------

@pytest.mark.parametrize(("scenario", "flags", "size", "is_root", "roles"), [
    (Scenario.COPY, BOTH, 1, True, (True, True)),
    (Scenario.COMBINE, OP0, 1, True, (True, False)),
    (Scenario.SEND, RES, 2, False, (False, True)),  # into the peer's stream
    (Scenario.RECV, BOTH, 2, False, (False, True)),  # a receive reads no operand
    (Scenario.REDUCE, BOTH, 3, True, (True, True)),
    (Scenario.REDUCE, BOTH, 3, False, (True, False)),  # only the root has a result
    (Scenario.ALLREDUCE, BOTH, 1, True, (True, True)),  # one rank: the firmware copies
    (Scenario.ALLREDUCE, BOTH, 2, True, (False, False)),  # ignored: works in memory
    (Scenario.ALLTOALL, BOTH, 1, True, (True, True)),
    (Scenario.ALLTOALL, OP0, 2, True, None),  # COLLECTIVE_NOT_IMPLEMENTED
    (Scenario.BCAST, OP0, 2, True, (False, False)),
    (Scenario.NOP, BOTH, 1, True, (False, False)),
    (Scenario.COPY, 0, 1, True, (False, False)),
])
def test_which_calls_take_which_flags(scenario: Scenario, flags: int, size: int, is_root: bool,
                                      roles: tuple[bool, bool] | None) -> None:
    assert stream_roles(scenario, flags, size, is_root) == roles


def test_segments_of_a_message() -> None:
    assert segments(2800, 1024) == [1024, 1024, 752]
    assert segments(1024, 1024) == [1024]
    assert segments(0, 1024) == []
    assert sum(segments(12345, 100)) == 12345


class Ports:
    """StreamPorts whose kernel runs inline and whose events run at once."""

    def __init__(self) -> None:
        self.ports = StreamPorts(self._run, lambda fn, *args: fn(*args))

    @staticmethod
    def _run(job: Callable[[], None], waitfor: Any) -> DeviceCall:
        call = DeviceCall(None)
        try:
            job()
        except Exception as error:
            call.complete(error=error)
        else:
            call.complete()
        return call


def test_reads_take_whole_words_and_drop_the_rest() -> None:
    ports = Ports().ports
    first, second = np.arange(20, dtype=np.float32), np.arange(100, 110, dtype=np.float32)
    ports.emit(first, 0)  # 80 bytes: two words, the second padded
    ports.emit(second, 0)  # 40 bytes: one word
    assert ports.held == 3 * WORD
    five = ports.read([5 * 4])  # one word: elements 0..15, of which it keeps 5
    assert five.done
    np.testing.assert_array_equal(five.value.view(np.float32), first[:5])
    rest = ports.read([4 * 4])  # the next word: elements 16..19 of the first packet
    np.testing.assert_array_equal(rest.value.view(np.float32), first[16:])
    np.testing.assert_array_equal(ports.read([40]).value.view(np.float32), second)
    assert ports.held == 0


def test_a_read_waits_for_enough_words_in_order() -> None:
    ports = Ports().ports
    a, b = ports.read([64]), ports.read([8])
    assert not a.done and not b.done
    ports.emit(np.arange(2, dtype=np.int64), 0)  # one word: not the first reader's two
    assert a.done and not b.done  # 16 bytes fill one 64-byte word: a read takes it
    ports.emit(np.array([7], np.int64), 0)
    assert b.done and b.value.view(np.int64)[0] == 7
    expired = ports.read([64])
    assert expired.expire() and ports.read([8]) is not expired


def test_moves_each_take_their_own_words() -> None:
    """A send from the stream reads it one segment at a time (each in whole words)."""
    ports = Ports().ports
    data = np.arange(48, dtype=np.int32)  # 192 bytes: three words
    ports.emit(data, 0)
    got = ports.read([40, 40]).value.view(np.int32)  # two moves of 10 elements
    np.testing.assert_array_equal(got, np.concatenate([data[:10], data[16:26]]))


def test_a_kernel_sees_each_packet_with_its_tag_and_returns_the_next() -> None:
    ports = Ports().ports
    seen: list[tuple[np.ndarray, int]] = []

    def kernel(chunk: np.ndarray, tag: int) -> np.ndarray | None:
        seen.append((chunk.copy(), tag))
        return None if tag == 3 else chunk * 3

    ports.attach(kernel, "triple")
    ports.emit(np.arange(4, dtype=np.float64), 0x1_05)  # TDEST keeps the low 8 bits
    ports.emit(np.arange(4, dtype=np.float64), 3)  # a sink: nothing comes back
    assert [tag for _, tag in seen] == [5, 3]
    assert ports.held == WORD
    np.testing.assert_array_equal(ports.read([32]).value.view(np.float64), np.arange(4) * 3)


def test_puts_that_come_before_the_cclo_are_kept_for_it() -> None:
    """Over MPI a peer may start first: its put into our stream (a send with
    RES_STREAM) waits in the inbox, acknowledged, until our CCLO takes its stream."""
    payload = np.arange(4, dtype=np.float32)
    msg = Message(1, ("stream",), 0, 9, payload.view(np.uint8), eager=True)
    acknowledged: list[bool] = []
    msg.on_done = lambda: acknowledged.append(True)
    inbox = Inbox()
    assert inbox.deliver(msg) and acknowledged == [True]
    payload[:] = -1  # the sender's memory is its own again: the inbox kept a copy
    taken: list[Message] = []
    inbox.stream_to(taken.append)
    assert taken == [msg] and msg.payload is not None
    np.testing.assert_array_equal(msg.payload.view(np.float32), np.arange(4))


# -- on the soft CCLO ----------------------------------------------------------------------

@pytest.mark.anyio
async def test_copy_to_the_stream_and_back_through_the_loopback() -> None:
    async with aaccl.open_world(1, timeout=TIMEOUT) as (accl,):
        src, dst = filled(accl, values(0)), accl.allocate(N)
        dst[:] = -1
        await accl.copy(src, dst, N, stream_flags=RES)
        np.testing.assert_array_equal(dst, -1)  # the result went to the stream, not dst
        src[:] = -2  # and the source buffer is not read when OP0 is on the stream
        await accl.copy(src, dst, N, stream_flags=OP0)
        np.testing.assert_array_equal(dst, values(0))
        np.testing.assert_array_equal(src, -2)
        # stream to stream: the loopback turns it around once more
        await load(accl, values(1, 64))
        await accl.copy(src, dst, 64, stream_flags=BOTH)
        np.testing.assert_array_equal(await drain(accl, 64), values(1, 64))


@pytest.mark.anyio
async def test_combine_reads_val1_from_the_stream_and_writes_the_result_to_it() -> None:
    async with aaccl.open_world(1, timeout=TIMEOUT) as (accl,):
        a, b = values(0, 300, np.int32), values(1, 300, np.int32)
        await load(accl, a)
        dtype_of = accl.allocate(1, np.int32)
        await accl.combine(300, ReduceFunction.MAX, dtype_of, filled(accl, b), dtype_of,
                           stream_flags=BOTH)
        np.testing.assert_array_equal(await drain(accl, 300, np.int32), np.maximum(a, b))


@pytest.mark.anyio
async def test_a_receive_into_the_stream_then_a_copy_drains_it() -> None:
    """pyaccl's pattern: send from memory, receive into the kernel stream, copy out."""
    async with aaccl.open_world(2, timeout=TIMEOUT) as accls:
        seen: list[tuple[int, int]] = []

        def record(chunk: np.ndarray, tag: int) -> np.ndarray:
            seen.append((chunk.size, tag))
            return chunk

        accls[1].attach_stream(accls[1].kernel(record))  # a Kernel works as well as a callable

        async def rank(accl: aaccl.ACCL) -> np.ndarray | None:
            if accl.rank == 0:
                await accl.send(filled(accl, values(0)), N, 1, tag=5)
                return None
            await accl.recv(accl.allocate(1), N, 0, tag=5, stream_flags=RES)
            return await drain(accl, N)

        _, got = await run_ranks(accls, rank)
        np.testing.assert_array_equal(got, values(0))
        assert seen == [(256, 5), (256, 5), (188, 5)]  # one packet per rx buffer's worth


@pytest.mark.anyio
async def test_a_send_with_res_stream_puts_into_the_peers_stream() -> None:
    """One-sided: no receive takes it, and it takes no place in the message order."""
    async with aaccl.open_world(2, timeout=TIMEOUT) as accls:
        tags: list[int] = []

        accls[1].attach_stream(lambda chunk, tag: tags.append(tag) or chunk)

        async def rank(accl: aaccl.ACCL) -> tuple[np.ndarray, np.ndarray] | None:
            if accl.rank == 0:
                await accl.send(filled(accl, values(0)), N, 1, tag=42, stream_flags=RES)
                await accl.send(filled(accl, values(2, 8)), 8, 1, tag=42)  # a plain one after
                return None
            plain = accl.allocate(8)
            await accl.recv(plain, 8, 0, tag=42)
            return await drain(accl, N), np.array(plain)

        _, (put, plain) = await run_ranks(accls, rank)
        np.testing.assert_array_equal(put, values(0))
        np.testing.assert_array_equal(plain, values(2, 8))
        assert tags == [42, 42, 42]


@pytest.mark.anyio
async def test_a_send_takes_its_data_from_the_stream() -> None:
    async with aaccl.open_world(2, timeout=TIMEOUT) as accls:
        async def rank(accl: aaccl.ACCL) -> np.ndarray | None:
            if accl.rank == 0:
                await load(accl, values(3))
                await accl.send(accl.allocate(1), N, 1, tag=1, stream_flags=OP0)
                return None
            dst = accl.allocate(N)
            await accl.recv(dst, N, 0, tag=1)
            return np.array(dst)

        _, got = await run_ranks(accls, rank)
        np.testing.assert_array_equal(got, values(3))


@pytest.mark.anyio
async def test_reduce_from_every_ranks_stream_into_the_roots() -> None:
    async with aaccl.open_world(3, timeout=TIMEOUT) as accls:
        async def rank(accl: aaccl.ACCL) -> np.ndarray | None:
            await load(accl, values(accl.rank, 100, np.float64))
            dtype_of = accl.allocate(1, np.float64)
            root = accl.rank == 1
            await accl.reduce(dtype_of, dtype_of if root else None, 100, 1, SUM,
                              stream_flags=BOTH)
            return await drain(accl, 100, np.float64) if root else None

        got = (await run_ranks(accls, rank))[1]
        np.testing.assert_array_equal(got, sum(values(r, 100, np.float64) for r in range(3)))


@pytest.mark.anyio
async def test_an_attached_kernel_computes_between_the_streams() -> None:
    async with aaccl.open_world(1, timeout=TIMEOUT) as (accl,):
        accl.attach_stream(lambda chunk, tag: chunk * 2)
        await load(accl, values(0))
        np.testing.assert_array_equal(await drain(accl, N), values(0) * 2)
        accl.attach_stream(lambda chunk, tag: chunk.astype(np.float64))  # a kernel's own type
        await load(accl, values(0, 16))
        np.testing.assert_array_equal(await drain(accl, 16, np.float64), values(0, 16))
        accl.attach_stream(None)  # back to the loopback
        await load(accl, values(1, 16))
        np.testing.assert_array_equal(await drain(accl, 16), values(1, 16))


@pytest.mark.anyio
async def test_stream_calls_run_in_submission_order() -> None:
    """As on a card, where every call runs in turn: the first read gets what the first
    write put there, although that write waits for a message and the second does not."""
    async with aaccl.open_world(2, timeout=2.0) as accls:
        async def rank(accl: aaccl.ACCL) -> list[np.ndarray] | None:
            if accl.rank == 0:
                await accl.send(filled(accl, values(0, 32)), 32, 1)
                return None
            dtype_of = accl.allocate(1)
            outs = [accl.allocate(32) for _ in range(3)]
            calls = [accl.recv(dtype_of, 32, 0, stream_flags=RES),
                     accl.copy(filled(accl, values(1, 32)), dtype_of, 32, stream_flags=RES),
                     accl.copy(dtype_of, outs[0], 32, stream_flags=OP0),
                     accl.copy(dtype_of, outs[1], 32, stream_flags=OP0)]
            for call in calls:
                await call
            return [np.array(o) for o in outs[:2]]

        _, (first, second) = await run_ranks(accls, rank)
        np.testing.assert_array_equal(first, values(0, 32))
        np.testing.assert_array_equal(second, values(1, 32))


@pytest.mark.anyio
async def test_reading_an_empty_stream_times_out_and_the_rank_stays_usable() -> None:
    async with aaccl.open_world(1, timeout=SHORT) as (accl,):
        accl.attach_stream(lambda chunk, tag: None)  # a sink
        await load(accl, values(0, 8))
        with pytest.raises(CCLOError) as info:
            await drain(accl, 8)
        assert info.value.code == ErrorCode.KRNL_TIMEOUT_STS_ERROR
        assert "32 bytes (1 word) from the kernel stream" in str(info.value)
        assert "kernel <lambda> attached" in str(info.value)
        accl.attach_stream(None)
        await load(accl, values(0, 8))
        np.testing.assert_array_equal(await drain(accl, 8), values(0, 8))


@pytest.mark.anyio
async def test_a_kernel_that_raises_fails_the_next_read_with_kernel_error() -> None:
    async with aaccl.open_world(1, timeout=TIMEOUT) as (accl,):
        def broken(chunk: np.ndarray, tag: int) -> np.ndarray:
            raise ZeroDivisionError("no")

        accl.attach_stream(broken)
        await load(accl, values(0, 8))  # the write itself succeeds, as on a card
        with pytest.raises(KernelError, match="stream kernel broken raised ZeroDivisionError"
                           ) as info:
            await drain(accl, 8)
        assert isinstance(info.value.__cause__, ZeroDivisionError)
        accl.attach_stream(lambda chunk, tag: chunk + 1)
        await load(accl, values(0, 8))
        np.testing.assert_array_equal(await drain(accl, 8), values(0, 8) + 1)


@pytest.mark.anyio
async def test_a_send_from_an_empty_stream_gives_back_its_place() -> None:
    """It times out before sending: the receiver's next message still matches."""
    async with aaccl.open_world(2, timeout=SHORT) as accls:
        a, b = accls
        with pytest.raises(CCLOError) as info:
            await a.send(a.allocate(1), 4, 1, stream_flags=OP0)
        assert info.value.code == ErrorCode.KRNL_TIMEOUT_STS_ERROR
        dst = b.allocate(4)
        await a.send(filled(a, values(0, 4)), 4, 1)
        await b.recv(dst, 4, 0)
        np.testing.assert_array_equal(dst, values(0, 4))


@pytest.mark.anyio
async def test_calls_that_the_firmware_runs_without_streams() -> None:
    """Below the API (as pyaccl-style code can reach it): a collective that ignores the
    flags works in memory; alltoall on several ranks fails as the firmware fails it."""
    async with aaccl.open_world(2, timeout=TIMEOUT) as accls:
        async def rank(accl: aaccl.ACCL) -> tuple[int, int]:
            buf = filled(accl, values(accl.rank, 4))
            buf.sync_to_device()
            driver, dtype = accl._driver, np.dtype(np.float32)
            bcast = driver.start(Scenario.BCAST, count=4, root_src_dst=0, dtype=dtype,
                                 stream_flags=int(BOTH),
                                 addrs=(buf.device_address, 0, buf.device_address))
            alltoall = driver.start(Scenario.ALLTOALL, count=2, dtype=dtype,
                                    stream_flags=int(OP0),
                                    addrs=(buf.device_address, 0, buf.device_address))
            for call in (bcast, alltoall):
                assert await anyio.to_thread.run_sync(call.block, 5.0)
            buf.sync_from_device()
            np.testing.assert_array_equal(buf, values(0, 4))
            return bcast.retcode, alltoall.retcode

        for codes in await run_ranks(accls, rank):
            assert codes == (0, int(ErrorCode.COLLECTIVE_NOT_IMPLEMENTED))


@pytest.mark.anyio
async def test_bad_stream_arguments_fail_before_the_device() -> None:
    async with aaccl.open_world(2, timeout=TIMEOUT) as accls:
        a, b = accls
        src = a.allocate(4)
        with pytest.raises(ValueError, match="recv takes stream_flags RES_STREAM, not OP0_STREAM"):
            a.recv(src, 4, 1, stream_flags=OP0)
        with pytest.raises(ValueError, match="not a combination of StreamFlags"):
            a.copy(src, src, 4, stream_flags=4)
        with pytest.raises(TypeError, match="stream_flags must be an integer"):
            a.send(src, 4, 1, stream_flags=True)
        with pytest.raises(ValueError, match="0..246, not 4294967295"):
            a.send(src, 4, 1, stream_flags=RES)  # the tag is the peer's stream id
        with pytest.raises(ValueError, match="holds 4 elements, the call needs 5"):
            a.copy(src, src, 5, stream_flags=OP0)  # the result still needs room
        with pytest.raises(TypeError, match="a stream kernel is a Python callable"):
            a.attach_stream(42)
        with pytest.raises(ValueError, match="belongs to another rank"):
            a.attach_stream(b.kernel(np.negative))
        # nothing reached the device: the ranks go on as before
        await load(a, values(0, 4))
        np.testing.assert_array_equal(await drain(a, 4), values(0, 4))


# -- over MPI, one rank per process ------------------------------------------------------

@pytest.mark.parametrize(("nprocs", "backend"), [(2, "asyncio"), (3, "trio")])
def test_streams_over_the_mpi_fabric(nprocs: int, backend: str) -> None:
    """Puts into a peer's stream cross processes; the rest works on each rank's own."""
    pytest.importorskip("mpi4py")
    from test_mpi_fabric import MPIEXEC, assert_passed, launch

    if MPIEXEC is None:
        pytest.skip("no mpiexec (pip install 'aaccl[mpi]')")
    assert_passed(launch(nprocs, "streams.py", "streams", "timeout=5.0", f"backend={backend}"),
                  nprocs)


def test_the_guides_example_runs() -> None:
    """docs/concepts/streams.md's example: rank 1 receives into a kernel and sends out
    of it, never touching memory."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "concepts" / "streams.md").read_text()
    code = page.split("```python\n", 1)[1].split("```", 1)[0]
    code, run_line = code.rsplit("aaccl.run(", 1)
    assert run_line.startswith("main, world_size=2)")
    namespace: dict[str, Any] = {}
    exec(compile(code, "streams.md", "exec"), namespace)
    first, second = aaccl.run(namespace["main"], world_size=2)
    np.testing.assert_array_equal(first, np.arange(1000) * 2)
    assert second is None


def test_pyaccl_style_stream_sends_run_on_the_soft_cclo() -> None:
    """pyaccl's one stream option, send(stream_flags=...), through aaccl.compat: rank 0
    puts into rank 1's stream; rank 1 sends it back out of its stream (the loopback)."""
    from aaccl.compat import ACCLStreamFlags, accl
    from test_compat import on_threads

    ranks = [accl(2, i, sim_mode=True) for i in range(2)]
    try:
        def body(rank: accl) -> np.ndarray | None:
            buf = rank.allocate((N,))
            if rank.communicators[0].local_rank == 0:
                buf[:] = values(0)
                rank.send(buf, N, 1, tag=9, stream_flags=ACCLStreamFlags.RES_STREAM)
                rank.recv(buf, N, 1, tag=10)
                return np.array(buf)
            rank.send(buf, N, 0, tag=10, stream_flags=ACCLStreamFlags.OP0_STREAM)
            return None

        first, _ = on_threads(ranks, body)
        np.testing.assert_array_equal(first, values(0))
    finally:
        for rank in ranks:
            rank.deinit()
