"""Random programs of collectives and messages on the soft CCLO, against a numpy model.

Hypothesis draws a program: a world of 1..4 ranks, maybe a sub-communicator (any
subset, in any order), a network stack ("tcp": every message eager; "rdma": those
above an rx buffer rendezvous), and a list of operations with random dtypes,
counts (0..300), roots, functions and host/device flags; a send/recv pair moves
one rank's buffer to another's. Some operations take their input
from an earlier one's output on the device (`from_fpga=True, waitfor=[parent]`),
forming chains; others start from fresh data. Every rank submits the operations it
takes part in in program order, without awaiting them, except at the program's sync
points; ranks yield to each other at random places and await outstanding calls in a
random order, so the interleaving of submissions differs from rank to rank.

The model replays the program in program order: for each buffer of each rank it
tracks the host copy and the device copy, with the API's syncs (host to device
before a call unless `from_fpga`, device to host after it unless `to_fpga`).
At the end every buffer's host copy, then its device copy, must match the model.
Reductions are modelled folding contributions in rank order, and float results are
compared with a tolerance of a few ulps.

Every such program is correct in submission order, so with `in_order=True` (each
rank's calls one at a time in submission order, ready or not, as ACCL's firmware
runs them) it must complete with the same results, on both event-loop backends.
"""

from __future__ import annotations

import pickle
import random
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aaccl
from aaccl import ReduceFunction
from conftest import DTYPES

SUM, MAX = ReduceFunction.SUM, ReduceFunction.MAX
KINDS = ["bcast", "scatter", "gather", "reduce", "allgather", "allreduce", "reduce_scatter",
         "alltoall", "barrier", "copy", "combine", "sendrecv"]
REDUCING = {"reduce", "allreduce", "reduce_scatter", "combine"}
MAX_COUNT = 300
MAX_SIZE = 4
CAPACITY = MAX_COUNT * MAX_SIZE + 5  # elements of every buffer: room for any call, plus a tail
MAX_CHAIN = 3
GARBAGE = -77  # what a host copy holds once its data was synced to the device by hand


@dataclass(frozen=True)
class Op:
    kind: str
    comm: int  # 0: the world; 1: the program's sub-communicator
    dtype: Any
    count: int
    root: int  # a rank of the op's communicator (sendrecv: the sender)
    func: ReduceFunction
    parent: int | None  # the op whose output (on the device) is this op's input
    from_fpga: bool  # fresh inputs: synced by hand before the program, host copy scrambled
    from_fpga2: bool  # combine's second operand, likewise
    to_fpga: bool
    inplace: bool  # allreduce, alltoall: sbuf is rbuf
    sync_after: bool  # every rank awaits its outstanding calls after submitting this op
    peer: int = 0  # sendrecv: the receiver (a rank of the op's communicator, not root)


@dataclass(frozen=True)
class Program:
    size: int
    subset: tuple[int, ...] | None  # global ranks of the sub-communicator, in its rank order
    ops: tuple[Op, ...]
    seed: int
    stack: str = "tcp"  # "rdma": messages above an rx buffer go rendezvous


@st.composite
def programs(draw: st.DrawFn, min_size: int = 1, max_size: int = MAX_SIZE) -> Program:
    size = draw(st.integers(min_size, max_size))
    subset = draw(st.none() | st.permutations(range(size)).flatmap(
        lambda p: st.integers(1, size).map(lambda k: tuple(p[:k]))))
    ops: list[Op] = []
    depth: dict[int, int] = {}
    used: set[int] = set()
    for k in range(draw(st.integers(1, 12))):
        comm = draw(st.sampled_from([0, 1])) if subset else 0
        csize = size if comm == 0 else len(subset or ())
        kind = draw(st.sampled_from(KINDS if csize > 1 else KINDS[:-1]))
        parents = [j for j, o in enumerate(ops) if o.comm == comm and o.kind != "barrier"
                   and j not in used and depth[j] < MAX_CHAIN]
        parent = None
        if kind != "barrier" and parents:
            parent = draw(st.none() | st.sampled_from(parents))
        if parent is not None:
            used.add(parent)
        depth[k] = 1 if parent is None else depth[parent] + 1
        ops.append(Op(
            kind=kind, comm=comm,
            dtype=ops[parent].dtype if parent is not None else draw(st.sampled_from(DTYPES)),
            count=draw(st.integers(0, MAX_COUNT)), root=draw(st.integers(0, csize - 1)),
            func=draw(st.sampled_from([SUM, MAX])), parent=parent,
            from_fpga=parent is not None or draw(st.booleans()), from_fpga2=draw(st.booleans()),
            to_fpga=draw(st.booleans()),
            inplace=kind in ("allreduce", "alltoall") and draw(st.booleans()),
            sync_after=draw(st.integers(0, 3)) == 0,
            peer=draw(st.integers(0, max(csize - 2, 0)))))
        if kind == "sendrecv":  # a receiver other than the sender
            op = ops[-1]
            ops[-1] = replace(op, peer=op.peer + (op.peer >= op.root))
    return Program(size, subset, tuple(ops), draw(st.integers(0, 2**32 - 1)),
                   draw(st.sampled_from(["tcp", "rdma"])))


