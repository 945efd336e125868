"""A recording fake of the part of PYNQ 3.0.1 that drives Alveo cards.

It behaves as PYNQ 3.0.1 does where aaccl relies on it (pynq/overlay.py,
pynq/buffer.py, pynq/pl_server/device.py and xrt_device.py):

- `pynq.Device.devices` lists the cards on first use; a card made on a thread with
  no asyncio loop raises, as XrtDevice's `asyncio.get_event_loop()` does, and the
  listing then stays empty.
- `pynq.Overlay(xclbin, device=card)` has the CCLO IP `ccl_offload_<i>` (exchange
  memory by `read(offset)` / `write(offset, value)`), the kernel `hostctrl_<i>`
  (`start(*args, waitfor=[handles])`), memories by PYNQ's names ("HBM[0]" -> `HBM0`)
  and an `ip_dict` saying which memory each CCLO's m_axi_0 port uses.
- `pynq.allocate(shape, dtype, target=memory)` returns a numpy array with a
  `device_address` whose device copy changes only on `sync_to_device`; its slices
  sync just their own bytes, as PynqBuffer's do.
- A run's handle is `done` only after the card's `_handle_events` collected it (as
  ErtWaitHandle's future); a failed run leaves an exception in `handle._future`.
- Each hostctrl runs its calls one at a time, in order, each only once the runs in
  its `waitfor` have ended (ERT's rule). A run does what the test asks: CONFIG
  reset clears CFGRDY, COPY copies `count` elements from addr_0 to addr_2 (the element
  size read from the arithmetic config at `arithcfg`), anything else nothing; then it
  writes the retcode chosen for its scenario into RETCODE, as ACCL's firmware does.

Everything is recorded in `Fake.events`; `Fake.races` lists any two threads found in
`start` / `_handle_events` of one card at once (PYNQ does not guard them).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
import sys
import threading
import time
import types
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

RETCODE, CFGRDY = 0x1FFC, 0x1FF4
CONFIG, COPY = 0, 1
RESET_PERIPH = 0
DMA_DECODE_ERROR = 1 << 2


@dataclass(eq=False)
class Run:
    """One hostctrl run: its arguments, what it waits for, and its progress on the card."""

    hostctrl: FakeHostctrl
    args: tuple[int, ...]
    kwargs: dict[str, Any]
    waits: tuple[FakeHandle, ...]
    handle: FakeHandle = field(init=False)
    began: threading.Event = field(default_factory=threading.Event)
    ended: threading.Event = field(default_factory=threading.Event)
    ok: bool = True

    def __post_init__(self) -> None:
        self.handle = FakeHandle(self)

    @property
    def scenario(self) -> int | None:
        return None if isinstance(self.hostctrl, FakeVadd) else self.args[0]

    @property
    def waitfor(self) -> tuple[Any, ...]:
        return tuple(self.kwargs.get("waitfor", ()))


class FakeHandle:
    """PYNQ's ErtWaitHandle: `done` turns true when the card's events are handled."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self._future: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._bo: object | None = object()

    @property
    def _has_bo(self) -> bool:
        return self._bo is not None

    @property
    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> None:
        while not self.done:
            self.run.hostctrl.card._handle_events(1000)

    def _complete(self) -> None:
        if self.run.ok:
            self._future.set_result(None)
        else:
            self._future.set_exception(RuntimeError("Execution failed: 4"))
        self._bo = None


class FakeCard:
    """One Alveo card (XrtDevice): memories, runs in flight, and the card's own threads."""

    def __init__(self, fake: Fake, index: int) -> None:
        if threading.current_thread() is not threading.main_thread():
            self._loop = asyncio.get_event_loop()  # raises without a loop, as XrtDevice's
        self.fake, self.index = fake, index
        self.name = f"xilinx_u280_fake_{index}"
        self.active_bos: list[Run] = []
        self.memories = {tag: FakeMemory(self, tag, base) for tag, base in fake.memories.items()}
        self._device_memory: dict[int, np.ndarray] = {}  # address -> device copy
        self._api = threading.Lock()

    def has_capability(self, cap: str) -> bool:
        return {"REGISTER_RW": True, "CALLABLE": True, "ERT": self.fake.ert}.get(cap, False)

    def _enter(self, what: str) -> None:
        if not self._api.acquire(blocking=False):
            self.fake.races.append(what)
            self._api.acquire()

    def _handle_events(self, timeout: int = 0) -> None:
        if timeout:
            time.sleep(min(timeout, 1) / 1000)
        self._enter("_handle_events")
        try:
            left = []
            for run in self.active_bos:
                if run.ended.is_set():
                    run.handle._complete()
                else:
                    left.append(run)
            self.active_bos = left
        finally:
            self._api.release()

    def device_view(self, address: int, nbytes: int) -> np.ndarray:
        for start, data in self._device_memory.items():
            if start <= address and address + nbytes <= start + data.size:
                return data[address - start:address - start + nbytes]
        raise ValueError(f"no device memory at {address:#x} (+{nbytes})")


