"""The XRT device at its library boundary: what it asks of pyxrt, checked against a
recording fake (tests/fakes/fake_pyxrt.py), since no Alveo card is here."""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest

from aaccl import _exchmem as xm
from aaccl import CCLOError, DependencyError, ErrorCode
from aaccl._constants import TAG_ANY, ConfigFunction, Scenario
from aaccl.api import ACCL, Buffer
from aaccl.devices import CallArgs, Device, DeviceCall
from aaccl.devices import _serial, _xrt
from aaccl import DeviceError, DeviceStuck
from aaccl.devices._xrt import INSTALL_HINT, XRTDevice, available
from aaccl.driver import Driver
from fakes.fake_pyxrt import BANK_STRIDE, FROM_DEVICE, TO_DEVICE, Bump, FakeXRT, ert_cmd_state

F32 = np.dtype(np.float32)
RETCODE_READ = ("read_register", xm.RETCODE)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeXRT]:
    fake = FakeXRT(ndevices=2, cclos=2).install(monkeypatch)
    yield fake
    fake.release()


@pytest.fixture
def xclbin(tmp_path: Path) -> Path:
    path = tmp_path / "accl.xclbin"
    path.write_bytes(b"xclbin2\0")
    return path


@pytest.fixture
def device(fake: FakeXRT, xclbin: Path) -> Iterator[XRTDevice]:
    dev = XRTDevice(xclbin)
    yield dev
    dev.close()


def ranks(size: int) -> list[xm.RankRecord]:
    return [xm.RankRecord(ip=xm.ip_encode(f"10.0.0.{r + 1}"), port=5000 + r, session=r,
                          max_segment_size=1024) for r in range(size)]


def configured(device: object, **options: float) -> Driver:
    driver = Driver(device, 0, ranks(2), nbufs=4, bufsize=256, **options)  # type: ignore[arg-type]
    driver.configure()
    return driver


def args(scenario: Scenario, count: int = 0, **fields: int) -> CallArgs:
    values = dict(scenario=int(scenario), count=count, comm=0, root_src_dst=0, function=0,
                  tag=TAG_ANY, arithcfg=0, compression_flags=0, stream_flags=0,
                  addr_0=0, addr_1=0, addr_2=0)
    return CallArgs(**{**values, **fields})


def finish(*calls: DeviceCall) -> None:
    for call in calls:
        assert call.block(5), f"{call.args} never completed"


class RecordingDevice(Device):
    """The plainest device: a dict for exchange memory, every call succeeds at once."""

    timer_hz = 250_000_000

    def __init__(self) -> None:
        self.exchange: dict[int, int] = {}
        self.writes: list[tuple[int, int]] = []
        self.calls: list[tuple[int, ...]] = []
        self._alloc = Bump(BANK_STRIDE)  # where the fake puts bank 0's buffers

    def mmio_read(self, offset: int) -> int:
        return self.exchange.get(offset, 0)

    def mmio_write(self, offset: int, value: int) -> None:
        self.writes.append((offset, value))
        self.exchange[offset] = value

    def alloc(self, nbytes: int) -> int:
        return self._alloc(nbytes)

    def free(self, address: int) -> None:
        pass

    def write(self, address: int, data: np.ndarray) -> None:
        pass

    def read(self, address: int, out: np.ndarray) -> None:
        pass

    def start(self, args: CallArgs, waitfor: Sequence[DeviceCall] = ()) -> DeviceCall:
        self.calls.append(tuple(args))
        call = DeviceCall(args)
        call.complete()
        return call

    def run(self, job: Any, waitfor: Sequence[DeviceCall] = ()) -> DeviceCall:
        raise AssertionError("configuring runs no host job")

    def close(self) -> None:
        pass


# -- opening the card ------------------------------------------------------------------

