"""DESIGN.md's example, verbatim in spirit: the contract every user starts from."""

from __future__ import annotations

import numpy as np
import pytest

import aaccl
from aaccl import ReduceFunction


async def main(accl: aaccl.ACCL) -> tuple[np.ndarray, np.ndarray]:
    src = accl.allocate((1024,), np.float32)
    dst = accl.allocate((1024,), np.float32)
    src[:] = accl.rank
    await accl.allreduce(src, dst, 1024, ReduceFunction.SUM)
    first = np.array(dst)
    dst[:] = -1  # host copy only: the chain below works on the device
    a = accl.allreduce(src, dst, 1024, ReduceFunction.SUM, to_fpga=True)
    b = accl.bcast(dst, 1024, root=0, from_fpga=True, waitfor=[a])
    await b
    assert a.done() and b.done()
    return first, np.array(dst)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_design_example(backend: str) -> None:
    results = aaccl.run(main, world_size=4, backend=backend)
    assert len(results) == 4
    for first, chained in results:
        np.testing.assert_array_equal(first, np.full(1024, 0 + 1 + 2 + 3, np.float32))
        np.testing.assert_array_equal(chained, np.full(1024, 6, np.float32))


def test_run_returns_results_in_rank_order() -> None:
    async def rank_of(accl: aaccl.ACCL) -> int:
        return accl.rank

    assert aaccl.run(rank_of, world_size=5) == [0, 1, 2, 3, 4]


def test_a_failing_rank_raises_its_own_error() -> None:
    async def fail_on_two(accl: aaccl.ACCL) -> None:
        if accl.rank == 2:
            raise KeyError("rank two")
        await accl.barrier()

    with pytest.raises(KeyError, match="rank two"):
        aaccl.run(fail_on_two, world_size=3, timeout=0.5)
