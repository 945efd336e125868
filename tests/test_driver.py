"""The driver's exchange-memory layout and call encoding, read back from the soft
CCLO; and the exchange-memory records (aaccl._exchmem) on their own."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import aaccl
from aaccl import _exchmem as xm
from aaccl._constants import CompressionFlags, ReduceFunction, Scenario
from aaccl.devices import CallArgs
from aaccl.driver import Driver

F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)
I32, I64 = np.dtype(np.int32), np.dtype(np.int64)

# ACCL's DEFAULT_ARITH_CONFIG (driver/xrt/include/accl/arithconfig.hpp), as the 7 header
# words (uncompressed bytes, compressed bytes, ratio log, compressor tdest, decompressor
# tdest, number of functions, arith_is_compressed) and then the functions' tdests.
ACCL_ARITH_WORDS = {
    (F16, F16): [2, 2, 0, 0, 0, 2, 0, 4, 9],
    (F32, F16): [4, 2, 0, 0, 1, 2, 1, 4, 9],
    (F32, F32): [4, 4, 0, 0, 0, 2, 0, 0, 5],
    (F64, F64): [8, 8, 0, 0, 0, 2, 0, 1, 6],
    (I32, I32): [4, 4, 0, 0, 0, 2, 0, 2, 7],
    (I64, I64): [8, 8, 0, 0, 0, 2, 0, 3, 8],
}


def words(accl: aaccl.ACCL, offset: int, n: int) -> list[int]:
    dev = accl._driver.device
    return [dev.mmio_read(offset + 4 * i) for i in range(n)]


def in_device_memory(accl: aaccl.ACCL, address: int, nbytes: int) -> bool:
    try:
        accl._driver.device.memory.view(address, nbytes)
    except KeyError:
        return False
    return True


# -- the layout after open_world -----------------------------------------------------------

@pytest.mark.anyio
@pytest.mark.parametrize("nbufs, bufsize", [(16, 1024), (5, 256), (1, 8)])
async def test_rx_buffers(nbufs: int, bufsize: int) -> None:
    async with aaccl.open_world(2, nbufs=nbufs, bufsize=bufsize) as accls:
        for accl in accls:
            assert words(accl, 0x0, 2) == [nbufs, bufsize]
            spans = []
            for i in range(nbufs):
                record = words(accl, 0x8 + 4 * 7 * i, 7)
                status, lo, hi, tag, length, src, seq = record
                address = lo | (hi << 32)
                assert status == xm.RxBuffer.IDLE
                assert [tag, length, src, seq] == [0, 0, 0, 0]
                assert hi != 0  # the soft CCLO's memory lies above 4 GiB: both words count
                assert in_device_memory(accl, address, bufsize)
                spans.append((address, address + bufsize))
                assert xm.RxBuffer.read(accl._driver.device.mmio_read, 0x8 + 28 * i) \
                    == xm.RxBuffer(address)
            spans.sort()
            assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))


@pytest.mark.anyio
@pytest.mark.parametrize("nbufs", [16, 3])
async def test_global_communicator_follows_rx_buffers(nbufs: int) -> None:
    size, bufsize = 3, 512
    async with aaccl.open_world(size, nbufs=nbufs, bufsize=bufsize) as accls:
        for accl in accls:
            address = 0x8 + 4 * 7 * nbufs
            assert accl._driver.communicators[0][0] == address
            assert words(accl, address, 2) == [size, accl.rank]
            for r in range(size):
                ip, port, inbound, outbound, session, segment = words(
                    accl, address + 8 + 4 * 6 * r, 6)
                assert xm.ip_decode(ip) == "127.0.0.1"
                assert ip == 0x7F000001
                assert port == 17000 + r
                assert (inbound, outbound) == (0, 0)
                assert session == r
                assert segment == bufsize
            comm = xm.Communicator.read(accl._driver.device.mmio_read, address)
            assert comm == accl._driver.comm(aaccl.GLOBAL_COMM)
            assert comm.local_rank == accl.rank and len(comm.ranks) == size


@pytest.mark.anyio
async def test_arithmetic_configs() -> None:
    nbufs, size = 4, 2
    async with aaccl.open_world(size, nbufs=nbufs) as accls:
        for accl in accls:
            arith = accl._driver._arith
            assert set(arith) == set(ACCL_ARITH_WORDS)
            comm_end = 0x8 + 28 * nbufs + 4 * (2 + 6 * size)
            assert min(arith.values()) == comm_end  # right after the global communicator
            for key, expected in ACCL_ARITH_WORDS.items():
                address = arith[key]
                assert address % 4 == 0 and address + 4 * len(expected) <= xm.CONFIG_END
                assert words(accl, address, len(expected)) == expected, key
                assert accl._driver.arithcfg(*key) == address
            assert words(accl, arith[(F32, F16)], 9) == [4, 2, 0, 0, 1, 2, 1, 4, 9]
            # the records do not overlap
            spans = sorted((a, a + 4 * len(ACCL_ARITH_WORDS[k])) for k, a in arith.items())
            assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))


@pytest.mark.anyio
async def test_fixed_registers() -> None:
    async with aaccl.open_world(2, bufsize=2048) as accls:
        for accl in accls:
            assert words(accl, 0x1FF4, 1) == [1]  # CFGRDY
            assert words(accl, xm.CFGRDY, 1) == [1]
            assert words(accl, 0x1FF8, 1) != [0]  # HWID
            # flat-tree thresholds, as ACCL's driver sets them
            # ACCL's tuning: reduce's flat tree up to a quarter of the rendezvous size
            rendezvous = accl._driver.max_rendezvous_size
            assert words(accl, 0x1FC4, 5) == [2, 32 * 1024, 3, 4, min(rendezvous // 4, 32 * 1024)]
            # spare buffers: 64-bit addresses into device memory
            for offset in (0x1FD8, 0x1FE0, 0x1FE8):
                lo, hi = words(accl, offset, 2)
                assert in_device_memory(accl, lo | (hi << 32), 2048)


@pytest.mark.anyio
@pytest.mark.parametrize("stack, eager", [("tcp", 1 << 30), ("udp", 1 << 30), ("rdma", 512),
                                          (None, 1 << 30)])
async def test_configuration_calls_reach_the_device(stack: str | None, eager: int) -> None:
    """The stack's eager threshold: every message on TCP and UDP (the default), one rx
    buffer on RDMA, as ACCL sets them."""
    async with aaccl.open_world(2, nbufs=8, bufsize=512, timeout=1.5, stack=stack) as accls:
        for accl in accls:
            dev = accl._driver.device
            assert dev.timeout == pytest.approx(1.5)
            assert dev.max_eager_size == accl._driver.max_eager_size == eager
            assert dev.max_rendezvous_size == max(8 * 512, eager + 1)


@pytest.mark.anyio
async def test_split_communicator_is_appended() -> None:
    size = 4
    async with aaccl.open_world(size, nbufs=2) as accls:
        for accl in accls:
            driver = accl._driver
            end = max(driver._arith.values()) + 4 * 9
            before = [words(accl, a, 2 + 6 * len(c.ranks)) for a, c in driver.communicators]
            arith_before = {k: words(accl, a, 9) for k, a in driver._arith.items()}
            members = [3, 1] if accl.rank in (1, 3) else [0, 2]
            comm_id = accl.split_communicator(members)
            assert comm_id == 1
            address = driver.communicators[comm_id][0]
            assert address == end  # after the last record, which was an arithmetic config
            record = words(accl, address, 2 + 6 * 2)
            assert record[:2] == [2, members.index(accl.rank)]
            global_address = driver.communicators[0][0]
            for i, g in enumerate(members):  # the members' records, copied from the world's
                assert record[2 + 6 * i:8 + 6 * i] == words(accl, global_address + 8 + 24 * g, 6)
            # nothing else moved
            assert [words(accl, a, 2 + 6 * len(c.ranks)) for a, c in
                    driver.communicators[:1]] == before
            assert {k: words(accl, a, 9) for k, a in driver._arith.items()} == arith_before
            # a second split goes after the first
            single = accl.split_communicator([accl.rank])
            assert driver.communicators[single][0] == address + 4 * (2 + 6 * 2)
            assert words(accl, driver.communicators[single][0], 8)[:2] == [1, 0]


@pytest.mark.anyio
async def test_exchange_memory_full() -> None:
    """Splitting until the exchange memory has no room raises ValueError, writes
    nothing past its end, and leaves the communicators made so far usable."""
    async with aaccl.open_world(1) as (accl,):
        driver = accl._driver
        made = []
        with pytest.raises(ValueError):
            for _ in range(xm.SIZE // 32):
                made.append(accl.split_communicator([0]))
        assert len(made) > 10
        last_address, last = driver.communicators[-1]
        assert last_address + last.nbytes <= xm.CONFIG_END
        assert words(accl, xm.GATHER_FLAT_TREE_MAX_FANIN, 5)[:4] == [2, 32 * 1024, 3, 4]
        assert len(driver.communicators) == len(made) + 1
        src, dst = accl.allocate(4), accl.allocate(4)
        src[:] = [1, 2, 3, 4]
        await accl.allreduce(src, dst, 4, ReduceFunction.SUM, comm_id=made[-1])
        np.testing.assert_array_equal(dst, [1, 2, 3, 4])


# -- the 12-argument call ----------------------------------------------------------------

@pytest.mark.anyio
async def test_call_arguments() -> None:
    """What the driver hands the device: ACCL's 12 arguments, with the communicator and
    arithmetic config as exchange-memory addresses and buffers as device addresses."""
    async with aaccl.open_world(2) as accls:
        a, b = accls
        seen: list[CallArgs] = []
        dev = a._driver.device
        start = dev.start

        def spy(args: CallArgs, waitfor: Any = ()) -> Any:
            seen.append(args)
            return start(args, waitfor)

        dev.start = spy
        try:
            comm = a.split_communicator([1, 0])
            b_comm = b.split_communicator([1, 0])
            src, dst = a.allocate(16), a.allocate(16)
            calls = [a.allreduce(src, dst, 7, ReduceFunction.MAX, comm_id=comm,
                                 compress_dtype=np.float16),
                     b.allreduce(b.allocate(16), b.allocate(16), 7, ReduceFunction.MAX,
                                 comm_id=b_comm, compress_dtype=np.float16)]
            for call in calls:
                await call
            send = a.send(src[4:], 3, 1, tag=42)
            await b.recv(b.allocate(3), 3, 0, tag=42)
            await send
            i64 = a.allocate(4, np.int64)
            await a.copy(i64, a.allocate(4, np.int64), 2)
            await a.nop()
        finally:
            del dev.start
        driver = a._driver
        allreduce, sent, copied, nop = seen
        assert allreduce == CallArgs(
            scenario=Scenario.ALLREDUCE, count=7, comm=driver.communicators[comm][0],
            root_src_dst=0, function=int(ReduceFunction.MAX), tag=aaccl.TAG_ANY,
            arithcfg=driver._arith[(F32, F16)], compression_flags=CompressionFlags.ETH_COMPRESSED,
            stream_flags=0, addr_0=src.device_address, addr_1=dst.device_address,
            addr_2=dst.device_address)
        assert sent.scenario == Scenario.SEND == 3
        assert (sent.count, sent.root_src_dst, sent.tag) == (3, 1, 42)
        assert sent.comm == driver.communicators[0][0]
        assert sent.arithcfg == driver._arith[(F32, F32)]
        assert sent.compression_flags == 0
        assert sent.addr_0 == src.device_address + 4 * 4
        assert copied.scenario == Scenario.COPY and copied.count == 2
        assert copied.arithcfg == driver._arith[(I64, I64)]
        assert nop.scenario == Scenario.NOP == 255
        assert all(type(v) is int for v in allreduce)  # plain ints, as pyxrt takes them
        assert all(0 <= v < 2**64 for args in seen for v in args)


@pytest.mark.anyio
async def test_retcode_register() -> None:
    """The soft CCLO leaves each finished call's return code at RETCODE (0x1FFC)."""
    async with aaccl.open_world(1, timeout=0.05) as (accl,):
        src, dst = accl.allocate(4), accl.allocate(4)
        with pytest.raises(aaccl.CCLOError):  # nothing comes on the kernel stream
            await accl.copy(src, dst, 4, stream_flags=aaccl.StreamFlags.OP0_STREAM)
        assert words(accl, 0x1FFC, 1) == [int(aaccl.ErrorCode.KRNL_TIMEOUT_STS_ERROR)]
        await accl.copy(src, dst, 4)
        assert words(accl, 0x1FFC, 1) == [0]


