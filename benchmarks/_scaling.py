"""How cost grows with the work (a performance target of aaccl; benchmarks/README.md): allreduce latency
over N in-process ranks against N log N, MPICH's at the same N where it is
affordable, and K outstanding send/recv pairs against O(K). bench_inprocess.py runs
these; this module measures, judges, prints and draws them.

Every number here is checked against a second way of timing the same thing
(`timing_check`): a median of per-iteration times that disagrees by more than
TIMING_TOLERANCE with the whole loop's wall time / iterations is reported as a
warning, never silently.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import IO, Any

import numpy as np

SWEEP_RANKS = (2, 4, 8, 16, 32, 64)
SWEEP_COUNTS = (1, 256)
"""float32 elements: 4 bytes and 1 KiB."""
SWEEP_MPI_RANKS = (2, 4)
"""MPICH process counts measured by default: more than the 2 CPUs oversubscribe."""
MIN_ITERS = 5
"""Timed iterations every point gets, however long they take."""
REFERENCE_RANKS = 4
"""The N that t(N) is compared from: the other targets are at 4 ranks, and
from N=2 (2 log2 2 = 2) the N log N limit would be 4x laxer."""
BINDING_RANKS = 64
"""The verdict binds (--check) once the sweep reaches this N."""
TIMING_TOLERANCE = 0.25
"""Two timings of one thing that differ by more than this (max/min - 1) warn."""
OUTSTANDING_KS = (1000, 10000)
OUTSTANDING_LIMIT = 1.5
"""Per-pair time at the largest K / at the smallest K for cost O(K): 1 with no noise."""
OUTSTANDING_TAG = 5


def summarize(samples: Sequence[float]) -> dict[str, float]:
    """Median, mean, 10th and 90th percentiles, min, max and count of `samples`."""
    ordered = sorted(samples)
    if len(ordered) >= 2:
        deciles = statistics.quantiles(ordered, n=10, method="inclusive")
        p10, p90 = deciles[0], deciles[-1]
    else:
        p10 = p90 = ordered[0]
    return {"median": statistics.median(ordered), "mean": statistics.fmean(ordered),
            "p10": p10, "p90": p90,
            "min": ordered[0], "max": ordered[-1], "n": len(ordered)}


def nlogn(n: int) -> float:
    return n * math.log2(n)


def size_name(nbytes: int) -> str:
    return f"{nbytes // 1024} KiB" if nbytes >= 1024 and nbytes % 1024 == 0 else f"{nbytes} B"


def timing_check(what: str, median: float | None, second: float | None, second_name: str,
                 mean: float | None = None) -> dict[str, Any] | None:
    """Compare a median of per-iteration times with a second timing of the same
    iterations (None when either is missing). With `mean`, the mean of the same
    per-iteration times, when the second timing is the wall time of the very loop
    that took them: `covered` (mean / second) says how much of the loop's time the
    per-iteration timer saw, so a disagreement reads as a heavy tail (covered ~1)
    or as time the timer misses (covered < 1)."""
    if not median or not second:
        return None
    ratio = second / median
    return {"what": what, "median_s": median, "second_s": second, "second": second_name,
            "ratio": ratio, "covered": None if mean is None else mean / second,
            "ok": max(ratio, 1 / ratio) <= 1 + TIMING_TOLERANCE}


# -- allreduce over N in-process ranks ------------------------------------------------------


class Gate:
    """Lets `parties` tasks through together, again and again (asyncio.Barrier is
    3.11+): the ranks' start line for each timed iteration."""

    def __init__(self, parties: int) -> None:
        self.parties, self.arrived = parties, 0
        self.open: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def wait(self) -> None:
        self.arrived += 1
        if self.arrived < self.parties:
            await self.open
            return
        opened, self.arrived = self.open, 0
        self.open = asyncio.get_running_loop().create_future()
        opened.set_result(None)


