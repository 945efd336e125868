"""A recording stand-in for XRT's Python bindings (pyxrt), with a toy CCLO behind it.

It keeps the shapes of the real bindings where aaccl depends on them (XRT
src/python/pybind11/src/pyxrt.cpp): `run.set_arg` takes a scalar as a C `int`
(pybind11 raises TypeError outside [-2**31, 2**31)) and writes only its 4 bytes of
a 64-bit argument; `write_register` takes uint32 words; a buffer object stages data
in host memory, apart from device memory, until synced; `run.state()` reports
RUNNING as a value pyxrt's enum has no name for. It adds `ip`, xrt::ip's register
access, which the real bindings lack (`with_ip=False` leaves it out).

Install it with `FakeXRT().install(monkeypatch)`. Every call lands in `log` as a
tuple whose first item names it. Runs complete on their own threads after `delay`
seconds (scenarios in `hanging` wait for `release()`), leaving `retcodes[scenario]`
(default 0) in the exchange memory's RETCODE word.
"""

from __future__ import annotations

import enum
import os
import sys
import threading
import time
import types
import weakref
from typing import Any

import numpy as np
import pytest

from aaccl import _exchmem as xm
from aaccl._constants import ConfigFunction, ErrorCode, Scenario

HWID = 0xACC1_0001
BANK_STRIDE = 0x1000_0000
"""Bank b's buffers start at (b + 1) * BANK_STRIDE unless `bank_bases` says otherwise."""
PAGE = 4096
RUNNING = 3  # ERT_CMD_STATE_RUNNING: pyxrt's enum does not name it


class ert_cmd_state(enum.IntEnum):  # the members pyxrt binds, with XRT's values
    ERT_CMD_STATE_NEW = 1
    ERT_CMD_STATE_QUEUED = 2
    ERT_CMD_STATE_COMPLETED = 4
    ERT_CMD_STATE_ERROR = 5
    ERT_CMD_STATE_ABORT = 6
    ERT_CMD_STATE_SUBMITTED = 7
    ERT_CMD_STATE_TIMEOUT = 8
    ERT_CMD_STATE_NORESPONSE = 9
    ERT_CMD_STATE_SKERROR = 10
    ERT_CMD_STATE_SKCRASHED = 11


class xclBOSyncDirection(enum.IntEnum):
    XCL_BO_SYNC_BO_TO_DEVICE = 0
    XCL_BO_SYNC_BO_FROM_DEVICE = 1


TO_DEVICE = xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE
FROM_DEVICE = xclBOSyncDirection.XCL_BO_SYNC_BO_FROM_DEVICE


