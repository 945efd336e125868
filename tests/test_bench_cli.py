"""`aaccl bench`: the sweep's pure parts (sizes, bus factors, references, rows), real
in-process sweeps through `aaccl.cli.main`, failures it must report, and one run
under MPI where only rank 0 may print."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aaccl
from aaccl import ReduceFunction
from aaccl.cli import _bench, main
from aaccl.cli._bench import (
    Case,
    Expected,
    Progress,
    Row,
    UsageError,
    bandwidths,
    bus_factor,
    call_count,
    count_wrong,
    expected,
    fit,
    format_row,
    format_table,
    make_rows,
    parse_size,
    plan,
    progress_line,
    rank_input,
    size_bytes,
    sizes,
)

ROOT = Path(__file__).resolve().parents[1]
QUICK = ["-n", "2", "-w", "1"]  # two timed iterations after one warm-up: fast, still real
ROW = re.compile(r"^\s+\d+\s+\d+\s+\w+\s+\w+\s+-?\d+\s")


def bench(*args: str) -> int:
    """`aaccl bench ...` in this process; its exit status (argparse's included)."""
    try:
        return main(["bench", *args])
    except SystemExit as exc:
        return int(exc.code or 0)


def table(out: str) -> dict[str, list[list[str]]]:
    """The printed rows, by op section: each row split into its columns."""
    sections: dict[str, list[list[str]]] = {}
    current = None
    for line in out.splitlines():
        if ROW.match(line):
            assert current is not None, line
            sections[current].append(line.split())
        elif re.fullmatch(r"# (\w+)", line):
            current = line[2:]
            sections[current] = []
    return sections


# -- sizes ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "size"), [
    ("8", 8), ("1K", 1024), ("1k", 1024), ("64K", 65536), ("1M", 1 << 20), ("1.5M", 3 << 19),
    ("2G", 2 << 30), (" 16 ", 16),
])
def test_sizes_take_nccl_tests_suffixes(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "1X", "K", "-8", "1KB", "eight"])
def test_bad_sizes_are_usage_errors(text: str) -> None:
    with pytest.raises(UsageError):
        parse_size(text)


def test_sweep_multiplies_up_to_maxbytes() -> None:
    assert sizes(8, 1024, 2) == [8, 16, 32, 64, 128, 256, 512, 1024]
    assert sizes(8, 1000, 4) == [8, 32, 128, 512]  # stops below a maxbytes it cannot hit
    assert sizes(100, 100, 2) == [100]
    for bad in ((0, 8, 2), (16, 8, 2), (8, 64, 1)):
        with pytest.raises(UsageError):
            sizes(*bad)


