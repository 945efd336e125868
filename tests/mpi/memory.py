"""The MPI fabric's memory over time: what a receiver holds for point-to-point messages.

    AACCL_TEST_COUNT=.. AACCL_TEST_KIB=.. AACCL_TEST_BOUND=.. \
        mpiexec -n N python tests/mpi/memory.py SUITE [timeout=..]

Suites:
  unreceived  N == 2: rank 0 posts `count` sends of `kib` KiB (past the eager
              threshold) before rank 1 posts any receive; rank 1 measures its RSS once
              every header is there, then receives them all, in order, exactly. Its
              peak RSS may exceed its RSS before by no more than `bound` MiB: the
              payloads wait in the sender's memory (rendezvous), not the receiver's.
  ring        N >= 2: `count` messages of `kib` KiB around the ring (each rank sends to
              the next and receives from the one before); every rank's RSS after the
              last message exceeds its RSS after the first tenth by no more than `bound`
              MiB: nothing of a received message outlives its receive.
  withdraw    N == 2: rank 0's rendezvous sends time out (its timeout is short) while
              rank 1 receives them late, some just as the timeout fires: for each
              message both sides agree whether it was delivered (the send succeeded
              exactly when the receive got its data).

`count`, `kib` and `bound` (MiB) come from the environment (AACCL_TEST_COUNT, ...).
Each rank prints its measurements (MEASURE_MARK lines) for the pytest side to show.
"""

from __future__ import annotations

import os
from typing import Any

import anyio
import numpy as np
from _harness import OPTIONS, Checks, rank_of_process, run_suite, say

import aaccl
from aaccl import CCLOError, ErrorCode

MEASURE_MARK = "aaccl-mpi-measure"
SENDER, RECEIVER = 0, 1
GO = 77


def option(name: str) -> int:
    return int(os.environ[f"AACCL_TEST_{name.upper()}"])


def rss_mib(field: str = "VmRSS") -> float:
    """This process's resident set (or, with "VmHWM", its peak), in MiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def measure(what: str, **values: Any) -> None:
    words = " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in values.items())
    say(f"{MEASURE_MARK} rank={rank_of_process()} {what} {words}")


def expected(i: int, count: int) -> np.ndarray:
    """Message i: a window of a ramp, distinct for every i."""
    return np.arange(i, i + count, dtype=np.float32)


async def unreceived(checks: Checks, accl: aaccl.ACCL) -> None:
    n, kib, bound = option("count"), option("kib"), option("bound")
    count = kib * 256
    if accl.rank == SENDER:
        srcs = [accl.allocate(count, np.float32) for _ in range(n)]  # calls on one buffer
        sends = []  # would run one after another
        for i, src in enumerate(srcs):
            src[:] = expected(i, count)
            sends.append(accl.send(src, count, RECEIVER, tag=1))
        go = accl.allocate(1, np.float32)
        await accl.send(go, 1, RECEIVER, tag=GO)  # after every header, in MPI's order
        for send in sends:
            await send
            checks()
    elif accl.rank == RECEIVER:
        dst, go = accl.allocate(count, np.float32), accl.allocate(1, np.float32)
        before = rss_mib()
        await accl.recv(go, 1, SENDER, tag=GO)  # every header has come
        waiting = rss_mib()
        for i in range(n):
            await accl.recv(dst, count, SENDER, tag=1)
            if not np.array_equal(dst, expected(i, count)):
                raise AssertionError(f"message {i} arrived wrong: {np.asarray(dst[:4])}...")
            checks()
        peak = rss_mib("VmHWM")
        measure("unreceived", messages=n, kib=kib, before=before, waiting=waiting, peak=peak)
        if peak - before > bound:
            raise AssertionError(f"{n} unreceived {kib} KiB sends took the receiver from "
                                 f"{before:.0f} MiB to {peak:.0f} MiB at its peak")
    await accl.barrier()


async def ring(checks: Checks, accl: aaccl.ACCL) -> None:
    n, kib, bound = option("count"), option("kib"), option("bound")
    count = kib * 256
    right, left = (accl.rank + 1) % accl.size, (accl.rank - 1) % accl.size
    src, dst = accl.allocate(count, np.float32), accl.allocate(count, np.float32)
    settled = 0.0
    for i in range(n):
        src[:2] = (accl.rank, i)
        send = accl.send(src, count, right, tag=i % 5)
        await accl.recv(dst, count, left, tag=i % 5)
        await send
        if dst[0] != left or dst[1] != i:
            raise AssertionError(f"message {i} from rank {left} arrived as {dst[:2]}")
        checks()
        if i == n // 10:
            settled = rss_mib()
    end = rss_mib()
    measure("ring", messages=n, kib=kib, settled=settled, end=end)
    fabric = accl._driver.device.port.fabric  # white box: its records per message
    records = {name: len(getattr(fabric, name)) for name in (
        "_incoming", "_waiting", "_held", "_fetches", "_asked", "_eager", "_arriving")}
    if sum(records.values()) > 4:  # the last messages' acknowledgements may be on their way
        raise AssertionError(f"the fabric keeps records of {n} messages: {records}")
    if end - settled > bound:
        raise AssertionError(f"{n} messages of {kib} KiB took rank {accl.rank} from "
                             f"{settled:.0f} MiB to {end:.0f} MiB")


async def wait_for_go(accl: aaccl.ACCL, one: aaccl.Buffer) -> None:
    """Rank 1's GO, which may come after a timeout or two (its receive failed)."""
    for attempt in range(4):
        try:
            await accl.recv(one, 1, RECEIVER, tag=GO)
            return
        except CCLOError as failed:
            if not failed.code & ErrorCode.RECEIVE_TIMEOUT_ERROR or attempt == 3:
                raise


