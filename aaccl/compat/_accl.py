"""`accl`: pyaccl 0.2's blocking driver class, on aaccl's core.

Each method submits the same call aaccl's `ACCL` does and blocks the calling
thread until it finished (no event loop anywhere), or with `run_async=True`
returns a `Handle` to `wait()` on. Submission never blocks on peers, so ranks can
be driven from one thread per rank or from one thread in turn (a send before its
matching receive), as pyaccl's notebooks do.
"""

from __future__ import annotations

import numbers
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .. import _exchmem as xm
from .._constants import GLOBAL_COMM, TAG_ANY, ConfigFunction, ErrorCode
from ..api import ACCL, Buffer, Call, mpi_launched
from ..devices import Device
from ..driver import EAGER_ONLY, Driver
from . import _devices, _worlds
from ._checks import Settings, settings, timeout_ticks
from ._tables import (
    ACCL_DEFAULT_ARITH_CONFIG,
    ACCLArithConfig,
    ACCLCommunicator,
    ACCLReduceFunctions,
    ACCLStreamFlags,
)

_API_LAYER = True  # a dropped run_async handle's warning points at the user's line
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
    a process makes (ranks 0..nranks-1, in any order) form one world; under
    `mpiexec -n nranks`, each process makes its own rank (`local_rank` its MPI
    rank) and the processes form one world over MPI. `sim_sock=` drives ACCL's
    emulator instead (pyaccl's meaning of sim mode), `xclbin=` an Alveo card
    through PYNQ (card `board_idx`, CCLO `cclo_idx`). Every argument is checked
    before anything is made: a failed constructor takes no place in a world.
    """

    def __init__(self, nranks: int, local_rank: int, ranks: Sequence[dict[str, Any]] | None = None,
                 protocol: str | None = None, nbufs: int = 16, bufsize: int = 1024,
                 arith_config: dict[tuple[str, str], ACCLArithConfig] = ACCL_DEFAULT_ARITH_CONFIG,
                 sim_mode: bool = False, xclbin: str | None = None, sim_sock: str | None = None,
                 board_idx: int | None = None, cclo_idx: int = 0) -> None:
        mpi = sim_mode is True and sim_sock is None and mpi_launched()
        wanted: Settings | Exception
        try:
            wanted = settings(nranks, local_rank, ranks, protocol, nbufs, bufsize, arith_config,
                              sim_mode, xclbin, sim_sock, board_idx, cclo_idx)
        except (TypeError, ValueError) as error:
            if not mpi:
                raise
            wanted = error  # the job's other processes hear of it (join_mpi raises it)
        place: _worlds.Place | None = None
        if mpi:
            driver, place = _worlds.join_mpi(wanted, self._configure(wanted))
        else:
            assert isinstance(wanted, Settings)
            if wanted.mode == "soft":
                driver, place = _worlds.join(wanted.size, wanted.rank, self._configure(wanted))
            elif wanted.emulator is not None:
                driver = self._configure(wanted)(_devices.emulator_device(
                    *wanted.emulator, wanted.rank, wanted.protocol))
            else:
                driver = self._configure(wanted)(_devices.card_device(
                    str(wanted.xclbin), wanted.board_idx, wanted.cclo_idx))
        assert isinstance(wanted, Settings)
        self.sim_mode, self.sim_sock = sim_mode, sim_sock
        self.protocol = wanted.protocol
        self.rx_buffer_size = self.segment_size = wanted.bufsize
        self.arith_config = arith_config
        self._driver, self._place = driver, place
        self._accl = ACCL(driver)
        self._timeout = DEFAULT_TIMEOUT  # seconds; see set_timeout
        self._lock = threading.Lock()  # guards the `communicators` list
        self._communicators: list[ACCLCommunicator] = []
        for (a, b), cfg in arith_config.items():
            cfg.exchmem_addr = driver.arithcfg(np.dtype(a), np.dtype(b))
        if mpi:
            _worlds.deinit_at_exit(self)

    @staticmethod
    def _configure(wanted: Settings | Exception) -> Callable[[Device], Driver]:
        """How to bring this rank's device to ready (it is closed if that fails)."""
        def configure(device: Device) -> Driver:
            assert isinstance(wanted, Settings)
            eager = EAGER_ONLY if wanted.mode == "emulator" else None  # its TCP/UDP stacks
            driver = Driver(device, wanted.rank, wanted.records, nbufs=wanted.nbufs,
                            bufsize=wanted.bufsize, timeout=DEFAULT_TIMEOUT,
                            max_eager_size=eager, arith_configs=wanted.arith)
            try:
                driver.configure()
            except BaseException:
                device.close()
                raise
            return driver

        return configure

    def __repr__(self) -> str:
        return f"<aaccl.compat.accl rank {self._accl.rank} of {self._accl.size}>"

    @property
    def communicators(self) -> list[ACCLCommunicator]:
        """The communicators, global first, then each split in order."""
        with self._lock:
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
        """Wait for this rank's outstanding calls, then release its CCLO. Under
        mpiexec, the other ranks' calls that wait for this one then fail at once, and
        deinit waits (up to the timeout) for every process to deinit."""
        place, self._place = self._place, None
        if place is None:
            self._accl._close_blocking()
            return
        try:
            place.close(self._accl, self._timeout)
        finally:
            _worlds.deinitialized(self)

    def set_timeout(self, value: int, run_async: bool = False) -> None:
        """How long a call may wait for a peer, in the CCLO's timer ticks (1 us on the
        soft CCLO, 4 ns on cards): 1 to 2**32 - 1."""
        ticks = timeout_ticks(value)
        self._driver._config_call(ConfigFunction.SET_TIMEOUT, ticks)
        self._timeout = ticks / self._driver.device.timer_hz

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
