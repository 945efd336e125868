"""Results as if in order: memory hazards between one rank's unfinished calls.

First the pure tracker (aaccl/api/_hazards.py) against a byte-by-byte model, then
the API: calls whose device memory overlaps run in submission order (on the soft
CCLO, ACCL's emulator protocol and the PYNQ fake, where the order shows as
`waitfor`), calls on disjoint memory still overlap, host syncs take their data at
submission, a failed earlier call fails the later one, and random programs of
un-awaited calls give what running them one at a time gives.
"""

from __future__ import annotations

import random
import threading
import time
from collections import defaultdict
from dataclasses import dataclass

import anyio
from typing import Any

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


def test_a_call_alone_in_the_books_is_one_slot_until_a_second_comes() -> None:
    """The common case costs a slot: no allocation listed, no segment built, until a
    second call comes; then the first one's spans are what they were."""
    h: Hazards[str] = Hazards()
    h.add("alone", reads=[rd(A, 0, 8)], writes=[rd(B, 0, 4)])
    assert h._one == "alone" and not h._lone and not h._solo and not h._regions
    assert h and len(h) == 1 and h.uses([rd(B, 8, 9)]) and not h.uses([rd(0x20000, 0, 4)])
    assert h.conflicts(reads=[rd(A, 0, 8)]) == [] and h.conflicts(writes=[rd(A, 4, 5)]) == ["alone"]
    assert h.conflicts(reads=[rd(B, 3, 9)]) == ["alone"] and h.conflicts(reads=[rd(B, 4, 9)]) == []
    assert h._one == "alone"  # (asking changes nothing)
    h.discard("someone else")
    h.discard("alone")
    assert not h and len(h) == 0 and h._one is None and h._one_spans is None
    h.add("first", writes=[rd(A, 0, 8)])
    h.add("second", reads=[rd(A, 4, 12)])
    assert h._one is None and h.conflicts(writes=[rd(A, 0, 1)]) == ["first"]
    assert h.layout(A) == [(A, A + 4, "first", []), (A + 4, A + 8, "first", ["second"]),
                           (A + 8, A + 12, None, ["second"])]
    h.discard("first")
    h.discard("second")
    assert not h and len(h) == 0


def test_a_call_alone_beside_superseded_ones_is_one_slot_and_each_is_forgotten() -> None:
    """Calls whose segments were all superseded are still listed (in `_held`) when
    their allocation's region is gone: the next call alone is one slot, and forgetting
    either leaves nothing behind."""
    h: Hazards[str] = Hazards()
    h.add("w1", writes=[rd(A, 0, 8)])
    h.add("w2", writes=[rd(A, 0, 8)])  # supersedes w1 there
    h.discard("w2")  # the region goes; w1 is listed still
    assert not h._regions and not h._lone
    h.add("alone", reads=[rd(B, 0, 4)])
    assert h._one == "alone" and len(h) == 2
    h.discard("w1")
    assert h._one == "alone" and len(h) == 1 and not h._held and not h._solo
    h.discard("alone")
    assert not h and len(h) == 0


def test_the_books_may_be_asked_whether_memory_is_in_use_while_a_call_goes() -> None:
    """A rank asks `uses` without its lock (ACCL._submit): the call in the one slot may
    be forgotten meanwhile, by the thread that completed it (here: while `uses` reads
    the spans it was asked about), and `uses` still answers."""
    h: Hazards[str] = Hazards()
    h.add("alone", reads=[rd(A, 0, 8)])

    class ForgottenMeanwhile(list):  # type: ignore[type-arg]
        def __iter__(self):  # type: ignore[no-untyped-def]
            h.discard("alone")  # (as ACCL._forget does, on the completing thread)
            return super().__iter__()

    assert not h.uses([rd(B, 0, 4)], ForgottenMeanwhile([rd(B, 8, 12)]))
    assert not h and h.uses([rd(A, 0, 4)]) is False


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
async def test_a_large_host_buffer_changed_in_its_last_byte_is_still_told_apart() -> None:
    n = 100_000  # compared chunk by chunk
    async with aaccl.open_world(1) as (accl,):
        buf = filled(accl, np.arange(n, dtype=np.float32), on_device=False)
        outs = [accl.allocate(n, np.float32) for _ in range(3)]
        opened, held = gate(accl)
        first = accl.copy(buf, outs[0], n, waitfor=[held])
        again = accl.copy(buf, outs[1], n)  # the same bytes: no wait
        with anyio.fail_after(5):
            await again
        buf[-1] = -1
        changed = accl.copy(buf, outs[2], n)
        await settle()
        assert not changed.done()
        opened.set()
        await changed
        await first
        np.testing.assert_array_equal(outs[0], np.arange(n))
        np.testing.assert_array_equal(outs[2], np.r_[np.arange(n - 1), -1])


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



