"""The LZ4 pipeline of examples/lz4_frame.py against single-threaded lz4.frame, side by side.

    python benchmarks/bench_lz4.py                 # 64 MiB of text, 5 rounds: 10-20 s
    python benchmarks/bench_lz4.py --quick         # 16 MiB, 3 rounds: a CI smoke test
    python benchmarks/bench_lz4.py --json - --check   # JSON on stdout; exit 1 on a miss

What it measures (see benchmarks/README.md): `--size-mib` MiB of the example's
text-like data (generated once into a temporary directory, or `--input FILE`) written
as an LZ4 frame (1 MiB independent blocks) two ways, in alternating runs so that load
from elsewhere hits both alike:

- the example's overlapped pipeline on a one-rank soft CCLO: bricks of `--brick` blocks,
  each one chain of an upload, a compression kernel per block and a download, double
  buffered (examples/lz4_frame.py: `pipeline`);
- `lz4.frame.compress` on one thread with the same frame parameters (the example's
  `run_reference`).

Each run is timed from reading INPUT (in the page cache) to the whole frame written to
a file, by the example's own stopwatch; the pipeline's device buffers are allocated
before its clock starts. Every pipeline run's output is decompressed and compared with
the input (outside the timing). The figure of merit is the example's: the best
reference time over the best pipeline time (target >= 1.8 on 2 cores), beside the
median of the run-by-run ratios. Each stopwatch is checked against a second timing of
the same run: for the pipeline, from its first read or write of either file to the
output's last flush (the files are wrapped to see them); for the reference, the whole
call, from outside. A disagreement of more than 10 % prints a warning.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import sys
import tempfile
import time
from typing import Any, BinaryIO

import numpy as np

from _common import MiB, OtherLoad, busy_cpus, report, spread, verdict

TARGET = 1.8
TARGETS = {"lz4_pipeline_vs_lz4_frame":
           f"best lz4.frame time / best pipeline time >= {TARGET} (2 cores)"}
HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, os.pardir, "examples", "lz4_frame.py")
CHECK_TOLERANCE = 0.10


def load_example() -> Any:
    """examples/lz4_frame.py as a module (examples/ is no package)."""
    spec = importlib.util.spec_from_file_location("lz4_frame_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class Watched:
    """A binary file whose first I/O and last flush are timed (the second timing)."""

    def __init__(self, f: BinaryIO, clock: dict[str, float]) -> None:
        self._f, self._clock = f, clock

    def _io(self) -> None:
        self._clock.setdefault("first", time.perf_counter())

    def readinto(self, b: Any) -> int | None:
        self._io()
        return self._f.readinto(b)

    def write(self, b: Any) -> int:
        self._io()
        return self._f.write(b)

    def flush(self) -> None:
        self._f.flush()
        self._clock["flushed"] = time.perf_counter()


def run_pipeline(lz: Any, path: str, output: str, brick: int) -> dict[str, float]:
    """One run of the example's overlapped pipeline: its stopwatch and the second timing."""
    import aaccl

    clock: dict[str, float] = {}
    with open(path, "rb", buffering=0) as source, open(output, "wb") as out:
        size = os.fstat(source.fileno()).st_size

        async def main(accl: aaccl.ACCL) -> Any:
            return await lz.pipeline(accl, Watched(source, clock), size, Watched(out, clock),
                                     brick)
        timing = aaccl.run(main, world_size=1)[0]
    return {"wall": timing.wall, "cpu": timing.cpu, "check": clock["flushed"] - clock["first"]}


def run_reference(lz: Any, path: str, directory: str) -> dict[str, float]:
    """One run of single-threaded lz4.frame.compress: its stopwatch and the whole call."""
    start = time.perf_counter()
    timing = lz.run_reference(path, directory)
    return {"wall": timing.wall, "cpu": timing.cpu, "check": time.perf_counter() - start}


def measure(lz: Any, path: str, rounds: int, brick: int, log: Any) -> dict[str, Any]:
    with open(path, "rb") as f:
        data = f.read()
    directory = tempfile.mkdtemp(prefix="bench-lz4-")
    output = os.path.join(directory, "out.lz4")
    runs: dict[str, list[dict[str, float]]] = {"reference": [], "pipeline": []}
    ok = True
    load = OtherLoad()
    try:
        run_pipeline(lz, path, output, brick)  # warm-up: imports, first threads, page cache
        for i in range(rounds):
            order = ("reference", "pipeline") if i % 2 == 0 else ("pipeline", "reference")
            for which in order:
                if which == "reference":
                    runs[which].append(run_reference(lz, path, directory))
                else:
                    runs[which].append(run_pipeline(lz, path, output, brick))
                    ok &= lz.round_trip_ok(data, output)  # outside the timing
            ref, pipe = runs["reference"][-1], runs["pipeline"][-1]
            print(f"  round {i + 1}/{rounds}: lz4.frame {ref['wall'] * 1e3:.1f} ms, pipeline "
                  f"{pipe['wall'] * 1e3:.1f} ms ({pipe['cpu'] / pipe['wall']:.2f} cores): "
                  f"{ref['wall'] / pipe['wall']:.2f}x", file=log, flush=True)
        frame_ratio = os.path.getsize(output) / max(1, len(data))
    finally:
        for name in os.listdir(directory):
            os.unlink(os.path.join(directory, name))
        os.rmdir(directory)
    other = load.cpus()
    out: dict[str, Any] = {"bytes": len(data), "frame_ratio": frame_ratio, "round_trip_ok": ok,
                           "other_load_cpus": other}
    for which, rs in runs.items():
        walls = [r["wall"] for r in rs]
        out[which] = {"wall_s": spread(walls), "best_s": min(walls),
                      "cores": spread([r["cpu"] / r["wall"] for r in rs]),
                      "check_s": [r["check"] for r in rs], "walls_s": walls}
    ratios = [r["wall"] / p["wall"] for r, p in zip(runs["reference"], runs["pipeline"])]
    out["ratio_best"] = out["reference"]["best_s"] / out["pipeline"]["best_s"]
    out["ratio_pairs"] = spread(ratios)
    return out


