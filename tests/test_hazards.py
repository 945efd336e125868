"""Results as if in order: memory hazards between one rank's unfinished calls.

First the pure tracker (aaccl/api/_hazards.py) against a byte-by-byte model, then
the API: calls whose device memory overlaps run in submission order (on the soft
CCLO, ACCL's emulator protocol and the PYNQ fake, where the order shows as
`waitfor`), calls on disjoint memory still overlap, host syncs take their data at
submission, a failed earlier call fails the later one, and random programs of
un-awaited calls give what running them one at a time gives.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict

import anyio
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import aaccl
from aaccl import DependencyError, KernelError, ReduceFunction
from aaccl.api._hazards import Hazards, Span
from conftest import on_device, run_ranks

SUM = ReduceFunction.SUM

A, B = 0x1000, 0x9000  # two allocations' base addresses


def rd(base: int, start: int, end: int) -> Span:
    return base, base + start, base + end


# -- the tracker -----------------------------------------------------------------------------

def test_readers_wait_for_writers_and_never_for_each_other() -> None:
    h: Hazards[str] = Hazards()
    assert not h and h.conflicts([rd(A, 0, 8)], [rd(A, 0, 8)]) == []
    h.add("w", writes=[rd(A, 0, 8)])
    h.add("r1", reads=[rd(A, 0, 8)])
    h.add("r2", reads=[rd(A, 2, 4)])
    assert h.conflicts(reads=[rd(A, 0, 8)]) == ["w"]  # a read: the writer, not the readers
    assert h.conflicts(writes=[rd(A, 3, 4)]) == ["w", "r1", "r2"]  # a write: all of them
    assert h.conflicts(writes=[rd(A, 6, 8)]) == ["w", "r1"]
    assert h.conflicts(writes=[rd(A, 8, 16)]) == []  # touching is not overlapping
    assert h.conflicts(writes=[rd(B, 0, 8)]) == []  # another allocation


def test_a_write_supersedes_what_it_covers() -> None:
    """What a write covers is ordered before it: later calls wait for it alone."""
    h: Hazards[str] = Hazards()
    h.add("w1", writes=[rd(A, 0, 10)])
    h.add("r", reads=[rd(A, 0, 10)])
    h.add("w2", writes=[rd(A, 4, 6)])
    assert h.conflicts(writes=[rd(A, 4, 6)]) == ["w2"]
    assert h.conflicts(writes=[rd(A, 0, 10)]) == ["w1", "r", "w2"]  # around w2, still theirs
    assert [seg[:3] for seg in h.layout(A)] == [(A, A + 4, "w1"), (A + 4, A + 6, "w2"),
                                                (A + 6, A + 10, "w1")]
    h.add("w3", writes=[rd(A, 0, 10)])
    assert h.layout(A) == [(A, A + 10, "w3", [])]


def test_a_call_that_reads_and_writes_the_same_bytes_is_their_writer() -> None:
    h: Hazards[str] = Hazards()
    h.add("inplace", reads=[rd(A, 0, 8)], writes=[rd(A, 0, 8)])
    assert h.layout(A) == [(A, A + 8, "inplace", [])]
    assert h.conflicts(reads=[rd(A, 0, 1)]) == ["inplace"]


def test_finished_calls_are_forgotten_and_so_is_idle_memory() -> None:
    h: Hazards[str] = Hazards()
    h.add("w", writes=[rd(A, 0, 8)])
    h.add("r", reads=[rd(A, 4, 12), rd(B, 0, 4)])
    h.discard("w")
    assert h.conflicts(writes=[rd(A, 0, 12)]) == ["r"]
    h.discard("r")
    h.discard("never added")
    assert not h and len(h) == 0 and h.layout(A) == []
    h.add("empty", reads=[rd(A, 4, 4)], writes=[rd(A, 4, 4)])  # count 0 touches nothing
    assert not h and len(h) == 0


def test_readers_are_kept_through_splits() -> None:
    h: Hazards[str] = Hazards()
    h.add("r", reads=[rd(A, 0, 100)])
    h.add("w", writes=[rd(A, 40, 60)])  # splits r's segment in three
    h.add("r2", reads=[rd(A, 50, 70)])
    assert h.conflicts(writes=[rd(A, 90, 100)]) == ["r"]
    assert h.conflicts(writes=[rd(A, 55, 65)]) == ["w", "r2", "r"]
    h.discard("r")
    assert h.conflicts(writes=[rd(A, 0, 100)]) == ["w", "r2"]
    h.discard("w")
    h.discard("r2")
    assert not h


class ByteModel:
    """The tracker's meaning, one byte at a time: each byte's last unfinished writer
    and the unfinished readers since."""

    def __init__(self) -> None:
        self.writer: dict[int, int] = {}
        self.readers: dict[int, set[int]] = defaultdict(set)

    def conflicts(self, reads: list[Span], writes: list[Span]) -> set[int]:
        found = set()
        for spans, write in ((reads, False), (writes, True)):
            for _, start, end in spans:
                for byte in range(start, end):
                    if byte in self.writer:
                        found.add(self.writer[byte])
                    if write:
                        found |= self.readers[byte]
        return found

    def add(self, key: int, reads: list[Span], writes: list[Span]) -> None:
        for _, start, end in reads:
            for byte in range(start, end):
                self.readers[byte].add(key)
        for _, start, end in writes:
            for byte in range(start, end):
                self.writer[byte], self.readers[byte] = key, set()

    def discard(self, key: int) -> None:
        self.writer = {b: k for b, k in self.writer.items() if k != key}
        for readers in self.readers.values():
            readers.discard(key)


def check_invariants(h: Hazards[int]) -> None:
    held: dict[int, int] = defaultdict(int)
    for region in h._regions.values():
        assert region.starts == [s.start for s in region.segments]
        assert all(s.start < s.end for s in region.segments)
        assert all(a.end <= b.start for a, b in zip(region.segments, region.segments[1:]))
        assert region.live == sum(s.members() for s in region.segments) > 0
        for seg in region.segments:
            assert seg.region is region
            for key in [*seg.readers, *([seg.writer] if seg.writer is not None else [])]:
                assert seg in h._held[key]  # so that discard finds it
                held[key] += 1


spans = st.tuples(st.sampled_from([A, B]), st.integers(0, 40), st.integers(0, 12)).map(
    lambda t: (t[0], t[0] + t[1], t[0] + t[1] + t[2]))
steps = st.lists(st.one_of(
    st.tuples(st.just("add"), st.lists(spans, max_size=3), st.lists(spans, max_size=2)),
    st.tuples(st.just("discard"), st.integers(0, 30))), max_size=40)


@settings(max_examples=300, deadline=None)
@given(steps)
def test_the_tracker_agrees_with_a_byte_model(program: list[tuple]) -> None:
    h: Hazards[int] = Hazards()
    model = ByteModel()
    added: list[int] = []
    for step in program:
        if step[0] == "add":
            _, reads, writes = step
            assert set(h.conflicts(reads, writes)) == model.conflicts(reads, writes)
            key = len(added)
            added.append(key)
            h.add(key, reads, writes)
            model.add(key, reads, writes)
        elif added:
            key = added[step[1] % len(added)]
            h.discard(key)
            model.discard(key)
        check_invariants(h)
        for probe in [rd(A, 0, 60), rd(B, 0, 60), rd(A, 10, 11), rd(B, 30, 45)]:
            assert set(h.conflicts([probe], [])) == model.conflicts([probe], [])
            assert set(h.conflicts([], [probe])) == model.conflicts([], [probe])
    for key in added:
        h.discard(key)
    assert not h and len(h) == 0


def test_the_cost_is_linear_in_the_number_of_calls() -> None:
    """Tens of thousands of outstanding calls: readers of one range, writers of one
    range, and calls on disjoint slices of one allocation."""
    k = 40_000
    began = time.perf_counter()
    h: Hazards[int] = Hazards()
    for i in range(k):  # 40,000 sends of one buffer
        assert h.conflicts(reads=[rd(A, 0, 4096)]) == []
        h.add(i, reads=[rd(A, 0, 4096)])
    assert len(h.conflicts(writes=[rd(A, 0, 4096)])) == k  # one write waits for all
    h.add(k, writes=[rd(A, 0, 4096)])
    assert len(h.layout(A)) == 1 and len(h.conflicts(writes=[rd(A, 0, 4096)])) == 1
    for i in range(k + 1, 2 * k):  # allreduces into one buffer: each waits for the last
        assert h.conflicts(reads=[rd(B, 0, 64)], writes=[rd(A, 0, 4096)]) == [i - 1]
        h.add(i, reads=[rd(B, 0, 64)], writes=[rd(A, 0, 4096)])
    for i in range(2 * k):
        h.discard(i)
    assert not h
    for i in range(k):  # receives and sends into disjoint slices of one allocation
        h.add(i, writes=[rd(A, 16 * i, 16 * i + 8)])
        h.add(k + i, reads=[rd(A, 16 * i + 8, 16 * i + 16)])
        assert h.conflicts(writes=[rd(A, 16 * i, 16 * i + 8)]) == [i]
    for i in range(k):
        h.discard(i)
        h.discard(k + i)
    assert not h
    assert time.perf_counter() - began < 10  # about 1 s; quadratic would take hours


# -- through the API, on the soft CCLO ----------------------------------------------------------

def filled(accl: aaccl.ACCL, values: np.ndarray, *, on_device: bool = True) -> aaccl.Buffer:
    buf = accl.allocate(values.shape, values.dtype)
    buf[:] = values
    if on_device:
        buf.sync_to_device()
    return buf


def gate(accl: aaccl.ACCL) -> tuple[threading.Event, aaccl.Call]:
    """A call (a kernel touching no buffer) that holds until the event is set: calls
    waiting for it stay queued meanwhile."""
    opened = threading.Event()
    return opened, accl.kernel(lambda: opened.wait(10), name="gate")()


async def settle() -> None:
    """Time for anything that does not wait to finish."""
    await anyio.sleep(0.05)


@pytest.mark.anyio
@pytest.mark.parametrize("size", [2, 3])
async def test_two_outstanding_allreduces_into_one_buffer_give_the_in_order_result(
        size: int) -> None:
    n = 300

    async def rank(accl: aaccl.ACCL) -> tuple[np.ndarray, np.ndarray]:
        s = filled(accl, np.full(n, accl.rank + 1, np.float64))
        r, out = accl.allocate(n, np.float64), accl.allocate(n, np.float64)
        first = accl.allreduce(s, r, n, SUM, to_fpga=True)
        second = accl.allreduce(r, r, n, SUM, from_fpga=True)  # folds what the first wrote
        third = accl.allreduce(s, out, n, SUM)  # two writers of one buffer: the last wins
        fourth = accl.allreduce(r, out, n, SUM, from_fpga=True)
        for call in (fourth, third, second, first):
            await call
        return np.array(r), np.array(out)

    async with aaccl.open_world(size, timeout=5) as accls:
        results = await run_ranks(accls, rank)
    once = sum(range(1, size + 1))
    for r, out in results:
        np.testing.assert_array_equal(r, np.full(n, once * size))  # not 0, not a double fold
        np.testing.assert_array_equal(out, np.full(n, once * size * size))


@pytest.mark.anyio
async def test_a_send_delivers_its_data_though_a_later_call_overwrites_the_buffer() -> None:
    """A rendezvous send reads its buffer only once the receiver is there: the copy
    into that buffer, submitted after it, waits for it."""
    n = 8192  # 32 KiB: beyond the eager limit

    async def rank(accl: aaccl.ACCL) -> np.ndarray:
        if accl.rank == 0:
            buf = filled(accl, np.ones(n, np.float32))
            sent = accl.send(buf, n, 1, from_fpga=True)
            overwrite = accl.copy(filled(accl, np.full(n, 2, np.float32)), buf, n)
            await overwrite
            await sent
            return on_device(buf)
        dst = accl.allocate(n, np.float32)
        await settle()  # the overwrite had all the time it needed to overtake the send
        await accl.recv(dst, n, 0)
        return np.array(dst)

    async with aaccl.open_world(2, timeout=5) as accls:
        sender, receiver = await run_ranks(accls, rank)
    np.testing.assert_array_equal(receiver, 1)
    np.testing.assert_array_equal(sender, 2)


@pytest.mark.anyio
async def test_overlapping_slices_of_one_allocation_are_ordered() -> None:
    async with aaccl.open_world(1) as (accl,):
        buf = filled(accl, np.arange(100, dtype=np.float32))
        src = filled(accl, np.full(50, -1, np.float32))
        dst = accl.allocate(50, np.float32)
        opened, held = gate(accl)
        write = accl.copy(src, buf[10:60], 50, from_fpga=True, to_fpga=True, waitfor=[held])
        read = accl.copy(buf[40:90], dst, 50, from_fpga=True)  # reads bytes the write writes
        await settle()
        assert not read.done()
        opened.set()
        await read
        await write
        expected = np.arange(100, dtype=np.float32)
        expected[10:60] = -1
        np.testing.assert_array_equal(dst, expected[40:90])


@pytest.mark.anyio
async def test_calls_on_disjoint_memory_still_overlap() -> None:
    """Slices of one allocation side by side (in the buffer's own itemsize: float16
    here), and readers of the same bytes, do not wait for each other."""
    async with aaccl.open_world(1) as (accl,):
        wide = filled(accl, np.arange(100, dtype=np.float32))
        narrow = accl.allocate(100, np.float16)
        copies = accl.allocate(100, np.float32)
        opened, held = gate(accl)
        first = accl.copy(wide, narrow[:50], 50, from_fpga=True, to_fpga=True, waitfor=[held])
        beside = accl.copy(wide[50:], narrow[50:], 50, from_fpga=True, to_fpga=True)
        reader = accl.copy(wide, copies, 100, from_fpga=True)  # reads what `first` reads
        after = accl.copy(narrow[49:51], copies[:2], 2, from_fpga=True)  # reads both halves
        with anyio.fail_after(5):
            await beside
            await reader
        await settle()
        assert not first.done() and not after.done()
        opened.set()
        await after
        await first
        np.testing.assert_array_equal(on_device(narrow), np.arange(100, dtype=np.float16))
        np.testing.assert_array_equal(copies, np.r_[49, 50, 2:100].astype(np.float32))


@pytest.mark.anyio
async def test_host_data_is_taken_at_submission_and_written_after_earlier_users() -> None:
    """Syncing host data in would overwrite device memory an earlier call still
    writes (or reads): the snapshot is written once that call is done."""
    n = 64
    async with aaccl.open_world(1) as (accl,):
        src = filled(accl, np.ones(n, np.float32))
        mid, dst = accl.allocate(n, np.float32), accl.allocate(n, np.float32)
        opened, held = gate(accl)
        produce = accl.copy(src, mid, n, from_fpga=True, to_fpga=True, waitfor=[held])
        mid[:] = 7  # host only, after submitting `produce`
        consume = accl.copy(mid, dst, n)  # syncs host mid in: 7, after `produce` wrote 1
        mid[:] = 8  # too late for `consume`: it took its snapshot
        await settle()
        assert not consume.done()
        np.testing.assert_array_equal(on_device(mid), 0)  # nothing written yet
        opened.set()
        await consume
        await produce
        np.testing.assert_array_equal(dst, 7)
        np.testing.assert_array_equal(on_device(mid), 7)  # as in order: produce, then the sync


@pytest.mark.anyio
async def test_host_data_sent_twice_while_the_first_send_waits() -> None:
    """One host buffer sent again while the first send waits: unchanged, the second
    send overlaps the first; changed on the host in between, each send delivers what
    it was given."""
    n = 64

    async def rank(accl: aaccl.ACCL) -> list[np.ndarray]:
        if accl.rank == 0:
            buf = filled(accl, np.ones(n, np.float32), on_device=False)
            opened, held = gate(accl)
            first = accl.send(buf, n, 1, waitfor=[held])
            again = accl.send(buf, n, 2)  # the same bytes: it need not wait
            with anyio.fail_after(5):
                await again
            buf[:] = 3
            changed = accl.send(buf, n, 2)  # must not change what `first` sends
            await settle()
            assert not first.done() and not changed.done()
            opened.set()
            for call in (first, changed):
                await call
            return []
        dsts = [accl.allocate(n, np.float32) for _ in range(accl.rank)]
        for dst in dsts:
            await accl.recv(dst, n, 0)
        return [np.array(d) for d in dsts]

    async with aaccl.open_world(3, timeout=5) as accls:
        _, (to_1,), (to_2, to_2_changed) = await run_ranks(accls, rank)
    np.testing.assert_array_equal(to_1, 1)
    np.testing.assert_array_equal(to_2, 1)
    np.testing.assert_array_equal(to_2_changed, 3)


@pytest.mark.anyio
async def test_a_failed_earlier_call_on_the_same_buffer_fails_the_later_one() -> None:
    opened = threading.Event()

    def broken(x: np.ndarray) -> None:
        opened.wait(10)
        raise ValueError("no good")

    async with aaccl.open_world(1) as (accl,):
        buf = filled(accl, np.ones(16, np.float32))
        dst, other = accl.allocate(16, np.float32), accl.allocate(16, np.float32)
        bad = accl.kernel(broken)(buf)
        later = accl.copy(buf, dst, 16, from_fpga=True)
        elsewhere = accl.copy(dst, other, 16, from_fpga=True, waitfor=[later])
        apart = accl.copy(other, other[8:], 8, from_fpga=True)  # waits for `elsewhere`
        unrelated = accl.copy(accl.allocate(16, np.float32), dst[:0], 0)
        opened.set()
        with pytest.raises(KernelError):
            await bad
        with pytest.raises(DependencyError, match=r"^copy \(rank 0, call \d+\) did not run: "
                           r"kernel broken \(rank 0, call \d+\) failed \(an earlier call on "
                           r"the same buffer\)$") as info:
            await later
        assert isinstance(info.value.__cause__, KernelError)
        with pytest.raises(DependencyError, match=r"copy \(rank 0, call \d+\) failed$"):
            await elsewhere  # an explicit waitfor: named as before
        with pytest.raises(DependencyError, match="failed \\(an earlier call on the same"):
            await apart
        await unrelated
        np.testing.assert_array_equal(on_device(dst), 0)  # nothing ran on bad data
