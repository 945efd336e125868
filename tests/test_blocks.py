"""The opening exchange of collectives over MPI (`aaccl.soft.fabric._blocks`), pure.

Every rank's block goes through encode/read as MPI's allgather would carry it, and
`settle` must give what numpy says each collective gives; no MPI here (the MPI
worker suites run the same code between processes).
"""

from __future__ import annotations

import numpy as np
import pytest

from aaccl import ReduceFunction
from aaccl._constants import Scenario
from aaccl.soft.fabric import _blocks as blocks
from aaccl.soft.fabric._lane import runs_natively
from conftest import DTYPES

S = Scenario
REDUCING = {S.REDUCE: True, S.ALLREDUCE: True, S.REDUCE_SCATTER: True}


def fingerprint(scenario: Scenario, count: int | None, dtype: np.dtype, size: int,
                root: int | None = None, function: int | None = None,
                wire: np.dtype | None = None) -> tuple:
    return (int(scenario), count, dtype.str, (wire or dtype).str, root, function, size)


def exchange(fps: list[tuple], datas: list[np.ndarray | None]) -> np.ndarray:
    """What every rank receives from the allgather of everyone's blocks."""
    gathered = np.zeros(len(fps) * blocks.BLOCK, np.uint8)
    for k, (fp, data) in enumerate(zip(fps, datas)):
        blocks.encode(gathered[k * blocks.BLOCK:(k + 1) * blocks.BLOCK], fp, data)
    return gathered


