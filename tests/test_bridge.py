"""`_bridge.wait` (and `answered`, an await's first poll): waking a task from any
thread, and polling a device before parking.

A `Poller` stands in for the MPI fabric: its `poll` delivers the answer on the
loop's own thread after some polls, or never (then the task parks, says so through
`park`, and the answer comes from another thread). Both event-loop backends.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest

from aaccl.api import _bridge

pytestmark = pytest.mark.anyio


class Event:
    """Something that happens once: `register(wake)` as a Call offers it."""

    def __init__(self) -> None:
        self.happened = False
        self.wakers: list[Callable[[], None]] = []

    def register(self, wake: Callable[[], None]) -> bool:
        if self.happened:
            return False
        self.wakers.append(wake)
        return True

    def fire(self) -> None:
        self.happened = True
        for wake in self.wakers:
            wake()


class Poller:
    """Fires `event` at its `answer_at`-th poll (never, if None), on the polling thread."""

    def __init__(self, event: Event, answer_at: int | None) -> None:
        self.event, self.answer_at = event, answer_at
        self.polls, self.parks = 0, 0
        self.threads: set[int] = set()

    def poll(self) -> bool:
        self.polls += 1
        self.threads.add(threading.get_ident())
        if self.polls == self.answer_at:
            self.event.fire()
            return True
        return False

    def park(self) -> None:
        self.parks += 1


@pytest.fixture
def patient(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tasks poll until answered, however slow the machine: one that parked after its
    2 ms would wait for an answer that only a poll gives."""
    monkeypatch.setattr(_bridge, "POLL_FOR", 60.0)


async def test_an_answer_found_by_polling_resumes_the_task_without_parking(patient: None) -> None:
    event = Event()
    poller = Poller(event, answer_at=5)
    with anyio.fail_after(30):
        await _bridge.wait(event.register, poller)
    assert poller.polls == 5 and poller.parks == 0
    assert poller.threads == {threading.get_ident()}  # polled on the loop's thread


