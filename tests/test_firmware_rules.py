"""The calls ACCL's firmware gets wrong (aaccl/driver/_firmware.py), against a literal
model of the firmware's own loops; the equivalent calls the driver sends instead,
run for real on the soft CCLO (made to take them, as a firmware device does) and
against numpy; and their order on the wire, against the emulator stand-in."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import aaccl
from aaccl._constants import TAG_ANY, CompressionFlags, ErrorCode, Scenario, StreamFlags
from aaccl.devices import CallArgs, DeviceCall
from aaccl.devices._base import in_sequence
from aaccl.driver import Driver
from aaccl.driver import _firmware as fw
from aaccl.soft import SoftDevice
from test_collectives import sweep

U32 = 2**32
F32 = np.dtype(np.float32)

# -- a model of the firmware, transcribed from its loops --------------------------------------


def firmware_ring_chunks(count: int, size: int, bufsize: int, itemsize: int,
                         streamed: bool = False) -> list[tuple[int, int]] | None:
    """(bulk, tail) element counts of every segment of the firmware's eager ring
    allreduce (ccl_offload_control.c, allreduce(), its `else` branch), in its unsigned
    32-bit arithmetic; None if its segment loop never ends."""
    max_seg_count = count if streamed else bufsize // itemsize
    if not streamed:
        max_seg_count -= max_seg_count % size
    chunks = []
    elems_remaining = count
    while elems_remaining > 0:
        elems = min(max_seg_count, elems_remaining)
        if elems == 0:
            return None
        bulk_count = (elems + size - 1) // size
        tail_count = (elems - bulk_count * (size - 1)) % U32
        chunks.append((bulk_count, tail_count))
        elems_remaining -= elems
    return chunks


def hangs(chunks: list[tuple[int, int]] | None) -> bool:
    """A move of zero elements that receives never retires; a "negative" one asks for
    about 4 GiB: either hangs the call."""
    return chunks is None or any(not 0 < n < 2**31 for chunk in chunks for n in chunk)


def firmware_bcast_sources(count: int, size: int, root: int, segment: int) -> list[int]:
    """The element offset each of the root's sends reads from, as the DMA mover's op0
    address register evolves (dma_mover.cpp: IMMEDIATE, INCREMENT = previous address
    + previous length, REPEAT = previous address; a zero-count move still updates
    them) over broadcast()'s eager loop (ccl_offload_control.c)."""
    sources = []
    prev_addr = prev_len = 0
    elems_remaining = count
    while elems_remaining > 0:
        for i in range(size):
            n = 0 if i == root else min(segment, elems_remaining)
            if i == 0:
                addr = 0 if elems_remaining == count else prev_addr + prev_len
            else:
                addr = prev_addr
            prev_addr, prev_len = addr, n
            if i != root:
                sources.append(addr)
        elems_remaining -= segment
    return sources


def correct_bcast_sources(count: int, size: int, segment: int) -> list[int]:
    return [start for start in range(0, count, segment) for _ in range(size - 1)]


# -- the rules against the model -----------------------------------------------------------------

def test_the_short_segments_that_hang_on_2_3_and_4_ranks() -> None:
    """The table in _firmware's docstring: last segments that leave no rest."""
    for size, bad in ((2, [1]), (3, [1, 2, 4]), (4, [1, 2, 3, 5, 6, 9])):
        assert [e for e in range(1, 100) if fw.ring_rest(e, size) < 1] == bad
        assert [e for e in range(1, 100) if hangs(firmware_ring_chunks(e, size, 1024, 4))] == bad


def test_none_hang_from_p_times_p_minus_1() -> None:
    for size in range(2, 40):
        assert all(fw.ring_rest(e, size) >= 1 for e in range(size * (size - 1), 4000))


@settings(max_examples=600, deadline=None)
@given(count=st.integers(0, 6000), size=st.integers(1, 9),
       bufsize=st.integers(1, 512).map(lambda k: 8 * k), itemsize=st.sampled_from([2, 4, 8]))
