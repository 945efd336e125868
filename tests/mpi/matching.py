"""Matching stays flat over the MPI fabric, one rank per process.

    mpiexec -n N python tests/mpi/matching.py ring [nbufs=.. bufsize=..]

Suites:
  ring   N >= 2: tests/test_memory.py's send/recv ring (two communicators, messages of
         64 B and 16 KiB), with tags and TAG_ANY on either side, then by tag alone;
         every rank's RSS grows by under 8 MiB after warm-up (the receiver kept every
         payload before), and its matching queues hold no matched message.
"""

from __future__ import annotations

import aaccl
from _harness import Checks, run_suite
from test_memory import MiB, queues_bounded, ring_rank, rss, two_comms

ROUNDS, WINDOW, WARMUP, LARGE = 300, 10, 40, 4096


async def ring(checks: Checks, accl: aaccl.ACCL) -> None:
    comms = two_comms([accl], accl.size)[accl.rank]
    await ring_rank(accl, accl.size, comms, WARMUP, WINDOW, WARMUP, [], LARGE)
    began = rss()
    for mixed in (True, False):
        await ring_rank(accl, accl.size, comms, ROUNDS, WINDOW, ROUNDS, [], LARGE, mixed)
    grew = rss() - began
    assert grew < 8 * MiB, f"rank {accl.rank}'s RSS grew by {grew / MiB:.1f} MiB"
    queues_bounded([accl])
    checks(2 * ROUNDS)


if __name__ == "__main__":
    run_suite({"ring": ring})
