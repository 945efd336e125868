"""aaccl's MPI-fabric targets (benchmarks/README.md): aaccl over MPI against mpi4py, in one run.

    python benchmarks/bench_mpi.py              # full run: 2 and 4 processes, 4 B and 16 MiB
    python benchmarks/bench_mpi.py --quick      # 4 MiB and fewer iterations, a CI smoke test
    python benchmarks/bench_mpi.py --json -     # machine-readable results on stdout
    python benchmarks/bench_mpi.py --sweep --plot docs/img/mpi_sweep.png
                                                # every size from 4 B to 16 MiB, drawn
    python benchmarks/bench_mpi.py --procs "" --hosts 2x1,2x2 --net-rate 1gbit --net-delay 50us,1ms
                                                # across simulated hosts (root, Linux)

For each process count (`--procs`, default 2 and 4) the script runs itself under
`mpiexec -n N ... --mpi-worker`. Every worker process measures, in the same processes:

- raw MPI: mpi4py's `Comm.Allreduce` (SUM) of float32 numpy arrays;
- aaccl over the MPI fabric (`aaccl.open_world()` under mpiexec: one rank per process),
  `allreduce(..., ReduceFunction.SUM)` on device-resident buffers (from_fpga=True,
  to_fpga=True), the configuration the targets name;
- for information, the same aaccl allreduce on host buffers (the driver copies the
  input to the device before the call and the result back after it);

- for reference, the floor: what bounds an awaitable collective with aaccl's
  opening, without aaccl: MPI's (persistent) allgather of a 512-byte block per rank
  holding the data if it fits (else followed by MPI's `Iallreduce`), tested by an
  asyncio task that spins on it (no turn of the event loop between tests; a vain
  test yields the core, as aaccl's polls do), and the sum of the blocks' data. No
  awaitable collective with such an opening can be faster here;
- for comparison, aaccl with the world's collectives on the soft CCLO's own schedules
  over messages (AACCL_MPI_COLLECTIVES=0) instead of MPI's nonblocking collectives;

each of them at 4 bytes (count=1) and at `--size-mib` MiB (default 16), and with
`--sweep` at the sizes between (256 B, 4 KiB, 64 KiB, 1 MiB); `--plot` draws latency
against size for each process count (matplotlib: `pip install 'aaccl[plot]'`).

`--cold-mib M` has every process stream M MiB of memory of its own (a numpy sum)
before each iteration of every side, outside the timed interval: a program's own data
between its calls evicts the caches, and a call's cost then includes fetching its code
and objects again. The targets are set with warm caches, so its verdicts are for
information; it shows what a small call costs inside a program that works on big data.

Every iteration starts after an MPI Barrier on COMM_WORLD; its time is the latest
rank's return minus the earliest rank's entry (time.perf_counter is CLOCK_MONOTONIC,
one clock for every process of the machine), so it covers the whole collective on
every rank. Medians after warm-up iterations are reported. Half of the raw MPI
iterations run before aaccl's world is opened and half after it is closed, so MPI is
never timed while aaccl's progress thread polls, and slow drift hits both sides alike.

`--hosts HxR,...` runs the same side by side across H simulated hosts of R ranks each
(benchmarks/_netns.py: network namespaces on a bridge, MPICH's launcher reaching them
through a wrapper in place of ssh, UCX on TCP between them), over links limited to
`--net-rate` (tc tbf) with `--net-delay` added to every packet a host sends (tc netem,
one run per delay; where the kernel has no netem the delay is left out and the output
says so). The clock stays one machine's, so the timing is the same as above. The
target's verdict is for one machine only: across hosts the ratios are information.

Bandwidths follow nccl-tests: algorithm bandwidth = bytes / time; bus bandwidth =
algorithm bandwidth * 2 (n - 1) / n for allreduce. The targets: aaccl's bus bandwidth
at 16 MiB (device-resident) at least 0.9x MPI's, and its 4-byte latency within 3x of
MPI's, checked for each process count.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import platform
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import _netns
import numpy as np
from _common import (
    MiB,
    OtherLoad,
    add_run_options,
    busy_cpus,
    find_mpiexec,
    fmt_time,
    median,
    mpi_env,
    report,
    run_mpiexec,
    spread,
    verdict,
)

TARGET_SIZE_MIB = 16
TARGET_RATIO = 0.9
LATENCY_RATIO = 1 / 3
SWEEP = {"s256": 64, "s4k": 1024, "s64k": 16 * 1024, "s1m": 256 * 1024}
"""--sweep's sizes between 4 B and the large one, in float32 elements."""
TARGET = ("aaccl busbw / MPI busbw >= 0.9 at 16 MiB, and 4 B latency within 3x of MPI's "
          "(>= 0.33x), device-resident buffers")
