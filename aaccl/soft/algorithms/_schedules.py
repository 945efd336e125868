"""Collective algorithms as pure schedules: which chunk goes where, what gets reduced.

A schedule is the list of steps one rank runs for one collective. Steps name the
call's buffers by slot (0 = addr_0, 1 = addr_1, 2 = addr_2) and offsets in elements;
messages are named by peer and a small tag that both ends of a transfer compute
alike. No I/O happens here, so every algorithm is tested by simulating it.

Reductions fold contributions in rank order, so every rank of an allreduce computes
bit-identical results and floating-point sums do not depend on arrival order.
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
"""Allreduce of at most this many elements sends whole vectors in one phase (lower
latency); larger ones reduce-scatter then allgather (each rank reduces 1/size)."""


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


def allreduce(rank: int, size: int, count: int,
              small_count: int = SMALL_ALLREDUCE_COUNT) -> list[Step]:
    if count <= small_count or size == 1:
        steps: list[Step] = [Send(p, 0, Local(OP0, 0), count) for p in _others(rank, size)]
        return steps + _fold(_contributions(rank, size, Local(OP0, 0), 0), Local(RES, 0), count)
    parts = chunks(count, size)
    mine, mylen = parts[rank]
    steps = [Send(c, 0, Local(OP0, parts[c][0]), parts[c][1])
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
    steps: list[Step] = [Send(p, 0, Local(OP0, 0), 0) for p in _others(rank, size)]
    return steps + [Copy(Incoming(p, 0), Local(OP0, 0), 0) for p in _others(rank, size)]


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
