"""A rank's last messages of a world go out before its farewells (`MPIFabric.close`).

    mpiexec -n 2 python tests/mpi/farewell.py leave

Rank 0's "leave" notice (sent as its world closes) is queued on its engine while
another thread holds the engine, as the progress thread does while it drains; and
that thread's send of it is held up, as a loaded machine's scheduler may hold a
thread up, until one of rank 0's farewells went or HOLD_UP seconds passed. The
notice must still go out, before rank 0's farewells, and no message may follow a
farewell: a peer that has every farewell frees the communicator, and MPI gives the
freed context to its next world, which would receive what came late (most likely
how a 4-process run of bench_mpi.py saw rank 0 "leave" its second world at that
world's second call).
Then both ranks form a second world in the same processes and reduce in it.
"""

from __future__ import annotations

import asyncio
import pickle
import sys
import threading
import time
from typing import Any

import numpy as np
from _harness import FAIL_MARK, OK_MARK, say

import aaccl
from aaccl import ReduceFunction
from aaccl.soft.fabric import _mpi

HOLD_UP = 0.3  # seconds the thread sending the notice is held up at most


class Recorder:
    """Rank 0's communicator, recording what it sends, in order: (peer, tag, kind)."""

    def __init__(self, comm: Any) -> None:
        self._comm = comm
        self.sent: list[tuple[int, int, str]] = []
        self.farewell = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)

    def Isend(self, buf: Any, dst: int, tag: int) -> Any:  # (MPI's name)
        kind = "payload"
        if tag in (_mpi.HEADER, _mpi.ACK, _mpi.WITHDRAW):
            obj = pickle.loads(bytes(buf[0]))  # (an inline payload after it is ignored)
            kind = "farewell" if obj is None else \
                "leave" if tag == _mpi.HEADER and obj[1] == ("leave",) else "message"
        if kind == "leave":  # its thread is held up (after the fabric chose to send it)
            self.farewell.wait(HOLD_UP)
        self.sent.append((dst, tag, kind))
        if kind == "farewell":
            self.farewell.set()
        return self._comm.Isend(buf, dst, tag)


def hold_engine(engine: Any, held: threading.Event) -> None:
    """Hold rank 0's engine until its fabric begins to close, then drain what was
    posted meanwhile (the notice), as a draining thread does (`Engine._drain`)."""
    engine._lock.acquire()
    held.set()
    while not _mpi._closes:  # (the close begins: an event, looked for every ms)
        time.sleep(0.001)
    engine._drain()  # (runs the queue, then lets the engine go)


async def first_world() -> Recorder | None:
    recorder = None
    async with aaccl.open_world() as (accl,):
        src, dst = accl.allocate(4, np.float32), accl.allocate(4, np.float32)
        src[:] = accl.rank + 1
        await accl.allreduce(src, dst, 4, ReduceFunction.SUM)
        assert (dst == 3).all(), dst
        if accl.rank == 0:
            fabric = accl._driver.device.port.fabric
            recorder = fabric.comm = Recorder(fabric.comm)
            held = threading.Event()
            threading.Thread(target=hold_engine, args=(fabric.engine, held), daemon=True).start()
            held.wait()
    return recorder


def check(recorder: Recorder) -> int:
    """The notice went to rank 1 before every farewell, and nothing after any."""
    sent = recorder.sent
    leaves = [i for i, (dst, _, kind) in enumerate(sent) if dst == 1 and kind == "leave"]
    farewells = [i for i, (dst, _, kind) in enumerate(sent) if dst == 1 and kind == "farewell"]
    assert leaves, f"rank 0's leave notice never went: {sent}"
    assert len(farewells) == 3, f"rank 0's farewells: {sent}"
    assert leaves[-1] < farewells[0], f"a leave notice after a farewell: {sent}"
    for i in farewells:
        _, tag, _ = sent[i]
        late = [s for s in sent[i + 1:] if s[0] == 1 and s[1] == tag]
        assert not late, f"sent after the farewell on tag {tag}: {late} (all: {sent})"
    return 1 + len(farewells)


async def second_world() -> int:
    async with aaccl.open_world() as (accl,):
        src, dst = accl.allocate(3, np.float32), accl.allocate(3, np.float32)
        for i in range(20):
            src[:] = accl.rank + i
            await accl.allreduce(src, dst, 3, ReduceFunction.SUM)
            assert (dst == 1 + 2 * i).all(), (i, dst)
        await accl.barrier()
        return 20


def main() -> None:
    suite = sys.argv[1]
    assert suite == "leave", suite
    rank = "?"
    try:
        from mpi4py import MPI

        rank = str(MPI.COMM_WORLD.Get_rank())
        recorder = asyncio.run(first_world())
        checks = check(recorder) if recorder is not None else 1
        checks += asyncio.run(second_world())
    except BaseException:  # noqa: BLE001 - report anything, then fail the process
        import traceback

        say(f"{FAIL_MARK} rank={rank} suite={suite}:\n{traceback.format_exc()}", sys.stderr)
        sys.exit(1)
    say(f"{OK_MARK} suite={suite} rank={rank} size=2 checks={checks}")


if __name__ == "__main__":
    main()
