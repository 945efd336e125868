"""A pyaccl-style program, one rank per process, as pyaccl's users run theirs:

    mpiexec -n N python tests/mpi/compat_prog.py SUITE

Each process makes `accl(N, its MPI rank, sim_mode=True)` with pyaccl's constructor,
as written for pyaccl (only the import changed), and checks its results against
numpy. Suites:
  ok          send/recv around a ring, allreduce, bcast, allgather, reduce_scatter, a
              split communicator; then deinit and a second world in the same processes.
  worlds      40 worlds one after another, each a ring send/recv and an immediate
              deinit: nothing of one world reaches the next (a leave notice still in
              flight used to, failing a receive there with "rank N left the world").
  mismatches  constructors that cannot form a world, each failing on every process
              at once with a clear error: local_rank not the process's rank, nranks not
              the job's size, one process's bad argument; then a world that works.
  leave       rank 0's program ends without deinit (its instance is deinit at exit):
              the others' receives from it fail at once instead of at the timeout.
  absent      the last process exits without making its instance: the others'
              constructors fail after FORM_TIMEOUT (2 s here), saying why.

Each process prints `compat-ok rank=R size=N checks=K` when every check passed, and
`compat-error rank=R case=C error=TYPE: MESSAGE` for each constructor that failed as
it should, so the pytest side (tests/test_compat_mpi.py) asserts on output alone.
"""

from __future__ import annotations

import sys
import time
import traceback

import numpy as np
from mpi4py import MPI

import aaccl
from aaccl.compat import ACCLReduceFunctions, _worlds, accl

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()


def say(text: str) -> None:
    sys.stdout.write(text + "\n")  # one write: mpiexec keeps the line whole
    sys.stdout.flush()


def inputs(r: int, count: int) -> np.ndarray:
    return (np.arange(count) * (r + 1) + 7 * r).astype(np.float32)


def ok() -> int:
    checks = 0
    for world in range(2):  # the second world forms in the same processes
        cclo = accl(size, rank, sim_mode=True, bufsize=256)
        count = 1000 + world  # a few rx buffers each: segmented, and past the eager size
        src, dst = cclo.allocate((count,)), cclo.allocate((count,))
        src[:] = inputs(rank, count)
        nxt, prv = (rank + 1) % size, (rank - 1) % size
        if rank % 2 == 0:
            cclo.send(src, count, nxt, tag=5)
            cclo.recv(dst, count, prv, tag=5)
        else:
            cclo.recv(dst, count, prv, tag=5)
            cclo.send(src, count, nxt, tag=5)
        np.testing.assert_array_equal(dst, inputs(prv, count))
        cclo.allreduce(src, dst, count, ACCLReduceFunctions.SUM)
        np.testing.assert_array_equal(dst, np.sum([inputs(r, count) for r in range(size)],
                                                  axis=0, dtype=np.float32))
        root = size - 1
        bc = cclo.allocate((count,))
        bc[:] = src if rank == root else 0
        cclo.bcast(bc, count, root)
        np.testing.assert_array_equal(bc, inputs(root, count))
        every = cclo.allocate((count * size,))
        cclo.allgather(src, every, count)
        np.testing.assert_array_equal(every, np.concatenate([inputs(r, count)
                                                             for r in range(size)]))
        part = cclo.allocate((count // size,))
        cclo.reduce_scatter(every, part, count // size, ACCLReduceFunctions.MAX)
        n = count // size
        np.testing.assert_array_equal(part, every[rank * n:(rank + 1) * n])
        checks += 5
        members = list(range(1, size))  # a communicator without rank 0
        if rank in members:
            cclo.split_communicator(members)
            small = cclo.allocate((16,))
            small[:] = rank
            cclo.allreduce(small, small, 16, ACCLReduceFunctions.SUM, comm_id=1)
            np.testing.assert_array_equal(small, sum(members))
            checks += 1
        cclo.barrier()
        cclo.deinit()
    return checks


def worlds() -> int:
    for world in range(40):
        cclo = accl(size, rank, sim_mode=True)
        src, dst = cclo.allocate((64,)), cclo.allocate((64,))
        src[:] = inputs(rank + world, 64)
        handle = cclo.recv(dst, 64, (rank - 1) % size, run_async=True)
        cclo.send(src, 64, (rank + 1) % size)
        handle.wait()
        np.testing.assert_array_equal(dst, inputs((rank - 1) % size + world, 64))
        cclo.deinit()
    return 40


def mismatches() -> int:
    """Worlds that cannot form fail at once on every process; then one forms."""
    cases = {
        "local_rank": dict(nranks=size, local_rank=(rank + 1) % size),
        "nranks": dict(nranks=size + 1, local_rank=rank),
        "bufsize": dict(nranks=size, local_rank=rank, bufsize=7 if rank == 1 else 1024),
        "nbufs": dict(nranks=size, local_rank=rank, nbufs=0 if rank == size - 1 else 16),
    }
    for case, kwargs in cases.items():
        started = time.monotonic()
        try:
            accl(sim_mode=True, **kwargs)
        except (TypeError, ValueError) as error:
            message = " ".join(str(error).split())
            say(f"compat-error rank={rank} case={case} seconds={time.monotonic() - started:.2f} "
                f"error={type(error).__name__}: {message}")
        else:
            raise AssertionError(f"accl({kwargs}) formed a world")
    cclo = accl(size, rank, sim_mode=True)
    buf = cclo.allocate((64,), np.int32)
    buf[:] = rank + 1
    cclo.allreduce(buf, buf, 64, ACCLReduceFunctions.SUM)
    np.testing.assert_array_equal(buf, size * (size + 1) // 2)
    cclo.deinit()
    return len(cases) + 1


def leave() -> int:
    cclo = accl(size, rank, sim_mode=True)
    buf = cclo.allocate((8,))
    buf[:] = rank
    cclo.allreduce(buf, buf, 8, ACCLReduceFunctions.SUM)
    np.testing.assert_array_equal(buf, size * (size - 1) // 2)
    if rank == 0:
        return 1  # no deinit: the interpreter's exit does it
    started = time.monotonic()
    try:
        cclo.recv(buf, 8, 0)  # rank 0 never sends
    except aaccl.Aborted as error:
        say(f"compat-error rank={rank} case=leave seconds={time.monotonic() - started:.2f} "
            f"error={type(error).__name__}: {error}")
        cclo.deinit()
        return 2
    raise AssertionError("a receive from a rank that left succeeded")


def absent() -> int:
    if rank == size - 1:  # this program's last process never makes its instance
        return 0
    _worlds.FORM_TIMEOUT = 2.0  # instead of a minute
    started = time.monotonic()
    try:
        accl(size, rank, sim_mode=True)
    except aaccl.ACCLError as error:
        say(f"compat-error rank={rank} case=absent seconds={time.monotonic() - started:.2f} "
            f"error={type(error).__name__}: {error}")
        return 1
    raise AssertionError("a world formed without its last process")


if __name__ == "__main__":
    suite = sys.argv[1]
    try:
        checks = {"ok": ok, "worlds": worlds, "mismatches": mismatches,
                  "leave": leave, "absent": absent}[suite]()
    except BaseException:
        say(f"compat-FAIL rank={rank}:\n{traceback.format_exc()}")
        sys.exit(1)
    say(f"compat-ok rank={rank} size={size} checks={checks}")
