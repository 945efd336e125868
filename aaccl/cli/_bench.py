"""`aaccl bench`: sweep message sizes over aaccl's collectives, like nccl-tests.

    aaccl bench -b 8 -e 1M -f 2 --ops allreduce,allgather     # 4 in-process ranks
    aaccl launch -n 4 -m aaccl bench -b 8 -e 1M               # one rank per process

Sizes, bandwidths and the table follow nccl-tests (doc/PERFORMANCE.md): `size` is
the largest buffer a rank touches, so for scatter, gather, allgather, alltoall and
reduce_scatter it is the whole array (count per rank * nranks); algbw = size / time;
busbw = algbw * a per-collective factor that makes it comparable across rank counts.

The sweep is planned and judged by pure functions (`sizes`, `plan`, `bus_factor`,
`expected`, `count_wrong`, `make_rows`, `format_table`); `run_rank` is the only part
that talks to a device, and `main` the only one that prints.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import socket
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import IO, Any, cast

import numpy as np

import aaccl

from .._constants import ReduceFunction

if sys.version_info < (3, 11):
    from exceptiongroup import ExceptionGroup

OPS = ("sendrecv", "bcast", "scatter", "gather", "reduce", "allgather", "allreduce",
       "reduce_scatter", "alltoall")
ROOTED = frozenset({"bcast", "scatter", "gather", "reduce"})
REDUCING = frozenset({"reduce", "allreduce", "reduce_scatter"})
# (elements in, elements out) per rank, in units of `count`: "n" means count * nranks.
# The ops with an "n" side are those whose nccl-tests size is the whole array.
LAYOUT: dict[str, tuple[int | str, int | str]] = {
    "sendrecv": (1, 1), "bcast": (1, 1), "scatter": ("n", 1), "gather": (1, "n"),
    "reduce": (1, 1), "allgather": (1, "n"), "allreduce": (1, 1),
    "reduce_scatter": ("n", 1), "alltoall": ("n", "n"),
}
DTYPES = {"float16": np.float16, "float32": np.float32, "float64": np.float64,
          "int32": np.int32, "int64": np.int64}
DTYPE_ALIASES = {"half": "float16", "float": "float32", "double": "float64", "int": "int32"}
REDOPS = {"sum": ReduceFunction.SUM, "max": ReduceFunction.MAX}
UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}  # binary, as in nccl-tests
MAX_COUNT = 2**32 - 1  # the CCLO's count field is 32 bits
EMULATOR_CANNOT = ("alltoall",)  # needs rendezvous, which the emulator's stacks lack


class UsageError(ValueError):
    """Arguments that cannot make a sweep: exit status 2, like argparse's errors."""


# -- the plan (pure) -------------------------------------------------------------------------

def parse_size(text: str) -> int:
    """Bytes from nccl-tests' notation: `8`, `64K`, `1.5M`, `1G` (binary units)."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmg]?)\s*", text, re.IGNORECASE)
    if found is None:
        raise UsageError(f"invalid size {text!r}: use bytes with an optional K, M or G suffix")
    return int(float(found[1]) * UNITS[found[2].lower()])


def sizes(minbytes: int, maxbytes: int, stepfactor: int) -> list[int]:
    """The sizes nccl-tests sweeps: minbytes, times stepfactor, up to maxbytes."""
    if minbytes < 1:
        raise UsageError(f"minbytes must be at least 1, got {minbytes}")
    if maxbytes < minbytes:
        raise UsageError(f"maxbytes {maxbytes} is below minbytes {minbytes}")
    if stepfactor < 2:
        raise UsageError(f"stepfactor must be at least 2, got {stepfactor}")
    out, size = [], minbytes
    while size <= maxbytes:
        out.append(size)
        size *= stepfactor
    return out


def _chunks(side: int | str, nranks: int) -> int:
    return nranks if side == "n" else int(side)


def io_elements(op: str, count: int, nranks: int) -> tuple[int, int]:
    """Elements a rank's send and receive buffers need for one call with `count`."""
    ins, outs = LAYOUT[op]
    return count * _chunks(ins, nranks), count * _chunks(outs, nranks)


