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
from collections.abc import Callable

Register = Callable[[Callable[[], None]], bool]
"""Registers `wake`; returns False (and never calls it) if the event already happened."""


async def wait(register: Register) -> None:
    """Suspend the current task until the registered `wake` is called from any thread."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        await _wait_trio(register)
    else:
        await _wait_asyncio(loop, register)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():  # a cancelled waiter has gone away
        future.set_result(None)


async def _wait_asyncio(loop: asyncio.AbstractEventLoop, register: Register) -> None:
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

    if register(wake):
        await future


async def _wait_trio(register: Register) -> None:
    import trio

    task = trio.lowlevel.current_task()
    token = trio.lowlevel.current_trio_token()
    home = threading.get_ident()
    waiting = True

    def resume() -> None:
        nonlocal waiting
        if waiting:
            waiting = False
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
        await trio.lowlevel.wait_task_rescheduled(abort)