def test_allreduce_split_is_exactly_where_the_ring_hangs(count: int, size: int, bufsize: int,
                                                         itemsize: int) -> None:
    segment = fw.ring_segment(bufsize, itemsize, size)
    ring, rest = fw.allreduce_split(count, size, segment)
    assert ring + rest == count and ring >= 0 and rest >= 0
    broken = size > 1 and hangs(firmware_ring_chunks(count, size, bufsize, itemsize))
    assert bool(rest) == broken
    if size > 1:
        assert not hangs(firmware_ring_chunks(ring, size, bufsize, itemsize))
    if rest and segment:  # just the short last segment goes another way
        assert ring % segment == 0 and 0 < rest < size * (size - 1)


@settings(max_examples=400, deadline=None)
@given(count=st.integers(0, 3000), size=st.integers(1, 8), data=st.data(),
       segment=st.integers(1, 300))
def test_bcast_repeats_exactly_where_the_firmware_resends(count: int, size: int,
                                                          data: st.DataObject,
                                                          segment: int) -> None:
    root = data.draw(st.integers(0, size - 1))
    wrong = firmware_bcast_sources(count, size, root, segment) \
        != correct_bcast_sources(count, size, segment)
    assert fw.bcast_repeats(count, size, root, segment) == wrong


# -- the substitute calls ---------------------------------------------------------------------

SETUP = fw.Setup(bufsize=1024, max_eager_size=1 << 30)
A0, A1, A2 = 0x10000, 0x20000, 0x30000


def call(scenario: Scenario, count: int, root: int = 0, **fields: int) -> CallArgs:
    values = dict(scenario=int(scenario), count=count, comm=0x200, root_src_dst=root,
                  function=0, tag=TAG_ANY, arithcfg=0x700, compression_flags=0,
                  stream_flags=0, addr_0=A0, addr_1=A1, addr_2=A2)
    return CallArgs(**{**values, **fields})


def covered(steps: list[CallArgs], base: int, itemsize: int, count: int,
            field: str = "addr_2") -> list[int]:
    """The elements of the buffer at `base` the steps' `field` addresses cover, in order."""
    out: list[int] = []
    for step in steps:
        start = (getattr(step, field) - base) // itemsize
        out += range(start, start + step.count)
    return out


@pytest.mark.parametrize("scenario", sorted(fw.RECEIVING))
def test_nothing_to_move_is_a_nop(scenario: Scenario) -> None:
    args = call(scenario, 0)
    assert fw.substitute(args, 2, (4, 4, 4), SETUP) == [args._replace(scenario=Scenario.NOP)]
    assert fw.substitute(args, 1, (4, 4, 4), SETUP) is None  # one rank: no receive
    for other in (Scenario.SEND, Scenario.RECV, Scenario.COPY, Scenario.BARRIER, Scenario.NOP):
        assert fw.substitute(call(other, 0), 2, (4, 4, 4), SETUP) is None


@pytest.mark.parametrize("size, count", [(2, 1), (2, 257), (2, 256 * 5 + 1), (3, 2), (3, 259),
                                         (4, 9), (4, 256 + 6), (7, 29)])
def test_an_allreduce_the_ring_hangs_on_becomes_ring_reduce_and_bcast(size: int,
                                                                     count: int) -> None:
    args = call(Scenario.ALLREDUCE, count, function=1,
                compression_flags=CompressionFlags.ETH_COMPRESSED)
    steps = fw.substitute(args, size, (4, 4, 4), SETUP)
    assert steps is not None
    segment = fw.ring_segment(1024, 4, size)
    ring, rest = fw.allreduce_split(count, size, segment)
    *rings, reduce, bcast = steps
    assert rings == ([args._replace(count=ring)] if ring else [])
    assert reduce == args._replace(scenario=Scenario.REDUCE, count=rest, root_src_dst=0,
                                   addr_0=A0 + 4 * ring, addr_1=0, addr_2=A2 + 4 * ring)
    assert bcast == args._replace(scenario=Scenario.BCAST, count=rest, root_src_dst=0,
                                  function=0, addr_0=A2 + 4 * ring, addr_1=0,
                                  addr_2=A2 + 4 * ring)
    assert covered(steps[:-1], A2, 4, count) == list(range(count))  # every result element once
    assert not hangs(firmware_ring_chunks(ring, size, 1024, 4))


