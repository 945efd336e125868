"""The PYNQ device (aaccl/devices/_pynq.py) at its boundary with PYNQ, against a
recording fake of pynq 3.0.1 (tests/fakes/fake_pynq.py), since no Alveo card is here:
configuration, the call's arguments, chains handed to ERT or resolved on the host,
return codes, timeouts, device memory, lifetime, and what it says when PYNQ is
missing or unfit."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import numpy as np
import pytest

import aaccl
from aaccl import CCLOError, DependencyError, ErrorCode
from aaccl import _exchmem as xm
from aaccl._constants import TAG_ANY, ConfigFunction, Scenario
from aaccl.api._accl import ACCL
from aaccl.api._world import _ranks
from aaccl.devices import CallArgs, DeviceCall
from aaccl import DeviceError
from aaccl.devices._pynq import PynqDevice, available
from aaccl.driver import Driver
from fakes.fake_pynq import Fake

XCLBIN = "/opt/accl/ccl_offload.xclbin"
NOP = CallArgs(Scenario.NOP, 0, 0, 0, 0, TAG_ANY, 0, 0, 0, 0, 0, 0)
BARRIER = NOP._replace(scenario=Scenario.BARRIER)
F32 = np.dtype(np.float32)


@pytest.fixture
def make_fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Fake]]:
    made: list[Fake] = []

    def make(**options: Any) -> Fake:
        made.append(Fake(**options).install(monkeypatch))
        return made[-1]

    yield make
    for fake in made:
        fake.shutdown()
        assert fake.races == [], "PYNQ's start and _handle_events ran at once"


@pytest.fixture
def fake(make_fake: Callable[..., Fake]) -> Fake:
    return make_fake()


@pytest.fixture
def devices(make_fake: Callable[..., Fake]) -> Iterator[Callable[..., PynqDevice]]:
    """Opens PynqDevices on the installed fake; closes them after the test."""
    opened: list[PynqDevice] = []

    def open_device(**options: Any) -> PynqDevice:
        opened.append(PynqDevice(XCLBIN, **options))
        return opened[-1]

    yield open_device
    for device in opened:
        device.close()


def driver_on(device: PynqDevice, size: int = 1, **options: Any) -> Driver:
    return Driver(device, 0, _ranks(size, 1024), nbufs=4, bufsize=1024, **options)


def done(call: DeviceCall) -> DeviceCall:
    assert call.block(5), "the call did not complete"
    return call


def position(fake: Fake, *event: Any) -> int:
    return fake.events.index(event)


# -- configuration and the call --------------------------------------------------------------

def test_configure_lays_out_the_exchange_memory(fake: Fake, devices: Any) -> None:
    device = devices()
    driver = driver_on(device, size=2, timeout=2.0)
    driver.configure()

    allocations = fake.of("allocate")  # (bank, shape, dtype, address)
    assert {bank for bank, *_ in allocations} == {"HBM[0]"}  # the bank of the CCLO's m_axi_0
    assert {address for *_, address in allocations} <= {a for a, _ in fake.of("sync_to_device")}
    records = [xm.RxBuffer.read(device.mmio_read, xm.RX_RECORDS + 28 * i) for i in range(4)]
    assert records == [xm.RxBuffer(address) for *_, address in allocations[:4]]
    assert all(r.address >> 32 for r in records)  # above 4 GiB: both address words count

    words = fake.cclo().words
    assert (words[xm.NUM_RX_BUFS // 4], words[xm.RX_BUF_SIZE // 4], words[xm.CFGRDY // 4]) \
        == (4, 1024, 1)
    offsets = [offset for _, offset, _ in fake.of("write")]
    last_record = max(i for i, o in enumerate(offsets) if xm.RX_RECORDS <= o < xm.RX_RECORDS + 4 * 28)
    assert offsets.index(xm.NUM_RX_BUFS) > last_record  # the firmware waits for it: last
    assert xm.Communicator.read(device.mmio_read, driver.communicators[0][0]) \
        == xm.Communicator(0, tuple(_ranks(2, 1024)))

    configs = [CallArgs(*run.args) for run in fake.runs(Scenario.CONFIG)]
    assert [c.function for c in configs] == [
        ConfigFunction.RESET_PERIPH, ConfigFunction.SET_TIMEOUT,
        ConfigFunction.SET_MAX_EAGER_MSG_SIZE, ConfigFunction.SET_MAX_RENDEZVOUS_MSG_SIZE,
        ConfigFunction.ENABLE_PKT]
    assert configs[1].count == 2 * 250_000_000


def test_a_call_passes_its_12_arguments_positionally_in_accls_order(fake: Fake,
                                                                    devices: Any) -> None:
    device = devices()
    args = CallArgs(Scenario.ALLREDUCE, 1000, 0x1F8, 1, 0, 7, 0x200, 8, 2,
                    0x1_0000_1000, 0x1_0000_2000, 0x1_0000_3000)
    assert not done(device.start(args)).failed
    (run,) = fake.runs()
    assert run.args == tuple(args) and all(type(a) is int for a in run.args)
    assert run.kwargs == {}  # no waitfor at all: PYNQ's non-ERT start refuses even []


# -- dependencies ----------------------------------------------------------------------------

@pytest.mark.anyio
async def test_a_chain_goes_to_ert_as_pynq_handles_and_costs_one_await(fake: Fake,
                                                                        devices: Any) -> None:
    accl = await ACCL.open(driver_on(devices(), timeout=5.0))
    try:
        gate = fake.hold(Scenario.NOP)
        a = accl.nop()
        b = accl.nop(waitfor=[a])
        c = accl.nop(waitfor=[b])
        first, second, third = fake.runs(Scenario.NOP)  # all on the card while `a` is held
        assert (first.waitfor, second.waitfor, third.waitfor) \
            == ((), (first.handle,), (second.handle,))
        assert not a.done()
        gate.set()
        await c
        assert a.done() and b.done()
        assert position(fake, "ended", first) < position(fake, "began", second) \
            < position(fake, "ended", second) < position(fake, "began", third)
    finally:
        await accl.aclose()


def test_a_foreign_dependency_is_resolved_on_the_host(fake: Fake, devices: Any) -> None:
    device = devices()
    foreign = DeviceCall(NOP)  # another device's call, still running
    call = device.start(NOP, [foreign])
    assert fake.runs() == []
    foreign.complete()
    (run,) = fake.runs()
    assert run.kwargs == {}  # started by the host, with no wait list
    assert not done(call).failed


def test_one_foreign_dependency_sends_the_whole_wait_list_to_the_host(fake: Fake,
                                                                      devices: Any) -> None:
    device = devices()
    gate = fake.hold(Scenario.NOP)
    own = device.start(NOP)
    foreign = DeviceCall(NOP)
    call = device.start(NOP, [own, foreign])
    foreign.complete()
    assert len(fake.runs()) == 1  # still waiting for `own`, on the host
    gate.set()
    assert not done(call).failed
    assert [run.kwargs for run in fake.runs()] == [{}, {}]
    assert position(fake, "ended", fake.runs()[0]) < position(fake, "start", 0, fake.runs()[1])


@pytest.mark.parametrize("xrt_version", [(2, 11, 0), (2, 14, 354)])
def test_xrt_without_wait_lists_gets_chains_resolved_on_the_host(
        make_fake: Callable[..., Fake], devices: Any, xrt_version: tuple[int, ...]) -> None:
    fake = make_fake(xrt_version=xrt_version)
    device = devices()
    gate = fake.hold(Scenario.NOP)
    a = device.start(NOP)
    b = device.start(NOP, [a])
    assert len(fake.runs()) == 1
    gate.set()
    assert not done(b).failed
    assert [run.kwargs for run in fake.runs()] == [{}, {}]


def test_a_failed_dependency_aborts_the_dependent_before_it_starts(fake: Fake,
                                                                   devices: Any) -> None:
    device = devices()
    failed = DeviceCall(NOP)
    failed.complete(retcode=int(ErrorCode.RECEIVE_TIMEOUT_ERROR))
    call = device.start(NOP, [failed])
    assert call.done() and call.aborted
    assert isinstance(Driver.error(call, "nop"), DependencyError)

    pending = DeviceCall(NOP)
    later = device.start(NOP, [pending])
    pending.complete(aborted=True)
    assert later.aborted
    assert fake.runs() == []


def test_a_dependent_chained_on_the_card_is_reported_aborted(fake: Fake, devices: Any) -> None:
    """ERT starts it anyway (it knows nothing of return codes): the device still
    reports it as aborted, so its caller gets DependencyError."""
    device = devices()
    fake.retcodes[Scenario.BARRIER] = int(ErrorCode.DMA_TAG_MISMATCH_ERROR)
    barrier_gate, nop_gate = fake.hold(Scenario.BARRIER), fake.hold(Scenario.NOP)
    failing = device.start(BARRIER)
    dependent = device.start(NOP, [failing])
    assert fake.runs()[1].waitfor == (fake.runs()[0].handle,)
    barrier_gate.set()
    error = Driver.error(done(failing), "barrier")
    assert isinstance(error, CCLOError) and error.code == ErrorCode.DMA_TAG_MISMATCH_ERROR
    assert done(dependent).aborted  # at once, though its run is still held on the card
    assert isinstance(Driver.error(dependent, "nop"), DependencyError)
    nop_gate.set()
    fake.runs()[1].ended.wait(5)


@pytest.mark.anyio
async def test_a_nonzero_retcode_raises_cclo_error(fake: Fake, devices: Any) -> None:
    accl = await ACCL.open(driver_on(devices(), timeout=5.0))
    try:
        bits = ErrorCode.DMA_TAG_MISMATCH_ERROR | ErrorCode.ARITH_ERROR
        fake.retcodes[Scenario.NOP] = int(bits)
        with pytest.raises(CCLOError) as info:
            await accl.nop()
        assert info.value.code == bits
        del fake.retcodes[Scenario.NOP]
        await accl.nop()
    finally:
        await accl.aclose()


def test_a_run_ert_failed_is_a_pynq_error(fake: Fake, devices: Any) -> None:
    device = devices()
    fake.broken.add(Scenario.NOP)
    error = Driver.error(done(device.start(NOP)), "nop")
    assert isinstance(error, DeviceError) and "Execution failed" in str(error)


def test_a_call_that_never_ends_times_out_and_the_next_gets_its_own_timeout(
        fake: Fake, devices: Any) -> None:
    driver = driver_on(devices(), size=2, timeout=0.05)
    driver.configure()
    assert CallArgs(*fake.runs(Scenario.CONFIG)[1].args).count == 12_500_000
    gate = fake.hold(Scenario.RECV)
    began = time.monotonic()
    recv = driver.start(Scenario.RECV, count=4, root_src_dst=1, dtype=F32)
    queued = driver.start(Scenario.NOP)  # behind the recv on the card
    error = Driver.error(done(recv), "recv")
    assert isinstance(error, CCLOError) and error.code == ErrorCode.RECEIVE_TIMEOUT_ERROR
    assert time.monotonic() - began >= 0.05
    assert done(queued).retcode == ErrorCode.RECEIVE_TIMEOUT_ERROR
    assert time.monotonic() - began >= 0.1  # its clock started when it led the queue
    gate.set()  # the peer comes after all: the card catches up
    assert not done(driver.start(Scenario.NOP)).failed


def test_a_timeout_longer_than_the_register_holds_is_enforced_in_full(
        fake: Fake, devices: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """SET_TIMEOUT saturates at 2**32 - 1 ticks (here, with a faster clock, 0.1 s):
    the host's limit is still the timeout the driver was given."""
    device = devices()
    monkeypatch.setattr(device, "timer_hz", int(0xFFFFFFFF / 0.1))
    driver = driver_on(device, size=2, timeout=0.4)
    driver.configure()
    assert CallArgs(*fake.runs(Scenario.CONFIG)[1].args).count == 0xFFFFFFFF
    gate = fake.hold(Scenario.RECV)
    began = time.monotonic()
    recv = driver.start(Scenario.RECV, count=4, root_src_dst=1, dtype=F32)
    assert done(recv).retcode == ErrorCode.RECEIVE_TIMEOUT_ERROR
    assert time.monotonic() - began >= 0.4  # not the register's 0.1 s
    gate.set()


