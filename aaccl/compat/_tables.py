"""pyaccl's names for ACCL's numbers and exchange-memory records.

The enums are aaccl's own (pyaccl's members, plus what aaccl adds: MAX); the
records keep pyaccl's attributes and printed forms, read from and written to the
same exchange-memory layout.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import _exchmem as xm
from .._constants import CompressionFlags, ErrorCode, ReduceFunction, StreamFlags

ACCLReduceFunctions = ReduceFunction
ACCLCompressionFlags = CompressionFlags
ACCLStreamFlags = StreamFlags


class CCLOp(enum.IntEnum):
    """The CCLO's operation IDs, by pyaccl's names (aaccl's `Scenario`)."""

    config = 0
    copy = 1
    combine = 2
    send = 3
    recv = 4
    bcast = 5
    scatter = 6
    gather = 7
    reduce = 8
    allgather = 9
    allreduce = 10
    reduce_scatter = 11
    barrier = 12
    all_to_all = 13
    nop = 255


__all__ = ["ACCLArithConfig", "ACCLCommunicator", "ACCLCompressionFlags", "ACCLReduceFunctions",
           "ACCLStreamFlags", "ACCL_DEFAULT_ARITH_CONFIG", "CCLOp", "ErrorCode"]


class ACCLArithConfig:
    """How the CCLO moves and reduces one (uncompressed, compressed) dtype pair, with
    pyaccl's constructor; `exchmem_addr` is where an instance last wrote it."""

    def __init__(self, uncompressed_elem_bytes: int, compressed_elem_bytes: int,
                 elem_ratio_log: int, compressor_tdest: int, decompressor_tdest: int,
                 arith_is_compressed: int | bool, arith_tdest: list[int]) -> None:
        self.uncompressed_elem_bytes = uncompressed_elem_bytes
        self.compressed_elem_bytes = compressed_elem_bytes
        self.elem_ratio_log = elem_ratio_log
        self.compressor_tdest = compressor_tdest
        self.decompressor_tdest = decompressor_tdest
        self.arith_is_compressed = arith_is_compressed
        self.arith_tdest = list(arith_tdest)
        self.arith_nfunctions = len(self.arith_tdest)
        self.exchmem_addr: int | None = None

    @classmethod
    def _from_record(cls, cfg: xm.ArithConfig) -> ACCLArithConfig:
        return cls(cfg.uncompressed_elem_bytes, cfg.compressed_elem_bytes, cfg.elem_ratio_log,
                   cfg.compressor_tdest, cfg.decompressor_tdest, int(cfg.arith_is_compressed),
                   list(cfg.arith_tdest))

    def _record(self) -> xm.ArithConfig:
        return xm.ArithConfig(self.uncompressed_elem_bytes, self.compressed_elem_bytes,
                              self.elem_ratio_log, self.compressor_tdest, self.decompressor_tdest,
                              bool(self.arith_is_compressed), tuple(self.arith_tdest))

    @property
    def addr(self) -> int:
        if self.exchmem_addr is None:
            raise ValueError("this arithmetic config has not been written to a CCLO")
        return self.exchmem_addr

    def __str__(self) -> str:
        return (f"Arithmetic Config at address {self.exchmem_addr}\n"
                f"Uncompressed dtype B/element: {self.uncompressed_elem_bytes}\n"
                f"Compressed dtype B/element: {self.compressed_elem_bytes}\n"
                f"Ratio of number of compressed to uncompressed elements: "
                f"{2 ** self.elem_ratio_log}\n"
                f"Perform arithmetic on compressed dtype: {bool(self.arith_is_compressed)}\n"
                f"Compressor ID: {self.compressor_tdest}\n"
                f"Decompressor ID: {self.decompressor_tdest}\n"
                f"Reduction function IDs: {self.arith_tdest}\n")


ACCL_DEFAULT_ARITH_CONFIG: dict[tuple[str, str], ACCLArithConfig] = {
    (data.name, wire.name): ACCLArithConfig._from_record(cfg)
    for (data, wire), cfg in xm.DEFAULT_ARITH_CONFIGS.items()
}
"""ACCL's default configurations by (uncompressed, compressed) dtype name; each
also lists the MAX unit after the SUM unit pyaccl 0.2 listed."""


def arith_records(configs: dict[tuple[str, str], ACCLArithConfig],
                  ) -> dict[tuple[np.dtype, np.dtype], xm.ArithConfig]:
    return {(np.dtype(a), np.dtype(b)): cfg._record() for (a, b), cfg in configs.items()}


class ACCLCommunicator:
    """One communicator as pyaccl showed it: `ranks` (a dict per rank: ip, port,
    session_id, max_segment_size, inbound/outbound_seq_number), `local_rank`, `index`
    and `addr`. `readback()` refreshes the dicts from the CCLO's exchange memory."""

    def __init__(self, record: xm.Communicator, index: int, address: int,
                 read: Callable[[int], int]) -> None:
        self.local_rank, self.index, self.exchmem_addr = record.local_rank, index, address
        self._read = read
        self.ranks: list[dict[str, Any]] = []
        self._fill(record)

    @property
    def addr(self) -> int:
        return self.exchmem_addr

    def _fill(self, record: xm.Communicator) -> None:
        self.ranks[:] = [{"ip": xm.ip_decode(r.ip), "port": r.port, "session_id": r.session,
                          "max_segment_size": r.max_segment_size,
                          "inbound_seq_number": r.inbound_seq,
                          "outbound_seq_number": r.outbound_seq} for r in record.ranks]

    def readback(self) -> None:
        """Read the communicator back from the CCLO (sequence numbers change as
        messages pass), and say so, as pyaccl did."""
        record = xm.Communicator.read(self._read, self.exchmem_addr)
        self.local_rank = record.local_rank
        self._fill(record)
        print(f"Communicator readback on local_rank {self.local_rank} of {len(self.ranks)}.")

    def __str__(self) -> str:
        lines = [f"Communicator {self.index} at address {self.exchmem_addr}, "
                 f"rank {self.local_rank} of {len(self.ranks)}:\n"]
        for i, r in enumerate(self.ranks):
            if i != self.local_rank:
                lines.append(f"Rank {i} -> IP: {r['ip']}, Port: {r['port']}, "
                             f"Session: {r['session_id']}, SegSize: {r['max_segment_size']}, "
                             f"ISeq: {r['inbound_seq_number']}, "
                             f"OSeq: {r['outbound_seq_number']}\n")
        return "".join(lines)

    def __repr__(self) -> str:
        return (f"<ACCLCommunicator {self.index}: rank {self.local_rank} of {len(self.ranks)} "
                f"at {self.exchmem_addr:#x}>")
