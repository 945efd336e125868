"""aaccl's in-process targets (benchmarks/README.md), measured side by side in one run.

    python benchmarks/bench_inprocess.py            # full run: 64 MiB, the sweeps, 30 s-1 min
    python benchmarks/bench_inprocess.py --quick    # small sizes, a CI smoke test
    python benchmarks/bench_inprocess.py --json -   # machine-readable results on stdout
    python benchmarks/bench_inprocess.py --plot sweep.png   # and draw the N sweep

What it measures (see benchmarks/README.md for the details):

(a) allreduce of `--size-mib` MiB of float32 over 4 in-process ranks on device-resident
    buffers (from_fpga=True, to_fpga=True), against mpi4py's Comm.Allreduce over 4 MPICH
    processes and against one numpy pass doing the same sums and copies;
(b) the round trip of `await accl.nop()`;
(c) a 4-byte allreduce (count=1 float32) over 4 in-process ranks, against MPICH's,
    and its floor: the same 4 tasks meeting with nothing of aaccl (BareMeeting);
(d) the N sweep: allreduce of 4 B and 1 KiB over N = 2..64 in-process ranks, timed as
    (c), against N log N, and MPICH's Allreduce over 2 and 4 processes;
(e) K = 1,000 and 10,000 outstanding send/recv pairs between 2 ranks: time per pair,
    against O(K).

One aaccl iteration of (a) is the wall time from just before the first rank submits its
call to the moment the event loop has seen every rank's call complete (all four calls
are awaited together): it covers the whole collective on every rank. In (c) each rank
is a task of its own, as in a program; the ranks pass a gate together before each
iteration (outside the timing), and an iteration lasts from the earliest rank's call
to the latest rank's return from its await, as MPI's does. One MPI iteration
starts after a Barrier and lasts from the earliest rank's entry into Allreduce to the
latest rank's return from it (time.perf_counter is CLOCK_MONOTONIC, one clock for
every process of the machine). Medians are reported, after warm-up iterations, and
each is checked against a second timing of the same iterations (the whole loop's wall
time / iterations): a disagreement of more than 25 % prints a warning.

MPI is optional: without `mpiexec` or mpi4py, its columns read n/a. The script runs
itself under `mpiexec -n 4 ... --mpi-worker` for the MPI side; rank 0 prints JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import subprocess
import sys
import time
from typing import Any

import numpy as np

import _scaling as scaling
from _common import (MiB, add_run_options, busy_cpus, find_mpiexec, fmt_time, mpi_env, report,
                     run_mpiexec, spread, verdict)

RANKS = 4
TARGET_SIZE_MIB = 64

TARGETS = {
    "allreduce_large_vs_mpi": "MPICH time / aaccl time >= 2.5",
    "allreduce_large_vs_numpy": "aaccl time / numpy time <= 1.5",
    "nop_round_trip": "median <= 3 us",
    "allreduce_small_vs_mpi": "aaccl time / MPICH time <= 1.0",
    "allreduce_scaling_4B": "4 B allreduce over N in-process ranks: for every N above 4, "
                            "t(N)/t(4) <= (N log2 N)/(4 log2 4)",
    "allreduce_scaling_1KiB": "the same at 1 KiB",
    "outstanding_calls": "time per send/recv pair with 10,000 outstanding <= 1.5x that with "
                         "1,000",
}


# -- aaccl ----------------------------------------------------------------------------


async def _aaccl_bench(count: int, iters: int, warmup: int, small_iters: int,
                       nop_iters: int) -> dict[str, Any]:
    import aaccl
    from aaccl import ReduceFunction

    out: dict[str, Any] = {}
    async with aaccl.open_world(RANKS) as accls:
        # (a) large allreduce on device-resident buffers
        pairs = [(a.allocate((count,), np.float32), a.allocate((count,), np.float32))
                 for a in accls]
        for a, (src, dst) in zip(accls, pairs):
            src[:] = a.rank + 1
            src.sync_to_device()
            dst.sync_to_device()  # fault the device pages in before timing

        async def allreduce(n: int) -> float:
            start = time.perf_counter()
            await asyncio.gather(*(a.allreduce(s, d, n, ReduceFunction.SUM, from_fpga=True,
                                               to_fpga=True) for a, (s, d) in zip(accls, pairs)))
            return time.perf_counter() - start

        for _ in range(warmup):
            await allreduce(count)
        loop = asyncio.get_running_loop()
        loop_start = loop.time()
        large = [await allreduce(count) for _ in range(iters)]
        out["allreduce_large_back_to_back_s"] = (loop.time() - loop_start) / iters
        expected = RANKS * (RANKS + 1) / 2
        for _, dst in pairs:  # outside the timing: the result really is on every device
            dst[:] = 0
            dst.sync_from_device()
            if not (dst[0] == expected and dst[-1] == expected and dst[count // 2] == expected):
                raise AssertionError(f"aaccl allreduce gave {dst[[0, count // 2, -1]]}, "
                                     f"expected {expected}")
        out["allreduce_large_s"] = spread(large)

        # (c) 4-byte allreduce, same buffers, count=1, each rank a task of its own
        await scaling.allreduce_spans(accls, pairs, 1, max(10, small_iters // 10))
        out["allreduce_small_s"] = spread(await scaling.allreduce_spans(accls, pairs, 1,
                                                                        small_iters))
        start = time.perf_counter()  # second timing: back to back, no gate
        await scaling.allreduce_spans(accls, pairs, 1, small_iters, gated=False)
        out["allreduce_small_back_to_back_s"] = (time.perf_counter() - start) / small_iters
        pairs.clear()

        # (c)'s floor: the same 4 tasks, timed the same, meeting with nothing of aaccl
        bare = scaling.BareMeeting(RANKS, 1).calls()
        await scaling.spans(bare, max(10, small_iters // 10))
        out["allreduce_small_floor_s"] = spread(await scaling.spans(bare, small_iters))
        start = time.perf_counter()
        await scaling.spans(bare, small_iters, gated=False)
        out["allreduce_small_floor_back_to_back_s"] = (time.perf_counter() - start) / small_iters

        # (b) nop round trip on rank 0 (the other ranks are idle)
        accl = accls[0]
        for _ in range(max(10, nop_iters // 10)):
            await accl.nop()
        nops = []
        loop_start = loop.time()
        for _ in range(nop_iters):
            start = time.perf_counter()
            await accl.nop()
            nops.append(time.perf_counter() - start)
        out["nop_back_to_back_s"] = (loop.time() - loop_start) / nop_iters  # second timing
        out["nop_s"] = spread(nops)
    return out


def run_aaccl(count: int, iters: int, warmup: int, small_iters: int,
              nop_iters: int) -> dict[str, Any]:
    try:
        return asyncio.run(_aaccl_bench(count, iters, warmup, small_iters, nop_iters))
    finally:
        gc.collect()


# -- numpy ------------------------------------------------------------------------------


def run_numpy(count: int, iters: int, warmup: int) -> dict[str, Any]:
    """One thread, one pass: dst0 = s0 + s1 + s2 + s3, then dst0 copied to dst1..3."""
    srcs = [np.full(count, r + 1, np.float32) for r in range(RANKS)]
    dsts = [np.ones(count, np.float32) for _ in range(RANKS)]  # pages faulted in

    def one_pass() -> float:
        start = time.perf_counter()
        np.add(srcs[0], srcs[1], out=dsts[0])
        for src in srcs[2:]:
            np.add(dsts[0], src, out=dsts[0])
        for dst in dsts[1:]:
            np.copyto(dst, dsts[0])
        return time.perf_counter() - start

    for _ in range(warmup):
        one_pass()
    times = [one_pass() for _ in range(iters)]
    srcs.clear()
    dsts.clear()
    gc.collect()
    return {"allreduce_large_s": spread(times)}


# -- MPI ----------------------------------------------------------------------------------


def mpi_worker(count: int, iters: int, warmup: int, small_iters: int) -> None:
    """Runs in each of the mpiexec processes; rank 0 prints one line of JSON."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()

    def timed(src: np.ndarray, dst: np.ndarray, n: int, keep: bool) -> list[float]:
        spans = []
        for _ in range(n):
            comm.Barrier()
            start = time.perf_counter()
            comm.Allreduce(src, dst, op=MPI.SUM)
            end = time.perf_counter()
            if keep:
                ends = comm.gather((start, end), root=0)  # outside the timed span
                if rank == 0:
                    spans.append(max(e for _, e in ends) - min(s for s, _ in ends))
        return spans

    src = np.full(count, rank + 1, np.float32)
    dst = np.ones(count, np.float32)
    timed(src, dst, warmup, False)
    large = timed(src, dst, iters, True)
    expected = comm.Get_size() * (comm.Get_size() + 1) / 2
    ok = bool(dst[0] == expected and dst[-1] == expected)
    del src, dst
    s1 = np.full(1, rank + 1, np.float32)
    d1 = np.zeros(1, np.float32)
    timed(s1, d1, max(10, small_iters // 10), False)
    small = timed(s1, d1, small_iters, True)
    comm.Barrier()
    start = time.perf_counter()  # informational: back to back, as OSU's osu_allreduce does
    for _ in range(small_iters):
        comm.Allreduce(s1, d1, op=MPI.SUM)
    elapsed = comm.reduce(time.perf_counter() - start, op=MPI.MAX, root=0)
    if rank == 0:
        print(json.dumps({
            "size": comm.Get_size(), "library": MPI.Get_library_version().splitlines()[0],
            "correct": ok and bool(d1[0] == expected),
            "allreduce_large_s": spread(large), "allreduce_small_s": spread(small),
            "allreduce_small_back_to_back_s": elapsed / small_iters}), flush=True)


def run_mpi(args: argparse.Namespace, count: int, iters: int, warmup: int,
            small_iters: int) -> dict[str, Any]:
    """Launch this script under mpiexec; {"error": why} if MPI is not available."""
    mpiexec, why = find_mpiexec(args.no_mpi)
    if mpiexec is None:
        return {"error": why}
    cmd = [mpiexec, "-n", str(RANKS), sys.executable, os.path.abspath(__file__),
           "--mpi-worker", "--count", str(count), "--iters", str(iters), "--warmup",
           str(warmup), "--small-iters", str(small_iters)]
    result = run_mpiexec(cmd, args.mpi_timeout)
    if "error" in result:
        return result
    result["command"] = " ".join(cmd)
    result["env"] = mpi_env()
    return result


# -- report --------------------------------------------------------------------------------


def evaluate(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per target; (a) binds only at the size the target names (64 MiB)."""
    aac, mpi, npy = results["aaccl"], results["mpi"], results["numpy"]
    binding_size = results["config"]["size_mib"] == TARGET_SIZE_MIB
    mpi_ok = "error" not in mpi

    def med(block: dict[str, Any], key: str) -> float | None:
        return block[key]["median"] if key in block else None

    a_large, m_large = med(aac, "allreduce_large_s"), med(mpi, "allreduce_large_s")
    n_large = med(npy, "allreduce_large_s")
    a_small, m_small = med(aac, "allreduce_small_s"), med(mpi, "allreduce_small_s")
    nop = med(aac, "nop_s")
    rows = []
    ratio = m_large / a_large if mpi_ok and a_large and m_large else None
    rows.append({"target": "allreduce_large_vs_mpi", "ratio_name": "MPICH/aaccl",
                 "ratio": ratio, "limit": ">= 2.5x",
                 "pass": None if ratio is None else ratio >= 2.5})
    ratio = a_large / n_large if a_large and n_large else None
    rows.append({"target": "allreduce_large_vs_numpy", "ratio_name": "aaccl/numpy",
                 "ratio": ratio, "limit": "<= 1.5x",
                 "pass": None if ratio is None else ratio <= 1.5})
    rows.append({"target": "nop_round_trip", "ratio_name": "", "ratio": None,
                 "limit": "<= 3 us", "pass": None if nop is None else nop <= 3e-6})
    ratio = a_small / m_small if mpi_ok and a_small and m_small else None
    rows.append({"target": "allreduce_small_vs_mpi", "ratio_name": "aaccl/MPICH",
                 "ratio": ratio, "limit": "<= 1.0x",
                 "pass": None if ratio is None else ratio <= 1.0})
    for row in rows:
        row["binding"] = binding_size or not row["target"].startswith("allreduce_large")
    sweep = results.get("sweep")
    if sweep:
        rows += scaling.scaling_verdicts(sweep["points"], sweep["counts"])
    if results.get("outstanding"):
        rows.append(scaling.outstanding_verdict(results["outstanding"]))
    return rows


def timing_checks(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every reported median against a second timing of the same iterations."""
    aac, mpi = results["aaccl"], results["mpi"]
    checks = []

    def med(block: dict[str, Any], key: str) -> float | None:
        return block[key]["median"] if isinstance(block.get(key), dict) else None

    def mean(block: dict[str, Any], key: str) -> float | None:
        return block[key].get("mean") if isinstance(block.get(key), dict) else None

    loop_wall = "loop's wall time / iterations"
    checks.append(scaling.timing_check("(a) aaccl allreduce, large", med(aac, "allreduce_large_s"),
                                       aac.get("allreduce_large_back_to_back_s"), loop_wall,
                                       mean(aac, "allreduce_large_s")))
    checks.append(scaling.timing_check("(b) aaccl nop round trip", med(aac, "nop_s"),
                                       aac.get("nop_back_to_back_s"), loop_wall,
                                       mean(aac, "nop_s")))
    checks.append(scaling.timing_check("(c) aaccl allreduce 4 B, 4 ranks",
                                       med(aac, "allreduce_small_s"),
                                       aac.get("allreduce_small_back_to_back_s"),
                                       "a back-to-back run"))
    checks.append(scaling.timing_check("(c) floor, 4 bare asyncio tasks",
                                       med(aac, "allreduce_small_floor_s"),
                                       aac.get("allreduce_small_floor_back_to_back_s"),
                                       "a back-to-back run"))
    checks.append(scaling.timing_check("(c) MPICH allreduce 4 B, 4 processes",
                                       med(mpi, "allreduce_small_s"),
                                       mpi.get("allreduce_small_back_to_back_s"),
                                       "back to back, no barrier"))
    sweep = results.get("sweep") or {}
    for side, points, second in (
            ("aaccl", sweep.get("points", []), "a back-to-back run"),
            ("MPICH", sweep.get("mpi", {}).get("points", []),
             "back to back, no barrier")):
        for p in points:
            checks.append(scaling.timing_check(
                f"(d) {side} allreduce {scaling.size_name(p['bytes'])}, N={p['ranks']}",
                p.get("median"), p.get("back_to_back_s"), second,
                p.get("mean") if side == "aaccl" else None))
    return [c for c in checks if c is not None]


def print_table(results: dict[str, Any], verdicts: list[dict[str, Any]]) -> None:
    aac, mpi, npy, cfg = results["aaccl"], results["mpi"], results["numpy"], results["config"]

    def med(block: dict[str, Any], key: str) -> float | None:
        return block[key]["median"] if key in block else None

    size = f"{cfg['size_mib']:g} MiB"
    head = f"{'measurement (median)':<36}{'aaccl':>11}{'MPICH':>11}{'numpy':>11}   " \
           f"{'ratio':<20}{'target':<10}result"
    print(head)
    print("-" * len(head))
    v = {row["target"]: row for row in verdicts}

    def ratio(row: dict[str, Any]) -> str:
        if not row["ratio_name"]:
            return ""
        return "n/a" if row["ratio"] is None else f"{row['ratio_name']} {row['ratio']:.2f}x"

    def line(label: str, a: float | None, m: float | None, n: float | None,
             row: dict[str, Any] | None) -> None:
        tail = "" if row is None else f"{ratio(row):<20}{row['limit']:<10}" \
            f"{verdict(row['pass'])}{'' if row['binding'] else ' (info)'}"
        cells = ["" if not label else fmt_time(t) for t in (a, m, n)]
        print(f"{label:<36}{cells[0]:>11}{cells[1]:>11}{cells[2]:>11}   {tail}".rstrip())

    a_l, m_l, n_l = med(aac, "allreduce_large_s"), med(mpi, "allreduce_large_s"), \
        med(npy, "allreduce_large_s")
    line(f"(a) allreduce {size} f32, 4 ranks", a_l, m_l, n_l, v["allreduce_large_vs_mpi"])
    line("", None, None, None, v["allreduce_large_vs_numpy"])
    nbytes = cfg["count"] * 4
    bw = [None if t is None else f"{nbytes / t / 1e9:.2f}" for t in (a_l, m_l, n_l)]
    print(f"{'    algorithm bandwidth (GB/s)':<36}{bw[0] or 'n/a':>11}{bw[1] or 'n/a':>11}"
          f"{bw[2] or 'n/a':>11}")
    line("(b) await accl.nop() round trip", med(aac, "nop_s"), None, None, v["nop_round_trip"])
    line("(c) allreduce 4 B, 4 ranks", med(aac, "allreduce_small_s"),
         med(mpi, "allreduce_small_s"), None, v["allreduce_small_vs_mpi"])
    line("    back to back, per iteration (info)", aac.get("allreduce_small_back_to_back_s"),
         mpi.get("allreduce_small_back_to_back_s"), None, None)
    floor, m_s, nop = med(aac, "allreduce_small_floor_s"), med(mpi, "allreduce_small_s"), \
        med(aac, "nop_s")
    line("    floor: 4 bare asyncio tasks (info)", floor, None, None, None)
    print()
    if floor and m_s and nop:
        print(f"(c) leaves each rank's allreduce (MPICH - floor) / {RANKS} = "
              f"{fmt_time((m_s - floor) / RANKS)} of its own; a nop, the least call there "
              f"is, takes {fmt_time(nop)}")
    if not all(row["binding"] for row in verdicts):
        print(f"(a)'s targets are set at {TARGET_SIZE_MIB} MiB: at {cfg['size_mib']:g} MiB "
              "their verdicts are for information only")
    print(f"iterations: large {cfg['iters']} (+{cfg['warmup']} warm-up), small "
          f"{cfg['small_iters']}, nop {cfg['nop_iters']}; machine: {cfg['cpus']} CPUs, "
          f"Python {cfg['python']}, numpy {cfg['numpy']}")
    busy = cfg["busy_cpus_at_start"]
    if busy is not None and busy > 0.3:
        print(f"warning: other processes kept {busy:.1f} CPUs busy when the run started: "
              "the timings are noisy")
    if "error" in mpi:
        print(f"MPI: n/a ({mpi['error']})")
    else:
        env = " ".join(f"{k}={val}" for k, val in mpi["env"].items()) or "none"
        library = " ".join(mpi["library"].split())
        print(f"MPI: {library}; {mpi['size']} processes, MPI env vars: {env}; "
              f"results {'correct' if mpi['correct'] else 'WRONG'}")
    source = cfg.get("aaccl_source")
    if source:
        print(f"aaccl: {source['path']}, {cfg.get('label') or 'commit unknown'}")
    scaling.print_scaling(results, verdicts)
    print()
    scaling.print_timing_checks(results.get("timing_checks", []))


def source_of_aaccl() -> dict[str, Any]:
    """Where the aaccl this run imports lives and, if it is a git checkout, the last
    commit that changed aaccl/ ("+dirty" when aaccl/ has uncommitted changes)."""
    import importlib.util

    spec = importlib.util.find_spec("aaccl")
    path = os.path.dirname(spec.origin) if spec and spec.origin else None
    info: dict[str, Any] = {"path": path, "commit": None}
    if path is None:
        return info
    try:
        def git(*argv: str) -> str:
            return subprocess.run(["git", "-C", path, *argv], capture_output=True, text=True,
                                  timeout=10, check=True).stdout.strip()
        commit = git("log", "-1", "--format=%h", "--", ".")
        dirty = bool(git("status", "--porcelain", "--", "."))
        info["commit"] = commit + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=float, default=None,
                        help="allreduce size for (a), MiB of float32 (default 64, --quick: 4)")
    parser.add_argument("--iters", type=int, default=None,
                        help="timed iterations of (a) (default 10, --quick: 3)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations of (a)")
    parser.add_argument("--small-iters", type=int, default=None,
                        help="timed iterations of (c) (default 1000, --quick: 100)")
    parser.add_argument("--nop-iters", type=int, default=None,
                        help="timed iterations of (b) (default 5000, --quick: 500)")
    parser.add_argument("--no-mpi", action="store_true", help="skip the MPICH comparison")
    sweep = parser.add_argument_group("(d) the N sweep and (e) outstanding calls")
    sweep.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True,
                       help="run (d), allreduce over N in-process ranks (default: yes)")
    sweep.add_argument("--sweep-ranks", type=int_list, default=None, metavar="N,N,...",
                       help="the Ns of (d) (default 2,4,8,16,32,64; --quick: 2,4,8,16)")
    sweep.add_argument("--sweep-counts", type=int_list, default=list(scaling.SWEEP_COUNTS),
                       metavar="C,C,...",
                       help="float32 elements per allreduce in (d) (default 1,256: 4 B, 1 KiB)")
    sweep.add_argument("--sweep-iters", type=int, default=None,
                       help="most timed iterations per point of (d) (default 300, --quick: 30)")
    sweep.add_argument("--sweep-budget", type=float, default=None, metavar="SECONDS",
                       help="seconds of timed iterations per point of (d) and per K of (e); "
                            f"every point gets at least {scaling.MIN_ITERS} (default 3, "
                            "--quick: 0.5)")
    sweep.add_argument("--sweep-mpi-ranks", type=int_list, default=None, metavar="N,N,...",
                       help="MPICH process counts for (d) (default 2,4; --quick: 2); "
                            "needs MPI, skipped with --no-mpi")
    sweep.add_argument("--outstanding", type=int_list, default=None, metavar="K,K,...",
                       help="outstanding send/recv pairs of (e) (default 1000,10000; "
                            "--quick: 100,1000)")
    sweep.add_argument("--no-outstanding", action="store_true", help="skip (e)")
    sweep.add_argument("--outstanding-reps", type=int, default=3,
                       help="runs of each K of (e), fewer once the budget is spent (default 3)")
    sweep.add_argument("--outstanding-timeout", type=float, default=None, metavar="SECONDS",
                       help="the world's timeout and the await's bound in (e) (default 30, "
                            "--quick: 10); a K that exceeds it is FAILED")
    output = parser.add_argument_group("plot and labels")
    output.add_argument("--plot", metavar="PNG", help="draw (d): latency vs N, log-log")
    output.add_argument("--plot-with", action="append", default=[], metavar="JSON",
                        help="also draw the sweep of an earlier --json file (repeatable)")
    output.add_argument("--from-json", metavar="JSON",
                        help="measure nothing: print (and --plot) an earlier --json file")
    output.add_argument("--label", help="name of this run in the JSON and the plot's legend "
                                        "(default: aaccl's git commit)")
    parser.add_argument("--sweep-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--outstanding-worker", action="store_true", help=argparse.SUPPRESS)
    add_run_options(parser)
    args = parser.parse_args()

    quick = args.quick
    size_mib = args.size_mib if args.size_mib is not None else (4 if quick else 64)
    count = args.count or max(1, int(size_mib * MiB) // 4)
    iters = args.iters or (3 if quick else 10)
    small_iters = args.small_iters or (100 if quick else 1000)
    nop_iters = args.nop_iters or (500 if quick else 5000)
    warmup = max(1, args.warmup)
    sweep_ranks = args.sweep_ranks or ([2, 4, 8, 16] if quick else list(scaling.SWEEP_RANKS))
    if min(sweep_ranks) < 2:
        parser.error("--sweep-ranks: every N must be at least 2 (N log2 N is 0 at N=1)")
    sweep_iters = max(1, args.sweep_iters or (30 if quick else 300))
    budget = args.sweep_budget if args.sweep_budget is not None else (0.5 if quick else 3.0)
    mpi_ranks = args.sweep_mpi_ranks or ([2] if quick else list(scaling.SWEEP_MPI_RANKS))
    ks = args.outstanding or ([100, 1000] if quick else list(scaling.OUTSTANDING_KS))
    out_timeout = args.outstanding_timeout or (10.0 if quick else 30.0)
    script = os.path.abspath(__file__)

    if args.mpi_worker and args.sweep_worker:
        scaling.mpi_sweep_worker(args.sweep_counts, sweep_iters, budget)
        return 0
    if args.mpi_worker:
        mpi_worker(count, iters, warmup, small_iters)
        return 0
    if args.outstanding_worker:
        scaling.outstanding_worker(count, max(1, args.outstanding_reps), budget, out_timeout)
        return 0

    if args.from_json:
        with open(args.from_json) as f:
            results = json.load(f)
        if args.label:
            results["config"]["label"] = args.label
        verdicts = evaluate(results)
        results["timing_checks"] = timing_checks(results)
        print_table(results, verdicts)
        missed = any(row["pass"] is False and row["binding"] for row in verdicts)
    else:
        source = source_of_aaccl()
        config = {"size_mib": count * 4 / MiB, "count": count, "iters": iters, "warmup": warmup,
                  "small_iters": small_iters, "nop_iters": nop_iters, "ranks": RANKS,
                  "cpus": os.cpu_count(), "python": platform.python_version(),
                  "numpy": np.__version__, "quick": quick,
                  "label": args.label or source["commit"], "aaccl_source": source,
                  "busy_cpus_at_start": busy_cpus()}
        log = sys.stderr if args.json == "-" else sys.stdout
        print(f"numpy pass ({config['size_mib']:g} MiB)...", file=log, flush=True)
        npy = run_numpy(count, iters, warmup)
        print("aaccl, 4 in-process ranks...", file=log, flush=True)
        aac = run_aaccl(count, iters, warmup, small_iters, nop_iters)
        print("mpi4py over MPICH, 4 processes...", file=log, flush=True)
        mpi = run_mpi(args, count, iters, warmup, small_iters)
        results = {"config": config, "aaccl": aac, "mpi": mpi, "numpy": npy,
                   "targets": TARGETS}
        if args.sweep:
            print(f"(d) allreduce over N = {sweep_ranks} in-process ranks...", file=log,
                  flush=True)
            points = scaling.run_sweep(sweep_ranks, args.sweep_counts, sweep_iters, budget, log)
            results["sweep"] = {"ranks": sweep_ranks, "counts": args.sweep_counts,
                                "iters": sweep_iters, "budget_s": budget, "points": points}
            mpiexec, why = find_mpiexec(args.no_mpi)
            if mpiexec is None:
                results["sweep"]["mpi"] = {"error": why}
            elif mpi_ranks:
                print(f"(d) MPICH Allreduce over N = {mpi_ranks} processes...", file=log,
                      flush=True)
                results["sweep"]["mpi"] = scaling.run_mpi_sweep(
                    mpiexec, script, mpi_ranks, args.sweep_counts, sweep_iters, budget,
                    args.mpi_timeout, log)
        if not args.no_outstanding and ks:
            print(f"(e) K = {ks} outstanding send/recv pairs, 2 ranks...", file=log, flush=True)
            results["outstanding"] = scaling.run_outstanding(
                script, ks, max(1, args.outstanding_reps), budget, out_timeout, log)
        verdicts = evaluate(results)
        results["verdicts"] = verdicts
        results["timing_checks"] = timing_checks(results)
        report(results, verdicts, args.json, print_table)
        missed = any(row["pass"] is False and row["binding"] for row in verdicts)
    if args.plot:
        runs = [(results["config"].get("label") or "", results)]
        for path in args.plot_with:
            with open(path) as f:
                earlier = json.load(f)
            runs.append((earlier["config"].get("label") or os.path.basename(path), earlier))
        scaling.plot_sweep(runs, args.plot)
        print(f"plot: {args.plot}", file=sys.stderr if args.json == "-" else sys.stdout)
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