def test_a_call_the_firmware_gets_wrong_runs_as_steps_started_back_to_back(
        fake: Fake, devices: Any) -> None:
    """An allreduce whose ring would leave a chunk empty (1 element on 2 ranks) goes to
    the card as a reduce and a bcast, started one after the other with the same
    dependencies, so hostctrl runs them together; the call fails as its first failed
    step."""
    driver = driver_on(devices(), size=2, timeout=5.0, max_eager_size=1 << 30)
    driver.configure()
    before = len(fake.runs())
    call = driver.start(Scenario.ALLREDUCE, count=1, dtype=F32, addrs=(0x1000, 0x2000, 0x2000))
    assert not done(call).failed
    assert [(r.scenario, CallArgs(*r.args).count) for r in fake.runs()[before:]] \
        == [(Scenario.REDUCE, 1), (Scenario.BCAST, 1)]
    fake.broken.add(Scenario.REDUCE)  # ERT reports the reduce's run failed
    error = Driver.error(done(driver.start(Scenario.ALLREDUCE, count=1, dtype=F32,
                                           addrs=(0x1000, 0x2000, 0x2000))), "allreduce")
    assert isinstance(error, DeviceError) and "reduce" in str(error)


def test_starts_and_collection_never_meet_inside_pynq(fake: Fake, devices: Any) -> None:
    """PYNQ keeps a card's runs in one unguarded list: the fake counts any overlap
    (checked after every test); here two CCLOs of one card and four threads push."""
    pair = [devices(), devices(cclo_index=1)]
    last: list[DeviceCall] = []

    def chain(device: PynqDevice) -> None:
        call = device.start(NOP)
        for _ in range(100):
            call = device.start(NOP, [call])
        last.append(call)

    threads = [threading.Thread(target=chain, args=(pair[i % 2],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not any(done(call).failed for call in last)
    assert len(fake.runs()) == 404


# -- device memory and the card --------------------------------------------------------------

def test_device_memory_round_trip_syncs_just_the_bytes_touched(fake: Fake, devices: Any) -> None:
    device = devices()
    address = device.alloc(256)
    assert fake.of("allocate")[-1] == ("HBM[0]", (256,), np.dtype(np.uint8), address)
    data = np.arange(16, dtype=np.float32)
    device.write(address + 64, data)
    assert fake.of("sync_to_device")[-1] == (address + 64, 64)
    card = fake.module.Device.devices[0]
    np.testing.assert_array_equal(card.device_view(address + 64, 64).view(np.float32), data)
    out = np.zeros(16, np.float32)
    device.read(address + 64, out)
    assert fake.of("sync_from_device")[-1] == (address + 64, 64)
    np.testing.assert_array_equal(out, data)
    with pytest.raises(ValueError):
        device.write(address + 224, data)  # runs past the buffer's end
    with pytest.raises(ValueError):
        device.read(address - 4, out)
    device.free(address)
    assert fake.of("freebuffer") == [(address,)]
    with pytest.raises(KeyError):
        device.free(address)


def test_buffers_go_to_the_cclos_bank_or_the_one_asked_for(make_fake: Callable[..., Fake],
                                                           devices: Any) -> None:
    fake = make_fake(cclo_memories=("HBM[0]", ["HBM[1]", "HBM[2]"]))
    first, second = devices(), devices(cclo_index=1)  # CCLO 1 spans a group: its first bank
    by_name, by_object = devices(memory_bank="HBM[2]"), devices(memory_bank=fake.overlays[0].HBM0)
    for device in (first, second, by_name, by_object):
        device.alloc(8)
    assert [bank for bank, *_ in fake.of("allocate")] == ["HBM[0]", "HBM[1]", "HBM[2]", "HBM[0]"]
    assert len(fake.of("overlay")) == 1  # loaded once: no reprogramming under a running CCLO
    second.mmio_write(0x10, 5)
    assert (fake.cclo(1).words[4], fake.cclo(0).words[4]) == (5, 0)
    done(second.start(NOP))
    assert [cclo for cclo, _ in fake.of("start")] == [1]


def test_a_missing_card_kernel_or_bank_is_a_clear_error(make_fake: Callable[..., Fake],
                                                        devices: Any) -> None:
    make_fake()
    with pytest.raises(DeviceError, match="sees 1 Alveo card"):
        devices(device_index=1)
    with pytest.raises(DeviceError, match="no kernel ccl_offload_7"):
        devices(cclo_index=7)
    with pytest.raises(DeviceError, match="no memory 'DDR0'"):
        devices(memory_bank="DDR0")


@pytest.mark.parametrize("options, message", [({"cards": 0}, "XILINX_XRT"),
                                              ({"ert": False}, "ERT")])
def test_a_card_pynq_cannot_use_is_refused(make_fake: Callable[..., Fake], devices: Any,
                                           options: dict[str, Any], message: str) -> None:
    make_fake(**options)
    with pytest.raises(DeviceError, match=message):
        devices()


@pytest.mark.anyio
async def test_a_device_opened_on_a_worker_thread_lists_the_cards(fake: Fake,
                                                                  devices: Any) -> None:
    """PYNQ 3.0.1 asks asyncio for the thread's loop when it lists the cards."""
    device = await anyio.to_thread.run_sync(devices)
    assert len(fake.module.Device.devices) == 1
    assert not done(device.start(NOP)).failed


def test_close_stops_the_thread_frees_the_buffers_and_refuses_calls(fake: Fake,
                                                                    devices: Any) -> None:
    device = devices()
    kept, freed = device.alloc(64), device.alloc(64)
    device.free(freed)
    fake.hold(Scenario.NOP)
    running = device.start(NOP)
    device.close()
    assert "aaccl-pynq-0.0" not in {thread.name for thread in threading.enumerate()}
    assert sorted(fake.of("freebuffer")) == sorted([(kept,), (freed,)])
    assert isinstance(running.error, DeviceError)
    later = device.start(NOP)
    assert later.done() and isinstance(later.error, DeviceError)
    device.close()


# -- through aaccl.ACCL ------------------------------------------------------------------------

@pytest.mark.anyio
async def test_copy_end_to_end(fake: Fake, devices: Any) -> None:
    driver = driver_on(devices(), timeout=5.0)
    accl = await ACCL.open(driver)
    try:
        src = accl.allocate((300,), np.float32)
        dst = accl.allocate((300,), np.float32)
        src[:] = np.arange(300) * 1.5
        await accl.copy(src, dst, 300)
        np.testing.assert_array_equal(dst, src)
        (run,) = fake.runs(Scenario.COPY)
        args = CallArgs(*run.args)
        assert (args.count, args.addr_0, args.addr_1, args.addr_2) \
            == (300, src.device_address, 0, dst.device_address)
        assert args.arithcfg == driver.arithcfg(F32, F32)
        assert position(fake, "sync_to_device", src.device_address, 1200) \
            < position(fake, "start", 0, run) \
            < position(fake, "sync_from_device", dst.device_address, 1200)
    finally:
        await accl.aclose()
    # the driver's rx buffers and spares, then (on close) the buffers still in use
    assert sorted(fake.of("freebuffer")) == sorted((a,) for *_, a in fake.of("allocate"))


# -- kernels of the overlay, and host work ------------------------------------------------------

@pytest.mark.anyio
async def test_an_overlay_kernel_chains_on_the_card_between_cclo_calls(fake: Fake,
                                                                       devices: Any) -> None:
    accl = await ACCL.open(driver_on(devices(), timeout=5.0))
    try:
        n = 100
        a, b, total, out = (accl.allocate((n,), np.float32) for _ in range(4))
        a[:], b[:] = np.arange(n), 0.5
        vadd = accl.kernel("vadd_0")
        assert repr(vadd) == "<Kernel vadd_0 of rank 0>"
        assert accl.kernel(fake.overlays[0].vadd_0).name == "FakeVadd"
        with pytest.raises(DeviceError, match="no kernel vadd_7 .*vadd_0"):
            accl.kernel("vadd_7")
        with pytest.raises(TypeError, match="by position"):
            vadd(a, b, total, n=n)
        gate = fake.hold(Scenario.COPY)
        copied = accl.copy(a, a, n, to_fpga=True)
        up = accl.sync_to_device(b)
        added = vadd(a, b, total, n, waitfor=[copied, up])
        back = accl.copy(total, out, n, from_fpga=True, waitfor=[added])
        copy_run = fake.runs(Scenario.COPY)[0]
        await anyio.wait_all_tasks_blocked()
        gate.set()
        await back  # one await for card, kernel and card again
        np.testing.assert_array_equal(out, np.arange(n) + 0.5)
        (vadd_run,) = [run for run in fake.runs() if run.scenario is None]
        assert vadd_run.args == (a.device_address, b.device_address, total.device_address, n)
        assert copy_run.handle in vadd_run.waitfor  # chained on the card, through ERT
        assert position(fake, "ended", copy_run) < position(fake, "began", vadd_run)
    finally:
        await accl.aclose()


@pytest.mark.anyio
async def test_without_wait_lists_an_overlay_kernel_waits_on_the_host(
        make_fake: Callable[..., Fake], devices: Any) -> None:
    fake = make_fake(xrt_version=(2, 12, 0))
    accl = await ACCL.open(driver_on(devices(), timeout=5.0))
    try:
        a = accl.allocate((8,), np.float32)
        a[:] = 2
        gate = fake.hold(Scenario.NOP)
        first = accl.nop()
        added = accl.kernel(fake.overlays[0].vadd_0)(a, a, a, 8,
                                                     waitfor=[accl.sync_to_device(a), first])
        await anyio.wait_all_tasks_blocked()
        assert not any(run.scenario is None for run in fake.runs())  # not started yet
        gate.set()
        await accl.sync_from_device(a, waitfor=[added])
        np.testing.assert_array_equal(a, 4)
        assert all(run.kwargs == {} for run in fake.runs())
    finally:
        await accl.aclose()


@pytest.mark.anyio
async def test_a_failed_kernel_run_is_a_device_error_and_its_dependents_never_run(
        fake: Fake, devices: Any) -> None:
    accl = await ACCL.open(driver_on(devices(), timeout=5.0))
    try:
        a = accl.allocate((4,), np.float32)
        fake.broken.add("vadd")
        added = accl.kernel(fake.overlays[0].vadd_0)(a, a, a, 4)
        after = accl.nop(waitfor=[added])
        with pytest.raises(DependencyError):
            await after
        with pytest.raises(DeviceError, match="kernel run ended badly: Execution failed"):
            await added
        await accl.nop()
    finally:
        await accl.aclose()


def test_a_held_kernel_run_never_times_out_the_cclo(fake: Fake, devices: Any) -> None:
    """Kernels run beside the CCLO: only the CCLO's own calls count for its timeout."""
    driver = driver_on(devices(), timeout=0.05)
    driver.configure()
    buf = driver.device.alloc(16)
    gate = fake.hold("vadd")
    pointer = type("Pointer", (), {"device_address": buf})()
    run = driver.device.start_kernel(fake.overlays[0].vadd_0, [pointer, pointer, pointer, 4])
    for _ in range(3):
        assert not done(driver.start(Scenario.NOP)).failed
    assert not run.done()
    gate.set()
    assert not done(run).failed


@pytest.mark.anyio
async def test_a_python_kernel_on_a_card_works_on_a_copy_of_device_memory(
        fake: Fake, devices: Any) -> None:
    accl = await ACCL.open(driver_on(devices(), timeout=5.0))
    try:
        buf = accl.allocate((6,), np.int32)
        buf[:] = 3
        up = accl.sync_to_device(buf)
        buf[:] = 0  # host only
        squared = accl.kernel(lambda x: np.multiply(x, x, out=x))(buf, waitfor=[up])
        await squared
        np.testing.assert_array_equal(buf, 0)
        card = fake.overlays[0].device
        np.testing.assert_array_equal(card.device_view(buf.device_address, 24).view(np.int32), 9)
        await accl.sync_from_device(buf)
        np.testing.assert_array_equal(buf, 9)
    finally:
        await accl.aclose()


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_world_on_cards_through_aaccl_run(make_fake: Callable[..., Fake], backend: str) -> None:
    """open_world(device="pynq") opens one card per rank and writes the addresses given."""
    fake = make_fake(cards=2)
    async def main(accl: aaccl.ACCL) -> list[float]:
        src = accl.allocate((16,), np.float32)
        dst = accl.allocate((16,), np.float32)
        src[:] = accl.rank + 0.5
        await accl.copy(src, dst, 16)
        return dst.tolist()

    addresses = [("10.1.212.101", 5001), ("10.1.212.102", 5002)]
    results = aaccl.run(main, 2, backend=backend, device="pynq", xclbin=XCLBIN, nbufs=4,
                        addresses=addresses)
    assert results == [[0.5] * 16, [1.5] * 16]
    # each card's CCLO got the whole communicator: both ranks' IP addresses
    for ip in (0x0A01D465, 0x0A01D466):
        assert any(write[-1] == ip for write in fake.of("write")), hex(ip)


def test_hardware_worlds_need_an_xclbin() -> None:
    with pytest.raises(ValueError, match="xclbin"):
        aaccl.run(lambda accl: accl.nop(), 1, device="pynq")


# -- PYNQ missing or unfit -----------------------------------------------------------------------

def test_without_pynq_the_device_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynq", None)
    with pytest.raises(ImportError, match=r"pynq 3\.0\.1 .*pip install 'aaccl\[pynq\]'"):
        PynqDevice(XCLBIN)
    ok, reason = available()
    assert not ok and "pip install 'aaccl[pynq]'" in reason


@pytest.mark.parametrize("version", ["3.1", "3.1.0", "4.0.0", "2.4"])
def test_a_pynq_without_alveo_support_is_refused(make_fake: Callable[..., Fake],
                                                 version: str) -> None:
    make_fake(version=version)
    with pytest.raises(ImportError, match="Alveo support"):
        PynqDevice(XCLBIN)
    ok, reason = available()
    assert not ok and f"pynq {version}" in reason and "Alveo support" in reason


def test_an_older_pynq_with_alveo_support_works_with_a_warning(make_fake: Callable[..., Fake],
                                                               devices: Any) -> None:
    make_fake(version="2.7.0")
    with pytest.warns(UserWarning, match="3.0.1"):
        device = devices()
    assert not done(device.start(NOP)).failed


def test_available_reports_the_version_and_the_cards(make_fake: Callable[..., Fake]) -> None:
    make_fake(cards=2)
    ok, reason = available()
    assert ok and "pynq 3.0.1" in reason and "2 Alveo card(s)" in reason


def test_available_without_a_card_says_why(make_fake: Callable[..., Fake]) -> None:
    make_fake(cards=0)
    ok, reason = available()
    assert not ok and "no Alveo card" in reason and "XILINX_XRT" in reason