ONE_RANK = [xm.RankRecord(ip=0, port=0, session=0, max_segment_size=1024)]


class _Clock:
    """Just enough of a device for the driver's timeout check: its timer's rate."""

    def __init__(self, timer_hz: int, host_enforced: bool) -> None:
        self.timer_hz = timer_hz
        self.enforces_call_timeout = host_enforced


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf"), True, "10", None])
def test_a_timeout_that_is_no_positive_number_is_refused(timeout: Any) -> None:
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        Driver(_Clock(1_000_000, True), 0, ONE_RANK, timeout=timeout)  # type: ignore[arg-type]


def test_a_timeout_beyond_the_register_needs_a_device_that_enforces_it() -> None:
    """2**32 - 1 ticks: 4295 s at the soft CCLO's 1 MHz, 17.2 s at a card's 250 MHz.
    A device that fails calls on the host (`set_call_timeout`) holds any timeout;
    one that goes by the register is refused what it cannot hold, before configuring."""
    card = 250_000_000
    assert Driver(_Clock(card, True), 0, ONE_RANK, timeout=30).timeout == 30.0  # type: ignore[arg-type]
    assert Driver(_Clock(card, False), 0, ONE_RANK, timeout=17).timeout == 17.0  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"timeout=30 s is more than _Clock can hold: .* 17\.1"):
        Driver(_Clock(card, False), 0, ONE_RANK, timeout=30)  # type: ignore[arg-type]
    assert Driver(_Clock(1_000_000, False), 0, ONE_RANK, timeout=4000).timeout == 4000


