"""What pyaccl's blocking API costs on aaccl: `aaccl.compat` against the async API and
MPICH, side by side in one run.

    python benchmarks/bench_compat.py           # about 20 s
    python benchmarks/bench_compat.py --quick   # a CI smoke test

Measured as bench_inprocess.py measures the async API, which this script runs too:
(a) the round trip of a blocking `nop()` on rank 0 against `await accl.nop()`;
(b) a 4-byte allreduce over 4 ranks, each rank a thread calling the blocking
    `allreduce`, against 4 asyncio tasks and against 4 MPICH processes;
(c) a 1 MiB allreduce on device-resident buffers, the same three ways.
A compat iteration starts when the threads leave a barrier and ends when the last
rank's call returned.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import threading
import time
from typing import Any


import bench_inprocess as async_bench
from _common import MiB, add_run_options, fmt_time, report, spread

RANKS = async_bench.RANKS
TARGET = "compat time / async time <= 1.25 (a cost 'little more than the async ones')"


def run_compat(count: int, iters: int, small_iters: int, nop_iters: int) -> dict[str, Any]:
    from aaccl.compat import ACCLReduceFunctions, accl

    ranks = [accl(RANKS, i, sim_mode=True) for i in range(RANKS)]
    try:
        bufs = [(a.allocate((count,)), a.allocate((count,))) for a in ranks]
        for i, (src, dst) in enumerate(bufs):
            src[:] = i + 1
            src.sync_to_device()
            dst.sync_to_device()

        def allreduce(n: int, times: int) -> list[float]:
            barrier = threading.Barrier(RANKS)
            spans = [[(0.0, 0.0)] * times for _ in range(RANKS)]

            def rank(i: int) -> None:
                src, dst = bufs[i]
                for k in range(times):
                    barrier.wait()
                    start = time.perf_counter()
                    ranks[i].allreduce(src, dst, n, ACCLReduceFunctions.SUM, from_fpga=True,
                                       to_fpga=True)
                    spans[i][k] = (start, time.perf_counter())

            threads = [threading.Thread(target=rank, args=(i,)) for i in range(RANKS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return [max(s[k][1] for s in spans) - min(s[k][0] for s in spans)
                    for k in range(times)]

        allreduce(count, 2)
        large = allreduce(count, iters)
        allreduce(1, max(10, small_iters // 10))
        small = allreduce(1, small_iters)
        dst = bufs[0][1]
        dst.sync_from_device()
        assert dst[0] == RANKS * (RANKS + 1) / 2, dst[:4]
        a = ranks[0]
        for _ in range(max(10, nop_iters // 10)):
            a.nop()
        nops = []
        for _ in range(nop_iters):
            start = time.perf_counter()
            a.nop()
            nops.append(time.perf_counter() - start)
        return {"nop_s": spread(nops), "allreduce_small_s": spread(small),
                "allreduce_large_s": spread(large)}
    finally:
        for a in ranks:
            a.deinit()
        gc.collect()


def print_table(results: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    compat, asyn, mpi = results["compat"], results["async"], results["mpi"]

    def med(block: dict[str, Any], key: str) -> float | None:
        return block[key]["median"] if key in block else None

    print(f"{'':34} {'compat':>10} {'async':>10} {'MPICH':>10} {'compat/async':>13}")
    labels = {"nop_s": "(a) nop round trip, rank 0",
              "allreduce_small_s": f"(b) 4 B allreduce, {RANKS} ranks",
              "allreduce_large_s": f"(c) {results['config']['size_mib']:g} MiB allreduce"}
    for key, label in labels.items():
        c, a, m = med(compat, key), med(asyn, key), med(mpi, key)
        ratio = f"{c / a:.2f}x" if c and a else "n/a"
        print(f"{label:34} {fmt_time(c):>10} {fmt_time(a):>10} {fmt_time(m):>10} {ratio:>13}")
    if "error" in mpi:
        print(f"MPI: n/a ({mpi['error']})")
    print(f"target: {TARGET}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=float, default=1.0, help="size of (c) in MiB")
    parser.add_argument("--no-mpi", action="store_true", help="skip the MPICH comparison")
    add_run_options(parser)
    args = parser.parse_args()
    count = args.count or max(1, int(args.size_mib * MiB) // 4)
    iters, small_iters, nop_iters = (5, 100, 500) if args.quick else (20, 1000, 5000)
    log = sys.stderr if args.json == "-" else sys.stdout
    print("aaccl.compat, 4 ranks on threads...", file=log, flush=True)
    compat = run_compat(count, iters, small_iters, nop_iters)
    print("aaccl async API, 4 ranks as tasks...", file=log, flush=True)
    asyn = async_bench.run_aaccl(count, iters, 2, small_iters, nop_iters)
    print("mpi4py over MPICH, 4 processes...", file=log, flush=True)
    mpi = async_bench.run_mpi(args, count, iters, 2, small_iters)  # bench_inprocess's worker
    config = {"size_mib": count * 4 / MiB, "count": count, "iters": iters,
              "small_iters": small_iters, "nop_iters": nop_iters, "cpus": os.cpu_count()}
    ratios = {key: compat[key]["median"] / asyn[key]["median"]
              for key in ("nop_s", "allreduce_small_s", "allreduce_large_s")}
    results = {"config": config, "compat": compat, "async": asyn, "mpi": mpi,
               "compat_over_async": ratios, "target": TARGET}
    report(results, [], args.json, print_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
