"""The collective algorithms, simulated without any I/O against numpy.

Each rank's schedule runs in a toy interpreter: sends drop a copy into a mailbox,
a step that needs a message waits until it is there. The simulation checks the
schedules alone — that they deliver the right data and cannot deadlock.
"""

from __future__ import annotations

import numpy as np
import pytest

from aaccl._constants import Scenario
from aaccl.soft.algorithms import Copy, Incoming, Local, Reduce, Send, chunks, schedule

SIZES = [1, 2, 3, 4, 5, 7, 8, 12]
COUNTS = [0, 1, 5, 13, 1500]


def simulate(scenario: Scenario, size: int, count: int, root: int = 0,
             op=np.add) -> list[list[np.ndarray]]:
    """Run every rank's schedule; return each rank's (op0, op1, res) buffers."""
    n = count * size
    bufs = [[np.arange(n, dtype=np.int64) * 10 + r, np.zeros(n, np.int64),
             np.full(n, -1, np.int64)] for r in range(size)]
    programs = [list(schedule(scenario, r, size, root, count)) for r in range(size)]
    mailbox: dict[tuple[int, int, int], np.ndarray] = {}

    def value(rank: int, operand, length: int) -> np.ndarray | None:
        if isinstance(operand, Local):
            return bufs[rank][operand.slot][operand.offset:operand.offset + length]
        key = (operand.peer, rank, operand.tag)
        return mailbox.get(key)

    progress = True
    while progress:
        progress = False
        for rank, program in enumerate(programs):
            while program:
                step = program[0]
                if isinstance(step, Send):
                    key = (rank, step.peer, step.tag)
                    assert key not in mailbox, f"two messages {key} in flight"
                    mailbox[key] = value(rank, step.src, step.count).copy()
                else:
                    operands = [step.src] if isinstance(step, Copy) else [step.a, step.b]
                    values = [value(rank, o, step.count) for o in operands]
                    if any(v is None for v in values):
                        break
                    for o in operands:
                        if isinstance(o, Incoming):
                            assert len(mailbox.pop((o.peer, rank, o.tag))) == step.count
                    dst = bufs[rank][step.dst.slot][step.dst.offset:step.dst.offset + step.count]
                    dst[...] = values[0] if isinstance(step, Copy) else op(*values)
                program.pop(0)
                progress = True
    assert not any(programs), "deadlock: some ranks never finished"
    assert not mailbox, f"messages never received: {sorted(mailbox)}"
    return bufs


def inputs(size: int, count: int) -> list[np.ndarray]:
    return [np.arange(count * size, dtype=np.int64) * 10 + r for r in range(size)]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("count", COUNTS)
def test_allreduce(size: int, count: int) -> None:
    bufs = simulate(Scenario.ALLREDUCE, size, count)
    expected = sum(x[:count] for x in inputs(size, count))
    for b in bufs:
        np.testing.assert_array_equal(b[2][:count], expected)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("count", COUNTS)
def test_reduce_scatter_and_max(size: int, count: int) -> None:
    bufs = simulate(Scenario.REDUCE_SCATTER, size, count, op=np.maximum)
    full = np.maximum.reduce(inputs(size, count)) if size else None
    for r, b in enumerate(bufs):
        np.testing.assert_array_equal(b[2][:count], full[r * count:(r + 1) * count])


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("count", [0, 1, 13])
def test_allgather_and_alltoall(size: int, count: int) -> None:
    x = inputs(size, count)
    for b in simulate(Scenario.ALLGATHER, size, count):
        np.testing.assert_array_equal(b[2], np.concatenate([xi[:count] for xi in x]))
    for r, b in enumerate(simulate(Scenario.ALLTOALL, size, count)):
        expected = np.concatenate([xi[r * count:(r + 1) * count] for xi in x])
        np.testing.assert_array_equal(b[2], expected)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("root_is_last", [False, True])
def test_rooted(size: int, root_is_last: bool) -> None:
    count, root = 6, (size - 1 if root_is_last else 0)
    x = inputs(size, count)
    for b in simulate(Scenario.BCAST, size, count, root):
        np.testing.assert_array_equal(b[0][:count], x[root][:count])
    for r, b in enumerate(simulate(Scenario.SCATTER, size, count, root)):
        np.testing.assert_array_equal(b[2][:count], x[root][r * count:(r + 1) * count])
    gathered = simulate(Scenario.GATHER, size, count, root)[root]
    np.testing.assert_array_equal(gathered[2], np.concatenate([xi[:count] for xi in x]))
    reduced = simulate(Scenario.REDUCE, size, count, root)[root]
    np.testing.assert_array_equal(reduced[2][:count], sum(xi[:count] for xi in x))