async def spans(calls: Sequence[Callable[[], Awaitable[Any]]], iters: int,
                gated: bool = True) -> list[float]:
    """`iters` rounds of `calls[r]()` awaited by rank r, each rank a task of its own
    looping over them, as in a program. Gated, the ranks pass a gate together
    before each round (outside the timing, as MPI's ranks meet at a Barrier) and a
    round's span runs from the earliest rank's call to the latest rank's return from
    its await; ungated they run back to back (the second timing)."""
    size = len(calls)
    starts = [[0.0] * iters for _ in range(size)]
    ends = [[0.0] * iters for _ in range(size)]
    gate = Gate(size)

    async def rank(r: int) -> None:
        call, begin, end = calls[r], starts[r], ends[r]
        for i in range(iters):
            if gated:
                await gate.wait()
            begin[i] = time.perf_counter()
            await call()
            end[i] = time.perf_counter()

    await asyncio.gather(*(rank(r) for r in range(size)))
    return [max(e[i] for e in ends) - min(b[i] for b in starts) for i in range(iters)]


async def allreduce_spans(accls: Sequence[Any], pairs: Sequence[tuple[Any, Any]], count: int,
                          iters: int, gated: bool = True) -> list[float]:
    """`iters` allreduces of `count` float32 on device-resident buffers, timed by
    `spans`."""
    from aaccl import ReduceFunction

    def call(a: Any, s: Any, d: Any) -> Callable[[], Awaitable[Any]]:
        return lambda: a.allreduce(s, d, count, ReduceFunction.SUM, from_fpga=True,
                                   to_fpga=True)

    return await spans([call(a, s, d) for a, (s, d) in zip(accls, pairs)], iters, gated)


class BareMeeting:
    """An allreduce of in-process ranks with nothing of aaccl: each rank suspends on
    a future; the last to arrive sums the contributions in rank order (numpy), writes
    every rank's result and wakes the others. What one event loop costs any
    in-process allreduce at least: (c)'s floor."""

    def __init__(self, size: int, count: int) -> None:
        self.srcs = [np.full(count, r + 1, np.float32) for r in range(size)]
        self.dsts = [np.zeros(count, np.float32) for _ in range(size)]
        self.waiting: list[asyncio.Future[None]] = []

    async def allreduce(self, rank: int) -> None:
        arrived = asyncio.get_running_loop().create_future()
        self.waiting.append(arrived)
        if len(self.waiting) == len(self.srcs):
            total = self.srcs[0].copy()
            for src in self.srcs[1:]:
                np.add(total, src, out=total)
            for dst in self.dsts:
                dst[...] = total
            waiting, self.waiting = self.waiting, []
            for future in waiting:
                future.set_result(None)
        await arrived

    def calls(self) -> list[Callable[[], Awaitable[None]]]:
        return [functools.partial(self.allreduce, r) for r in range(len(self.srcs))]