@pytest.mark.anyio
async def test_10000_outstanding_calls_on_one_allocation() -> None:
    """Half on disjoint slices (none waits), half a chain folding into one slice (each
    waits for the last): submitted in time linear in their number, and forgotten."""
    k = 5000
    async with aaccl.open_world(1) as (accl,):
        one = filled(accl, np.ones(4, np.float32))
        big = accl.allocate(4 * k + 4, np.float32)
        began = time.perf_counter()
        calls = [accl.copy(one, big[4 * i:4 * i + 4], 4, from_fpga=True, to_fpga=True)
                 for i in range(k)]
        total = big[4 * k:]
        calls += [accl.combine(4, SUM, total, one, total, True, True, to_fpga=True)
                  for _ in range(k)]
        submitted = time.perf_counter() - began
        for call in calls:
            await call
        np.testing.assert_array_equal(on_device(big), np.r_[np.ones(4 * k), np.full(4, k)])
        assert not accl._hazards and len(accl._hazards) == 0 and not accl._hazard_deps
        assert submitted < 20  # about 1 s here


@pytest.mark.anyio
async def test_10000_outstanding_sends_of_one_host_buffer_cost_each_the_same() -> None:
    """A host buffer sent again and again while the earlier sends still wait for
    their receives: each new send finds the device copy equal and writes nothing,
    without listing the earlier sends that read it (every one of them: time
    quadratic in their number, as it was)."""
    k = 10_000
    async with aaccl.open_world(2, timeout=30) as (a, b):
        src = a.allocate(4, np.float32)
        src[:] = [1, 2, 3, 4]
        book = a._hazards
        listed: list[int] = []
        conflicts = book.conflicts

        def counted(reads: Any = (), writes: Any = ()) -> list[Any]:
            found = conflicts(reads, writes)
            listed.append(len(found))
            return found

        book.conflicts = counted  # type: ignore[method-assign]
        began = time.perf_counter()
        sends = [a.send(src, 4, 1, tag=7) for _ in range(k)]
        submitted = time.perf_counter() - began
        assert not any(s.done() for s in sends[100:])  # they wait for their receives
        assert max(listed) <= 1  # the last sync's writer at most, never the readers
        dsts = [b.allocate(4, np.float32) for _ in range(k)]
        recvs = [b.recv(dst, 4, 0, tag=7) for dst in dsts]
        for call in (*sends, *recvs):
            await call
        assert all((dst == [1, 2, 3, 4]).all() for dst in dsts)
        assert not book and len(book) == 0
        assert submitted < 30  # about 1 s here; quadratic took a minute


# -- on ACCL's emulator protocol and on the PYNQ fake: hazards as waitfor --------------------------

def spy_on_starts(device: object) -> list[tuple[object, list[object]]]:
    """Record (args, waitfor) of every call the driver starts on `device`."""
    seen: list[tuple[object, list[object]]] = []
    start = device.start  # type: ignore[attr-defined]

    def recording(args: object, waitfor: object = ()) -> object:
        seen.append((args, list(waitfor)))  # type: ignore[call-overload]
        return start(args, waitfor)

    device.start = recording  # type: ignore[attr-defined]
    return seen


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_on_the_emulator_protocol_a_hazard_is_a_dependency_resolved_on_the_host(
        backend: str) -> None:
    pytest.importorskip("zmq", reason="the emulator device needs pyzmq")
    from aaccl._constants import Scenario
    from test_emulator_protocol import FakeEmulator

    n = 50
    fake = FakeEmulator()

    async def main(accl: aaccl.ACCL) -> list[tuple[int, int]]:
        seen = spy_on_starts(accl._driver.device)
        src, mid, dst, other = (accl.allocate(n, np.float32) for _ in range(4))
        src[:] = np.arange(n)
        opened, held = gate(accl)
        produce = accl.copy(src, mid, n, to_fpga=True, waitfor=[held])
        consume = accl.copy(mid, dst, n, from_fpga=True)  # reads what produce writes
        beside = accl.copy(src, other, n)  # reads what produce reads: no wait
        with anyio.fail_after(5):
            await beside  # ran on the emulator while produce waits
        assert not produce.done() and not consume.done()
        opened.set()
        await consume
        await produce
        np.testing.assert_array_equal(dst, np.arange(n))
        copies = [waitfor for args, waitfor in seen if args.scenario == Scenario.COPY]
        assert copies == [[held], [produce], []]
        return [(b.device_address, c.device_address) for b, c in
                [(src, other), (src, mid), (mid, dst)]]

    try:
        [expected] = aaccl.run(main, 1, device="emulator", emulator_port=fake.port, nbufs=4,
                               timeout=5, backend=backend)
        started = [(c.request["addr_0"], c.request["addr_2"]) for c in fake.started()
                   if c.scenario == Scenario.COPY]
        assert started == expected  # beside while produce waited, consume after produce
    finally:
        fake.close()
    assert fake.violations == []