async def withdraw(checks: Checks, accl: aaccl.ACCL) -> list[bool]:
    """Rank 0's sends fail at their timeout unless rank 1 took them: rank 1 posts
    message i's receive 0.5 to 1.5 timeouts after telling rank 0 to send it, so some
    land as the send's deadline passes."""
    n, count, timeout = option("count"), 8192, OPTIONS["timeout"]  # more than the rx buffers
    one = accl.allocate(1, np.float32)
    outcomes = []
    for i in range(n):
        if accl.rank == SENDER:
            await wait_for_go(accl, one)  # rank 1 is about to wait
            src = accl.allocate(count, np.float32)
            src[:] = expected(i, count)
            try:
                await accl.send(src, count, RECEIVER, tag=i)
                outcomes.append(True)
            except CCLOError as failed:
                if not failed.code & ErrorCode.DEQUEUE_BUFFER_TIMEOUT_ERROR:
                    raise
                outcomes.append(False)
        elif accl.rank == RECEIVER:
            dst = accl.allocate(count, np.float32)
            await accl.send(one, 1, SENDER, tag=GO)  # eager: done at once
            await anyio.sleep(timeout * (0.5 + i / max(1, n - 1)))
            try:
                await accl.recv(dst, count, SENDER, tag=i)
                outcomes.append(True)
            except CCLOError as failed:
                if not failed.code & ErrorCode.RECEIVE_TIMEOUT_ERROR:
                    raise
                outcomes.append(False)
            if outcomes[-1] and not np.array_equal(dst, expected(i, count)):
                raise AssertionError(f"message {i} arrived wrong")
        checks()
    if accl.rank == RECEIVER:  # both finish together (rank 0 may be a timeout ahead)
        await accl.send(one, 1, SENDER, tag=GO)
    elif accl.rank == SENDER:
        await wait_for_go(accl, one)
    return outcomes


def verify(name: str, results: list[Any]) -> None:
    if name == "withdraw":
        sent, received = results[SENDER], results[RECEIVER]
        differ = [i for i, (a, b) in enumerate(zip(sent, received)) if a != b]
        if differ:
            raise AssertionError(f"messages {differ}: the send and its receive disagree "
                                 f"(sent {sent}, received {received})")
        measure("withdraw", delivered=sum(sent), failed=len(sent) - sum(sent))


if __name__ == "__main__":
    run_suite({"unreceived": unreceived, "ring": ring, "withdraw": withdraw}, verify)
