"""torch.distributed (gloo, CPU) beside mpi4py, for docs/comparison.md: one allreduce
of 4 bytes and of 16 MiB over 2 processes, both libraries timed in the same processes.

    pip install torch --index-url https://download.pytorch.org/whl/cpu   # beside aaccl[bench]
    python benchmarks/bench_torch.py              # 2 processes, 4 B and 16 MiB, 3 runs
    python benchmarks/bench_torch.py --runs 1 --size-mib 4 --iters 20
    python benchmarks/bench_torch.py --json -     # machine-readable results on stdout

torch is no dependency of aaccl: without it the script says so and exits 0 (skipped).

The script runs itself under `mpiexec -n N ... --mpi-worker` once per run. Each worker
process measures, as benchmarks/bench_mpi.py does for mpi4py and aaccl:

- mpi4py's `Comm.Allreduce` (SUM) of float32 numpy arrays; half of its iterations before
  torch's process group exists and half after it is destroyed, so that gloo's threads
  never run while MPI is timed;
- `torch.distributed.all_reduce` (SUM) of float32 CPU tensors over a gloo process group
  (TCP on 127.0.0.1, the port chosen by rank 0 and shared over MPI).

Every iteration starts after an MPI Barrier; its time is the latest rank's return minus
the earliest rank's entry (time.perf_counter is CLOCK_MONOTONIC, one clock for every
process of the machine). Medians after warm-up iterations; bus bandwidth as nccl-tests
(algorithm bandwidth * 2 (n - 1) / n). With several runs, the table gives each run's
median and their range, and how many CPUs' worth of work other processes did meanwhile.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import sys
import time
from typing import Any

from _common import MiB, OtherLoad, find_mpiexec, fmt_time, median, run_mpiexec

INSTALL = "pip install torch --index-url https://download.pytorch.org/whl/cpu"


def bus_factor(procs: int) -> float:
    return 2 * (procs - 1) / procs


# -- worker (one per MPI process) ---------------------------------------------------------

def timed(comm: Any, step: Any, iters: int, warmup: int) -> list[float]:
    """Barrier-separated iterations of `step`, each from the earliest rank's start to
    the latest rank's end (on rank 0; the others return [])."""
    spans = []
    for i in range(warmup + iters):
        comm.Barrier()
        start = time.perf_counter()
        step()
        end = time.perf_counter()
        ends = comm.gather((start, end), root=0)
        if i >= warmup and ends is not None:
            spans.append(max(e for _, e in ends) - min(s for s, _ in ends))
    return spans


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    counts = {"4 B": 1, f"{args.size_mib} MiB": args.size_mib * MiB // 4}
    mpi: dict[str, list[float]] = {name: [] for name in counts}

    def mpi_half() -> None:
        for name, count in counts.items():
            src = np.full(count, rank + 1, np.float32)
            dst = np.empty_like(src)
            big = count > 1
            mpi[name] += timed(comm, lambda: comm.Allreduce(src, dst, op=MPI.SUM),
                               args.iters // 2 if big else args.small_iters // 2,
                               args.warmup)
            assert dst[0] == size * (size + 1) // 2

    mpi_half()
    port = comm.bcast(free_port() if rank == 0 else None, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    gloo: dict[str, list[float]] = {}
    for name, count in counts.items():
        tensor = torch.full((count,), float(rank + 1), dtype=torch.float32)
        expected = torch.full((count,), float(size * (size + 1) // 2))

        def step() -> None:
            tensor.fill_(rank + 1)  # in place: the next iteration starts from the input
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)

        big = count > 1
        gloo[name] = timed(comm, step, args.iters if big else args.small_iters, args.warmup)
        assert torch.equal(tensor, expected)
    dist.destroy_process_group()
    mpi_half()
    if rank == 0:
        print(json.dumps({
            "procs": size, "torch": torch.__version__,
            "mpi": " ".join(MPI.Get_library_version().split()[:3]),  # "MPICH Version: 5.0.2"
            "bytes": {name: count * 4 for name, count in counts.items()},
            "mpi4py": {name: median(s) for name, s in mpi.items()},
            "gloo": {name: median(s) for name, s in gloo.items()},
            "iterations": {name: len(s) for name, s in gloo.items()},
        }))


# -- driver -------------------------------------------------------------------------------

def run_once(mpiexec: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [mpiexec, "-n", str(args.procs), sys.executable, os.path.abspath(__file__),
           "--mpi-worker", "--size-mib", str(args.size_mib), "--iters", str(args.iters),
           "--small-iters", str(args.small_iters), "--warmup", str(args.warmup)]
    return run_mpiexec(cmd, args.mpi_timeout)


def table(runs: list[dict[str, Any]]) -> None:
    first = runs[0]
    procs = first["procs"]
    print(f"allreduce (SUM, float32) over {procs} processes on one machine "
          f"({os.cpu_count()} CPUs): torch {first['torch']} gloo and mpi4py on {first['mpi']}; "
          f"median per run, {len(runs)} run(s)")
    print(f"{'size':>8}  {'side':>7}  {'medians':<34} {'range':<22} bus bandwidth")
    for name, nbytes in first["bytes"].items():
        for side in ("mpi4py", "gloo"):
            times = [r[side][name] for r in runs]
            busbw = [nbytes / t * bus_factor(procs) / 1e9 for t in times]
            each = ", ".join(fmt_time(t) for t in times)
            span = f"{fmt_time(min(times))} to {fmt_time(max(times))}"
            bw = (f"{min(busbw):.2f} to {max(busbw):.2f} GB/s" if nbytes >= MiB else "")
            print(f"{name:>8}  {side:>7}  {each:<34} {span:<22} {bw}")
        ratios = [r["gloo"][name] / r["mpi4py"][name] for r in runs]
        print(f"{'':>8}  gloo time / mpi4py time: {min(ratios):.1f}x to {max(ratios):.1f}x")
    loads = [r["other_load_cpus"] for r in runs if r.get("other_load_cpus") is not None]
    if loads:  # timings on a shared machine: how busy others kept it
        print(f"other processes' load during the runs: {min(loads):.2f} to {max(loads):.2f} CPUs")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--procs", type=int, default=2, help="processes (default 2)")
    parser.add_argument("--size-mib", type=int, default=16, help="the large size (default 16)")
    parser.add_argument("--iters", type=int, default=40,
                        help="timed iterations at the large size (default 40)")
    parser.add_argument("--small-iters", type=int, default=2000,
                        help="timed iterations at 4 bytes (default 2000)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed iterations (default 5)")
    parser.add_argument("--runs", type=int, default=3, help="runs of the whole (default 3)")
    parser.add_argument("--json", nargs="?", const="-", metavar="PATH",
                        help="write the runs as JSON to PATH (or stdout: -)")
    parser.add_argument("--mpi-timeout", type=float, default=600.0,
                        help="seconds each mpiexec may take")
    parser.add_argument("--mpi-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mpi_worker:
        worker(args)
        return 0
    if importlib.util.find_spec("torch") is None:
        print(f"bench_torch: skipped: torch is not installed here ({INSTALL})")
        return 0
    mpiexec, why = find_mpiexec()
    if mpiexec is None:
        print(f"bench_torch: skipped: {why} (pip install 'aaccl[bench]')")
        return 0
    runs = []
    for i in range(args.runs):
        print(f"run {i + 1} of {args.runs} ...", file=sys.stderr)
        load = OtherLoad()
        result = run_once(mpiexec, args)
        result["other_load_cpus"] = load.cpus()
        if "error" in result:
            print(f"bench_torch: run {i + 1} failed: {result['error']}", file=sys.stderr)
            return 1
        runs.append(result)
    if args.json is not None:
        text = json.dumps(runs, indent=2)
        if args.json == "-":
            print(text)
            return 0
        with open(args.json, "w") as f:
            f.write(text + "\n")
    table(runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
