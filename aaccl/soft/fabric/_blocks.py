"""The opening exchange of a collective run by MPI: what each rank puts in, what it
makes of everyone's. Pure: no MPI here.

Over MPI every collective of the world's communicator starts with one allgather of
fixed-size blocks, a block per rank: its call's fingerprint, whether the call was
aborted or failed before it could run (with why), and, when every rank's share of
the data fits, the data itself. Fixed size means the exchange can never mismatch in
MPI's eyes, whatever the ranks called; everyone sees every block, so every rank
reaches the same verdict: a mismatch or a peer's failure fails the call on all of
them at once, small data is settled right here (one round trip in all), and larger
data then moves in one MPI collective matching the call.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import numpy as np

from ..._constants import Scenario
from ._message import Fingerprint

BLOCK = 512
"""Bytes per rank in the opening exchange."""
_HEADER = struct.Struct("<qqqq8s8sqqq")  # state, code, scenario, count, dtype, wire, root, function, size
INLINE = BLOCK - _HEADER.size
"""Bytes of data (or of a failure's reason) that ride in a rank's block."""

RUNS, ABORTED, FAILED, PENDING = 0, 1, 2, 3
"""A block's state: the call runs; it was aborted (a dependency failed, the world
was cancelled); it failed with an error code of its own before it ran; it waits for
its dependencies still (every rank then runs it with the schedules, see _lane)."""

_NONE = -1
_RUNNING = RUNS.to_bytes(8, "little")
"""A block's first 8 bytes when its call runs."""

Combine = Callable[[np.ndarray, np.ndarray, np.ndarray], None]
Raw = np.ndarray | bytearray
"""Blocks as bytes: the lane's are bytearrays, `encode` writes into arrays."""


_ALL_ALIKE = frozenset({Scenario.ALLREDUCE, Scenario.REDUCE, Scenario.ALLGATHER,
                        Scenario.GATHER})
"""Collectives to which every rank contributes `count` elements."""


def share(fp: Fingerprint, rank: int) -> int:
    """Elements `rank` contributes to a collective (the root's layout for rooted ones)."""
    scenario, count, _, _, root, _, size = fp
    if scenario == Scenario.BARRIER or count is None:
        return 0
    if scenario == Scenario.SCATTER:
        return size * count if rank == root else 0
    if scenario == Scenario.BCAST:
        return count if rank == root else 0
    if scenario in (Scenario.ALLTOALL, Scenario.REDUCE_SCATTER):
        return size * count
    return count


_ITEMSIZE = {code: np.dtype(code).itemsize for code in ("<f2", "<f4", "<f8", "<i4", "<i8")}


def fits(fp: Fingerprint) -> bool:
    """Every rank's share of the data rides in its block (no compression on the wire)."""
    scenario, count, dtype, wire, root, _, size = fp
    if dtype != wire:
        return False
    if scenario in _ALL_ALIKE:  # (`share`, inline: this is on every collective's path)
        most = count or 0
    else:
        most = share(fp, 0 if root is None else root)  # the root's share is the largest
    itemsize = _ITEMSIZE.get(dtype) or np.dtype(dtype).itemsize
    return most * itemsize <= INLINE


def encode(out: np.ndarray, fp: Fingerprint, data: np.ndarray | None = None,
           state: int = RUNS, code: int = 0, why: str = "") -> None:
    """Write a rank's block into `out` (BLOCK bytes): its fingerprint, and its data or
    the reason its call did not run."""
    scenario, count, dtype, wire, root, function, size = fp
    # (an ndarray is a buffer; numpy's stubs say so only for Python 3.12+, mypy checks 3.10)
    _HEADER.pack_into(out, 0, state, code, scenario,  # type: ignore[arg-type]
                      _NONE if count is None else count,
                      dtype.encode(), wire.encode(), _NONE if root is None else root,
                      _NONE if function is None else function, size)
    if state != RUNS:
        tail = out[_HEADER.size:]
        text = why.encode()[:INLINE]
        tail[:len(text)] = np.frombuffer(text, np.uint8)
        tail[len(text):] = 0
    elif data is not None and data.nbytes:
        out[_HEADER.size:_HEADER.size + data.nbytes] = data.reshape(-1).view(np.uint8)


TEMPLATES: dict[Fingerprint, bytes] = {}
"""A running call's block without its data (`template`), by fingerprint."""
HEAD = _HEADER.size
"""Where a block's data (or reason) starts."""


def template(fp: Fingerprint) -> bytes:
    """A running call's block (`encode`'s, state RUNS) without its data, zeros in its
    place: packed once per fingerprint (`TEMPLATES`), copied for every call."""
    raw = TEMPLATES.get(fp)
    if raw is None:
        if len(TEMPLATES) >= 4096:
            TEMPLATES.clear()
        block = np.zeros(BLOCK, np.uint8)
        encode(block, fp)
        raw = TEMPLATES[fp] = block.tobytes()
    return raw


