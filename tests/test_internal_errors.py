"""A bug inside the soft CCLO fails the call (logged) instead of leaving it pending."""

from __future__ import annotations

import logging

import anyio
import numpy as np
import pytest

import aaccl
from aaccl import ErrorCode, ReduceFunction
from aaccl.soft._datapath import Datapath


@pytest.mark.anyio
@pytest.mark.parametrize("count", [4, 5000])  # inline (parked) and worker paths
async def test_internal_error_fails_the_call(count: int, monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    def broken(self: Datapath, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        raise ZeroDivisionError("model bug")

    async with aaccl.open_world(2, timeout=1.0) as accls:
        bufs = [(a.allocate(count), a.allocate(count)) for a in accls]
        with monkeypatch.context() as patch:
            patch.setattr(Datapath, "combine", broken)
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
