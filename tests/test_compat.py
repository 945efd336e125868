"""`aaccl.compat`: pyaccl 0.2's blocking API on aaccl, checked against numpy.

Every collective from one thread per rank, primitives from one thread in turn,
run_async handles, pyaccl's argument order and count quirks, errors that raise
(where pyaccl passed silently), thread safety, how instances made one at a time
form worlds, the printed tables, and the emulator and card modes.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import aaccl
from aaccl.compat import (
    ACCL_DEFAULT_ARITH_CONFIG,
    TAG_ANY,
    ACCLArithConfig,
    ACCLReduceFunctions,
    CCLOp,
    ErrorCode,
    Handle,
    _worlds,
    accl,
)
from aaccl.soft._device import HWID as SOFT_HWID
from conftest import DTYPES, reference_inputs

SUM, MAX = ACCLReduceFunctions.SUM, ACCLReduceFunctions.MAX


@pytest.fixture
def world() -> Iterator[Callable[..., list[accl]]]:
    made: list[accl] = []

    def make(size: int, **options: Any) -> list[accl]:
        ranks = [accl(size, i, sim_mode=True, **options) for i in range(size)]
        made.extend(ranks)
        return ranks

    yield make
    for instance in made:
        instance.deinit()


def on_threads(ranks: list[accl], fn: Callable[[accl], Any]) -> list[Any]:
    """Run fn(rank) on one thread per rank, as pyaccl's collectives notebook does."""
    results: list[Any] = [None] * len(ranks)
    errors: list[BaseException] = []

    def body(i: int) -> None:
        try:
            results[i] = fn(ranks[i])
        except BaseException as error:  # reported on the test's thread
            errors.append(error)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]
    return results


def rank_of(instance: accl) -> int:
    return instance.communicators[0].local_rank


# -- collectives against numpy ------------------------------------------------------------

