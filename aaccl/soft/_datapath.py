"""What the CCLO's data movers and arithmetic units do to elements, per call.

Chosen from the call's arithmetic config (read from exchange memory), its
compression flags and its reduce function, as the hardware would.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from .. import _exchmem as xm
from .._constants import OPERAND_COMPRESSION, CompressionFlags, ErrorCode

_UFUNCS = {"sum": np.add, "max": np.maximum}

OPERAND_FLAGS = int(sum(OPERAND_COMPRESSION))
"""OPERAND_COMPRESSION as one int: a plain int test costs the hot path least."""


class UnsupportedConfig(Exception):
    """The call's datapath does not exist on this CCLO: the call fails with `code`."""

    def __init__(self, code: ErrorCode = ErrorCode.ARITH_ERROR) -> None:
        super().__init__(code)
        self.code = code


def fold_one(operands: Iterable[np.ndarray]) -> np.generic:
    """The sum of the first float of each operand, in their order, as numpy's scalars:
    a third of the cost of its ufuncs on 1-element arrays, a small allreduce's fold
    (`Datapath.sums_floats`). They round as its ufuncs do, bit for bit, but for which
    NaN the sum of two NaNs keeps (the other sign, where numpy's loop takes its
    operands the other way round: IEEE 754 leaves that open)."""
    items = iter(operands)
    total = next(items)[0]
    for operand in items:
        total = total + operand[0]
    return total


class Datapath:
    """`dtype`: the uncompressed element type; `wire`: what goes over the network;
    `arith`: what the arithmetic unit adds; `slots`: the element type of each buffer
    (op0, op1, result) in memory, the compressed one where its flag is set.

    Conversions between a slot, the arithmetic and the wire are the compression
    lanes' (numpy's astype, rounding to nearest).
    """

    __slots__ = ("dtype", "wire", "arith", "ufunc", "slots", "itemsizes", "sums_floats")

    def __init__(self, cfg: xm.ArithConfig, compression_flags: int, function: int) -> None:
        if cfg.arith_is_compressed:
            lane = xm.COMPRESSION_LANES.get(cfg.compressor_tdest)
            if lane is None:
                raise UnsupportedConfig
            self.dtype, compressed = lane
        else:
            compressed = None
        if function >= len(cfg.arith_tdest) or cfg.arith_tdest[function] not in xm.ARITH_UNITS:
            raise UnsupportedConfig
        self.arith, op = xm.ARITH_UNITS[cfg.arith_tdest[function]]
        if compressed is None:
            self.dtype = self.arith
        if self.dtype.itemsize != cfg.uncompressed_elem_bytes:
            raise UnsupportedConfig
        eth = compression_flags & CompressionFlags.ETH_COMPRESSED
        self.wire = compressed if (eth and compressed is not None) else self.dtype
        self.ufunc = _UFUNCS[op]
        self.slots: tuple[np.dtype, np.dtype, np.dtype] = (self.dtype, self.dtype, self.dtype)
        if compression_flags & OPERAND_FLAGS:
            narrow = self._compressed_dtype(cfg)
            a, b, c = (narrow if compression_flags & flag else self.dtype for flag in OPERAND_COMPRESSION)
            self.slots = (a, b, c)
        self.itemsizes = tuple(dtype.itemsize for dtype in self.slots)
        # floats summed in their own type: one element of them folds as numpy's scalars
        # (`fold_one`)
        self.sums_floats = op == "sum" and self.arith == self.dtype and self.dtype.kind == "f"

    def _compressed_dtype(self, cfg: xm.ArithConfig) -> np.dtype:
        """The element type of compressed operands: the compressor lane's output, which
        the decompressor lane turns back into the uncompressed type. A config without
        such a pair of lanes cannot take compressed operands."""
        lane = xm.COMPRESSION_LANES.get(cfg.compressor_tdest)
        back = xm.COMPRESSION_LANES.get(cfg.decompressor_tdest)
        if lane is None or back != (lane[1], lane[0]) or lane[0] != self.dtype \
                or lane[1].itemsize != cfg.compressed_elem_bytes or cfg.elem_ratio_log:
            raise UnsupportedConfig(ErrorCode.COMPRESSION_ERROR)
        if self.arith not in lane:  # arithmetic on neither side of the lanes
            raise UnsupportedConfig(ErrorCode.ARITH_ERROR)
        return lane[1]

    def to_wire(self, data: np.ndarray) -> np.ndarray:
        return data if self.wire == self.dtype else data.astype(self.wire)

    def combine(self, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        if a.dtype == b.dtype == out.dtype == self.arith:
            self.ufunc(a, b, out=out)
        else:
            out[...] = self.ufunc(a.astype(self.arith, copy=False), b.astype(self.arith, copy=False))
