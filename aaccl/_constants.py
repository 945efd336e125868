"""ACCL's numbers: operation IDs, flags and error bits, as the CCLO firmware defines them."""

from __future__ import annotations

import enum

import numpy as np

TAG_ANY = 0xFFFFFFFF
"""Matches any tag in a receive (and is the default tag of a send)."""

GLOBAL_COMM = 0
"""ID of the communicator that holds every rank."""


class Scenario(enum.IntEnum):
    """The CCLO's operation IDs, the first argument of every call."""

    CONFIG = 0
    COPY = 1
    COMBINE = 2
    SEND = 3
    RECV = 4
    BCAST = 5
    SCATTER = 6
    GATHER = 7
    REDUCE = 8
    ALLGATHER = 9
    ALLREDUCE = 10
    REDUCE_SCATTER = 11
    BARRIER = 12
    ALLTOALL = 13
    NOP = 255


class ConfigFunction(enum.IntEnum):
    """Sub-functions of a CONFIG call, passed in the `function` argument."""

    RESET_PERIPH = 0
    ENABLE_PKT = 1
    SET_TIMEOUT = 2
    SET_MAX_EAGER_MSG_SIZE = 3
    SET_MAX_RENDEZVOUS_MSG_SIZE = 4


class ReduceFunction(enum.IntEnum):
    """Elementwise reduction applied by combine, reduce, allreduce and reduce_scatter."""

    SUM = 0
    MAX = 1


class CompressionFlags(enum.IntFlag):
    NO_COMPRESSION = 0
    OP0_COMPRESSED = 1
    OP1_COMPRESSED = 2
    RES_COMPRESSED = 4
    ETH_COMPRESSED = 8


OPERAND_COMPRESSION = (CompressionFlags.OP0_COMPRESSED, CompressionFlags.OP1_COMPRESSED,
                       CompressionFlags.RES_COMPRESSED)
"""The flags that mark a call's buffers (op0, op1, result) as holding compressed
elements, in the order of its three addresses."""


class StreamFlags(enum.IntFlag):
    NO_STREAM = 0
    OP0_STREAM = 1
    RES_STREAM = 2


MAX_STREAM_ID = 246
"""The largest tag of a send into a peer's kernel stream (RES_STREAM): ACCL routes it
as tag + 9 through an 8-bit TDEST, and its driver rejects larger ones."""


class ErrorCode(enum.IntFlag):
    """The bits of the CCLO's return code (ACCL's `errorCode`)."""

    COLLECTIVE_OP_SUCCESS = 0
    DMA_MISMATCH_ERROR = 1 << 0
    DMA_INTERNAL_ERROR = 1 << 1
    DMA_DECODE_ERROR = 1 << 2
    DMA_SLAVE_ERROR = 1 << 3
    DMA_NOT_OKAY_ERROR = 1 << 4
    DMA_NOT_END_OF_PACKET_ERROR = 1 << 5
    DMA_NOT_EXPECTED_BTT_ERROR = 1 << 6
    DMA_TIMEOUT_ERROR = 1 << 7
    CONFIG_SWITCH_ERROR = 1 << 8
    DEQUEUE_BUFFER_TIMEOUT_ERROR = 1 << 9
    DEQUEUE_BUFFER_SPARE_BUFFER_STATUS_ERROR = 1 << 10
    RECEIVE_TIMEOUT_ERROR = 1 << 11
    DEQUEUE_BUFFER_SPARE_BUFFER_DMATAG_MISMATCH = 1 << 12
    DEQUEUE_BUFFER_SPARE_BUFFER_INDEX_ERROR = 1 << 13
    COLLECTIVE_NOT_IMPLEMENTED = 1 << 14
    RECEIVE_OFFCHIP_SPARE_BUFF_ID_NOT_VALID = 1 << 15
    EAGER_THRESHOLD_INVALID = 1 << 16
    RENDEZVOUS_THRESHOLD_INVALID = 1 << 17
    DMA_SIZE_ERROR = 1 << 18
    ARITH_ERROR = 1 << 19
    PACK_TIMEOUT_STS_ERROR = 1 << 20
    PACK_SEQ_NUMBER_ERROR = 1 << 21
    COMPRESSION_ERROR = 1 << 22
    KRNL_TIMEOUT_STS_ERROR = 1 << 23
    KRNL_STS_COUNT_ERROR = 1 << 24
    SEGMENTER_EXPECTED_BTT_ERROR = 1 << 25
    DMA_TAG_MISMATCH_ERROR = 1 << 26

    def names(self) -> list[str]:
        """Every set bit's name, lowest first; unknown bits as hex."""
        names = [bit.name for bit in ErrorCode if bit.value and bit.value & self.value]
        unknown = self.value & ~_KNOWN_BITS
        if unknown:
            names.append(hex(unknown))
        return [name for name in names if name is not None]


_KNOWN_BITS = sum(1 << i for i in range(27))

SUPPORTED_DTYPES: tuple[np.dtype, ...] = tuple(
    np.dtype(t) for t in (np.float16, np.float32, np.float64, np.int32, np.int64)
)
"""Element types the CCLO's arithmetic and data movers handle."""

COMPRESSION_PAIRS: frozenset[tuple[np.dtype, np.dtype]] = frozenset(
    {(np.dtype(np.float32), np.dtype(np.float16))}
)
"""(data dtype, wire dtype) pairs the CCLO can compress on the wire."""
