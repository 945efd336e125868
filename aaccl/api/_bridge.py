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
from collections.abc import Callable
from typing import Protocol

Register = Callable[[Callable[[], None]], bool]
"""Registers `wake`; returns False (and never calls it) if the event already happened."""
Forget = Callable[[Callable[[], None]], None]
"""Unregisters `wake`: its task stopped waiting (cancelled)."""

class Poller(Protocol):
    """A device whose progress a waiting task can make itself (the MPI fabric)."""

    def poll(self) -> object:
        """Make progress once, on the calling thread."""

    def park(self) -> None:
        """A task stopped polling before its call finished: the device's own thread
        takes over."""


POLL_FOR = 0.002
"""Seconds a task polls (then yields to the other tasks, and again) before it leaves
the waiting to the device's own thread: a quick answer then costs no thread hop and
no wake-up of the loop, and a long wait costs no core."""

TURN_EVERY = 0.001
"""On asyncio, a task whose poll answers its call at once goes on without a turn of
the event loop (a turn costs more than the rest of a small call's wait), unless the
loop has not turned for this many seconds: the other tasks still run, and a timeout
or cancel scope around a loop of such calls still fires. (trio checkpoints anyway.)"""
_next_turn = 0.0  # (monotonic) when a polling task next lets the loop turn


async def wait(register: Register, poller: Poller | None = None,
               forget: Forget | None = None) -> None:
    """Suspend the current task until the registered `wake` is called from any thread;
    with a `poller`, poll it for a while first. If the task is cancelled meanwhile,
    `forget(wake)` unregisters it (so that waits retried under timeouts add none)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        await _wait_trio(register, poller, forget)
    else:
        await _wait_asyncio(loop, register, poller, forget)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():  # a cancelled waiter has gone away
        future.set_result(None)


async def _wait_asyncio(loop: asyncio.AbstractEventLoop, register: Register,
                        poller: Poller | None, forget: Forget | None) -> None:
    future: asyncio.Future[None] = loop.create_future()
    home = threading.get_ident()

    def wake() -> None:
        try:
            if threading.get_ident() == home:
                _resolve(future)
            else:
                loop.call_soon_threadsafe(_resolve, future)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    global _next_turn
    if register(wake):
        try:
            if poller is not None:
                until = time.monotonic() + POLL_FOR
                while True:
                    poller.poll()
                    now = time.monotonic()
                    if future.done() and now < _next_turn:
                        return
                    if not future.done() and now >= until:
                        poller.park()
                        break
                    await asyncio.sleep(0)
                    _next_turn = time.monotonic() + TURN_EVERY
                    if future.done():
                        break
            await future
        except BaseException:
            if forget is not None:
                forget(wake)
            raise


async def _wait_trio(register: Register, poller: Poller | None,
                     forget: Forget | None) -> None:
    import trio

    task = trio.lowlevel.current_task()
    token = trio.lowlevel.current_trio_token()
    home = threading.get_ident()
    waiting = True
    parked = poller is None  # while polling, the task is not parked: a wake only says so

    def resume() -> None:
        nonlocal waiting, parked
        if waiting:
            waiting = False
            if parked:
                parked = False
                trio.lowlevel.reschedule(task)

    def wake() -> None:
        if threading.get_ident() == home:
            resume()
            return
        try:
            token.run_sync_soon(resume)
        except trio.RunFinishedError:
            pass

    def abort(_: object) -> trio.lowlevel.Abort:
        nonlocal waiting
        waiting = False
        return trio.lowlevel.Abort.SUCCEEDED

    if register(wake):
        try:
            if poller is not None:
                until = time.monotonic() + POLL_FOR
                while waiting and time.monotonic() < until:
                    poller.poll()
                    await trio.lowlevel.checkpoint()
                if not waiting:
                    return
                parked = True
                poller.park()
            await trio.lowlevel.wait_task_rescheduled(abort)
        except BaseException:
            if forget is not None:
                forget(wake)
            raise
