"""Memory hazards between one rank's unfinished calls.

ACCL's CCLO runs a rank's calls one at a time, in submission order; aaccl lets them
overlap. To give the results that order gives, a new call must wait for every
earlier unfinished call whose device memory overlaps its own, one of the two
writing (read-after-write, write-after-read, write-after-write). Calls on disjoint
memory, and readers of the same memory, still overlap.

This module only keeps the books (no I/O, no locks: the ACCL guards it). Each
allocation has a map of disjoint byte segments, and each segment remembers its last
unfinished writer and the unfinished readers since: a write supersedes everything
it covers (whatever was there is ordered before it, so later calls need only wait
for it), so the books stay as small as the memory's distinct pieces, and

- a new read looks only at writers (10,000 outstanding sends of one buffer cost
  nothing to the next send);
- a new write looks at the writer and the readers of what it covers, then drops
  them;
- a finished call leaves in time proportional to the segments it is in.

Most calls use memory no other unfinished call of their rank uses: such a call is
kept as it came, its spans under its allocations (`_lone`), with no segment built;
only a second call on the same allocation turns the first one's spans into
segments. So a rank whose calls do not share memory pays a dict entry per
allocation, whatever the size of the books. And a call alone in the books (a
rank's small calls one at a time) is one slot (`_one`): added and forgotten in a
store each (the rank does both in line), and moved to `_lone` only once a second
call comes.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Hashable, Iterable, Sequence
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)

Span = tuple[int, int, int]
"""(allocation, start, end): device bytes [start, end) of the allocation whose base
address is `allocation`."""


class _Segment(Generic[K]):
    """Bytes [start, end) of one allocation: their last unfinished writer and the
    unfinished readers since (readers as a dict: ordered, O(1) removal)."""

    __slots__ = ("start", "end", "writer", "readers", "region")

    def __init__(self, start: int, end: int, writer: K | None, readers: dict[K, None],
                 region: _Region[K]) -> None:
        self.start, self.end, self.writer, self.readers = start, end, writer, readers
        self.region: _Region[K] | None = region  # None once superseded: a stale reference

    def members(self) -> int:
        return len(self.readers) + (self.writer is not None)


class _Region(Generic[K]):
    """The segments of one allocation, sorted and disjoint (gaps are untouched memory).

    `live` counts (call, segment) memberships: at zero nothing is outstanding in the
    allocation and the region is dropped, empty segments and all."""

    __slots__ = ("base", "starts", "segments", "live")

    def __init__(self, base: int) -> None:
        self.base = base
        self.starts: list[int] = []
        self.segments: list[_Segment[K]] = []
        self.live = 0

    def overlapping(self, start: int, end: int) -> tuple[int, int]:
        """Index range of the segments that overlap [start, end)."""
        lo = bisect_left(self.starts, start)
        if lo and self.segments[lo - 1].end > start:
            lo -= 1
        return lo, bisect_left(self.starts, end, lo)


class Hazards(Generic[K]):
    """The device memory that one rank's unfinished calls read and write, keyed by call.

    `conflicts` says what a new call must wait for; `add` records the call once it was
    submitted; `discard` forgets it when it finishes.
    """

    def __init__(self) -> None:
        self._regions: dict[int, _Region[K]] = {}
        self._held: dict[K, list[_Segment[K]]] = {}  # segments each call is (or was) in
        # allocations that exactly one call uses, which has no segments there; and the
        # accesses of such calls, as they came
        self._lone: dict[int, K] = {}
        self._solo: dict[K, tuple[Sequence[Span], Sequence[Span]]] = {}
        # the one call in the books when no other uses memory (others may be listed in
        # _held or _solo still, all of their segments superseded), and its spans
        self._one: K | None = None
        self._one_spans: tuple[Sequence[Span], Sequence[Span]] | None = None

    def __bool__(self) -> bool:
        """False when no memory is in use by an unfinished call: nothing to check."""
        return self._one is not None or bool(self._regions) or bool(self._lone)

    def __len__(self) -> int:
        """Calls tracked (some of them may be superseded already)."""
        return len(self._held.keys() | self._solo.keys()) + (self._one is not None)

    def _spill(self) -> None:
        """A second call comes: the one call's spans go under their allocations."""
        key, spans = self._one, self._one_spans
        assert key is not None and spans is not None
        self._one = self._one_spans = None
        for accesses in spans:
            for base, _, _ in accesses:
                self._lone[base] = key
        self._solo[key] = spans

    def uses(self, reads: Iterable[Span], writes: Iterable[Span] = ()) -> bool:
        """Whether an unfinished call uses any of these spans' allocations: if not, a
        call on them conflicts with nothing (O(1) per span)."""
        one = self._one_spans  # (read once: a rank asks without its lock, see _submit)
        if one is not None:  # (then no allocation has a region or lone call)
            for spans in (reads, writes):
                for base, _, _ in spans:
                    for accesses in one:
                        for other, _, _ in accesses:
                            if other == base:
                                return True
            return False
        regions, lone = self._regions, self._lone
        if regions or lone:
            for spans in (reads, writes):
                for base, _, _ in spans:
                    if base in regions or base in lone:
                        return True
        return False

    def conflicts(self, reads: Iterable[Span] = (), writes: Iterable[Span] = ()) -> list[K]:
        """Unfinished calls a call with these accesses must wait for, in the order
        first found, each once."""
        found: dict[K, None] = {}
        if self._one is None and not self._regions and not self._lone:
            return []
        for span in reads:
            self._collect(span, False, found)
        for span in writes:
            self._collect(span, True, found)
        return list(found)

    def _collect(self, span: Span, write: bool, found: dict[K, None]) -> None:
        base, start, end = span
        if start >= end:
            return
        region = self._regions.get(base)
        if region is None:
            # one call there, its spans as they came: the one call in the books, or the
            # lone call on this allocation
            if self._one_spans is not None:
                other: K | None = self._one
                reads, writes = self._one_spans
            else:
                other = self._lone.get(base)
                if other is None:
                    return
                reads, writes = self._solo[other]
            assert other is not None
            if any(b == base and s < end and start < e and s < e for b, s, e in writes) \
                    or write and any(b == base and s < end and start < e and s < e
                                     for b, s, e in reads):
                found[other] = None
            return
        lo, hi = region.overlapping(start, end)
        segments = region.segments
        for i in range(lo, hi):
            seg = segments[i]
            if seg.writer is not None:
                found[seg.writer] = None
            if write and seg.readers:
                found.update(seg.readers)

    def add(self, key: K, reads: Sequence[Span] = (), writes: Sequence[Span] = ()) -> None:
        """Record a submitted call's accesses. Reads go first: a call that reads and
        writes the same bytes (in place) is their writer."""
        if self._one is not None:
            self._spill()
        regions, lone = self._regions, self._lone
        if not regions and not lone:  # no other unfinished call uses memory: the one
            reads = tuple(span for span in reads if span[1] < span[2])
            writes = tuple(span for span in writes if span[1] < span[2])
            if reads or writes:
                self._one, self._one_spans = key, (reads, writes)
            return
        bases: list[int] = []
        shared = False
        for spans in (reads, writes):
            for base, start, end in spans:
                if start < end and base not in bases:
                    bases.append(base)
                    if base in lone:  # a second call there: the first's spans become segments
                        self._segment(lone.pop(base), base)
                    shared = shared or base in regions
        if not bases:
            return
        if not shared:  # memory nobody else uses
            for base in bases:
                lone[base] = key
            self._solo[key] = (reads, writes)
            return
        held = self._held.setdefault(key, [])  # listed first: a split may extend it
        for base, start, end in reads:
            if start < end:
                self._read(key, self._region(base), start, end, held)
        for base, start, end in writes:
            if start < end:
                self._write(key, self._region(base), start, end, held)
        if not held:
            del self._held[key]

    def _segment(self, key: K, base: int) -> None:
        """Turn a lone call's spans on allocation `base` into segments."""
        reads, writes = self._solo[key]
        region = self._region(base)
        held = self._held.setdefault(key, [])
        for b, start, end in reads:
            if b == base and start < end:
                self._read(key, region, start, end, held)
        for b, start, end in writes:
            if b == base and start < end:
                self._write(key, region, start, end, held)

    def discard(self, key: K) -> None:
        """Forget a finished call (no-op for a call never added)."""
        if self._one is not None and self._one == key:
            self._one = self._one_spans = None
            return
        solo = self._solo.pop(key, None)
        if solo is not None:
            lone = self._lone
            for base, _, _ in (*solo[0], *solo[1]):
                if lone.get(base) is key:
                    del lone[base]
        held = self._held.pop(key, None)
        if held is None:
            return
        for seg in held:
            region = seg.region
            if region is None:
                continue  # superseded by a later write
            if seg.writer == key:
                seg.writer = None
            elif key in seg.readers:
                del seg.readers[key]
            else:
                continue  # a stale reference: the segment was rewritten since
            region.live -= 1
            if not region.live and self._regions.get(region.base) is region:
                del self._regions[region.base]

    def layout(self, base: int) -> list[tuple[int, int, K | None, list[K]]]:
        """(start, end, writer, readers) of each segment of an allocation: for tests."""
        if self._one is not None:
            self._spill()
        if base in self._lone:
            self._segment(self._lone.pop(base), base)
        region = self._regions.get(base)
        if region is None:
            return []
        return [(s.start, s.end, s.writer, list(s.readers)) for s in region.segments]

    # -- the segment map ----------------------------------------------------------------

    def _region(self, base: int) -> _Region[K]:
        region = self._regions.get(base)
        if region is None:
            region = self._regions[base] = _Region(base)
        return region

    def _read(self, key: K, region: _Region[K], start: int, end: int,
              held: list[_Segment[K]]) -> None:
        """Add `key` as a reader of [start, end): to the segments there, and to one new
        segment per stretch of untouched memory (empty segments merged into it)."""
        if not region.segments:  # the common case: memory no other call uses
            seg = self._fresh(key, region, start, end, held)
            region.segments.append(seg)
            region.starts.append(start)
            return
        lo, hi = self._cut(region, start, end)
        old = region.segments[lo:hi]
        out: list[_Segment[K]] = []
        free: int | None = None  # start of the untouched stretch being gathered
        changed = False
        position = start
        for seg in old:
            if free is None and seg.start > position:
                free = position
            if seg.writer is None and not seg.readers:  # empty: part of the stretch
                if free is None:
                    free = seg.start
                seg.region, changed = None, True
            else:
                if free is not None:
                    out.append(self._fresh(key, region, free, seg.start, held))
                    free, changed = None, True
                if key not in seg.readers and seg.writer != key:
                    seg.readers[key] = None
                    region.live += 1
                    held.append(seg)
                out.append(seg)
            position = seg.end
        if free is None and position < end:
            free = position
        if free is not None:
            out.append(self._fresh(key, region, free, end, held))
            changed = True
        if changed:
            region.segments[lo:hi] = out
            region.starts[lo:hi] = [seg.start for seg in out]

    def _fresh(self, key: K, region: _Region[K], start: int, end: int,
               held: list[_Segment[K]]) -> _Segment[K]:
        seg = _Segment(start, end, None, {key: None}, region)
        region.live += 1
        held.append(seg)
        return seg

    def _write(self, key: K, region: _Region[K], start: int, end: int,
               held: list[_Segment[K]]) -> None:
        """Make `key` the writer of [start, end): one segment that supersedes whatever
        was there (those calls are ordered before it)."""
        segments = region.segments
        lo, hi = self._cut(region, start, end) if segments else (0, 0)
        if hi - lo == 1 and segments[lo].start == start and segments[lo].end == end:
            seg = segments[lo]  # the same bytes again (a loop into one buffer): reuse
            region.live -= seg.members()
            seg.writer, seg.readers = key, {}
        else:
            for i in range(lo, hi):
                region.live -= segments[i].members()
                segments[i].region = None
            seg = _Segment(start, end, key, {}, region)
            segments[lo:hi] = [seg]
            region.starts[lo:hi] = [start]
        region.live += 1
        held.append(seg)

    def _cut(self, region: _Region[K], start: int, end: int) -> tuple[int, int]:
        """Split the segments that straddle `start` or `end`; return the index range
        of the segments within [start, end)."""
        starts, segments = region.starts, region.segments
        lo = bisect_left(starts, start)
        if lo and segments[lo - 1].end > start:
            self._split(region, lo - 1, start)
        hi = bisect_left(starts, end, lo)
        if hi > lo and segments[hi - 1].end > end:
            self._split(region, hi - 1, end)
        return lo, hi

    def _split(self, region: _Region[K], index: int, at: int) -> None:
        """Cut segment `index` in two at `at`; its calls are members of both halves."""
        seg = region.segments[index]
        right = _Segment(at, seg.end, seg.writer, dict(seg.readers), region)
        seg.end = at
        region.segments.insert(index + 1, right)
        region.starts.insert(index + 1, at)
        region.live += right.members()
        for member in right.readers:
            self._held[member].append(right)
        if right.writer is not None:
            self._held[right.writer].append(right)
