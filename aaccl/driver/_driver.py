"""The CCLO host protocol, written once for every device.

The driver lays out the exchange memory as ACCL's firmware expects it, encodes the
12-argument call and decodes the return code. It knows buffers only as device
addresses and dtypes; validation and host<->device syncs belong to the API above.
"""

from __future__ import annotations

import math
import numbers
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from .. import _exchmem as xm
from .._constants import (
    GLOBAL_COMM,
    OPERAND_COMPRESSION,
    TAG_ANY,
    CompressionFlags,
    ConfigFunction,
    Scenario,
)
from .._errors import Aborted, ACCLError, CCLOError, DependencyError, DeviceError, KernelError
from ..devices import CallArgs, Device, DeviceCall
from . import _firmware as firmware

OperandDtypes = tuple[np.dtype | None, np.dtype | None, np.dtype | None]
"""Element types of a call's buffers (op0, op1, result); None for a buffer it lacks."""

_new_tuple = tuple.__new__
"""`_new_tuple(CallArgs, fields)`: CallArgs from a tuple of its 12 fields, without the
namedtuple's Python-level constructor (a call's worth of cost on every submission)."""

CONFIG_TIMEOUT = 60.0
"""Seconds the driver waits for one configuration call before giving up on the device."""
MAX_TICKS = 0xFFFFFFFF
"""The most timer ticks SET_TIMEOUT's 32-bit register holds."""
STACKS = ("tcp", "udp", "rdma")
"""The network stacks ACCL's CCLO runs on."""
EAGER_ONLY = 1 << 30
"""The eager threshold on ACCL's TCP and UDP stacks, which cannot carry rendezvous:
every message is eager."""


def eager_threshold(stack: str, bufsize: int) -> int:
    """Bytes up to which a message is eager on `stack`: any message on TCP and UDP;
    one rx buffer's worth on RDMA, above which it goes rendezvous, as ACCL's drivers
    set it (accl_network_utils: the eager size is the rx buffer size, which the
    firmware takes as its least)."""
    if stack not in STACKS:
        raise ValueError(f"stack must be one of {', '.join(map(repr, STACKS))}, got {stack!r}")
    return bufsize if stack == "rdma" else EAGER_ONLY