async def test_a_task_spins_before_its_first_turn_of_the_loop(
        patient: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Within SPIN_FOR (and while the loop turned lately: TURN_EVERY) a task polls
    with no turn of the event loop between polls: the other tasks do not run."""
    import time

    monkeypatch.setattr(_bridge, "SPIN_FOR", 60.0)
    event = Event()
    poller = Poller(event, answer_at=50)
    turns = 0

    async def other() -> None:
        nonlocal turns
        while not event.happened:
            turns += 1
            await anyio.sleep(0)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(other)
            await anyio.sleep(0)
            before = turns
            monkeypatch.setattr(_bridge, "_next_turn", time.monotonic() + 60)
            await _bridge.wait(event.register, poller)
            assert turns == before and poller.polls == 50


async def test_polling_yields_to_the_other_tasks(patient: None) -> None:
    event = Event()
    poller = Poller(event, answer_at=None)
    seen: list[int] = []

    async def other() -> None:  # runs between polls, and answers
        while poller.polls < 3:
            await anyio.sleep(0)
        seen.append(poller.polls)
        event.fire()

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(other)
            await _bridge.wait(event.register, poller)
    assert seen and seen[0] >= 3 and poller.parks == 0


async def turns_beside(step: Callable[[], Awaitable[object]]) -> int:
    """Await `step()` over and over for 50 ms of a cancel scope, beside a task that
    counts the loop's turns meanwhile; the turns counted, once the scope fired."""
    turns = steps = 0

    async def other() -> None:
        nonlocal turns
        while True:
            turns += 1
            await anyio.sleep(0)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(other)
            with anyio.move_on_after(0.05) as scope:
                while steps < 500_000:  # (a bound: a task that never yields ends too)
                    await step()
                    steps += 1
            tg.cancel_scope.cancel()
    assert scope.cancelled_caught and steps > 0
    return turns


async def test_calls_answered_at_their_first_poll_still_let_the_loop_turn() -> None:
    """A loop of waits, each answered by its first poll, still lets the other tasks
    run, and the cancel scope around it fires (on asyncio such an answer skips the
    loop's turn, but not for long: _bridge.TURN_EVERY)."""

    async def step() -> None:
        event = Event()
        await _bridge.wait(event.register, Poller(event, answer_at=1))

    assert await turns_beside(step) >= 2


class Awaited:
    """The call a task awaits, as `answered` and `wait` read it: `_finished` once its
    event happened."""

    def __init__(self, event: Event) -> None:
        self.event = event

    @property
    def _finished(self) -> bool:
        return self.event.happened


async def test_calls_answered_by_the_first_poll_of_their_await_still_let_the_loop_turn(
        ) -> None:
    """Call.__await__ polls once (`answered`) before it waits, with a device to poll:
    a loop of calls that poll answers goes on with no wait at all, but not for long:
    once TURN_EVERY has passed, `answered` says so, and `wait` lets the loop turn (the
    other tasks run, the cancel scope around the loop fires)."""
    answered = waited = 0

    async def step() -> None:
        nonlocal answered, waited
        event = Event()
        call, poller = Awaited(event), Poller(event, answer_at=1)
        if _bridge.answered(poller, call):
            answered += 1
        else:  # (its answer is in: the wait's only turn of the loop)
            await _bridge.wait(event.register, poller, call=call)
            waited += 1
        assert poller.polls == 1 and event.happened

    assert await turns_beside(step) >= 2 and answered > waited > 0


async def test_a_task_that_polls_in_vain_parks_and_is_woken_from_another_thread() -> None:
    event = Event()
    poller = Poller(event, answer_at=None)
    parked = threading.Event()
    poller.park = parked.set  # type: ignore[method-assign]

    def device_thread() -> None:  # the answer comes from the device's own thread
        parked.wait(10)
        event.fire()

    thread = threading.Thread(target=device_thread)
    thread.start()
    with anyio.fail_after(10):
        await _bridge.wait(event.register, poller)
    thread.join()
    assert parked.is_set() and poller.polls > 0


async def test_an_event_that_happened_already_costs_no_poll() -> None:
    event = Event()
    event.fire()
    poller = Poller(event, answer_at=None)
    await _bridge.wait(event.register, poller)
    assert poller.polls == 0 and poller.parks == 0


@pytest.mark.parametrize("while_", ["polling", "parked"])
async def test_cancelling_a_waiting_task_leaves_a_later_wake_harmless(while_: str) -> None:
    event = Event()
    poller = Poller(event, answer_at=None)
    if while_ == "parked":
        before = _bridge.POLL_FOR
        _bridge.POLL_FOR = 0.0  # park at once
    try:
        with anyio.move_on_after(0.05 if while_ == "parked" else 0.001) as scope:
            await _bridge.wait(event.register, poller)
    finally:
        if while_ == "parked":
            _bridge.POLL_FOR = before
    assert scope.cancelled_caught
    event.fire()  # nobody waits any more: no error, no resumed task
    await anyio.sleep(0)
    later = Event()  # the task waits again, as usual (and answers its own second poll)
    _bridge.POLL_FOR, before = 60.0, _bridge.POLL_FOR
    try:
        with anyio.fail_after(30):
            await _bridge.wait(later.register, Poller(later, answer_at=2))
    finally:
        _bridge.POLL_FOR = before


def test_a_trio_task_is_woken_from_another_thread_in_every_run() -> None:
    """A trio task's wait keeps its run's token in its context (a wake from another
    thread goes through it): a later run in the same thread, a child task, and a run
    started in another thread with a copy of the task's context (which trio's
    `to_thread` and anyio's make) must each be woken through their own run's, never
    another run's (a finished run's wake is lost, a live one's goes astray)."""
    trio = pytest.importorskip("trio")

    async def woken_from_a_thread() -> None:
        event = Event()
        registered = threading.Event()

        def register(wake: Callable[[], None]) -> bool:
            waiting = event.register(wake)
            registered.set()
            return waiting

        def device_thread() -> None:
            registered.wait(10)
            event.fire()

        thread = threading.Thread(target=device_thread)
        thread.start()
        with trio.fail_after(10):
            await _bridge.wait_trio(register)
        thread.join()
        assert event.happened

    async def run(depth: int) -> None:
        for _ in range(2):  # its first wait looks the token up, the second keeps it
            await woken_from_a_thread()
        async with trio.open_nursery() as nursery:  # a child, in a copy of its context
            nursery.start_soon(woken_from_a_thread)
        if depth:  # a run in a thread that has a copy of this task's context
            await trio.to_thread.run_sync(trio.run, run, depth - 1)

    for _ in range(3):
        trio.run(run, 1)


def test_trio_as_the_guest_of_an_asyncio_loop_waits_as_trio() -> None:
    """Under `trio.lowlevel.start_guest_run` an asyncio loop runs in the thread too
    (trio's steps run in its callbacks, outside its tasks): a call's await must still
    wait the trio way, and a wait that suspends must not hand trio an asyncio future."""
    import asyncio

    import numpy as np

    import aaccl

    trio = pytest.importorskip("trio")
    trio_testing = pytest.importorskip("trio.testing")

    async def guest() -> list[float]:
        async with aaccl.open_world(2, timeout=30) as accls:
            bufs = [accl.allocate(8, np.float32) for accl in accls]
            for accl, buf in zip(accls, bufs):
                buf[:] = accl.rank + 1
            waited = []

            async def first() -> None:  # waits: rank 1 has not called yet
                call = accls[0].allreduce(bufs[0], bufs[0], 8, aaccl.ReduceFunction.SUM)
                waited.append(call.done())
                await call

            async with trio.open_nursery() as nursery:
                nursery.start_soon(first)
                await trio_testing.wait_all_tasks_blocked()
                await accls[1].allreduce(bufs[1], bufs[1], 8, aaccl.ReduceFunction.SUM)
            assert waited == [False]
            return [float(buf[0]) for buf in bufs]

    async def host() -> list[float]:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()
        trio.lowlevel.start_guest_run(guest, run_sync_soon_threadsafe=loop.call_soon_threadsafe,
                                      done_callback=done.set_result)
        return (await done).unwrap()  # type: ignore[no-any-return]

    assert asyncio.run(host()) == [3.0, 3.0]