async def _sweep_point(accls: list[Any], count: int, iters: int,
                       budget: float) -> dict[str, Any]:
    """Allreduce `count` float32 over every rank of `accls`, device-resident buffers,
    timed as (c) is. Warm-up, then timed iterations (in batches) until `iters` of them
    or `budget` seconds (but at least MIN_ITERS); then the result is checked on every
    rank's device memory."""
    size = len(accls)
    pairs = [(a.allocate((count,), np.float32), a.allocate((count,), np.float32))
             for a in accls]
    for a, (src, dst) in zip(accls, pairs):
        src[:] = a.rank + 1
        src.sync_to_device()
        dst.sync_to_device()

    began, warmup = time.perf_counter(), 0
    while warmup < 2 or (warmup < max(2, iters // 10)
                         and time.perf_counter() - began < budget / 10):
        await allreduce_spans(accls, pairs, count, 1)
        warmup += 1

    spans: list[float] = []
    start = time.perf_counter()
    batch = max(1, min(10, iters))
    while len(spans) < iters and (len(spans) < MIN_ITERS
                                  or time.perf_counter() - start < budget):
        spans += await allreduce_spans(accls, pairs, count, min(batch, iters - len(spans)))
    began = time.perf_counter()  # the second timing: as many, back to back, no gate
    await allreduce_spans(accls, pairs, count, len(spans), gated=False)
    back_to_back = (time.perf_counter() - began) / len(spans)

    expected = size * (size + 1) / 2
    correct = True
    for _, dst in pairs:  # outside the timing: the sum really is on every device
        dst[:] = 0
        dst.sync_from_device()
        correct = correct and bool(np.all(dst == expected))
    return {"ranks": size, "count": count, "bytes": 4 * count, **summarize(spans),
            "warmup": warmup, "stopped_by": "iterations" if len(spans) >= iters else "budget",
            "back_to_back_s": back_to_back, "correct": correct}


async def _sweep(ranks: Sequence[int], counts: Sequence[int], iters: int, budget: float,
                 log: IO[str]) -> list[dict[str, Any]]:
    import aaccl

    points: list[dict[str, Any]] = []
    for n in ranks:
        done: set[int] = set()
        try:
            async with aaccl.open_world(n) as accls:
                for count in counts:
                    point = await _sweep_point(accls, count, iters, budget)
                    points.append(point)
                    done.add(count)
                    print(f"  N={n:<3} {size_name(4 * count):>6}: median "
                          f"{point['median'] * 1e3:.3f} ms over {point['n']} iterations",
                          file=log, flush=True)
        except Exception as exc:  # a failing point is a result: report it, go on
            error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            print(f"  N={n}: FAILED: {error}", file=log, flush=True)
            points += [{"ranks": n, "count": c, "bytes": 4 * c, "error": error}
                       for c in counts if c not in done]
        gc.collect()
    return points


def run_sweep(ranks: Sequence[int], counts: Sequence[int], iters: int, budget: float,
              log: IO[str]) -> list[dict[str, Any]]:
    try:
        return asyncio.run(_sweep(ranks, counts, iters, budget, log))
    finally:
        gc.collect()


def mpi_sweep_worker(counts: Sequence[int], iters: int, budget: float) -> None:
    """In each mpiexec process: Allreduce of each count as bench_inprocess's (c) times
    it (Barrier, then from the earliest rank's entry to the latest rank's return),
    until `iters` iterations or `budget` seconds (at least MIN_ITERS), then as many
    back to back (no barrier) for the second timing. Rank 0 prints one JSON line."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    points = []
    for count in counts:
        src = np.full(count, rank + 1, np.float32)
        dst = np.zeros(count, np.float32)
        for _ in range(max(2, iters // 10)):
            comm.Barrier()
            comm.Allreduce(src, dst, op=MPI.SUM)
        spans: list[float] = []
        began = time.perf_counter()
        while True:
            comm.Barrier()
            start = time.perf_counter()
            comm.Allreduce(src, dst, op=MPI.SUM)
            end = time.perf_counter()
            ends = comm.gather((start, end), root=0)  # outside the timed span
            more = None
            if rank == 0:
                spans.append(max(e for _, e in ends) - min(s for s, _ in ends))
                more = len(spans) < iters and (len(spans) < MIN_ITERS
                                               or time.perf_counter() - began < budget)
            if not comm.bcast(more, root=0):
                break
        n = comm.bcast(len(spans), root=0)
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(n):
            comm.Allreduce(src, dst, op=MPI.SUM)
        elapsed = comm.reduce(time.perf_counter() - start, op=MPI.MAX, root=0)
        correct = comm.reduce(bool(np.all(dst == size * (size + 1) / 2)), op=MPI.LAND, root=0)
        if rank == 0:
            points.append({"ranks": size, "count": count, "bytes": 4 * count,
                           **summarize(spans), "back_to_back_s": elapsed / n,
                           "correct": bool(correct)})
    if rank == 0:
        print(json.dumps({"points": points}), flush=True)


def run_mpi_sweep(mpiexec: str, script: str, ranks: Sequence[int], counts: Sequence[int],
                  iters: int, budget: float, timeout: float, log: IO[str]) -> dict[str, Any]:
    """MPICH's Allreduce at each process count of `ranks`, by `script --mpi-worker
    --sweep-worker` under mpiexec; a failing count is reported, not raised."""
    from _common import mpi_env, run_mpiexec

    points: list[dict[str, Any]] = []
    for n in ranks:
        cmd = [mpiexec, "-n", str(n), sys.executable, script, "--mpi-worker", "--sweep-worker",
               "--sweep-counts", ",".join(map(str, counts)), "--sweep-iters", str(iters),
               "--sweep-budget", str(budget)]
        result = run_mpiexec(cmd, timeout)
        if "error" in result:
            print(f"  MPICH N={n}: FAILED: {result['error']}", file=log, flush=True)
            points += [{"ranks": n, "count": c, "bytes": 4 * c, "error": result["error"]}
                       for c in counts]
            continue
        for point in result["points"]:
            print(f"  MPICH N={n:<3} {size_name(point['bytes']):>6}: median "
                  f"{point['median'] * 1e3:.3f} ms over {point['n']} iterations",
                  file=log, flush=True)
        points += result["points"]
    return {"points": points, "env": mpi_env()}


def scaling_verdicts(points: Sequence[dict[str, Any]], counts: Sequence[int]
                     ) -> list[dict[str, Any]]:
    """One verdict per message size on "allreduce latency over N in-process ranks grows
    no faster than N log N": for every measured N above the reference N (4, or the
    smallest measured), t(N) / t(ref) <= (N log2 N) / (ref log2 ref). A point that
    failed fails the verdict. The headline ratio is at the largest N; a least-squares
    exponent (t ~ N^k over all N) is given for information."""
    verdicts = []
    for count in counts:
        mine = sorted((p for p in points if p["count"] == count), key=lambda p: p["ranks"])
        ok = [p for p in mine if "median" in p]
        failed = [p["ranks"] for p in mine if "error" in p]
        ns = [p["ranks"] for p in ok]
        ref = REFERENCE_RANKS if REFERENCE_RANKS in ns else (ns[0] if ns else None)
        t = {p["ranks"]: p["median"] for p in ok}
        rows = [] if ref is None else [
            {"ranks": n, "ratio": t[n] / t[ref], "limit": nlogn(n) / nlogn(ref),
             "pass": t[n] / t[ref] <= nlogn(n) / nlogn(ref)} for n in ns if n > ref]
        exponent = None
        if len(ns) >= 2:
            xs, ys = [math.log(n) for n in ns], [math.log(t[n]) for n in ns]
            mx, my = statistics.fmean(xs), statistics.fmean(ys)
            exponent = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / \
                sum((x - mx) ** 2 for x in xs)
        top = rows[-1] if rows else None
        passed = None if top is None and not failed else \
            not failed and all(r["pass"] for r in rows)
        largest = max([p["ranks"] for p in mine], default=0)
        verdicts.append({
            "target": f"allreduce_scaling_{size_name(4 * count).replace(' ', '')}",
            "count": count, "bytes": 4 * count, "reference_ranks": ref,
            "largest_ranks": None if top is None else top["ranks"],
            "ratio_name": f"t({top['ranks']})/t({ref})" if top else "",
            "ratio": None if top is None else top["ratio"],
            "limit": "n/a" if top is None else f"<= {top['limit']:.1f}x",
            "pass": passed, "per_ranks": rows, "failed_ranks": failed,
            "exponent": exponent, "binding": largest >= BINDING_RANKS})
    return verdicts


# -- many outstanding calls ------------------------------------------------------------------


async def _outstanding(k: int, reps: int, budget: float, timeout: float) -> dict[str, Any]:
    """K sends of one float32 from rank 0 to rank 1, then K receives on rank 1, all
    submitted before any is awaited, then awaited together: repeated `reps` times
    (fewer once `budget` seconds are spent), each in a new 2-rank world whose calls
    time out after `timeout` seconds, each awaited at most `timeout` seconds."""
    import aaccl

    runs: list[dict[str, float]] = []
    began = time.perf_counter()
    for _ in range(reps):
        async with aaccl.open_world(2, timeout=timeout) as (a, b):
            src = a.allocate((k,), np.float32)
            src[:] = np.arange(k)
            src.sync_to_device()
            dst = b.allocate((k,), np.float32)
            dst[:] = -1
            dst.sync_to_device()
            sources = [src[i:i + 1] for i in range(k)]  # outside the timing
            slots = [dst[i:i + 1] for i in range(k)]  # disjoint: no write-write ordering
            warm = min(k, 100)
            await asyncio.wait_for(asyncio.gather(
                *[a.send(s, 1, 1, tag=OUTSTANDING_TAG, from_fpga=True) for s in sources[:warm]],
                *[b.recv(d, 1, 0, tag=OUTSTANDING_TAG, to_fpga=True) for d in slots[:warm]]),
                timeout)
            start = time.perf_counter()
            calls = [a.send(s, 1, 1, tag=OUTSTANDING_TAG, from_fpga=True) for s in sources]
            calls += [b.recv(d, 1, 0, tag=OUTSTANDING_TAG, to_fpga=True) for d in slots]
            submitted = time.perf_counter()
            await asyncio.wait_for(asyncio.gather(*calls), timeout)
            end = time.perf_counter()
            calls.clear()
            dst[:] = -1
            dst.sync_from_device()
            if not np.array_equal(dst, np.arange(k, dtype=np.float32)):
                raise AssertionError(f"wrong data received: {dst[:4]}...")
            runs.append({"total_s": end - start, "submit_s": submitted - start})
        gc.collect()
        if time.perf_counter() - began > budget:
            break
    per_pair = [r["total_s"] / k for r in runs]
    return {"k": k, "per_pair_s": statistics.median(per_pair),
            "per_pair_runs_s": per_pair,
            "submit_per_pair_s": statistics.median(r["submit_s"] / k for r in runs),
            "reps": len(runs)}


def outstanding_worker(k: int, reps: int, budget: float, timeout: float) -> None:
    """In a child process: one line of JSON, the result or {"error": ...}."""
    try:
        result = asyncio.run(_outstanding(k, reps, budget, timeout))
    except BaseException as exc:  # noqa: BLE001 - every failure is the result
        if isinstance(exc, asyncio.TimeoutError):
            error = f"TimeoutError: not all {2 * k} calls completed within {timeout:g} s"
        else:
            error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        result = {"k": k, "error": error}
    print(json.dumps(result), flush=True)


def run_outstanding(script: str, ks: Sequence[int], reps: int, budget: float, timeout: float,
                    log: IO[str]) -> dict[str, Any]:
    """Each K in a child process (`script --outstanding-worker`), killed if it outlives
    its bound: a wedged engine is reported as FAILED, never waited for."""
    points = []
    for k in ks:
        bound = budget + 2 * timeout + 30  # a failed call may hold the world's exit a timeout
        cmd = [sys.executable, script, "--outstanding-worker", "--count", str(k),
               "--outstanding-reps", str(reps), "--sweep-budget", str(budget),
               "--outstanding-timeout", str(timeout)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=bound,
                                  stdin=subprocess.DEVNULL, check=False)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
            if lines:
                point = json.loads(lines[-1])
            else:
                tail = " | ".join(proc.stderr.strip().splitlines()[-2:])
                point = {"k": k, "error": f"exited with {proc.returncode}: {tail}"}
        except subprocess.TimeoutExpired:
            point = {"k": k, "error": f"killed: did not finish within {bound:g} s"}
        if "error" in point:
            print(f"  K={k}: FAILED: {point['error']}", file=log, flush=True)
        else:
            print(f"  K={k}: {point['per_pair_s'] * 1e6:.1f} us per send/recv pair "
                  f"({point['reps']} runs)", file=log, flush=True)
        points.append(point)
    return {"points": points, "timeout_s": timeout}


def outstanding_verdict(block: dict[str, Any]) -> dict[str, Any]:
    """"K outstanding calls cost O(K)": the time per send/recv pair at the largest K
    at most OUTSTANDING_LIMIT times that at the smallest K; a failed K fails it."""
    points = sorted(block.get("points", []), key=lambda p: p["k"])
    failed = [p["k"] for p in points if "error" in p]
    lo, hi = (points[0], points[-1]) if len(points) >= 2 else (None, None)
    ratio = hi["per_pair_s"] / lo["per_pair_s"] \
        if lo and not failed and "per_pair_s" in lo and "per_pair_s" in hi else None
    passed = False if failed else None if ratio is None else ratio <= OUTSTANDING_LIMIT
    return {"target": "outstanding_calls",
            "ratio_name": f"K={hi['k']}/K={lo['k']}" if hi else "",
            "ratio": ratio, "limit": f"<= {OUTSTANDING_LIMIT}x", "pass": passed,
            "failed_k": failed, "binding": bool(hi) and hi["k"] >= 10 * lo["k"]}


# -- report -----------------------------------------------------------------------------------


def print_scaling(results: dict[str, Any], verdicts: Sequence[dict[str, Any]]) -> None:
    from _common import fmt_time, verdict

    sweep = results.get("sweep")
    v = {row["target"]: row for row in verdicts}
    if sweep:
        points, mpi = sweep["points"], sweep.get("mpi", {})
        mpi_points = mpi.get("points", [])
        counts = sweep["counts"]

        def cell(pts: list[dict[str, Any]], n: int, count: int) -> str:
            p = next((p for p in pts if p["ranks"] == n and p["count"] == count), None)
            if p is None:
                return ""
            if "error" in p:
                return "FAILED"
            scale, unit = (1e3, "ms") if p["median"] >= 1e-3 else (1e6, "us")

            def num(x: float) -> str:
                return f"{x * scale:.0f}" if x * scale >= 100 else f"{x * scale:.3g}"
            return f"{num(p['median'])} [{num(p['p10'])}, {num(p['p90'])}] {unit} x{p['n']}"

        def table(side: str, pts: list[dict[str, Any]], ranks: Sequence[int]) -> None:
            head = f"{'N':>4}" + "".join(f"{side + ' ' + size_name(4 * c):>34}" for c in counts)
            print(head)
            print("-" * len(head))
            for n in ranks:
                print(f"{n:>4}" + "".join(f"{cell(pts, n, c):>34}" for c in counts))

        print()
        print("(d) allreduce over N in-process ranks, device-resident buffers: "
              "median [p10, p90] x timed iterations")
        table("aaccl", points, sweep["ranks"])
        if mpi_points:
            print()
            table("MPICH", mpi_points, sorted({p["ranks"] for p in mpi_points}))
        for p in points + mpi_points:
            if "error" in p:
                print(f"  N={p['ranks']} {size_name(p['bytes'])}: FAILED: {p['error']}")
            elif not p.get("correct", True):
                print(f"  N={p['ranks']} {size_name(p['bytes'])}: WRONG RESULT")
        if "error" in mpi:
            print(f"MPICH: n/a ({mpi['error']})")
        print(f"per point: at most {sweep['iters']} timed iterations or {sweep['budget_s']:g} s "
              f"(at least {MIN_ITERS}), after warm-up")
        print()
        print("N log N target: for every N above the reference, t(N)/t(ref) <= "
              "(N log2 N)/(ref log2 ref)")
        for count in counts:
            row = v.get(f"allreduce_scaling_{size_name(4 * count).replace(' ', '')}")
            if row is None:
                continue
            steps = ", ".join(f"N={r['ranks']}: {r['ratio']:.2f}x/{r['limit']:.1f}x"
                              for r in row["per_ranks"])
            exponent = "" if row["exponent"] is None else \
                f"; fitted t ~ N^{row['exponent']:.2f}"
            if row["ratio"] is None:
                print(f"  {size_name(4 * count):>6}: n/a (no measured N above "
                      f"N={row['reference_ranks']}){exponent}")
                continue
            headline = f"{row['ratio_name']} = {row['ratio']:.2f}x"
            failed = f"; FAILED at N={row['failed_ranks']}" if row["failed_ranks"] else ""
            print(f"  {size_name(4 * count):>6}: {headline}  {row['limit']}  "
                  f"{verdict(row['pass'])}{'' if row['binding'] else ' (info)'}"
                  f"{exponent}{failed}")
            if steps:
                print(f"          ratio/limit by N: {steps}")
        if not any(row.get("binding") for row in verdicts
                   if row["target"].startswith("allreduce_scaling")):
            print(f"  (the verdict binds once the sweep reaches N={BINDING_RANKS})")

    block = results.get("outstanding")
    if block:
        print()
        print("(e) many outstanding calls: K sends of 4 B from rank 0, then K receives on rank 1,"
              " all submitted, then awaited together (2 ranks)")
        for p in block["points"]:
            if "error" in p:
                print(f"  K={p['k']:>6}: FAILED: {p['error']}")
            else:
                print(f"  K={p['k']:>6}: {fmt_time(p['per_pair_s'])} per send/recv pair "
                      f"(submitting: {fmt_time(p['submit_per_pair_s'])}), median of "
                      f"{p['reps']} runs")
        row = v.get("outstanding_calls")
        if row is not None:
            ratio = "n/a" if row["ratio"] is None else f"{row['ratio']:.2f}x"
            print(f"  O(K): per-pair time {row['ratio_name']} = {ratio}  {row['limit']}  "
                  f"{verdict(row['pass'])}{'' if row['binding'] else ' (info)'}")


def print_timing_checks(checks: Sequence[dict[str, Any]]) -> None:
    from _common import fmt_time

    bad = [c for c in checks if not c["ok"]]
    print(f"timing checks: {len(checks) - len(bad)} of {len(checks)} medians agree within "
          f"{TIMING_TOLERANCE:.0%} with a second timing of the same iterations")
    for c in bad:
        covered = c.get("covered")
        why = ""
        if covered is not None:
            why = f"; the timed iterations cover {covered:.0%} of the loop's time: " + (
                "a heavy tail of slow iterations" if covered >= 0.9
                else "time passes outside the timed iterations")
        print(f"warning: {c['what']}: median {fmt_time(c['median_s'])}, {c['second']} "
              f"{fmt_time(c['second_s'])} ({c['ratio']:.2f}x){why}")


# -- plot ---------------------------------------------------------------------------------------


def plot_sweep(runs: Sequence[tuple[str, dict[str, Any]]], out: str | os.PathLike[str]) -> None:
    """Latency vs N, log-log, one colour per message size: each run's aaccl medians
    (solid, p10-p90 bars), an N log N line through its reference point (dashed),
    MPICH's medians (squares, dotted). The first run is drawn boldest."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(8, 5.5))
    legend: list[tuple[tuple[int, int, int], Any, str]] = []  # (order, handle, label)
    drawn_any = False
    for r, (label, results) in enumerate(runs):
        sweep = results.get("sweep") or {}
        alpha = 1.0 if r == 0 else 0.45
        for i, count in enumerate(sweep.get("counts", [])):
            colour = colours(i)
            pts = sorted((p for p in sweep["points"] if p["count"] == count and "median" in p),
                         key=lambda p: p["ranks"])
            if not pts:
                continue
            drawn_any = True
            ns = [p["ranks"] for p in pts]
            med = np.array([p["median"] for p in pts]) * 1e3
            err = np.array([[p["median"] - p["p10"] for p in pts],
                            [p["p90"] - p["median"] for p in pts]]) * 1e3
            name = size_name(4 * count)
            handle = ax.errorbar(ns, med, yerr=err, color=colour, alpha=alpha, marker="o",
                                 capsize=3, linestyle="-" if r == 0 else "--")
            legend.append(((0 if r == 0 else 3, r, i), handle,
                           f"aaccl {name}" + (f" ({label})" if label else "")))
            ref = REFERENCE_RANKS if REFERENCE_RANKS in ns else ns[0]
            t_ref = med[ns.index(ref)]
            grid = np.array([n for n in ns if n >= ref], dtype=float)
            if r == 0 and len(grid) > 1:
                handle, = ax.plot(grid, t_ref * grid * np.log2(grid) / nlogn(ref),
                                  color=colour, linestyle=(0, (2, 2)), linewidth=1)
                legend.append(((1, r, i), handle, f"N log2 N through aaccl {name} at N={ref}"))
            mpi = sorted((p for p in sweep.get("mpi", {}).get("points", [])
                          if p["count"] == count and "median" in p), key=lambda p: p["ranks"])
            if mpi and r == 0:
                handle, = ax.plot([p["ranks"] for p in mpi], [p["median"] * 1e3 for p in mpi],
                                  color=colour, marker="s", markersize=8, linestyle=":",
                                  markerfacecolor="white")
                legend.append(((2, r, i), handle, f"MPICH {name}, processes"))
    if not drawn_any:
        plt.close(fig)
        raise ValueError("no sweep points to draw (was the sweep run?)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("N ranks")
    ax.set_ylabel("allreduce latency, median (ms)")
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.grid(True, which="both", alpha=0.3)
    first = runs[0][1]["config"]
    ax.set_title(f"allreduce over N in-process ranks, device-resident buffers "
                 f"({first['cpus']} CPUs); bars: p10-p90", fontsize=10)
    legend.sort(key=lambda entry: entry[0])
    ax.legend([h for _, h, _ in legend], [text for _, _, text in legend], fontsize=8,
              loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
