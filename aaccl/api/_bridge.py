"""Wake a task from a device thread, on asyncio or trio, without blocking either side.

A device completes calls on its own threads or, for the soft CCLO, often on the
event loop's own thread (a call submitted from a task runs there to its end). The
waiting task registers a `wake` callback: from another thread it hands control back
through the loop's thread-safe entry (a wake-up of the loop); on the loop's thread
it resumes the task directly, which costs no system call.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, Protocol

from ..devices._base import Poller
from ..devices._call import asyncio_loop

Register = Callable[[Callable[[], None]], bool]
"""Registers `wake`; returns False (and never calls it) if the event already happened."""
Forget = Callable[[Callable[[], None]], None]
"""Unregisters `wake`: its task stopped waiting (cancelled)."""


class Finishes(Protocol):
    """What a wait is for (the API's Call): `_finished` turns True when it happened."""

    @property
    def _finished(self) -> bool: ...

SPIN_FOR = 50e-6
"""Seconds a task spins on its poller (polls with no turn of the event loop between
them) before its first turn of the loop: over MPI a peer close behind answers within
a round trip of a few microseconds, and a turn of the loop costs more than that.
(A vain poll yields the core to another process: see MPIFabric.poll.)"""

POLL_FOR = 0.002
"""Seconds a task polls (after its spin, yielding to the other tasks between polls)
before it leaves the waiting to the device's own thread: a quick answer then costs no
thread hop and no wake-up of the loop, and a long wait costs no core."""

TURN_EVERY = 0.001
"""A task whose poll answers its call goes on without a turn of the event loop (a
turn costs more than the rest of a small call's wait), and one that spins spins on,
unless the loop has not turned for this many seconds: the other tasks still run, and
a timeout or cancel scope around a loop of such calls still fires."""
_next_turn = 0.0  # (monotonic) when a polling task next lets the loop turn
_ident = threading.get_ident
_trio: Any = None  # trio, once a wait ran on it (asyncio's programs never import it)
_token: ContextVar[tuple[Callable[[], Any], Any]] = ContextVar("aaccl_trio_token")
"""(a weak reference to a trio task, the token of its run), kept in the task's
context so that its next wait costs no lookup (a wake from another thread goes
through the token). Only the task that set it uses it: a context is copied to child
tasks, and to other threads (`anyio.to_thread.run_sync`), where another run may
start in it."""


def answered(poller: Poller, call: Finishes) -> bool:
    """Poll once for a task (asyncio or trio) about to wait for `call`: True if that
    finished it and the loop turned lately (TURN_EVERY), so the task goes on without
    waiting; else it waits (`wait`, which lets the loop turn if `call` is done, or
    polls on). Over MPI a small collective's answer is most often in by the time its
    task awaits it: this is its whole wait, with no waker made on either loop."""
    poller.poll()
    return call._finished and time.monotonic() < _next_turn


async def wait(register: Register, poller: Poller | None = None,
               forget: Forget | None = None, call: Finishes | None = None,
               loop: asyncio.AbstractEventLoop | None = None) -> None:
    """Suspend the current task until the registered `wake` is called from any thread;
    with a `poller`, poll it for a while first: for up to SPIN_FOR without a turn of
    the event loop, then with one between polls, up to POLL_FOR in all. If the task
    is cancelled meanwhile, `forget(wake)` unregisters it (so that waits retried under
    timeouts add none).

    On asyncio (inline here: a small call's wait is on the path of every call) the
    loop's future is only made if the task suspends for good (it parks). With `call`
    (whose `_finished` says that the event happened), the spin comes first, before
    `wake` is made and registered: a call that a poll of the spin completes (a small
    collective over MPI) costs no waker at all. `loop`: the running loop of asyncio,
    if the caller knows it (asyncio's lookup costs a system call). (One coroutine on
    asyncio: tests/mpi/budget.py counts a wait's calls where a first poll did not
    answer.)"""
    if loop is None:
        loop = asyncio_loop()  # (None: trio, where asyncio's own lookup would raise)
        if loop is None:
            await wait_trio(register, poller, forget)
            return
    global _next_turn
    began = 0.0
    if call is not None and poller is not None:
        while not call._finished:  # (`answered` may have polled it done already)
            poller.poll()
            if call._finished:
                break
            now = time.monotonic()
            if not began:  # (the spin counts from its first poll: most often the last)
                began = now
            if now >= began + SPIN_FOR or now >= _next_turn:
                break  # (what is left of the wait goes the general way, below)
        if call._finished:  # the loop turns if it has not lately, and the task goes on
            if time.monotonic() >= _next_turn:
                await asyncio.sleep(0)
                _next_turn = time.monotonic() + TURN_EVERY
            return
    home = _ident()
    woke = False
    future: asyncio.Future[None] | None = None

    def wake() -> None:
        nonlocal woke
        woke = True
        waiting = future  # (set before the task reads `woke` again: see below)
        if waiting is not None:
            try:
                if _ident() == home:
                    _resolve(waiting)
                else:
                    loop.call_soon_threadsafe(_resolve, waiting)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                pass

    if not register(wake):
        return
    try:
        if poller is not None:
            now = time.monotonic()
            began = began or now  # (counted from the spin before `register`, if any)
            spin_until, until = began + SPIN_FOR, began + POLL_FOR
            while True:
                poller.poll()
                if woke:
                    if time.monotonic() < _next_turn:
                        return
                    await asyncio.sleep(0)
                    _next_turn = time.monotonic() + TURN_EVERY
                    return
                now = time.monotonic()
                if now < spin_until and now < _next_turn:
                    continue
                if now >= until:
                    poller.park()
                    break
                await asyncio.sleep(0)
                _next_turn = time.monotonic() + TURN_EVERY
                if woke:
                    return
        future = loop.create_future()
        if not woke:  # (a wake from another thread sees `future` now, or set `woke`)
            await future
    except BaseException:
        if forget is not None:
            forget(wake)
        raise


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():  # a cancelled waiter has gone away
        future.set_result(None)


class _TrioWaiter:
    """A trio task's wait for one event, as one object: `wake` (registered, called
    from any thread) and `abort` (trio cancels the wait) in place of a closure each.
    `waiting`: nobody woke it, nor was it cancelled; `parked`: it sleeps in trio's
    scheduler (a polling task does not: a wake only tells it to stop polling)."""

    __slots__ = ("task", "token", "home", "waiting", "parked")

    task: Any
    token: Any
    home: int
    waiting: bool
    parked: bool

    def wake(self) -> None:
        if _ident() == self.home:
            self.resume()
            return
        try:  # (trio's thread-safe entry: `resume` runs in the run's own thread)
            self.token.run_sync_soon(self.resume)
        except _trio.RunFinishedError:
            pass

    def resume(self) -> None:
        if self.waiting:
            self.waiting = False
            if self.parked:
                self.parked = False
                _trio.lowlevel.reschedule(self.task)

    def abort(self, _: object) -> Any:
        self.waiting = False
        return _trio.lowlevel.Abort.SUCCEEDED


async def wait_trio(register: Register, poller: Poller | None = None,
                    forget: Forget | None = None) -> None:
    """`wait` on trio (where no asyncio loop runs)."""
    global _next_turn, _trio
    trio = _trio
    if trio is None:
        import trio
        _trio = trio
    lowlevel = trio.lowlevel
    waiter = _TrioWaiter()
    task = lowlevel.current_task()
    kept = _token.get(None)
    if kept is not None and kept[0]() is task:
        token = kept[1]
    else:  # the task's first wait (what its context holds is another task's, if any)
        token = lowlevel.current_trio_token()
        _token.set((weakref.ref(task), token))
    waiter.task, waiter.token, waiter.home = task, token, _ident()
    waiter.waiting, waiter.parked = True, poller is None
    wake = waiter.wake
    if not register(wake):  # it happened already (`answered` may have polled it done)
        if poller is not None and time.monotonic() >= _next_turn:  # a polling task's turn
            await lowlevel.checkpoint()
            _next_turn = time.monotonic() + TURN_EVERY
        return
    try:
        if poller is not None:
            now = time.monotonic()
            spin_until, until = now + SPIN_FOR, now + POLL_FOR
            while waiter.waiting and now < until:
                poller.poll()
                now = time.monotonic()
                if waiter.waiting:
                    if now < spin_until and now < _next_turn:
                        continue  # spin: no checkpoint between polls
                elif now < _next_turn:
                    return  # answered, and the loop turned lately
                await lowlevel.checkpoint()
                now = time.monotonic()
                _next_turn = now + TURN_EVERY
            if not waiter.waiting:
                return
            waiter.parked = True
            poller.park()
        await lowlevel.wait_task_rescheduled(waiter.abort)
    except BaseException:
        if forget is not None:
            forget(wake)
        raise
