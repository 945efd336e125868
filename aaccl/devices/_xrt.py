"""ACCL's CCLO on an Alveo card, driven through XRT's Python bindings (pyxrt).

ACCL's reference designs name CCLO `i` as the IP `ccl_offload:{ccl_offload_i}`,
whose AXI-lite registers 0x0..0x1FFC are the exchange memory, and take its calls
through the kernel `hostctrl:{hostctrl_i_0}`, whose 12 scalar arguments are the
call ABI (Xilinx/ACCL driver/utils/accl_network_utils, driver/xrt). Device memory
is XRT buffer objects in the memory bank the CCLO's data movers reach.

XRT 2.11 and later start runs without wait lists, and every call leaves its result
in the one RETCODE register, so this device does what ACCL's XRTDevice does: calls
go one at a time through `SerialDevice`'s host-side queue, which also enforces the
timeout the firmware never acts on.

Two limits of pyxrt shape this module (XRT src/python/pybind11/src/pyxrt.cpp):
- it binds xrt::kernel but not xrt::ip, and the exchange memory is reachable only
  through xrt::ip; the device needs a pyxrt that has `ip` and says so otherwise;
- `run.set_arg` takes scalars as a C `int`, so every 32-bit argument goes in as its
  two's complement and 64-bit buffer addresses must lie below 4 GiB (checked when
  a buffer is allocated, so a bank above 4 GiB fails at once, not mid-call).
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
import time
from types import ModuleType
from typing import Any

import numpy as np

from .._errors import DeviceError
from ._base import CallArgs
from ._poll import poll
from ._serial import SerialDevice

log = logging.getLogger("aaccl")

INSTALL_HINT = ("the XRT device needs XRT's Python bindings (pyxrt): install XRT and "
                "source /opt/xilinx/xrt/setup.sh")
CONFIG_TIMEOUT = 30.0
"""Seconds a configuration call may take before the card counts as unresponsive."""
ADDRESS_ARGS = (9, 10, 11)
"""Indices of addr_0, addr_1, addr_2: hostctrl's only 64-bit arguments."""
_WORD = 1 << 32
_FAILED_STATES = ("ERT_CMD_STATE_ERROR", "ERT_CMD_STATE_ABORT", "ERT_CMD_STATE_TIMEOUT",
                  "ERT_CMD_STATE_NORESPONSE", "ERT_CMD_STATE_SKERROR", "ERT_CMD_STATE_SKCRASHED")

_unfinished_runs: list[Any] = []
"""Runs still on the card when their device closed. XRT aborts the process if a run
object is destroyed while its command is in flight, so they live until exit."""


def instance_names(cclo_index: int) -> tuple[str, str]:
    """(CCLO IP, hostctrl kernel) names of CCLO `cclo_index` in ACCL's designs."""
    return f"ccl_offload:{{ccl_offload_{cclo_index}}}", f"hostctrl:{{hostctrl_{cclo_index}_0}}"


def available() -> tuple[bool, str]:
    """Whether this machine can open an XRT device, and a sentence saying why (not)."""
    try:
        pyxrt = _import_pyxrt()
    except ImportError as error:
        return False, str(error)
    try:
        found = _describe_cards(pyxrt)
    except Exception as error:  # XRT reports a missing driver or card by raising
        return False, f"pyxrt imports, but XRT cannot reach a card: {error}"
    if found is None:
        return False, "pyxrt imports, but XRT finds no Alveo card (see `xbutil examine`)"
    if not hasattr(pyxrt, "ip"):
        return False, (f"XRT finds {found}, but this pyxrt has no `ip` class, which the "
                       "CCLO's exchange memory needs")
    return True, f"XRT finds {found}"


def _import_pyxrt() -> ModuleType:
    try:
        import pyxrt
    except ImportError:
        raise ImportError(INSTALL_HINT) from None
    return pyxrt


def _describe_cards(pyxrt: ModuleType) -> str | None:
    """'N card(s)', or None if there is none; older pyxrt cannot count, so open card 0."""
    if hasattr(pyxrt, "enumerate_devices"):
        count = int(pyxrt.enumerate_devices())
        return f"{count} card(s)" if count else None
    pyxrt.device(0)
    return "card 0 (this pyxrt cannot count cards)"


def _c_int(word: int) -> int:
    """A 32-bit word as pybind11 passes it to a C `int`: two's complement."""
    word &= _WORD - 1
    return word - _WORD if word >= 1 << 31 else word


