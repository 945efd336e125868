"""The exchange memory's layout: what the host writes and the CCLO firmware reads.

Pure data: records encode to and decode from 32-bit words. The driver writes them,
devices that model the firmware (the soft CCLO) read them back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

SIZE = 0x2000
NUM_RX_BUFS = 0x0
RX_BUF_SIZE = 0x4
RX_RECORDS = 0x8
GATHER_FLAT_TREE_MAX_FANIN = 0x1FC4
GATHER_FLAT_TREE_MAX_COUNT = 0x1FC8
BCAST_FLAT_TREE_MAX_RANKS = 0x1FCC
REDUCE_FLAT_TREE_MAX_RANKS = 0x1FD0
REDUCE_FLAT_TREE_MAX_COUNT = 0x1FD4
SPARE1 = 0x1FD8
SPARE2 = 0x1FE0
SPARE3 = 0x1FE8
PERFCNT = 0x1FF0
CFGRDY = 0x1FF4
HWID = 0x1FF8
RETCODE = 0x1FFC
CONFIG_END = GATHER_FLAT_TREE_MAX_FANIN
"""Communicators and arithmetic configs must end below this address."""

NO_SESSION = 0xFFFFFFFF
Reader = Callable[[int], int]


@dataclass(frozen=True)
class RxBuffer:
    """An eager rx buffer's record: 7 words, status first."""

    WORDS = 7
    IDLE, ENQUEUED, RESERVED = 0, 1, 2

    address: int
    status: int = IDLE
    tag: int = 0
    length: int = 0
    src: int = 0
    seq: int = 0

    def words(self) -> list[int]:
        return [self.status, self.address & 0xFFFFFFFF, self.address >> 32,
                self.tag, self.length, self.src, self.seq]

    @classmethod
    def read(cls, read: Reader, offset: int) -> RxBuffer:
        w = [read(offset + 4 * i) for i in range(cls.WORDS)]
        return cls(w[1] | (w[2] << 32), w[0], w[3], w[4], w[5], w[6])


@dataclass(frozen=True)
class RankRecord:
    """One rank of a communicator: 6 words."""

    WORDS = 6

    ip: int
    port: int
    session: int
    max_segment_size: int
    inbound_seq: int = 0
    outbound_seq: int = 0

    def words(self) -> list[int]:
        return [self.ip, self.port, self.inbound_seq, self.outbound_seq,
                self.session, self.max_segment_size]


@dataclass(frozen=True)
class Communicator:
    """A communicator's record: its size, the local rank, then one record per rank."""

    local_rank: int
    ranks: tuple[RankRecord, ...]

    @property
    def nbytes(self) -> int:
        return 4 * (2 + RankRecord.WORDS * len(self.ranks))

    def words(self) -> list[int]:
        out = [len(self.ranks), self.local_rank]
        for r in self.ranks:
            out += r.words()
        return out

    @classmethod
    def read(cls, read: Reader, offset: int) -> Communicator:
        size, local_rank = read(offset), read(offset + 4)
        if size > (CONFIG_END - offset) // (4 * RankRecord.WORDS):
            raise ValueError(f"no communicator at {offset:#x}")
        ranks = []
        for i in range(size):
            base = offset + 8 + 4 * RankRecord.WORDS * i
            w = [read(base + 4 * j) for j in range(RankRecord.WORDS)]
            ranks.append(RankRecord(ip=w[0], port=w[1], session=w[4], max_segment_size=w[5],
                                    inbound_seq=w[2], outbound_seq=w[3]))
        return cls(local_rank, tuple(ranks))

    def split(self, indices: Sequence[int]) -> Communicator:
        """The sub-communicator of `indices` (global ranks), as seen from this rank."""
        mine = self.ranks[self.local_rank]
        ranks = tuple(self.ranks[i] for i in indices)
        return Communicator(ranks.index(mine), ranks)


@dataclass(frozen=True)
class ArithConfig:
    """How the CCLO moves and reduces one (data, wire) dtype pair.

    `arith_tdest[function]` selects the arithmetic unit (see ARITH_UNITS);
    compressor/decompressor tdests select the conversion lanes (COMPRESSION_LANES).
    """

    uncompressed_elem_bytes: int
    compressed_elem_bytes: int
    elem_ratio_log: int
    compressor_tdest: int
    decompressor_tdest: int
    arith_is_compressed: bool
    arith_tdest: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return 4 * (7 + len(self.arith_tdest))

    def words(self) -> list[int]:
        return [self.uncompressed_elem_bytes, self.compressed_elem_bytes, self.elem_ratio_log,
                self.compressor_tdest, self.decompressor_tdest, len(self.arith_tdest),
                int(self.arith_is_compressed), *self.arith_tdest]

    @classmethod
    def read(cls, read: Reader, offset: int) -> ArithConfig:
        w = [read(offset + 4 * i) for i in range(7)]
        if not 0 < w[5] <= 16:
            raise ValueError(f"no arithmetic config at {offset:#x}")
        tdests = tuple(read(offset + 28 + 4 * i) for i in range(w[5]))
        return cls(w[0], w[1], w[2], w[3], w[4], bool(w[6]), tdests)


_f16, _f32, _f64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)
_i32, _i64 = np.dtype(np.int32), np.dtype(np.int64)

ARITH_UNITS: dict[int, tuple[np.dtype, str]] = {
    0: (_f32, "sum"), 1: (_f64, "sum"), 2: (_i32, "sum"), 3: (_i64, "sum"), 4: (_f16, "sum"),
    5: (_f32, "max"), 6: (_f64, "max"), 7: (_i32, "max"), 8: (_i64, "max"), 9: (_f16, "max"),
}
"""The default CCLO's arithmetic units by tdest: element type and operation."""

COMPRESSION_LANES: dict[int, tuple[np.dtype, np.dtype]] = {0: (_f32, _f16), 1: (_f16, _f32)}
"""The default CCLO's conversion lanes by tdest: (from, to)."""

DEFAULT_ARITH_CONFIGS: dict[tuple[np.dtype, np.dtype], ArithConfig] = {
    (_f16, _f16): ArithConfig(2, 2, 0, 0, 0, False, (4, 9)),
    (_f32, _f16): ArithConfig(4, 2, 0, 0, 1, True, (4, 9)),
    (_f32, _f32): ArithConfig(4, 4, 0, 0, 0, False, (0, 5)),
    (_f64, _f64): ArithConfig(8, 8, 0, 0, 0, False, (1, 6)),
    (_i32, _i32): ArithConfig(4, 4, 0, 0, 0, False, (2, 7)),
    (_i64, _i64): ArithConfig(8, 8, 0, 0, 0, False, (3, 8)),
}
"""ACCL's default arithmetic configurations, keyed by (data dtype, wire dtype)."""


def ip_encode(ip: str) -> int:
    a, b, c, d = (int(x) for x in ip.split("."))
    return (a << 24) | (b << 16) | (c << 8) | d


def ip_decode(value: int) -> str:
    return ".".join(str((value >> s) & 0xFF) for s in (24, 16, 8, 0))