SIDES = ("mpi", "floor", "aaccl_device", "aaccl_host", "aaccl_schedules")
LABELS = {"mpi": "mpi4py Allreduce", "floor": "floor (no aaccl)",
          "aaccl_device": "aaccl, device buffers", "aaccl_host": "aaccl, host buffers",
          "aaccl_schedules": "aaccl, schedules"}
"""aaccl_schedules: device buffers, the world's collectives on the soft CCLO's own
schedules over messages (AACCL_MPI_COLLECTIVES=0) instead of MPI's collectives.
floor: what bounds an awaitable allreduce with aaccl's opening, without aaccl
(`floor_side`)."""


def bus_factor(procs: int) -> float:
    """nccl-tests' allreduce bus bandwidth factor."""
    return 2 * (procs - 1) / procs


# -- worker (one per MPI process) ---------------------------------------------------------


Span = tuple[float, float]
"""One iteration: (latest end - earliest start, latest start - earliest start)."""


class Timer:
    """Barrier-separated iterations, each timed from the earliest rank's start to the
    latest rank's end; only rank 0 keeps the spans."""

    def __init__(self, comm: Any, cold_mib: float = 0) -> None:
        self.comm, self.rank = comm, comm.Get_rank()
        self._flush = np.ones(int(cold_mib * MiB) // 4, np.float32) if cold_mib else None

    def barrier(self, comm: Any = None) -> None:
        """Before an iteration: stream `--cold-mib` MiB through the caches (if asked),
        then wait for every rank (on `comm`, the timer's if None)."""
        if self._flush is not None:
            self._flush.sum()
        (comm or self.comm).Barrier()

    def span(self, start: float, end: float) -> Span | None:
        """On rank 0: (latest end - earliest start, how far apart the starts were);
        the timestamps are exchanged outside the timed interval."""
        ends = self.comm.gather((start, end), root=0)
        if self.rank != 0:
            return None
        starts = [s for s, _ in ends]
        return max(e for _, e in ends) - min(starts), max(starts) - min(starts)


def _summary(spans: list[Span]) -> dict[str, Any]:
    out: dict[str, Any] = spread([s for s, _ in spans])
    out["start_skew_median"] = median([k for _, k in spans])
    # for information: from the latest rank's start (nobody finishes before it)
    out["from_last_start_median"] = median([s - k for s, k in spans])
    return out


def mpi_side(timer: Timer, src: np.ndarray, dst: np.ndarray, iters: int,
             warmup: int) -> list[Span]:
    from mpi4py import MPI

    comm, spans = timer.comm, []
    for i in range(warmup + iters):
        timer.barrier()
        start = time.perf_counter()
        comm.Allreduce(src, dst, op=MPI.SUM)
        end = time.perf_counter()
        span = timer.span(start, end)
        if i >= warmup and span is not None:
            spans.append(span)
    return spans


async def floor_side(timer: Timer, src: np.ndarray, dst: np.ndarray, iters: int,
                     warmup: int) -> list[Span]:
    """The least an awaited allreduce with aaccl's opening costs here, whatever
    library runs it: MPI's persistent allgather of a block per rank (holding the
    data, if it fits), then, for data that does not, MPI's Iallreduce; the asyncio
    task that awaits each spins on MPI's test (no turn of the event loop between
    tests, which would cost more than the whole round trip; a vain test yields the
    core, as aaccl's polls do, for the peer that shares it), then sums the blocks'
    data. Nothing else: no fingerprint check, no device memory, no call object, no
    dependencies."""
    from mpi4py import MPI

    from aaccl.soft.fabric._blocks import BLOCK, INLINE  # the opening's block, its data's room

    comm, spans = timer.comm.Dup(), []
    size, nbytes, head = comm.Get_size(), src.nbytes, BLOCK - INLINE
    inline = nbytes <= INLINE
    block = np.zeros(BLOCK, np.uint8)
    if inline:
        block[head:head + nbytes] = src.view(np.uint8)
    gathered = np.empty(size * BLOCK, np.uint8)
    parts = gathered.reshape(size, BLOCK)[:, head:head + nbytes].view(src.dtype) \
        if inline else None
    sched_yield = os.sched_yield

    def spin(request: Any) -> None:
        while not request.Test():
            sched_yield()

    try:  # one persistent request, as aaccl's lane opens (MPI 4)
        opening: Any = comm.Allgather_init(block, gathered)
    except (AttributeError, NotImplementedError):
        opening = None

    for i in range(warmup + iters):
        timer.barrier(comm)
        start = time.perf_counter()
        if opening is not None:
            opening.Start()
            spin(opening)
        else:
            spin(comm.Iallgather(block, gathered))
        if parts is not None:
            np.add.reduce(parts, axis=0, out=dst)
        else:
            spin(comm.Iallreduce(src, dst, MPI.SUM))
        end = time.perf_counter()
        span = timer.span(start, end)
        if i >= warmup and span is not None:
            spans.append(span)
    if opening is not None:
        opening.Free()
    comm.Free()
    return spans


async def aaccl_side(timer: Timer, counts: dict[str, int], iters: dict[str, int],
                     warmup: int) -> tuple[dict[str, Any], bool]:
    """Every aaccl variant at every size; ({side: {size: spans}}, results correct)."""
    out: dict[str, dict[str, list[Span]]] = {}
    correct = True
    for lane in ("1", "0"):  # MPI's collectives, then the soft CCLO's schedules
        os.environ["AACCL_MPI_COLLECTIVES"] = lane
        correct &= await _aaccl_world(timer, counts, iters, warmup, out, lane == "1")
    return out, correct


async def _aaccl_world(timer: Timer, counts: dict[str, int], iters: dict[str, int],
                       warmup: int, out: dict[str, Any], lane: bool) -> bool:
    """One world's variants into `out`; whether their results were correct."""
    import aaccl
    from aaccl import ReduceFunction

    comm, correct = timer.comm, True
    expected = comm.Get_size() * (comm.Get_size() + 1) / 2
    async with aaccl.open_world() as accls:
        (accl,) = accls
        src = accl.allocate((max(counts.values()),), np.float32)
        dst = accl.allocate((max(counts.values()),), np.float32)
        src[:] = accl.rank + 1
        dst[:] = 0
        src.sync_to_device()
        dst.sync_to_device()  # fault the device pages in before timing

        async def timed(call: Callable[[], Awaitable[Any]], n: int,
                        skip: int) -> list[Span]:
            spans = []
            for i in range(skip + n):
                timer.barrier()
                start = time.perf_counter()
                await call()
                end = time.perf_counter()
                span = timer.span(start, end)
                if i >= skip and span is not None:
                    spans.append(span)
            return spans

        sides = (("aaccl_device", True), ("aaccl_host", False)) if lane \
            else (("aaccl_schedules", True),)
        for side, on_device in sides:
            out[side] = {}
            for name, count in counts.items():
                def call(count: int = count, on_device: bool = on_device) -> Any:
                    return accl.allreduce(src, dst, count, ReduceFunction.SUM,
                                          from_fpga=on_device, to_fpga=on_device)

                out[side][name] = await timed(call, iters[name], warmup)
                # outside the timing: the last result really is where it should be
                dst[:] = 0
                if on_device:
                    dst.sync_from_device()
                else:
                    dst.sync_to_device()
                    await call()
                picks = dst[[0, count // 2, count - 1]]
                correct &= bool((picks == expected).all())
    return correct


def mpi_worker(counts: dict[str, int], iters: dict[str, int], warmup: int,
               cold_mib: float = 0) -> None:
    """Runs in each of the mpiexec processes; rank 0 prints one line of JSON."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    timer = Timer(comm, cold_mib)
    size, rank = comm.Get_size(), comm.Get_rank()
    expected = size * (size + 1) / 2
    bufs = {name: (np.full(count, rank + 1, np.float32), np.zeros(count, np.float32))
            for name, count in counts.items()}
    for _, dst in bufs.values():
        dst[:] = 1  # fault the pages in before timing

    mpi: dict[str, list[Span]] = {name: [] for name in counts}
    for name, (src, dst) in bufs.items():  # first half of MPI's iterations
        mpi[name] += mpi_side(timer, src, dst, iters[name] - iters[name] // 2, warmup)
    floor: dict[str, list[Span]] = {}
    for name, (src, dst) in bufs.items():
        dst[:] = 0
        floor[name] = asyncio.run(floor_side(timer, src, dst, iters[name], warmup))
    floor_ok = all(bool(dst[0] == expected and dst[-1] == expected) for _, dst in bufs.values())
    aac, aaccl_ok = asyncio.run(aaccl_side(timer, counts, iters, warmup))
    gc.collect()
    for name, (src, dst) in bufs.items():  # second half, aaccl's world closed
        mpi[name] += mpi_side(timer, src, dst, iters[name] // 2, warmup)
    mpi_ok = all(bool(dst[0] == expected and dst[-1] == expected) for _, dst in bufs.values())
    correct = comm.reduce(mpi_ok and floor_ok and aaccl_ok, op=MPI.LAND, root=0)
    if rank == 0:
        results = {"mpi": {name: _summary(spans) for name, spans in mpi.items()},
                   "floor": {name: _summary(spans) for name, spans in floor.items()}}
        for side, by_size in aac.items():
            results[side] = {name: _summary(spans) for name, spans in by_size.items()}
        print(json.dumps({"procs": size, "library": MPI.Get_library_version().splitlines()[0],
                          "thread_level": MPI.Query_thread(), "correct": bool(correct),
                          "results": results}), flush=True)


def run_procs(args: argparse.Namespace, procs: int, counts: dict[str, int],
              iters: dict[str, int], warmup: int, cluster: Any = None) -> dict[str, Any]:
    """Launch this script under `mpiexec -n procs` (on the simulated hosts of
    `cluster`, a benchmarks/_netns.py Cluster, if given); {"error": why} if that fails."""
    mpiexec, why = find_mpiexec()
    if mpiexec is None:
        return {"error": why}
    hosts = ["-f", str(cluster.hostfile)] if cluster is not None else []
    cmd = [mpiexec, *hosts, "-n", str(procs), sys.executable, os.path.abspath(__file__),
           "--mpi-worker", "--count", str(counts["large"]), "--iters", str(iters["large"]),
           "--small-iters", str(iters["small"]), "--warmup", str(warmup),
           *(["--sweep"] if len(counts) > 2 else []),
           *(["--cold-mib", str(args.cold_mib)] if args.cold_mib else [])]
    result = run_mpiexec(cmd, args.mpi_timeout, None if cluster is None else cluster.env)
    result["command"] = " ".join(cmd)
    return result


def parse_layouts(text: str) -> list[tuple[int, int]]:
    """"2x1,2x2" -> [(2, 1), (2, 2)]: simulated hosts x ranks per host."""
    layouts = []
    for word in filter(None, (w.strip() for w in text.split(","))):
        hosts, _, slots = word.lower().partition("x")
        if not (hosts.isdigit() and slots.isdigit() and int(hosts) >= 1 and int(slots) >= 1):
            raise argparse.ArgumentTypeError(f"--hosts {word!r}: expected HOSTSxRANKS, e.g. 2x2")
        layouts.append((int(hosts), int(slots)))
    return layouts


def run_hosts(args: argparse.Namespace, counts: dict[str, int], iters: dict[str, int],
              warmup: int, log: Any) -> list[dict[str, Any]]:
    """One run per layout and delay across simulated hosts (a delay the kernel cannot
    add is left out, once, with the reason)."""
    why = _netns.unavailable()
    if why is not None:
        return [{"procs": h * s, "hosts": f"{h}x{s}", "error": f"no simulated hosts: {why}"}
                for h, s in args.hosts]
    runs = []
    for hosts, slots in args.hosts:
        for delay in args.net_delay or [None]:
            network = _netns.Network(rate=args.net_rate or None, delay=delay)
            with _netns.Cluster(hosts, slots, network) as cluster:
                if delay is not None and cluster.notes:  # no netem: all delays are one
                    if any(r.get("hosts") == f"{hosts}x{slots}" and r.get("net_delay") is None
                           for r in runs):
                        continue
                    delay = None
                print(f"{cluster.describe()}: mpi4py and aaccl allreduce...", file=log,
                      flush=True)
                for note in cluster.notes:
                    print(f"  note: {note}", file=log, flush=True)
                run = run_procs(args, cluster.size, counts, iters, warmup, cluster)
                run.update(procs=cluster.size, hosts=f"{hosts}x{slots}",
                           net_rate=network.rate, net_delay=delay, notes=cluster.notes,
                           env={k: v for k, v in cluster.env.items() if k.startswith("UCX")},
                           link_bytes_sent={h: sent for h, (sent, _) in
                                            cluster.traffic().items()})
            runs.append(run)
    return runs


def cold_mib(text: str) -> float:
    """--cold-mib: MiB a process streams before each iteration, finite and >= 0."""
    try:
        mib = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is no number of MiB") from None
    if not math.isfinite(mib) or mib < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give 0 (caches warm) or more MiB")
    return mib


def net_rate(text: str) -> str:
    if text:
        try:
            _netns.parse_rate(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def where(run: dict[str, Any]) -> str:
    """Where a run's ranks were: "-" on this machine, else hosts x ranks and the links."""
    if "hosts" not in run:
        return "-"
    link = ",".join(filter(None, [run.get("net_rate"), run.get("net_delay")
                                  and f"+{run['net_delay']}"]))
    return f"{run['hosts']}{' ' + link if link else ''}"


# -- report --------------------------------------------------------------------------------


def evaluate(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (process count, size, side), with bandwidths and the ratio to MPI."""
    cfg = results["config"]
    rows = []
    for run in results["runs"]:
        procs = run["procs"]
        hosts = run.get("hosts") is not None
        for name in cfg["counts"]:
            nbytes = cfg["bytes"][name]
            times = {side: run["results"][side][name]["median"]
                     for side in SIDES if "results" in run}
            for side in SIDES:
                t = times.get(side)
                algbw = None if not t else nbytes / t / 1e9
                busbw = None if algbw is None else algbw * bus_factor(procs)
                mpi_t = times.get("mpi")
                ratio = mpi_t / t if side != "mpi" and t and mpi_t else None  # busbw ratio
                binding = (side == "aaccl_device" and name == "large" and not hosts
                           and cfg["size_mib"] == TARGET_SIZE_MIB)
                binding = binding or (side == "aaccl_device" and name == "small" and not hosts)
                binding = binding and not cfg.get("cold_mib")  # (targets: warm caches)
                judged = side == "aaccl_device" and name in ("small", "large")
                goal = TARGET_RATIO if name == "large" else LATENCY_RATIO
                rows.append({"procs": procs, "where": where(run), "size": name, "bytes": nbytes, "side": side,
                             "time_s": t, "algbw_GBps": algbw, "busbw_GBps": busbw,
                             "busbw_vs_mpi": ratio, "judged": judged, "binding": binding,
                             "goal": goal,
                             "pass": None if not judged or ratio is None else ratio >= goal})
    return rows


def plot(rows: list[dict[str, Any]], out: str) -> None:
    """Latency against message size, one panel per process count on this machine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mine = [r for r in rows if r["where"] == "-" and r["time_s"]]
    procs = sorted({r["procs"] for r in mine})
    fig, axes = plt.subplots(1, len(procs), figsize=(5.5 * len(procs), 4.2), squeeze=False)
    styles = {"mpi": ("k", "--"), "floor": ("0.6", "-."), "aaccl_device": ("C0", "-"),
              "aaccl_schedules": ("C1", ":")}
    for ax, n in zip(axes[0], procs):
        for side, (color, line) in styles.items():
            points = sorted((r["bytes"], r["time_s"]) for r in mine
                            if r["procs"] == n and r["side"] == side)
            if points:
                x, y = zip(*points)
                ax.loglog(x, [t * 1e6 for t in y], line, color=color, marker="o",
                          label=LABELS[side] + (" (device buffers)" if side
                                                == "aaccl_schedules" else ""))
        ax.set_title(f"allreduce, {n} processes on one machine")
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("median latency (us)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def _fmt_size(nbytes: int) -> str:
    return f"{nbytes / MiB:g} MiB" if nbytes >= MiB else f"{nbytes} B"


def _fmt_bw(gbps: float | None) -> str:
    if gbps is None:
        return "n/a"
    return f"{gbps:.2f}" if gbps >= 0.01 else f"{gbps:.1e}"


def print_table(results: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    cfg = results["config"]
    head = (f"{'procs':<6}{'hosts':<16}{'size':<9}{'side (median)':<24}{'latency':>10}{'algbw GB/s':>12}"
            f"{'busbw GB/s':>12}{'busbw vs MPI':>14}   {'target':<9}result")
    print(head)
    print("-" * len(head))
    last = None
    for row in rows:
        if last is not None and (row["procs"], row["where"], row["size"]) != last:
            print()
        last = (row["procs"], row["where"], row["size"])
        ratio = "" if row["side"] == "mpi" else \
            "n/a" if row["busbw_vs_mpi"] is None else f"{row['busbw_vs_mpi']:.2f}x"
        tail = ""
        if row["judged"]:
            tail = f"   {'>= ' + format(row['goal'], '.2g') + 'x':<9}{verdict(row['pass'])}" \
                   f"{'' if row['binding'] else ' (info)'}"
        print(f"{row['procs']:<6}{row['where']:<16}{_fmt_size(row['bytes']):<9}{LABELS[row['side']]:<24}"
              f"{fmt_time(row['time_s']):>10}{_fmt_bw(row['algbw_GBps']):>12}"
              f"{_fmt_bw(row['busbw_GBps']):>12}{ratio:>14}{tail}".rstrip())
    print()
    if cfg.get("cold_mib"):
        print(f"caches cold: every process streamed {cfg['cold_mib']:g} MiB of other memory "
              "before each iteration (untimed); the targets are set with warm caches, so "
              "these verdicts are for information only")
    if cfg["size_mib"] != TARGET_SIZE_MIB:
        print(f"the target is set at {TARGET_SIZE_MIB} MiB: at {cfg['size_mib']:g} MiB its "
              "verdicts are for information only")
    print("busbw = algbw x 2(n-1)/n (nccl-tests' allreduce factor); 'busbw vs MPI' = aaccl's "
          "busbw / MPI's = MPI time / aaccl time")
    print(f"target: {TARGET}")
    print(f"iterations: {cfg['size_mib']:g} MiB {cfg['iters']['large']}, 4 B "
          f"{cfg['iters']['small']} (+{cfg['warmup']} warm-up each); machine: {cfg['cpus']} "
          f"CPUs, Python {cfg['python']}, numpy {cfg['numpy']}")
    busy, during = cfg["busy_cpus_at_start"], cfg["other_cpus_during_run"]
    if busy is not None and during is not None and max(busy, during) > 0.3:
        print(f"warning: other processes kept {busy:.1f} CPUs busy when the run started and "
              f"{during:.1f} on average during it: the timings are noisy")
    for run in results["runs"]:
        label = f"{run.get('procs', '?')} processes" + \
            (f" on {where(run)}" if "hosts" in run else "")
        if "error" in run:
            print(f"{label}: n/a ({run['error']})")
            continue
        res = run["results"]
        late = res["mpi"]["large"]["from_last_start_median"] / \
            res["aaccl_device"]["large"]["from_last_start_median"]
        print(f"{label}, timed from the latest rank's start instead (info): "
              f"{cfg['size_mib']:g} MiB device-buffer busbw vs MPI {late:.2f}x")
        skew = ", ".join(f"{side.replace('aaccl_', 'aaccl ')} "
                         f"{fmt_time(run['results'][side]['large']['start_skew_median'])}"
                         for side in SIDES)
        env = {**results["env"], **run.get("env", {})}
        print(f"{label}: {' '.join(run['library'].split())}, MPI env vars: "
              f"{' '.join(f'{k}={v}' for k, v in env.items()) or 'none'}; results "
              f"{'correct' if run['correct'] else 'WRONG'}; barrier exit skew at "
              f"{cfg['size_mib']:g} MiB (median, part of the times): {skew}")
        if "hosts" in run:
            sent = run.get("link_bytes_sent", {})
            print(f"{label}: bytes each host sent over its link (MPI's traffic between "
                  f"hosts): {', '.join(f'{b / MiB:.0f} MiB' for b in sent.values())}")
            for note in run.get("notes", []):
                print(f"{label}: note: {note}")
    if cfg["cpus"] and any(run.get("procs", 0) > cfg["cpus"] for run in results["runs"]):
        print(f"note: more processes than the {cfg['cpus']} CPUs: MPICH busy-polls and aaccl "
              "adds a progress thread per process, so both sides are oversubscribed")
        if cfg.get("cold_mib"):
            print("note: with --cold-mib and more processes than CPUs, the times are mostly "
                  "which process the scheduler runs first after its flush")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--procs", default="2,4",
                        help="comma-separated process counts (default 2,4)")
    parser.add_argument("--size-mib", type=float, default=None,
                        help="the large size, MiB of float32 (default 16, --quick: 4)")
    parser.add_argument("--iters", type=int, default=None,
                        help="timed iterations at the large size (default 20, --quick: 5)")
    parser.add_argument("--small-iters", type=int, default=None,
                        help="timed iterations at 4 B (default 300, --quick: 50)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations of each")
    parser.add_argument("--cold-mib", type=cold_mib, default=0, metavar="M",
                        help="stream M MiB of other memory before each iteration (caches "
                             "cold, as in a program working on big data; verdicts for "
                             "information)")
    parser.add_argument("--sweep", action="store_true",
                        help="also 256 B, 4 KiB, 64 KiB and 1 MiB")
    parser.add_argument("--plot", metavar="PNG",
                        help="draw latency against size for each process count into PNG")
    parser.add_argument("--hosts", type=parse_layouts, default=[],
                        help="simulated host layouts, HOSTSxRANKS,... e.g. 2x1,2x2 "
                             "(Linux network namespaces: root; see benchmarks/_netns.py)")
    parser.add_argument("--net-rate", default="1gbit", type=net_rate,
                        help="rate limit of each simulated host's link (tc units, default "
                             "1gbit; '' for none)")
    parser.add_argument("--net-delay", type=lambda t: [d for d in t.split(",") if d],
                        default=[], help="delays added to every packet a simulated host "
                                         "sends, one run each, e.g. 50us,1ms (needs netem)")
    add_run_options(parser)
    args = parser.parse_args()

    quick = args.quick
    size_mib = args.size_mib if args.size_mib is not None else (4 if quick else 16)
    counts = {"small": 1, **(SWEEP if args.sweep else {}),
              "large": args.count or max(1, int(size_mib * MiB) // 4)}
    iters = {"small": args.small_iters or (50 if quick else 300),
             "large": args.iters or (5 if quick else 20)}
    for name, count in counts.items():  # the sweep's: as many as the nearer end's
        iters.setdefault(name, iters["small"] if count * 4 <= 64 * 1024 else iters["large"])
    warmup = max(1, args.warmup)

    if args.mpi_worker:
        mpi_worker(counts, iters, warmup, args.cold_mib)
        return 0

    procs = [int(p) for p in args.procs.split(",") if p.strip()]
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    flushing = args.cold_mib * MiB * max(procs + [h * r for h, r in args.hosts], default=0)
    if flushing > memory / 2:
        parser.error(f"--cold-mib {args.cold_mib:g}: {flushing / 2**30:.1f} GiB for every "
                     f"process's array, more than half of this machine's "
                     f"{memory / 2**30:.1f} GiB")
    config = {"size_mib": counts["large"] * 4 / MiB, "counts": counts,
              "bytes": {name: 4 * c for name, c in counts.items()}, "iters": iters,
              "warmup": warmup, "procs": procs, "cpus": os.cpu_count(),
              "python": platform.python_version(), "numpy": np.__version__, "quick": quick,
              "busy_cpus_at_start": busy_cpus(), "cold_mib": args.cold_mib,
              "hosts": [f"{h}x{s}" for h, s in args.hosts], "net_rate": args.net_rate,
              "net_delay": args.net_delay}
    mpiexec, why = find_mpiexec()
    if mpiexec is None:
        print(f"bench_mpi needs MPI: {why} (pip install mpi4py mpich)", file=sys.stderr)
        return 2
    log = sys.stderr if args.json == "-" else sys.stdout
    runs = []
    other = OtherLoad()
    for n in procs:
        print(f"mpiexec -n {n}: mpi4py and aaccl allreduce, 4 B and "
              f"{config['size_mib']:g} MiB...", file=log, flush=True)
        run = run_procs(args, n, counts, iters, warmup)
        run.setdefault("procs", n)
        runs.append(run)
    runs += run_hosts(args, counts, iters, warmup, log) if args.hosts else []
    config["other_cpus_during_run"] = other.cpus()
    results: dict[str, Any] = {"config": config, "env": mpi_env(), "runs": runs,
                               "target": TARGET}
    rows = evaluate(results)
    results["rows"] = rows
    report(results, rows, args.json, print_table)
    if args.plot:
        plot(rows, args.plot)
    failed = any("error" in run or not run.get("correct", False) for run in runs)
    missed = any(row["pass"] is False and row["binding"] for row in rows)
    return 1 if args.check and (missed or failed) else 0


if __name__ == "__main__":
    sys.exit(main())
