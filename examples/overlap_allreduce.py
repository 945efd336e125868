"""Hide an allreduce behind compute, as data-parallel training does: while step k
computes its weight gradient, the gradient of step k-1 is allreduced. Both are Calls
(a compute kernel and an allreduce on the device) joined by one ``await`` per step.

Usage::

    python examples/overlap_allreduce.py [--ranks N] [--features F] [--batch B]
                                         [--steps K] [--rounds R]

Every rank (``aaccl.run``: in-process ranks on the soft CCLO) holds a batch of
activations X (B x F) and output gradients dY (B x F) in device memory. The compute
kernel is a dense layer's weight gradient, ``X.T @ dY`` (one BLAS call, 2*B*F*F
flops, which releases the GIL), into one of two F x F gradient buffers; the
allreduce sums the other one over the ranks, on the device (``from_fpga`` /
``to_fpga``). Each rank times K steps of compute alone, of allreduce alone and of
both at once, R times interleaved (the best of each counts), and prints:

- the overlap efficiency, overlapped time / max(compute alone, allreduce alone):
  1.00 is perfect overlap, (compute + allreduce) / max(...) is none;
- how much of the allreduce the overlap hid, (compute + allreduce - overlapped) /
  allreduce.

The final allreduced gradient is checked against numpy.

What limits the overlap here: the soft CCLO's allreduce runs on the host's cores
(copies, sums, and Python handing each step from thread to thread), and every rank's
kernel keeps one core busy. With at least as many ranks as cores, nothing is left for
the allreduce: its steps wait for a core, and the ranks wait for each other, so the
overlapped step is no shorter than the two one after the other (on 2 cores, 2 ranks
hid none of a 0.7 ms allreduce behind 7 ms of compute). With a core to spare it
hides: ``--ranks 1 --features 2048 --batch 128`` hid about 70% of the (one-rank,
16 MiB) allreduce. BLAS gets one thread (``OPENBLAS_NUM_THREADS=1`` unless set): one
core per rank's kernel. On an FPGA the CCLO, not the host, runs the collective.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy loads BLAS

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

import aaccl
from aaccl import ReduceFunction


def weight_gradient(x: np.ndarray, dy: np.ndarray, grad: np.ndarray) -> None:
    """The compute step, grad = X.T @ dY: one BLAS call, so the kernel holds the GIL
    only to start and finish and the CCLO's threads and the event loop run meanwhile
    (many short numpy calls would each have to win the GIL back)."""
    np.matmul(x.T, dy, out=grad)


def inputs(rank: int, batch: int, features: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank `rank`'s activations and output gradients."""
    rng = np.random.default_rng(rank)
    return (rng.standard_normal((batch, features), np.float32),
            rng.standard_normal((batch, features), np.float32))


@dataclass
class Timings:
    """Seconds per step of one rank."""

    compute: float
    allreduce: float
    overlapped: float


async def rank_main(accl: aaccl.ACCL, features: int, batch: int, steps: int,
                    rounds: int) -> Timings:
    x, dy = accl.allocate((batch, features)), accl.allocate((batch, features))
    grads = [accl.allocate((features, features)) for _ in range(2)]
    total = accl.allocate((features, features))
    x[:], dy[:] = inputs(accl.rank, batch, features)
    kernel = accl.kernel(weight_gradient)
    n = features * features

    def compute_step(k: int) -> aaccl.Call:  # step k's gradient
        return kernel(x, dy, grads[k % 2])

    def allreduce_step(k: int) -> aaccl.Call:  # step k-1's gradient, left on the device
        return accl.allreduce(grads[(k - 1) % 2], total, n, ReduceFunction.SUM,
                              from_fpga=True, to_fpga=True)

    def both(k: int) -> aaccl.Call:
        return accl.nop(waitfor=[compute_step(k), allreduce_step(k)])

    async def per_step(step: Callable[[int], aaccl.Call]) -> float:
        await step(1)  # warm-up
        await accl.barrier()
        start = time.perf_counter()
        for k in range(steps):
            await step(k)
        return (time.perf_counter() - start) / steps

    uploads = [accl.sync_to_device(x), accl.sync_to_device(dy)]
    await accl.nop(waitfor=[kernel(x, dy, g, waitfor=uploads) for g in grads])
    best = Timings(float("inf"), float("inf"), float("inf"))
    for _ in range(rounds):  # interleaved, the best of each: other processes add noise
        best.compute = min(best.compute, await per_step(compute_step))
        best.allreduce = min(best.allreduce, await per_step(allreduce_step))
        best.overlapped = min(best.overlapped, await per_step(both))
    await accl.sync_from_device(total)
    expected = sum(a.T @ b for a, b in (inputs(r, batch, features) for r in range(accl.size)))
    if not np.allclose(total, expected, rtol=1e-4, atol=1e-2):
        raise AssertionError(f"rank {accl.rank}: the allreduced gradient is wrong")
    return best


def report(per_rank: list[Timings], ranks: int, features: int, batch: int) -> float:
    """Print the slowest rank's times; return the overlap efficiency."""
    c = max(t.compute for t in per_rank)
    a = max(t.allreduce for t in per_rank)
    o = max(t.overlapped for t in per_rank)
    efficiency = o / max(c, a)
    size = features * features * 4
    print(f"{ranks} ranks on {os.cpu_count()} cores: gradient {features}x{features} float32 "
          f"({size / 2**20:.2f} MiB) from a batch of {batch}; per step:")
    print(f"  compute alone   {c * 1e3:8.2f} ms  ({2 * batch * features**2 / c / 1e9:.0f} GFLOP/s "
          f"per rank)")
    print(f"  allreduce alone {a * 1e3:8.2f} ms")
    print(f"  one after other {(c + a) * 1e3:8.2f} ms  (sum)")
    print(f"  overlapped      {o * 1e3:8.2f} ms")
    print(f"overlap efficiency {efficiency:.2f}  (overlapped / max(compute, allreduce); 1.00 is "
          f"perfect, {(c + a) / max(c, a):.2f} is none)")
    print(f"allreduce hidden   {100 * (c + a - o) / a:.0f} %  (below 0: running both at once "
          f"cost more than it hid)")
    return efficiency


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--features", type=int, default=512,
                        help="F: the gradient is F x F float32 (the allreduce's size)")
    parser.add_argument("--batch", type=int, default=1024,
                        help="B: 2*B*F*F flops per compute step")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of the three loops; the best of each counts")
    args = parser.parse_args(argv)
    if min(args.ranks, args.features, args.batch, args.steps, args.rounds) < 1:
        parser.error("every count is at least 1")

    async def rank(accl: aaccl.ACCL) -> Timings:
        return await rank_main(accl, args.features, args.batch, args.steps, args.rounds)

    per_rank = aaccl.run(rank, world_size=args.ranks)
    report(per_rank, args.ranks, args.features, args.batch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