def opening(fp: Fingerprint, data: bytes | None = None) -> bytearray:
    """A running call's block, with its data (bytes) if any."""
    block = bytearray(template(fp))
    if data:
        block[HEAD:HEAD + len(data)] = data
    return block


class Block:
    """A rank's block as read back: its state, error code, fingerprint and tail."""

    __slots__ = ("state", "code", "fp", "tail")

    def __init__(self, raw: Raw) -> None:
        state, code, scenario, count, dtype, wire, root, function, size = \
            _HEADER.unpack_from(raw, 0)  # type: ignore[arg-type]  # (a buffer: see encode)
        self.state, self.code = state, code
        self.fp: Fingerprint = (scenario, None if count == _NONE else count,
                                dtype.rstrip(b"\0").decode(), wire.rstrip(b"\0").decode(),
                                None if root == _NONE else root,
                                None if function == _NONE else function, size)
        self.tail = raw[_HEADER.size:]

    @property
    def why(self) -> str:
        return bytes(self.tail).rstrip(b"\0").decode(errors="replace")


def read(gathered: Raw, size: int) -> list[Block]:
    """Every rank's block from the exchange's receive buffer, in rank order."""
    return [Block(gathered[k * BLOCK:(k + 1) * BLOCK]) for k in range(size)]


def headers(gathered: Raw, size: int) -> list[memoryview]:
    """Every rank's header in the exchange's receive buffer, in rank order, as views
    into it (`agree`'s: a lane makes them once for its buffer)."""
    view = memoryview(gathered).cast("B")  # type: ignore[arg-type]  # (see encode)
    return [view[k * BLOCK:k * BLOCK + HEAD] for k in range(size)]


def agree(heads: list[memoryview]) -> bool:
    """Whether every rank's call runs, all with the same fingerprint: then their
    headers (`heads`: see `headers`) are the same bytes, so this compares bytes,
    copies and decodes nothing (it runs for every collective; `read` is for the rare
    exchange that disagrees)."""
    first = heads[0]
    if first[:8] != _RUNNING:
        return False
    for head in heads:  # (a loop: no generator to resume)
        if head != first:
            return False
    return True


_BCAST, _SCATTER, _GATHER, _ALLGATHER, _ALLTOALL, _REDUCE, _ALLREDUCE, _REDUCE_SCATTER = (
    int(scenario) for scenario in (Scenario.BCAST, Scenario.SCATTER, Scenario.GATHER,
                                   Scenario.ALLGATHER, Scenario.ALLTOALL, Scenario.REDUCE,
                                   Scenario.ALLREDUCE, Scenario.REDUCE_SCATTER))
_DTYPES: dict[str, np.dtype] = {}


def settle(fp: Fingerprint, rank: int, gathered: Raw, op0: np.ndarray | None,
           res: np.ndarray | None, combine: Combine) -> None:
    """Complete a collective whose data rode in the blocks (`gathered`, which
    `agree`s): write this rank's result into `op0` (a bcast's) or `res` (None where
    this rank's call has no such buffer: then it writes nothing there).
    Reductions fold contributions in rank order, as the soft CCLO's schedules do."""
    scenario, count, dtype_str, _, root, _, size = fp
    if count is None or count == 0:
        return
    dtype = _DTYPES.get(dtype_str)
    if dtype is None:
        dtype = _DTYPES[dtype_str] = np.dtype(dtype_str)
    if scenario in _ALL_ALIKE:  # every rank's share at once: rows of one strided view
        parts = np.ndarray((size, count), dtype, gathered, _HEADER.size,
                           (BLOCK, dtype.itemsize))
        if scenario == _ALLREDUCE or scenario == _REDUCE:  # (first: the most frequent)
            if scenario == _REDUCE and rank != root:
                return
            assert res is not None
            out = res[:count]
            combine(parts[0], parts[1], out) if size > 1 else np.copyto(out, parts[0])
            for k in range(2, size):
                combine(out, parts[k], out)
        elif scenario == _ALLGATHER or rank == root:  # (a gather's)
            assert res is not None
            res[:size * count] = parts.reshape(-1)
        return
    start, gathered = _HEADER.size, np.frombuffer(gathered, np.uint8)
    parts = [gathered[k * BLOCK + start:k * BLOCK + start + share(fp, k) * dtype.itemsize]
             .view(dtype) for k in range(size)]
    mine = slice(rank * count, (rank + 1) * count)
    if scenario == _BCAST:
        if rank != root:
            assert op0 is not None
            op0[:count] = parts[root]
    elif scenario == _SCATTER:
        assert res is not None
        res[:count] = parts[root][mine]
    elif scenario == _ALLTOALL:
        assert res is not None
        for k, part in enumerate(parts):
            res[k * count:(k + 1) * count] = part[mine]
    elif scenario == _REDUCE_SCATTER:
        assert res is not None
        parts = [part[mine] for part in parts]
        out = res[:count]
        combine(parts[0], parts[1], out) if size > 1 else np.copyto(out, parts[0])
        for part in parts[2:]:
            combine(out, part, out)