def whole_array(op: str) -> bool:
    """True where nccl-tests' size is count per rank times nranks."""
    return "n" in LAYOUT[op]


def call_count(op: str, nbytes: int, itemsize: int, nranks: int) -> int:
    """The call's `count` for a swept size: whole elements, and for whole-array ops
    whole elements per rank (nccl-tests' rounding, without its 16-byte alignment,
    which only GPU kernels need)."""
    elements = nbytes // itemsize
    return elements // nranks if whole_array(op) else elements


def size_bytes(op: str, count: int, itemsize: int, nranks: int) -> int:
    """nccl-tests' size column: the bytes of the largest buffer of one rank."""
    return count * itemsize * (nranks if whole_array(op) else 1)


def bus_factor(op: str, nranks: int) -> float:
    """nccl-tests' busbw / algbw: the share of the data that must cross a rank's link.
    Broadcast and reduce funnel everything through the root, sendrecv is one link."""
    if op == "allreduce":
        return 2 * (nranks - 1) / nranks
    if op in ("reduce_scatter", "allgather", "alltoall", "gather", "scatter"):
        return (nranks - 1) / nranks
    if op in ("bcast", "reduce", "sendrecv"):
        return 1.0
    raise ValueError(f"unknown op {op!r}")


def bandwidths(op: str, nbytes: int, seconds: float, nranks: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (10^9 bytes, as nccl-tests)."""
    algbw = nbytes / seconds / 1e9 if seconds > 0 else 0.0
    return algbw, algbw * bus_factor(op, nranks)


@dataclass(frozen=True)
class Case:
    """One row of the sweep: a call every rank makes with the same arguments."""

    op: str
    dtype: np.dtype
    redop: ReduceFunction | None  # None: the op does not reduce
    root: int  # -1: the op has no root
    count: int  # the call's count (per rank where the op chunks its buffers)
    nbytes: int  # nccl-tests' size

    @property
    def redop_name(self) -> str:
        return "none" if self.redop is None else self.redop.name.lower()


def plan(ops: Sequence[str], dtypes: Sequence[Any], redops: Sequence[ReduceFunction],
         root: int, swept: Sequence[int], nranks: int) -> list[Case]:
    """Every case of the sweep, op by op; the same list on every rank."""
    if not 0 <= root < nranks:
        raise UsageError(f"root {root} is out of range for {nranks} ranks")
    cases = []
    for op in ops:
        for dt in map(np.dtype, dtypes):
            for redop in (redops if op in REDUCING else [None]):
                for nbytes in swept:
                    count = call_count(op, nbytes, dt.itemsize, nranks)
                    if max(io_elements(op, count, nranks)) > MAX_COUNT:
                        raise UsageError(f"{nbytes} bytes of {dt.name} is more than the "
                                         f"CCLO's {MAX_COUNT} elements")
                    cases.append(Case(op, dt, redop, root if op in ROOTED else -1, count,
                                      size_bytes(op, count, dt.itemsize, nranks)))
    return cases


# -- data and its reference (pure) -----------------------------------------------------------

def rank_input(rank: int, start: int, stop: int, dtype: Any) -> np.ndarray:
    """Elements [start, stop) of `rank`'s input: small integers in [-8, 8], so sums
    over up to 256 ranks are exact in every dtype, and every rank's data differs."""
    i = np.arange(start, stop, dtype=np.int64)
    return ((i * 3 + rank * 7) % 17 - 8).astype(dtype)


def fill_value(dtype: Any) -> Any:
    """What an output buffer holds before the call: never a right answer."""
    dt = np.dtype(dtype)
    return np.nan if dt.kind == "f" else np.iinfo(dt).min


@dataclass
class Expected:
    """What a rank's output must hold; `tolerance` (per element) for float sums,
    whose rounding depends on the order the device adds in."""

    values: np.ndarray  # float64 or int64
    tolerance: np.ndarray | None = None


def _reduced(case: Case, nranks: int, start: int, stop: int) -> Expected:
    exact = np.int64 if case.dtype.kind == "i" else np.float64
    acc: np.ndarray | None = None
    magnitude = np.zeros(stop - start)
    for rank in range(nranks):
        x = rank_input(rank, start, stop, exact)
        if acc is None:
            acc = x.copy()
        elif case.redop == ReduceFunction.SUM:
            acc += x
        else:
            np.maximum(acc, x, out=acc)
        magnitude += np.abs(x)
    assert acc is not None
    if case.dtype.kind != "f" or case.redop != ReduceFunction.SUM:
        return Expected(acc)
    # any summation order of n terms, then the cast to the dtype: within n*eps*sum|x|
    return Expected(acc, nranks * float(np.finfo(case.dtype).eps) * magnitude)


def expected(case: Case, rank: int, nranks: int) -> Expected | None:
    """The reference for `rank`'s output buffer after `case` (None: the rank gets no
    output, as non-roots of gather and reduce), from the ranks' known inputs."""
    c, op, exact = case.count, case.op, (np.int64 if case.dtype.kind == "i" else np.float64)
    if op in ("gather", "reduce") and rank != case.root:
        return None
    if op == "sendrecv":
        return Expected(rank_input((rank - 1) % nranks, 0, c, exact))
    if op == "bcast":
        return Expected(rank_input(case.root, 0, c, exact))
    if op == "scatter":
        return Expected(rank_input(case.root, rank * c, (rank + 1) * c, exact))
    if op in ("gather", "allgather"):
        return Expected(np.concatenate([rank_input(r, 0, c, exact) for r in range(nranks)]))
    if op == "alltoall":
        return Expected(np.concatenate([rank_input(r, rank * c, (rank + 1) * c, exact)
                                        for r in range(nranks)]))
    if op in ("reduce", "allreduce"):
        return _reduced(case, nranks, 0, c)
    if op == "reduce_scatter":
        return _reduced(case, nranks, rank * c, (rank + 1) * c)
    raise ValueError(f"unknown op {op!r}")


def count_wrong(got: np.ndarray, want: Expected) -> int:
    """Elements of `got` that miss the reference (a NaN always does)."""
    if want.tolerance is None:
        return int(np.count_nonzero(got.astype(want.values.dtype) != want.values))
    off = np.abs(got.astype(np.float64) - want.values)
    return int(np.count_nonzero(~(off <= want.tolerance)))


# -- rows and the table (pure) ---------------------------------------------------------------

@dataclass(frozen=True)
class Row:
    """One line of the table, and one object of --json's "rows"."""

    op: str
    size_bytes: int  # nccl-tests' size
    count: int  # elements: the call's count
    type: str
    redop: str
    root: int
    time_us: float  # the slowest rank's mean time per call
    algbw_gbps: float  # 10^9 bytes per second
    busbw_gbps: float
    wrong: int | None  # None: not checked


def make_rows(cases: Sequence[Case], times: Sequence[Sequence[float]],
              wrongs: Sequence[Sequence[int | None]], nranks: int) -> list[Row]:
    """Rows from every rank's results (`times[rank][case]`: mean seconds per call):
    a call takes as long as its slowest rank; wrong elements add up over ranks."""
    rows = []
    for i, case in enumerate(cases):
        seconds = max(t[i] for t in times)
        counted = [w[i] for w in wrongs]
        wrong = None if any(w is None for w in counted) else sum(w or 0 for w in counted)
        algbw, busbw = bandwidths(case.op, case.nbytes, seconds, nranks)
        rows.append(Row(case.op, case.nbytes, case.count, case.dtype.name, case.redop_name,
                        case.root, seconds * 1e6, algbw, busbw, wrong))
    return rows


def fit(value: float, width: int) -> str:
    """`value` in `width` characters, dropping decimals before going exponential
    (nccl-tests' getFloatStr)."""
    for fmt in (".2f", ".1f", ".0f"):
        text = f"{value:{width}{fmt}}"
        if len(text) <= width:
            return text
    return f"{value:{width}.{1 if width >= 7 else 0}e}"


COLUMNS = ("# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s" %
           ("size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong"))
UNITS_LINE = ("# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s" %
              ("(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)"))


def format_row(row: Row) -> str:
    wrong = "N/A" if row.wrong is None else str(row.wrong)
    return (f"{row.size_bytes:12d}  {row.count:12d}  {row.type:>8}  {row.redop:>6}  {row.root:6d}  "
            f"{fit(row.time_us, 7)}  {fit(row.algbw_gbps, 6)}  {fit(row.busbw_gbps, 6)}  "
            f"{wrong:>6}")


def average_busbw(rows: Sequence[Row]) -> float:
    return sum(r.busbw_gbps for r in rows) / len(rows) if rows else 0.0


def format_table(rows: Sequence[Row]) -> list[str]:
    """One section per op (as if each were its own nccl-tests binary), then the
    summary lines."""
    lines: list[str] = []
    for i, row in enumerate(rows):
        if i == 0 or rows[i - 1].op != row.op:
            lines += ["#", f"# {row.op}", COLUMNS, UNITS_LINE.rstrip()]
        lines.append(format_row(row))
    failed = sum(1 for r in rows if r.wrong)
    checked = all(r.wrong is not None for r in rows)
    verdict = ("N/A" if not checked else "FAILED" if failed else "OK")
    lines += ["#", f"# {'Out of bounds values':<20} : {failed} {verdict}",
              f"# {'Avg bus bandwidth':<20} : {average_busbw(rows):g}", "#"]
    return lines


@dataclass(frozen=True)
class RankInfo:
    rank: int
    pid: int
    host: str


def format_header(args: argparse.Namespace, nranks: int, fabric: str,
                  ranks: Sequence[RankInfo], notes: Sequence[str] = ()) -> list[str]:
    lines = [f"# aaccl bench {aaccl.__version__}",
             f"#  nranks {nranks}  device {args.device}  fabric {fabric}",
             f"#  minBytes {args.minbytes} maxBytes {args.maxbytes} step: {args.stepfactor}"
             f"(factor) warmup iters: {args.warmup_iters} iters: {args.iters} validation: "
             f"{0 if args.no_check else 1} nbufs: {args.nbufs} bufsize: {args.bufsize} "
             f"timeout: {args.timeout:g}",
             "#", "# Using devices"]
    lines += [f"#  Rank {r.rank:2d} Pid {r.pid:6d} on {r.host:>10} device {args.device}"
              for r in ranks]
    lines += [f"# {note}" for note in notes]
    return lines


def describe(args: argparse.Namespace, settings: Settings, nranks: int, fabric: str | None,
             ranks: Sequence[RankInfo], notes: Sequence[str],
             versions: dict[str, str]) -> dict[str, Any]:
    """--json's account of the run beside its rows: what ran, where, with which
    software (units in the key names, as in the rows)."""
    return {
        "settings": {
            "nranks": nranks, "device": args.device, "fabric": fabric,
            "ops": list(settings.ops), "dtypes": [np.dtype(d).name for d in settings.dtypes],
            "redops": [r.name.lower() for r in settings.redops], "root": settings.root,
            "minbytes": args.minbytes, "maxbytes": args.maxbytes,
            "stepfactor": args.stepfactor, "warmup_iters": settings.warmup,
            "iters": settings.iters, "check": settings.check, "nbufs": args.nbufs,
            "bufsize_bytes": args.bufsize, "timeout_s": args.timeout,
        },
        "versions": versions,
        "ranks": [asdict(r) for r in ranks],
        "notes": list(notes),
    }


# -- progress (to a terminal only) -----------------------------------------------------------

def progress_line(done: int, total: int, label: str, width: int = 30) -> str:
    filled = width * done // total if total else width
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label}"