def test_opens_the_cclo_and_hostctrl_that_acccls_designs_name(fake: FakeXRT,
                                                              xclbin: Path) -> None:
    dev = XRTDevice(xclbin, device_index=1, cclo_index=1)
    try:
        assert fake.events("device") == [(1,)]
        assert fake.events("xclbin") == [(str(xclbin),)] == fake.events("load_xclbin")
        assert fake.events("ip") == [("ccl_offload:{ccl_offload_1}",)]
        assert fake.events("kernel") == [("hostctrl:{hostctrl_1_0}",
                                          fake.module.kernel.cu_access_mode.exclusive)]
        dev.alloc(10)  # ACCL's designs put CCLO i's device memory in bank 6 * i
        assert [group for _, _, group, _ in fake.events("bo")] == [6]
    finally:
        dev.close()


def test_buffers_go_to_the_chosen_bank(fake: FakeXRT, xclbin: Path) -> None:
    dev = XRTDevice(xclbin, memory_bank=2)
    try:
        address = dev.alloc(10)
        assert fake.events("bo") == [(10, fake.module.bo.flags.normal, 2, address)]
        assert address == 3 * BANK_STRIDE
    finally:
        dev.close()


def test_a_bank_above_4_gib_fails_at_allocation(monkeypatch: pytest.MonkeyPatch,
                                                xclbin: Path) -> None:
    FakeXRT(bank_bases={1: 0x40_0000_0000}).install(monkeypatch)
    dev = XRTDevice(xclbin, memory_bank=1)
    try:
        with pytest.raises(DeviceError, match="above 4 GiB"):
            dev.alloc(64)
    finally:
        dev.close()


def test_a_missing_xclbin_is_named(fake: FakeXRT, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere.xclbin"):
        XRTDevice(tmp_path / "nowhere.xclbin")
    assert fake.log == []


def test_without_pyxrt_the_error_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch,
                                                    xclbin: Path) -> None:
    monkeypatch.setitem(sys.modules, "pyxrt", None)  # makes `import pyxrt` fail
    with pytest.raises(ImportError) as info:
        XRTDevice(xclbin)
    assert str(info.value) == INSTALL_HINT
    assert "pyxrt" in INSTALL_HINT and "/opt/xilinx/xrt/setup.sh" in INSTALL_HINT
    assert available() == (False, INSTALL_HINT)


def test_a_pyxrt_without_ip_is_refused_before_opening_the_card(
        monkeypatch: pytest.MonkeyPatch, xclbin: Path) -> None:
    fake = FakeXRT(with_ip=False).install(monkeypatch)
    with pytest.raises(DeviceError, match="xrt::ip"):
        XRTDevice(xclbin)
    assert fake.events("device") == []


@pytest.mark.parametrize("options, ok, words", [
    ({"ndevices": 2}, True, "2 card"),
    ({"ndevices": 0}, False, "no Alveo card"),
    ({"with_ip": False}, False, "no `ip` class"),
    ({"count_devices": False}, True, "card 0"),
    ({"count_devices": False, "ndevices": 0}, False, "cannot reach a card"),
])
def test_available_says_why(monkeypatch: pytest.MonkeyPatch, options: dict, ok: bool,
                            words: str) -> None:
    FakeXRT(**options).install(monkeypatch)
    found, reason = available()
    assert found is ok
    assert words in reason


# -- exchange memory --------------------------------------------------------------------

def test_configure_writes_what_it_writes_on_any_device(fake: FakeXRT, device: XRTDevice) -> None:
    plain = RecordingDevice()
    configured(plain)
    configured(device)
    assert fake.register_writes() == plain.writes
    assert fake.started() == plain.calls