def test_counts_are_whole_elements_per_rank() -> None:
    """Whole-array ops split the size over the ranks in whole elements, and report
    the bytes they really move (nccl-tests' rounding)."""
    assert call_count("allgather", 40, 8, 4) == 1  # 5 float64 -> 1 per rank
    assert size_bytes("allgather", 1, 8, 4) == 32
    assert call_count("allreduce", 10, 4, 4) == 2  # 2.5 float32 -> 2 whole elements
    assert call_count("alltoall", 8, 4, 4) == 0  # 2 float32 over 4 ranks: nothing each
    cases = plan(["scatter", "gather", "allgather", "reduce_scatter", "alltoall",
                  "allreduce", "bcast", "sendrecv", "reduce"], [np.float64, np.int32],
                 [ReduceFunction.SUM], 0, sizes(8, 1 << 12, 3), 3)
    for case in cases:
        per_rank = 3 if case.op in ("scatter", "gather", "allgather", "reduce_scatter",
                                    "alltoall") else 1
        assert case.nbytes == case.count * case.dtype.itemsize * per_rank
        assert case.nbytes <= max(s for s in sizes(8, 1 << 12, 3) if s >= case.nbytes)
    assert [c.count for c in cases if c.op == "allgather" and c.dtype == np.float64] == \
           [n // 8 // 3 for n in sizes(8, 1 << 12, 3)]


def test_plan_orders_cases_and_names_roots_and_redops() -> None:
    cases = plan(["bcast", "allreduce"], [np.float32], [ReduceFunction.SUM, ReduceFunction.MAX],
                 2, [8, 16], 4)
    assert [(c.op, c.redop_name, c.root, c.nbytes) for c in cases] == [
        ("bcast", "none", 2, 8), ("bcast", "none", 2, 16),
        ("allreduce", "sum", -1, 8), ("allreduce", "sum", -1, 16),
        ("allreduce", "max", -1, 8), ("allreduce", "max", -1, 16)]
    with pytest.raises(UsageError, match="root 4"):
        plan(["bcast"], [np.float32], [ReduceFunction.SUM], 4, [8], 4)


# -- bandwidths ----------------------------------------------------------------------------

@pytest.mark.parametrize(("op", "factor"), [
    ("allreduce", 2 * 3 / 4), ("reduce_scatter", 3 / 4), ("allgather", 3 / 4),
    ("alltoall", 3 / 4), ("gather", 3 / 4), ("scatter", 3 / 4),
    ("bcast", 1.0), ("reduce", 1.0), ("sendrecv", 1.0),
])
def test_bus_factors_are_nccl_tests(op: str, factor: float) -> None:
    assert bus_factor(op, 4) == pytest.approx(factor)
    algbw, busbw = bandwidths(op, 4_000_000, 0.002, 4)
    assert algbw == pytest.approx(2.0)  # GB/s: 10^9 bytes
    assert busbw == pytest.approx(2.0 * factor)


def test_one_rank_moves_nothing_over_a_bus() -> None:
    assert bus_factor("allreduce", 1) == 0.0
    assert bus_factor("bcast", 1) == 1.0


# -- references ----------------------------------------------------------------------------

def world(nranks: int, elements: int) -> list[np.ndarray]:
    return [rank_input(r, 0, elements, np.int64) for r in range(nranks)]


def test_references_follow_each_collective() -> None:
    n, c = 3, 4
    full = world(n, c * n)
    head = [x[:c] for x in full]

    def want(op: str, rank: int, redop: ReduceFunction | None = None, root: int = 1) -> Any:
        ref = expected(Case(op, np.dtype(np.int32), redop, root, c, 0), rank, n)
        return None if ref is None else ref.values.tolist()

    assert want("sendrecv", 0) == head[2].tolist()
    assert want("bcast", 2) == head[1].tolist()
    assert want("scatter", 2) == full[1][2 * c:3 * c].tolist()
    assert want("gather", 1) == np.concatenate(head).tolist()
    assert want("gather", 0) is None  # non-roots get nothing
    assert want("reduce", 0, ReduceFunction.SUM) is None
    assert want("reduce", 1, ReduceFunction.MAX) == np.max(head, axis=0).tolist()
    assert want("allgather", 0) == np.concatenate(head).tolist()
    assert want("allreduce", 2, ReduceFunction.SUM) == np.sum(head, axis=0).tolist()
    assert want("reduce_scatter", 1, ReduceFunction.SUM) == \
        np.sum([x[c:2 * c] for x in full], axis=0).tolist()
    assert want("alltoall", 2) == np.concatenate([x[2 * c:3 * c] for x in full]).tolist()


def test_inputs_differ_between_ranks_and_stay_small() -> None:
    a, b = rank_input(0, 0, 100, np.int32), rank_input(1, 0, 100, np.int32)
    assert (a != b).any()
    assert a.min() >= -8 and a.max() <= 8
    assert rank_input(1, 10, 20, np.float16).tolist() == b[10:20].tolist()


def test_float_sums_allow_rounding_only_there() -> None:
    case = Case("allreduce", np.dtype(np.float16), ReduceFunction.SUM, -1, 5, 10)
    ref = expected(case, 0, 4)
    assert ref is not None and ref.tolerance is not None
    assert (ref.tolerance > 0).all() and (ref.tolerance < 0.1).all()
    for exact in (Case("allreduce", np.dtype(np.float16), ReduceFunction.MAX, -1, 5, 10),
                  Case("allreduce", np.dtype(np.int32), ReduceFunction.SUM, -1, 5, 20),
                  Case("allgather", np.dtype(np.float32), None, -1, 5, 80)):
        got = expected(exact, 0, 4)
        assert got is not None and got.tolerance is None


def test_count_wrong() -> None:
    exact = Expected(np.array([1, 2, 3], np.int64))
    assert count_wrong(np.array([1, 2, 3], np.int32), exact) == 0
    assert count_wrong(np.array([1, 0, np.iinfo(np.int32).min], np.int32), exact) == 2
    rounded = Expected(np.array([1.0, 2.0, 3.0]), np.array([0.01, 0.01, 0.01]))
    assert count_wrong(np.array([1.005, 2.0, np.nan], np.float32), rounded) == 1  # NaN misses
    assert count_wrong(np.array([1.5, 2.0, 3.0], np.float32), rounded) == 1


# -- rows ----------------------------------------------------------------------------------

def test_rows_take_the_slowest_rank_and_add_wrong_elements() -> None:
    cases = [Case("allreduce", np.dtype(np.float32), ReduceFunction.SUM, -1, 256, 1024)]
    rows = make_rows(cases, [[1e-6], [4e-6]], [[0], [3]], 2)
    (row,) = rows
    assert (row.op, row.size_bytes, row.count, row.type, row.redop, row.root, row.wrong) == \
        ("allreduce", 1024, 256, "float32", "sum", -1, 3)
    assert (row.time_us, row.algbw_gbps, row.busbw_gbps) == pytest.approx((4.0, 0.256, 0.256))
    unchecked = make_rows(cases, [[1e-6], [1e-6]], [[None], [None]], 2)
    assert unchecked[0].wrong is None


def test_numbers_fit_their_columns() -> None:
    assert fit(12.3456, 7) == "  12.35"
    assert fit(1234.5678, 7) == "1234.57"
    assert fit(123456.7, 7) == " 123457"  # decimals go first
    assert fit(3.2e9, 6) == " 3e+09"  # then the exponent comes in
    line = format_row(Row("bcast", 1024, 256, "float32", "none", 0, 12.5, 0.08, 0.08, None))
    assert line.split() == ["1024", "256", "float32", "none", "0", "12.50", "0.08", "0.08", "N/A"]


def test_table_summarizes_like_nccl_tests() -> None:
    rows = [Row("allreduce", 8, 2, "float32", "sum", -1, 5.0, 1.0, 1.5, 0),
            Row("allgather", 8, 1, "float32", "none", -1, 5.0, 1.0, 0.5, 2)]
    lines = format_table(rows)
    assert "# allreduce" in lines and "# allgather" in lines
    assert "# Out of bounds values : 1 FAILED" in lines
    assert "# Avg bus bandwidth    : 1" in lines


def test_progress_draws_only_on_a_terminal() -> None:
    assert progress_line(3, 12, "bcast 8 B", width=8) == "[##......] 3/12 bcast 8 B"

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    shown, hidden = Terminal(), io.StringIO()
    for stream in (shown, hidden):
        bar = Progress(2, stream, delay=0.0)
        bar.advance("a")
        bar.advance("b")
        bar.close()
    assert "2/2 b" in shown.getvalue() and shown.getvalue().endswith("\r\033[K")
    assert hidden.getvalue() == ""


# -- real sweeps -------------------------------------------------------------------------

def test_inprocess_sweep_of_every_collective(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench("-b", "8", "-e", "1K", "--ranks", "3", "-r", "2", *QUICK) == 0
    out = capsys.readouterr().out
    assert "#  nranks 3  device soft  fabric inprocess" in out
    sections = table(out)
    assert list(sections) == list(_bench.OPS)
    for op, rows in sections.items():
        assert len(rows) == 8, op  # 8, 16, ..., 1024
        for size, count, dtype, redop, root, time_us, _, _, wrong in rows:
            assert dtype == "float32" and wrong == "0", (op, size)
            assert root == ("2" if op in _bench.ROOTED else "-1")
            assert redop == ("sum" if op in _bench.REDUCING else "none")
            assert float(time_us) > 0
            assert int(size) == size_bytes(op, int(count), 4, 3)
    assert [r[0] for r in sections["allreduce"]] == [str(s) for s in sizes(8, 1024, 2)]
    assert [r[0] for r in sections["allgather"]][:3] == ["0", "12", "24"]  # 3 ranks' whole rows
    assert "# Out of bounds values : 0 OK" in out
    assert out.count("# Avg bus bandwidth") == 1


def test_every_dtype_and_redop(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench("-b", "64", "-e", "128", "-d", "all", "-o", "all", "--ops",
                 "reduce_scatter,reduce", *QUICK) == 0
    rows = [r for rows in table(capsys.readouterr().out).values() for r in rows]
    assert {(r[2], r[3]) for r in rows} == {(d, o) for d in _bench.DTYPES for o in ("sum", "max")}
    assert all(r[-1] == "0" for r in rows)


def test_json_lists_the_rows_and_the_runs_settings(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench("-b", "8", "-e", "64", "--ops", "allreduce,alltoall", "--json", "--ranks", "3",
                 *QUICK) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"settings", "versions", "ranks", "notes", "rows"}
    rows = out["rows"]
    assert [(r["op"], r["size_bytes"]) for r in rows] == \
        [("allreduce", s) for s in (8, 16, 32, 64)] + [("alltoall", s) for s in (0, 12, 24, 60)]
    assert set(rows[0]) == {"op", "size_bytes", "count", "type", "redop", "root", "time_us",
                            "algbw_gbps", "busbw_gbps", "wrong"}
    assert all(r["wrong"] == 0 and r["time_us"] > 0 for r in rows)
    for r in rows:  # the units the keys name: bytes / microseconds = 10^9 bytes/s * 1000
        assert r["algbw_gbps"] == pytest.approx(r["size_bytes"] / r["time_us"] / 1e3)
    assert out["settings"] == {
        "nranks": 3, "device": "soft", "fabric": "inprocess", "ops": ["allreduce", "alltoall"],
        "dtypes": ["float32"], "redops": ["sum"], "root": 0, "minbytes": 8, "maxbytes": 64,
        "stepfactor": 2, "warmup_iters": 1, "iters": 2, "check": True, "nbufs": 16,
        "bufsize_bytes": 1024, "timeout_s": 10.0}
    assert out["versions"]["aaccl"] == aaccl.__version__
    assert out["versions"]["numpy"] == np.__version__
    assert out["versions"]["python"] == platform.python_version()
    assert [r["rank"] for r in out["ranks"]] == [0, 1, 2]
    assert {r["pid"] for r in out["ranks"]} == {os.getpid()}


def test_no_rank_checks_while_another_is_timed(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """In-process ranks share one event loop: a result check (numpy, blocking) that
    ran while another rank's clock ran would be timed as that rank's call. Every
    rank reads the clock twice per case (start, stop); all of a case's readings come
    before any rank checks that case."""
    events: list[str] = []
    real_clock, real_check = _bench.time.perf_counter, _bench._check

    class Clock:
        monotonic = staticmethod(time.monotonic)

        @staticmethod
        def perf_counter() -> float:
            events.append("clock")
            return real_clock()

    def check(*args: Any) -> int:
        events.append("check")
        return real_check(*args)

    monkeypatch.setattr(_bench, "time", Clock)
    monkeypatch.setattr(_bench, "_check", check)
    nranks, ncases = 3, 2 * 3  # two ops, three sizes
    assert bench("-b", "64K", "-e", "256K", "--ops", "allreduce,allgather", "--ranks",
                 str(nranks), *QUICK) == 0
    assert events.count("check") == nranks * ncases
    assert events.count("clock") == 2 * nranks * ncases
    readings = 0
    for event in events:
        if event == "clock":
            readings += 1
        else:  # no rank is between its start and stop readings
            assert readings % (2 * nranks) == 0, events
    capsys.readouterr()


def test_checked_and_unchecked_times_agree(monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """What a rank spends checking its result must not show in the times: with a
    check that costs far more than the call (each reference built ten times), times
    with and without --no-check still agree, within 3x (the machine is noisy:
    checked and unchecked runs alternate, and the medians are compared)."""
    right = _bench.expected

    def costly(case: Case, rank: int, nranks: int) -> Expected | None:
        for _ in range(9):
            right(case, rank, nranks)
        return right(case, rank, nranks)

    monkeypatch.setattr(_bench, "expected", costly)
    args = ["-b", "256K", "-e", "1M", "--ops", "allreduce", "--ranks", "4", "-n", "3", "-w", "1",
            "--json"]
    runs: dict[bool, list[list[float]]] = {True: [], False: []}
    for _ in range(2):
        for checked in (True, False):
            assert bench(*args, *([] if checked else ["--no-check"])) == 0
            rows = json.loads(capsys.readouterr().out)["rows"]
            runs[checked].append([row["time_us"] for row in rows])
    checked_us, unchecked_us = (statistics.median(t for run in runs[c] for t in run)
                                for c in (True, False))
    assert 1 / 3 < checked_us / unchecked_us < 3, runs


def test_a_wrong_reference_fails_the_run(monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    right = _bench.expected

    def off_by_one(case: Case, rank: int, nranks: int) -> Expected | None:
        ref = right(case, rank, nranks)
        if ref is not None and case.op == "allreduce":
            ref.values = ref.values + 1
        return ref

    monkeypatch.setattr(_bench, "expected", off_by_one)
    assert bench("-b", "8", "-e", "32", "--ops", "allreduce,bcast", *QUICK) == 1
    out = capsys.readouterr().out
    sections = table(out)
    assert [r[-1] for r in sections["allreduce"]] == ["8", "16", "32"]  # every rank's elements
    assert all(r[-1] == "0" for r in sections["bcast"])
    assert "# Out of bounds values : 3 FAILED" in out


def test_corrupted_device_data_is_counted(monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Rank 1's device input loses an element: the result is wrong everywhere it
    reaches, and the check sees it through the device copy."""
    prepare = _bench._prepare

    def corrupt(accl: Any, case: Case, sbuf: Any, rbuf: Any) -> None:
        prepare(accl, case, sbuf, rbuf)
        if accl.rank == 1 and case.count:
            sbuf[:1] = 100
            sbuf[:1].sync_to_device()

    monkeypatch.setattr(_bench, "_prepare", corrupt)
    assert bench("-b", "16", "-e", "16", "--ops", "allgather,allreduce", "--json", *QUICK) == 1
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["op"], r["wrong"]) for r in rows] == [("allgather", 4), ("allreduce", 4)]


def test_no_check_skips_the_reference(monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(_bench, "expected", lambda *a: pytest.fail("checked"))
    assert bench("-b", "8", "-e", "16", "--ops", "gather", "--no-check", *QUICK) == 0
    out = capsys.readouterr().out
    assert all(r[-1] == "N/A" for r in table(out)["gather"])
    assert "# Out of bounds values : 0 N/A" in out


@pytest.mark.parametrize("args", [
    ["-b", "2K", "-e", "1K"], ["-b", "1X"], ["-e", "0"], ["-f", "1"], ["-n", "0"],
    ["-w", "-1"], ["--ops", "allreduce,nope"], ["-d", "float8"], ["-o", "min"],
    ["-r", "4"], ["--ranks", "2", "-r", "2"], ["--device", "gpu"],
    ["--device", "emulator", "--fabric", "inprocess"], ["--device", "emulator", "--ops", "alltoall"],
    ["--bufsize", "12"], ["--timeout", "0"], ["-e", "16G", "-d", "float16"],
])
def test_usage_errors_exit_2(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert bench(*args) == 2
    assert "error" in capsys.readouterr().err


# -- under MPI -----------------------------------------------------------------------------

def _mpiexec() -> str | None:
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


@pytest.mark.skipif(_mpiexec() is None or importlib.util.find_spec("mpi4py") is None,
                    reason="no MPI: pip install 'aaccl[mpi]'")
def test_under_mpi_only_rank_0_prints() -> None:
    """`aaccl launch -n 2 -m aaccl bench ...`, as `aaccl bench --help` gives it."""
    cmd = [sys.executable, "-m", "aaccl", "launch", "-n", "2", "-m", "aaccl", "bench",
           "-b", "8", "-e", "64", "--ops", "allreduce", "--json", *QUICK]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"aaccl bench under MPI hangs\n{out}\n{err}")
    assert proc.returncode == 0, f"{out}\n{err}"
    run = json.loads(out)  # one document: only rank 0 printed
    assert run["settings"]["nranks"] == 2 and run["settings"]["fabric"] == "mpi"
    assert {"mpi4py", "mpi"} <= set(run["versions"]) and run["versions"]["mpi"]  # its library
    assert [r["rank"] for r in run["ranks"]] == [0, 1]
    assert len({r["pid"] for r in run["ranks"]}) == 2  # one process each
    rows = run["rows"]
    assert [r["size_bytes"] for r in rows] == [8, 16, 32, 64] and all(r["wrong"] == 0 for r in rows)
