"""Kernel streams over the MPI fabric, one rank per process.

    mpiexec -n N python tests/mpi/streams.py streams [backend=..]

Suite `streams` (N >= 2), around the ring of ranks: a send with RES_STREAM into the
next rank's kernel stream (one-sided, over MPI), drained into memory there; a plain
send received into the stream through an attached kernel that doubles it; a send
whose data comes from the stream; a reduce from every rank's stream into the root's.
The references are tests/test_streams.py's.
"""

from __future__ import annotations

import numpy as np
from _harness import Checks, run_suite
from test_streams import BOTH, N, OP0, RES, SUM, drain, filled, load, values

import aaccl


def same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    np.testing.assert_array_equal(got, want, err_msg=what)


async def streams(checks: Checks, accl: aaccl.ACCL) -> None:
    me, size = accl.rank, accl.size
    nxt, prv = (me + 1) % size, (me - 1) % size
    await accl.send(filled(accl, values(me)), N, nxt, tag=9, stream_flags=RES)
    same(await drain(accl, N), values(prv), "a put from the previous rank")
    checks()

    accl.attach_stream(lambda chunk, tag: chunk * 2)
    sent = accl.send(filled(accl, values(me)), N, nxt, tag=3)
    await accl.recv(accl.allocate(1), N, prv, tag=3, stream_flags=RES)
    await sent
    same(await drain(accl, N), values(prv) * 2, "received into the stream, doubled")
    accl.attach_stream(None)
    checks()

    await load(accl, values(me, 300))
    sent = accl.send(accl.allocate(1), 300, nxt, tag=4, stream_flags=OP0)
    dst = accl.allocate(300)
    await accl.recv(dst, 300, prv, tag=4)
    await sent
    same(np.array(dst), values(prv, 300), "sent from the stream")
    checks()

    await load(accl, values(me, 100, np.float64))
    dtype_of = accl.allocate(1, np.float64)
    await accl.reduce(dtype_of, dtype_of if me == 0 else None, 100, 0, SUM, stream_flags=BOTH)
    if me == 0:
        want = sum(values(r, 100, np.float64) for r in range(size))
        same(await drain(accl, 100, np.float64), want, "reduced from the streams")
        checks()


if __name__ == "__main__":
    run_suite({"streams": streams})