def test_allreduces_the_firmware_runs_right_are_left_alone() -> None:
    for size, count in ((2, 2), (2, 256), (3, 3), (4, 4), (2, 1000), (5, 20)):
        assert fw.substitute(call(Scenario.ALLREDUCE, count), size, (4, 4, 4), SETUP) is None
    assert fw.substitute(call(Scenario.ALLREDUCE, 1), 1, (4, 4, 4), SETUP) is None
    rendezvous = fw.Setup(bufsize=1024, max_eager_size=1024)  # 257 * 4 bytes go rendezvous
    assert fw.substitute(call(Scenario.ALLREDUCE, 257), 2, (4, 4, 4), rendezvous) is None
    compressed = call(Scenario.ALLREDUCE, 257, compression_flags=CompressionFlags.ETH_COMPRESSED)
    assert fw.substitute(compressed, 2, (4, 4, 4), rendezvous) is not None  # eager again


def test_mixed_precision_offsets_each_buffer_by_its_own_element() -> None:
    args = call(Scenario.ALLREDUCE, 257, compression_flags=CompressionFlags.RES_COMPRESSED)
    *_, reduce, bcast = fw.substitute(args, 2, (4, 4, 2), SETUP)
    assert (reduce.addr_0, reduce.addr_2) == (A0 + 4 * 256, A2 + 2 * 256)
    assert bcast.addr_0 == bcast.addr_2 == A2 + 2 * 256
    both = CompressionFlags.OP0_COMPRESSED | CompressionFlags.RES_COMPRESSED
    assert bcast.compression_flags == both


def test_what_cannot_be_split_is_refused() -> None:
    streamed = call(Scenario.ALLREDUCE, 1, stream_flags=StreamFlags.OP0_STREAM)
    with pytest.raises(ValueError, match="streamed one cannot be split"):
        fw.substitute(streamed, 2, (4, 4, 4), SETUP)
    assert fw.substitute(streamed._replace(count=2), 2, (4, 4, 4), SETUP) is None
    with pytest.raises(ValueError, match=r"bufsize >= 24"):  # one float64 per rx buffer
        fw.substitute(call(Scenario.ALLREDUCE, 5), 3, (8, 8, 8), fw.Setup(8, 1 << 30))


@pytest.mark.parametrize("size, count", [(2, 257), (2, 1000), (3, 513), (5, 256 * 7)])
def test_a_bcast_from_the_last_rank_goes_one_rx_buffer_at_a_time(size: int, count: int) -> None:
    args = call(Scenario.BCAST, count, root=size - 1, addr_1=0, addr_0=A2)
    steps = fw.substitute(args, size, (4, 4, 4), SETUP)
    assert steps is not None and all(s.count <= 256 for s in steps)
    assert all(s.root_src_dst == size - 1 and s.scenario == Scenario.BCAST for s in steps)
    assert covered(steps, A2, 4, count) == list(range(count))
    assert all(s.addr_0 == s.addr_2 and s.addr_1 == 0 for s in steps)
    for fine in (args._replace(root_src_dst=0), args._replace(count=256),
                 args._replace(stream_flags=StreamFlags.OP0_STREAM)):
        assert fw.substitute(fine, size, (4, 4, 4), SETUP) is None


# -- one device call for several ------------------------------------------------------------------

