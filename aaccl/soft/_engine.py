"""The soft CCLO's progress engine: one event queue, its timers and its data workers.

Everything that changes a soft CCLO's state — a call submitted, a dependency done, a
message arrived, a payload consumed, a deadline passed, a data job finished — is an
event. Any thread may post one; the thread that finds the engine idle processes the
queue until it is empty (so a small call submitted from the event loop runs to its
end on that thread, with no hand-off), and whatever those events raise goes to the
back of the same queue: nothing recurses, however long a chain of calls is. State
is only ever touched by the one thread that drains, so it needs no locks.

The engine owns its timers (a deadline per wait, dropped when the wait ends) and a
small pool of workers for large copies and reductions; both end with the engine.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from .. import _threads

log = logging.getLogger("aaccl")

Event = Callable[..., None]

DATA_WORKERS = max(2, min(8, os.cpu_count() or 2))
"""Threads for large numpy copies and reductions (they release the GIL): they only
ever compute, never wait, so their number bounds parallelism, not outstanding calls."""


class Waiter(Protocol):
    """The call a `Wait` resumes once set (a soft call: `SoftCall._wake`)."""

    def _wake(self, wait: Wait) -> None: ...


class Wait:
    """Something a call waits for: a message, a consumed payload, a data job.

    The engine resumes the waiting call once `set` is called (in engine context).
    `expire` says what the call's deadline does to it: True fails the call with
    `timeout_code`; False means the wait goes on without a deadline (a peer is
    reading our data right now, say). Subclasses override it to withdraw what they
    registered (or `withdraw`, if they are shared by several calls).
    """

    __slots__ = ("done", "value", "waiter", "timeout_code")

    def __init__(self, timeout_code: int = 0) -> None:
        self.done = False
        self.value: Any = None
        self.waiter: Waiter | None = None
        self.timeout_code = timeout_code

    def set(self, value: Any = None) -> None:
        if self.done:
            return
        self.done, self.value = True, value
        waiter, self.waiter = self.waiter, None
        if waiter is not None:
            waiter._wake(self)

    def expire(self) -> bool:
        return self.timeout_code != 0

    def withdraw(self, call: Any) -> bool:
        """`call` stops waiting for this (an abort, its deadline): `expire`, unless
        what it waits for is shared and must know which call leaves (an in-process
        meeting)."""
        return self.expire()


class Timer:
    """A handle on an armed deadline; `cancel` drops it (and what it refers to)."""

    __slots__ = ("deadline", "fn", "_timers")

    fn: Callable[[], None] | None  # None once cancelled, or taken to run

    def __init__(self, timers: _Timers, deadline: float, fn: Callable[[], None]) -> None:
        self.deadline, self.fn, self._timers = deadline, fn, timers

    def cancel(self) -> None:
        if self.fn is not None:
            self.fn = None
            self._timers.cancelled += 1


ALARM_STEP = 0.001
"""Seconds: the shortest delay an `Alarm` sets again (the others are this times a
power of two)."""


class Alarm:
    """Deadlines of many waits under one engine timer (engine context): a wait
    parked with its deadline (`park`) costs a dict entry, not a timer of its own, as
    waits come and go one after another; `parked.pop(key, None)` drops one. The
    timer is set for the first deadline parked while none comes sooner; when it goes
    off it hands the keys past their deadlines to `expire` and is set again for the
    first of the others (the engine keeps its timers by delay, so that delay is the
    largest of a few fixed ones not longer than what is left: late by at most
    ALARM_STEP)."""

    __slots__ = ("parked", "at", "_engine", "_expire", "_timer")

    def __init__(self, engine: Engine, expire: Callable[[list[Any]], None]) -> None:
        self.parked: dict[Any, float] = {}
        self.at = math.inf  # when the timer goes off
        self._engine, self._expire = engine, expire
        self._timer: Timer | None = None

    def park(self, key: Any, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        self.parked[key] = deadline
        if deadline < self.at:
            self.set(timeout, deadline)

    def set(self, delay: float, at: float) -> None:
        """Set the timer for `at`, `delay` seconds from now: a deadline parked before
        the one it is set for (`park` does it; a caller that parks in line, one
        call less, calls this only then)."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self.at = self._engine.call_later(delay, self._look), at

    def _look(self) -> None:
        self._timer, self.at = None, math.inf
        now = time.monotonic()
        parked = self.parked
        overdue = [key for key, deadline in parked.items() if deadline <= now]
        for key in overdue:
            del parked[key]
        if parked:  # (set first: the alarm goes on whatever an expiry does)
            first = min(parked.values())
            delay = ALARM_STEP
            while delay * 2 <= first - now:
                delay *= 2
            self.set(delay, now + delay)
        if overdue:
            self._expire(overdue)