class Progress:
    """A one-line bar on a terminal, drawn once a sweep has run for `delay` seconds
    (short sweeps stay quiet), at most ten times a second."""

    def __init__(self, total: int, stream: IO[str], delay: float = 1.0) -> None:
        self.total, self.stream, self.done = total, stream, 0
        self.enabled = stream.isatty()
        self.start = self.last = time.monotonic()
        self.delay, self.drawn = delay, False

    def advance(self, label: str) -> None:
        self.done += 1
        now = time.monotonic()
        if self.enabled and now - self.start >= self.delay and (
                now - self.last >= 0.1 or self.done == self.total):
            self.last, self.drawn = now, True
            self.stream.write("\r\033[K" + progress_line(self.done, self.total, label))
            self.stream.flush()

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\r\033[K")
            self.stream.flush()


# -- running (I/O) ---------------------------------------------------------------------------

@dataclass
class Settings:
    """What every rank needs to run the sweep (the same on every rank)."""

    ops: tuple[str, ...]
    dtypes: tuple[Any, ...]
    redops: tuple[ReduceFunction, ...]
    root: int
    sizes: tuple[int, ...]
    iters: int
    warmup: int
    check: bool
    use_barrier: bool  # ACCL's emulator cannot run a barrier: it syncs with an allreduce


def _start(accl: aaccl.ACCL, case: Case, sbuf: aaccl.Buffer, rbuf: aaccl.Buffer,
           ) -> list[aaccl.Call]:
    """Submit one iteration of `case` on device-resident buffers."""
    op, c, root, func = case.op, case.count, case.root, case.redop
    is_root = accl.rank == root
    if op == "sendrecv":  # a ring, as in nccl-tests: to the next rank, from the previous
        n = accl.size
        return [accl.send(sbuf, c, (accl.rank + 1) % n, from_fpga=True),
                accl.recv(rbuf, c, (accl.rank - 1) % n, to_fpga=True)]
    if op == "bcast":
        return [accl.bcast(sbuf, c, root, from_fpga=True, to_fpga=True)]
    if op == "scatter":
        return [accl.scatter(sbuf if is_root else None, rbuf, c, root, from_fpga=True,
                             to_fpga=True)]
    if op == "gather":
        return [accl.gather(sbuf, rbuf if is_root else None, c, root, from_fpga=True,
                            to_fpga=True)]
    if op == "allgather":
        return [accl.allgather(sbuf, rbuf, c, from_fpga=True, to_fpga=True)]
    if op == "alltoall":
        return [accl.alltoall(sbuf, rbuf, c, from_fpga=True, to_fpga=True)]
    assert func is not None, case
    if op == "reduce":
        return [accl.reduce(sbuf, rbuf if is_root else None, c, root, func, from_fpga=True,
                            to_fpga=True)]
    if op == "allreduce":
        return [accl.allreduce(sbuf, rbuf, c, func, from_fpga=True, to_fpga=True)]
    if op == "reduce_scatter":
        return [accl.reduce_scatter(sbuf, rbuf, c, func, from_fpga=True, to_fpga=True)]
    raise ValueError(f"unknown op {op!r}")


def _head(buf: aaccl.Buffer, elements: int) -> aaccl.Buffer:
    """The first `elements` elements: a Buffer too, at the same device address."""
    return cast(aaccl.Buffer, buf[:elements])


def _output(case: Case, sbuf: aaccl.Buffer, rbuf: aaccl.Buffer, nranks: int) -> aaccl.Buffer:
    """The part of the buffers a rank's result lands in (bcast works in place)."""
    if case.op == "bcast":
        return _head(sbuf, case.count)
    return _head(rbuf, io_elements(case.op, case.count, nranks)[1])


def _prepare(accl: aaccl.ACCL, case: Case, sbuf: aaccl.Buffer, rbuf: aaccl.Buffer) -> None:
    """Put this rank's input on the device, and a never-right value where its output
    goes, so a call that writes nothing cannot pass the check."""
    n_in, n_out = io_elements(case.op, case.count, accl.size)
    gets_input = case.op not in ("bcast", "scatter") or accl.rank == case.root
    if gets_input:
        sbuf[:n_in] = rank_input(accl.rank, 0, n_in, case.dtype)
    else:
        sbuf[:n_in] = fill_value(case.dtype)
    rbuf[:n_out] = fill_value(case.dtype)
    _head(sbuf, n_in).sync_to_device()
    _head(rbuf, n_out).sync_to_device()


async def _sync(accl: aaccl.ACCL, settings: Settings,
                scratch: tuple[aaccl.Buffer, aaccl.Buffer]) -> None:
    """Wait for every rank: a barrier (or, on ACCL's emulator, an allreduce of one
    element), which no rank leaves before all have entered."""
    if settings.use_barrier:
        await accl.barrier()
    else:
        await accl.allreduce(*scratch, 1, ReduceFunction.SUM, from_fpga=True, to_fpga=True)


async def run_rank(accl: aaccl.ACCL, settings: Settings, progress: Progress | None = None,
                   ) -> tuple[list[float], list[int | None]]:
    """This rank's sweep: per case, its mean seconds per call and its wrong elements.

    Each case is timed between two synchronizations of all ranks (the clock stops
    before the second) and checked after the second: in-process ranks share one
    event loop (and processes a machine's CPUs), so a rank checking its result while
    another is still timing would add the check to the other's time."""
    cases = plan(settings.ops, settings.dtypes, settings.redops, settings.root,
                 settings.sizes, accl.size)
    times: list[float] = []
    wrongs: list[int | None] = []
    scratch = (accl.allocate((1,), np.int32), accl.allocate((1,), np.int32))
    for buf in scratch:
        buf.sync_to_device()
    groups: dict[tuple[str, np.dtype], list[Case]] = {}
    for case in cases:
        groups.setdefault((case.op, case.dtype), []).append(case)
    for (_, dtype), group in groups.items():
        # one pair of buffers per op and dtype, as large as its largest case
        n_in = max(io_elements(c.op, c.count, accl.size)[0] for c in group)
        n_out = max(io_elements(c.op, c.count, accl.size)[1] for c in group)
        sbuf, rbuf = accl.allocate((n_in,), dtype), accl.allocate((n_out,), dtype)
        for case in group:
            _prepare(accl, case, sbuf, rbuf)
            for _ in range(settings.warmup):
                for call in _start(accl, case, sbuf, rbuf):
                    await call
            await _sync(accl, settings, scratch)
            began = time.perf_counter()
            for _ in range(settings.iters):
                for call in _start(accl, case, sbuf, rbuf):
                    await call
            times.append((time.perf_counter() - began) / settings.iters)
            await _sync(accl, settings, scratch)  # every rank has stopped its clock
            wrongs.append(_check(accl, case, sbuf, rbuf) if settings.check else None)
            if progress is not None:
                progress.advance(f"{case.op} {case.nbytes} B")
    return times, wrongs


def _check(accl: aaccl.ACCL, case: Case, sbuf: aaccl.Buffer, rbuf: aaccl.Buffer) -> int:
    want = expected(case, accl.rank, accl.size)
    if want is None:
        return 0
    out = _output(case, sbuf, rbuf, accl.size)
    out.sync_from_device()  # the only host sync of a result
    return count_wrong(np.asarray(out), want)


# -- the command -----------------------------------------------------------------------------

def _argtype(convert: Any) -> Any:
    """An argparse type from a function that raises UsageError."""
    def parse(text: str) -> Any:
        try:
            return convert(text)
        except (UsageError, ValueError) as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    parse.__name__ = getattr(convert, "__name__", "value")
    return parse


def _at_least(low: int) -> Any:
    def integer(text: str) -> int:
        value = int(text)
        if value < low:
            raise UsageError(f"must be at least {low}, got {value}")
        return value
    return _argtype(integer)


def _choices(names: Iterable[str], aliases: dict[str, str] | None = None) -> Any:
    """A comma-separated list of names (or `all`), in the order given, no repeats."""
    known = list(names)

    def listed(text: str) -> tuple[str, ...]:
        picked: list[str] = []
        for part in (p.strip().lower() for p in text.split(",")):
            part = (aliases or {}).get(part, part)
            if part == "all":
                picked += [k for k in known if k not in picked]
            elif part in known:
                if part not in picked:
                    picked.append(part)
            else:
                raise UsageError(f"unknown {part!r}: choose from {', '.join(known)} or all")
        if not picked:
            raise UsageError("name at least one")
        return tuple(picked)
    return _argtype(listed)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`aaccl bench`'s options (nccl-tests' letters where nccl-tests has one)."""
    add = parser.add_argument
    add("-b", "--minbytes", type=_argtype(parse_size), default=8,
        help="smallest size in bytes, K/M/G suffixes (default 8)")
    add("-e", "--maxbytes", type=_argtype(parse_size), default=1 << 20,
        help="largest size (default 1M)")
    add("-f", "--stepfactor", type=_at_least(2), default=2,
        help="multiply the size by this each step (default 2)")
    add("-n", "--iters", type=_at_least(1), default=20, help="timed iterations (default 20)")
    add("-w", "--warmup_iters", type=_at_least(0), default=5,
        help="untimed iterations before them (default 5)")
    add("-d", "--datatype", type=_choices(DTYPES, DTYPE_ALIASES), default=("float32",),
        help=f"{', '.join(DTYPES)} or all; comma-separated (default float32)")
    add("-o", "--op", type=_choices(REDOPS), default=("sum",),
        help="reduction: sum, max or all (default sum)")
    add("-r", "--root", type=_at_least(0), default=0, help="root of rooted ops (default 0)")
    add("--ops", type=_choices(OPS), default=None,
        help=f"collectives to run, comma-separated: {', '.join(OPS)} or all (default all)")
    add("--ranks", type=_at_least(1), default=None,
        help="ranks of an in-process world (default 4; under mpiexec: the job's processes)")
    add("--device", choices=("soft", "emulator"), default="soft",
        help="the soft CCLO or ACCL's emulator (default soft)")
    add("--fabric", choices=("auto", "inprocess", "mpi"), default="auto",
        help="soft CCLO's fabric; auto is mpi under mpiexec, else inprocess")
    add("--nbufs", type=_at_least(1), default=16, help="eager rx buffers per rank (default 16)")
    add("--bufsize", type=_at_least(1), default=1024,
        help="bytes per eager rx buffer (default 1024)")
    add("--timeout", type=float, default=10.0,
        help="seconds a call waits for a peer (default 10)")
    add("--no-check", action="store_true", help="skip checking results (#wrong: N/A)")
    add("--json", action="store_true",
        help="print the run (settings, versions, rows) as JSON instead of the table")


def _settings(args: argparse.Namespace) -> tuple[Settings, list[str]]:
    """The sweep the arguments ask for, and notes for the header."""
    notes = []
    ops = args.ops or OPS
    if args.device == "emulator":
        if args.ops is not None and set(ops) & set(EMULATOR_CANNOT):
            raise UsageError(f"ACCL's emulator cannot run {', '.join(EMULATOR_CANNOT)} "
                             "(it needs rendezvous)")
        if args.ops is None:
            ops = tuple(op for op in ops if op not in EMULATOR_CANNOT)
            notes.append(f"skipped {', '.join(EMULATOR_CANNOT)}: ACCL's emulator cannot run it")
        if args.fabric != "auto":
            raise UsageError("--fabric is for the soft CCLO: the emulator brings its own network")
    swept = sizes(args.minbytes, args.maxbytes, args.stepfactor)
    settings = Settings(tuple(ops), tuple(DTYPES[d] for d in args.datatype),
                        tuple(REDOPS[o] for o in args.op), args.root, tuple(swept),
                        args.iters, args.warmup_iters, not args.no_check,
                        use_barrier=args.device != "emulator")
    return settings, notes


def _world_size(args: argparse.Namespace) -> int | None:
    """Ranks to ask aaccl.run for: None lets an MPI job decide."""
    if args.ranks is not None:
        return int(args.ranks)
    if args.fabric == "mpi" or (args.fabric == "auto" and aaccl.mpi_launched()):
        return None
    return 4


def _versions(fabric: str | None) -> dict[str, str]:
    """aaccl's, Python's, numpy's and, over MPI, mpi4py's and the MPI library's."""
    found = {"aaccl": aaccl.__version__, "python": platform.python_version(),
             "numpy": np.__version__}
    mpi = sys.modules.get("mpi4py.MPI")
    if fabric == "mpi" and mpi is not None:
        found["mpi4py"] = sys.modules["mpi4py"].__version__
        found["mpi"] = mpi.Get_library_version().strip().splitlines()[0].strip()
    return found


