"""Argument checks: bad input fails here, before anything reaches the device."""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import Any

import numpy as np

from .._constants import (COMPRESSION_PAIRS, MAX_STREAM_ID, SUPPORTED_DTYPES, TAG_ANY,
                          ReduceFunction, StreamFlags)
from ._buffer import Buffer
from ._call import Call


def dtype(value: Any) -> np.dtype:
    """A dtype a buffer can hold: any numpy dtype of plain data. The CCLO itself moves
    only SUPPORTED_DTYPES (`buffer` checks that per call); the others (bytes, int8,
    complex, records) serve kernels and transfers."""
    try:
        dt = np.dtype(value)
    except TypeError:
        raise TypeError(f"{value!r} is not a dtype") from None
    if dt.hasobject:
        raise TypeError(f"dtype {dt} holds Python objects, which device memory cannot")
    return dt


def _cclo_dtypes() -> str:
    return ", ".join(d.name for d in SUPPORTED_DTYPES)


def _integer(value: Any, name: str) -> int:
    """An integer argument (numpy integers too; bools are not counts or ranks)."""
    if type(value) is int:  # the common case, without the ABC check's cost
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, not {type(value).__name__}")
    return int(value)


def index(value: Any, name: str, limit: int) -> int:
    value = _integer(value, name)
    if not 0 <= value < limit:
        raise ValueError(f"{name} {value} is out of range: this communicator has {limit} ranks")
    return value


def count(value: Any) -> int:
    value = _integer(value, "count")
    if value < 0:
        raise ValueError(f"count must not be negative, got {value}")
    if value >= 2**32:
        raise ValueError(f"count {value} does not fit the CCLO's 32-bit count")
    return value


def tag(value: Any) -> int:
    value = _integer(value, "tag")
    if not 0 <= value <= TAG_ANY:
        raise ValueError(f"tag {value} is not a 32-bit unsigned integer")
    return value


def function(value: Any) -> ReduceFunction:
    if type(value) is ReduceFunction:
        return value
    # an integer (numpy's too) naming one; not a float or bool that equals one (0.0, True)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        try:
            return ReduceFunction(int(value))
        except ValueError:
            pass
    names = ", ".join(f.name for f in ReduceFunction)
    raise ValueError(f"{value!r} is not a reduce function: use ReduceFunction ({names})")


def buffer(buf: Any, name: str, owner: object, elements: int, cclo: bool = True) -> Buffer:
    """A buffer of this rank holding at least `elements` elements, of a dtype the CCLO
    moves (unless `cclo` is False: kernels and transfers take any). Looks up its device
    address, which the call then reads as `buf._address`."""
    if type(buf) is Buffer:  # the common case, in one test
        alloc = buf._allocation
        if alloc is not None and alloc.owner is owner and buf._address is not None \
                and elements <= buf.size and (not cclo or buf.dtype in SUPPORTED_DTYPES):
            return buf
    if not isinstance(buf, Buffer):
        raise TypeError(f"{name} must be a Buffer from ACCL.allocate(), "
                        f"not {type(buf).__name__}")
    alloc = buf._allocation
    if alloc is None or alloc.owner is not owner:
        raise ValueError(f"{name} belongs to another rank: allocate it on this ACCL")
    _ = buf.device_address  # raises for views that are not device memory
    if elements > buf.size:
        raise ValueError(f"{name} holds {buf.size} elements, the call needs {elements}")
    if cclo and buf.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} holds {buf.dtype}, which the CCLO does not move (it moves "
                        f"{_cclo_dtypes()}); buffers of other dtypes serve kernels and "
                        "transfers")
    return buf


def buffers(sbuf: Any, rbuf: Any, owner: object, sends: int, receives: int,
            ) -> tuple[Buffer, Buffer]:
    """`buffer` of a collective's sbuf and rbuf, in one call: the common case (two of
    this rank's buffers, large enough) in one test."""
    if type(sbuf) is Buffer and type(rbuf) is Buffer:
        s, r = sbuf._allocation, rbuf._allocation
        if s is not None and r is not None and s.owner is owner and r.owner is owner \
                and sbuf._address is not None and rbuf._address is not None \
                and sends <= sbuf.size and receives <= rbuf.size \
                and sbuf.dtype in SUPPORTED_DTYPES and rbuf.dtype in SUPPORTED_DTYPES:
            return sbuf, rbuf
    return buffer(sbuf, "sbuf", owner, sends), buffer(rbuf, "rbuf", owner, receives)