def check_buffers(nbufs: Any, bufsize: Any, nranks: int | None = None,
                  arith_configs: Iterable[xm.ArithConfig] | None = None) -> None:
    """Raise ValueError unless `nbufs` rx buffers of `bufsize` bytes suit the CCLO:
    whole bytes in 8-byte words, sizes its 32-bit registers hold, and records that
    fit its exchange memory beside the world's communicator of `nranks` (if given)
    and the arithmetic configs. Pure: run it before any device is touched."""
    for name, value in (("nbufs", nbufs), ("bufsize", bufsize)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if bufsize % 8:
        raise ValueError(f"bufsize must be a multiple of 8 bytes, got {bufsize}")
    if nbufs * bufsize >= 2**32:
        raise ValueError(f"nbufs * bufsize ({nbufs} * {bufsize}) must stay below 4 GiB: the "
                         "CCLO's message size registers are 32-bit")
    if nranks is None:
        return
    configs = xm.DEFAULT_ARITH_CONFIGS.values() if arith_configs is None else arith_configs
    room = xm.CONFIG_END - xm.RX_RECORDS - sum(cfg.nbytes for cfg in configs)
    per_rank, record = 4 * xm.RankRecord.WORDS, 4 * xm.RxBuffer.WORDS
    world = 8 + per_rank * nranks  # the communicator's record (xm.Communicator.nbytes)
    if world + record > room:
        raise ValueError(f"a world of {nranks} ranks does not fit the CCLO's exchange memory "
                         f"beside one rx buffer: at most {(room - record - 8) // per_rank} ranks")
    if world + nbufs * record > room:
        raise ValueError(f"nbufs={nbufs} rx buffers do not fit the CCLO's exchange memory "
                         f"beside a world of {nranks} ranks: at most {(room - world) // record}")


def check_timeout(device: Device, seconds: Any) -> float:
    """`seconds` if the device can hold it as a call's timeout, else ValueError (before
    anything reaches the device). Devices that enforce the timeout on the host
    (`enforces_call_timeout`) hold any; others only what SET_TIMEOUT's register does."""
    real = isinstance(seconds, numbers.Real) and not isinstance(seconds, bool)
    value = float(seconds) if real else math.nan
    if not 0 < value < math.inf:
        raise ValueError(f"timeout must be a positive number of seconds, got {seconds!r}")
    limit = MAX_TICKS / device.timer_hz
    if not device.enforces_call_timeout and value > limit:
        raise ValueError(f"timeout={seconds:g} s is more than {type(device).__name__} can "
                         f"hold: its timer register counts at most {limit:g} s")
    return value


def _itemsizes(operand_dtypes: OperandDtypes) -> tuple[int, int, int]:
    """Element bytes of a call's three buffers; those it lacks as its first one's
    (zeros for a call without buffers)."""
    first = next((d for d in operand_dtypes if d is not None), None)
    if first is None:
        return 0, 0, 0
    a, b, c = ((first if d is None else d).itemsize for d in operand_dtypes)
    return a, b, c


class Driver:
    """Configures one CCLO and submits its calls."""

    def __init__(self, device: Device, local_rank: int, ranks: Sequence[xm.RankRecord], *,
                 nbufs: int = 16, bufsize: int = 1024, timeout: float = 10.0,
                 max_eager_size: int | None = None,
                 arith_configs: dict[tuple[np.dtype, np.dtype], xm.ArithConfig] | None = None,
                 stack: str | None = None) -> None:
        """`stack` is the network stack the CCLO runs on ("tcp", "udp", "rdma"): it
        sets the eager threshold (unless `max_eager_size` does), and on TCP and UDP
        ACCL's firmware cannot run barrier or alltoall, which always go rendezvous.
        None: unknown, with a threshold of a quarter of the rx buffers."""
        self.device = device
        self.stack = stack
        if stack is not None and max_eager_size is None:
            max_eager_size = eager_threshold(stack, bufsize)
        self.arith_configs = dict(xm.DEFAULT_ARITH_CONFIGS if arith_configs is None
                                  else arith_configs)
        self.nbufs, self.bufsize, self.timeout = nbufs, bufsize, check_timeout(device, timeout)
        self.max_eager_size = bufsize * max(1, nbufs // 4) if max_eager_size is None else max_eager_size
        self.max_rendezvous_size = max(bufsize * nbufs, self.max_eager_size + 1)
        self._world = xm.Communicator(local_rank, tuple(ranks))
        self.communicators: list[tuple[int, xm.Communicator]] = []
        self._arith: dict[tuple[np.dtype, np.dtype], int] = {}
        # (dtype, compress_dtype, operand_dtypes) -> (arithcfg, compression flags): `_encode`
        self._codes: dict[tuple[Any, Any, Any], tuple[int, int]] = {}
        self._allocations: list[int] = []
        self._next_free = xm.RX_RECORDS
        # exchange memory and `communicators` grow from any thread (pyaccl's threads
        # split communicators on one instance): one writer at a time
        self._records = threading.RLock()

    # -- configuration (blocking: run it off the event loop) -------------------------

    def configure(self) -> None:
        """Bring a reset CCLO to ready, as ACCL's driver does, and check each step."""
        self._config_call(ConfigFunction.RESET_PERIPH)
        # the firmware acknowledges the reset before its init clears CFGRDY: give it a moment
        deadline = time.monotonic() + 1.0
        while self.device.mmio_read(xm.CFGRDY) != 0:
            if time.monotonic() > deadline:
                raise RuntimeError("the CCLO is configured already: is another process using it?")
            time.sleep(0.001)
        self._setup_rx_buffers()
        self._setup_spares()
        self._write_communicator(self._world)
        self._codes.clear()  # (the configs' addresses are written anew)
        for key, cfg in self.arith_configs.items():
            self._arith[key] = self._write_record(cfg.words())
        self._write_words(xm.GATHER_FLAT_TREE_MAX_FANIN, [2, 32 * 1024, 3, 4, min(self.max_rendezvous_size // 4, 32 * 1024)])
        self.device.mmio_write(xm.CFGRDY, 1)
        self._config_call(ConfigFunction.SET_TIMEOUT, self._timeout_ticks(self.timeout))
        self._hold_timeout()
        self._config_call(ConfigFunction.SET_MAX_EAGER_MSG_SIZE, self.max_eager_size)
        self._config_call(ConfigFunction.SET_MAX_RENDEZVOUS_MSG_SIZE, self.max_rendezvous_size)
        self._config_call(ConfigFunction.ENABLE_PKT)

    def _setup_rx_buffers(self) -> None:
        offset = xm.RX_RECORDS
        for _ in range(self.nbufs):
            address = self._alloc(self.bufsize)
            self._write_words(offset, xm.RxBuffer(address).words())
            offset += 4 * xm.RxBuffer.WORDS
        self._next_free = offset
        self.device.mmio_write(xm.RX_BUF_SIZE, self.bufsize)
        self.device.mmio_write(xm.NUM_RX_BUFS, self.nbufs)  # last: the firmware waits for it

    def _setup_spares(self) -> None:
        """Scratch buffers the firmware's rendezvous collectives use, as large as the
        default biggest rendezvous message (as ACCL's driver sizes them)."""
        for offset in (xm.SPARE1, xm.SPARE2, xm.SPARE3):
            address = self._alloc(self.bufsize * self.nbufs)
            self._write_words(offset, [address & 0xFFFFFFFF, address >> 32])

    def _alloc(self, nbytes: int) -> int:
        address = self.device.alloc(nbytes)
        self._allocations.append(address)
        self.device.write(address, np.zeros(nbytes, np.uint8))
        return address

    def _write_communicator(self, comm: xm.Communicator) -> int:
        with self._records:
            address = self._write_record(comm.words())
            self.communicators.append((address, comm))
            return len(self.communicators) - 1

    def _write_record(self, words: list[int]) -> int:
        with self._records:
            address = self._next_free
            if address + 4 * len(words) > xm.CONFIG_END:
                raise ValueError("the exchange memory is full: no room for another communicator")
            self._write_words(address, words)
            self._next_free = address + 4 * len(words)
            return address

    def _write_words(self, offset: int, words: Sequence[int]) -> None:
        for i, word in enumerate(words):
            self.device.mmio_write(offset + 4 * i, word)

    def _timeout_ticks(self, seconds: float) -> int:
        """SET_TIMEOUT's value: timer ticks, saturated at what its 32-bit register holds
        (about 17 s at a card's 250 MHz). The firmware stores it but never acts on it."""
        return max(1, min(MAX_TICKS, round(seconds * self.device.timer_hz)))

    def _hold_timeout(self) -> None:
        """Make the device fail a call after `timeout` seconds, whatever the register
        holds: devices that enforce the timeout on the host take it in seconds."""
        self.device.set_call_timeout(self.timeout)

    def _config_call(self, function: ConfigFunction, value: int = 0) -> None:
        call = self.device.start(CallArgs(Scenario.CONFIG, value, 0, 0, int(function), TAG_ANY,
                                          0, 0, 0, 0, 0, 0))
        if not call.block(CONFIG_TIMEOUT):
            raise TimeoutError(f"the CCLO did not answer config {function.name} "
                               f"within {CONFIG_TIMEOUT} s")
        error = self.error(call, f"config {function.name.lower()}")
        if error is not None:
            raise error

    # -- communicators and arithmetic -------------------------------------------------

    def split_communicator(self, indices: Sequence[int]) -> int:
        """Write the sub-communicator of `indices` (global ranks); return its ID."""
        return self._write_communicator(self._world.split(indices))

    def comm(self, comm_id: int) -> xm.Communicator:
        return self.communicators[comm_id][1]

    def arithcfg(self, dtype: np.dtype, wire: np.dtype) -> int:
        """Exchange-memory address of the arithmetic config for (dtype, wire dtype)."""
        return self._arith[(dtype, wire)]

    # -- calls ------------------------------------------------------------------------

    def start(self, scenario: Scenario, count: int = 0, comm_id: int = GLOBAL_COMM,
              root_src_dst: int = 0, function: int = 0, tag: int = TAG_ANY,
              dtype: np.dtype | None = None, compress_dtype: np.dtype | None = None,
              operand_dtypes: OperandDtypes | None = None,
              stream_flags: int = 0, addrs: tuple[int, int, int] = (0, 0, 0),
              waitfor: Sequence[DeviceCall] = ()) -> DeviceCall:
        """Encode one call and hand it to the device. (Its arguments may come by
        position, in this order: `ACCL._submit` passes them so, on every call's path.)

        `dtype` is the element type of every buffer, `compress_dtype` the one on the
        wire (ETH_COMPRESSED). For buffers of mixed precision pass `operand_dtypes`
        instead: the element types of (op0, op1, result), None where the call has no
        such buffer. Two types select the arithmetic config (wider, narrower) and mark
        the buffers of the narrower type OP0/OP1/RES_COMPRESSED, as pyaccl does.

        On ACCL's firmware (`device.runs_accl_firmware`), a call it would hang on or
        get wrong runs as equivalent calls instead, one device call for them all
        (`_firmware.substitute`); one nothing can stand in for raises ValueError.
        """
        arithcfg, flags = self._codes.get((dtype, compress_dtype, operand_dtypes)) \
            or self._encode(dtype, compress_dtype, operand_dtypes)
        (address, _), (a0, a1, a2) = self.communicators[comm_id], addrs  # (one tuple made)
        args = _new_tuple(CallArgs, (int(scenario), count, address, root_src_dst, function, tag,
                                     arithcfg, flags, stream_flags, a0, a1, a2))
        if not self.device.runs_accl_firmware:
            return self.device.start(args, waitfor)
        if scenario in firmware.RENDEZVOUS_ONLY and self.stack in ("tcp", "udp"):
            # through rendezvous notifications the stack never delivers: it would spin
            refused = DeviceCall(args)
            refused.complete(error=DeviceError(
                f"ACCL's firmware cannot run {scenario.name.lower()} over a {self.stack} "
                "stack (it needs the rendezvous protocol of an RDMA stack)"))
            return refused
        if dtype is not None:
            operand_dtypes = (dtype, None, None)
        itemsizes = _itemsizes(operand_dtypes) if operand_dtypes is not None else (0, 0, 0)
        comm = self.comm(comm_id)
        steps = firmware.substitute(args, len(comm.ranks), itemsizes,
                                    firmware.Setup(self.bufsize, self.max_eager_size),
                                    comm.local_rank)
        if steps is None:
            return self.device.start(args, waitfor)
        return self.device.start_steps(args, steps, waitfor)  # in one place of its order

    def _encode(self, dtype: np.dtype | None, compress_dtype: np.dtype | None,
                operand_dtypes: OperandDtypes | None) -> tuple[int, int]:
        """A call's (arithmetic config address, compression flags) for these element
        types (see `start`), kept for the next call with them: they depend on nothing
        else, and the configs are written once, at `configure`."""
        key = (dtype, compress_dtype, operand_dtypes)
        if dtype is not None:
            if operand_dtypes is not None:
                raise TypeError("pass dtype or operand_dtypes, not both")
            operand_dtypes = (dtype, None, None)
        if operand_dtypes is None:
            arithcfg, flags = 0, CompressionFlags.NO_COMPRESSION
        else:
            arithcfg, flags = self._operand_compression(operand_dtypes, compress_dtype)
        code = self._codes[key] = (arithcfg, int(flags))
        return code

    def _operand_compression(self, operand_dtypes: OperandDtypes,
                             compress_dtype: np.dtype | None) -> tuple[int, CompressionFlags]:
        """(arithmetic config address, compression flags) for buffers of these element
        types, as pyaccl chooses them: one dtype is a plain call; two make the
        narrower one the compressed type, the config (wider, narrower), and set
        OP0/OP1/RES_COMPRESSED for the buffers of the narrower type. `compress_dtype`
        equal to the narrower type also compresses the wire (ETH_COMPRESSED)."""
        present = {d for d in operand_dtypes if d is not None}
        if len(present) <= 1:
            if not present:
                return 0, CompressionFlags.NO_COMPRESSION
            (dtype,) = present
            if compress_dtype is None or compress_dtype == dtype:
                return self._config(dtype, dtype), CompressionFlags.NO_COMPRESSION
            return self._config(dtype, compress_dtype), CompressionFlags.ETH_COMPRESSED
        narrow, *_, wide = sorted(present, key=lambda d: d.itemsize)
        if len(present) > 2 or narrow.itemsize == wide.itemsize:
            names = ", ".join("-" if d is None else d.name for d in operand_dtypes)
            raise TypeError(f"operands of types ({names}) are no (uncompressed, compressed) "
                            "pair: mixed precision takes two types of different sizes")
        flags = CompressionFlags.NO_COMPRESSION
        for flag, d in zip(OPERAND_COMPRESSION, operand_dtypes):
            if d == narrow:
                flags |= flag
        if compress_dtype is not None and compress_dtype != wide:
            if compress_dtype != narrow:
                raise TypeError(f"compress_dtype {compress_dtype.name} is neither of the "
                                f"operands' types ({wide.name}, {narrow.name})")
            flags |= CompressionFlags.ETH_COMPRESSED
        return self._config(wide, narrow), flags

    def _config(self, dtype: np.dtype, wire: np.dtype) -> int:
        try:
            return self._arith[(dtype, wire)]
        except KeyError:
            raise TypeError(f"the CCLO has no arithmetic config for {dtype.name} "
                            f"compressed to {wire.name}") from None

    @staticmethod
    def error(call: DeviceCall, operation: str) -> Exception | None:
        """The exception a completed call stands for, or None if it succeeded."""
        if call.error is not None and call.args is None:  # host work raised: its own error
            if isinstance(call.error, ACCLError):  # as raised, attributes and all
                _add_note(call.error, f"raised by {operation}")
                return call.error
            error = KernelError(f"{operation} raised {type(call.error).__name__}: {call.error}")
            error.__cause__ = call.error
            return error
        if isinstance(call.error, Aborted):
            return Aborted(f"{operation} was aborted: {call.error}")
        if call.error is not None:  # a fresh exception of the device's kind, per call
            kind = type(call.error) if isinstance(call.error, ACCLError) else ACCLError
            if isinstance(call.error, KernelError):  # a soft CCLO's stream kernel raised
                failed = kind(f"{operation} failed: {call.error}")
                failed.__cause__ = call.error.__cause__
                return failed
            return kind(f"{operation} could not run: {call.error}")
        if call.aborted:
            return DependencyError(f"{operation} did not run: a call it waits for failed")
        if call.retcode:
            return CCLOError(operation, call.retcode, call.detail)
        return None

    def close(self) -> None:
        """Release the device memory the driver allocated, then the device."""
        for address in self._allocations:
            self.device.free(address)
        self._allocations.clear()
        self.device.close()


def _add_note(error: BaseException, note: str) -> None:
    """`error.add_note(note)`, also before Python 3.11 (where the exceptiongroup
    backport that anyio installs prints `__notes__` in tracebacks)."""
    if sys.version_info >= (3, 11):
        error.add_note(note)
    else:
        error.__notes__ = [*getattr(error, "__notes__", ()), note]  # type: ignore[attr-defined]