# -- the records on their own ---------------------------------------------------------------

class Memory(dict):
    """A word-addressed exchange memory for records to be written into and read from."""

    def write(self, offset: int, values: list[int]) -> None:
        for i, value in enumerate(values):
            assert 0 <= value < 2**32
            self[offset + 4 * i] = value

    def read(self, offset: int) -> int:
        return self.get(offset, 0)


def test_layout_constants() -> None:
    assert xm.SIZE == 0x2000
    assert (xm.NUM_RX_BUFS, xm.RX_BUF_SIZE, xm.RX_RECORDS) == (0x0, 0x4, 0x8)
    assert (xm.RETCODE, xm.HWID, xm.CFGRDY, xm.PERFCNT) == (0x1FFC, 0x1FF8, 0x1FF4, 0x1FF0)
    assert (xm.SPARE1, xm.SPARE2, xm.SPARE3) == (0x1FD8, 0x1FE0, 0x1FE8)
    assert (xm.GATHER_FLAT_TREE_MAX_FANIN, xm.GATHER_FLAT_TREE_MAX_COUNT,
            xm.BCAST_FLAT_TREE_MAX_RANKS, xm.REDUCE_FLAT_TREE_MAX_RANKS,
            xm.REDUCE_FLAT_TREE_MAX_COUNT) == (0x1FC4, 0x1FC8, 0x1FCC, 0x1FD0, 0x1FD4)