def heard_from(size: int) -> list[set[int]]:
    """Whose entry into the barrier each rank's exit depends on (transitively)."""
    knows = [{r} for r in range(size)]
    rounds = [[s for s in schedule(Scenario.BARRIER, r, size, 0, 0)] for r in range(size)]
    for k in range(max(map(len, rounds), default=0) // 2):
        before = [set(k_) for k_ in knows]
        for r in range(size):
            waits = rounds[r][2 * k + 1]
            assert isinstance(waits, Copy) and isinstance(waits.src, Incoming)
            knows[r] |= before[waits.src.peer]
    return knows


@pytest.mark.parametrize("size", SIZES + [16, 33])
def test_barrier_waits_for_everyone_in_log_rounds(size: int) -> None:
    simulate(Scenario.BARRIER, size, 0)
    assert heard_from(size) == [set(range(size))] * size
    rounds = len(schedule(Scenario.BARRIER, 0, size, 0, 0)) // 2
    assert rounds == (size - 1).bit_length()


@pytest.mark.parametrize("size", [2, 3, 4, 5, 8, 12, 64])
def test_small_allreduce_gives_every_rank_the_same_bits(size: int) -> None:
    """Recursive doubling combines the lower half with the upper half on every rank:
    floating-point results agree exactly, and each rank sends log2 messages."""
    rng = np.random.default_rng(size)
    x = [rng.standard_normal(7).astype(np.float32) for _ in range(size)]
    bufs = simulate_values(Scenario.ALLREDUCE, x)
    results = [b[2][:7] for b in bufs]
    for r in results[1:]:
        assert r.tobytes() == results[0].tobytes()
    np.testing.assert_allclose(results[0], np.sum(x, axis=0), rtol=1e-5)
    p = 1 << (size.bit_length() - 1)
    sends = [sum(isinstance(s, Send) for s in schedule(Scenario.ALLREDUCE, r, size, 0, 7))
             for r in range(size)]
    assert sum(sends) == p * (p.bit_length() - 1) + 2 * (size - p)


def simulate_values(scenario: Scenario, x: list[np.ndarray]) -> list[list[np.ndarray]]:
    """simulate() on given float inputs (one vector per rank)."""
    size, count = len(x), len(x[0])
    bufs = [[xi.copy(), np.zeros_like(xi), np.zeros_like(xi)] for xi in x]
    programs = [list(schedule(scenario, r, size, 0, count)) for r in range(size)]
    mailbox: dict[tuple[int, int, int], np.ndarray] = {}
    while any(programs):
        progressed = False
        for rank, program in enumerate(programs):
            while program:
                step = program[0]
                if isinstance(step, Send):
                    loc = step.src
                    mailbox[(rank, step.peer, step.tag)] = \
                        bufs[rank][loc.slot][loc.offset:loc.offset + step.count].copy()
                else:
                    ops = [step.src] if isinstance(step, Copy) else [step.a, step.b]
                    keys = [(o.peer, rank, o.tag) for o in ops if isinstance(o, Incoming)]
                    if any(k not in mailbox for k in keys):
                        break
                    vals = [mailbox.pop((o.peer, rank, o.tag)) if isinstance(o, Incoming)
                            else bufs[rank][o.slot][o.offset:o.offset + step.count].copy()
                            for o in ops]
                    out = bufs[rank][step.dst.slot][step.dst.offset:step.dst.offset + step.count]
                    out[...] = vals[0] if isinstance(step, Copy) else vals[0] + vals[1]
                program.pop(0)
                progressed = True
        assert progressed, "deadlock"
    return bufs


def test_reductions_fold_in_rank_order() -> None:
    """Past the small-message threshold every rank reduces its chunk as
    ((x0 + x1) + x2) + x3, so float results agree."""
    steps = schedule(Scenario.ALLREDUCE, 2, 4, 0, 8000)
    folds = [s for s in steps if isinstance(s, Reduce)]
    order = []
    for s in folds:
        order += [o.peer if isinstance(o, Incoming) else 2 for o in (s.a, s.b) if o != s.dst]
    assert order == [0, 1, 2, 3]


@pytest.mark.parametrize("count,size", [(10, 3), (2, 5), (0, 4), (9, 1)])
def test_chunks_cover_the_buffer(count: int, size: int) -> None:
    parts = chunks(count, size)
    assert len(parts) == size
    assert [o for o, _ in parts] == list(np.cumsum([0] + [n for _, n in parts])[:-1])
    assert sum(n for _, n in parts) == count
    assert max(n for _, n in parts) - min(n for _, n in parts) <= 1


def test_large_allreduce_moves_each_chunk_once_per_peer() -> None:
    """Reduce-scatter then allgather: a rank sends 2 * (size - 1) messages of ~count/size."""
    size, count = 4, 4000
    sends = [s for s in schedule(Scenario.ALLREDUCE, 0, size, 0, count) if isinstance(s, Send)]
    assert len(sends) == 2 * (size - 1)
    assert all(s.count == count // size for s in sends)