def test_configure_layout_and_order(fake: FakeXRT, device: XRTDevice) -> None:
    driver = configured(device, timeout=3.0)
    log = fake.log
    writes = [i for i, e in enumerate(log) if e[0] == "write_register"]
    starts = {e[1][4]: i for i, e in enumerate(log) if e[0] == "start"}  # config function -> index
    assert starts[ConfigFunction.RESET_PERIPH] < writes[0]
    # rx buffers: records, then their size, then their number, which the firmware waits for
    rx_end = xm.RX_RECORDS + 4 * 7 * 4
    rx = [log[i][1] for i in writes if log[i][1] < rx_end]
    assert rx[-2:] == [xm.RX_BUF_SIZE, xm.NUM_RX_BUFS]
    assert device.mmio_read(xm.NUM_RX_BUFS) == 4 and device.mmio_read(xm.RX_BUF_SIZE) == 256
    # CFGRDY comes after every record and before the config calls that need it
    cfgrdy = fake.index(("write_register", xm.CFGRDY, 1))
    assert cfgrdy == writes[-1]
    assert cfgrdy < starts[ConfigFunction.SET_TIMEOUT] < starts[ConfigFunction.ENABLE_PKT]
    assert fake.started()[1][1] == 3 * 250_000_000  # SET_TIMEOUT in CCLO clock ticks
    # the communicator follows the rx records: size, local rank, then 6 words a rank
    address = driver.communicators[0][0]
    assert address == rx_end
    want = [2, 0] + [w for r in ranks(2) for w in r.words()]
    assert [device.mmio_read(address + 4 * i) for i in range(len(want))] == want
    # rx buffers and spares are buffer objects in bank 0, zeroed on the device
    bos = {address: size for size, _, group, address in fake.events("bo") if group == 0}
    for i in range(4):
        record = xm.RxBuffer.read(device.mmio_read, xm.RX_RECORDS + 28 * i)
        assert bos[record.address] == 256
    for spare in (xm.SPARE1, xm.SPARE2, xm.SPARE3):
        assert device.mmio_read(spare) in bos and device.mmio_read(spare + 4) == 0
    synced = {(a, size) for a, direction, size, offset in fake.events("sync")
              if direction == TO_DEVICE and offset == 0}
    assert synced == set(bos.items())


# -- calls ------------------------------------------------------------------------------

def test_a_call_sets_all_twelve_arguments_in_acccls_order(fake: FakeXRT,
                                                          device: XRTDevice) -> None:
    call_args = args(Scenario.SEND, 1000, comm=0x208, root_src_dst=1, function=1, tag=TAG_ANY,
                     arithcfg=0x300, compression_flags=8, stream_flags=2, addr_0=0x1000_0000,
                     addr_1=0xFFFF_F000, addr_2=0x8000_0000)
    finish(device.start(call_args))
    assert fake.events("run") == [("hostctrl:{hostctrl_0_0}",)]
    # pyxrt takes C ints: words above 2**31 go in as their two's complement
    assert fake.events("set_arg") == [(0, 3), (1, 1000), (2, 0x208), (3, 1), (4, 1), (5, -1),
                                      (6, 0x300), (7, 8), (8, 2), (9, 0x1000_0000),
                                      (10, -0x1000), (11, -0x8000_0000)]
    assert fake.started() == [tuple(call_args)]
    assert fake.index(RETCODE_READ) > fake.index(("done", tuple(call_args)))
    assert fake.events("wait") == []  # run.wait holds the GIL: the device polls state()


def test_an_address_above_4_gib_is_refused_not_truncated(fake: FakeXRT,
                                                         device: XRTDevice) -> None:
    call = device.start(args(Scenario.COPY, 1, addr_2=0x1_0000_0000))
    finish(call)
    assert isinstance(call.error, DeviceError) and "4 GiB" in str(call.error)
    assert fake.started() == []


def test_calls_run_one_at_a_time_in_order(fake: FakeXRT, device: XRTDevice) -> None:
    fake.delay = 0.005
    calls = [device.start(args(Scenario.NOP, n)) for n in range(8)]
    finish(*calls)
    assert [a[1] for a in fake.started()] == list(range(8))
    assert fake.max_in_flight == 1
    for earlier, later in zip(calls, calls[1:]):  # the retcode is read before the next start
        done = fake.index(("done", tuple(earlier.args)))
        read = fake.index(RETCODE_READ, done)
        assert read < fake.index(("start", tuple(later.args)))


def test_a_dependent_starts_only_after_its_dependency(fake: FakeXRT, device: XRTDevice) -> None:
    fake.delay = 0.02
    first = device.start(args(Scenario.NOP, 1))
    dependent = device.start(args(Scenario.NOP, 2), waitfor=[first])
    independent = device.start(args(Scenario.NOP, 3))
    finish(dependent, independent)
    assert [a[1] for a in fake.started()] == [1, 3, 2]  # the dependent does not block others
    assert fake.index(("start", tuple(dependent.args))) > fake.index(("done", tuple(first.args)))
    assert not dependent.failed


