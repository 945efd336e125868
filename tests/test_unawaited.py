"""A `Call` garbage collected without ever being used warns, like a coroutine never
awaited: forgetting `await` otherwise reads a buffer before the result is in place.

Used means awaited, `wait()`ed, its `exception()` read, or passed in another call's
`waitfor`; `done()` alone does not count. The warning points at the user's line that
made the call (as a coroutine's would at the line that forgot to await it), so that
warning filters by module and `-W error` apply to it there. A failed call is reported by its error
instead, once: logged if nobody retrieved it, silent if a dependent's
DependencyError reported it. Leaving a world waits for outstanding calls without
counting as using them; the compat API's blocking calls wait for theirs, so a pyaccl
program never sees the warning.
"""

from __future__ import annotations

import gc
import logging
import re
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import anyio
import numpy as np
import pytest

import aaccl
from conftest import wait_until
from aaccl import CCLOError, DependencyError
from aaccl import ReduceFunction as F

pytestmark = pytest.mark.anyio


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


# One line each: a lambda's first line is the line that makes the call.
MAKERS: dict[str, Callable[..., aaccl.Call]] = {
    "nop": lambda a, x, y, z: a.nop(),
    "copy": lambda a, x, y, z: a.copy(x, y, 4),
    "combine": lambda a, x, y, z: a.combine(4, F.SUM, x, y, z),
    "send": lambda a, x, y, z: a.send(x, 4, 0, 7),
    "recv": lambda a, x, y, z: a.recv(y, 4, 0, 8),
    "bcast": lambda a, x, y, z: a.bcast(x, 4, 0),
    "scatter": lambda a, x, y, z: a.scatter(x, y, 4, 0),
    "gather": lambda a, x, y, z: a.gather(x, y, 4, 0),
    "reduce": lambda a, x, y, z: a.reduce(x, y, 4, 0, F.SUM),
    "allgather": lambda a, x, y, z: a.allgather(x, y, 4),
    "allreduce": lambda a, x, y, z: a.allreduce(x, y, 4, F.SUM),
    "allreduce_keywords": lambda a, x, y, z: a.allreduce(x, y, 4, func=F.SUM, to_fpga=True),
    "reduce_scatter": lambda a, x, y, z: a.reduce_scatter(x, y, 4, F.SUM),
    "alltoall": lambda a, x, y, z: a.alltoall(x, y, 4),
    "barrier": lambda a, x, y, z: a.barrier(),
    "kernel": lambda a, x, y, z: a.kernel(np.negative)(x, x),
    "sync_to_device": lambda a, x, y, z: a.sync_to_device(x),
    "sync_from_device": lambda a, x, y, z: a.sync_from_device(x),
}
PARTNERS = {  # what completes a dropped send or recv on a rank of one
    "send": lambda a, x, y, z: a.recv(z, 4, 0, 7),
    "recv": lambda a, x, y, z: a.send(x, 4, 0, 8),
}


@pytest.mark.parametrize("method", list(MAKERS))
async def test_the_warning_points_at_the_line_that_made_the_call(method: str) -> None:
    """Not at aaccl's own files: at the caller of the public method (or of a kernel),
    with its module, on either event loop."""
    with recorded() as caught:
        async with aaccl.open_world(1, timeout=5) as (accl,):
            bufs = [accl.allocate(4) for _ in range(3)]
            call = MAKERS[method](accl, *bufs)
            name, ref = call.name, weakref.ref(call)
            if method in PARTNERS:
                await PARTNERS[method](accl, *bufs)
            await wait_until(call.done)
            del call
        await collected(ref, caught)
    warned = [w for w in caught if w.category is RuntimeWarning and name in str(w.message)]
    assert len(warned) == 1
    assert (warned[0].filename, warned[0].lineno) == \
        (__file__, MAKERS[method].__code__.co_firstlineno)


async def test_filters_by_module_and_error_apply_at_the_users_line(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`-W error` and `filterwarnings(..., module=...)` act on the warning as on one
    the user's module issued: ignored, or raised (from __del__: to the unraisable hook)."""
    raised: list[tuple[type, str]] = []  # not the error: its traceback holds the call
    monkeypatch.setattr("sys.unraisablehook", lambda unraisable: raised.append(
        (type(unraisable.exc_value), str(unraisable.exc_value))))
    async with aaccl.open_world(1, timeout=5) as (accl,):
        for action in ("ignore", "error"):
            call = accl.nop()
            ref = weakref.ref(call)
            await wait_until(call.done)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                warnings.filterwarnings(action, category=RuntimeWarning,
                                        module=re.escape(__name__))
                del call
                await wait_until(lambda: gc.collect() >= 0 and ref() is None)
            assert never_awaited(caught) == []
    assert len(raised) == 1 and raised[0][0] is RuntimeWarning
    assert "was never awaited" in raised[0][1]


def test_a_dropped_run_async_handle_of_the_compat_api_points_at_its_line() -> None:
    from aaccl.compat import accl

    rank = accl(1, 0, sim_mode=True)
    try:
        buf = rank.allocate(16)
        with recorded() as caught:
            line = sys._getframe().f_lineno + 1
            handle = rank.copy(buf, rank.allocate(16), 16, run_async=True)
            call = handle.call
            ref = weakref.ref(call)
            anyio.run(wait_until, call.done)
            del handle, call
            anyio.run(collected, ref, caught)
    finally:
        rank.deinit()
    warned = [w for w in caught if "never awaited" in str(w.message)]
    assert [(w.filename, w.lineno) for w in warned] == [(__file__, line)]


# (the copies read on the host what the failing recv was to write: on purpose)
@pytest.mark.filterwarnings("ignore:this .* reads its input from host memory:RuntimeWarning")
async def test_a_failure_that_fails_a_thousand_dropped_calls_is_logged_once(caplog) -> None:
    """A loop of calls nobody awaited, on one buffer, whose first fails: each of the
    others fails with it (they read what it was to write). One line says what failed,
    not 1,000 (the first collected names it; the rest are not listed)."""
    async with aaccl.open_world(2, timeout=0.2) as (_, b):
        buf, out = b.allocate(4), b.allocate(4)
        calls = [b.recv(buf, 4, 0)]  # never sent: times out
        calls += [b.copy(buf, out, 4) for _ in range(1000)]
        last, refs = calls[-1], [weakref.ref(c) for c in calls]
        await wait_until(last.done)
        with caplog.at_level(logging.ERROR, logger="aaccl"), recorded() as caught:
            del calls, last
            await collected(refs[0], caught)
            assert all(ref() is None for ref in refs)  # (one collection took them all)
    assert never_awaited(caught) == []
    logged = [r.getMessage() for r in caplog.records if "nobody awaited" in r.getMessage()]
    assert len(logged) == 1, logged[:3]
    assert "recv (rank 1, call 1)" in logged[0] and "RECEIVE_TIMEOUT" in logged[0]
