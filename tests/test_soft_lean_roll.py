"""The lean call path's pieces below the API (issue 28), where the API's checks cannot
reach: calls made through the driver. A collective's call that its CCLO cannot run
still counts in the in-process roll call (`_RollCall.join`, fingerprint None), so
that the roll's entry ends with the last rank; and the RETCODE register, kept as an
int, reads back every call's return code through `mmio_read` as a word of exchange
memory would."""

from __future__ import annotations

import asyncio

import numpy as np

import aaccl
from aaccl import ErrorCode, ReduceFunction
from aaccl import _exchmem as xm
from aaccl._constants import Scenario

F32 = np.dtype(np.float32)


def test_a_collective_one_cclo_cannot_decode_fails_everywhere_and_leaves_no_roll() -> None:
    """Rank 1's bcast names a root outside the communicator (its CCLO cannot decode
    it, so it never joins with a fingerprint): the receiving ranks' calls fail, the
    next collective runs and matches, and the fabric's roll call holds no entry."""
    async def main() -> tuple[list[aaccl.devices.DeviceCall], int, float]:
        async with aaccl.open_world(3, timeout=30.0) as accls:
            bufs = [a.allocate(4, np.float32) for a in accls]
            calls = [a._driver.start(Scenario.BCAST, 4, 0, 7 if a.rank == 1 else 0,
                                     dtype=F32, addrs=(b._address, 0, b._address))
                     for a, b in zip(accls, bufs)]
            for call in calls:
                assert await asyncio.to_thread(call.block, 10), "the call never ended"
            for b in bufs:
                b[:] = 1
            await asyncio.gather(*(a.allreduce(b, b, 4, ReduceFunction.SUM) for a, b in
                                   zip(accls, bufs)))
            return calls, len(accls[0]._driver.device.port.fabric.roll), float(bufs[2][0])

    calls, roll, total = asyncio.run(main())
    assert calls[1].retcode == ErrorCode.DMA_DECODE_ERROR
    assert calls[2].failed  # on rank 1's notice (the root's sends may have ended well)
    assert total == 3.0  # the next collective matched on every rank
    assert roll == 0


def test_the_retcode_register_reads_back_each_calls_return_code() -> None:
    """A call that fails leaves its code in RETCODE, the next one that succeeds 0;
    the host's own write to the register reads back too."""
    async def main() -> tuple[int, int, int]:
        async with aaccl.open_world(2, timeout=30.0) as (a, b):
            dev = a._driver.device
            src = a.allocate(4, np.float32)
            failed = a._driver.start(Scenario.COPY, 4, dtype=F32,
                                     addrs=(123_456_789, 0, src._address))
            assert await asyncio.to_thread(failed.block, 10)
            after_failure = dev.mmio_read(xm.RETCODE)
            ok = a._driver.start(Scenario.COPY, 4, dtype=F32,
                                 addrs=(src._address, 0, src._address))
            assert await asyncio.to_thread(ok.block, 10)
            after_success = dev.mmio_read(xm.RETCODE)
            dev.mmio_write(xm.RETCODE, 42)
            return after_failure, after_success, dev.mmio_read(xm.RETCODE)

    after_failure, after_success, written = asyncio.run(main())
    assert after_failure == ErrorCode.DMA_DECODE_ERROR
    assert after_success == 0
    assert written == 42