def test_a_failed_call_aborts_its_dependents(fake: FakeXRT, device: XRTDevice) -> None:
    code = ErrorCode.DMA_SLAVE_ERROR | ErrorCode.DMA_TIMEOUT_ERROR
    fake.retcodes[Scenario.RECV] = int(code)
    failing = device.start(args(Scenario.RECV, 4))
    dependent = device.start(args(Scenario.BCAST, 4), waitfor=[failing])
    chained = device.start(args(Scenario.NOP), waitfor=[dependent])
    finish(chained)
    assert dependent.aborted and chained.aborted
    assert fake.started() == [tuple(failing.args)]
    error = Driver.error(failing, "recv")
    assert isinstance(error, CCLOError) and error.code == code
    assert "DMA_SLAVE_ERROR" in str(error) and "DMA_TIMEOUT_ERROR" in str(error)
    assert isinstance(Driver.error(dependent, "bcast"), DependencyError)
    later = device.start(args(Scenario.NOP))
    finish(later)
    assert not later.failed


def test_a_retcode_becomes_a_cclo_error(fake: FakeXRT, device: XRTDevice) -> None:
    driver = configured(device)
    fake.retcodes[Scenario.ALLREDUCE] = int(ErrorCode.ARITH_ERROR)
    call = driver.start(Scenario.ALLREDUCE, count=4, dtype=F32)
    finish(call)
    error = Driver.error(call, "allreduce")
    assert isinstance(error, CCLOError) and error.code == ErrorCode.ARITH_ERROR


def test_a_timeout_fails_the_call_then_fails_fast_until_the_card_finishes(
        fake: FakeXRT, device: XRTDevice, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_serial, "TIMEOUT_GRACE", 0.05)
    driver = configured(device, timeout=0.1)
    fake.hanging.add(Scenario.RECV)
    began = time.monotonic()
    stuck = driver.start(Scenario.RECV, count=4, root_src_dst=1, dtype=F32)
    finish(stuck)
    assert 0.15 <= time.monotonic() - began < 2
    error = Driver.error(stuck, "recv")
    assert isinstance(error, CCLOError) and error.code == ErrorCode.RECEIVE_TIMEOUT_ERROR
    began = time.monotonic()
    refused = driver.start(Scenario.NOP)
    finish(refused)
    assert time.monotonic() - began < 0.1
    error = Driver.error(refused, "nop")
    assert isinstance(error, DeviceStuck) and "timed out" in str(error)
    assert fake.started()[-1][0] == Scenario.RECV  # nothing reached the busy card
    fake.release()
    deadline = time.monotonic() + 5
    while not fake.events("done")[-1][0][0] == Scenario.RECV:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    after = driver.start(Scenario.NOP)
    finish(after)
    assert not after.failed and fake.max_in_flight == 1


def test_closing_keeps_a_run_the_card_still_runs(fake: FakeXRT, xclbin: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_serial, "TIMEOUT_GRACE", 0.0)
    monkeypatch.setattr(_xrt, "_unfinished_runs", [])
    dev = XRTDevice(xclbin)
    configured(dev, timeout=0.01)
    fake.hanging.add(Scenario.RECV)
    finish(dev.start(args(Scenario.RECV, 1)))
    dev.close()  # XRT aborts the process if a run in flight is destroyed
    assert len(_xrt._unfinished_runs) == 1