class XRTDevice(SerialDevice):
    """One CCLO of an xclbin on an Alveo card."""

    stuck_remedy = "reset the card (xbutil reset) or reload the xclbin"

    def __init__(self, xclbin: str | os.PathLike[str], *, device_index: int = 0,
                 cclo_index: int = 0, memory_bank: int | None = None,
                 config_timeout: float = CONFIG_TIMEOUT) -> None:
        """`memory_bank` is the memory group of device buffers; by default ACCL's own
        choice for its designs (accl_network_utils): bank 6 * cclo_index."""
        pyxrt = _import_pyxrt()
        path = os.fspath(xclbin)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no xclbin at {path!r}")
        if not hasattr(pyxrt, "ip"):
            raise DeviceError("this pyxrt has no `ip` class: XRT's Python bindings do not bind "
                           "xrt::ip, and the CCLO's exchange memory is reachable only through it")
        self._xrt = pyxrt
        self.device_index, self.cclo_index = device_index, cclo_index
        self.memory_bank = 6 * cclo_index if memory_bank is None else memory_bank
        self.config_timeout = config_timeout
        cclo_name, hostctrl_name = instance_names(cclo_index)
        self._device = pyxrt.device(device_index)
        uuid = self._device.load_xclbin(pyxrt.xclbin(path))
        self._cclo = pyxrt.ip(self._device, uuid, cclo_name)
        self._hostctrl = pyxrt.kernel(self._device, uuid, hostctrl_name,
                                      pyxrt.kernel.cu_access_mode.exclusive)
        states = pyxrt.ert_cmd_state
        self._completed = states.ERT_CMD_STATE_COMPLETED
        self._failed = tuple(getattr(states, name) for name in _FAILED_STATES
                             if hasattr(states, name))
        self._lock = threading.Lock()  # guards the buffer maps
        self._bos: dict[int, tuple[Any, int]] = {}  # address -> (buffer object, bytes)
        self._starts: list[int] = []  # the same addresses, sorted
        self._start_runner(f"aaccl-xrt-{device_index}.{cclo_index}")

    def __repr__(self) -> str:
        return f"<XRTDevice card {self.device_index}, CCLO {self.cclo_index}>"

    # -- exchange memory ----------------------------------------------------------------

    def mmio_read(self, offset: int) -> int:
        return int(self._cclo.read_register(offset))

    def mmio_write(self, offset: int, value: int) -> None:
        self._cclo.write_register(offset, int(value) & (_WORD - 1))

    # -- device memory: one buffer object per allocation ----------------------------------

    def alloc(self, nbytes: int) -> int:
        flags = self._xrt.bo.flags.normal  # host-backed, so bo.write/read stage the data
        bo = self._xrt.bo(self._device, max(nbytes, 1), flags, self.memory_bank)
        address = int(bo.address())
        if address + nbytes > _WORD:
            raise DeviceError(
                f"memory bank {self.memory_bank} put a buffer at {address:#x}, above 4 GiB: "
                "pyxrt passes kernel arguments as 32-bit ints, so hostctrl could not be given "
                "this address. Choose a bank below 4 GiB with memory_bank=")
        with self._lock:
            self._bos[address] = (bo, nbytes)
            bisect.insort(self._starts, address)
        return address

    def free(self, address: int) -> None:
        with self._lock:
            if self._bos.pop(address, None) is None:
                raise ValueError(f"no device allocation at {address:#x}")
            del self._starts[bisect.bisect_left(self._starts, address)]

    def write(self, address: int, data: np.ndarray) -> None:
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        if raw.size:
            bo, offset = self._locate(address, raw.size)
            bo.write(raw, offset)
            bo.sync(self._xrt.xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE, raw.size, offset)

    def read(self, address: int, out: np.ndarray) -> None:
        raw = out.view(np.uint8).reshape(-1)
        if raw.size:
            bo, offset = self._locate(address, raw.size)
            bo.sync(self._xrt.xclBOSyncDirection.XCL_BO_SYNC_BO_FROM_DEVICE, raw.size, offset)
            raw[:] = np.asarray(bo.read(raw.size, offset)).view(np.uint8)

    def _locate(self, address: int, nbytes: int) -> tuple[Any, int]:
        """The buffer object holding [address, address + nbytes), and the offset in it:
        buffer views pass addresses inside their allocation."""
        with self._lock:
            i = bisect.bisect_right(self._starts, address) - 1
            if i >= 0:
                start = self._starts[i]
                bo, size = self._bos[start]
                if address + nbytes <= start + size:
                    return bo, address - start
        raise ValueError(f"{nbytes} bytes at {address:#x} are not inside one device allocation")

    # -- calls ------------------------------------------------------------------------

    def _outcome(self, state: Any) -> int | Exception:
        if state != self._completed:
            return DeviceError(f"hostctrl's run ended in state {state!r}")
        return super()._outcome(state)

    def _launch(self, args: CallArgs) -> Any:
        """Start one hostctrl run with all 12 arguments set, as every call needs.

        A C int fills the low 4 bytes of a 64-bit address argument; the high word
        keeps what XRT's command buffer held, zero as long as every hostctrl command
        this process sends stays below 4 GiB (XRT reuses command buffers unzeroed).
        """
        for i in ADDRESS_ARGS:
            if args[i] >= _WORD:
                raise DeviceError(f"address {args[i]:#x} is above 4 GiB, beyond what pyxrt "
                               "can pass to hostctrl")
        run = self._xrt.run(self._hostctrl)
        for i, value in enumerate(args):
            run.set_arg(i, _c_int(value))
        run.start()
        return run

    def _wait(self, run: Any, deadline: float) -> Any:
        """The run's final state, or None at `deadline`.

        pyxrt binds run.wait without releasing the GIL (pyxrt.cpp: no
        gil_scoped_release in its `wait` lambdas), so waiting in it would freeze every
        Python thread, the event loop included. run.state() polls the command and
        returns at once (xrt_kernel.cpp, get_state): poll it with growing sleeps.
        RUNNING has no name in pyxrt's enum, so pending is whatever is neither
        completed nor failed.
        """
        def ended() -> Any:
            state = run.state()
            return state if state == self._completed or state in self._failed else None

        return poll(ended, deadline)

    def close(self) -> None:
        """Stop the runner and drop every buffer object and handle."""
        if not self._stop_runner():
            return
        if self._stuck is not None and self._wait(self._stuck, time.monotonic()) is None:
            log.warning("%r: closed while the card still runs a call that timed out", self)
            _unfinished_runs.append(self._stuck)
        self._stuck = None
        with self._lock:
            self._bos.clear()
            self._starts.clear()
        self._hostctrl = self._cclo = self._device = None