# -- which buffers each op uses ----------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    ins: str | None  # sbuf (bcast: buf; combine: val1; copy: srcbuf)
    ins2: str | None  # combine's val2
    out: str | None  # rbuf (bcast: buf)
    fresh: tuple[tuple[str, bool], ...]  # buffers this op creates: (name, holds input data)


def layout(program: Program) -> list[Layout]:
    out: list[Layout] = []
    for k, op in enumerate(program.ops):
        if op.kind == "barrier":
            out.append(Layout(None, None, None, ()))
            continue
        fresh: list[tuple[str, bool]] = []
        if op.parent is None:
            ins = f"in{k}"
            fresh.append((ins, True))
        else:
            ins = out[op.parent].out
        ins2 = None
        if op.kind == "combine":
            ins2 = f"in2_{k}"
            fresh.append((ins2, True))
        if op.kind == "bcast" or op.inplace:
            res = ins
        else:
            res = f"out{k}"
            fresh.append((res, False))
        out.append(Layout(ins, ins2, res, tuple(fresh)))
    return out


def members(program: Program, op: Op) -> list[int]:
    """Global ranks of the op's communicator, in its rank order."""
    if op.comm == 0:
        return list(range(program.size))
    assert program.subset is not None
    return list(program.subset)


def fresh_data(program: Program, rank: int, name: str, dtype: Any) -> np.ndarray:
    rng = np.random.default_rng([program.seed, rank, *name.encode()])
    if np.issubdtype(dtype, np.integer):
        return rng.integers(-1000, 1000, size=CAPACITY).astype(dtype)
    return rng.uniform(-4, 4, size=CAPACITY).astype(dtype)


def lengths(kind: str, size: int, count: int) -> tuple[int, int]:
    chunked_in = kind in ("scatter", "reduce_scatter", "alltoall")
    chunked_out = kind in ("gather", "allgather", "alltoall")
    return count * (size if chunked_in else 1), count * (size if chunked_out else 1)


# -- the model ---------------------------------------------------------------------------


def fold(func: ReduceFunction, values: list[np.ndarray]) -> np.ndarray:
    """Contributions combined in rank order, in their own dtype."""
    ufunc = np.add if func == SUM else np.maximum
    acc = values[0].copy()
    for v in values[1:]:
        acc = ufunc(acc, v)
    return acc


def model(program: Program) -> list[dict[str, list[np.ndarray]]]:
    """Every rank's buffers after the program: name -> [host copy, device copy]."""
    state: list[dict[str, list[np.ndarray]]] = [{} for _ in range(program.size)]
    for op, lay in zip(program.ops, layout(program)):
        ranks = members(program, op)
        for r in ranks:
            for name, holds_input in lay.fresh:
                host = fresh_data(program, r, name, op.dtype) if holds_input \
                    else np.zeros(CAPACITY, op.dtype)
                dev = np.zeros(CAPACITY, op.dtype)
                hand_synced = (op.from_fpga if name == lay.ins else op.from_fpga2) \
                    if holds_input else False
                if hand_synced:
                    dev, host = host.copy(), np.full(CAPACITY, GARBAGE, op.dtype)
                state[r][name] = [host, dev]
        if op.kind == "barrier":
            continue
        run_model_op(program, op, lay, ranks, state)
    return state


