"""Faults over the MPI fabric: a rank that dies, ranks that disagree, a rank that quits.

    mpiexec [-disable-auto-cleanup ...] -n N python tests/mpi/faults.py SUITE timeout=1.0

Suites (all but `late` end with a non-zero exit status on purpose):
  kill      the last rank SIGKILLs itself right after submitting a large allreduce, in
            the middle of a sequence of collectives; the survivors' pending collective
            must fail with RECEIVE_TIMEOUT_ERROR within about the timeout.
  mismatch  rank 0 calls bcast while the others call allreduce (of COUNT elements, or
            $AACCL_TEST_COUNT): nobody waits forever.
  quit      rank 1's code raises in the middle of the sequence; the others time out.
  relay     the last rank raises at once; rank 0 waits for a message from it (aborted
            when it leaves), and rank 1 for one from rank 0: rank 0, whose program
            ended with that Aborted, leaves too, so rank 1 fails at once as well.
  exit      the last rank's own code raises SystemExit after a barrier (its world
            closes: it gathers no results); the others return, and must not wait
            for it to gather until the timeout: they fail at once, naming it.
  late      the last rank's own code runs LATE seconds longer than the others' (after
            its last call): leaving waits for it, whatever the timeout, and the job
            succeeds; with $AACCL_TEST_LATE_DIES, its process is SIGKILLed there, and
            the others fail at once.

Every rank whose call fails prints one FAULT_MARK line (which call, after how long,
the error) before the harness reports the failure and exits 1.

Under `mpiexec -disable-auto-cleanup`, MPICH's launcher (hydra) may tell the other
processes of a proxy that one of them left without MPI_Finalize by sending them
SIGUSR1, whose default action kills them silently: these ranks ignore it, and learn
of the death through aaccl's timeout.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np
from _harness import Checks, rank_of_process, run_suite, say

import aaccl
from aaccl import CCLOError, ReduceFunction

signal.signal(signal.SIGUSR1, signal.SIG_IGN)

FAULT_MARK = "aaccl-mpi-fault"
ROUNDS, FAULTY_ROUND = 12, 6
LATE = 5.0  # seconds the last rank's own code takes after its calls (suite `late`)
COUNT = 5000  # past the eager threshold of the default world (4 KiB): multi-step


async def reported(name: str, call: aaccl.Call) -> None:
    """Await `call`; if it fails, print what failed after how long, and re-raise."""
    started = time.monotonic()
    try:
        await call
    except Exception as exc:
        kind = type(exc).__name__
        if isinstance(exc, CCLOError):
            kind += ":" + "|".join(exc.code.names())
        say(f"{FAULT_MARK} rank={rank_of_process()} after={time.monotonic() - started:.2f} "
            f"error={kind} call=[{name}]: {exc}")
        raise


async def sequence(checks: Checks, accl: aaccl.ACCL, fault: str) -> None:
    """Rounds of different collectives, checked against numpy; `fault` strikes in
    round FAULTY_ROUND."""
    size, rank = accl.size, accl.rank
    src, dst = accl.allocate(COUNT, np.float32), accl.allocate(COUNT * size, np.float32)
    for i in range(ROUNDS):
        src[:] = rank + i
        if i == FAULTY_ROUND and fault == "kill" and rank == size - 1:
            accl.allreduce(src, dst, COUNT, ReduceFunction.SUM)  # in flight on the device
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        if i == FAULTY_ROUND and fault == "quit" and rank == 1:
            raise RuntimeError(f"rank {rank}'s own code gave up in round {i}")
        await reported(f"allreduce of round {i}",
                       accl.allreduce(src, dst, COUNT, ReduceFunction.SUM))
        np.testing.assert_array_equal(dst[:COUNT], sum(range(size)) + size * i)
        await reported(f"bcast of round {i}", accl.bcast(src, 100, i % size))
        np.testing.assert_array_equal(src[:100], i % size + i)
        await reported(f"allgather of round {i}", accl.allgather(src, dst, 10))
        await reported(f"barrier of round {i}", accl.barrier())
        checks(3)


async def kill(checks: Checks, accl: aaccl.ACCL) -> None:
    await sequence(checks, accl, "kill")


async def quit_(checks: Checks, accl: aaccl.ACCL) -> None:
    await sequence(checks, accl, "quit")


async def mismatch(checks: Checks, accl: aaccl.ACCL) -> None:
    count = int(os.environ.get("AACCL_TEST_COUNT", COUNT))
    src, dst = accl.allocate(count, np.float32), accl.allocate(count, np.float32)
    await reported("barrier", accl.barrier())  # everyone is here and working
    if accl.rank == 0:
        await reported("bcast", accl.bcast(src, count, 0))
    else:
        await reported("allreduce", accl.allreduce(src, dst, count, ReduceFunction.SUM))
    checks()


async def relay(checks: Checks, accl: aaccl.ACCL) -> None:
    buf = accl.allocate(16, np.float32)
    await reported("barrier", accl.barrier())  # everyone is here and working
    if accl.rank == accl.size - 1:
        raise RuntimeError(f"rank {accl.rank}'s own code gave up")
    await reported("recv", accl.recv(buf, 16, (accl.rank - 1) % (accl.size - 1)
                                     if accl.rank else accl.size - 1))
    checks()


async def exit_(checks: Checks, accl: aaccl.ACCL) -> int:
    await reported("barrier", accl.barrier())  # everyone is here and working
    if accl.rank == accl.size - 1:
        raise SystemExit(3)
    checks()
    return accl.rank


async def late(checks: Checks, accl: aaccl.ACCL) -> int:
    src, dst = accl.allocate(COUNT, np.float32), accl.allocate(COUNT, np.float32)
    src[:] = accl.rank
    await reported("allreduce", accl.allreduce(src, dst, COUNT, ReduceFunction.SUM))
    np.testing.assert_array_equal(dst, sum(range(accl.size)))
    checks()
    if accl.rank == accl.size - 1:
        if os.environ.get("AACCL_TEST_LATE_DIES"):  # ... and its process is killed there
            time.sleep(1)  # noqa: ASYNC251 - its own code, while the others wait to leave
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(LATE)  # noqa: ASYNC251 - its own code, blocking as a computation is
    return accl.rank


def every_rank_returned(name: str, results: list[object]) -> None:
    if name == "late":
        assert results == list(range(len(results))), results


if __name__ == "__main__":
    run_suite({"kill": kill, "quit": quit_, "mismatch": mismatch, "late": late,
               "relay": relay, "exit": exit_},
              every_rank_returned)
