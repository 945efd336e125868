"""Progress without threads for small calls: a trampoline and a watchdog.

A small call runs on whichever thread makes progress possible — the one that
submits it, or the one that delivers the message it waits for — and parks in
between, holding no thread. The trampoline keeps those hand-offs iterative (a
delivery that resumes a call that delivers... does not recurse); the watchdog
fails parked calls whose peer never comes.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable

_local = threading.local()


def trampoline(fn: Callable[..., None], *args: object) -> None:
    """Run `fn(*args)` now, or after the current trampolined function on this thread."""
    queue: deque | None = getattr(_local, "queue", None)
    if queue is not None:
        queue.append((fn, args))
        return
    queue = _local.queue = deque([(fn, args)])
    try:
        while queue:
            fn, args = queue.popleft()
            fn(*args)
    finally:
        _local.queue = None


class Watchdog:
    """Calls `on_expiry()` of each armed entry at its deadline, unless disarmed first."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Entry]] = []
        self._order = itertools.count()
        self._disarmed = 0
        self._thread: threading.Thread | None = None

    def arm(self, deadline: float, on_expiry: Callable[[], None]) -> Entry:
        entry = Entry(self, on_expiry)
        with self._cond:
            heapq.heappush(self._heap, (deadline, next(self._order), entry))
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="soft-cclo-watchdog",
                                                daemon=True)
                self._thread.start()
            elif self._heap[0][2] is entry:
                self._cond.notify()
        return entry

    def _disarm(self) -> None:
        with self._cond:
            self._disarmed += 1
            if self._disarmed > 1024 and 2 * self._disarmed > len(self._heap):
                self._heap = [item for item in self._heap if item[2].armed]
                heapq.heapify(self._heap)
                self._disarmed = 0

    def _watch(self) -> None:
        while True:
            with self._cond:
                while True:
                    while self._heap and not self._heap[0][2].armed:
                        heapq.heappop(self._heap)
                        self._disarmed -= 1
                    wait = self._heap[0][0] - time.monotonic() if self._heap else None
                    if wait is not None and wait <= 0:
                        entry = heapq.heappop(self._heap)[2]
                        break
                    self._cond.wait(wait)
            if entry.armed:
                entry.armed = False
                entry.on_expiry()


class Entry:
    __slots__ = ("_watchdog", "on_expiry", "armed")

    def __init__(self, watchdog: Watchdog, on_expiry: Callable[[], None]) -> None:
        self._watchdog, self.on_expiry, self.armed = watchdog, on_expiry, True

    def disarm(self) -> None:
        if self.armed:
            self.armed = False
            self._watchdog._disarm()


WATCHDOG = Watchdog()
