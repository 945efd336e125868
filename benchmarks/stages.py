"""Where a small allreduce's time goes, rank by rank, with no event loop in between.

    python benchmarks/stages.py                      # 4 ranks, 20,000 rounds
    python benchmarks/stages.py --lean DIR           # beside the lean prototype in DIR

One task makes the four in-process ranks' 1-element float32 allreduce calls one
after another, timing each synchronous call (the first three wait in their
meeting; the last folds and ends all four), then awaits the four calls. The gated
figure of `bench_inprocess.py` (c) adds the event loop's turns to this; here the
calls' own cost shows, call by call. A diagnostic beside the side-by-side
benchmarks, not a target: docs/benchmarks.md quotes it.

The round is timed twice: as one span, and as the sum of its parts' medians; the two
must agree within 25 %, or the script says so.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np

import aaccl
from aaccl import ReduceFunction

RANKS = 4
_ns = time.perf_counter_ns


async def rounds(calls: Sequence[Callable[[], Any]], n: int) -> list[float]:
    """Medians (us) of each rank's call, of the awaits, and of the whole round."""
    parts: list[list[int]] = [[] for _ in range(RANKS + 2)]
    for _ in range(n):
        begin = last = _ns()
        made = []
        for rank, call in enumerate(calls):
            made.append(call())
            now = _ns()
            parts[rank].append(now - last)
            last = now
        for call in made:
            await call
        end = _ns()
        parts[RANKS].append(end - last)
        parts[RANKS + 1].append(end - begin)
    return [statistics.median(p) / 1000 for p in parts]


async def aaccl_calls(n: int) -> list[float]:
    async with aaccl.open_world(RANKS) as accls:
        pairs = [(a.allocate(1, np.float32), a.allocate(1, np.float32)) for a in accls]
        for a, (src, _) in zip(accls, pairs):
            src[:] = a.rank + 1
            src.sync_to_device()
        calls = [partial(a.allreduce, s, d, 1, ReduceFunction.SUM, from_fpga=True,
                         to_fpga=True) for a, (s, d) in zip(accls, pairs)]
        await rounds(calls, max(100, n // 10))  # warm-up
        result = await rounds(calls, n)
        for _, dst in pairs:  # the timed calls did their work
            dst.sync_from_device()
            assert dst[0] == RANKS * (RANKS + 1) // 2
    return result


async def lean_calls(path: str, n: int) -> list[float]:
    sys.path.insert(0, path)
    import lean  # type: ignore[import-not-found]  # the prototype, outside this repository

    world = lean.World(RANKS)
    srcs = [np.full(1, r + 1, np.float32) for r in range(RANKS)]
    dsts = [np.zeros(1, np.float32) for _ in range(RANKS)]
    calls = [partial(world.ranks[r].allreduce, srcs[r], dsts[r], 1, lean.SUM)
             for r in range(RANKS)]
    await rounds(calls, max(100, n // 10))
    return await rounds(calls, n)


def show(name: str, medians: list[float]) -> None:
    *ranks, awaits, whole = medians
    cells = " ".join(f"{m:7.2f}" for m in (*ranks, awaits, whole))
    print(f"{name:8s} {cells}")
    parts = sum(ranks) + awaits
    if abs(parts - whole) > 0.25 * whole:
        print(f"warning: {name}'s parts add up to {parts:.2f} us, its round takes {whole:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20_000)
    parser.add_argument("--lean", metavar="DIR", help="the lean prototype's directory")
    args = parser.parse_args()
    print(f"us per call, medians of {args.rounds:,} rounds of a 4-byte allreduce on "
          f"{RANKS} in-process ranks (rank {RANKS - 1} is the last to come)")
    print(f"{'':8s} " + " ".join(f"{h:>7s}" for h in
                                  [f"rank {r}" for r in range(RANKS)] + ["awaits", "round"]))
    show("aaccl", asyncio.run(aaccl_calls(args.rounds)))
    if args.lean:
        show("lean", asyncio.run(lean_calls(args.lean, args.rounds)))


if __name__ == "__main__":
    main()