@pytest.mark.anyio
async def test_on_pynq_a_hazard_is_a_waitfor_handed_to_the_card(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from aaccl._constants import Scenario
    from aaccl.api._accl import ACCL
    from aaccl.api._world import _ranks
    from aaccl.devices._pynq import PynqDevice
    from aaccl.driver import Driver
    from fakes.fake_pynq import Fake

    fake = Fake().install(monkeypatch)
    device = PynqDevice("/opt/accl/ccl_offload.xclbin")
    accl = await ACCL.open(Driver(device, 0, _ranks(1, 1024), nbufs=4, bufsize=1024, timeout=5))
    try:
        n = 100
        src, mid, dst, other = (accl.allocate(n, np.float32) for _ in range(4))
        src[:] = np.arange(n)
        held = fake.hold(Scenario.COPY)
        produce = accl.copy(src, mid, n, to_fpga=True)
        consume = accl.copy(mid, dst, n, from_fpga=True)  # reads what produce writes
        beside = accl.copy(src, other, n, to_fpga=True)  # reads what produce reads
        mid[:] = 5
        resync = accl.copy(mid, other, n)  # host mid in: after produce wrote, consume read it
        first, second, third = fake.runs(Scenario.COPY)
        assert (first.waitfor, second.waitfor, third.waitfor) == ((), (first.handle,), ())
        assert len(fake.runs(Scenario.COPY)) == 3  # resync waits for its snapshot, on the host
        held.set()
        for call in (resync, consume, beside, produce):
            await call
        np.testing.assert_array_equal(dst, np.arange(n))
        np.testing.assert_array_equal(other, 5)
        (fourth,) = fake.runs(Scenario.COPY)[3:]
        synced = fake.events.index(("sync_to_device", mid.device_address, 4 * n))
        assert fake.events.index(("ended", second)) < synced < fake.events.index(("began", fourth))

        held.clear()  # readers of host data: the card's memory is read to compare
        reader = accl.copy(src, dst, n)
        again = accl.copy(src, other, n)
        src[0] = -1
        changed = accl.copy(src, mid, n)
        assert [run.waitfor for run in fake.runs(Scenario.COPY)[4:]] == [(), ()]
        held.set()
        for call in (changed, again, reader):
            await call
        np.testing.assert_array_equal(dst, np.arange(n))
        np.testing.assert_array_equal(mid, np.r_[-1, 1:n])
    finally:
        await accl.aclose()
        fake.shutdown()
    assert fake.races == [], "PYNQ's start and _handle_events ran at once"


# -- random programs of un-awaited calls, against running them one at a time ---------------------

NBUFS, LENGTH, MAX_N = 3, 24, 8
KINDS = ["copy", "combine", "sendrecv", "allreduce", "bcast"]


@dataclass(frozen=True)
class Op:
    kind: str
    rank: int  # copy, combine: the rank; sendrecv: the sender; bcast: the root
    peer: int  # sendrecv: the receiver
    slices: tuple[tuple[int, int], ...]  # (buffer, offset): what the op reads, then writes
    n: int
    func: ReduceFunction


@dataclass(frozen=True)
class Program:
    size: int
    ops: tuple[Op, ...]
    seed: int


def apart_or_same(slices: list[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    """An op's written slice either is one of its read slices (in place) or overlaps
    none: partial overlap inside one call is not what this tests."""
    *reads, write = slices
    for read in reads:
        if read[0] == write[0] and read != write and abs(read[1] - write[1]) < n:
            reads = [read if other[0] == read[0] and abs(other[1] - read[1]) < n else other
                     for other in reads]
            write = read
    return [*reads, write]


@st.composite
def programs(draw: st.DrawFn) -> Program:
    size = draw(st.integers(2, 3))
    ops = []
    for _ in range(draw(st.integers(1, 14))):
        kind = draw(st.sampled_from(KINDS))
        n = draw(st.integers(1, MAX_N))
        arity = 3 if kind == "combine" else 2
        slices = [(draw(st.integers(0, NBUFS - 1)), draw(st.integers(0, LENGTH - n)))
                  for _ in range(arity)]
        if kind != "sendrecv":  # a sendrecv's slices are on two ranks
            slices = apart_or_same(slices, n)
        rank = draw(st.integers(0, size - 1))
        peer = draw(st.integers(0, size - 2))
        ops.append(Op(kind, rank, peer + (peer >= rank), tuple(slices), n,
                      draw(st.sampled_from([ReduceFunction.SUM, ReduceFunction.MAX]))))
    return Program(size, tuple(ops), draw(st.integers(0, 2**16)))


def initial(rank: int, buf: int) -> np.ndarray:
    return np.random.default_rng(100 * rank + buf).integers(-9, 10, LENGTH).astype(np.float64)


def in_order(program: Program) -> list[list[np.ndarray]]:
    """Device memory after running the program one call at a time, in order."""
    mem = [[initial(r, b) for b in range(NBUFS)] for r in range(program.size)]
    fold = {ReduceFunction.SUM: np.add, ReduceFunction.MAX: np.maximum}
    for op in program.ops:
        n = op.n

        def at(rank: int, where: tuple[int, int]) -> np.ndarray:
            return mem[rank][where[0]][where[1]:where[1] + n]
        if op.kind == "copy":
            at(op.rank, op.slices[1])[:] = at(op.rank, op.slices[0]).copy()
        elif op.kind == "combine":
            a, b, out = op.slices
            at(op.rank, out)[:] = fold[op.func](at(op.rank, a), at(op.rank, b))
        elif op.kind == "sendrecv":
            at(op.peer, op.slices[1])[:] = at(op.rank, op.slices[0]).copy()
        elif op.kind == "allreduce":
            values = [at(r, op.slices[0]).copy() for r in range(program.size)]
            total = values[0]
            for value in values[1:]:
                total = fold[op.func](total, value)
            for r in range(program.size):
                at(r, op.slices[1])[:] = total
        else:  # bcast
            value = at(op.rank, op.slices[0]).copy()
            for r in range(program.size):
                at(r, op.slices[0])[:] = value
    return mem


def run_program(program: Program, backend: str) -> list[list[np.ndarray]]:
    """Every rank submits its part of the program in order, awaiting nothing until the
    end; ranks yield to each other at random places."""

    async def main(accl: aaccl.ACCL) -> list[np.ndarray]:
        rng = random.Random(program.seed * 10 + accl.rank)
        bufs = [filled(accl, initial(accl.rank, b)) for b in range(NBUFS)]
        calls = []
        for tag, op in enumerate(program.ops):
            if rng.random() < 0.3:
                await anyio.lowlevel.checkpoint()
            slices = [bufs[b][offset:offset + op.n] for b, offset in op.slices]
            on = {"from_fpga": True, "to_fpga": True}
            if op.kind == "copy" and accl.rank == op.rank:
                calls.append(accl.copy(*slices, op.n, **on))
            elif op.kind == "combine" and accl.rank == op.rank:
                calls.append(accl.combine(op.n, op.func, *slices, val1_from_fpga=True,
                                          val2_from_fpga=True, to_fpga=True))
            elif op.kind == "sendrecv" and accl.rank == op.rank:
                calls.append(accl.send(slices[0], op.n, op.peer, tag=tag, from_fpga=True))
            elif op.kind == "sendrecv" and accl.rank == op.peer:
                calls.append(accl.recv(slices[1], op.n, op.rank, tag=tag, to_fpga=True))
            elif op.kind == "allreduce":
                calls.append(accl.allreduce(*slices, op.n, op.func, **on))
            elif op.kind == "bcast":
                calls.append(accl.bcast(slices[0], op.n, op.rank, **on))
        rng.shuffle(calls)
        for call in calls:
            await call
        return [on_device(buf) for buf in bufs]

    return aaccl.run(main, world_size=program.size, backend=backend, timeout=5.0)


def check_program(program: Program, backend: str) -> None:
    want = in_order(program)
    got = run_program(program, backend)
    for rank in range(program.size):
        for b in range(NBUFS):
            np.testing.assert_array_equal(got[rank][b], want[rank][b],
                                          err_msg=f"rank {rank}, buffer {b}, of {program}")


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@settings(max_examples=50, deadline=None)
@given(programs())
def test_random_programs_give_the_in_order_result(backend: str, program: Program) -> None:
    check_program(program, backend)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@settings(max_examples=150, deadline=None)
@given(programs())
def test_random_programs_give_the_in_order_result_at_length(backend: str,
                                                            program: Program) -> None:
    check_program(program, backend)


@pytest.mark.anyio
async def test_on_pynq_an_overwrite_waits_for_the_earlier_result_to_reach_the_host(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """ERT would start the second copy as soon as the first ends on the card, before
    the host synced the first one's result out: the second waits on the host."""
    from aaccl._constants import Scenario
    from aaccl.api._accl import ACCL
    from aaccl.api._world import _ranks
    from aaccl.devices._pynq import PynqDevice
    from aaccl.driver import Driver
    from fakes.fake_pynq import Fake

    fake = Fake().install(monkeypatch)
    device = PynqDevice("/opt/accl/ccl_offload.xclbin")
    accl = await ACCL.open(Driver(device, 0, _ranks(1, 1024), nbufs=4, bufsize=1024, timeout=5))
    try:
        n = 1000
        one, two, mid = (accl.allocate(n, np.float32) for _ in range(3))
        one[:], two[:] = 1, 2
        for _ in range(5):
            held = fake.hold(Scenario.COPY)
            first = accl.copy(one, mid, n)  # syncs mid to the host once it ran
            second = accl.copy(two, mid, n, to_fpga=True)  # overwrites mid on the card
            held.set()
            await first
            np.testing.assert_array_equal(mid, 1)
            await second
            fake.gates.clear()
        assert all(run.waitfor == () for run in fake.runs(Scenario.COPY))
    finally:
        await accl.aclose()
        fake.shutdown()


# -- a host read that races with an earlier call's host result --------------------------

RACE = "reads its input from host memory that an earlier allreduce of its rank"


@pytest.mark.anyio
async def test_a_host_input_that_an_earlier_call_is_yet_to_write_warns_at_its_line() -> None:
    """A call that syncs in host memory an earlier call of its rank, still running,
    syncs its result into reads whatever is there first: a race of the program's own
    (host memory is the program's to order), said at the user's line, once per line."""
    import warnings

    async with aaccl.open_world(2) as (a, b):
        bufs = [[accl.allocate(4, np.float32) for _ in range(3)] for accl in (a, b)]
        (x, y, z), (u, v, w) = bufs
        x[:], u[:] = 1, 2
        first = a.allreduce(x, y, 4, SUM)  # rank 1 has not called: it is still running
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            racing = [a.allreduce(y, z, 4, SUM) for _ in range(20)]; line = _line()  # noqa: E702
        assert [(str(w.message).startswith(f"this allreduce {RACE}"), w.filename, w.lineno)
                for w in caught] == [(True, __file__, line)]
        later = [b.allreduce(u, v, 4, SUM)] + [b.allreduce(v, w, 4, SUM) for _ in racing]
        for call in [first, *racing, *later]:
            await call
        assert y[0] == 3


@pytest.mark.anyio
async def test_data_kept_on_the_device_or_an_awaited_call_do_not_warn() -> None:
    import warnings

    async with aaccl.open_world(2) as (a, b):
        (x, y, z), (u, v, w) = [[accl.allocate(4, np.float32) for _ in range(3)]
                                for accl in (a, b)]
        x[:], u[:] = 1, 2
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            chain = [a.allreduce(x, y, 4, SUM, to_fpga=True),
                     a.allreduce(y, z, 4, SUM, from_fpga=True)]  # y stays on the device
            peer = [b.allreduce(u, v, 4, SUM, to_fpga=True),
                    b.allreduce(v, w, 4, SUM, from_fpga=True)]
            for call in chain + peer:
                await call
            assert z[0] == 6
            x[:], u[:] = 5, 6
            ends = [a.allreduce(x, y, 4, SUM), b.allreduce(u, v, 4, SUM)]
            for call in ends:
                await call
            again = [a.allreduce(y, z, 4, SUM), b.allreduce(v, w, 4, SUM)]  # y's ended
            for call in again:
                await call
        assert [w for w in caught if RACE in str(w.message)] == []
        assert z[0] == 22


def _line() -> int:
    import sys

    return sys._getframe(1).f_lineno