@pytest.mark.parametrize("address", [0, 0x1000, 0xFFFF_FFFF, 0x1_0000_0000, 0x1234_5678_9ABC_D000])
def test_rx_buffer_round_trip(address: int) -> None:
    record = xm.RxBuffer(address, status=xm.RxBuffer.ENQUEUED, tag=7, length=100, src=3, seq=9)
    assert record.words() == [1, address & 0xFFFFFFFF, address >> 32, 7, 100, 3, 9]
    assert len(record.words()) == xm.RxBuffer.WORDS == 7
    mem = Memory()
    mem.write(0x40, record.words())
    assert xm.RxBuffer.read(mem.read, 0x40) == record
    assert xm.RxBuffer(address).words() == [0, address & 0xFFFFFFFF, address >> 32, 0, 0, 0, 0]


def test_rank_record_words() -> None:
    rank = xm.RankRecord(ip=xm.ip_encode("10.1.2.3"), port=5001, session=4,
                         max_segment_size=4096, inbound_seq=11, outbound_seq=12)
    assert rank.words() == [0x0A010203, 5001, 11, 12, 4, 4096]
    assert len(rank.words()) == xm.RankRecord.WORDS == 6


def make_comm(local_rank: int, size: int) -> xm.Communicator:
    ranks = tuple(xm.RankRecord(ip=xm.ip_encode(f"192.168.0.{10 + r}"), port=6000 + r,
                                session=r * 3, max_segment_size=1024 * (r + 1),
                                inbound_seq=r, outbound_seq=2 * r) for r in range(size))
    return xm.Communicator(local_rank, ranks)


