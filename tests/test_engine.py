"""The soft CCLO's progress engine: its queue, its timers, its shared-memory meetings."""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Callable

import anyio
import numpy as np
import pytest

import aaccl
from aaccl import CCLOError, DependencyError, ErrorCode, ReduceFunction
from aaccl.soft import Engine
from aaccl.soft._engine import Alarm, Wait

TIMEOUT = 0.3


# -- the engine alone -------------------------------------------------------------------

def test_events_posted_while_draining_run_after_in_order_without_nesting() -> None:
    engine = Engine("test")
    seen: list[int] = []
    depth = 0

    def event(n: int) -> None:
        nonlocal depth
        depth += 1
        assert depth == 1, "an event ran inside another"
        seen.append(n)
        if n < 50_000:
            engine.post(event, n + 1)  # a chain as long as you like: no recursion
        depth -= 1

    engine.post(event, 0)
    assert seen == list(range(50_001))
    engine.close()


def test_events_posted_from_many_threads_each_run_once_one_at_a_time() -> None:
    """Whoever finds the engine idle drains it; a post that finds it busy is left to
    the drainer: once every post returned, every event has run, once, in its
    thread's order, and never two at a time."""
    engine = Engine("test")
    ran: list[tuple[int, int]] = []
    running = [0]
    overlaps = [0]

    def event(thread: int, n: int) -> None:
        running[0] += 1
        if running[0] != 1:
            overlaps[0] += 1
        ran.append((thread, n))
        if n % 7 == 0:
            engine.soon(ran.append, (thread, -n))  # raised while draining: runs too
        running[0] -= 1

    def poster(thread: int) -> None:
        for n in range(1, 5001):
            engine.post(event, thread, n)

    threads = [threading.Thread(target=poster, args=(t,)) for t in range(4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between any two steps, often
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert overlaps[0] == 0
    for t in range(4):
        assert [n for thread, n in ran if thread == t and n > 0] == list(range(1, 5001))
        assert sorted(-n for thread, n in ran if thread == t and n < 0) == list(range(7, 5001, 7))
    engine.close()


class _LetGo:
    """The engine's lock, which runs `before_release` once, just before it lets go:
    a post that comes at the drainer's last moment, found the lock held, and left
    its event to the drainer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.before_release: Callable[[], None] | None = None

    def acquire(self, blocking: bool = True) -> bool:
        return self._lock.acquire(blocking)

    def release(self) -> None:
        hook, self.before_release = self.before_release, None
        if hook is not None:
            hook()
        self._lock.release()


@pytest.mark.parametrize("drained", [False, True], ids=["idle", "draining"])
def test_an_event_posted_as_the_drainer_lets_go_still_runs(drained: bool) -> None:
    engine = Engine("test")
    lock = engine._lock = _LetGo()  # type: ignore[assignment]
    ran: list[str] = []

    def first() -> None:
        if drained:  # something raised: the engine drains its queue
            engine.soon(ran.append, "raised")
        lock.before_release = lambda: engine.post(ran.append, "late")

    engine.post(first)
    assert ran == (["raised", "late"] if drained else ["late"])
    engine.close()


def test_an_event_that_raises_is_logged_and_the_rest_run(caplog: pytest.LogCaptureFixture) -> None:
    engine = Engine("test")
    seen = []

    def broken() -> None:
        engine.soon(seen.append, "after")
        raise ZeroDivisionError("bug")

    engine.post(broken)
    engine.post(seen.append, "next")
    assert seen == ["after", "next"]
    assert "internal error" in caplog.text
    engine.close()


@pytest.mark.parametrize("kind", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_inside_an_event_propagates_and_the_engine_still_drains(
        kind: type[BaseException]) -> None:
    engine = Engine("test")
    seen: list[str] = []

    def interrupted() -> None:
        engine.soon(seen.append, "raised before")  # queued behind the interrupted event
        engine.post(seen.append, "posted before")
        raise kind()

    with pytest.raises(kind):
        engine.post(interrupted)
    assert seen == []  # the interrupt went to the caller at once ...
    engine.post(seen.append, "after")  # ... and the next post drains everything, in order
    assert seen == ["raised before", "posted before", "after"]
    engine.post(seen.append, "later")
    assert seen[-1] == "later"
    engine.close()


def test_timers_fire_once_cancelled_ones_never_and_the_clock_survives_a_raising_timer(
        caplog: pytest.LogCaptureFixture) -> None:
    engine = Engine("test")
    fired: list[str] = []
    done = threading.Event()

    def boom() -> None:
        raise RuntimeError("timer bug")

    engine.post(lambda: engine.call_later(0.01, boom))
    cancelled = []
    engine.post(lambda: cancelled.append(engine.call_later(0.02, lambda: fired.append("no"))))
    engine.post(lambda: cancelled[0].cancel())
    engine.post(lambda: engine.call_later(0.05, lambda: (fired.append("yes"), done.set())))
    assert done.wait(5)
    assert fired == ["yes"]
    assert "timer bug" in caplog.text
    engine.close()


def test_a_shorter_delay_armed_later_wakes_the_sleeping_clock() -> None:
    """Deadlines sit in one lane per delay: one armed after a far one, in another
    lane, must still fire on time (the timer thread sleeps until the far one)."""
    engine = Engine("test")
    order: list[str] = []
    done = threading.Event()
    engine.post(lambda: engine.call_later(3600, lambda: order.append("far")))
    for _ in range(100):  # let the timer thread go to sleep until the far deadline
        if engine._timers.sleeping_until != -math.inf:
            break
        time.sleep(0.01)
    start = time.monotonic()
    engine.post(lambda: engine.call_later(0.05, lambda: (order.append("near"), done.set())))
    engine.post(lambda: engine.call_later(0.02, lambda: order.append("nearer")))
    assert done.wait(5)
    assert time.monotonic() - start < 2
    assert order == ["nearer", "near"]
    engine.close()


def test_deadlines_armed_in_a_row_wake_the_sleeping_clock_once() -> None:
    """Calls that wait arm their deadlines one after the other on the engine's
    thread, which holds the GIL meanwhile: the sleeping timer thread cannot look
    again between them, and only the first, earlier than what it sleeps until, has
    to wake it (a notify costs a lock and five Python calls)."""
    engine = Engine("test")
    engine.post(lambda: engine.call_later(3600, lambda: None))
    for _ in range(100):  # let the timer thread go to sleep until the far deadline
        if engine._timers.sleeping_until not in (-math.inf, math.inf):
            break
        time.sleep(0.01)
    cond = engine._timers.cond
    notified = 0
    real = cond.notify

    def notify(n: int = 1) -> None:
        nonlocal notified
        notified += 1
        real(n)

    cond.notify = notify  # type: ignore[method-assign]
    engine.post(lambda: [engine.call_later(60, lambda: None) for _ in range(1_000)])
    assert notified <= 2, f"1,000 deadlines armed in a row notified the clock {notified} times"
    engine.close()


def test_cancelled_timers_do_not_pile_up() -> None:
    engine = Engine("test")

    def churn() -> None:
        live = engine.call_later(3600, lambda: None)  # keeps every lane's head alive
        for _ in range(50_000):
            engine.call_later(3600, lambda: None).cancel()
        live.cancel()

    engine.post(churn)
    assert engine._timers.armed < 5_000
    engine.close()
    assert not engine._timers.lanes


def test_an_alarm_expires_each_parked_key_once_past_its_deadline_and_dropped_ones_never(
        caplog: pytest.LogCaptureFixture) -> None:
    """Many deadlines under one timer (the in-process meetings'): a shorter one parked
    after a longer one still comes first, a key dropped before its deadline never
    expires, and an expiry that raises stops nothing."""
    engine = Engine("test")
    deadlines: dict[str, float] = {}
    expired: list[tuple[str, float]] = []
    done = threading.Event()

    def expire(keys: list[str]) -> None:
        expired.extend((key, time.monotonic()) for key in keys)
        if "late" in keys:
            done.set()
        if "raises" in keys:
            raise RuntimeError("expiry bug")

    alarm = Alarm(engine, expire)

    def park(key: str, timeout: float) -> None:
        deadlines[key] = time.monotonic() + timeout
        alarm.park(key, timeout)

    engine.post(park, "late", 0.25)
    engine.post(park, "early", 0.03)
    engine.post(park, "dropped", 0.06)
    engine.post(park, "raises", 0.1)
    engine.post(alarm.parked.pop, "dropped", None)
    assert done.wait(5)
    assert [key for key, _ in expired] == ["early", "raises", "late"]
    for key, when in expired:
        assert deadlines[key] <= when < deadlines[key] + 1, key
    assert not alarm.parked
    assert "expiry bug" in caplog.text
    engine.close()


def test_a_wait_set_before_anyone_waits_keeps_its_value() -> None:
    wait = Wait()
    wait.set(42)
    wait.set(43)
    assert wait.done and wait.value == 42


# -- worlds -----------------------------------------------------------------------------

@pytest.mark.anyio
async def test_a_late_wait_is_not_failed_by_an_earlier_deadline() -> None:
    """A receive waits, is answered, and a later receive of the same rank starts; the
    first wait's deadline must not fail the second."""
    async with aaccl.open_world(2, timeout=TIMEOUT) as (a, b):
        src, dst = a.allocate(4, np.int32), b.allocate(4, np.int32)
        for i in range(3):
            recv = b.recv(dst, 4, 0, tag=i)
            with anyio.fail_after(5):
                await anyio.sleep(TIMEOUT * 0.6)  # half a deadline passes while it waits
                src[:] = i
                await a.send(src, 4, 1, tag=i)
                await recv
            assert list(dst) == [i] * 4


@pytest.mark.anyio
@pytest.mark.parametrize("count", [1, 4000])  # shared-memory meeting and schedule
async def test_allreduce_with_a_rank_missing_times_out_and_the_world_stays_usable(count: int) -> None:
    async with aaccl.open_world(3, timeout=TIMEOUT) as accls:
        bufs = [(a.allocate(count), a.allocate(count)) for a in accls]
        began = time.monotonic()
        calls = [a.allreduce(s, d, count, ReduceFunction.SUM) for a, (s, d) in
                 zip(accls[:2], bufs)]
        with anyio.fail_after(5):
            for call in calls:
                with pytest.raises(CCLOError) as info:
                    await call
                assert info.value.code & ErrorCode.RECEIVE_TIMEOUT_ERROR
        assert time.monotonic() - began < TIMEOUT * 3
        late = accls[2].allreduce(*bufs[2], count, ReduceFunction.SUM)  # the straggler
        with anyio.fail_after(5), pytest.raises(CCLOError):
            await late
        for a, (s, _) in zip(accls, bufs):
            s[:] = a.rank + 1
        with anyio.fail_after(5):
            for call in [a.allreduce(s, d, count, ReduceFunction.SUM)
                         for a, (s, d) in zip(accls, bufs)]:
                await call
        for _, d in bufs:
            assert (d == 6).all()


@pytest.mark.anyio
async def test_a_small_allreduce_whose_peer_never_runs_fails_by_its_deadline() -> None:
    """Rank 1's allreduce waits for a call that fails, so it never runs: rank 0's
    allreduce (in a shared-memory meeting) fails no later than its deadline: aborted
    by rank 1's notice, or timed out if its own deadline (the same length, started
    a moment later) comes first."""
    async with aaccl.open_world(2, timeout=TIMEOUT) as (a, b):
        sa, da = a.allocate(4), a.allocate(4)
        sb, db = b.allocate(4), b.allocate(4)
        doomed = b.recv(db, 4, 0, tag=9)  # nobody sends: times out
        skipped = b.allreduce(sb, db, 4, ReduceFunction.SUM, waitfor=[doomed])
        with anyio.fail_after(5):
            mine = a.allreduce(sa, da, 4, ReduceFunction.SUM)
            with pytest.raises(CCLOError):
                await doomed
            with pytest.raises(DependencyError):
                await skipped
            with pytest.raises((aaccl.Aborted, CCLOError)) as info:
                await mine
            if isinstance(info.value, CCLOError):  # its own deadline came first, barely
                assert info.value.code == ErrorCode.RECEIVE_TIMEOUT_ERROR


@pytest.mark.anyio
async def test_small_allreduce_with_counts_that_differ_fails_on_every_rank() -> None:
    async with aaccl.open_world(2, timeout=TIMEOUT) as (a, b):
        calls = [a.allreduce(a.allocate(8), a.allocate(8), 4, ReduceFunction.SUM),
                 b.allreduce(b.allocate(8), b.allocate(8), 8, ReduceFunction.SUM)]
        with anyio.fail_after(5):
            for call in calls:
                with pytest.raises(CCLOError) as info:
                    await call
                assert info.value.code & ErrorCode.DMA_SIZE_ERROR


@pytest.mark.anyio
@pytest.mark.parametrize("size", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int32, np.int64])
async def test_small_allreduce_gives_every_rank_the_rank_order_fold(size: int, dtype: type) -> None:
    rng = np.random.default_rng(size)
    data = [rng.integers(-9, 9, 7).astype(dtype) for _ in range(size)]
    async with aaccl.open_world(size) as accls:
        out = [a.allocate(7, dtype) for a in accls]
        srcs = []
        for a, x in zip(accls, data):
            s = a.allocate(7, dtype)
            s[:] = x
            srcs.append(s)
        with anyio.fail_after(10):
            for call in [a.allreduce(s, d, 7, ReduceFunction.MAX if dtype == np.int64
                                     else ReduceFunction.SUM)
                         for a, s, d in zip(accls, srcs, out)]:
                await call
    fold = np.maximum.reduce(data) if dtype == np.int64 else sum(data[1:], data[0].copy())
    for d in out:
        np.testing.assert_array_equal(d, fold)
