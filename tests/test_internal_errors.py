"""A bug inside the soft CCLO or a completion callback fails that call or callback
(logged) instead of leaving calls pending."""

from __future__ import annotations

import logging

import anyio
import numpy as np
import pytest

import aaccl
from aaccl import ErrorCode, ReduceFunction
from aaccl.devices import DeviceCall
from aaccl.soft._datapath import Datapath
from aaccl.soft.fabric._inprocess import Meeting


@pytest.mark.anyio
@pytest.mark.parametrize("count", [4, 5000])  # inline (parked) and worker paths
async def test_internal_error_fails_the_call(count: int, monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    def broken(self: Datapath, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        raise ZeroDivisionError("model bug")

    def broken_fold(self: Meeting) -> np.ndarray:
        raise ZeroDivisionError("model bug")

    async with aaccl.open_world(2, timeout=1.0) as accls:
        bufs = [(a.allocate(count), a.allocate(count)) for a in accls]
        with monkeypatch.context() as patch:
            patch.setattr(Datapath, "combine", broken)
            patch.setattr(Meeting, "fold", broken_fold)  # (a small allreduce's ranks meeting)
            calls = [a.allreduce(s, d, count, ReduceFunction.SUM) for a, (s, d) in zip(accls, bufs)]
            with anyio.fail_after(5):
                for call in calls:
                    with pytest.raises(aaccl.ACCLError) as info:
                        await call
                    if isinstance(info.value, aaccl.CCLOError):
                        assert info.value.code & (ErrorCode.DMA_INTERNAL_ERROR
                                                  | ErrorCode.RECEIVE_TIMEOUT_ERROR)
        assert "internal error in allreduce" in caplog.text
        caplog.set_level(logging.ERROR)
        for a, (s, _) in zip(accls, bufs):  # the ranks stay usable
            s[:] = a.rank + 1
        with anyio.fail_after(5):
            for call in [a.allreduce(s, d, count, ReduceFunction.SUM) for a, (s, d) in zip(accls, bufs)]:
                await call
        for _, d in bufs:
            np.testing.assert_array_equal(d, np.full(count, 3, np.float32))


def test_a_raising_completion_callback_fails_alone(caplog: pytest.LogCaptureFixture) -> None:
    """Its own failure, logged: the call's other callbacks and those of calls
    completed inside it (queued on this thread, as a chain's are) still run."""
    first, second, third = DeviceCall(None), DeviceCall(None), DeviceCall(None)
    ran: list[str] = []

    def complete_second_then_raise(_: DeviceCall) -> None:
        second.complete()  # its callbacks queue behind first's
        raise RuntimeError("callback bug")

    first.add_done_callback(complete_second_then_raise)
    first.add_done_callback(lambda _: ran.append("first's next"))
    second.add_done_callback(lambda _: ran.append("second's"))
    second.add_done_callback(lambda _: third.complete())
    third.add_done_callback(lambda _: ran.append("third's"))
    first.complete()  # does not raise: the failure stays the callback's
    assert ran == ["first's next", "second's", "third's"]
    assert "callback bug" in caplog.text and "completion callback" in caplog.text
    fourth = DeviceCall(None)  # the thread's queue starts afresh
    fourth.add_done_callback(lambda _: ran.append("fourth's"))
    fourth.complete()
    assert ran[-1] == "fourth's"


@pytest.mark.anyio
async def test_a_raising_callback_loses_no_dependent_start(
        caplog: pytest.LogCaptureFixture) -> None:
    def broken(_: DeviceCall) -> None:
        raise RuntimeError("callback bug")

    async with aaccl.open_world(2, timeout=5) as (a, b):
        buf, out = a.allocate(4), b.allocate(4)
        received = a.recv(buf, 4, 1)
        received.add_done_callback(broken)  # before the kernel's start, below
        doubled = a.kernel(lambda x: np.multiply(x, 2, out=x))(buf, waitfor=[received])
        out[:] = [1, 2, 3, 4]
        with anyio.fail_after(5):
            await b.send(out, 4, 0)
            await a.sync_from_device(buf, waitfor=[doubled])
        np.testing.assert_array_equal(buf, [2, 4, 6, 8])
        await received
    assert "callback bug" in caplog.text
