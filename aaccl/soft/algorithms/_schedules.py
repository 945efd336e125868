"""Collective algorithms as pure schedules: which chunk goes where, what gets reduced.

A schedule is the list of steps one rank runs for one collective. Steps name the
call's buffers by slot (0 = addr_0, 1 = addr_1, 2 = addr_2) and offsets in elements;
messages are named by peer and a small tag that both ends of a transfer compute
alike. No I/O happens here, so every algorithm is tested by simulating it.

Reductions combine contributions in an order fixed by ranks alone (in rank order,
or pairwise lower half first), so every rank of an allreduce computes bit-identical
results and floating-point sums do not depend on arrival order.

Small messages pay per message, large ones per byte: small allreduces use
recursive doubling (log2 N rounds, N log N messages in all), large ones a
reduce-scatter then an allgather (each rank reduces 1/N of the data); the barrier
is a dissemination barrier (log2 N rounds).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from ..._constants import Scenario


@dataclass(frozen=True, slots=True)
class Local:
    """`count` elements of the call's buffer `slot`, from element `offset`."""

    slot: int
    offset: int


@dataclass(frozen=True, slots=True)
class Incoming:
    """The message that `peer` sends this rank with `tag`."""

    peer: int
    tag: int


Operand = Union[Local, Incoming]


@dataclass(frozen=True, slots=True)
class Send:
    peer: int
    tag: int
    src: Local
    count: int


@dataclass(frozen=True, slots=True)
class Copy:
    src: Operand
    dst: Local
    count: int


@dataclass(frozen=True, slots=True)
class Reduce:
    """dst = a (op) b, elementwise."""

    a: Operand
    b: Operand
    dst: Local
    count: int


Step = Union[Send, Copy, Reduce]

OP0, OP1, RES = 0, 1, 2
SMALL_ALLREDUCE_COUNT = 1024
"""Allreduce of at most this many elements sends whole vectors (recursive doubling:
fewest rounds); larger ones reduce-scatter then allgather (each rank reduces 1/size)."""
FOLD_IN, FOLD_OUT = 1 << 20, (1 << 20) + 1
"""Tags of recursive doubling's messages to and from the ranks past a power of two
(its rounds use tags 0, 1, ...)."""


def chunks(count: int, size: int) -> list[tuple[int, int]]:
    """Split `count` elements into `size` contiguous (offset, length) chunks, the
    first `count % size` one element longer."""
    base, extra = divmod(count, size)
    out, offset = [], 0
    for i in range(size):
        length = base + (i < extra)
        out.append((offset, length))
        offset += length
    return out


def _others(rank: int, size: int) -> list[int]:
    """Every other rank, starting after this one, so that ranks do not all send to
    the same peer first."""
    return [(rank + i) % size for i in range(1, size)]


def _fold(contributions: list[Operand], dst: Local, count: int) -> list[Step]:
    """Reduce contributions (in rank order) into dst."""
    if len(contributions) == 1:
        return [] if contributions[0] == dst else [Copy(contributions[0], dst, count)]
    steps: list[Step] = [Reduce(contributions[0], contributions[1], dst, count)]
    steps += [Reduce(dst, c, dst, count) for c in contributions[2:]]
    return steps


def _contributions(rank: int, size: int, mine: Local, tag: int) -> list[Operand]:
    return [mine if k == rank else Incoming(k, tag) for k in range(size)]


def bcast(rank: int, size: int, root: int, count: int) -> list[Step]:
    if rank == root:
        return [Send(p, 0, Local(OP0, 0), count) for p in _others(rank, size)]
    return [Copy(Incoming(root, 0), Local(OP0, 0), count)]


def scatter(rank: int, size: int, root: int, count: int) -> list[Step]:
    if rank != root:
        return [Copy(Incoming(root, 0), Local(RES, 0), count)]
    steps: list[Step] = [Send(p, 0, Local(OP0, p * count), count) for p in _others(rank, size)]
    steps.append(Copy(Local(OP0, rank * count), Local(RES, 0), count))
    return steps


def gather(rank: int, size: int, root: int, count: int) -> list[Step]:
    if rank != root:
        return [Send(root, 0, Local(OP0, 0), count)]
    return [Copy(Local(OP0, 0) if k == rank else Incoming(k, 0), Local(RES, k * count), count)
            for k in range(size)]


def reduce(rank: int, size: int, root: int, count: int) -> list[Step]:
    if rank != root:
        return [Send(root, 0, Local(OP0, 0), count)]
    return _fold(_contributions(rank, size, Local(OP0, 0), 0), Local(RES, 0), count)


def allgather(rank: int, size: int, count: int) -> list[Step]:
    steps: list[Step] = [Send(p, 0, Local(OP0, 0), count) for p in _others(rank, size)]
    steps += [Copy(Local(OP0, 0) if k == rank else Incoming(k, 0), Local(RES, k * count), count)
              for k in range(size)]
    return steps