class FakeMemory:
    """A memory bank of the card (XrtMemory), handing out 4 KiB-aligned buffers."""

    def __init__(self, card: FakeCard, tag: str, base: int) -> None:
        self.card, self.tag, self.next = card, tag, base

    def allocate(self, shape: tuple[int, ...], dtype: Any, **kwargs: Any) -> FakeBuffer:
        host = np.zeros(shape, dtype)
        address = self.next
        self.next += -(-max(host.nbytes, 1) // 4096) * 4096
        self.card._device_memory[address] = np.zeros(host.nbytes, np.uint8)
        buf = host.view(FakeBuffer)
        buf.device_address, buf.card, buf.offset, buf.memory = address, self.card, 0, self
        self.card.fake.record("allocate", self.tag, tuple(shape), np.dtype(dtype), address)
        return buf

    def __repr__(self) -> str:
        return f"<FakeMemory {self.tag}>"


class FakeBuffer(np.ndarray):
    """PynqBuffer: host memory whose device twin changes only through syncs."""

    device_address: Any
    card: Any
    offset: int

    def __array_finalize__(self, obj: Any) -> None:
        parent = getattr(obj, "card", None)
        if parent is not None and getattr(obj, "device_address", None) is not None:
            delta = self.__array_interface__["data"][0] - obj.__array_interface__["data"][0]
            self.device_address, self.card = obj.device_address + delta, parent
            self.offset = obj.offset + delta
        else:
            self.device_address, self.card, self.offset = None, None, 0

    def _device(self) -> np.ndarray:
        return self.card.device_view(self.device_address, self.nbytes)

    def sync_to_device(self) -> None:
        self.card.fake.record("sync_to_device", self.device_address, self.nbytes)
        self._device()[:] = np.asarray(self).reshape(-1).view(np.uint8)

    def sync_from_device(self) -> None:
        self.card.fake.record("sync_from_device", self.device_address, self.nbytes)
        np.asarray(self).reshape(-1).view(np.uint8)[:] = self._device()

    def freebuffer(self) -> None:
        if getattr(self, "memory", None) is None:
            return  # a slice: PynqBuffer frees only what allocate returned
        self.card.fake.record("freebuffer", self.device_address)
        self.card._device_memory.pop(self.device_address)


class FakeCCLO:
    """The CCLO IP: 8 KiB of exchange memory, every access recorded."""

    def __init__(self, fake: Fake, index: int) -> None:
        self.fake, self.index = fake, index
        self.words = np.zeros(0x2000 // 4, np.uint32)

    def read(self, offset: int = 0) -> int:
        self.fake.record("read", self.index, offset)
        return int(self.words[offset // 4])

    def write(self, offset: int, value: int) -> None:
        if not 0 <= value <= 0xFFFFFFFF:
            raise ValueError(f"{value} does not fit a register")
        self.fake.record("write", self.index, offset, value)
        self.words[offset // 4] = value


class FakeHostctrl:
    """The hostctrl kernel: `start` queues a run; a thread runs them in order."""

    def __init__(self, fake: Fake, card: FakeCard, cclo: FakeCCLO) -> None:
        self.fake, self.card, self.cclo = fake, card, cclo
        self.queue: list[Run] = []
        self.cv = threading.Condition()
        self.stopped = False
        threading.Thread(target=self._serve, daemon=True).start()

    def _arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        if len(args) != 12 or set(kwargs) - {"waitfor"}:
            raise TypeError(f"hostctrl takes 12 arguments, got {args} {kwargs}")
        return args

    def start(self, *args: Any, **kwargs: Any) -> FakeHandle:
        self.card._enter("start")
        try:
            args = self._arguments(args, kwargs)
            waitfor = tuple(kwargs.get("waitfor", ()))
            if waitfor and self.fake.xrt_version >= (2, 11, 0):
                raise RuntimeError("waitfor list to schedule dependent executions is not "
                                   "supported by XRT anymore.")
            # as _start_ert: handles of runs that ended no longer count
            waits = tuple(w for w in waitfor if w is not None and w._has_bo)
            run = Run(self, tuple(args), dict(kwargs), waits)
            self.card.active_bos.append(run)
        finally:
            self.card._api.release()
        self.fake.record("start", self.cclo.index, run)
        with self.cv:
            self.queue.append(run)
            self.cv.notify()
        return run.handle

    def _serve(self) -> None:
        while True:
            with self.cv:
                while not self.queue and not self.stopped:
                    self.cv.wait()
                if self.stopped:
                    return
                run = self.queue.pop(0)
            for dep in run.waits:
                dep.run.ended.wait()
            self._execute(run)

    def _execute(self, run: Run) -> None:
        run.began.set()
        self.fake.record("began", run)
        gate = self.fake.gates.get(run.scenario)
        if gate is not None:
            gate.wait()
        if self.fake.delay:
            time.sleep(self.fake.delay)
        retcode = self.fake.retcodes.get(run.scenario, 0)
        try:
            self._effect(run)
        except ValueError:
            retcode = DMA_DECODE_ERROR
        run.ok = run.scenario not in self.fake.broken
        self.cclo.words[RETCODE // 4] = retcode
        self.fake.record("ended", run)
        run.ended.set()

    def _effect(self, run: Run) -> None:
        scenario, count, _, _, function, _, arithcfg, *_, addr_0, _, addr_2 = run.args
        if scenario == CONFIG and function == RESET_PERIPH:
            self.cclo.words[CFGRDY // 4] = 0
        elif scenario == COPY:
            elem = int(self.cclo.words[arithcfg // 4]) if arithcfg else 4
            n = count * elem
            self.card.device_view(addr_2, n)[:] = self.card.device_view(addr_0, n)


class FakeVadd(FakeHostctrl):
    """A user kernel of the overlay, `vadd_0(a, b, out, n)`: out[:n] = a[:n] + b[:n] in
    float32 device memory. As PYNQ's _start_ert, it takes each pointer argument's
    `device_address` (an int has none), and ERT runs it after its wait list. Its runs
    are recorded as "start"/"began"/"ended" with scenario None; `gates["vadd"]` holds
    them, `broken` containing "vadd" makes ERT fail them."""

    def _arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        if len(args) != 4 or set(kwargs) - {"waitfor"}:
            raise TypeError(f"vadd takes 4 arguments, got {args} {kwargs}")
        a, b, out, n = args
        return (a.device_address, b.device_address, out.device_address, int(n))

    def _execute(self, run: Run) -> None:
        run.began.set()
        self.fake.record("began", run)
        gate = self.fake.gates.get("vadd")
        if gate is not None:
            gate.wait()
        a, b, out, n = run.args
        view = lambda address: self.card.device_view(address, 4 * n).view(np.float32)  # noqa: E731
        view(out)[:] = view(a) + view(b)
        run.ok = "vadd" not in self.fake.broken
        self.fake.record("ended", run)
        run.ended.set()


class FakeOverlay:
    """pynq.Overlay: the CCLOs and hostctrls of the xclbin, and the card's memories."""

    def __init__(self, fake: Fake, xclbin: str, device: FakeCard) -> None:
        fake.record("overlay", xclbin, device.name)
        self.device = device
        self.ip_dict: dict[str, Any] = {}
        for i, tag in enumerate(fake.cclo_memories):
            port = {"memory": tag[-1]} if isinstance(tag, list) else {"memory": tag}
            if isinstance(tag, list):
                port["MBG"] = tag
            cclo = FakeCCLO(fake, i)
            self.ip_dict[f"ccl_offload_{i}"] = {
                "type": "Xilinx:ACCL:ccl_offload:1.0",
                "registers": {"m_axi_0": port, "m_axi_1": port}}
            self.ip_dict[f"hostctrl_{i}"] = {"type": "xilinx.com:ACCL:hostctrl:1.0"}
            setattr(self, f"ccl_offload_{i}", cclo)
            setattr(self, f"hostctrl_{i}", FakeHostctrl(fake, device, cclo))
        self.ip_dict["vadd_0"] = {"type": "xilinx.com:hls:vadd:1.0"}
        self.vadd_0 = FakeVadd(fake, device, cclo)
        for tag, memory in device.memories.items():
            setattr(self, re.sub("[^A-Za-z0-9_]", "", tag), memory)

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"Could not find IP or hierarchy {name} in overlay")


class _DeviceClass:
    """`pynq.Device`: probes the cards on first use, and keeps what it found."""

    def __init__(self, fake: Fake) -> None:
        self.fake = fake
        self._devices: list[FakeCard] | None = None

    @property
    def devices(self) -> list[FakeCard]:
        if self._devices is None:
            self._devices = []  # set before probing, as DeviceMeta does
            self._devices.extend(FakeCard(self.fake, i) for i in range(self.fake.ncards))
        return self._devices


class Fake:
    """One fake PYNQ installation, with the knobs tests turn.

    `gates[scenario]`: runs of that scenario wait for the event before ending;
    `retcodes[scenario]`: what they write into RETCODE; `broken`: scenarios whose
    runs ERT reports failed; `delay`: seconds every run takes.
    """

    def __init__(self, *, version: str = "3.0.1", cards: int = 1,
                 xrt_version: tuple[int, ...] = (2, 10, 0), ert: bool = True,
                 cclo_memories: tuple[Any, ...] = ("HBM[0]", "HBM[1]")) -> None:
        self.ncards, self.xrt_version, self.ert = cards, xrt_version, ert
        self.cclo_memories = cclo_memories
        self.memories = {"HBM[0]": 0x1_0000_0000, "HBM[1]": 0x1_1000_0000,
                         "HBM[2]": 0x1_2000_0000}
        self.events: list[tuple[Any, ...]] = []
        self.races: list[str] = []
        self.gates: dict[int, threading.Event] = {}
        self.retcodes: dict[int, int] = {}
        self.broken: set[int] = set()
        self.delay = 0.0
        self.overlays: list[FakeOverlay] = []
        self._record_lock = threading.Lock()
        self.module = types.ModuleType("pynq")
        self.module.__version__ = version  # type: ignore[attr-defined]
        self.module.Device = _DeviceClass(self)  # type: ignore[attr-defined]
        self.module.Overlay = self._overlay  # type: ignore[attr-defined]
        self.module.allocate = self._allocate  # type: ignore[attr-defined]
        self.xrt_device = types.ModuleType("pynq.pl_server.xrt_device")
        self.xrt_device._xrt_version = xrt_version  # type: ignore[attr-defined]

    def install(self, monkeypatch: pytest.MonkeyPatch) -> Fake:
        monkeypatch.setitem(sys.modules, "pynq", self.module)
        monkeypatch.setitem(sys.modules, "pynq.pl_server.xrt_device", self.xrt_device)
        return self

    def shutdown(self) -> None:
        """Let every held run end and stop the hostctrl threads."""
        for gate in self.gates.values():
            gate.set()
        for overlay in self.overlays:
            for name in overlay.ip_dict:
                if name.startswith(("hostctrl_", "vadd_")):
                    hostctrl = getattr(overlay, name)
                    with hostctrl.cv:
                        hostctrl.stopped = True
                        hostctrl.cv.notify()

    # -- the module's API ----------------------------------------------------------------

    def _overlay(self, xclbin: str, device: FakeCard | None = None, **kwargs: Any) -> FakeOverlay:
        overlay = FakeOverlay(self, xclbin, device or self.module.Device.devices[0])
        self.overlays.append(overlay)
        return overlay

    def _allocate(self, shape: Any, dtype: Any = "u4", target: Any = None,
                  **kwargs: Any) -> FakeBuffer:
        if target is None:
            raise RuntimeError("Multiple memories active in design: specify the memory "
                               "using the `target` parameters")
        return target.allocate(shape, dtype, **kwargs)

    # -- what tests read -----------------------------------------------------------------

    def record(self, *event: Any) -> None:
        with self._record_lock:
            self.events.append(event)

    def of(self, kind: str) -> list[tuple[Any, ...]]:
        """The events of one kind, without their kind."""
        with self._record_lock:
            return [e[1:] for e in self.events if e[0] == kind]

    def runs(self, scenario: int | None = None) -> list[Run]:
        return [run for _, run in self.of("start") if scenario in (None, run.scenario)]

    def hold(self, scenario: int) -> threading.Event:
        """Hold runs of `scenario` on the card until the returned event is set."""
        return self.gates.setdefault(scenario, threading.Event())

    def cclo(self, index: int = 0, overlay: int = 0) -> FakeCCLO:
        return getattr(self.overlays[overlay], f"ccl_offload_{index}")