def run_model_op(program: Program, op: Op, lay: Layout, ranks: list[int],
                 state: list[dict[str, list[np.ndarray]]]) -> None:
    size, c = len(ranks), op.count
    n_in, n_out = lengths(op.kind, size, c)
    root = ranks[op.root]
    rooted_in = op.kind in ("bcast", "scatter", "sendrecv")  # only the root's input matters
    rooted_out = op.kind in ("gather", "reduce")  # only the root gets a result

    def dev(r: int, name: str | None) -> np.ndarray:
        assert name is not None
        return state[r][name][1]

    # syncs to the device, at submission
    for r in ranks:
        if not op.from_fpga and (not rooted_in or r == root):
            host, device = state[r][lay.ins]
            device[:n_in] = host[:n_in]
        if op.kind == "combine" and not op.from_fpga2:
            host, device = state[r][lay.ins2]
            device[:c] = host[:c]

    ins = {r: dev(r, lay.ins)[:n_in].copy() for r in ranks}  # as they were before the call
    for i, r in enumerate(ranks):
        out = dev(r, lay.out)
        if op.kind == "copy":
            out[:c] = ins[r]
        elif op.kind == "combine":
            out[:c] = fold(op.func, [ins[r], dev(r, lay.ins2)[:c]])
        elif op.kind == "bcast":
            out[:c] = ins[root]
        elif op.kind == "scatter":
            out[:c] = ins[root][i * c:(i + 1) * c]
        elif op.kind == "gather" and r == root:
            out[:n_out] = np.concatenate([ins[q] for q in ranks])
        elif op.kind == "reduce" and r == root:
            out[:c] = fold(op.func, [ins[q] for q in ranks])
        elif op.kind == "allgather":
            out[:n_out] = np.concatenate([ins[q] for q in ranks])
        elif op.kind == "allreduce":
            out[:c] = fold(op.func, [ins[q] for q in ranks])
        elif op.kind == "reduce_scatter":
            out[:c] = fold(op.func, [ins[q] for q in ranks])[i * c:(i + 1) * c]
        elif op.kind == "alltoall":
            out[:n_out] = np.concatenate([ins[q][i * c:(i + 1) * c] for q in ranks])
        elif op.kind == "sendrecv" and i == op.peer:
            out[:c] = ins[root]

    # syncs back to the host, at completion
    for r in ranks:
        if op.to_fpga or (rooted_out and r != root) or (op.kind == "sendrecv"
                                                        and r != ranks[op.peer]):
            continue
        if op.kind == "bcast" and r == root and not op.from_fpga:
            continue  # the root's host copy is its input already
        host, device = state[r][lay.out]
        host[:n_out] = device[:n_out]


# -- running a program -------------------------------------------------------------------


def submit(accl: aaccl.ACCL, op: Op, lay: Layout, bufs: dict[str, aaccl.Buffer], comm_id: int,
           waitfor: list[aaccl.Call], me: int) -> aaccl.Call | None:
    """Submit `op` on this rank, `me` in the op's communicator (None: not its part)."""
    s = bufs.get(lay.ins) if lay.ins else None
    d = bufs.get(lay.out) if lay.out else None
    c, root, func = op.count, op.root, op.func
    flags = {"comm_id": comm_id, "from_fpga": op.from_fpga, "to_fpga": op.to_fpga,
             "waitfor": waitfor}
    kind = op.kind
    if kind == "barrier":
        return accl.barrier(comm_id, waitfor=waitfor)
    if kind == "copy":
        return accl.copy(s, d, c, op.from_fpga, op.to_fpga, waitfor=waitfor)
    if kind == "combine":
        assert lay.ins2 is not None
        return accl.combine(c, func, s, bufs[lay.ins2], d, val1_from_fpga=op.from_fpga,
                            val2_from_fpga=op.from_fpga2, to_fpga=op.to_fpga, waitfor=waitfor)
    if kind == "bcast":
        return accl.bcast(s, c, root, **flags)
    if kind == "sendrecv":
        assert lay.out is not None
        tag = int(lay.out.removeprefix("out"))  # its own: the op's index
        if me == root:
            return accl.send(s, c, op.peer, tag, comm_id, op.from_fpga, waitfor=waitfor)
        if me == op.peer:
            return accl.recv(d, c, root, tag, comm_id, op.to_fpga, waitfor=waitfor)
        return None
    if kind in ("scatter", "gather"):
        return getattr(accl, kind)(s, d, c, root, **flags)
    if kind == "reduce":
        return accl.reduce(s, d, c, root, func, **flags)
    if kind in ("allreduce", "reduce_scatter"):
        return getattr(accl, kind)(s, d, c, func, **flags)
    return getattr(accl, kind)(s, d, c, **flags)