def recursive_doubling(rank: int, size: int, count: int) -> list[Step]:
    """Allreduce in log2(p) rounds of pairwise exchange among the first p ranks (p the
    largest power of two <= size); each rank past p first folds its vector into rank
    - p and gets the result back at the end. Each pair combines the lower half's
    value with the upper half's, so every rank computes the same bits."""
    p = 1 << (size.bit_length() - 1)
    mine, acc = Local(OP0, 0), Local(RES, 0)
    if rank >= p:
        return [Send(rank - p, FOLD_IN, mine, count), Copy(Incoming(rank - p, FOLD_OUT), acc, count)]
    steps: list[Step] = [Reduce(mine, Incoming(rank + p, FOLD_IN), acc, count)
                         if rank + p < size else Copy(mine, acc, count)]
    distance, tag = 1, 0
    while distance < p:
        partner = rank ^ distance
        theirs = Incoming(partner, tag)
        steps.append(Send(partner, tag, acc, count))
        steps.append(Reduce(acc, theirs, acc, count) if rank < partner
                     else Reduce(theirs, acc, acc, count))
        distance, tag = distance * 2, tag + 1
    if rank + p < size:
        steps.append(Send(rank + p, FOLD_OUT, acc, count))
    return steps


def allreduce(rank: int, size: int, count: int,
              small_count: int = SMALL_ALLREDUCE_COUNT) -> list[Step]:
    if size == 1:
        return _fold([Local(OP0, 0)], Local(RES, 0), count)
    if count <= small_count:
        return recursive_doubling(rank, size, count)
    parts = chunks(count, size)
    mine, mylen = parts[rank]
    steps: list[Step] = [Send(c, 0, Local(OP0, parts[c][0]), parts[c][1])
                         for c in _others(rank, size) if parts[c][1]]
    if mylen:
        steps += _fold(_contributions(rank, size, Local(OP0, mine), 0), Local(RES, mine), mylen)
        steps += [Send(c, 1, Local(RES, mine), mylen) for c in _others(rank, size)]
    steps += [Copy(Incoming(c, 1), Local(RES, parts[c][0]), parts[c][1])
              for c in _others(rank, size) if parts[c][1]]
    return steps


def reduce_scatter(rank: int, size: int, count: int) -> list[Step]:
    steps: list[Step] = [Send(c, 0, Local(OP0, c * count), count) for c in _others(rank, size)]
    return steps + _fold(_contributions(rank, size, Local(OP0, rank * count), 0),
                         Local(RES, 0), count)


def alltoall(rank: int, size: int, count: int) -> list[Step]:
    steps: list[Step] = [Send(c, 0, Local(OP0, c * count), count) for c in _others(rank, size)]
    steps += [Copy(Local(OP0, rank * count) if k == rank else Incoming(k, 0),
                   Local(RES, k * count), count) for k in range(size)]
    return steps


def barrier(rank: int, size: int) -> list[Step]:
    """Dissemination: in round k each rank signals rank + 2^k and waits for rank - 2^k,
    so after ceil(log2 size) rounds every rank has heard, indirectly, from all."""
    steps: list[Step] = []
    distance, tag = 1, 0
    while distance < size:
        steps.append(Send((rank + distance) % size, tag, Local(OP0, 0), 0))
        steps.append(Copy(Incoming((rank - distance) % size, tag), Local(OP0, 0), 0))
        distance, tag = distance * 2, tag + 1
    return steps


def schedule(scenario: Scenario, rank: int, size: int, root: int, count: int) -> list[Step]:
    """The steps `rank` runs for one collective (or copy/combine) on `size` ranks."""
    if scenario == Scenario.COPY:
        return [Copy(Local(OP0, 0), Local(RES, 0), count)]
    if scenario == Scenario.COMBINE:
        return [Reduce(Local(OP0, 0), Local(OP1, 0), Local(RES, 0), count)]
    if scenario == Scenario.BCAST:
        return bcast(rank, size, root, count)
    if scenario == Scenario.SCATTER:
        return scatter(rank, size, root, count)
    if scenario == Scenario.GATHER:
        return gather(rank, size, root, count)
    if scenario == Scenario.REDUCE:
        return reduce(rank, size, root, count)
    if scenario == Scenario.ALLGATHER:
        return allgather(rank, size, count)
    if scenario == Scenario.ALLREDUCE:
        return allreduce(rank, size, count)
    if scenario == Scenario.REDUCE_SCATTER:
        return reduce_scatter(rank, size, count)
    if scenario == Scenario.ALLTOALL:
        return alltoall(rank, size, count)
    if scenario == Scenario.BARRIER:
        return barrier(rank, size)
    raise ValueError(f"no schedule for {scenario!r}")