class Recording:
    """A device that completes every call at once, with the return code its count asks."""

    def __init__(self, retcodes: dict[int, int] | None = None) -> None:
        self.started: list[CallArgs] = []
        self.retcodes = retcodes or {}

    def start(self, args: CallArgs, waitfor: Any = ()) -> DeviceCall:
        call = DeviceCall(args)
        if any(dep.failed for dep in waitfor):
            call.complete(aborted=True)
            return call
        self.started.append(args)
        call.mark_started()
        call.complete(retcode=self.retcodes.get(args.count, 0))
        return call


def test_in_sequence_succeeds_once_the_last_step_has() -> None:
    device, whole = Recording(), call(Scenario.ALLREDUCE, 3)
    steps = [call(Scenario.REDUCE, 1), call(Scenario.BCAST, 2)]
    result = in_sequence(device, whole, steps)  # type: ignore[arg-type]
    assert result.block(1) and not result.failed and result.args == whole
    assert device.started == steps and result.started


def test_in_sequence_fails_as_its_first_failed_step_and_runs_no_later_one() -> None:
    device = Recording({2: int(ErrorCode.RECEIVE_TIMEOUT_ERROR)})
    steps = [call(Scenario.ALLREDUCE, 1), call(Scenario.REDUCE, 2), call(Scenario.BCAST, 3)]
    result = in_sequence(device, call(Scenario.ALLREDUCE, 6), steps)  # type: ignore[arg-type]
    assert result.block(1) and result.retcode == ErrorCode.RECEIVE_TIMEOUT_ERROR
    assert not result.aborted and device.started == steps[:2]
    error = Driver.error(result, "allreduce")
    assert isinstance(error, aaccl.CCLOError) and error.code == ErrorCode.RECEIVE_TIMEOUT_ERROR


def test_in_sequence_after_a_failed_dependency_never_runs() -> None:
    failed = DeviceCall(None)
    failed.complete(error=RuntimeError("boom"))
    device = Recording()
    result = in_sequence(device, call(Scenario.BCAST, 2),  # type: ignore[arg-type]
                                 [call(Scenario.BCAST, 1), call(Scenario.BCAST, 1)], [failed])
    assert result.block(1) and result.aborted and device.started == []
    assert isinstance(Driver.error(result, "bcast"), aaccl.DependencyError)


def test_a_scatter_over_more_than_one_rx_buffer_runs_as_sends() -> None:
    """The firmware sends each rank its whole chunk as one message: past one rx buffer
    (256 float32 of SETUP's 1 KiB) the root copies its own chunk and sends the others
    theirs, each of which receives; rank by rank."""
    args = call(Scenario.SCATTER, 300, root=1)
    chunk = 300 * 4
    assert fw.substitute(args, 3, (4, 4, 4), SETUP, rank=1) == [
        args._replace(scenario=Scenario.COPY, root_src_dst=0, addr_0=A0 + chunk, addr_1=0),
        args._replace(scenario=Scenario.SEND, root_src_dst=0, addr_0=A0, addr_1=0, addr_2=0),
        args._replace(scenario=Scenario.SEND, root_src_dst=2, addr_0=A0 + 2 * chunk, addr_1=0,
                      addr_2=0)]
    for rank in (0, 2):
        assert fw.substitute(args, 3, (4, 4, 4), SETUP, rank=rank) == [
            args._replace(scenario=Scenario.RECV, addr_0=0, addr_1=0)]
    assert all(step.tag == TAG_ANY for step in fw.substitute(args, 3, (4, 4, 4), SETUP, rank=1))


