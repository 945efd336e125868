"""Results as if in order: memory hazards between one rank's unfinished calls.

First the pure tracker (aaccl/api/_hazards.py) against a byte-by-byte model, then
the API: calls whose device memory overlaps run in submission order (on the soft
CCLO, ACCL's emulator protocol and the PYNQ fake, where the order shows as
`waitfor`), calls on disjoint memory still overlap, host syncs take their data at
submission, a failed earlier call fails the later one, and random programs of
un-awaited calls give what running them one at a time gives.
"""

from __future__ import annotations

import time
from collections import defaultdict

from hypothesis import given, settings
from hypothesis import strategies as st

from aaccl.api._hazards import Hazards, Span

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