def _first_error(error: BaseException) -> BaseException:
    while isinstance(error, ExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return error


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run the sweep; 0 if every result is right, 1 if any is wrong (or a call
    failed), 2 for arguments that cannot make a sweep."""
    try:
        settings, notes = _settings(args)
        world_size = _world_size(args)
        if world_size is not None:  # check the plan before any rank starts
            plan(settings.ops, settings.dtypes, settings.redops, settings.root,
                 settings.sizes, world_size)
    except UsageError as error:
        parser.error(str(error))
    local: list[RankInfo] = []
    progress: list[Progress] = []

    async def rank(accl: aaccl.ACCL) -> tuple[RankInfo, list[float], list[int | None]]:
        me = RankInfo(accl.rank, os.getpid(), socket.gethostname())
        local.append(me)
        bar = None
        if accl.rank == 0:
            total = len(plan(settings.ops, settings.dtypes, settings.redops, settings.root,
                             settings.sizes, accl.size))
            bar = Progress(total, sys.stderr)
            progress.append(bar)
        times, wrongs = await run_rank(accl, settings, bar)
        return me, times, wrongs

    options: dict[str, Any] = {"device": args.device, "nbufs": args.nbufs,
                               "bufsize": args.bufsize, "timeout": args.timeout}
    if args.device == "soft":
        options["fabric"] = args.fabric
    try:
        results = aaccl.run(rank, world_size, **options)
    except (UsageError, ValueError, TypeError) as error:  # aaccl's argument checks
        print(f"aaccl bench: error: {error}", file=sys.stderr)
        return 2
    except (aaccl.ACCLError, ImportError, OSError, ExceptionGroup) as error:
        first = _first_error(error)
        print(f"aaccl bench: {type(first).__name__}: {first}", file=sys.stderr)
        return 2 if isinstance(first, ValueError) else 1
    finally:
        for bar in progress:
            bar.close()
    nranks = len(results)
    cases = plan(settings.ops, settings.dtypes, settings.redops, settings.root,
                 settings.sizes, nranks)
    rows = make_rows(cases, [r[1] for r in results], [r[2] for r in results], nranks)
    failed = any(row.wrong for row in rows)
    if 0 not in {info.rank for info in local}:
        return 1 if failed else 0  # an MPI rank other than 0: rank 0 prints
    one_per_process = len(local) == 1 and nranks > 1
    fabric = None if args.device != "soft" else "mpi" if one_per_process else "inprocess"
    ranks = [r[0] for r in results]
    if args.json:
        run = describe(args, settings, nranks, fabric, ranks, notes, _versions(fabric))
        print(json.dumps({**run, "rows": [asdict(row) for row in rows]}, indent=1))
    else:
        lines = format_header(args, nranks, fabric or "-", ranks, notes)
        print("\n".join(lines + format_table(rows)), flush=True)
    return 1 if failed else 0

