"""A pyaccl-style pytest suite, one rank per process, as pyaccl's users run theirs:

    mpiexec -n N python -m pytest tests/mpi/compat_suite.py

Every process runs every test; each test makes its world with pyaccl's constructor
(`accl(N, MPI rank, sim_mode=True)`, in a fixture) and deinits it, so one process
forms a world per test. Results are checked against numpy. (The file's name keeps
the ordinary test run from collecting it: tests/test_compat_mpi.py launches it.)
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

mpi4py = pytest.importorskip("mpi4py")
from mpi4py import MPI  # noqa: E402

import aaccl  # noqa: E402
from aaccl.compat import ACCLReduceFunctions, accl  # noqa: E402

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


@pytest.fixture
def cclo() -> Iterator[accl]:
    instance = accl(SIZE, RANK, sim_mode=True)
    yield instance
    instance.deinit()


def data(rank: int, count: int, dtype: type = np.float32) -> np.ndarray:
    return (np.arange(count) % 97 + rank).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.int64])
def test_allreduce(cclo: accl, dtype: type) -> None:
    src, dst = cclo.allocate((300,), dtype), cclo.allocate((300,), dtype)
    src[:] = data(RANK, 300, dtype)
    cclo.allreduce(src, dst, 300, ACCLReduceFunctions.SUM)
    np.testing.assert_array_equal(dst, np.sum([data(r, 300, dtype) for r in range(SIZE)],
                                              axis=0, dtype=dtype))


def test_send_to_the_next_rank(cclo: accl) -> None:
    src, dst = cclo.allocate((64,)), cclo.allocate((64,))
    src[:] = data(RANK, 64)
    handle = cclo.recv(dst, 64, (RANK - 1) % SIZE, run_async=True)
    cclo.send(src, 64, (RANK + 1) % SIZE)
    handle.wait()
    np.testing.assert_array_equal(dst, data((RANK - 1) % SIZE, 64))


def test_gather_and_bcast(cclo: accl) -> None:
    src, everyone = cclo.allocate((10,)), cclo.allocate((10 * SIZE,))
    src[:] = data(RANK, 10)
    cclo.gather(src, everyone, 10, 0)
    if RANK == 0:
        np.testing.assert_array_equal(everyone, np.concatenate([data(r, 10)
                                                                for r in range(SIZE)]))
    cclo.bcast(everyone, 10 * SIZE, 0)
    np.testing.assert_array_equal(everyone, np.concatenate([data(r, 10) for r in range(SIZE)]))


def test_a_rejected_constructor_takes_no_world() -> None:
    with pytest.raises(ValueError, match="multiple of 8"):
        accl(SIZE, RANK, sim_mode=True, bufsize=7)
    with pytest.raises(ValueError, match="local_rank must be the process's MPI rank"):
        accl(SIZE, (RANK + 1) % SIZE, sim_mode=True)
    instance = accl(SIZE, RANK, sim_mode=True)
    try:
        buf = instance.allocate((8,), np.int32)
        buf[:] = 1
        instance.allreduce(buf, buf, 8, ACCLReduceFunctions.SUM)
        np.testing.assert_array_equal(buf, SIZE)
    finally:
        instance.deinit()


def test_a_peer_that_deinits_fails_a_call_waiting_for_it_at_once() -> None:
    instance = accl(SIZE, RANK, sim_mode=True)
    buf = instance.allocate((8,))
    if RANK == 0:
        with pytest.raises(aaccl.ACCLError, match="left the world: its accl was closed"):
            instance.recv(buf, 8, SIZE - 1)  # rank SIZE-1 never sends: it deinits
    instance.deinit()