@pytest.mark.parametrize("size, count", [(1, 5), (3, 33), (4, 1000)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_collective_from_one_thread_per_rank(world: Any, size: int, count: int,
                                                   dtype: type) -> None:
    ranks = world(size, bufsize=256)
    inputs = [reference_inputs(r, count * size, dtype) for r in range(size)]
    flat = [x[:count] for x in inputs]

    def collectives(a: accl) -> dict[str, np.ndarray]:
        r = rank_of(a)
        out: dict[str, np.ndarray] = {}
        src = a.allocate((count * size,), dtype)
        src[:] = inputs[r]
        big, small = a.allocate((count * size,), dtype), a.allocate((count,), dtype)
        a.allreduce(src, small, count, SUM)
        out["allreduce"] = np.array(small)
        a.reduce(src, small, count, size - 1, MAX)
        out["reduce"] = np.array(small)
        a.allgather(src, big, count)
        out["allgather"] = np.array(big)
        a.reduce_scatter(src, small, count, SUM)
        out["reduce_scatter"] = np.array(small)
        a.scatter(src, small, count, 0)
        out["scatter"] = np.array(small)
        a.gather(src, big, count, 0)
        out["gather"] = np.array(big)
        bc = a.allocate((count,), dtype)
        bc[:] = src[:count]
        a.bcast(bc, count, size - 1)
        out["bcast"] = np.array(bc)
        a.barrier()
        return out

    results = on_threads(ranks, collectives)
    total = np.sum(flat, axis=0, dtype=dtype)
    for r, out in enumerate(results):
        np.testing.assert_array_equal(out["allreduce"], total)
        if r == size - 1:
            np.testing.assert_array_equal(out["reduce"], np.maximum.reduce(flat))
        np.testing.assert_array_equal(out["allgather"], np.concatenate(flat))
        np.testing.assert_array_equal(
            out["reduce_scatter"], np.sum(inputs, axis=0, dtype=dtype)[r * count:(r + 1) * count])
        np.testing.assert_array_equal(out["scatter"], inputs[0][r * count:(r + 1) * count])
        if r == 0:
            np.testing.assert_array_equal(out["gather"], np.concatenate(flat))
        np.testing.assert_array_equal(out["bcast"], flat[size - 1])


def test_primitives_from_one_thread_in_turn(world: Any) -> None:
    a0, a1 = world(2)
    src, dst = a0.allocate((300,)), a1.allocate((300,))
    src[:] = np.arange(300)
    a0.send(src, 300, 1, 7)  # pyaccl's 4th positional argument is the tag
    a0.send(src, 100, 1)
    a1.recv(dst, 300, 0, 7)
    np.testing.assert_array_equal(dst, np.arange(300))
    a1.recv(dst, 100, 0, TAG_ANY)
    np.testing.assert_array_equal(dst[:100], np.arange(100))
    out = a0.allocate((300,))
    a0.copy(src, out, 300)
    a0.combine(300, SUM, src, out, out)  # count and func first, as in pyaccl
    np.testing.assert_array_equal(out, 2 * np.arange(300))
    a0.nop()


def test_a_message_bigger_than_the_rx_buffers_and_compression(world: Any) -> None:
    a0, a1 = world(2, bufsize=128, nbufs=4)
    src, dst = a0.allocate((1000,)), a1.allocate((1000,))
    src[:] = np.linspace(-3, 3, 1000)

    def send(a: accl) -> None:
        a.send(src, 1000, 1, tag=1, compress_dtype=np.dtype("float16"))

    def recv(a: accl) -> None:
        a.recv(dst, 1000, 0, tag=1, compress_dtype=np.dtype("float16"))

    on_threads([a0, a1], lambda a: send(a) if a is a0 else recv(a))
    np.testing.assert_array_equal(dst, src.astype(np.float16).astype(np.float32))


# -- run_async, counts, communicators -------------------------------------------------------

def test_run_async_handles_wait_and_chain_into_the_async_api(world: Any) -> None:
    (a,) = world(1)
    src, dst = a.allocate((64,)), a.allocate((64,))
    src[:] = 3
    handle = a.copy(src, dst, 64, run_async=True)
    assert isinstance(handle, Handle)
    handle.wait()
    assert handle.done
    np.testing.assert_array_equal(dst, 3)  # synced back already; syncing again is harmless
    dst.sync_from_device()
    np.testing.assert_array_equal(dst, 3)
    first = a.copy(src, dst, 64, to_fpga=True, run_async=True)
    second = a.async_api.copy(dst, src, 64, from_fpga=True, waitfor=[first.call])
    second.wait(5)
    handle = a.nop(run_async=True)
    assert handle is not None and a.nop() is None
    handle.wait()


def test_counts_may_be_whole_floats_but_nothing_else(world: Any) -> None:
    (a,) = world(1)
    src, dst = a.allocate((256,)), a.allocate((256,))
    src[:] = 1
    a.copy(src, dst, 1024 / 4)  # pyaccl's performance notebook
    np.testing.assert_array_equal(dst, 1)
    for bad in (2.5, "4", True):
        with pytest.raises(TypeError, match="whole number"):
            a.copy(src, dst, bad)


def test_split_communicator_appends_and_returns_none(world: Any,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    ranks = world(4)
    members = ranks[1:]
    for a in members:
        assert a.split_communicator([3, 1, 2, 2]) is None  # sorted, once each
    for a in members:
        assert len(a.communicators) == 2
    comm = members[0].communicators[1]
    assert comm.local_rank == 0 and [r["port"] for r in comm.ranks] == [9001, 9002, 9003]
    bufs = [a.allocate((32,)) for a in members]
    bufs[0][:] = 5
    on_threads(members, lambda a: a.bcast(bufs[members.index(a)], 32, 0, comm_id=1))
    for buf in bufs:
        np.testing.assert_array_equal(buf, 5)
    comm.readback()
    assert capsys.readouterr().out == "Communicator readback on local_rank 0 of 3.\n"
    assert str(comm).splitlines()[0] == f"Communicator 1 at address {comm.addr}, rank 0 of 3:"
    assert str(comm).splitlines()[1] == ("Rank 1 -> IP: 127.0.0.1, Port: 9002, Session: 2, "
                                         "SegSize: 1024, ISeq: 0, OSeq: 0")
    with pytest.raises(ValueError, match="not in indices"):
        ranks[0].split_communicator([1, 2])


def test_readback_shows_the_messages_counted_per_peer(world: Any,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    a0, a1, _ = world(3)
    src, dst = a0.allocate((4,)), a1.allocate((4,))
    for _ in range(2):
        a0.send(src, 4, 1, 0)
    a1.recv(dst, 4, 0, 0)
    a0.communicators[0].readback()
    a1.communicators[0].readback()
    capsys.readouterr()
    assert [r["outbound_seq_number"] for r in a0.communicators[0].ranks] == [0, 2, 0]
    assert [r["inbound_seq_number"] for r in a1.communicators[0].ranks] == [1, 0, 0]
    assert "Rank 1 -> IP: 127.0.0.1, Port: 9001, Session: 1, SegSize: 1024, ISeq: 0, OSeq: 2" \
        in str(a0.communicators[0])
    a1.recv(dst, 4, 0, 0)


def test_tables_and_enums_keep_pyaccl_names() -> None:
    cfg = ACCL_DEFAULT_ARITH_CONFIG[("float32", "float16")]
    assert (cfg.uncompressed_elem_bytes, cfg.compressed_elem_bytes, cfg.arith_is_compressed) \
        == (4, 2, 1)
    custom = ACCLArithConfig(4, 4, 0, 0, 0, 0, [0])
    assert str(custom).startswith("Arithmetic Config at address None\n"
                                  "Uncompressed dtype B/element: 4\n")
    assert CCLOp.allreduce == 10 and CCLOp.all_to_all == 13 and CCLOp.nop == 255
    assert ErrorCode.RECEIVE_TIMEOUT_ERROR == 1 << 11 and SUM == 0


# -- errors ------------------------------------------------------------------------------------

def test_failures_raise_where_pyaccl_passed_silently(world: Any) -> None:
    a0, a1 = world(2)
    a1.set_timeout(200_000)  # 0.2 s in the soft CCLO's microsecond ticks
    dst = a1.allocate((8,))
    with pytest.raises(aaccl.CCLOError) as error:
        a1.recv(dst, 8, 0)  # nobody sends
    assert error.value.code & ErrorCode.RECEIVE_TIMEOUT_ERROR
    with pytest.raises(Exception, match=r"CCLO @0x0 during recv: RECEIVE_TIMEOUT_ERROR  you"):
        a1.check_return_value("recv")
    # the rank stays usable
    src = a0.allocate((8,))
    src[:] = 4
    a0.send(src, 8, 1)
    a1.recv(dst, 8, 0)
    np.testing.assert_array_equal(dst, 4)
    assert a1.get_retcode() == 0
    a1.check_return_value("recv")


@pytest.mark.parametrize("tag, words", [(TAG_ANY, "any tag"), (5, "tag=5")])
def test_timeouts_name_the_tag_as_the_user_wrote_it(world: Any, tag: int, words: str) -> None:
    """pyaccl's default tag is TAG_ANY (0xFFFFFFFF): messages say "any tag", never
    the number, on both sides of a timed-out pair."""
    ranks = world(2)
    for a in ranks:
        a.set_timeout(200_000)  # 0.2 s
    count = 1 << 20  # above the rx buffers: a send waits for its receive

    def failures(handles: list[Handle]) -> list[str]:  # both submitted before either waits
        errors = []
        for handle in handles:
            with pytest.raises(aaccl.CCLOError) as error:
                handle.wait()
            errors.append(str(error.value))
        return errors

    received = failures([a.recv(a.allocate((8,)), 8, 1 - rank_of(a), tag, run_async=True)
                         for a in ranks])
    sent = failures([a.send(a.allocate((count,)), count, 1 - rank_of(a), tag, run_async=True)
                     for a in ranks])
    for rank, (recv, send) in enumerate(zip(received, sent)):
        peer = 1 - rank
        assert f"waited 0.2 s for a message from rank {peer} ({words})" in recv
        assert f"recv(count=8, src={rank}, {words})" in recv  # the peer's call
        assert f"no matching recv(src={rank}, {words}) ran there" in send
        assert f"send(count={count}, dst={rank}, {words})" in send
        assert "4294967295" not in recv + send and "tag " not in recv + send


def test_bad_arguments_fail_before_anything_reaches_the_device(world: Any) -> None:
    with pytest.raises(ValueError, match="FPGA bitstream must be provided"):
        accl(2, 0)
    with pytest.raises(ValueError, match="Unrecognized Protocol"):
        accl(2, 0, protocol="IB", sim_mode=True)
    with pytest.raises(ValueError, match="local_rank 2"):
        accl(2, 2, sim_mode=True)
    a0, a1 = world(2)
    with pytest.raises(TypeError, match="does not move"):
        a0.copy(a0.allocate((4,), np.int8), a0.allocate((4,), np.int8), 4)
    with pytest.raises(ValueError, match="belongs to another rank"):
        a0.copy(a1.allocate((4,)), a0.allocate((4,)), 4)
    with pytest.raises(ValueError, match="unknown comm_id"):
        a0.allreduce(a0.allocate((4,)), a0.allocate((4,)), 4, SUM, comm_id=3)
    a0.nop()


# -- threads and worlds ------------------------------------------------------------------------

def test_one_instance_driven_from_many_threads(world: Any) -> None:
    (a,) = world(1)
    bufs = [(a.allocate((500,), np.int64), a.allocate((500,), np.int64)) for _ in range(8)]

    def work(i: int) -> None:
        src, dst = bufs[i]
        for k in range(30):
            src[:] = i * 1000 + k
            a.copy(src, dst, 500)
            assert (dst == i * 1000 + k).all()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    np.testing.assert_array_equal([dst[0] for _, dst in bufs], [i * 1000 + 29 for i in range(8)])


def test_instances_made_in_any_order_form_one_world_and_the_next_starts_after(world: Any) -> None:
    first = [accl(3, i, sim_mode=True) for i in (2, 0, 1)]
    second = [accl(3, i, sim_mode=True) for i in (0, 1, 2)]
    try:
        for group, value in ((first, 1), (second, 10)):
            bufs = {rank_of(a): a.allocate((4,)) for a in group}
            for r, buf in bufs.items():
                buf[:] = value * (r + 1)
            on_threads(group, lambda a, bufs=bufs: a.allreduce(bufs[rank_of(a)], bufs[rank_of(a)],
                                                                4, SUM))
            for buf in bufs.values():
                np.testing.assert_array_equal(buf, 6 * value)
    finally:
        for a in first + second:
            a.deinit()


@pytest.mark.filterwarnings("ignore:Call .* was never awaited:RuntimeWarning")
def test_deinit_waits_for_outstanding_calls_and_closes(world: Any) -> None:
    a0, a1 = world(2)
    dst = a1.allocate((16,))
    pending = a1.recv(dst, 16, 0, run_async=True)
    src = a0.allocate((16,))
    src[:] = 9
    a0.send(src, 16, 1)
    a1.deinit()
    assert pending.done
    np.testing.assert_array_equal(dst, 9)
    with pytest.raises(RuntimeError, match="closed"):
        a1.nop()
    a1.deinit()  # twice is harmless


def test_dumps_print_the_exchange_memory_and_rx_buffers(world: Any,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    (a,) = world(1, nbufs=2)
    a.dump_exchange_memory()
    a.dump_rx_buffers()
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "exchange mem:" and out[1] == "0x0 ['0x2', '0x400', " + repr(hex(
        a._driver.device.mmio_read(8))) + ", " + repr(hex(a._driver.device.mmio_read(12))) + "]"
    assert len(out) == 1 + 0x2000 // 16 + 1 + 2
    assert out[-1].startswith("SPARE RX BUFFER1:\t ADDR: ") and "STATUS: NOT USED" in out[-1]
    assert a.get_hwid() == SOFT_HWID


# -- the emulator and cards ------------------------------------------------------------------------

def test_sim_sock_drives_accls_emulator() -> None:
    from test_emulator_protocol import FakeEmulator

    server = FakeEmulator()
    try:
        a = accl(1, 0, sim_mode=True, sim_sock=f"tcp://localhost:{server.port}")
        try:
            src, dst = a.allocate((50,), np.int32), a.allocate((50,), np.int32)
            src[:] = np.arange(50)
            a.copy(src, dst, 50)
            np.testing.assert_array_equal(dst, np.arange(50))
        finally:
            a.deinit()
    finally:
        server.close()
    assert server.violations == []
    with pytest.raises(ValueError, match="ZMQ TCP address"):
        accl(1, 0, sim_mode=True, sim_sock="ipc:///tmp/x")


def test_xclbin_drives_a_card_through_pynq(monkeypatch: pytest.MonkeyPatch) -> None:
    from fakes.fake_pynq import Fake

    fake = Fake().install(monkeypatch)
    try:
        a = accl(1, 0, xclbin="/opt/accl/axis3x.xclbin", cclo_idx=0)
        try:
            src, dst = a.allocate((30,)), a.allocate((30,))
            src[:] = 2.5
            a.copy(src, dst, 30)
            np.testing.assert_array_equal(dst, 2.5)
            assert a.protocol == "AXIS"
        finally:
            a.deinit()
    finally:
        fake.shutdown()


# -- robustness: concurrent splits, bad constructors, stray instances ----------------------------

@pytest.fixture
def eager_thread_switches() -> Iterator[None]:
    """Let threads switch every microsecond instead of every 5 ms: a race between
    threads then shows in a few trials instead of one in hundreds."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def comm_id_of(a: accl, members: list[int]) -> int:
    """The index of the newest communicator of global ranks `members` on `a`."""
    ports = [9000 + m for m in members]
    found = [c.index for c in a.communicators if [r["port"] for r in c.ranks] == ports]
    assert found, f"no communicator of ranks {members} on {a}"
    return found[-1]


def test_threads_splitting_communicators_on_one_instance_get_their_own_records(
        world: Any, eager_thread_switches: None) -> None:
    """Ranks 1 and 2 split two communicators at once, from two threads each, 20 times
    over; every communicator gets exchange memory of its own, and an allreduce on it
    from the splitting thread sums its members' data."""
    ranks = world(4)
    groups = ([0, 1, 2], [1, 2, 3])
    for trial in range(20):
        jobs = [(r, g) for g in groups for r in g]
        start = threading.Barrier(len(jobs))
        results: dict[tuple[int, int], np.ndarray] = {}

        def split_and_sum(job: tuple[int, list[int]], trial: int = trial,
                          start: threading.Barrier = start,
                          results: dict[tuple[int, int], np.ndarray] = results) -> None:
            r, members = job
            a = ranks[r]
            start.wait(10)
            a.split_communicator(members)
            buf = a.allocate((16,), np.int64)
            buf[:] = 100 * trial + r
            a.allreduce(buf, buf, 16, SUM, comm_id=comm_id_of(a, members))
            results[(r, members[0])] = np.array(buf)

        on_threads(jobs, split_and_sum)
        for (r, first), got in results.items():
            members = groups[first]
            np.testing.assert_array_equal(got, sum(100 * trial + m for m in members))
    for a in ranks:
        addresses = [c.addr for c in a.communicators]
        assert len(set(addresses)) == len(addresses), f"{a}: records share an address"
        for c in a.communicators[1:]:  # every record reads back as what was split
            members = [r["port"] - 9000 for r in c.ranks]
            assert members in ([0, 1, 2], [1, 2, 3])
            assert c.local_rank == members.index(rank_of(a))


def test_communicators_read_from_many_threads_are_listed_once(
        world: Any, eager_thread_switches: None) -> None:
    (a,) = world(1)
    for rounds in range(1, 21):
        for _ in range(3):
            a.split_communicator([0])
        start = threading.Barrier(8)

        def read(a: accl, start: threading.Barrier = start) -> list[int]:
            start.wait(10)
            return [c.index for c in a.communicators]

        lists = on_threads([a] * 8, read)
        assert all(indices == list(range(1 + 3 * rounds)) for indices in lists)


def allreduce_works(group: list[accl]) -> None:
    bufs = {rank_of(a): a.allocate((8,), np.int32) for a in group}
    for r, buf in bufs.items():
        buf[:] = r + 1
    on_threads(group, lambda a: a.allreduce(bufs[rank_of(a)], bufs[rank_of(a)], 8, SUM))
    n = len(group)
    for buf in bufs.values():
        np.testing.assert_array_equal(buf, n * (n + 1) // 2)


def rank_1_completes(a0: accl) -> None:
    """accl(2, 1) joins `a0`'s world, and the two allreduce correctly."""
    a1 = accl(2, 1, sim_mode=True)
    try:
        allreduce_works([a0, a1])
    finally:
        a1.deinit()


BAD_CONSTRUCTORS = [
    (dict(bufsize=7), ValueError, "bufsize must be a multiple of 8 bytes, got 7"),
    (dict(bufsize=0), ValueError, "bufsize must be a positive integer, got 0"),
    (dict(bufsize="1024"), ValueError, "bufsize must be a positive integer, got '1024'"),
    (dict(nbufs=0), ValueError, "nbufs must be a positive integer, got 0"),
    (dict(nbufs=-3), ValueError, "nbufs must be a positive integer, got -3"),
    (dict(nbufs=281), ValueError, "nbufs=281 rx buffers do not fit the CCLO's exchange memory "
                                  "beside a world of 2 ranks: at most 280"),
    (dict(nbufs=2**20, bufsize=2**12), ValueError, r"must stay below 4 GiB"),
    (dict(nranks=0), ValueError, "nranks must be at least 1, got 0"),
    (dict(nranks=2.0), TypeError, "nranks must be an integer, not 2.0"),
    (dict(nranks=400), ValueError, "a world of 400 ranks does not fit"),
    (dict(local_rank=-1), ValueError, "local_rank must be at least 0, got -1"),
    (dict(local_rank=2), ValueError, "local_rank 2 is not a rank of a world of 2"),
    (dict(local_rank=True), TypeError, "local_rank must be an integer, not True"),
    (dict(sim_mode="yes"), TypeError, "sim_mode must be True or False, not 'yes'"),
    (dict(protocol="IB"), ValueError, "Unrecognized Protocol"),
    (dict(ranks=[{"ip": "10.0.0.1", "port": 1}, {"ip": "10.0.0.300", "port": 2}]),
     ValueError, r"ranks\[1\] = .* is no rank as pyaccl describes one .*: ip '10.0.0.300' "
                 "is not an IPv4 address"),
    (dict(ranks=[{"ip": "10.0.0.1"}, {"ip": "10.0.0.2"}]), ValueError, "KeyError: 'port'|'port'"),
    (dict(ranks="10.0.0.1"), TypeError, "ranks must be a list of one dict per rank"),
    (dict(arith_config={("float32", "nope"): ACCL_DEFAULT_ARITH_CONFIG[("float32", "float32")]}),
     TypeError, "arith_config names a dtype numpy does not know"),
    (dict(arith_config={"float32": 1}), TypeError, "must be an ACCLArithConfig"),
    (dict(cclo_idx=-1), ValueError, "cclo_idx must be at least 0, got -1"),
    (dict(sim_sock=5500), TypeError, "sim_sock must be a ZMQ address"),
]


@pytest.mark.parametrize(("bad", "kind", "message"), BAD_CONSTRUCTORS,
                         ids=[next(iter(b)) + "=" + repr(b[next(iter(b))])[:20]
                              for b, _, _ in BAD_CONSTRUCTORS])
def test_a_rejected_constructor_takes_no_place_in_a_world(world: Any, bad: dict[str, Any],
                                                          kind: type, message: str) -> None:
    """Between rank 0 and rank 1 of a world, a constructor with one bad argument raises
    before anything is made; rank 1 made next completes rank 0's world, and the world
    after that forms as usual."""
    first = world(1)  # a world of one in between changes nothing either
    a0 = accl(2, 0, sim_mode=True)
    try:
        with pytest.raises(kind, match=message):
            accl(**{"nranks": 2, "local_rank": 1, "sim_mode": True, **bad})
        rank_1_completes(a0)
    finally:
        a0.deinit()
    allreduce_works(world(2))
    allreduce_works(first)


def test_a_constructor_whose_device_fails_takes_no_place(world: Any,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from aaccl.driver import Driver

    configure = Driver.configure

    def fails_once(self: Driver) -> None:
        monkeypatch.setattr(Driver, "configure", configure)
        raise RuntimeError("the device broke")

    a0 = accl(2, 0, sim_mode=True)
    try:
        monkeypatch.setattr(Driver, "configure", fails_once)
        with pytest.raises(RuntimeError, match="the device broke"):
            accl(2, 1, sim_mode=True)
        rank_1_completes(a0)
    finally:
        a0.deinit()


def test_a_stray_instance_does_not_shift_later_worlds_and_learns_why(world: Any) -> None:
    """An extra accl(2, 0) whose rank 1 never comes: the next accl(2, 0) starts a new
    world, which accl(2, 1) completes; the stray's calls that need rank 1 fail at
    once, saying why, where they used to wait for the timeout."""
    stray = accl(2, 0, sim_mode=True)
    try:
        pending = stray.recv(stray.allocate((4,)), 4, 1, run_async=True)  # waits for rank 1
        allreduce_works(world(2))
        allreduce_works(world(2))  # and the next world too
        started = time.monotonic()
        with pytest.raises(aaccl.Aborted, match=r"rank 1 left the world: its accl\(2, 1, "
                           r"sim_mode=True\) was never made: a later accl\(2, 0, sim_mode=True\) "
                           r"started a new world first"):
            pending.wait(5)
        with pytest.raises(aaccl.Aborted, match="was never made"):
            stray.send(stray.allocate((4,)), 4, 1)
        assert time.monotonic() - started < 1  # not the 10 s timeout
        stray.nop()  # what needs no peer still works
    finally:
        stray.deinit()


def test_a_world_with_a_rank_closed_before_it_was_complete_is_not_joined(world: Any) -> None:
    early = accl(3, 0, sim_mode=True)
    other = accl(3, 1, sim_mode=True)
    try:
        early.deinit()
        pending = other.recv(other.allocate((4,)), 4, 2, run_async=True)
        with pytest.raises(aaccl.Aborted, match=r"accl\(3, 2, sim_mode=True\) was never made: "
                                               "rank 0 of its world was closed"):
            pending.wait(5)
        allreduce_works(world(3))  # rank 2 made now starts a fresh world with its peers
    finally:
        other.deinit()
    assert 3 not in _worlds._forming


@pytest.mark.parametrize(("value", "kind", "message"), [
    (-1, ValueError, "timeout must be 1 to 4294967295 timer ticks"),
    (0, ValueError, "timeout must be 1 to 4294967295 timer ticks"),
    (2**32, ValueError, "timeout must be 1 to 4294967295 timer ticks"),
    (1.5, TypeError, "timeout must be an integer, not 1.5"),
    ("100", TypeError, "timeout must be an integer, not '100'"),
    (None, TypeError, "timeout must be an integer, not None"),
])
def test_set_timeout_rejects_what_the_cclo_cannot_hold(world: Any, value: Any, kind: type,
                                                       message: str) -> None:
    a0, a1 = world(2)
    with pytest.raises(kind, match=message):
        a1.set_timeout(value)
    a1.set_timeout(2e5)  # a whole float is taken: 0.2 s
    src, dst = a0.allocate((8,)), a1.allocate((8,))
    src[:] = 6
    a0.send(src, 8, 1)
    a1.recv(dst, 8, 0)
    np.testing.assert_array_equal(dst, 6)
    started = time.monotonic()
    with pytest.raises(aaccl.CCLOError, match="RECEIVE_TIMEOUT"):
        a1.recv(dst, 8, 0)  # nobody sends: fails after the 0.2 s set above
    assert 0.15 < time.monotonic() - started < 2