@pytest.mark.parametrize("local_rank, size", [(0, 1), (2, 3), (7, 8)])
def test_communicator_round_trip(local_rank: int, size: int) -> None:
    comm = make_comm(local_rank, size)
    w = comm.words()
    assert w[:2] == [size, local_rank]
    assert len(w) == 2 + 6 * size and comm.nbytes == 4 * len(w)
    for r in range(size):
        assert w[2 + 6 * r:8 + 6 * r] == comm.ranks[r].words()
    mem = Memory()
    mem.write(0x100, w)
    assert xm.Communicator.read(mem.read, 0x100) == comm


def test_communicator_read_rejects_garbage() -> None:
    mem = Memory()
    mem.write(0x100, [0xFFFF, 0])  # more ranks than the exchange memory could hold
    with pytest.raises(ValueError):
        xm.Communicator.read(mem.read, 0x100)


def test_communicator_split() -> None:
    comm = make_comm(2, 5)
    sub = comm.split([4, 2, 0])
    assert sub.local_rank == 1
    assert sub.ranks == (comm.ranks[4], comm.ranks[2], comm.ranks[0])
    assert comm.split([2]) == xm.Communicator(0, (comm.ranks[2],))
    mem = Memory()
    mem.write(0x200, sub.words())
    assert xm.Communicator.read(mem.read, 0x200) == sub


@pytest.mark.parametrize("key", list(ACCL_ARITH_WORDS))
def test_default_arith_configs_match_accl(key: tuple[np.dtype, np.dtype]) -> None:
    cfg = xm.DEFAULT_ARITH_CONFIGS[key]
    assert cfg.words() == ACCL_ARITH_WORDS[key]
    assert cfg.nbytes == 4 * len(ACCL_ARITH_WORDS[key])
    mem = Memory()
    mem.write(0x300, cfg.words())
    assert xm.ArithConfig.read(mem.read, 0x300) == cfg


def test_arith_config_round_trip_and_garbage() -> None:
    cfg = xm.ArithConfig(8, 4, 1, 2, 3, True, (5, 6, 7))
    assert cfg.words() == [8, 4, 1, 2, 3, 3, 1, 5, 6, 7]
    mem = Memory()
    mem.write(0x10, cfg.words())
    assert xm.ArithConfig.read(mem.read, 0x10) == cfg
    for nfunctions in (0, 17, 0xFFFFFFFF):
        bad = Memory()
        bad.write(0x10, [4, 4, 0, 0, 0, nfunctions, 0])
        with pytest.raises(ValueError):
            xm.ArithConfig.read(bad.read, 0x10)


@pytest.mark.parametrize("ip", ["0.0.0.0", "127.0.0.1", "10.0.0.255", "255.255.255.255",
                                "192.168.1.20"])
def test_ip_round_trip(ip: str) -> None:
    value = xm.ip_encode(ip)
    assert 0 <= value < 2**32
    assert xm.ip_decode(value) == ip
    assert value == int.from_bytes(bytes(int(x) for x in ip.split(".")), "big")


def test_arith_units_and_lanes() -> None:
    """Every tdest the default configs name exists on the default CCLO, with the
    element type its config says."""
    for (data, wire), cfg in xm.DEFAULT_ARITH_CONFIGS.items():
        arith_dtype = wire if cfg.arith_is_compressed else data
        assert [xm.ARITH_UNITS[t] for t in cfg.arith_tdest] == [(arith_dtype, "sum"),
                                                                (arith_dtype, "max")]
        assert cfg.uncompressed_elem_bytes == data.itemsize
        assert cfg.compressed_elem_bytes == wire.itemsize
        if cfg.arith_is_compressed:
            assert xm.COMPRESSION_LANES[cfg.compressor_tdest] == (data, wire)
            assert xm.COMPRESSION_LANES[cfg.decompressor_tdest] == (wire, data)