class Bump:
    """Page-aligned addresses handed out in order, as a fresh XRT bank does."""

    def __init__(self, base: int) -> None:
        self.next = base

    def __call__(self, nbytes: int) -> int:
        address = self.next
        self.next += -(-max(nbytes, 1) // PAGE) * PAGE
        return address


class FakeXRT:
    """One machine: its cards, one CCLO's exchange memory, device memory, and a log."""

    def __init__(self, *, ndevices: int = 1, cclos: int = 1, with_ip: bool = True,
                 count_devices: bool = True, bank_bases: dict[int, int] | None = None) -> None:
        self.ndevices = ndevices
        self.cclo_names = {f"ccl_offload:{{ccl_offload_{i}}}" for i in range(cclos)}
        self.hostctrl_names = {f"hostctrl:{{hostctrl_{i}_0}}" for i in range(cclos)}
        self.lock = threading.Lock()
        self.log: list[tuple[Any, ...]] = []
        self.exchange: dict[int, int] = {xm.HWID: HWID}
        self.memory: dict[int, bytearray] = {}  # device side of each buffer object
        self.live_bos: weakref.WeakSet[Any] = weakref.WeakSet()
        self._banks: dict[int, Bump] = {}
        self._bank_bases = bank_bases or {}
        self.delay = 0.0
        self.retcodes: dict[int, int] = {}
        self.hanging: set[int] = set()
        self._released = threading.Event()
        self.in_flight = self.max_in_flight = 0
        self.module = _module(self, with_ip, count_devices)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeXRT:
        monkeypatch.setitem(sys.modules, "pyxrt", self.module)
        return self

    # -- what the tests read --------------------------------------------------------------

    def record(self, *event: Any) -> None:
        with self.lock:
            self.log.append(event)

    def events(self, kind: str) -> list[tuple[Any, ...]]:
        with self.lock:
            return [e[1:] for e in self.log if e[0] == kind]

    def index(self, event: tuple[Any, ...], start: int = 0) -> int:
        with self.lock:
            return self.log.index(event, start)

    def started(self) -> list[tuple[int, ...]]:
        """The 12 arguments of every run started, as hostctrl received them."""
        return [e[0] for e in self.events("start")]

    def register_writes(self) -> list[tuple[int, int]]:
        return [(offset, value) for offset, value in self.events("write_register")]

    def release(self) -> None:
        """Let every hanging run finish."""
        self._released.set()

    def device_bytes(self, address: int, nbytes: int) -> bytes:
        mem, offset = self._find(address, nbytes)
        return bytes(mem[offset:offset + nbytes])

    def poke(self, address: int, data: bytes) -> None:
        """Change device memory behind the host's back, as the CCLO does."""
        mem, offset = self._find(address, len(data))
        mem[offset:offset + len(data)] = data

    # -- the machine ----------------------------------------------------------------------

    def new_address(self, group: int, nbytes: int) -> int:
        with self.lock:
            bank = self._banks.get(group)
            if bank is None:
                base = self._bank_bases.get(group, (group + 1) * BANK_STRIDE)
                bank = self._banks[group] = Bump(base)
            return bank(nbytes)

    def _find(self, address: int, nbytes: int) -> tuple[bytearray, int]:
        for start, mem in self.memory.items():
            if start <= address and address + nbytes <= start + len(mem):
                return mem, address - start
        raise KeyError(f"no device memory at {address:#x}")

    def run_call(self, args: tuple[int, ...]) -> None:
        """The toy CCLO: take the time asked for, act, leave the return code."""
        scenario = args[0]
        with self.lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        if scenario in self.hanging:
            self._released.wait()
        elif self.delay:
            time.sleep(self.delay)
        retcode = self.retcodes.get(scenario, 0)
        try:
            self._act(args)
        except KeyError:
            retcode |= ErrorCode.DMA_DECODE_ERROR
        with self.lock:
            self.exchange[xm.RETCODE] = int(retcode)
            self.in_flight -= 1
            self.log.append(("done", args))

    def _act(self, args: tuple[int, ...]) -> None:
        scenario, count, _, _, function, _, arithcfg, _, _, addr_0, _, addr_2 = args
        if scenario == Scenario.CONFIG and function == ConfigFunction.RESET_PERIPH:
            self.exchange[xm.CFGRDY] = 0
        elif scenario == Scenario.COPY:
            nbytes = count * self.exchange.get(arithcfg, 0)  # the config's element size
            src, src_offset = self._find(addr_0, nbytes)
            dst, dst_offset = self._find(addr_2, nbytes)
            dst[dst_offset:dst_offset + nbytes] = src[src_offset:src_offset + nbytes]


def _module(system: FakeXRT, with_ip: bool, count_devices: bool) -> types.ModuleType:
    """A `pyxrt` module whose classes all talk to `system`."""
    module = types.ModuleType("pyxrt")
    for cls in (_Device, _Xclbin, _Uuid, _Kernel, _Run, _BO) + ((_IP,) if with_ip else ()):
        setattr(module, cls.name, type(cls.name, (cls,), {"system": system}))
    module.ert_cmd_state = ert_cmd_state  # type: ignore[attr-defined]
    module.xclBOSyncDirection = xclBOSyncDirection  # type: ignore[attr-defined]
    if count_devices:
        module.enumerate_devices = lambda: system.ndevices  # type: ignore[attr-defined]
    return module


class _Bound:
    name = ""
    system: FakeXRT


class _Uuid(_Bound):
    name = "uuid"

    def __init__(self, text: str) -> None:
        self.text = text

    def to_string(self) -> str:
        return self.text


class _Xclbin(_Bound):
    name = "xclbin"

    def __init__(self, path: str) -> None:
        if not os.path.isfile(path):
            raise RuntimeError(f"No such file '{path}'")
        self.path = path
        self.system.record("xclbin", path)


class _Device(_Bound):
    name = "device"

    def __init__(self, index: int) -> None:
        if not 0 <= index < self.system.ndevices:
            raise RuntimeError(f"Could not open device with index '{index}'")
        self.index = index
        self.system.record("device", index)

    def load_xclbin(self, xclbin: Any) -> _Uuid:
        self.system.record("load_xclbin", xclbin.path)
        return _Uuid("4c0ffee0-acc1-0000-0000-000000000000")


class _Kernel(_Bound):
    name = "kernel"

    class cu_access_mode(enum.IntEnum):
        exclusive = 0
        shared = 1
        none = 2

    def __init__(self, device: _Device, uuid: _Uuid, name: str,
                 mode: cu_access_mode = cu_access_mode.shared) -> None:
        if name not in self.system.hostctrl_names:
            raise RuntimeError(f"No compute units matching '{name}'")
        self.kernel_name = name
        self.system.record("kernel", name, mode)


class _IP(_Bound):
    name = "ip"

    def __init__(self, device: _Device, uuid: _Uuid, name: str) -> None:
        if name not in self.system.cclo_names:
            raise RuntimeError(f"No IP matching '{name}'")
        self.system.record("ip", name)

    def read_register(self, offset: int) -> int:
        _check_offset(offset)
        with self.system.lock:
            self.system.log.append(("read_register", offset))
            return self.system.exchange.get(offset, 0)

    def write_register(self, offset: int, value: int) -> None:
        _check_offset(offset)
        if not isinstance(value, int) or not 0 <= value < 1 << 32:
            raise TypeError(f"write_register(): incompatible function arguments: {value!r}")
        with self.system.lock:
            self.system.log.append(("write_register", offset, value))
            self.system.exchange[offset] = value


def _check_offset(offset: int) -> None:
    if not isinstance(offset, int) or offset % 4 or not 0 <= offset < xm.SIZE:
        raise RuntimeError(f"register offset {offset!r} outside the CCLO's exchange memory")


class _BO(_Bound):
    name = "bo"

    class flags(enum.IntEnum):
        normal = 0
        cacheable = 1
        device_only = 2
        host_only = 3
        p2p = 4
        svm = 5

    def __init__(self, device: _Device, size: int, flags: flags, group: int) -> None:
        if not isinstance(device, _Device) or size < 1:
            raise TypeError("bo(): incompatible constructor arguments")
        self._address = self.system.new_address(group, size)
        self._host = bytearray(size)
        self.system.memory[self._address] = bytearray(size)
        self.system.live_bos.add(self)
        self.system.record("bo", size, flags, group, self._address)

    def address(self) -> int:
        return self._address

    def size(self) -> int:
        return len(self._host)

    def _check(self, nbytes: int, offset: int) -> None:
        if offset < 0 or offset + nbytes > len(self._host):
            raise RuntimeError(f"{nbytes} bytes at offset {offset} exceed the buffer object")

    def write(self, buffer: Any, seek: int) -> None:
        data = memoryview(buffer).tobytes()
        self._check(len(data), seek)
        self._host[seek:seek + len(data)] = data
        self.system.record("bo.write", self._address, seek, len(data))

    def read(self, size: int, skip: int) -> np.ndarray:
        self._check(size, skip)
        self.system.record("bo.read", self._address, skip, size)
        return np.frombuffer(bytes(self._host[skip:skip + size]), np.int8)

    def sync(self, direction: xclBOSyncDirection, size: int, offset: int) -> None:
        self._check(size, offset)
        device = self.system.memory[self._address]
        if direction == TO_DEVICE:
            device[offset:offset + size] = self._host[offset:offset + size]
        else:
            self._host[offset:offset + size] = device[offset:offset + size]
        self.system.record("sync", self._address, xclBOSyncDirection(direction), size, offset)


class _Run(_Bound):
    name = "run"

    def __init__(self, kernel: _Kernel) -> None:
        self._payload = [0] * 12
        self._state: int = ert_cmd_state.ERT_CMD_STATE_NEW
        self.system.record("run", kernel.kernel_name)

    def set_arg(self, index: int, value: Any) -> None:
        if isinstance(value, _BO):  # XRT writes a buffer's whole 64-bit address
            self._payload[index] = value.address()
        elif isinstance(value, bool) or not isinstance(value, int) \
                or not -(1 << 31) <= value < 1 << 31:
            raise TypeError(f"set_arg(): incompatible function arguments: ({index}, {value!r})")
        else:  # a C int fills the low 4 bytes of the argument
            self._payload[index] = (self._payload[index] & ~0xFFFFFFFF) | (value & 0xFFFFFFFF)
        self.system.record("set_arg", index, value)

    def start(self) -> None:
        if self._state not in (ert_cmd_state.ERT_CMD_STATE_NEW,
                               ert_cmd_state.ERT_CMD_STATE_COMPLETED):
            raise RuntimeError("run is still in progress")
        self._state = RUNNING
        args = tuple(self._payload)
        self.system.record("start", args)
        threading.Thread(target=self._finish, args=(args,), daemon=True).start()

    def _finish(self, args: tuple[int, ...]) -> None:
        self.system.run_call(args)
        self._state = ert_cmd_state.ERT_CMD_STATE_COMPLETED

    def state(self) -> int:
        return self._state

    def wait(self, timeout_ms: int = 0) -> int:
        """Blocks like the real one (which holds the GIL): recorded so tests can say
        the device never calls it."""
        self.system.record("wait", timeout_ms)
        while self._state == RUNNING:
            time.sleep(0.001)
        return self._state