class _Timers:
    """Deadlines in lanes, one per delay: a lane's deadlines (now + its delay) come
    in order, so arming is an append and the earliest is a lane's head, with no heap
    and no lock. Written in engine context; the timer thread only reads lane heads
    to know how long to sleep, and is woken only when a new deadline comes before
    the one it sleeps until."""

    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.lanes: dict[float, deque[Timer]] = {}
        self.armed = 0  # entries in the lanes, cancelled ones included
        self.cancelled = 0
        self.sleeping_until = -math.inf  # -inf: awake, it looks again before sleeping

    def arm(self, delay: float, fn: Callable[[], None]) -> Timer:
        deadline = time.monotonic() + delay
        timer = Timer(self, deadline, fn)
        lane = self.lanes.get(delay)
        if lane is None:
            lane = self.lanes[delay] = deque()
        lane.append(timer)
        self.armed += 1
        if self.cancelled > 1024 and 2 * self.cancelled > self.armed:
            self._compact()
        if deadline < self.sleeping_until:
            with self.cond:
                self.cond.notify()
                # it looks again once it runs (for every deadline armed by then), and
                # until it does, only an earlier deadline needs to wake it: calls armed
                # in a row, before the timer thread gets the GIL, notify once
                self.sleeping_until = deadline
        return timer

    def _compact(self) -> None:
        for delay, lane in list(self.lanes.items()):
            self.lanes[delay] = deque(t for t in lane if t.fn is not None)
        self.armed = sum(len(lane) for lane in self.lanes.values())
        self.cancelled = 0

    def earliest(self) -> float:
        """The first deadline of any lane (maybe a cancelled one: a harmless early
        look); any thread."""
        heads = [lane[0].deadline for lane in list(self.lanes.values()) if lane]
        return min(heads, default=math.inf)

    def due(self, now: float) -> list[Timer]:
        """Pop every live timer whose deadline has passed, and the cancelled ones
        ahead of live ones (engine context)."""
        out = []
        for lane in self.lanes.values():
            while lane and (lane[0].fn is None or lane[0].deadline <= now):
                timer = lane.popleft()
                self.armed -= 1
                if timer.fn is None:
                    self.cancelled = max(0, self.cancelled - 1)
                else:
                    out.append(timer)
        return out

    def clear(self) -> None:
        self.lanes.clear()
        self.armed = self.cancelled = 0


