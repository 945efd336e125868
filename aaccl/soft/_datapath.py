"""What the CCLO's data movers and arithmetic units do to elements, per call.

Chosen from the call's arithmetic config (read from exchange memory), its
compression flags and its reduce function, as the hardware would.
"""

from __future__ import annotations

import numpy as np

from .. import _exchmem as xm
from .._constants import CompressionFlags

_UFUNCS = {"sum": np.add, "max": np.maximum}


class UnsupportedConfig(Exception):
    """The arithmetic config or function does not exist on this CCLO."""


class Datapath:
    __slots__ = ("dtype", "wire", "arith", "ufunc")

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

    def to_wire(self, data: np.ndarray) -> np.ndarray:
        return data if self.wire == self.dtype else data.astype(self.wire)

    def combine(self, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        if a.dtype == b.dtype == out.dtype == self.arith:
            self.ufunc(a, b, out=out)
        else:
            out[...] = self.ufunc(a.astype(self.arith, copy=False), b.astype(self.arith, copy=False))
