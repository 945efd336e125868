"""benchmarks/bench_mpi.py's bookkeeping: what `--cold-mib` does before an iteration,
and that its verdicts never bind (the targets are set with warm caches). Its timings
are not tested: a timed unit test is noise on a shared machine."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
from conftest import benchmark_module

bench_mpi = benchmark_module("bench_mpi")


class _Comm:
    """What Timer uses of an MPI communicator: its rank and a barrier, counted."""

    def __init__(self) -> None:
        self.barriers = 0

    def Get_rank(self) -> int:  # noqa: N802  (mpi4py's name)
        return 0

    def Barrier(self) -> None:  # noqa: N802
        self.barriers += 1


def test_a_cold_timer_streams_its_megabytes_before_each_barrier() -> None:
    comm, other = _Comm(), _Comm()
    warm, cold = bench_mpi.Timer(comm), bench_mpi.Timer(comm, cold_mib=2)
    assert warm._flush is None
    assert cold._flush.nbytes == 2 * bench_mpi.MiB
    warm.barrier()
    cold.barrier(other)  # (the floor's own communicator)
    assert (comm.barriers, other.barriers) == (1, 1)


def _results(cold_mib: float) -> dict[str, Any]:
    times = {"small": {"median": 1e-5}, "large": {"median": 1e-2}}
    return {"config": {"counts": {"small": 1, "large": 4 << 20}, "size_mib": 16,
                       "bytes": {"small": 4, "large": 16 << 20}, "cold_mib": cold_mib},
            "runs": [{"procs": 2, "results": {side: times for side in bench_mpi.SIDES}}]}


def test_only_warm_runs_are_judged_against_the_targets() -> None:
    def binding(cold_mib: float) -> list[tuple[str, str]]:
        return [(row["size"], row["side"]) for row in bench_mpi.evaluate(_results(cold_mib))
                if row["binding"]]

    assert binding(0) == [("small", "aaccl_device"), ("large", "aaccl_device")]
    assert binding(32) == []
    judged = [row for row in bench_mpi.evaluate(_results(32)) if row["judged"]]
    assert len(judged) == 2 and all(row["pass"] is not None for row in judged)  # (info)


def test_nonsense_cold_sizes_are_refused_before_anything_runs() -> None:
    assert bench_mpi.cold_mib("0") == 0 and bench_mpi.cold_mib("2.5") == 2.5
    for text in ("-1", "abc", "nan", "inf", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="MiB"):
            bench_mpi.cold_mib(text)