def test_a_run_that_ends_in_error_fails_the_call(fake: FakeXRT, device: XRTDevice,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    def ends_in_error(run: Any, args: tuple[int, ...]) -> None:
        run._state = ert_cmd_state.ERT_CMD_STATE_ERROR

    monkeypatch.setattr(fake.module.run, "_finish", ends_in_error)
    call = device.start(args(Scenario.NOP))
    finish(call)
    assert isinstance(call.error, DeviceError) and "ERROR" in str(call.error)
    error = Driver.error(call, "nop")
    assert isinstance(error, DeviceError) and "could not run" in str(error)


# -- device memory ----------------------------------------------------------------------

def test_data_round_trip_through_buffer_objects(fake: FakeXRT, device: XRTDevice) -> None:
    a, b = device.alloc(64), device.alloc(100)
    data = np.arange(16, dtype=np.float32)
    device.write(a, data)
    assert fake.log[-2:] == [("bo.write", a, 0, 64), ("sync", a, TO_DEVICE, 64, 0)]
    assert fake.device_bytes(a, 64) == data.tobytes()
    out = np.zeros(16, np.float32)
    device.read(a, out)
    assert fake.log[-2:] == [("sync", a, FROM_DEVICE, 64, 0), ("bo.read", a, 0, 64)]
    np.testing.assert_array_equal(out, data)
    # a buffer view passes an address inside its allocation
    device.write(a + 16, np.array([7, 8], np.int32))
    assert fake.log[-1] == ("sync", a, TO_DEVICE, 8, 16)
    view = np.zeros(2, np.int32)
    device.read(a + 16, view)
    assert list(view) == [7, 8]
    # what the CCLO writes is seen only through a sync from the device
    fake.poke(b + 4, b"\x01\x02\x03")
    got = np.zeros(100, np.uint8)
    device.read(b, got)
    assert list(got[3:8]) == [0, 1, 2, 3, 0]


def test_addresses_outside_allocations_are_refused(fake: FakeXRT, device: XRTDevice) -> None:
    a = device.alloc(64)
    with pytest.raises(ValueError, match="not inside"):
        device.read(a + 60, np.zeros(2, np.float32))  # runs past the end
    with pytest.raises(ValueError, match="not inside"):
        device.write(a - 4, np.zeros(1, np.float32))
    device.free(a)
    with pytest.raises(ValueError):
        device.read(a, np.zeros(1, np.float32))
    with pytest.raises(ValueError):
        device.free(a)


def test_close_releases_the_runner_and_every_buffer(fake: FakeXRT, xclbin: Path) -> None:
    dev = XRTDevice(xclbin)
    addresses = [dev.alloc(n) for n in (8, 4096, 10_000)]
    finish(dev.start(args(Scenario.NOP)))
    dev.close()
    dev.close()  # twice is fine
    assert not dev._runner.is_alive()
    gc.collect()
    assert len(fake.live_bos) == 0
    with pytest.raises(ValueError):  # what a Buffer's finalizer meets after close
        dev.free(addresses[0])
    late = dev.start(args(Scenario.NOP))
    finish(late)
    assert isinstance(late.error, DeviceError) and "closed" in str(late.error)


# -- the whole stack ----------------------------------------------------------------------

@pytest.mark.anyio
async def test_accl_copy_end_to_end(fake: FakeXRT, xclbin: Path) -> None:
    driver = Driver(XRTDevice(xclbin), 0, ranks(2), nbufs=4, bufsize=256)
    async with await ACCL.open(driver) as accl:
        src, dst = accl.allocate(300, np.float32), accl.allocate(300, np.float32)
        src[:] = np.arange(300) * 0.5
        await accl.copy(src, dst, 300)
        np.testing.assert_array_equal(dst, src)
        copy = CallArgs(*fake.started()[-1])
        assert (copy.scenario, copy.count) == (Scenario.COPY, 300)
        assert (copy.addr_0, copy.addr_2) == (src.device_address, dst.device_address)
        assert copy.arithcfg == driver.arithcfg(F32, F32)
        assert fake.index(("sync", src.device_address, TO_DEVICE, 1200, 0)) \
            < fake.index(("start", tuple(copy))) \
            < fake.index(("sync", dst.device_address, FROM_DEVICE, 1200, 0))
        # to_fpga leaves the result on the device until it is synced
        src[:] = 7
        head, middle = cast(Buffer, src[:100]), cast(Buffer, dst[100:200])
        await accl.copy(head, middle, 100, to_fpga=True)
        assert dst[150] == 75
        dst.sync_from_device()
        np.testing.assert_array_equal(dst[100:200], 7)
        assert dst[99] == 49.5
    assert not driver.device._runner.is_alive()  # type: ignore[attr-defined]