def run_program(program: Program, backend: str = "asyncio", in_order: bool = False,
                ) -> list[dict[str, tuple[np.ndarray, np.ndarray]]]:
    """Run the program on the soft CCLO; every rank's buffers: name -> (host, device)."""
    layouts = layout(program)

    async def main(accl: aaccl.ACCL) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        rank = accl.rank
        rng = random.Random(program.seed * MAX_SIZE + rank)
        comm_ids = {0: aaccl.GLOBAL_COMM}
        if program.subset and rank in program.subset:
            comm_ids[1] = accl.split_communicator(program.subset)
        mine = [k for k, op in enumerate(program.ops) if op.comm in comm_ids]
        bufs: dict[str, aaccl.Buffer] = {}
        for k in mine:  # every buffer exists before the first call
            op, lay = program.ops[k], layouts[k]
            for name, holds_input in lay.fresh:
                buf = bufs[name] = accl.allocate(CAPACITY, op.dtype)
                if holds_input:
                    buf[:] = fresh_data(program, rank, name, op.dtype)
                    if op.from_fpga if name == lay.ins else op.from_fpga2:
                        buf.sync_to_device()
                        buf[:] = GARBAGE
        calls: dict[int, aaccl.Call] = {}
        pending: list[aaccl.Call] = []

        async def settle() -> None:
            rng.shuffle(pending)
            for call in pending:
                await call
            pending.clear()

        for k, op in enumerate(program.ops):
            for _ in range(rng.randrange(3)):
                await anyio.lowlevel.checkpoint()
            if k in mine:
                waitfor = [calls[op.parent]] if op.parent in calls else []
                call = submit(accl, op, layouts[k], bufs, comm_ids[op.comm], waitfor,
                              members(program, op).index(rank))
                if call is not None:
                    calls[k] = call
                    pending.append(call)
            if op.sync_after:
                await settle()
        await settle()
        assert all(call.done() for call in calls.values())

        out = {}
        for name, buf in bufs.items():
            host = np.array(buf)
            buf.sync_from_device()
            out[name] = (host, np.array(buf))
        return out

    return aaccl.run(main, world_size=program.size, backend=backend, timeout=5.0,
                     in_order=in_order, stack=program.stack)


def assert_same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    if np.issubdtype(want.dtype, np.integer):
        np.testing.assert_array_equal(got, want, err_msg=what)
        return
    finite = want[np.isfinite(want)]
    scale = float(np.abs(finite.astype(np.float64)).max()) if finite.size else 1.0
    eps = float(np.finfo(want.dtype).eps)
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64),
                               rtol=4 * eps, atol=4 * eps * max(scale, 1.0), equal_nan=True,
                               err_msg=what)


def describe(program: Program) -> str:
    lines = [f"world {program.size}, sub-communicator {program.subset}, seed {program.seed}"]
    lines += [f"  {k}: {op}" for k, op in enumerate(program.ops)]
    return "\n".join(lines)


def check_program(program: Program, backend: str = "asyncio", in_order: bool = False) -> None:
    want = model(program)
    got = run_program(program, backend, in_order)
    for rank in range(program.size):
        assert sorted(got[rank]) == sorted(want[rank])
        for name, (host, device) in got[rank].items():
            what = f"rank {rank}, buffer {name}, of\n{describe(program)}"
            assert_same(host, want[rank][name][0], f"host copy: {what}")
            assert_same(device, want[rank][name][1], f"device copy: {what}")


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_random_programs(program: Program) -> None:
    check_program(program)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs(min_size=2))
def test_random_programs_in_order(backend: str, program: Program) -> None:
    """A call waiting for an earlier one's result keeps its place: the independent
    calls behind it wait too, on every rank alike (issue 27: they overtook it)."""
    check_program(program, backend, in_order=True)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs(min_size=2))
def test_random_programs_in_order_at_length(backend: str, program: Program) -> None:
    check_program(program, backend, in_order=True)



MPI_BATCH = 10
"""Programs one MPI launch runs (a launch costs a second or so)."""


@pytest.mark.parametrize(("nprocs", "backend"), [(2, "asyncio"), (3, "trio"), (4, "asyncio")])
@settings(max_examples=1, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_programs_in_order_over_mpi(nprocs: int, backend: str, data: st.DataObject,
                                           ) -> None:
    """The same programs on the MPI fabric, one rank per process (tests/mpi/random_programs.py),
    where MPI runs the world's collectives in the order each rank admits them."""
    test_mpi_fabric = pytest.importorskip("test_mpi_fabric")  # skips without mpi4py
    if test_mpi_fabric.MPIEXEC is None:
        pytest.skip("no mpiexec (pip install 'aaccl[mpi]')")
    batch = data.draw(st.lists(programs(nprocs, nprocs), min_size=MPI_BATCH, max_size=MPI_BATCH))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "programs.pickle"
        path.write_bytes(pickle.dumps(batch))
        job = test_mpi_fabric.launch(nprocs, "random_programs.py", str(path),
                                     f"backend={backend}", "in_order=1")
    test_mpi_fabric.assert_passed(job, nprocs)
