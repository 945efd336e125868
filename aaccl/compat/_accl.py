"""`accl`: pyaccl 0.2's blocking driver class, on aaccl's core.

Each method submits the same call aaccl's `ACCL` does and blocks the calling
thread until it finished (no event loop anywhere), or with `run_async=True`
returns a `Handle` to `wait()` on. Submission never blocks on peers, so ranks can
be driven from one thread per rank or from one thread in turn (a send before its
matching receive), as pyaccl's notebooks do.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import _exchmem as xm
from .._constants import GLOBAL_COMM, TAG_ANY, ConfigFunction, ErrorCode
from ..api import ACCL, Buffer, Call
from ..devices import Device
from ..devices._emulator import EAGER_ONLY
from ..driver import Driver
from . import _devices
from ._tables import (
    ACCL_DEFAULT_ARITH_CONFIG,
    ACCLArithConfig,
    ACCLCommunicator,
    ACCLReduceFunctions,
    ACCLStreamFlags,
    arith_records,
)

DEFAULT_TIMEOUT = 10.0
"""Seconds a call may wait for a peer (pyaccl's firmware never timed out at all)."""


class Handle:
    """What `run_async=True` returns: pyaccl's wait handle, over an `aaccl.Call`.

    Unlike pyaccl's, `wait()` returns once the result is in host memory (unless
    `to_fpga`), and raises the call's error; a later `sync_from_device()` is harmless.
    """

    __slots__ = ("call",)

    def __init__(self, call: Call) -> None:
        self.call = call  # the aaccl.Call: await it, or chain it with waitfor=[handle.call]

    def wait(self, timeout: float | None = None) -> None:
        self.call.wait(timeout)

    @property
    def done(self) -> bool:
        return self.call.done()

    async def wait_async(self) -> None:
        await self.call

    def __repr__(self) -> str:
        return f"<Handle of {self.call!r}>"


def _count(value: Any) -> int:
    """pyaccl passed counts straight to the CCLO, so `1024/4` worked: take whole floats."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    raise TypeError(f"count must be a whole number of elements, not {value!r}")


class accl:  # noqa: N801  (pyaccl's name)
    """One rank's CCLO, as pyaccl 0.2's `accl` drove it.

    `sim_mode=True` runs it on aaccl's embedded soft CCLO: the `nranks` instances
    a process makes (ranks 0..nranks-1, in any order) form one world. `sim_sock=`
    drives ACCL's emulator instead (pyaccl's meaning of sim mode), `xclbin=` an
    Alveo card through PYNQ (card `board_idx`, CCLO `cclo_idx`).
    """

    def __init__(self, nranks: int, local_rank: int, ranks: Sequence[dict[str, Any]] | None = None,
                 protocol: str | None = None, nbufs: int = 16, bufsize: int = 1024,
                 arith_config: dict[tuple[str, str], ACCLArithConfig] = ACCL_DEFAULT_ARITH_CONFIG,
                 sim_mode: bool = False, xclbin: str | None = None, sim_sock: str | None = None,
                 board_idx: int | None = None, cclo_idx: int = 0) -> None:
        if not sim_mode and xclbin is None:
            raise ValueError("FPGA bitstream must be provided")
        size = nranks if ranks is None else len(ranks)
        if not 0 <= local_rank < size:
            raise ValueError(f"local_rank {local_rank} is not a rank of a world of {size}")
        if protocol is not None and protocol not in ("TCP", "UDP", "AXIS"):
            raise ValueError("Unrecognized Protocol" if protocol != "RDMA"
                             else "RDMA not supported yet")
        self.sim_mode, self.sim_sock = sim_mode, sim_sock
        self.protocol = protocol or ("TCP" if sim_mode else "AXIS")
        self.rx_buffer_size = self.segment_size = bufsize
        self.arith_config = arith_config
        soft = sim_mode and sim_sock is None
        device: Device
        if soft:
            device = _devices.soft_device(size, local_rank)
        elif sim_mode:
            assert sim_sock is not None
            device = _devices.emulator_device(sim_sock, local_rank, self.protocol)
        else:
            assert xclbin is not None
            device = _devices.card_device(xclbin, board_idx, cclo_idx)
        eager = EAGER_ONLY if sim_mode and not soft else None  # the emulator's TCP/UDP stacks
        driver = Driver(device, local_rank, _devices.rank_records(size, ranks, bufsize, soft),
                        nbufs=nbufs, bufsize=bufsize, timeout=DEFAULT_TIMEOUT,
                        max_eager_size=eager, arith_configs=arith_records(arith_config))
        try:
            driver.configure()
        except BaseException:
            device.close()
            raise
        self._driver = driver
        self._accl = ACCL(driver)
        for (a, b), cfg in arith_config.items():
            cfg.exchmem_addr = driver.arithcfg(np.dtype(a), np.dtype(b))
        self._communicators: list[ACCLCommunicator] = []

    def __repr__(self) -> str:
        return f"<aaccl.compat.accl rank {self._accl.rank} of {self._accl.size}>"

    @property
    def communicators(self) -> list[ACCLCommunicator]:
        """The communicators, global first, then each split in order."""
        for index in range(len(self._communicators), len(self._driver.communicators)):
            address, record = self._driver.communicators[index]
            self._communicators.append(ACCLCommunicator(record, index, address,
                                                        self._driver.device.mmio_read))
        return self._communicators

    @property
    def async_api(self) -> ACCL:
        """This rank as aaccl's own `ACCL`, whose calls are awaitable and chain."""
        return self._accl

    # -- memory -----------------------------------------------------------------------

    def allocate(self, shape: int | tuple[int, ...], dtype: Any = np.float32,
                 physical_address: int | None = None, prealloc: bool = True) -> Buffer:
        """A zeroed host array with a twin in device memory (an `aaccl.Buffer`);
        `physical_address` and `prealloc` are pyaccl's and ignored."""
        return self._accl.allocate(shape, dtype)

    # -- calls --------------------------------------------------------------------------

    @staticmethod
    def _run(call: Call, run_async: bool) -> Handle | None:
        if run_async:
            return Handle(call)
        call.wait()
        return None

    def nop(self, run_async: bool = False) -> Handle | None:
        return self._run(self._accl.nop(), run_async)

    def copy(self, srcbuf: Buffer, dstbuf: Buffer, count: Any, from_fpga: bool = False,
             to_fpga: bool = False, run_async: bool = False) -> Handle | None:
        return self._run(self._accl.copy(srcbuf, dstbuf, _count(count), from_fpga, to_fpga),
                         run_async)

    def combine(self, count: Any, func: ACCLReduceFunctions, val1: Buffer, val2: Buffer,
                result: Buffer, val1_from_fpga: bool = False, val2_from_fpga: bool = False,
                to_fpga: bool = False, run_async: bool = False) -> Handle | None:
        return self._run(self._accl.combine(_count(count), func, val1, val2, result,
                                            val1_from_fpga, val2_from_fpga, to_fpga), run_async)

    def send(self, srcbuf: Buffer, count: Any, dst: int, tag: int = TAG_ANY,
             comm_id: int = GLOBAL_COMM, from_fpga: bool = False, compress_dtype: Any = None,
             stream_flags: int = ACCLStreamFlags.NO_STREAM,
             run_async: bool = False) -> Handle | None:
        return self._run(self._accl.send(srcbuf, _count(count), dst, tag, comm_id, from_fpga,
                                         compress_dtype, stream_flags), run_async)

    def recv(self, dstbuf: Buffer, count: Any, src: int, tag: int = TAG_ANY,
             comm_id: int = GLOBAL_COMM, to_fpga: bool = False, compress_dtype: Any = None,
             run_async: bool = False) -> Handle | None:
        return self._run(self._accl.recv(dstbuf, _count(count), src, tag, comm_id, to_fpga,
                                         compress_dtype), run_async)

    def bcast(self, buf: Buffer, count: Any, root: int, comm_id: int = GLOBAL_COMM,
              from_fpga: bool = False, to_fpga: bool = False, compress_dtype: Any = None,
              run_async: bool = False) -> Handle | None:
        return self._run(self._accl.bcast(buf, _count(count), root, comm_id, from_fpga, to_fpga,
                                          compress_dtype), run_async)

    def scatter(self, sbuf: Buffer, rbuf: Buffer, count: Any, root: int,
                comm_id: int = GLOBAL_COMM, from_fpga: bool = False, to_fpga: bool = False,
                compress_dtype: Any = None, run_async: bool = False) -> Handle | None:
        return self._run(self._accl.scatter(sbuf, rbuf, _count(count), root, comm_id, from_fpga,
                                            to_fpga, compress_dtype), run_async)

    def gather(self, sbuf: Buffer, rbuf: Buffer, count: Any, root: int,
               comm_id: int = GLOBAL_COMM, from_fpga: bool = False, to_fpga: bool = False,
               compress_dtype: Any = None, run_async: bool = False) -> Handle | None:
        return self._run(self._accl.gather(sbuf, rbuf, _count(count), root, comm_id, from_fpga,
                                           to_fpga, compress_dtype), run_async)

    def allgather(self, sbuf: Buffer, rbuf: Buffer, count: Any, comm_id: int = GLOBAL_COMM,
                  from_fpga: bool = False, to_fpga: bool = False, compress_dtype: Any = None,
                  run_async: bool = False) -> Handle | None:
        return self._run(self._accl.allgather(sbuf, rbuf, _count(count), comm_id, from_fpga,
                                              to_fpga, compress_dtype), run_async)

    def reduce(self, sbuf: Buffer, rbuf: Buffer, count: Any, root: int,
               func: ACCLReduceFunctions, comm_id: int = GLOBAL_COMM, from_fpga: bool = False,
               to_fpga: bool = False, compress_dtype: Any = None,
               run_async: bool = False) -> Handle | None:
        return self._run(self._accl.reduce(sbuf, rbuf, _count(count), root, func, comm_id,
                                           from_fpga, to_fpga, compress_dtype), run_async)

    def allreduce(self, sbuf: Buffer, rbuf: Buffer, count: Any, func: ACCLReduceFunctions,
                  comm_id: int = GLOBAL_COMM, from_fpga: bool = False, to_fpga: bool = False,
                  compress_dtype: Any = None, run_async: bool = False) -> Handle | None:
        return self._run(self._accl.allreduce(sbuf, rbuf, _count(count), func, comm_id,
                                              from_fpga, to_fpga, compress_dtype), run_async)

    def reduce_scatter(self, sbuf: Buffer, rbuf: Buffer, count: Any, func: ACCLReduceFunctions,
                       comm_id: int = GLOBAL_COMM, from_fpga: bool = False,
                       to_fpga: bool = False, compress_dtype: Any = None,
                       run_async: bool = False) -> Handle | None:
        return self._run(self._accl.reduce_scatter(sbuf, rbuf, _count(count), func, comm_id,
                                                   from_fpga, to_fpga, compress_dtype),
                         run_async)

    def barrier(self, comm_id: int = GLOBAL_COMM) -> None:
        self._accl.barrier(comm_id).wait()

    # -- communicators and housekeeping ----------------------------------------------------

    def split_communicator(self, indices: Sequence[int]) -> None:
        """Append the communicator of global ranks `indices` (sorted, once each) to
        `communicators`; every member splits alike. Returns None, as pyaccl did."""
        self._accl.split_communicator(sorted(set(indices)))

    def deinit(self) -> None:
        """Wait for this rank's outstanding calls, then release its CCLO."""
        self._accl._close_blocking()

    def set_timeout(self, value: int, run_async: bool = False) -> None:
        """How long a call may wait for a peer, in the CCLO's timer ticks (1 us on the
        soft CCLO, 4 ns on cards)."""
        self._driver._config_call(ConfigFunction.SET_TIMEOUT, int(value))

    def get_hwid(self) -> int:
        return self._driver.device.mmio_read(xm.HWID)

    def get_retcode(self) -> int:
        """The return code the CCLO left after its last call."""
        return self._driver.device.mmio_read(xm.RETCODE)

    def check_return_value(self, label: str = "") -> None:
        """Raise if the last call left a nonzero return code (pyaccl's message)."""
        code = ErrorCode(self.get_retcode())
        if code:
            names = "".join(f"{name} " for name in code.names())
            raise Exception(f"CCLO @0x0 during {label}: {names} you should consider "
                            "resetting mpi_offload")

    def dump_exchange_memory(self) -> None:
        print("exchange mem:")
        read = self._driver.device.mmio_read
        for row in range(0, xm.SIZE, 16):
            print(hex(row), [hex(read(row + 4 * i)) for i in range(4)])

    def dump_rx_buffers(self, nbufs: int | None = None) -> None:
        device = self._driver.device
        count = device.mmio_read(xm.NUM_RX_BUFS) if nbufs is None else nbufs
        print("CCLO address:0x0")
        statuses = {0: "NOT USED", 1: "ENQUEUED", 2: "RESERVED"}
        for i in range(count):
            rec = xm.RxBuffer.read(device.mmio_read, xm.RX_RECORDS + 4 * xm.RxBuffer.WORDS * i)
            content = np.empty(self.rx_buffer_size, np.uint8)
            device.read(rec.address, content)
            print(f"SPARE RX BUFFER{i}:\t ADDR: {hex(rec.address)} \t "
                  f"STATUS: {statuses.get(rec.status, 'UNKNOWN')} \t "
                  f"OCCUPANCY: {rec.length}/{self.rx_buffer_size} \t  MPI TAG:{hex(rec.tag)} \t "
                  f"SEQ: {rec.seq} \t SRC:{rec.src} \t DATA: {content}")
