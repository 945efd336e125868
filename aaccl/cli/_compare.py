"""`aaccl compare`: one program on the soft CCLO and on ACCL's emulator, their results
compared bit for bit.

The soft CCLO runs with the options that make it behave as the firmware does
(`PORTABLE`: one call at a time, the same network stack); the emulator runs ACCL's
real firmware. A program whose every rank returns the same bytes on both is one
that will behave the same on a card. Without a program, `sweep` runs every
collective over sizes from 1 to 4096 elements and every root.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .._constants import ReduceFunction
from ..api import ACCL, run
from ..devices._emulator import DEFAULT_PORT, available
from ..driver import STACKS

SIZES = (1, 2, 3, 4, 5, 9, 255, 256, 257, 1024, 1025, 4096)
"""Element counts `sweep` runs: the smallest (whose allreduce rings leave chunks
empty), around a 1 KiB rx buffer of float32, and several rx buffers."""
PORTABLE: dict[str, Any] = {"in_order": True}
"""Soft CCLO options that make it run calls as the firmware does (with the stack)."""
SWEEP_OPTIONS: dict[str, Any] = {"nbufs": 16, "bufsize": 4096, "timeout": 60.0}
"""Defaults for both runs: rx buffers that hold a few of `sweep`'s largest messages
at once (ACCL's firmware needs all of a message's rx buffers to receive it)."""
ROOTED = ("bcast", "scatter", "gather", "reduce")
COLLECTIVES = ("sendrecv", "bcast", "scatter", "gather", "reduce", "allgather", "allreduce",
               "reduce_scatter")
RENDEZVOUS_ONLY = ("alltoall", "barrier")  # ACCL's firmware runs these only over RDMA
SENTINEL = -12345.0  # in output buffers before a call: exact, and no sum of the inputs

Program = Callable[[ACCL], Awaitable[Any]]

SAME, DIFFERENT, USAGE, NOT_COMPARED = 0, 1, 2, 3
"""Exit statuses: the same results; differences (or a run raised); the command line
was wrong; nothing was compared (no emulator to compare with)."""


# -- the built-in program --------------------------------------------------------------------


def cases(size: int, sizes: Sequence[int] = SIZES, rendezvous: bool = False,
          ) -> list[tuple[str, int, int, ReduceFunction | None]]:
    """(operation, count, root, function) of every call `sweep` makes on `size` ranks."""
    ops = COLLECTIVES + (RENDEZVOUS_ONLY if rendezvous else ())
    out = []
    for op in ops:
        for count in ((0,) if op == "barrier" else sizes):
            for root in (range(size) if op in ROOTED else (0,)):
                funcs = (ReduceFunction.SUM, ReduceFunction.MAX) \
                    if op in ("reduce", "allreduce", "reduce_scatter") else (None,)
                out += [(op, count, root, func) for func in funcs]
    return out


def inputs(rank: int, case: int, length: int) -> np.ndarray:
    """Rank `rank`'s input to case `case`: float32 integers, whose sums over any number
    of ranks and in any order are exact, so results can agree bit for bit."""
    rng = np.random.default_rng([case, rank, length])
    return rng.integers(-100, 101, size=length).astype(np.float32)


def lengths(op: str, size: int, count: int) -> tuple[int, int]:
    """Elements of the (input, output) buffer an operation uses; count is per rank."""
    chunked_in = op in ("scatter", "reduce_scatter", "alltoall")
    chunked_out = op in ("gather", "allgather", "alltoall")
    return count * (size if chunked_in else 1), count * (size if chunked_out else 1)


async def sweep(accl: ACCL, sizes: Sequence[int] = SIZES, rendezvous: bool = False,
                ) -> list[np.ndarray]:
    """Every collective at every size in `sizes`, from every root, with SUM and MAX:
    what each call left in this rank's output buffer, in order. `rendezvous` adds
    alltoall and barrier (ACCL's firmware runs them only over RDMA). Point-to-point
    is a ring: each rank sends to the next and receives from the one before (even
    ranks send first, so that rendezvous sends meet their receives)."""
    out = []
    for i, (op, count, root, func) in enumerate(cases(accl.size, sizes, rendezvous)):
        n_in, n_out = lengths(op, accl.size, count)
        src, dst = accl.allocate(max(n_in, 1)), accl.allocate(max(n_out, 1))
        src[:n_in], dst[:] = inputs(accl.rank, i, n_in), SENTINEL
        if op == "sendrecv":
            nxt, prev = (accl.rank + 1) % accl.size, (accl.rank - 1) % accl.size
            steps = [lambda: accl.send(src, count, nxt, tag=i),
                     lambda: accl.recv(dst, count, prev, tag=i)]
            for step in steps if accl.rank % 2 == 0 else steps[::-1]:
                await step()
        elif op == "bcast":
            dst[:n_in] = src[:n_in]
            await accl.bcast(dst, count, root)
        elif op in ("scatter", "gather"):
            await getattr(accl, op)(src, dst, count, root)
        elif op == "reduce":
            assert func is not None  # (a reducing op: `cases` gives it a function)
            await accl.reduce(src, dst, count, root, func)
        elif op in ("allreduce", "reduce_scatter"):
            await getattr(accl, op)(src, dst, count, func)
        elif op == "barrier":
            await accl.barrier()
        else:
            await getattr(accl, op)(src, dst, count)
        out.append(np.array(dst))
    return out


# -- comparing ---------------------------------------------------------------------------------


def leaves(result: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """Every array and plain value in a (nested) result, with where it sits."""
    if isinstance(result, np.ndarray):
        yield path, np.asarray(result)
    elif isinstance(result, dict):
        for key in result:
            yield from leaves(result[key], f"{path}[{key!r}]")
    elif isinstance(result, (list, tuple)):
        for i, item in enumerate(result):
            yield from leaves(item, f"{path}[{i}]")
    else:
        yield path, result


def differences(first: Sequence[Any], second: Sequence[Any],
                names: tuple[str, str] = ("soft", "emulator")) -> list[str]:
    """Where two runs' results (one per rank) differ in any bit, in words."""
    found = []
    for rank, (a, b) in enumerate(zip(first, second, strict=True)):
        ours, theirs = list(leaves(a)), list(leaves(b))
        if [p for p, _ in ours] != [p for p, _ in theirs]:
            found.append(f"rank {rank}: the results differ in shape: {names[0]} returned "
                         f"{len(ours)} values, {names[1]} {len(theirs)}")
            continue
        for (path, x), (_, y) in zip(ours, theirs):
            where = f"rank {rank} result{path}"
            if isinstance(x, np.ndarray) != isinstance(y, np.ndarray):
                found.append(f"{where}: {names[0]} gave {type(x).__name__}, "
                             f"{names[1]} {type(y).__name__}")
            elif not isinstance(x, np.ndarray):
                if x != y:
                    found.append(f"{where}: {names[0]} gave {x!r}, {names[1]} {y!r}")
            elif (x.dtype, x.shape) != (y.dtype, y.shape):
                found.append(f"{where}: {names[0]} gave {x.dtype}{list(x.shape)}, "
                             f"{names[1]} {y.dtype}{list(y.shape)}")
            elif x.tobytes() != y.tobytes():
                flat_x, flat_y = x.reshape(-1), y.reshape(-1)
                bytes_x = np.ascontiguousarray(flat_x).view(np.uint8).reshape(flat_x.size, -1)
                bytes_y = np.ascontiguousarray(flat_y).view(np.uint8).reshape(flat_y.size, -1)
                bad = np.flatnonzero((bytes_x != bytes_y).any(axis=1))
                at = int(bad[0])
                ours_at, theirs_at = flat_x[at].item(), flat_y[at].item()
                found.append(f"{where}: {bad.size} of {flat_x.size} elements differ, the first "
                             f"at {at}: {names[0]} {ours_at!r}, {names[1]} {theirs_at!r}")
    return found


def compare(program: Program, world_size: int, *, emulator_port: int = DEFAULT_PORT,
            stack: str = "tcp", **options: Any) -> list[str]:
    """Run `program` on the soft CCLO (portable options) and on the emulator; return
    the differences, in words (none: the same bytes on every rank). A run that raises
    is a difference too."""
    outcomes: list[list[Any] | Exception] = []
    for name, device in (("soft", {"device": "soft", **PORTABLE}),
                         ("emulator", {"device": "emulator", "emulator_port": emulator_port})):
        try:
            outcomes.append(run(program, world_size, stack=stack, **device, **options))
        except Exception as error:  # the other run may still tell something
            outcomes.append(error)
    soft, emulated = outcomes
    if isinstance(soft, Exception) or isinstance(emulated, Exception):
        return [f"{name} raised {type(o).__name__}: {o}" for name, o
                in (("soft", soft), ("emulator", emulated)) if isinstance(o, Exception)]
    return differences(soft, emulated)


# -- the command -------------------------------------------------------------------------------


def load(spec: str) -> Program:
    """`module:function` or `path/to/file.py:function`."""
    target, _, name = spec.rpartition(":")
    if not target or not name:
        raise ValueError(f"name the program as module:function or file.py:function, got {spec!r}")
    if target.endswith(".py"):
        path = Path(target)
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        if module_spec is None or module_spec.loader is None or not path.is_file():
            raise ValueError(f"no Python file at {target}")
        module = importlib.util.module_from_spec(module_spec)
        sys.path.insert(0, str(path.resolve().parent))
        try:
            module_spec.loader.exec_module(module)
        finally:
            sys.path.remove(str(path.resolve().parent))
    else:
        module = importlib.import_module(target)
    program = getattr(module, name, None)
    if not callable(program):
        raise ValueError(f"{target} has no function {name!r}")
    return program


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("program", nargs="?",
                        help="the async main(accl) to run, as module:function or "
                             "file.py:function (default: every collective over sizes 1 to "
                             "4096 and every root)")
    parser.add_argument("-n", "--world-size", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--emulator-port", type=int, default=DEFAULT_PORT,
                        help="start port of the running cclo_emu ranks (default 5500)")
    parser.add_argument("--stack", choices=STACKS, default="tcp",
                        help="the network stack cclo_emu runs (its -c; rdma is cyt_rdma); "
                             "the soft CCLO follows its rules (default tcp)")
    parser.add_argument("--nbufs", type=int, default=SWEEP_OPTIONS["nbufs"],
                        help="rx buffers per rank (default %(default)s)")
    parser.add_argument("--bufsize", type=int, default=SWEEP_OPTIONS["bufsize"],
                        help="bytes per rx buffer (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=SWEEP_OPTIONS["timeout"],
                        help="seconds a call may wait for a peer (default %(default)s)")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)),
                        help="element counts of the built-in program, comma-separated")


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.world_size < 1:
        parser.error("-n must be at least 1")
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
        if args.program:
            program = load(args.program)
            what = args.program
        else:
            rendezvous = args.stack == "rdma"

            async def program(accl: ACCL) -> list[np.ndarray]:
                return await sweep(accl, sizes, rendezvous)

            what = (f"every collective over sizes {min(sizes)}..{max(sizes)}, every root "
                    f"({len(cases(args.world_size, sizes, rendezvous))} calls per rank)")
    except (ValueError, ImportError) as error:
        print(f"aaccl compare: {error}", file=sys.stderr)
        return USAGE
    ready, why = available(args.emulator_port)
    if not ready:  # not a difference: there is nothing to compare with
        ranks = " ".join(map(str, range(args.world_size)))
        print(f"aaccl compare: could not compare, ACCL's emulator is not running: {why}.\n"
              "Start one cclo_emu per rank (docs/emulator.md), then run this again:\n"
              f"  for r in {ranks}; do cclo_emu -s {args.world_size} -r $r "
              f"-p {args.emulator_port} -c {args.stack} -l 0 & done", file=sys.stderr)
        return NOT_COMPARED
    found = compare(program, args.world_size, emulator_port=args.emulator_port,
                    stack=args.stack, nbufs=args.nbufs, bufsize=args.bufsize,
                    timeout=args.timeout)
    print(f"{what} on {args.world_size} ranks over {args.stack}: soft CCLO "
          f"(in_order=True) and ACCL's emulator at port {args.emulator_port}")
    if not found:
        print("the same results, bit for bit, on every rank")
        return SAME
    for line in found[:50]:
        print(f"  {line}")
    if len(found) > 50:
        print(f"  ... and {len(found) - 50} more")
    print(f"{len(found)} difference(s)")
    return DIFFERENT