def test_a_gather_over_more_than_one_rx_buffer_runs_as_sends() -> None:
    """The ring gather relays whole chunks: past one rx buffer each rank sends its own
    to the root, which copies its own and receives the others' in place."""
    args = call(Scenario.GATHER, 300, root=2)
    chunk = 300 * 4
    assert fw.substitute(args, 3, (4, 4, 4), SETUP, rank=2) == [
        args._replace(scenario=Scenario.COPY, root_src_dst=0, addr_1=0, addr_2=A2 + 2 * chunk),
        args._replace(scenario=Scenario.RECV, root_src_dst=0, addr_0=0, addr_1=0, addr_2=A2),
        args._replace(scenario=Scenario.RECV, root_src_dst=1, addr_0=0, addr_1=0,
                      addr_2=A2 + chunk)]
    for rank in (0, 1):
        assert fw.substitute(args, 3, (4, 4, 4), SETUP, rank=rank) == [
            args._replace(scenario=Scenario.SEND, addr_1=0, addr_2=0)]


def test_an_allgather_over_more_than_one_rx_buffer_runs_as_sends() -> None:
    """Each rank copies its own chunk, then in step k sends it to the k-th next rank
    and receives the k-th previous rank's in place."""
    args = call(Scenario.ALLGATHER, 300)
    chunk = 300 * 4
    plain = args._replace(addr_1=0)
    assert fw.substitute(args, 3, (4, 4, 4), SETUP, rank=1) == [
        plain._replace(scenario=Scenario.COPY, addr_2=A2 + chunk),
        plain._replace(scenario=Scenario.SEND, root_src_dst=2, addr_2=0),
        plain._replace(scenario=Scenario.RECV, root_src_dst=0, addr_0=0, addr_2=A2),
        plain._replace(scenario=Scenario.SEND, root_src_dst=0, addr_2=0),
        plain._replace(scenario=Scenario.RECV, root_src_dst=2, addr_0=0, addr_2=A2 + 2 * chunk)]
    assert fw.substitute(call(Scenario.ALLGATHER, 256), 3, (4, 4, 4), SETUP, rank=1) is None


def test_a_reduce_scatter_over_more_than_one_rx_buffer_runs_as_reduces() -> None:
    """The ring relays whole chunks: past one rx buffer, chunk k is reduced to rank k,
    for each k in turn (the same calls on every rank, but where the result lands)."""
    args = call(Scenario.REDUCE_SCATTER, 256, function=1)
    for rank in range(2):
        assert fw.substitute(args._replace(count=257), 2, (4, 4, 4), SETUP, rank=rank)[::2] == [
            args._replace(scenario=Scenario.REDUCE, count=256, root_src_dst=k,
                          addr_0=A0 + k * 257 * 4, addr_1=0, addr_2=A2 if k == rank else 0)
            for k in range(2)]
    assert fw.substitute(args, 3, (4, 4, 4), SETUP, rank=1) is None  # one rx buffer each
    # each of those reduces is cut, as a reduce is (below)
    args = call(Scenario.REDUCE_SCATTER, 300, function=1)
    steps = fw.substitute(args, 3, (4, 4, 4), SETUP, rank=1)
    assert steps is not None
    assert [(s.root_src_dst, s.count) for s in steps] == [(0, 256), (0, 44), (1, 256), (1, 44),
                                                           (2, 256), (2, 44)]
    assert covered(steps, A0, 4, 300, "addr_0") == list(range(900))
    assert [s.addr_2 for s in steps] == [0, 0, A2, A2 + 1024, 0, 0]


@pytest.mark.parametrize("size", [2, 3])
def test_a_reduce_over_more_than_one_rx_buffer_runs_in_pieces(size: int) -> None:
    """Every rank of the chain but the first receives the whole message in one move:
    past one rx buffer, it goes one rx buffer's worth at a time."""
    args = call(Scenario.REDUCE, 600, root=1)
    steps = fw.substitute(args, size, (4, 4, 4), SETUP, rank=0)
    assert steps is not None and [s.count for s in steps] == [256, 256, 88]
    same = {"count": 0, "addr_0": 0, "addr_1": 0, "addr_2": 0}
    assert all(s._replace(**same) == args._replace(**same) for s in steps)
    assert covered(steps, A0, 4, 600, "addr_0") == covered(steps, A2, 4, 600) == list(range(600))
    assert fw.substitute(args, 1, (4, 4, 4), SETUP, rank=0) is None
    assert fw.substitute(call(Scenario.REDUCE, 256), 4, (4, 4, 4), SETUP, rank=0) is None