def timing_checks(m: dict[str, Any]) -> list[dict[str, Any]]:
    """Each run's stopwatch against its second timing."""
    rows = []
    for which in ("reference", "pipeline"):
        for wall, check in zip(m[which]["walls_s"], m[which]["check_s"]):
            rows.append({"what": which, "stopwatch_s": wall, "second_s": check,
                         "agree": abs(check - wall) <= CHECK_TOLERANCE * wall})
    return rows


def print_table(results: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    cfg, m = results["config"], results["lz4"]
    mb = m["bytes"] / 1e6
    print(f"LZ4 frame of {mb:.1f} MB of text-like data (frame {m['frame_ratio']:.3f} of it), "
          f"bricks of {cfg['brick']} blocks, {cfg['rounds']} rounds interleaved; "
          f"{cfg['cpus']} CPUs, other load {_cpus(m['other_load_cpus'])} CPUs "
          f"(at start {_cpus(cfg['busy_cpus_at_start'])})")
    print(f"  {'':32} {'best MB/s':>10} {'median MB/s':>12} {'cores':>11}")
    for which, label in (("reference", "lz4.frame.compress, 1 thread"),
                         ("pipeline", f"aaccl pipeline, bricks of {cfg['brick']}")):
        r = m[which]
        print(f"  {label:32} {mb / r['best_s']:10.1f} {mb / r['wall_s']['median']:12.1f} "
              f"{r['cores']['median']:5.2f} med")
    pairs = m["ratio_pairs"]
    row = rows[0]
    print(f"  pipeline vs lz4.frame: {m['ratio_best']:.2f}x best against best "
          f"(run by run: median {pairs['median']:.2f}x, {pairs['min']:.2f}x-{pairs['max']:.2f}x); "
          f"target >= {TARGET}x: {verdict(row['pass'])}")
    print(f"  round trip (lz4.frame.decompress of every pipeline frame == input): "
          f"{'ok' if m['round_trip_ok'] else 'FAILED'}")
    other = m["other_load_cpus"]
    if other is not None and other > 0.3:
        print(f"  WARNING: other processes kept {other:.2f} CPUs busy meanwhile: the pipeline "
              "wants both cores, so this ratio understates it")
    bad = [c for c in results["timing_checks"] if not c["agree"]]
    if bad:
        for c in bad:
            print(f"  WARNING: {c['what']} stopwatch {c['stopwatch_s'] * 1e3:.1f} ms, second "
                  f"timing {c['second_s'] * 1e3:.1f} ms: more than "
                  f"{CHECK_TOLERANCE:.0%} apart")
    else:
        print(f"  timing check: every stopwatch within {CHECK_TOLERANCE:.0%} of its second "
              "timing")


def _cpus(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=None,
                        help="MiB of text-like data to compress (default 64, --quick: 16)")
    parser.add_argument("--input", metavar="FILE", help="compress FILE instead of generated data")
    parser.add_argument("--rounds", type=int, default=None,
                        help="runs of each, interleaved (default 5, --quick: 3)")
    parser.add_argument("--brick", type=int, default=8, help="1 MiB blocks per brick (default 8)")
    parser.add_argument("--quick", action="store_true", help="16 MiB, 3 rounds: a smoke test")
    parser.add_argument("--json", nargs="?", const="-", metavar="PATH",
                        help="write the results as JSON to PATH (or stdout: -) too")
    parser.add_argument("--check", action="store_true",
                        help="exit with status 1 if the target is missed or a round trip fails")
    args = parser.parse_args()
    size_mib = args.size_mib or (16 if args.quick else 64)
    rounds = args.rounds or (3 if args.quick else 5)
    if rounds < 1 or args.brick < 1 or size_mib < 1:
        parser.error("--rounds, --brick and --size-mib are at least 1")
    log = sys.stderr if args.json == "-" else sys.stdout
    lz = load_example()
    config = {"size_mib": size_mib, "rounds": rounds, "brick": args.brick,
              "cpus": os.cpu_count(), "python": platform.python_version(),
              "numpy": np.__version__, "quick": args.quick, "input": args.input,
              "busy_cpus_at_start": busy_cpus()}
    with tempfile.TemporaryDirectory(prefix="bench-lz4-in-") as tmp:
        path = args.input
        if path is None:
            path = os.path.join(tmp, "input.txt")
            print(f"generating {size_mib} MiB of text-like data...", file=log, flush=True)
            with open(path, "wb") as f:
                f.write(lz.text_like(size_mib * MiB))
        else:
            config["size_mib"] = os.path.getsize(path) / MiB
        print(f"{rounds} rounds of lz4.frame and the pipeline, interleaved...", file=log,
              flush=True)
        m = measure(lz, path, rounds, args.brick, log)
    ok = m["ratio_best"] >= TARGET
    rows = [{"target": "lz4_pipeline_vs_lz4_frame", "value": m["ratio_best"], "pass": ok}]
    results = {"config": config, "lz4": m, "targets": TARGETS, "verdicts": rows}
    results["timing_checks"] = timing_checks(m)
    report(results, rows, args.json, print_table)
    return 1 if args.check and not (ok and m["round_trip_ok"]) else 0


if __name__ == "__main__":
    sys.exit(main())