class Engine:
    """Progress for a group of soft CCLOs (one fabric endpoint: every rank of an
    in-process world, or one process's rank under MPI)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()  # held by the thread that drains (`post`)
        self._posted: deque[tuple[Event, tuple[Any, ...]]] = deque()  # from any thread
        self._soon: deque[tuple[Event, tuple[Any, ...]]] = deque()  # raised while draining
        self._timers = _Timers()
        self._timer_thread: threading.Thread | None = None
        self._workers: ThreadPoolExecutor | None = None
        self._users = 0
        self.closed = False

    # -- events ------------------------------------------------------------------

    def post(self, fn: Event, *args: Any) -> None:
        """Queue `fn(*args)` from any thread; process the queue here if nobody is.

        Whoever holds `_lock` drains, and lets go only once the queue is empty; it
        looks again after letting go, so that a post which found the lock held
        meanwhile is never left behind (either it drains, or the drainer that looked
        again does). An idle engine runs the event at once, queued nowhere."""
        lock = self._lock
        if self._posted or self._soon or not lock.acquire(False):
            self._posted.append((fn, args))
            if lock.acquire(False):  # nobody drains (any more): we do
                self._drain()
            return
        try:
            fn(*args)
        except Exception:  # events fail their own calls; a last resort
            log.exception("soft CCLO engine %s: internal error in %r", self.name, fn)
        except BaseException:
            lock.release()
            raise
        if self._soon or self._posted:
            self._drain()
            return
        lock.release()
        if self._posted and lock.acquire(False):  # posted as we let go
            self._drain()

    def soon(self, fn: Event, *args: Any) -> None:
        """Queue `fn(*args)` from engine context (an event being processed)."""
        self._soon.append((fn, args))

    def _drain(self) -> None:
        """Process the queue until it is empty (holding `_lock`), then let go. What
        the events raise (`soon`) runs before the next of those posted meanwhile."""
        soon, posted, lock = self._soon, self._posted, self._lock
        while True:
            try:
                while True:
                    while soon:
                        fn, args = soon.popleft()
                        try:
                            fn(*args)
                        except Exception:  # events fail their own calls; a last resort
                            log.exception("soft CCLO engine %s: internal error in %r",
                                          self.name, fn)
                    if not posted:
                        break
                    for _ in range(len(posted)):  # (deques: safe beside other threads' appends)
                        soon.append(posted.popleft())
            except BaseException:
                # KeyboardInterrupt, SystemExit: the caller gets it at once, and the engine
                # stays drainable; what is still queued runs, in order, at the next post
                lock.release()
                raise
            lock.release()
            if not posted or not lock.acquire(False):
                return

    # -- timers -------------------------------------------------------------------

    def call_later(self, delay: float, fn: Callable[[], None]) -> Timer:
        """Run `fn` in engine context once `delay` seconds have passed, unless the
        returned timer is cancelled first (engine context)."""
        if self._timer_thread is None and not self.closed:
            self._timer_thread = _threads.start(self._watch, f"soft-cclo-timers-{self.name}")
        return self._timers.arm(delay, fn)

    def _watch(self) -> None:
        timers = self._timers
        while not self.closed:
            try:
                with timers.cond:
                    while not self.closed:
                        # say "asleep" before looking: a deadline armed after the
                        # look then sees it and notifies (once we wait, as we hold
                        # the lock until then)
                        timers.sleeping_until = math.inf
                        first = timers.earliest()
                        wait = first - time.monotonic()
                        if wait <= 0:
                            break
                        timers.sleeping_until = first
                        timers.cond.wait(None if first == math.inf else wait)
                    timers.sleeping_until = -math.inf
                if not self.closed:
                    # the expiry runs as an event; wait for it before looking again
                    done = threading.Event()
                    self.post(self._expire, done)
                    done.wait()
            except Exception:  # never let the clock stop
                log.exception("soft CCLO engine %s: timer thread error", self.name)

    def _expire(self, done: threading.Event) -> None:
        try:
            for timer in self._timers.due(time.monotonic()):
                fn, timer.fn = timer.fn, None
                if fn is not None:
                    try:
                        fn()
                    except Exception:
                        log.exception("soft CCLO engine %s: internal error at a deadline",
                                      self.name)
        finally:
            done.set()

    # -- data jobs ----------------------------------------------------------------

    def offload(self, job: Callable[[], None]) -> Wait:
        """Run `job` on a data worker; the Wait is set (in engine context) when it
        ends, with the exception it raised or None."""
        wait = Wait()
        if self._workers is None:
            self._workers = ThreadPoolExecutor(DATA_WORKERS,
                                               thread_name_prefix=f"soft-cclo-data-{self.name}",
                                               initializer=_threads.leave_signals)

        def run() -> None:
            error: BaseException | None = None
            try:
                job()
            except BaseException as exc:
                error = exc
            self.post(wait.set, error)

        try:
            self._workers.submit(run)
        except RuntimeError:  # shut down with the engine
            wait.set(RuntimeError("the soft CCLO is closed"))
        return wait

    # -- lifetime -----------------------------------------------------------------

    def attach(self) -> None:
        """A soft CCLO now uses this engine."""
        self._users += 1

    def detach(self) -> None:
        """A soft CCLO is done with this engine; the last one stops it."""
        self._users -= 1
        if self._users <= 0:
            self.close()

    def close(self) -> None:
        self.closed = True
        self.post(self._timers.clear)
        with self._timers.cond:
            self._timers.cond.notify_all()
        if self._workers is not None:
            self._workers.shutdown(wait=False)