@pytest.mark.parametrize("args, size, rank, setup", [
    (call(Scenario.SCATTER, 256), 3, 0, SETUP),  # one rx buffer each: as it is
    (call(Scenario.GATHER, 256), 3, 0, SETUP),
    (call(Scenario.SCATTER, 300), 1, 0, SETUP),  # one rank
    (call(Scenario.SCATTER, 300), 3, None, SETUP),  # rank unknown
    (call(Scenario.SCATTER, 300), 3, 0, fw.Setup(1024, 1024)),  # rendezvous
    (call(Scenario.SCATTER, 300, compression_flags=int(CompressionFlags.ETH_COMPRESSED)),
     3, 0, SETUP),
])
def test_scatters_and_gathers_the_firmware_runs_as_they_are(args: CallArgs, size: int, rank: int | None,
                                               setup: fw.Setup) -> None:
    assert fw.substitute(args, size, (4, 4, 4), setup, rank=rank) is None


# -- for real, on the soft CCLO taking the firmware's path -----------------------------------

@pytest.fixture
def firmware_path(monkeypatch: pytest.MonkeyPatch) -> list[list[CallArgs]]:
    """Make the soft CCLO take the calls a firmware device would get; record every
    substitution the driver made."""
    made: list[list[CallArgs]] = []
    real = fw.substitute

    def recording(*args: Any) -> list[CallArgs] | None:
        steps = real(*args)
        if steps is not None:
            made.append(steps)
        return steps

    monkeypatch.setattr(SoftDevice, "runs_accl_firmware", True, raising=False)
    monkeypatch.setattr(fw, "substitute", recording)
    return made


@pytest.mark.anyio
@pytest.mark.parametrize("size, counts", [(2, [1, 2, 257, 1]), (3, [1, 2, 4, 259, 3]),
                                          (4, [1, 5, 6, 9, 256 + 9, 4])])
async def test_substituted_allreduces_match_numpy(size: int, counts: list[int],
                                                  firmware_path: list[list[CallArgs]]) -> None:
    await sweep(size, "allreduce", np.int32, counts)
    scenarios = {s.scenario for steps in firmware_path for s in steps}
    assert Scenario.REDUCE in scenarios and Scenario.BCAST in scenarios


@pytest.mark.anyio
@pytest.mark.parametrize("size", [2, 3])
async def test_substituted_bcasts_and_empty_collectives_match_numpy(
        size: int, firmware_path: list[list[CallArgs]]) -> None:
    await sweep(size, "bcast", np.float32, [300, 1000, 0, 7])
    assert any(len(steps) > 1 for steps in firmware_path)  # a bcast went in pieces
    for op in ("scatter", "gather", "reduce", "allgather", "reduce_scatter"):
        await sweep(size, op, np.int32, [0])
    assert any(steps[0].scenario == Scenario.NOP for steps in firmware_path)


@pytest.mark.anyio
@pytest.mark.parametrize("size", [2, 3, 4])
async def test_substituted_chunked_collectives_match_numpy(
        size: int, firmware_path: list[list[CallArgs]]) -> None:
    for op in ("scatter", "gather", "allgather", "reduce_scatter", "reduce"):
        await sweep(size, op, np.float32, [1000, 256, 257, 7])  # bufsize 1 KiB
    scenarios = {steps[0].scenario for steps in firmware_path}
    assert {Scenario.COPY, Scenario.RECV, Scenario.SEND, Scenario.REDUCE} <= scenarios