def same_dtype(**buffers: Buffer | None) -> np.dtype:
    dtypes = {name: b.dtype for name, b in buffers.items() if b is not None}
    first, *others = dtypes.values()
    if any(d != first for d in others):
        listed = ", ".join(f"{n}: {d.name}" for n, d in dtypes.items())
        raise TypeError(f"buffers must share one dtype ({listed})")
    return first


def mixed_dtypes(**buffers: Buffer) -> tuple[np.dtype, ...]:
    """The buffers' dtypes, in order: one dtype, or a pair the CCLO's compression lanes
    convert between (float32 with float16), for copy and combine."""
    dtypes = tuple(b.dtype for b in buffers.values())
    distinct = set(dtypes)
    if len(distinct) > 1:
        pair = tuple(sorted(distinct, key=lambda d: -d.itemsize))
        if pair not in COMPRESSION_PAIRS:
            listed = ", ".join(f"{n}: {d.name}" for n, d in zip(buffers, dtypes))
            pairs = ", ".join(f"{a.name} with {b.name}" for a, b in COMPRESSION_PAIRS)
            raise TypeError(f"buffers must share one dtype or mix {pairs} ({listed})")
    return dtypes


def compression(data: np.dtype, compress_dtype: Any) -> np.dtype | None:
    if compress_dtype is None:
        return None
    wire = np.dtype(compress_dtype)
    if wire == data:
        return None
    if (data, wire) not in COMPRESSION_PAIRS:
        pairs = ", ".join(f"{a.name} -> {b.name}" for a, b in COMPRESSION_PAIRS)
        raise ValueError(f"the CCLO cannot compress {data.name} to {wire.name} (supported: {pairs})")
    return wire


def stream_flags(value: Any, op: str, allowed: int) -> int:
    """`stream_flags` for `op`, which takes the `allowed` ones: where ACCL's firmware
    would ignore a flag (recv has no operand to read from a stream), it is more likely
    a slip than a wish."""
    bits = _integer(value, "stream_flags")
    if bits & ~allowed or bits < 0:
        if not 0 <= bits <= StreamFlags.OP0_STREAM | StreamFlags.RES_STREAM:
            raise ValueError(f"stream_flags {value!r} is not a combination of StreamFlags "
                             "OP0_STREAM (1) and RES_STREAM (2)")
        takes = " or ".join(str(f.name) for f in StreamFlags if f & allowed)
        raise ValueError(f"{op} takes stream_flags {takes}, not {StreamFlags(bits).name}: "
                         "ACCL's firmware ignores the others")
    return bits


def stream_id(tag: int) -> int:
    """The tag of a send into a peer's kernel stream (RES_STREAM), its stream id."""
    if tag > MAX_STREAM_ID:
        raise ValueError(f"a send with RES_STREAM puts the data into the peer's kernel stream "
                         f"under its tag, which must be 0..{MAX_STREAM_ID}, not {tag}")
    return tag


def flags(**values: Any) -> None:
    """Flags such as from_fpga are True or False: a truthy string or None is more
    likely a slip (an argument in the wrong place) than a wish."""
    for name, value in values.items():
        if value is not True and value is not False and not isinstance(value, np.bool_):
            raise TypeError(f"{name} must be True or False, not {value!r}")


def waitfor(calls: Iterable[Any], owner: object) -> tuple[Call, ...]:
    """The calls a call waits for: an iterable of this rank's Calls."""
    if isinstance(calls, Call):
        raise TypeError(f"waitfor takes a list of Calls, not one: waitfor=[{calls.name}]")
    try:
        out = tuple(calls)
    except TypeError:
        raise TypeError(f"waitfor takes a list of Calls (leave it out for none), "
                        f"not {type(calls).__name__}") from None
    for call in out:
        if not isinstance(call, Call):
            raise TypeError(f"waitfor takes Calls, not {type(call).__name__}")
        if call.owner is None:
            raise TypeError(f"waitfor takes the Calls a rank returned, not a device's own "
                            f"call ({call.name})")
        if call.owner is not owner:
            raise ValueError(f"{call.name} belongs to another rank: a call can only wait for "
                             "calls of its own rank")
        call._used = call._seen = True  # a dependent waits for it: not dropped unawaited
    return out
