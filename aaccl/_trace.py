"""Call timelines: an opt-in record of every call's submit, start and end per rank,
and of the host's waits, exported as Chrome / Perfetto trace JSON.

Off by default; while off, the only cost is one clock read per call (the device
marks when a call starts, whether anyone records it or not). Lanes are per rank:
"host" for the time a task spends awaiting, and one lane per engine ("cclo")
for the device's calls. Calls that overlap on one engine are spread over numbered
lanes ("cclo", "cclo 2", ...), because trace viewers and the plot both want the
spans of one lane to nest or follow each other.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple


class Span(NamedTuple):
    """One interval on one rank's lane, in perf_counter nanoseconds."""

    rank: int
    engine: str
    name: str
    start: int
    end: int
    args: dict[str, Any]


class Trace:
    """Spans recorded while tracing; thread-safe, as devices complete calls on their
    own threads."""

    def __init__(self) -> None:
        self.origin = time.perf_counter_ns()
        self.spans: list[Span] = []
        self._lock = threading.Lock()

    def add(self, rank: int, engine: str, name: str, start: int, end: int,
            **args: Any) -> None:
        with self._lock:
            self.spans.append(Span(rank, engine, name, start, max(start, end), args))

    def to_chrome(self) -> dict[str, Any]:
        """The trace as Chrome's Trace Event Format (what Perfetto and chrome://tracing
        open): a process per rank, a thread per lane, complete ("X") events in us."""
        with self._lock:
            spans = sorted(self.spans, key=lambda s: (s.rank, s.engine, s.start))
        events: list[dict[str, Any]] = []
        lanes: dict[tuple[int, str], int] = {}
        for span, lane in zip(spans, lane_names(spans)):
            if (span.rank, lane) not in lanes:
                tid = lanes[(span.rank, lane)] = len(lanes) + 1
                events.append({"ph": "M", "name": "thread_name", "pid": span.rank, "tid": tid,
                               "args": {"name": lane}})
            events.append({"ph": "X", "name": span.name, "cat": span.engine,
                           "pid": span.rank, "tid": lanes[(span.rank, lane)],
                           "ts": (span.start - self.origin) / 1000,
                           "dur": (span.end - span.start) / 1000, "args": span.args})
        for rank in sorted({s.rank for s in spans}):
            events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                           "args": {"name": f"rank {rank}"}})
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def save(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w") as f:
            json.dump(self.to_chrome(), f)


def lane_names(spans: list[Span]) -> list[str]:
    """A lane for each span (sorted by rank, engine, start): the engine's name, or
    "engine k" for the k-th lane needed so that no two spans of a lane overlap."""
    names: list[str] = []
    ends: dict[tuple[int, str], list[int]] = {}  # per rank and engine: each lane's last end
    for span in spans:
        lanes = ends.setdefault((span.rank, span.engine), [])
        k = next((i for i, end in enumerate(lanes) if end <= span.start), len(lanes))
        if k == len(lanes):
            lanes.append(0)
        lanes[k] = span.end
        names.append(span.engine if k == 0 else f"{span.engine} {k + 1}")
    return names


_active: Trace | None = None


def active() -> Trace | None:
    """The trace being recorded, if any (read on every call: keep it cheap)."""
    return _active


@contextmanager
def tracing(path: str | os.PathLike[str] | None = None) -> Iterator[Trace]:
    """Record every call of every rank in this process while inside; save the trace
    as Chrome/Perfetto JSON to `path` (if given) on the way out.

    Open the file in https://ui.perfetto.dev or chrome://tracing, or draw it with
    `aaccl trace plot trace.json -o timeline.png`.
    """
    global _active
    if _active is not None:
        raise RuntimeError("aaccl is tracing already")
    trace = _active = Trace()
    try:
        yield trace
    finally:
        _active = None
        if path is not None:
            trace.save(path)