def test_compressed_substituted_allreduce(firmware_path: list[list[CallArgs]]) -> None:
    async def main(accl: aaccl.ACCL) -> np.ndarray:
        src, dst = accl.allocate(257, np.float32), accl.allocate(257, np.float32)
        src[:] = np.arange(257) + accl.rank
        await accl.allreduce(src, dst, 257, aaccl.ReduceFunction.SUM, compress_dtype=np.float16)
        return np.array(dst)

    results = aaccl.run(main, 2)
    for got in results:
        np.testing.assert_array_equal(got, 2 * np.arange(257) + 1)  # exact in float16
    assert firmware_path


def test_a_refused_allreduce_fails_before_the_call(firmware_path: list[list[CallArgs]]) -> None:
    async def main(accl: aaccl.ACCL) -> None:
        buf = accl.allocate(4, np.float64)
        with pytest.raises(ValueError, match="ACCL's firmware cannot run an eager allreduce"):
            accl.allreduce(buf, buf, 4, aaccl.ReduceFunction.SUM)
        await accl.nop()  # the rank stays usable

    aaccl.run(main, 3, bufsize=8)


# -- on the wire, against the emulator stand-in ----------------------------------------------

def test_the_emulator_gets_the_substitute_calls_in_order() -> None:
    """What ACCL's emulator is sent for an allreduce its ring hangs on, a bcast from its
    last rank over several rx buffers and an empty gather: the calls that stand in for
    them, one at a time, and one completion for each of the three."""
    pytest.importorskip("zmq", reason="the emulator device needs pyzmq")
    from aaccl import _exchmem as xm
    from aaccl.devices._emulator import EmulatorDevice
    from test_emulator_protocol import FakeEmulator, close_within, finish

    fake = FakeEmulator()
    fake.retcode_for[TAG_ANY] = 0  # the stand-in's firmware "runs" every collective
    device = EmulatorDevice(0, port=fake.port)
    try:
        ranks = [xm.RankRecord(ip=xm.ip_encode("127.0.0.1"), port=17000 + r, session=r,
                               max_segment_size=1024) for r in range(2)]
        driver = Driver(device, 0, ranks, nbufs=4, bufsize=1024, max_eager_size=1 << 30)
        driver.configure()
        src, dst = device.alloc(4 * 600), device.alloc(4 * 600)
        since = len(fake.started())
        calls = [driver.start(Scenario.ALLREDUCE, count=257, function=0, dtype=F32,
                              addrs=(src, dst, dst)),
                 driver.start(Scenario.BCAST, count=600, root_src_dst=1, dtype=F32,
                              addrs=(dst, 0, dst)),
                 driver.start(Scenario.GATHER, count=0, dtype=F32, addrs=(src, 0, dst))]
        finish(*calls)
        assert not any(c.failed for c in calls)
        sent = [(c.scenario, c.request["count"], c.request["root_src_dst"],
                 c.request["addr_0"], c.request["addr_2"]) for c in fake.started()[since:]]
        assert sent == [(Scenario.ALLREDUCE, 256, 0, src, dst),
                        (Scenario.REDUCE, 1, 0, src + 1024, dst + 1024),
                        (Scenario.BCAST, 1, 0, dst + 1024, dst + 1024),
                        (Scenario.BCAST, 256, 1, dst, dst),
                        (Scenario.BCAST, 256, 1, dst + 1024, dst + 1024),
                        (Scenario.BCAST, 88, 1, dst + 2048, dst + 2048),
                        (Scenario.NOP, 0, 0, src, dst)]

        fake.retcode_for[TAG_ANY] = int(ErrorCode.ARITH_ERROR)  # the ring part fails
        since = len(fake.started())
        failed = driver.start(Scenario.ALLREDUCE, count=257, dtype=F32, addrs=(src, dst, dst))
        finish(failed)
        assert failed.retcode == ErrorCode.ARITH_ERROR and not failed.aborted
        assert [c.scenario for c in fake.started()[since:]] == [Scenario.ALLREDUCE]
    finally:
        close_within(device, 10)
        fake.close()
    assert fake.violations == []  # never a call started while another ran
