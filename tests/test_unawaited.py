"""A `Call` garbage collected without ever being used warns, like a coroutine never
awaited: forgetting `await` otherwise reads a buffer before the result is in place.

Used means awaited, `wait()`ed, its `exception()` read, or passed in another call's
`waitfor`; `done()` alone does not count. A failed call is reported by its error
instead, once: logged if nobody retrieved it, silent if a dependent's
DependencyError reported it. Leaving a world waits for outstanding calls without
counting as using them; the compat API's blocking calls wait for theirs, so a pyaccl
program never sees the warning.
"""

from __future__ import annotations

import gc
import logging
import re
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import anyio
import pytest

import aaccl
from aaccl import CCLOError, DependencyError

pytestmark = pytest.mark.anyio


async def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.002)


@contextmanager
def recorded() -> Iterator[list[warnings.WarningMessage]]:
    """Every warning issued inside, from any thread (a call may be collected on the
    device's), each one recorded."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def warning_for(name: str) -> str:
    return (f"Call {name} was never awaited: its result may not be in place when you "
            "read the buffer; await it, pass it in waitfor=, or call .wait()")


def never_awaited(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught
            if w.category is RuntimeWarning and "never awaited" in str(w.message)]


async def collected(ref: weakref.ref, caught: list[warnings.WarningMessage]) -> None:
    """Wait until the call behind `ref` is finalized: gone, or kept alive only by the
    warning that names it (a recorded warning holds its source)."""
    def finalized() -> bool:
        gc.collect()
        return ref() is None or bool(never_awaited(caught))

    await wait_until(finalized)
    gc.collect()  # a second report, if there were one, would be here by now


async def test_a_dropped_call_warns_once_naming_it() -> None:
    async with aaccl.open_world(1, timeout=5) as (accl,):
        call = accl.nop()
        name, ref = call.name, weakref.ref(call)
        await wait_until(call.done)  # done() does not count as using it
        with recorded() as caught:
            del call
            await collected(ref, caught)
    assert never_awaited(caught) == [warning_for(name)]
    assert name.startswith("nop (rank 0, call ")


async def test_pytest_warns_sees_it() -> None:
    async with aaccl.open_world(1, timeout=5) as (accl,):
        buf = accl.allocate(8)
        call = accl.copy(buf, accl.allocate(8), 8)
        name, ref = call.name, weakref.ref(call)
        await accl.nop(waitfor=[accl.nop()])
        await wait_until(call.done)
        with pytest.warns(RuntimeWarning,
                          match=re.escape(f"Call {name} was never awaited")) as caught:
            del call
            await collected(ref, caught.list)


async def test_a_send_left_behind_when_leaving_the_world_warns() -> None:
    """Fire and forget: the world waits for the send on leaving, but nobody awaited it."""
    with recorded() as caught:
        async with aaccl.open_world(2, timeout=5) as (a, b):
            send = a.send(a.allocate(4), 4, 1)
            name, ref = send.name, weakref.ref(send)
            del send
            await b.recv(b.allocate(4), 4, 0)
        await collected(ref, caught)
    assert [m for m in never_awaited(caught) if name in m] == [warning_for(name)]
    assert len(never_awaited(caught)) == 1  # the awaited recv did not warn


async def test_an_awaited_call_does_not_warn() -> None:
    async with aaccl.open_world(1, timeout=5) as (accl,):
        call = accl.nop()
        await call
        ref = weakref.ref(call)
        with recorded() as caught:
            del call
            await collected(ref, caught)
    assert never_awaited(caught) == []


async def test_a_waited_call_does_not_warn() -> None:
    async with aaccl.open_world(1, timeout=5) as (accl,):
        call = accl.nop()
        await anyio.to_thread.run_sync(call.wait)
        ref = weakref.ref(call)
        with recorded() as caught:
            del call
            await collected(ref, caught)
    assert never_awaited(caught) == []


async def test_a_call_in_waitfor_does_not_warn() -> None:
    async with aaccl.open_world(1, timeout=5) as (accl,):
        call = accl.nop()
        await accl.nop(waitfor=[call])
        ref = weakref.ref(call)
        with recorded() as caught:
            del call
            await collected(ref, caught)
    assert never_awaited(caught) == []


async def test_a_call_whose_exception_was_read_does_not_warn() -> None:
    async with aaccl.open_world(1, timeout=5) as (accl,):
        call = accl.nop()
        await wait_until(call.done)
        assert call.exception() is None
        ref = weakref.ref(call)
        with recorded() as caught:
            del call
            await collected(ref, caught)
    assert never_awaited(caught) == []


async def test_a_cancelled_await_counts_as_awaiting() -> None:
    async with aaccl.open_world(2, timeout=5) as (a, b):
        call = b.recv(b.allocate(4), 4, 0)
        with anyio.move_on_after(0.05):
            await call
        await a.send(a.allocate(4), 4, 1)
        ref = weakref.ref(call)
        with recorded() as caught:
            del call
            await collected(ref, caught)
    assert never_awaited(caught) == []


async def test_a_failed_call_nobody_awaited_is_logged_not_warned(caplog) -> None:
    """One report per call: the failure, on the aaccl logger."""
    async with aaccl.open_world(2, timeout=0.2) as (_, b):
        call = b.recv(b.allocate(4), 4, 0)
        name, ref = call.name, weakref.ref(call)
        await wait_until(call.done)
        with caplog.at_level(logging.ERROR, logger="aaccl"), recorded() as caught:
            del call
            await collected(ref, caught)
    assert never_awaited(caught) == []
    logged = [r.getMessage() for r in caplog.records if name in r.getMessage()]
    assert len(logged) == 1 and "nobody awaited" in logged[0]


async def test_a_failure_reported_through_a_dependent_does_not_warn_for_either(caplog) -> None:
    async with aaccl.open_world(2, timeout=0.2) as (_, b):
        failing = b.recv(b.allocate(4), 4, 0)
        dependent = b.nop(waitfor=[failing])
        refs = weakref.ref(failing), weakref.ref(dependent)
        with pytest.raises(DependencyError) as raised:
            await dependent
        assert isinstance(raised.value.__cause__, CCLOError)
        del raised
        with caplog.at_level(logging.ERROR, logger="aaccl"), recorded() as caught:
            del failing, dependent
            for ref in refs:
                await collected(ref, caught)
    assert never_awaited(caught) == []
    assert [r for r in caplog.records if "nobody awaited" in r.getMessage()] == []


async def test_a_dropped_call_whose_failure_a_later_call_reported_is_silent(caplog) -> None:
    """Not in any waitfor: the copy waits for the recv because it reads its buffer."""
    async with aaccl.open_world(2, timeout=0.2) as (_, b):
        buf = b.allocate(4)
        failing = b.recv(buf, 4, 0)
        ref = weakref.ref(failing)
        with caplog.at_level(logging.ERROR, logger="aaccl"), recorded() as caught:
            del failing
            with pytest.raises(DependencyError, match=r"recv \(rank 1, call 1\) failed"):
                await b.copy(buf, b.allocate(4), 4)
            await collected(ref, caught)
    assert never_awaited(caught) == []
    assert [r for r in caplog.records if "nobody awaited" in r.getMessage()] == []


def test_the_compat_blocking_api_does_not_warn() -> None:
    """aaccl.compat waits for its own calls: a pyaccl program never sees the warning."""
    from aaccl.compat import accl

    with recorded() as caught:
        rank = accl(1, 0, sim_mode=True)
        try:
            buf = rank.allocate(16)
            rank.nop()
            rank.copy(buf, rank.allocate(16), 16)
            rank.nop(run_async=True).wait()
        finally:
            rank.deinit()
        gc.collect()
    assert never_awaited(caught) == []