def combine_for(function: int):
    ufunc = np.add if function == ReduceFunction.SUM else np.maximum

    def combine(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        ufunc(a, b, out=out)
    return combine


CASES = [(s, size, count) for s in (S.BCAST, S.SCATTER, S.GATHER, S.REDUCE, S.ALLGATHER,
                                    S.ALLREDUCE, S.REDUCE_SCATTER, S.ALLTOALL)
         for size in (1, 2, 3, 5) for count in (1, 3)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scenario,size,count", CASES)
def test_settle_matches_numpy(scenario: Scenario, size: int, count: int, dtype: type) -> None:
    dt = np.dtype(dtype)
    rng = np.random.default_rng(size * 100 + count)
    function = int(ReduceFunction.MAX if count == 3 else ReduceFunction.SUM) \
        if scenario in REDUCING else None
    for root in ((0, size - 1) if scenario in (S.BCAST, S.SCATTER, S.GATHER, S.REDUCE)
                 else (None,)):
        fp = fingerprint(scenario, count, dt, size, root, function)
        assert blocks.fits(fp)
        n = size * count  # every rank's operand is that long (rooted ones use less)
        inputs = [rng.integers(-50, 50, n).astype(dt) for _ in range(size)]
        datas = [inputs[k][:blocks.share(fp, k)] for k in range(size)]
        seen = exchange([fp] * size, datas)
        assert blocks.agree(blocks.headers(seen, size))
        assert all(b.state == blocks.RUNS and b.fp == fp for b in blocks.read(seen, size))
        for rank in range(size):
            op0 = inputs[rank].copy()
            res = np.full(n, 77, dt)
            blocks.settle(fp, rank, seen, op0, res, combine_for(function or 0))
            want_op0, want_res = op0.copy(), res.copy()
            reduce = (np.add if function == ReduceFunction.SUM else np.maximum) \
                if function is not None else None
            mine = slice(rank * count, (rank + 1) * count)
            if scenario == S.BCAST:
                want_op0[:count] = inputs[root][:count]
                np.testing.assert_array_equal(op0, want_op0)
                continue
            if scenario == S.SCATTER:
                want_res[:count] = inputs[root][mine]
            elif scenario == S.GATHER and rank == root or scenario == S.ALLGATHER:
                want_res[:n] = np.concatenate([x[:count] for x in inputs])
            elif scenario == S.ALLTOALL:
                want_res[:n] = np.concatenate([x[mine] for x in inputs])
            elif scenario in (S.REDUCE, S.ALLREDUCE) and (scenario == S.ALLREDUCE or rank == root):
                want_res[:count] = reduce.reduce([x[:count] for x in inputs])
            elif scenario == S.REDUCE_SCATTER:
                want_res[:count] = reduce.reduce([x[mine] for x in inputs])
            np.testing.assert_array_equal(res, want_res)
            np.testing.assert_array_equal(op0, inputs[rank])  # operands stay as they were


def test_a_failed_or_aborted_call_says_why() -> None:
    fp = fingerprint(S.ALLREDUCE, 4, np.dtype(np.float32), 3, None, 0)
    gathered = np.zeros(3 * blocks.BLOCK, np.uint8)
    blocks.encode(gathered[:blocks.BLOCK], fp, np.arange(4, dtype=np.float32))
    blocks.encode(gathered[blocks.BLOCK:2 * blocks.BLOCK], fp, state=blocks.ABORTED,
                  why="rank 1's allreduce was aborted: it did not run")
    long = "x" * 2000  # longer than a block holds: cut, never spilled into the next
    blocks.encode(gathered[2 * blocks.BLOCK:], fp, state=blocks.FAILED, code=5, why=long)
    assert not blocks.agree(blocks.headers(gathered, 3))
    first, second, third = blocks.read(gathered, 3)
    assert first.state == blocks.RUNS
    np.testing.assert_array_equal(first.tail[:16].view(np.float32), np.arange(4))
    assert (second.state, second.why) == (blocks.ABORTED,
                                          "rank 1's allreduce was aborted: it did not run")
    assert third.state == blocks.FAILED and third.code == 5
    assert third.why == long[:blocks.INLINE]
    assert second.fp == third.fp == fp


def test_fingerprints_round_trip_with_none_fields() -> None:
    barrier = (int(S.BARRIER), None, "<f4", "<f4", None, None, 7)
    (seen,) = blocks.read(exchange([barrier], [None]), 1)
    assert seen.fp == barrier


def test_blocks_agree_only_if_every_call_runs_with_one_fingerprint() -> None:
    f32 = np.dtype(np.float32)
    fp = fingerprint(S.ALLREDUCE, 2, f32, 3, None, 0)
    data = [np.full(2, k, f32) for k in range(3)]
    assert blocks.agree(blocks.headers(exchange([fp] * 3, data), 3))  # the data may differ
    for other in (fingerprint(S.ALLREDUCE, 3, f32, 3, None, 0),  # count
                  fingerprint(S.ALLREDUCE, 2, np.dtype(np.int32), 3, None, 0),  # dtype
                  fingerprint(S.ALLREDUCE, 2, f32, 3, None, 1),  # function
                  fingerprint(S.ALLGATHER, 2, f32, 3)):  # operation
        for k in range(3):  # whichever rank differs, the first included
            fps = [fp] * 3
            fps[k] = other
            assert not blocks.agree(blocks.headers(exchange(fps, data), 3))
    gathered = exchange([fp] * 3, data)  # a rank's call did not run
    blocks.encode(gathered[blocks.BLOCK:2 * blocks.BLOCK], fp, state=blocks.ABORTED, why="x")
    assert not blocks.agree(blocks.headers(gathered, 3))


@pytest.mark.parametrize("dtype", DTYPES)
def test_what_rides_in_the_block(dtype: type) -> None:
    dt = np.dtype(dtype)
    most = blocks.INLINE // dt.itemsize
    assert blocks.fits(fingerprint(S.ALLREDUCE, most, dt, 4, None, 0))
    assert not blocks.fits(fingerprint(S.ALLREDUCE, most + 1, dt, 4, None, 0))
    # the root's share decides rooted ones; per-peer slices count the whole operand
    assert not blocks.fits(fingerprint(S.SCATTER, most // 4 + 1, dt, 4, 2))
    assert blocks.fits(fingerprint(S.SCATTER, most // 4, dt, 4, 2))
    assert not blocks.fits(fingerprint(S.ALLTOALL, most // 3 + 1, dt, 3))
    assert blocks.fits(fingerprint(S.GATHER, most, dt, 64, 0))
    # compressed on the wire: never inline, never MPI's own collective
    wire = fingerprint(S.ALLREDUCE, 1, dt, 2, None, 0, wire=np.dtype(np.float16))
    if dt != np.float16:
        assert not blocks.fits(wire) and not runs_natively(wire)


def test_which_collectives_mpi_runs() -> None:
    f32, f16 = np.dtype(np.float32), np.dtype(np.float16)
    assert runs_natively(fingerprint(S.ALLREDUCE, 10**6, f32, 4, None, 0))
    assert runs_natively(fingerprint(S.ALLGATHER, 10**6, f16, 4))  # bytes, any dtype
    assert not runs_natively(fingerprint(S.ALLREDUCE, 10**6, f16, 4, None, 0))  # no MPI float16 sum
    assert not runs_natively(fingerprint(S.BARRIER, None, f32, 4))  # the opening is the barrier
